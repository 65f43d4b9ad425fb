"""Where a stored leaf's local piece lies among the blocks of its logical tensor, and the block
scales of a batch of pieces, the same as the whole tensor's under any sharding.

A piece split along leading dims only holds whole blocks: its scales are its own. A piece split
along the last dim holds parts of the blocks that a cut between pieces falls inside (the group's
*shared* blocks, found from the layout alone, the same on every rank of the group): their absmax
is the maximum over the ranks holding parts, taken in one all-reduce per distinct
group for all leaves at once (none when no piece straddles a block). The absmax travels as its
float32 bit pattern, an integer (a non-negative float's patterns order as its values, and a NaN's
lies above infinity's): so a block holding a NaN on one rank is NaN on all, although gloo's MAX
drops NaN values.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from torch import Tensor

from gradtx.quantization import blocks
from gradtx.sharding.edges import RowCuts, max_grouped
from gradtx.sharding.mesh import MeshAxes


@dataclass(frozen=True)
class Place:
    """A stored leaf's local piece: ``column``, the logical column of its first column; ``shared``,
    the logical blocks (of every row) that pieces of its group share, combined over ``axes``."""

    column: int = 0
    axes: tuple[str, ...] = ()
    shared: tuple[int, ...] = ()


WHOLE = Place()


def place_of(cuts: Optional[RowCuts], block_size: int) -> Place:
    """The :class:`Place` of a piece whose group cuts its last dim as ``cuts`` says (``None``: whole)."""
    if cuts is None:
        return WHOLE
    return Place(cuts.column, cuts.axes, cuts.shared_blocks(block_size))


def scales_of(
    pieces: Sequence[Tensor],
    places: Sequence[Place],
    block_size: int,
    mesh: Optional[MeshAxes],
    signed: Sequence[bool],
    timeout: Optional[float] = None,
) -> list[Tensor]:
    """Every piece's block scales, ``(rows, blocks)`` float32 (see :mod:`gradtx.quantization.blocks`):
    its blocks' absmax, the shared blocks' combined over their groups (one all-reduce per group),
    negated where the piece's field is ``signed`` (the sign bit records the map; an all-zero
    signed block's scale is ``-0.0``). ``timeout``: the spec's bound on each wait."""
    maxima: list[Tensor] = []
    items: list[tuple[tuple[str, ...], Tensor]] = []
    held: list[tuple[int, list[int], Tensor]] = []  # (piece, positions among its shared blocks, local blocks)
    for index, (x, place) in enumerate(zip(pieces, places)):
        geo = blocks.geometry(x.shape, block_size, place.column)
        absmax = blocks.block_absmax(x, geo)
        maxima.append(absmax)
        if not place.shared:
            continue
        positions = [j for j, b in enumerate(place.shared) if geo.first_block <= b < geo.first_block + geo.blocks]
        local = torch.tensor([place.shared[j] - geo.first_block for j in positions], dtype=torch.int64, device=x.device)
        # the absmax as its float32 bit pattern (exact in float64): a NaN's pattern is above every
        # other, so a NaN block stays NaN through gloo's MAX, which drops NaN values
        buffer = torch.zeros(absmax.shape[0], len(place.shared), dtype=torch.float64, device=x.device)
        buffer[:, positions] = absmax[:, local].view(torch.int32).to(torch.float64)
        items.append((place.axes, buffer.reshape(-1)))
        held.append((index, positions, local))
    if items:
        shared = max_grouped(mesh, items, timeout=timeout, what="quantize_state's shared blocks")  # type: ignore[arg-type]
        for (index, positions, local), reduced in zip(held, shared):
            absmax = maxima[index]
            reduced = reduced.reshape(absmax.shape[0], -1)[:, positions]
            absmax[:, local] = reduced.to(torch.int64).to(torch.int32).view(torch.float32)
    return [-absmax if sign else absmax for absmax, sign in zip(maxima, signed)]
