"""Scaling by constants, learning rates, schedules and trust ratios (optax's names and defaults).

A schedule is any callable ``count -> step size`` (``gradtx.schedules`` or a plain function); it is
called with the 0-d int32 step counter kept in the state, so a schedule written with tensor ops
never makes ``torch.compile`` recompile. It may return a number or a 0-d tensor.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional, Union

import torch
from torch import Tensor

from gradtx import sharding
from gradtx import tree as tree_lib
from gradtx.base import (
    takes_spec,
    EmptyState,
    GradientTransformation,
    donation,
    identity,
    init_empty_state,
    set_elementwise,
    supports_donated_updates,
    takes_scaled_gradients,
)
from gradtx.numerics import ScalarOrSchedule
from gradtx.state_check import named
from gradtx.transforms import _foreach as fe

Schedule = Callable[[Tensor], Union[float, Tensor]]


def scale(step_size: Union[float, Tensor]) -> GradientTransformation:
    """Multiplies every update by the fixed number ``step_size`` (or 0-d tensor)."""
    step_size = fe.number_or_tensor(step_size)


    def update_fn(updates, state, params=None, *, inplace=False):
        del params
        own_updates, _ = donation(inplace)  # stateless
        leaves = fe.leaves_of(updates, what="scale")
        (scaled,) = fe.map_groups(lambda g: (fe.mul(g, fe.on(step_size, g), inplace=own_updates),), leaves.tensors, outputs=1)
        return leaves.rebuild(scaled), state

    return GradientTransformation(init_empty_state, set_elementwise(supports_donated_updates(update_fn)))


class ScaleByScheduleState(NamedTuple):
    """``count``: the number of updates so far (0-d int32 tensor), the schedule's argument."""

    count: Tensor


def scale_by_schedule(step_size_fn: Schedule) -> GradientTransformation:
    """Multiplies the updates by ``step_size_fn(count)``, then increments ``count``.

    The step size is rounded to each update's dtype before the product, as optax does.
    """
    if not callable(step_size_fn):
        raise TypeError(f"scale_by_schedule: step_size_fn must be callable, got {type(step_size_fn).__name__}")

    def init_fn(params: Any) -> ScaleByScheduleState:
        return ScaleByScheduleState(count=fe.zero_count(params))

    def update_fn(updates, state, params=None, *, inplace=False):
        del params
        own_updates, own_state = donation(inplace)
        leaves = fe.leaves_of(updates, what="scale_by_schedule")
        step_size = fe.schedule_value(step_size_fn, state.count)
        (scaled,) = fe.map_groups(lambda g: (fe.mul(g, fe.on(step_size, g), inplace=own_updates),), leaves.tensors, outputs=1)
        return leaves.rebuild(scaled), ScaleByScheduleState(count=fe.increment(state.count, inplace=own_state))

    return GradientTransformation(init_fn, set_elementwise(supports_donated_updates(update_fn)))


def scale_by_learning_rate(
    learning_rate: Optional[ScalarOrSchedule] = None, *, flip_sign: bool = True
) -> GradientTransformation:
    """Multiplies the updates by ``-learning_rate`` (``+learning_rate`` when ``flip_sign=False``).

    A number gives :func:`scale` (no state), a schedule :func:`scale_by_schedule`, ``None`` the
    identity, exactly as in optax.
    """
    if learning_rate is None:
        return identity()
    sign = -1.0 if flip_sign else 1.0
    if callable(learning_rate):
        schedule = learning_rate
        return scale_by_schedule(lambda count: sign * schedule(count))
    return scale(sign * fe.number_or_tensor(learning_rate))


class FoldedLearningRate:
    """What :func:`scale_by_learning_rate` does in a chain, for a transformation that folds the
    learning rate into its own step (the fused Adam, SGD, AMSGrad and Lion steps): that member's
    state (:meth:`init`) and, each step, its factor ``-learning_rate`` and next state (:meth:`step`)."""

    def __init__(self, learning_rate: Optional[ScalarOrSchedule]):
        self.is_schedule = callable(learning_rate)
        self.value = learning_rate if learning_rate is None or self.is_schedule else fe.number_or_tensor(learning_rate)

    def init(self, params: Any) -> Union[ScaleByScheduleState, EmptyState]:
        return ScaleByScheduleState(count=fe.zero_count(params)) if self.is_schedule else EmptyState()

    def step(self, state: Any, *, inplace: bool) -> tuple[Any, Any]:
        """``(factor, new state)``: the factor ``-learning_rate`` (``None`` for ``None``, the
        identity), a number or a 0-d tensor; ``inplace``: the count is donated."""
        if self.is_schedule:
            factor = -fe.schedule_value(self.value, state.count)
            return factor, ScaleByScheduleState(count=fe.increment(state.count, inplace=inplace))
        return (None if self.value is None else -self.value), state


def with_learning_rate(
    init: Callable[[Any], Any], step: Callable[..., tuple[Any, Any]], learning_rate: ScalarOrSchedule, name: str
) -> GradientTransformation:
    """``chain(<inner>, scale_by_learning_rate(learning_rate))`` as one transformation whose inner
    step multiplies its updates by ``-learning_rate`` where it writes them: that chain's state (a
    tuple ``(inner state, learning-rate state)``) and numbers. ``init(params)`` is the inner state;
    ``step(updates, state, *, own_updates, own_state, grad_scale, scaling, update_scale)`` the inner
    step (see :func:`~gradtx.base.takes_scaled_gradients` for ``grad_scale`` and ``scaling``), so a
    ``clip_by_global_norm`` before it in a chain hands it its coefficient."""
    rate = FoldedLearningRate(learning_rate)

    def init_fn(params: Any) -> tuple:
        return (init(params), rate.init(params))

    def update_fn(updates, state, params=None, *, inplace=False, **extra_args):
        del params, extra_args  # value=, grad=, ...: taken and ignored, as by the chain it stands for
        return run(updates, state, inplace)

    def scaled_update(updates, state, params=None, *, inplace=False, grad_scale, scaling=None):
        del params
        return run(updates, state, inplace, grad_scale, scaling)

    def run(updates, state, inplace, grad_scale=None, scaling=None):
        own_updates, own_state = donation(inplace)
        factor, lr_state = rate.step(state[1], inplace=own_state)
        new_updates, inner_state = step(
            updates, state[0], own_updates=own_updates, own_state=own_state, grad_scale=grad_scale, scaling=scaling,
            update_scale=factor,
        )
        return new_updates, (inner_state, lr_state)

    update_fn = set_elementwise(supports_donated_updates(update_fn))
    return GradientTransformation(init_fn, named(takes_scaled_gradients(update_fn, scaled_update), name))


@takes_spec
def scale_by_trust_ratio(
    min_norm: float = 0.0,
    trust_coefficient: float = 1.0,
    eps: float = 0.0,
    *,
    spec: Optional[sharding.ShardingSpec] = None,
) -> GradientTransformation:
    """Scales each leaf by ``trust_coefficient * ||param|| / (||update|| + eps)`` (LARS / LAMB).

    Norms are floored at ``min_norm``; a leaf whose parameter or update has norm zero keeps a ratio
    of 1, as in optax. With a sharding ``spec`` the per-leaf norms are those of the whole logical
    leaf, reduced over its shard axes. Norms accumulate in float32 or wider.
    """
    min_norm, trust_coefficient, eps = float(min_norm), float(trust_coefficient), float(eps)


    def update_fn(updates, state, params=None, *, inplace=False):
        leaves = fe.leaves_of(updates, what="scale_by_trust_ratio")
        param_values = fe.params_of(leaves, params, owner="scale_by_trust_ratio")
        update_norms = tree_lib.leaves(sharding.leaf_norms(updates, spec))
        param_norms = tree_lib.leaves(sharding.leaf_norms(leaves.rebuild(param_values), spec))
        ratios = []
        for i in leaves.present:
            param_norm = torch.clamp(param_norms[i], min=min_norm)
            update_norm = torch.clamp(update_norms[i], min=min_norm).to(param_norm.device)
            ratio = trust_coefficient * param_norm / (update_norm + eps)
            ratios.append(torch.where((param_norm == 0.0) | (update_norm == 0.0), 1.0, ratio))

        def scale_group(g, r):
            return (fe.mul(g, [x.to(device=t.device, dtype=t.dtype) for x, t in zip(r, g)], inplace=inplace),)

        (scaled,) = fe.map_groups(scale_group, leaves.tensors, ratios, outputs=1)
        return leaves.rebuild(scaled), state

    return GradientTransformation(init_empty_state, update_fn)


ScaleState = EmptyState
"""The state of :func:`scale`: it keeps nothing, as optax's alias says."""

ScaleByTrustRatioState = EmptyState
"""The state of :func:`scale_by_trust_ratio`: it keeps nothing, as optax's alias says."""
