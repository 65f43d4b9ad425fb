"""Step gates: how a caller learns that a transformation skipped a step.

``MultiSteps`` (on its mini-steps) and ``apply_if_finite`` (on a non-finite step) return zero
updates and keep their inner state. In a pure chain that is all a skip needs: the zeros change no
parameter. A caller that runs something stateful after the chain (``gradtx.wrap`` runs a torch
optimizer, whose momentum, weight decay and step count move even on zero gradients) must know the
step was skipped, and not run it at all.

A :class:`StepGate` answers that from the transformation's state: ``before(state)`` keeps the little
it needs (copied counters) before ``update``, and ``applied(kept, new_state)`` says, as a 0-d bool
tensor, whether that update was applied. Gates compose: a chain's gate is applied when every gated
member's is, and ``MultiSteps`` / ``apply_if_finite`` fold in the gate of the transformation they
wrap. :func:`gate_of` reads a transformation's gate; :func:`ungated_skippers` finds states of
skipping transformations that no gate covers (one nested in ``partition``, say), which skip only
some leaves and so cannot be expressed as "skip the whole step".
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional, Sequence

import torch
from torch import Tensor

from gradtx import tree as tree_lib

_GATE = "_gradtx_step_gate"


class StepGate(NamedTuple):
    """Whether an update was applied, from the transformation's state before and after it.

    Attributes:
      before: ``state -> kept``: what to keep of the state before ``update`` (copied, small).
      applied: ``(kept, new_state) -> 0-d bool tensor``: whether the update was applied.
      covers: how many skipping states (``MultiStepsState`` / ``ApplyIfFiniteState``) it decides for.
    """

    before: Callable[[Any], Any]
    applied: Callable[[Any, Any], Tensor]
    covers: int


def set_gate(update_fn: Callable[..., Any], gate: Optional[StepGate]) -> Callable[..., Any]:
    """Attaches ``gate`` to an update function (nothing when ``gate`` is None); returns the function."""
    if gate is not None:
        setattr(update_fn, _GATE, gate)
    return update_fn


def gate_of(tx: Any) -> Optional[StepGate]:
    """The gate of a transformation (or of its update function), or None when it never skips."""
    update = getattr(tx, "update", tx)
    return getattr(update, _GATE, None)


def _true() -> Tensor:
    return torch.ones((), dtype=torch.bool)


def wrapping(
    own_before: Callable[[Any], Any],
    own_applied: Callable[[Any, Any], Tensor],
    inner_gate: Optional[StepGate],
    inner_state: Callable[[Any], Any],
) -> StepGate:
    """The gate of a skipping transformation that wraps ``inner`` (whose gate may be None).

    Applied when its own test says so and, if ``inner`` is gated, when ``inner``'s does too.
    """
    if inner_gate is None:
        return StepGate(lambda state: (own_before(state), None), lambda kept, new: own_applied(kept[0], new), 1)

    def before(state: Any) -> Any:
        return own_before(state), inner_gate.before(inner_state(state))

    def applied(kept: Any, new: Any) -> Tensor:
        mine = own_applied(kept[0], new)
        theirs = inner_gate.applied(kept[1], inner_state(new))
        return mine & theirs.to(mine.device)

    return StepGate(before, applied, 1 + inner_gate.covers)


def sequence(gates: Sequence[Optional[StepGate]], member_states: Callable[[Any], Sequence[Any]]) -> Optional[StepGate]:
    """The gate of a chain whose members have ``gates``: applied when every gated member's is."""
    gated = [(i, gate) for i, gate in enumerate(gates) if gate is not None]
    if not gated:
        return None

    def before(state: Any) -> Any:
        states = member_states(state)
        return tuple(gate.before(states[i]) for i, gate in gated)

    def applied(kept: Any, new: Any) -> Tensor:
        states = member_states(new)
        verdict = _true()
        for (i, gate), member_kept in zip(gated, kept):
            verdict = _and(verdict, gate.applied(member_kept, states[i]))
        return verdict

    return StepGate(before, applied, sum(gate.covers for _, gate in gated))


def _and(a: Tensor, b: Tensor) -> Tensor:
    """``a & b`` on ``b``'s device (a starts as a CPU true)."""
    return a.to(b.device) & b


def ungated_skippers(state: Any, gate: Optional[StepGate]) -> int:
    """How many skipping states in ``state`` no gate decides for (0 when all are covered)."""
    from gradtx.chains.accumulation import MultiStepsState
    from gradtx.chains.conditionals import ApplyIfFiniteState

    kinds = (MultiStepsState, ApplyIfFiniteState)

    def count(tree: Any) -> int:
        nodes = tree_lib.leaves_until(tree, lambda x: isinstance(x, kinds))
        found = 0
        for node in nodes:
            if isinstance(node, kinds):
                inner = node.inner_opt_state if isinstance(node, MultiStepsState) else node.inner_state
                found += 1 + count(inner)
        return found

    return count(state) - (gate.covers if gate is not None else 0)


def copied(value: Tensor) -> Tensor:
    """A detached copy of a counter, kept across an update that may write the original in place."""
    return value.detach().clone()
