"""Per tensor dim: the mesh axes that split it, and the logical shape of each leaf.

Matrix-aware transforms (Adafactor's factored moments) reduce along chosen tensor dims of the
*logical* leaf. They decide which dims on the logical shape, reduce this rank's partial sums over
the axes that split those dims (and only those), and keep the result as this rank's slice.

A DTensor knows its logical shape and which dim each mesh axis splits (uneven shards included). A
plain tensor under a :class:`ShardingSpec` is taken as split evenly, and every axis that splits a
leaf of two or more dims must name its tensor dim (``Shard("tp", dim=1)``); a one-dim leaf can
only be split along dim 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

import torch.distributed as dist
from torch import Tensor

from gradtx.sharding import dtensor as dtensor_lib
from gradtx.sharding.mesh import MeshAxes
from gradtx.sharding.plan import LeafLayout, plan_for
from gradtx.sharding.reductions import reduce_grouped
from gradtx.sharding.spec import ShardingSpec


@dataclass(frozen=True)
class DimLayout:
    """One leaf on this rank: its ``path``, its logical ``shape``, and per tensor dim the mesh axes
    (of size > 1) whose ranks hold disjoint pieces along that dim."""

    path: str
    shape: tuple[int, ...]
    dim_axes: tuple[tuple[str, ...], ...]

    def axes_of(self, *dims: int) -> tuple[str, ...]:
        """The axes splitting any of ``dims``: the group a sum along those dims reduces over."""
        return tuple(a for d in sorted(set(dims)) for a in self.dim_axes[d])


@dataclass(frozen=True)
class DimLayouts:
    """The layouts of a tree's leaves (``None`` for ``None`` leaves) and the mesh they reduce over."""

    mesh: MeshAxes
    layouts: list[Optional[DimLayout]]
    timeout: Optional[float] = None  # the spec's bound on a reduction's wait

    def sum_over(self, items: Sequence[tuple[tuple[str, ...], Tensor]]) -> list[Tensor]:
        """All-reduces (SUM) each tensor of ``items`` over the ranks of its axes: one collective per
        distinct axis set, in the same order on every rank; tensors with no axes come back as given."""
        return self._reduce(items, dist.ReduceOp.SUM)

    def max_over(self, items: Sequence[tuple[tuple[str, ...], Tensor]]) -> list[Tensor]:
        """As :meth:`sum_over`, the maximum (SM3's accumulators over a split dim)."""
        return self._reduce(items, dist.ReduceOp.MAX)

    def _reduce(self, items: Sequence[tuple[tuple[str, ...], Tensor]], op: Any) -> list[Tensor]:
        if not any(axes for axes, _ in items):
            return [t for _, t in items]
        flat = [(axes, t.reshape(-1)) for axes, t in items]
        reduced = reduce_grouped(self.mesh, flat, op, timeout=self.timeout, what="reductions over split dims")
        return [r.reshape(t.shape) for r, (_, t) in zip(reduced, items)]


def _leaf_dims(layout: LeafLayout, leaf: Tensor, mesh: MeshAxes) -> DimLayout:
    local = dtensor_lib.local(leaf)
    ndim = local.ndim
    per_dim: list[list[str]] = [[] for _ in range(ndim)]
    for axis, dim in zip(layout.axes, layout.dims):
        if mesh.sizes[axis] <= 1:
            continue
        if dim is None:
            if ndim != 1:
                raise ValueError(
                    f"leaf {layout.path!r} is sharded over axis {axis!r} along an unknown tensor dim, and a "
                    f"matrix-aware transform needs it: give Shard({axis!r}, dim=...) (0 for column-parallel, "
                    "1 for row-parallel)"
                )
            dim = 0
        if ndim == 0:
            raise ValueError(f"leaf {layout.path!r} is a 0-d tensor sharded over axis {axis!r}")
        per_dim[dim % ndim].append(axis)
    if leaf is not local:  # a DTensor knows its logical shape
        shape = tuple(leaf.shape)
    else:
        shape_list = list(local.shape)
        for d, axes in enumerate(per_dim):
            for axis in axes:
                shape_list[d] *= mesh.sizes[axis]
        shape = tuple(shape_list)
    return DimLayout(layout.path, shape, tuple(tuple(mesh.ordered(axes)) for axes in per_dim))


def dim_layouts(
    tree: Any, spec: Optional[ShardingSpec], *, what: str, check: bool = True, options: Optional[Mapping[str, Any]] = None
) -> DimLayouts:
    """The :class:`DimLayouts` of ``tree`` (plain tensors laid out by ``spec``, DTensors by their
    placements). With ``check``, ranks are checked to agree on the plan first (as every sharded
    reduction does, see :func:`gradtx.sharding.plan.plan_for`), and on the caller's ``options``
    that change which collectives run; without, nothing is communicated. Errors (an unknown split
    dim of a matrix, a bad spec) are ``ValueError`` naming the leaf."""
    from gradtx.sharding.matrices import declared

    found: list[tuple[list[Any], list[Optional[DimLayout]]]] = []

    def validate(plan: Any, tree_leaves: list[Any]) -> None:  # a bad split dim: an error on every rank
        found[:] = [(tree_leaves, [None if layout is None else _leaf_dims(layout, leaf, plan.mesh) for layout, leaf in zip(plan.layouts, tree_leaves)])]

    def whole_shapes() -> tuple[Any, ...]:
        # what the ranks must agree on besides the plan: each split matrix's logical shape (which
        # decides what is reduced over which dims), which plain pieces give only when every rank holds
        # an equal one; an uneven split would have ranks reduce other sums, or different collectives
        tree_leaves, dims_of = found[0]
        return tuple(
            (dims.path, tuple(a for axes in dims.dim_axes for a in axes), dims.shape, tuple(dtensor_lib.local(leaf).shape))
            for dims, leaf in zip(dims_of, tree_leaves)
            if dims is not None and len(dims.shape) >= 2 and any(dims.dim_axes)
        )

    plan, _ = plan_for(tree, spec, what=what, op=what + declared(options), check=check, validate=validate, pieces=whole_shapes)
    return DimLayouts(plan.mesh, found[0][1], plan.timeout)


def check_options(tree: Any, spec: Optional[ShardingSpec], *, what: str, options: Optional[Mapping[str, Any]]) -> None:
    """The cross-rank check :func:`dim_layouts` runs, for a caller that reduces nothing with these
    ``options`` (so that a rank reducing with other options is caught, not left waiting)."""
    from gradtx.sharding.matrices import declared

    plan_for(tree, spec, what=what, op=what + declared(options))
