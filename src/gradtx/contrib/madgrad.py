"""MADGRAD (Defazio & Jelassi, 2021): a momentumised, adaptive, dual-averaged gradient method."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor

from gradtx import tree as tree_lib
from gradtx.base import GradientTransformation
from gradtx.chains import chain
from gradtx.numerics import ScalarOrSchedule
from gradtx.optimizers._common import check_learning_rate
from gradtx.state_signs import nonnegative
from gradtx.transforms import _foreach as fe
from gradtx.transforms.weight_decay import add_decayed_weights


@nonnegative("grad_sum_sq")
class MadgradState(NamedTuple):
    """``count``: steps so far (0-d int32); ``grad_sum_sq``: the weighted sum of squared gradients;
    ``s``: the weighted sum of gradients; ``x0``: the parameters at ``init``."""

    count: Tensor
    grad_sum_sq: Any
    s: Any
    x0: Any


def scale_by_madgrad(learning_rate: ScalarOrSchedule, momentum: float = 0.9, eps: float = 1e-6) -> GradientTransformation:
    """Returns MADGRAD's step ``x_new - x`` (the learning rate is inside: no separate scaling).

    With ``lamb = (lr + eps) * sqrt(t + 1)`` (``t = 0`` first, ``lr`` a schedule of ``t``):
    ``grad_sum_sq += lamb * g^2``, ``s += lamb * g``, ``z = x0 - s / (cbrt(grad_sum_sq) + eps)``,
    ``x_new = (1 - momentum) * z + momentum * x``, as optax computes it. Needs ``params``.
    """
    momentum, eps = float(momentum), float(eps)
    rate = learning_rate if callable(learning_rate) else fe.number_or_tensor(learning_rate)

    def init_fn(params: Any) -> MadgradState:
        tree_lib.refuse_complex(params, owner="scale_by_madgrad", why="its denominator is a cube root of g * g sums")
        return MadgradState(
            count=fe.zero_count(params),
            grad_sum_sq=fe.zeros_like_tree(params),
            s=fe.zeros_like_tree(params),
            x0=tree_lib.tree_map(lambda p: p.clone(), params),  # (not detached: meta-gradients flow through x0)
        )

    def update_fn(updates, state, params=None, *, inplace=False):
        leaves = fe.leaves_of(updates, what="scale_by_madgrad")
        param_values = fe.params_of(leaves, params, owner="scale_by_madgrad")
        sums_sq = leaves.aligned(state.grad_sum_sq, what="scale_by_madgrad: state.grad_sum_sq")
        sums = leaves.aligned(state.s, what="scale_by_madgrad: state.s")
        x0 = leaves.aligned(state.x0, what="scale_by_madgrad: state.x0")
        lr = fe.schedule_value(rate, state.count) if callable(rate) else rate
        lamb = (lr + eps) * torch.sqrt(state.count.to(torch.float64) + 1.0)

        def group(g, q, s, start, p):
            weight = fe.on(lamb, g)
            q = fe.add(q, fe.mul(fe.mul(g, g, inplace=False), weight, inplace=True), inplace=inplace)
            s = fe.add(s, fe.mul(g, weight, inplace=False), inplace=inplace)
            sigma = fe.add(tree_lib.foreach("pow", q, 1.0 / 3.0, inplace=False), eps, inplace=True)
            z = fe.add(fe.mul(fe.div_into(s, sigma), -1.0, inplace=True), fe.cast(start, g[0].dtype), inplace=True)  # x0 - s / sigma
            out = fe.mul(fe.add(z, fe.cast(p, z[0].dtype), alpha=-1.0, inplace=True), 1.0 - momentum, inplace=True)
            return fe.finish(out, g), q, s

        new_updates, new_sums_sq, new_sums = fe.map_groups(group, leaves.tensors, sums_sq, sums, x0, param_values, outputs=3)
        # the pure path hands back a state that shares no storage with the one it was given
        new_x0 = state.x0 if inplace else tree_lib.tree_map(lambda x: x.clone(), state.x0)
        new_state = MadgradState(
            count=fe.increment(state.count, inplace=inplace),
            grad_sum_sq=leaves.rebuild(new_sums_sq, like=state.grad_sum_sq),
            s=leaves.rebuild(new_sums, like=state.s),
            x0=new_x0,
        )
        return leaves.rebuild(new_updates), new_state

    return GradientTransformation(init_fn, update_fn)


def madgrad(
    learning_rate: ScalarOrSchedule, momentum: float = 0.9, weight_decay: float = 0.0, eps: float = 1e-6
) -> GradientTransformation:
    """MADGRAD: dual averaging with a cube-root adaptive scaling, and momentum by averaging iterates.

    With ``lamb_t = (learning_rate + eps) * sqrt(t + 1)`` (``t = 0`` first): the weighted sums
    ``s += lamb_t * g`` and ``q += lamb_t * g^2``, the dual-averaging point
    ``z = x_0 - s / (cbrt(q) + eps)``, and the new params
    ``(1 - momentum) * z + momentum * x``: the momentum averages the iterates rather than the
    gradients. The cube root (where AdaGrad takes a square root) is the paper's. As optax:
    ``chain(add_decayed_weights(weight_decay), scale_by_madgrad(learning_rate, momentum, eps))``,
    so the weight decay is an L2 penalty added to the gradient. ``params`` are required (the
    initial point is kept in the state). See :func:`scale_by_madgrad`.

    Args:
      learning_rate: the step size: a number, a 0-d tensor, or a schedule called with the step
        count (see :mod:`gradtx.schedules`).
      momentum: the weight of the current params in the average with ``z`` (the paper's
        ``1 - c``).
      weight_decay: the rate of an L2 penalty added to the gradient, a number.
      eps: added to the learning rate in the weights and to the cube root.

    Returns:
      The optimizer, a :class:`~gradtx.GradientTransformation`.

    References:
      Defazio & Jelassi, `Adaptivity without Compromise: A Momentumized, Adaptive, Dual Averaged
      Gradient Method for Stochastic Optimization <https://arxiv.org/abs/2101.11075>`_, 2021

    Examples:
      >>> import torch
      >>> import gradtx as gtx
      >>> def f(params):  # a quadratic, smallest at w = 0
      ...     return (params["w"] ** 2).sum()
      >>> params = {"w": torch.tensor([1.0, 2.0, 3.0])}
      >>> tx = gtx.contrib.madgrad(learning_rate=0.1)
      >>> state = tx.init(params)
      >>> for _ in range(5):
      ...     grads = torch.func.grad(f)(params)
      ...     updates, state = tx.update(grads, state, params)
      ...     params = gtx.apply_updates(params, updates)
      ...     print(f"{f(params):.4f}")
      13.5775
      12.8774
      11.9620
      10.8891
      9.7134
    """
    check_learning_rate(learning_rate, "madgrad")
    return chain(add_decayed_weights(weight_decay), scale_by_madgrad(learning_rate, momentum, eps))
