"""The per-value work of a code book, written once and run eagerly or as one compiled loop.

:func:`absmax` (a block's scale), :func:`table_codes` (a block's values to their nearest-value codes) and :func:`table_values`
(codes back to values) are elementwise over a ``(rows, blocks, block_size)`` view, with the block
scales broadcast along its last dim. Eagerly each of their dozen operations is a pass over the
whole leaf; ``torch.compile`` (Inductor) fuses them into one loop over it, several times faster
on CPU. :func:`run` chooses: the compiled function for leaves of at least :data:`COMPILE_MIN_SIZE`
values (one compilation, with dynamic shapes, serves every leaf size; below that size the eager calls are about as fast), the eager one for smaller
leaves, inside a graph being traced (``compile_step``), or where ``GRADTX_QUANTIZE_COMPILE=0``.
Eagerly, :mod:`gradtx.native.codebook` runs the same work in C before either is reached, where it
can be built.
``GRADTX_QUANTIZE_COMPILE=1`` compiles for every size. Both give the same codes and values, bit
for bit: the same float32 operations in the same order, and integer ones. The stochastic rounding
of :func:`table_codes_stochastic` (4-bit first moments) always runs eagerly.
"""

from __future__ import annotations

import os
import warnings
from typing import Callable

import torch
from torch import Tensor

from gradtx import torch_internals
from gradtx.native import checks as native_checks

# a non-negative float32's exponent and top 10 mantissa bits name its cell (see maps._NearestMagnitude)
CELL_SHIFT = 13
CELLS = (0x3F800000 >> CELL_SHIFT) + 2  # the cells of [0, 1], and one above for NaN
COMPILE_MIN_SIZE = 1 << 16  # values of a leaf from which the compiled loop is used by default
ENVIRONMENT = "GRADTX_QUANTIZE_COMPILE"
_SIGN_BIT = -(2**31)  # int32's sign bit


def gather(table: Tensor, index: Tensor) -> Tensor:
    """``table[index]`` for int32 ``index`` of any shape, every index known to be in range. Eagerly
    ``index_select``, which takes int32 indices as they are and runs several times faster on CPU
    than advanced indexing; compiled, an unchecked load (Inductor checks and wraps indices
    otherwise, which doubles the cost of the loop)."""
    if torch.compiler.is_compiling():
        if torch_internals.unchecked_index is not None:
            return torch_internals.unchecked_index(table, [index])
        return table[index]
    return torch.index_select(table, 0, index.reshape(-1)).view(index.shape)


def block_rows(x: Tensor, scales: Tensor) -> tuple[Tensor, Tensor]:
    """``x`` (``(rows, blocks, block_size)``) as ``(rows * blocks, block_size)`` and its ``scales``
    as ``(rows * blocks,)``: one size that varies from leaf to leaf, never 1 for a leaf large enough
    to be compiled for (Dynamo compiles a size of 1 apart), so one compiled loop serves them all."""
    return x.reshape(-1, x.shape[-1]), scales.reshape(-1)


def absmax(x: Tensor) -> Tensor:
    """Each block's absolute maximum, float32 ``(rows, blocks)``, of ``x`` (``(rows, blocks, block_size)``;
    NaN if it holds one). Its sign bit is clear, NaN's too: Inductor's ``amax`` returns a NaN with
    the sign bit set, which would name the other map (see :func:`signed`) and order below every
    number as a bit pattern (the all-reduce of shared blocks' absmax)."""
    return x.abs().amax(dim=-1).to(torch.float32).abs()


def signed(scales: Tensor) -> Tensor:
    """Whether each float32 scale has its sign bit set (its block uses the signed map), as an integer
    comparison of its bit pattern: Inductor writes ``torch.signbit`` as a loop over ``std::signbit``,
    which g++ 12 can fail to compile when it vectorizes it (an internal compiler error on a
    ``lshiftrt:V2SI`` instruction, ``cmath:662``, seen on a compiled quantized step)."""
    return scales.view(torch.int32) < 0


def divisors(scales: Tensor) -> Tensor:
    """What a block's values are divided by: its absmax (the scale's magnitude), or 1 for an all-zero block."""
    absmax = scales.abs()
    return torch.where(absmax > 0, absmax, torch.ones_like(absmax))[..., None]


def _nearest(x: Tensor, scales: Tensor, first: Tensor, midpoints: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per value of ``x`` (see :func:`table_codes`): its bit pattern after division by its block's
    absmax, whether its block uses the signed map, and the joint index of its nearest magnitude."""
    in_signed = signed(scales)[..., None]
    # the quotient's magnitude with x's own sign: an infinite x in a block whose absmax is infinite
    # divides to a NaN whose sign bit the CPU chooses (x86 sets it), and +inf would read back as -inf
    bits = ((x / divisors(scales)).view(torch.int32) & 0x7FFFFFFF) | (x.view(torch.int32) & _SIGN_BIT)
    magnitude = bits & 0x7FFFFFFF  # |value|'s bit pattern; a NaN's lies above 1.0's, in the last cell
    cell = (magnitude >> CELL_SHIFT).clamp(0, CELLS - 1) + torch.where(in_signed, 0, CELLS).to(torch.int32)
    index = gather(first, cell)
    index = index + (magnitude.view(torch.float32) > gather(midpoints, index)).to(torch.int32)
    return bits, in_signed, index


def _code(bits: Tensor, in_signed: Tensor, index: Tensor, zero: int, offset: int) -> Tensor:
    """The ``uint8`` code of a joint ``index``: mirrored below ``zero`` for a negative value of the signed map."""
    code = torch.where(in_signed, torch.where(bits < 0, zero - 1 - index, zero + index), index - offset)
    return code.to(torch.uint8)


def table_codes(x: Tensor, scales: Tensor, first: Tensor, midpoints: Tensor, zero: int, offset: int) -> Tensor:
    """The ``uint8`` codes of ``x`` (float32, ``(rows, blocks, block_size)``) under ``scales``
    (``(rows, blocks)``, the map in the sign bit): each value divided by its block's absmax, and
    looked up in the signed map's non-negative half (indices from ``zero`` up, mirrored below it
    for negative values) or the unsigned map (the joint tables' indices from ``offset``). ``first``
    and ``midpoints`` are the joint nearest-value tables of ``maps.TableCodec``."""
    bits, in_signed, index = _nearest(x, scales, first, midpoints)
    return _code(bits, in_signed, index, zero, offset)


def table_codes_stochastic(
    x: Tensor, scales: Tensor, draws: Tensor, first: Tensor, midpoints: Tensor, magnitudes: Tensor, zero: int, offset: int
) -> Tensor:
    """:func:`table_codes`, rounded stochastically: each value takes the code of the lower or the
    upper of the two map magnitudes around it, the upper iff ``(|x| - lo) * 2**24 > draw * (hi -
    lo)``, so the value read back is unbiased. ``draws``: integers uniform in ``[0, 2**24)``, shaped
    as ``x``; ``magnitudes``: the values the joint index names (the signed map's non-negative half,
    then the unsigned map, from ``offset``). A magnitude beyond a table's end takes that end."""
    bits, in_signed, nearest = _nearest(x, scales, first, midpoints)
    magnitude = (bits & 0x7FFFFFFF).view(torch.float32)
    start = torch.where(in_signed, 0, offset).to(torch.int32)
    end = torch.where(in_signed, offset - 1, magnitudes.shape[0] - 1).to(torch.int32)
    at = gather(magnitudes, nearest)
    above = at > magnitude  # the nearest value is the upper neighbour: the other one is below
    other = torch.clamp(torch.where(above, nearest - 1, nearest + 1), start, end)  # itself at a table's end
    beside = gather(magnitudes, other)
    low, high = torch.where(above, beside, at), torch.where(above, at, beside)
    away = (magnitude - low) * float(2**24) > draws.to(torch.float32) * (high - low)
    return _code(bits, in_signed, torch.where(away == above, nearest, other), zero, offset)


def table_values(codes: Tensor, scales: Tensor, joint: Tensor, size: int) -> Tensor:
    """The float32 values of ``codes`` (``(rows, blocks, block_size)``) under ``scales``: one gather
    from ``joint``, the signed and unsigned maps laid end to end (the unsigned one from ``size``)."""
    index = codes.to(torch.int32) + torch.where(signed(scales), 0, size).to(torch.int32)[..., None]
    return gather(joint, index) * scales.abs()[..., None]


_compiled: dict[Callable, Callable] = {}
_failed: set[Callable] = set()


def _wanted(x: Tensor) -> bool:
    """Whether the compiled loop is used for the leaf ``x`` (see the module's docstring)."""
    setting = os.environ.get(ENVIRONMENT, "")
    if setting == "0" or torch.compiler.is_compiling() or type(x) is not torch.Tensor or x.requires_grad:
        return False
    if native_checks.reference_only():  # the eager ops are the reference of gradtx's C kernels
        return False
    return setting == "1" or x.numel() >= COMPILE_MIN_SIZE


def run(fn: Callable[..., Tensor], x: Tensor, *args: object) -> Tensor:
    """``fn(x, *args)``, compiled where :func:`_wanted` says so. A compilation that fails (no C++
    compiler, say) warns once and leaves ``fn`` eager from then on: the numbers are the same."""
    if fn in _failed or not _wanted(x):
        return fn(x, *args)
    compiled = _compiled.get(fn)
    if compiled is None:
        compiled = _compiled[fn] = torch.compile(fn, dynamic=True)
    try:
        with torch.no_grad():  # codes need no graph; one compiled variant, whatever the grad mode
            return compiled(x, *args)
    except Exception as error:  # noqa: BLE001 - any failure to build the loop: run it eagerly
        _failed.add(fn)
        warnings.warn(
            f"gradtx.quantize_state: compiling {fn.__name__} failed ({type(error).__name__}: {error}); "
            f"it runs eagerly from now on (same numbers, slower; {ENVIRONMENT}=0 skips the attempt)",
            RuntimeWarning,
            stacklevel=3,
        )
        return fn(x, *args)
