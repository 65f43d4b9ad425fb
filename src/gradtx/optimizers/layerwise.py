"""Layer-wise trust ratios: each leaf's step is scaled by its parameter's norm (LARS, LAMB, Fromage).

Each optimizer is the chain optax builds, with that chain's tuple state; ``learning_rate`` is a
number, a 0-d tensor or a schedule (a callable of the 0-d step count), and an optimizer inside
another ``chain`` keeps its own tuple state.
"""

from __future__ import annotations

from typing import Any, Optional

from gradtx import sharding
from gradtx.base import GradientTransformation, takes_spec
from gradtx.chains.chain import chain
from gradtx.chains.masking import masked
from gradtx.optimizers._common import _one, check_learning_rate
from gradtx.transforms.adam import scale_by_adam
from gradtx.transforms.momentum import trace
from gradtx.transforms.scaling import ScalarOrSchedule, scale_by_learning_rate, scale_by_trust_ratio
from gradtx.transforms.weight_decay import add_decayed_weights


@takes_spec
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
    """LARS: SGD with momentum whose step per layer is scaled by the ratio of norms.

    Per leaf (layer), ``u = g + weight_decay * param``, scaled by the trust ratio
    ``trust_coefficient * ||param|| / (||u|| + eps)`` (1 where either norm is 0), so each layer
    moves by a set fraction of its own norm whatever its gradient's scale, then ``-learning_rate``
    and heavy-ball momentum: ``chain(add_decayed_weights(weight_decay, weight_decay_mask),
    masked(scale_by_trust_ratio(...), trust_ratio_mask), scale_by_learning_rate(learning_rate),
    trace(momentum, nesterov))``. The masks usually leave biases and normalisation layers out.

    Args:
      learning_rate: the step size: a number, a 0-d tensor, or a schedule called with the step
        count (see :mod:`gradtx.schedules`).
      weight_decay: the rate of the L2 penalty added to the gradient before the trust ratio: a
        number, a 0-d tensor or a schedule.
      weight_decay_mask: the leaves to decay: ``True`` (all), a tree of bools like the params
        (or a prefix of it), or a callable ``params -> such a tree``.
      trust_coefficient: the fraction of the parameter's norm a step moves before the learning
        rate (the paper's ``eta``).
      eps: added to the update's norm in the trust ratio.
      trust_ratio_mask: the leaves scaled by the trust ratio, in the same forms as
        ``weight_decay_mask``; the others keep ``u``.
      momentum: the decay of the heavy-ball momentum on the scaled steps.
      nesterov: use Nesterov's momentum.
      spec: a :class:`gradtx.sharding.ShardingSpec` describing how plain-tensor leaves are
        sharded (DTensor leaves need none): the per-leaf norms are then those of the whole
        logical leaves, reduced over each leaf's shard axes.

    Returns:
      The optimizer, a :class:`~gradtx.GradientTransformation`.

    References:
      You, Gitman & Ginsburg, `Large Batch Training of Convolutional Networks
      <https://arxiv.org/abs/1708.03888>`_, 2017

    Examples:
      >>> import torch
      >>> import gradtx as gtx
      >>> def f(params):  # a quadratic, smallest at w = 0
      ...     return (params["w"] ** 2).sum()
      >>> params = {"w": torch.tensor([1.0, 2.0, 3.0])}
      >>> tx = gtx.lars(learning_rate=0.5, trust_coefficient=0.1)
      >>> state = tx.init(params)
      >>> for _ in range(5):
      ...     grads = torch.func.grad(f)(params)
      ...     updates, state = tx.update(grads, state, params)
      ...     params = gtx.apply_updates(params, updates)
      ...     print(f"{f(params):.4f}")
      12.6350
      10.2943
      7.4887
      4.7306
      2.4363
    """
    check_learning_rate(learning_rate, "lars")
    return _one(
        chain(
            add_decayed_weights(weight_decay, mask=weight_decay_mask),
            masked(scale_by_trust_ratio(trust_coefficient=trust_coefficient, eps=eps, spec=spec), trust_ratio_mask),
            scale_by_learning_rate(learning_rate),
            trace(decay=momentum, nesterov=nesterov),
        )
    )


@takes_spec
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
    """LAMB: Adam whose step per layer is scaled by the ratio of norms.

    Per leaf (layer), Adam's direction plus decoupled decay, ``u = mu_hat / (sqrt(nu_hat +
    eps_root) + eps) + weight_decay * param``, is scaled by the trust ratio
    ``||param|| / ||u||`` (1 where either norm is 0) and by ``-learning_rate``:
    ``chain(scale_by_adam(...), add_decayed_weights(weight_decay, mask), scale_by_trust_ratio(),
    scale_by_learning_rate(learning_rate))``. Every layer moves by a fraction
    ``learning_rate`` of its own norm, which keeps very large batches stable.

    Args:
      learning_rate: the step size: a number, a 0-d tensor, or a schedule called with the step
        count (see :mod:`gradtx.schedules`).
      b1: the decay rate of the first moment, the moving average of the gradients.
      b2: the decay rate of the second moment, the moving average of the squared gradients.
      eps: added to the square root of the second moment, for numerical stability.
      eps_root: added to the second moment inside the square root.
      weight_decay: the rate of the decoupled weight decay, added to Adam's direction before the
        trust ratio: a number, a 0-d tensor or a schedule.
      mask: the leaves to decay: a tree of bools like the params (or a prefix of it), or a
        callable ``params -> such a tree``; ``None`` decays every leaf.
      spec: a :class:`gradtx.sharding.ShardingSpec` describing how plain-tensor leaves are
        sharded (DTensor leaves need none): the per-leaf norms are then those of the whole
        logical leaves, reduced over each leaf's shard axes.

    Returns:
      The optimizer, a :class:`~gradtx.GradientTransformation`.

    References:
      You et al., `Large Batch Optimization for Deep Learning: Training BERT in 76 minutes
      <https://arxiv.org/abs/1904.00962>`_, ICLR, 2020

    Examples:
      >>> import torch
      >>> import gradtx as gtx
      >>> def f(params):  # a quadratic, smallest at w = 0
      ...     return (params["w"] ** 2).sum()
      >>> params = {"w": torch.tensor([1.0, 2.0, 3.0])}
      >>> tx = gtx.lamb(learning_rate=0.1)
      >>> state = tx.init(params)
      >>> for _ in range(5):
      ...     grads = torch.func.grad(f)(params)
      ...     updates, state = tx.update(grads, state, params)
      ...     params = gtx.apply_updates(params, updates)
      ...     print(f"{f(params):.4f}")
      11.5477
      9.5589
      7.9423
      6.6237
      5.5428
    """
    check_learning_rate(learning_rate, "lamb")
    return _one(
        chain(
            scale_by_adam(b1=b1, b2=b2, eps=eps, eps_root=eps_root),
            add_decayed_weights(weight_decay=weight_decay, mask=mask),
            scale_by_trust_ratio(spec=spec),
            scale_by_learning_rate(learning_rate),
        )
    )


@takes_spec
def fromage(
    learning_rate: ScalarOrSchedule, min_norm: float = 1e-6, *, spec: Optional[sharding.ShardingSpec] = None
) -> GradientTransformation:
    """Fromage: per-layer steps of a set relative size, followed by a shrink that keeps norms stable.

    Per leaf (layer), ``p_new = (p - learning_rate * ||p|| / ||g|| * g) / sqrt(1 + learning_rate^2)``
    with both norms floored at ``min_norm``: the step moves each layer by ``learning_rate``
    times its norm, and the division undoes the growth of the norm such a step causes (the
    paper's "deep relative trust"). As in optax: ``chain(scale_by_trust_ratio(min_norm),
    scale_by_learning_rate(learning_rate * m), add_decayed_weights(m - 1))`` with
    ``m = 1 / sqrt(1 + learning_rate^2)``; a schedule gives ``m`` per step.

    Args:
      learning_rate: the step size: a number, a 0-d tensor, or a schedule called with the step
        count (see :mod:`gradtx.schedules`).
      min_norm: the floor of both norms in the trust ratio.
      spec: a :class:`gradtx.sharding.ShardingSpec` describing how plain-tensor leaves are
        sharded (DTensor leaves need none): the per-leaf norms are then those of the whole
        logical leaves, reduced over each leaf's shard axes.

    Returns:
      The optimizer, a :class:`~gradtx.GradientTransformation`.

    References:
      Bernstein, Vahdat, Yue & Liu, `On the distance between two neural networks and the
      stability of learning <https://arxiv.org/abs/2002.03432>`_, NeurIPS, 2020

    Examples:
      >>> import torch
      >>> import gradtx as gtx
      >>> def f(params):  # a quadratic, smallest at w = 0
      ...     return (params["w"] ** 2).sum()
      >>> params = {"w": torch.tensor([1.0, 2.0, 3.0])}
      >>> tx = gtx.fromage(learning_rate=0.1)
      >>> state = tx.init(params)
      >>> for _ in range(5):
      ...     grads = torch.func.grad(f)(params)
      ...     updates, state = tx.update(grads, state, params)
      ...     params = gtx.apply_updates(params, updates)
      ...     print(f"{f(params):.4f}")
      11.2277
      9.0044
      7.2214
      5.7914
      4.6446
    """
    check_learning_rate(learning_rate, "fromage")
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
