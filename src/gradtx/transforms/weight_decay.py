"""Decoupled weight decay: ``updates + weight_decay * params`` on the leaves a mask selects."""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

from torch import Tensor

from gradtx import tree as tree_lib
from gradtx.base import EmptyState, GradientTransformation, donation, set_elementwise, supports_donated_updates
from gradtx.numerics import ScalarOrSchedule
from gradtx.transforms import _foreach as fe


class WeightDecaySchedule(NamedTuple):
    """``count``: steps so far (0-d int32), the argument of a weight-decay schedule."""

    count: Tensor


def add_decay_term(updates: list[Tensor], params: list[Any], flags: list[bool], factor: Any, *, inplace: bool) -> list[Tensor]:
    """``updates + factor * params`` where ``flags`` says so, the other updates as they are: as a
    fused multiply-add (``add(alpha=)``) for a number, the product rounded first for a tensor
    factor; ``inplace``: into the updates' buffers."""
    chosen = [i for i, flag in enumerate(flags) if flag]
    if not chosen:
        return list(updates)
    targets = [updates[i] for i in chosen]
    values = fe.cast([params[i] for i in chosen], targets[0].dtype)
    scale = fe.on(factor, targets)
    if isinstance(scale, Tensor):
        added = fe.add(targets, fe.mul(values, scale, inplace=False), inplace=inplace)
    else:
        added = fe.add(targets, values, alpha=scale, inplace=inplace)
    out = list(updates)
    for i, value in zip(chosen, added):
        out[i] = value
    return out


class WeightDecayTerm:
    """The ``weight_decay * param`` term of :func:`add_decayed_weights`, for it and for the steps
    that fold it into their own pass (the fused Adam and Lion steps): that member's state
    (:meth:`init`) and, each step, the factor, which leaves it decays and their params (:meth:`step`)."""

    def __init__(self, weight_decay: ScalarOrSchedule, mask: Optional[Any], owner: str, why: str = ""):
        self.is_schedule = callable(weight_decay)
        self.value = weight_decay if self.is_schedule else fe.number_or_tensor(weight_decay)  # type: ignore[arg-type]
        self.mask, self.owner, self.why = mask, owner, why

    def init(self, params: Any) -> Any:
        return WeightDecaySchedule(count=fe.zero_count(params)) if self.is_schedule else EmptyState()

    def step(self, updates: Any, state: Any, params: Any, *, inplace: bool) -> tuple[Optional[tuple[Any, list[bool], list[Any]]], Any]:
        """``((factor, flags, params), new state)``, a flag and a param per leaf of ``updates``
        (``fe.leaves_of``), or ``(None, new state)`` where the factor is the number 0;
        ``inplace``: the count is donated."""
        tree_lib.require_params(updates, params, owner=self.owner, why=self.why)
        if self.is_schedule:
            factor: Any = fe.schedule_value(self.value, state.count)
            state = WeightDecaySchedule(count=fe.increment(state.count, inplace=inplace))
        else:
            factor = self.value
        if isinstance(factor, float) and fe.known_zero(factor):
            return None, state
        leaves = fe.leaves_of(updates, what=self.owner)
        param_values = fe.params_of(leaves, params, owner=self.owner)
        flags = [True] * len(param_values)
        if self.mask is not None:
            selected = tree_lib.mask_leaves(self.mask, params, what=f"{self.owner}: mask")
            flags = [selected[i] for i in leaves.present]
        return (factor, flags, param_values), state


def add_decayed_weights(weight_decay: ScalarOrSchedule = 0.0, mask: Optional[Any] = None) -> GradientTransformation:
    """Adds ``weight_decay * param`` to each update, as ``optax.add_decayed_weights``.

    Args:
      weight_decay: a number, or a schedule called with the step count (then the state is a
        :class:`WeightDecaySchedule`, else ``EmptyState``).
      mask: a pytree of bools shaped like the params (or a prefix of them), or a callable
        ``params -> such a tree``; only leaves marked ``True`` are decayed. optax wraps the
        transformation in ``masked`` for this, which nests its state in a ``MaskedState``; here
        the mask is applied inside, so the state is the same with or without a mask.
    """
    term = WeightDecayTerm(weight_decay, mask, "add_decayed_weights")

    def init_fn(params: Any) -> Any:
        return term.init(params)

    def update_fn(updates, state, params=None, *, inplace=False):
        inplace, own_state = donation(inplace)  # from here on ``inplace`` is about the updates
        decay, state = term.step(updates, state, params, inplace=own_state)
        if decay is None:
            return updates, state
        factor, flags, param_values = decay
        leaves = fe.leaves_of(updates, what="add_decayed_weights")

        def group(g, p, decayed):
            return (add_decay_term(g, p, decayed, factor, inplace=inplace),)

        (new_updates,) = fe.map_groups(group, leaves.tensors, param_values, flags, outputs=1)
        return leaves.rebuild(new_updates), state

    # a zero decay or a mask passes updates through as they are: new updates only when donated
    update_fn = supports_donated_updates(update_fn, returns_new_updates=False)
    return GradientTransformation(init_fn, set_elementwise(update_fn, not callable(mask)))  # a mask made from the params sees them all


AddDecayedWeightsState = EmptyState
"""The state of :func:`add_decayed_weights`: it keeps nothing, as optax's alias says."""
