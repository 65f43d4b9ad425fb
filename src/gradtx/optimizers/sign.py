"""Steps from the sign of (a momentum of) the gradient: signSGD, Signum, Lion, Rprop.

Each optimizer is the chain optax builds, with that chain's tuple state; ``learning_rate`` is a
number or a schedule (a callable of the 0-d step count), and an optimizer inside another ``chain``
keeps its own tuple state.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from gradtx.base import GradientTransformation
from gradtx.chains.chain import chain
from gradtx.optimizers._common import _one
from gradtx.transforms.lion import scale_by_lion
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


def lion(
    learning_rate: ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.99,
    mu_dtype: Optional[torch.dtype] = None,
    weight_decay: ScalarOrSchedule = 1e-3,
    mask: Any = None,
) -> GradientTransformation:
    """Lion (Chen et al., 2023): signed momentum updates with decoupled weight decay."""
    return _one(
        chain(
            scale_by_lion(b1=b1, b2=b2, mu_dtype=mu_dtype),
            add_decayed_weights(weight_decay, mask),
            scale_by_learning_rate(learning_rate),
        )
    )


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
