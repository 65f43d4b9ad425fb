"""Numerically safe helpers that optax users reach for: norms with a floor and a finite gradient,
saturating counters, a gradient scaler, and the two ways of blending a slow copy of the params.

``safe_norm`` and ``safe_root_mean_squares`` return ``max(value, floor)`` whose derivative stays
finite where the value is 0 (a plain ``sqrt`` of a zero sum has an infinite derivative there).
``incremental_update`` and ``periodic_update`` keep target networks and EMA weights; the period
test stays on the device (``torch.where``), so nothing syncs with the host.

``update_moment``, ``update_moment_per_elem_norm``, ``update_infinity_moment`` and
``bias_correction`` are optax's top-level names for the moment helpers of
:mod:`gradtx.tree_utils` (``tree_update_moment``, ...): the same functions, not copies, kept
here with the other numerics optax exports at its top level.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence, Union

import torch
from torch import Tensor

from gradtx import tree as tree_lib
from gradtx import tree_utils

PyTree = Any
ScalarOrSchedule = Union[float, Tensor, Callable[[Tensor], Any]]
"""A hyperparameter given as a number, a 0-d tensor, or a schedule: a callable of the 0-d int32
step count returning a number or a 0-d tensor (see :mod:`gradtx.schedules`). Every signature in
gradtx that names this type takes all three."""


def safe_norm(
    x: Tensor,
    min_norm: Union[float, Tensor],
    ord: Optional[Union[int, float, str]] = None,  # noqa: A002 - optax's (and numpy's) name
    axis: Union[None, int, Sequence[int]] = None,
    keepdims: bool = False,
) -> Tensor:
    """``max(norm(x), min_norm)`` with a finite derivative where the norm is at most ``min_norm``.

    As ``optax.safe_norm``: where the norm is small the result is the constant ``min_norm`` and
    the norm is recomputed on ones, so its derivative (zero there) is never ``0 / 0``. ``ord`` and
    ``axis`` follow ``torch.linalg.norm`` (``None``: the 2-norm of the flattened tensor).
    """
    dim = tuple(axis) if isinstance(axis, (list, tuple)) else axis
    norm = torch.linalg.norm(x, ord, dim=dim, keepdim=True) if x.ndim else x.abs().reshape(())
    small = norm <= min_norm
    masked = torch.where(small, torch.ones_like(x), x)
    masked_norm = torch.linalg.norm(masked, ord, dim=dim, keepdim=keepdims) if x.ndim else masked.abs().reshape(())
    if not keepdims and x.ndim:
        small = small.reshape(masked_norm.shape) if dim is None else small.squeeze(dim)
    return torch.where(small, torch.as_tensor(min_norm, dtype=masked_norm.dtype, device=masked_norm.device), masked_norm)


def safe_root_mean_squares(x: Tensor, min_rms: Union[float, Tensor]) -> Tensor:
    """``max(rms(x), min_rms)`` with a finite derivative where the RMS is at most ``min_rms`` (as optax's;
    the RMS of a complex ``x`` is that of its moduli)."""

    def rms_of(t: Tensor) -> Tensor:
        return (torch.view_as_real(t).square().sum(-1) if t.is_complex() else t.square()).mean().sqrt()

    rms = rms_of(x)
    small = rms <= min_rms
    masked = torch.where(small, torch.ones_like(x), x)
    return torch.where(small, torch.as_tensor(min_rms, dtype=rms.dtype, device=rms.device), rms_of(masked))


def safe_increment(count: Tensor) -> Tensor:
    """``count + 1``, saturating at the dtype's largest value instead of wrapping (floats: no limit)."""
    limit = torch.iinfo(count.dtype).max if not count.dtype.is_floating_point else float("inf")
    return torch.where(count < limit, count + 1, count)


def safe_int32_increment(count: Tensor) -> Tensor:
    """:func:`safe_increment` for an int32 counter (optax's older name); other dtypes are an error."""
    if count.dtype != torch.int32:
        raise ValueError(f"safe_int32_increment: expected an int32 counter, got {count.dtype}")
    return safe_increment(count)


def scale_gradient(inputs: PyTree, scale: Union[float, Tensor]) -> PyTree:
    """Every tensor leaf unchanged in value, but its gradient multiplied by ``scale`` on the way back.

    ``x.detach() + scale * (x - x.detach())``: the forward value is exactly ``x`` (the second term is
    exactly zero), the derivative is ``scale``. ``scale=0`` stops the gradient.
    """

    def one(x: Tensor) -> Tensor:
        if not x.requires_grad and not tree_lib.needs_graph(x):
            return x
        frozen = x.detach()
        return frozen + scale * (x - frozen)

    return tree_lib.tree_map(one, inputs)


def incremental_update(new_tensors: PyTree, old_tensors: PyTree, step_size: Union[float, Tensor]) -> PyTree:
    """``step_size * new + (1 - step_size) * old`` leaf by leaf (a target network's Polyak average)."""
    return tree_lib.tree_map(lambda new, old: torch.lerp(old, new.to(old.dtype), step_size), new_tensors, old_tensors)


def periodic_update(new_tensors: PyTree, old_tensors: PyTree, steps: Union[int, Tensor], update_period: int) -> PyTree:
    """``new_tensors`` on steps that are a multiple of ``update_period``, else ``old_tensors``.

    A tensor ``steps`` is compared on the device and the trees selected with ``torch.where`` (no
    host synchronisation); an int ``steps`` selects in Python. The result never aliases the inputs'
    storage when selected on the device.
    """
    if update_period < 1:
        raise ValueError(f"periodic_update: update_period must be >= 1, got {update_period}")
    if not isinstance(steps, Tensor):
        chosen = new_tensors if steps % update_period == 0 else old_tensors
        return tree_lib.tree_map(lambda x: x, chosen)
    take_new = steps % update_period == 0
    return tree_lib.tree_map(
        lambda new, old: torch.where(take_new.to(old.device), new.to(old.dtype), old), new_tensors, old_tensors
    )


# optax's top-level names for the moment helpers of tree_utils: the same functions.
bias_correction = tree_utils.tree_bias_correction
update_infinity_moment = tree_utils.tree_update_infinity_moment
update_moment = tree_utils.tree_update_moment
update_moment_per_elem_norm = tree_utils.tree_update_moment_per_elem_norm
