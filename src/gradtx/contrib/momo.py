"""MoMo: momentum models for adaptive learning rates (optax.contrib's ``momo`` and ``momo_adam``).

SGD with momentum (or Adam) with a Polyak-type step ``min(learning_rate, <model gap> / ||d||^2)``,
built from a lower bound of the loss. The update needs the loss at the current params: these are
:class:`~gradtx.GradientTransformationExtraArgs` taking ``value=`` (see docs/extra_args.md).
The inner products and norms are sums over the whole tree: under ``spec=`` (or DTensor leaves)
they are those of the logical tree (:func:`gradtx.sharding.global_sums`, one collective a step).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import torch
from torch import Tensor

from gradtx import sharding
from gradtx import tree as tree_lib
from gradtx.base import GradientTransformationExtraArgs, takes_spec
from gradtx.contrib import _scalars as sc
from gradtx.numerics import ScalarOrSchedule
from gradtx.optimizers._common import check_learning_rate
from gradtx.state_signs import nonnegative
from gradtx.transforms import _foreach as fe


def _check_value(value: Any, owner: str) -> None:
    if value is None:
        raise ValueError(f"{owner}: pass the latest loss value to update as value= (the objective at params)")


class MomoState(NamedTuple):
    """``exp_avg``: the gradients' moving average; ``barf``: the losses'; ``gamma``: that of
    ``<g, x>``; ``lb``: the (estimated) lower bound of the loss; ``count``: steps (0-d int32)."""

    exp_avg: Any
    barf: Tensor
    gamma: Tensor
    lb: Tensor
    count: Tensor


@takes_spec
def momo(
    learning_rate: ScalarOrSchedule = 1.0,
    beta: float = 0.9,
    lower_bound: float = 0.0,
    weight_decay: float = 0.0,
    adapt_lower_bound: bool = False,
    *,
    spec: Optional[sharding.ShardingSpec] = None,
) -> GradientTransformationExtraArgs:
    """MoMo: SGD with momentum whose step is capped by a Polyak-type model of the loss.

    ``d``, ``f_bar`` and ``gamma`` are moving averages (with ``beta``) of the gradients, of the
    losses and of ``<g, x>``: together a model of the loss, whose step to the lower bound ``lb``
    is ``tau = min(learning_rate, max(f_bar - lb - gamma + <d, x>, 0) / ||d||^2)`` (with the
    weight decay folded in); the update is ``-tau * d``. The learning rate is only a cap, so
    MoMo needs little tuning. ``update`` takes the loss at ``params`` as ``value=``; ``params``
    are required.

    Args:
      learning_rate: the largest step: a number, a 0-d tensor, or a schedule called with the
        step count.
      beta: the decay of the three moving averages.
      lower_bound: a lower bound of the loss (0 suits most losses, which are non-negative).
      weight_decay: the rate of the weight decay, folded into the step as in the paper: the
        params are also divided by ``1 + learning_rate * weight_decay`` at every step. A number.
      adapt_lower_bound: estimate the lower bound on the fly, starting from ``lower_bound``
        (for losses whose minimum is far above it).
      spec: a :class:`gradtx.sharding.ShardingSpec` describing how plain-tensor leaves are
        sharded (DTensor leaves need none): the inner products and norms over the tree are then
        those of the logical tree, exact under any sharding.

    Returns:
      The optimizer, a :class:`~gradtx.GradientTransformationExtraArgs`.

    References:
      Schaipp, Ohana, Eickenberg, Defazio & Gower, `MoMo: Momentum Models for Adaptive Learning
      Rates <https://arxiv.org/abs/2305.07583>`_, ICML, 2024

    Examples:
      >>> import torch
      >>> import gradtx as gtx
      >>> def f(params):  # a quadratic, smallest at w = 0 where it is 0
      ...     return (params["w"] ** 2).sum()
      >>> params = {"w": torch.tensor([1.0, 2.0, 3.0])}
      >>> tx = gtx.contrib.momo()
      >>> state = tx.init(params)
      >>> for _ in range(5):
      ...     value, grads = f(params), torch.func.grad(f)(params)
      ...     updates, state = tx.update(grads, state, params, value=value)
      ...     params = gtx.apply_updates(params, updates)
      ...     print(f"{f(params):.4f}")
      3.5000
      3.3182
      3.1419
      2.9713
      2.8069
    """
    check_learning_rate(learning_rate, "momo")
    owner = "momo"
    beta, weight_decay = fe.number_or_tensor(beta), fe.number_or_tensor(weight_decay)

    def init_fn(params: Any) -> MomoState:
        tree_lib.refuse_complex(params, owner=owner, why="its step size is fitted to real inner products")
        dtype, device = sc.lowest_dtype(params), tree_lib.first_device(params)
        return MomoState(
            exp_avg=fe.zeros_like_tree(params),
            barf=torch.zeros((), dtype=dtype, device=device),
            gamma=torch.zeros((), dtype=dtype, device=device),
            lb=sc.scalar(lower_bound, dtype, device),
            count=fe.zero_count(params),
        )

    def update_fn(updates, state, params=None, *, inplace=False, value=None, **extra_args):
        del extra_args
        _check_value(value, owner)
        leaves = fe.leaves_of(updates, what=owner)
        p = fe.params_of(leaves, params, owner=owner)
        ea = leaves.aligned(state.exp_avg, what=f"{owner}: state.exp_avg")
        g = leaves.tensors
        dtype, device = state.barf.dtype, state.barf.device
        value = sc.scalar(value, dtype, device)
        donate = inplace and not tree_lib.needs_graph(g, p, ea, state.barf, state.gamma, state.lb, value)
        bt = torch.where(state.count == 0, sc.scalar(0.0, dtype, device), sc.scalar(beta, dtype, device))
        barf = bt * state.barf + (1 - bt) * value
        (new_ea,) = fe.map_groups(lambda g, ea: (fe.lerp(ea, fe.cast(g, ea[0].dtype), 1 - bt, inplace=donate),), g, ea, outputs=1)
        sums = sc.sums(
            lambda gi, pi, eai: [sc.vdot(gi, pi), sc.vdot(eai, eai), sc.vdot(eai, pi)],
            leaves.rebuild(g), leaves.rebuild(p), leaves.rebuild(new_ea), spec=spec, dtype=dtype, what=owner,
        )
        gamma = bt * state.gamma + (1 - bt) * sums[0]
        norm_sq, iprod = sums[1], sums[2]
        alpha = sc.hyper(learning_rate, state.count, dtype)
        lower = sc.scalar(lower_bound, dtype, device)
        one = 1 + alpha * weight_decay
        if adapt_lower_bound:
            cap = one * (barf - gamma) + iprod
            this_lb = torch.where(cap < one * state.lb, torch.maximum(cap / (2 * one), lower), state.lb)
        else:
            this_lb = state.lb
        tiny = norm_sq <= sc.DOUBLE_EPS
        t1 = torch.clamp_min(one * (barf - this_lb - gamma) + iprod, 0.0) / torch.where(tiny, torch.ones_like(norm_sq), norm_sq)
        t1 = torch.where(tiny, torch.zeros_like(t1), t1)
        tau = torch.minimum(alpha, t1)
        shrink = alpha * weight_decay / one

        def step(g, p, ea):
            # -tau * ea - shrink * p, in the donated gradients' buffers
            out = fe.fresh(fe.cast(ea, g[0].dtype), into=g if donate else None)
            out = fe.mul(out, fe.on(-tau, out), inplace=True)
            return (fe.add(out, fe.cast(p, out[0].dtype), alpha=-shrink, inplace=True),)

        (out,) = fe.map_groups(step, g, p, new_ea, outputs=1)
        if adapt_lower_bound:
            lb = torch.maximum((barf + iprod - gamma) - 0.5 * tau * norm_sq, lower)
        else:
            lb = state.lb if donate else state.lb.clone()
        count = fe.increment(state.count, inplace=donate)
        new_state = MomoState(
            exp_avg=leaves.rebuild(new_ea, like=state.exp_avg),
            barf=sc.keep([state.barf], [barf], donate)[0],
            gamma=sc.keep([state.gamma], [gamma], donate)[0],
            lb=sc.keep([state.lb], [lb], donate and adapt_lower_bound)[0],
            count=count,
        )
        return leaves.rebuild(out), new_state

    return GradientTransformationExtraArgs(init_fn, update_fn)


@nonnegative("exp_avg_sq")
class MomoAdamState(NamedTuple):
    """As :class:`MomoState`, plus ``exp_avg_sq``: the squared gradients' moving average (Adam's)."""

    exp_avg: Any
    exp_avg_sq: Any
    barf: Tensor
    gamma: Tensor
    lb: Tensor
    count: Tensor


@takes_spec
def momo_adam(
    learning_rate: ScalarOrSchedule = 1e-2,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    lower_bound: float = 0.0,
    weight_decay: float = 0.0,
    adapt_lower_bound: bool = False,
    *,
    spec: Optional[sharding.ShardingSpec] = None,
) -> GradientTransformationExtraArgs:
    """MoMo-Adam: Adam whose step is capped by MoMo's Polyak-type model of the loss.

    :func:`momo` in the geometry of Adam's preconditioner ``D = eps + sqrt(v / (1 - b2^t))``:
    ``d`` is the moving average of the gradients (with ``b1``), the step is
    ``tau = min(learning_rate / (1 - b1^t), max(gap, 0) / <d, D^-1 d>)`` with ``gap`` the model's
    gap to the lower bound, and the update ``-tau * D^-1 d`` (with the weight decay folded in).
    ``update`` takes the loss at ``params`` as ``value=``; ``params`` are required.

    Args:
      learning_rate: the largest step (before Adam's bias correction): a number, a 0-d tensor,
        or a schedule called with the step count.
      b1: the decay of the moving averages of the gradients, losses and ``<g, x>``.
      b2: the decay of the second moment in the preconditioner.
      eps: added to the root of the second moment in the preconditioner.
      lower_bound: a lower bound of the loss (0 suits most losses, which are non-negative).
      weight_decay: the rate of the weight decay, folded into the step as in the paper: the
        params are also divided by ``1 + learning_rate * weight_decay`` at every step. A number.
      adapt_lower_bound: estimate the lower bound on the fly, starting from ``lower_bound``
        (for losses whose minimum is far above it).
      spec: a :class:`gradtx.sharding.ShardingSpec` describing how plain-tensor leaves are
        sharded (DTensor leaves need none): the inner products and norms over the tree are then
        those of the logical tree, exact under any sharding.

    Returns:
      The optimizer, a :class:`~gradtx.GradientTransformationExtraArgs`.

    References:
      Schaipp, Ohana, Eickenberg, Defazio & Gower, `MoMo: Momentum Models for Adaptive Learning
      Rates <https://arxiv.org/abs/2305.07583>`_, ICML, 2024

    Examples:
      >>> import torch
      >>> import gradtx as gtx
      >>> def f(params):  # a quadratic, smallest at w = 0 where it is 0
      ...     return (params["w"] ** 2).sum()
      >>> params = {"w": torch.tensor([1.0, 2.0, 3.0])}
      >>> tx = gtx.contrib.momo_adam(learning_rate=0.1)
      >>> state = tx.init(params)
      >>> for _ in range(5):
      ...     value, grads = f(params), torch.func.grad(f)(params)
      ...     updates, state = tx.update(grads, state, params, value=value)
      ...     params = gtx.apply_updates(params, updates)
      ...     print(f"{f(params):.4f}")
      12.8300
      11.7218
      10.6764
      9.6943
      8.7758
    """
    check_learning_rate(learning_rate, "momo_adam")
    owner = "momo_adam"
    b1, b2, eps = fe.number_or_tensor(b1), fe.number_or_tensor(b2), float(eps)
    weight_decay = fe.number_or_tensor(weight_decay)

    def init_fn(params: Any) -> MomoAdamState:
        tree_lib.refuse_complex(params, owner=owner, why="its step size is fitted to real inner products")
        dtype, device = sc.lowest_dtype(params), tree_lib.first_device(params)
        return MomoAdamState(
            exp_avg=fe.zeros_like_tree(params),
            exp_avg_sq=fe.zeros_like_tree(params),
            barf=torch.zeros((), dtype=dtype, device=device),
            gamma=torch.zeros((), dtype=dtype, device=device),
            lb=sc.scalar(lower_bound, dtype, device),
            count=fe.zero_count(params),
        )

    def update_fn(updates, state, params=None, *, inplace=False, value=None, **extra_args):
        del extra_args
        _check_value(value, owner)
        leaves = fe.leaves_of(updates, what=owner)
        p = fe.params_of(leaves, params, owner=owner)
        ea = leaves.aligned(state.exp_avg, what=f"{owner}: state.exp_avg")
        eas = leaves.aligned(state.exp_avg_sq, what=f"{owner}: state.exp_avg_sq")
        g = leaves.tensors
        dtype, device = state.barf.dtype, state.barf.device
        value = sc.scalar(value, dtype, device)
        donate = inplace and not tree_lib.needs_graph(g, p, ea, eas, state.barf, state.gamma, state.lb, value)
        alpha = sc.hyper(learning_rate, state.count, dtype)
        count = fe.increment(state.count, inplace=donate)
        t = count.to(torch.float64)
        bc1 = (1.0 - torch.pow(b1, t)).to(dtype)
        bc2 = (1.0 - torch.pow(b2, t)).to(dtype)
        barf = b1 * state.barf + (1 - b1) * value

        def moments(g, ea, eas):
            g = fe.cast(g, ea[0].dtype)
            ea = fe.lerp(ea, g, 1 - b1, inplace=donate)
            eas = fe.addcmul(fe.mul(eas, fe.on(b2, eas), inplace=donate), g, g, 1 - b2, inplace=True)
            precond = fe.add(fe.sqrt(fe.div(eas, fe.on(bc2, eas), inplace=False), inplace=True), eps, inplace=True)
            return ea, eas, precond

        new_ea, new_eas, precond = fe.map_groups(moments, g, ea, eas, outputs=3)
        sums = sc.sums(
            lambda gi, pi, eai, di: [sc.vdot(eai, eai / di), sc.vdot(gi, pi), sc.vdot(eai, pi)],
            leaves.rebuild(g), leaves.rebuild(p), leaves.rebuild(new_ea), leaves.rebuild(precond),
            spec=spec, dtype=dtype, what=owner,
        )
        norm_sq, iprod = sums[0], sums[2]
        gamma = b1 * state.gamma + (1 - b1) * sums[1]
        lower = sc.scalar(lower_bound, dtype, device)
        one = 1 + alpha * weight_decay
        if adapt_lower_bound:
            cap = one * (barf - gamma) + iprod
            this_lb = torch.where(cap < one * bc1 * state.lb, torch.maximum(cap / (2 * bc1 * one), lower), state.lb)
        else:
            this_lb = state.lb
        tiny = norm_sq <= sc.DOUBLE_EPS
        t1 = torch.clamp_min(one * (barf - bc1 * this_lb - gamma) + iprod, 0.0) / torch.where(tiny, torch.ones_like(norm_sq), norm_sq)
        t1 = torch.where(tiny, torch.zeros_like(t1), t1)
        tau = torch.minimum(alpha / bc1, t1)
        shrink = alpha * weight_decay / one

        def step(g, p, ea, precond):
            # -tau * ea / precond - shrink * p, in the preconditioner's (our own) buffers
            out = fe.mul(fe.div_into(ea, precond), fe.on(-tau, precond), inplace=True)
            out = fe.add(out, fe.cast(p, out[0].dtype), alpha=-shrink, inplace=True)
            return (fe.finish(out, g),)

        (out,) = fe.map_groups(step, g, p, new_ea, precond, outputs=1)
        if adapt_lower_bound:
            lb = torch.maximum(((barf + iprod - gamma) - 0.5 * tau * norm_sq) / bc1, lower)
        else:
            lb = state.lb if donate else state.lb.clone()
        new_state = MomoAdamState(
            exp_avg=leaves.rebuild(new_ea, like=state.exp_avg),
            exp_avg_sq=leaves.rebuild(new_eas, like=state.exp_avg_sq),
            barf=sc.keep([state.barf], [barf], donate)[0],
            gamma=sc.keep([state.gamma], [gamma], donate)[0],
            lb=sc.keep([state.lb], [lb], donate and adapt_lower_bound)[0],
            count=count,
        )
        return leaves.rebuild(out), new_state

    return GradientTransformationExtraArgs(init_fn, update_fn)


__all__ = ["MomoAdamState", "MomoState", "momo", "momo_adam"]
