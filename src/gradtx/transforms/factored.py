"""Adafactor's factored second moments (Shazeer & Stern, 2018): ``scale_by_factored_rms``, as in optax.

A leaf whose two largest dimensions both have at least ``min_dim_size_to_factor`` entries keeps
only the means of ``g^2 + epsilon`` along each of them (``v_row``, ``v_col``) instead of the full
second moment; every other leaf keeps the full moment ``v``. The unused slots hold a ``(1,)`` zero,
as in optax, so the state has the same structure for every leaf.

Sharded leaves (a ``spec``, or DTensor leaves) get the moments of the *logical* matrix: which dims
are factored is decided on the logical shape, this rank's partial row and column sums are reduced
over the mesh axes that split the summed dims only (batched, one collective per distinct axis set:
one in all when every matrix is split along one dim, as under TP or FSDP alone; three when a
matrix is split along both factored dims, as under TP x FSDP), and each rank keeps
its slice of ``v_row`` / ``v_col`` and returns its slice of the dense update. Unfactored leaves are
elementwise and never communicate. For DTensor leaves the factored moments are DTensors too, laid
out as the leaf with the averaged dim replicated.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional

import torch
from torch import Tensor

from gradtx import sharding
from gradtx import tree as tree_lib
from gradtx.base import GradientTransformation, takes_spec
from gradtx.sharding import dims as dims_lib
from gradtx.sharding import dtensor as dtensor_lib
from gradtx.state_dims import ParamLeaf, same, state_dims, whole
from gradtx.transforms import _foreach as fe


class FactoredState(NamedTuple):
    """``count``: steps so far (0-d int32); ``v_row``, ``v_col``: the factored moments (or ``(1,)``
    zeros); ``v``: the full moment of unfactored leaves (or a ``(1,)`` zero). Under sharding each
    rank holds its slices (DTensors for DTensor leaves)."""

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


def _unfactored(leaf: ParamLeaf) -> bool:
    """An unfactored leaf keeps its full moment in ``v`` (the param's shape); a factored one a ``(1,)`` zero."""
    return leaf.fields.get("v") == leaf.local_shape


def _averaged_along(which: int):
    """The checkpoint layout of ``v_row`` (``which=1``: averaged along ``d0``) or ``v_col`` (``0``:
    along ``d1``): the param's other dims, split as the param is; a ``(1,)`` placeholder is whole."""

    def rule(leaf: ParamLeaf):
        if _unfactored(leaf):
            return whole(leaf)
        dropped = _factored_dims(leaf.shape, True, 0)[which]  # type: ignore[index]
        return tuple(d for d in range(len(leaf.shape)) if d != dropped)

    return rule


state_dims(
    v_row=_averaged_along(1),
    v_col=_averaged_along(0),
    v=lambda leaf: same(leaf) if _unfactored(leaf) else whole(leaf),
)(FactoredState)


@takes_spec
def scale_by_factored_rms(
    factored: bool = True,
    decay_rate: float = 0.8,
    step_offset: int = 0,
    min_dim_size_to_factor: int = 128,
    epsilon: float = 1e-30,
    decay_rate_fn: Callable[[Any, Any], Any] = _decay_rate_pow,
    *,
    spec: Optional[sharding.ShardingSpec] = None,
) -> GradientTransformation:
    """Divides updates by the root of Adafactor's (factored) second moment.

    With ``b = decay_rate_fn(count - step_offset, decay_rate)`` and ``s = g^2 + epsilon``: a factored
    leaf keeps ``v_row = b v_row + (1 - b) mean(s, d0)`` and ``v_col = b v_col + (1 - b) mean(s, d1)``
    and is scaled by ``(v_row / mean(v_row))^-1/2`` along ``d1`` and ``v_col^-1/2`` along ``d0``;
    any other leaf keeps ``v = b v + (1 - b) s`` and is scaled by ``v^-1/2``.

    ``spec`` (a :class:`gradtx.sharding.ShardingSpec`; DTensor leaves need none) makes the means
    those of the logical matrices: each rank's update and state are its slices of the dense ones.
    A plain tensor split along a dim must say which (``Shard("tp", dim=1)``) and is taken as split
    evenly; DTensors may be split unevenly.
    """
    owner = "scale_by_factored_rms"
    epsilon = float(epsilon)
    if spec is not None and not isinstance(spec, sharding.ShardingSpec):
        raise TypeError(f"{owner}: spec must be a gradtx.sharding.ShardingSpec or None, got {type(spec).__name__}")

    # which leaves are factored, so which sums are reduced: checked to agree across ranks
    collective_options = {"factored": factored, "min_dim_size_to_factor": min_dim_size_to_factor}

    def layouts_of(tree: Any, tensors: list, *, check: bool) -> Optional[dims_lib.DimLayouts]:
        if not sharding.is_sharded(tensors, spec):
            return None
        if not factored:  # elementwise, nothing to reduce; checked all the same, so a rank that factors is caught
            if check:
                dims_lib.check_options(tree, spec, what=owner, options=collective_options)
            return None
        return dims_lib.dim_layouts(tree, spec, what=owner, check=check, options=collective_options)

    def init_fn(params: Any) -> FactoredState:
        rows, cols, full = [], [], []
        leaves, treedef = tree_lib.flatten(params)
        layouts = layouts_of(params, [p for p in leaves if p is not None], check=False)  # no collective
        for index, p in enumerate(leaves):
            if p is None:
                rows.append(None), cols.append(None), full.append(None)
                continue
            shape = layouts.layouts[index].shape if layouts is not None else tuple(p.shape)
            dims = _factored_dims(shape, factored, min_dim_size_to_factor)
            local = dtensor_lib.local(p)
            one = torch.zeros((1,), dtype=p.dtype, device=local.device)
            if dims is not None:
                d1, d0 = dims
                rows.append(dtensor_lib.reduced_like(p, torch.zeros_like(local).sum(dim=d0), d0))
                cols.append(dtensor_lib.reduced_like(p, torch.zeros_like(local).sum(dim=d1), d1))
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
        v_rows, wrap_rows = dtensor_lib.locals_of(leaves.aligned(state.v_row, what=f"{owner}: state.v_row"))
        v_cols, wrap_cols = dtensor_lib.locals_of(leaves.aligned(state.v_col, what=f"{owner}: state.v_col"))
        v_fulls, wrap_fulls = dtensor_lib.locals_of(leaves.aligned(state.v, what=f"{owner}: state.v"))
        grads, wrap_grads = dtensor_lib.locals_of(leaves.tensors)
        layouts = layouts_of(updates, leaves.tensors, check=True)
        b = decay_rate_fn(state.count - step_offset, decay_rate)

        # Per leaf: the squares, the factored dims (of the logical shape) and, for a matrix split
        # along a factored dim, its partial sums, all reduced together below.
        plans, items = [], []
        for index, g, v_row, v in zip(leaves.present, grads, v_rows, v_fulls):
            layout = layouts.layouts[index] if layouts is not None else None
            shape = layout.shape if layout is not None else tuple(leaves.all_leaves[index].shape)
            dims = _factored_dims(shape, factored, min_dim_size_to_factor)
            sq = fe.squares([g.to(v.dtype)])[0] + epsilon  # |g|^2 for a complex g
            split = dims is not None and layout is not None and bool(layout.axes_of(*dims))
            if split:
                d1, d0 = dims
                reduced_d1 = d1 - 1 if d1 > d0 else d1
                first = len(items)
                items += [
                    (layout.axes_of(d0), sq.sum(dim=d0)),
                    (layout.axes_of(d1), sq.sum(dim=d1)),
                    (layout.axes_of(d1), v_row.sum(dim=reduced_d1, keepdim=True)),
                    (layout.axes_of(d0, d1), sq.sum(dim=(d0, d1), keepdim=True).squeeze(d0)),
                ]
                plans.append((sq, dims, shape, first))
            else:
                plans.append((sq, dims, shape, None))
        reduced = layouts.sum_over(items) if items else []

        outs, new_rows, new_cols, new_fulls = [], [], [], []
        for g, v_row, v_col, v, (sq, dims, shape, first) in zip(grads, v_rows, v_cols, v_fulls, plans):
            beta = b.to(device=g.device, dtype=v.dtype) if isinstance(b, Tensor) else b
            if dims is not None:
                d1, d0 = dims
                reduced_d1 = d1 - 1 if d1 > d0 else d1
                if first is None:
                    row = beta * v_row + (1.0 - beta) * sq.mean(dim=d0)
                    col = beta * v_col + (1.0 - beta) * sq.mean(dim=d1)
                    row_mean = row.mean(dim=reduced_d1, keepdim=True)
                else:
                    row_sum, col_sum, row_state_sum, total = reduced[first : first + 4]
                    n0, n1 = shape[d0], shape[d1]
                    row = beta * v_row + (1.0 - beta) * (row_sum / n0)
                    col = beta * v_col + (1.0 - beta) * (col_sum / n1)
                    row_mean = (beta * row_state_sum + (1.0 - beta) * (total / n0)) / n1
                row_factor = (row / row_mean) ** -0.5
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
        return leaves.rebuild(wrap_grads(outs)), FactoredState(
            count=fe.increment(state.count, inplace=inplace),
            v_row=leaves.rebuild(wrap_rows(new_rows), like=state.v_row),
            v_col=leaves.rebuild(wrap_cols(new_cols), like=state.v_col),
            v=leaves.rebuild(wrap_fulls(new_fulls), like=state.v),
        )

    return GradientTransformation(init_fn, update_fn)
