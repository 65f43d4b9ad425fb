"""Combinators that decide, step by step, whether an inner transformation applies: ``apply_every``,
``conditionally_transform`` and ``conditionally_mask``, with optax's names and states.

A decision that is a tensor stays on the device: the inner transformation always runs (on the pure
path, so a rejected step can keep its inputs) and ``torch.where`` selects its results or the
alternative, so there is no host synchronisation and a compiled step is one graph. A condition
function that returns a Python ``bool`` is branched on directly.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import torch
from torch import Tensor

from gradtx import tree as tree_lib
from gradtx.base import GradientTransformation, with_inplace
from gradtx.chains._select import counter, safe_increment, where_tree, zeros_like_tree
from gradtx.transforms import _foreach as fe

PyTree = Any


class ApplyEvery(NamedTuple):
    """``count``: steps since the last application, modulo ``k`` (0-d int32); ``grad_acc``: the sum of
    the updates since then, like the params."""

    count: Tensor
    grad_acc: Any


def apply_every(k: int = 1) -> GradientTransformation:
    """Accumulates updates and lets their sum through every ``k``-th step, zeros in between.

    As optax's: the sum restarts after each emission. The selection uses ``torch.where``, so a
    NaN in an emitted sum does not leak into the zeros of the next steps (optax multiplies by 0/1).
    """
    if int(k) != k or k < 1:
        raise ValueError(f"apply_every: k must be an int >= 1, got {k!r}")
    k = int(k)

    def init_fn(params: PyTree) -> ApplyEvery:
        return ApplyEvery(count=counter(params), grad_acc=fe.zeros_like_tree(params))

    def update_fn(updates, state, params=None, *, inplace=False):
        del params
        leaves = fe.leaves_of(updates, what="apply_every")
        accs = leaves.aligned(state.grad_acc, what="apply_every: state.grad_acc")
        phase = torch.remainder(state.count, k)
        keep, emit = phase != 0, phase == k - 1
        new_accs, outs = [], []
        for g, a in zip(leaves.tensors, accs):
            total = torch.where(keep.to(a.device), a + g.to(a.dtype), g.to(a.dtype))
            out = torch.where(emit.to(g.device), total.to(g.dtype), 0)
            if inplace:
                total, out = a.copy_(total), g.copy_(out)
            new_accs.append(total)
            outs.append(out)
        count = torch.remainder(safe_increment(state.count), k)
        if inplace:
            count = state.count.copy_(count)
        return leaves.rebuild(outs), ApplyEvery(count=count, grad_acc=leaves.rebuild(new_accs, like=state.grad_acc))

    return GradientTransformation(init_fn, update_fn)


class ConditionallyTransformState(NamedTuple):
    """``inner_state``: the inner transformation's state; ``step``: steps so far (0-d int32)."""

    inner_state: Any
    step: Tensor


class ConditionallyMaskState(NamedTuple):
    """``step``: steps so far (0-d int32); ``inner_state``: the inner transformation's state."""

    step: Tensor
    inner_state: Any


def _conditional(owner: str, inner: GradientTransformation, should_transform_fn: Callable, forward_extra_args: bool, reject):
    inner_update = with_inplace(inner)

    def run(updates, state_step, inner_state, params, inplace, extra_args):
        condition_kwargs = extra_args if forward_extra_args else {}
        decision = should_transform_fn(state_step, **condition_kwargs)
        if isinstance(decision, Tensor):
            new_updates, new_inner = inner_update(updates, inner_state, params, inplace=False, **extra_args)
            decision = decision.to(torch.bool).reshape(())
            out = where_tree(decision, new_updates, reject(updates), what=owner)
            return out, where_tree(decision, new_inner, inner_state, what=owner)
        if decision:
            return inner_update(updates, inner_state, params, inplace=inplace, **extra_args)
        kept = inner_state if inplace else tree_lib.tree_map(lambda t: t.clone() if isinstance(t, Tensor) else t, inner_state)
        return reject(updates, inplace=inplace), kept

    return run


def conditionally_transform(
    inner: GradientTransformation, should_transform_fn: Callable[..., Any], forward_extra_args: bool = False
) -> GradientTransformation:
    """Runs ``inner`` on the steps where ``should_transform_fn(step)`` holds, and lets the updates
    through unchanged (inner state kept) on the others. ``step`` counts every call from 0."""

    def keep(updates, *, inplace=False):
        del inplace
        return updates

    run = _conditional("conditionally_transform", inner, should_transform_fn, forward_extra_args, keep)

    def init_fn(params: PyTree) -> ConditionallyTransformState:
        return ConditionallyTransformState(inner_state=inner.init(params), step=counter(params))

    def update_fn(updates, state, params=None, *, inplace=False, **extra_args):
        out, inner_state = run(updates, state.step, state.inner_state, params, inplace, extra_args)
        return out, ConditionallyTransformState(inner_state, safe_increment(state.step))

    return GradientTransformation(init_fn, update_fn)


def conditionally_mask(
    inner: GradientTransformation, should_transform_fn: Callable[..., Any], forward_extra_args: bool = False
) -> GradientTransformation:
    """Runs ``inner`` on the steps where ``should_transform_fn(step)`` holds, and returns zero
    updates (inner state kept) on the others. ``step`` counts every call from 0."""

    def zeros(updates, *, inplace=False):
        return zeros_like_tree(updates, inplace=inplace)

    run = _conditional("conditionally_mask", inner, should_transform_fn, forward_extra_args, zeros)

    def init_fn(params: PyTree) -> ConditionallyMaskState:
        return ConditionallyMaskState(step=counter(params), inner_state=inner.init(params))

    def update_fn(updates, state, params=None, *, inplace=False, **extra_args):
        out, inner_state = run(updates, state.step, state.inner_state, params, inplace, extra_args)
        return out, ConditionallyMaskState(step=safe_increment(state.step), inner_state=inner_state)

    return GradientTransformation(init_fn, update_fn)


__all__ = [
    "ApplyEvery",
    "ConditionallyMaskState",
    "ConditionallyTransformState",
    "apply_every",
    "conditionally_mask",
    "conditionally_transform",
]
