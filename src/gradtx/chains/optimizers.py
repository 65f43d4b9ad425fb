"""More of optax's optimizers, each the chain optax builds, with that chain's tuple state.

As in :mod:`gradtx.chains.aliases`: ``learning_rate`` is a number or a schedule (a callable of the
0-d step count), and an optimizer inside another ``chain`` keeps its own tuple state.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from gradtx.base import GradientTransformation
from gradtx.chains.aliases import _one
from gradtx.chains.chain import chain
from gradtx.transforms.adadelta import scale_by_adadelta, scale_by_yogi
from gradtx.transforms.momentum import ema
from gradtx.transforms.scaling import ScalarOrSchedule, scale, scale_by_learning_rate
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
