"""Per-coordinate step sizes from accumulated squared gradients, without Adam's first moment:
AdaGrad, AdaDelta, RMSProp, Adafactor, SM3.

Each optimizer is the chain optax builds, with that chain's tuple state; ``learning_rate`` is a
number, a 0-d tensor or a schedule (a callable of the 0-d step count), and an optimizer inside
another ``chain`` keeps its own tuple state.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from gradtx import sharding
from gradtx.base import GradientTransformation, takes_spec
from gradtx.chains.chain import chain
from gradtx.optimizers._common import _momentum, _one, check_learning_rate, check_number_learning_rate
from gradtx.transforms._foreach import number_or_tensor as fe_number
from gradtx.transforms.adadelta import scale_by_adadelta
from gradtx.transforms.block_norm import scale_by_param_block_rms
from gradtx.transforms.clipping import clip_by_block_rms
from gradtx.transforms.factored import scale_by_factored_rms
from gradtx.transforms.momentum import ema
from gradtx.transforms.rms import scale_by_rms, scale_by_rss, scale_by_stddev
from gradtx.transforms.scaling import ScalarOrSchedule, scale, scale_by_learning_rate
from gradtx.transforms.sm3 import scale_by_sm3
from gradtx.transforms.weight_decay import add_decayed_weights


def adagrad(
    learning_rate: ScalarOrSchedule, initial_accumulator_value: float = 0.1, eps: float = 1e-7
) -> GradientTransformation:
    """AdaGrad: per-coordinate steps shrinking with the sum of all squared gradients so far.

    ``s = s + g^2`` (``s`` starts at ``initial_accumulator_value``) and the update is
    ``-learning_rate * g / sqrt(s + eps)`` (0 where ``s`` is still 0): coordinates with large
    past gradients take small steps, rare ones large steps. ``torch.optim.Adagrad`` starts ``s``
    at 0 and adds its ``eps`` outside the square root; with the same initial accumulator on both
    sides and ``eps=0`` the two give the same steps.

    Args:
      learning_rate: the step size: a number, a 0-d tensor, or a schedule called with the step
        count (see :mod:`gradtx.schedules`).
      initial_accumulator_value: the starting value of the sum of squared gradients.
      eps: added to the sum inside the square root.

    Returns:
      The optimizer, a :class:`~gradtx.GradientTransformation`.

    References:
      Duchi, Hazan & Singer, `Adaptive Subgradient Methods for Online Learning and Stochastic
      Optimization <https://jmlr.org/papers/v12/duchi11a.html>`_, JMLR, 2011

    Examples:
      >>> import torch
      >>> import gradtx as gtx
      >>> def f(params):  # a quadratic, smallest at w = 0
      ...     return (params["w"] ** 2).sum()
      >>> params = {"w": torch.tensor([1.0, 2.0, 3.0])}
      >>> tx = gtx.adagrad(learning_rate=0.5)
      >>> state = tx.init(params)
      >>> for _ in range(5):
      ...     grads = torch.func.grad(f)(params)
      ...     updates, state = tx.update(grads, state, params)
      ...     params = gtx.apply_updates(params, updates)
      ...     print(f"{f(params):.4f}")
      8.7643
      6.2805
      4.7504
      3.7014
      2.9390
    """
    check_learning_rate(learning_rate, "adagrad")
    return _one(chain(scale_by_rss(initial_accumulator_value, eps), scale_by_learning_rate(learning_rate)))


def adadelta(
    learning_rate: Optional[ScalarOrSchedule] = None,
    rho: float = 0.9,
    eps: float = 1e-6,
    weight_decay: ScalarOrSchedule = 0.0,
    weight_decay_mask: Any = None,
) -> GradientTransformation:
    """Adadelta: steps whose size is the ratio of two running RMS, of past steps and of gradients.

    ``e_g = rho * e_g + (1 - rho) * g^2``, the direction
    ``delta = sqrt(e_x + eps) / sqrt(e_g + eps) * g``, then ``e_x = rho * e_x + (1 - rho) * delta^2``;
    the update is ``-learning_rate * delta``. The units of ``delta`` are those of the params, so
    the method needs no learning rate in the paper. ``weight_decay`` adds
    ``weight_decay * param`` to the gradient first (coupled, L2). The same numbers as
    ``torch.optim.Adadelta(lr, rho, eps, weight_decay)``.

    Args:
      learning_rate: the step size: a number, a 0-d tensor, a schedule called with the step
        count, or ``None`` (the default, as in optax), which applies no learning rate at all: the
        update is then the direction ``+delta`` itself, neither scaled nor negated, so
        :func:`~gradtx.apply_updates` adds it and the params *ascend*. Pass a number to descend
        (``1.0`` is ``torch.optim.Adadelta``'s default).
      rho: the decay rate of both running averages.
      eps: added inside both square roots.
      weight_decay: the rate of the L2 penalty added to the gradient: a number, a 0-d tensor or a
        schedule.
      weight_decay_mask: the leaves to decay: a tree of bools like the params (or a prefix of it),
        or a callable ``params -> such a tree``; ``None`` decays every leaf.

    Returns:
      The optimizer, a :class:`~gradtx.GradientTransformation`.

    References:
      Zeiler, `ADADELTA: An Adaptive Learning Rate Method <https://arxiv.org/abs/1212.5701>`_, 2012

    Examples:
      >>> import torch
      >>> import gradtx as gtx
      >>> def f(params):  # a quadratic, smallest at w = 0
      ...     return (params["w"] ** 2).sum()
      >>> params = {"w": torch.tensor([1.0, 2.0, 3.0])}
      >>> tx = gtx.adadelta(learning_rate=10.0)
      >>> state = tx.init(params)
      >>> for _ in range(5):
      ...     grads = torch.func.grad(f)(params)
      ...     updates, state = tx.update(grads, state, params)
      ...     params = gtx.apply_updates(params, updates)
      ...     print(f"{f(params):.4f}")
      13.6235
      13.2464
      12.8728
      12.5051
      12.1442
    """
    return _one(
        chain(
            add_decayed_weights(weight_decay, mask=weight_decay_mask),
            scale_by_adadelta(rho=rho, eps=eps),
            scale_by_learning_rate(learning_rate),
        )
    )


def rmsprop(
    learning_rate: ScalarOrSchedule,
    decay: float = 0.9,
    eps: float = 1e-8,
    initial_scale: float = 0.0,
    eps_in_sqrt: bool = True,
    centered: bool = False,
    momentum: Optional[float] = None,
    nesterov: bool = False,
    bias_correction: bool = False,
) -> GradientTransformation:
    """RMSProp: gradients divided by the root of a moving average of their squares.

    ``nu = decay * nu + (1 - decay) * g^2`` (starting at ``initial_scale``) and the update
    ``-learning_rate * g / sqrt(nu + eps)``, or ``g / (sqrt(nu) + eps)`` with
    ``eps_in_sqrt=False``. ``centered=True`` divides by the root of the variance estimate
    ``nu - mu^2`` instead, ``mu`` the moving average of the gradients. ``momentum`` then keeps a
    trace of the scaled steps. optax (and gradtx) put ``eps`` inside the square root by default;
    ``eps_in_sqrt=False`` gives ``torch.optim.RMSprop(alpha=decay, eps=eps, centered=...,
    momentum=...)`` exactly.

    Args:
      learning_rate: the step size: a number, a 0-d tensor, or a schedule called with the step
        count (see :mod:`gradtx.schedules`).
      decay: the decay rate of the moving average of the squared gradients (torch's ``alpha``).
      eps: added to the average, inside the square root or outside (``eps_in_sqrt``).
      initial_scale: the starting value of the average of the squared gradients (the centered
        variant's average of the gradients starts at 0).
      eps_in_sqrt: add ``eps`` inside the square root (optax's default) or to the root (torch's).
      centered: divide by the root of the variance estimate rather than of the second moment.
      momentum: the decay of a heavy-ball momentum on the scaled steps; ``None`` for none.
      nesterov: use Nesterov's momentum (with ``momentum``).
      bias_correction: divide the averages by ``1 - decay^t`` first.

    Returns:
      The optimizer, a :class:`~gradtx.GradientTransformation`.

    References:
      Hinton, Srivastava & Swersky, `Neural Networks for Machine Learning, Lecture 6e
      <https://www.cs.toronto.edu/~tijmen/csc321/slides/lecture_slides_lec6.pdf>`_, 2012

      Graves, `Generating Sequences With Recurrent Neural Networks
      <https://arxiv.org/abs/1308.0850>`_ (the centered variant), 2013

    Examples:
      >>> import torch
      >>> import gradtx as gtx
      >>> def f(params):  # a quadratic, smallest at w = 0
      ...     return (params["w"] ** 2).sum()
      >>> params = {"w": torch.tensor([1.0, 2.0, 3.0])}
      >>> tx = gtx.rmsprop(learning_rate=0.1)
      >>> state = tx.init(params)
      >>> for _ in range(5):
      ...     grads = torch.func.grad(f)(params)
      ...     updates, state = tx.update(grads, state, params)
      ...     params = gtx.apply_updates(params, updates)
      ...     print(f"{f(params):.4f}")
      10.5053
      8.5064
      7.1012
      6.0271
      5.1670
    """
    check_learning_rate(learning_rate, "rmsprop")
    scaler = scale_by_stddev if centered else scale_by_rms
    return _one(
        chain(
            scaler(
                decay=decay,
                eps=eps,
                initial_scale=initial_scale,
                eps_in_sqrt=eps_in_sqrt,
                bias_correction=bias_correction,
            ),
            scale_by_learning_rate(learning_rate),
            _momentum(momentum, nesterov),
        )
    )


@takes_spec
def adafactor(
    learning_rate: Optional[ScalarOrSchedule] = None,
    min_dim_size_to_factor: int = 128,
    decay_rate: float = 0.8,
    decay_offset: int = 0,
    multiply_by_parameter_scale: bool = True,
    clipping_threshold: Optional[float] = 1.0,
    momentum: Optional[float] = None,
    dtype_momentum: torch.dtype = torch.float32,
    weight_decay_rate: Optional[ScalarOrSchedule] = None,
    eps: float = 1e-30,
    factored: bool = True,
    weight_decay_mask: Any = None,
    *,
    spec: Optional[sharding.ShardingSpec] = None,
) -> GradientTransformation:
    """Adafactor: a factored second moment and steps relative to the size of the params.

    A matrix (a leaf whose two largest dimensions both have at least ``min_dim_size_to_factor``
    entries) keeps only the row and column means of ``g^2 + eps``, averaged with the decay
    ``1 - k^-decay_rate`` at the ``k``-th step, and is divided by the root of their outer product
    over their mean, so the state grows with ``m + n`` instead of ``m * n``; any other leaf keeps
    the full average. Then, each when asked for: the step's RMS is clipped at ``clipping_threshold``,
    multiplied by ``learning_rate``, by the RMS of the parameter (at least ``1e-3``), averaged with
    ``momentum`` (no bias correction), and ``weight_decay_rate * param`` is added (not multiplied by
    the learning rate); the result is negated. This is optax's chain: ``scale_by_factored_rms``,
    ``clip_by_block_rms``, ``scale_by_learning_rate(learning_rate, flip_sign=False)``,
    ``scale_by_param_block_rms``, ``ema(momentum, debias=False)``, ``add_decayed_weights`` and
    ``scale(-1)``.

    ``torch.optim.Adafactor(lr, beta2_decay=-decay_rate, d=clipping_threshold,
    weight_decay=wd)`` is this chain with ``learning_rate`` the schedule
    ``min(lr, 1 / sqrt(count + 1))``, ``min_dim_size_to_factor`` small enough to factor every
    matrix, ``weight_decay_rate = lr * wd`` and a negligible ``eps``, up to where torch floors its
    variance estimate (at ``eps1^2``) and its parameter RMS (at ``eps2``, here ``1e-3``); torch
    factors the last two dimensions of every tensor, optax the two largest.

    Args:
      learning_rate: the step size, relative to the parameter's RMS when
        ``multiply_by_parameter_scale``: a number, a 0-d tensor, a schedule called with the step
        count, or ``None`` (the default, as in optax), which leaves the scaling out of the chain:
        the step is then the one of a learning rate of 1. The chain still ends in ``scale(-1)``,
        so the params descend either way.
      min_dim_size_to_factor: factor a leaf's second moment only when its two largest dimensions
        both reach this size.
      decay_rate: the exponent of the second moment's decay ``1 - k^-decay_rate`` (``k`` = 1 at
        the first step).
      decay_offset: subtracted from ``k`` in that decay (to restart it when fine-tuning from a
        given step).
      multiply_by_parameter_scale: multiply each leaf's step by its parameter's RMS (at least
        ``1e-3``), so ``learning_rate`` is a relative step size.
      clipping_threshold: clip each leaf's step to this RMS (``None``: no clipping).
      momentum: the decay of a moving average of the steps (``None``: no momentum, and no
        memory for it).
      dtype_momentum: the dtype of the momentum's buffer.
      weight_decay_rate: ``weight_decay_rate * param`` is added to the step (after the learning
        rate, so it is not scaled by it): a number, a 0-d tensor, a schedule or ``None`` for none.
      eps: added to the squared gradients.
      factored: factor the second moment of large matrices (``False``: keep it whole, as Adam).
      weight_decay_mask: the leaves to decay: a tree of bools like the params (or a prefix of it),
        or a callable ``params -> such a tree``; ``None`` decays every leaf.
      spec: a :class:`gradtx.sharding.ShardingSpec` describing how plain-tensor leaves are
        sharded (DTensor leaves need none): the factored moments, the clipping's RMS and the
        parameter scale are then those of the whole logical leaves.

    Returns:
      The optimizer, a :class:`~gradtx.GradientTransformation`.

    References:
      Shazeer & Stern, `Adafactor: Adaptive Learning Rates with Sublinear Memory Cost
      <https://arxiv.org/abs/1804.04235>`_, ICML, 2018

    Examples:
      >>> import torch
      >>> import gradtx as gtx
      >>> def f(params):  # a quadratic, smallest at w = 0
      ...     return (params["w"] ** 2).sum()
      >>> params = {"w": torch.tensor([1.0, 2.0, 3.0])}
      >>> tx = gtx.adafactor(learning_rate=0.1)
      >>> state = tx.init(params)
      >>> for _ in range(5):
      ...     grads = torch.func.grad(f)(params)
      ...     updates, state = tx.update(grads, state, params)
      ...     params = gtx.apply_updates(params, updates)
      ...     print(f"{f(params):.4f}")
      11.5477
      9.6541
      8.1658
      6.9772
      6.0140
    """
    txs = [scale_by_factored_rms(factored, decay_rate, decay_offset, min_dim_size_to_factor, eps, spec=spec)]
    if clipping_threshold is not None:
        txs.append(clip_by_block_rms(clipping_threshold, spec))
    if learning_rate is not None:
        txs.append(scale_by_learning_rate(learning_rate, flip_sign=False))
    if multiply_by_parameter_scale:
        txs.append(scale_by_param_block_rms(spec=spec))
    if momentum is not None:
        txs.append(ema(momentum, debias=False, accumulator_dtype=dtype_momentum))
    if weight_decay_rate is not None:
        txs.append(add_decayed_weights(weight_decay_rate, mask=weight_decay_mask))
    txs.append(scale(-1.0))
    return _one(chain(*txs))


@takes_spec
def sm3(learning_rate: float, momentum: float = 0.9, *, spec: Optional[sharding.ShardingSpec] = None) -> GradientTransformation:
    """SM3: AdaGrad with one accumulator per row and column of a matrix, plus momentum.

    Each tensor keeps, for each of its dimensions, one accumulator per index (a matrix: one per
    row and one per column). Per entry, ``acc = g^2 + min`` of the accumulators that cover it,
    the step is ``u = g / sqrt(acc)`` (0 where ``acc`` is 0), and each accumulator becomes the
    maximum of ``acc`` over the entries it covers; the memory grows with the sum of the
    dimensions instead of their product. The update is ``-learning_rate * nu`` with the momentum
    ``nu = momentum * nu + (1 - momentum) * u``. optax's definition (SM3-II), with
    :func:`~gradtx.scale_by_sm3`'s ``eps=1e-8`` in the square root.

    Args:
      learning_rate: the step size, a number or a 0-d tensor (no schedule, as in optax).
      momentum: the decay of the moving average of the steps.
      spec: how plain-tensor leaves are sharded (a :class:`gradtx.sharding.ShardingSpec`): the
        accumulators of a split matrix are then the dense run's (see :func:`~gradtx.scale_by_sm3`).
        DTensor leaves need none.

    Returns:
      The optimizer, a :class:`~gradtx.GradientTransformation`.

    References:
      Anil, Gupta, Koren & Singer, `Memory-Efficient Adaptive Optimization
      <https://arxiv.org/abs/1901.11150>`_, NeurIPS, 2019

    Examples:
      >>> import torch
      >>> import gradtx as gtx
      >>> def f(params):  # a quadratic, smallest at w = 0
      ...     return (params["w"] ** 2).sum()
      >>> params = {"w": torch.tensor([1.0, 2.0, 3.0])}
      >>> tx = gtx.sm3(learning_rate=0.5)
      >>> state = tx.init(params)
      >>> for _ in range(5):
      ...     grads = torch.func.grad(f)(params)
      ...     updates, state = tx.update(grads, state, params)
      ...     params = gtx.apply_updates(params, updates)
      ...     print(f"{f(params):.4f}")
      13.4075
      12.4917
      11.4021
      10.2381
      9.0684
    """
    check_number_learning_rate(learning_rate, "sm3")
    return _one(chain(scale_by_sm3(momentum, spec=spec), scale(-fe_number(learning_rate))))
