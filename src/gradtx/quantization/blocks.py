"""Block-wise quantization on the logical tensor: block geometry, scales, codes, 4-bit packing.

A block is a run of ``block_size`` elements along the last dim of the *logical* tensor, within
one row (a 1-D tensor has one row; a 0-d one is a row of one). Each function here works on a
local piece of that tensor, ``(..., columns)``, whose first column is logical column ``offset``:
the whole tensor is the piece at offset 0, a piece split along a leading dim holds whole blocks,
and a piece split along the last dim starts and ends inside blocks it shares with its neighbours
(their absmax is then the maximum over the pieces). A flat piece of the flattened tensor is cut
into such pieces by :func:`flat_segments`. Everything is vectorized over a ``(rows, blocks,
block_size)`` zero-padded view: no loop over blocks or elements.

A block's *scale* is its absolute maximum (float32), negated (sign bit set) when the block is read
with the codec's signed map, else read with its unsigned map. :func:`gradtx.quantize_state`
chooses the map per state field (see :mod:`gradtx.state_signs`); :func:`block_signed` gives the
per-block choice from the block's own values, for callers that know nothing of fields.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Optional

import torch
from torch import Tensor

from gradtx.native import codebook as native_codebook
from gradtx.quantization import kernels
from gradtx.quantization.maps import Codec


@dataclass(frozen=True)
class Geometry:
    """Where the columns of a local piece fall among the blocks of its logical rows.

    ``columns``: the piece's last-dim length; ``offset``: the logical column of its first column;
    ``block_size``: the block length. The piece covers logical blocks ``first_block ..
    first_block + blocks - 1`` of each row; in the padded view it starts ``lead`` elements into its
    first block and leaves ``trail`` elements of its last block out.
    """

    columns: int
    offset: int
    block_size: int

    @property
    def lead(self) -> int:
        return self.offset % self.block_size if self.columns else 0  # an empty piece touches no block

    @property
    def first_block(self) -> int:
        return self.offset // self.block_size

    @property
    def blocks(self) -> int:
        return -(-(self.lead + self.columns) // self.block_size)

    @property
    def trail(self) -> int:
        return self.blocks * self.block_size - self.lead - self.columns


def geometry(shape: torch.Size | tuple[int, ...], block_size: int, offset: int = 0) -> Geometry:
    """The :class:`Geometry` of a local piece of shape ``shape`` starting at logical column ``offset``."""
    if block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    if offset < 0:
        raise ValueError(f"offset must be >= 0, got {offset!r}")
    return Geometry(shape[-1] if len(shape) else 1, offset, block_size)


def row_count(shape: torch.Size | tuple[int, ...]) -> int:
    """How many rows (runs along the last dim) a tensor of ``shape`` has: 1 for a 0-d or 1-D one."""
    return math.prod(shape[:-1])


def blocked(x: Tensor, geo: Geometry) -> Tensor:
    """``x`` (``(..., columns)``) as ``(rows, blocks, block_size)``, zero-padded at both edges."""
    rows = x.reshape(row_count(x.shape), geo.columns)
    if geo.lead or geo.trail:
        rows = torch.nn.functional.pad(rows, (geo.lead, geo.trail))
    return rows.reshape(rows.shape[0], geo.blocks, geo.block_size)


def unblocked(y: Tensor, geo: Geometry, shape: torch.Size | tuple[int, ...]) -> Tensor:
    """The inverse of :func:`blocked`: the padding dropped, ``shape`` restored."""
    rows = y.reshape(y.shape[0], geo.blocks * geo.block_size)
    if geo.lead or geo.trail:
        rows = rows[:, geo.lead : geo.lead + geo.columns]
    return rows.reshape(shape)


def block_absmax(x: Tensor, geo: Geometry) -> Tensor:
    """Each block's absolute maximum over this piece, float32 ``(rows, blocks)`` (NaN if it holds one)."""
    native = native_codebook.absmax(x, geo)
    if native is not None:
        return native
    y = blocked(x, geo)
    return kernels.run(kernels.absmax, y.reshape(-1, geo.block_size)).view(y.shape[:-1])


def block_signed(x: Tensor, geo: Geometry) -> Tensor:
    """Whether each block holds a value with its sign bit set (``-0.0`` included), bool ``(rows, blocks)``."""
    return torch.signbit(blocked(x, geo)).any(dim=-1)


def block_scales(absmax: Tensor, signed: Tensor) -> Tensor:
    """The stored scales: ``absmax``, with the sign bit set where the block is ``signed``."""
    return torch.where(signed, -absmax, absmax)


def quantize(x: Tensor, scales: Tensor, geo: Geometry, codec: Codec, draws: Optional[Tensor] = None) -> Tensor:
    """The codes of ``x`` (a piece laid out as ``geo`` says) under the blocks' ``scales``: each value
    divided by its block's absmax, then encoded by ``codec`` (the nearest map value; with ``draws``,
    integers uniform in ``[0, 2**24)`` shaped as ``x``, one of the two around it, unbiased). Same shape as ``x``."""
    if draws is None:
        native = native_codebook.codes(x, scales, geo, codec)
        if native is not None:
            return native
    if _padded_while_tracing(geo):
        parts = [x.to(torch.float32)] + ([] if draws is None else [draws])
        return _by_whole_blocks(lambda s, y, *d: codec.codes(y, s, *d), parts, scales, geo, x.shape)
    blocked_draws = None if draws is None else blocked(draws, geo)
    return unblocked(codec.codes(blocked(x.to(torch.float32), geo), scales, blocked_draws), geo, x.shape)


def dequantize(codes: Tensor, scales: Tensor, geo: Geometry, codec: Codec, dtype: torch.dtype) -> Tensor:
    """The values ``codes`` stand for under the blocks' ``scales``, in ``dtype``, shaped as ``codes``."""
    native = native_codebook.values(codes, scales, geo, codec)
    if native is not None:
        return native.to(dtype)
    if _padded_while_tracing(geo):
        return _by_whole_blocks(lambda s, c: codec.values(c, s), [codes], scales, geo, codes.shape).to(dtype)
    return unblocked(codec.values(blocked(codes, geo), scales), geo, codes.shape).to(dtype)


def _padded_while_tracing(geo: Geometry) -> bool:
    """Whether a traced step would pad this piece into whole blocks for an elementwise op. Inductor
    (torch 2.13 and 2.14, CPU) compiles a pointwise op over such a padded view, sliced back and fed
    to another op, into a loop over whole blocks only: the values of a last partial block are never
    written. Traced, such a piece takes :func:`_by_whole_blocks` instead (the same numbers)."""
    return bool(geo.lead or geo.trail) and torch.compiler.is_compiling()


def _by_whole_blocks(op: Callable[..., Tensor], parts: list[Tensor], scales: Tensor, geo: Geometry, shape: Any) -> Tensor:
    """``op(block scales, *blocked parts)`` (each part ``(..., columns)``) without padding: the
    columns of a partial first block, the whole blocks, and those of a partial last block each as
    blocks of their own length, the results laid side by side again, ``shape`` restored."""
    rows = row_count(shape)
    flat = [p.reshape(rows, geo.columns) for p in parts]
    block_scales = scales.reshape(rows, geo.blocks)
    first = min(geo.columns, geo.block_size - geo.lead) if geo.lead else 0
    whole = (geo.columns - first) // geo.block_size
    stop = first + whole * geo.block_size
    pieces = []  # (first column, columns, block lengths, first block, blocks)
    if first:
        pieces.append((0, first, first, 0, 1))
    if whole:
        pieces.append((first, stop - first, geo.block_size, 1 if first else 0, whole))
    if stop < geo.columns:
        pieces.append((stop, geo.columns - stop, geo.columns - stop, geo.blocks - 1, 1))
    out = []
    for start, columns, length, block, count in pieces:
        blocked_parts = [f[:, start : start + columns].reshape(rows, count, length) for f in flat]
        out.append(op(block_scales[:, block : block + count], *blocked_parts).reshape(rows, columns))
    return torch.cat(out, dim=1).reshape(shape)


def pack_nibbles(codes: Tensor, offset: int = 0) -> Tensor:
    """4-bit ``codes`` (``uint8`` below 16, ``(..., columns)``) two per byte along the last dim.

    Logical columns ``2j`` and ``2j + 1`` share byte ``j`` (low and high nibble), so a piece at an
    odd ``offset`` starts with a high nibble and a piece of odd extent ends with a low one; the
    missing halves are zero. Result: ``(..., ceil((offset % 2 + columns) / 2))`` ``uint8``.
    """
    native = native_codebook.pack_nibbles(codes, offset)
    if native is not None:
        return native
    columns = codes.shape[-1] if codes.ndim else 1
    lead = offset % 2 if columns else 0
    rows = codes.reshape(row_count(codes.shape), columns)
    trail = (lead + columns) % 2
    if lead or trail:
        rows = torch.nn.functional.pad(rows, (lead, trail))
    pairs = rows.reshape(rows.shape[0], rows.shape[1] // 2, 2)
    packed = pairs[..., 0] | (pairs[..., 1] << 4)
    return packed.reshape(*codes.shape[:-1], packed.shape[-1])


def unpack_nibbles(packed: Tensor, columns: int, offset: int = 0) -> Tensor:
    """The inverse of :func:`pack_nibbles`: ``(..., columns)`` ``uint8`` codes."""
    native = native_codebook.unpack_nibbles(packed, columns, offset)
    if native is not None:
        return native
    lead = offset % 2
    rows = packed.reshape(row_count(packed.shape), packed.shape[-1] if packed.ndim else 1)
    both = torch.stack((rows & 0x0F, rows >> 4), dim=-1).reshape(rows.shape[0], 2 * rows.shape[1])
    return both[:, lead : lead + columns].reshape(*packed.shape[:-1], columns)


class Segment(NamedTuple):
    """A run of a flat piece that is a block of whole local rows: elements ``begin .. end`` of the
    piece, ``(rows, end - begin) / rows`` once reshaped, its first column at logical ``offset``."""

    begin: int
    end: int
    rows: int
    offset: int


def flat_segments(start: int, stop: int, row_length: int) -> list[Segment]:
    """Elements ``start .. stop`` of a flattened logical tensor whose rows have ``row_length``
    elements, cut into at most three :class:`Segment` s (a partial first row, whole rows, a
    partial last row) each of which the functions above take as a piece at its offset."""
    if not 0 <= start <= stop or row_length < 1:
        raise ValueError(f"flat_segments: need 0 <= start <= stop and row_length >= 1, got {start}, {stop}, {row_length}")
    segments = []
    position = start
    head = start % row_length
    if head and position < stop:
        end = min(stop, start - head + row_length)
        segments.append(Segment(0, end - start, 1, head))
        position = end
    whole = (stop - position) // row_length
    if whole:
        end = position + whole * row_length
        segments.append(Segment(position - start, end - start, whole, 0))
        position = end
    if position < stop:
        segments.append(Segment(position - start, stop - start, 1, 0))
    return segments
