"""``apply_if_finite``: skip a step whose gradients hold a NaN or an infinity, and count it.

The decision stays on the device: the inner transformation always runs, then ``torch.where``
selects, leaf by leaf, either its updates and new state or zeros and the old state. Nothing is
read back to the host, so the wrapper costs no synchronisation and compiles to one graph.

Under sharding (a ``spec``, or DTensor gradients) the decision is taken on the logical gradient
and is the same on every rank: a NaN in one rank's shard skips the step everywhere. When the inner
transformation takes the global norm of the same gradients anyway (``clip_by_global_norm`` first
in the chain), the finiteness flag rides in that norm's all-reduce; otherwise it costs one
all-reduce of a 0/1 flag.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import torch
from torch import Tensor

from gradtx import sharding
from gradtx import tree as tree_lib
from gradtx.base import GradientTransformation, GradientTransformationExtraArgs, takes_extra_args, with_inplace, runs_inner, takes_spec
from gradtx.chains import step_gates
from gradtx.chains._select import counter, safe_increment, where_or_zero, where_tree

PyTree = Any


class ApplyIfFiniteState(NamedTuple):
    """As ``optax.ApplyIfFiniteState``.

    Attributes:
      notfinite_count: consecutive steps with a non-finite gradient (0-d int32; reset by a finite one).
      last_finite: whether the last step's gradients were all finite (0-d bool).
      total_notfinite: steps with a non-finite gradient since ``init`` (0-d int32; never reset).
      inner_state: the inner transformation's state, left as it was by a skipped step.
    """

    notfinite_count: Tensor
    last_finite: Tensor
    total_notfinite: Tensor
    inner_state: Any


@takes_spec
def apply_if_finite(
    inner: GradientTransformation, max_consecutive_errors: int, spec: Optional[sharding.ShardingSpec] = None
) -> GradientTransformation:
    """Runs ``inner`` only on steps whose incoming updates are all finite.

    A step with a NaN or an infinity anywhere in the updates returns zero updates and leaves the
    inner state untouched, unless more than ``max_consecutive_errors`` such steps came in a row:
    then the step is applied anyway (as optax does), NaNs and all.

    ``spec`` (a :class:`gradtx.sharding.ShardingSpec`; DTensor gradients need none) makes the
    decision global: every rank skips when any rank's piece is not finite, and the counters agree
    on every rank.

    The inner transformation always runs on its pure path (its state must survive a skipped
    step), so with ``inplace=True`` only this wrapper's own counters are reused.

    Extra arguments given to ``update`` reach ``inner`` when it takes them (and the result is then a
    ``GradientTransformationExtraArgs``).
    """
    if int(max_consecutive_errors) != max_consecutive_errors or max_consecutive_errors < 0:
        raise ValueError(f"apply_if_finite: max_consecutive_errors must be an int >= 0, got {max_consecutive_errors!r}")
    max_consecutive_errors = int(max_consecutive_errors)
    inner_update = with_inplace(inner)
    extra = takes_extra_args(inner)

    def init_fn(params: PyTree) -> ApplyIfFiniteState:
        zero = counter(params)
        return ApplyIfFiniteState(
            notfinite_count=zero,
            last_finite=torch.ones((), dtype=torch.bool, device=zero.device),
            total_notfinite=zero.clone(),
            inner_state=inner.init(params),
        )

    def decide_and_run(updates, state, params, extra_args):
        """``(all finite, inner updates, inner state)``, the flag global under sharding."""
        device = state.notfinite_count.device
        sharded = sharding.is_sharded(tree_lib.leaves(updates), spec)
        if not sharded or torch.compiler.is_compiling():
            isfinite = sharding.all_finite(updates, spec, device=device) if sharded else tree_lib.all_finite(updates, device=device)
            return (isfinite, *inner_update(updates, state.inner_state, params, inplace=False, **extra_args))
        with sharding.finiteness_probe(updates, spec) as probe:
            new_updates, new_inner_state = inner_update(updates, state.inner_state, params, inplace=False, **extra_args)
        isfinite = probe.finite if probe.finite is not None else sharding.all_finite(updates, spec, device=device)
        return isfinite.to(device), new_updates, new_inner_state

    def update_fn(updates, state, params=None, *, inplace=False, **extra_args):
        del inplace  # the inner state must survive a rejected step: see the docstring
        isfinite, new_updates, new_inner_state = decide_and_run(updates, state, params, extra_args if extra else {})
        notfinite_count = torch.where(
            isfinite, torch.zeros_like(state.notfinite_count), safe_increment(state.notfinite_count)
        )
        total_notfinite = torch.where(isfinite, state.total_notfinite, safe_increment(state.total_notfinite))
        apply = isfinite | (notfinite_count > max_consecutive_errors)
        out_updates = where_or_zero(apply, new_updates)
        inner_state = where_tree(apply, new_inner_state, state.inner_state, what="apply_if_finite")
        return out_updates, ApplyIfFiniteState(notfinite_count, isfinite, total_notfinite, inner_state)

    runs_inner(update_fn, inner)
    step_gates.set_gate(
        update_fn,
        step_gates.wrapping(
            lambda state: None,
            lambda _, new: new.last_finite | (new.notfinite_count > max_consecutive_errors),
            step_gates.gate_of(inner),
            lambda state: state.inner_state,
        ),
    )
    return (GradientTransformationExtraArgs if extra else GradientTransformation)(init_fn, update_fn)
