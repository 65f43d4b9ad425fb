"""Schedule-Free learning (Defazio et al., 2024): averaging and interpolation instead of a decaying
learning-rate schedule, as a wrapper around any base transformation.

Three sequences: ``z`` (the base optimizer's iterates), ``x`` (their weighted average, where the
model should be evaluated) and ``y = b1 * x + (1 - b1) * z`` (where gradients are taken: the
params). Only ``z`` is stored; ``x`` is recovered from ``y`` and ``z``
(:func:`schedule_free_eval_params`). With ``c = w_t / sum(w_i)``, ``w_t = max_lr_t **
weight_lr_power``, one step is::

    z' = z + base_update(g)
    x  = (y - (1 - b1) * z) / b1
    x' = (1 - c) * x + c * z'
    y' = b1 * x' + (1 - b1) * z'          # the update returned is y' - y

exactly as optax.contrib.schedule_free computes it. This is the paper's weighted average
(``c_{t+1} = gamma_t^2 / sum_{i<=t} gamma_i^2``; with a constant ``gamma``, ``x`` is the plain
average of the ``z`` iterates after each step) and the step of Meta's current
``AdamWScheduleFree`` (``weight_lr_power = 2``, ``r = 0``, constant learning rate). Two
differences with the paper's Schedule-Free AdamW (Meta's ``AdamWScheduleFreePaper``), both
optax's: :func:`schedule_free_adamw` bias-corrects the second moment inside the denominator
(``g / (sqrt(v / (1 - b2^t)) + eps)``, as Meta's current code) instead of multiplying the
learning rate by ``sqrt(1 - b2^t)``, so neither the averaging weights nor the decay see the
bias correction; and under a warmup the averaging weights read the schedule at ``t`` (from 1)
while the base optimizer's learning rate reads it at ``t - 1`` (its own counter, from 0), one
step behind (Meta's code reads ``t`` for both).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import torch
from torch import Tensor

from gradtx import tree as tree_lib
from gradtx.base import (
    GradientTransformation,
    GradientTransformationExtraArgs,
    identity,
    with_extra_args_support,
    with_inplace,
)
from gradtx.chains import chain
from gradtx.numerics import ScalarOrSchedule
from gradtx.optimizers._common import check_learning_rate
from gradtx.schedules import warmup_constant_schedule
from gradtx.transforms import _foreach as fe
from gradtx.transforms.rms import scale_by_rms
from gradtx.transforms.scaling import scale_by_learning_rate
from gradtx.transforms.weight_decay import add_decayed_weights


class ScheduleFreeState(NamedTuple):
    """``b1``: the interpolation weight (0-d, in the params' lowest float dtype); ``weight_sum``: the
    sum of the averaging weights so far; ``step_count``: the step about to be taken (0-d int32,
    starting at 1); ``max_lr``: the largest learning rate so far; ``base_optimizer_state``: the
    wrapped transformation's state; ``z``: the base optimizer's iterates, like the params."""

    b1: Tensor
    weight_sum: Tensor
    step_count: Tensor
    max_lr: Tensor
    base_optimizer_state: Any
    z: Any


def _lowest_float_dtype(params: Any) -> torch.dtype:
    """The floating dtype of the fewest bits among the leaves (the default dtype if there is none)."""
    dtypes = tree_lib.real_dtypes(params)
    if not dtypes:
        return torch.get_default_dtype()
    return min(dtypes, key=lambda d: torch.finfo(d).bits)


def schedule_free_eval_params(state: Any, params: Any) -> Any:
    """The averaged parameters ``x = (y - (1 - b1) * z) / b1``, where a :func:`schedule_free` model
    is evaluated (``params`` are the ``y`` the gradients were taken at). ``state`` must be a
    :class:`ScheduleFreeState`."""
    b1, z = getattr(state, "b1", None), getattr(state, "z", None)
    if b1 is None or z is None:
        raise ValueError("schedule_free_eval_params requires a ScheduleFreeState as input.")
    return tree_lib.tree_map(lambda y, zi: (y - (1.0 - b1) * zi) / b1, params, z)


def schedule_free(
    base_optimizer: GradientTransformation,
    learning_rate: ScalarOrSchedule,
    b1: float = 0.9,
    weight_lr_power: float = 2.0,
    state_dtype: Optional[torch.dtype] = None,
) -> GradientTransformationExtraArgs:
    """Schedule-Free: replaces a decaying learning-rate schedule by averaging and interpolation.

    Three sequences: ``z``, the base optimizer's iterates (``z' = z + base_update(g)``); ``x``,
    their weighted average (``x' = (1 - c) x + c z'``, ``c`` the step's share of the weights
    ``lr_max^weight_lr_power``), where the model should be evaluated; and
    ``y = b1 * x + (1 - b1) * z``, the params, where the gradients are taken. The average
    plays the part of the schedule's decay and the interpolation the part of momentum, so no
    schedule or stopping time is needed. Only ``z`` is stored; :func:`schedule_free_eval_params`
    recovers ``x`` from ``y`` and ``z``. As optax.contrib's ``schedule_free`` (the module's
    docstring gives the step and where it differs from the paper).

    Args:
      base_optimizer: the optimizer whose updates move ``z``: with no momentum of its own
        (``b1 = 0`` for Adam), applying ``learning_rate`` itself. Extra arguments
        (``value=``...) are passed on to it.
      learning_rate: the base optimizer's learning rate, here only for the averaging weights:
        a number, a 0-d tensor, or a schedule called with the step count (from 1).
      b1: the interpolation weight: the params are ``y = b1 * x + (1 - b1) * z`` (the role of
        momentum; must be positive).
      weight_lr_power: the power of the largest learning rate so far in the averaging weights
        ``c_t = lr_max^weight_lr_power / sum``.
      state_dtype: the dtype of ``z``, the state's copy of the params (``None``: the params').

    Returns:
      The optimizer, a :class:`~gradtx.GradientTransformationExtraArgs`.

    References:
      Defazio et al., `The Road Less Scheduled <https://arxiv.org/abs/2405.15682>`_, NeurIPS, 2024

    Examples:
      >>> import torch
      >>> import gradtx as gtx
      >>> def f(params):  # a quadratic, smallest at w = 0
      ...     return (params["w"] ** 2).sum()
      >>> params = {"w": torch.tensor([1.0, 2.0, 3.0])}
      >>> tx = gtx.contrib.schedule_free(gtx.sgd(0.1), learning_rate=0.1)
      >>> state = tx.init(params)
      >>> for _ in range(5):
      ...     grads = torch.func.grad(f)(params)  # taken at y, the params
      ...     updates, state = tx.update(grads, state, params)
      ...     params = gtx.apply_updates(params, updates)
      ...     x = gtx.contrib.schedule_free_eval_params(state, params)  # where to evaluate
      ...     print(f"{f(x):.4f}")
      8.9600
      7.2576
      5.8400
      4.6650
      3.6960
    """
    check_learning_rate(learning_rate, "schedule_free")
    b1, weight_lr_power = float(b1), float(weight_lr_power)
    if not b1 > 0.0:
        raise ValueError(f"schedule_free: b1 must be strictly positive, got {b1}")
    base_update = with_inplace(with_extra_args_support(base_optimizer))
    rate = learning_rate if callable(learning_rate) else fe.number_or_tensor(learning_rate)

    def init_fn(params: Any) -> ScheduleFreeState:
        dtype, device = _lowest_float_dtype(params), tree_lib.first_device(params)
        # z is a copy of the params (not detached: meta-gradients flow through it)
        z = tree_lib.tree_map(lambda p: p.clone() if state_dtype is None else p.to(state_dtype, copy=True), params)
        return ScheduleFreeState(
            b1=torch.full((), b1, dtype=dtype, device=device),
            weight_sum=torch.zeros((), dtype=dtype, device=device),
            step_count=torch.ones((), dtype=torch.int32, device=device),
            max_lr=torch.zeros((), dtype=dtype, device=device),
            base_optimizer_state=base_optimizer.init(params),
            z=z,
        )

    def update_fn(updates, state, params=None, *, inplace=False, **extra_args):
        dtype = state.max_lr.dtype
        lr = fe.schedule_value(rate, state.step_count) if callable(rate) else rate
        lr = lr.to(dtype) if isinstance(lr, Tensor) else torch.full((), lr, dtype=dtype, device=state.max_lr.device)
        max_lr = torch.maximum(state.max_lr, lr)
        weight = max_lr**weight_lr_power
        weight_sum = state.weight_sum + weight
        # weight / weight_sum, 0 while every learning rate so far is 0 (a warmup's first step)
        ratio = torch.nan_to_num(weight / weight_sum, nan=0.0, posinf=float("inf"))
        ck = torch.where(torch.isnan(weight) | torch.isnan(weight_sum), torch.full_like(ratio, float("nan")), ratio)

        base_updates, base_state = base_update(
            updates, state.base_optimizer_state, params, inplace=inplace, **extra_args
        )
        leaves = fe.leaves_of(base_updates, what="schedule_free")
        param_values = fe.params_of(leaves, params, owner="schedule_free")
        z = leaves.aligned(state.z, what="schedule_free: state.z")

        def group(u, zs, p):
            work = torch.promote_types(p[0].dtype, zs[0].dtype)
            x = fe.add(fe.cast(p, work), fe.cast(zs, work), alpha=-(1.0 - b1), inplace=False)
            x = fe.div(x, b1, inplace=True)  # the average before this step
            zs = fe.add(zs, fe.cast(u, zs[0].dtype), inplace=inplace)
            x = fe.lerp(x, fe.cast(zs, work), fe.on(ck, x), inplace=True)  # the average after it
            y = fe.lerp(x, fe.cast(zs, work), 1.0 - b1, inplace=True)  # the new params
            out = fe.add(y, fe.cast(p, work), alpha=-1.0, inplace=True)
            return fe.finish(out, u), zs

        new_updates, new_z = fe.map_groups(group, leaves.tensors, z, param_values, outputs=2)
        new_state = ScheduleFreeState(
            b1=state.b1 if inplace else state.b1.clone(),
            weight_sum=weight_sum,
            step_count=fe.increment(state.step_count, inplace=inplace),
            max_lr=max_lr,
            base_optimizer_state=base_state,
            z=leaves.rebuild(new_z, like=state.z),
        )
        return leaves.rebuild(new_updates), new_state

    return GradientTransformationExtraArgs(init_fn, update_fn)


def _warmed_up(learning_rate: ScalarOrSchedule, warmup_steps: Optional[int], owner: str) -> ScalarOrSchedule:
    """The learning rate, warmed up linearly from 0 over ``warmup_steps`` when given (as optax's
    ``warmup_constant_schedule``, whose peak must then be a number or a 0-d tensor)."""
    check_learning_rate(learning_rate, owner)
    if warmup_steps is None:
        return learning_rate
    if callable(learning_rate):
        raise TypeError(
            f"{owner}: learning_rate must be a number or a 0-d tensor when warmup_steps is given, got a schedule"
            " (without warmup_steps a schedule is taken)"
        )
    return warmup_constant_schedule(init_value=0.0, peak_value=learning_rate, warmup_steps=warmup_steps)


def schedule_free_sgd(
    learning_rate: float = 1.0,
    warmup_steps: Optional[int] = None,
    b1: float = 0.9,
    weight_decay: Optional[float] = None,
    weight_lr_power: float = 2.0,
    state_dtype: Optional[torch.dtype] = None,
) -> GradientTransformationExtraArgs:
    """Schedule-Free SGD: SGD with averaging and interpolation in place of a schedule.

    :func:`schedule_free` around ``sgd(learning_rate)`` (without momentum, after
    ``add_decayed_weights(weight_decay)`` when a decay is given), with a linear warmup from 0
    over ``warmup_steps`` when given. The params are ``y``, where gradients are taken; evaluate
    the model at :func:`schedule_free_eval_params`.

    Args:
      learning_rate: the (peak) step size: a number or a 0-d tensor (typed ``float``, as in
        optax). Without ``warmup_steps``, a schedule is taken too (the averaging weights read
        it at ``t``, from 1, and the base optimizer at ``t - 1``).
      warmup_steps: the number of steps of a linear warmup from 0 to ``learning_rate``
        (``None``: none).
      b1: the interpolation weight: the params are ``y = b1 * x + (1 - b1) * z`` (the role of
        momentum; must be positive).
      weight_decay: the rate of an L2 penalty added to the gradient (so multiplied by the
        learning rate), evaluated at ``y``; ``None`` for none.
      weight_lr_power: the power of the largest learning rate so far in the averaging weights
        ``c_t = lr_max^weight_lr_power / sum``.
      state_dtype: the dtype of ``z``, the state's copy of the params (``None``: the params').

    Returns:
      The optimizer, a :class:`~gradtx.GradientTransformationExtraArgs`.

    References:
      Defazio et al., `The Road Less Scheduled <https://arxiv.org/abs/2405.15682>`_, NeurIPS, 2024

    Examples:
      >>> import torch
      >>> import gradtx as gtx
      >>> def f(params):  # a quadratic, smallest at w = 0
      ...     return (params["w"] ** 2).sum()
      >>> params = {"w": torch.tensor([1.0, 2.0, 3.0])}
      >>> tx = gtx.contrib.schedule_free_sgd(learning_rate=0.1)
      >>> state = tx.init(params)
      >>> for _ in range(5):
      ...     grads = torch.func.grad(f)(params)  # taken at y, the params
      ...     updates, state = tx.update(grads, state, params)
      ...     params = gtx.apply_updates(params, updates)
      ...     x = gtx.contrib.schedule_free_eval_params(state, params)  # where to evaluate
      ...     print(f"{f(x):.4f}")
      8.9600
      7.2576
      5.8400
      4.6650
      3.6960
    """
    learning_rate = _warmed_up(learning_rate, warmup_steps, "schedule_free_sgd")
    optimizer = chain(identity(), scale_by_learning_rate(learning_rate))  # optax's sgd, without momentum
    if weight_decay is not None:
        optimizer = chain(add_decayed_weights(weight_decay), optimizer)
    return schedule_free(optimizer, learning_rate, b1, weight_lr_power, state_dtype)


def schedule_free_adamw(
    learning_rate: float = 0.0025,
    warmup_steps: Optional[int] = None,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    weight_lr_power: float = 2.0,
    state_dtype: Optional[torch.dtype] = None,
) -> GradientTransformationExtraArgs:
    """Schedule-Free AdamW: Adam without momentum, averaged and interpolated in place of a schedule.

    :func:`schedule_free` around ``chain(scale_by_rms(b2, eps, eps_in_sqrt=False,
    bias_correction=True), add_decayed_weights(weight_decay), scale_by_learning_rate(learning_rate))``:
    Adam with ``b1 = 0`` (the interpolation takes momentum's place), with a linear warmup from 0
    over ``warmup_steps`` when given. The decay is applied at ``y``, where gradients are taken,
    as in Meta's ``AdamWScheduleFree``; the second moment is bias-corrected inside the
    denominator, as optax does (the paper multiplies the learning rate by
    ``sqrt(1 - b2^t)`` instead; see the module's docstring). Evaluate the model at
    :func:`schedule_free_eval_params`.

    Args:
      learning_rate: the (peak) step size: a number or a 0-d tensor (typed ``float``, as in
        optax). Without ``warmup_steps``, a schedule is taken too (the averaging weights read
        it at ``t``, from 1, and the base optimizer at ``t - 1``).
      warmup_steps: the number of steps of a linear warmup from 0 to ``learning_rate``
        (``None``: none).
      b1: the interpolation weight: the params are ``y = b1 * x + (1 - b1) * z`` (the role of
        momentum; must be positive).
      b2: the decay rate of the second moment.
      eps: added to the square root of the (bias-corrected) second moment.
      weight_decay: the rate of the decoupled weight decay, evaluated at ``y``: each step also
        subtracts ``learning_rate * weight_decay * y`` from ``z``. A number.
      weight_lr_power: the power of the largest learning rate so far in the averaging weights
        ``c_t = lr_max^weight_lr_power / sum``.
      state_dtype: the dtype of ``z``, the state's copy of the params (``None``: the params').

    Returns:
      The optimizer, a :class:`~gradtx.GradientTransformationExtraArgs`.

    References:
      Defazio et al., `The Road Less Scheduled <https://arxiv.org/abs/2405.15682>`_, NeurIPS, 2024

    Examples:
      >>> import torch
      >>> import gradtx as gtx
      >>> def f(params):  # a quadratic, smallest at w = 0
      ...     return (params["w"] ** 2).sum()
      >>> params = {"w": torch.tensor([1.0, 2.0, 3.0])}
      >>> tx = gtx.contrib.schedule_free_adamw(learning_rate=0.1, warmup_steps=2)
      >>> state = tx.init(params)
      >>> for _ in range(5):
      ...     grads = torch.func.grad(f)(params)  # taken at y, the params
      ...     updates, state = tx.update(grads, state, params)
      ...     params = gtx.apply_updates(params, updates)
      ...     x = gtx.contrib.schedule_free_eval_params(state, params)  # where to evaluate
      ...     print(f"{f(x):.4f}")
      14.0000
      13.5248
      12.9640
      12.4158
      11.8852
    """
    learning_rate = _warmed_up(learning_rate, warmup_steps, "schedule_free_adamw")
    optimizer = chain(
        scale_by_rms(decay=b2, eps=eps, eps_in_sqrt=False, bias_correction=True),
        add_decayed_weights(weight_decay),
        scale_by_learning_rate(learning_rate),
    )
    return schedule_free(optimizer, learning_rate, b1, weight_lr_power, state_dtype)
