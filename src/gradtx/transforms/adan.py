"""Adan (Xie et al., 2022): Nesterov-style moments of the gradient and of its change, as in optax."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor

from gradtx.base import GradientTransformation
from gradtx.state_signs import nonnegative
from gradtx.transforms import _foreach as fe
from gradtx.transforms.adam import _check_decay, _correction, first_moment, second_moment


@nonnegative("n")
class ScaleByAdanState(NamedTuple):
    """``m``, ``v``, ``n``: moving averages of the gradient, of its change and of the squared
    corrected gradient; ``g``: the last gradient; ``t``: steps so far (0-d int32), as optax names them."""

    m: Any
    v: Any
    n: Any
    g: Any
    t: Tensor


def scale_by_adan(
    b1: float = 0.98, b2: float = 0.92, b3: float = 0.99, eps: float = 1e-8, eps_root: float = 0.0
) -> GradientTransformation:
    """Adan, Algorithm 1 of the paper as optax computes it.

    With ``d = g - g_prev`` (zero at the first step): ``m = b1 m + (1 - b1) g``,
    ``v = b2 v + (1 - b2) d``, ``n = b3 n + (1 - b3) (g + (1 - b2) d)^2``, and the update is
    ``(m_hat + (1 - b2) v_hat) / (sqrt(n_hat + eps_root) + eps)`` with each moment bias-corrected by
    its own rate.
    """
    owner = "scale_by_adan"
    b1, b2, b3 = _check_decay("b1", b1, owner), _check_decay("b2", b2, owner), _check_decay("b3", b3, owner)
    eps, eps_root = float(eps), float(eps_root)

    def init_fn(params: Any) -> ScaleByAdanState:
        return ScaleByAdanState(
            m=fe.zeros_like_tree(params),
            v=fe.zeros_like_tree(params),
            n=fe.zeros_like_tree(params),
            g=fe.zeros_like_tree(params),
            t=fe.zero_count(params),
        )

    def update_fn(updates, state, params=None, *, inplace=False):
        del params
        leaves = fe.leaves_of(updates, what=owner)
        ms = leaves.aligned(state.m, what=f"{owner}: state.m")
        vs = leaves.aligned(state.v, what=f"{owner}: state.v")
        ns = leaves.aligned(state.n, what=f"{owner}: state.n")
        prev = leaves.aligned(state.g, what=f"{owner}: state.g")
        first = state.t == 0
        t = fe.increment(state.t, inplace=inplace)
        inv_bc1, inv_bc2, inv_bc3 = (1.0 / _correction(b, t) for b in (b1, b2, b3))

        def group(g, m, v, n, p):
            change = fe.add(fe.cast(g, p[0].dtype), p, alpha=-1.0, inplace=False)
            flag = first.to(change[0].device)
            change = [torch.where(flag, 0.0, c) for c in change]
            m = first_moment(m, g, b1, inplace=inplace)
            v = first_moment(v, change, b2, inplace=inplace)
            corrected = fe.add(fe.cast(g, change[0].dtype), change, alpha=1.0 - b2, inplace=False)
            n = second_moment(n, corrected, b3, inplace=inplace)
            numer = fe.mul(fe.cast(m, corrected[0].dtype), fe.on(inv_bc1, corrected), inplace=False)
            numer = fe.add(numer, fe.mul(v, fe.on(inv_bc2, corrected), inplace=False), alpha=1.0 - b2, inplace=True)
            d = fe.mul(fe.cast(n, corrected[0].dtype), fe.on(inv_bc3, corrected), inplace=False)
            if not fe.known_zero(eps_root):
                d = fe.add(d, eps_root, inplace=True)
            # a new tensor for the sum: autograd needs the square root as it was
            d = fe.add(fe.sqrt(d, inplace=True), eps, inplace=False)
            out = fe.finish(fe.div(numer, d, inplace=True), g)
            # kept in the state's dtype (init's), as the donated step keeps it in its buffer
            new_prev = fe.copy_into(p, g) if inplace else [x.to(dtype=q.dtype, copy=True) for x, q in zip(g, p)]
            return (fe.copy_into(g, out) if inplace else out), m, v, n, new_prev

        new_updates, new_m, new_v, new_n, new_g = fe.map_groups(
            group, leaves.tensors, ms, vs, ns, prev, outputs=5, pack=not inplace
        )
        return leaves.rebuild(new_updates), ScaleByAdanState(
            m=leaves.rebuild(new_m, like=state.m),
            v=leaves.rebuild(new_v, like=state.v),
            n=leaves.rebuild(new_n, like=state.n),
            g=leaves.rebuild(new_g, like=state.g),
            t=t,
        )

    return GradientTransformation(init_fn, update_fn)
