"""The code books of quantized state: which normalized value each code stands for.

A block of ``block_size`` state values is divided by its absolute maximum, so every value lies in
``[-1, 1]``; a code book maps that interval onto a few bits. Two kinds live here:

- :class:`TableCodec`: a table of at most ``2**bits`` values and nearest-value encoding. Its maps
  are the non-linear ones of the literature, built below: Dettmers et al.'s *dynamic tree* map for
  8 bits (`8-bit Optimizers via Block-wise Quantization <https://arxiv.org/abs/2110.02861>`_, ICLR
  2022), and for 4 bits Li et al.'s signed *dynamic exponent* map for first moments and their
  *linear map without zero* for second moments (`Memory Efficient Optimizers with 4-bit States
  <https://arxiv.org/abs/2309.01507>`_, NeurIPS 2023).
- :class:`FloatCodec`: a scaled cast to a float8 dtype (the absmax lands on the dtype's largest
  finite value), rounding to nearest as torch's cast does.

Each codec holds a *signed* map (first moments, momenta: any sign, and a zero) and an *unsigned*
one (second moments: more resolution on ``[0, 1]``, and for 4 bits no zero, which keeps a second
moment from collapsing to zero and its update from blowing up, the failure Li et al. identify). The
signed tables also hold ``-0.0`` beside ``0.0``: a negative value too small for any negative code
reads back as ``-0.0``, so the sign bit of every value survives and the block stays signed when
it is quantized again (quantizing a dequantized block gives the same codes).
"""

from __future__ import annotations

import functools
from typing import Optional, Union

import torch
from torch import Tensor

from gradtx.quantization import kernels
from gradtx.quantization.kernels import CELL_SHIFT, CELLS


def dynamic_magnitudes(magnitude_bits: int) -> list[float]:
    """The positive values of a dynamic tree (dynamic exponent) map with ``magnitude_bits`` bits, ascending.

    A code's bits after the sign are a run of ``e`` zeros (the decimal exponent), an indicator
    one, and ``magnitude_bits - e - 1`` bits of a linear fraction in ``(0.1, 1]``: the value is
    ``10**-e * (0.1 + 0.9 * k / 2**f)`` for ``k = 1 .. 2**f``, ``f`` the fraction's bits. The
    all-zero code is ``0`` (not listed here). So large values get fine linear steps and small ones
    a wide range of exponents: 8 bits reach down to ``1e-6`` (signed) or ``1e-7`` (unsigned).
    """
    values = []
    for zeros in range(magnitude_bits):
        fraction_bits = magnitude_bits - zeros - 1
        count = 2**fraction_bits
        values += [10.0**-zeros * (0.1 + 0.9 * k / count) for k in range(1, count + 1)]
    return sorted(values)


def signed_dynamic_map(bits: int) -> list[float]:
    """Dettmers' signed dynamic tree map (Li et al.'s dynamic exponent map for 4 bits), ascending,
    with ``-0.0`` before ``0.0``: ``2**bits`` values in ``[-1, 1]``."""
    positive = dynamic_magnitudes(bits - 1)
    return [-v for v in reversed(positive)] + [-0.0, 0.0] + positive


def unsigned_dynamic_map(bits: int) -> list[float]:
    """Dettmers' unsigned dynamic tree map: ``0`` and ``2**bits - 1`` values in ``(0, 1]``, ascending."""
    return [0.0] + dynamic_magnitudes(bits)


def linear_map_without_zero(bits: int) -> list[float]:
    """Li et al.'s linear map without zero: ``k / 2**bits`` for ``k = 1 .. 2**bits``, ascending."""
    count = 2**bits
    return [k / count for k in range(1, count + 1)]




class _NearestMagnitude:
    """The tables of a nearest-value lookup in an ascending list of non-negative values, in constant time.

    The float32 bit pattern of a value, shifted right by :data:`~gradtx.quantization.kernels.CELL_SHIFT`, names a cell of
    relative width ``2**-10``; the tables here hold no two midpoints that close, so each cell
    holds at most one midpoint between neighbouring values. ``first[cell]`` is the index of the
    lowest value a member of the cell can be nearest to; one comparison with the midpoint above it
    finishes the job (a tie goes to the smaller value). As exact as ``bucketize`` on the midpoints,
    without its binary search.
    """

    def __init__(self, values: list[float]) -> None:
        table = torch.tensor(values, dtype=torch.float32).to(torch.float64)
        exact = (table[1:] + table[:-1]) / 2
        # the float32 at or below each exact midpoint: for a float32 m, m > it exactly when m > the midpoint
        midpoints = exact.to(torch.float32)
        midpoints = torch.where(midpoints.to(torch.float64) > exact, torch.nextafter(midpoints, torch.tensor(-1.0)), midpoints)
        starts = (torch.arange(CELLS, dtype=torch.int64) << CELL_SHIFT).to(torch.int32).view(torch.float32)
        first = torch.bucketize(starts, midpoints, right=False)  # the midpoints below the cell's start
        ends = torch.cat([starts[1:], torch.tensor([float("inf")])])
        inside = torch.bucketize(ends, midpoints, right=False) - torch.bucketize(starts, midpoints, right=True)
        if int(inside.max()) > 1:
            raise ValueError("a code book with two midpoints closer than the lookup's cells")
        self.first = first.to(torch.int32)
        self.midpoints = torch.cat([midpoints, torch.tensor([float("inf")])])

class TableCodec:
    """Nearest-value encoding against a signed and an unsigned table of normalized values.

    ``codes`` gives, per value, the index of the nearest table value (a tie goes to the smaller
    magnitude), in the signed table where ``signed`` is true, else in the unsigned one; a negative
    value that rounds to zero gets ``-0.0``'s code. ``values`` looks the codes up. Both are
    elementwise and deterministic. The signed table must be symmetric: its non-negative half
    (``0.0`` and up) follows ``-0.0``, and ``-v`` sits as far below ``-0.0`` as ``v`` above ``0.0``.
    """

    def __init__(self, bits: int, signed: list[float], unsigned: list[float]) -> None:
        if len(signed) > 2**bits or len(unsigned) > 2**bits:
            raise ValueError(f"a {bits}-bit code book has at most {2**bits} values")
        self.bits = bits
        self.code_dtype = torch.uint8
        self.signed = torch.tensor(signed, dtype=torch.float32)
        self.unsigned = torch.tensor(unsigned, dtype=torch.float32)
        self._zero = len(signed) // 2  # the index of 0.0; -0.0 just below
        half = signed[self._zero :]
        if [-v for v in reversed(half)] != signed[: self._zero] or half[0] != 0.0:
            raise ValueError("a signed code book must be symmetric around -0.0, 0.0")
        signed_half, unsigned_lookup = _NearestMagnitude(half), _NearestMagnitude(unsigned)
        self._offset = len(signed_half.midpoints)  # where the unsigned table's midpoints start
        self._first = torch.cat([signed_half.first, unsigned_lookup.first + self._offset])
        self._midpoints = torch.cat([signed_half.midpoints, unsigned_lookup.midpoints])
        padding = lambda values: torch.zeros(2**bits - len(values))  # noqa: E731 - codes never reach it
        self._joint = torch.cat([self.signed, padding(signed), self.unsigned, padding(unsigned)])
        # the magnitudes the joint lookup indexes: the signed half, then the unsigned table
        self._magnitudes = torch.tensor(half + list(unsigned), dtype=torch.float32)

    def codes(self, x: Tensor, scales: Tensor, draws: Optional[Tensor] = None) -> Tensor:
        """The ``uint8`` codes of float32 ``x`` (``(rows, blocks, block_size)``) under the blocks'
        ``scales`` (``(rows, blocks)``; the map in their sign bit): each value divided by its
        block's absmax, then looked up once, in the signed map's non-negative half or in the
        unsigned map (:func:`~gradtx.quantization.kernels.table_codes`).

        ``draws`` (integers uniform in ``[0, 2**24)``, shaped as ``x``): round stochastically instead,
        to one of the two map values around each value, the upper one with probability ``(|x| - lo)
        / (hi - lo)``, so the code's value is unbiased (``E[values] = x``); a magnitude below an
        unsigned map's smallest value (no zero there) takes that value. This path runs eagerly
        (:func:`~gradtx.quantization.kernels.table_codes_stochastic`)."""
        device = x.device
        flat, flat_scales = kernels.block_rows(x, scales)
        first, midpoints = self._first.to(device), self._midpoints.to(device)
        if draws is not None:
            flat_draws = draws.reshape(flat.shape)
            codes = kernels.table_codes_stochastic(flat, flat_scales, flat_draws, first, midpoints, self._magnitudes.to(device), self._zero, self._offset)
        else:
            codes = kernels.run(kernels.table_codes, flat, flat_scales, first, midpoints, self._zero, self._offset)
        return codes.view(x.shape)

    def values(self, codes: Tensor, scales: Tensor) -> Tensor:
        """The float32 values ``codes`` (``(rows, blocks, block_size)``) stand for under ``scales``:
        one gather from the two tables laid end to end, the unsigned one from ``2**bits``."""
        flat, flat_scales = kernels.block_rows(codes, scales)
        return kernels.run(kernels.table_values, flat, flat_scales, self._joint.to(codes.device), 2**self.bits).view(codes.shape)


class FloatCodec:
    """A scaled cast to a float8 ``dtype``: each value over its block's absmax, times ``max``, rounded
    to the nearest ``dtype`` value (``max`` the dtype's largest finite value), read back as ``code /
    max`` times the absmax. The sign is the dtype's own, so the map a scale's sign bit names is ignored."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.bits = torch.finfo(dtype).bits
        self.code_dtype = dtype
        self.max = float(torch.finfo(dtype).max)

    def codes(self, x: Tensor, scales: Tensor, draws: Optional[Tensor] = None) -> Tensor:
        """``x`` (``(rows, blocks, block_size)``) divided by its blocks' absmax, scaled and cast."""
        if draws is not None:
            raise ValueError("a float8 cast rounds to nearest only")
        return (x / kernels.divisors(scales) * self.max).clamp(-self.max, self.max).to(self.code_dtype)

    def values(self, codes: Tensor, scales: Tensor) -> Tensor:
        """The float32 values ``codes`` stand for under ``scales``."""
        return codes.to(torch.float32) / self.max * scales.abs()[..., None]


Codec = Union[TableCodec, FloatCodec]


@functools.lru_cache(maxsize=None)
def codec(bits: Union[int, torch.dtype]) -> Codec:
    """The codec of a storage format: 8 (dynamic tree maps), 4 (dynamic exponent and linear
    without zero), or a float8 dtype. Built once per format."""
    if bits == 8:
        return TableCodec(8, signed_dynamic_map(8), unsigned_dynamic_map(8))
    if bits == 4:
        return TableCodec(4, signed_dynamic_map(4), linear_map_without_zero(4))
    if isinstance(bits, torch.dtype):
        return FloatCodec(bits)
    raise ValueError(f"no code book for {bits!r}")
