"""Schedules: published formulas, torch.optim.lr_scheduler where definitions agree, int/tensor parity."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import gradtx as gtx
from gradtx import schedules as sched


def _both(schedule, count):
    """The value for an int count and for a 0-d tensor count (checked to be a 0-d float32 tensor)."""
    scalar = schedule(count)
    assert isinstance(scalar, float)
    tensor = schedule(torch.tensor(count))
    assert isinstance(tensor, torch.Tensor) and tensor.ndim == 0 and tensor.dtype == torch.float32
    return scalar, float(tensor)


def _check(schedule, reference, counts, rel=1e-6):
    for count in counts:
        scalar, tensor = _both(schedule, count)
        expected = reference(count)
        assert scalar == pytest.approx(expected, rel=1e-12, abs=1e-12), count
        assert tensor == pytest.approx(expected, rel=rel, abs=1e-7), count


def _torch_lrs(make_scheduler, steps, lr=0.1):
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=lr)
    scheduler = make_scheduler(opt)
    lrs = []
    for _ in range(steps):
        lrs.append(scheduler.get_last_lr()[0])
        opt.step()
        scheduler.step()
    return lrs


def test_constant_schedule():
    _check(gtx.constant_schedule(0.25), lambda t: 0.25, [0, 1, 10_000])


def test_polynomial_schedule_formula_and_documented_values():
    schedule = gtx.polynomial_schedule(init_value=1.0, end_value=0.01, power=2, transition_steps=100, transition_begin=5)

    def reference(t):
        t = min(max(t - 5, 0), 100)
        return (1.0 - 0.01) * (1 - t / 100) ** 2 + 0.01

    _check(schedule, reference, range(0, 120, 3))
    documented = {0: 1.0, 5: 1.0, 6: 0.9803, 104: 0.0101, 105: 0.01, 110: 0.01}
    for count, value in documented.items():
        assert schedule(count) == pytest.approx(value, abs=5e-5)
    # non-positive transition_steps: constant init_value; negative begin counts as 0
    _check(gtx.polynomial_schedule(2.0, 1.0, 1, transition_steps=0), lambda t: 2.0, [0, 50])
    _check(gtx.polynomial_schedule(2.0, 1.0, 1, 4, transition_begin=-3), lambda t: 2.0 - min(t, 4) / 4, range(7))


def test_linear_schedule_matches_torch_linear_lr():
    base = 0.1
    lrs = _torch_lrs(lambda o: torch.optim.lr_scheduler.LinearLR(o, start_factor=0.2, end_factor=0.9, total_iters=7), 12)
    schedule = gtx.linear_schedule(init_value=base * 0.2, end_value=base * 0.9, transition_steps=7)
    for count, lr in enumerate(lrs):
        scalar, tensor = _both(schedule, count)
        assert scalar == pytest.approx(lr, rel=1e-9)
        assert tensor == pytest.approx(lr, rel=1e-6)


def test_cosine_decay_matches_torch_cosine_annealing_lr():
    base, eta_min, total = 0.1, 0.004, 20
    lrs = _torch_lrs(lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=total, eta_min=eta_min), total + 1)
    schedule = gtx.cosine_decay_schedule(init_value=base, decay_steps=total, alpha=eta_min / base)
    for count, lr in enumerate(lrs):
        scalar, tensor = _both(schedule, count)
        assert scalar == pytest.approx(lr, rel=1e-9, abs=1e-12)
        assert tensor == pytest.approx(lr, rel=1e-5)
    # unlike torch, the value stays at the floor after decay_steps
    assert _both(schedule, 3 * total) == pytest.approx((eta_min, eta_min), rel=1e-6)


def test_cosine_decay_exponent():
    schedule = gtx.cosine_decay_schedule(2.0, decay_steps=10, alpha=0.1, exponent=2.0)
    _check(schedule, lambda t: 2.0 * (0.9 * (0.5 * (1 + math.cos(math.pi * min(t, 10) / 10))) ** 2 + 0.1), range(15))
    with pytest.raises(ValueError, match="decay_steps"):
        gtx.cosine_decay_schedule(1.0, decay_steps=0)


def test_exponential_decay_matches_torch_exponential_and_step_lr():
    lrs = _torch_lrs(lambda o: torch.optim.lr_scheduler.ExponentialLR(o, gamma=0.9), 15)
    schedule = gtx.exponential_decay(init_value=0.1, transition_steps=1, decay_rate=0.9)
    steps = _torch_lrs(lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=4, gamma=0.5), 15)
    stair = gtx.exponential_decay(init_value=0.1, transition_steps=4, decay_rate=0.5, staircase=True)
    for count in range(15):
        for s, lr in ((schedule, lrs[count]), (stair, steps[count])):
            scalar, tensor = _both(s, count)
            assert scalar == pytest.approx(lr, rel=1e-9)
            assert tensor == pytest.approx(lr, rel=1e-5)


def test_exponential_decay_begin_and_end_value():
    decay = gtx.exponential_decay(1.0, transition_steps=2, decay_rate=0.5, transition_begin=3, end_value=0.2)
    _check(decay, lambda t: 1.0 if t <= 3 else max(0.5 ** ((t - 3) / 2), 0.2), range(12))
    grow = gtx.exponential_decay(1.0, transition_steps=1, decay_rate=2.0, end_value=10.0)
    _check(grow, lambda t: min(2.0**t, 10.0), range(8))
    _check(gtx.exponential_decay(3.0, 0, 0.5), lambda t: 3.0, [0, 9])
    _check(gtx.exponential_decay(3.0, 5, 0.0), lambda t: 3.0, [0, 9])


def test_piecewise_constant_matches_torch_multistep_lr_and_documented_values():
    lrs = _torch_lrs(lambda o: torch.optim.lr_scheduler.MultiStepLR(o, milestones=[3, 7], gamma=0.1), 10)
    schedule = gtx.piecewise_constant_schedule(0.1, {7: 0.1, 3: 0.1})  # unsorted on purpose
    for count, lr in enumerate(lrs):
        scalar, tensor = _both(schedule, count)
        assert scalar == pytest.approx(lr, rel=1e-9)
        assert tensor == pytest.approx(lr, rel=1e-5)
    documented = gtx.piecewise_constant_schedule(init_value=1.0, boundaries_and_scales={100: 0.1, 200: 0.01})
    assert [documented(c) for c in (50, 150, 250)] == pytest.approx([1.0, 0.1, 0.001])
    _check(gtx.piecewise_constant_schedule(0.5), lambda t: 0.5, [0, 10])
    with pytest.raises(ValueError, match="non-negative"):
        gtx.piecewise_constant_schedule(1.0, {5: -0.1})


def test_join_schedules_restarts_the_count_at_each_boundary():
    joined = gtx.join_schedules(
        [gtx.constant_schedule(1.0), gtx.linear_schedule(0.0, 1.0, 10), gtx.constant_schedule(7.0)], [3, 8]
    )
    _check(joined, lambda t: 1.0 if t < 3 else ((t - 3) / 10 if t < 8 else 7.0), range(12))
    with pytest.raises(ValueError, match="boundaries"):
        gtx.join_schedules([gtx.constant_schedule(1.0)], [3])


def test_warmup_schedules():
    warm = gtx.warmup_constant_schedule(init_value=0.0, peak_value=2.0, warmup_steps=4)
    _check(warm, lambda t: 2.0 * min(t, 4) / 4, range(8))
    wcd = gtx.warmup_cosine_decay_schedule(init_value=0.1, peak_value=1.0, warmup_steps=5, decay_steps=25, end_value=0.05)

    def reference(t):
        if t < 5:
            return 0.1 + 0.9 * t / 5
        s = min(t - 5, 20)
        return 0.05 + (1.0 - 0.05) * 0.5 * (1 + math.cos(math.pi * s / 20))

    _check(wcd, reference, range(0, 32))
    # a zero peak: alpha defaults to 0 rather than dividing by zero
    _check(gtx.warmup_cosine_decay_schedule(0.0, 0.0, 2, 6), lambda t: 0.0, range(8))


def test_sgdr_schedule_restarts():
    cycles = [
        dict(init_value=0.0, peak_value=1.0, warmup_steps=2, decay_steps=10),
        dict(init_value=0.0, peak_value=0.5, warmup_steps=1, decay_steps=5, end_value=0.1),
    ]
    first = gtx.warmup_cosine_decay_schedule(**cycles[0])
    second = gtx.warmup_cosine_decay_schedule(**cycles[1])
    schedule = gtx.sgdr_schedule(cycles)
    _check(schedule, lambda t: first(t) if t < 10 else second(t - 10), range(20))
    assert gtx.schedules.sgdr_schedule is gtx.sgdr_schedule


def test_tensor_counts_compile_once():
    from torch._dynamo.testing import CompileCounter

    schedules = [
        sched.warmup_cosine_decay_schedule(0.0, 1.0, 3, 10, 0.1),
        sched.exponential_decay(1.0, 2, 0.5, 1, True, 0.1),
        sched.piecewise_constant_schedule(1.0, {2: 0.5, 4: 0.5}),
        sched.polynomial_schedule(1.0, 0.0, 2, 6),
        sched.sgdr_schedule([dict(init_value=0.0, peak_value=1.0, warmup_steps=1, decay_steps=4)] * 2),
    ]
    counter = CompileCounter()

    @torch.compile(backend=counter, fullgraph=True)
    def values(count):
        return torch.stack([s(count) for s in schedules])

    for step in range(9):
        count = torch.tensor(step, dtype=torch.int32)
        expected = torch.tensor([s(step) for s in schedules], dtype=torch.float32)
        torch.testing.assert_close(values(count), expected)
    assert counter.frame_count == 1


@settings(max_examples=40, deadline=None)
@given(
    init=st.floats(1e-3, 2.0),
    end=st.floats(0.0, 2.0),
    power=st.floats(0.5, 3.0),
    steps=st.integers(1, 50),
    begin=st.integers(0, 10),
    count=st.integers(0, 80),
)
def test_property_int_and_tensor_counts_agree(init, end, power, steps, begin, count):
    candidates = [
        gtx.polynomial_schedule(init, end, power, steps, begin),
        gtx.cosine_decay_schedule(init, steps, alpha=end / 2, exponent=power),
        gtx.exponential_decay(init, steps, 0.7, begin, staircase=count % 2 == 0, end_value=end / 10),
        gtx.warmup_cosine_decay_schedule(end, init, begin, begin + steps, end_value=end / 3),
    ]
    for schedule in candidates:
        scalar, tensor = _both(schedule, count)
        assert tensor == pytest.approx(scalar, rel=2e-6, abs=1e-6)


# --------------------------------------------------------------------------- interpolated and one-cycle schedules


def _piecewise_reference(kind, init, boundaries_and_scales, count):
    """optax's definition, written out: the interpolation on the interval holding ``count``."""
    bounds, values = [0], [init]
    for boundary, scale in sorted(boundaries_and_scales.items()):
        bounds.append(boundary)
        values.append(values[-1] * scale)
    if count < 0:
        return 0.0
    if count >= bounds[-1]:
        return values[-1]
    for i in range(len(bounds) - 1):
        if bounds[i] <= count < bounds[i + 1]:
            pct = (count - bounds[i]) / max(bounds[i + 1] - bounds[i], 1)
            a, b = values[i], values[i + 1]
            if kind == "linear":
                return a + pct * (b - a)
            return b + (a - b) * (1 + math.cos(math.pi * pct)) / 2
    raise AssertionError("unreachable")


@pytest.mark.parametrize("kind", ["linear", "cosine"])
def test_piecewise_interpolate_schedule(kind):
    table = {5: 2.0, 12: 0.25, 20: 0.0}
    schedule = gtx.piecewise_interpolate_schedule(kind, 0.8, table)
    _check(schedule, lambda c: _piecewise_reference(kind, 0.8, table, c), range(-2, 25))
    constant = gtx.piecewise_interpolate_schedule(kind, 0.8)
    _check(constant, lambda c: 0.0 if c < 0 else 0.8, [-1, 0, 7])


def test_piecewise_interpolate_schedule_rejects_bad_arguments():
    with pytest.raises(ValueError, match="interpolate_type"):
        gtx.piecewise_interpolate_schedule("quadratic", 1.0)
    with pytest.raises(ValueError, match="non-negative"):
        gtx.piecewise_interpolate_schedule("linear", 1.0, {3: -1.0})


def test_linear_onecycle_schedule():
    schedule = gtx.linear_onecycle_schedule(100, 2.0, pct_start=0.25, pct_final=0.8, div_factor=10.0, final_div_factor=100.0)

    def reference(c):
        start, peak, end = 0.2, 2.0, 0.2 / 100.0
        if c < 25:
            return start + (peak - start) * c / 25
        if c < 80:
            return peak + (start - peak) * (c - 25) / 55
        if c < 100:
            return start + (end - start) * (c - 80) / 20
        return end

    _check(schedule, reference, list(range(0, 110, 3)) + [25, 80, 100])
    with pytest.raises(ValueError, match="transition_steps"):
        gtx.linear_onecycle_schedule(0, 1.0)


def test_cosine_onecycle_schedule():
    schedule = gtx.cosine_onecycle_schedule(50, 1.5, pct_start=0.2, div_factor=5.0, final_div_factor=20.0)

    def reference(c):
        start, peak, end = 0.3, 1.5, 1.5 / 100.0
        if c < 10:
            return peak + (start - peak) * (1 + math.cos(math.pi * c / 10)) / 2
        if c < 50:
            return end + (peak - end) * (1 + math.cos(math.pi * (c - 10) / 40)) / 2
        return end

    _check(schedule, reference, list(range(0, 60, 2)) + [10, 50])
    with pytest.raises(ValueError, match="transition_steps"):
        gtx.cosine_onecycle_schedule(-1, 1.0)


@pytest.mark.parametrize("staircase", [False, True])
def test_warmup_exponential_decay_schedule(staircase):
    schedule = gtx.warmup_exponential_decay_schedule(
        0.1, 1.0, warmup_steps=4, transition_steps=3, decay_rate=0.5, transition_begin=2, staircase=staircase, end_value=0.2
    )

    def reference(c):
        if c < 4:
            return 0.1 + 0.9 * c / 4
        t = c - 4 - 2
        if t <= 0:
            return 1.0
        exponent = math.floor(t / 3) if staircase else t / 3
        return max(0.5**exponent, 0.2)

    _check(schedule, reference, range(0, 25))


def test_new_schedules_compile_without_recompiling():
    schedule = gtx.cosine_onecycle_schedule(20, 1.0)
    torch._dynamo.reset()
    graphs = []
    compiled = torch.compile(schedule, backend=lambda gm, inputs: graphs.append(gm) or gm.forward, fullgraph=True)
    for c in (0, 3, 11, 25):
        assert float(compiled(torch.tensor(c))) == pytest.approx(schedule(c), rel=1e-6, abs=1e-7)
    assert len(graphs) == 1
