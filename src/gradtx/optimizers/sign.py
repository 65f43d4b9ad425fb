"""Steps from the sign of (a momentum of) the gradient: signSGD, Signum, Lion, Rprop.

Each optimizer is the chain optax builds, with that chain's tuple state; ``learning_rate`` is a
number, a 0-d tensor or a schedule (a callable of the 0-d step count), and an optimizer inside
another ``chain`` keeps its own tuple state.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from gradtx.base import GradientTransformation
from gradtx.chains.chain import chain
from gradtx.optimizers._common import _one, check_learning_rate, check_number_learning_rate
from gradtx.transforms.lion import fused_lion
from gradtx.transforms.momentum import ema
from gradtx.transforms.scaling import ScalarOrSchedule, scale, scale_by_learning_rate
from gradtx.transforms.sign import scale_by_rprop, scale_by_sign


def sign_sgd(learning_rate: ScalarOrSchedule) -> GradientTransformation:
    """signSGD: steps of a fixed size along the sign of each gradient entry.

    The update is ``-learning_rate * sign(g)``: every coordinate moves by ``learning_rate``
    whatever its gradient's magnitude (0 where the gradient is 0). ``chain(scale_by_sign(),
    scale_by_learning_rate(learning_rate))``. One bit per coordinate is all a worker needs to
    send, which is the paper's motivation.

    Args:
      learning_rate: the step size: a number, a 0-d tensor, or a schedule called with the step
        count (see :mod:`gradtx.schedules`).

    Returns:
      The optimizer, a :class:`~gradtx.GradientTransformation`.

    References:
      Bernstein, Wang, Azizzadenesheli & Anandkumar, `signSGD: Compressed Optimisation for
      Non-Convex Problems <https://arxiv.org/abs/1802.04434>`_, ICML, 2018

    Examples:
      >>> import torch
      >>> import gradtx as gtx
      >>> def f(params):  # a quadratic, smallest at w = 0
      ...     return (params["w"] ** 2).sum()
      >>> params = {"w": torch.tensor([1.0, 2.0, 3.0])}
      >>> tx = gtx.sign_sgd(learning_rate=0.1)
      >>> state = tx.init(params)
      >>> for _ in range(5):
      ...     grads = torch.func.grad(f)(params)
      ...     updates, state = tx.update(grads, state, params)
      ...     params = gtx.apply_updates(params, updates)
      ...     print(f"{f(params):.4f}")
      12.8300
      11.7200
      10.6700
      9.6800
      8.7500
    """
    check_learning_rate(learning_rate, "sign_sgd")
    return _one(chain(scale_by_sign(), scale_by_learning_rate(learning_rate)))


def signum(
    learning_rate: ScalarOrSchedule, beta: float = 0.9, accumulator_dtype: Optional[torch.dtype] = None
) -> GradientTransformation:
    """Signum: signSGD on a moving average of the gradients.

    ``m = beta * m + (1 - beta) * g`` (no bias correction) and the update is
    ``-learning_rate * sign(m)``: ``chain(ema(beta, debias=False), scale_by_sign(),
    scale_by_learning_rate(learning_rate))``.

    Args:
      learning_rate: the step size: a number, a 0-d tensor, or a schedule called with the step
        count (see :mod:`gradtx.schedules`).
      beta: the decay of the moving average.
      accumulator_dtype: the dtype of the moving average's buffer (``None``: the params' dtype).

    Returns:
      The optimizer, a :class:`~gradtx.GradientTransformation`.

    References:
      Bernstein, Wang, Azizzadenesheli & Anandkumar, `signSGD: Compressed Optimisation for
      Non-Convex Problems <https://arxiv.org/abs/1802.04434>`_, ICML, 2018

    Examples:
      >>> import torch
      >>> import gradtx as gtx
      >>> def f(params):  # a quadratic, smallest at w = 0
      ...     return (params["w"] ** 2).sum()
      >>> params = {"w": torch.tensor([1.0, 2.0, 3.0])}
      >>> tx = gtx.signum(learning_rate=0.1)
      >>> state = tx.init(params)
      >>> for _ in range(5):
      ...     grads = torch.func.grad(f)(params)
      ...     updates, state = tx.update(grads, state, params)
      ...     params = gtx.apply_updates(params, updates)
      ...     print(f"{f(params):.4f}")
      12.8300
      11.7200
      10.6700
      9.6800
      8.7500
    """
    check_learning_rate(learning_rate, "signum")
    return _one(
        chain(
            ema(beta, debias=False, accumulator_dtype=accumulator_dtype),
            scale_by_sign(),
            scale_by_learning_rate(learning_rate),
        )
    )


def lion(
    learning_rate: ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.99,
    mu_dtype: Optional[torch.dtype] = None,
    weight_decay: ScalarOrSchedule = 1e-3,
    mask: Any = None,
) -> GradientTransformation:
    """Lion: the sign of an interpolation of momentum and gradient, with decoupled weight decay.

    The update is ``-learning_rate * (sign(b1 * m + (1 - b1) * g) + weight_decay * param)``,
    then the momentum moves with a different rate, ``m = b2 * m + (1 - b2) * g``. Every
    coordinate steps by ``learning_rate`` (before the decay), so Lion usually wants a learning
    rate 3-10x smaller than AdamW's and a weight decay that much larger; it keeps one buffer,
    Adam two. Found by a program search in the paper.

    Args:
      learning_rate: the step size: a number, a 0-d tensor, or a schedule called with the step
        count (see :mod:`gradtx.schedules`).
      b1: the weight of the momentum in the interpolation whose sign is the step.
      b2: the decay rate of the momentum.
      mu_dtype: the dtype of the momentum's buffer (``None``: the params' dtype).
      weight_decay: the rate of the decoupled weight decay: each step also subtracts
        ``learning_rate * weight_decay * param``. A number, a 0-d tensor or a schedule.
      mask: the leaves to decay: a tree of bools like the params (or a prefix of it), or a
        callable ``params -> such a tree``; ``None`` decays every leaf.

    Returns:
      The optimizer, a :class:`~gradtx.GradientTransformation`.

    References:
      Chen et al., `Symbolic Discovery of Optimization Algorithms
      <https://arxiv.org/abs/2302.06675>`_, NeurIPS, 2023

    Examples:
      >>> import torch
      >>> import gradtx as gtx
      >>> def f(params):  # a quadratic, smallest at w = 0
      ...     return (params["w"] ** 2).sum()
      >>> params = {"w": torch.tensor([1.0, 2.0, 3.0])}
      >>> tx = gtx.lion(learning_rate=0.1)
      >>> state = tx.init(params)
      >>> for _ in range(5):
      ...     grads = torch.func.grad(f)(params)
      ...     updates, state = tx.update(grads, state, params)
      ...     params = gtx.apply_updates(params, updates)
      ...     print(f"{f(params):.4f}")
      12.8273
      11.7150
      10.6630
      9.6713
      8.7399
    """
    check_learning_rate(learning_rate, "lion")
    # chain(scale_by_lion, add_decayed_weights, scale_by_learning_rate) as one transformation: the
    # same state and numbers, in one pass (the C kernel), with a clip's coefficient handed to it
    return fused_lion(learning_rate, b1, b2, mu_dtype, weight_decay, mask)


def rprop(
    learning_rate: float,
    eta_minus: float = 0.5,
    eta_plus: float = 1.2,
    min_step_size: float = 1e-6,
    max_step_size: float = 50.0,
) -> GradientTransformation:
    """Rprop: a step size per coordinate that grows while the gradient keeps its sign.

    Each coordinate's step size is multiplied by ``eta_plus`` while its gradient keeps its sign
    and by ``eta_minus`` when the sign flips (clipped to ``[min_step_size, max_step_size]``);
    it moves by that step size against the sign of its gradient, and takes no step right after
    a flip. Only the signs of the gradients are used, so it suits full-batch training. optax's
    definition (``chain(scale_by_rprop(...), scale(-1))``), whose update lags one step behind
    its state: the first update is zero, and on the same gradients the ``k``-th is the step
    ``torch.optim.Rprop`` takes at its ``(k-1)``-th (see :func:`~gradtx.scale_by_rprop`).

    Args:
      learning_rate: the initial step size of every coordinate, a number or a 0-d tensor (no
        schedule, as in optax).
      eta_minus: the factor applied to a step size when its gradient changes sign.
      eta_plus: the factor applied to a step size when its gradient keeps its sign.
      min_step_size: the smallest step size.
      max_step_size: the largest step size.

    Returns:
      The optimizer, a :class:`~gradtx.GradientTransformation`.

    References:
      Riedmiller & Braun, `A direct adaptive method for faster backpropagation learning: the
      RPROP algorithm <https://doi.org/10.1109/ICNN.1993.298623>`_, IEEE ICNN, 1993

    Examples:
      >>> import torch
      >>> import gradtx as gtx
      >>> def f(params):  # a quadratic, smallest at w = 0
      ...     return (params["w"] ** 2).sum()
      >>> params = {"w": torch.tensor([1.0, 2.0, 3.0])}
      >>> tx = gtx.rprop(learning_rate=0.1)
      >>> state = tx.init(params)
      >>> for _ in range(5):
      ...     grads = torch.func.grad(f)(params)
      ...     updates, state = tx.update(grads, state, params)
      ...     params = gtx.apply_updates(params, updates)
      ...     print(f"{f(params):.4f}")
      14.0000
      12.8300
      11.5052
      10.0295
      8.4229
    """
    check_number_learning_rate(learning_rate, "rprop")
    return _one(
        chain(
            scale_by_rprop(learning_rate, eta_minus, eta_plus, min_step_size, max_step_size),
            scale(-1.0),
        )
    )
