"""The Adam family: first and second moment estimates, with their corrections and extensions.

``adam``, ``adamw``, ``nadam`` and ``nadamw`` run :func:`gradtx.transforms.adam.fused_adam`: the
same numbers and state as the chain, computed in fewer passes over memory.

Each optimizer is the chain optax builds, with that chain's tuple state; ``learning_rate`` is a
number, a 0-d tensor or a schedule (a callable of the 0-d step count), and an optimizer inside
another ``chain`` keeps its own tuple state.
"""

from __future__ import annotations

import warnings
from typing import Any, Optional

import torch

from gradtx import sharding
from gradtx.base import GradientTransformation, takes_spec
from gradtx.chains.chain import chain
from gradtx.optimizers._common import _one, check_learning_rate, check_number_learning_rate
from gradtx.transforms.adadelta import scale_by_yogi
from gradtx.transforms.adam import (
    fused_adam,
    fused_amsgrad,
    scale_by_adam,
    scale_by_adamax,
    scale_by_belief,
    scale_by_radam,
)
from gradtx.transforms.adan import scale_by_adan
from gradtx.transforms.novograd import scale_by_novograd
from gradtx.transforms.optimistic import scale_by_optimistic_gradient
from gradtx.transforms.scaling import ScalarOrSchedule, scale_by_learning_rate
from gradtx.transforms.weight_decay import add_decayed_weights


def adam(
    learning_rate: ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    mu_dtype: Optional[torch.dtype] = None,
    *,
    nesterov: bool = False,
) -> GradientTransformation:
    """Adam: steps along the first moment divided by the root of the second.

    With ``g`` the gradient at step ``t``: ``mu = b1 * mu + (1 - b1) * g``,
    ``nu = b2 * nu + (1 - b2) * g^2``, bias corrections ``mu_hat = mu / (1 - b1^t)`` and
    ``nu_hat = nu / (1 - b2^t)``, and the update
    ``-learning_rate * mu_hat / (sqrt(nu_hat + eps_root) + eps)``. This is
    ``chain(scale_by_adam(...), scale_by_learning_rate(learning_rate))`` with that chain's state,
    computed by one fused kernel, and the same numbers as ``torch.optim.Adam`` (whose ``eps`` is
    outside the square root too; ``eps_root=0``).

    Args:
      learning_rate: the step size: a number, a 0-d tensor, or a schedule called with the step
        count (see :mod:`gradtx.schedules`).
      b1: the decay rate of the first moment, the moving average of the gradients.
      b2: the decay rate of the second moment, the moving average of the squared gradients.
      eps: added to the square root of the second moment, for numerical stability.
      eps_root: added to the second moment inside the square root; a small positive value keeps
        the derivative finite where a gradient is exactly zero (when differentiating through the
        update, as in meta-learning).
      mu_dtype: the dtype of the first moment's buffer (``None``: the params' dtype); the second
        moment keeps the params' dtype and the updates the gradients'.
      nesterov: use Nesterov's momentum (Dozat's NAdam): ``mu_hat`` is replaced by
        ``b1 * mu / (1 - b1^(t+1)) + (1 - b1) * g / (1 - b1^t)``, the moment one step ahead.

    Returns:
      The optimizer, a :class:`~gradtx.GradientTransformation`.

    References:
      Kingma & Ba, `Adam: A Method for Stochastic Optimization <https://arxiv.org/abs/1412.6980>`_, 2014

    Examples:
      >>> import torch
      >>> import gradtx as gtx
      >>> def f(params):  # a quadratic, smallest at w = 0
      ...     return (params["w"] ** 2).sum()
      >>> params = {"w": torch.tensor([1.0, 2.0, 3.0])}
      >>> tx = gtx.adam(learning_rate=0.1)
      >>> state = tx.init(params)
      >>> for _ in range(5):
      ...     grads = torch.func.grad(f)(params)
      ...     updates, state = tx.update(grads, state, params)
      ...     params = gtx.apply_updates(params, updates)
      ...     print(f"{f(params):.4f}")
      12.8300
      11.7218
      10.6764
      9.6943
      8.7758
    """
    check_learning_rate(learning_rate, "adam")
    return fused_adam(learning_rate, b1, b2, eps, eps_root, mu_dtype, nesterov=nesterov)


def adamw(
    learning_rate: ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    mu_dtype: Optional[torch.dtype] = None,
    weight_decay: ScalarOrSchedule = 1e-4,
    mask: Any = None,
    *,
    nesterov: bool = False,
) -> GradientTransformation:
    """AdamW: Adam with weight decay decoupled from the gradient.

    Adam's update (see :func:`adam`), plus ``-learning_rate * weight_decay * param``: the decay
    shrinks the params directly instead of being added to the gradient, where Adam's
    normalisation would rescale it. This is ``chain(scale_by_adam(...),
    add_decayed_weights(weight_decay, mask), scale_by_learning_rate(learning_rate))`` with that
    chain's state, computed by one fused kernel, and the same numbers as ``torch.optim.AdamW``
    for the same ``weight_decay`` (whose default there is ``1e-2``; optax's and gradtx's is
    ``1e-4``).

    Args:
      learning_rate: the step size: a number, a 0-d tensor, or a schedule called with the step
        count (see :mod:`gradtx.schedules`).
      b1: the decay rate of the first moment, the moving average of the gradients.
      b2: the decay rate of the second moment, the moving average of the squared gradients.
      eps: added to the square root of the second moment, for numerical stability.
      eps_root: added to the second moment inside the square root; a small positive value keeps
        the derivative finite where a gradient is exactly zero (when differentiating through the
        update, as in meta-learning).
      mu_dtype: the dtype of the first moment's buffer (``None``: the params' dtype); the second
        moment keeps the params' dtype and the updates the gradients'.
      weight_decay: the rate of the decoupled weight decay: each step also subtracts
        ``learning_rate * weight_decay * param``. A number, a 0-d tensor or a schedule.
      mask: the leaves to decay: a tree of bools like the params (or a prefix of it), or a
        callable ``params -> such a tree``; ``None`` decays every leaf.
      nesterov: use Nesterov's momentum (Dozat's NAdam): ``mu_hat`` is replaced by
        ``b1 * mu / (1 - b1^(t+1)) + (1 - b1) * g / (1 - b1^t)``, the moment one step ahead.

    Returns:
      The optimizer, a :class:`~gradtx.GradientTransformation`.

    References:
      Loshchilov & Hutter, `Decoupled Weight Decay Regularization <https://arxiv.org/abs/1711.05101>`_,
      ICLR, 2019

    Examples:
      >>> import torch
      >>> import gradtx as gtx
      >>> def f(params):  # a quadratic, smallest at w = 0 and b = 0
      ...     return (params["w"] ** 2).sum() + (params["b"] ** 2).sum()
      >>> params = {"w": torch.tensor([1.0, 2.0, 3.0]), "b": torch.tensor([1.0])}
      >>> tx = gtx.adamw(learning_rate=0.1, weight_decay=0.5, mask={"w": True, "b": False})
      >>> state = tx.init(params)
      >>> for _ in range(5):
      ...     grads = torch.func.grad(f)(params)
      ...     updates, state = tx.update(grads, state, params)
      ...     params = gtx.apply_updates(params, updates)
      ...     print(f"{f(params):.4f}")
      12.3350
      10.0500
      8.1058
      6.4664
      5.0981
    """
    check_learning_rate(learning_rate, "adamw")
    return fused_adam(
        learning_rate, b1, b2, eps, eps_root, mu_dtype, nesterov=nesterov, weight_decay=weight_decay, mask=mask
    )


def nadam(
    learning_rate: ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    mu_dtype: Optional[torch.dtype] = None,
    *,
    nesterov: bool = True,
) -> GradientTransformation:
    """NAdam: Adam with Nesterov's momentum, as optax defines it.

    :func:`adam` with ``nesterov=True``: the first moment in the update is taken one step ahead,
    ``b1 * mu / (1 - b1^(t+1)) + (1 - b1) * g / (1 - b1^t)``, and divided by
    ``sqrt(nu_hat + eps_root) + eps`` as in Adam. ``torch.optim.NAdam`` is Dozat's algorithm with
    a momentum-decay schedule ``mu_t = b1 * (1 - 0.5 * 0.96^(0.004 t))``; with a
    ``momentum_decay`` large enough that ``mu_t == b1`` the two give the same steps, up to
    rounding.

    Args:
      learning_rate: the step size: a number, a 0-d tensor, or a schedule called with the step
        count (see :mod:`gradtx.schedules`).
      b1: the decay rate of the first moment, the moving average of the gradients.
      b2: the decay rate of the second moment, the moving average of the squared gradients.
      eps: added to the square root of the second moment, for numerical stability.
      eps_root: added to the second moment inside the square root; a small positive value keeps
        the derivative finite where a gradient is exactly zero (when differentiating through the
        update, as in meta-learning).
      mu_dtype: the dtype of the first moment's buffer (``None``: the params' dtype); the second
        moment keeps the params' dtype and the updates the gradients'.
      nesterov: use Nesterov's momentum (``True``, NAdam); ``False`` gives :func:`adam`.

    Returns:
      The optimizer, a :class:`~gradtx.GradientTransformation`.

    References:
      Dozat, `Incorporating Nesterov Momentum into Adam <https://openreview.net/forum?id=OM0jvwB8jIp57ZJjtNEZ>`_,
      ICLR workshop, 2016

    Examples:
      >>> import torch
      >>> import gradtx as gtx
      >>> def f(params):  # a quadratic, smallest at w = 0
      ...     return (params["w"] ** 2).sum()
      >>> params = {"w": torch.tensor([1.0, 2.0, 3.0])}
      >>> tx = gtx.nadam(learning_rate=0.1)
      >>> state = tx.init(params)
      >>> for _ in range(5):
      ...     grads = torch.func.grad(f)(params)
      ...     updates, state = tx.update(grads, state, params)
      ...     params = gtx.apply_updates(params, updates)
      ...     print(f"{f(params):.4f}")
      12.2967
      11.0732
      10.0110
      9.0493
      8.1680
    """
    check_learning_rate(learning_rate, "nadam")
    return fused_adam(learning_rate, b1, b2, eps, eps_root, mu_dtype, nesterov=nesterov)


def nadamw(
    learning_rate: ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    mu_dtype: Optional[torch.dtype] = None,
    weight_decay: ScalarOrSchedule = 1e-4,
    mask: Any = None,
    *,
    nesterov: bool = True,
) -> GradientTransformation:
    """NAdamW: NAdam with decoupled weight decay.

    :func:`adamw` with ``nesterov=True``: NAdam's update (see :func:`nadam`) plus
    ``-learning_rate * weight_decay * param``. The same numbers as ``torch.optim.NAdam`` with
    ``decoupled_weight_decay=True`` and a ``momentum_decay`` large enough to keep its momentum at
    ``b1``.

    Args:
      learning_rate: the step size: a number, a 0-d tensor, or a schedule called with the step
        count (see :mod:`gradtx.schedules`).
      b1: the decay rate of the first moment, the moving average of the gradients.
      b2: the decay rate of the second moment, the moving average of the squared gradients.
      eps: added to the square root of the second moment, for numerical stability.
      eps_root: added to the second moment inside the square root; a small positive value keeps
        the derivative finite where a gradient is exactly zero (when differentiating through the
        update, as in meta-learning).
      mu_dtype: the dtype of the first moment's buffer (``None``: the params' dtype); the second
        moment keeps the params' dtype and the updates the gradients'.
      weight_decay: the rate of the decoupled weight decay: each step also subtracts
        ``learning_rate * weight_decay * param``. A number, a 0-d tensor or a schedule.
      mask: the leaves to decay: a tree of bools like the params (or a prefix of it), or a
        callable ``params -> such a tree``; ``None`` decays every leaf.
      nesterov: use Nesterov's momentum (``True``, NAdamW); ``False`` gives :func:`adamw`.

    Returns:
      The optimizer, a :class:`~gradtx.GradientTransformation`.

    References:
      Dozat, `Incorporating Nesterov Momentum into Adam <https://openreview.net/forum?id=OM0jvwB8jIp57ZJjtNEZ>`_,
      ICLR workshop, 2016

      Loshchilov & Hutter, `Decoupled Weight Decay Regularization <https://arxiv.org/abs/1711.05101>`_,
      ICLR, 2019

    Examples:
      >>> import torch
      >>> import gradtx as gtx
      >>> def f(params):  # a quadratic, smallest at w = 0
      ...     return (params["w"] ** 2).sum()
      >>> params = {"w": torch.tensor([1.0, 2.0, 3.0])}
      >>> tx = gtx.nadamw(learning_rate=0.1, weight_decay=0.01)
      >>> state = tx.init(params)
      >>> for _ in range(5):
      ...     grads = torch.func.grad(f)(params)
      ...     updates, state = tx.update(grads, state, params)
      ...     params = gtx.apply_updates(params, updates)
      ...     print(f"{f(params):.4f}")
      12.2705
      11.0254
      9.9451
      8.9686
      8.0751
    """
    check_learning_rate(learning_rate, "nadamw")
    return adamw(learning_rate, b1, b2, eps, eps_root, mu_dtype, weight_decay, mask, nesterov=nesterov)


def amsgrad(
    learning_rate: ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    mu_dtype: Optional[torch.dtype] = None,
    bias_correction_mu: bool = True,
    bias_correction_nu: bool = True,
) -> GradientTransformation:
    """AMSGrad: Adam dividing by the running maximum of its second moment.

    Adam's moments, but the denominator never shrinks: ``nu_max = max(nu_max, nu_hat)`` and the
    update is ``-learning_rate * mu_hat / (sqrt(nu_max + eps_root) + eps)``: the paper shows Adam
    may fail to converge on convex problems and proves AMSGrad converges. As in optax, the maximum
    is taken of the bias-corrected ``nu_hat``; ``torch.optim.Adam(amsgrad=True)`` keeps the maximum
    of the uncorrected ``nu`` and corrects it afterwards, so the two differ while ``1 - b2^t``
    changes.

    Args:
      learning_rate: the step size: a number, a 0-d tensor, or a schedule called with the step
        count (see :mod:`gradtx.schedules`).
      b1: the decay rate of the first moment, the moving average of the gradients.
      b2: the decay rate of the second moment, the moving average of the squared gradients.
      eps: added to the square root of the second moment, for numerical stability.
      eps_root: added to the second moment inside the square root; a small positive value keeps
        the derivative finite where a gradient is exactly zero (when differentiating through the
        update, as in meta-learning).
      mu_dtype: the dtype of the first moment's buffer (``None``: the params' dtype); the second
        moment keeps the params' dtype and the updates the gradients'.
      bias_correction_mu: divide the first moment by ``1 - b1^t``.
      bias_correction_nu: divide the second moment by ``1 - b2^t`` before taking the maximum.

    Returns:
      The optimizer, a :class:`~gradtx.GradientTransformation`.

    References:
      Reddi, Kale & Kumar, `On the Convergence of Adam and Beyond
      <https://openreview.net/forum?id=ryQu7f-RZ>`_, ICLR, 2018

    Examples:
      >>> import torch
      >>> import gradtx as gtx
      >>> def f(params):  # a quadratic, smallest at w = 0
      ...     return (params["w"] ** 2).sum()
      >>> params = {"w": torch.tensor([1.0, 2.0, 3.0])}
      >>> tx = gtx.amsgrad(learning_rate=0.1)
      >>> state = tx.init(params)
      >>> for _ in range(5):
      ...     grads = torch.func.grad(f)(params)
      ...     updates, state = tx.update(grads, state, params)
      ...     params = gtx.apply_updates(params, updates)
      ...     print(f"{f(params):.4f}")
      12.8300
      11.7478
      10.7480
      9.8256
      8.9757
    """
    check_learning_rate(learning_rate, "amsgrad")
    # chain(scale_by_amsgrad, scale_by_learning_rate) as one transformation: the same state and
    # numbers, in one pass (the C kernel), with a clip's coefficient handed to it
    return fused_amsgrad(learning_rate, b1, b2, eps, eps_root, mu_dtype, bias_correction_mu, bias_correction_nu)


def adamax(learning_rate: ScalarOrSchedule, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8) -> GradientTransformation:
    """Adamax: Adam with the infinity norm in place of the second moment.

    ``mu = b1 * mu + (1 - b1) * g``, ``nu = max(b2 * nu, |g| + eps)`` and the update
    ``-learning_rate * mu / ((1 - b1^t) * nu)``: ``nu`` needs no bias correction. The same numbers
    as ``torch.optim.Adamax``. The state is a ``ScaleByAdamState`` whose ``nu`` holds the
    infinity-norm moment, as in optax.

    Args:
      learning_rate: the step size: a number, a 0-d tensor, or a schedule called with the step
        count (see :mod:`gradtx.schedules`).
      b1: the decay rate of the first moment, the moving average of the gradients.
      b2: the decay rate of the infinity-norm moment.
      eps: added to ``|g|`` before the maximum, so the denominator is never zero.

    Returns:
      The optimizer, a :class:`~gradtx.GradientTransformation`.

    References:
      Kingma & Ba, `Adam: A Method for Stochastic Optimization <https://arxiv.org/abs/1412.6980>`_
      (Section 7.1), 2014

    Examples:
      >>> import torch
      >>> import gradtx as gtx
      >>> def f(params):  # a quadratic, smallest at w = 0
      ...     return (params["w"] ** 2).sum()
      >>> params = {"w": torch.tensor([1.0, 2.0, 3.0])}
      >>> tx = gtx.adamax(learning_rate=0.1)
      >>> state = tx.init(params)
      >>> for _ in range(5):
      ...     grads = torch.func.grad(f)(params)
      ...     updates, state = tx.update(grads, state, params)
      ...     params = gtx.apply_updates(params, updates)
      ...     print(f"{f(params):.4f}")
      12.8300
      11.7467
      10.7451
      9.8202
      8.9673
    """
    check_learning_rate(learning_rate, "adamax")
    return _one(chain(scale_by_adamax(b1, b2, eps), scale_by_learning_rate(learning_rate)))


def adamaxw(
    learning_rate: ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: ScalarOrSchedule = 1e-4,
    mask: Any = None,
) -> GradientTransformation:
    """Adamax with decoupled weight decay.

    :func:`adamax`'s update plus ``-learning_rate * weight_decay * param``:
    ``chain(scale_by_adamax(...), add_decayed_weights(weight_decay, mask),
    scale_by_learning_rate(learning_rate))``. ``torch.optim.Adamax`` takes the same step after
    the params are shrunk by ``1 - learning_rate * weight_decay``.

    Args:
      learning_rate: the step size: a number, a 0-d tensor, or a schedule called with the step
        count (see :mod:`gradtx.schedules`).
      b1: the decay rate of the first moment, the moving average of the gradients.
      b2: the decay rate of the infinity-norm moment.
      eps: added to ``|g|`` before the maximum, so the denominator is never zero.
      weight_decay: the rate of the decoupled weight decay: each step also subtracts
        ``learning_rate * weight_decay * param``. A number, a 0-d tensor or a schedule.
      mask: the leaves to decay: a tree of bools like the params (or a prefix of it), or a
        callable ``params -> such a tree``; ``None`` decays every leaf.

    Returns:
      The optimizer, a :class:`~gradtx.GradientTransformation`.

    References:
      Kingma & Ba, `Adam: A Method for Stochastic Optimization <https://arxiv.org/abs/1412.6980>`_
      (Section 7.1), 2014

      Loshchilov & Hutter, `Decoupled Weight Decay Regularization <https://arxiv.org/abs/1711.05101>`_,
      ICLR, 2019

    Examples:
      >>> import torch
      >>> import gradtx as gtx
      >>> def f(params):  # a quadratic, smallest at w = 0
      ...     return (params["w"] ** 2).sum()
      >>> params = {"w": torch.tensor([1.0, 2.0, 3.0])}
      >>> tx = gtx.adamaxw(learning_rate=0.1, weight_decay=0.01)
      >>> state = tx.init(params)
      >>> for _ in range(5):
      ...     grads = torch.func.grad(f)(params)
      ...     updates, state = tx.update(grads, state, params)
      ...     params = gtx.apply_updates(params, updates)
      ...     print(f"{f(params):.4f}")
      12.8032
      11.6972
      10.6764
      9.7358
      8.8700
    """
    check_learning_rate(learning_rate, "adamaxw")
    return _one(
        chain(
            scale_by_adamax(b1=b1, b2=b2, eps=eps),
            add_decayed_weights(weight_decay, mask),
            scale_by_learning_rate(learning_rate),
        )
    )


def radam(
    learning_rate: ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    threshold: float = 5.0,
    *,
    nesterov: bool = False,
) -> GradientTransformation:
    """Rectified Adam: Adam whose adaptive step waits until its variance is tractable.

    With ``rho_inf = 2 / (1 - b2) - 1`` and ``rho_t = rho_inf - 2 t b2^t / (1 - b2^t)`` (the
    length of the approximated simple moving average), steps where ``rho_t >= threshold`` take
    Adam's update times the rectification
    ``r_t = sqrt((rho_t - 4) (rho_t - 2) rho_inf / ((rho_inf - 4) (rho_inf - 2) rho_t))``, and the
    earlier steps plain momentum ``-learning_rate * mu_hat``. The switch is made with tensor ops,
    so it neither syncs nor recompiles. The same numbers as ``torch.optim.RAdam`` (with
    ``eps=0``, since torch adds ``eps`` before the bias correction), which switches at
    ``rho_t > 5``: the same steps for the default ``b2``.

    Args:
      learning_rate: the step size: a number, a 0-d tensor, or a schedule called with the step
        count (see :mod:`gradtx.schedules`).
      b1: the decay rate of the first moment, the moving average of the gradients.
      b2: the decay rate of the second moment, the moving average of the squared gradients.
      eps: added to the square root of the second moment, for numerical stability.
      eps_root: added to the second moment inside the square root; a small positive value keeps
        the derivative finite where a gradient is exactly zero (when differentiating through the
        update, as in meta-learning).
      threshold: the value of ``rho_t`` from which the rectified adaptive step is taken.
      nesterov: use Nesterov's momentum (Dozat's NAdam): ``mu_hat`` is replaced by
        ``b1 * mu / (1 - b1^(t+1)) + (1 - b1) * g / (1 - b1^t)``, the moment one step ahead.

    Returns:
      The optimizer, a :class:`~gradtx.GradientTransformation`.

    References:
      Liu et al., `On the Variance of the Adaptive Learning Rate and Beyond
      <https://arxiv.org/abs/1908.03265>`_, ICLR, 2020

    Examples:
      >>> import torch
      >>> import gradtx as gtx
      >>> def f(params):  # a quadratic, smallest at w = 0
      ...     return (params["w"] ** 2).sum()
      >>> params = {"w": torch.tensor([1.0, 2.0, 3.0])}
      >>> tx = gtx.radam(learning_rate=0.1)
      >>> state = tx.init(params)
      >>> for _ in range(5):
      ...     grads = torch.func.grad(f)(params)
      ...     updates, state = tx.update(grads, state, params)
      ...     params = gtx.apply_updates(params, updates)
      ...     print(f"{f(params):.4f}")
      8.9600
      5.3999
      2.9921
      1.4591
      0.5693
    """
    check_learning_rate(learning_rate, "radam")
    return _one(
        chain(
            scale_by_radam(b1, b2, eps, eps_root, threshold, nesterov=nesterov),
            scale_by_learning_rate(learning_rate),
        )
    )


def adabelief(
    learning_rate: ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-16,
    eps_root: float = 1e-16,
    *,
    nesterov: bool = False,
) -> GradientTransformation:
    """AdaBelief: Adam whose second moment tracks how far gradients stray from their mean.

    ``mu = b1 * mu + (1 - b1) * g``, ``s = b2 * s + (1 - b2) * (g - mu)^2 + eps_root`` and the
    update ``-learning_rate * mu_hat / (sqrt(s_hat) + eps)``: a gradient close to the
    prediction ``mu`` (high "belief") gets a large step. As in optax, ``eps_root`` is added to the
    stored ``s`` at every step.

    Args:
      learning_rate: the step size: a number, a 0-d tensor, or a schedule called with the step
        count (see :mod:`gradtx.schedules`).
      b1: the decay rate of the first moment, the moving average of the gradients.
      b2: the decay rate of ``s``, the moving average of ``(g - mu)^2``.
      eps: added to the square root of the second moment, for numerical stability.
      eps_root: added to ``s`` at every step (inside the square root).
      nesterov: use Nesterov's momentum (Dozat's NAdam): ``mu_hat`` is replaced by
        ``b1 * mu / (1 - b1^(t+1)) + (1 - b1) * g / (1 - b1^t)``, the moment one step ahead.

    Returns:
      The optimizer, a :class:`~gradtx.GradientTransformation`.

    References:
      Zhuang et al., `AdaBelief Optimizer: Adapting Stepsizes by the Belief in Observed Gradients
      <https://arxiv.org/abs/2010.07468>`_, NeurIPS, 2020

    Examples:
      >>> import torch
      >>> import gradtx as gtx
      >>> def f(params):  # a quadratic, smallest at w = 0
      ...     return (params["w"] ** 2).sum()
      >>> params = {"w": torch.tensor([1.0, 2.0, 3.0])}
      >>> tx = gtx.adabelief(learning_rate=0.1)
      >>> state = tx.init(params)
      >>> for _ in range(5):
      ...     grads = torch.func.grad(f)(params)
      ...     updates, state = tx.update(grads, state, params)
      ...     params = gtx.apply_updates(params, updates)
      ...     print(f"{f(params):.4f}")
      12.7037
      11.4236
      10.1732
      8.9668
      7.8185
    """
    check_learning_rate(learning_rate, "adabelief")
    return _one(
        chain(scale_by_belief(b1, b2, eps, eps_root, nesterov=nesterov), scale_by_learning_rate(learning_rate))
    )


def yogi(learning_rate: ScalarOrSchedule, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-3) -> GradientTransformation:
    """Yogi: Adam whose second moment changes additively, so it cannot grow too fast.

    ``nu = nu - (1 - b2) * sign(nu - g^2) * g^2`` instead of Adam's multiplicative average (both
    moments start at ``1e-6``, :func:`~gradtx.scale_by_yogi`'s ``initial_accumulator_value``),
    and the update is ``-learning_rate * mu_hat / (sqrt(nu_hat) + eps)`` with the usual bias
    corrections. The larger default ``eps`` follows the paper.

    Args:
      learning_rate: the step size: a number, a 0-d tensor, or a schedule called with the step
        count (see :mod:`gradtx.schedules`).
      b1: the decay rate of the first moment, the moving average of the gradients.
      b2: the rate at which the second moment moves towards ``g^2``.
      eps: added to the square root of the second moment, for numerical stability.

    Returns:
      The optimizer, a :class:`~gradtx.GradientTransformation`.

    References:
      Zaheer et al., `Adaptive Methods for Nonconvex Optimization
      <https://proceedings.neurips.cc/paper/2018/hash/90365351ccc7437a1309dc64e4db32a3-Abstract.html>`_,
      NeurIPS, 2018

    Examples:
      >>> import torch
      >>> import gradtx as gtx
      >>> def f(params):  # a quadratic, smallest at w = 0
      ...     return (params["w"] ** 2).sum()
      >>> params = {"w": torch.tensor([1.0, 2.0, 3.0])}
      >>> tx = gtx.yogi(learning_rate=0.1)
      >>> state = tx.init(params)
      >>> for _ in range(5):
      ...     grads = torch.func.grad(f)(params)
      ...     updates, state = tx.update(grads, state, params)
      ...     params = gtx.apply_updates(params, updates)
      ...     print(f"{f(params):.4f}")
      12.8303
      11.7227
      10.6780
      9.6968
      8.7794
    """
    check_learning_rate(learning_rate, "yogi")
    return _one(chain(scale_by_yogi(b1=b1, b2=b2, eps=eps), scale_by_learning_rate(learning_rate)))


def adan(
    learning_rate: ScalarOrSchedule,
    b1: float = 0.98,
    b2: float = 0.92,
    b3: float = 0.99,
    eps: float = 1e-8,
    eps_root: float = 1e-8,
    weight_decay: ScalarOrSchedule = 0.0,
    mask: Any = None,
) -> GradientTransformation:
    """Adan: adaptive Nesterov momentum, from moments of the gradient and of its difference.

    With ``d = g - g_prev`` (zero at the first step): ``m = b1 m + (1 - b1) g``,
    ``v = b2 v + (1 - b2) d``, ``n = b3 n + (1 - b3) (g + (1 - b2) d)^2``, each bias-corrected by
    its own rate, and the update is
    ``-learning_rate * ((m_hat + (1 - b2) v_hat) / (sqrt(n_hat + eps_root) + eps) + weight_decay * param)``,
    optax's definition, with optax's numbers. ``b1``, ``b2`` and ``b3`` are decay rates, as in
    optax: the paper's ``1 - beta_1``, ``1 - beta_2``, ``1 - beta_3``. Two differences from the
    paper and its official code follow optax: the gradient differences enter ``n`` and the update
    with weight ``1 - b2`` (the paper's ``beta_2``, 0.08 by default) where the paper weights them
    by its ``1 - beta_2`` (``b2``, 0.92), and the weight decay is added to the update where the
    paper applies it as a proximal step.

    Args:
      learning_rate: the step size: a number, a 0-d tensor, or a schedule called with the step
        count (see :mod:`gradtx.schedules`).
      b1: the decay rate of the moving average of the gradients.
      b2: the decay rate of the moving average of the gradient differences.
      b3: the decay rate of the moving average of the squared corrected gradients.
      eps: added to the square root of the second moment, for numerical stability.
      eps_root: added inside the square root. Its default here is optax's ``1e-8``
        (:func:`~gradtx.scale_by_adan`'s is ``0.0``).
      weight_decay: the rate of the decoupled weight decay: each step also subtracts
        ``learning_rate * weight_decay * param``. A number, a 0-d tensor or a schedule.
      mask: the leaves to decay: a tree of bools like the params (or a prefix of it), or a
        callable ``params -> such a tree``; ``None`` decays every leaf.

    Returns:
      The optimizer, a :class:`~gradtx.GradientTransformation`.

    References:
      Xie et al., `Adan: Adaptive Nesterov Momentum Algorithm for Faster Optimizing
      Deep Models <https://arxiv.org/abs/2208.06677>`_, 2022

    Examples:
      >>> import torch
      >>> import gradtx as gtx
      >>> def f(params):  # a quadratic, smallest at w = 0
      ...     return (params["w"] ** 2).sum()
      >>> params = {"w": torch.tensor([1.0, 2.0, 3.0])}
      >>> tx = gtx.adan(learning_rate=0.1)
      >>> state = tx.init(params)
      >>> for _ in range(5):
      ...     grads = torch.func.grad(f)(params)
      ...     updates, state = tx.update(grads, state, params)
      ...     params = gtx.apply_updates(params, updates)
      ...     print(f"{f(params):.4f}")
      12.8300
      11.7207
      10.6723
      9.6850
      8.7587
    """
    check_learning_rate(learning_rate, "adan")
    return _one(
        chain(
            scale_by_adan(b1=b1, b2=b2, b3=b3, eps=eps, eps_root=eps_root),
            add_decayed_weights(weight_decay, mask),
            scale_by_learning_rate(learning_rate),
        )
    )


@takes_spec
def novograd(
    learning_rate: ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.25,
    eps: float = 1e-6,
    eps_root: float = 0.0,
    weight_decay: float = 0.0,
    *,
    spec: Optional[sharding.ShardingSpec] = None,
) -> GradientTransformation:
    """NovoGrad: a layer-wise second moment, and the weight decay inside the momentum.

    Per leaf (layer), ``nu = ||g||^2`` at the first step and ``b2 * nu + (1 - b2) * ||g||^2``
    after; the momentum is ``mu = b1 * mu + g / (sqrt(nu + eps_root) + eps) + weight_decay * param``
    and the update ``-learning_rate * mu``. One 0-d second moment per leaf makes the state about
    half of Adam's. Under a sharding ``spec`` the norms are those of the whole logical leaves.

    Args:
      learning_rate: the step size: a number, a 0-d tensor, or a schedule called with the step
        count (see :mod:`gradtx.schedules`).
      b1: the decay rate of the momentum.
      b2: the decay rate of the per-layer second moment.
      eps: added to the square root of the second moment, for numerical stability.
      eps_root: added to the per-layer second moment inside the square root.
      weight_decay: ``weight_decay * param`` is added to the normalized gradient inside the
        momentum (a number; ``params`` are then required).
      spec: a :class:`gradtx.sharding.ShardingSpec` describing how plain-tensor leaves are
        sharded, so the per-layer norms are those of the logical leaves (``None``: unsharded or
        DTensor leaves).

    Returns:
      The optimizer, a :class:`~gradtx.GradientTransformation`.

    References:
      Ginsburg et al., `Stochastic Gradient Methods with Layer-wise Adaptive Moments for Training of Deep
      Networks <https://arxiv.org/abs/1905.11286>`_, 2019

    Examples:
      >>> import torch
      >>> import gradtx as gtx
      >>> def f(params):  # a quadratic, smallest at w = 0
      ...     return (params["w"] ** 2).sum()
      >>> params = {"w": torch.tensor([1.0, 2.0, 3.0])}
      >>> tx = gtx.novograd(learning_rate=0.1)
      >>> state = tx.init(params)
      >>> for _ in range(5):
      ...     grads = torch.func.grad(f)(params)
      ...     updates, state = tx.update(grads, state, params)
      ...     params = gtx.apply_updates(params, updates)
      ...     print(f"{f(params):.4f}")
      13.2617
      11.9187
      10.1349
      8.0893
      5.9659
    """
    check_learning_rate(learning_rate, "novograd")
    return _one(
        chain(
            scale_by_novograd(b1=b1, b2=b2, eps=eps, eps_root=eps_root, weight_decay=weight_decay, spec=spec),
            scale_by_learning_rate(learning_rate),
        )
    )


def optimistic_adam(
    learning_rate: float,
    optimism: Optional[float] = None,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    mu_dtype: Optional[torch.dtype] = None,
    *,
    nesterov: bool = True,
) -> GradientTransformation:
    """Optimistic Adam, optax's first version (deprecated: use :func:`optimistic_adam_v2`).

    Adam's direction ``a_t`` (see :func:`adam`) made optimistic, then scaled:
    ``-((learning_rate + optimism) * a_t - optimism * a_{t-1})``, with ``a_0`` taken as the
    first direction. This is ``chain(scale_by_adam(...),
    scale_by_optimistic_gradient(alpha=learning_rate, beta=optimism), scale_by_learning_rate(1.0))``;
    the learning rate must be a number or a 0-d tensor. Building it warns with a ``DeprecationWarning``, as optax's
    does.

    Args:
      learning_rate: the step size, a number or a 0-d tensor (a schedule is refused, as in
        optax: :func:`optimistic_adam_v2` takes one).
      optimism: the weight of the correction by the previous direction (``None``:
        ``learning_rate``).
      b1: the decay rate of the first moment, the moving average of the gradients.
      b2: the decay rate of the second moment, the moving average of the squared gradients.
      eps: added to the square root of the second moment, for numerical stability.
      eps_root: added to the second moment inside the square root; a small positive value keeps
        the derivative finite where a gradient is exactly zero (when differentiating through the
        update, as in meta-learning).
      mu_dtype: the dtype of the first moment's buffer (``None``: the params' dtype); the second
        moment keeps the params' dtype and the updates the gradients'.
      nesterov: use Nesterov's momentum (Dozat's NAdam): ``mu_hat`` is replaced by
        ``b1 * mu / (1 - b1^(t+1)) + (1 - b1) * g / (1 - b1^t)``, the moment one step ahead.

    Returns:
      The optimizer, a :class:`~gradtx.GradientTransformation`.

    References:
      Daskalakis, Ilyas, Syrgkanis & Zeng, `Training GANs with Optimism
      <https://arxiv.org/abs/1711.00141>`_, ICLR, 2018

    Examples:
      >>> import torch
      >>> import gradtx as gtx
      >>> def f(params):  # a quadratic, smallest at w = 0
      ...     return (params["w"] ** 2).sum()
      >>> params = {"w": torch.tensor([1.0, 2.0, 3.0])}
      >>> tx = gtx.optimistic_adam(learning_rate=0.1)
      >>> state = tx.init(params)
      >>> for _ in range(5):
      ...     grads = torch.func.grad(f)(params)
      ...     updates, state = tx.update(grads, state, params)
      ...     params = gtx.apply_updates(params, updates)
      ...     print(f"{f(params):.4f}")
      12.2967
      11.4297
      10.4222
      9.4669
      8.5755
    """
    check_number_learning_rate(learning_rate, "optimistic_adam", instead="optimistic_adam_v2 takes a schedule")
    warnings.warn(
        "`optimistic_adam` is deprecated, please use `optimistic_adam_v2` instead.", category=DeprecationWarning, stacklevel=2
    )
    if optimism is None:
        optimism = learning_rate
    return _one(
        chain(
            scale_by_adam(b1=b1, b2=b2, eps=eps, eps_root=eps_root, mu_dtype=mu_dtype, nesterov=nesterov),
            scale_by_optimistic_gradient(alpha=learning_rate, beta=optimism),
            scale_by_learning_rate(1.0),
        )
    )


def optimistic_adam_v2(
    learning_rate: ScalarOrSchedule,
    *,
    alpha: float = 1.0,
    beta: float = 1.0,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    mu_dtype: Optional[torch.dtype] = None,
    nesterov: bool = True,
) -> GradientTransformation:
    """Optimistic Adam: Adam's direction extrapolated with the previous one, for min-max games.

    With Adam's direction ``a_t`` (see :func:`adam`), the update is
    ``-learning_rate * ((alpha + beta) * a_t - beta * a_{t-1})`` (``a_0`` taken as the first
    direction): ``chain(scale_by_adam(...), scale_by_optimistic_gradient(alpha, beta),
    scale_by_learning_rate(learning_rate))``. The correction by the previous step damps the
    rotation that plain gradient steps show on saddle-point problems such as GAN training.

    Args:
      learning_rate: the step size: a number, a 0-d tensor, or a schedule called with the step
        count (see :mod:`gradtx.schedules`).
      alpha: the weight of the current direction.
      beta: the weight of the optimistic correction ``a_t - a_{t-1}``.
      b1: the decay rate of the first moment, the moving average of the gradients.
      b2: the decay rate of the second moment, the moving average of the squared gradients.
      eps: added to the square root of the second moment, for numerical stability.
      eps_root: added to the second moment inside the square root; a small positive value keeps
        the derivative finite where a gradient is exactly zero (when differentiating through the
        update, as in meta-learning).
      mu_dtype: the dtype of the first moment's buffer (``None``: the params' dtype); the second
        moment keeps the params' dtype and the updates the gradients'.
      nesterov: use Nesterov's momentum (Dozat's NAdam): ``mu_hat`` is replaced by
        ``b1 * mu / (1 - b1^(t+1)) + (1 - b1) * g / (1 - b1^t)``, the moment one step ahead.

    Returns:
      The optimizer, a :class:`~gradtx.GradientTransformation`.

    References:
      Daskalakis, Ilyas, Syrgkanis & Zeng, `Training GANs with Optimism
      <https://arxiv.org/abs/1711.00141>`_, ICLR, 2018

    Examples:
      >>> import torch
      >>> import gradtx as gtx
      >>> def f(params):  # a quadratic, smallest at w = 0
      ...     return (params["w"] ** 2).sum()
      >>> params = {"w": torch.tensor([1.0, 2.0, 3.0])}
      >>> tx = gtx.optimistic_adam_v2(learning_rate=0.1)
      >>> state = tx.init(params)
      >>> for _ in range(5):
      ...     grads = torch.func.grad(f)(params)
      ...     updates, state = tx.update(grads, state, params)
      ...     params = gtx.apply_updates(params, updates)
      ...     print(f"{f(params):.4f}")
      12.2967
      11.4297
      10.4222
      9.4669
      8.5755
    """
    check_learning_rate(learning_rate, "optimistic_adam_v2")
    return _one(
        chain(
            scale_by_adam(b1=b1, b2=b2, eps=eps, eps_root=eps_root, mu_dtype=mu_dtype, nesterov=nesterov),
            scale_by_optimistic_gradient(alpha=alpha, beta=beta),
            scale_by_learning_rate(learning_rate),
        )
    )
