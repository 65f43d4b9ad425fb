"""Scalings by per-leaf ("block") norms and by the global norm, and the non-negativity constraint.

A block is one leaf (a weight matrix, a bias vector). Per-leaf norms come from
:func:`gradtx.sharding.leaf_norms` / :func:`gradtx.sharding.leaf_rms`: with a sharding ``spec`` (or
DTensor leaves) they are the norms of the whole logical leaf, reduced over its shard axes; without,
the local norms, accumulated in float32 or wider.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import torch
from torch import Tensor

from gradtx import sharding
from gradtx import tree as tree_lib
from gradtx.base import GradientTransformation, init_empty_state, takes_spec
from gradtx.state_check import named
from gradtx.transforms import _foreach as fe


def _scale_by_param_blocks(owner: str, measure, min_scale: float, spec) -> GradientTransformation:
    min_scale = float(min_scale)

    def update_fn(updates, state, params=None, *, inplace=False):
        leaves = fe.leaves_of(updates, what=owner)
        param_values = fe.params_of(leaves, params, owner=owner)
        sizes = tree_lib.leaves(measure(leaves.rebuild(param_values), spec))
        # optax's safe_norm / safe_root_mean_squares: the measure, or min_scale where it is not above it
        factors = [torch.where(sizes[i] <= min_scale, min_scale, sizes[i]) for i in leaves.present]

        def group(g, f):
            return (fe.mul(g, [x.to(device=t.device, dtype=t.dtype) for x, t in zip(f, g)], inplace=inplace),)

        (scaled,) = fe.map_groups(group, leaves.tensors, factors, outputs=1)
        return leaves.rebuild(scaled), state

    return GradientTransformation(init_empty_state, named(update_fn, owner))


@takes_spec
def scale_by_param_block_norm(
    min_scale: float = 1e-3, *, spec: Optional[sharding.ShardingSpec] = None
) -> GradientTransformation:
    """Multiplies each leaf of the updates by the l2 norm of its parameter, at least ``min_scale``."""
    return _scale_by_param_blocks("scale_by_param_block_norm", sharding.leaf_norms, min_scale, spec)


@takes_spec
def scale_by_param_block_rms(
    min_scale: float = 1e-3, *, spec: Optional[sharding.ShardingSpec] = None
) -> GradientTransformation:
    """Multiplies each leaf of the updates by the root-mean-square of its parameter, at least
    ``min_scale`` (Adafactor's ``multiply_by_parameter_scale``)."""
    return _scale_by_param_blocks("scale_by_param_block_rms", sharding.leaf_rms, min_scale, spec)


@takes_spec
def normalize_by_update_norm(
    scale_factor: float = 1.0, eps: float = 1e-6, *, spec: Optional[sharding.ShardingSpec] = None
) -> GradientTransformation:
    """Divides the updates by ``(global_norm(updates) + eps) / scale_factor``: every step has l2 norm
    ``scale_factor`` (up to ``eps``). Under a ``spec`` the norm is that of the logical updates."""
    owner = "normalize_by_update_norm"
    scale_factor, eps = fe.number_or_tensor(scale_factor), float(eps)

    def update_fn(updates, state, params=None, *, inplace=False):
        del params
        leaves = fe.leaves_of(updates, what=owner)
        if not leaves.tensors and spec is None:
            return updates, state
        norm = sharding.global_norm(updates, spec)  # a pipeline stage without gradients still joins the reduction
        if not leaves.tensors:
            return updates, state
        factor = scale_factor / (norm.to(torch.float64) + eps)

        def group(g):
            return (fe.mul(g, fe.on(factor, g), inplace=inplace),)

        (scaled,) = fe.map_groups(group, leaves.tensors, outputs=1)
        return leaves.rebuild(scaled), state

    return GradientTransformation(init_empty_state, update_fn)


class NonNegativeParamsState(NamedTuple):
    """``keep_params_nonnegative`` keeps no state."""


def keep_params_nonnegative() -> GradientTransformation:
    """Where ``param + update`` would be negative the update becomes ``-param``, so that applying it
    lands on zero (a projection onto the non-negative orthant, as optax's)."""
    owner = "keep_params_nonnegative"

    def init_fn(params: Any) -> NonNegativeParamsState:
        tree_lib.refuse_complex(params, owner=owner, why="complex numbers have no sign")
        return NonNegativeParamsState()

    def update_fn(updates, state, params=None, *, inplace=False):
        leaves = fe.leaves_of(updates, what=owner)
        param_values = fe.params_of(leaves, params, owner=owner)
        outs = []
        for u, p in zip(leaves.tensors, param_values):
            out = torch.where(p + u < 0.0, -p, u).to(u.dtype)
            outs.append(u.copy_(out) if inplace else out)
        return leaves.rebuild(outs), state

    return GradientTransformation(init_fn, update_fn)


class ScaleByDistanceOverGradientsState(NamedTuple):
    """``max_dist``: per leaf, the largest distance from the initial parameters so far (0-d);
    ``grad_sum_of_squares``: per leaf, the running sum of squared gradient entries (shape ``(1,)``,
    as optax's); ``init_params``: the initial parameters in ``param_dtype``."""

    max_dist: Any
    grad_sum_of_squares: Any
    init_params: Any


@takes_spec
def scale_by_distance_over_gradients(
    reps_rel: float = 1e-6,
    eps: float = 1e-8,
    param_dtype: Optional[torch.dtype] = torch.float32,
    global_scale: float = 1.0,
    *,
    spec: Optional[sharding.ShardingSpec] = None,
) -> GradientTransformation:
    """Layer-wise DoG (Ivgi et al., 2023), learning-rate free, as optax defines it.

    Per leaf: ``max_dist = max(max_dist, ||param - init_param||)`` (starting at
    ``reps_rel * (1 + ||init_param||)``), ``grad_sum_of_squares += sum(g^2)``, and the update is
    ``global_scale * max_dist / sqrt(grad_sum_of_squares + eps) * g``. ``params`` are required.
    The two per-leaf scalars are kept in float32 or the parameter's dtype if wider (optax uses
    JAX's default float); ``param_dtype=None`` keeps the initial parameters in their own dtype.
    Under a ``spec`` the norms are those of the logical leaves.
    """
    owner = "scale_by_distance_over_gradients"
    reps_rel, eps, global_scale = float(reps_rel), float(eps), float(global_scale)

    def scalar_dtype(p: Tensor) -> torch.dtype:
        return torch.promote_types(p.dtype, torch.float32)

    def init_fn(params: Any) -> ScaleByDistanceOverGradientsState:
        # optax keeps the initial params in a real param_dtype and sums the complex g * g
        tree_lib.refuse_complex(params, owner=owner, why="its distances and sums of squares are kept for real numbers")
        norms = sharding.leaf_norms(params, spec)
        return ScaleByDistanceOverGradientsState(
            max_dist=tree_lib.tree_map(lambda n, p: (reps_rel * (1.0 + n)).to(scalar_dtype(p)), norms, params),
            grad_sum_of_squares=tree_lib.tree_map(
                lambda p: torch.zeros((1,), dtype=scalar_dtype(p), device=p.device), params
            ),
            init_params=tree_lib.tree_map(lambda p: p.detach().to(param_dtype or p.dtype, copy=True), params),
        )

    def update_fn(updates, state, params=None, *, inplace=False):
        leaves = fe.leaves_of(updates, what=owner)
        param_values = fe.params_of(leaves, params, owner=owner)
        max_dist = leaves.aligned(state.max_dist, what=f"{owner}: state.max_dist")
        sums = leaves.aligned(state.grad_sum_of_squares, what=f"{owner}: state.grad_sum_of_squares")
        init = leaves.aligned(state.init_params, what=f"{owner}: state.init_params")
        moved = [p - i.to(p.dtype) for p, i in zip(param_values, init)]
        distances = tree_lib.leaves(sharding.leaf_norms(leaves.rebuild(moved), spec))
        grad_norms = tree_lib.leaves(sharding.leaf_norms(updates, spec))
        outs, new_dist, new_sums = [], [], []
        for i, g, d, s in zip(leaves.present, leaves.tensors, max_dist, sums):
            d_new = torch.maximum(d, distances[i].to(d.dtype))
            s_new = s + (grad_norms[i].to(s.dtype) ** 2)
            eta = global_scale * (d_new / torch.sqrt(s_new + eps)).reshape(())
            out = (eta.to(g.dtype) * g) if g.dtype != eta.dtype else eta * g
            if inplace:
                d_new, s_new, out = d.copy_(d_new), s.copy_(s_new), g.copy_(out)
            outs.append(out)
            new_dist.append(d_new)
            new_sums.append(s_new)
        return leaves.rebuild(outs), ScaleByDistanceOverGradientsState(
            max_dist=leaves.rebuild(new_dist, like=state.max_dist),
            grad_sum_of_squares=leaves.rebuild(new_sums, like=state.grad_sum_of_squares),
            # a new state shares no storage with the old one (the caller may donate either later)
            init_params=state.init_params if inplace else tree_lib.tree_map(torch.clone, state.init_params),
        )

    return GradientTransformation(init_fn, update_fn)
