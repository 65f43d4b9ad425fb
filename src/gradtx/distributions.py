"""``multi_normal``: optax's diagonal Gaussian parametrised by its log scale, as a torch distribution.

optax uses it for perturbation-based (evolution-strategy) gradient estimates: ``sample`` draws
``loc + exp(log_scale) * noise`` (a reparametrised draw, so gradients reach ``loc`` and
``log_scale``) and ``log_prob`` sums the per-coordinate densities over the parameter's axes. Here
it is a :class:`torch.distributions.Independent` over a :class:`torch.distributions.Normal`, so it
goes wherever a torch distribution does (``entropy``, ``kl_divergence``, ``rsample``, ...). Its own
module because it is neither a transformation nor a tree or numerics helper.
"""

from __future__ import annotations

import numbers
from typing import Sequence, Union

import torch
from torch import Tensor

Key = Union[torch.Generator, int, None]


class MultiNormalDiagFromLogScale(torch.distributions.Independent):
    """A Gaussian with diagonal covariance ``exp(log_scale)**2``, its parameters exposed as optax's.

    The event shape is the broadcast shape of ``loc`` and ``log_scale`` (``log_prob`` sums over
    all of it, as optax's does); the batch shape is empty.
    """

    def __init__(self, loc: Union[Tensor, float], log_scale: Union[Tensor, float]):
        loc_t = torch.as_tensor(loc)
        log_scale_t = torch.as_tensor(log_scale)
        if not (loc_t.is_floating_point() and log_scale_t.is_floating_point()):
            loc_t, log_scale_t = loc_t.to(torch.get_default_dtype()), log_scale_t.to(torch.get_default_dtype())
        try:
            param_shape = torch.broadcast_shapes(loc_t.shape, log_scale_t.shape)
        except RuntimeError:
            raise ValueError(
                f"multi_normal: loc of shape {tuple(loc_t.shape)} and log_scale of shape "
                f"{tuple(log_scale_t.shape)} do not broadcast"
            ) from None
        self._loc = loc_t
        self._log_scale = log_scale_t
        self._param_shape = tuple(param_shape)
        base = torch.distributions.Normal(loc_t.expand(param_shape), torch.exp(log_scale_t).expand(param_shape))
        super().__init__(base, len(param_shape))

    def sample(self, shape: Sequence[int] = (), key: Key = None) -> Tensor:  # type: ignore[override]
        """``shape + event_shape`` draws, ``loc + exp(log_scale) * noise``.

        ``key`` is a ``torch.Generator`` or an integer seed (optax's PRNG key); ``None`` uses
        torch's global generator. The draw is reparametrised: it carries gradients to ``loc`` and
        ``log_scale`` when they require them (as optax's does).
        """
        if isinstance(key, numbers.Integral) and not isinstance(key, bool):
            key = torch.Generator(device=self._loc.device).manual_seed(int(key))
        elif key is not None and not isinstance(key, torch.Generator):
            raise TypeError(f"multi_normal.sample: key must be a torch.Generator, an integer seed or None, got a {type(key).__name__}")
        shape = tuple(torch.Size(shape)) + self._param_shape
        dtype = torch.promote_types(self._loc.dtype, self._log_scale.dtype)
        noise = torch.randn(shape, generator=key, dtype=dtype, device=self._loc.device)
        return noise * torch.exp(self._log_scale) + self._loc

    def rsample(self, sample_shape: Sequence[int] = ()) -> Tensor:  # type: ignore[override]
        return self.sample(sample_shape)

    @property
    def log_scale(self) -> Tensor:
        return self._log_scale

    @property
    def params(self) -> list[Tensor]:
        """``[loc, log_scale]``, as optax's."""
        return [self._loc, self._log_scale]


def multi_normal(loc: Union[Tensor, float], log_scale: Union[Tensor, float]) -> MultiNormalDiagFromLogScale:
    """A diagonal Gaussian with mean ``loc`` and standard deviation ``exp(log_scale)`` (as optax's).

    Differences from optax's signature, for torch: ``sample(shape, key)`` takes a
    ``torch.Generator`` or an integer seed as ``key`` (or ``None``, the global generator) instead
    of a JAX PRNG key, and the object is a ``torch.distributions.Distribution``.

    ```python
    dist = gradtx.multi_normal(torch.zeros(3), torch.zeros(3))
    draws = dist.sample((16,), key=0)        # shape (16, 3)
    log_p = dist.log_prob(draws)             # shape (16,)
    ```
    """
    return MultiNormalDiagFromLogScale(loc, log_scale)


__all__ = ["MultiNormalDiagFromLogScale", "multi_normal"]
