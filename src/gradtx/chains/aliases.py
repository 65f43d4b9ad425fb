"""Ready-made optimizers with optax's names, arguments, defaults, states and numbers.

Each alias is the chain optax builds (``adamw`` is ``chain(scale_by_adam, add_decayed_weights,
scale_by_learning_rate)``, ...) and has that chain's tuple state. An alias is one transformation:
inside another ``chain`` it keeps its own tuple, as in optax (``chain(clip, adamw(...))`` has state
``(clip_state, (adam_state, decay_state, lr_state))``).

``adam``, ``adamw``, ``nadam`` and ``nadamw`` run :func:`gradtx.transforms.adam.fused_adam`: the
same numbers and state as the chain, computed in fewer passes over memory.

``learning_rate`` is a number or a schedule (a callable of the 0-d step count).
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from gradtx.base import GradientTransformation, identity
from gradtx.chains.chain import chain
from gradtx.chains.masking import masked
from gradtx.transforms.adam import (
    fused_adam,
    scale_by_adam,
    scale_by_adamax,
    scale_by_amsgrad,
    scale_by_belief,
    scale_by_radam,
)
from gradtx.transforms.lion import scale_by_lion
from gradtx.transforms.momentum import trace
from gradtx.transforms.noise import add_noise, differentially_private_aggregate
from gradtx.transforms.rms import scale_by_rms, scale_by_rss, scale_by_stddev
from gradtx.transforms.scaling import ScalarOrSchedule, scale_by_learning_rate, scale_by_trust_ratio
from gradtx.transforms.weight_decay import add_decayed_weights


def _one(tx: GradientTransformation) -> GradientTransformation:
    """``tx`` as a single transformation, so an enclosing chain nests its state instead of splicing it."""

    def init_fn(params: Any):
        return tx.init(params)

    return type(tx)(init_fn, tx.update)


def _momentum(momentum: Optional[float], nesterov: bool) -> GradientTransformation:
    return trace(decay=momentum, nesterov=nesterov) if momentum is not None else identity()


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


def lamb(
    learning_rate: ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-6,
    eps_root: float = 0.0,
    weight_decay: ScalarOrSchedule = 0.0,
    mask: Any = None,
    *,
    spec: Any = None,
) -> GradientTransformation:
    """LAMB (You et al., 2019): Adam, decoupled decay, then a per-leaf trust ratio.

    ``spec`` (a ``gradtx.sharding.ShardingSpec``) makes the trust ratio's per-leaf norms those of
    the whole logical leaf when the leaves are sharded.
    """
    return _one(
        chain(
            scale_by_adam(b1=b1, b2=b2, eps=eps, eps_root=eps_root),
            add_decayed_weights(weight_decay=weight_decay, mask=mask),
            scale_by_trust_ratio(spec=spec),
            scale_by_learning_rate(learning_rate),
        )
    )


def lars(
    learning_rate: ScalarOrSchedule,
    weight_decay: ScalarOrSchedule = 0.0,
    weight_decay_mask: Any = True,
    trust_coefficient: float = 0.001,
    eps: float = 0.0,
    trust_ratio_mask: Any = True,
    momentum: float = 0.9,
    nesterov: bool = False,
    *,
    spec: Any = None,
) -> GradientTransformation:
    """LARS (You et al., 2017): decay, a masked per-leaf trust ratio, learning rate, then momentum.

    ``spec`` as in :func:`lamb`.
    """
    return _one(
        chain(
            add_decayed_weights(weight_decay, mask=weight_decay_mask),
            masked(scale_by_trust_ratio(trust_coefficient=trust_coefficient, eps=eps, spec=spec), trust_ratio_mask),
            scale_by_learning_rate(learning_rate),
            trace(decay=momentum, nesterov=nesterov),
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


def adagrad(
    learning_rate: ScalarOrSchedule, initial_accumulator_value: float = 0.1, eps: float = 1e-7
) -> GradientTransformation:
    """AdaGrad: ``g / sqrt(sum of g^2 + eps)`` with the sum starting at ``initial_accumulator_value``.

    torch's ``Adagrad`` starts at 0 and adds ``eps`` outside the square root; with
    ``initial_accumulator_value`` equal on both sides and ``eps=0`` the two agree.
    """
    return _one(chain(scale_by_rss(initial_accumulator_value, eps), scale_by_learning_rate(learning_rate)))


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
