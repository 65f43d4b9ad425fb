"""The Adam family: first and second moment estimates, with their corrections and extensions.

``adam``, ``adamw``, ``nadam`` and ``nadamw`` run :func:`gradtx.transforms.adam.fused_adam`: the
same numbers and state as the chain, computed in fewer passes over memory.

Each optimizer is the chain optax builds, with that chain's tuple state; ``learning_rate`` is a
number or a schedule (a callable of the 0-d step count), and an optimizer inside another ``chain``
keeps its own tuple state.
"""

from __future__ import annotations

import warnings
from typing import Any, Optional

import torch

from gradtx import sharding
from gradtx.base import GradientTransformation
from gradtx.chains.chain import chain
from gradtx.optimizers._common import _one
from gradtx.transforms.adadelta import scale_by_yogi
from gradtx.transforms.adam import (
    fused_adam,
    scale_by_adam,
    scale_by_adamax,
    scale_by_amsgrad,
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
    """Adam: ``chain(scale_by_adam(...), scale_by_learning_rate(learning_rate))``, fused.

    Equals ``torch.optim.Adam`` (eps outside the square root, ``eps_root=0``).
    """
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
    """AdamW: ``chain(scale_by_adam, add_decayed_weights(weight_decay, mask), scale_by_learning_rate)``, fused.

    The decay is ``learning_rate * weight_decay * param``, as in torch's ``AdamW`` (whose default
    ``weight_decay`` is ``1e-2``; optax's and gradtx's is ``1e-4``).
    """
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
    """NAdam as optax defines it: :func:`adam` with ``nesterov=True``.

    torch's ``NAdam`` is a different algorithm (Dozat's momentum-decay schedule
    ``mu_t = b1 * (1 - 0.5 * 0.96^(0.004 t))``); with ``momentum_decay`` large enough that
    ``mu_t == b1`` the two agree up to where they take ``1 - b1^(t+1)``.
    """
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
    """:func:`adamw` with ``nesterov=True``."""
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
    """AMSGrad: ``chain(scale_by_amsgrad(...), scale_by_learning_rate(learning_rate))``."""
    return _one(
        chain(
            scale_by_amsgrad(b1, b2, eps, eps_root, mu_dtype, bias_correction_mu, bias_correction_nu),
            scale_by_learning_rate(learning_rate),
        )
    )


def adamax(learning_rate: ScalarOrSchedule, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8) -> GradientTransformation:
    """Adamax: equals ``torch.optim.Adamax``."""
    return _one(chain(scale_by_adamax(b1, b2, eps), scale_by_learning_rate(learning_rate)))


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
    """Rectified Adam: equals ``torch.optim.RAdam`` for the default ``threshold`` and ``b2``."""
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
    """AdaBelief: ``chain(scale_by_belief(...), scale_by_learning_rate(learning_rate))``."""
    return _one(
        chain(scale_by_belief(b1, b2, eps, eps_root, nesterov=nesterov), scale_by_learning_rate(learning_rate))
    )


def yogi(learning_rate: ScalarOrSchedule, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-3) -> GradientTransformation:
    """Yogi: ``chain(scale_by_yogi(b1, b2, eps), scale_by_learning_rate(learning_rate))``."""
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
