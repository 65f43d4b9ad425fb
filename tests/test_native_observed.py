"""What gradtx.observe reads in the step's own passes (gradtx/native/observed.c, squares.h and the
Adam kernel's tally).

Checked: the observed scaling gives ATen's products bit for bit, with ``aminmax``'s ``max |x|`` and
the exact non-finite count; the Adam kernel's tally equals the standalone sums bit for bit (every
decay, sizes around the blocks, one or two threads); a tally is not read for a tensor changed
since; observe's statistics with the kernels match dense float64 references and leave the updates
untouched; the statistics take no pass of their own over the gradients, params or updates of a
``chain(clip, adamw)`` step; the check refuses a kernel whose product is off.
"""

from __future__ import annotations

import ctypes
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import gradtx as gtx
from gradtx.native import adam as native_adam
from gradtx.native import checks
from gradtx.native import observed
from gradtx.sharding import statistics as stats_lib
from native_helpers import NEEDS_KERNELS, equal_bits, probe_values

pytestmark = NEEDS_KERNELS


def _kernel():
    kernel = observed.usable()
    assert kernel is not None, observed.status()
    return kernel


@settings(max_examples=40, deadline=None)
@given(
    shapes=st.lists(st.sampled_from([(), (0,), (1,), (31,), (2049,), (3, 700), (70_001,)]), min_size=1, max_size=3),
    factor=st.sampled_from([0.0, 1.0, 0.37, 1e-30, 3.5e-5, -0.5, 3.5, float("nan")]),
    inplace=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_observed_scaling_is_atens_product_with_its_extremes(shapes, factor, inplace, seed):
    tensors = [probe_values(s, seed + i) for i, s in enumerate(shapes)]
    coef = torch.tensor(factor, dtype=torch.float32)
    want = [torch.mul(t, coef) for t in tensors]
    want_max, _ = stats_lib.extremes_of(tensors, torch.device("cpu"))
    want_count = torch.tensor([float((~torch.isfinite(t)).sum()) for t in tensors], dtype=torch.float64)
    given_tensors = [t.clone() for t in tensors]
    done = observed.scale_observed(given_tensors, coef, inplace=inplace)
    if inplace and not abs(factor) <= 1.0:  # its count reads the products: declined
        assert done is None
        return
    out, maxima, counts = done
    for w, o, g in zip(want, out, given_tensors):
        assert equal_bits(w, o)
        assert (o is g) == inplace
    assert equal_bits(want_max, maxima) and torch.equal(counts, want_count)


def test_observed_scaling_declines_what_it_cannot_take():
    coef = torch.tensor(0.5)
    x = torch.randn(8, 4)
    assert observed.scale_observed([x.t()], coef, inplace=False) is None  # not row-major
    assert observed.scale_observed([x.double()], coef.double(), inplace=False) is None
    assert observed.scale_observed([x, x[1]], coef, inplace=True) is None  # shared memory
    assert observed.scale_observed([x], coef.double(), inplace=False) is None  # a float64 factor
    assert observed.scale_observed([x.requires_grad_()], coef, inplace=False) is None
    with checks.aten_only():
        assert observed.scale_observed([torch.randn(3)], coef, inplace=False) is None


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("decay", [native_adam.DECAY_NONE, native_adam.DECAY_FMA, native_adam.DECAY_PRODUCT])
def test_the_adam_kernels_tally_is_the_standalone_sum_bit_for_bit(decay, threads):
    kernel, before = native_adam.usable(), torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for n in (0, 1, 31, 33, 2047, 2048, 2049, 70_001):
            g, m, v, p = (probe_values((n,), 10 * n + k) for k in range(4))
            v = v.abs()
            outs = [torch.empty(n) for _ in range(3)]
            sums = (ctypes.c_double * 2)()
            kernel(g, m, v, p, *outs, 0.1, 0.999, 0.001, 1e-8, -1e-3, 0.01, decay, sums)
            plain = [torch.empty(n) for _ in range(3)]
            kernel(g, m, v, p if decay else None, *plain, 0.1, 0.999, 0.001, 1e-8, -1e-3, 0.01, decay)
            assert all(equal_bits(a, b) for a, b in zip(outs, plain)), n  # the tally changes no number
            for total, x in zip(sums, (outs[2], p)):
                standalone = observed.squares(x)
                assert total == standalone or (math.isnan(total) and math.isnan(standalone)), (n, total, standalone)
    finally:
        torch.set_num_threads(before)


def test_sums_of_squares_are_float64_references_to_float32_rounding_whatever_the_threads():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1_000_003, generator=gen) * torch.exp(torch.randn(1_000_003, generator=gen) * 3)
    before, totals = torch.get_num_threads(), []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            totals.append(observed.squares(x))
    finally:
        torch.set_num_threads(before)
    assert totals[0] == totals[1]
    exact = float(x.double().square().sum())
    assert abs(totals[0] - exact) <= 1e-5 * exact  # float32 sums of at most 128 squares, then float64


def test_a_tally_holds_only_for_the_same_unchanged_tensor():
    tally = observed.Tally()
    x = torch.ones(4)
    tally.record(x, 4.0)
    assert tally.squares(x) == 4.0
    assert tally.squares(torch.ones(4)) is None  # another tensor, equal or not
    x.mul_(2.0)
    assert tally.squares(x) is None
    tally.record(x, -1.0)  # the kernel could not take it
    assert tally.squares(x) is None


def test_kernels_writing_in_place_mark_the_tensor_changed():
    g, m, v = torch.randn(5000), torch.randn(5000), torch.rand(5000)
    versions = [t._version for t in (g, m, v)]
    tx = gtx.scale_by_adam()
    state = tx.init({"w": g})
    state = state._replace(mu={"w": m}, nu={"w": v})
    calls = native_adam.usable().calls
    tx.update({"w": g}, state, inplace=True)
    assert native_adam.usable().calls == calls + 1
    assert all(t._version > before for t, before in zip((g, m, v), versions))


def _observed_steps(tx, params, grads, steps=3, inplace=False):
    state, p, updates = tx.init(params), params, None
    for _ in range(steps):
        donated = {k: g.clone() for k, g in grads.items()}
        updates, state = tx.update(donated, state, p, inplace=inplace)
        p = gtx.apply_updates(p, updates)
    return updates, state


def _clipped_adamw(learning_rate):
    return gtx.chain(gtx.clip_by_global_norm(1.0), gtx.adamw(learning_rate, weight_decay=0.1))


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize(
    "inner",
    [
        lambda: gtx.chain(gtx.clip_by_global_norm(1.0), gtx.adamw(1e-2, weight_decay=0.1)),
        lambda: gtx.chain(gtx.clip_by_global_norm(1.0), gtx.adam(1e-2), gtx.scale(0.5)),  # changed after the tally
        lambda: gtx.adamw(1e-2, weight_decay=0.1),  # no clip: the ATen extremes
        lambda: gtx.chain(gtx.clip_by_global_norm(1.0), gtx.sgd(1e-2, momentum=0.9)),
        lambda: gtx.inject_hyperparams(_clipped_adamw)(learning_rate=1e-2),  # the clip found inside
    ],
    ids=["clip_adamw", "clip_adam_scale", "adamw", "clip_sgd", "injected"],
)
@pytest.mark.parametrize("bad", [None, float("inf"), float("nan")], ids=["finite", "inf", "nan"])
def test_observed_statistics_with_the_kernels_equal_the_aten_ops_to_rounding(inner, inplace, bad):
    # an infinity makes the clip's coefficient 0, a NaN makes it NaN (in place: the ATen ops)
    gen = torch.Generator().manual_seed(3)
    params = {"a": torch.randn(300, 70, generator=gen), "b": torch.randn(70, generator=gen), "c": torch.randn(5000, generator=gen)}
    grads = {k: torch.randn(p.shape, generator=gen) for k, p in params.items()}
    if bad is not None:
        grads["c"][7] = bad
    with checks.aten_only():
        want_updates, want = _observed_steps(gtx.observe(inner(), groups=1), params, grads, inplace=inplace)
    got_updates, got = _observed_steps(gtx.observe(inner(), groups=1), params, grads, inplace=inplace)
    for k in params:
        assert equal_bits(want_updates[k], got_updates[k]), k  # statistics change no update
    want_logged, got_logged = gtx.observations(want), gtx.observations(got)
    assert want_logged.keys() == got_logged.keys()
    for key, value in want_logged.items():
        # the ATen path's float32 2-norms accumulate thousands of squares per lane: 1e-5
        assert math.isclose(value, got_logged[key], rel_tol=1e-5) or (math.isnan(value) and math.isnan(got_logged[key])), key


@pytest.mark.parametrize("between", [False, True], ids=["handed", "scaled by the clip"])
@pytest.mark.parametrize("inplace", [False, True])
def test_a_clipped_adamw_step_takes_no_pass_of_its_own_for_its_statistics(inplace, between):
    params = {"w": torch.randn(200, 300), "b": torch.randn(300)}
    grads = {k: torch.randn(p.shape) for k, p in params.items()}
    middle = [gtx.identity()] if between else []  # a member between: the clip scales on its own
    tx = gtx.observe(gtx.chain(gtx.clip_by_global_norm(1.0), *middle, gtx.adamw(1e-3, weight_decay=0.01)), groups=1)
    state = tx.init(params)
    _, state = tx.update({k: g.clone() for k, g in grads.items()}, state, params, inplace=inplace)
    kernel, step_kernel = _kernel(), native_adam.usable()
    scaled, squared, steps = kernel.scaled, kernel.squared, step_kernel.calls
    updates, state = tx.update({k: g.clone() for k, g in grads.items()}, state, params, inplace=inplace)
    # max |g| and the non-finite counts: in the clip's scaling pass, or, where the clip hands its
    # coefficient to the Adam step, in the Adam kernel's pass, which then takes the product too
    assert kernel.scaled == scaled + (2 if between else 0) and step_kernel.calls == steps + 2
    assert kernel.squared == squared  # params and updates: from the Adam kernel's tally
    dense = torch.cat([u.reshape(-1).double() for u in updates.values()])
    _, later = tx.update({k: g.clone() for k, g in grads.items()}, state, params)
    assert math.isclose(float(later.total.prev_update_norm), float(dense.norm()), rel_tol=1e-6)


def test_extremes_refuse_tensors_the_clip_did_not_scale():
    from gradtx.chains.observing import _Extremes

    extremes = _Extremes(torch.device("cpu"))
    x = torch.randn(4)
    extremes.scale([x], torch.tensor(0.5), False)
    with pytest.raises(RuntimeError, match="other tensors"):
        extremes.of([torch.randn(4)])


def test_the_check_refuses_a_product_one_step_off():
    good = _kernel()

    class Off:
        calls = scaled = squared = 0

        def scale(self, xs, factor, outs):
            found = good.scale(xs, factor, outs)
            for out in outs:
                out.copy_(torch.nextafter(out, torch.full_like(out, math.inf)))
            return found

        def squares(self, x):
            return good.squares(x)

        def squares_extremes(self, xs):
            return good.squares_extremes(xs)

    assert "x * " in observed._mismatch(Off())
    assert observed._mismatch(good) == ""


@pytest.mark.parametrize("wrong", ["sum", "max", "count"])
def test_the_check_refuses_a_one_pass_sum_or_extreme_that_is_off(wrong):
    good = _kernel()

    class Off:
        calls = scaled = squared = 0
        scale, squares = good.scale, good.squares

        def squares_extremes(self, xs):
            sums, largest, bad = good.squares_extremes(xs)
            if wrong == "sum":
                sums = torch.nextafter(sums, torch.full_like(sums, math.inf))
            elif wrong == "max":
                largest = torch.nextafter(largest, torch.full_like(largest, math.inf))
            else:
                bad = bad + 1
            return sums, largest, bad

    assert "one pass" in observed._mismatch(Off())


@settings(max_examples=30, deadline=None)
@given(
    shapes=st.lists(st.sampled_from([(0,), (1,), (31,), (2049,), (3, 700), (70_001,)]), min_size=1, max_size=3),
    threads=st.sampled_from([1, 2]),
    poison=st.sampled_from([None, float("nan"), float("inf"), -float("inf")]),
    seed=st.integers(0, 2**16),
)
def test_one_pass_sums_and_extremes_are_the_separate_passes_numbers(shapes, threads, poison, seed):
    gen = torch.Generator().manual_seed(seed)
    xs = [torch.randn(shape, generator=gen) * 3 for shape in shapes]
    if poison is not None and xs[-1].numel():
        xs[-1].view(-1)[torch.randint(0, xs[-1].numel(), (3,), generator=gen)] = poison
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        sums, largest, counts = observed.squares_extremes(xs)
    finally:
        torch.set_num_threads(before)
    for k, x in enumerate(xs):
        alone = observed.squares(x)
        assert sums[k].item() == alone or (math.isnan(alone) and sums[k].isnan())
        low, high = torch.aminmax(x) if x.numel() else (torch.zeros(()), torch.zeros(()))
        top = torch.maximum(low.abs(), high.abs())
        assert torch.equal(largest[k], top) or (top.isnan() and largest[k].isnan())
        assert counts[k].item() == int((~torch.isfinite(x)).sum())


@pytest.mark.parametrize("inner", [lambda: gtx.chain(gtx.clip_by_global_norm(1.0), gtx.adamw(1e-2, weight_decay=0.1)), lambda: gtx.adamw(1e-2)])
def test_a_param_donated_as_its_own_gradient_has_the_norm_it_had_before_the_step(inner):
    w = torch.randn(50, 20)
    norm = torch.linalg.vector_norm(w.double())
    tx = gtx.observe(inner(), groups=1)
    _, state = tx.update({"w": w}, tx.init({"w": w}), {"w": w}, inplace=True)
    assert not torch.equal(w.double().norm(), norm)  # the step overwrote it
    _, state = tx.update({"w": torch.ones_like(w)}, state, {"w": w})  # reports the step before's params
    assert math.isclose(float(state.total.prev_param_norm), float(norm), rel_tol=1e-6)


@pytest.mark.parametrize("inplace", [False, True])
def test_statistics_are_the_same_bits_at_one_and_two_threads(inplace):
    # the kernels split a leaf over threads by blocks and add the blocks' sums in block order
    gen = torch.Generator().manual_seed(5)
    params = {"w": torch.randn(400, 500, generator=gen), "b": torch.randn(500, generator=gen)}
    grads = {k: torch.randn(p.shape, generator=gen) for k, p in params.items()}
    before, logged = torch.get_num_threads(), []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            tx = gtx.observe(gtx.chain(gtx.clip_by_global_norm(1.0), gtx.adamw(1e-3, weight_decay=0.01)), groups=1)
            _, state = _observed_steps(tx, params, grads, steps=2, inplace=inplace)
            logged.append(gtx.observations(state))
    finally:
        torch.set_num_threads(before)
    assert logged[0] == logged[1]
