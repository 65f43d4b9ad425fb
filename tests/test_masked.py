"""masked, freeze, partition / multi_transform, selective_transform."""

import pytest
import torch
from combinator_helpers import Recorder, assert_same, clone, make_tree, run_both_paths, running_sum, scale_by

import gradtx as gtx


def _grads(step: int) -> dict:
    return make_tree(seed=100 + step)


def _matrices(tree):
    return gtx.tree.tree_map(lambda x: x.ndim > 1, tree)


# --------------------------------------------------------------------------- masked


def test_masked_applies_inner_to_selected_leaves_only():
    params = make_tree()
    grads = _grads(0)
    tx = gtx.masked(gtx.clip_by_value(0.1), {"layer": {"w": True, "b": False}, "head": False, "frozen": True})
    updates, _ = tx.update(grads, tx.init(params), params)
    torch.testing.assert_close(updates["layer"]["w"], grads["layer"]["w"].clamp(-0.1, 0.1))
    assert updates["layer"]["b"] is grads["layer"]["b"]  # passed through untouched
    assert updates["head"] is grads["head"]
    assert updates["frozen"] is None


@pytest.mark.parametrize(
    "mask",
    [
        {"layer": True, "head": False, "frozen": False},  # a prefix: one bool covers a subtree
        lambda tree: {"layer": True, "head": False, "frozen": False},  # a callable
    ],
    ids=["prefix", "callable"],
)
def test_masked_state_covers_selected_leaves_only(mask):
    params = make_tree()
    tx = gtx.masked(running_sum(), mask)
    state = tx.init(params)
    assert isinstance(state, gtx.MaskedState)
    assert state.inner_state.total["head"] is None and state.inner_state.total["frozen"] is None
    assert state.inner_state.total["layer"]["w"].shape == (3, 4)
    g0, g1 = _grads(0), _grads(1)
    u0, state = tx.update(g0, state, params)
    u1, state = tx.update(g1, state, params)
    torch.testing.assert_close(u1["layer"]["w"], g0["layer"]["w"] + g1["layer"]["w"])
    torch.testing.assert_close(u1["layer"]["b"], g0["layer"]["b"] + g1["layer"]["b"])
    assert u1["head"] is g1["head"]


def test_masked_inner_sees_none_at_masked_out_leaves_and_gets_inplace():
    recorder = Recorder()
    params = make_tree()
    calls = []

    def mask_fn(tree):
        calls.append(tree)
        return _matrices(tree)

    tx = gtx.masked(recorder.transformation(), mask_fn)
    tx.init(params)
    grads = _grads(0)
    tx.update(grads, tx.init(params), params, inplace=True)
    assert calls[0] is params and calls[-1] is grads  # mask(params) at init, mask(updates) at update
    _, init_params, _ = recorder.seen[0]
    assert init_params["layer"]["b"] is None and init_params["layer"]["w"] is params["layer"]["w"]
    seen_updates, seen_params, seen_inplace = recorder.seen[-1]
    assert seen_updates["layer"]["b"] is None and seen_updates["head"] is grads["head"]
    assert seen_params["layer"]["b"] is None and seen_params["head"] is params["head"]
    assert seen_inplace is True


def test_masked_with_a_single_bool_and_pure_vs_donated():
    params = make_tree()
    for mask in (True, False, _matrices):
        tx = gtx.chain(gtx.masked(running_sum(), mask), scale_by(0.5))
        run_both_paths(tx, params, [_grads(i) for i in range(3)])


def test_masked_mask_mismatch_names_the_leaf():
    tx = gtx.masked(running_sum(), {"layer": True, "head": False})
    with pytest.raises(ValueError, match="frozen"):
        tx.init(make_tree())
    with pytest.raises(TypeError, match="layer"):
        gtx.masked(running_sum(), {"layer": "yes", "head": False, "frozen": False}).init(make_tree())


# --------------------------------------------------------------------------- freeze


def test_freeze_zeroes_masked_leaves_and_passes_the_rest():
    params = make_tree()
    grads = _grads(0)
    tx = gtx.freeze({"layer": {"w": True, "b": False}, "head": False, "frozen": False})
    updates, _ = tx.update(grads, tx.init(params), params)
    torch.testing.assert_close(updates["layer"]["w"], torch.zeros(3, 4))
    assert updates["layer"]["b"] is grads["layer"]["b"] and updates["head"] is grads["head"]
    # frozen parameters keep their values
    new_params = gtx.apply_updates(params, updates)
    assert torch.equal(new_params["layer"]["w"], params["layer"]["w"])
    everything, _ = gtx.freeze(True).update(grads, gtx.freeze(True).init(params))
    assert all(float(x.abs().sum()) == 0 for x in gtx.tree.leaves(everything) if x is not None)
    run_both_paths(gtx.chain(gtx.freeze(_matrices), running_sum()), params, [_grads(i) for i in range(2)])


# --------------------------------------------------------------------------- partition


def test_partition_routes_each_label_to_its_transformation():
    params = make_tree()
    labels = {"layer": {"w": "sum", "b": "clip"}, "head": "sum", "frozen": "clip"}
    tx = gtx.partition({"sum": running_sum(), "clip": gtx.clip_by_value(0.05)}, labels)
    state = tx.init(params)
    assert isinstance(state, gtx.PartitionState)
    sum_state = state.inner_states["sum"].inner_state
    assert sum_state.total["layer"]["b"] is None and sum_state.total["head"] is not None
    g0, g1 = _grads(0), _grads(1)
    _, state = tx.update(g0, state, params)
    updates, state = tx.update(g1, state, params)
    torch.testing.assert_close(updates["layer"]["w"], g0["layer"]["w"] + g1["layer"]["w"])
    torch.testing.assert_close(updates["head"], g0["head"] + g1["head"])
    torch.testing.assert_close(updates["layer"]["b"], g1["layer"]["b"].clamp(-0.05, 0.05))
    assert updates["frozen"] is None


def test_partition_labels_callable_prefix_and_alias():
    assert gtx.multi_transform is gtx.partition
    params = make_tree()

    def label_fn(tree):
        return {"layer": "a", "head": "b", "frozen": "b"}

    tx = gtx.multi_transform({"a": scale_by(2.0), "b": scale_by(-1.0), "unused": running_sum()}, label_fn)
    state = tx.init(params)
    assert set(state.inner_states) == {"a", "b", "unused"}
    assert all(leaf is None for leaf in gtx.tree.leaves(state.inner_states["unused"].inner_state.total))
    grads = _grads(0)
    updates, _ = tx.update(grads, state, params)
    torch.testing.assert_close(updates["layer"]["w"], 2 * grads["layer"]["w"])
    torch.testing.assert_close(updates["head"], -grads["head"])
    run_both_paths(
        gtx.partition({"a": running_sum(), "b": gtx.clip_by_global_norm(0.1)}, label_fn),
        params,
        [_grads(i) for i in range(3)],
    )


def test_partition_label_without_transformation_is_named():
    tx = gtx.partition({"a": scale_by(1.0)}, {"layer": "a", "head": "mystery", "frozen": "a"})
    with pytest.raises(ValueError, match="'mystery'.*'head'"):
        tx.init(make_tree())


def test_selective_transform_keeps_no_state_for_frozen_leaves():
    params = make_tree()
    mask = {"layer": False, "head": True, "frozen": True}
    tx = gtx.selective_transform(running_sum(), freeze_mask=mask)
    state = tx.init(params)
    assert state.inner_states["train"].inner_state.total["head"] is None
    grads = _grads(0)
    updates, _ = tx.update(grads, state, params)
    torch.testing.assert_close(updates["head"], torch.zeros(2, 3))
    torch.testing.assert_close(updates["layer"]["w"], grads["layer"]["w"])


def test_masked_inside_partition_inside_chain_compose():
    """Nested combinators: the states nest and the donated path still agrees with the pure one."""
    params = make_tree()
    inner = gtx.partition(
        {"m": gtx.masked(running_sum(), {"layer": {"w": True, "b": False}, "head": False, "frozen": False}), "h": gtx.freeze(True)},
        {"layer": "m", "head": "h", "frozen": "h"},
    )
    outputs = run_both_paths(gtx.chain(gtx.clip_by_global_norm(1.0), inner), params, [_grads(i) for i in range(3)])
    updates, state = outputs[-1]
    assert updates["head"].abs().sum() == 0
    assert_same(clone(updates), updates)


def test_labels_and_masks_mapped_over_params_may_hold_none_at_none_leaves():
    params = make_tree()
    labels = gtx.tree.tree_map(lambda x: "matrix" if x.ndim > 1 else "vector", params)
    assert labels["frozen"] is None
    tx = gtx.partition({"matrix": scale_by(2.0), "vector": scale_by(3.0)}, labels)
    grads = _grads(0)
    updates, _ = tx.update(grads, tx.init(params), params)
    torch.testing.assert_close(updates["layer"]["b"], 3 * grads["layer"]["b"])
    torch.testing.assert_close(updates["head"], 2 * grads["head"])
    bad = dict(labels, head=None)
    with pytest.raises(ValueError, match="'head' has no label"):
        gtx.partition({"matrix": scale_by(2.0), "vector": scale_by(3.0)}, bad).init(params)


def test_partition_of_adamw_and_adam_matches_torch_param_groups():
    """Weight decay on matrices only: torch's AdamW with two parameter groups as the reference."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))
    reference = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))
    reference.load_state_dict(model.state_dict())
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    labels = {k: "decay" if v.ndim > 1 else "no_decay" for k, v in params.items()}
    tx = gtx.partition(
        {"decay": gtx.adamw(1e-2, weight_decay=0.1), "no_decay": gtx.adamw(1e-2, weight_decay=0.0)}, labels
    )
    state = tx.init(params)
    named = dict(reference.named_parameters())
    opt = torch.optim.AdamW(
        [
            {"params": [named[k] for k in labels if labels[k] == "decay"], "weight_decay": 0.1},
            {"params": [named[k] for k in labels if labels[k] == "no_decay"], "weight_decay": 0.0},
        ],
        lr=1e-2,
    )
    x, y = torch.randn(8, 4), torch.randn(8, 2)
    for _ in range(4):
        grads = torch.func.grad(
            lambda p: ((torch.func.functional_call(model, p, (x,)) - y) ** 2).mean()
        )(params)
        updates, state = tx.update(grads, state, params)
        params = gtx.apply_updates(params, updates)
        opt.zero_grad()
        ((reference(x) - y) ** 2).mean().backward()
        opt.step()
        for k, p in named.items():
            torch.testing.assert_close(params[k], p.detach(), rtol=1e-5, atol=1e-6)


def test_nested_combinator_state_saves_loads_and_resumes():
    import io

    params = make_tree()
    tx = gtx.chain(
        gtx.apply_if_finite(
            gtx.MultiSteps(
                gtx.inject_hyperparams(gtx.adamw)(learning_rate=gtx.cosine_decay_schedule(1e-2, 10)), 2
            ).gradient_transformation(),
            max_consecutive_errors=2,
        ),
        gtx.selective_transform(running_sum(), freeze_mask={"layer": False, "head": True, "frozen": True}),
        gtx.monitor({"norm": gtx.global_norm}),
    )
    run_both_paths(tx, params, [_grads(i) for i in range(3)])
    state = tx.init(params)
    for i in range(3):
        _, state = tx.update(_grads(i), state, params)
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    restored = torch.load(buffer, weights_only=False)
    assert_same(restored, state)
    for i in range(3, 6):
        expected, state = tx.update(_grads(i), state, params)
        resumed, restored = tx.update(_grads(i), restored, params)
        assert_same(resumed, expected)
