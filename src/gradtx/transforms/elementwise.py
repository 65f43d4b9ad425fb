"""Leafwise edits of the updates: ``centralize``, ``zero_nans``, ``set_to_zero``."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from gradtx import tree as tree_lib
from gradtx.base import GradientTransformation, init_empty_state
from gradtx.transforms import _foreach as fe


def centralize() -> GradientTransformation:
    """Gradient centralization (Yong et al., 2020): subtracts from every leaf with 2+ dims its mean
    over all dims but the first, as optax does.

    In torch's output-first layout (``Linear``: ``(out, in)``) each output unit's weights are
    centred, as in the paper.
    """

    def update_fn(updates, state, params=None, *, inplace=False):
        del params
        leaves = fe.leaves_of(updates, what="centralize")
        out = []
        for g in leaves.tensors:
            if g.ndim > 1:
                mean = g.mean(dim=tuple(range(1, g.ndim)), keepdim=True)
                g = g.sub_(mean) if inplace else g - mean
            out.append(g)
        return leaves.rebuild(out), state

    return GradientTransformation(init_empty_state, update_fn)


class ZeroNansState(NamedTuple):
    """``found_nan``: per leaf, a 0-d bool tensor, true when the last update of that leaf had a NaN."""

    found_nan: Any


def zero_nans() -> GradientTransformation:
    """Replaces NaNs in the updates by zeros (infinities are kept) and records which leaves had any."""

    def init_fn(params: Any) -> ZeroNansState:
        return ZeroNansState(found_nan=tree_lib.tree_map(lambda p: torch.zeros((), dtype=torch.bool, device=p.device), params))

    def update_fn(updates, state, params=None, *, inplace=False):
        del params
        leaves = fe.leaves_of(updates, what="zero_nans")
        out, found = [], []
        for g in leaves.tensors:
            is_nan = torch.isnan(g)
            found.append(is_nan.any())
            out.append(g.masked_fill_(is_nan, 0.0) if inplace else g.masked_fill(is_nan, 0.0))
        return leaves.rebuild(out), ZeroNansState(found_nan=leaves.rebuild(found, like=state.found_nan))

    return GradientTransformation(init_fn, update_fn)


def set_to_zero() -> GradientTransformation:
    """Replaces every update by zeros (freezes the parameters it reaches)."""

    def update_fn(updates, state, params=None, *, inplace=False):
        del params
        leaves = fe.leaves_of(updates, what="set_to_zero")
        if inplace:
            (zeros,) = fe.map_groups(lambda g: (fe.zero(g),), leaves.tensors, outputs=1)
        else:
            zeros = [torch.zeros_like(g) for g in leaves.tensors]
        return leaves.rebuild(zeros), state

    return GradientTransformation(init_empty_state, update_fn)
