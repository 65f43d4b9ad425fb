"""The C kernel of the quantized state's code books (gradtx/native/codebook.c): the ATen ops' numbers.

Checked: for random pieces (shapes, block sizes, pieces that start and end inside blocks), both
maps of the 8- and 4-bit code books and values from ordinary to extreme (zeros, infinities, NaNs,
subnormals), the kernel's block absmax, codes and values read back equal the eager ATen ops' bit
for bit, at one and two threads; whole ``quantize_state`` steps too; where it must not run it does
not; its tables and its check refuse what would change a code.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import gradtx as gtx
from gradtx import tree as tree_lib
from gradtx.native import build, checks
from gradtx.native import codebook as native_codebook
from gradtx.quantization import blocks
from gradtx.quantization.maps import TableCodec, codec
from native_helpers import NEEDS_KERNELS, equal_bits

pytestmark = NEEDS_KERNELS


def _calls() -> int:
    return native_codebook.usable().calls


def _values(n: int, seed: int, kind: str) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if kind == "extreme":
        return checks.probe(n, seed) if n else torch.empty(0)
    x = torch.randn(n, generator=gen) * torch.exp(torch.randn(n, generator=gen) * 3)
    if kind == "squares":  # a second moment
        x = x * x
    elif kind == "sparse zeros":
        x[torch.rand(n, generator=gen) < 0.7] = 0.0
    return x


def _both_ways(x: torch.Tensor, geo: blocks.Geometry, book, signed: bool) -> tuple[dict, dict]:
    """The block absmax, codes and values of ``x``, by the eager ATen ops and by the kernel."""
    found = []
    for reference in (True, False):
        with checks.aten_only() if reference else contextlib.nullcontext():
            absmax = blocks.block_absmax(x, geo)
            scales = blocks.block_scales(absmax, torch.full_like(absmax, signed, dtype=torch.bool))
            codes = blocks.quantize(x, scales, geo, book)
            values = blocks.dequantize(codes, scales, geo, book, torch.float32)
        found.append({"absmax": absmax, "codes": codes, "values": values})
    return found[0], found[1]


@settings(max_examples=60, deadline=None)
@given(
    bits=st.sampled_from([8, 4]),
    rows=st.integers(0, 4),
    columns=st.integers(1, 700),
    block_size=st.sampled_from([1, 2, 7, 64, 128, 256, 300]),
    offset=st.integers(0, 600),
    kind=st.sampled_from(["extreme", "mild", "squares", "sparse zeros"]),
    signed=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_absmax_codes_and_values_equal_the_aten_ops_bit_for_bit(bits, rows, columns, block_size, offset, kind, signed, seed):
    shape = (rows, columns) if rows else (columns,)
    x = _values(int(torch.Size(shape).numel()), seed, kind).reshape(shape)
    geo = blocks.geometry(shape, block_size, offset)
    before = _calls()
    want, got = _both_ways(x, geo, codec(bits), signed)
    for key in want:
        assert equal_bits(want[key], got[key]), key
    assert _calls() == before + 3


@settings(max_examples=40, deadline=None)
@given(
    bits=st.sampled_from([8, 4]),
    rows=st.integers(1, 4),
    columns=st.integers(1, 700),
    block_size=st.sampled_from([1, 7, 128, 256]),
    offset=st.integers(0, 300),
    kind=st.sampled_from(["extreme", "mild", "squares", "sparse zeros"]),
    signed=st.booleans(),
    key=st.integers(-(2**63), 2**63 - 1),
    permuted=st.booleans(),
    start=st.integers(0, 2**40),
    seed=st.integers(0, 2**16),
)
def test_stochastically_rounded_codes_equal_the_aten_ops_bit_for_bit(bits, rows, columns, block_size, offset, kind, signed, key, permuted, start, seed):
    from gradtx.transforms.low_precision import quick_draws

    x = _values(rows * columns, seed, kind).reshape(rows, columns)
    geo = blocks.geometry(x.shape, block_size, offset)
    book, key = codec(bits), torch.tensor(key, dtype=torch.int64)
    absmax = blocks.block_absmax(x, geo)
    scales = blocks.block_scales(absmax, torch.full_like(absmax, signed, dtype=torch.bool))
    gen = torch.Generator().manual_seed(seed)
    index = (torch.randperm(rows * columns, generator=gen) + 2**40).reshape(x.shape) if permuted else None
    with checks.aten_only():
        logical = index if permuted else torch.arange(start, start + x.numel()).reshape(x.shape)
        want = blocks.quantize(x, scales, geo, book, quick_draws(key, logical))
    before = _calls()
    got = native_codebook.stochastic_codes(x, scales, geo, book, key, index, 0 if permuted else start)
    assert _calls() == before + 1
    assert torch.equal(want, got)


@pytest.mark.parametrize("bits", [8, 4])
def test_every_midpoint_and_its_neighbours_get_the_aten_ops_codes(bits):
    """Values at, just below and just above each midpoint of both maps (times a block's absmax),
    where nearest-value rounding turns: the kernel's tables must turn exactly there."""
    book = codec(bits)
    midpoints = book._midpoints[torch.isfinite(book._midpoints)]
    near = torch.cat([midpoints, torch.nextafter(midpoints, torch.tensor(0.0)), torch.nextafter(midpoints, torch.tensor(2.0))])
    near = torch.cat([near, -near, book.signed, book.unsigned, torch.tensor([1.0, 0.0, -0.0, 1e-45, 1e-38])])
    for absmax in (1.0, 3.0e-4, 7.5e12):
        block = torch.cat([near * absmax, torch.tensor([absmax])])  # the block's absmax is absmax
        geo = blocks.geometry(block.shape, block.numel())
        for signed in (True, False):
            want, got = _both_ways(block, geo, book, signed)
            for key in want:
                assert equal_bits(want[key], got[key]), (absmax, signed, key)


def test_a_quantized_adamw_and_lion_step_take_the_kernel_and_the_aten_ops_numbers():
    params = {"w": _values(300 * 256, 1, "mild").reshape(300, 256), "b": _values(5000, 2, "mild"), "s": torch.ones(10)}
    for tx in (gtx.quantize_state(gtx.adamw(1e-2, weight_decay=0.1), 8), gtx.quantize_state(gtx.lion(1e-3), 8),
               gtx.quantize_state(gtx.sgd(0.1, momentum=0.9), 4), gtx.quantize_state(gtx.adam(1e-3), 4)):
        results = []
        for reference in (True, False):
            before = _calls()
            with checks.aten_only() if reference else contextlib.nullcontext():
                state, p = tx.init(params), dict(params)
                for step in range(3):
                    grads = {k: _values(v.numel(), 10 * step + i, "mild").reshape(v.shape) for i, (k, v) in enumerate(p.items())}
                    updates, state = tx.update(grads, state, p)
                    p = gtx.apply_updates(p, updates)
            assert (_calls() > before) != reference
            results.append((p, state))
        (p0, s0), (p1, s1) = results
        leaves = [[x for x in tree_lib.leaves(tree) if x is not None] for tree in ((p0, s0), (p1, s1))]
        assert len(leaves[0]) == len(leaves[1])
        for a, b in zip(*leaves):
            assert equal_bits(a, b)


def test_the_same_codes_at_one_and_two_threads():
    x = _values(3 * 70_001, 3, "extreme").reshape(3, 70_001)
    geo = blocks.geometry(x.shape, 256, 100)
    book = codec(8)
    threads = torch.get_num_threads()
    found = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            found.append(_both_ways(x, geo, book, True)[1])
    finally:
        torch.set_num_threads(threads)
    for key in found[0]:
        assert equal_bits(found[0][key], found[1][key])


@pytest.mark.parametrize("case", ["a recorded graph", "bfloat16 values", "a transposed piece"])
def test_the_kernel_is_not_used_where_it_could_change_a_number(case):
    x = _values(64 * 32, 4, "mild").reshape(64, 32)
    if case == "a recorded graph":
        x.requires_grad_()
    elif case == "bfloat16 values":
        x = x.bfloat16()
    elif case == "a transposed piece":
        x = x.t()
    geo = blocks.geometry(x.shape, 16)
    scales = torch.ones(x.shape[0], geo.blocks)
    before = _calls()
    assert native_codebook.absmax(x, geo) is None
    assert native_codebook.codes(x, scales, geo, codec(8)) is None
    assert _calls() == before


def test_float8_storage_and_other_codes_keep_to_the_aten_ops():
    x = _values(64 * 32, 4, "mild").reshape(64, 32)
    geo = blocks.geometry(x.shape, 16)
    scales = torch.ones(64, 2)
    assert native_codebook.codes(x, scales, geo, codec(torch.float8_e4m3fn)) is None
    assert native_codebook.values(x.to(torch.float8_e4m3fn), scales, geo, codec(torch.float8_e4m3fn)) is None
    assert native_codebook.values(torch.zeros(64, 32, dtype=torch.int32), scales, geo, codec(8)) is None
    assert native_codebook.codes(x, torch.ones(64, 3), geo, codec(8)) is None  # scales of another geometry


def test_a_code_book_whose_midpoints_share_a_cell_keeps_to_the_aten_ops():
    crowded = TableCodec(8, [-1.0, -0.5, -0.0, 0.0, 0.5, 1.0], [0.0, 0.5, 0.501, 0.502, 1.0])  # midpoints 2**-9 apart
    assert native_codebook.lookup(crowded) is None
    x = torch.linspace(0.0, 1.0, 4096)
    geo = blocks.geometry(x.shape, 256)
    scales = blocks.block_absmax(x, geo)
    assert native_codebook.codes(x, scales, geo, crowded) is None
    with checks.aten_only():
        want = blocks.quantize(x, scales, geo, crowded)
    assert torch.equal(blocks.quantize(x, scales, geo, crowded), want)


def test_the_check_refuses_stochastic_rounding_with_other_draws():
    lib, _ = build.load("codebook")

    class OtherKey(native_codebook._Kernel):
        def stochastic_codes(self, x, scales, geo, codec, tables, key, index, first_index, out):
            super().stochastic_codes(x, scales, geo, codec, tables, key ^ 1, index, first_index, out)

    assert "stochastic codes" in native_codebook._mismatch(OtherKey(lib))


def test_the_check_refuses_tables_one_midpoint_off():
    lib, _ = build.load("codebook")
    kernel = native_codebook._Kernel(lib)
    assert native_codebook._mismatch(kernel) == ""
    book = codec(8)
    good = native_codebook.lookup(book)
    signed = good.signed.clone()
    cells = (signed & 0xFF).diff().nonzero().flatten()  # cells holding a midpoint: shift the count below the next one
    signed[cells[len(cells) // 2] + 1 :] += 1
    native_codebook._lookups[id(book)] = (book, good._replace(signed=signed))
    try:
        assert "values of" in native_codebook._mismatch(kernel)
    finally:
        native_codebook._lookups[id(book)] = (book, good)


@settings(max_examples=80, deadline=None)
@given(data=st.data(), shape=st.lists(st.integers(1, 5), min_size=1, max_size=3))
def test_a_pieces_contiguous_start_is_its_first_logical_index_when_its_indices_run_on(data, shape):
    from gradtx.sharding.elements import contiguous_start, logical_indices
    from gradtx.sharding.matrices import Piece

    offset = [data.draw(st.integers(0, n - 1)) for n in shape]
    size = [data.draw(st.integers(1, n - o)) for n, o in zip(shape, offset)]
    piece = Piece(tuple(shape), tuple(size), tuple(offset), ())
    flat = logical_indices(piece, size, torch.device("cpu")).flatten()
    runs_on = bool((flat.diff() == 1).all())
    start = contiguous_start(piece)
    assert (start is not None) == runs_on
    if start is not None:
        assert start == int(flat[0])
    assert contiguous_start(None) == 0


@settings(max_examples=60, deadline=None)
@given(
    shape=st.lists(st.integers(0, 9), min_size=0, max_size=3),
    offset=st.integers(0, 5),
    seed=st.integers(0, 2**16),
)
def test_nibbles_packed_and_unpacked_as_the_aten_ops_pack_them(shape, offset, seed):
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, tuple(shape), generator=gen, dtype=torch.uint8)
    columns = codes.shape[-1] if codes.ndim else 1
    with checks.aten_only():
        want = blocks.pack_nibbles(codes, offset)
        want_back = blocks.unpack_nibbles(want, columns, offset)
    before = _calls()
    got = blocks.pack_nibbles(codes, offset)
    got_back = blocks.unpack_nibbles(got, columns, offset)
    assert _calls() == before + 2
    assert got.shape == want.shape and torch.equal(got, want)
    assert torch.equal(got_back, want_back) and torch.equal(got_back, codes.reshape(want_back.shape))
