"""Stochastic gradient descent and its variants: momentum, noise, differential privacy, optimism.

Each optimizer is the chain optax builds, with that chain's tuple state; ``learning_rate`` is a
number or a schedule (a callable of the 0-d step count), and an optimizer inside another ``chain``
keeps its own tuple state.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from gradtx.base import GradientTransformation, identity
from gradtx.chains.chain import chain
from gradtx.optimizers._common import _momentum, _one
from gradtx.transforms.momentum import trace
from gradtx.transforms.noise import add_noise, differentially_private_aggregate
from gradtx.transforms.optimistic import scale_by_optimistic_gradient
from gradtx.transforms.scaling import ScalarOrSchedule, scale_by_learning_rate


def sgd(
    learning_rate: ScalarOrSchedule,
    momentum: Optional[float] = None,
    nesterov: bool = False,
    accumulator_dtype: Optional[torch.dtype] = None,
) -> GradientTransformation:
    """Stochastic gradient descent, with optional heavy-ball or Nesterov momentum.

    Equals ``torch.optim.SGD(lr, momentum, nesterov=nesterov)`` (``dampening=0``).
    """
    if momentum is None:
        return _one(chain(identity(), scale_by_learning_rate(learning_rate)))
    return _one(
        chain(
            trace(decay=momentum, nesterov=nesterov, accumulator_dtype=accumulator_dtype),
            scale_by_learning_rate(learning_rate),
        )
    )


def noisy_sgd(
    learning_rate: ScalarOrSchedule, eta: float = 0.01, gamma: float = 0.55, key: Any = None
) -> GradientTransformation:
    """SGD with annealed Gaussian noise ``N(0, eta / t^gamma)`` added to the gradients."""
    return _one(chain(add_noise(eta, gamma, key), scale_by_learning_rate(learning_rate)))


def dpsgd(
    learning_rate: ScalarOrSchedule,
    l2_norm_clip: float,
    noise_multiplier: float,
    seed: int,
    momentum: Optional[float] = None,
    nesterov: bool = False,
) -> GradientTransformation:
    """DP-SGD (Abadi et al., 2016). The updates are per-example gradients (batch on dim 0)."""
    return _one(
        chain(
            differentially_private_aggregate(l2_norm_clip, noise_multiplier, seed),
            _momentum(momentum, nesterov),
            scale_by_learning_rate(learning_rate),
        )
    )


def optimistic_gradient_descent(
    learning_rate: ScalarOrSchedule, alpha: float = 1.0, beta: float = 1.0
) -> GradientTransformation:
    """Optimistic gradient descent: ``chain(scale_by_optimistic_gradient(alpha, beta), scale_by_learning_rate)``."""
    return _one(chain(scale_by_optimistic_gradient(alpha=alpha, beta=beta), scale_by_learning_rate(learning_rate)))
