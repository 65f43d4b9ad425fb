"""Layer-wise trust ratios: each leaf's step is scaled by its parameter's norm (LARS, LAMB, Fromage).

Each optimizer is the chain optax builds, with that chain's tuple state; ``learning_rate`` is a
number or a schedule (a callable of the 0-d step count), and an optimizer inside another ``chain``
keeps its own tuple state.
"""

from __future__ import annotations

from typing import Any, Optional

from gradtx import sharding
from gradtx.base import GradientTransformation
from gradtx.chains.chain import chain
from gradtx.chains.masking import masked
from gradtx.optimizers._common import _one
from gradtx.transforms.adam import scale_by_adam
from gradtx.transforms.momentum import trace
from gradtx.transforms.scaling import ScalarOrSchedule, scale_by_learning_rate, scale_by_trust_ratio
from gradtx.transforms.weight_decay import add_decayed_weights


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
