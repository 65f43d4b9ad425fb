"""Schedules: functions from a step count to a hyperparameter value, with optax's names and defaults.

Every schedule takes either a Python ``int`` or a 0-d tensor count:

- an ``int`` gives a Python ``float`` (plain arithmetic, nothing allocated);
- a tensor gives a 0-d float32 tensor on the count's device, computed with tensor ops only (no
  ``.item()``, no Python branch on the count's value), so a step function that reads its schedule
  from a tensor count in the optimizer state compiles once under ``torch.compile`` and never
  recompiles as the count changes.

The values are optax's formulas; the two paths agree to float32 rounding.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterable, Mapping, NamedTuple, Optional, Sequence, Union

import torch
from torch import Tensor

from gradtx.numerics import safe_increment

Numeric = Union[float, int, Tensor]
Schedule = Callable[[Numeric], Numeric]
"""A schedule: a function from the step count (an ``int`` or a 0-d tensor) to a value."""

_DTYPE = torch.float32


# --------------------------------------------------------------------------- scalar/tensor helpers


def _as_float(count: Numeric) -> Numeric:
    """The count as a float: a float32 tensor (float64 kept) for tensors, a ``float`` otherwise."""
    if isinstance(count, Tensor):
        return count if count.dtype == torch.float64 else count.to(_DTYPE)
    return float(count)


def _like(count: Numeric, value: Numeric) -> Numeric:
    """``value`` in the form a schedule returns for ``count``: a 0-d tensor or a ``float``."""
    if isinstance(count, Tensor):
        if isinstance(value, Tensor):
            return value.to(count.device)
        return torch.full((), value, dtype=_DTYPE, device=count.device)
    return value if isinstance(value, Tensor) else float(value)


def _select(condition: Any, if_true: Numeric, if_false: Numeric) -> Numeric:
    """``if_true`` where ``condition`` holds, else ``if_false``; a ``torch.where`` for tensors."""
    if isinstance(condition, Tensor):
        return torch.where(condition, if_true, if_false)
    return if_true if condition else if_false


def _clip(x: Numeric, low: float, high: float) -> Numeric:
    if isinstance(x, Tensor):
        return torch.clamp(x, low, high)
    return min(max(x, low), high)


def _cos(x: Numeric) -> Numeric:
    return torch.cos(x) if isinstance(x, Tensor) else math.cos(x)


def _floor(x: Numeric) -> Numeric:
    return torch.floor(x) if isinstance(x, Tensor) else float(math.floor(x))


def _maximum(x: Numeric, y: Numeric) -> Numeric:
    if isinstance(x, Tensor):
        return torch.maximum(x, y) if isinstance(y, Tensor) else torch.clamp(x, min=y)
    return torch.clamp(y, min=x) if isinstance(y, Tensor) else max(x, y)


def _minimum(x: Numeric, y: Numeric) -> Numeric:
    if isinstance(x, Tensor):
        return torch.minimum(x, y) if isinstance(y, Tensor) else torch.clamp(x, max=y)
    return torch.clamp(y, max=x) if isinstance(y, Tensor) else min(x, y)


# --------------------------------------------------------------------------- schedules


def constant_schedule(value: Numeric) -> Schedule:
    """Always ``value``."""

    def schedule(count: Numeric) -> Numeric:
        return _like(count, value)

    return schedule


def polynomial_schedule(
    init_value: Numeric,
    end_value: Numeric,
    power: Numeric,
    transition_steps: int,
    transition_begin: int = 0,
) -> Schedule:
    """``init_value`` until ``transition_begin``, then ``(I - E) * (1 - t / T) ** power + E``, then ``end_value``.

    With ``t = clip(count - transition_begin, 0, T)``, ``T = transition_steps``. A non-positive
    ``transition_steps`` gives the constant ``init_value``; a negative ``transition_begin`` counts as 0.
    """
    if transition_steps <= 0:
        return constant_schedule(init_value)
    transition_begin = max(transition_begin, 0)

    def schedule(count: Numeric) -> Numeric:
        steps = _clip(_as_float(count) - transition_begin, 0.0, float(transition_steps))
        frac = 1.0 - steps / transition_steps
        return _like(count, (init_value - end_value) * frac**power + end_value)

    return schedule


def linear_schedule(
    init_value: Numeric, end_value: Numeric, transition_steps: int, transition_begin: int = 0
) -> Schedule:
    """Linear ramp from ``init_value`` to ``end_value`` over ``transition_steps`` (power-1 polynomial)."""
    return polynomial_schedule(
        init_value=init_value,
        end_value=end_value,
        power=1,
        transition_steps=transition_steps,
        transition_begin=transition_begin,
    )


def piecewise_constant_schedule(
    init_value: Numeric, boundaries_and_scales: Optional[Mapping[int, float]] = None
) -> Schedule:
    """``init_value`` times every ``scale`` whose boundary ``step <= count`` (a ``MultiStepLR``).

    Scales must be non-negative (``ValueError`` otherwise).
    """
    items = sorted((boundaries_and_scales or {}).items())
    for boundary, scale in items:
        if not scale >= 0.0:
            raise ValueError(
                f"piecewise_constant_schedule: scale {scale!r} at boundary {boundary} must be non-negative"
            )

    def schedule(count: Numeric) -> Numeric:
        value = _like(count, init_value)
        for boundary, scale in items:
            value = _select(count < boundary, value, value * scale)
        return value

    return schedule


def exponential_decay(
    init_value: Numeric,
    transition_steps: int,
    decay_rate: float,
    transition_begin: int = 0,
    staircase: bool = False,
    end_value: Optional[Numeric] = None,
) -> Schedule:
    """``init_value * decay_rate ** ((count - transition_begin) / transition_steps)`` after ``transition_begin``.

    ``staircase`` floors the exponent (a ``StepLR``). ``end_value`` bounds the decay: a floor when
    ``decay_rate < 1``, a ceiling otherwise. A non-positive ``transition_steps`` or a zero
    ``decay_rate`` gives the constant ``init_value``; a negative ``transition_begin`` counts as 0.
    """
    if transition_steps <= 0 or decay_rate == 0:
        return constant_schedule(init_value)
    transition_begin = max(transition_begin, 0)
    bound = _maximum if decay_rate < 1.0 else _minimum

    def schedule(count: Numeric) -> Numeric:
        elapsed = _as_float(count) - transition_begin
        exponent = elapsed / transition_steps
        if staircase:
            exponent = _floor(exponent)
        if isinstance(elapsed, Tensor):
            value = torch.where(elapsed <= 0, init_value, init_value * torch.pow(decay_rate, exponent))
        else:
            value = init_value if elapsed <= 0 else init_value * decay_rate**exponent
        if end_value is not None:
            value = bound(value, end_value)
        return _like(count, value)

    return schedule


def cosine_decay_schedule(
    init_value: Numeric, decay_steps: int, alpha: Numeric = 0.0, exponent: Numeric = 1.0
) -> Schedule:
    """``init_value * ((1 - alpha) * (0.5 * (1 + cos(pi * t / T))) ** exponent + alpha)``, ``t = min(count, T)``.

    ``T = decay_steps`` must be positive. After ``T`` steps the value stays at ``alpha * init_value``
    (torch's ``CosineAnnealingLR`` would swing back up instead).
    """
    if not decay_steps > 0:
        raise ValueError(f"cosine_decay_schedule: decay_steps must be positive, got {decay_steps}")

    def schedule(count: Numeric) -> Numeric:
        steps = _minimum(_as_float(count), float(decay_steps))
        cosine = 0.5 * (1.0 + _cos(math.pi * steps / decay_steps))
        return _like(count, init_value * ((1.0 - alpha) * cosine**exponent + alpha))

    return schedule


def join_schedules(schedules: Sequence[Schedule], boundaries: Sequence[int]) -> Schedule:
    """Runs ``schedules[0]``, then from ``boundaries[i]`` on ``schedules[i + 1]`` (counting from 0 again).

    ``boundaries`` has one entry fewer than ``schedules``. With a tensor count every schedule is
    evaluated and the right value selected by ``torch.where``; with an ``int`` only the active one runs.
    """
    schedules = list(schedules)
    boundaries = list(boundaries)
    if len(boundaries) != len(schedules) - 1:
        raise ValueError(
            f"join_schedules: expected {len(schedules) - 1} boundaries for {len(schedules)} schedules, "
            f"got {len(boundaries)}"
        )

    def schedule(count: Numeric) -> Numeric:
        if isinstance(count, Tensor):
            value = _like(count, schedules[0](count))
            for boundary, next_schedule in zip(boundaries, schedules[1:]):
                value = torch.where(count < boundary, value, _like(count, next_schedule(count - boundary)))
            return value
        active, offset = schedules[0], 0
        for boundary, next_schedule in zip(boundaries, schedules[1:]):
            if count >= boundary:
                active, offset = next_schedule, boundary
        return _like(count, active(count - offset))

    return schedule


def warmup_constant_schedule(init_value: Numeric, peak_value: Numeric, warmup_steps: int) -> Schedule:
    """Linear warmup from ``init_value`` to ``peak_value`` over ``warmup_steps``, then constant."""
    return linear_schedule(init_value=init_value, end_value=peak_value, transition_steps=warmup_steps)


def warmup_cosine_decay_schedule(
    init_value: Numeric,
    peak_value: Numeric,
    warmup_steps: int,
    decay_steps: int,
    end_value: Numeric = 0.0,
    exponent: Numeric = 1.0,
) -> Schedule:
    """Linear warmup to ``peak_value``, then cosine decay to ``end_value``.

    ``decay_steps`` is the total length *including* the warmup, so the cosine part lasts
    ``decay_steps - warmup_steps`` steps (which must be positive).
    """
    alpha = 0.0 if peak_value == 0.0 else end_value / peak_value
    return join_schedules(
        [
            linear_schedule(init_value=init_value, end_value=peak_value, transition_steps=warmup_steps),
            cosine_decay_schedule(
                init_value=peak_value, decay_steps=decay_steps - warmup_steps, alpha=alpha, exponent=exponent
            ),
        ],
        [warmup_steps],
    )


def sgdr_schedule(cosine_kwargs: Iterable[Mapping[str, Any]]) -> Schedule:
    """SGD with warm restarts (Loshchilov & Hutter, 2017): warmup-cosine cycles run back to back.

    Each dict of ``cosine_kwargs`` holds the arguments of one :func:`warmup_cosine_decay_schedule`;
    its ``decay_steps`` is the length of that cycle.
    """
    schedules: list[Schedule] = []
    boundaries: list[int] = []
    step = 0
    for kwargs in cosine_kwargs:
        schedules.append(warmup_cosine_decay_schedule(**kwargs))
        step += kwargs["decay_steps"]
        boundaries.append(step)
    if not schedules:
        raise ValueError("sgdr_schedule: cosine_kwargs is empty")
    return join_schedules(schedules, boundaries[:-1])


def _interval(count: Numeric, low: float, high: float) -> Any:
    """Whether ``low <= count < high``: a bool tensor for tensors, a ``bool`` otherwise."""
    if isinstance(count, Tensor):
        return (count >= low) & (count < high)
    return low <= count < high


def _linear_interpolate(start: float, end: float, pct: Numeric) -> Numeric:
    return (end - start) * pct + start


def _cosine_interpolate(start: float, end: float, pct: Numeric) -> Numeric:
    return end + (start - end) / 2.0 * (_cos(math.pi * pct) + 1.0)


def piecewise_interpolate_schedule(
    interpolate_type: str, init_value: Numeric, boundaries_and_scales: Optional[Mapping[int, float]] = None
) -> Schedule:
    """Interpolates (``"linear"`` or ``"cosine"``) between ``init_value`` times the running product of the
    scales, from one boundary to the next; the last value holds after the last boundary.

    As optax's: the value is 0 for a negative count, and scales must be non-negative.
    """
    if interpolate_type == "linear":
        interpolate = _linear_interpolate
    elif interpolate_type == "cosine":
        interpolate = _cosine_interpolate
    else:
        raise ValueError(f"piecewise_interpolate_schedule: interpolate_type must be 'cosine' or 'linear', got {interpolate_type!r}")
    items = sorted((boundaries_and_scales or {}).items())
    for boundary, scale in items:
        if not scale >= 0.0:
            raise ValueError(
                f"piecewise_interpolate_schedule: scale {scale!r} at boundary {boundary} must be non-negative"
            )
    bounds = [0] + [int(b) for b, _ in items]
    values = [init_value]
    for _, scale in items:
        values.append(values[-1] * scale)

    def schedule(count: Numeric) -> Numeric:
        steps = _as_float(count)
        value: Numeric = _like(count, 0.0)
        for low, high, start, end in zip(bounds[:-1], bounds[1:], values[:-1], values[1:]):
            pct = (steps - low) / max(high - low, 1)
            value = _select(_interval(steps, low, high), _like(count, interpolate(start, end, pct)), value)
        return _select(steps >= bounds[-1], _like(count, values[-1]), value)

    return schedule


def linear_onecycle_schedule(
    transition_steps: int,
    peak_value: Numeric,
    pct_start: float = 0.3,
    pct_final: float = 0.85,
    div_factor: float = 25.0,
    final_div_factor: float = 1e4,
) -> Schedule:
    """The one-cycle policy (Smith & Topin, 2017) with linear pieces: from ``peak_value / div_factor`` up to
    ``peak_value`` at ``pct_start * transition_steps``, back down by ``pct_final * transition_steps``, then
    to ``peak_value / (div_factor * final_div_factor)`` at ``transition_steps``."""
    if transition_steps <= 0:
        raise ValueError(f"linear_onecycle_schedule: transition_steps must be positive, got {transition_steps}")
    return piecewise_interpolate_schedule(
        "linear",
        peak_value / div_factor,
        {
            int(pct_start * transition_steps): div_factor,
            int(pct_final * transition_steps): 1.0 / div_factor,
            transition_steps: 1.0 / final_div_factor,
        },
    )


def cosine_onecycle_schedule(
    transition_steps: int,
    peak_value: Numeric,
    pct_start: float = 0.3,
    div_factor: float = 25.0,
    final_div_factor: float = 1e4,
) -> Schedule:
    """The one-cycle policy with cosine pieces: from ``peak_value / div_factor`` up to ``peak_value`` at
    ``pct_start * transition_steps``, then down to ``peak_value / (div_factor * final_div_factor)``."""
    if transition_steps <= 0:
        raise ValueError(f"cosine_onecycle_schedule: transition_steps must be positive, got {transition_steps}")
    return piecewise_interpolate_schedule(
        "cosine",
        peak_value / div_factor,
        {
            int(pct_start * transition_steps): div_factor,
            int(transition_steps): 1.0 / (div_factor * final_div_factor),
        },
    )


def warmup_exponential_decay_schedule(
    init_value: Numeric,
    peak_value: Numeric,
    warmup_steps: int,
    transition_steps: int,
    decay_rate: float,
    transition_begin: int = 0,
    staircase: bool = False,
    end_value: Optional[Numeric] = None,
) -> Schedule:
    """Linear warmup from ``init_value`` to ``peak_value`` over ``warmup_steps``, then
    :func:`exponential_decay` from ``peak_value`` (its count starting again at 0)."""
    return join_schedules(
        [
            linear_schedule(init_value=init_value, end_value=peak_value, transition_steps=warmup_steps),
            exponential_decay(
                init_value=peak_value,
                transition_steps=transition_steps,
                decay_rate=decay_rate,
                transition_begin=transition_begin,
                staircase=staircase,
                end_value=end_value,
            ),
        ],
        [warmup_steps],
    )


# --------------------------------------------------------------------------- stateful schedules


class WrappedScheduleState(NamedTuple):
    """The state of a :class:`WrappedSchedule`: ``count``, the steps taken so far (0-d int32)."""

    count: Tensor


class WrappedSchedule:
    """A stateless schedule made stateful (optax's ``init``/``update``/``__call__`` protocol).

    ``init()`` starts the count at 0, ``update(state)`` adds one (saturating), and
    ``schedule(state)`` is ``schedule_fn(state.count)``. Extra keyword arguments are accepted and
    ignored, as in optax, so it goes wherever a stateful schedule does.

    ```python
    schedule = gradtx.WrappedSchedule(gradtx.linear_schedule(1.0, 0.0, 10))
    state = schedule.init()
    value = schedule(state)          # 1.0
    state = schedule.update(state)   # count 1
    ```
    """

    def __init__(self, schedule_fn: Schedule):
        if not callable(schedule_fn):
            raise TypeError(f"WrappedSchedule: schedule_fn must be callable, got a {type(schedule_fn).__name__}")
        self.schedule_fn = schedule_fn

    def init(self) -> WrappedScheduleState:
        return WrappedScheduleState(count=torch.zeros((), dtype=torch.int32))

    def update(self, state: WrappedScheduleState, **extra_args: Any) -> WrappedScheduleState:
        del extra_args
        return WrappedScheduleState(count=safe_increment(state.count))

    def __call__(self, state: WrappedScheduleState, **extra_args: Any) -> Numeric:
        del extra_args
        return self.schedule_fn(state.count)


__all__ = [
    "Schedule",
    "constant_schedule",
    "cosine_decay_schedule",
    "exponential_decay",
    "join_schedules",
    "linear_schedule",
    "piecewise_constant_schedule",
    "polynomial_schedule",
    "sgdr_schedule",
    "warmup_constant_schedule",
    "warmup_cosine_decay_schedule",
]
__all__ += [
    "cosine_onecycle_schedule",
    "linear_onecycle_schedule",
    "piecewise_interpolate_schedule",
    "warmup_exponential_decay_schedule",
]
__all__ += ["WrappedSchedule", "WrappedScheduleState"]
