"""Adafactor's factored second moments (Shazeer & Stern, 2018): ``scale_by_factored_rms``, as in optax.

A leaf whose two largest dimensions both have at least ``min_dim_size_to_factor`` entries keeps
only the means of ``g^2 + epsilon`` along each of them (``v_row``, ``v_col``) instead of the full
second moment; every other leaf keeps the full moment ``v``. The unused slots hold a ``(1,)`` zero,
as in optax, so the state has the same structure for every leaf.

The moments are computed on each leaf as it is: a leaf sharded along a factored dimension needs
its means reduced across ranks, which this transform does not do (pass whole leaves, or DTensors,
whose reductions torch carries out).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional

import torch
from torch import Tensor

from gradtx import tree as tree_lib
from gradtx.base import GradientTransformation
from gradtx.transforms import _foreach as fe


class FactoredState(NamedTuple):
    """``count``: steps so far (0-d int32); ``v_row``, ``v_col``: the factored moments (or ``(1,)``
    zeros); ``v``: the full moment of unfactored leaves (or a ``(1,)`` zero)."""

    count: Tensor
    v_row: Any
    v_col: Any
    v: Any


def _decay_rate_pow(i: Any, exponent: float = 0.8) -> Any:
    """Adafactor's ``1 - (i + 1) ** -exponent`` (0 at the first step), in float64 for a tensor ``i``."""
    t = i.to(torch.float64) + 1.0 if isinstance(i, Tensor) else float(i) + 1.0
    return 1.0 - t ** (-exponent)


def _factored_dims(shape: tuple[int, ...], factored: bool, min_dim_size_to_factor: int) -> Optional[tuple[int, int]]:
    """``(d1, d0)``: the second largest and the largest dimension, or ``None`` when not factored.
    Ties go to the earlier dimension first, as ``numpy.argsort`` orders them."""
    if not factored or len(shape) < 2:
        return None
    order = sorted(range(len(shape)), key=lambda d: shape[d])
    if shape[order[-2]] < min_dim_size_to_factor:
        return None
    return order[-2], order[-1]


def scale_by_factored_rms(
    factored: bool = True,
    decay_rate: float = 0.8,
    step_offset: int = 0,
    min_dim_size_to_factor: int = 128,
    epsilon: float = 1e-30,
    decay_rate_fn: Callable[[Any, Any], Any] = _decay_rate_pow,
) -> GradientTransformation:
    """Divides updates by the root of Adafactor's (factored) second moment.

    With ``b = decay_rate_fn(count - step_offset, decay_rate)`` and ``s = g^2 + epsilon``: a factored
    leaf keeps ``v_row = b v_row + (1 - b) mean(s, d0)`` and ``v_col = b v_col + (1 - b) mean(s, d1)``
    and is scaled by ``(v_row / mean(v_row))^-1/2`` along ``d1`` and ``v_col^-1/2`` along ``d0``;
    any other leaf keeps ``v = b v + (1 - b) s`` and is scaled by ``v^-1/2``.
    """
    owner = "scale_by_factored_rms"
    epsilon = float(epsilon)

    def init_fn(params: Any) -> FactoredState:
        rows, cols, full = [], [], []
        leaves, treedef = tree_lib.flatten(params)
        for p in leaves:
            if p is None:
                rows.append(None), cols.append(None), full.append(None)
                continue
            dims = _factored_dims(tuple(p.shape), factored, min_dim_size_to_factor)
            one = torch.zeros((1,), dtype=p.dtype, device=p.device)
            if dims is not None:
                d1, d0 = dims
                rows.append(torch.zeros_like(p).sum(dim=d0))
                cols.append(torch.zeros_like(p).sum(dim=d1))
                full.append(one)
            else:
                rows.append(one), cols.append(one.clone()), full.append(torch.zeros_like(p))
        unflatten = tree_lib.unflatten
        return FactoredState(
            count=fe.zero_count(params),
            v_row=unflatten(treedef, rows),
            v_col=unflatten(treedef, cols),
            v=unflatten(treedef, full),
        )

    def update_fn(updates, state, params=None, *, inplace=False):
        del params
        leaves = fe.leaves_of(updates, what=owner)
        v_rows = leaves.aligned(state.v_row, what=f"{owner}: state.v_row")
        v_cols = leaves.aligned(state.v_col, what=f"{owner}: state.v_col")
        v_fulls = leaves.aligned(state.v, what=f"{owner}: state.v")
        b = decay_rate_fn(state.count - step_offset, decay_rate)
        outs, new_rows, new_cols, new_fulls = [], [], [], []
        for g, v_row, v_col, v in zip(leaves.tensors, v_rows, v_cols, v_fulls):
            beta = b.to(device=g.device, dtype=v.dtype) if isinstance(b, Tensor) else b
            sq = g.to(v.dtype) * g.to(v.dtype) + epsilon
            dims = _factored_dims(tuple(g.shape), factored, min_dim_size_to_factor)
            if dims is not None:
                d1, d0 = dims
                row = beta * v_row + (1.0 - beta) * sq.mean(dim=d0)
                col = beta * v_col + (1.0 - beta) * sq.mean(dim=d1)
                reduced_d1 = d1 - 1 if d1 > d0 else d1
                row_factor = (row / row.mean(dim=reduced_d1, keepdim=True)) ** -0.5
                col_factor = col**-0.5
                out = g * row_factor.unsqueeze(d0).to(g.dtype) * col_factor.unsqueeze(d1).to(g.dtype)
                full = torch.zeros_like(v) if not inplace else v.zero_()
                if inplace:
                    row, col = v_row.copy_(row), v_col.copy_(col)
            else:
                full = beta * v + (1.0 - beta) * sq
                out = g * (full**-0.5).to(g.dtype)
                row, col = (v_row.zero_(), v_col.zero_()) if inplace else (torch.zeros_like(v_row), torch.zeros_like(v_col))
                if inplace:
                    full = v.copy_(full)
            outs.append(g.copy_(out) if inplace else out)
            new_rows.append(row)
            new_cols.append(col)
            new_fulls.append(full)
        return leaves.rebuild(outs), FactoredState(
            count=fe.increment(state.count, inplace=inplace),
            v_row=leaves.rebuild(new_rows, like=state.v_row),
            v_col=leaves.rebuild(new_cols, like=state.v_col),
            v=leaves.rebuild(new_fulls, like=state.v),
        )

    return GradientTransformation(init_fn, update_fn)
