"""Sharpness-aware minimization (Foret et al., 2021, https://arxiv.org/abs/2010.01412), optax.contrib's
combinator, and ``normalize``, the unit-norm gradient its adversarial step usually takes.

SAM alternates adversarial steps (uphill, with an inner optimizer) and outer steps (with the outer
optimizer, taken from the params the adversarial steps started from, using the gradient at the
adversarial point):

    adversarial:  params = params + rho * normalize(grad)
    outer:        params = cache - learning_rate * grad;  cache = params
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional

import torch
from torch import Tensor

from gradtx import tree as tree_lib
from gradtx.base import (
    takes_spec,
    EmptyState,
    GradientTransformation,
    GradientTransformationExtraArgs,
    apply_updates,
    init_empty_state,
    with_inplace,
)
from gradtx.sharding import ShardingSpec, global_norm
from gradtx.transforms import _foreach as fe

NormalizeState = EmptyState


@takes_spec
def normalize(*, spec: Optional[ShardingSpec] = None) -> GradientTransformation:
    """Divides every update by the global L2 norm of all of them (optax.contrib's ``normalize``), as
    SAM's adversarial step does (Foret et al., 2021, https://arxiv.org/abs/2010.01412).

    No epsilon, as in optax: an all-zero gradient gives NaNs. The norm is
    :func:`gradtx.sharding.global_norm`'s, accumulated in float32 or wider and exact under
    ``spec`` (or DTensor leaves): the norm of the logical gradient, identical on every rank.

    Example::

        import torch
        from gradtx.contrib import normalize

        tx = normalize()
        updates, _ = tx.update({"w": torch.tensor([3.0, 4.0])}, tx.init(None))
        print(updates["w"])   # tensor([0.6000, 0.8000])
    """

    def update_fn(updates, state, params=None, *, inplace=False):
        del params
        leaves = fe.leaves_of(updates, what="normalize")
        if not leaves.tensors and spec is None:
            return updates, state
        norm = global_norm(updates, spec)  # a pipeline stage without gradients still joins the reduction
        if not leaves.tensors:
            return updates, state

        def group(g):
            return (fe.div(g, fe.on(norm, g), inplace=inplace),)

        (out,) = fe.map_groups(group, leaves.tensors, outputs=1)
        return leaves.rebuild(out), state

    return GradientTransformation(init_empty_state, update_fn)


class SAMState(NamedTuple):
    """``steps_since_sync``: adversarial steps since the last outer step (0-d int32);
    ``opt_state``, ``adv_state``: the outer and adversarial optimizers' states; ``cache``: the
    params the current adversarial steps started from (``None`` in opaque mode)."""

    steps_since_sync: Tensor
    opt_state: Any
    adv_state: Any
    cache: Optional[Any]


def _pick(flag: Tensor, if_true: Any, if_false: Any) -> Any:
    """Leafwise ``if_true`` where the 0-d ``flag`` holds, else ``if_false`` (new tensors)."""

    def one(a, b):
        if not isinstance(a, Tensor):
            return a
        return torch.where(flag.to(a.device), a, b.to(a.dtype))

    return tree_lib.tree_map(one, if_true, if_false)


def sam(
    optimizer: GradientTransformation,
    adv_optimizer: GradientTransformation,
    sync_period: int = 2,
    reset_state: bool = True,
    opaque_mode: bool = False,
    batch_axis_name: Optional[str] = None,
) -> GradientTransformationExtraArgs:
    """SAM (sharpness-aware minimization): outer steps taken with the gradient at an adversarial point.

    SAM minimises the largest loss within a ball around the params: from the params ``x``, it
    takes ``sync_period - 1`` adversarial steps uphill (with ``adv_optimizer``, whose update is
    negated; ``chain(normalize(), sgd(rho))`` gives the paper's ``x + rho * g / ||g||``), then
    an outer step with ``optimizer``, using the gradient at the adversarial point but taken from
    ``x``. This is optax.contrib's combinator.

    In the default *transparent* mode every ``update`` is one step the caller applies: the
    adversarial ones move the params uphill, and every ``sync_period``-th returns the outer
    update taken from the cached ``x`` (``cache - params + update``), so the params land where
    the outer step from ``x`` leads. Both optimizers run at every call and the step's one is
    selected with tensor ops (no host decision, as in optax); the outer state advances only on
    outer steps, and the adversarial state is reset to ``adv_optimizer.init(params)`` after
    each (``reset_state``). In *opaque* mode every ``update`` runs the adversarial steps itself
    and returns the outer update: it needs ``grad_fn=``, a function ``(params, i) -> gradients``
    it calls ``sync_period - 1`` times (``i`` = 0, 1, ...). Other extra arguments are accepted
    and ignored, as in optax.

    Args:
      optimizer: the outer optimizer, which takes the real steps.
      adv_optimizer: the adversarial optimizer; its (descent) update is negated, so it climbs.
      sync_period: the number of calls per outer step: ``sync_period - 1`` adversarial steps,
        then the outer one.
      reset_state: reset the adversarial optimizer's state after each outer step (else it is
        kept).
      opaque_mode: run the adversarial steps inside each ``update`` (through ``grad_fn=``)
        rather than one per call.
      batch_axis_name: optax's ``pmean`` axis, which has no counterpart here: average the
        gradients inside ``grad_fn`` under data parallelism.

    Returns:
      The optimizer, a :class:`~gradtx.GradientTransformationExtraArgs`.

    References:
      Foret, Kleiner, Mobahi & Neyshabur, `Sharpness-Aware Minimization for Efficiently
      Improving Generalization <https://arxiv.org/abs/2010.01412>`_, ICLR, 2021

    Examples:
      >>> import torch
      >>> import gradtx as gtx
      >>> def f(params):  # a quadratic, smallest at w = 1
      ...     return ((params["w"] - 1.0) ** 2).sum()
      >>> params = {"w": torch.tensor([3.0, -2.0])}
      >>> adversary = gtx.chain(gtx.contrib.normalize(), gtx.sgd(0.05))  # rho = 0.05
      >>> tx = gtx.contrib.sam(gtx.sgd(0.1), adversary, sync_period=2)
      >>> state = tx.init(params)
      >>> for step in range(1, 21):  # adversarial and outer steps in turn
      ...     grads = torch.func.grad(f)(params)
      ...     updates, state = tx.update(grads, state, params)
      ...     params = gtx.apply_updates(params, updates)
      ...     if step % 4 == 0:  # after an outer step
      ...         print(f"{f(params):.4f}")
      5.2421
      2.0947
      0.8250
      0.3173
      0.1173
    """
    if sync_period < 1:
        raise ValueError("sam: sync_period must be >= 1")
    if batch_axis_name is not None:
        raise ValueError("sam: batch_axis_name is JAX's pmean axis; average the gradients inside grad_fn instead")
    opt_update, adv_update = with_inplace(optimizer), with_inplace(adv_optimizer)

    def init_fn(params: Any) -> SAMState:
        return SAMState(
            steps_since_sync=fe.zero_count(params),
            opt_state=optimizer.init(params),
            adv_state=adv_optimizer.init(params),
            cache=None if opaque_mode else tree_lib.tree_map(torch.clone, params),
        )

    def transparent_update_fn(updates, state, params=None, *, inplace=False, grad_fn=None, **extra_args):
        del grad_fn, extra_args
        if params is None:
            raise ValueError("sam: params are required (pass them to update)")
        first_step = state.steps_since_sync == 0
        last_step = state.steps_since_sync == sync_period - 1
        # both optimizers read the same updates: neither may overwrite them
        adv_updates, adv_state = adv_update(updates, state.adv_state, params, inplace=False)
        adv_updates = tree_lib.tree_map(torch.neg, adv_updates)
        opt_updates, opt_state = opt_update(updates, state.opt_state, state.cache, inplace=False)
        opt_updates = tree_lib.tree_map(lambda c, p, u: (c - p + u).to(u.dtype), state.cache, params, opt_updates)
        cache = _pick(first_step, params, state.cache)
        new_updates = _pick(last_step, opt_updates, adv_updates)
        if reset_state:
            adv_state = _pick(last_step, adv_optimizer.init(params), adv_state)
        else:
            adv_state = _pick(last_step, state.adv_state, adv_state)
        opt_state = _pick(last_step, opt_state, state.opt_state)
        steps = torch.remainder(state.steps_since_sync + 1, sync_period).to(state.steps_since_sync.dtype)
        return new_updates, SAMState(steps_since_sync=steps, opt_state=opt_state, adv_state=adv_state, cache=cache)

    def opaque_update_fn(updates, state, params=None, *, inplace=False, grad_fn: Optional[Callable] = None, **extra_args):
        del extra_args
        if grad_fn is None:
            raise ValueError("sam: grad_fn= is required when opaque_mode=True")
        if params is None:
            raise ValueError("sam: params are required (pass them to update)")
        adv_params, adv_updates, adv_state = params, updates, state.adv_state
        for i in range(sync_period - 1):
            adv_updates, adv_state = adv_update(adv_updates, adv_state, adv_params, inplace=inplace and i == 0)
            adv_updates = tree_lib.tree_map(torch.neg, adv_updates)
            adv_params = apply_updates(adv_params, adv_updates)
            adv_updates = grad_fn(adv_params, i)
        if reset_state:
            adv_state = adv_optimizer.init(params)
        elif not inplace and sync_period == 1:
            adv_state = tree_lib.tree_map(lambda t: t.clone() if isinstance(t, Tensor) else t, adv_state)
        new_updates, opt_state = opt_update(adv_updates, state.opt_state, params, inplace=inplace)
        steps = torch.zeros_like(state.steps_since_sync)
        return new_updates, SAMState(steps_since_sync=steps, opt_state=opt_state, adv_state=adv_state, cache=None)

    return GradientTransformationExtraArgs(init_fn, opaque_update_fn if opaque_mode else transparent_update_fn)


__all__ = ["NormalizeState", "SAMState", "normalize", "sam"]
