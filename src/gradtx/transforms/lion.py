"""Lion (Chen et al., 2023): the sign of an interpolation of the momentum and the gradient."""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import torch
from torch import Tensor

from gradtx.base import GradientTransformation, set_elementwise
from gradtx.transforms import _foreach as fe

_MODES = ("hard", "smooth", "refined")


class ScaleByLionState(NamedTuple):
    """``count``: steps so far (0-d int32); ``mu``: the momentum, like the params."""

    count: Tensor
    mu: Any


def scale_by_lion(
    b1: float = 0.9,
    b2: float = 0.99,
    mu_dtype: Optional[torch.dtype] = None,
    *,
    mode: str = "hard",
    smooth_beta: float = 1.0,
) -> GradientTransformation:
    """Updates ``sign((1 - b1) * g + b1 * mu)``, then ``mu = (1 - b2) * g + b2 * mu``, as optax.

    ``mode="smooth"`` uses ``tanh(smooth_beta * x)`` and ``mode="refined"`` keeps ``x`` where
    ``|x| < 1`` (``clamp(x, -1, 1)``) instead of the sign. The sign of a complex entry is ``x / |x|``.
    """
    if mode not in _MODES:
        raise ValueError(f"scale_by_lion: mode must be one of {_MODES}, got {mode!r}")
    b1, b2, smooth_beta = float(b1), float(b2), float(smooth_beta)

    def init_fn(params: Any) -> ScaleByLionState:
        return ScaleByLionState(count=fe.zero_count(params), mu=fe.zeros_like_tree(params, mu_dtype))

    def update_fn(updates, state, params=None, *, inplace=False):
        del params
        leaves = fe.leaves_of(updates, what="scale_by_lion")
        mu = leaves.aligned(state.mu, what="scale_by_lion: state.mu")

        def group(g, m):
            # g + b1 * (mu - g) == (1 - b1) * g + b1 * mu, in a new buffer: g is still needed.
            x = fe.lerp(g, fe.cast(m, g[0].dtype), b1, inplace=False)
            if mode == "hard":
                x = fe.sign(x, inplace=True)
            elif mode == "smooth":
                x = fe.tanh(fe.mul(x, smooth_beta, inplace=True), inplace=True)
            elif x[0].is_complex():  # x where |x| < 1, else x / |x|: the real clamp, on the unit disc
                x = [torch.where(xi.abs() < 1.0, xi, torch.sgn(xi)) for xi in x]
            else:
                x = fe.clamp_max(fe.clamp_min(x, -1.0, inplace=True), 1.0, inplace=True)
            m = fe.lerp(m, fe.cast(g, m[0].dtype), 1.0 - b2, inplace=inplace)
            if inplace:
                x = fe.copy_into(g, x)
            return x, m

        new_updates, new_mu = fe.map_groups(group, leaves.tensors, mu, outputs=2, pack=not inplace)
        count = fe.increment(state.count, inplace=inplace)
        return leaves.rebuild(new_updates), ScaleByLionState(count=count, mu=leaves.rebuild(new_mu, like=state.mu))

    return GradientTransformation(init_fn, set_elementwise(update_fn))
