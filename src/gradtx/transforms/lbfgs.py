"""L-BFGS: precondition the updates by a limited-memory inverse-Hessian estimate (``optax.scale_by_lbfgs``).

The estimate is built from the last ``memory_size`` differences of parameters and of updates
(gradients), kept stacked in the state (each leaf gets a leading ``memory_size`` axis), and applied
by the two-loop recursion (Algorithm 7.4 of Nocedal and Wright). Everything stays in tensors on the
params' device: the ring-buffer index is a 0-d tensor, nothing is read back to the host.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import torch
from torch import Tensor

from gradtx import tree as tree_lib
from gradtx.base import GradientTransformation, unsharded_only
from gradtx.sharding import dtensor as dtensor_lib
from gradtx.state_dims import ParamLeaf, state_dims

PyTree = Any


class ScaleByLBFGSState(NamedTuple):
    """As ``optax.ScaleByLBFGSState``.

    Attributes:
      count: updates done so far (0-d int32).
      params: the params at the last update.
      updates: the incoming updates (gradients) at the last update.
      diff_params_memory: the last ``memory_size`` parameter differences, stacked on a leading axis.
      diff_updates_memory: the matching update differences, stacked likewise.
      weights_memory: ``1 / <diff_updates, diff_params>`` for each entry (0 for an empty one).
    """

    count: Tensor
    params: PyTree
    updates: PyTree
    diff_params_memory: PyTree
    diff_updates_memory: PyTree
    weights_memory: Tensor


def _stacked(leaf: ParamLeaf) -> tuple:
    """A memory leaf: its leading dim is the memory's (whole), the others its param's."""
    return (None, *range(len(leaf.shape)))


# Laid out for checkpoints (gradtx.checkpoint): each memory entry is split as its param is.
state_dims(diff_params_memory=_stacked, diff_updates_memory=_stacked)(ScaleByLBFGSState)


def _pairs(a: PyTree, b: PyTree) -> list[tuple[Tensor, Tensor]]:
    return [(x, y) for x, y in zip(tree_lib.leaves(a), tree_lib.leaves(b)) if x is not None and y is not None]


def _vdot(a: PyTree, b: PyTree, dtype: torch.dtype, device: torch.device) -> Tensor:
    """``sum_i Re <a_i, b_i>`` over the leaves of two like-shaped trees (conjugated for complex
    leaves, optax's ``real(vdot)``), in the real ``dtype`` on ``device``."""
    total = torch.zeros((), dtype=dtype, device=device)
    for x, y in _pairs(a, b):
        total = total + tree_lib.real_inner(x, y, dtype).to(device)
    return total


def _axpy(alpha: Tensor, x: PyTree, y: PyTree) -> PyTree:
    """``y + alpha * x`` leaf by leaf, in ``y``'s dtypes (``alpha`` real, ``x`` real or complex)."""
    return tree_lib.tree_map(
        lambda yi, xi: yi + (alpha.to(yi.device) * xi.to(torch.promote_types(alpha.dtype, xi.dtype))).to(yi.dtype), y, x
    )


def _select(memory: PyTree, index: Tensor) -> PyTree:
    return tree_lib.tree_map(lambda m: m.index_select(0, index.to(m.device).reshape(1)).squeeze(0), memory)


def _refuse_dtensors(params: PyTree) -> None:
    """The memory and the inner products are of plain tensors: a DTensor param is an error naming it."""
    for path, leaf in zip(tree_lib.paths(params), tree_lib.leaves(params)):
        if dtensor_lib.is_dtensor(leaf):
            raise TypeError(
                f"scale_by_lbfgs: leaf {path!r} is a DTensor; L-BFGS keeps its memory and takes its inner products "
                "on plain tensors (gather the params with full_tensor(), or run it on an unsharded copy)"
            )


def precondition_by_lbfgs(
    updates: PyTree,
    diff_params_memory: PyTree,
    diff_updates_memory: PyTree,
    weights_memory: Tensor,
    identity_scale: Tensor,
    memory_idx: Tensor,
) -> PyTree:
    """The two-loop recursion: ``updates`` times the L-BFGS inverse-Hessian estimate.

    Entries are visited from the newest (just before ``memory_idx``) to the oldest and back; an
    entry with weight 0 (not filled yet) changes nothing.
    """
    memory_size = weights_memory.shape[0]
    dtype, device = weights_memory.dtype, weights_memory.device
    indices = (memory_idx.to(device=device, dtype=torch.long) + torch.arange(memory_size, device=device)) % memory_size
    vec = updates
    alphas: list[Tensor] = [torch.zeros((), dtype=dtype, device=device)] * memory_size
    for j in reversed(range(memory_size)):
        idx = indices[j]
        dw, du = _select(diff_params_memory, idx), _select(diff_updates_memory, idx)
        alphas[j] = weights_memory[idx] * _vdot(dw, vec, dtype, device)
        vec = _axpy(-alphas[j], du, vec)
    vec = tree_lib.tree_map(lambda v: v * identity_scale.to(v.device, v.dtype), vec)
    for j in range(memory_size):
        idx = indices[j]
        dw, du = _select(diff_params_memory, idx), _select(diff_updates_memory, idx)
        beta = weights_memory[idx] * _vdot(du, vec, dtype, device)
        vec = _axpy(alphas[j] - beta, dw, vec)
    return vec


def scale_by_lbfgs(memory_size: int = 10, scale_init_precond: bool = True) -> GradientTransformation:
    r"""Multiplies the updates by the L-BFGS estimate of the inverse Hessian (as ``optax.scale_by_lbfgs``).

    With :math:`\delta w_k = w_{k+1} - w_k`, :math:`\delta u_k = u_{k+1} - u_k` (params and incoming
    updates at successive calls) and :math:`\rho_k = 1 / \langle \delta u_k, \delta w_k \rangle`
    (0 when the product is 0), the estimate :math:`P_k` is built from the last ``memory_size``
    pairs on top of :math:`\gamma_k I`, where :math:`\gamma_k = \langle \delta w, \delta u\rangle /
    \|\delta u\|^2` for the newest pair when ``scale_init_precond`` (else 1). At the first call there
    is no pair and :math:`\gamma_0 = \min(1, 1/\|u_0\|)`. The output is :math:`P_k u_k`, a descent
    direction to be scaled by ``-1`` and a step size: :func:`gradtx.lbfgs` chains it with
    :func:`~gradtx.scale_by_zoom_linesearch`.

    The memory is updated before preconditioning, so in a chain with a line search the pair added
    at a call is the step the search accepted at the previous one. ``params`` are required. A
    ``None`` update ("no gradient") comes back ``None`` and leaves its leaf out of the estimate.

    Args:
      memory_size: the number of pairs kept.
      scale_init_precond: use :math:`\gamma_k I` rather than :math:`I` as the initial estimate.
    """
    if memory_size < 1:
        raise ValueError(f"scale_by_lbfgs: memory_size must be >= 1, got {memory_size}")

    def init_fn(params: PyTree) -> ScaleByLBFGSState:
        floats = [leaf.dtype for leaf in tree_lib.leaves(params) if isinstance(leaf, Tensor)]
        device = tree_lib.first_device(params)
        _refuse_dtensors(params)
        stacked = tree_lib.tree_map(lambda p: torch.zeros((memory_size, *p.shape), dtype=p.dtype, device=p.device), params)
        return ScaleByLBFGSState(
            count=torch.zeros((), dtype=torch.int32, device=device),
            params=tree_lib.tree_map(torch.zeros_like, params),
            updates=tree_lib.tree_map(torch.zeros_like, params),
            diff_params_memory=stacked,
            diff_updates_memory=tree_lib.tree_map(torch.zeros_like, stacked),
            weights_memory=torch.zeros(memory_size, dtype=tree_lib.accumulation_dtype(floats), device=device),
        )

    def update_fn(updates, state, params=None, *, inplace=False):
        if params is None:
            raise ValueError("scale_by_lbfgs: params are required (pass them to update)")
        weights = state.weights_memory
        dtype, device = weights.dtype, weights.device
        count = state.count.to(device)
        memory_idx = count % memory_size
        prev_idx = (count - 1) % memory_size
        started = count > 0

        # 1. the newest pair: differences since the last call (zero at the first one)
        diff_params = tree_lib.tree_map(
            lambda p, q, u: None if u is None else torch.where(started.to(p.device), p - q, 0), params, state.params, updates
        )
        diff_updates = tree_lib.tree_map(lambda u, v: torch.where(started.to(u.device), u - v, 0), updates, state.updates)
        curvature = _vdot(diff_updates, diff_params, dtype, device)
        weight = torch.where(curvature == 0, torch.zeros_like(curvature), 1.0 / curvature)
        weight = torch.where(started, weight, torch.zeros_like(weight))

        def store(memory: Tensor, value: Optional[Tensor]) -> Tensor:
            if value is None:  # no update for this leaf: its memory stays as it is
                return memory if inplace else memory.clone()
            value = value.to(memory.dtype).unsqueeze(0)
            index = prev_idx.to(device=memory.device, dtype=torch.long).reshape(1)
            return memory.index_copy_(0, index, value) if inplace else memory.index_copy(0, index, value)

        diff_params_memory = tree_lib.tree_map(store, state.diff_params_memory, diff_params)
        diff_updates_memory = tree_lib.tree_map(store, state.diff_updates_memory, diff_updates)
        weights_memory = store(weights, weight)

        # 2. the scale of the initial estimate
        if scale_init_precond:
            denominator = _vdot(diff_updates, diff_updates, dtype, device)
            identity_scale = torch.where(denominator > 0, curvature / denominator, torch.ones_like(curvature))
            update_norm = _vdot(updates, updates, dtype, device).detach().sqrt()
            capped_inv_norm = torch.clamp(1.0 / update_norm, max=1.0)
            identity_scale = torch.where(started, identity_scale, capped_inv_norm)
        else:
            identity_scale = torch.ones((), dtype=dtype, device=device)

        # 3. the two-loop recursion
        precond_updates = precondition_by_lbfgs(
            updates, diff_params_memory, diff_updates_memory, weights_memory, identity_scale, memory_idx
        )

        def keep(old: Tensor, new: Optional[Tensor]) -> Tensor:
            if new is None:
                return old if inplace else old.clone()
            return old.copy_(new) if inplace else new.clone()

        new_state = ScaleByLBFGSState(
            count=torch.where(count < torch.iinfo(count.dtype).max, count + 1, count).to(state.count.device),
            params=tree_lib.tree_map(keep, state.params, params),
            updates=tree_lib.tree_map(keep, state.updates, updates),
            diff_params_memory=diff_params_memory,
            diff_updates_memory=diff_updates_memory,
            weights_memory=weights_memory,
        )
        return precond_updates, new_state

    return GradientTransformation(init_fn, unsharded_only(update_fn, "scale_by_lbfgs", "inner products"))
