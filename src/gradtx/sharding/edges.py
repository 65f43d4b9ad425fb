"""Where the pieces of a leaf's shard group cut its last dim, and maxima over the ranks that share a cut.

Statistics of runs of ``block`` elements along the last dim of a logical tensor (the absmax of
each block of quantized optimizer state) are local to a rank's piece, except in the blocks that a
cut between two pieces falls strictly inside: pieces split along leading dims only hold whole
blocks, pieces split along the last dim at a column that is no multiple of ``block`` (a TP
``Shard(1)`` at a misaligned offset, a flat ZeRO piece) share their edge blocks with their
neighbours. :func:`row_cuts` finds the cuts from :func:`~gradtx.sharding.elements.element_grid`
(any layout: DTensors, plain pieces even or uneven, flat ZeRO pieces even or uneven);
:func:`max_grouped` takes the maximum of such blocks' statistics over the axes that split the last
dim, one collective per distinct group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch.distributed as dist
from torch import Tensor

from gradtx.sharding.elements import element_grid
from gradtx.sharding.matrices import Piece
from gradtx.sharding.mesh import MeshAxes
from gradtx.sharding.spec import ShardingSpec


@dataclass(frozen=True)
class RowCuts:
    """This rank's ``piece`` of one leaf; the mesh ``axes`` (of size > 1) that split its last dim
    (ranks along them hold the same rows, other columns); and the ``cuts``: the columns strictly
    inside the last dim where a piece of the group begins or ends (ascending, the same on every
    rank of the group)."""

    piece: Piece
    axes: tuple[str, ...]
    cuts: tuple[int, ...]

    @property
    def column(self) -> int:
        """The logical column of the piece's first column (0 for a 0-d leaf)."""
        return self.piece.offset[-1] if self.piece.offset else 0

    def shared_blocks(self, block: int) -> tuple[int, ...]:
        """The blocks (runs of ``block`` columns of a row, numbered from 0) that a cut falls
        strictly inside: those whose statistics pieces of several ranks hold parts of. None
        without blocks (``block`` 0: bfloat16 storage, a plain cast)."""
        if block <= 0:
            return ()
        return tuple(sorted({c // block for c in self.cuts if c % block}))


def row_cuts(tree: Any, spec: Optional[ShardingSpec], *, what: str) -> tuple[Optional[MeshAxes], list[Optional[RowCuts]]]:
    """The mesh the ranks talk over (``None`` when nothing is sharded) and every leaf's
    :class:`RowCuts` (``None`` for ``None`` leaves), from :func:`~gradtx.sharding.elements.element_grid`
    (plain pieces' sizes exchanged once per plan; a 1-D plain leaf split with no ``dim`` is a flat
    piece). No communication once found."""
    grid = element_grid(tree, spec, what=what)
    out: list[Optional[RowCuts]] = []
    for piece, splits, bounds in zip(grid.pieces, grid.splits, grid.bounds):
        if piece is None or not piece.shape:
            out.append(None if piece is None else RowCuts(piece, (), ()))
            continue
        last = len(piece.shape) - 1
        axes = tuple(axis for axis, dim in splits if dim == last)  # type: ignore[union-attr]
        cuts = tuple(c for c in bounds[last] if 0 < c < piece.shape[last]) if axes else ()  # type: ignore[index]
        out.append(RowCuts(piece, axes, cuts))
    return grid.mesh, out


def max_grouped(
    mesh: MeshAxes, items: Sequence[tuple[tuple[str, ...], Tensor]], *, timeout: Optional[float] = None, what: str = "a maximum over pieces"
) -> list[Tensor]:
    """Each tensor of ``items`` replaced by its elementwise maximum over the ranks of its axes: one
    all-reduce per distinct group, in float64 (integers below ``2**53`` are exact; gloo's MAX
    drops a NaN, so pass NaN-free encodings, e.g. a float32's bit pattern as an integer). Each
    wait is bounded by ``timeout`` seconds (the spec's)."""
    from gradtx.sharding.reductions import reduce_grouped

    return reduce_grouped(mesh, items, dist.ReduceOp.MAX, timeout=timeout, what=what)
