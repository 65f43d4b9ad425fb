"""Per-coordinate step sizes from accumulated squared gradients, without Adam's first moment:
AdaGrad, AdaDelta, RMSProp, Adafactor, SM3.

Each optimizer is the chain optax builds, with that chain's tuple state; ``learning_rate`` is a
number or a schedule (a callable of the 0-d step count), and an optimizer inside another ``chain``
keeps its own tuple state.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from gradtx import sharding
from gradtx.base import GradientTransformation
from gradtx.chains.chain import chain
from gradtx.optimizers._common import _momentum, _one
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
    """AdaGrad: ``g / sqrt(sum of g^2 + eps)`` with the sum starting at ``initial_accumulator_value``.

    torch's ``Adagrad`` starts at 0 and adds ``eps`` outside the square root; with
    ``initial_accumulator_value`` equal on both sides and ``eps=0`` the two agree.
    """
    return _one(chain(scale_by_rss(initial_accumulator_value, eps), scale_by_learning_rate(learning_rate)))


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
    """RMSProp, optionally centered and with momentum, as optax builds it.

    optax (and gradtx) put ``eps`` inside the square root by default; ``eps_in_sqrt=False``
    gives ``torch.optim.RMSprop(alpha=decay, eps=eps, centered=..., momentum=...)`` exactly.
    """
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
    ``min_dim_size_to_factor``. ``spec`` makes the block RMS of the clipping and of the parameter
    scale those of the logical leaves.
    """
    txs = [scale_by_factored_rms(factored, decay_rate, decay_offset, min_dim_size_to_factor, eps)]
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
