"""How a stored leaf is kept: the storage format, and a batch of (local) leaves to codes and scales and back.

:func:`encode_all` finds every leaf's block scales (the blocks pieces share combined across ranks,
one all-reduce per group) and codes; :func:`decode` reads one leaf back; :func:`rounding_keys`
says what stochastic (4-bit) rounding draws its random bits from.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple, Optional, Sequence, Union

import torch
from torch import Tensor

from gradtx.native import codebook as native_codebook
from gradtx.quantization import blocks
from gradtx.quantization.maps import Codec, codec
from gradtx.quantization.placement import WHOLE, Place, scales_of
from gradtx.sharding import dtensor as dtensor_lib
from gradtx.sharding.elements import contiguous_start, logical_indices
from gradtx.sharding.matrices import Piece
from gradtx.sharding.mesh import MeshAxes
from gradtx.transforms.low_precision import leaf_keys, quick_draws, stream_key

_FORMATS = (8, 4, torch.bfloat16, torch.float8_e4m3fn)
_DEFAULT_BLOCK_SIZE = {8: 256, 4: 128, torch.float8_e4m3fn: 256}


@dataclass(frozen=True)
class StorageFormat:
    """How a leaf is stored: ``storage`` (8, 4 or a dtype), ``block_size`` (0: no blocks), the
    ``codec`` (``None``: a plain cast to ``storage``), whether codes are ``packed`` two per byte,
    and whether the leaves read with the signed map are rounded ``stochastic`` ally (else to nearest)."""

    storage: Union[int, torch.dtype]
    block_size: int
    codec: Optional[Codec]
    packed: bool
    stochastic: bool = False


def storage_format(bits: Any, block_size: Any, *, owner: str = "quantize_state") -> StorageFormat:
    """The :class:`StorageFormat` of ``bits`` and ``block_size``, or a ``ValueError``/``TypeError`` saying what is wrong."""
    known = isinstance(bits, torch.dtype) or (isinstance(bits, int) and not isinstance(bits, bool))
    if not known or bits not in _FORMATS:
        raise ValueError(f"{owner}: bits must be 8, 4, torch.bfloat16 or torch.float8_e4m3fn, got {bits!r}")
    if bits == torch.bfloat16:
        if block_size is not None:
            raise ValueError(f"{owner}: bfloat16 storage is a plain cast, with no blocks; got block_size={block_size!r}")
        return StorageFormat(bits, 0, None, False)
    if block_size is None:
        block_size = _DEFAULT_BLOCK_SIZE[bits]
    if not isinstance(block_size, int) or isinstance(block_size, bool):
        raise TypeError(f"{owner}: block_size must be an int, got {type(block_size).__name__}")
    if block_size < 1:
        raise ValueError(f"{owner}: block_size must be at least 1, got {block_size}")
    return StorageFormat(bits, block_size, codec(bits), bits == 4, stochastic=bits == 4)


class Rounding(NamedTuple):
    """What one leaf's stochastic rounding draws from: its ``key`` (0-d int64, of the seed, step
    count, path and field) and its ``piece`` of the logical tensor (``None``: the whole of it)."""

    key: Tensor
    piece: Optional[Piece]


DRAW_SIZE = 1 << 14  # values a leaf's random bits are made and used for at a time (int64 temporaries)


def encode_all(
    leaves: Sequence[Tensor],
    fmt: StorageFormat,
    places: Sequence[Place],
    mesh: Optional[MeshAxes],
    signed: Sequence[bool],
    rounding: Optional[Sequence[Optional[Rounding]]] = None,
    timeout: Optional[float] = None,
) -> list[tuple[Tensor, Optional[Tensor]]]:
    """Each (local) leaf as stored, ``(codes, scales)`` (``scales`` ``None`` for a plain cast): its
    blocks as ``places`` say, the blocks pieces share combined across ranks (one all-reduce per group).
    ``signed``: per leaf, whether it is read with the codec's signed map (else the unsigned one, for
    a field declared non-negative); recorded in the sign bit of every scale. ``rounding``: per leaf,
    ``None`` (round to nearest) or what its stochastic rounding draws from (:func:`rounding_keys`).
    ``timeout``: the spec's bound on the wait for the shared blocks' all-reduce."""
    if fmt.codec is None:
        return [(leaf.to(fmt.storage), None) for leaf in leaves]  # type: ignore[arg-type]
    out = []
    rounding = rounding if rounding is not None else [None] * len(leaves)
    for leaf, place, scales, drawn in zip(leaves, places, scales_of(leaves, places, fmt.block_size, mesh, signed, timeout), rounding):
        geo = blocks.geometry(leaf.shape, fmt.block_size, place.column)
        if drawn is None:
            codes = blocks.quantize(leaf, scales, geo, fmt.codec)
        else:
            codes = _rounded_stochastically(leaf, scales, geo, fmt.codec, drawn)  # type: ignore[arg-type]
        if fmt.packed:
            codes = blocks.pack_nibbles(codes, place.column)
        out.append((codes, scales.reshape(*leaf.shape[:-1], geo.blocks)))
    return out


def _rounded_stochastically(leaf: Tensor, scales: Tensor, geo: blocks.Geometry, codec: Codec, rounding: Rounding) -> Tensor:
    """The stochastically rounded codes of ``leaf``, a range of rows of about :data:`DRAW_SIZE` values
    at a time, so that the draws and their int64 temporaries exist for those rows only (each value's
    draw is its logical index's, whichever rows it is made with: the same codes). A traced step takes
    the leaf whole: the compiler makes the draws inside its loop, and a loop of ranges would be
    unrolled into the graph (128 ranges for an 8192 x 256 leaf), each copied into place."""
    rows = leaf.reshape(blocks.row_count(leaf.shape), geo.columns)
    scale_rows = scales.reshape(rows.shape[0], geo.blocks)
    start = contiguous_start(rounding.piece)
    if start is not None or rounding.piece is None:  # the draws and the rounding in one pass, in C, with the same numbers
        native = native_codebook.stochastic_codes(rows, scale_rows, geo, codec, rounding.key, None, start)
    else:
        native = native_codebook.stochastic_codes(rows, scale_rows, geo, codec, rounding.key, _indices(rounding, leaf, rows), 0)
    if native is not None:
        return native.reshape(leaf.shape)
    index = None if rounding.piece is None else _indices(rounding, leaf, rows)

    def codes(r0: int, r1: int) -> Tensor:
        if index is None:
            at = torch.arange(r0 * geo.columns, r1 * geo.columns, dtype=torch.int64, device=leaf.device).view(r1 - r0, geo.columns)
        else:
            at = index[r0:r1]
        return blocks.quantize(rows[r0:r1], scale_rows[r0:r1], geo, codec, quick_draws(rounding.key, at))

    if torch.compiler.is_compiling():
        return codes(0, rows.shape[0]).reshape(leaf.shape)
    out = torch.empty(rows.shape, dtype=codec.code_dtype, device=leaf.device)
    step = max(DRAW_SIZE // max(geo.columns, 1), 1)
    for r0 in range(0, rows.shape[0], step):
        r1 = min(r0 + step, rows.shape[0])
        out[r0:r1] = codes(r0, r1)
    return out.reshape(leaf.shape)


def _indices(rounding: Rounding, leaf: Tensor, rows: Tensor) -> Tensor:
    """The logical index of every element of ``leaf``'s piece, shaped as its ``rows``."""
    return logical_indices(rounding.piece, leaf.shape, leaf.device).reshape(rows.shape)


def rounding_keys(seed: int, count: Tensor, keys: Sequence[str], pieces: Sequence[Optional[Piece]]) -> list[Rounding]:
    """Per (local) leaf, what its stochastic rounding draws from: integers uniform in ``[0, 2**24)``,
    a hash of (``seed``, ``count``, the leaf's ``key``, each element's index in the logical tensor,
    found from its ``piece``, ``None`` for a whole leaf), so any layout draws the dense run's."""
    if not keys:
        return []
    stream = stream_key(torch.tensor(seed, dtype=torch.int64, device=count.device), count)
    return [Rounding(k, piece) for k, piece in zip(leaf_keys(stream, list(keys)), pieces)]


def decode(codes: Tensor, scales: Optional[Tensor], placeholder: Tensor, fmt: StorageFormat, place: Place = WHOLE) -> Tensor:
    """The stored leaf read back, with the shape, dtype, device (and DTensor layout) ``placeholder``
    records; ``place``: where its local piece lies among the logical tensor's blocks."""
    local = dtensor_lib.local(placeholder)
    shape = local.shape[:-1]
    if fmt.codec is None:
        values = codes.to(local.dtype)
    else:
        geo = blocks.geometry(shape, fmt.block_size, place.column)
        if fmt.packed:
            codes = blocks.unpack_nibbles(codes, geo.columns, place.column)
        codes = codes.reshape(shape)
        values = blocks.dequantize(codes, scales.reshape(blocks.row_count(shape), geo.blocks), geo, fmt.codec, local.dtype)  # type: ignore[union-attr]
    return dtensor_lib.without_empty_dim(values, placeholder)
