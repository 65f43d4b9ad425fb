"""Reduce the learning rate when a monitored value stops improving: optax.contrib's ``reduce_on_plateau``.

The decisions are taken with tensor ops on 0-d tensors (no host read, as optax's ``lax.cond``), so
a step neither synchronises with the device nor recompiles under ``torch.compile``.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Union

import torch
from torch import Tensor

from gradtx import tree as tree_lib
from gradtx.base import GradientTransformationExtraArgs
from gradtx.transforms import _foreach as fe

Number = Union[int, float, Tensor]


class ReduceLROnPlateauState(NamedTuple):
    """``scale``: the factor the updates are multiplied by (the params' lowest float dtype);
    ``best_value``: the best average value so far and ``avg_value``: the running average of the
    current accumulation (the params' highest float dtype); ``plateau_count``,
    ``cooldown_count``, ``count``: 0-d int32 counters (steps without improvement, cooldown steps
    left, values accumulated)."""

    scale: Tensor
    best_value: Tensor
    plateau_count: Tensor
    cooldown_count: Tensor
    count: Tensor
    avg_value: Tensor


def _float_dtypes(params: Any) -> list[torch.dtype]:
    return tree_lib.real_dtypes(params) or [torch.get_default_dtype()]


def reduce_on_plateau(
    factor: float = 0.1,
    patience: Number = 10,
    rtol: float = 1e-4,
    atol: float = 0.0,
    cooldown: Number = 0,
    accumulation_size: Number = 1,
    min_scale: Number = 0.0,
) -> GradientTransformationExtraArgs:
    """Multiplies the updates by a scale that drops by ``factor`` when the value plateaus.

    The schedule of Keras' and torch's ``ReduceLROnPlateau`` callbacks, as an optax-style
    transformation (chain it after the optimizer) with optax.contrib's state and decisions.

    The ``update`` needs ``value=`` (a loss, a validation metric). Values are averaged over
    ``accumulation_size`` calls; at the end of each accumulation the average improves on the best
    one when ``avg < (1 - rtol) * best - atol``. After ``patience`` accumulations in a row without
    improvement the scale is multiplied by ``factor`` (never below ``min_scale``) and ``cooldown``
    accumulations follow during which no plateau is counted. As torch's
    ``ReduceLROnPlateau(mode="min", threshold_mode="rel", threshold=rtol)`` with ``patience - 1``
    (torch reduces when the count of bad epochs *exceeds* its patience) and ``atol = 0``.

    Example::

        import torch
        from gradtx.contrib import reduce_on_plateau

        tx = reduce_on_plateau(factor=0.5, patience=2)
        params = {"w": torch.ones(2)}
        state = tx.init(params)
        for loss in [1.0, 0.9, 0.95, 0.93, 0.97]:
            updates, state = tx.update({"w": torch.ones(2)}, state, params, value=torch.tensor(loss))
        print(float(state.scale))   # 0.5: two values in a row no better than 0.9
    """
    if factor <= 0.0 or factor >= 1.0:
        raise ValueError(f"reduce_on_plateau: factor must be in (0, 1), got {factor}")
    if rtol < 0.0 or atol < 0.0:
        raise ValueError(f"reduce_on_plateau: rtol and atol must be non-negative, got rtol={rtol}, atol={atol}")
    if rtol == 0.0 and atol == 0.0:
        raise ValueError("reduce_on_plateau: at least one of rtol and atol must be positive")
    if rtol > 1.0:
        raise ValueError(f"reduce_on_plateau: rtol must be at most 1, got {rtol}")
    factor, rtol, atol = float(factor), float(rtol), float(atol)

    def init_fn(params: Any) -> ReduceLROnPlateauState:
        device = tree_lib.first_device(params)
        dtypes = _float_dtypes(params)
        lowest = min(dtypes, key=lambda d: torch.finfo(d).bits)
        highest = max(dtypes, key=lambda d: torch.finfo(d).bits)
        count = fe.zero_count(params)
        return ReduceLROnPlateauState(
            scale=torch.ones((), dtype=lowest, device=device),
            best_value=torch.full((), float("inf"), dtype=highest, device=device),
            plateau_count=count,
            cooldown_count=count.clone(),
            count=count.clone(),
            avg_value=torch.zeros((), dtype=highest, device=device),
        )

    def _as(value: Number, like: Tensor) -> Tensor:
        if isinstance(value, Tensor):
            return value.to(device=like.device, dtype=like.dtype).reshape(())
        return torch.full((), value, dtype=like.dtype, device=like.device)

    def update_fn(updates, state, params=None, *, inplace=False, value=None, **extra_args):
        del params, extra_args
        if value is None:
            raise ValueError("reduce_on_plateau: value= is required (the quantity to monitor)")
        leaves = fe.leaves_of(updates, what="reduce_on_plateau")
        # accumulate the value into a running average
        count = state.count
        new_count = count + 1
        value_t = torch.as_tensor(value).to(device=state.avg_value.device, dtype=state.avg_value.dtype).reshape(())
        avg_value = (count.to(value_t.dtype) * state.avg_value + value_t) / new_count.to(value_t.dtype)
        done = new_count == _as(accumulation_size, new_count)

        # at the end of an accumulation: the plateau logic
        improved = avg_value < (1.0 - rtol) * state.best_value - atol
        best_value = torch.where(improved, avg_value, state.best_value)
        plateau = torch.where(improved, torch.zeros_like(state.plateau_count), state.plateau_count + 1)
        in_cooldown = state.cooldown_count > 0
        reduce = plateau == _as(patience, plateau)
        scale_if_not = torch.maximum(
            torch.where(reduce, state.scale * factor, state.scale), _as(min_scale, state.scale)
        ).to(state.scale.dtype)
        zero = torch.zeros_like(state.plateau_count)
        plateau_if_not = torch.where(reduce, zero, plateau)
        cooldown_if_not = torch.where(reduce, _as(cooldown, zero), zero)
        decided = ReduceLROnPlateauState(
            scale=torch.where(in_cooldown, state.scale, scale_if_not),
            best_value=best_value,
            plateau_count=torch.where(in_cooldown, zero, plateau_if_not),
            cooldown_count=torch.where(in_cooldown, state.cooldown_count - 1, cooldown_if_not),
            count=zero,
            avg_value=torch.zeros_like(avg_value),
        )
        accumulating = ReduceLROnPlateauState(
            scale=state.scale,
            best_value=state.best_value,
            plateau_count=state.plateau_count,
            cooldown_count=state.cooldown_count,
            count=new_count,
            avg_value=avg_value,
        )
        new_state = ReduceLROnPlateauState(*(torch.where(done, a, b) for a, b in zip(decided, accumulating)))

        def group(g):
            return (fe.mul(g, fe.on(new_state.scale, g), inplace=inplace),)

        (out,) = fe.map_groups(group, leaves.tensors, outputs=1)
        return leaves.rebuild(out), new_state

    return GradientTransformationExtraArgs(init_fn, update_fn)


__all__ = ["ReduceLROnPlateauState", "reduce_on_plateau"]
