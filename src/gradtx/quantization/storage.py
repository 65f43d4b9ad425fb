"""How a stored leaf is kept: the storage format, and a batch of (local) leaves to codes and scales and back.

:func:`encode_all` finds every leaf's block scales (the blocks pieces share combined across ranks,
one all-reduce per group) and codes; :func:`decode` reads one leaf back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence, Union

import torch
from torch import Tensor

from gradtx.quantization import blocks
from gradtx.quantization.maps import Codec, codec
from gradtx.quantization.placement import WHOLE, Place, scales_of
from gradtx.sharding import dtensor as dtensor_lib
from gradtx.sharding.mesh import MeshAxes

_FORMATS = (8, 4, torch.bfloat16, torch.float8_e4m3fn)
_DEFAULT_BLOCK_SIZE = {8: 256, 4: 128, torch.float8_e4m3fn: 256}


@dataclass(frozen=True)
class StorageFormat:
    """How a leaf is stored: ``storage`` (8, 4 or a dtype), ``block_size`` (0: no blocks), the
    ``codec`` (``None``: a plain cast to ``storage``), and whether codes are ``packed`` two per byte."""

    storage: Union[int, torch.dtype]
    block_size: int
    codec: Optional[Codec]
    packed: bool


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
    return StorageFormat(bits, block_size, codec(bits), bits == 4)


def encode_all(
    leaves: Sequence[Tensor],
    fmt: StorageFormat,
    places: Sequence[Place],
    mesh: Optional[MeshAxes],
    signed: Sequence[bool],
) -> list[tuple[Tensor, Optional[Tensor]]]:
    """Each (local) leaf as stored, ``(codes, scales)`` (``scales`` ``None`` for a plain cast): its
    blocks as ``places`` say, the blocks pieces share combined across ranks (one all-reduce per group).
    ``signed``: per leaf, whether it is read with the codec's signed map (else the unsigned one, for
    a field declared non-negative); recorded in the sign bit of every scale."""
    if fmt.codec is None:
        return [(leaf.to(fmt.storage), None) for leaf in leaves]  # type: ignore[arg-type]
    out = []
    for leaf, place, scales in zip(leaves, places, scales_of(leaves, places, fmt.block_size, mesh, signed)):
        geo = blocks.geometry(leaf.shape, fmt.block_size, place.column)
        codes = blocks.quantize(leaf, scales, geo, fmt.codec)
        if fmt.packed:
            codes = blocks.pack_nibbles(codes, place.column)
        out.append((codes, scales.reshape(*leaf.shape[:-1], geo.blocks)))
    return out


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
