"""Per-example gradient clipping for differentially private training (DP-SGD).

The gradients carry a leading batch dimension (as ``torch.func.vmap(torch.func.grad(loss))``
returns them): each example's gradient is clipped, then the clipped gradients are summed over the
batch. Everything is tensor arithmetic with no data-dependent Python branch and no ``.item()``, so
these functions also run inside ``torch.func.vmap`` (over, say, micro-batches) and under
``torch.compile``.

Numbers follow ``optax.per_example_global_norm_clip`` / ``per_example_layer_norm_clip``: an
example is scaled by ``min(1, clip / norm)``, a ``0 / 0`` multiplier (zero gradient, zero clip)
counts as ``1``, and an example counts as clipped when its multiplier is below ``1``. Norms
accumulate in float32 or wider whatever the gradient dtype.

Unlike optax, the gradients may be any pytree (not only a list) and ``None`` leaves are allowed:
they stay ``None`` in the result and are not counted. Counts are ``int64`` tensors.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
from torch import Tensor

from gradtx import tree as tree_lib

PyTree = Any


def _batched_leaves(grads: PyTree, owner: str) -> tuple[list[Any], Any, list[int]]:
    """Flattens ``grads`` and checks every tensor leaf shares one leading batch dimension."""
    tree_leaves, treedef, present = tree_lib.tensor_leaves(grads, what=owner)
    batch_size: Optional[int] = None
    for i in present:
        leaf = tree_leaves[i]
        if leaf.ndim == 0 or (batch_size is not None and leaf.shape[0] != batch_size):
            raise ValueError(
                f"{owner}: leaf {tree_lib.path_at(grads, i)!r} has shape {tuple(leaf.shape)}; every gradient "
                f"needs the same leading batch dimension"
                + (f" (the first leaf has {batch_size})" if batch_size is not None else "")
            )
        batch_size = leaf.shape[0]
    return tree_leaves, treedef, present


def _per_example_norms(grad: Tensor, dtype: torch.dtype) -> Tensor:
    """The L2 norm of every example (slice along dim 0) of ``grad``, accumulated and returned in the
    real ``dtype`` (a complex example's is the norm of its moduli)."""
    flat = grad.reshape(grad.shape[0], math.prod(grad.shape[1:]))
    return torch.linalg.vector_norm(flat, 2, dim=1, dtype=tree_lib.norm_dtype(tree_lib.state_dtype(dtype, grad))).to(dtype)


def _multipliers(norms: Tensor, clip: float | Tensor) -> Tensor:
    """``min(1, clip / norm)`` per example, ``0 / 0`` (NaN) read as ``1``."""
    return torch.nan_to_num(torch.clamp(clip / norms, max=1.0), nan=1.0)


def _weighted_sum(multipliers: Tensor, grad: Tensor) -> Tensor:
    """``sum_b multipliers[b] * grad[b]``, in float32 or wider (complex for a complex ``grad``),
    returned in ``grad``'s dtype."""
    dtype = torch.promote_types(grad.dtype, tree_lib.accumulation_dtype([grad.dtype, multipliers.dtype]))
    weights = multipliers.to(device=grad.device, dtype=dtype)
    return torch.tensordot(weights, grad.to(dtype), dims=1).to(grad.dtype)


def per_example_global_norm_clip(grads: PyTree, l2_norm_clip: float | Tensor) -> tuple[PyTree, Tensor]:
    """Clips each example's gradient to global L2 norm ``l2_norm_clip`` and sums over the batch.

    Args:
      grads: a pytree of gradients, each with the batch on dim 0 (``None`` leaves allowed).
      l2_norm_clip: the largest global norm one example may contribute (``inf`` disables clipping).

    Returns:
      ``(summed, num_clipped)``: a tree like ``grads`` without the batch dimension, and the number
      of examples that were scaled down (a 0-d int64 tensor).
    """
    tree_leaves, treedef, present = _batched_leaves(grads, "per_example_global_norm_clip")
    tensors = [tree_leaves[i] for i in present]
    if not tensors:
        return grads, torch.zeros((), dtype=torch.int64)
    dtype = tree_lib.accumulation_dtype([t.dtype for t in tensors])
    device = tensors[0].device
    leaf_norms = [_per_example_norms(t, dtype).to(device) for t in tensors]
    norms = torch.linalg.vector_norm(torch.stack(leaf_norms), 2, dim=0)
    multipliers = _multipliers(norms, l2_norm_clip)
    num_clipped = (multipliers < 1.0).sum()
    summed = [_weighted_sum(multipliers, t) for t in tensors]
    return tree_lib.unflatten(treedef, tree_lib.replace_present(tree_leaves, present, summed)), num_clipped


def per_example_layer_norm_clip(
    grads: PyTree, global_l2_norm_clip: float | Tensor, uniform: bool = True
) -> tuple[PyTree, PyTree]:
    """Clips each example's gradient leaf by leaf, then sums over the batch (McMahan et al., 2017).

    With ``K`` leaves (``None`` ones not counted) and ``C = global_l2_norm_clip``, leaf ``i`` is
    clipped to ``C / sqrt(K)`` when ``uniform``, else to ``C * sqrt(D_i / D)`` with ``D_i`` its
    per-example size and ``D`` the total; either way the clipped example's global norm is at most ``C``.

    Returns:
      ``(summed, num_clipped)``: two trees like ``grads``; the second holds, per leaf, how many
      examples that leaf clipped (0-d int64 tensors).
    """
    tree_leaves, treedef, present = _batched_leaves(grads, "per_example_layer_norm_clip")
    tensors = [tree_leaves[i] for i in present]
    if uniform:
        clips = [global_l2_norm_clip * (1.0 / max(len(tensors), 1)) ** 0.5] * len(tensors)
    else:
        sizes = [math.prod(t.shape[1:]) for t in tensors]
        total = sum(sizes)
        clips = [global_l2_norm_clip * (size / total) ** 0.5 for size in sizes]
    summed, counts = [], []
    for tensor, clip in zip(tensors, clips):
        dtype = tree_lib.accumulation_dtype([tensor.dtype])
        multipliers = _multipliers(_per_example_norms(tensor, dtype), clip)
        summed.append(_weighted_sum(multipliers, tensor))
        counts.append((multipliers < 1.0).sum())
    return (
        tree_lib.unflatten(treedef, tree_lib.replace_present(tree_leaves, present, summed)),
        tree_lib.unflatten(treedef, tree_lib.replace_present(tree_leaves, present, counts)),
    )
