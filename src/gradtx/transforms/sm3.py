"""SM3 (Anil et al., 2019): memory-efficient adaptive scaling with one accumulator per dimension slice.

A leaf of shape ``(n_0, ..., n_k)`` keeps ``k + 1`` vectors ``mu[i]`` of length ``n_i`` (the
maximum of the accumulated squares over every slice along dimension ``i``) instead of a full second
moment; its accumulator is rebuilt each step as the elementwise minimum of the broadcast vectors.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor

from gradtx import tree as tree_lib
from gradtx.base import GradientTransformation
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


def scale_by_sm3(b1: float = 0.9, b2: float = 1.0, eps: float = 1e-8) -> GradientTransformation:
    """SM3-II with momentum, optax's definition.

    ``acc = c * g^2 + b2 * min_i(mu[i])`` (``c = 1 - b2``, or 1 when ``b2 == 1``; a vector's
    accumulator is its single ``mu[0]``), ``u = g / sqrt(acc + eps)`` (0 where ``acc`` is 0),
    ``nu = b1 * nu + (1 - b1) * u``; ``mu[i]`` becomes the maximum of ``acc`` over all dimensions but
    ``i``. The update is ``nu``. A 0-d leaf is treated as a vector of one element (optax has no
    accumulator for it), its ``mu`` a list of one 0-d tensor.
    """
    owner = "scale_by_sm3"
    b1, b2, eps = float(b1), float(b2), float(eps)
    c0 = (1.0 - b2) if b2 != 1.0 else 1.0

    def accumulators(p: Tensor) -> list[Tensor]:
        if p.ndim == 0:
            return [torch.zeros((), dtype=p.dtype, device=p.device)]
        return [torch.zeros((n,), dtype=p.dtype, device=p.device) for n in p.shape]

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
        outs, new_mus, new_nus = [], [], []
        for g, v_list, nu in zip(leaves.tensors, mus, nus):
            sq = g * g
            if g.ndim < 2:
                acc = c0 * sq + b2 * v_list[0]
                new_v = [acc.clone()] if g.ndim == 1 else [acc.reshape(())]
            else:
                bound = _expanded(v_list[0], g.ndim, 0)
                for axis in range(1, g.ndim):
                    bound = torch.minimum(bound, _expanded(v_list[axis], g.ndim, axis))
                acc = c0 * sq + b2 * bound
                new_v = [
                    torch.amax(acc, dim=[d for d in range(g.ndim) if d != axis]) for axis in range(g.ndim)
                ]
            scale = torch.where(acc > 0, torch.rsqrt(acc + eps), 0.0)
            new_nu = (1.0 - b1) * (g * scale) + b1 * nu
            if inplace:
                new_v = [v.copy_(n) for v, n in zip(v_list, new_v)]
                new_nu = nu.copy_(new_nu)
            outs.append(g.copy_(new_nu) if inplace else new_nu.clone())
            new_mus.append(new_v)
            new_nus.append(new_nu)
        return leaves.rebuild(outs), ScaleBySM3State(
            mu=tree_lib.unflatten(leaves.treedef, tree_lib.replace_present(mu_lists, leaves.present, new_mus)),
            nu=leaves.rebuild(new_nus, like=state.nu),
        )

    return GradientTransformation(init_fn, update_fn)
