"""apply_if_finite: skip non-finite steps on the device, count them, give up after max_consecutive_errors."""

import math

import pytest
import torch
from combinator_helpers import assert_same, make_tree, run_both_paths, running_sum

import gradtx as gtx


def _grads(step: int, bad: float | None = None) -> dict:
    grads = make_tree(seed=step)
    if bad is not None:
        grads["layer"]["b"][1] = bad
    return grads


def test_finite_steps_match_the_inner_transformation():
    params = make_tree()
    tx = gtx.apply_if_finite(running_sum(), max_consecutive_errors=2)
    inner = running_sum()
    state, inner_state = tx.init(params), inner.init(params)
    for step in range(3):
        grads = _grads(step)
        updates, state = tx.update(grads, state, params)
        expected, inner_state = inner.update(grads, inner_state, params)
        assert_same(updates, expected)
        assert_same(state.inner_state, inner_state)
    assert int(state.notfinite_count) == 0 and int(state.total_notfinite) == 0 and bool(state.last_finite)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_step_is_skipped_and_counted(bad):
    params = make_tree()
    tx = gtx.apply_if_finite(running_sum(), max_consecutive_errors=3)
    state = tx.init(params)
    _, state = tx.update(_grads(0), state, params)
    before = state.inner_state
    updates, state = tx.update(_grads(1, bad), state, params)
    for leaf in gtx.tree.leaves(updates):
        assert leaf is None or (leaf == 0).all()
    assert updates["frozen"] is None
    assert_same(state.inner_state, before)  # the inner state did not move
    assert (int(state.notfinite_count), bool(state.last_finite), int(state.total_notfinite)) == (1, False, 1)
    # a finite step resets the consecutive count, not the total, and continues from the old state
    updates, state = tx.update(_grads(2), state, params)
    torch.testing.assert_close(updates["head"], _grads(0)["head"] + _grads(2)["head"])
    assert (int(state.notfinite_count), bool(state.last_finite), int(state.total_notfinite)) == (0, True, 1)


def test_applies_anyway_after_max_consecutive_errors():
    params = make_tree()
    tx = gtx.apply_if_finite(running_sum(), max_consecutive_errors=2)
    state = tx.init(params)
    skipped = []
    for step in range(4):
        updates, state = tx.update(_grads(step, math.nan), state, params)
        skipped.append(bool((updates["head"] == 0).all()))
    # optax: a step applies when notfinite_count > max_consecutive_errors (here the 3rd and 4th)
    assert skipped == [True, True, False, False]
    assert int(state.notfinite_count) == 4 and int(state.total_notfinite) == 4
    assert torch.isnan(state.inner_state.total["layer"]["b"][1])
    torch.testing.assert_close(state.inner_state.total["head"], _grads(2)["head"] + _grads(3)["head"])


def test_state_is_tensors_with_optax_dtypes():
    state = gtx.apply_if_finite(running_sum(), 1).init(make_tree())
    assert isinstance(state, gtx.ApplyIfFiniteState)
    assert state.notfinite_count.dtype == torch.int32 and state.notfinite_count.ndim == 0
    assert state.total_notfinite.dtype == torch.int32 and state.last_finite.dtype == torch.bool
    with pytest.raises(ValueError, match="max_consecutive_errors"):
        gtx.apply_if_finite(running_sum(), -1)


def test_pure_and_donated_paths_agree_through_skips_and_give_up():
    params = make_tree()
    tx = gtx.apply_if_finite(gtx.chain(gtx.clip_by_global_norm(1.0), running_sum()), max_consecutive_errors=1)
    sequence = [_grads(0), _grads(1, math.nan), _grads(2), _grads(3, math.inf), _grads(4, math.nan), _grads(5)]
    run_both_paths(tx, params, sequence)


def test_low_precision_and_clip_chain_reference():
    """bf16 overflow to inf is caught; the clipped steps equal clip_grad_norm_ on the finite ones."""
    params = {"w": torch.zeros(4, dtype=torch.bfloat16)}
    tx = gtx.apply_if_finite(gtx.clip_by_global_norm(1.0), max_consecutive_errors=5)
    state = tx.init(params)
    big = torch.tensor([3e38, 3e38, 1.0, 1.0]).to(torch.bfloat16) * 2  # overflows to inf
    assert torch.isinf(big).any()
    updates, state = tx.update({"w": big}, state, params)
    assert (updates["w"] == 0).all() and not bool(state.last_finite)
    g = torch.tensor([3.0, 4.0, 0.0, 0.0], dtype=torch.bfloat16)
    updates, state = tx.update({"w": g}, state, params)
    param = torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))
    param.grad = g.clone()
    torch.nn.utils.clip_grad_norm_([param], 1.0)
    torch.testing.assert_close(updates["w"], param.grad)


def test_compiles_to_one_graph_with_no_host_sync():
    from torch._dynamo.testing import CompileCounter

    params = {"w": torch.zeros(3), "b": torch.zeros(2)}
    tx = gtx.apply_if_finite(running_sum(), max_consecutive_errors=1)
    counter = CompileCounter()

    @torch.compile(backend=counter, fullgraph=True)  # fullgraph: any .item() or bool() would fail
    def step(grads, state):
        return tx.update(grads, state)

    state = tx.init(params)
    eager_state = tx.init(params)
    for i, bad in enumerate([None, math.nan, None, math.inf, math.inf, None]):
        grads = {"w": torch.full((3,), float(i + 1)), "b": torch.ones(2)}
        if bad is not None:
            grads["w"][0] = bad
        updates, state = step(grads, state)
        expected, eager_state = tx.update(grads, eager_state)
        assert_same(updates, expected)
        assert_same(state, eager_state)
    assert counter.frame_count == 1


def test_large_finite_values_are_not_mistaken_for_overflow():
    params = {"w": torch.zeros(3), "d": torch.zeros(2, dtype=torch.float64)}
    tx = gtx.apply_if_finite(running_sum(), max_consecutive_errors=0)
    grads = {"w": torch.tensor([3e38, -3e38, 1.0]), "d": torch.tensor([1e300, -1e300], dtype=torch.float64)}
    updates, state = tx.update(grads, tx.init(params))
    assert bool(state.last_finite) and int(state.total_notfinite) == 0
    assert_same(updates, grads)


def test_adam_skipping_nan_steps_matches_torch_adam_that_never_saw_them():
    torch.manual_seed(0)
    w0 = torch.randn(4)
    grads = [torch.randn(4) for _ in range(5)]
    tx = gtx.apply_if_finite(gtx.adam(1e-2), max_consecutive_errors=3)
    params = {"w": w0.clone()}
    state = tx.init(params)
    w = torch.nn.Parameter(w0.clone())
    opt = torch.optim.Adam([w], lr=1e-2)
    for i, g in enumerate(grads):
        if i in (1, 3):  # a NaN step in between: skipped, Adam's count and moments untouched
            updates, state = tx.update({"w": torch.full((4,), math.nan)}, state, params)
            params = gtx.apply_updates(params, updates)
        updates, state = tx.update({"w": g}, state, params)
        params = gtx.apply_updates(params, updates)
        w.grad = g.clone()
        opt.step()
        torch.testing.assert_close(params["w"], w.detach(), rtol=1e-5, atol=1e-6)
    assert int(state.total_notfinite) == 2


def test_complex_gradients_are_tested_for_finiteness():
    """A NaN in the real or the imaginary part of a complex gradient skips the step."""
    params = {"z": torch.zeros(3, dtype=torch.complex64), "x": torch.zeros(2)}
    tx = gtx.apply_if_finite(gtx.sgd(0.1), 5)
    state = tx.init(params)
    finite = {"z": torch.tensor([1 + 2j, 0j, 3j], dtype=torch.complex64), "x": torch.ones(2)}
    updates, state = tx.update(finite, state, params)
    assert bool(state.last_finite) and torch.equal(updates["z"], -0.1 * finite["z"])
    for bad in (complex(float("nan"), 0.0), complex(0.0, float("inf"))):
        grads = {"z": torch.tensor([1 + 2j, bad, 3j], dtype=torch.complex64), "x": torch.ones(2)}
        updates, state = tx.update(grads, state, params)
        assert not bool(state.last_finite) and torch.count_nonzero(updates["z"]) == 0
    _, skip_state = gtx.skip_not_finite(grads, torch.zeros((), dtype=torch.int32), None)
    assert bool(skip_state["should_skip"]) and int(skip_state["num_not_finite"]) == 1
