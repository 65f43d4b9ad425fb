"""optax's top-level names for states, types, schedules and tree helpers: what each one is in gradtx."""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch

import gradtx as gtx
from gradtx import base, tree_utils

F64 = torch.float64


def params():
    return {"w": torch.tensor([[1.0, -2.0], [3.0, 0.5]], dtype=F64), "b": torch.tensor([0.25, -1.0], dtype=F64)}


# --------------------------------------------------------------------------- states that keep nothing


@pytest.mark.parametrize(
    "alias, factory",
    [
        ("AdaptiveGradClipState", lambda: gtx.adaptive_grad_clip(0.1)),
        ("AddDecayedWeightsState", lambda: gtx.add_decayed_weights(0.1)),
        ("AddDecayedWeightsState", lambda: gtx.add_decayed_weights(0.1, mask={"w": True, "b": False})),
        ("ClipState", lambda: gtx.clip(1.0)),
        ("ClipState", lambda: gtx.clip_by_value(1.0)),
        ("ScaleByTrustRatioState", lambda: gtx.scale_by_trust_ratio()),
        ("ScaleState", lambda: gtx.scale(0.5)),
    ],
)
def test_empty_state_aliases_are_the_states_of_their_transformations(alias, factory):
    state_type = getattr(gtx, alias)
    assert state_type is gtx.EmptyState
    tx = factory()
    p = params()
    state = tx.init(p)
    assert type(state) is state_type and state == state_type()
    _, new_state = tx.update(p, state, p)
    assert type(new_state) is state_type and gtx.tree.leaves(new_state) == []


def test_multi_transform_state_is_partition_state():
    assert gtx.MultiTransformState is gtx.PartitionState
    tx = gtx.multi_transform({"a": gtx.sgd(0.1), "b": gtx.scale(2.0)}, {"w": "a", "b": "b"})
    assert isinstance(tx.init(params()), gtx.MultiTransformState)


def test_inject_stateful_hyperparams_state_is_what_it_returns():
    assert gtx.InjectStatefulHyperparamsState is gtx.InjectHyperparamsState
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        tx = gtx.inject_stateful_hyperparams(gtx.sgd)(learning_rate=0.1)
    state = tx.init(params())
    assert isinstance(state, gtx.InjectStatefulHyperparamsState)
    assert set(state._fields) == {"count", "hyperparams", "inner_state"}


def test_masked_node_is_an_empty_pytree_node():
    t = torch.ones(2)
    tree = {"a": gtx.MaskedNode(), "b": t}
    assert gtx.tree.leaves(tree) == [t]
    summed = gtx.apply_updates(tree, {"a": gtx.MaskedNode(), "b": torch.full((2,), 2.0)})
    assert summed["a"] == gtx.MaskedNode() and summed["b"].tolist() == [3.0, 3.0]


# --------------------------------------------------------------------------- type names


def test_protocol_and_type_names_come_from_base():
    assert gtx.TransformInitFn is base.TransformInitFn
    assert gtx.TransformUpdateFn is base.TransformUpdateFn
    assert gtx.TransformUpdateExtraArgsFn is base.TransformUpdateExtraArgsFn
    assert gtx.MaskOrFn is base.MaskOrFn
    update = inspect.signature(gtx.TransformUpdateFn.__call__).parameters
    assert list(update) == ["self", "updates", "state", "params", "inplace"]
    assert "extra_args" in inspect.signature(gtx.TransformUpdateExtraArgsFn.__call__).parameters


def test_should_skip_update_function_matches_the_skip_functions():
    expected = ["updates", "gradient_step", "params"]
    assert list(inspect.signature(gtx.ShouldSkipUpdateFunction.__call__).parameters)[1:] == expected
    for fn in (gtx.skip_not_finite, gtx.skip_large_updates):
        assert list(inspect.signature(fn).parameters)[:3] == expected
    grads = {"w": torch.tensor([1.0, float("nan")])}
    skip, info = gtx.skip_not_finite(grads, torch.tensor(0, dtype=torch.int32), None)
    assert bool(skip) and int(info["num_not_finite"]) == 1


# --------------------------------------------------------------------------- WrappedSchedule


def test_wrapped_schedule_counts_and_evaluates():
    schedule = gtx.WrappedSchedule(lambda count: 10.0 - count)
    state = schedule.init()
    assert state.count.dtype == torch.int32 and state.count.shape == () and int(state.count) == 0
    values = []
    for _ in range(3):
        values.append(float(schedule(state, value=1.0)))
        state = schedule.update(state, value=1.0)  # extra arguments are ignored
    assert values == [10.0, 9.0, 8.0] and int(state.count) == 3


def test_wrapped_schedule_saturates_and_rejects_non_callables():
    schedule = gtx.WrappedSchedule(gtx.constant_schedule(1.0))
    top = torch.tensor(torch.iinfo(torch.int32).max, dtype=torch.int32)
    assert int(schedule.update(gtx.schedules.WrappedScheduleState(top)).count) == torch.iinfo(torch.int32).max
    with pytest.raises(TypeError, match="schedule_fn must be callable"):
        gtx.WrappedSchedule(0.1)


# --------------------------------------------------------------------------- moment helpers


def test_top_level_moment_helpers_are_the_tree_utils_functions():
    assert gtx.update_moment is tree_utils.tree_update_moment
    assert gtx.update_moment_per_elem_norm is tree_utils.tree_update_moment_per_elem_norm
    assert gtx.update_infinity_moment is tree_utils.tree_update_infinity_moment
    assert gtx.bias_correction is tree_utils.tree_bias_correction


def test_moment_helpers_against_the_formulas():
    g = {"a": torch.tensor([1.0, -2.0, 0.5], dtype=F64), "c": torch.tensor([1 + 2j, -3j], dtype=torch.complex128)}
    m = {"a": torch.tensor([0.1, 0.2, -0.3], dtype=F64), "c": torch.tensor([0.5, 0.25], dtype=F64)}
    decay = 0.9
    out = gtx.update_moment({"a": g["a"]}, {"a": m["a"]}, decay, 2)
    expected = [(1 - decay) * x * x + decay * y for x, y in zip([1.0, -2.0, 0.5], [0.1, 0.2, -0.3])]
    torch.testing.assert_close(out["a"], torch.tensor(expected, dtype=F64), rtol=1e-15, atol=0)
    out = gtx.update_moment_per_elem_norm(g, m, decay, 2)
    moduli_sq = [5.0, 9.0]
    expected_c = [(1 - decay) * s + decay * y for s, y in zip(moduli_sq, [0.5, 0.25])]
    torch.testing.assert_close(out["c"], torch.tensor(expected_c, dtype=F64), rtol=1e-14, atol=0)
    out = gtx.update_infinity_moment({"a": g["a"]}, {"a": m["a"]}, decay, 1e-3)
    expected = [max(abs(x) + 1e-3, decay * y) for x, y in zip([1.0, -2.0, 0.5], [0.1, 0.2, -0.3])]
    torch.testing.assert_close(out["a"], torch.tensor(expected, dtype=F64), rtol=1e-15, atol=0)
    corrected = gtx.bias_correction({"a": m["a"]}, 0.9, torch.tensor(3, dtype=torch.int32))
    torch.testing.assert_close(corrected["a"], m["a"] / (1 - 0.9**3), rtol=1e-15, atol=0)


# --------------------------------------------------------------------------- tree_map_params


def test_tree_map_params_at_top_level_maps_the_params_shaped_parts():
    assert gtx.tree_map_params is tree_utils.tree_map_params
    tx = gtx.chain(gtx.add_decayed_weights(0.1), gtx.sgd(0.1, momentum=0.9), gtx.scale_by_adam())
    p = params()
    state = tx.init(p)
    _, state = tx.update(p, state, p)
    doubled = gtx.tree_map_params(tx, lambda x: 2 * x, state)
    torch.testing.assert_close(doubled[1][0].trace["w"], 2 * state[1][0].trace["w"])
    torch.testing.assert_close(doubled[2].mu["b"], 2 * state[2].mu["b"])
    torch.testing.assert_close(doubled[2].nu["w"], 2 * state[2].nu["w"])
    assert doubled[2].count is state[2].count  # not params-shaped: kept
    counts = gtx.tree_map_params(tx, lambda x: x, state, transform_non_params=lambda c: c + 100)
    assert int(counts[2].count) == int(state[2].count) + 100
    shapes = gtx.tree_map_params(tx, lambda x, name: (name, tuple(x.shape)), state, {"w": "W", "b": "B"})
    assert shapes[2].mu == {"w": ("W", (2, 2)), "b": ("B", (2,))}


def test_tree_map_params_is_leaf_stops_early():
    tx = gtx.scale_by_adam()
    nested = {"layer": {"w": torch.ones(2), "b": torch.zeros(1)}}
    state = tx.init(nested)
    seen = []
    gtx.tree_map_params(
        tx, lambda node: seen.append(sorted(node)) or node, state, is_leaf=lambda n: isinstance(n, dict) and "w" in n
    )
    assert seen == [["b", "w"], ["b", "w"]]  # once for mu, once for nu, each the whole inner dict
