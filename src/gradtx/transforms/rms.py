"""Second-moment normalisers without momentum: RMSProp's ``scale_by_rms`` / ``scale_by_stddev``
and AdaGrad's ``scale_by_rss``, with optax's arguments, defaults and numbers.

Where optax and torch differ, gradtx follows optax: ``eps`` goes *inside* the square root by
default (``eps_in_sqrt=True``; torch's ``RMSprop`` adds it outside, which ``eps_in_sqrt=False``
reproduces), and AdaGrad starts its sum at ``initial_accumulator_value=0.1`` with ``eps`` inside
the square root (torch starts at 0 and adds ``eps`` outside).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor

from gradtx.base import GradientTransformation
from gradtx.state_signs import nonnegative
from gradtx.transforms import _foreach as fe


@nonnegative("nu")
class ScaleByRmsState(NamedTuple):
    """``nu``: the moving average of squared updates."""

    nu: Any


@nonnegative("nu")
class ScaleByRmsWithCountState(NamedTuple):
    count: Tensor
    nu: Any


@nonnegative("nu")
class ScaleByRStdDevState(NamedTuple):
    """``mu``, ``nu``: moving averages of the updates and of their squares."""

    mu: Any
    nu: Any


@nonnegative("nu")
class ScaleByRStdDevWithCountState(NamedTuple):
    count: Tensor
    mu: Any
    nu: Any


@nonnegative("sum_of_squares")
class ScaleByRssState(NamedTuple):
    """``sum_of_squares``: the running sum of squared updates (plus its initial value)."""

    sum_of_squares: Any


def _rms_denominator(second: list[Tensor], eps: float, eps_in_sqrt: bool, *, owned: bool) -> list[Tensor]:
    """``sqrt(second + eps)`` or ``sqrt(second) + eps``, in ``second``'s buffers when ``owned``."""
    if eps_in_sqrt:
        return fe.sqrt(fe.add(second, eps, inplace=owned), inplace=True)
    return fe.add(fe.sqrt(second, inplace=owned), eps, inplace=True)


def _corrected(moment: list[Tensor], inv_bc: Any, dtype: torch.dtype) -> list[Tensor]:
    """``moment / bc`` in new tensors of ``dtype``."""
    return fe.mul(fe.cast(moment, dtype), fe.on(inv_bc, moment), inplace=False)


def scale_by_rms(
    decay: float = 0.9,
    eps: float = 1e-8,
    initial_scale: float = 0.0,
    eps_in_sqrt: bool = True,
    bias_correction: bool = False,
) -> GradientTransformation:
    """Divides updates by the root of the moving average of their squares (RMSProp).

    ``nu = decay * nu + (1 - decay) * g^2`` starting at ``initial_scale``; the update is
    ``g / sqrt(nu + eps)`` (``eps_in_sqrt``) or ``g / (sqrt(nu) + eps)``, with ``nu`` divided by
    ``1 - decay^t`` first when ``bias_correction``.
    """
    decay, eps, initial_scale = float(decay), float(eps), float(initial_scale)

    def init_fn(params: Any):
        nu = fe.full_like_tree(params, initial_scale)
        return ScaleByRmsWithCountState(count=fe.zero_count(params), nu=nu) if bias_correction else ScaleByRmsState(nu=nu)

    def update_fn(updates, state, params=None, *, inplace=False):
        del params
        leaves = fe.leaves_of(updates, what="scale_by_rms")
        nu = leaves.aligned(state.nu, what="scale_by_rms: state.nu")
        count, inv_bc = None, None
        if bias_correction:
            count = fe.increment(state.count, inplace=inplace)
            inv_bc = 1.0 / (1.0 - fe.decay_power(decay, count))

        def group(g, v):
            v = fe.add_squares(fe.mul(v, decay, inplace=inplace), g, 1.0 - decay, inplace=True)
            if inv_bc is None:
                d = _rms_denominator(fe.cast(v, g[0].dtype), eps, eps_in_sqrt, owned=False)
            else:
                d = _rms_denominator(_corrected(v, inv_bc, g[0].dtype), eps, eps_in_sqrt, owned=True)
            return fe.div(g, d, inplace=inplace), v

        new_updates, new_nu = fe.map_groups(group, leaves.tensors, nu, outputs=2, pack=not inplace)
        new_nu = leaves.rebuild(new_nu, like=state.nu)
        new_state = ScaleByRmsWithCountState(count=count, nu=new_nu) if bias_correction else ScaleByRmsState(nu=new_nu)
        return leaves.rebuild(new_updates), new_state

    return GradientTransformation(init_fn, update_fn)


def scale_by_stddev(
    decay: float = 0.9,
    eps: float = 1e-8,
    initial_scale: float = 0.0,
    eps_in_sqrt: bool = True,
    bias_correction: bool = False,
) -> GradientTransformation:
    """Centered RMSProp: divides by the root of ``nu - mu^2``, the running variance estimate."""
    decay, eps, initial_scale = float(decay), float(eps), float(initial_scale)

    def init_fn(params: Any):
        mu, nu = fe.zeros_like_tree(params), fe.full_like_tree(params, initial_scale)
        if bias_correction:
            return ScaleByRStdDevWithCountState(count=fe.zero_count(params), mu=mu, nu=nu)
        return ScaleByRStdDevState(mu=mu, nu=nu)

    def update_fn(updates, state, params=None, *, inplace=False):
        del params
        leaves = fe.leaves_of(updates, what="scale_by_stddev")
        mu = leaves.aligned(state.mu, what="scale_by_stddev: state.mu")
        nu = leaves.aligned(state.nu, what="scale_by_stddev: state.nu")
        count, inv_bc = None, None
        if bias_correction:
            count = fe.increment(state.count, inplace=inplace)
            inv_bc = 1.0 / (1.0 - fe.decay_power(decay, count))

        def group(g, m, v):
            m = fe.lerp(m, g, 1.0 - decay, inplace=inplace)
            v = fe.add_squares(fe.mul(v, decay, inplace=inplace), g, 1.0 - decay, inplace=True)
            dtype = g[0].dtype
            if inv_bc is None:
                mean, variance = fe.cast(m, dtype), fe.fresh(fe.cast(v, dtype), into=None)
            else:
                mean, variance = _corrected(m, inv_bc, dtype), _corrected(v, inv_bc, dtype)
            variance = fe.add_squares(variance, mean, -1.0, inplace=True)  # nu_hat - |mu_hat|^2
            d = _rms_denominator(variance, eps, eps_in_sqrt, owned=True)
            return fe.div(g, d, inplace=inplace), m, v

        new_updates, new_mu, new_nu = fe.map_groups(group, leaves.tensors, mu, nu, outputs=3, pack=not inplace)
        new_mu, new_nu = leaves.rebuild(new_mu, like=state.mu), leaves.rebuild(new_nu, like=state.nu)
        if bias_correction:
            new_state = ScaleByRStdDevWithCountState(count=count, mu=new_mu, nu=new_nu)
        else:
            new_state = ScaleByRStdDevState(mu=new_mu, nu=new_nu)
        return leaves.rebuild(new_updates), new_state

    return GradientTransformation(init_fn, update_fn)


def scale_by_rss(initial_accumulator_value: float = 0.1, eps: float = 1e-7) -> GradientTransformation:
    """AdaGrad's scaling: ``g / sqrt(sum_of_squares + eps)``, and ``0`` where the sum is still 0."""
    initial_accumulator_value, eps = float(initial_accumulator_value), float(eps)
    if not fe.symbolic_hyperparams() and initial_accumulator_value < 0.0:
        raise ValueError(f"scale_by_rss: initial_accumulator_value must be >= 0, got {initial_accumulator_value}")

    def init_fn(params: Any) -> ScaleByRssState:
        return ScaleByRssState(sum_of_squares=fe.full_like_tree(params, initial_accumulator_value))

    def update_fn(updates, state, params=None, *, inplace=False):
        del params
        leaves = fe.leaves_of(updates, what="scale_by_rss")
        sums = leaves.aligned(state.sum_of_squares, what="scale_by_rss: state.sum_of_squares")

        def group(g, acc):
            acc = fe.add_squares(acc, g, 1.0, inplace=inplace)
            d = fe.add(fe.cast(acc, g[0].dtype), eps, inplace=False)
            if fe.symbolic_hyperparams() or eps == 0.0:
                # A zero sum means every gradient so far was zero: the update is 0, not 0 / 0. (With
                # eps > 0 the clamp changes nothing: kept where eps is symbolic.)
                d = fe.clamp_min(d, torch.finfo(d[0].dtype).tiny, inplace=True)
            return fe.div(g, fe.sqrt(d, inplace=True), inplace=inplace), acc

        new_updates, new_sums = fe.map_groups(group, leaves.tensors, sums, outputs=2, pack=not inplace)
        return leaves.rebuild(new_updates), ScaleByRssState(sum_of_squares=leaves.rebuild(new_sums, like=state.sum_of_squares))

    return GradientTransformation(init_fn, update_fn)
