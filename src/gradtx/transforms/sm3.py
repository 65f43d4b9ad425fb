"""SM3 (Anil et al., 2019): memory-efficient adaptive scaling with one accumulator per dimension slice.

A leaf of shape ``(n_0, ..., n_k)`` keeps ``k + 1`` vectors ``mu[i]`` of length ``n_i`` (the
maximum of the accumulated squares over every slice along dimension ``i``) instead of a full second
moment; its accumulator is rebuilt each step as the elementwise minimum of the broadcast vectors.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import torch
from torch import Tensor

from gradtx import sharding
from gradtx import tree as tree_lib
from gradtx.base import GradientTransformation, takes_spec
from gradtx.sharding import dims as dims_lib
from gradtx.sharding import dtensor as dtensor_lib
from gradtx.transforms import _foreach as fe


class ScaleBySM3State(NamedTuple):
    """``mu``: per leaf, a list of one vector per dimension (the accumulators); ``nu``: the momentum
    of the scaled updates, like the params."""

    mu: Any
    nu: Any


def _expanded(vector: Tensor, ndim: int, axis: int) -> Tensor:
    shape = [1] * ndim
    shape[axis] = vector.shape[0]
    return vector.reshape(shape)


def _vector_like(vector: Tensor, leaf: Tensor, axis: int) -> Tensor:
    """``vector`` (one value per index of ``leaf``'s dim ``axis``) laid out as ``leaf`` lays that dim
    out: for a DTensor leaf, split where the leaf's dim ``axis`` is split and copied elsewhere (a
    maximum over a split dim is reduced across ranks here), so the accumulators are the dense
    run's at any sharding."""
    if not dtensor_lib.is_dtensor(leaf):
        return vector
    from torch.distributed.tensor import Replicate, Shard

    placements = [Shard(0) if p.is_shard() and getattr(p, "dim", None) == axis and vector.ndim else Replicate() for p in leaf.placements]  # type: ignore[attr-defined]
    if dtensor_lib.is_dtensor(vector):
        return vector.redistribute(leaf.device_mesh, placements)  # type: ignore[attr-defined]
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(vector, leaf.device_mesh, placements, src_data_rank=None)  # type: ignore[attr-defined]


def _piece_layouts(leaves: fe.Leaves, updates: Any, spec: Optional[sharding.ShardingSpec]) -> tuple[list[Any], Any]:
    """Per present leaf its dim layout under ``spec`` (``None`` for a DTensor, whose own ops reduce),
    and the layouts' reducer; ``None`` for each without a spec."""
    if spec is None:
        return [None] * len(leaves.tensors), None
    dims = dims_lib.dim_layouts(updates, spec, what="scale_by_sm3")
    present = [dims.layouts[i] for i in leaves.present]
    return [None if dtensor_lib.is_dtensor(g) else d for g, d in zip(leaves.tensors, present)], dims


@takes_spec
def scale_by_sm3(
    b1: float = 0.9, b2: float = 1.0, eps: float = 1e-8, *, spec: Optional[sharding.ShardingSpec] = None
) -> GradientTransformation:
    """SM3-II with momentum, optax's definition.

    ``acc = c * g^2 + b2 * min_i(mu[i])`` (``c = 1 - b2``, or 1 when ``b2 == 1``; a vector's
    accumulator is its single ``mu[0]``), ``u = g / sqrt(acc + eps)`` (0 where ``acc`` is 0),
    ``nu = b1 * nu + (1 - b1) * u``; ``mu[i]`` becomes the maximum of ``acc`` over all dimensions but
    ``i``. The update is ``nu``. A 0-d leaf is treated as a vector of one element (optax has no
    accumulator for it), its ``mu`` a list of one 0-d tensor.

    Under sharding the accumulators are the dense run's: a DTensor leaf keeps each ``mu[i]`` split as
    its dim ``i`` is (copied elsewhere), and a maximum over a split dim is reduced across ranks by
    DTensor; plain pieces need ``spec`` (a :class:`gradtx.sharding.ShardingSpec` naming each split
    matrix's dim, ``Shard("tp", dim=...)``), and each rank keeps its slice of every ``mu[i]``, the
    maxima over split dims reduced in one all-reduce per set of axes.
    """
    owner = "scale_by_sm3"
    b1, b2, eps = float(b1), float(b2), float(eps)
    c0 = (1.0 - b2) if b2 != 1.0 else 1.0

    def accumulators(p: Tensor) -> list[Tensor]:
        if p.ndim == 0:
            return [_vector_like(torch.zeros((), dtype=p.dtype, device=dtensor_lib.local(p).device), p, 0)]
        return [_vector_like(torch.zeros((n,), dtype=p.dtype, device=dtensor_lib.local(p).device), p, axis) for axis, n in enumerate(p.shape)]

    def init_fn(params: Any) -> ScaleBySM3State:
        tree_lib.refuse_complex(params, owner=owner, why="its accumulators are maxima (as in optax, which refuses them too)")
        leaves, treedef = tree_lib.flatten(params)
        mu = [None if p is None else accumulators(p) for p in leaves]
        return ScaleBySM3State(mu=tree_lib.unflatten(treedef, mu), nu=fe.zeros_like_tree(params))

    def update_fn(updates, state, params=None, *, inplace=False):
        del params
        leaves = fe.leaves_of(updates, what=owner)
        nus = leaves.aligned(state.nu, what=f"{owner}: state.nu")
        # each leaf's mu is a list: the state's mu is flattened down to the updates' structure only
        mu_lists = leaves.treedef.flatten_up_to(state.mu)
        mus = [mu_lists[i] for i in leaves.present]
        # plain pieces under a spec: a maximum over a split dim is this rank's, reduced below
        layouts, dims = _piece_layouts(leaves, updates, spec)
        accs, new_mus, pending = [], [], []
        for k, (g, v_list) in enumerate(zip(leaves.tensors, mus)):
            sq = g * g
            if g.ndim < 2:
                acc = c0 * sq + b2 * v_list[0]
                new_v = [acc.clone()] if g.ndim == 1 else [acc.reshape(())]
            else:
                bound = _expanded(v_list[0], g.ndim, 0)
                for axis in range(1, g.ndim):
                    bound = torch.minimum(bound, _expanded(v_list[axis], g.ndim, axis))
                acc = c0 * sq + b2 * bound
                new_v = []
                for axis in range(g.ndim):
                    others = [d for d in range(g.ndim) if d != axis]
                    new_v.append(_vector_like(torch.amax(acc, dim=others), g, axis))
                    if layouts[k] is not None and layouts[k].axes_of(*others):
                        pending.append((layouts[k].axes_of(*others), k, axis))
            accs.append(acc)
            new_mus.append(new_v)
        if pending:  # one all-reduce (MAX) per set of axes, on every rank alike
            reduced = dims.max_over([(axes, new_mus[k][axis]) for axes, k, axis in pending])
            for (_, k, axis), value in zip(pending, reduced):
                new_mus[k][axis] = value
        outs, new_nus = [], []
        for g, acc, nu, v_list, k in zip(leaves.tensors, accs, nus, mus, range(len(mus))):
            scale = torch.where(acc > 0, torch.rsqrt(acc + eps), 0.0)
            new_nu = (1.0 - b1) * (g * scale) + b1 * nu
            if inplace:
                new_mus[k] = [v.copy_(n) for v, n in zip(v_list, new_mus[k])]
                new_nu = nu.copy_(new_nu)
            outs.append(g.copy_(new_nu) if inplace else new_nu.clone())
            new_nus.append(new_nu)
        return leaves.rebuild(outs), ScaleBySM3State(
            mu=tree_lib.unflatten(leaves.treedef, tree_lib.replace_present(mu_lists, leaves.present, new_mus)),
            nu=leaves.rebuild(new_nus, like=state.nu),
        )

    return GradientTransformation(init_fn, update_fn)
