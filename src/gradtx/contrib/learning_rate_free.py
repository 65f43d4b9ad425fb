"""Learning-rate-free optimizers from optax.contrib: Prodigy, D-Adaptation AdamW, DoG, DoWG,
COCOB and Mechanic, with optax's names, arguments, defaults and states.

Each estimates its own step size from quantities of the whole gradient tree (distances travelled,
gradient norms, inner products between gradients and displacements). Those are global sums, so
under a ``spec=`` (or with DTensor leaves) they are reduced exactly with
:func:`gradtx.sharding.global_norm` / :func:`gradtx.sharding.global_sums`: every logical element
counted once, the same scalars on every rank, whatever the layout. Scalar states are kept, as in
optax, in the parameters' lowest-precision floating dtype.

The arithmetic is the same on both paths: the pure update returns new tensors (and copies of the
initial point it keeps), ``inplace=True`` writes the same numbers into the donated state buffers.
Prodigy, D-Adaptation, DoG and DoWG run on foreach kernels per (device, dtype) group, updating
donated moments in place and writing the step into the donated gradients' buffers.
"""

from __future__ import annotations

from typing import Any, Literal, NamedTuple, Optional

import torch
from torch import Tensor

from gradtx import sharding
from gradtx import tree as tree_lib
from gradtx.base import GradientTransformation, GradientTransformationExtraArgs, identity, with_extra_args_support, takes_spec
from gradtx.chains import chain
from gradtx.contrib import _scalars as sc
from gradtx.numerics import ScalarOrSchedule
from gradtx.optimizers._common import check_learning_rate
from gradtx.state_signs import nonnegative
from gradtx.transforms import _foreach as fe
from gradtx.transforms import add_decayed_weights, scale_by_learning_rate


# --------------------------------------------------------------------------- Prodigy


@nonnegative("exp_avg_sq")
class ProdigyState(NamedTuple):
    """``exp_avg``/``exp_avg_sq``: Adam's moments of ``estim_lr * g``; ``grad_sum``: the weighted sum
    of gradients estimating ``D``; ``params0``: the initial point; ``estim_lr``: the current ``D``
    estimate; ``numerator_weighted``: its numerator; ``count``: steps (0-d int32)."""

    exp_avg: Any
    exp_avg_sq: Any
    grad_sum: Any
    params0: Any
    estim_lr: Tensor
    numerator_weighted: Tensor
    count: Tensor


@takes_spec
def prodigy(
    learning_rate: ScalarOrSchedule = 1.0,
    betas: tuple[float, float] = (0.9, 0.999),
    beta3: Optional[float] = None,
    eps: float = 1e-8,
    estim_lr0: float = 1e-6,
    estim_lr_coef: float = 1.0,
    weight_decay: float = 0.0,
    safeguard_warmup: bool = False,
    *,
    spec: Optional[sharding.ShardingSpec] = None,
) -> GradientTransformationExtraArgs:
    """Prodigy: AdamW whose learning rate is an estimate of the distance to the solution.

    A D-Adaptation AdamW (see :func:`dadapt_adamw`) whose estimate ``D`` grows faster, by weighting
    recent gradients more: ``D = max(D, estim_lr_coef * sum_k w_k <g_k, x_0 - x_k> /
    ||sum_k w_k g_k||_1)`` with weights ``w_k`` decaying by ``beta3``; the step is AdamW's with the
    learning rate ``D * learning_rate`` (bias corrections included), plus
    ``-D * learning_rate * weight_decay * param``. ``D`` starts at ``estim_lr0`` and never
    decreases. ``params`` are required (for ``x_0 - x_k`` and the decay).

    Args:
      learning_rate: multiplies the step the method finds (a schedule's peak should be 1): a
        number, a 0-d tensor, or a schedule called with the step count.
      betas: ``(b1, b2)``, the decay rates of Adam's two moments.
      beta3: the decay of the sums in the estimate (``None``: ``sqrt(b2)``).
      eps: added to the square root of the second moment (times ``D``).
      estim_lr0: the initial estimate ``D``.
      estim_lr_coef: multiplies the estimate (the reference implementation's ``d_coef``).
      weight_decay: the rate of the decoupled weight decay, a number.
      safeguard_warmup: leave the learning rate (a warmup schedule) out of the estimate's
        denominator, which keeps ``D`` from being overestimated during warmup.
      spec: a :class:`gradtx.sharding.ShardingSpec` describing how plain-tensor leaves are
        sharded (DTensor leaves need none): the inner products and norms over the tree are then
        those of the logical tree, exact under any sharding.

    Returns:
      The optimizer, a :class:`~gradtx.GradientTransformationExtraArgs`.

    References:
      Mishchenko & Defazio, `Prodigy: An Expeditiously Adaptive Parameter-Free Learner
      <https://arxiv.org/abs/2306.06101>`_, ICML, 2024

    Examples:
      >>> import torch
      >>> import gradtx as gtx
      >>> def f(params):  # a quadratic, smallest at w = 0
      ...     return (params["w"] ** 2).sum()
      >>> params = {"w": torch.tensor([1.0, 2.0, 3.0])}
      >>> tx = gtx.contrib.prodigy()
      >>> state = tx.init(params)
      >>> for step in range(1, 51):  # slow while the estimate grows from its small start
      ...     grads = torch.func.grad(f)(params)
      ...     updates, state = tx.update(grads, state, params)
      ...     params = gtx.apply_updates(params, updates)
      ...     if step % 10 == 0:
      ...         print(f"{f(params):.4f}  D = {state.estim_lr:.3g}")
      13.9996  D = 1.65e-05
      13.9805  D = 0.000856
      12.7244  D = 0.0562
      3.6840  D = 0.833
      1.1181  D = 0.833
    """
    check_learning_rate(learning_rate, "prodigy")
    owner = "prodigy"
    beta1, beta2 = (fe.number_or_tensor(b) for b in betas)
    beta3 = beta2**0.5 if beta3 is None else fe.number_or_tensor(beta3)
    eps, estim_lr0, estim_lr_coef = float(eps), float(estim_lr0), float(estim_lr_coef)
    weight_decay = fe.number_or_tensor(weight_decay)

    def init_fn(params: Any) -> ProdigyState:
        tree_lib.refuse_complex(params, owner=owner, why="its moments and distance estimate are defined for real numbers")
        dtype, device = sc.lowest_dtype(params), tree_lib.first_device(params)
        return ProdigyState(
            exp_avg=fe.zeros_like_tree(params),
            exp_avg_sq=fe.zeros_like_tree(params),
            grad_sum=fe.zeros_like_tree(params),
            params0=sc.copy_params(params),
            estim_lr=torch.full((), estim_lr0, dtype=dtype, device=device),
            numerator_weighted=torch.zeros((), dtype=dtype, device=device),
            count=fe.zero_count(params),
        )

    def update_fn(updates, state, params=None, *, inplace=False, **extra_args):
        del extra_args
        leaves = fe.leaves_of(updates, what=owner)
        p = fe.params_of(leaves, params, owner=owner)
        ea = leaves.aligned(state.exp_avg, what=f"{owner}: state.exp_avg")
        eas = leaves.aligned(state.exp_avg_sq, what=f"{owner}: state.exp_avg_sq")
        gs = leaves.aligned(state.grad_sum, what=f"{owner}: state.grad_sum")
        p0 = leaves.aligned(state.params0, what=f"{owner}: state.params0")
        g = leaves.tensors
        estim_lr, dtype = state.estim_lr, state.estim_lr.dtype
        donate = inplace and not tree_lib.needs_graph(g, p, ea, eas, gs, p0, estim_lr, state.numerator_weighted)
        sched = sc.hyper(learning_rate, state.count, dtype)
        count = fe.increment(state.count, inplace=donate)
        t = count.to(torch.float64)
        bc = (torch.sqrt(1.0 - torch.pow(beta2, t)) / (1.0 - torch.pow(beta1, t))).to(dtype)
        dlr = estim_lr * sched * bc
        weight = estim_lr if safeguard_warmup else dlr

        def moments(g, ea, eas, gs):
            dg = fe.mul(fe.cast(g, ea[0].dtype), fe.on(estim_lr, ea), inplace=False)
            ea = fe.lerp(ea, dg, 1.0 - beta1, inplace=donate)
            eas = fe.addcmul(fe.mul(eas, fe.on(beta2, eas), inplace=donate), dg, dg, 1.0 - beta2, inplace=True)
            gs = fe.add(fe.mul(gs, fe.on(beta3, gs), inplace=donate), dg, alpha=weight / estim_lr0, inplace=True)
            return ea, eas, gs

        new_ea, new_eas, new_gs = fe.map_groups(moments, g, ea, eas, gs, outputs=3)
        sums = sc.sums(
            lambda gi, pi, p0i, gsi: [sc.vdot(gi, p0i - pi), gsi.abs().sum()],
            leaves.rebuild(g), leaves.rebuild(p), leaves.rebuild(p0), leaves.rebuild(new_gs),
            spec=spec, dtype=dtype, what=owner,
        )
        numerator = beta3 * state.numerator_weighted + (estim_lr / estim_lr0) * dlr * sums[0]
        new_estim_lr = torch.maximum(estim_lr, estim_lr_coef * numerator / sums[1])

        def direction(g, p, ea, eas):
            # -dlr * ea / (sqrt(eas) + D * eps) - weight_decay * dlr * p, in the donated gradients' buffers
            into = g if donate and g[0].dtype == eas[0].dtype else None
            d = fe.add(fe.sqrt_of(eas, into=into), fe.on(new_estim_lr * eps, eas), inplace=True)
            out = fe.mul(fe.div_into(ea, d), fe.on(-dlr, d), inplace=True)
            if not (isinstance(weight_decay, float) and weight_decay == 0.0):
                out = fe.add(out, fe.cast(p, out[0].dtype), alpha=-weight_decay * dlr, inplace=True)
            return (fe.finish(out, g),)

        (out,) = fe.map_groups(direction, g, p, new_ea, new_eas, outputs=1)
        new_state = ProdigyState(
            exp_avg=leaves.rebuild(new_ea, like=state.exp_avg),
            exp_avg_sq=leaves.rebuild(new_eas, like=state.exp_avg_sq),
            grad_sum=leaves.rebuild(new_gs, like=state.grad_sum),
            params0=state.params0 if donate else tree_lib.tree_map(torch.clone, state.params0),
            estim_lr=sc.keep([estim_lr], [new_estim_lr], donate)[0],
            numerator_weighted=sc.keep([state.numerator_weighted], [numerator], donate)[0],
            count=count,
        )
        return leaves.rebuild(out), new_state

    return GradientTransformationExtraArgs(init_fn, update_fn)


# --------------------------------------------------------------------------- D-Adaptation AdamW


@nonnegative("exp_avg_sq")
class DAdaptAdamWState(NamedTuple):
    """``exp_avg``: the first moment of ``D * lr * g``; ``exp_avg_sq``: the second moment of ``g``;
    ``grad_sum``: the weighted sum of steps; ``estim_lr``: the current ``D``; ``numerator_weighted``:
    the estimate's numerator; ``count``: steps (0-d int32)."""

    exp_avg: Any
    exp_avg_sq: Any
    grad_sum: Any
    estim_lr: Tensor
    numerator_weighted: Tensor
    count: Tensor


@takes_spec
def dadapt_adamw(
    learning_rate: ScalarOrSchedule = 1.0,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    estim_lr0: float = 1e-6,
    weight_decay: float = 0.0,
    *,
    spec: Optional[sharding.ShardingSpec] = None,
) -> GradientTransformationExtraArgs:
    """D-Adaptation AdamW: AdamW whose learning rate is an estimate of the distance to the solution.

    The base learning rate ``D`` is a lower bound on the distance from the initial point to a
    solution, grown from what the gradients show: ``D = max(D, sum_k <g_k, s_k / (sqrt(v_k) +
    eps)> / ||s||_1)``, with ``s`` a weighted sum of past steps and ``v`` Adam's second moment.
    The step is AdamW's with the learning rate ``D * learning_rate`` (bias corrections
    included), plus ``-D * learning_rate * weight_decay * param``; ``D`` starts at ``estim_lr0``
    and never decreases. ``params`` are required (for the decay).

    Args:
      learning_rate: multiplies the step the method finds (a schedule's peak should be 1): a
        number, a 0-d tensor, or a schedule called with the step count.
      betas: ``(b1, b2)``, the decay rates of Adam's two moments.
      eps: added to the square root of the second moment.
      estim_lr0: the initial estimate ``D``.
      weight_decay: the rate of the decoupled weight decay, a number.
      spec: a :class:`gradtx.sharding.ShardingSpec` describing how plain-tensor leaves are
        sharded (DTensor leaves need none): the inner products and norms over the tree are then
        those of the logical tree, exact under any sharding.

    Returns:
      The optimizer, a :class:`~gradtx.GradientTransformationExtraArgs`.

    References:
      Defazio & Mishchenko, `Learning-Rate-Free Learning by D-Adaptation
      <https://arxiv.org/abs/2301.07733>`_, ICML, 2023

    Examples:
      >>> import torch
      >>> import gradtx as gtx
      >>> def f(params):  # a quadratic, smallest at w = 0
      ...     return (params["w"] ** 2).sum()
      >>> params = {"w": torch.tensor([1.0, 2.0, 3.0])}
      >>> tx = gtx.contrib.dadapt_adamw()
      >>> state = tx.init(params)
      >>> for step in range(1, 51):  # slow while the estimate grows from its small start
      ...     grads = torch.func.grad(f)(params)
      ...     updates, state = tx.update(grads, state, params)
      ...     params = gtx.apply_updates(params, updates)
      ...     if step % 10 == 0:
      ...         print(f"{f(params):.4f}  D = {state.estim_lr:.3g}")
      13.9971  D = 0.000426
      13.8221  D = 0.0237
      8.5912  D = 0.767
      1.4614  D = 2.9
      0.4580  D = 2.9
    """
    check_learning_rate(learning_rate, "dadapt_adamw")
    owner = "dadapt_adamw"
    beta1, beta2 = (fe.number_or_tensor(b) for b in betas)
    sb2 = beta2**0.5
    eps, estim_lr0 = float(eps), float(estim_lr0)
    weight_decay = fe.number_or_tensor(weight_decay)

    def init_fn(params: Any) -> DAdaptAdamWState:
        tree_lib.refuse_complex(params, owner=owner, why="its moments and distance estimate are defined for real numbers")
        dtype, device = sc.lowest_dtype(params), tree_lib.first_device(params)
        return DAdaptAdamWState(
            exp_avg=fe.zeros_like_tree(params),
            exp_avg_sq=fe.zeros_like_tree(params),
            grad_sum=fe.zeros_like_tree(params),
            estim_lr=torch.full((), estim_lr0, dtype=dtype, device=device),
            numerator_weighted=torch.zeros((), dtype=dtype, device=device),
            count=fe.zero_count(params),
        )

    def update_fn(updates, state, params=None, *, inplace=False, **extra_args):
        del extra_args
        leaves = fe.leaves_of(updates, what=owner)
        p = fe.params_of(leaves, params, owner=owner)
        ea = leaves.aligned(state.exp_avg, what=f"{owner}: state.exp_avg")
        eas = leaves.aligned(state.exp_avg_sq, what=f"{owner}: state.exp_avg_sq")
        gs = leaves.aligned(state.grad_sum, what=f"{owner}: state.grad_sum")
        g = leaves.tensors
        estim_lr, dtype = state.estim_lr, state.estim_lr.dtype
        donate = inplace and not tree_lib.needs_graph(g, p, ea, eas, gs, estim_lr, state.numerator_weighted)
        sched = sc.hyper(learning_rate, state.count, dtype)
        count = fe.increment(state.count, inplace=donate)
        t = count.to(torch.float64)
        bc = (torch.sqrt(1.0 - torch.pow(beta2, t)) / (1.0 - torch.pow(beta1, t))).to(dtype)
        dlr = estim_lr * sched * bc

        def partials(gi, gsi, easi):
            # <g, s / (sqrt(v) + eps)> on the old state, and ||s_new||_1 with s_new as the step below makes it
            new_gsi = sb2 * gsi + (1.0 - sb2) * sc.on(dlr, gi) * gi
            return [sc.vdot(gi, gsi / (torch.sqrt(easi) + eps)), new_gsi.abs().sum()]

        # the sums first: the moments below overwrite the donated state
        sums = sc.sums(partials, leaves.rebuild(g), leaves.rebuild(gs), leaves.rebuild(eas), spec=spec, dtype=dtype, what=owner)
        numerator = sb2 * state.numerator_weighted + (1.0 - sb2) * dlr * sums[0]
        new_estim_lr = torch.maximum(estim_lr, numerator / ((1.0 - sb2) * sums[1]))

        def moments(g, ea, eas, gs):
            g = fe.cast(g, ea[0].dtype)
            step = fe.mul(g, fe.on(dlr, g), inplace=False)
            ea = fe.lerp(ea, step, 1.0 - beta1, inplace=donate)
            eas = fe.addcmul(fe.mul(eas, fe.on(beta2, eas), inplace=donate), g, g, 1.0 - beta2, inplace=True)
            gs = fe.lerp(gs, step, 1.0 - sb2, inplace=donate)
            return ea, eas, gs

        def direction(g, p, ea, eas):
            # -ea / (sqrt(eas) + eps) - weight_decay * dlr * p, in the donated gradients' buffers
            into = g if donate and g[0].dtype == eas[0].dtype else None
            d = fe.add(fe.sqrt_of(eas, into=into), eps, inplace=True)
            out = fe.mul(fe.div_into(ea, d), -1.0, inplace=True)
            if not (isinstance(weight_decay, float) and weight_decay == 0.0):
                out = fe.add(out, fe.cast(p, out[0].dtype), alpha=-weight_decay * dlr, inplace=True)
            return (fe.finish(out, g),)

        new_ea, new_eas, new_gs = fe.map_groups(moments, g, ea, eas, gs, outputs=3)
        (out,) = fe.map_groups(direction, g, p, new_ea, new_eas, outputs=1)
        new_state = DAdaptAdamWState(
            exp_avg=leaves.rebuild(new_ea, like=state.exp_avg),
            exp_avg_sq=leaves.rebuild(new_eas, like=state.exp_avg_sq),
            grad_sum=leaves.rebuild(new_gs, like=state.grad_sum),
            estim_lr=sc.keep([estim_lr], [new_estim_lr], donate)[0],
            numerator_weighted=sc.keep([state.numerator_weighted], [numerator], donate)[0],
            count=count,
        )
        return leaves.rebuild(out), new_state

    return GradientTransformationExtraArgs(init_fn, update_fn)


# --------------------------------------------------------------------------- DoG


class DoGState(NamedTuple):
    """``is_init_step``: whether no step was taken yet (0-d bool); ``init_params``: the initial point;
    ``max_dist``: the largest distance from it so far; ``sum_sq_norm_grads``: the sum of squared
    gradient norms."""

    is_init_step: Tensor
    init_params: Any
    max_dist: Tensor
    sum_sq_norm_grads: Tensor


InitStep = tuple[Literal["distance", "learning_rate", "heuristic"], float]


@takes_spec
def scale_by_dog(
    init_step: InitStep, eps: float = 1e-8, *, spec: Optional[sharding.ShardingSpec] = None
) -> GradientTransformation:
    """Scales the updates by DoG's step ``max_k ||x_k - x_0|| / sqrt(sum_k ||g_k||^2 + eps)``.

    See :func:`dog`. ``init_step`` is ``("distance", r0)`` (the initial distance), ``("heuristic",
    alpha)`` (``r0 = alpha * (1 + ||x_0||)``; ``init`` must get the real parameters) or
    ``("learning_rate", eta0)`` (the first step's rate). Under ``spec`` the norms are those of the
    logical tree.
    """
    owner = "scale_by_dog"
    init_step_type, init_step_value = init_step
    if init_step_type not in ("distance", "learning_rate", "heuristic"):
        raise ValueError(f"Invalid init_step specification for scale_by_dog: {init_step_type=}")
    eps = float(eps)

    def init_fn(params: Any) -> DoGState:
        dtype, device = sc.lowest_dtype(params), tree_lib.first_device(params)
        if init_step_type == "distance":
            r_epsilon = sc.scalar(init_step_value, dtype, device)
        elif init_step_type == "heuristic":
            r_epsilon = (init_step_value * (1.0 + sharding.global_norm(params, spec))).to(dtype)
        else:
            r_epsilon = torch.zeros((), dtype=dtype, device=device)
        return DoGState(
            is_init_step=torch.ones((), dtype=torch.bool, device=device),
            init_params=sc.copy_params(params),
            max_dist=r_epsilon,
            sum_sq_norm_grads=torch.zeros((), dtype=dtype, device=device),
        )

    def update_fn(updates, state, params=None, *, inplace=False):
        leaves = fe.leaves_of(updates, what=owner)
        p = fe.params_of(leaves, params, owner=owner)
        p0 = leaves.aligned(state.init_params, what=f"{owner}: state.init_params")
        g = leaves.tensors
        dtype = state.max_dist.dtype
        donate = inplace and not tree_lib.needs_graph(g, p, p0, state.max_dist, state.sum_sq_norm_grads)
        distance = sharding.global_norm(leaves.rebuild([a - b for a, b in zip(p0, p)]), spec).to(dtype)
        max_dist = torch.maximum(state.max_dist, distance)
        sum_sq = state.sum_sq_norm_grads + (sharding.global_norm(updates, spec) ** 2).to(dtype)
        learning_rate = max_dist / torch.sqrt(sum_sq + eps)
        if init_step_type == "learning_rate":
            learning_rate = torch.where(state.is_init_step, sc.scalar(init_step_value, dtype, learning_rate.device), learning_rate)
        (out,) = fe.map_groups(lambda g: (fe.mul(g, fe.on(learning_rate, g), inplace=donate),), g, outputs=1)
        new_state = DoGState(
            is_init_step=sc.keep([state.is_init_step], [torch.zeros_like(state.is_init_step)], donate)[0],
            init_params=state.init_params if donate else tree_lib.tree_map(torch.clone, state.init_params),
            max_dist=sc.keep([state.max_dist], [max_dist], donate)[0],
            sum_sq_norm_grads=sc.keep([state.sum_sq_norm_grads], [sum_sq], donate)[0],
        )
        return leaves.rebuild(out), new_state

    return GradientTransformation(init_fn, update_fn)


def _with_decay(weight_decay: Optional[Any], mask: Any) -> GradientTransformation:
    return add_decayed_weights(weight_decay, mask) if weight_decay is not None else identity()


@takes_spec
def dog(
    learning_rate: ScalarOrSchedule = 1.0,
    init_step: InitStep = ("heuristic", 1e-6),
    eps: float = 1e-8,
    weight_decay: Optional[float] = None,
    mask: Any = None,
    *,
    spec: Optional[sharding.ShardingSpec] = None,
) -> GradientTransformation:
    """DoG ("Distance over Gradients"): SGD whose step is the distance travelled over the gradients' norms.

    The update is ``-learning_rate * eta_t * g`` with
    ``eta_t = max_{k<=t} ||x_k - x_0|| / sqrt(sum_{k<=t} ||g_k||^2 + eps)``: no learning rate to
    tune (``learning_rate`` only scales or schedules the step), and a step that grows while the
    iterates travel. ``init_step`` sets the first step, when no distance has been travelled;
    the authors suggest averaging the iterates. As optax: ``chain([add_decayed_weights(weight_decay,
    mask),] scale_by_dog(init_step, eps), scale_by_learning_rate(learning_rate))``.
    ``params`` are required.

    Args:
      learning_rate: multiplies the step the method finds (a schedule's peak should be 1): a
        number, a 0-d tensor, or a schedule called with the step count.
      init_step: how the first step is set: ``("distance", r0)``, the initial distance;
        ``("heuristic", alpha)``, ``r0 = alpha * (1 + ||x_0||)`` (``init`` must get the real
        params); or ``("learning_rate", eta0)``, the first step's rate.
      eps: added to the sum of squared norms.
      weight_decay: the rate of an L2 penalty added to the gradients first (``None``: none).
      mask: the leaves to decay: a tree of bools like the params (or a prefix of it), or a
        callable ``params -> such a tree``; ``None`` decays every leaf.
      spec: a :class:`gradtx.sharding.ShardingSpec` describing how plain-tensor leaves are
        sharded (DTensor leaves need none): the inner products and norms over the tree are then
        those of the logical tree, exact under any sharding.

    Returns:
      The optimizer, a :class:`~gradtx.GradientTransformation`.

    References:
      Ivgi, Hinder & Carmon, `DoG is SGD's Best Friend: A Parameter-Free Dynamic Step Size
      Schedule <https://arxiv.org/abs/2302.12022>`_, ICML, 2023

    Examples:
      >>> import torch
      >>> import gradtx as gtx
      >>> def f(params):  # a quadratic, smallest at w = 0
      ...     return (params["w"] ** 2).sum()
      >>> params = {"w": torch.tensor([1.0, 2.0, 3.0])}
      >>> tx = gtx.contrib.dog()
      >>> state = tx.init(params)
      >>> for step in range(1, 51):  # slow while the estimate grows from its small start
      ...     grads = torch.func.grad(f)(params)
      ...     updates, state = tx.update(grads, state, params)
      ...     params = gtx.apply_updates(params, updates)
      ...     if step % 10 == 0:
      ...         print(f"{f(params):.4f}")
      13.9990
      13.9906
      13.9422
      13.7289
      12.9558
    """
    check_learning_rate(learning_rate, "dog")
    return chain(
        _with_decay(weight_decay, mask), scale_by_dog(init_step, eps, spec=spec), scale_by_learning_rate(learning_rate)
    )


# --------------------------------------------------------------------------- DoWG


class DoWGState(NamedTuple):
    """``init_params``: the initial point; ``weighted_sq_norm_grads``: ``sum_k r_k^2 ||g_k||^2``;
    ``estim_sq_dist``: the largest squared distance from the initial point so far (``r^2``)."""

    init_params: Any
    weighted_sq_norm_grads: Tensor
    estim_sq_dist: Tensor


@takes_spec
def scale_by_dowg(
    init_estim_sq_dist: Optional[float] = None, eps: float = 1e-4, *, spec: Optional[sharding.ShardingSpec] = None
) -> GradientTransformation:
    """Scales the updates by DoWG's step ``r_t^2 / (sqrt(sum_k r_k^2 ||g_k||^2) + eps)``, see :func:`dowg`.

    ``init_estim_sq_dist`` is the initial guess of the squared distance (``eps`` when ``None``).
    """
    owner = "scale_by_dowg"
    eps = float(eps)
    initial = eps if init_estim_sq_dist is None else init_estim_sq_dist

    def init_fn(params: Any) -> DoWGState:
        dtype, device = sc.lowest_dtype(params), tree_lib.first_device(params)
        return DoWGState(
            init_params=sc.copy_params(params),
            weighted_sq_norm_grads=torch.zeros((), dtype=dtype, device=device),
            estim_sq_dist=sc.scalar(initial, dtype, device),
        )

    def update_fn(updates, state, params=None, *, inplace=False):
        leaves = fe.leaves_of(updates, what=owner)
        p = fe.params_of(leaves, params, owner=owner)
        p0 = leaves.aligned(state.init_params, what=f"{owner}: state.init_params")
        g = leaves.tensors
        dtype = state.estim_sq_dist.dtype
        donate = inplace and not tree_lib.needs_graph(g, p, p0, state.estim_sq_dist, state.weighted_sq_norm_grads)
        sums = sc.sums(
            lambda gi, pi, p0i: [sc.vdot(p0i - pi, p0i - pi), sc.vdot(gi, gi)],
            leaves.rebuild(g), leaves.rebuild(p), leaves.rebuild(p0), spec=spec, dtype=dtype, what=owner,
        )
        estim_sq_dist = torch.maximum(state.estim_sq_dist, sums[0])
        weighted = estim_sq_dist * sums[1] + state.weighted_sq_norm_grads
        learning_rate = estim_sq_dist / (torch.sqrt(weighted) + eps)
        (out,) = fe.map_groups(lambda g: (fe.mul(g, fe.on(learning_rate, g), inplace=donate),), g, outputs=1)
        new_state = DoWGState(
            init_params=state.init_params if donate else tree_lib.tree_map(torch.clone, state.init_params),
            weighted_sq_norm_grads=sc.keep([state.weighted_sq_norm_grads], [weighted], donate)[0],
            estim_sq_dist=sc.keep([state.estim_sq_dist], [estim_sq_dist], donate)[0],
        )
        return leaves.rebuild(out), new_state

    return GradientTransformation(init_fn, update_fn)


@takes_spec
def dowg(
    learning_rate: ScalarOrSchedule = 1.0,
    init_estim_sq_dist: Optional[float] = None,
    eps: float = 1e-4,
    weight_decay: Optional[float] = None,
    mask: Any = None,
    *,
    spec: Optional[sharding.ShardingSpec] = None,
) -> GradientTransformation:
    """DoWG ("Distance over Weighted Gradients"): DoG with gradients weighted by the squared distance.

    The update is ``-learning_rate * r_t^2 / (sqrt(v_t) + eps) * g``, with
    ``r_t^2 = max_{k<=t} ||x_k - x_0||^2`` (at least the initial guess) and
    ``v_t = sum_{k<=t} r_k^2 ||g_k||^2``: weighting later gradients more lets the step adapt to
    the problem's smoothness. As optax: ``chain([add_decayed_weights(weight_decay, mask),]
    scale_by_dowg(init_estim_sq_dist, eps), scale_by_learning_rate(learning_rate))``.
    ``params`` are required.

    Args:
      learning_rate: multiplies the step the method finds (a schedule's peak should be 1): a
        number, a 0-d tensor, or a schedule called with the step count.
      init_estim_sq_dist: the initial guess of the squared distance ``r_0^2`` (``None``: ``eps``).
      eps: added to ``sqrt(v_t)``.
      weight_decay: the rate of an L2 penalty added to the gradients first (``None``: none).
      mask: the leaves to decay: a tree of bools like the params (or a prefix of it), or a
        callable ``params -> such a tree``; ``None`` decays every leaf.
      spec: a :class:`gradtx.sharding.ShardingSpec` describing how plain-tensor leaves are
        sharded (DTensor leaves need none): the inner products and norms over the tree are then
        those of the logical tree, exact under any sharding.

    Returns:
      The optimizer, a :class:`~gradtx.GradientTransformation`.

    References:
      Khaled, Mishchenko & Jin, `DoWG Unleashed: An Efficient Universal Parameter-Free
      Gradient Descent Method <https://arxiv.org/abs/2305.16284>`_, NeurIPS, 2023

    Examples:
      >>> import torch
      >>> import gradtx as gtx
      >>> def f(params):  # a quadratic, smallest at w = 0
      ...     return (params["w"] ** 2).sum()
      >>> params = {"w": torch.tensor([1.0, 2.0, 3.0])}
      >>> tx = gtx.contrib.dowg()
      >>> state = tx.init(params)
      >>> for _ in range(5):
      ...     grads = torch.func.grad(f)(params)
      ...     updates, state = tx.update(grads, state, params)
      ...     params = gtx.apply_updates(params, updates)
      ...     print(f"{f(params):.4f}")
      13.9254
      13.8728
      13.7754
      13.5962
      13.2688
    """
    check_learning_rate(learning_rate, "dowg")
    return chain(
        _with_decay(weight_decay, mask),
        scale_by_dowg(init_estim_sq_dist, eps, spec=spec),
        scale_by_learning_rate(learning_rate),
    )


# --------------------------------------------------------------------------- COCOB


@nonnegative("scale", "subgradients")
class COCOBState(NamedTuple):
    """``init_particles``: the initial point; ``cumulative_gradients``: minus the sum of gradients;
    ``scale``: the largest ``|g|`` seen (from ``eps``); ``subgradients``: the sum of ``|g|``;
    ``reward``: the gambler's wealth, per coordinate."""

    init_particles: Any
    cumulative_gradients: Any
    scale: Any
    subgradients: Any
    reward: Any


def scale_by_cocob(alpha: float = 100.0, eps: float = 1e-8) -> GradientTransformation:
    """Replaces the updates by COCOB-Backprop's bet (see :func:`cocob`); ``params`` are required.

    Per coordinate: ``L = max(L, |g|)``, ``G += |g|``, ``R = max(R - g (x - x_0), 0)``, ``C -= g``,
    and the new point is ``x_0 + C (L + R) / (L max(G + L, alpha L))``.
    """
    owner = "scale_by_cocob"
    alpha, eps = float(alpha), float(eps)

    def init_fn(params: Any) -> COCOBState:
        tree_lib.refuse_complex(params, owner=owner, why="its rewards and bets compare real numbers")
        return COCOBState(
            init_particles=sc.copy_params(params),
            cumulative_gradients=fe.zeros_like_tree(params),
            scale=fe.full_like_tree(params, eps),
            subgradients=fe.zeros_like_tree(params),
            reward=fe.zeros_like_tree(params),
        )

    def update_fn(updates, state, params=None, *, inplace=False):
        leaves = fe.leaves_of(updates, what=owner)
        p = fe.params_of(leaves, params, owner=owner)
        fields = {name: leaves.aligned(getattr(state, name), what=f"{owner}: state.{name}") for name in COCOBState._fields}
        g = leaves.tensors
        donate = inplace and not tree_lib.needs_graph(g, p, *fields.values())
        new = {name: [] for name in COCOBState._fields if name != "init_particles"}
        out = []
        for i, (gi, pi) in enumerate(zip(g, p)):
            p0 = fields["init_particles"][i]
            scale = torch.maximum(fields["scale"][i], gi.abs())
            subgradients = fields["subgradients"][i] + gi.abs()
            reward = torch.clamp_min(fields["reward"][i] - gi * (pi - p0), 0.0)
            cumulative = fields["cumulative_gradients"][i] - gi
            bet = cumulative / (scale * torch.maximum(subgradients + scale, alpha * scale)) * (scale + reward)
            out.append(-pi + (p0 + bet))
            for name, value in zip(("scale", "subgradients", "reward", "cumulative_gradients"), (scale, subgradients, reward, cumulative)):
                new[name].append(value)
        out = sc.keep(g, fe.finish(out, g), donate)
        rebuilt = {
            name: leaves.rebuild(sc.keep(fields[name], values, donate), like=getattr(state, name)) for name, values in new.items()
        }
        init_particles = state.init_particles if donate else tree_lib.tree_map(torch.clone, state.init_particles)
        return leaves.rebuild(out), COCOBState(init_particles=init_particles, **rebuilt)

    return GradientTransformation(init_fn, update_fn)


def cocob(
    learning_rate: ScalarOrSchedule = 1.0,
    alpha: float = 100.0,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    mask: Any = None,
) -> GradientTransformation:
    """COCOB-Backprop: learning-rate-free steps from a coin-betting game, per coordinate.

    Each coordinate is a gambler betting on the sign of the negative gradient sum, a fraction of
    its wealth (the reward it has accumulated) at a time: with ``L`` the largest ``|g|`` seen,
    ``G`` the sum of ``|g|``, ``R`` the reward and ``C`` minus the sum of gradients, the new
    point is ``x_0 + C (L + R) / (L max(G + L, alpha L))`` (Algorithm 2 of the paper). As optax:
    ``chain(add_decayed_weights(weight_decay, mask), scale_by_learning_rate(learning_rate,
    flip_sign=False), scale_by_cocob(alpha, eps))``, so ``learning_rate`` scales the gradients
    the bets see. Elementwise, so exact under any sharding as it is. ``params`` are required.

    Args:
      learning_rate: multiplies the gradients before the bets: a number, a 0-d tensor, or a
        schedule called with the step count.
      alpha: bounds the fraction bet early on, while ``G`` is small (the paper's ``alpha``).
      eps: the initial ``L``, so the first bets are defined.
      weight_decay: the rate of an L2 penalty added to the gradients first, a number.
      mask: the leaves to decay: a tree of bools like the params (or a prefix of it), or a
        callable ``params -> such a tree``; ``None`` decays every leaf.

    Returns:
      The optimizer, a :class:`~gradtx.GradientTransformation`.

    References:
      Orabona & Tommasi, `Training Deep Networks without Learning Rates Through Coin Betting
      <https://arxiv.org/abs/1705.07795>`_, NeurIPS, 2017

    Examples:
      >>> import torch
      >>> import gradtx as gtx
      >>> def f(params):  # a quadratic, smallest at w = 0
      ...     return (params["w"] ** 2).sum()
      >>> params = {"w": torch.tensor([1.0, 2.0, 3.0])}
      >>> tx = gtx.contrib.cocob()
      >>> state = tx.init(params)
      >>> for _ in range(5):
      ...     grads = torch.func.grad(f)(params)
      ...     updates, state = tx.update(grads, state, params)
      ...     params = gtx.apply_updates(params, updates)
      ...     print(f"{f(params):.4f}")
      13.8803
      13.7594
      13.6339
      13.5003
      13.3548
    """
    check_learning_rate(learning_rate, "cocob")
    return chain(
        add_decayed_weights(weight_decay, mask),
        scale_by_learning_rate(learning_rate, flip_sign=False),
        scale_by_cocob(alpha, eps),
    )


# --------------------------------------------------------------------------- Mechanic


class MechanicState(NamedTuple):
    """``base_optimizer_state``: the wrapped optimizer's state; ``count``: steps (0-d int32); ``r``,
    ``m``, ``v``, ``s``: the tuner's wealth, gradient bound, second moment and scales, one per beta
    (1-D tensors of ``num_betas``); ``x0``: the initial point."""

    base_optimizer_state: Any
    count: Tensor
    r: Tensor
    m: Tensor
    v: Tensor
    s: Tensor
    x0: Any


@takes_spec
def mechanize(
    base_optimizer: GradientTransformation,
    weight_decay: float = 1e-2,
    eps: float = 1e-8,
    s_init: float = 1e-6,
    num_betas: int = 6,
    *,
    spec: Optional[sharding.ShardingSpec] = None,
) -> GradientTransformationExtraArgs:
    """Mechanic: learns, online, the scale of another optimizer's updates.

    The base optimizer's updates are summed into ``Delta`` and the iterate is
    ``x = x_0 + (sum s) * Delta``: the scales ``s``, one for each decay ``1 - 0.1^k``
    (``k = 1..num_betas``), are tuned by a coin-betting rule on
    ``h = <g + weight_decay * (sum s) * ||g|| / ||x|| * x, -Delta_prev>``, the derivative of the
    loss along the direction travelled. Keep the base optimizer's learning rate (or schedule
    peak) at 1.0 and let Mechanic find the scale. Extra arguments (``value=``...) are passed on
    to the base optimizer. ``params`` are required.

    Args:
      base_optimizer: the optimizer whose updates are scaled, its learning rate at 1.0.
      weight_decay: the tuner's own weight decay (in ``h``), not the base optimizer's.
      eps: added to denominators, for numerical stability.
      s_init: the initial value of each scale, and the tuner's initial wealth, shared among
        them.
      num_betas: the number of scales, each with its own decay.
      spec: a :class:`gradtx.sharding.ShardingSpec` describing how plain-tensor leaves are
        sharded (DTensor leaves need none): the inner products and norms over the tree are then
        those of the logical tree, exact under any sharding.

    Returns:
      The optimizer, a :class:`~gradtx.GradientTransformationExtraArgs`.

    References:
      Cutkosky, Defazio & Mehta, `Mechanic: A Learning Rate Tuner
      <https://arxiv.org/abs/2306.00144>`_, NeurIPS, 2023

    Examples:
      >>> import torch
      >>> import gradtx as gtx
      >>> def f(params):  # a quadratic, smallest at w = 0
      ...     return (params["w"] ** 2).sum()
      >>> params = {"w": torch.tensor([1.0, 2.0, 3.0])}
      >>> tx = gtx.contrib.mechanize(gtx.adam(learning_rate=1.0))
      >>> state = tx.init(params)
      >>> for step in range(1, 51):  # slow while the estimate grows from its small start
      ...     grads = torch.func.grad(f)(params)
      ...     updates, state = tx.update(grads, state, params)
      ...     params = gtx.apply_updates(params, updates)
      ...     if step % 10 == 0:
      ...         print(f"{f(params):.4f}")
      13.9988
      13.9624
      13.2668
      5.2311
      1.5100
    """
    owner = "mechanize"
    base = with_extra_args_support(base_optimizer)
    weight_decay, eps, s_init, num_betas = float(weight_decay), float(eps), float(s_init), int(num_betas)

    def init_fn(params: Any) -> MechanicState:
        tree_lib.refuse_complex(params, owner=owner, why="its scale is fitted to real inner products")
        dtype, device = sc.lowest_dtype(params), tree_lib.first_device(params)
        zeros = lambda: torch.zeros(num_betas, dtype=dtype, device=device)  # noqa: E731
        return MechanicState(
            base_optimizer_state=base.init(params),
            count=fe.zero_count(params),
            r=zeros(),
            m=zeros(),
            v=zeros(),
            s=torch.full((num_betas,), s_init, dtype=dtype, device=device),
            x0=sc.copy_params(params),
        )

    def update_fn(updates, state, params=None, *, inplace=False, **extra_args):
        if params is None:
            raise ValueError(f"{owner}: params are required (pass them to update)")
        leaves = fe.leaves_of(updates, what=owner)
        p = fe.params_of(leaves, params, owner=owner)
        old_x0 = leaves.aligned(state.x0, what=f"{owner}: state.x0")
        g = leaves.tensors
        dtype = state.s.dtype
        donate = inplace and not tree_lib.needs_graph(g, p, old_x0, state.r, state.m, state.v, state.s)
        first = state.count == 0
        x0 = [torch.where(first.to(pi.device), pi, x0i) for pi, x0i in zip(p, old_x0)]
        s_sum = state.s.sum()
        delta_prev = [(x0i - pi) / sc.on(s_sum + eps, pi) for pi, x0i in zip(p, x0)]
        # everything h needs from g, before the base optimizer may overwrite donated updates
        sums = sc.sums(
            lambda gi, pi, di: [sc.vdot(gi, gi), sc.vdot(pi, pi), sc.vdot(gi, di), sc.vdot(pi, di)],
            leaves.rebuild(g), leaves.rebuild(p), leaves.rebuild(delta_prev), spec=spec, dtype=dtype, what=owner,
        )
        grad_norm, param_norm = sc.safe_sqrt(sums[0]), sc.safe_sqrt(sums[1])
        decay = weight_decay * s_sum * grad_norm / (param_norm + eps)
        h = sums[2] + decay * sums[3]
        count = fe.increment(state.count, inplace=donate)
        base_updates, base_state = base.update(updates, state.base_optimizer_state, params, inplace=inplace, **extra_args)
        base_leaves = leaves.aligned(base_updates, what=f"{owner}: the base optimizer's updates")
        betas = torch.tensor([1.0 - 0.1**k for k in range(1, num_betas + 1)], dtype=dtype, device=state.s.device)
        clipped_h = torch.clamp(h * torch.ones_like(state.m), min=-state.m, max=state.m)
        m = torch.maximum(betas * state.m, h.abs() + eps)
        v = betas**2 * state.v + h**2
        r = betas * state.r + clipped_h * state.s
        wealth = (s_init / num_betas) * m + torch.clamp_min(r, 0.0)
        s = wealth / (sc.safe_sqrt(v) + eps)
        scale = s.sum()
        out = []
        for pi, x0i, di, ui in zip(p, x0, delta_prev, base_leaves):
            new_param = x0i - sc.on(scale, pi) * (di - ui.to(pi.dtype))
            out.append(new_param - pi)
        out = fe.finish(out, g)  # new tensors: the base optimizer's updates may share its state's buffers
        if donate:
            new_x0 = leaves.rebuild(sc.keep(old_x0, x0, True), like=state.x0)
        else:  # torch.where gave new tensors; only the leaves with no update are copied
            kept = tree_lib.flatten_like(state.x0, leaves.treedef, leaves.tree, what=f"{owner}: state.x0", like="updates")
            present = set(leaves.present)
            kept = [x if i in present or x is None else x.clone() for i, x in enumerate(kept)]
            new_x0 = tree_lib.unflatten(leaves.treedef, tree_lib.replace_present(kept, leaves.present, x0))
        new_state = MechanicState(
            base_optimizer_state=base_state,
            count=count,
            r=sc.keep([state.r], [r], donate)[0],
            m=sc.keep([state.m], [m], donate)[0],
            v=sc.keep([state.v], [v], donate)[0],
            s=sc.keep([state.s], [s], donate)[0],
            x0=new_x0,
        )
        return leaves.rebuild(out), new_state

    return GradientTransformationExtraArgs(init_fn, update_fn)


__all__ = [
    "COCOBState",
    "DAdaptAdamWState",
    "DoGState",
    "DoWGState",
    "MechanicState",
    "ProdigyState",
    "cocob",
    "dadapt_adamw",
    "dog",
    "dowg",
    "mechanize",
    "prodigy",
    "scale_by_cocob",
    "scale_by_dog",
    "scale_by_dowg",
]
