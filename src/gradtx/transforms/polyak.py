"""Polyak's step size: scale the updates by ``(f(x) - f*) / ||u||^2``, capped (as ``optax.scale_by_polyak``).

The objective's value at the current params comes in as the extra argument ``value=``, so this is
a :class:`~gradtx.GradientTransformationExtraArgs`.
"""

from __future__ import annotations

from typing import Any, Union

import torch
from torch import Tensor

from gradtx import tree as tree_lib
from gradtx.base import GradientTransformationExtraArgs, init_empty_state

PyTree = Any
Scalar = Union[float, Tensor]


def _squared_norm(tensors: list[Tensor]) -> Tensor:
    """``sum_i ||t_i||^2`` (moduli squared for complex leaves) accumulated in float32 at least (float64 kept)."""
    dtype = tree_lib.accumulation_dtype([t.dtype for t in tensors])
    device = tensors[0].device
    return sum((tree_lib.real_inner(t, t, dtype).to(device) for t in tensors), torch.zeros((), dtype=dtype, device=device))


def _scalar(x: Scalar, dtype: torch.dtype, device: torch.device) -> Tensor:
    """A number or 0-d tensor as a 0-d tensor of ``dtype`` (a number is not rounded through float32 first)."""
    if isinstance(x, Tensor):
        return x.to(device=device, dtype=dtype).reshape(())
    return torch.tensor(float(x), dtype=dtype, device=device)


def scale_by_polyak(
    f_min: Scalar = 0.0,
    max_learning_rate: Scalar = 1.0,
    eps: Scalar = 0.0,
    variant: str = "sps",
) -> GradientTransformationExtraArgs:
    r"""Scales the updates by Polyak's step size.

    ``step = min((value - f_min) / (||u||^2 + eps), max_learning_rate)``, or 0 when
    ``||u||^2 + eps`` is at most the machine epsilon of the norm's dtype; the updates are multiplied
    by ``step``. With ``variant="sps+"`` the gap ``value - f_min`` is clipped at 0 from below.

    Args:
      f_min: a lower bound on the objective (``f*``).
      max_learning_rate: the largest step allowed.
      eps: added to the squared norm in the denominator.
      variant: ``"sps"`` or ``"sps+"``.

    The ``update`` takes the keyword argument ``value=``: the objective at the current params (a
    number or 0-d tensor). Stateless: the state is ``EmptyState()``.
    """
    if variant not in ("sps", "sps+"):
        raise ValueError(f"scale_by_polyak: variant must be 'sps' or 'sps+', got {variant!r}")

    def update_fn(updates, state, params=None, *, inplace=False, value, **extra_args):
        del params, extra_args
        leaves, treedef = tree_lib.flatten(updates)
        tensors = [leaf for leaf in leaves if leaf is not None]
        if not tensors:
            return updates, state
        grad_sq_norm = _squared_norm(tensors)
        dtype, device = grad_sq_norm.dtype, grad_sq_norm.device
        gap = _scalar(value, dtype, device) - _scalar(f_min, dtype, device)
        if variant == "sps+":
            gap = gap.clamp_min(0.0)
        denominator = grad_sq_norm + _scalar(eps, dtype, device)
        cap = _scalar(max_learning_rate, dtype, device)
        step = torch.where(
            denominator <= torch.finfo(dtype).eps,
            torch.zeros((), dtype=dtype, device=device),
            torch.minimum(gap / denominator, cap),
        )
        scaled = [
            None if leaf is None else (leaf.mul_(step.to(leaf.device, leaf.dtype)) if inplace else leaf * step.to(leaf.device, leaf.dtype))
            for leaf in leaves
        ]
        return tree_lib.unflatten(treedef, scaled), state

    return GradientTransformationExtraArgs(init_empty_state, update_fn)


__all__ = ["scale_by_polyak"]
