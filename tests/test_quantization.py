"""Quantized state (``gradtx.quantize_state``) against the published recipes.

The code books are checked against Dettmers et al.'s and Li et al.'s constructions; per block,
the codes are checked against a reference computed here from the published formula (divide by
the block's absmax, take the nearest map value), with hypothesis properties (the error bound,
zeros, signs, idempotence); the wrapper keeps small leaves bit for bit, stores ~2 (8-bit) and
~1 (4-bit) bytes per parameter for AdamW, tracks fp32 AdamW over 50 steps, and goes through
checkpoints, ``wrap``, ``compile_step`` and ``inject_hyperparams``.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import io
import pathlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import gradtx as gtx
from gradtx.native import checks
from gradtx.quantization import blocks, kernels, maps
from gradtx.quantization.state import decode, storage_format

FORMATS = (8, 4, torch.float8_e4m3fn)


# --------------------------------------------------------------------------- code books


def test_8_bit_dynamic_tree_maps_follow_the_paper():
    signed, unsigned = maps.signed_dynamic_map(8), maps.unsigned_dynamic_map(8)
    assert len(signed) == len(unsigned) == 256
    assert signed == sorted(signed) and unsigned == sorted(unsigned)
    assert signed[0] == -1.0 and signed[-1] == 1.0 and unsigned[0] == 0.0 and unsigned[-1] == 1.0
    positive = [v for v in signed if v > 0]
    assert positive == [-v for v in reversed(signed[:127])]  # symmetric
    # one decade per exponent: 2**6 linear steps in (0.1, 1], 2**5 in (0.01, 0.1], ..., one at 1e-6
    for exponent, count in enumerate((64, 32, 16, 8, 4, 2, 1)):
        top = 10.0**-exponent
        assert sum(top / 10 < v <= top * (1 + 1e-12) for v in positive) == count
    assert min(positive) == pytest.approx(1e-6) and min(v for v in unsigned if v > 0) == pytest.approx(1e-7)
    assert [torch.signbit(torch.tensor(v)).item() for v in signed[127:129]] == [True, False]  # -0.0, 0.0


def test_4_bit_maps_follow_the_paper():
    signed, linear = maps.signed_dynamic_map(4), maps.linear_map_without_zero(4)
    assert len(signed) == len(linear) == 16
    assert [v for v in signed if v > 0] == pytest.approx([0.01, 0.055, 0.1, 0.325, 0.55, 0.775, 1.0])
    assert linear == [k / 16 for k in range(1, 17)] and 0.0 not in linear


# --------------------------------------------------------------------------- one block: the published formula


def _reference(x: torch.Tensor, block_size: int, bits) -> torch.Tensor:
    """Dequantized ``x`` (2-D) by the formula, block by block, with Python slicing: absmax of the
    block, the nearest value of the signed map if the block has a sign bit set, else the unsigned."""
    codec = maps.codec(bits)
    out = torch.empty_like(x)
    for r in range(x.shape[0]):
        for start in range(0, x.shape[1], block_size):
            block = x[r, start : start + block_size]
            absmax = block.abs().max()
            signed = bool(torch.signbit(block).any())
            normalized = block / absmax if absmax > 0 else block
            if isinstance(codec, maps.FloatCodec):
                values = (normalized * codec.max).to(codec.code_dtype).to(torch.float32) / codec.max
            else:
                table = (codec.signed if signed else codec.unsigned).to(torch.float64)
                values = table[(normalized.double()[:, None] - table).abs().argmin(dim=1)].to(torch.float32)
                if signed:  # the sign bit survives rounding to zero
                    values = torch.where(values == 0, torch.copysign(values, block), values)
            out[r, start : start + block_size] = values * absmax
    return out


def _roundtrip(x: torch.Tensor, block_size: int, bits, offset: int = 0):
    geo = blocks.geometry(x.shape, block_size, offset)
    scales = blocks.block_scales(blocks.block_absmax(x, geo), blocks.block_signed(x, geo))
    codec = maps.codec(bits)
    codes = blocks.quantize(x, scales, geo, codec)
    return codes, scales, blocks.dequantize(codes, scales, geo, codec, torch.float32)


def _tensors(draw, max_rows=3, max_cols=70):
    rows, cols = draw(st.integers(1, max_rows)), draw(st.integers(1, max_cols))
    scale = draw(st.sampled_from([1e-12, 1e-3, 1.0, 1e6]))
    seed = draw(st.integers(0, 2**16))
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=gen) * scale
    kind = draw(st.sampled_from(["signed", "non-negative", "sparse", "tiny negative"]))
    if kind == "non-negative":
        x = x.abs()
    elif kind == "sparse":
        x = torch.where(torch.rand(rows, cols, generator=gen) < 0.5, x, torch.zeros(()))
    elif kind == "tiny negative":
        x = x.abs()
        x[..., 0] = -1e-9 * scale  # rounds to zero in every map: read back as -0.0
    return x


@settings(max_examples=60, deadline=None)
@given(data=st.data(), bits=st.sampled_from(FORMATS), block_size=st.sampled_from([1, 4, 16, 32]))
def test_codes_are_the_nearest_map_value_of_each_block(data, bits, block_size):
    x = data.draw(st.builds(lambda: None).flatmap(lambda _: st.composite(_tensors)()))
    codes, scales, y = _roundtrip(x, block_size, bits)
    assert codes.shape == x.shape and scales.shape == (x.shape[0], -(-x.shape[1] // block_size))
    expected = _reference(x, block_size, bits)
    codec = maps.codec(bits)
    absmax = scales.abs().repeat_interleave(block_size, dim=1)[:, : x.shape[1]]
    if isinstance(codec, maps.TableCodec):
        # equal to the reference but where the value sits on a midpoint, up to float32 rounding
        assert torch.allclose(y, expected, rtol=1e-6, atol=0) or _near_midpoints(x, absmax, scales, block_size, codec)
        # the error is at most half the gap of the map around the value (or the distance to the
        # map's end for a value beyond it: the zero-free map below its first entry)
        signed = torch.signbit(scales).repeat_interleave(block_size, dim=1)[:, : x.shape[1]]
        normalized = torch.where(absmax > 0, x / torch.where(absmax > 0, absmax, 1), x)
        bound = torch.where(signed, _half_gaps(normalized, codec.signed), _half_gaps(normalized, codec.unsigned))
        assert ((y - x).abs() <= bound * absmax * (1 + 1e-5) + 1e-30).all()
        # zeros stay zero where the map has one
        has_zero = signed | (codec.unsigned[0] == 0)
        assert (y[(x == 0) & has_zero] == 0).all()
    else:
        assert torch.equal(y, expected)
    # the sign bit is kept, and quantizing the dequantized tensor gives the same codes and scales
    assert torch.equal(torch.signbit(y), torch.signbit(x))
    codes_again, scales_again, _ = _roundtrip(y, block_size, bits)
    assert torch.equal(codes_again.view(torch.uint8), codes.view(torch.uint8)) and torch.equal(scales_again, scales)


def _half_gaps(normalized: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    table = table.double()
    above = torch.searchsorted(table, normalized.double()).clamp(max=len(table) - 1)
    below = (above - 1).clamp(min=0)
    gap = (table[above] - table[below]) / 2
    beyond = (normalized.double() - table[above]).abs()  # below the first entry, or above the last
    outside = (normalized.double() < table[0]) | (normalized.double() > table[-1])
    return torch.where(outside, beyond, gap).to(torch.float32) + 1e-7


def _near_midpoints(x, absmax, scales, block_size, codec) -> bool:
    normalized = (x / torch.where(absmax > 0, absmax, 1)).double()
    mids = torch.cat([(codec.signed[1:] + codec.signed[:-1]) / 2, (codec.unsigned[1:] + codec.unsigned[:-1]) / 2]).double()
    return bool(((normalized[..., None] - mids).abs().min(dim=-1).values < 1e-6).any())


def _neighbours(normalized: torch.Tensor, table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The map values at or below and at or above each ``|normalized|`` (float64; a value below a
    zero-free map's first entry has that entry as both)."""
    table = table.double().abs().unique()  # the magnitudes, ascending (0.0 and -0.0 are one)
    magnitude = normalized.double().abs()
    above = torch.searchsorted(table, magnitude).clamp(max=len(table) - 1)
    below = torch.where(table[above] > magnitude, above - 1, above).clamp(min=0)
    return table[below], table[above]


@settings(max_examples=60, deadline=None)
@given(data=st.data(), block_size=st.sampled_from([1, 4, 16, 32]), draw_seed=st.integers(0, 2**16))
def test_4_bit_stochastic_codes_are_one_of_the_two_map_values_around_each_value(data, block_size, draw_seed):
    """With draws, each value reads back as the map value just below or just above its magnitude
    (so the error is at most that gap), with its sign; zeros stay zero, and all-zero draws round
    every value strictly between two map values up, the largest draws down."""
    x = data.draw(st.builds(lambda: None).flatmap(lambda _: st.composite(_tensors)()))
    geo = blocks.geometry(x.shape, block_size)
    scales = blocks.block_scales(blocks.block_absmax(x, geo), blocks.block_signed(x, geo))
    codec = maps.codec(4)
    absmax = scales.abs().repeat_interleave(block_size, dim=1)[:, : x.shape[1]]
    signed = torch.signbit(scales).repeat_interleave(block_size, dim=1)[:, : x.shape[1]]
    normalized = x / torch.where(absmax > 0, absmax, 1)
    low_s, high_s = _neighbours(normalized, codec.signed)
    low_u, high_u = _neighbours(normalized, codec.unsigned)
    low, high = torch.where(signed, low_s, low_u), torch.where(signed, high_s, high_u)
    draws = torch.randint(0, 2**24, x.shape, generator=torch.Generator().manual_seed(draw_seed))
    for d in (draws, torch.zeros_like(draws), torch.full_like(draws, 2**24 - 1)):
        codes = blocks.quantize(x, scales, geo, codec, d)
        y = blocks.dequantize(codes, scales, geo, codec, torch.float32)
        read = (y.double() / torch.where(absmax > 0, absmax, 1).double()).abs()
        on_a_neighbour = ((read - low).abs() < 1e-6) | ((read - high).abs() < 1e-6)
        assert (on_a_neighbour | (absmax == 0)).all()  # an all-zero block reads back zero
        assert torch.equal(torch.signbit(y), torch.signbit(x))
        assert (y[(x == 0) & signed] == 0).all()
        between = (normalized.double().abs() > low + 1e-6) & (normalized.double().abs() < high - 1e-6)
        if d is not draws:
            expected = high if int(d.reshape(-1)[0]) == 0 else low
            assert ((read - expected).abs() < 1e-6)[between].all()


@pytest.mark.parametrize("signed", [True, False])
def test_4_bit_stochastic_rounding_is_unbiased(signed):
    """Over equidistributed draws (``k * 2**24 / n``, k = 0 .. n-1) the mean read-back value of
    each value is the value itself, to ``1/n`` of the gap around it: the rounding is unbiased,
    where rounding to nearest errs by up to half the gap every time."""
    n = 256
    x = torch.linspace(-1.0 if signed else 0.07, 1.0, 97).reshape(1, 97)
    geo = blocks.geometry(x.shape, 97)
    scales = blocks.block_scales(blocks.block_absmax(x, geo), torch.tensor([[signed]]))
    codec = maps.codec(4)
    draws = (torch.arange(n) * (2**24 // n)).view(n, 1, 1).expand(n, 1, 97)
    mean = torch.stack([blocks.dequantize(blocks.quantize(x, scales, geo, codec, d), scales, geo, codec, torch.float32) for d in draws])
    mean = mean.double().mean(dim=0)
    low, high = _neighbours(x, codec.signed if signed else codec.unsigned)
    assert ((mean - x.double()).abs() <= (high - low) / n + 1e-6).all()
    nearest = blocks.dequantize(blocks.quantize(x, scales, geo, codec), scales, geo, codec, torch.float32)
    assert (nearest - x).abs().max() > 10 * (mean - x.double()).abs().max()  # the bias the stochastic mean removes


def test_8_bit_and_float8_round_to_nearest_and_float8_takes_no_draws():
    assert not storage_format(8, None).stochastic and not storage_format(torch.float8_e4m3fn, None).stochastic
    assert storage_format(4, None).stochastic
    with pytest.raises(ValueError, match="nearest only"):
        maps.codec(torch.float8_e4m3fn).codes(torch.zeros(1, 1, 2), torch.ones(1, 1), torch.zeros(1, 1, 2, dtype=torch.int64))


@pytest.mark.parametrize("bits", FORMATS)
def test_a_non_finite_value_makes_its_block_non_finite(bits):
    x = torch.linspace(-1, 1, 12).reshape(1, 12)
    for bad in (float("nan"), float("inf")):
        x_bad = x.clone()
        x_bad[0, 1] = bad
        _, _, y = _roundtrip(x_bad, 4, bits)
        assert not torch.isfinite(y[0, :4]).any() and torch.isfinite(y[0, 4:]).all()


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("infinity", [float("inf"), float("-inf")])
@pytest.mark.parametrize("route", ["default", "aten", "compiled"])
def test_an_infinite_value_reads_back_with_its_own_sign(bits, infinity, route, monkeypatch):
    """In a block whose absmax is infinite, inf / inf is a NaN whose sign bit the CPU picks (x86
    sets it): the code takes x's own sign, so +inf reads back as +inf (not -inf) in the signed map,
    and in the unsigned one, by the C kernels, the ATen ops and the compiled loop alike."""
    x = torch.linspace(-1, 1, 24).reshape(2, 12)
    x[0, 1] = infinity
    geo = blocks.geometry(x.shape, 4, 0)
    codec = maps.codec(bits)
    for in_signed in (blocks.block_signed(x, geo), torch.zeros(2, 3, dtype=torch.bool)):
        if infinity < 0 and not in_signed.any():
            continue  # the unsigned map holds magnitudes only
        scales = blocks.block_scales(blocks.block_absmax(x, geo), in_signed)
        if route == "compiled":
            monkeypatch.setenv(kernels.ENVIRONMENT, "1")
            blocked = x.reshape(2, 3, 4)
            y = codec.values(codec.codes(blocked, scales), scales).reshape(2, 12)
        else:
            with checks.aten_only() if route == "aten" else contextlib.nullcontext():
                y = blocks.dequantize(blocks.quantize(x, scales, geo, codec), scales, geo, codec, torch.float32)
        assert y[0, 1] == infinity


# --------------------------------------------------------------------------- pieces of the logical tensor


@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(1, 3), cols=st.integers(1, 40), block_size=st.integers(1, 9),
    cut=st.data(), bits=st.sampled_from(FORMATS),
)
def test_a_piece_at_its_offset_holds_the_dense_codes(rows, cols, block_size, cut, bits):
    """A column slice, given the scales of the blocks it touches (the max over the pieces
    sharing an edge block), quantizes to the dense codes' slice; its own absmax and sign flags
    combine (max, or) to the dense ones."""
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(cols))
    codes, scales, y = _roundtrip(x, block_size, bits)
    start = cut.draw(st.integers(0, cols - 1))
    stop = cut.draw(st.integers(start + 1, cols))
    piece = x[:, start:stop]
    geo = blocks.geometry(piece.shape, block_size, start)
    mine = scales[:, geo.first_block : geo.first_block + geo.blocks]
    codec = maps.codec(bits)
    piece_codes = blocks.quantize(piece, mine, geo, codec)
    assert torch.equal(piece_codes.view(torch.uint8), codes[:, start:stop].view(torch.uint8))
    assert torch.equal(blocks.dequantize(piece_codes, mine, geo, codec, torch.float32), y[:, start:stop])
    # the pieces [0, start), [start, stop), [stop, cols) together give the dense absmax
    absmax = torch.zeros(rows, scales.shape[1])
    signed = torch.zeros(rows, scales.shape[1], dtype=torch.bool)
    for a, b in ((0, start), (start, stop), (stop, cols)):
        if a < b:
            g = blocks.geometry((rows, b - a), block_size, a)
            sl = slice(g.first_block, g.first_block + g.blocks)
            absmax[:, sl] = torch.maximum(absmax[:, sl], blocks.block_absmax(x[:, a:b], g))
            signed[:, sl] |= blocks.block_signed(x[:, a:b], g)
    assert torch.equal(blocks.block_scales(absmax, signed), scales)


@settings(max_examples=40, deadline=None)
@given(start=st.integers(0, 60), length=st.integers(0, 60), row_length=st.integers(1, 13))
def test_flat_segments_cover_a_flat_piece_row_by_row(start, length, row_length):
    stop = start + length
    covered = []
    for seg in blocks.flat_segments(start, stop, row_length):
        assert (seg.end - seg.begin) % seg.rows == 0
        columns = (seg.end - seg.begin) // seg.rows
        assert seg.offset + columns <= row_length
        for r in range(seg.rows):
            first = start + seg.begin + r * columns
            assert first % row_length == seg.offset  # each row of the segment starts at its offset
            covered += list(range(first, first + columns))
    assert covered == list(range(start, stop))


@settings(max_examples=40, deadline=None)
@given(lead=st.integers(0, 3), columns=st.integers(1, 9), offset=st.integers(0, 5), seed=st.integers(0, 99))
def test_4_bit_codes_pack_two_per_byte_and_unpack(lead, columns, offset, seed):
    shape = (2,) * lead + (columns,)
    codes = torch.randint(0, 16, shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    packed = blocks.pack_nibbles(codes, offset)
    assert packed.dtype == torch.uint8 and packed.shape == shape[:-1] + (-(-(offset % 2 + columns) // 2),)
    assert torch.equal(blocks.unpack_nibbles(packed, columns, offset), codes)
    if offset % 2 == 0 and columns % 2 == 0:  # logical columns 2j, 2j + 1 in byte j, low nibble first
        assert torch.equal(packed, codes[..., 0::2] | (codes[..., 1::2] << 4))


# --------------------------------------------------------------------------- the wrapper


def _problem(n_in=64, n_out=64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    data = torch.randn(256, n_in, generator=gen)
    target = data @ torch.randn(n_in, n_out, generator=gen) * 0.1 + 0.01 * torch.randn(256, n_out, generator=gen)
    params = {"w": torch.zeros(n_in, n_out), "b": torch.zeros(n_out)}

    def loss(p):
        return ((data @ p["w"] + p["b"] - target) ** 2).mean()

    return params, loss


def _run(tx, params, loss, steps):
    state = tx.init(params)
    for _ in range(steps):
        updates, state = tx.update(torch.func.grad(loss)(params), state, params)
        params = gtx.apply_updates(params, updates)
    return params, state


# bits: (|loss - fp32 loss| / initial loss, relative distance of the params, of mu, of nu) after 50
# steps; measured: 8-bit 9e-5, 0.0088, 0.12, 0.048; 4-bit 0.0045, 0.095, 1.44, 0.38 (mu rounded to
# nearest instead: 0.036, 0.26, 2.4, 0.40: momenta stall on their codes); float8 5e-5, 0.030, 0.26,
# 0.16; bfloat16 4e-6, 0.0013, 0.012, 0.019. mu ends near zero, so its relative error is large.
TRACKING = {
    8: (1e-3, 0.03, 0.2, 0.1),
    4: (0.01, 0.15, 2.0, 0.6),
    torch.float8_e4m3fn: (1e-3, 0.06, 0.4, 0.25),
    torch.bfloat16: (1e-4, 0.005, 0.03, 0.04),
}


@functools.cache
def _fp32_adamw_over_50_steps():
    """The float32 AdamW run every storage format is held to (pure: computed once, only read)."""
    params, loss = _problem()
    return _run(gtx.adamw(1e-2, weight_decay=0.1), params, loss, 50)


@pytest.mark.parametrize("bits", list(TRACKING), ids=str)
def test_quantized_adamw_tracks_fp32_adamw_over_50_steps(bits):
    loss_tol, params_tol, mu_tol, nu_tol = TRACKING[bits]
    params, loss = _problem()
    exact_params, exact_state = _fp32_adamw_over_50_steps()
    tx = gtx.quantize_state(gtx.adamw(1e-2, weight_decay=0.1), bits)
    q_params, q_state = _run(tx, params, loss, 50)
    start = loss(params).item()
    assert loss(exact_params).item() < 0.01 * start
    assert abs(loss(q_params).item() - loss(exact_params).item()) <= loss_tol * start
    assert (q_params["w"] - exact_params["w"]).norm() <= params_tol * exact_params["w"].norm()
    fmt = storage_format(bits, None)
    adam = q_state.inner[0]
    assert adam.mu["b"].shape == (64,)  # 64 < min_size: kept as it is
    for part, name, tol in ((0, "mu", mu_tol), (1, "nu", nu_tol)):
        stored = decode(q_state.codes[part]["w"], q_state.scales[part]["w"], getattr(adam, name)["w"], fmt)
        reference = getattr(exact_state[0], name)["w"]
        assert (stored - reference).norm() <= tol * reference.norm()


def _tiny_gpt_module():
    path = pathlib.Path(__file__).resolve().parents[1] / "examples" / "_tiny_gpt.py"
    spec = importlib.util.spec_from_file_location("_tiny_gpt", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def _train_tiny_gpt(bits, steps=60, vocab=16, context=8, width=32):
    """The held-out loss of a one-block GPT (examples/_tiny_gpt.py) after ``steps`` AdamW steps on
    its synthetic language, its matrices' moments stored in ``bits`` (``None``: fp32)."""
    tiny_gpt = _tiny_gpt_module()
    torch.manual_seed(0)
    model = tiny_gpt.GPT(vocab, context, width, 2, 4 * width, layers=1)
    tx = gtx.adamw(0.02, weight_decay=0.01)
    if bits is not None:
        tx = gtx.quantize_state(tx, bits, min_size=256)
    params = dict(model.named_parameters())
    state = tx.init({k: p.detach() for k, p in params.items()})
    data = torch.Generator().manual_seed(0)

    def loss(tokens):
        return torch.nn.functional.cross_entropy(model(tokens[:, :-1]).reshape(-1, vocab), tokens[:, 1:].reshape(-1))

    for _ in range(steps):
        model.zero_grad()
        loss(tiny_gpt.sequences(data, 16, vocab, context)).backward()
        updates, state = tx.update({k: p.grad for k, p in params.items()}, state, {k: p.detach() for k, p in params.items()})
        with torch.no_grad():
            for k, p in params.items():
                p.add_(updates[k])
    with torch.no_grad():
        return loss(tiny_gpt.sequences(torch.Generator().manual_seed(99), 128, vocab, context)).item()


def test_4_bit_adamw_trains_a_small_gpt_as_well_as_fp32_adamw():
    """60 steps of a one-block GPT: held-out loss 2.6e-4 with fp32 AdamW, 2.8e-4 at 4 bits (seeds
    1, 2: 0.89x and 1.19x fp32's); with the first moment rounded to nearest, 1.3e-3 (3.6x to 4.9x
    over seeds 0 to 2): its EMA stalls on the codes."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny kernels: more threads only wait on each other on a shared machine
    try:
        exact, quantized = _train_tiny_gpt(None), _train_tiny_gpt(4)
    finally:
        torch.set_num_threads(threads)
    assert exact < 1e-3
    assert quantized <= 1.5 * exact


def test_each_step_stores_the_reference_codes_of_the_inner_update():
    """One step of quantize_state is: read back, run the inner update, quantize by the formula."""
    params, loss = _problem(64, 64)
    inner = gtx.adam(1e-2)
    tx = gtx.quantize_state(inner, 8, block_size=64)
    state = tx.init(params)
    fmt = storage_format(8, 64)
    for _ in range(5):
        grads = torch.func.grad(loss)(params)
        adam = state.inner[0]
        read = adam._replace(
            mu={**adam.mu, "w": decode(state.codes[0]["w"], state.scales[0]["w"], adam.mu["w"], fmt)},
            nu={**adam.nu, "w": decode(state.codes[1]["w"], state.scales[1]["w"], adam.nu["w"], fmt)},
        )
        expected_updates, expected = inner.update(grads, (read,) + tuple(state.inner[1:]), params)
        updates, state = tx.update(grads, state, params)
        assert torch.equal(updates["w"], expected_updates["w"]) and torch.equal(updates["b"], expected_updates["b"])
        for part, name in ((0, "mu"), (1, "nu")):
            got = decode(state.codes[part]["w"], state.scales[part]["w"], state.inner[0].mu["w"], fmt)
            want = _reference(getattr(expected[0], name)["w"], 64, 8)
            assert torch.allclose(got, want, rtol=1e-6, atol=0)
        params = gtx.apply_updates(params, updates)


@pytest.mark.parametrize(
    "make",
    [
        lambda: gtx.adam(1e-2),
        lambda: gtx.lion(1e-3),
        lambda: gtx.sgd(1e-1, momentum=0.9),
        lambda: gtx.contrib.adopt(1e-2),
        lambda: gtx.contrib.ademamix(1e-2),
    ],
    ids=["adam", "lion", "sgd-momentum", "adopt", "ademamix"],
)
def test_any_inner_optimizer_with_per_element_moments(make):
    params, loss = _problem()
    exact, _ = _run(make(), params, loss, 10)
    quantized, state = _run(gtx.quantize_state(make()), params, loss, 10)
    stored = [c for tree in state.codes for c in gtx.tree.leaves(tree) if c is not None]
    assert stored and all(c.dtype == torch.uint8 and c.shape == (64, 64) for c in stored)
    assert loss(quantized).item() < 0.9 * loss(params).item()
    assert abs(loss(quantized).item() - loss(exact).item()) <= 0.05 * loss(params).item()


def test_small_leaves_stay_as_the_inner_optimizer_keeps_them_bit_for_bit():
    params, loss = _problem(16, 16)  # 256 and 16 elements, both under min_size
    plain_params, plain_state = _run(gtx.adamw(1e-2), params, loss, 5)
    q_params, q_state = _run(gtx.quantize_state(gtx.adamw(1e-2), 4), params, loss, 5)
    assert all(c is None for tree in q_state.codes for c in gtx.tree.leaves(tree))
    for a, b in zip(gtx.tree.leaves((plain_params, plain_state)), gtx.tree.leaves((q_params, q_state.inner))):
        assert torch.equal(a, b)
    # with a min_size between them, the small leaf's state and updates are still the plain ones
    tx, plain = gtx.quantize_state(gtx.adamw(1e-2), 8, min_size=100), gtx.adamw(1e-2)
    state, plain_state = tx.init(params), plain.init(params)
    for step in range(5):
        gen = torch.Generator().manual_seed(step)
        grads = {k: torch.randn(v.shape, generator=gen) for k, v in params.items()}
        updates, state = tx.update(grads, state, params)
        plain_updates, plain_state = plain.update(grads, plain_state, params)
        assert torch.equal(updates["b"], plain_updates["b"]) and torch.equal(state.inner[0].nu["b"], plain_state[0].nu["b"])
        assert state.codes[0]["w"] is not None


def test_a_partition_per_leaf_gives_the_whole_trees_numbers():
    # Adam acts leaf by leaf, so running one quantized AdamW per leaf (each step then holds one
    # leaf's moments in float32 at a time: the peak the docstring describes) changes no number.
    params, loss = _problem(64, 80)
    make = lambda: gtx.quantize_state(gtx.adamw(1e-2), 4, min_size=64)  # noqa: E731
    whole_params, whole_state = _run(make(), params, loss, 3)
    per_leaf = gtx.partition({name: make() for name in params}, {name: name for name in params})
    leaf_params, leaf_state = _run(per_leaf, params, loss, 3)
    for name in params:
        assert torch.equal(whole_params[name], leaf_params[name])
        inner = leaf_state.inner_states[name].inner_state
        assert torch.equal(whole_state.codes[0][name], inner.codes[0][name])
        assert torch.equal(whole_state.scales[1][name], inner.scales[1][name])


@pytest.mark.parametrize(("bits", "low", "high"), [(8, 2.0, 2.04), (4, 1.0, 1.07), (torch.float8_e4m3fn, 2.0, 2.04), (torch.bfloat16, 4.0, 4.0)])
def test_bytes_per_parameter_of_adamw_state(bits, low, high):
    params = {"w": torch.zeros(1024, 1024)}
    state = gtx.quantize_state(gtx.adamw(1e-3), bits).init(params)
    total = sum(x.numel() * x.element_size() for x in gtx.tree.leaves(state) if isinstance(x, torch.Tensor))
    assert low <= total / 2**20 <= high + 16 / 2**20  # the step count's bytes included


def test_dtype_of_a_stored_leaf_is_kept():
    params = {"w": torch.randn(64, 64).to(torch.bfloat16)}
    tx = gtx.quantize_state(gtx.adam(1e-2, mu_dtype=torch.float32), 8, min_size=16)
    state = tx.init(params)
    assert state.inner[0].mu["w"].dtype == torch.float32 and state.inner[0].nu["w"].dtype == torch.bfloat16
    _, state = tx.update({"w": torch.ones(64, 64, dtype=torch.bfloat16)}, state, params)
    assert state.inner[0].mu["w"].shape == (64, 64, 0) and state.inner[0].mu["w"].dtype == torch.float32
    assert state.inner[0].nu["w"].dtype == torch.bfloat16
    fmt = storage_format(8, None)
    mu = decode(state.codes[0]["w"], state.scales[0]["w"], state.inner[0].mu["w"], fmt)
    assert mu.dtype == torch.float32 and torch.allclose(mu, torch.full((64, 64), 0.1), rtol=1e-6)


# --------------------------------------------------------------------------- which map each field gets


def _stored_signs(tx, grads):
    """Per params-shaped part of ``tx``'s state after one step on ``grads``: whether the stored
    leaf's scales all say "signed map", or all say "unsigned map"."""
    params = {"w": torch.zeros(64, 64)}
    _, state = tx.update(grads, tx.init(params), params)
    signs = []
    for scales in state.scales:
        signbits = torch.signbit(scales["w"])
        assert signbits.all() or not signbits.any()
        signs.append("signed" if signbits.all() else "unsigned")
    return tuple(signs)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize(
    ("make", "expected"),
    [
        (lambda: gtx.adamw(1e-2), ("signed", "unsigned")),
        (lambda: gtx.amsgrad(1e-2), ("signed", "unsigned", "unsigned")),
        (lambda: gtx.adabelief(1e-2), ("signed", "unsigned")),
        (lambda: gtx.contrib.ademamix(1e-2), ("signed", "signed", "unsigned")),
        (lambda: gtx.inject_hyperparams(gtx.adamw)(learning_rate=1e-2), ("signed", "unsigned")),
        (lambda: gtx.lion(1e-3), ("signed",)),
        (lambda: gtx.sgd(1e-1, momentum=0.9), ("signed",)),
        (lambda: gtx.rmsprop(1e-2), ("unsigned",)),
    ],
    ids=["adamw", "amsgrad", "adabelief", "ademamix", "injected-adamw", "lion", "sgd-momentum", "rmsprop"],
)
def test_the_map_is_chosen_per_state_field_not_per_block(make, expected, bits):
    """Second moments (fields their state type declares non-negative) get the unsigned map, every
    other field the signed one, whatever the values: here every gradient is positive, so every
    first-moment block is non-negative too, and still read with the signed map."""
    grads = {"w": torch.logspace(0, -3, 4096).reshape(64, 64)}
    assert _stored_signs(gtx.quantize_state(make(), bits, min_size=1000), grads) == expected


def test_a_non_negative_first_moment_block_keeps_its_small_entries_at_4_bits():
    """An all-positive block of Adam's ``mu`` whose entries span 4 decades: entries under 1% of
    the block's largest read back within 1% of it (the signed map has a zero and a code at
    1%), not as the zero-free map's smallest value, 1/16 of the largest."""
    grads = {"w": torch.logspace(0, -4, 64).repeat(64, 1)}  # each row: one block of 64
    tx = gtx.quantize_state(gtx.adam(1e-2), 4)
    params = {"w": torch.zeros(64, 64)}
    _, state = tx.update(grads, tx.init(params), params)
    mu = decode(state.codes[0]["w"], state.scales[0]["w"], state.inner[0].mu["w"], storage_format(4, None))
    exact = 0.1 * grads["w"]
    absmax = exact.amax(dim=1, keepdim=True)
    small = exact < absmax / 100
    assert small.sum() > 1000
    assert ((mu - exact).abs()[small] <= (absmax / 100).expand_as(exact)[small]).all()
    assert ((mu - exact).abs() <= 0.23 * absmax).all()  # one of the two codes around it: the widest gap, 0.225


def test_a_second_moment_never_reads_back_as_zero_at_4_bits():
    """Adam's ``nu`` uses the zero-free linear map: entries down to 1e-8 of their block's largest reads
    back as 1/16 of it, so ``1 / sqrt(nu)`` stays bounded (the zero-point problem of Li et al.)."""
    grads = {"w": torch.logspace(0, -4, 64).repeat(64, 1)}  # each row: one block of 64
    tx = gtx.quantize_state(gtx.adam(1e-2), 4)
    params = {"w": torch.zeros(64, 64)}
    _, state = tx.update(grads, tx.init(params), params)
    nu = decode(state.codes[1]["w"], state.scales[1]["w"], state.inner[0].nu["w"], storage_format(4, None))
    absmax = (1e-3 * grads["w"] ** 2).amax(dim=1, keepdim=True)
    assert (nu >= absmax / 16 * (1 - 1e-6)).all()


def test_nonnegative_declarations_are_checked():
    from typing import NamedTuple

    from gradtx.state_signs import nonnegative, nonnegative_fields

    class State(NamedTuple):
        mu: torch.Tensor
        nu: torch.Tensor

    assert nonnegative_fields(nonnegative("nu")(State)) == {"nu"}
    assert nonnegative_fields(gtx.ScaleByAdamState) == {"nu"} and nonnegative_fields(tuple) == set()
    with pytest.raises(TypeError, match="nonnegative: State has no field 'sigma'"):
        nonnegative("sigma")(State)
    with pytest.raises(TypeError, match="nonnegative: dict is not a NamedTuple"):
        nonnegative("nu")(dict)


# --------------------------------------------------------------------------- checkpoints, wrap, compile, hyperparams


def test_the_seed_draws_the_4_bit_first_moments_rounding_only():
    """Two seeds store other 4-bit first-moment codes (the same seed, the same ones) and the same
    second-moment codes; 8-bit codes round to nearest and ignore the seed."""
    params, loss = _problem()
    grads = torch.func.grad(loss)(params)

    def codes(bits, seed):
        tx = gtx.quantize_state(gtx.adamw(1e-2), bits, seed=seed)
        state = tx.update(grads, tx.init(params), params)[1]
        return state.codes[0]["w"], state.codes[1]["w"]

    (mu_a, nu_a), (mu_b, nu_b), (mu_again, _) = codes(4, 0), codes(4, 1), codes(4, 0)
    assert not torch.equal(mu_a, mu_b) and torch.equal(mu_a, mu_again) and torch.equal(nu_a, nu_b)
    assert all(torch.equal(a, b) for a, b in zip(codes(8, 0), codes(8, 1)))


def test_state_round_trips_through_a_checkpoint_and_torch_load_weights_only():
    params, loss = _problem()
    tx = gtx.quantize_state(gtx.adamw(1e-2), 4)
    straight, _ = _run(tx, params, loss, 6)
    first, state = _run(tx, params, loss, 3)
    buffer = io.BytesIO()
    torch.save(gtx.checkpoint.state_dict(state, first), buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    template = tx.init(first)
    state = gtx.checkpoint.load_state_dict(template, loaded, first)
    for a, b in zip(gtx.tree.leaves(state), gtx.tree.leaves(_run(tx, params, loss, 3)[1])):
        assert (a is None and b is None) or (torch.equal(a, b) and a.dtype == b.dtype and a.shape == b.shape)
    resumed = first
    for _ in range(3):
        updates, state = tx.update(torch.func.grad(loss)(resumed), state, resumed)
        resumed = gtx.apply_updates(resumed, updates)
    assert all(torch.equal(resumed[k], straight[k]) for k in straight)


def _mlp(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.Tanh(), torch.nn.Linear(96, 4))


def _batch_loss(model, step):
    gen = torch.Generator().manual_seed(step)
    x, y = torch.randn(32, 64, generator=gen), torch.randn(32, 4, generator=gen)
    return ((model(x) - y) ** 2).mean()


def test_under_wrap_it_is_the_functional_step_and_its_state_dict_loads_with_weights_only(tmp_path):
    """``wrap(SGD(lr), quantize_state(scale_by_adam()))`` is quantized Adam; saving and loading
    the optimizer's state dict midway (``weights_only=True``) resumes the same run."""

    def make(model):
        return gtx.wrap(torch.optim.SGD(model.parameters(), lr=1e-2), gtx.quantize_state(gtx.scale_by_adam(), min_size=1000), model=model)

    straight = _mlp()
    opt = make(straight)
    functional = {k: v.detach().clone() for k, v in _mlp().named_parameters()}
    tx = gtx.chain(gtx.quantize_state(gtx.scale_by_adam(), min_size=1000), gtx.scale(-1e-2))
    state = tx.init(functional)
    for step in range(6):
        opt.zero_grad()
        _batch_loss(straight, step).backward()
        opt.step()
        grads = torch.func.grad(lambda p: _batch_loss(lambda x: torch.func.functional_call(straight, p, (x,)), step))(functional)
        updates, state = tx.update(grads, state, functional)
        functional = gtx.apply_updates(functional, updates)
    for name, p in straight.named_parameters():
        torch.testing.assert_close(p.detach(), functional[name], rtol=1e-5, atol=1e-6)

    first = _mlp()
    opt = make(first)
    for step in range(3):
        opt.zero_grad()
        _batch_loss(first, step).backward()
        opt.step()
    torch.save({"model": first.state_dict(), "opt": opt.state_dict()}, tmp_path / "ckpt.pt")
    checkpoint = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    resumed = _mlp(seed=7)
    resumed.load_state_dict(checkpoint["model"])
    opt = make(resumed)
    opt.load_state_dict(checkpoint["opt"])
    for step in range(3, 6):
        opt.zero_grad()
        _batch_loss(resumed, step).backward()
        opt.step()
    for a, b in zip(resumed.parameters(), straight.parameters()):
        assert torch.equal(a, b)


def test_compiled_step_equals_the_eager_step_bit_for_bit(bits=4):
    """The whole step traces as one graph (``fullgraph=True``) and computes what the eager step
    does, 4-bit codes (unpacked, looked up, packed) included. (Inductor's kernels round AdamW's arithmetic differently from eager, by an ulp, with or
    without quantized state; ``tests/test_compile_step.py`` checks that closeness.)"""
    torch._dynamo.reset()
    params, loss = _problem(64, 64)
    tx = gtx.quantize_state(gtx.adamw(1e-2, weight_decay=0.1), bits, min_size=1000)
    step = gtx.compile_step(tx, backend="aot_eager")
    state = eager_state = tx.init(params)
    eager = params
    for _ in range(3):
        grads = torch.func.grad(loss)(eager)
        params, state = step(grads, state, params)
        updates, eager_state = tx.update(grads, eager_state, eager)
        eager = gtx.apply_updates(eager, updates)
        for a, b in zip(gtx.tree.leaves((params, state)), gtx.tree.leaves((eager, eager_state))):
            assert (a is None and b is None) or (a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b))
    torch._dynamo.reset()


def test_a_learning_rate_changed_midway_takes_effect_under_inject_hyperparams():
    params, loss = _problem()

    def quantized_adamw(learning_rate):
        return gtx.quantize_state(gtx.adamw(learning_rate))

    outside = gtx.inject_hyperparams(quantized_adamw)(learning_rate=1e-2)
    inside = gtx.quantize_state(gtx.inject_hyperparams(gtx.adamw)(learning_rate=1e-2))
    for tx, hyperparams in ((outside, lambda s: s.hyperparams), (inside, lambda s: s.inner.hyperparams)):
        p, state = _run(tx, params, loss, 3)
        hyperparams(state)["learning_rate"].fill_(0.0)
        updates, state = tx.update(torch.func.grad(loss)(p), state, p)
        assert all(not u.any() for u in gtx.tree.leaves(updates))
        hyperparams(state)["learning_rate"].fill_(2e-2)  # twice the rate: twice the plain run's update
        twice, _ = tx.update(torch.func.grad(loss)(p), state, p)
        hyperparams(state)["learning_rate"].fill_(1e-2)
        once, _ = tx.update(torch.func.grad(loss)(p), state, p)
        torch.testing.assert_close(twice["w"], 2 * once["w"], rtol=1e-5, atol=1e-8)


def test_extra_arguments_reach_an_inner_transformation_that_takes_them():
    assert isinstance(gtx.quantize_state(gtx.lbfgs()), gtx.GradientTransformationExtraArgs)
    assert not isinstance(gtx.quantize_state(gtx.adam(1e-2)), gtx.GradientTransformationExtraArgs)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        (dict(bits=3), ValueError, "bits must be 8, 4, torch.bfloat16 or torch.float8_e4m3fn, got 3"),
        (dict(bits=True), ValueError, "bits must be"),
        (dict(bits=torch.float16), ValueError, r"bits must be .*, got torch\.float16"),
        (dict(block_size=0), ValueError, "block_size must be at least 1, got 0"),
        (dict(block_size=2.5), TypeError, "block_size must be an int, got float"),
        (dict(bits=torch.bfloat16, block_size=64), ValueError, "bfloat16 storage is a plain cast"),
        (dict(min_size=-1), ValueError, "min_size must be >= 0"),
        (dict(min_size="big"), TypeError, "min_size must be an int"),
        (dict(spec="tp"), TypeError, "spec must be a gradtx.sharding.ShardingSpec"),
        (dict(seed=1.5), TypeError, "seed must be an int, got float"),
    ],
)
def test_bad_arguments_are_clear_errors(kwargs, error, message):
    with pytest.raises(error, match="quantize_state: " + message):
        gtx.quantize_state(gtx.adam(1e-2), **kwargs)


def test_bad_inner_and_non_tensor_params_are_clear_errors():
    with pytest.raises(TypeError, match="quantize_state: inner must be a GradientTransformation, got function"):
        gtx.quantize_state(gtx.adam)
    with pytest.raises(TypeError, match="'w'"):
        gtx.quantize_state(gtx.adam(1e-2)).init({"w": 1.0})


@pytest.mark.parametrize("other", [dict(bits=8, block_size=160), dict(bits=4, block_size=128), dict(bits=torch.float8_e4m3fn, block_size=256)])
def test_a_state_stored_otherwise_is_refused_by_update_and_by_a_checkpoint(other):
    """Codes of blocks of 256 read as blocks of 160 are other numbers, yet a row of 300 values
    has two blocks either way: the codes and scales have the same shapes. The state records how
    it was stored (``stored_as``, an empty tensor shaped ``(bits, block_size, 0)``): ``update``
    refuses another, and so does a checkpoint's manifest."""
    params = {"w": torch.randn(8, 300), "v": torch.randn(8, 1)}
    grads = {k: torch.randn_like(v) for k, v in params.items()}
    saved_tx = gtx.quantize_state(gtx.adamw(1e-3), 8, block_size=256, min_size=1)
    state = saved_tx.init(params)
    _, state = saved_tx.update(grads, state, params)
    assert tuple(state.stored_as.shape) == (8, 256, 0) and state.stored_as.numel() == 0
    tx = gtx.quantize_state(gtx.adamw(1e-3), **other, min_size=1)
    match = "stored_as" if other["bits"] == 8 else None  # other formats differ in their codes' shape or dtype too
    with pytest.raises(ValueError, match=match):
        tx.update(grads, state, params)
    with pytest.raises(ValueError, match=match):
        gtx.checkpoint.load_state_dict(tx.init(params), gtx.checkpoint.state_dict(state, params), params)
    again = gtx.checkpoint.load_state_dict(saved_tx.init(params), gtx.checkpoint.state_dict(state, params), params)
    saved_tx.update(grads, again, params)  # the same storage loads and steps


def test_a_state_with_another_storage_mark_is_refused_with_both_storages_named():
    params = {"w": torch.randn(4, 300)}
    tx = gtx.quantize_state(gtx.adamw(1e-3), 8, block_size=160, min_size=1)
    state = tx.init(params)
    forged = state._replace(stored_as=torch.empty(8, 256, 0, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"stored_as says .*8-bit codes in blocks of 256.*8-bit codes in blocks of 160"):
        tx.update(params, forged, params)
