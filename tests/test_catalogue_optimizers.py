"""The catalogue's optimizers (optax's aliases): whole trajectories against float64 references of
optax's chains and against torch.optim where torch has the same algorithm; their tuple states."""

from __future__ import annotations

import warnings

import pytest
import torch

import gradtx as gtx
from catalogue_helpers import leafwise
from optimizer_helpers import (
    assert_trees_close,
    check_pure_and_donated,
    grad_sequence,
    gradtx_trajectory,
    torch_trajectory,
    tree,
)
from test_catalogue_transforms import (
    _grads_with_sign_flips,
    ref_adan,
    ref_novograd,
    ref_optimistic,
    ref_rprop,
    ref_yogi,
)

STEPS = 6


def reference_trajectory(params, grads, init, step):
    """Params after a reference ``step(g, state, params) -> (updates, state)`` on each gradient."""
    state = init(params)
    for g in grads:
        updates, state = step(g, state, params)
        params = leafwise(torch.add, params, updates)
    return params


def _scaled(ref, factor):
    init, step = ref

    def scaled_step(g, s, p):
        u, s = step(g, s, p)
        return leafwise(lambda x: factor * x, u), s

    return init, scaled_step


def ref_signum(lr, beta=0.9):
    def step(g, s, p):
        m = leafwise(lambda gi, mi: (1 - beta) * gi + beta * mi, g, s["m"])
        return leafwise(lambda x: -lr * torch.sign(x), m), {"m": m}

    return (lambda p: {"m": leafwise(torch.zeros_like, p)}), step


def ref_sign_sgd(lr):
    return (lambda p: {}), (lambda g, s, p: (leafwise(lambda x: -lr * torch.sign(x), g), s))


def _then(first, second):
    """The reference of ``chain(first, second)``."""
    (init1, step1), (init2, step2) = first, second

    def step(g, s, p):
        u, s1 = step1(g, s["a"], p)
        u, s2 = step2(u, s["b"], p)
        return u, {"a": s1, "b": s2}

    return (lambda p: {"a": init1(p), "b": init2(p)}), step


def _quietly(fn, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return fn(*args, **kwargs)


def ref_decay(weight_decay):
    return (lambda p: {}), (lambda g, s, p: (leafwise(lambda gi, pi: gi + weight_decay * pi, g, p), s))


def ref_adam_nesterov(b1=0.9, b2=0.999, eps=1e-8):
    def step(g, s, p):
        t = s["count"] + 1
        mu = leafwise(lambda gi, m: (1 - b1) * gi + b1 * m, g, s["mu"])
        nu = leafwise(lambda gi, v: (1 - b2) * gi**2 + b2 * v, g, s["nu"])
        u = leafwise(
            lambda gi, m, v: (b1 * m / (1 - b1 ** (t + 1)) + (1 - b1) * gi / (1 - b1**t)) / (torch.sqrt(v / (1 - b2**t)) + eps),
            g, mu, nu,
        )
        return u, {"count": t, "mu": mu, "nu": nu}

    return (lambda p: {"count": 0, "mu": leafwise(torch.zeros_like, p), "nu": leafwise(torch.zeros_like, p)}), step


def ref_fromage(lr, min_norm=1e-6):
    mult = 1 / (1 + lr**2) ** 0.5

    def trust(g, p):
        pn = torch.clamp(torch.linalg.norm(p.flatten()), min=min_norm)
        gn = torch.clamp(torch.linalg.norm(g.flatten()), min=min_norm)
        ratio = pn / gn if (pn != 0 and gn != 0) else 1.0
        return -lr * mult * ratio * g + (mult - 1) * p

    return (lambda p: {}), (lambda g, s, p: (leafwise(trust, g, p), s))


REFERENCE_CASES = {
    "fromage": (lambda: gtx.fromage(0.1), lambda: ref_fromage(0.1)),
    "fromage_min_norm": (lambda: gtx.fromage(0.3, min_norm=0.5), lambda: ref_fromage(0.3, min_norm=0.5)),
    "adan": (
        lambda: gtx.adan(0.05, weight_decay=0.1),
        lambda: _scaled(_then(ref_adan(eps_root=1e-8), ref_decay(0.1)), -0.05),
    ),
    "novograd": (
        lambda: gtx.novograd(0.05, weight_decay=0.1),
        lambda: _scaled(ref_novograd(eps=1e-6, weight_decay=0.1), -0.05),
    ),
    "optimistic_gradient_descent": (
        lambda: gtx.optimistic_gradient_descent(0.05, alpha=0.5, beta=0.8),
        lambda: _scaled(ref_optimistic(0.5, 0.8), -0.05),
    ),
    "optimistic_adam_v2": (
        lambda: gtx.optimistic_adam_v2(0.05, alpha=0.5, beta=0.8),
        lambda: _scaled(_then(ref_adam_nesterov(), ref_optimistic(0.5, 0.8)), -0.05),
    ),
    "optimistic_adam": (
        lambda: _quietly(gtx.optimistic_adam, 0.05, optimism=0.02),
        lambda: _scaled(_then(ref_adam_nesterov(), ref_optimistic(0.05, 0.02)), -1.0),
    ),
    "sign_sgd": (lambda: gtx.sign_sgd(0.1), lambda: ref_sign_sgd(0.1)),
    "signum": (lambda: gtx.signum(0.1, beta=0.8), lambda: ref_signum(0.1, beta=0.8)),
    "yogi": (lambda: gtx.yogi(0.05, b1=0.8, eps=1e-2), lambda: _scaled(ref_yogi(b1=0.8, eps=1e-2), -0.05)),
    "rprop": (lambda: gtx.rprop(0.1, eta_plus=1.5), lambda: _scaled(ref_rprop(0.1, eta_plus=1.5), -1.0)),
}


@pytest.mark.parametrize("name", sorted(REFERENCE_CASES))
@pytest.mark.parametrize("inplace", [False, True])
def test_trajectory_matches_reference(name, inplace):
    make_tx, make_ref = REFERENCE_CASES[name]
    params = tree(0)
    grads = _grads_with_sign_flips(STEPS) if name == "rprop" else grad_sequence(STEPS)
    ours, _ = gradtx_trajectory(make_tx(), params, grads, inplace=inplace)
    assert_trees_close(ours, reference_trajectory(params, grads, *make_ref()), rtol=1e-9, atol=1e-12)


TORCH_CASES = {
    "adadelta": (
        lambda: gtx.adadelta(1.0, weight_decay=0.1),
        lambda ps: torch.optim.Adadelta(ps, lr=1.0, weight_decay=0.1),
    ),
    "adadelta_args": (
        lambda: gtx.adadelta(0.5, rho=0.7, eps=1e-4),
        lambda ps: torch.optim.Adadelta(ps, lr=0.5, rho=0.7, eps=1e-4),
    ),
}


@pytest.mark.parametrize("name", sorted(TORCH_CASES))
@pytest.mark.parametrize("inplace", [False, True])
def test_trajectory_matches_torch(name, inplace):
    make_tx, make_opt = TORCH_CASES[name]
    params, grads = tree(0), grad_sequence(STEPS)
    ours, _ = gradtx_trajectory(make_tx(), params, grads, inplace=inplace)
    assert_trees_close(ours, torch_trajectory(make_opt, params, grads), rtol=1e-10, atol=1e-12)


def _decoupled_adamax_trajectory(params, grads, lr, weight_decay, **kwargs):
    """torch's Adamax, the params first shrunk by ``1 - lr * weight_decay`` (decoupled decay)."""
    names = list(params)
    tensors = [params[k].clone().requires_grad_(True) for k in names]
    opt = torch.optim.Adamax(tensors, lr=lr, **kwargs)
    for g in grads:
        with torch.no_grad():
            for t in tensors:
                t.mul_(1 - lr * weight_decay)
        for t, k in zip(tensors, names):
            t.grad = g[k].clone()
        opt.step()
    return {k: t.detach() for k, t in zip(names, tensors)}


@pytest.mark.parametrize("inplace", [False, True])
def test_adamaxw_matches_torch_adamax_with_decoupled_decay(inplace):
    params, grads = tree(0), grad_sequence(STEPS)
    ours, _ = gradtx_trajectory(gtx.adamaxw(0.05, b1=0.8, weight_decay=0.3), params, grads, inplace=inplace)
    theirs = _decoupled_adamax_trajectory(params, grads, 0.05, 0.3, betas=(0.8, 0.999))
    assert_trees_close(ours, theirs, rtol=1e-10, atol=1e-12)


def test_optimistic_adam_is_deprecated_and_rejects_schedules():
    with pytest.warns(DeprecationWarning, match="optimistic_adam_v2"):
        gtx.optimistic_adam(0.1)
    with pytest.raises(TypeError, match="^optimistic_adam: learning_rate must be a number or a 0-d tensor, got a schedule"):
        gtx.optimistic_adam(gtx.constant_schedule(0.1))


def test_adadelta_without_learning_rate_is_unscaled_as_in_optax():
    params, grads = tree(0), grad_sequence(3)
    ours, _ = gradtx_trajectory(gtx.adadelta(), params, grads)
    descended = torch_trajectory(lambda ps: torch.optim.Adadelta(ps, lr=1.0), params, grads)
    # no learning rate: the chain ends in the identity, so the step is +delta where torch takes -delta
    assert_trees_close({k: 2 * params[k] - ours[k] for k in params}, descended, rtol=1e-10, atol=1e-12)


STATE_TYPES = {
    "sign_sgd": lambda: (gtx.sign_sgd(0.1), (gtx.EmptyState, gtx.EmptyState)),
    "sign_sgd_sched": lambda: (gtx.sign_sgd(gtx.linear_schedule(0.1, 0.01, 3)), (gtx.EmptyState, gtx.ScaleByScheduleState)),
    "signum": lambda: (gtx.signum(0.1), (gtx.EmaState, gtx.EmptyState, gtx.EmptyState)),
    "adadelta": lambda: (gtx.adadelta(1.0), (gtx.EmptyState, gtx.ScaleByAdaDeltaState, gtx.EmptyState)),
    "yogi": lambda: (gtx.yogi(0.1), (gtx.ScaleByAdamState, gtx.EmptyState)),
    "rprop": lambda: (gtx.rprop(0.1), (gtx.ScaleByRpropState, gtx.EmptyState)),
    "adan": lambda: (gtx.adan(0.1), (gtx.ScaleByAdanState, gtx.EmptyState, gtx.EmptyState)),
    "novograd": lambda: (gtx.novograd(0.1), (gtx.ScaleByNovogradState, gtx.EmptyState)),
    "optimistic_gradient_descent": lambda: (
        gtx.optimistic_gradient_descent(0.1),
        (gtx.ScaleByOptimisticGradientState, gtx.EmptyState),
    ),
    "optimistic_adam_v2": lambda: (
        gtx.optimistic_adam_v2(0.1),
        (gtx.ScaleByAdamState, gtx.ScaleByOptimisticGradientState, gtx.EmptyState),
    ),
    "adamaxw": lambda: (gtx.adamaxw(0.1), (gtx.ScaleByAdamState, gtx.EmptyState, gtx.EmptyState)),
    "fromage": lambda: (gtx.fromage(0.1), (gtx.EmptyState, gtx.EmptyState, gtx.EmptyState)),
    "fromage_sched": lambda: (
        gtx.fromage(gtx.linear_schedule(0.1, 0.01, 3)),
        (gtx.EmptyState, gtx.ScaleByScheduleState, gtx.WeightDecaySchedule),
    ),
}


@pytest.mark.parametrize("name", sorted(STATE_TYPES))
def test_state_is_optax_chain_tuple(name):
    tx, types = STATE_TYPES[name]()
    state = tx.init(tree(0))
    assert isinstance(state, tuple) and tuple(type(s) for s in state) == types
    inner = gtx.chain(gtx.clip_by_value(1.0), tx).init(tree(0))
    assert len(inner) == 2 and tuple(type(s) for s in inner[1]) == types


@pytest.mark.parametrize(
    "name", ["sign_sgd", "signum", "adadelta", "yogi", "rprop", "adan", "novograd", "optimistic_adam_v2", "adamaxw", "fromage_sched"]
)
def test_pure_and_donated_agree(name):
    tx, _ = STATE_TYPES[name]()
    check_pure_and_donated(tx, tree(0), grad_sequence(4))


def test_schedule_learning_rate():
    schedule = gtx.linear_schedule(0.1, 0.01, 3)
    params, grads = tree(0), grad_sequence(4)
    ours, _ = gradtx_trajectory(gtx.sign_sgd(schedule), params, grads)
    expected = dict(params)
    for i, g in enumerate(grads):
        expected = {k: expected[k] - schedule(i) * torch.sign(g[k]) for k in g}
    assert_trees_close(ours, expected, rtol=1e-7, atol=1e-8)


def test_fromage_schedule_matches_constant_at_each_step():
    schedule = gtx.linear_schedule(0.2, 0.05, 3)
    params, grads = tree(0), grad_sequence(4)
    ours, _ = gradtx_trajectory(gtx.fromage(schedule), params, grads)
    expected = dict(params)
    for i, g in enumerate(grads):
        tx = gtx.fromage(float(schedule(i)))
        updates, _ = tx.update(g, tx.init(expected), expected)
        expected = gtx.apply_updates(expected, updates)
    assert_trees_close(ours, expected, rtol=1e-6, atol=1e-8)


# --------------------------------------------------------------------------- Adafactor


def _relative_step(lr):
    """torch's Adafactor step size ``min(lr, 1 / sqrt(t))`` as a schedule of the 0-d count."""
    return lambda count: torch.clamp((torch.as_tensor(count, dtype=torch.float64) + 1.0) ** -0.5, max=lr)


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("inplace", [False, True])
def test_adafactor_matches_torch_adafactor(weight_decay, inplace):
    lr = 0.05
    params, grads = tree(0), grad_sequence(STEPS)
    tx = gtx.adafactor(
        _relative_step(lr),
        min_dim_size_to_factor=1,
        weight_decay_rate=lr * weight_decay if weight_decay else None,
    )
    ours, _ = gradtx_trajectory(tx, params, grads, inplace=inplace)
    theirs = torch_trajectory(lambda ps: torch.optim.Adafactor(ps, lr=lr, weight_decay=weight_decay, foreach=False), params, grads)
    assert_trees_close(ours, theirs, rtol=1e-10, atol=1e-12)


def test_adafactor_differs_from_torch_where_it_does_not_factor():
    """With optax's default ``min_dim_size_to_factor=128`` a small matrix keeps its full second moment,
    which torch's Adafactor never does for a matrix: the trajectories part."""
    lr = 0.05
    params, grads = tree(0), grad_sequence(STEPS)
    ours, _ = gradtx_trajectory(gtx.adafactor(_relative_step(lr)), params, grads)
    theirs = torch_trajectory(lambda ps: torch.optim.Adafactor(ps, lr=lr), params, grads)
    assert not torch.allclose(ours["layer.weight"], theirs["layer.weight"], rtol=1e-6)
    torch.testing.assert_close(ours["layer.bias"], theirs["layer.bias"], rtol=1e-10, atol=1e-12)


def test_adafactor_default_chain_matches_reference():
    """optax's defaults: no learning rate, so ``-clip_by_block_rms(g / sqrt(v), 1) * max(rms(param), 1e-3)``."""
    params, grads = tree(0), grad_sequence(4)
    ours, _ = gradtx_trajectory(gtx.adafactor(momentum=0.5, dtype_momentum=torch.float64), params, grads)
    expected, v, m = dict(params), {k: torch.zeros_like(x) for k, x in params.items()}, {k: torch.zeros_like(x) for k, x in params.items()}
    for t, g in enumerate(grads):
        beta = 1.0 - (t + 1.0) ** -0.8
        new = {}
        for k in g:
            v[k] = beta * v[k] + (1 - beta) * (g[k] ** 2 + 1e-30)
            u = g[k] / torch.sqrt(v[k])
            u = u / max(1.0, float(torch.sqrt(torch.mean(u**2))))
            u = u * max(float(torch.sqrt(torch.mean(expected[k] ** 2))), 1e-3)
            m[k] = 0.5 * m[k] + 0.5 * u
            new[k] = expected[k] - m[k]
        expected = new
    assert_trees_close(ours, expected, rtol=1e-9, atol=1e-12)


def test_adafactor_state():
    tx = gtx.adafactor(0.1, momentum=0.9, weight_decay_rate=0.1)
    state = tx.init(tree(0))
    assert state[4].ema["layer.weight"].dtype == torch.float32  # optax's dtype_momentum default
    assert tuple(type(s) for s in state) == (
        gtx.FactoredState, gtx.EmptyState, gtx.EmptyState, gtx.EmptyState, gtx.EmaState, gtx.EmptyState, gtx.EmptyState
    )
    check_pure_and_donated(tx, tree(0), grad_sequence(3))


def test_sm3_optimizer():
    from test_catalogue_transforms import SM3_SHAPES, ref_sm3

    params, grads = tree(0, shapes=SM3_SHAPES), grad_sequence(4, shapes=SM3_SHAPES)
    for inplace in (False, True):
        ours, state = gradtx_trajectory(gtx.sm3(0.1, momentum=0.8), params, grads, inplace=inplace)
        expected = reference_trajectory(params, grads, *_scaled(ref_sm3(b1=0.8), -0.1))
        assert_trees_close(ours, expected, rtol=1e-10, atol=1e-12)
    assert tuple(type(s) for s in state) == (gtx.ScaleBySM3State, gtx.EmptyState)
