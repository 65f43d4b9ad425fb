"""Gradient clipping: by global norm (torch-compatible numbers), by value, by block RMS, and AGC.

``clip_by_global_norm`` computes exactly what ``torch.nn.utils.clip_grad_norm_`` computes:
``norm = ||all leaves||_p``, ``coef = min(1, max_norm / (norm + 1e-6))``, every leaf times ``coef``,
with no data-dependent Python branch, so it runs under ``torch.func.vmap`` (per-example clipping)
and ``torch.compile(fullgraph=True)``. Norms accumulate in float32 or wider whatever the gradient
dtype, and the norm before clipping is kept in the state for logging.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple, Optional

import torch
from torch import Tensor

from gradtx import tree as tree_lib
from gradtx.base import EmptyState, GradientTransformation

_EPS = 1e-6  # the same epsilon as torch.nn.utils.clip_grad_norm_


def _check_non_negative(name: str, value: float, owner: str) -> float:
    value = float(value)
    if not value >= 0.0:  # also rejects NaN
        raise ValueError(f"{owner}: {name} must be >= 0, got {value}")
    return value


def _norm_state_dtype(params: Any) -> tuple[torch.dtype, torch.device]:
    tensors = [leaf for leaf in tree_lib.leaves(params) if isinstance(leaf, Tensor)]
    dtype = tree_lib.accumulation_dtype([t.dtype for t in tensors])
    device = tensors[0].device if tensors else torch.device("cpu")
    return dtype, device


def global_norm(tree: Any, *, norm_type: float = 2.0) -> Tensor:
    """The ``norm_type``-norm of every non-``None`` leaf of ``tree`` taken together (a 0-d tensor).

    Equal to ``torch.nn.utils.get_total_norm`` on the same tensors, but accumulated in float32 or
    wider whatever their dtype. ``norm_type`` may be ``inf``.
    """
    tree_leaves, _, present = tree_lib.tensor_leaves(tree, what="global_norm")
    return tree_lib.total_norm([tree_leaves[i] for i in present], float(norm_type))


class ClipByGlobalNormState(NamedTuple):
    """``norm``: the global norm of the last gradients *before* clipping (0-d tensor)."""

    norm: Tensor


def clip_by_global_norm(
    max_norm: float, *, norm_type: float = 2.0, error_if_nonfinite: bool = False
) -> GradientTransformation:
    """Scales all updates by ``min(1, max_norm / (norm + 1e-6))``, as ``clip_grad_norm_`` does.

    Args:
      max_norm: the largest global norm let through; ``0`` turns every update into zeros.
      norm_type: the p of the p-norm (``inf`` allowed).
      error_if_nonfinite: raise ``RuntimeError`` when the norm is NaN or infinite (this reads the
        norm on the host, so leave it off under ``vmap`` / ``torch.compile``). Otherwise a
        non-finite norm behaves as in torch; wrap the chain in ``apply_if_finite`` to skip such steps.
    """
    max_norm = _check_non_negative("max_norm", max_norm, "clip_by_global_norm")
    norm_type = float(norm_type)

    def init_fn(params: Any) -> ClipByGlobalNormState:
        dtype, device = _norm_state_dtype(params)
        return ClipByGlobalNormState(norm=torch.zeros((), dtype=dtype, device=device))

    def update_fn(updates, state, params=None, *, inplace=False):
        del params, state
        tree_leaves, treedef, present = tree_lib.tensor_leaves(updates, what="clip_by_global_norm")
        grads = [tree_leaves[i] for i in present]
        norm = tree_lib.total_norm(grads, norm_type)
        if error_if_nonfinite and not bool(torch.isfinite(norm)):
            raise RuntimeError(
                f"clip_by_global_norm: the total norm of order {norm_type} of the gradients is non-finite "
                f"({norm.item()}), so it cannot be clipped. Pass error_if_nonfinite=False to scale by it "
                "anyway, or wrap the chain in apply_if_finite to skip such steps."
            )
        coef = torch.clamp(max_norm / (norm + _EPS), max=1.0)
        clipped = tree_lib.scale_(grads, coef, inplace=inplace)
        new_updates = tree_lib.unflatten(treedef, tree_lib.replace_present(tree_leaves, present, clipped))
        return new_updates, ClipByGlobalNormState(norm=norm)

    return GradientTransformation(init_fn, update_fn)


def _clamp_all(tensors: list[Tensor], low: float, high: float, *, inplace: bool) -> list[Tensor]:
    if tree_lib.uses_functorch(tensors):
        return [t.clamp_(low, high) if inplace else t.clamp(low, high) for t in tensors]
    if not inplace:
        tensors = list(torch._foreach_clamp_min(tensors, low))
    else:
        torch._foreach_clamp_min_(tensors, low)
    torch._foreach_clamp_max_(tensors, high)
    return tensors


def clip_by_value(max_delta: float) -> GradientTransformation:
    """Clamps every update element into ``[-max_delta, max_delta]`` (as ``clip_grad_value_``)."""
    max_delta = _check_non_negative("max_delta", max_delta, "clip_by_value")

    def init_fn(params: Any) -> EmptyState:
        del params
        return EmptyState()

    def update_fn(updates, state, params=None, *, inplace=False):
        del params
        tree_leaves, treedef, present = tree_lib.tensor_leaves(updates, what="clip_by_value")
        grads = [tree_leaves[i] for i in present]
        clipped: list[Optional[Tensor]] = [None] * len(grads)
        for indices, (group,) in tree_lib.grouped(grads):
            for i, value in zip(indices, _clamp_all(group, -max_delta, max_delta, inplace=inplace)):
                clipped[i] = value
        return tree_lib.unflatten(treedef, tree_lib.replace_present(tree_leaves, present, clipped)), state

    return GradientTransformation(init_fn, update_fn)


clip = clip_by_value


def clip_by_block_rms(threshold: float) -> GradientTransformation:
    """Scales each leaf by ``1 / max(1, rms(leaf) / threshold)``, as ``optax.clip_by_block_rms``.

    ``threshold`` must be positive: every leaf's root-mean-square ends up ``<= threshold``.
    """
    threshold = float(threshold)
    if not threshold > 0.0:
        raise ValueError(f"clip_by_block_rms: threshold must be > 0, got {threshold}")

    def init_fn(params: Any) -> EmptyState:
        del params
        return EmptyState()

    def update_fn(updates, state, params=None, *, inplace=False):
        del params
        tree_leaves, treedef, present = tree_lib.tensor_leaves(updates, what="clip_by_block_rms")
        grads = [tree_leaves[i] for i in present]
        norms = tree_lib.local_norms(grads, 2.0)
        factors = [
            1.0 / torch.clamp(n / (math.sqrt(max(g.numel(), 1)) * threshold), min=1.0) for n, g in zip(norms, grads)
        ]
        out: list[Optional[Tensor]] = [None] * len(grads)
        for indices, (group, group_factors) in tree_lib.grouped(grads, factors):
            for i, value in zip(indices, tree_lib.foreach_mul(group, group_factors, inplace=inplace)):
                out[i] = value
        return tree_lib.unflatten(treedef, tree_lib.replace_present(tree_leaves, present, out)), state

    return GradientTransformation(init_fn, update_fn)


def unitwise_norm(x: Tensor) -> Tensor:
    """The L2 norm of each output unit of ``x``, broadcastable against ``x``, in float32 or wider.

    Torch stores weights output-first (``Linear``: ``(out, in)``, ``Conv2d``: ``(out, in, kh, kw)``),
    so a unit is a slice along dim 0 and the norm reduces over every other dim. Scalars and vectors
    (after squeezing) are one unit. This is optax's ``unitwise_norm`` in torch's layout.
    """
    dtype = tree_lib.accumulation_dtype([x.dtype])
    if x.squeeze().ndim <= 1:
        return torch.linalg.vector_norm(x, 2, dtype=dtype)
    return torch.linalg.vector_norm(x, 2, dim=tuple(range(1, x.ndim)), keepdim=True, dtype=dtype)


def adaptive_grad_clip(clipping: float, eps: float = 1e-3) -> GradientTransformation:
    """Adaptive gradient clipping (Brock et al., 2021), as ``optax.adaptive_grad_clip``.

    Each unit's gradient norm is capped at ``clipping * max(||param unit||, eps)``; units under the
    cap are left as they are. Needs ``params``; unit norms follow torch's output-first layout
    (see :func:`unitwise_norm`).
    """
    clipping = _check_non_negative("clipping", clipping, "adaptive_grad_clip")
    eps = _check_non_negative("eps", eps, "adaptive_grad_clip")

    def init_fn(params: Any) -> EmptyState:
        del params
        return EmptyState()

    def update_fn(updates, state, params=None, *, inplace=False):
        if params is None:
            raise ValueError("adaptive_grad_clip: params are required (pass them to update)")
        tree_leaves, treedef, present = tree_lib.tensor_leaves(updates, what="adaptive_grad_clip")
        param_leaves = tree_lib.flatten_like(params, treedef, updates, what="params")
        out = list(tree_leaves)
        for i in present:
            grad, param = tree_leaves[i], param_leaves[i]
            if not isinstance(param, Tensor):
                raise TypeError(f"adaptive_grad_clip: params leaf {tree_lib.path_at(updates, i)!r} is not a tensor")
            if param.shape != grad.shape:
                raise ValueError(
                    f"adaptive_grad_clip: leaf {tree_lib.path_at(updates, i)!r} has gradient shape "
                    f"{tuple(grad.shape)} but parameter shape {tuple(param.shape)}"
                )
            grad_norm = unitwise_norm(grad)
            max_norm = torch.clamp(unitwise_norm(param), min=eps) * clipping
            factor = torch.where(grad_norm < max_norm, 1.0, max_norm / torch.clamp(grad_norm, min=_EPS))
            factor = factor.to(grad.dtype)
            out[i] = grad.mul_(factor) if inplace else grad * factor
        return tree_lib.unflatten(treedef, out), state

    return GradientTransformation(init_fn, update_fn)
