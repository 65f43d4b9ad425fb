"""The Adam step on moments stored in 8 bits (gradtx/native/stored_adam.py, adam.c): the numbers of
reading the moments back, stepping them and storing them again.

Checked: for random trees (leaves kept in float32 beside stored ones, 0-d, partial last blocks),
decays, learning rates and weight decays (numbers, schedules, masks), block sizes and donation
modes, three steps of ``quantize_state(adamw(...), 8)`` give the same updates, codes, scales and
float32 leaves as the ATen ops, bit for bit, with one kernel call per stored leaf and step; the
same at one and two threads; the route is not taken where it could change a number; its check
refuses a kernel one float32 step off, and one that leaves a clip's coefficient out.
"""

from __future__ import annotations


import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import gradtx as gtx
from gradtx import tree as tree_lib
from gradtx.native import adam as native_adam
from gradtx.native import build, checks, stored_adam
from gradtx.transforms.adam import fused_adam
from native_helpers import NEEDS_KERNELS, donated_run, equal_bits, in_threads, lerp_at_one_safe, probe_values

pytestmark = NEEDS_KERNELS


def _calls() -> int:
    return stored_adam.usable().calls


def _run(tx, params, grads_per_step, inplace):
    out, state = donated_run(tx, params, grads_per_step, inplace)
    return [x for x in tree_lib.leaves((out, state)) if x is not None]


_SHAPES = st.sampled_from([(), (5,), (300,), (3, 700), (2049,), (4, 3, 100), (70_001,)])


@settings(max_examples=30, deadline=None)
@given(
    shapes=st.lists(_SHAPES, min_size=1, max_size=3),
    b1=st.sampled_from([0.0, 0.5, 0.9]),
    b2=st.sampled_from([0.0, 0.95, 0.999]),
    lr=st.sampled_from([1e-3, 0.3, "schedule"]),
    wd=st.sampled_from([None, 0.1, "schedule"]),
    masked=st.booleans(),
    block_size=st.sampled_from([1, 64, 256, 2048]),
    min_size=st.sampled_from([1, 301]),
    inplace=st.sampled_from([False, True, "updates"]),
    seed=st.integers(0, 2**16),
)
def test_the_steps_equal_the_aten_ops_bit_for_bit(shapes, b1, b2, lr, wd, masked, block_size, min_size, inplace, seed):
    params = {f"p{i}": probe_values(s, seed + i) for i, s in enumerate(shapes)}
    grads = [{k: probe_values(p.shape, seed + 100 * t + i) for i, (k, p) in enumerate(params.items())} for t in range(3)]
    if b1 == 0.0:  # ATen's lerp signs a -0.0 end by position at weight 1 (native_helpers.lerp_at_one_safe)
        grads = [lerp_at_one_safe(g) for g in grads]
    learning_rate = (lambda count: 0.1 / (1.0 + count)) if lr == "schedule" else lr
    weight_decay = (lambda count: 0.01 * count) if wd == "schedule" else wd
    mask = {k: i % 2 == 0 for i, k in enumerate(params)} if masked and wd is not None else None
    make = lambda: gtx.quantize_state(  # noqa: E731
        fused_adam(learning_rate, b1, b2, weight_decay=weight_decay, mask=mask), 8, block_size=block_size, min_size=min_size
    )
    with checks.aten_only():
        want = _run(make(), params, grads, inplace)
    before = _calls()
    got = _run(make(), params, grads, inplace)
    stored = sum(1 for p in params.values() if p.numel() >= min_size)
    assert _calls() == before + 3 * stored
    assert len(want) == len(got)
    for a, b in zip(want, got):
        assert equal_bits(a, b)


def test_adamw_applied_over_steps_takes_the_route_and_keeps_the_numbers():
    params = {"w": probe_values((64, 512), 1), "b": probe_values((512,), 2), "e": probe_values((1000, 96), 3)}
    tx = gtx.quantize_state(gtx.adamw(1e-2, weight_decay=0.1), 8)

    def train():
        p, state = dict(params), tx.init(params)
        for t in range(4):
            grads = {k: probe_values(v.shape, 10 * t + i) * 1e-2 for i, (k, v) in enumerate(p.items())}
            updates, state = tx.update(grads, state, p)
            p = gtx.apply_updates(p, updates)
        return [x for x in tree_lib.leaves((p, state)) if x is not None]

    with checks.aten_only():
        want = train()
    before = _calls()
    got = train()
    assert _calls() == before + 4 * 2  # "b" (512 values) stays in float32
    for a, b in zip(want, got):
        assert equal_bits(a, b)


def test_the_same_numbers_at_one_and_two_threads():
    params = {"w": probe_values((300, 1000), 5)}
    grads = [{"w": probe_values((300, 1000), 6)}] * 2
    tx = gtx.quantize_state(gtx.adamw(1e-3, weight_decay=0.1), 8)
    threads = torch.get_num_threads()
    results = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            results.append(_run(tx, params, grads, False))
    finally:
        torch.set_num_threads(threads)
    for one, two in zip(*results):
        assert equal_bits(one, two)


@pytest.mark.parametrize(
    "case",
    ["4 bits", "bfloat16 storage", "nesterov", "eps_root", "bf16 mu", "a chain", "blocks over 2048", "a recorded graph",
     "bfloat16 gradients", "a transposed gradient", "one gradient twice", "a gradient that is the param"],
)
def test_the_route_is_not_taken_where_it_could_change_a_number(case):
    w = probe_values((64, 128), 7)
    g = probe_values((64, 128), 8)
    params, grads = {"w": w, "v": w + 1}, {"w": g, "v": g + 1}
    inner, bits, block_size = gtx.adamw(1e-3, weight_decay=0.1), 8, None
    if case == "4 bits":
        bits = 4
    elif case == "bfloat16 storage":
        bits = torch.bfloat16
    elif case == "nesterov":
        inner = gtx.adamw(1e-3, nesterov=True)
    elif case == "eps_root":
        inner = gtx.adam(1e-3, eps_root=1e-8)
    elif case == "bf16 mu":
        inner = gtx.adamw(1e-3, mu_dtype=torch.bfloat16)
    elif case == "a chain":
        inner = gtx.chain(gtx.scale_by_adam(), gtx.scale(-1e-3))
    elif case == "blocks over 2048":
        block_size = 4096
    elif case == "a recorded graph":
        grads = {k: v.requires_grad_() for k, v in grads.items()}
    elif case == "bfloat16 gradients":
        grads = {k: v.bfloat16() for k, v in grads.items()}
    elif case == "a transposed gradient":
        grads = {k: v.t().contiguous().t() for k, v in grads.items()}
    elif case == "one gradient twice":
        grads = {"w": g, "v": g}
    elif case == "a gradient that is the param":
        grads = {"w": w, "v": g}
    tx = gtx.quantize_state(inner, bits, block_size=block_size, min_size=1)
    state = tx.init(params)
    before = _calls()
    updates, _ = tx.update(grads, state, params)
    assert _calls() == before
    assert all(torch.isfinite(u).any() for u in updates.values())


def test_the_route_is_declared_by_the_adam_aliases_alone():
    assert stored_adam.declared(gtx.adam(1e-3).update) and stored_adam.declared(gtx.adamw(1e-3).update)
    assert not stored_adam.declared(gtx.adamw(1e-3, nesterov=True).update)
    assert not stored_adam.declared(gtx.adam(torch.tensor(1e-3), b1=torch.tensor(0.9)).update)
    assert not stored_adam.declared(gtx.lion(1e-3).update)


def test_the_check_refuses_a_kernel_whose_numbers_differ_or_that_leaves_a_clips_coefficient_out():
    lib, _ = build.load("adam")

    class OffByOne(stored_adam._Kernel):  # b2 one float32 step off
        def __call__(self, g, p, moments, out, uo, floats, decay, tables, grad_scale=None):
            floats = list(floats)
            floats[1] = float(torch.nextafter(torch.tensor(floats[1]), torch.tensor(0.0)))
            super().__call__(g, p, moments, out, uo, tuple(floats), decay, tables, grad_scale)

    class Unscaled(stored_adam._Kernel):  # leaves a clip's coefficient out
        def __call__(self, g, p, moments, out, uo, floats, decay, tables, grad_scale=None):
            super().__call__(g, p, moments, out, uo, floats, decay, tables, None)

    assert "values of" in stored_adam._mismatch(OffByOne(lib, native_adam.usable()))
    assert "coefficient=0.3711" in stored_adam._mismatch(Unscaled(lib, native_adam.usable()))
    assert stored_adam._mismatch(stored_adam._Kernel(lib, native_adam.usable())) == ""


def test_a_check_started_within_another_leaves_it_in_place():
    first, second = stored_adam._Kernel(build.load("adam")[0], native_adam.usable()), object()
    with checks.checking(first):
        with checks.checking(second):
            assert checks.under_check(stored_adam._Kernel) is None
        assert checks.under_check(stored_adam._Kernel) is first
    assert checks.under_check(stored_adam._Kernel) is None


def test_threads_stepping_at_once_get_the_numbers_of_steps_one_after_another():
    """The stored moments of a step are kept per thread: several Python threads may step quantized
    states at once, each with its own placeholders and results."""
    trees = [({"w": probe_values((100, 1000), 20 + i)}, {"w": probe_values((100, 1000), 40 + i)}) for i in range(4)]
    tx = gtx.quantize_state(gtx.adamw(1e-3, weight_decay=0.1), 8)
    alone = [_run(tx, params, [grads, grads], False) for params, grads in trees]
    before = _calls()
    together = in_threads(lambda i: _run(tx, trees[i][0], [trees[i][1], trees[i][1]], False), len(trees))
    assert _calls() >= before + 2 * len(trees)
    for one, other in zip(alone, together):
        assert len(one) == len(other)
        for want, got in zip(one, other):
            assert equal_bits(want, got)


def test_a_step_of_many_stored_leaves_recycles_the_outputs_of_the_step_before_the_last(monkeypatch):
    """All stored leaves of a step take their outputs in one call of the buffer pool: called once
    per leaf, a tree of more leaves than the pool keeps calls of (8) found none of the last step's
    storages free, and faulted every new code and update in again (the 124M tree: 50,000 page
    faults a step)."""
    from gradtx import buffer_pool

    assert stored_adam.usable() is not None  # its check, which steps probes, done before counting
    calls = []
    outputs = buffer_pool.outputs
    monkeypatch.setattr(buffer_pool, "outputs", lambda site, *groups: calls.append(site) or outputs(site, *groups))
    buffer_pool.release_buffers()
    leaves = 12  # over buffer_pool._EAGER_GENERATIONS; each leaf's codes over RECYCLE_MIN_BYTES
    params = {f"w{i}": probe_values((128, 1100), i) for i in range(leaves)}
    grads = {k: probe_values(v.shape, 50 + i) * 1e-2 for i, (k, v) in enumerate(params.items())}
    tx = gtx.quantize_state(gtx.adamw(1e-3, weight_decay=0.1), 8)
    state, p, seen = tx.init(params), params, []
    for _ in range(5):
        del calls[:]
        updates, state = tx.update(grads, state, p)
        assert calls.count("stored_adam") == 1
        seen.append({t.untyped_storage().data_ptr() for t in tree_lib.leaves((updates, state.codes))})
        p = gtx.apply_updates(p, updates, donate_updates=True)
        del updates
    assert len(seen[-1]) == 3 * leaves
    assert seen[-1] <= seen[0] | seen[1] | seen[2], "a step after the third wrote into storages the pool never held"
