"""``apply_if_finite``: skip a step whose gradients hold a NaN or an infinity, and count it.

The decision stays on the device: the inner transformation always runs, then ``torch.where``
selects, leaf by leaf, either its updates and new state or zeros and the old state. Nothing is
read back to the host, so the wrapper costs no synchronisation and compiles to one graph.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor

from gradtx.base import GradientTransformation, with_inplace
from gradtx.chains._select import all_finite, counter, safe_increment, where_or_zero, where_tree

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


def apply_if_finite(inner: GradientTransformation, max_consecutive_errors: int) -> GradientTransformation:
    """Runs ``inner`` only on steps whose incoming updates are all finite.

    A step with a NaN or an infinity anywhere in the updates returns zero updates and leaves the
    inner state untouched, unless more than ``max_consecutive_errors`` such steps came in a row:
    then the step is applied anyway (as optax does), NaNs and all.

    The inner transformation always runs on its pure path (its state must survive a skipped
    step), so with ``inplace=True`` only this wrapper's own counters are reused.
    """
    if int(max_consecutive_errors) != max_consecutive_errors or max_consecutive_errors < 0:
        raise ValueError(f"apply_if_finite: max_consecutive_errors must be an int >= 0, got {max_consecutive_errors!r}")
    max_consecutive_errors = int(max_consecutive_errors)
    inner_update = with_inplace(inner)

    def init_fn(params: PyTree) -> ApplyIfFiniteState:
        zero = counter(params)
        return ApplyIfFiniteState(
            notfinite_count=zero,
            last_finite=torch.ones((), dtype=torch.bool, device=zero.device),
            total_notfinite=zero.clone(),
            inner_state=inner.init(params),
        )

    def update_fn(updates, state, params=None, *, inplace=False):
        del inplace  # the inner state must survive a rejected step: see the docstring
        isfinite = all_finite(updates, device=state.notfinite_count.device)
        notfinite_count = torch.where(
            isfinite, torch.zeros_like(state.notfinite_count), safe_increment(state.notfinite_count)
        )
        total_notfinite = torch.where(isfinite, state.total_notfinite, safe_increment(state.total_notfinite))
        apply = isfinite | (notfinite_count > max_consecutive_errors)

        new_updates, new_inner_state = inner_update(updates, state.inner_state, params, inplace=False)
        out_updates = where_or_zero(apply, new_updates)
        inner_state = where_tree(apply, new_inner_state, state.inner_state, what="apply_if_finite")
        return out_updates, ApplyIfFiniteState(notfinite_count, isfinite, total_notfinite, inner_state)

    return GradientTransformation(init_fn, update_fn)
