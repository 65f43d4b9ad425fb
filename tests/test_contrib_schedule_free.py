"""Schedule-Free (gradtx.contrib) against three float64 references written independently:

- optax.contrib's definition (``z``, recovered ``x``, ``y``; weights ``max_lr_t ** weight_lr_power``
  with the schedule read at the step from 1, the base optimizer's learning rate at its own count
  from 0), for SGD and AdamW, with warmup;
- the paper's sequences (Defazio et al., 2024, "The Road Less Scheduled"): ``y = (1 - b1) z + b1 x``,
  ``z' = z - gamma (grad f(y) + lambda y)``, ``x' = (1 - c) x + c z'`` with ``c_{t+1} = gamma_t^2 /
  sum_{i<=t} gamma_i^2``, on a quadratic whose gradients are taken at ``y``;
- Meta's ``AdamWScheduleFree`` step (it updates ``y`` in place: ``y = lerp(y, z, c) + lr (b1 (1 - c)
  - 1) u``, ``z -= lr u``), where it agrees with optax: a constant learning rate (under a warmup
  Meta reads the schedule at ``k + 1`` for both the step and the weights, optax's base optimizer at
  ``k``), ``r = 0``.
"""

from __future__ import annotations


import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import gradtx as gtx
from gradtx import contrib
from optimizer_helpers import assert_trees_close, check_pure_and_donated, clone_tree, gradtx_trajectory, tree

SHAPES = {"w": (4, 3), "b": (3,), "s": ()}
STEPS = 6
TARGET = tree(7, shapes=SHAPES)
CURVATURE = {k: 0.5 + torch.rand(s, generator=torch.Generator().manual_seed(3), dtype=torch.float64) for k, s in SHAPES.items()}


def params0():
    return tree(0, shapes=SHAPES)


def grad_list(steps=STEPS):
    return [tree(100 + i, shapes=SHAPES) for i in range(steps)]


def quadratic_grad(y):
    """The gradient of ``sum(curvature * (y - target)^2) / 2`` at ``y``."""
    return {k: CURVATURE[k] * (v - TARGET[k]) for k, v in y.items()}


def _at(schedule, count):
    return float(schedule(torch.tensor(count, dtype=torch.int32))) if callable(schedule) else schedule


# --------------------------------------------------------------------------- optax's definition


def optax_reference(params, grads, *, base, learning_rate, b1=0.9, weight_lr_power=2.0):
    """``base(t, y, g, s) -> (z step, s)`` per leaf; returns the final ``(y, x)``."""
    y, z = clone_tree(params), clone_tree(params)
    s = {k: None for k in params}
    max_lr = weight_sum = 0.0
    for t, g in enumerate(grads):
        max_lr = max(max_lr, _at(learning_rate, t + 1))
        weight = max_lr**weight_lr_power
        weight_sum += weight
        c = weight / weight_sum if weight_sum > 0 else 0.0
        for k in params:
            dz, s[k] = base(t, y[k], g[k], s[k])
            x = (y[k] - (1 - b1) * z[k]) / b1
            z[k] = z[k] + dz
            x = (1 - c) * x + c * z[k]
            y[k] = b1 * x + (1 - b1) * z[k]
    return y, {k: (y[k] - (1 - b1) * z[k]) / b1 for k in y}


def sgd_base(learning_rate, weight_decay=0.0):
    def step(t, y, g, s):
        return -_at(learning_rate, t) * (g + weight_decay * y), s

    return step


def adamw_base(learning_rate, b2=0.999, eps=1e-8, weight_decay=0.0):
    def step(t, y, g, v):
        v = (1 - b2) * g * g if v is None else b2 * v + (1 - b2) * g * g
        direction = g / (torch.sqrt(v / (1 - b2 ** (t + 1))) + eps) + weight_decay * y
        return -_at(learning_rate, t) * direction, v

    return step


WARMUP = gtx.warmup_constant_schedule(0.0, 0.1, 3)
CASES = {
    "sgd": (lambda: contrib.schedule_free_sgd(0.1), dict(base=sgd_base(0.1), learning_rate=0.1)),
    "sgd/decay_warmup": (
        lambda: contrib.schedule_free_sgd(0.1, warmup_steps=3, b1=0.8, weight_decay=0.1, weight_lr_power=1.0),
        dict(base=sgd_base(WARMUP, 0.1), learning_rate=WARMUP, b1=0.8, weight_lr_power=1.0),
    ),
    "adamw": (
        lambda: contrib.schedule_free_adamw(0.1, weight_decay=0.1),
        dict(base=adamw_base(0.1, weight_decay=0.1), learning_rate=0.1),
    ),
    "adamw/warmup": (
        lambda: contrib.schedule_free_adamw(0.1, warmup_steps=3, b1=0.95, b2=0.9, eps=1e-3),
        dict(base=adamw_base(WARMUP, b2=0.9, eps=1e-3), learning_rate=WARMUP, b1=0.95),
    ),
    "schedule_free/adam_b1_0": (
        lambda: contrib.schedule_free(gtx.adam(gtx.linear_schedule(0.1, 0.02, 4), b1=0.0), gtx.linear_schedule(0.1, 0.02, 4)),
        dict(base=adamw_base(gtx.linear_schedule(0.1, 0.02, 4)), learning_rate=gtx.linear_schedule(0.1, 0.02, 4)),
    ),
}


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_optax_definition_in_float64(name, inplace):
    make, kwargs = CASES[name]
    expected_y, expected_x = optax_reference(params0(), grad_list(), **kwargs)
    y, state = gradtx_trajectory(make(), params0(), grad_list(), inplace=inplace)
    assert_trees_close(y, expected_y, rtol=1e-9, atol=1e-12)
    assert_trees_close(contrib.schedule_free_eval_params(state, y), expected_x, rtol=1e-9, atol=1e-12)
    assert int(state.step_count) == STEPS + 1


@pytest.mark.parametrize("name", sorted(CASES))
def test_pure_equals_donated_and_mutates_nothing(name):
    check_pure_and_donated(CASES[name][0](), params0(), grad_list())


def test_float32_close_to_the_float64_definition():
    make, kwargs = CASES["adamw"]
    expected_y, _ = optax_reference(params0(), grad_list(), **kwargs)
    p32 = gtx.tree.tree_map(lambda x: x.float(), params0())
    g32 = [gtx.tree.tree_map(lambda x: x.float(), g) for g in grad_list()]
    y, state = gradtx_trajectory(make(), p32, g32)
    assert state.b1.dtype == state.max_lr.dtype == state.weight_sum.dtype == torch.float32
    for k in expected_y:
        assert y[k].dtype == torch.float32
        torch.testing.assert_close(y[k].double(), expected_y[k], rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------- the paper


def paper_sgd(params, steps, gamma, beta, decay):
    """Schedule-Free SGD as the paper writes it, gradients taken at y (constant gamma)."""
    x, z = clone_tree(params), clone_tree(params)
    weight_sum = 0.0
    for _ in range(steps):
        y = {k: (1 - beta) * z[k] + beta * x[k] for k in x}
        g = quadratic_grad(y)
        z = {k: z[k] - gamma * g[k] - gamma * decay * y[k] for k in z}
        weight_sum += gamma**2
        c = gamma**2 / weight_sum
        x = {k: (1 - c) * x[k] + c * z[k] for k in x}
    y = {k: (1 - beta) * z[k] + beta * x[k] for k in x}
    return x, y


def run_on_quadratic(tx, params, steps, *, inplace=False):
    y = clone_tree(params)
    state = tx.init(y)
    for _ in range(steps):
        updates, state = tx.update(quadratic_grad(y), state, y, inplace=inplace)
        y = gtx.apply_updates(y, updates)
    return y, state


@pytest.mark.parametrize("inplace", [False, True])
def test_sgd_follows_the_paper_sequences(inplace):
    expected_x, expected_y = paper_sgd(params0(), 8, gamma=0.3, beta=0.9, decay=0.05)
    y, state = run_on_quadratic(contrib.schedule_free_sgd(0.3, b1=0.9, weight_decay=0.05), params0(), 8, inplace=inplace)
    assert_trees_close(y, expected_y, rtol=1e-9, atol=1e-12)
    assert_trees_close(contrib.schedule_free_eval_params(state, y), expected_x, rtol=1e-9, atol=1e-12)


# --------------------------------------------------------------------------- Meta's AdamWScheduleFree


def meta_adamw_schedule_free(params, steps, lr, betas, eps, weight_decay, warmup_steps=0, r=0.0, weight_lr_power=2.0):
    """The y-form step of facebookresearch/schedule_free's AdamWScheduleFree, in float64."""
    beta1, beta2 = betas
    y = clone_tree(params)
    z = clone_tree(params)
    v = {k: torch.zeros_like(p) for k, p in params.items()}
    lr_max, weight_sum = -1.0, 0.0
    for k in range(steps):
        grads = quadratic_grad(y)
        sched = (k + 1) / warmup_steps if k < warmup_steps else 1.0
        bias_correction2 = 1 - beta2 ** (k + 1)
        step_lr = lr * sched
        lr_max = max(step_lr, lr_max)
        weight = ((k + 1) ** r) * (lr_max**weight_lr_power)
        weight_sum += weight
        ckp1 = weight / weight_sum if weight_sum != 0 else 0.0
        for name in y:
            g = grads[name]
            v[name] = v[name] * beta2 + (1 - beta2) * g * g
            denom = torch.sqrt(v[name] / bias_correction2) + eps
            normalized = g / denom + weight_decay * y[name]
            y[name] = torch.lerp(y[name], z[name], ckp1) + step_lr * (beta1 * (1 - ckp1) - 1) * normalized
            z[name] = z[name] - step_lr * normalized
    x = {name: torch.lerp(y[name], z[name], 1 - 1 / beta1) for name in y}  # Meta's eval(): p = x
    return y, x


@pytest.mark.parametrize("inplace", [False, True])
def test_adamw_follows_meta_schedule_free_adamw(inplace):
    expected_y, expected_x = meta_adamw_schedule_free(params0(), 8, lr=0.1, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.05)
    tx = contrib.schedule_free_adamw(0.1, b1=0.9, b2=0.99, eps=1e-8, weight_decay=0.05)
    y, state = run_on_quadratic(tx, params0(), 8, inplace=inplace)
    assert_trees_close(y, expected_y, rtol=1e-9, atol=1e-12)
    assert_trees_close(contrib.schedule_free_eval_params(state, y), expected_x, rtol=1e-9, atol=1e-12)


# --------------------------------------------------------------------------- the wrapper


def test_state_is_optax_shaped():
    state = contrib.schedule_free_sgd(0.1, state_dtype=torch.float32).init(params0())
    assert isinstance(state, contrib.ScheduleFreeState)
    assert state._fields == ("b1", "weight_sum", "step_count", "max_lr", "base_optimizer_state", "z")
    assert state.step_count.dtype == torch.int32 and int(state.step_count) == 1
    assert state.b1.dtype == torch.float64 and float(state.b1) == 0.9
    assert state.z["w"].dtype == torch.float32


def test_state_dtype_keeps_z_in_it_and_updates_in_the_params_dtype():
    y, state = gradtx_trajectory(contrib.schedule_free_adamw(0.1, state_dtype=torch.float32), params0(), grad_list(3))
    assert state.z["w"].dtype == torch.float32 and y["w"].dtype == torch.float64


def test_warmup_first_step_leaves_params_unchanged():
    tx = contrib.schedule_free_sgd(0.1, warmup_steps=4)
    updates, state = tx.update(grad_list(1)[0], tx.init(params0()), params0())
    assert all(bool((u == 0).all()) for u in updates.values())  # lr 0 at count 0: weight 0, step 0
    assert float(state.weight_sum) > 0  # the averaging weights read the schedule at step 1


def test_extra_arguments_reach_the_base_optimizer():
    seen = []

    def update_fn(updates, state, params=None, **extra_args):
        seen.append(extra_args)
        return gtx.tree.tree_map(lambda g: -0.1 * g, updates), state

    base = gtx.GradientTransformationExtraArgs(lambda params: gtx.EmptyState(), update_fn)
    tx = contrib.schedule_free(base, 0.1)
    assert isinstance(tx, gtx.GradientTransformationExtraArgs)
    tx.update(grad_list(1)[0], tx.init(params0()), params0(), value=torch.tensor(1.0))
    assert list(seen[0]) == ["value"]


def test_errors():
    with pytest.raises(ValueError, match="ScheduleFreeState"):
        contrib.schedule_free_eval_params(gtx.adam(0.1).init(params0()), params0())
    with pytest.raises(ValueError, match="b1"):
        contrib.schedule_free(gtx.sgd(0.1), 0.1, b1=0.0)
    tx = contrib.schedule_free_sgd(0.1)
    with pytest.raises(ValueError, match="params"):
        tx.update(grad_list(1)[0], tx.init(params0()))


def test_none_leaves_pass_through():
    p = params0()
    tx = contrib.schedule_free_adamw(0.1)
    updates, state = tx.update(dict(grad_list(1)[0], b=None), tx.init(p), p)
    assert updates["b"] is None and torch.equal(state.z["b"], p["b"])


@settings(max_examples=25, deadline=None)
@given(
    b1=st.floats(0.05, 0.99),
    lr=st.floats(1e-3, 1.0),
    weight_lr_power=st.floats(0.0, 4.0),
    steps=st.integers(1, 6),
    adamw=st.booleans(),
)
def test_with_a_constant_rate_x_is_the_plain_average_of_the_z_iterates(b1, lr, weight_lr_power, steps, adamw):
    # the paper's claim for a constant learning rate: c_{t+1} = 1 / t, so x_T = mean(z_1, ..., z_T)
    make = contrib.schedule_free_adamw if adamw else contrib.schedule_free_sgd
    tx = make(lr, b1=b1, weight_lr_power=weight_lr_power)
    y = params0()
    state = tx.init(y)
    history = []
    for t in range(steps):
        updates, state = tx.update(grad_list(steps)[t], state, y)
        y = gtx.apply_updates(y, updates)
        history.append(state.z)
    x = contrib.schedule_free_eval_params(state, y)
    for k in x:
        mean = sum(z[k] for z in history) / steps
        torch.testing.assert_close(x[k], mean, rtol=1e-9, atol=1e-9 * (1 + float(mean.abs().max())) / b1)
