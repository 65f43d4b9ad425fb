"""Scaling, learning rates, schedules, trust ratios, weight decay and momentum."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import gradtx as gtx
from optimizer_helpers import (
    assert_trees_close,
    check_pure_and_donated,
    grad_sequence,
    gradtx_trajectory,
    torch_trajectory,
    tree,
)


def test_scale_multiplies_and_keeps_none():
    grads = {**tree(1), "frozen": None}
    tx = gtx.scale(-0.5)
    updates, state = tx.update(grads, tx.init(grads))
    assert updates["frozen"] is None and state == gtx.EmptyState()
    assert_trees_close(updates, gtx.tree.tree_map(lambda g: -0.5 * g, grads), rtol=0)


@settings(max_examples=20, deadline=None)
@given(lr=st.floats(1e-6, 10.0), flip=st.booleans())
def test_scale_by_learning_rate_number(lr, flip):
    grads = tree(2, torch.float32)
    tx = gtx.scale_by_learning_rate(lr, flip_sign=flip)
    updates, _ = tx.update(grads, tx.init(grads))
    sign = -1.0 if flip else 1.0
    assert_trees_close(updates, {k: v * torch.tensor(sign * lr, dtype=torch.float32) for k, v in grads.items()}, rtol=0)


def test_scale_by_learning_rate_none_is_identity():
    grads = tree(2)
    tx = gtx.scale_by_learning_rate(None)
    updates, _ = tx.update(grads, tx.init(grads))
    assert updates is grads


def test_schedule_sees_the_count_and_the_count_advances():
    seen = []

    def schedule(count):
        seen.append(count.clone())
        return 0.125 * (count + 1)  # exact in float32

    grads = tree(3)
    tx = gtx.scale_by_learning_rate(schedule)
    state = tx.init(grads)
    assert isinstance(state, gtx.ScaleByScheduleState)
    for step in range(3):
        updates, state = tx.update(grads, state)
        assert_trees_close(updates, {k: -0.125 * (step + 1) * v for k, v in grads.items()}, rtol=1e-15)
    assert [int(c) for c in seen] == [0, 1, 2]
    assert all(c.dtype == torch.int32 and c.ndim == 0 for c in seen)
    assert int(state.count) == 3


def test_scale_by_schedule_with_gradtx_schedule_and_donated_path():
    schedule = gtx.piecewise_constant_schedule(1.0, {2: 0.5})
    check_pure_and_donated(gtx.scale_by_schedule(schedule), tree(0, torch.float32), grad_sequence(4, torch.float32))
    with pytest.raises(TypeError, match="callable"):
        gtx.scale_by_schedule(0.1)


def test_scale_by_schedule_rounds_the_step_size_to_the_update_dtype():
    grads = {"h": torch.ones(3, dtype=torch.bfloat16)}
    tx = gtx.scale_by_schedule(lambda c: 1.0 / 3.0)
    updates, _ = tx.update(grads, tx.init(grads))
    assert updates["h"].dtype == torch.bfloat16
    assert torch.equal(updates["h"], torch.full((3,), 1.0 / 3.0, dtype=torch.bfloat16))


# --------------------------------------------------------------------------- trust ratio


def _trust_reference(u, p, min_norm, coef, eps):
    pn = max(float(torch.linalg.vector_norm(p)), min_norm)
    un = max(float(torch.linalg.vector_norm(u)), min_norm)
    ratio = 1.0 if pn == 0.0 or un == 0.0 else coef * pn / (un + eps)
    return u * ratio


@pytest.mark.parametrize("min_norm, coef, eps", [(0.0, 1.0, 0.0), (0.5, 0.01, 1e-3), (10.0, 2.0, 0.1)])
def test_trust_ratio_matches_its_formula(min_norm, coef, eps):
    params, grads = tree(0), tree(1)
    params["zero"] = torch.zeros(3, dtype=torch.float64)
    grads["zero"] = torch.ones(3, dtype=torch.float64)
    grads["dead"], params["dead"] = torch.zeros(2, dtype=torch.float64), torch.ones(2, dtype=torch.float64)
    tx = gtx.scale_by_trust_ratio(min_norm, coef, eps)
    updates, _ = tx.update(grads, tx.init(params), params)
    expected = {k: _trust_reference(grads[k], params[k], min_norm, coef, eps) for k in grads}
    assert_trees_close(updates, expected, rtol=1e-12)
    check_pure_and_donated(tx, params, [grads])


def test_trust_ratio_needs_params_of_the_same_shape():
    tx = gtx.scale_by_trust_ratio()
    grads = tree(1)
    with pytest.raises(ValueError, match="params are required"):
        tx.update(grads, tx.init(grads))
    with pytest.raises(ValueError, match="layer.bias"):
        tx.update(grads, tx.init(grads), {**grads, "layer.bias": torch.zeros(5)})


# --------------------------------------------------------------------------- weight decay


def test_add_decayed_weights_with_mask_prefix_and_callable():
    params, grads = tree(0), tree(1)
    tx = gtx.add_decayed_weights(0.1, mask={"layer.weight": True, "layer.bias": False, "scale": True})
    updates, state = tx.update(grads, tx.init(params), params)
    assert state == gtx.EmptyState()
    torch.testing.assert_close(updates["layer.weight"], grads["layer.weight"] + 0.1 * params["layer.weight"])
    torch.testing.assert_close(updates["layer.bias"], grads["layer.bias"])
    by_rank = gtx.add_decayed_weights(0.1, mask=lambda p: gtx.tree.tree_map(lambda x: x.ndim > 1, p))
    updates, _ = by_rank.update(grads, by_rank.init(params), params)
    torch.testing.assert_close(updates["scale"], grads["scale"])
    torch.testing.assert_close(updates["layer.weight"], grads["layer.weight"] + 0.1 * params["layer.weight"])
    check_pure_and_donated(by_rank, params, grad_sequence(2))


def test_add_decayed_weights_schedule_zero_and_errors():
    params, grads = tree(0), tree(1)
    tx = gtx.add_decayed_weights(lambda count: 0.5 * count)
    state = tx.init(params)
    assert isinstance(state, gtx.WeightDecaySchedule)
    first, state = tx.update(grads, state, params)
    second, state = tx.update(grads, state, params)
    assert_trees_close(first, grads, rtol=0)
    assert_trees_close(second, {k: grads[k] + 0.5 * params[k] for k in grads}, rtol=1e-12)
    check_pure_and_donated(tx, params, grad_sequence(3))
    zero = gtx.add_decayed_weights()
    assert zero.update(grads, zero.init(params), params)[0] is grads
    with pytest.raises(ValueError, match="params are required"):
        zero.update(grads, zero.init(params))
    with pytest.raises(ValueError, match="scale"):
        gtx.add_decayed_weights(0.1, mask={"layer": True}).update(grads, gtx.EmptyState(), params)


# --------------------------------------------------------------------------- momentum


@pytest.mark.parametrize("nesterov", [False, True])
@pytest.mark.parametrize("inplace", [False, True])
def test_sgd_momentum_matches_torch(nesterov, inplace):
    params, grads = tree(0), grad_sequence(6)
    ours, state = gradtx_trajectory(gtx.sgd(0.1, momentum=0.9, nesterov=nesterov), params, grads, inplace=inplace)
    theirs = torch_trajectory(lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=nesterov), params, grads)
    assert_trees_close(ours, theirs, rtol=1e-12, atol=1e-14)
    assert isinstance(state[0], gtx.TraceState)


def test_trace_returns_updates_that_do_not_alias_the_state():
    grads = tree(1)
    tx = gtx.trace(0.5)
    for inplace in (False, True):
        updates, state = tx.update({k: v.clone() for k, v in grads.items()}, tx.init(grads), inplace=inplace)
        updates["layer.weight"].mul_(0.0)  # a later transform overwriting its (donated) input
        torch.testing.assert_close(state.trace["layer.weight"], grads["layer.weight"])


def test_trace_accumulator_dtype_and_paths():
    params = tree(0, torch.float32)
    tx = gtx.trace(0.9, nesterov=True, accumulator_dtype=torch.float64)
    state = tx.init(params)
    assert all(t.dtype == torch.float64 for t in state.trace.values())
    check_pure_and_donated(tx, params, grad_sequence(4, torch.float32))
    check_pure_and_donated(gtx.trace(0.9), params, grad_sequence(4, torch.float32))


@pytest.mark.parametrize("debias", [True, False])
def test_ema_matches_its_formula(debias):
    grads = grad_sequence(5)
    tx = gtx.ema(0.8, debias=debias)
    state = tx.init(grads[0])
    average = {k: torch.zeros_like(v) for k, v in grads[0].items()}
    for t, g in enumerate(grads, start=1):
        updates, state = tx.update(g, state)
        average = {k: 0.8 * average[k] + 0.2 * g[k] for k in g}
        expected = {k: v / (1 - 0.8**t) for k, v in average.items()} if debias else average
        assert_trees_close(updates, expected, rtol=1e-12, atol=1e-15)
    assert int(state.count) == 5
    check_pure_and_donated(tx, tree(0), grads)
