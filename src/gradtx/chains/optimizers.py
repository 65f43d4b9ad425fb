"""More of optax's optimizers, each the chain optax builds, with that chain's tuple state.

As in :mod:`gradtx.chains.aliases`: ``learning_rate`` is a number or a schedule (a callable of the
0-d step count), and an optimizer inside another ``chain`` keeps its own tuple state.
"""

from __future__ import annotations

import warnings
from typing import Any, Optional

import torch

from gradtx.base import GradientTransformation
from gradtx.transforms._foreach import number_or_tensor as fe_number
from gradtx.chains.aliases import _one
from gradtx.chains.chain import chain
from gradtx import sharding
from gradtx.transforms.adadelta import scale_by_adadelta, scale_by_yogi
from gradtx.transforms.adam import scale_by_adam, scale_by_adamax
from gradtx.transforms.adan import scale_by_adan
from gradtx.transforms.block_norm import scale_by_param_block_rms
from gradtx.transforms.clipping import clip_by_block_rms
from gradtx.transforms.factored import scale_by_factored_rms
from gradtx.transforms.novograd import scale_by_novograd
from gradtx.transforms.optimistic import scale_by_optimistic_gradient
from gradtx.transforms.momentum import ema
from gradtx.transforms.scaling import ScalarOrSchedule, scale, scale_by_learning_rate, scale_by_trust_ratio
from gradtx.transforms.sm3 import scale_by_sm3
from gradtx.transforms.sign import scale_by_rprop, scale_by_sign
from gradtx.transforms.weight_decay import add_decayed_weights


def sign_sgd(learning_rate: ScalarOrSchedule) -> GradientTransformation:
    """signSGD: ``chain(scale_by_sign(), scale_by_learning_rate(learning_rate))``."""
    return _one(chain(scale_by_sign(), scale_by_learning_rate(learning_rate)))


def signum(
    learning_rate: ScalarOrSchedule, beta: float = 0.9, accumulator_dtype: Optional[torch.dtype] = None
) -> GradientTransformation:
    """Signum: the sign of an undebiased moving average of the gradients,
    ``chain(ema(beta, debias=False), scale_by_sign(), scale_by_learning_rate(learning_rate))``."""
    return _one(
        chain(
            ema(beta, debias=False, accumulator_dtype=accumulator_dtype),
            scale_by_sign(),
            scale_by_learning_rate(learning_rate),
        )
    )


def adadelta(
    learning_rate: Optional[ScalarOrSchedule] = None,
    rho: float = 0.9,
    eps: float = 1e-6,
    weight_decay: ScalarOrSchedule = 0.0,
    weight_decay_mask: Any = None,
) -> GradientTransformation:
    """Adadelta: ``chain(add_decayed_weights(weight_decay, weight_decay_mask), scale_by_adadelta(rho,
    eps), scale_by_learning_rate(learning_rate))``.

    Equals ``torch.optim.Adadelta(lr, rho, eps, weight_decay)`` (coupled decay). As in optax,
    ``learning_rate=None`` leaves the updates unscaled *and unsigned* (the chain ends in the identity),
    so pass a learning rate (torch's default is ``1.0``) to descend.
    """
    return _one(
        chain(
            add_decayed_weights(weight_decay, mask=weight_decay_mask),
            scale_by_adadelta(rho=rho, eps=eps),
            scale_by_learning_rate(learning_rate),
        )
    )


def yogi(learning_rate: ScalarOrSchedule, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-3) -> GradientTransformation:
    """Yogi: ``chain(scale_by_yogi(b1, b2, eps), scale_by_learning_rate(learning_rate))``."""
    return _one(chain(scale_by_yogi(b1=b1, b2=b2, eps=eps), scale_by_learning_rate(learning_rate)))


def rprop(
    learning_rate: float,
    eta_minus: float = 0.5,
    eta_plus: float = 1.2,
    min_step_size: float = 1e-6,
    max_step_size: float = 50.0,
) -> GradientTransformation:
    """Rprop: ``chain(scale_by_rprop(...), scale(-1.0))``, optax's definition (see :func:`scale_by_rprop`
    for how its one-step lag relates to ``torch.optim.Rprop``)."""
    return _one(
        chain(
            scale_by_rprop(learning_rate, eta_minus, eta_plus, min_step_size, max_step_size),
            scale(-1.0),
        )
    )


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
    """Adan: ``chain(scale_by_adan(...), add_decayed_weights(weight_decay, mask), scale_by_learning_rate)``
    (note optax's ``eps_root=1e-8`` here, ``0.0`` in :func:`scale_by_adan`)."""
    return _one(
        chain(
            scale_by_adan(b1=b1, b2=b2, b3=b3, eps=eps, eps_root=eps_root),
            add_decayed_weights(weight_decay, mask),
            scale_by_learning_rate(learning_rate),
        )
    )


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
    """NovoGrad: ``chain(scale_by_novograd(...), scale_by_learning_rate(learning_rate))``; per-layer norms
    of the logical leaves under a sharding ``spec``."""
    return _one(
        chain(
            scale_by_novograd(b1=b1, b2=b2, eps=eps, eps_root=eps_root, weight_decay=weight_decay, spec=spec),
            scale_by_learning_rate(learning_rate),
        )
    )


def optimistic_gradient_descent(
    learning_rate: ScalarOrSchedule, alpha: float = 1.0, beta: float = 1.0
) -> GradientTransformation:
    """Optimistic gradient descent: ``chain(scale_by_optimistic_gradient(alpha, beta), scale_by_learning_rate)``."""
    return _one(chain(scale_by_optimistic_gradient(alpha=alpha, beta=beta), scale_by_learning_rate(learning_rate)))


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
    """Optimistic Adam, optax's first version (deprecated there in favour of :func:`optimistic_adam_v2`):
    ``chain(scale_by_adam(...), scale_by_optimistic_gradient(alpha=learning_rate, beta=optimism),
    scale_by_learning_rate(1.0))``; ``optimism`` defaults to ``learning_rate``, which must be a number."""
    warnings.warn(
        "`optimistic_adam` is deprecated, please use `optimistic_adam_v2` instead.", category=DeprecationWarning, stacklevel=2
    )
    if callable(learning_rate):
        raise ValueError("optimistic_adam: learning rate schedules are not supported; optimistic_adam_v2 takes them")
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
    """Optimistic Adam: ``chain(scale_by_adam(...), scale_by_optimistic_gradient(alpha, beta),
    scale_by_learning_rate(learning_rate))``."""
    return _one(
        chain(
            scale_by_adam(b1=b1, b2=b2, eps=eps, eps_root=eps_root, mu_dtype=mu_dtype, nesterov=nesterov),
            scale_by_optimistic_gradient(alpha=alpha, beta=beta),
            scale_by_learning_rate(learning_rate),
        )
    )


def adamaxw(
    learning_rate: ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: ScalarOrSchedule = 1e-4,
    mask: Any = None,
) -> GradientTransformation:
    """Adamax with decoupled weight decay: ``chain(scale_by_adamax, add_decayed_weights(weight_decay,
    mask), scale_by_learning_rate)``; ``torch.optim.Adamax`` after shrinking the params by
    ``1 - learning_rate * weight_decay`` takes the same step."""
    return _one(
        chain(
            scale_by_adamax(b1=b1, b2=b2, eps=eps),
            add_decayed_weights(weight_decay, mask),
            scale_by_learning_rate(learning_rate),
        )
    )


def fromage(
    learning_rate: ScalarOrSchedule, min_norm: float = 1e-6, *, spec: Optional[sharding.ShardingSpec] = None
) -> GradientTransformation:
    """Fromage (Bernstein et al., 2020): ``chain(scale_by_trust_ratio(min_norm), scale_by_learning_rate(lr
    * m), add_decayed_weights(m - 1))`` with ``m = 1 / sqrt(1 + lr^2)``, so
    ``p_new = (p - lr * ||p|| / ||g|| * g) / sqrt(1 + lr^2)``. Per-leaf norms of the logical leaves
    under a sharding ``spec``.
    """
    if not callable(learning_rate):
        lr = float(learning_rate)
        mult = 1.0 / (1.0 + lr**2) ** 0.5
        return _one(
            chain(
                scale_by_trust_ratio(min_norm, spec=spec),
                scale_by_learning_rate(lr * mult),
                add_decayed_weights(mult - 1.0),
            )
        )
    schedule = learning_rate

    def mult_of(count):
        return 1.0 / (1.0 + schedule(count) ** 2) ** 0.5

    return _one(
        chain(
            scale_by_trust_ratio(min_norm, spec=spec),
            scale_by_learning_rate(lambda count: mult_of(count) * schedule(count)),
            add_decayed_weights(lambda count: mult_of(count) - 1.0),
        )
    )


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
    """Adafactor, optax's chain: ``scale_by_factored_rms``, then (each when asked for)
    ``clip_by_block_rms(clipping_threshold)``, ``scale_by_learning_rate(learning_rate, flip_sign=False)``,
    ``scale_by_param_block_rms()``, ``ema(momentum, debias=False)``, ``add_decayed_weights(weight_decay_rate,
    weight_decay_mask)``, and ``scale(-1)``.

    ``torch.optim.Adafactor(lr, beta2_decay=-decay_rate, d=clipping_threshold, weight_decay=wd)`` is
    this chain with ``learning_rate`` the schedule ``min(lr, 1 / sqrt(count + 1))``,
    ``min_dim_size_to_factor`` small enough to factor every matrix, ``weight_decay_rate = lr * wd``
    and a negligible ``eps``, up to where torch floors its variance estimate (at ``eps1^2``) and its
    parameter RMS (at ``eps2``, which is ``scale_by_param_block_rms``'s ``1e-3``); torch factors the
    last two dimensions of every tensor, optax the two largest when both reach
    ``min_dim_size_to_factor``. ``spec`` (or DTensor leaves) makes the factored moments, the block
    RMS of the clipping and the parameter scale those of the logical leaves.
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


def sm3(learning_rate: float, momentum: float = 0.9) -> GradientTransformation:
    """SM3: ``chain(scale_by_sm3(momentum), scale(-learning_rate))`` (a number, as in optax)."""
    return _one(chain(scale_by_sm3(momentum), scale(-fe_number(learning_rate))))
