"""gradtx.contrib.reduce_on_plateau: against a plain-Python loop of optax's definition and against
torch.optim.lr_scheduler.ReduceLROnPlateau's decisions where the two agree."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import gradtx as gtx
from gradtx.contrib import ReduceLROnPlateauState, reduce_on_plateau
from optimizer_helpers import assert_trees_close, assert_trees_equal, clone_tree

DTYPE = torch.float64
PARAMS = {"a": torch.zeros(3, 2, dtype=DTYPE), "b": torch.zeros(4, dtype=DTYPE)}


def reference_scales(values, *, factor, patience, rtol, atol, cooldown, accumulation_size, min_scale):
    """optax.contrib.reduce_on_plateau's scale after each value, in plain Python floats."""
    scale, best, plateau, cool, count, avg = 1.0, float("inf"), 0, 0, 0, 0.0
    out = []
    for v in values:
        avg = (count * avg + v) / (count + 1)
        count += 1
        if count == accumulation_size:
            improved = avg < (1 - rtol) * best - atol
            if improved:
                best = avg
            current = 0 if improved else plateau + 1
            if cool > 0:
                plateau, cool = 0, cool - 1
            else:
                reduce = current == patience
                scale = max(scale * factor if reduce else scale, min_scale)
                plateau = 0 if reduce else current
                cool = cooldown if reduce else 0
            count, avg = 0, 0.0
        out.append(scale)
    return out


def run(values, *, inplace=False, dtype=DTYPE, **hp):
    tx = reduce_on_plateau(**hp)
    params = {k: v.to(dtype) for k, v in PARAMS.items()}
    state = tx.init(params)
    scales = []
    for v in values:
        g = {k: torch.ones_like(p) for k, p in params.items()}
        updates, state = tx.update(g, state, params, inplace=inplace, value=torch.tensor(v, dtype=dtype))
        scales.append(float(state.scale))
        for u in updates.values():
            assert torch.equal(u, torch.full_like(u, float(state.scale)))
    return scales, state


HP = dict(factor=0.5, patience=3, rtol=1e-4, atol=0.0, cooldown=2, accumulation_size=1, min_scale=0.0)
values_strategy = st.lists(st.integers(0, 6).map(float), min_size=1, max_size=40)


@settings(max_examples=60, deadline=None)
@given(
    values_strategy,
    st.sampled_from([0.1, 0.5, 0.9]),
    st.integers(1, 4),
    st.integers(0, 3),
    st.integers(1, 3),
    st.sampled_from([0.0, 0.1]),
    st.sampled_from([(1e-4, 0.0), (0.0, 0.5), (0.1, 0.2)]),
)
def test_matches_the_definition(values, factor, patience, cooldown, accumulation_size, min_scale, tols):
    hp = dict(factor=factor, patience=patience, cooldown=cooldown, accumulation_size=accumulation_size,
              min_scale=min_scale, rtol=tols[0], atol=tols[1])
    got, _ = run(values, **hp)
    assert got == pytest.approx(reference_scales(values, **hp), rel=1e-12)


@settings(max_examples=60, deadline=None)
@given(values_strategy, st.sampled_from([0.1, 0.5]), st.integers(1, 4), st.integers(0, 3), st.sampled_from([0.0, 0.05]),
       st.sampled_from(["rel", "abs"]))
def test_decisions_match_torch_reduce_lr_on_plateau(values, factor, patience, cooldown, min_scale, mode):
    """torch's patience is optax's minus one (torch reduces when its bad-epoch count *exceeds* it);
    its relative threshold is rtol (atol = 0), its absolute one atol (rtol = 0)."""
    threshold = 1e-3 if mode == "rel" else 0.5
    param = torch.zeros(1, requires_grad=True)
    opt = torch.optim.SGD([param], lr=1.0)
    scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(
        opt, mode="min", factor=factor, patience=patience - 1, threshold=threshold, threshold_mode=mode,
        cooldown=cooldown, min_lr=min_scale, eps=0.0,
    )
    lrs = []
    for v in values:
        scheduler.step(v)
        lrs.append(opt.param_groups[0]["lr"])
    got, _ = run(values, factor=factor, patience=patience, cooldown=cooldown, min_scale=min_scale,
                 rtol=threshold if mode == "rel" else 0.0, atol=threshold if mode == "abs" else 0.0)
    assert got == pytest.approx(lrs, rel=1e-12)


def test_a_plateau_reduces_then_cools_down():
    values = [5.0, 4.0, 4.0, 4.0, 4.0, 4.0, 4.0, 4.0, 4.0, 3.0]
    got, state = run(values, **HP)
    assert got == [1.0, 1.0, 1.0, 1.0, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5]
    assert isinstance(state, ReduceLROnPlateauState)
    assert float(state.best_value) == 3.0 and int(state.plateau_count) == 0


def test_state_dtypes_follow_the_params():
    tx = reduce_on_plateau()
    state = tx.init({"a": torch.zeros(2, dtype=torch.bfloat16), "b": torch.zeros(2, dtype=torch.float64)})
    assert state.scale.dtype == torch.bfloat16 and state.best_value.dtype == torch.float64
    assert state.avg_value.dtype == torch.float64
    assert all(c.dtype == torch.int32 and c.shape == () for c in (state.plateau_count, state.cooldown_count, state.count))
    updates, _ = tx.update({"a": torch.ones(2, dtype=torch.bfloat16), "b": None}, state, value=1.0)
    assert updates["a"].dtype == torch.bfloat16 and updates["b"] is None


def test_pure_equals_donated_and_mutates_nothing():
    tx = reduce_on_plateau(factor=0.5, patience=2, cooldown=1, accumulation_size=2)
    pure_state, donated_state = tx.init(PARAMS), tx.init(PARAMS)
    gen = torch.Generator().manual_seed(0)
    for step, v in enumerate([3.0, 2.0, 2.5, 2.5, 2.5, 2.5, 2.5, 2.5, 1.0, 1.0]):
        g = {k: torch.randn(p.shape, generator=gen, dtype=DTYPE) for k, p in PARAMS.items()}
        before = (clone_tree(g), clone_tree(pure_state))
        pure_updates, new_state = tx.update(g, pure_state, PARAMS, value=v)
        assert_trees_equal((g, pure_state), before, f"step {step}: the pure update mutated its inputs")
        donated_updates, donated_state = tx.update(clone_tree(g), donated_state, PARAMS, inplace=True, value=v)
        assert_trees_equal(donated_updates, pure_updates, f"step {step}")
        assert_trees_equal(donated_state, new_state, f"step {step}")
        pure_state = new_state
    assert float(pure_state.scale) == 0.5


def test_the_scale_multiplies_the_updates_and_the_value_keeps_its_graph():
    tx = gtx.chain(gtx.sgd(1.0), reduce_on_plateau(factor=0.5, patience=1, accumulation_size=2))
    state = tx.init(PARAMS)
    g = {k: torch.ones_like(v) for k, v in PARAMS.items()}
    for v in [1.0, 1.0, 2.0]:
        _, state = tx.update(g, state, PARAMS, value=v)
    value = torch.tensor(3.0, dtype=DTYPE, requires_grad=True)
    updates, state = tx.update(g, state, PARAMS, value=value)  # the average (2 + 3) / 2 is no better
    assert_trees_close(updates, {k: -0.5 * v for k, v in g.items()}, rtol=0)
    fresh = reduce_on_plateau(accumulation_size=2)
    _, fresh_state = fresh.update(g, fresh.init(PARAMS), PARAMS, value=1.0)
    _, fresh_state = fresh.update(g, fresh_state, PARAMS, value=value)  # the first average improves on inf
    (d_value,) = torch.autograd.grad(fresh_state.best_value, value)
    assert float(d_value) == 0.5


def test_errors():
    for bad in (dict(factor=1.0), dict(factor=0.0), dict(rtol=-1.0), dict(rtol=0.0, atol=0.0), dict(rtol=2.0)):
        with pytest.raises(ValueError):
            reduce_on_plateau(**bad)
    tx = reduce_on_plateau()
    with pytest.raises(ValueError, match="value"):
        tx.update({"a": torch.ones(2)}, tx.init({"a": torch.ones(2)}))


def test_a_step_compiles_to_one_graph():
    """The decisions are tensor ops: no host read, no graph break."""
    torch._dynamo.reset()
    tx = gtx.chain(gtx.sgd(0.1), reduce_on_plateau(factor=0.5, patience=1, accumulation_size=2))

    def step(grads, state, value):
        return tx.update(grads, state, PARAMS, value=value)

    compiled = torch.compile(step, fullgraph=True, backend="eager")
    eager_state = compiled_state = tx.init(PARAMS)
    g = {k: torch.ones_like(v) for k, v in PARAMS.items()}
    for v in [2.0, 1.0, 3.0, 3.0, 3.0, 3.0]:
        eager, eager_state = step(g, eager_state, torch.tensor(v, dtype=DTYPE))
        got, compiled_state = compiled(g, compiled_state, torch.tensor(v, dtype=DTYPE))
        assert_trees_equal(got, eager)
        assert_trees_equal(compiled_state, eager_state)
    assert float(eager_state[1].scale) == 0.25  # averages 1.5, 3, 3: two reductions
