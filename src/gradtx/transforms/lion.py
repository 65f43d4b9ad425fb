"""Lion (Chen et al., 2023): the sign of an interpolation of the momentum and the gradient."""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import torch
from torch import Tensor

from gradtx.base import (
    GradientTransformation,
    donation,
    set_elementwise,
    supports_donated_updates,
    takes_scaled_gradients,
)
from gradtx.native import lion as native_lion
from gradtx.numerics import ScalarOrSchedule
from gradtx.state_check import named
from gradtx.transforms import _foreach as fe
from gradtx.transforms.scaling import FoldedLearningRate
from gradtx.transforms.weight_decay import WeightDecayTerm, add_decay_term

_MODES = ("hard", "smooth", "refined")


class ScaleByLionState(NamedTuple):
    """``count``: steps so far (0-d int32); ``mu``: the momentum, like the params."""

    count: Tensor
    mu: Any


def _direction(g: list[Tensor], m: list[Tensor], b1: float, mode: str, smooth_beta: float) -> list[Tensor]:
    """Lion's direction in new buffers (``g`` is still needed): the sign (or its smooth or refined
    stand-in) of ``g + b1 * (mu - g) == (1 - b1) * g + b1 * mu``."""
    x = fe.lerp(g, fe.cast(m, g[0].dtype), b1, inplace=False)
    if mode == "hard":
        return fe.sign(x, inplace=True)
    if mode == "smooth":
        return fe.tanh(fe.mul(x, smooth_beta, inplace=True), inplace=True)
    if x[0].is_complex():  # x where |x| < 1, else x / |x|: the real clamp, on the unit disc
        return [torch.where(xi.abs() < 1.0, xi, torch.sgn(xi)) for xi in x]
    return fe.clamp_max(fe.clamp_min(x, -1.0, inplace=True), 1.0, inplace=True)


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
            x = _direction(g, m, b1, mode, smooth_beta)
            m = fe.lerp(m, fe.cast(g, m[0].dtype), 1.0 - b2, inplace=inplace)
            if inplace:
                x = fe.copy_into(g, x)
            return x, m

        new_updates, new_mu = fe.map_groups(group, leaves.tensors, mu, outputs=2, pack=not inplace)
        count = fe.increment(state.count, inplace=inplace)
        return leaves.rebuild(new_updates), ScaleByLionState(count=count, mu=leaves.rebuild(new_mu, like=state.mu))

    return GradientTransformation(init_fn, set_elementwise(update_fn))


def fused_lion(
    learning_rate: ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.99,
    mu_dtype: Optional[torch.dtype] = None,
    weight_decay: ScalarOrSchedule = 1e-3,
    mask: Any = None,
) -> GradientTransformation:
    """``chain(scale_by_lion(b1, b2, mu_dtype), add_decayed_weights(weight_decay, mask),
    scale_by_learning_rate(learning_rate))`` as one transformation, for :func:`gradtx.lion`: that
    chain's state (a tuple ``(ScaleByLionState, decay state, learning-rate state)``) and its numbers
    bit for bit. Eagerly, for float32 CPU tensors, one C kernel makes the step in one pass over
    memory, and a ``clip_by_global_norm`` before it in a :func:`~gradtx.chain` hands it its
    coefficient (see :func:`~gradtx.base.takes_scaled_gradients`)."""
    b1, b2 = float(b1), float(b2)
    term = WeightDecayTerm(weight_decay, mask, "lion", why=" for weight decay")
    rate = FoldedLearningRate(learning_rate)

    def init_fn(params: Any) -> tuple:
        lion_state = ScaleByLionState(count=fe.zero_count(params), mu=fe.zeros_like_tree(params, mu_dtype))
        return (lion_state, term.init(params), rate.init(params))

    def update_fn(updates, state, params=None, *, inplace=False, **extra_args):
        del extra_args  # value=, grad=, ...: taken and ignored, as by the chain it stands for
        return run(updates, state, params, inplace)

    def scaled_update(updates, state, params=None, *, inplace=False, grad_scale, scaling=None):
        return run(updates, state, params, inplace, grad_scale, scaling)

    def run(updates, state, params, inplace, grad_scale=None, scaling=None):
        own_updates, own_state = donation(inplace)
        lion_state = state[0]
        leaves = fe.leaves_of(updates, what="lion")
        mu = leaves.aligned(lion_state.mu, what="lion: state[0].mu")
        decay, decay_state = term.step(updates, state[1], params, inplace=own_state)
        factor, flags, param_values = decay if decay is not None else (None, [False] * len(mu), [None] * len(mu))
        step, lr_state = rate.step(state[2], inplace=own_state)

        def group(g, m, decayed, p):
            scale = grad_scale
            if scale is not None and scaling is not None:  # a scaling that reads the gradients (observe's) scales them
                g, scale = fe.scaled(list(g), scale, scaling, inplace=own_updates), None
            if not torch.compiler.is_compiling():  # one pass for plain float32 CPU tensors, the same numbers
                done = native_lion.step(
                    g, m, decayed, p, b1=b1, b2=b2, factor=factor, step=step, inplace=own_state,
                    own_updates=own_updates, grad_scale=scale,
                )
                if done is not None:
                    return done
            if scale is not None:
                g = fe.scaled(list(g), scale, None, inplace=own_updates)
            x = add_decay_term(_direction(g, m, b1, "hard", 1.0), p, decayed, factor, inplace=True)  # new buffers
            if step is not None:
                x = fe.mul(x, fe.on(step, x), inplace=True)
            m = fe.lerp(m, fe.cast(g, m[0].dtype), 1.0 - b2, inplace=own_state)
            if own_updates:
                x = fe.copy_into(g, x)
            return x, m

        pack = not (own_updates or own_state or scaling is not None)  # a scaling that reads the gradients sees them as given
        new_updates, new_mu = fe.map_groups(group, leaves.tensors, mu, flags, param_values, outputs=2, pack=pack)
        count = fe.increment(lion_state.count, inplace=own_state)
        new_lion_state = ScaleByLionState(count=count, mu=leaves.rebuild(new_mu, like=lion_state.mu))
        return leaves.rebuild(new_updates), (new_lion_state, decay_state, lr_state)

    update_fn = set_elementwise(supports_donated_updates(update_fn), not callable(mask))  # a mask made from the params sees them all
    return GradientTransformation(init_fn, named(takes_scaled_gradients(update_fn, scaled_update), "lion"))
