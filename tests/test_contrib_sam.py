"""gradtx.contrib's sam combinator and normalize, against float64 loops written from optax's definitions."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import gradtx as gtx
from gradtx.contrib import NormalizeState, SAMState, normalize, sam
from optimizer_helpers import assert_trees_close, assert_trees_equal, clone_tree

DTYPE = torch.float64
SHAPES = {"a": (3, 2), "b": (4,), "c": ()}


def _tree(seed):
    gen = torch.Generator().manual_seed(seed)
    return {k: torch.randn(s, generator=gen, dtype=DTYPE) for k, s in SHAPES.items()}


PARAMS, TARGET = _tree(0), _tree(1)


def loss(params):
    return sum(((1.0 + i) * (params[k] - TARGET[k]) ** 2 + 0.1 * params[k] ** 4).sum() for i, k in enumerate(sorted(params)))


def gradient(params):
    return {k: 2 * (1.0 + i) * (params[k] - TARGET[k]) + 0.4 * params[k] ** 3 for i, k in enumerate(sorted(params))}


def norm(tree):
    return torch.sqrt(sum((v**2).sum() for v in tree.values()))


def reference_sam(params, steps, *, lr, momentum, rho, adv_momentum, sync_period, reset_state):
    """optax.contrib.sam (transparent mode) with outer sgd(lr, momentum) and adversarial
    chain(normalize(), sgd(rho, adv_momentum)): each step's update is the adversarial one
    (+rho times the normalized gradient's trace) except every sync_period-th, which jumps to the
    cached params' outer step; the cache takes the params at the first step of each period."""
    p = {k: v.clone() for k, v in params.items()}
    cache = {k: v.clone() for k, v in p.items()}
    outer_trace = {k: torch.zeros_like(v) for k, v in p.items()}
    adv_trace = {k: torch.zeros_like(v) for k, v in p.items()}
    for i in range(steps):
        s = i % sync_period
        g = gradient(p)
        n = norm(g)
        if s == sync_period - 1:
            outer_trace = {k: g[k] + momentum * outer_trace[k] for k in p}
            u = {k: cache[k] - p[k] - lr * outer_trace[k] for k in p}
            if reset_state:
                adv_trace = {k: torch.zeros_like(v) for k, v in p.items()}
        else:
            adv_trace = {k: g[k] / n + adv_momentum * adv_trace[k] for k in p}
            u = {k: rho * adv_trace[k] for k in p}
        if s == 0:
            cache = {k: v.clone() for k, v in p.items()}
        p = {k: p[k] + u[k] for k in p}
    return p


def make_sam(*, lr, momentum, rho, adv_momentum, sync_period, reset_state, opaque_mode=False):
    return sam(
        gtx.sgd(lr, momentum=momentum),
        gtx.chain(normalize(), gtx.sgd(rho, momentum=adv_momentum)),
        sync_period=sync_period,
        reset_state=reset_state,
        opaque_mode=opaque_mode,
    )


def run(tx, params, steps, *, inplace=False, **extra):
    p = {k: v.clone() for k, v in params.items()}
    state = tx.init(p)
    for _ in range(steps):
        updates, state = tx.update(gradient(p), state, p, inplace=inplace, **extra)
        p = gtx.apply_updates(p, updates)
    return p, state


CASES = {
    "period2": dict(lr=0.05, momentum=0.5, rho=0.1, adv_momentum=0.0, sync_period=2, reset_state=True),
    "period3_keep_state": dict(lr=0.05, momentum=0.9, rho=0.05, adv_momentum=0.5, sync_period=3, reset_state=False),
    "period3_reset": dict(lr=0.02, momentum=0.0, rho=0.05, adv_momentum=0.5, sync_period=3, reset_state=True),
    "period1": dict(lr=0.05, momentum=0.5, rho=0.1, adv_momentum=0.0, sync_period=1, reset_state=True),
}


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("inplace", [False, True], ids=["pure", "donated"])
def test_sam_matches_the_reference(name, inplace):
    got, state = run(make_sam(**CASES[name]), PARAMS, 9, inplace=inplace)
    expected = reference_sam(PARAMS, 9, **CASES[name])
    assert_trees_close(got, expected, rtol=1e-9, atol=1e-12)
    assert isinstance(state, SAMState) and int(state.steps_since_sync) == 9 % CASES[name]["sync_period"]
    assert max(float((got[k] - PARAMS[k]).abs().max()) for k in got) > 1e-2


def test_sam_opaque_mode_equals_the_transparent_trajectory_at_outer_steps():
    hp = CASES["period3_reset"]
    transparent, _ = run(make_sam(**hp), PARAMS, 12)
    opaque, state = run(make_sam(**hp, opaque_mode=True), PARAMS, 4, grad_fn=lambda p, i: gradient(p))
    assert_trees_close(opaque, transparent, rtol=1e-9, atol=1e-12)
    assert state.cache is None and int(state.steps_since_sync) == 0


def test_sam_opaque_mode_passes_the_adversarial_step_index():
    seen = []

    def grad_fn(params, i):
        seen.append(i)
        return gradient(params)

    run(make_sam(**CASES["period3_reset"], opaque_mode=True), PARAMS, 2, grad_fn=grad_fn)
    assert seen == [0, 1, 0, 1]


@pytest.mark.parametrize("opaque_mode", [False, True], ids=["transparent", "opaque"])
@pytest.mark.parametrize("reset_state", [False, True])
def test_sam_pure_equals_donated_and_mutates_nothing(opaque_mode, reset_state):
    tx = sam(
        gtx.adam(0.05), gtx.chain(normalize(), gtx.sgd(0.1, momentum=0.5)),
        sync_period=3, reset_state=reset_state, opaque_mode=opaque_mode,
    )
    extra = {"grad_fn": lambda p, i: gradient(p)} if opaque_mode else {}
    pure_state, donated_state = tx.init(PARAMS), tx.init(PARAMS)
    p = clone_tree(PARAMS)
    for step in range(6):
        g = gradient(p)
        before = (clone_tree(g), clone_tree(pure_state), clone_tree(p))
        pure_updates, new_state = tx.update(g, pure_state, p, **extra)
        assert_trees_equal((g, pure_state, p), before, f"step {step}: the pure update mutated its inputs")
        donated_updates, donated_state = tx.update(clone_tree(g), donated_state, p, inplace=True, **extra)
        assert_trees_equal(donated_updates, pure_updates, f"step {step}")
        assert_trees_equal(donated_state, new_state, f"step {step}")
        pure_state, p = new_state, gtx.apply_updates(p, pure_updates)


def test_sam_cache_is_a_copy_of_the_params():
    params = clone_tree(PARAMS)
    tx = make_sam(**CASES["period2"])
    state = tx.init(params)
    gtx.apply_updates(params, {k: torch.ones_like(v) for k, v in params.items()}, inplace=True)
    assert_trees_equal(state.cache, PARAMS)


def test_sam_errors():
    with pytest.raises(ValueError, match="sync_period"):
        sam(gtx.sgd(0.1), gtx.sgd(0.1), sync_period=0)
    tx = sam(gtx.sgd(0.1), gtx.sgd(0.1), opaque_mode=True)
    with pytest.raises(ValueError, match="grad_fn"):
        tx.update(gradient(PARAMS), tx.init(PARAMS), PARAMS)


def test_sam_accepts_extra_arguments_in_a_chain():
    tx = gtx.chain(gtx.scale(1.0), make_sam(**CASES["period2"]))
    assert isinstance(tx, gtx.GradientTransformationExtraArgs)
    got, _ = run(tx, PARAMS, 4, value=torch.tensor(1.0))
    assert_trees_close(got, reference_sam(PARAMS, 4, **CASES["period2"]), rtol=1e-9, atol=1e-12)


def test_normalize_divides_by_the_global_norm():
    g = gradient(PARAMS)
    tx = normalize()
    assert tx.init(PARAMS) == NormalizeState()
    out, _ = tx.update(g, tx.init(PARAMS))
    assert_trees_close(out, {k: v / norm(g) for k, v in g.items()}, rtol=1e-14)
    torch.testing.assert_close(norm(out), torch.tensor(1.0, dtype=DTYPE), rtol=1e-14, atol=0)


@settings(max_examples=25, deadline=None)
@given(st.lists(st.floats(-1e3, 1e3, allow_nan=False, width=32), min_size=1, max_size=8), st.floats(0.01, 100.0))
def test_normalize_is_scale_invariant(values, factor):
    g = {"x": torch.tensor(values, dtype=DTYPE), "y": None}
    if float(g["x"].abs().max()) == 0.0:
        return
    a, _ = normalize().update(g, NormalizeState())
    b, _ = normalize().update({"x": g["x"] * factor, "y": None}, NormalizeState())
    assert a["y"] is None
    torch.testing.assert_close(a["x"], b["x"], rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(a["x"].norm(), torch.tensor(1.0, dtype=DTYPE), rtol=1e-12, atol=0)


def test_normalize_pure_equals_donated_and_mutates_nothing():
    g = {"a": torch.randn(3, 2), "b": torch.randn(4, dtype=torch.bfloat16), "c": torch.randn((), dtype=DTYPE)}
    before = clone_tree(g)
    pure, _ = normalize().update(g, NormalizeState())
    assert_trees_equal(g, before)
    donated, _ = normalize().update(clone_tree(g), NormalizeState(), inplace=True)
    assert_trees_equal(donated, pure)
    assert all(pure[k].dtype == g[k].dtype for k in g)



def test_normalize_compiles_to_one_graph():
    torch._dynamo.reset()
    tx = normalize()
    compiled = torch.compile(lambda g: tx.update(g, NormalizeState())[0], fullgraph=True, backend="eager")
    g = gradient(PARAMS)
    assert_trees_equal(compiled(g), tx.update(g, NormalizeState())[0])
