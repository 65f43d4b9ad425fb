"""NovoGrad (Ginsburg et al., 2019): Adam-like steps with one second moment per layer, as in optax.

The second moment of each leaf is a 0-d tensor tracking its squared norm; under a sharding ``spec``
(or with DTensor leaves) the norm is that of the whole logical leaf, reduced over its shard axes
with :func:`gradtx.sharding.leaf_norms`.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import torch
from torch import Tensor

from gradtx import sharding
from gradtx import tree as tree_lib
from gradtx.base import GradientTransformation, takes_spec
from gradtx.transforms import _foreach as fe
from gradtx.transforms.adam import _check_decay


class ScaleByNovogradState(NamedTuple):
    """``count``: steps so far (0-d int32); ``mu``: the first moment, like the params; ``nu``: one
    0-d second moment per leaf."""

    count: Tensor
    mu: Any
    nu: Any


@takes_spec
def scale_by_novograd(
    b1: float = 0.9,
    b2: float = 0.25,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    weight_decay: float = 0.0,
    mu_dtype: Optional[torch.dtype] = None,
    *,
    spec: Optional[sharding.ShardingSpec] = None,
) -> GradientTransformation:
    """NovoGrad's direction, optax's definition.

    Per leaf, ``nu = ||g||^2`` at the first step and ``b2 * nu + (1 - b2) * ||g||^2`` after;
    ``mu = b1 * mu + g / (sqrt(nu + eps_root) + eps) + weight_decay * param`` (``mu`` starts at zero).
    The update is ``mu``. ``params`` are needed when ``weight_decay`` is not zero.
    """
    owner = "scale_by_novograd"
    b1, b2 = _check_decay("b1", b1, owner), _check_decay("b2", b2, owner)
    eps, eps_root, weight_decay = float(eps), float(eps_root), fe.number_or_tensor(weight_decay)

    def init_fn(params: Any) -> ScaleByNovogradState:
        return ScaleByNovogradState(
            count=fe.zero_count(params),
            mu=fe.zeros_like_tree(params, mu_dtype),
            nu=tree_lib.tree_map(lambda p: torch.zeros((), dtype=p.dtype, device=p.device), params),
        )

    def update_fn(updates, state, params=None, *, inplace=False):
        leaves = fe.leaves_of(updates, what=owner)
        mu = leaves.aligned(state.mu, what=f"{owner}: state.mu")
        nu = leaves.aligned(state.nu, what=f"{owner}: state.nu")
        decays = not (isinstance(weight_decay, float) and weight_decay == 0.0)
        param_values = fe.params_of(leaves, params, owner=owner) if decays else [None] * len(mu)
        first = state.count == 0
        count = fe.increment(state.count, inplace=inplace)
        norms = tree_lib.leaves(sharding.leaf_norms(updates, spec))
        outs, new_mu, new_nu = [], [], []
        for i, g, m, v, p in zip(leaves.present, leaves.tensors, mu, nu, param_values):
            sq = (norms[i] ** 2).to(device=v.device, dtype=v.dtype)
            v_new = torch.where(first.to(v.device), sq, (1.0 - b2) * sq + b2 * v)
            scale = 1.0 / (torch.sqrt(v_new + eps_root) + eps)
            step = g * scale.to(g.dtype)
            if decays:
                step = step + weight_decay * p
            m_new = (b1 * m + step.to(m.dtype)).to(m.dtype)
            if inplace:
                v_new, m_new = v.copy_(v_new), m.copy_(m_new)
            out = m_new.to(g.dtype) if m_new.dtype != g.dtype else m_new.clone()
            outs.append(g.copy_(out) if inplace else out)
            new_mu.append(m_new)
            new_nu.append(v_new)
        return leaves.rebuild(outs), ScaleByNovogradState(
            count=count, mu=leaves.rebuild(new_mu, like=state.mu), nu=leaves.rebuild(new_nu, like=state.nu)
        )

    return GradientTransformation(init_fn, update_fn)
