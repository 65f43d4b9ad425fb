"""The code books of :func:`gradtx.quantize_state` (block absmax, codes rounded to nearest or
stochastically, values read back, 4-bit codes packed two per byte) of float32 CPU tensors, each in
one pass over memory, with the ATen ops' numbers.

The ATen path (:mod:`gradtx.quantization.kernels`) runs a dozen elementwise ops per value, fused by
Inductor into one compiled loop for large leaves; ``codebook.c`` runs the same integer operations,
the same correctly rounded division and product, per value, without padding the piece into whole
blocks. Before its first use it runs beside the ATen ops on probe values (normal and extreme
magnitudes, zeros, infinities, NaNs, subnormals; both maps of the 8- and 4-bit code books; pieces
that start and end inside blocks; one long enough for the threads) and is kept only if every bit
agrees; else gradtx keeps to the ATen ops and :func:`status` says why.

Used only where it changes nothing but the speed: not while compiling or where a graph is
recorded, and only for plain contiguous CPU tensors (float32 values, ``uint8`` codes, float32 scales).
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any, NamedTuple, Optional

import torch
from torch import Tensor

from gradtx.native import checks

_INT64 = ctypes.c_int64
SHIFT = 15  # a cell: a float32's exponent and top 8 mantissa bits (relative width 2**-8)


class _Lookup(NamedTuple):
    """A code book's nearest-value tables for ``codebook.c``, one per map (signed half, unsigned):
    per cell from ``low`` to ``last`` (a float32 bit pattern shifted right by :data:`SHIFT`;
    ``last`` takes every pattern above 1.0's cell, NaN's too; ``low`` every pattern below its
    own, and holds no midpoint), an int32: how many of the map's midpoints lie below the cell's
    start, plus 256 times the low :data:`SHIFT` bits of the pattern of the one midpoint inside the
    cell, or of all ones where none is."""

    signed: Tensor
    unsigned: Tensor
    low: int
    last: int


def _lookup_of(book: Any) -> Optional[_Lookup]:
    """The tables of the ``TableCodec`` ``book``, or ``None`` where two of its midpoints share a cell
    (one comparison per value would then not do) or a map has over 256 values."""
    maps = (book._midpoints[: book._offset], book._midpoints[book._offset :])
    finite = [m[:-1] for m in maps]  # the last is +inf
    if any(len(m) > 255 or not len(m) for m in finite):
        return None
    low = min(int(m.min().view(torch.int32)) >> SHIFT for m in finite) - 1
    last = (0x3F800000 >> SHIFT) + 1  # past 1.0's cell: above every midpoint
    starts = (torch.arange(low, last + 1, dtype=torch.int32) << SHIFT).view(torch.float32)
    ends = torch.cat([starts[1:], torch.tensor([float("inf")])])
    within = (1 << SHIFT) - 1
    tables = []
    for m in finite:
        first = torch.bucketize(starts, m, right=False)  # the midpoints below each cell's start
        inside = torch.bucketize(ends, m, right=False) - first
        if int(inside.max()) > 1 or int(inside[0]) or int(inside[-1]):
            return None
        low_bits = m.view(torch.int32)[first.clamp(max=len(m) - 1)] & within
        tables.append((first + 256 * torch.where(inside > 0, low_bits, within)).to(torch.int32))
    return _Lookup(*tables, low, last)


_lookups: dict[int, tuple[Any, Optional[_Lookup]]] = {}
_lookups_lock = threading.Lock()


def lookup(book: Any) -> Optional[_Lookup]:
    """:func:`_lookup_of` ``book``, made once per code book."""
    found = _lookups.get(id(book))
    if found is None or found[0] is not book:
        with _lookups_lock:
            found = _lookups[id(book)] = (book, _lookup_of(book))
    return found[1]


class _Kernel:
    def __init__(self, lib: ctypes.CDLL):
        piece = [ctypes.c_void_p, _INT64, _INT64, _INT64, _INT64, _INT64]  # data, rows, columns, lead, block size, blocks
        self._absmax = lib.gradtx_absmax_f32
        self._absmax.argtypes = piece + [ctypes.c_void_p, ctypes.c_int]
        self._codes = lib.gradtx_table_codes_f32
        self._codes.argtypes = piece + [ctypes.c_void_p] * 3 + [ctypes.c_int32] * 4 + [ctypes.c_void_p, ctypes.c_int]
        self._stochastic = lib.gradtx_table_codes_stochastic_f32
        self._stochastic.argtypes = piece + [ctypes.c_void_p] * 3 + [ctypes.c_int32] * 4 + [ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32, ctypes.c_uint64, ctypes.c_void_p, _INT64, ctypes.c_void_p, ctypes.c_int]
        self._values = lib.gradtx_table_values_f32
        self._values.argtypes = piece + [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int32, ctypes.c_void_p, ctypes.c_int]
        self._pack = lib.gradtx_pack_nibbles
        self._pack.argtypes = [ctypes.c_void_p, _INT64, _INT64, _INT64, ctypes.c_void_p, _INT64]
        self._unpack = lib.gradtx_unpack_nibbles
        self._unpack.argtypes = [ctypes.c_void_p, _INT64, _INT64, _INT64, _INT64, ctypes.c_void_p]
        for fn in (self._absmax, self._codes, self._stochastic, self._values, self._pack, self._unpack):
            fn.restype = None
        self.calls = 0

    def absmax(self, x: Tensor, geo: Any, out: Tensor) -> None:
        self.calls += 1
        self._absmax(x.data_ptr(), *_piece(x, geo), out.data_ptr(), torch.get_num_threads())

    def codes(self, x: Tensor, scales: Tensor, geo: Any, codec: Any, tables: _Lookup, out: Tensor) -> None:
        self.calls += 1
        self._codes(
            x.data_ptr(), *_piece(x, geo), scales.data_ptr(), tables.signed.data_ptr(), tables.unsigned.data_ptr(),
            SHIFT, tables.low, tables.last, codec._zero,
            out.data_ptr(), torch.get_num_threads(),
        )

    def stochastic_codes(self, x: Tensor, scales: Tensor, geo: Any, codec: Any, tables: _Lookup, key: int,
                         index: Optional[Tensor], first_index: int, out: Tensor) -> None:
        self.calls += 1
        self._stochastic(
            x.data_ptr(), *_piece(x, geo), scales.data_ptr(), tables.signed.data_ptr(), tables.unsigned.data_ptr(),
            SHIFT, tables.low, tables.last, codec._zero, codec._magnitudes.data_ptr(), codec._offset, len(codec._magnitudes),
            key, index.data_ptr() if index is not None else None, first_index, out.data_ptr(), torch.get_num_threads(),
        )

    def pack(self, codes: Tensor, rows: int, columns: int, lead: int, out: Tensor) -> None:
        self.calls += 1
        self._pack(codes.data_ptr(), rows, columns, lead, out.data_ptr(), out.shape[-1] if out.ndim else 1)

    def unpack(self, packed: Tensor, rows: int, columns: int, lead: int, out: Tensor) -> None:
        self.calls += 1
        self._unpack(packed.data_ptr(), rows, packed.shape[-1] if packed.ndim else 1, columns, lead, out.data_ptr())

    def values(self, codes: Tensor, scales: Tensor, geo: Any, codec: Any, out: Tensor) -> None:
        self.calls += 1
        self._values(codes.data_ptr(), *_piece(codes, geo), scales.data_ptr(), codec._joint.data_ptr(), 2**codec.bits,
                     out.data_ptr(), torch.get_num_threads())


def _piece(x: Tensor, geo: Any) -> tuple[int, int, int, int, int]:
    """``rows, columns, lead, block_size, blocks`` of a piece laid out as ``geo`` says."""
    columns = geo.columns
    rows = x.numel() // columns if columns else 0
    return rows, columns, geo.lead, geo.block_size, geo.blocks


def status() -> str:
    """``"in use"``, or why the code books keep to the ATen ops."""
    return _kernel.status()


def usable() -> Optional[_Kernel]:
    """The checked kernel, or ``None``."""
    return _kernel.usable()


def _plain(x: Any, dtype: torch.dtype) -> bool:
    return type(x) is Tensor and x.dtype == dtype and x.device.type == "cpu" and x.is_contiguous()


def _kernel_for(*tensors: Any) -> Optional[_Kernel]:
    """The kernel, where it may run on these tensors (else ``None``: the ATen ops)."""
    if torch.compiler.is_compiling():
        return None
    if torch.is_grad_enabled() and any(isinstance(t, Tensor) and t.requires_grad for t in tensors):
        return None
    return checks.under_check(_Kernel) or usable()


def absmax(x: Tensor, geo: Any) -> Optional[Tensor]:
    """Each block's absolute maximum over the piece ``x``, float32 ``(rows, blocks)``, or ``None``."""
    kernel = _kernel_for(x)
    if kernel is None or not _plain(x, torch.float32):
        return None
    rows = _piece(x, geo)[0]
    out = torch.empty(rows, geo.blocks, dtype=torch.float32)
    kernel.absmax(x, geo, out)
    return out


def codes(x: Tensor, scales: Tensor, geo: Any, codec: Any) -> Optional[Tensor]:
    """The ``uint8`` codes of the float32 piece ``x`` under ``scales`` (``rows * blocks`` of them), or ``None``."""
    from gradtx.quantization.maps import TableCodec

    kernel = _kernel_for(x, scales)
    if kernel is None or not isinstance(codec, TableCodec) or not _scales_fit(scales, x, geo) or not _plain(x, torch.float32):
        return None
    tables = lookup(codec)
    if tables is None:
        return None
    out = torch.empty(x.shape, dtype=torch.uint8)
    kernel.codes(x, scales, geo, codec, tables, out)
    return out


def stochastic_codes(
    x: Tensor, scales: Tensor, geo: Any, codec: Any, key: Tensor, index: Optional[Tensor], first_index: int = 0
) -> Optional[Tensor]:
    """The ``uint8`` codes of the float32 piece ``x`` rounded stochastically, its draws those of
    ``quick_draws(key, index)`` (``index``: the values' logical indices, int64 shaped as ``x``;
    ``None``: ``first_index``, ``first_index + 1``, ... in row-major order), or ``None``."""
    from gradtx.quantization.maps import TableCodec

    kernel = _kernel_for(x, scales)
    if kernel is None or not isinstance(codec, TableCodec) or not _scales_fit(scales, x, geo) or not _plain(x, torch.float32):
        return None
    if index is not None and (not _plain(index, torch.int64) or index.shape != x.shape):
        return None
    if type(key) is not Tensor or key.dtype != torch.int64 or key.numel() != 1 or codec._magnitudes.dtype != torch.float32:
        return None
    tables = lookup(codec)
    if tables is None:
        return None
    out = torch.empty(x.shape, dtype=torch.uint8)
    kernel.stochastic_codes(x, scales, geo, codec, tables, int(key.item()), index, first_index, out)
    return out


def pack_nibbles(codes: Tensor, offset: int) -> Optional[Tensor]:
    """:func:`gradtx.quantization.blocks.pack_nibbles` of contiguous ``uint8`` CPU codes, or ``None``."""
    kernel = _kernel_for(codes)
    if kernel is None or not _plain(codes, torch.uint8):
        return None
    columns = codes.shape[-1] if codes.ndim else 1
    lead = offset % 2 if columns else 0
    rows = codes.numel() // columns if columns else int(torch.Size(codes.shape[:-1]).numel())
    out = torch.empty(*codes.shape[:-1], (lead + columns + 1) // 2, dtype=torch.uint8)
    kernel.pack(codes, rows, columns, lead, out)
    return out


def unpack_nibbles(packed: Tensor, columns: int, offset: int) -> Optional[Tensor]:
    """:func:`gradtx.quantization.blocks.unpack_nibbles` of contiguous ``uint8`` CPU bytes, or ``None``."""
    kernel = _kernel_for(packed)
    if kernel is None or not _plain(packed, torch.uint8):
        return None
    lead = offset % 2
    width = packed.shape[-1] if packed.ndim else 1
    if columns and lead + columns > 2 * width:
        return None
    rows = packed.numel() // width if width else int(torch.Size(packed.shape[:-1]).numel())
    out = torch.empty(*packed.shape[:-1], columns, dtype=torch.uint8)
    kernel.unpack(packed, rows, columns, lead, out)
    return out


def values(codes: Tensor, scales: Tensor, geo: Any, codec: Any) -> Optional[Tensor]:
    """The float32 values of the ``uint8`` piece ``codes`` under ``scales``, or ``None``."""
    from gradtx.quantization.maps import TableCodec

    kernel = _kernel_for(scales)
    if kernel is None or not isinstance(codec, TableCodec) or not _scales_fit(scales, codes, geo) or not _plain(codes, torch.uint8):
        return None
    out = torch.empty(codes.shape, dtype=torch.float32)
    kernel.values(codes, scales, geo, codec, out)
    return out


def _scales_fit(scales: Any, x: Tensor, geo: Any) -> bool:
    """Contiguous float32 scales, one per block of every row of ``x``."""
    return _plain(scales, torch.float32) and scales.numel() == _piece(x, geo)[0] * geo.blocks


# --------------------------------------------------------------------------- the check


def _build_and_check() -> tuple[Optional[_Kernel], str]:
    return checks.built_and_checked("codebook", _Kernel, _mismatch)


def _mismatch(kernel: _Kernel) -> str:
    """The first case where the kernel's absmax, codes or values differ from the ATen ops' in any bit, or ``""``."""
    from gradtx.quantization import blocks
    from gradtx.quantization.maps import codec

    cases = [  # (bits, shape, block size, offset): whole blocks, pieces inside blocks, one for the threads
        (8, (3, 1000), 256, 0),
        (8, (2, 300), 256, 100),
        (4, (5, 129), 128, 1),
        (4, (1, 70001), 128, 0),
        (8, (70001,), 256, 7),
    ]
    for number, (bits, shape, block_size, offset) in enumerate(cases):
        book, geo, n = codec(bits), blocks.geometry(shape, block_size, offset), int(torch.Size(shape).numel())
        gen = torch.Generator().manual_seed(number)
        extreme = checks.probe(n, 30 + number).reshape(shape)  # most blocks hold an infinity or a NaN
        extreme[..., : min(shape[-1], 300)] = 0.0  # an all-zero block
        mild = (torch.randn(n, generator=gen) * torch.exp(torch.randn(n, generator=gen) * 2)).reshape(shape)
        for x in (extreme, mild):
            results = [_encode_and_decode(x, geo, book, under_check) for under_check in (None, kernel)]
            difference = checks.first_difference([results[0]], [results[1]])
            if difference:
                return f"{bits} bits, shape {shape}, offset {offset}: {difference}"
    if not kernel.calls:
        return "the check never reached the kernel"
    return ""


def _encode_and_decode(x: Tensor, geo: Any, book: Any, kernel: Optional[_Kernel]) -> dict[str, Tensor]:
    """The absmax, and with either map the codes (to nearest and stochastically rounded) and values,
    of ``x``: by the ATen ops (``kernel`` ``None``) or by ``kernel``, under check."""
    from gradtx.quantization import blocks
    from gradtx.transforms.low_precision import quick_draws

    with checks.aten_only() if kernel is None else checks.checking(kernel):
        absmax = blocks.block_absmax(x, geo)
        found = {"absmax": absmax}
        for signed in (True, False):
            scales = blocks.block_scales(absmax, torch.full_like(absmax, signed, dtype=torch.bool))
            codes = blocks.quantize(x, scales, geo, book)
            found[f"codes {signed}"] = codes.to(torch.int32)
            found[f"values {signed}"] = blocks.dequantize(codes, scales, geo, book, torch.float32)
            key = torch.tensor(0x5DEECE66D + 977 * signed, dtype=torch.int64)
            if kernel is None:
                draws = quick_draws(key, torch.arange(x.numel()).reshape(x.shape))
                rounded = blocks.quantize(x, scales, geo, book, draws)
            else:
                rounded = stochastic_codes(x, scales, geo, book, key, None)
            found[f"stochastic codes {signed}"] = rounded.to(torch.int32) if rounded is not None else torch.full_like(codes, -1, dtype=torch.int32)
        nibbles = codes & 0x0F
        packed = blocks.pack_nibbles(nibbles, geo.offset)
        found["packed"] = packed.to(torch.int32)
        found["unpacked"] = blocks.unpack_nibbles(packed, nibbles.shape[-1] if nibbles.ndim else 1, geo.offset).to(torch.int32)
    return found


_kernel = checks.Lazy(_build_and_check)
