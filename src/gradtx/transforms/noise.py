"""Annealed Gaussian gradient noise (Neelakantan et al., 2015), from a seeded ``torch.Generator``.

optax threads a JAX PRNG key through the state; here the state holds the generator's state as a
uint8 tensor, so it saves, loads and moves like any other state, the pure path leaves it untouched,
and the same state always draws the same noise. Sampling runs on the host's side of the generator
(``Generator.set_state``), so this transformation is not traced by ``torch.compile``.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Union

import torch
from torch import Tensor

from gradtx import tree as tree_lib
from gradtx.base import GradientTransformation, untraceable
from gradtx.sharding import dtensor as dtensor_lib
from gradtx.transforms import _foreach as fe


class AddNoiseState(NamedTuple):
    """``count``: steps so far (0-d int32); ``rng_key``: the generator's state (uint8 tensor)."""

    count: Tensor
    rng_key: Tensor


def _on_host(rng_key: Tensor) -> Tensor:
    """The generator state as a CPU tensor (kept as it is when it already is one: under
    ``torch.func.grad`` even ``.cpu()`` of a CPU tensor returns a wrapper a generator cannot read)."""
    return rng_key if rng_key.device.type == "cpu" else rng_key.cpu()


def _generator_state(key: Union[int, torch.Generator, None], device: torch.device) -> Tensor:
    if isinstance(key, torch.Generator):
        if key.device != device:
            raise ValueError(f"add_noise: the generator is on {key.device} but the params are on {device}")
        return key.get_state()
    generator = torch.Generator(device=device)
    generator.manual_seed(0 if key is None else int(key))
    return generator.get_state()


_GENERATOR_WHY = (
    "draws from a torch.Generator whose state it keeps as a tensor, and torch.compile cannot trace a "
    "generator built from a tensor"
)


def _present_paths(leaves: fe.Leaves) -> list[str]:
    paths = tree_lib.paths(leaves.tree)
    return [paths[i] for i in leaves.present]


def _noise_like(g: Tensor, generator: torch.Generator, path: str) -> Tensor:
    """Standard normal noise for update ``g``, drawn for its logical shape: a DTensor takes its own
    piece of it, so the noise, like the step, is the same at any sharding."""
    noise = torch.randn(g.shape, generator=generator, dtype=g.dtype, device=generator.device)
    if not dtensor_lib.is_dtensor(g):
        return noise.to(g.device)
    try:  # a Partial update (not reduced yet) would take the noise once per rank
        dtensor_lib.check_one_layout([g])
    except ValueError as exc:
        raise ValueError(f"add_noise: leaf {path!r}: {exc}") from None
    return dtensor_lib.relayout(noise, g)


def add_noise(eta: float, gamma: float, key: Union[int, torch.Generator, None] = None) -> GradientTransformation:
    """Adds ``N(0, eta / t^gamma)`` noise to every update (``t`` = 1, 2, ...).

    Args:
      eta: the base variance of the noise.
      gamma: the decay exponent of the variance.
      key: an integer seed (``None`` means 0), or a ``torch.Generator`` on the params' device whose
        current state starts the stream. Leaves draw their noise in flattening order, each for its
        logical shape: a DTensor leaf adds its own piece of it, so the steps are the same at any
        sharding (every rank draws every leaf's noise).
    """
    eta, gamma = float(eta), float(gamma)

    def init_fn(params: Any) -> AddNoiseState:
        device = tree_lib.first_device(params)
        return AddNoiseState(count=fe.zero_count(params), rng_key=_generator_state(key, device))

    def update_fn(updates, state, params=None, *, inplace=False):
        del params
        leaves = fe.leaves_of(updates, what="add_noise")
        count = fe.increment(state.count, inplace=inplace)
        std = torch.sqrt(eta / count.to(torch.float64) ** gamma)
        generator = torch.Generator(device=state.count.device)
        generator.set_state(_on_host(state.rng_key))
        noise = [_noise_like(g, generator, path) for g, path in zip(leaves.tensors, _present_paths(leaves))]
        rng_key = generator.get_state()
        if inplace and rng_key.shape == state.rng_key.shape and not tree_lib.needs_graph(state.rng_key):
            rng_key = state.rng_key.copy_(rng_key)

        def group(g, n):
            return (fe.add(g, fe.mul(n, fe.on(std, n), inplace=True), inplace=inplace),)

        (new_updates,) = fe.map_groups(group, leaves.tensors, noise, outputs=1)
        return leaves.rebuild(new_updates), AddNoiseState(count=count, rng_key=rng_key)

    untraceable(update_fn, "add_noise", _GENERATOR_WHY)
    return GradientTransformation(init_fn, update_fn)


class DifferentiallyPrivateAggregateState(NamedTuple):
    """``rng_key``: the generator's state (uint8 tensor)."""

    rng_key: Tensor


def differentially_private_aggregate(
    l2_norm_clip: float, noise_multiplier: float, key: Union[int, torch.Generator, None] = None
) -> GradientTransformation:
    """DP-SGD's aggregation (Abadi et al., 2016): per-example clipping, summing, Gaussian noise.

    The updates are *per-example* gradients (batch on dim 0, as ``torch.func.vmap(grad(...))``
    gives them); each example is clipped to global L2 norm ``l2_norm_clip``, the batch is summed,
    ``N(0, (l2_norm_clip * noise_multiplier)^2)`` noise is added to every element, and the result is
    divided by the batch size. The result has no batch dimension, so this must come first in a chain.
    """
    from gradtx.transforms.per_example import per_example_global_norm_clip

    l2_norm_clip, noise_multiplier = float(l2_norm_clip), float(noise_multiplier)
    noise_std = l2_norm_clip * noise_multiplier

    def init_fn(params: Any) -> DifferentiallyPrivateAggregateState:
        return DifferentiallyPrivateAggregateState(rng_key=_generator_state(key, tree_lib.first_device(params)))

    def update_fn(updates, state, params=None, *, inplace=False):
        del params
        leaves = fe.leaves_of(updates, what="differentially_private_aggregate")
        summed, _ = per_example_global_norm_clip(updates, l2_norm_clip)
        if not leaves.tensors:
            return summed, state
        batch_size = leaves.tensors[0].shape[0]
        device = leaves.tensors[0].device
        generator = torch.Generator(device=device)
        generator.set_state(_on_host(state.rng_key))
        summed_leaves = fe.leaves_of(summed, what="differentially_private_aggregate")
        noised = []
        for total in summed_leaves.tensors:
            noise = torch.randn(total.shape, generator=generator, dtype=total.dtype, device=device).to(total.device)
            noised.append(total.add_(noise, alpha=noise_std).div_(batch_size))
        rng_key = generator.get_state()
        if inplace and rng_key.shape == state.rng_key.shape and not tree_lib.needs_graph(state.rng_key):
            rng_key = state.rng_key.copy_(rng_key)
        return summed_leaves.rebuild(noised), DifferentiallyPrivateAggregateState(rng_key=rng_key)

    untraceable(update_fn, "differentially_private_aggregate", _GENERATOR_WHY)
    return GradientTransformation(init_fn, update_fn)
