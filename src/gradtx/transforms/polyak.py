"""Polyak's step size: scale the updates by ``(f(x) - f*) / ||u||^2``, capped (as ``optax.scale_by_polyak``).

The objective's value at the current params comes in as the extra argument ``value=``, so this is
a :class:`~gradtx.GradientTransformationExtraArgs`.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Union

import torch
from torch import Tensor

from gradtx import sharding
from gradtx import tree as tree_lib
from gradtx.base import GradientTransformationExtraArgs, init_empty_state, takes_spec
from gradtx.sharding import dtensor as dtensor_lib
from gradtx.transforms import _foreach as fe

PyTree = Any
Scalar = Union[float, Tensor]


def _squared_norm(updates: Any, tensors: Sequence[Tensor], spec: Optional[sharding.ShardingSpec]) -> Tensor:
    """``sum_i ||t_i||^2`` (moduli squared for complex leaves) accumulated in float32 at least (float64
    kept); under ``spec`` or DTensors, that of the logical updates, the same on every rank."""
    dtype = tree_lib.accumulation_dtype([dtensor_lib.local(t).dtype for t in tensors])
    if sharding.is_sharded(tensors, spec):
        square = lambda u: tree_lib.real_inner(u, u, dtype).reshape(1)  # noqa: E731
        return sharding.global_sums(square, updates, spec=spec, what="scale_by_polyak")[0]
    device = tensors[0].device
    return sum((tree_lib.real_inner(t, t, dtype).to(device) for t in tensors), torch.zeros((), dtype=dtype, device=device))


def _scalar(x: Scalar, dtype: torch.dtype, device: torch.device) -> Tensor:
    """A number or 0-d tensor as a 0-d tensor of ``dtype`` (a number is not rounded through float32 first)."""
    if isinstance(x, Tensor):
        return x.to(device=device, dtype=dtype).reshape(())
    return torch.tensor(float(x), dtype=dtype, device=device)


@takes_spec
def scale_by_polyak(
    f_min: Scalar = 0.0,
    max_learning_rate: Scalar = 1.0,
    eps: Scalar = 0.0,
    variant: str = "sps",
    *,
    spec: Optional[sharding.ShardingSpec] = None,
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
      spec: how the updates are sharded (a :class:`gradtx.sharding.ShardingSpec`): the norm is then
        that of the logical updates, with one collective, so every rank takes the same step. DTensor
        updates need no spec. A pipeline stage without updates still joins the collective.

    The ``update`` takes the keyword argument ``value=``: the objective at the current params (a
    number or 0-d tensor), the same on every rank under sharding (the whole model's loss, which a
    pipeline's last stage must share with the others). Stateless: the state is ``EmptyState()``.
    """
    if variant not in ("sps", "sps+"):
        raise ValueError(f"scale_by_polyak: variant must be 'sps' or 'sps+', got {variant!r}")

    def update_fn(updates, state, params=None, *, inplace=False, value, **extra_args):
        del params, extra_args
        leaves = fe.leaves_of(updates, what="scale_by_polyak")
        if not leaves.tensors and spec is None:
            return updates, state
        grad_sq_norm = _squared_norm(updates, leaves.tensors, spec)  # a stage without updates joins the reduction
        if not leaves.tensors:
            return updates, state
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

        def group(u):
            return (fe.mul(u, fe.on(step, u), inplace=inplace),)

        (scaled,) = fe.map_groups(group, leaves.tensors, outputs=1)
        return leaves.rebuild(scaled), state

    return GradientTransformationExtraArgs(init_empty_state, update_fn)


__all__ = ["scale_by_polyak"]
