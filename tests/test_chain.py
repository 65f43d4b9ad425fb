"""chain and named_chain: order, flattened state, user update functions, donation, errors."""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch

import gradtx as gtx
from gradtx import tree as tree_lib


class CountState(NamedTuple):
    count: torch.Tensor


def counting(tag: str, log: list):
    """A transformation that records when it runs and counts its calls in its state."""

    def init_fn(params):
        return CountState(count=torch.zeros((), dtype=torch.int64))

    def update_fn(updates, state, params=None, *, inplace=False):
        log.append((tag, inplace))
        return updates, CountState(count=state.count + 1)

    return gtx.GradientTransformation(init_fn, update_fn)


def affine(scale: float, shift: float):
    return gtx.stateless_with_tree_map(lambda g: g * scale + shift)


def test_chain_applies_in_order():
    grads = {"w": torch.ones(3)}
    scale_then_shift = gtx.chain(affine(2.0, 0.0), affine(1.0, 1.0))
    shift_then_scale = gtx.chain(affine(1.0, 1.0), affine(2.0, 0.0))
    assert torch.equal(scale_then_shift.update(grads, scale_then_shift.init(grads))[0]["w"], torch.full((3,), 3.0))
    assert torch.equal(shift_then_scale.update(grads, shift_then_scale.init(grads))[0]["w"], torch.full((3,), 4.0))


def test_chain_clips_before_the_next_transform_sees_the_updates():
    grads = {"w": torch.full((4,), 3.0)}
    tx = gtx.chain(gtx.clip_by_global_norm(1.0), gtx.clip_by_global_norm(10.0))
    updates, (first, second) = tx.update(grads, tx.init(grads))
    torch.testing.assert_close(first.norm, torch.tensor(6.0))
    torch.testing.assert_close(second.norm, torch.tensor(1.0), rtol=1e-5, atol=0)  # saw the clipped updates
    torch.testing.assert_close(updates["w"], torch.full((4,), 0.5), rtol=1e-5, atol=0)


def test_chain_state_is_a_tuple_and_nested_chains_are_flattened():
    log = []
    a, b, c = counting("a", log), counting("b", log), counting("c", log)
    params = {"w": torch.zeros(1)}
    nested = gtx.chain(a, gtx.chain(b, gtx.chain(c)))
    flat = gtx.chain(a, b, c)
    state = nested.init(params)
    assert isinstance(state, tuple) and len(state) == 3
    assert tree_lib.structure(state) == tree_lib.structure(flat.init(params))
    _, state = nested.update(params, state)
    assert [tag for tag, _ in log] == ["a", "b", "c"]
    assert [s.count.item() for s in state] == [1, 1, 1]
    assert gtx.chain().init(params) == ()


def test_chain_passes_inplace_and_params_through():
    log, seen_params = [], []

    def init_fn(params):
        return gtx.EmptyState()

    def update_fn(updates, state, params=None, *, inplace=False):
        seen_params.append(params)
        return updates, state

    tx = gtx.chain(counting("a", log), gtx.GradientTransformation(init_fn, update_fn))
    params = {"w": torch.zeros(1)}
    tx.update(params, tx.init(params), params, inplace=True)
    tx.update(params, tx.init(params))
    assert log == [("a", True), ("a", False)]
    assert seen_params == [params, None]


def test_chain_accepts_optax_style_update_functions_without_inplace():
    """A hand-written ``update(updates, state, params=None)`` works inside a chain, donated or not."""

    def init_fn(params):
        return gtx.EmptyState()

    def update_fn(updates, state, params=None):
        return tree_lib.tree_map(lambda g, p: g + p, updates, params), state

    user = gtx.GradientTransformation(init_fn, update_fn)
    tx = gtx.chain(gtx.clip_by_global_norm(1.0), user)
    grads, params = {"w": torch.full((4,), 3.0)}, {"w": torch.ones(4)}
    pure, _ = tx.update(grads, tx.init(params), params)
    donated, _ = tx.update({"w": grads["w"].clone()}, tx.init(params), params, inplace=True)
    torch.testing.assert_close(pure["w"], torch.full((4,), 1.5), rtol=1e-5, atol=0)
    assert torch.equal(pure["w"], donated["w"])
    named = gtx.named_chain(("user", user))
    assert torch.equal(named.update(grads, named.init(params), params, inplace=True)[0]["w"], torch.full((4,), 4.0))


def test_chain_state_length_mismatch_is_a_value_error():
    tx = gtx.chain(gtx.identity(), gtx.identity())
    with pytest.raises(ValueError, match=r"chain\(identity, identity\): state is a tuple of 1, where init makes a tuple of 2"):
        tx.update({"w": torch.ones(1)}, (gtx.EmptyState(),))


def test_chain_rejects_non_transformations():
    with pytest.raises(TypeError, match="expected GradientTransformation, got function"):
        gtx.chain(lambda g: g)


def test_chain_is_pure_and_donated_path_matches():
    grads = {"w": torch.randn(5, 3) * 4, "b": torch.randn(3), "frozen": None}
    tx = gtx.chain(gtx.clip_by_value(1.0), gtx.clip_by_global_norm(0.5))
    state = tx.init(grads)
    before = tree_lib.tree_map(torch.clone, (grads, state))
    pure, pure_state = tx.update(grads, state)
    for x, y in zip(tree_lib.leaves((grads, state)), tree_lib.leaves(before)):
        assert (x is None and y is None) or torch.equal(x, y)
    donated = tree_lib.tree_map(torch.clone, grads)
    pointers = {k: v.data_ptr() for k, v in donated.items() if v is not None}
    inplace, inplace_state = tx.update(donated, tree_lib.tree_map(torch.clone, state), inplace=True)
    for k, v in pure.items():
        assert (v is None and inplace[k] is None) or torch.equal(v, inplace[k])
    assert {k: v.data_ptr() for k, v in inplace.items() if v is not None} == pointers
    assert torch.equal(pure_state[1].norm, inplace_state[1].norm)


def test_named_chain_state_is_a_dict_keyed_by_name():
    log = []
    tx = gtx.named_chain(("clip", gtx.clip_by_global_norm(1.0)), ("count", counting("n", log)))
    grads = {"w": torch.full((4,), 3.0)}
    state = tx.init(grads)
    assert list(state) == ["clip", "count"]
    updates, state = tx.update(grads, state)
    torch.testing.assert_close(state["clip"].norm, torch.tensor(6.0))
    assert state["count"].count.item() == 1 and log == [("n", False)]
    torch.testing.assert_close(gtx.global_norm(updates), torch.tensor(1.0), rtol=1e-5, atol=0)


def test_named_chain_rejects_duplicate_names_and_non_transformations():
    with pytest.raises(ValueError, match="names must be unique"):
        gtx.named_chain(("a", gtx.identity()), ("a", gtx.identity()))
    with pytest.raises(TypeError, match="'b' is a int"):
        gtx.named_chain(("a", gtx.identity()), ("b", 3))
