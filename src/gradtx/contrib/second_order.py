"""Sophia and its Hessian-diagonal estimator, with optax.contrib's names, arguments and states.

Sophia (Liu et al., 2023, https://arxiv.org/abs/2305.14342) divides a bias-corrected momentum by an
exponential average of the Hessian's diagonal and clips the result elementwise. The diagonal comes
from a separate transformation, Hutchinson's estimator by default: ``z * (H z)`` for a Rademacher
probe ``z``, where ``H z`` is a Hessian-vector product (forward-over-reverse, ``torch.func.jvp`` of
``torch.func.grad``), so the Hessian is never formed.

optax threads a JAX PRNG key through the state; here the state holds a ``torch.Generator``'s state
as a uint8 tensor (as :func:`gradtx.add_noise` does), so the same state always draws the same
probes, saves and loads like any other state, and the pure path leaves it untouched. The probes are
drawn on the host's side of the generator, so this family is not traced by ``torch.compile``.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, NamedTuple, Optional, Union

import torch
from torch import Tensor

from gradtx import torch_internals
from gradtx import tree as tree_lib
from gradtx.base import (
    GradientTransformation,
    GradientTransformationExtraArgs,
    runs_inner,
    untraceable,
    with_extra_args_support,
)
from gradtx.chains import chain
from gradtx.numerics import ScalarOrSchedule
from gradtx.optimizers._common import check_learning_rate
from gradtx.transforms import _foreach as fe
from gradtx.transforms import add_decayed_weights, scale_by_learning_rate

Seed = Union[int, torch.Generator, None]

# Extra arguments with a fixed meaning; the others are the objective's own keyword arguments.
_RESERVED = frozenset({"value", "grad", "value_fn", "obj_fn"})


class HutchinsonState(NamedTuple):
    """``key``: the probe generator's state (uint8 tensor), advanced at every estimate."""

    key: Tensor


def _generator_state(seed: Seed, device: torch.device, owner: str) -> Tensor:
    if isinstance(seed, torch.Generator):
        if seed.device != device:
            raise ValueError(f"{owner}: the generator is on {seed.device} but the params are on {device}")
        return seed.get_state()
    generator = torch.Generator(device=device)
    generator.manual_seed(0 if seed is None else int(seed))
    return generator.get_state()


def _generator(key: Tensor, device: torch.device) -> torch.Generator:
    # Under a torch.func transform every op's result is wrapped (a state cloned or selected there,
    # even .cpu() of a CPU tensor), and set_state needs the plain bytes: the key has no derivative,
    # so the wrappers are dropped. A CPU state tensor is used as it is.
    key = torch_internals.functorch_unwrapped(key, owner="hutchinson_estimator_diag_hessian")
    generator = torch.Generator(device=device)
    generator.set_state(key if key.device.type == "cpu" else key.cpu())
    return generator


def _objective(owner: str, obj_fn: Optional[Callable], value_fn: Optional[Callable], extra_args: dict) -> Callable:
    """The objective as a function of the params alone.

    ``obj_fn(params)`` (optax's name) is used as it is; ``value_fn`` (the name line searches use)
    also receives those of the other extra arguments it takes by name (a batch, say).
    """
    if obj_fn is not None:
        return obj_fn
    if value_fn is None:
        raise ValueError(f"{owner}: the objective is required: pass obj_fn= (or value_fn=) to update")
    try:
        parameters = list(inspect.signature(value_fn).parameters.values())
    except (TypeError, ValueError):
        parameters = []
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)
    names = {p.name for p in parameters[1:]}
    kwargs = {k: v for k, v in extra_args.items() if k not in _RESERVED and (takes_any or k in names)}
    return (lambda params: value_fn(params, **kwargs)) if kwargs else value_fn


def hutchinson_estimator_diag_hessian(random_seed: Seed = None) -> GradientTransformationExtraArgs:
    """Hutchinson's unbiased (high-variance) estimate of the Hessian's diagonal, as optax's.

    The update ignores the incoming updates and returns ``z * (H z)``, a tree shaped like the
    params, where ``H`` is the Hessian of the objective at ``params`` and ``z`` a Rademacher probe
    (entries ``+-1``, drawn in float32 and cast to the params' lowest float dtype, leaf by leaf in
    flattening order). ``E[z * (H z)] = diag(H)``; for a separable objective the estimate is exact.

    ``update`` needs ``params`` and the objective: ``obj_fn=`` (a function of the params alone,
    optax's argument) or ``value_fn=`` (which also receives the extra arguments it names). The
    Hessian-vector product is differentiable (through ``torch.func``) like the objective.

    Args:
      random_seed: an integer seed (``None`` means 0), or a ``torch.Generator`` on the params'
        device whose current state starts the stream of probes.

    Example::

        import torch
        from gradtx.contrib import hutchinson_estimator_diag_hessian

        def obj_fn(p):
            return (p["w"] ** 4).sum()

        params = {"w": torch.tensor([1.0, 2.0])}
        tx = hutchinson_estimator_diag_hessian(random_seed=0)
        diag, state = tx.update(params, tx.init(params), params, obj_fn=obj_fn)
        print(diag["w"])   # tensor([12., 48.]): 12 w^2, exact for a separable objective
    """
    owner = "hutchinson_estimator_diag_hessian"

    def init_fn(params: Any) -> HutchinsonState:
        tree_lib.refuse_complex(params, owner=owner, why="its Hessian-vector products take real probes")
        return HutchinsonState(key=_generator_state(random_seed, tree_lib.first_device(params), owner))

    def update_fn(updates, state, params=None, *, inplace=False, obj_fn=None, value_fn=None, **extra_args):
        del updates
        if params is None:
            raise ValueError(f"{owner}: params are required (pass them to update)")
        objective = _objective(owner, obj_fn, value_fn, extra_args)
        leaves = fe.leaves_of(params, what=f"{owner}: params")
        floats = [t.dtype for t in leaves.tensors if t.is_floating_point()]
        probe_dtype = min(floats, key=lambda d: torch.finfo(d).bits) if floats else torch.float32
        generator = _generator(state.key, tree_lib.first_device(params))
        probes = []
        for p in leaves.tensors:
            signs = torch.randint(0, 2, p.shape, generator=generator, dtype=torch.int8, device=generator.device)
            probes.append((signs.to(torch.float32) * 2 - 1).to(probe_dtype).to(p.device))
        key = generator.get_state()
        if inplace and key.shape == state.key.shape and not tree_lib.needs_graph(state.key):
            key = state.key.copy_(key)
        probe_tree = leaves.rebuild(probes)
        _, hvp = torch.func.jvp(torch.func.grad(objective), (params,), (probe_tree,))
        hvp_leaves = leaves.aligned(hvp, what=f"{owner}: the Hessian-vector product")
        product = [h * z.to(h.dtype) for h, z in zip(hvp_leaves, probes)]
        return leaves.rebuild(product), HutchinsonState(key=key)

    untraceable(update_fn, "hutchinson_estimator_diag_hessian", "draws its probes from a torch.Generator whose state it keeps as a tensor, which torch.compile cannot trace")
    return GradientTransformationExtraArgs(init_fn, update_fn)


# The default estimator (Sophia-H); it holds no state of its own, so one instance serves every call.
_HUTCHINSON = hutchinson_estimator_diag_hessian()


def _weight(value: Any, dtype: torch.dtype) -> Any:
    return value.to(dtype) if isinstance(value, Tensor) else value


class SophiaState(NamedTuple):
    """``count``: steps so far (0-d int32); ``mu``: the momentum (in ``mu_dtype``); ``nu``: the
    exponential average of the Hessian diagonal; ``hessian_fn_state``: the estimator's state."""

    count: Tensor
    mu: Any
    nu: Any
    hessian_fn_state: Any


def scale_by_sophia(
    b1: float = 0.965,
    b2: float = 0.99,
    eps: float = 1e-8,
    gamma: float = 0.01,
    clip_threshold: Optional[float] = 1.0,
    update_interval: int = 10,
    hessian_diagonal_fn: GradientTransformation = _HUTCHINSON,
    mu_dtype: Optional[torch.dtype] = None,
    verbose: bool = False,
    print_win_rate_every_n_steps: int = 0,
) -> GradientTransformationExtraArgs:
    """Sophia's preconditioning, without weight decay or learning rate (see :func:`sophia`).

    ``mu = b1 mu + (1 - b1) g``; the update is ``mu / (1 - b1^t)`` divided elementwise by
    ``max(gamma * nu, eps)`` and clipped to ``[-clip_threshold, clip_threshold]`` (not clipped when
    ``None``). Then, on the steps whose count *before* the step is a multiple of ``update_interval``
    (the first step included), ``hessian_diagonal_fn`` is run on the gradient (with ``params`` and
    every extra argument) and ``nu = b2 nu + (1 - b2) diag``. That decision is read on the host (so
    the Hessian-vector product runs only when needed). With ``verbose`` the win rate (the fraction
    of elements not clipped) is printed every ``print_win_rate_every_n_steps`` steps.
    """
    owner = "scale_by_sophia"
    update_interval = int(update_interval)
    if update_interval < 1:
        raise ValueError(f"{owner}: update_interval must be >= 1, got {update_interval}")
    hessian_fn = with_extra_args_support(hessian_diagonal_fn)
    clip = None if clip_threshold is None else fe.number_or_tensor(clip_threshold)
    b1_, b2_ = fe.number_or_tensor(b1), fe.number_or_tensor(b2)
    gamma_, eps_ = fe.number_or_tensor(gamma), fe.number_or_tensor(eps)

    def init_fn(params: Any) -> SophiaState:
        tree_lib.refuse_complex(params, owner=owner, why="its Hessian estimate and clipping are defined for real numbers")
        return SophiaState(
            count=fe.zero_count(params),
            mu=fe.zeros_like_tree(params, dtype=mu_dtype),
            nu=fe.zeros_like_tree(params),
            hessian_fn_state=hessian_fn.init(params),
        )

    def update_fn(updates, state, params=None, *, inplace=False, **extra_args):
        if params is None:
            raise ValueError(f"{owner}: params are required (pass them to update)")
        leaves = fe.leaves_of(updates, what=owner)
        grads = leaves.tensors
        mus = leaves.aligned(state.mu, what=f"{owner}: state.mu")
        nus = leaves.aligned(state.nu, what=f"{owner}: state.nu")
        run_hessian = int(state.count) % update_interval == 0
        count = fe.increment(state.count, inplace=inplace)
        correction = 1.0 - torch.pow(fe.as_scalar_tensor(b1_, count), count.to(torch.float64))
        new_mus, outs = [], []
        for g, m, nu in zip(grads, mus, nus):
            dtype = torch.promote_types(m.dtype, g.dtype)  # as optax: the moment in full, stored in mu_dtype
            m_new = torch.lerp(m.to(dtype), g.to(dtype), _weight(1.0 - b1_, dtype))
            u = (m_new / correction.to(dtype)) / torch.clamp(gamma_ * nu.to(dtype), min=eps_)
            if clip is not None:
                u = torch.clamp(u, -clip, clip)
            new_mus.append(m_new.to(m.dtype))
            outs.append(u.to(g.dtype))
        if verbose and clip is not None and print_win_rate_every_n_steps and int(count) % int(print_win_rate_every_n_steps) == 0:
            kept = sum(int((u.abs() < clip).sum()) for u in outs)
            total = sum(u.numel() for u in outs)
            print(f"Sophia optimizer win rate: {kept / max(total, 1)}")
        hessian_state = state.hessian_fn_state
        new_nus = nus
        if run_hessian:
            diag, hessian_state = hessian_fn.update(updates, state.hessian_fn_state, params, **extra_args)
            diag_leaves = leaves.aligned(diag, what=f"{owner}: the Hessian diagonal")
            new_nus = [torch.lerp(nu, h.to(nu.dtype), _weight(1.0 - b2_, nu.dtype)) for nu, h in zip(nus, diag_leaves)]
        if inplace and not tree_lib.needs_graph(grads, mus, nus, new_mus, new_nus, outs):
            outs = [g.copy_(u) for g, u in zip(grads, outs)]
            new_mus = [m.copy_(v) for m, v in zip(mus, new_mus)]
            new_nus = [n.copy_(v) if n is not v else n for n, v in zip(nus, new_nus)]
        elif not run_hessian:  # a pure update returns a state of its own
            new_nus = [n.clone() for n in nus]
            hessian_state = tree_lib.tree_map(lambda t: t.clone() if isinstance(t, Tensor) else t, hessian_state)
        return leaves.rebuild(outs), SophiaState(
            count=count,
            mu=leaves.rebuild(new_mus, like=state.mu),
            nu=leaves.rebuild(new_nus, like=state.nu),
            hessian_fn_state=hessian_state,
        )

    runs_inner(update_fn, hessian_diagonal_fn)
    return GradientTransformationExtraArgs(init_fn, update_fn)


def sophia(
    learning_rate: ScalarOrSchedule,
    b1: float = 0.965,
    b2: float = 0.99,
    eps: float = 1e-8,
    weight_decay: float = 1e-4,
    weight_decay_mask: Optional[Any] = None,
    gamma: float = 0.01,
    clip_threshold: Optional[float] = 1.0,
    update_interval: int = 10,
    hessian_diagonal_fn: GradientTransformation = _HUTCHINSON,
    mu_dtype: Optional[torch.dtype] = None,
    verbose: bool = False,
    print_win_rate_every_n_steps: int = 0,
) -> GradientTransformationExtraArgs:
    """Sophia: a momentum divided by an estimate of the Hessian's diagonal, clipped elementwise.

    ``mu = b1 * mu + (1 - b1) * g``; every ``update_interval`` steps (the first included) the
    Hessian's diagonal is estimated by ``hessian_diagonal_fn`` and averaged into
    ``nu = b2 * nu + (1 - b2) * diag``; the step is ``mu_hat / max(gamma * nu, eps)`` clipped to
    ``[-clip_threshold, clip_threshold]``, and the update ``-learning_rate`` times it plus
    ``weight_decay * param``: ``chain(scale_by_sophia(...), add_decayed_weights(weight_decay,
    weight_decay_mask), scale_by_learning_rate(learning_rate))``, optax.contrib's definition.
    The clipping bounds the step where the curvature estimate is small or negative. The default
    estimator is Hutchinson's (Sophia-H; Rademacher probes, as in optax), which needs the
    objective: pass ``obj_fn=`` (a function of the params alone) or ``value_fn=`` to ``update``;
    every extra argument reaches ``hessian_diagonal_fn``. Under data parallelism the estimator
    sees the local objective: average its result over ranks (a custom ``hessian_diagonal_fn``) to
    keep replicas equal. See :func:`scale_by_sophia`.

    Args:
      learning_rate: the step size: a number, a 0-d tensor, or a schedule called with the step
        count (see :mod:`gradtx.schedules`).
      b1: the decay rate of the momentum.
      b2: the decay rate of the average of the Hessian's diagonal (per estimate).
      eps: the floor of ``gamma * nu`` in the division.
      weight_decay: the rate of the decoupled weight decay: each step also subtracts
        ``learning_rate * weight_decay * param``. A number.
      weight_decay_mask: the leaves to decay: a tree of bools like the params (or a prefix of
        it), or a callable ``params -> such a tree``; ``None`` decays every leaf.
      gamma: scales the Hessian's diagonal in the denominator.
      clip_threshold: the bound of each entry of the step (``None``: no clipping).
      update_interval: the number of steps between estimates of the Hessian's diagonal.
      hessian_diagonal_fn: the estimator, a transformation whose update returns the diagonal
        (by default :func:`hutchinson_estimator_diag_hessian`).
      mu_dtype: the dtype of the momentum's buffer (``None``: the params' dtype).
      verbose: print the win rate (the fraction of entries not clipped).
      print_win_rate_every_n_steps: how often ``verbose`` prints it.

    Returns:
      The optimizer, a :class:`~gradtx.GradientTransformationExtraArgs`.

    References:
      Liu, Li, Hall, Liang & Ma, `Sophia: A Scalable Stochastic Second-order Optimizer for
      Language Model Pre-training <https://arxiv.org/abs/2305.14342>`_, ICLR, 2024

    Examples:
      >>> import torch
      >>> import gradtx as gtx
      >>> def f(params):  # separable: Hutchinson's estimate of its diagonal is exact
      ...     return ((params["w"] - 1.0) ** 2).sum() + (params["w"] ** 4).sum()
      >>> params = {"w": torch.tensor([2.0, -1.0])}
      >>> tx = gtx.contrib.sophia(learning_rate=0.1, update_interval=1)
      >>> state = tx.init(params)
      >>> for _ in range(5):
      ...     grads = torch.func.grad(f)(params)
      ...     updates, state = tx.update(grads, state, params, obj_fn=f)
      ...     params = gtx.apply_updates(params, updates)
      ...     print(f"{f(params):.4f}")
      18.1075
      14.7861
      11.9709
      9.6018
      7.6236
    """
    check_learning_rate(learning_rate, "sophia")
    return chain(
        scale_by_sophia(
            b1=b1,
            b2=b2,
            eps=eps,
            gamma=gamma,
            clip_threshold=clip_threshold,
            update_interval=update_interval,
            hessian_diagonal_fn=hessian_diagonal_fn,
            mu_dtype=mu_dtype,
            verbose=verbose,
            print_win_rate_every_n_steps=print_win_rate_every_n_steps,
        ),
        add_decayed_weights(weight_decay, mask=weight_decay_mask),
        scale_by_learning_rate(learning_rate),
    )


__all__ = ["HutchinsonState", "SophiaState", "hutchinson_estimator_diag_hessian", "scale_by_sophia", "sophia"]
