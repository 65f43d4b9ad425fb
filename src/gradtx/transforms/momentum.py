"""Accumulators of past updates: ``trace`` (heavy-ball / Nesterov momentum) and ``ema``.

``trace = decay * trace + g`` while ``ema = decay * ema + (1 - decay) * g``, as in optax.
The updates returned never share memory with the state, so a later transform in a donated chain
may overwrite them freely.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import torch
from torch import Tensor

from gradtx.base import (
    GradientTransformation,
    donation,
    set_elementwise,
    takes_scaled_gradients,
)
from gradtx.native import momentum as native_momentum
from gradtx.numerics import ScalarOrSchedule
from gradtx.transforms import _foreach as fe
from gradtx.transforms.scaling import with_learning_rate


class TraceState(NamedTuple):
    """``trace``: the accumulated updates, like the params."""

    trace: Any


class EmaState(NamedTuple):
    """``count``: steps so far (0-d int32); ``ema``: the moving average, like the params."""

    count: Tensor
    ema: Any


def _trace_step(updates: Any, state: TraceState, decay: Any, nesterov: bool, *, own_updates: bool, own_state: bool,
                grad_scale: Any = None, scaling: Any = None, update_scale: Any = None) -> tuple[Any, TraceState]:
    """One momentum step: the updates (multiplied by ``update_scale`` where given) and the new
    trace. ``own_updates``/``own_state``: the gradients'/the trace's buffers may be written;
    ``grad_scale``: the step of ``updates * grad_scale`` (see :func:`~gradtx.base.takes_scaled_gradients`)."""
    leaves = fe.leaves_of(updates, what="trace")
    traces = leaves.aligned(state.trace, what="trace: state.trace")

    def group(g, t):
        factor = grad_scale
        if factor is not None and scaling is not None:  # a scaling that reads the gradients (observe's) scales them
            g, factor = fe.scaled(list(g), factor, scaling, inplace=own_updates), None
        if not torch.compiler.is_compiling():  # one pass for plain float32 CPU tensors, the same numbers
            done = native_momentum.step(
                g, t, decay=decay, nesterov=nesterov, inplace=own_state, own_updates=own_updates,
                grad_scale=factor, update_scale=update_scale,
            )
            if done is not None:
                return done
        if factor is not None:
            g = fe.scaled(list(g), factor, None, inplace=own_updates)
        t = fe.add(fe.mul(t, fe.on(decay, t), inplace=own_state), fe.cast(g, t[0].dtype), inplace=True)
        if nesterov:
            out = fe.add(g, fe.cast(t, g[0].dtype), alpha=decay, inplace=own_updates)
        else:
            out = fe.fresh(fe.cast(t, g[0].dtype), into=g if own_updates else None)
        if update_scale is not None:  # ``out`` is new, or the donated gradients
            out = fe.mul(out, fe.on(update_scale, out), inplace=True)
        return out, t

    pack = not (own_updates or own_state or scaling is not None)  # a scaling that reads the gradients sees them as given
    new_updates, new_traces = fe.map_groups(group, leaves.tensors, traces, outputs=2, pack=pack)
    return leaves.rebuild(new_updates), TraceState(trace=leaves.rebuild(new_traces, like=state.trace))


def trace(decay: float, nesterov: bool = False, accumulator_dtype: Optional[torch.dtype] = None) -> GradientTransformation:
    """Momentum: ``trace = g + decay * trace``; returns ``trace``, or ``g + decay * trace`` with Nesterov.

    Equal to ``torch.optim.SGD``'s momentum buffer with ``dampening=0`` (and its ``nesterov``).
    """
    decay = fe.number_or_tensor(decay)

    def init_fn(params: Any) -> TraceState:
        return TraceState(trace=fe.zeros_like_tree(params, accumulator_dtype))

    def update_fn(updates, state, params=None, *, inplace=False):
        del params
        own_updates, own_state = donation(inplace)
        return _trace_step(updates, state, decay, nesterov, own_updates=own_updates, own_state=own_state)

    def scaled_update(updates, state, params=None, *, inplace=False, grad_scale, scaling=None):
        del params
        own_updates, own_state = donation(inplace)
        return _trace_step(
            updates, state, decay, nesterov, own_updates=own_updates, own_state=own_state, grad_scale=grad_scale, scaling=scaling
        )

    return GradientTransformation(init_fn, takes_scaled_gradients(set_elementwise(update_fn), scaled_update))


def fused_sgd(
    learning_rate: ScalarOrSchedule, momentum: float, nesterov: bool = False, accumulator_dtype: Optional[torch.dtype] = None
) -> GradientTransformation:
    """``chain(trace(momentum, nesterov, accumulator_dtype), scale_by_learning_rate(learning_rate))``
    as one transformation, for :func:`gradtx.sgd`: that chain's state (a tuple ``(TraceState,
    learning-rate state)``) and its numbers bit for bit. The learning rate multiplies each update
    where the momentum step writes it (one pass over memory, eagerly, for float32 CPU tensors), and
    a ``clip_by_global_norm`` before it in a :func:`~gradtx.chain` hands it its coefficient (see
    :func:`~gradtx.base.takes_scaled_gradients`), as it does the Adam step."""
    decay = fe.number_or_tensor(momentum)

    def init(params: Any) -> TraceState:
        return TraceState(trace=fe.zeros_like_tree(params, accumulator_dtype))

    def step(updates, state, **how):
        return _trace_step(updates, state, decay, nesterov, **how)

    return with_learning_rate(init, step, learning_rate, "sgd")


def ema(decay: float, debias: bool = True, accumulator_dtype: Optional[torch.dtype] = None) -> GradientTransformation:
    """Exponential moving average of the updates, divided by ``1 - decay^t`` when ``debias``."""
    decay = float(decay)

    def init_fn(params: Any) -> EmaState:
        return EmaState(count=fe.zero_count(params), ema=fe.zeros_like_tree(params, accumulator_dtype))

    def update_fn(updates, state, params=None, *, inplace=False):
        del params
        leaves = fe.leaves_of(updates, what="ema")
        averages = leaves.aligned(state.ema, what="ema: state.ema")
        count = fe.increment(state.count, inplace=inplace)
        inv_bc = 1.0 / (1.0 - fe.decay_power(decay, count)) if debias else None

        def group(g, e):
            e = fe.lerp(e, fe.cast(g, e[0].dtype), 1.0 - decay, inplace=inplace)
            out = fe.fresh(fe.cast(e, g[0].dtype), into=g if inplace else None)
            if inv_bc is not None:
                out = fe.mul(out, fe.on(inv_bc, out), inplace=True)
            return out, e

        new_updates, new_averages = fe.map_groups(group, leaves.tensors, averages, outputs=2)
        return leaves.rebuild(new_updates), EmaState(count=count, ema=leaves.rebuild(new_averages, like=state.ema))

    return GradientTransformation(init_fn, update_fn)
