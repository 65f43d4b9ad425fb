"""Small transformations and checks shared by the combinator tests."""

from __future__ import annotations

from typing import Any, NamedTuple

import optree
import torch

import gradtx as gtx


class SumState(NamedTuple):
    count: torch.Tensor
    total: Any


def running_sum() -> gtx.GradientTransformation:
    """A stateful test transformation: the update is the sum of every gradient seen so far.

    Supports the donated path (adds into its state and writes the result into the donated updates).
    """

    def init_fn(params):
        total = gtx.tree.tree_map(torch.zeros_like, params)
        return SumState(torch.zeros((), dtype=torch.int32), total)

    def update_fn(updates, state, params=None, *, inplace=False):
        del params
        if inplace:
            total = gtx.tree.tree_map(lambda t, g: t.add_(g), state.total, updates)
            out = gtx.tree.tree_map(lambda g, t: g.copy_(t), updates, total)
        else:
            total = gtx.tree.tree_map(lambda t, g: t + g, state.total, updates)
            out = gtx.tree.tree_map(torch.clone, total)
        return out, SumState(state.count + 1, total)

    return gtx.GradientTransformation(init_fn, update_fn)


def scale_by(factor: float) -> gtx.GradientTransformation:
    return gtx.stateless_with_tree_map(lambda g: g * factor)


class Recorder:
    """A stateless transformation that records what it was given."""

    def __init__(self):
        self.seen: list[tuple[Any, Any, bool]] = []

    def transformation(self) -> gtx.GradientTransformation:
        def init_fn(params):
            self.seen.append(("init", params, False))
            return gtx.EmptyState()

        def update_fn(updates, state, params=None, *, inplace=False):
            self.seen.append((updates, params, inplace))
            return updates, state

        return gtx.GradientTransformation(init_fn, update_fn)


def clone(tree: Any) -> Any:
    return optree.tree_map(
        lambda x: x.clone() if isinstance(x, torch.Tensor) else x, tree, none_is_leaf=True, namespace="gradtx"
    )


def assert_same(a: Any, b: Any) -> None:
    """Same structure, and bitwise-equal tensors (NaNs equal to NaNs)."""
    leaves_a, spec_a = optree.tree_flatten(a, none_is_leaf=True, namespace="gradtx")
    leaves_b, spec_b = optree.tree_flatten(b, none_is_leaf=True, namespace="gradtx")
    assert spec_a == spec_b, (spec_a, spec_b)
    for x, y in zip(leaves_a, leaves_b):
        if isinstance(x, torch.Tensor):
            assert isinstance(y, torch.Tensor) and x.dtype == y.dtype and x.shape == y.shape
            torch.testing.assert_close(x, y, rtol=0, atol=0, equal_nan=True)
        else:
            assert x == y or (x is None and y is None)


def run_both_paths(tx: gtx.GradientTransformation, params: Any, grads_sequence: list, *, with_params: bool = True):
    """Runs ``tx`` over the gradients on the pure and the donated path; checks they agree step by step.

    Also checks the pure path mutates nothing it is given. Returns the pure path's updates and states.
    """
    pure_state = tx.init(params)
    donated_state = tx.init(clone(params))
    outputs = []
    for grads in grads_sequence:
        grads_copy, state_copy, params_copy = clone(grads), clone(pure_state), clone(params)
        updates, new_state = tx.update(grads, pure_state, params if with_params else None)
        assert_same(grads, grads_copy)
        assert_same(pure_state, state_copy)
        assert_same(params, params_copy)
        donated_updates, donated_state = tx.update(
            clone(grads), donated_state, clone(params) if with_params else None, inplace=True
        )
        assert_same(updates, donated_updates)
        assert_same(new_state, donated_state)
        pure_state = new_state
        outputs.append((updates, new_state))
    return outputs


def make_tree(seed: int = 0, dtype=torch.float32) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {
        "layer": {"w": torch.randn(3, 4, generator=gen, dtype=dtype), "b": torch.randn(3, generator=gen, dtype=dtype)},
        "head": torch.randn(2, 3, generator=gen, dtype=dtype),
        "frozen": None,
    }
