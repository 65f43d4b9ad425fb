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
from gradtx.transforms import _foreach as fe


class ScaleByRmsState(NamedTuple):
    """``nu``: the moving average of squared updates."""

    nu: Any


class ScaleByRmsWithCountState(NamedTuple):
    count: Tensor
    nu: Any


class ScaleByRStdDevState(NamedTuple):
    """``mu``, ``nu``: moving averages of the updates and of their squares."""

    mu: Any
    nu: Any


class ScaleByRStdDevWithCountState(NamedTuple):
    count: Tensor
    mu: Any
    nu: Any


class ScaleByRssState(NamedTuple):
    """``sum_of_squares``: the running sum of squared updates (plus its initial value)."""

    sum_of_squares: Any


def _rms_denominator(second: list[Tensor], eps: float, eps_in_sqrt: bool, bc: Any, *, owned: bool) -> list[Tensor]:
    """``sqrt(second + eps)`` or ``sqrt(second) + eps``, in ``second``'s buffers when ``owned``.

    With a bias correction ``bc`` (0-d tensor) the true second moment is ``second / bc``; then
    this returns ``sqrt(second + eps * bc)`` or ``sqrt(second) + eps * sqrt(bc)``, which is the
    wanted denominator divided by ``sqrt(bc)`` (:func:`_normalise` multiplies it back).
    """
    if eps_in_sqrt:
        d = fe.add(second, eps if bc is None else fe.on(eps * bc, second), inplace=owned)
        return fe.sqrt(d, inplace=True)
    d = fe.sqrt(second, inplace=owned)
    return fe.add(d, eps if bc is None else fe.on(eps * torch.sqrt(bc), d), inplace=True)


def _normalise(g, d, bc, *, inplace):
    """``g / d`` (times ``sqrt(bc)`` with a bias correction), in ``g``'s buffer when donated."""
    out = fe.div(g, d, inplace=inplace)
    if bc is not None:
        fe.mul(out, fe.on(torch.sqrt(bc), out), inplace=True)
    return out


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
        count, bc = None, None
        if bias_correction:
            count = fe.increment(state.count, inplace=inplace)
            bc = 1.0 - fe.decay_power(decay, count)

        def group(g, v):
            v = fe.mul(v, decay, inplace=inplace)
            fe.addcmul(v, g, g, 1.0 - decay, inplace=True)
            d = _rms_denominator(fe.cast(v, g[0].dtype), eps, eps_in_sqrt, bc, owned=False)
            return _normalise(g, d, bc, inplace=inplace), v

        new_updates, new_nu = fe.map_groups(group, leaves.tensors, nu, outputs=2)
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
        count, bc = None, None
        if bias_correction:
            count = fe.increment(state.count, inplace=inplace)
            bc = 1.0 - fe.decay_power(decay, count)

        def group(g, m, v):
            m = fe.lerp(m, g, 1.0 - decay, inplace=inplace)
            v = fe.mul(v, decay, inplace=inplace)
            fe.addcmul(v, g, g, 1.0 - decay, inplace=True)
            # nu_hat - mu_hat^2 == (nu - mu^2 / bc) / bc
            variance = fe.addcmul(fe.cast(v, g[0].dtype), fe.cast(m, g[0].dtype), fe.cast(m, g[0].dtype), -1.0, inplace=False)
            if bc is not None:
                extra = fe.mul(fe.mul(m, m, inplace=False), fe.on(1.0 / bc - 1.0, m), inplace=True)
                fe.add(variance, fe.cast(extra, g[0].dtype), alpha=-1.0, inplace=True)
            d = _rms_denominator(variance, eps, eps_in_sqrt, bc, owned=True)
            return _normalise(g, d, bc, inplace=inplace), m, v

        new_updates, new_mu, new_nu = fe.map_groups(group, leaves.tensors, mu, nu, outputs=3)
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
    if initial_accumulator_value < 0.0:
        raise ValueError(f"scale_by_rss: initial_accumulator_value must be >= 0, got {initial_accumulator_value}")

    def init_fn(params: Any) -> ScaleByRssState:
        return ScaleByRssState(sum_of_squares=fe.full_like_tree(params, initial_accumulator_value))

    def update_fn(updates, state, params=None, *, inplace=False):
        del params
        leaves = fe.leaves_of(updates, what="scale_by_rss")
        sums = leaves.aligned(state.sum_of_squares, what="scale_by_rss: state.sum_of_squares")

        def group(g, acc):
            acc = fe.addcmul(acc, g, g, 1.0, inplace=inplace)
            d = fe.add(fe.cast(acc, g[0].dtype), eps, inplace=False)
            if eps == 0.0:
                # A zero sum means every gradient so far was zero: the update is 0, not 0 / 0.
                d = fe.clamp_min(d, torch.finfo(d[0].dtype).tiny, inplace=True)
            return fe.div(g, fe.sqrt(d, inplace=True), inplace=inplace), acc

        new_updates, new_sums = fe.map_groups(group, leaves.tensors, sums, outputs=2)
        return leaves.rebuild(new_updates), ScaleByRssState(sum_of_squares=leaves.rebuild(new_sums, like=state.sum_of_squares))

    return GradientTransformation(init_fn, update_fn)
