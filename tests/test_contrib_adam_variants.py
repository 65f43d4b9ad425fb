"""ADOPT, AdEMAMix, simplified AdEMAMix and ACProp (gradtx.contrib) against float64 references.

Each reference is a plain per-leaf loop written from the algorithm as optax.contrib defines it
(learning rate, weight decay and all), independent of gradtx's foreach code; ADOPT's and ACProp's
also follow the authors' PyTorch code (the first ADOPT step only sets ``v = g^2``; ACProp's first
step divides by ``1 + eps``).
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
RTOL = 1e-9


def params0():
    return tree(0, shapes=SHAPES)


def grad_list(steps=STEPS):
    return [tree(100 + i, shapes=SHAPES) for i in range(steps)]


def _rate(learning_rate, t):
    """A number, or a schedule read at step ``t`` (from 0) as a float64 number."""
    if callable(learning_rate):
        return float(learning_rate(torch.tensor(t, dtype=torch.int32)))
    return learning_rate


def reference(step_fn, init_fn, params, grads):
    """Runs ``step_fn(t, p, g, s) -> (new p, new s)`` leaf by leaf, from ``init_fn(p)``."""
    params = clone_tree(params)
    states = {k: init_fn(p) for k, p in params.items()}
    for t, g in enumerate(grads):
        for k in params:
            params[k], states[k] = step_fn(t, params[k], g[k], states[k])
    return params


def ref_adopt(lr, b1=0.9, b2=0.9999, eps=1e-6, nesterov=False, use_clipping=True):
    def init(p):
        return torch.zeros_like(p), torch.zeros_like(p)

    def step(t, p, g, s):
        m, v = s
        if t == 0:  # the first step only initialises v
            return p, (m, g * g)
        u = g / torch.clamp(torch.sqrt(v), min=eps)
        if use_clipping:
            u = torch.clamp(u, -(t**0.25), t**0.25)
        m = b1 * m + (1 - b1) * u
        direction = b1 * m + (1 - b1) * u if nesterov else m
        return p - _rate(lr, t) * direction, (m, b2 * v + (1 - b2) * g * g)

    return init, step


def ref_ademamix(lr, b1=0.9, b2=0.999, b3=0.9999, alpha=5.0, eps=1e-8, eps_root=0.0, weight_decay=0.0):
    def init(p):
        return torch.zeros_like(p), torch.zeros_like(p), torch.zeros_like(p)

    def step(t, p, g, s):
        m1, m2, v = s
        b3_t, alpha_t = _rate(b3, t), _rate(alpha, t)
        m1 = b1 * m1 + (1 - b1) * g
        m2 = b3_t * m2 + (1 - b3_t) * g
        v = b2 * v + (1 - b2) * g * g
        m1_hat, v_hat = m1 / (1 - b1 ** (t + 1)), v / (1 - b2 ** (t + 1))
        u = (m1_hat + alpha_t * m2) / (torch.sqrt(v_hat + eps_root) + eps) + weight_decay * p
        return p - _rate(lr, t) * u, (m1, m2, v)

    return init, step


def ref_simplified_ademamix(lr, b1=0.99, b2=0.95, alpha=0.0, eps=1e-8, eps_root=0.0, weight_decay=0.0):
    def init(p):
        return torch.zeros_like(p), torch.zeros_like(p)

    def step(t, p, g, s):
        m, n = s
        m = b1 * m + g
        n = b2 * n + (1 - b2) * g * g
        n_hat = n / (1 - b2 ** (t + 1))
        u = (m + _rate(alpha, t) * g) / (torch.sqrt(n_hat + eps_root) + eps) + weight_decay * p
        return p - _rate(lr, t) * u, (m, n)

    return init, step


def ref_acprop(lr, b1=0.9, b2=0.999, eps=1e-16, eps_root=1e-16, weight_decay=0.0):
    def init(p):
        return torch.zeros_like(p), torch.zeros_like(p)

    def step(t, p, g, s):
        m, v = s
        denominator = 1 + eps if t == 0 else torch.sqrt(v / (1 - b2**t)) + eps  # the steps before this one
        u = g / denominator + weight_decay * p
        v = b2 * v + (1 - b2) * (g - m) ** 2 + eps_root
        m = b1 * m + (1 - b1) * g
        return p - _rate(lr, t) * u, (m, v)

    return init, step


SCHEDULE = gtx.linear_schedule(0.05, 0.01, 4)
# name -> (gradtx factory, reference)
CASES = {
    "adopt": (lambda: contrib.adopt(0.05), ref_adopt(0.05)),
    "adopt/b2": (lambda: contrib.adopt(0.05, b1=0.5, b2=0.9), ref_adopt(0.05, b1=0.5, b2=0.9)),
    "adopt/nesterov": (lambda: contrib.adopt(SCHEDULE, b2=0.9, nesterov=True), ref_adopt(SCHEDULE, b2=0.9, nesterov=True)),
    "adopt/no_clipping": (
        lambda: contrib.adopt(0.05, b2=0.9, eps=0.1, use_clipping=False),
        ref_adopt(0.05, b2=0.9, eps=0.1, use_clipping=False),
    ),
    "ademamix": (lambda: contrib.ademamix(0.05, b3=0.99), ref_ademamix(0.05, b3=0.99)),
    "ademamix/decay": (
        lambda: contrib.ademamix(0.05, b3=0.99, alpha=3.0, eps_root=1e-6, weight_decay=0.1),
        ref_ademamix(0.05, b3=0.99, alpha=3.0, eps_root=1e-6, weight_decay=0.1),
    ),
    "ademamix/schedules": (
        lambda: contrib.ademamix(SCHEDULE, b3=gtx.linear_schedule(0.9, 0.999, 4), alpha=gtx.linear_schedule(0.0, 5.0, 4)),
        ref_ademamix(SCHEDULE, b3=gtx.linear_schedule(0.9, 0.999, 4), alpha=gtx.linear_schedule(0.0, 5.0, 4)),
    ),
    "simplified_ademamix": (lambda: contrib.simplified_ademamix(0.05), ref_simplified_ademamix(0.05)),
    "simplified_ademamix/alpha": (
        lambda: contrib.simplified_ademamix(0.05, b1=0.9, alpha=2.0, eps_root=1e-6, weight_decay=0.1),
        ref_simplified_ademamix(0.05, b1=0.9, alpha=2.0, eps_root=1e-6, weight_decay=0.1),
    ),
    "simplified_ademamix/schedules": (
        lambda: contrib.simplified_ademamix(SCHEDULE, alpha=gtx.linear_schedule(0.0, 2.0, 4)),
        ref_simplified_ademamix(SCHEDULE, alpha=gtx.linear_schedule(0.0, 2.0, 4)),
    ),
    "acprop": (lambda: contrib.acprop(0.05), ref_acprop(0.05)),
    "acprop/decay": (
        lambda: contrib.acprop(SCHEDULE, b1=0.5, b2=0.9, eps=1e-8, eps_root=1e-6, weight_decay=0.1),
        ref_acprop(SCHEDULE, b1=0.5, b2=0.9, eps=1e-8, eps_root=1e-6, weight_decay=0.1),
    ),
}


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_float64_reference(name, inplace):
    make, (init, step) = CASES[name]
    expected = reference(step, init, params0(), grad_list())
    got, _ = gradtx_trajectory(make(), params0(), grad_list(), inplace=inplace)
    assert_trees_close(got, expected, rtol=RTOL, atol=1e-12)


@pytest.mark.parametrize("name", sorted(CASES))
def test_pure_equals_donated_and_mutates_nothing(name):
    check_pure_and_donated(CASES[name][0](), params0(), grad_list())


@pytest.mark.parametrize("name", sorted(CASES))
def test_float32_close_to_the_float64_reference(name):
    make, (init, step) = CASES[name]
    expected = reference(step, init, params0(), grad_list())
    p32, g32 = gtx.tree.tree_map(lambda x: x.float(), params0()), [gtx.tree.tree_map(lambda x: x.float(), g) for g in grad_list()]
    got, _ = gradtx_trajectory(make(), p32, g32)
    for k in expected:
        assert got[k].dtype == torch.float32
        torch.testing.assert_close(got[k].double(), expected[k], rtol=1e-4, atol=1e-5)


def test_states_are_optax_shaped():
    p = params0()
    adopt = contrib.scale_by_adopt(mu_dtype=torch.float32).init(p)
    assert isinstance(adopt, gtx.ScaleByAdamState) and adopt.mu["w"].dtype == torch.float32
    assert adopt.nu["w"].dtype == torch.float64 and adopt.count.dtype == torch.int32
    ademamix = contrib.scale_by_ademamix(mu_dtype=torch.float32).init(p)
    assert isinstance(ademamix, contrib.ScaleByAdemamixState)
    assert ademamix._fields == ("count", "count_m2", "m1", "m2", "nu")
    assert all(x["b"].dtype == torch.float32 for x in (ademamix.m1, ademamix.m2, ademamix.nu))  # as optax
    simplified = contrib.scale_by_simplified_ademamix().init(p)
    assert simplified._fields == ("t", "m", "n") and simplified.t.dtype == torch.int32
    assert isinstance(contrib.scale_by_acprop().init(p), gtx.ScaleByBeliefState)


def test_adopt_first_step_is_zero_and_second_is_the_clipped_normalised_gradient():
    p, (g0, g1) = params0(), grad_list(2)
    tx = contrib.scale_by_adopt(b1=0.0)  # with b1 = 0 the direction is the normalised gradient itself
    state = tx.init(p)
    u0, state = tx.update(g0, state)
    assert all(bool((u == 0).all()) for u in u0.values())
    torch.testing.assert_close(state.nu["w"], g0["w"] ** 2)
    u1, _ = tx.update(g1, state)
    torch.testing.assert_close(u1["w"], torch.clamp(g1["w"] / g0["w"].abs().clamp(min=1e-6), -1.0, 1.0))


def test_mu_dtype_runs_and_keeps_dtypes():
    p = params0()
    for tx in (contrib.adopt(0.05, mu_dtype=torch.float32), contrib.ademamix(0.05, mu_dtype=torch.float32)):
        got, state = gradtx_trajectory(tx, p, grad_list(3))
        assert all(v.dtype == torch.float64 for v in got.values())
        moment = state[0].mu if hasattr(state[0], "mu") else state[0].m1
        assert moment["w"].dtype == torch.float32


def test_none_leaves_pass_through():
    p = params0()
    for make, _ in CASES.values():
        tx = make()
        state = tx.init(p)
        g = dict(grad_list(1)[0], b=None)
        updates, _ = tx.update(g, state, p)
        assert updates["b"] is None and updates["w"].shape == (4, 3)


def test_ademamix_alpha_zero_with_no_slow_term_is_adamw():
    p, gs = params0(), grad_list()
    got, _ = gradtx_trajectory(contrib.ademamix(0.05, alpha=0.0, weight_decay=0.1), p, gs)
    expected, _ = gradtx_trajectory(gtx.adamw(0.05, weight_decay=0.1), p, gs)
    assert_trees_close(got, expected, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("factory", [contrib.adopt, contrib.ademamix, contrib.simplified_ademamix, contrib.acprop])
def test_inject_hyperparams_gives_the_same_steps(factory):
    # ADOPT's default clip_value_fn is a callable: inject_hyperparams reads it as a schedule and
    # passes its value, which scale_by_adopt takes as the bound of that step
    p, gs = params0(), grad_list()
    got, _ = gradtx_trajectory(gtx.inject_hyperparams(factory)(learning_rate=0.05), p, gs)
    expected, _ = gradtx_trajectory(factory(0.05), p, gs)
    assert_trees_close(got, expected, rtol=1e-12, atol=1e-14)


@settings(max_examples=30, deadline=None)
@given(
    b1=st.floats(0.0, 0.99),
    b2=st.floats(0.0, 0.9999),
    nesterov=st.booleans(),
    scales=st.lists(st.sampled_from([0.0, 1e-12, 1e-3, 1.0, 1e6]), min_size=2, max_size=6),
)
def test_adopt_direction_stays_within_the_clipping_bound(b1, b2, nesterov, scales):
    # mu is a convex combination of 0 and normalised gradients clipped to s ** 0.25 (s <= t), so
    # |update_t| <= t ** 0.25 whatever the gradients, zeros and huge ones included
    tx = contrib.scale_by_adopt(b1=b1, b2=b2, nesterov=nesterov)
    p = params0()
    state = tx.init(p)
    for t, scale in enumerate(scales):
        g = {k: v * scale for k, v in tree(200 + t, shapes=SHAPES).items()}
        updates, state = tx.update(g, state)
        for u in updates.values():
            assert bool(torch.isfinite(u).all())
            assert float(u.abs().max()) <= t**0.25 * (1 + 1e-12)


def test_adopt_direction_is_taken_before_mu_is_rounded_to_mu_dtype():
    p, gs = params0(), grad_list(3)
    tx = contrib.scale_by_adopt(mu_dtype=torch.bfloat16)
    state = tx.init(p)
    for g in gs[:2]:
        _, state = tx.update(g, state)
    assert state.mu["w"].dtype == torch.bfloat16
    # the third direction: b1 * mu (as stored, in bfloat16) + (1 - b1) * u, in float64
    reference = contrib.scale_by_adopt()
    ref_state = reference.init(p)._replace(count=state.count, mu=gtx.tree.tree_map(lambda m: m.double(), state.mu), nu=state.nu)
    expected, _ = reference.update(gs[2], ref_state)
    got, _ = tx.update(gs[2], state)
    assert_trees_close(got, expected, rtol=1e-12, atol=1e-14)
