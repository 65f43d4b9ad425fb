"""Quantized state, fast: a group of leaves at a time, and the code books' compiled loops.

``quantize_state`` over an elementwise inner transformation (Adam, Lion, momentum) steps a few
leaves, or ranges of rows of a large leaf, at a time; checked here bit for bit against the
whole-tree step (the same inner transformation unmarked), and for its peak memory against fp32
AdamW's (torch's profiler, as ``benchmarks/memory.py`` measures it). The compiled code book loops
give the eager codes and values bit for bit, and a quantized step compiles with Inductor.
"""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import gradtx as gtx
from gradtx import tree as tree_lib
from gradtx.base import is_elementwise
from gradtx.quantization import kernels, maps, streaming

FORMATS = (8, 4, torch.bfloat16, torch.float8_e4m3fn)


def _whole(inner: gtx.GradientTransformation) -> gtx.GradientTransformation:
    """``inner`` without its elementwise mark: ``quantize_state`` then steps the whole tree at once."""
    return gtx.GradientTransformation(inner.init, lambda updates, state, params=None, **kw: inner.update(updates, state, params, **kw))


def _tree(seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    shapes = {"rows": (40, 300), "flat": (5000,), "long_rows": (3, 2000), "small": (7,), "square": (64, 64)}
    return {name: torch.randn(shape, generator=gen) for name, shape in shapes.items()}


def _steps(tx, grads_dropped: str = "", steps: int = 3) -> list:
    """``steps`` pure steps from :func:`_tree`; the gradient of ``grads_dropped`` is ``None`` on the second."""
    params, state, seen = _tree(), None, []
    state = tx.init(params)
    for k in range(steps):
        grads = {name: g * 1e-2 for name, g in _tree(k + 1).items()}
        if k == 1 and grads_dropped:
            grads[grads_dropped] = None
        updates, state = tx.update(grads, state, params)
        seen.append((updates, state))
        params = gtx.apply_updates(params, {n: u if u is not None else torch.zeros_like(params[n]) for n, u in updates.items()})
    return seen


def _assert_identical(a, b) -> None:
    for x, y in zip(tree_lib.leaves(a), tree_lib.leaves(b), strict=True):
        assert (x is None and y is None) or (x.shape == y.shape and x.dtype == y.dtype and torch.equal(x, y))


MAKERS = {
    "adamw": lambda: gtx.adamw(1e-2, weight_decay=0.1),
    "lion": lambda: gtx.lion(1e-3, weight_decay=0.1),
    "sgd_momentum": lambda: gtx.sgd(1e-2, momentum=0.9, nesterov=True),
}


@pytest.mark.parametrize("bits", FORMATS, ids=str)
@pytest.mark.parametrize("make", list(MAKERS))
def test_a_step_in_groups_and_row_ranges_is_the_whole_tree_step_bit_for_bit(monkeypatch, bits, make):
    # groups of 1000 values: "rows" in runs of 3 rows, "flat" and "long_rows" in runs of whole blocks
    # of a row, "small" (not stored) and "square" whole; a gradient missing on one step. At 4 bits
    # the first moments round stochastically: a range of rows draws its elements' logical indices' bits
    monkeypatch.setattr(streaming, "GROUP_SIZE", 1000)
    inner = MAKERS[make]()
    calls = []

    def counted(updates, state, params=None, **kw):
        calls.append(sum(1 for g in tree_lib.leaves(updates) if g is not None))
        return inner.update(updates, state, params, **kw)

    assert is_elementwise(inner)
    grouped = gtx.quantize_state(inner, bits, min_size=100)
    for dropped in ("", "flat"):
        _assert_identical(_steps(grouped, dropped), _steps(gtx.quantize_state(_whole(inner), bits, min_size=100), dropped))
    traced = gtx.quantize_state(gtx.GradientTransformation(inner.init, gtx.base.set_elementwise(counted)), bits, min_size=100)
    _steps(traced, steps=1)
    assert len(calls) > 20 and max(calls) <= 2  # one leaf or a piece of one per call, with "small" in a group


@pytest.mark.parametrize("make", list(MAKERS))
def test_a_donated_state_steps_its_counts_once_whatever_the_groups(monkeypatch, make):
    # each group's inner update steps the counts of a donated state in place: every group must
    # start from their values before the step, or Adam's count (its bias correction) runs ahead
    monkeypatch.setattr(streaming, "GROUP_SIZE", 1000)
    inner = MAKERS[make]()
    streamed = gtx.quantize_state(gtx.GradientTransformation(inner.init, gtx.base.set_elementwise(inner.update)), 8, min_size=100)
    params = _tree(0)
    results = []
    for inplace in (False, True):
        state = streamed.init(params)
        for k in range(3):
            grads = {name: g * 1e-2 for name, g in _tree(k + 1).items()}
            updates, state = streamed.update(grads, state, params, inplace=inplace)
        results.append((updates, state))
    _assert_identical(results[0], results[1])
    counts = [int(x) for x in tree_lib.leaves(results[1][1].inner) if isinstance(x, torch.Tensor) and x.ndim == 0]
    assert all(c == 3 for c in counts) and (counts or make != "adamw")


def test_elementwise_marks():
    # what quantize_state may step a few leaves at a time, and what it must not: a global-norm
    # clip sees every leaf (a leaf at a time it would clip by each leaf's norm), a mask made from
    # the params sees them all
    assert all(is_elementwise(tx) for tx in (gtx.adamw(1e-2), gtx.adam(1e-2), gtx.lion(1e-3), gtx.sgd(1e-2, momentum=0.9), gtx.sgd(1e-2)))
    assert is_elementwise(gtx.chain(gtx.scale_by_adam(), gtx.add_decayed_weights(0.1, mask={"w": True}), gtx.scale(-1e-3)))
    assert not is_elementwise(gtx.chain(gtx.clip_by_global_norm(1.0), gtx.adamw(1e-2)))
    assert not is_elementwise(gtx.adamw(1e-2, mask=lambda p: {k: True for k in p}))
    assert not is_elementwise(gtx.inject_hyperparams(gtx.adamw)(learning_rate=1e-2))


def _peak_bytes(step) -> int:
    """The peak, during ``step()``, of the CPU tensor memory allocated above what was live before it
    (torch's profiler: each top-level op's allocations less its frees, in time order)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    live = peak = 0
    for event in sorted((e for e in prof.events() if e.cpu_parent is None), key=lambda e: e.time_range.start):
        live += event.cpu_memory_usage
        peak = max(peak, live)
    return peak


@pytest.mark.parametrize("bits", [8, 4])
def test_a_whole_tree_quantized_step_peaks_below_an_fp32_step(monkeypatch, bits):
    # a pure fp32 AdamW step holds new moments and updates (3 trees); a quantized one the updates,
    # the new codes and one group's float32 moments and temporaries (the whole-tree step: 7.2
    # trees). Measured (eager loops): 8 bits 2.67 trees with the default groups (an eighth of the
    # tree), 2.2 with groups of 2**16 values; 4 bits 2.3 and 1.9 (the stochastically rounded first
    # moments are encoded 2**14 values at a time)
    monkeypatch.setenv(kernels.ENVIRONMENT, "0")
    monkeypatch.setenv("GRADTX_RECYCLE", "0")  # the memory each step needs, none of it recycled
    gen = torch.Generator().manual_seed(0)
    shapes = {"embedding": (1024, 256), "qkv": (256, 768), "proj": (256, 256), "fc": (256, 1024), "out": (1024, 256), "bias": (256,)}
    params = {name: torch.randn(shape, generator=gen) for name, shape in shapes.items()}
    grads = {name: torch.randn(shape, generator=gen) * 1e-2 for name, shape in shapes.items()}
    tree_bytes = sum(p.numel() * 4 for p in params.values())

    def peak(tx) -> int:
        state = tx.init(params)
        _, state = tx.update(grads, state, params)
        return _peak_bytes(lambda: tx.update(grads, state, params))

    fp32 = peak(gtx.adamw(1e-3))
    assert fp32 >= 2.9 * tree_bytes
    assert peak(gtx.quantize_state(gtx.adamw(1e-3), bits)) < 0.95 * fp32
    monkeypatch.setattr(streaming, "GROUP_SIZE", 1 << 16)
    assert peak(gtx.quantize_state(gtx.adamw(1e-3), bits)) < 0.8 * fp32


# --------------------------------------------------------------------------- compiled loops


def test_compiled_code_book_loops_give_the_eager_codes_and_values(monkeypatch):
    """``GRADTX_QUANTIZE_COMPILE=1`` compiles at every size; the codes, values and absmax equal the
    eager ones, in both maps, for values at the midpoints, zeros (of both signs), NaN and inf."""
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, 3, 64, generator=gen) * torch.logspace(-9, 0, 64)
    x[0, 0, :4] = torch.tensor([0.0, -0.0, float("nan"), float("inf")])
    for bits in (8, 4):
        codec = maps.codec(bits)
        half = codec._midpoints[: codec._offset - 1]  # the signed map's non-negative midpoints: ties
        x[1] = 0.0
        x[1, :, : min(63, len(half))] = half[:63]
        x[1, :, 63] = 1.0
        scales = kernels.absmax(x)
        scales[::2] = -scales[::2]  # blocks of rows 0, 2, 4 read with the signed map
        monkeypatch.setenv(kernels.ENVIRONMENT, "0")
        eager = (kernels.absmax(x), codec.codes(x, scales), codec.values(codec.codes(x, scales), scales))
        monkeypatch.setenv(kernels.ENVIRONMENT, "1")
        compiled = (kernels.run(kernels.absmax, x), codec.codes(x, scales), codec.values(eager[1], scales))
        assert kernels.table_codes in kernels._compiled and kernels.table_codes not in kernels._failed
        for a, b in zip(eager, compiled):
            assert a.dtype == b.dtype
            torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
        # a NaN block's absmax to the sign bit too (a set one would name the signed map)
        assert torch.equal(eager[0].view(torch.int32) < 0, compiled[0].view(torch.int32) < 0)
        assert not bool((compiled[0].view(torch.int32) < 0).any())
    torch._dynamo.reset()


def test_compiled_loops_read_the_sign_bit_as_an_integer():
    # Inductor writes torch.signbit as a loop over std::signbit, on which g++ 12 has failed with an
    # internal compiler error (lshiftrt:V2SI, cmath:662) when it vectorizes it: the loops avoid it
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    codec = maps.codec(8)
    x, scales = torch.randn(4, 2, 256), -torch.ones(4, 2)
    args = (codec._first, codec._midpoints, codec._zero, codec._offset)
    _, sources = run_and_get_code(torch.compile(kernels.table_codes, dynamic=True), x, scales, *args)
    _, more = run_and_get_code(torch.compile(kernels.table_values, dynamic=True), codec.codes(x, scales), scales, codec._joint, 256)
    assert sources and more and not any("signbit" in source for source in sources + more)
    torch._dynamo.reset()


@pytest.mark.parametrize("bits", [8, 4])
def test_a_traced_quantized_step_is_one_whole_tree_step_without_piece_copies(monkeypatch, bits):
    # Eagerly the step below goes a piece at a time (calls of inner.update counted: 8 pieces of
    # 256 rows of "w", then "b"), and at 4 bits draws the first moments' random bits 64 rows at a
    # time. Traced, pieces and ranges bring nothing (the compiler lays out the loops and buffers)
    # and cost a copy of each into its leaf's new tensors: Inductor then made a 1M-value leaf's
    # 8-bit step 10x slower (162 against 15 ns a value), and the ranges unrolled into the graph. So
    # a traced step is the whole-tree one: one call of inner.update, no copy into a part of a
    # tensor in the graph, the eager numbers.
    monkeypatch.setattr(streaming, "GROUP_SIZE", 1 << 16)
    gen = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(2048, 256, generator=gen), "b": torch.randn(256, generator=gen)}
    grads = {n: torch.randn(p.shape, generator=gen) * 1e-2 for n, p in params.items()}
    inner, calls = gtx.adamw(1e-2, weight_decay=0.1), []

    def counted(updates, state, params=None, **kw):
        calls.append(1)
        return inner.update(updates, state, params, **kw)

    tx = gtx.quantize_state(gtx.GradientTransformation(inner.init, gtx.base.set_elementwise(counted)), bits, min_size=1024)
    state = tx.init(params)
    eager_updates, eager_state = tx.update(grads, state, params)
    assert len(calls) == 9
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    calls.clear()
    updates, new_state = torch.compile(tx.update, backend=backend, fullgraph=True)(grads, state, params)
    torch._dynamo.reset()
    assert len(calls) == 1 and len(graphs) == 1
    targets = [str(node.target) for node in graphs[0].graph.nodes if node.op in ("call_method", "call_function")]
    assert not [t for t in targets if any(word in t for word in ("copy_", "slice_scatter", "setitem"))], targets
    _assert_identical((updates, new_state), (eager_updates, eager_state))


def _compiled_and_eager(tx, params: dict, gen: torch.Generator, steps: int = 2):
    """``(params, state)`` after ``steps`` steps of ``compile_step(tx)`` and after as many eager
    steps, on the same random gradients."""
    step = gtx.compile_step(tx)
    state = eager_state = tx.init(params)
    eager = params
    for _ in range(steps):
        grads = {n: torch.randn(p.shape, generator=gen) for n, p in params.items()}
        params, state = step(grads, state, params)
        updates, eager_state = tx.update(grads, eager_state, eager)
        eager = gtx.apply_updates(eager, updates)
    return params, state, eager, eager_state


def test_a_quantized_step_compiles_with_inductor_and_tracks_the_eager_step(monkeypatch):
    """``compile_step`` (Inductor, C++ on CPU) of a two-layer quantized AdamW step: the codes equal
    the eager step's but where Inductor's AdamW arithmetic, an ulp off, moves a value across a
    midpoint (see ``tests/test_compile_step.py``); the params agree to float32 rounding."""
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(0)
    params = {f"layer{i}.weight": torch.randn(64, 128, generator=gen) for i in range(2)}
    tx = gtx.quantize_state(gtx.adamw(1e-2, weight_decay=0.1), 8, min_size=1024)
    params, state, eager, eager_state = _compiled_and_eager(tx, params, gen)
    for name in params:
        torch.testing.assert_close(params[name], eager[name], rtol=1e-6, atol=1e-6)
        for part in (0, 1):
            same = (state.codes[part][name] == eager_state.codes[part][name]).float().mean().item()
            assert same > 0.99
            torch.testing.assert_close(state.scales[part][name], eager_state.scales[part][name])
    torch._dynamo.reset()


@pytest.mark.parametrize("bits", [8, 4])
def test_a_compiled_step_writes_the_partial_last_blocks(bits):
    """Leaves whose rows end in a partial block: Inductor (2.13, 2.14) compiled the padded view's
    elementwise loop over whole blocks only, and the last partial block's values were never
    written (garbage params, a scale of -0.0 or -8e19). The traced step now takes such pieces a run
    of whole blocks and the partial ones apart: the eager step's params, to float32 rounding."""
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(1)
    params = {"flat": torch.randn(5000, generator=gen), "rows": torch.randn(3, 2000, generator=gen), "small": torch.randn(5, generator=gen)}
    tx = gtx.quantize_state(gtx.adamw(1e-2, weight_decay=0.1), bits, min_size=1024)
    params, state, eager, eager_state = _compiled_and_eager(tx, params, gen)
    for name in params:
        torch.testing.assert_close(params[name], eager[name], rtol=1e-6, atol=1e-6)
    for part in (0, 1):
        for name in ("flat", "rows"):
            torch.testing.assert_close(state.scales[part][name], eager_state.scales[part][name])
    torch._dynamo.reset()


def test_a_compiled_step_with_no_leaf_stored_equals_the_eager_step():
    """Every leaf below ``min_size``: the codes and scales are trees of ``None``. Traced, Dynamo
    takes such a tree's structure for another one than the state's, and the step raised "the state
    holds codes for 2 params-shaped parts ... but its inner state has 0"."""
    torch._dynamo.reset()
    params = {"w": torch.randn(7, 30), "b": torch.randn(30)}
    tx = gtx.quantize_state(gtx.adamw(1e-2), 8)
    grads = {k: torch.randn(p.shape) for k, p in params.items()}
    compiled, state = gtx.compile_step(tx, backend="eager")(grads, tx.init(params), params)
    updates, eager_state = tx.update(grads, tx.init(params), params)
    eager = gtx.apply_updates(params, updates)
    assert all(torch.equal(compiled[k], eager[k]) for k in params)
    assert tree_lib.structure(state) == tree_lib.structure(eager_state)
    torch._dynamo.reset()
