"""Stochastic gradient descent and its variants: momentum, noise, differential privacy, optimism.

Each optimizer is the chain optax builds, with that chain's tuple state; ``learning_rate`` is a
number, a 0-d tensor or a schedule (a callable of the 0-d step count), and an optimizer inside
another ``chain`` keeps its own tuple state.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from gradtx.base import GradientTransformation, identity
from gradtx.chains.chain import chain
from gradtx.optimizers._common import _momentum, _one, check_learning_rate
from gradtx.transforms.momentum import fused_sgd
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

    Without momentum the update is ``-learning_rate * g``. With it, ``trace = g + momentum *
    trace`` and the update is ``-learning_rate * trace``, or ``-learning_rate * (g + momentum *
    trace)`` with Nesterov's momentum. The same numbers as ``torch.optim.SGD(lr, momentum,
    nesterov=nesterov)`` (``dampening=0``, no weight decay: chain
    :func:`~gradtx.add_decayed_weights` before it for that).

    Args:
      learning_rate: the step size: a number, a 0-d tensor, or a schedule called with the step
        count (see :mod:`gradtx.schedules`).
      momentum: the decay of the momentum trace; ``None`` for plain SGD (no momentum buffer).
      nesterov: use Nesterov's momentum (with ``momentum``).
      accumulator_dtype: the dtype of the momentum's buffer (``None``: the params' dtype).

    Returns:
      The optimizer, a :class:`~gradtx.GradientTransformation`.

    References:
      Robbins & Monro, `A Stochastic Approximation Method
      <https://doi.org/10.1214/aoms/1177729586>`_, The Annals of Mathematical Statistics, 1951

      Polyak, `Some methods of speeding up the convergence of iteration methods
      <https://doi.org/10.1016/0041-5553(64)90137-5>`_, USSR Computational Mathematics and
      Mathematical Physics, 1964

      Sutskever, Martens, Dahl & Hinton, `On the importance of initialization and momentum in
      deep learning <https://proceedings.mlr.press/v28/sutskever13.html>`_, ICML, 2013

    Examples:
      >>> import torch
      >>> import gradtx as gtx
      >>> def f(params):  # a quadratic, smallest at w = 0
      ...     return (params["w"] ** 2).sum()
      >>> params = {"w": torch.tensor([1.0, 2.0, 3.0])}
      >>> tx = gtx.sgd(learning_rate=0.1, momentum=0.5)
      >>> state = tx.init(params)
      >>> for _ in range(5):
      ...     grads = torch.func.grad(f)(params)
      ...     updates, state = tx.update(grads, state, params)
      ...     params = gtx.apply_updates(params, updates)
      ...     print(f"{f(params):.4f}")
      8.9600
      4.0824
      1.2769
      0.2104
      0.0010
    """
    check_learning_rate(learning_rate, "sgd")
    if momentum is None:
        return _one(chain(identity(), scale_by_learning_rate(learning_rate)))
    # chain(trace, scale_by_learning_rate) as one transformation: the same state and numbers, with
    # the learning rate taken in the momentum step's pass and a clip's coefficient handed to it
    return fused_sgd(learning_rate, momentum, nesterov, accumulator_dtype)


def noisy_sgd(
    learning_rate: ScalarOrSchedule, eta: float = 0.01, gamma: float = 0.55, key: Any = None
) -> GradientTransformation:
    """SGD on gradients with annealed Gaussian noise added.

    The update is ``-learning_rate * (g + n)`` with ``n`` drawn from ``N(0, eta / t^gamma)`` at
    step ``t`` (``t`` = 1, 2, ...): noise early in training helps deep networks escape poor
    regions, and its variance decays so the iterates settle. The noise comes from a
    ``torch.Generator`` whose state is kept in the optimizer's state, so a run is reproducible
    and its checkpoints resume the same stream.

    Args:
      learning_rate: the step size: a number, a 0-d tensor, or a schedule called with the step
        count (see :mod:`gradtx.schedules`).
      eta: the variance of the noise at the first step.
      gamma: the exponent of the variance's decay.
      key: an integer seed (``None`` means 0), or a ``torch.Generator`` on the params' device
        whose current state starts the stream (optax's PRNG key).

    Returns:
      The optimizer, a :class:`~gradtx.GradientTransformation`.

    References:
      Neelakantan et al., `Adding Gradient Noise Improves Learning for Very Deep Networks
      <https://arxiv.org/abs/1511.06807>`_, 2015

    Examples:
      >>> import torch
      >>> import gradtx as gtx
      >>> def f(params):  # a quadratic, smallest at w = 0
      ...     return (params["w"] ** 2).sum()
      >>> params = {"w": torch.tensor([1.0, 2.0, 3.0])}
      >>> tx = gtx.noisy_sgd(learning_rate=0.1, eta=0.01, key=0)
      >>> state = tx.init(params)
      >>> for _ in range(5):
      ...     grads = torch.func.grad(f)(params)
      ...     updates, state = tx.update(grads, state, params)
      ...     params = gtx.apply_updates(params, updates)
      ...     print(f"{f(params):.4f}")
      9.0500
      5.8541
      3.7475
      2.4042
      1.5468
    """
    check_learning_rate(learning_rate, "noisy_sgd")
    return _one(chain(add_noise(eta, gamma, key), scale_by_learning_rate(learning_rate)))


def dpsgd(
    learning_rate: ScalarOrSchedule,
    l2_norm_clip: float,
    noise_multiplier: float,
    seed: int,
    momentum: Optional[float] = None,
    nesterov: bool = False,
) -> GradientTransformation:
    """DP-SGD: SGD on clipped per-example gradients with Gaussian noise, for differential privacy.

    The updates must be *per-example* gradients, with the batch on dim 0 of every leaf (as
    ``torch.func.vmap(torch.func.grad(loss))`` gives them). Each example's gradient is clipped
    to global L2 norm ``l2_norm_clip``, the batch is summed, Gaussian noise of standard
    deviation ``l2_norm_clip * noise_multiplier`` is added to every entry, and the result is
    divided by the batch size; then optional momentum and ``-learning_rate``. The result has
    no batch dimension. The noise comes from a ``torch.Generator`` whose state is kept in the
    optimizer's state.

    Args:
      learning_rate: the step size: a number, a 0-d tensor, or a schedule called with the step
        count (see :mod:`gradtx.schedules`).
      l2_norm_clip: the largest L2 norm of one example's whole gradient.
      noise_multiplier: the noise's standard deviation relative to ``l2_norm_clip``.
      seed: the seed of the noise's generator (an int; a ``torch.Generator`` on the params'
        device is taken as it is).
      momentum: the decay of a momentum trace on the noisy mean; ``None`` for none.
      nesterov: use Nesterov's momentum (with ``momentum``).

    Returns:
      The optimizer, a :class:`~gradtx.GradientTransformation`.

    References:
      Abadi, Chu, Goodfellow, McMahan, Mironov, Talwar & Zhang, `Deep Learning with
      Differential Privacy <https://arxiv.org/abs/1607.00133>`_, ACM CCS, 2016

    Examples:
      >>> import torch
      >>> import gradtx as gtx
      >>> x = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [2.0, 1.0]])
      >>> y = torch.tensor([1.0, -1.0, 0.0, 1.0])
      >>> def loss(params, xi, yi):  # one example's squared error
      ...     return (xi @ params["w"] - yi) ** 2
      >>> def f(params):  # the mean over the batch
      ...     return ((x @ params["w"] - y) ** 2).mean()
      >>> per_example_grads = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0, 0))
      >>> params = {"w": torch.zeros(2)}
      >>> tx = gtx.dpsgd(learning_rate=0.2, l2_norm_clip=1.0, noise_multiplier=0.1, seed=0)
      >>> state = tx.init(params)
      >>> for _ in range(5):
      ...     grads = per_example_grads(params, x, y)  # {"w": a (4, 2) tensor}
      ...     updates, state = tx.update(grads, state, params)
      ...     params = gtx.apply_updates(params, updates)
      ...     print(f"{f(params):.4f}")
      0.6279
      0.5078
      0.4189
      0.3488
      0.2878
    """
    check_learning_rate(learning_rate, "dpsgd")
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
    """Optimistic gradient descent: each step corrected by the change of the gradient, for min-max games.

    The update is ``-learning_rate * ((alpha + beta) * g_t - beta * g_{t-1})`` (``g_0`` taken
    as the first gradient): ``chain(scale_by_optimistic_gradient(alpha, beta),
    scale_by_learning_rate(learning_rate))``. With ``alpha = beta = 1`` it is the optimistic
    step ``2 g_t - g_{t-1}`` that converges on bilinear saddle-point problems where plain
    gradient descent-ascent spirals away.

    Args:
      learning_rate: the step size: a number, a 0-d tensor, or a schedule called with the step
        count (see :mod:`gradtx.schedules`).
      alpha: the weight of the current gradient.
      beta: the weight of the optimistic correction ``g_t - g_{t-1}``.

    Returns:
      The optimizer, a :class:`~gradtx.GradientTransformation`.

    References:
      Daskalakis, Ilyas, Syrgkanis & Zeng, `Training GANs with Optimism
      <https://arxiv.org/abs/1711.00141>`_, ICLR, 2018

      Mokhtari, Ozdaglar & Pattathil, `A Unified Analysis of Extra-gradient and Optimistic
      Gradient Methods for Saddle Point Problems: Proximal Point Approach
      <https://arxiv.org/abs/1901.08511>`_, AISTATS, 2020

    Examples:
      >>> import torch
      >>> import gradtx as gtx
      >>> def f(params):  # a quadratic, smallest at w = 0
      ...     return (params["w"] ** 2).sum()
      >>> params = {"w": torch.tensor([1.0, 2.0, 3.0])}
      >>> tx = gtx.optimistic_gradient_descent(learning_rate=0.1)
      >>> state = tx.init(params)
      >>> for _ in range(5):
      ...     grads = torch.func.grad(f)(params)
      ...     updates, state = tx.update(grads, state, params)
      ...     params = gtx.apply_updates(params, updates)
      ...     print(f"{f(params):.4f}")
      8.9600
      6.4736
      4.5167
      3.1827
      2.2364
    """
    check_learning_rate(learning_rate, "optimistic_gradient_descent")
    return _one(chain(scale_by_optimistic_gradient(alpha=alpha, beta=beta), scale_by_learning_rate(learning_rate)))
