"""Composition: ``chain`` runs transformations one after the other, ``named_chain`` names them."""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple, Optional

from gradtx.base import (
    DONATE_UPDATES,
    GradientTransformation,
    GradientTransformationExtraArgs,
    LeadingClip,
    Scaling,
    donation,
    is_elementwise,
    leading_clip,
    returns_new_updates,
    scaled_update_of,
    set_elementwise,
    set_leading_clip,
    supports_donated_updates,
    takes_donated_updates,
    takes_extra_args,
    with_inplace,
)
from gradtx.chains import step_gates
from gradtx.state_check import name_of, named

_PARTS = "_gradtx_chain_parts"


def _flattened(transforms: tuple[GradientTransformation, ...]) -> tuple[GradientTransformation, ...]:
    out: list[GradientTransformation] = []
    for tx in transforms:
        if not isinstance(tx, GradientTransformation):
            raise TypeError(f"chain: expected GradientTransformation, got {type(tx).__name__}")
        out.extend(getattr(tx.init, _PARTS, (tx,)))
    return tuple(out)


class _Member(NamedTuple):
    """A chain member as the chain runs it: its ``update`` (taking ``inplace``), whether it takes
    extra arguments, takes donated updates and returns new ones; ``handed``: a global-norm clip's
    ``handed_factor`` (its coefficient for the next member to take), ``scaled``: the member's
    ``scaled_update`` (see :func:`~gradtx.base.takes_scaled_gradients`), ``scaling``: the
    :data:`~gradtx.base.Scaling` a caller gave the clip (``LeadingClip.given``)."""

    update: Callable
    extra: bool
    takes: bool
    returns_new: bool
    handed: Optional[Callable] = None
    scaled: Optional[Callable] = None
    scaling: Optional[Scaling] = None


def _run(members, states, updates, params, inplace, extra_args) -> tuple[Any, list]:
    """Runs the members in order. On a step that does not donate the state (pure, or
    ``inplace="updates"``) updates that the chain owns, because the member before made them new
    (or the caller donated them), go to the next member donated when it takes that; the state never is.

    A global-norm clip followed by a member that takes scaled gradients hands it its coefficient
    instead of scaling (where the clip's ``handed_factor`` allows it): the next member then runs
    on the updates the clip was given, as the clip would have been run, and its numbers are those
    of the scaled gradients (one pass over memory fewer, and no scaled copy on a pure step)."""
    owned, state_donated = donation(inplace)
    new_states: list = []
    index = 0
    while index < len(members):
        member = members[index]
        following = members[index + 1] if index + 1 < len(members) else None
        handed = None
        # (a member that takes extra arguments is run as it is: ``scaled_update`` takes none)
        if member.handed is not None and following is not None and following.scaled is not None and not following.extra:
            handed = member.handed(updates, states[index], params)
        if handed is not None:  # the pair runs as the member after the clip, on the clip's input
            member = following  # type: ignore[assignment]
        if state_donated:
            mode: Any = True
        elif owned and member.takes:
            mode = DONATE_UPDATES
        else:
            mode, owned = False, member.returns_new
        if handed is not None:
            coef, clip_state = handed
            updates, next_state = member.scaled(  # type: ignore[misc]
                updates, states[index + 1], params, inplace=mode, grad_scale=coef, scaling=members[index].scaling
            )
            new_states += [clip_state, next_state]
            index += 2
        elif member.extra:
            updates, tx_state = member.update(updates, states[index], params, inplace=mode, **extra_args)
            new_states.append(tx_state)
            index += 1
        else:
            updates, tx_state = member.update(updates, states[index], params, inplace=mode)
            new_states.append(tx_state)
            index += 1
    return updates, new_states


def _member(tx: GradientTransformation) -> _Member:
    return _Member(
        with_inplace(tx), takes_extra_args(tx), takes_donated_updates(tx), returns_new_updates(tx),
        getattr(tx.update, "handed_factor", None), scaled_update_of(tx.update),
    )


def _marked(update_fn, members) -> Any:
    """The chain's own mark: it takes donated updates (it never writes its state's buffers then), and
    returns new updates when its last member does."""
    return supports_donated_updates(update_fn, returns_new_updates=bool(members) and members[-1].returns_new)


def _leading_clip(first: Optional[GradientTransformation], members: tuple, first_state, run) -> Optional[LeadingClip]:
    """The first member's leading clip seen from the chain: ``first_state(state)`` is that member's
    state, ``run(members, updates, state, params, inplace, extra_args)`` runs the chain's members."""
    clip = None if first is None else leading_clip(first)
    if clip is None:
        return None

    def given(norm, scale=None):
        handed = members[0].handed
        replaced = (
            members[0]._replace(
                update=clip.given(norm, scale),
                handed=None if handed is None else functools.partial(handed, given=norm),
                scaling=scale,
            ),
        ) + members[1:]

        def update_given(updates, state, params=None, *, inplace=False, **extra_args):
            return run(replaced, updates, state, params, inplace, extra_args)

        return update_given

    return LeadingClip(
        clip.spec,
        clip.norm_type,
        lambda state: clip.norm_of(first_state(state)),
        lambda state, norm: clip.coefficient(first_state(state), norm),
        given,
    )


def chain(*transforms: GradientTransformation) -> GradientTransformation:
    """Applies ``transforms`` in order; the state is a tuple with one entry per transformation.

    Nested chains are flattened, so ``chain(a, chain(b, c))`` has the state of ``chain(a, b, c)``.

    Extra keyword arguments given to ``update`` (``value=``, ``grad=``, ``value_fn=``, ...) go to the
    members that take them (the :class:`~gradtx.GradientTransformationExtraArgs`), decided once
    here; the others never see them. The chain is itself a ``GradientTransformationExtraArgs`` when
    any member is; its ``update`` accepts (and then ignores) extra arguments either way.

    A pure step allocates no more than it must: the updates a member returns new (see
    :func:`~gradtx.base.supports_donated_updates`) are the chain's own, so the next member, if it
    takes donated updates, works in their buffers (``inplace="updates"``: updates donated, state
    not). Nothing the caller passed is written, and the numbers are those of the plain pure path.

    A ``clip_by_global_norm`` followed by a member that takes scaled gradients (``adam``, ``adamw``,
    ``amsgrad``, ``sgd`` with momentum, ``lion``, ``scale_by_adam``, ``trace``: see
    :func:`~gradtx.base.takes_scaled_gradients`) hands that member its coefficient instead of
    scaling: eagerly, for float32 CPU gradients, the member's kernel multiplies each gradient by it
    where it reads it, so no scaled copy is made, with the same numbers bit for bit; plain pieces
    laid out by the clip's ``spec`` too (the coefficient of the global norm is the same on every
    rank). Where it cannot be handed (DTensor, sparse or graph-recording gradients, while
    compiling) the clip scales as before.
    """
    parts = _flattened(transforms)
    members = tuple(_member(tx) for tx in parts)
    name = f"chain({', '.join(name_of(tx.update) for tx in parts)})"

    def init_fn(params: Any) -> tuple:
        return tuple(tx.init(params) for tx in parts)

    def run(members, updates, state, params, inplace, extra_args):
        if len(state) != len(parts):
            raise ValueError(
                f"{name}: state is a {type(state).__name__} of {len(state)}, where init makes a tuple of {len(parts)}"
            )
        updates, new_state = _run(members, state, updates, params, inplace, extra_args)
        return updates, tuple(new_state)

    def update_fn(updates, state, params: Optional[Any] = None, *, inplace: bool = False, **extra_args):
        return run(members, updates, state, params, inplace, extra_args)

    set_leading_clip(update_fn, _leading_clip(parts[0] if parts else None, members, lambda state: state[0], run))
    setattr(init_fn, _PARTS, parts)
    kind = GradientTransformationExtraArgs if any(member.extra for member in members) else GradientTransformation
    gate = step_gates.sequence([step_gates.gate_of(tx) for tx in parts], lambda state: state)
    update_fn = set_elementwise(_marked(update_fn, members), all(is_elementwise(tx) for tx in parts))
    return kind(init_fn, named(step_gates.set_gate(update_fn, gate), name))


def named_chain(*named_transforms: tuple[str, GradientTransformation]) -> GradientTransformation:
    """Like :func:`chain`, with the state a dict keyed by the given names (for logging and surgery).

    Extra arguments are forwarded as :func:`chain` forwards them.
    """
    names = [name for name, _ in named_transforms]
    if len(set(names)) != len(names):
        raise ValueError(f"named_chain: names must be unique, got {names}")
    for name, tx in named_transforms:
        if not isinstance(tx, GradientTransformation):
            raise TypeError(f"named_chain: {name!r} is a {type(tx).__name__}, expected GradientTransformation")

    members = tuple(_member(tx) for _, tx in named_transforms)

    def init_fn(params: Any) -> dict:
        return {name: tx.init(params) for name, tx in named_transforms}

    def run(members, updates, state, params, inplace, extra_args):
        updates, new_states = _run(members, [state[name] for name in names], updates, params, inplace, extra_args)
        return updates, dict(zip(names, new_states))

    def update_fn(updates, state, params: Optional[Any] = None, *, inplace: bool = False, **extra_args):
        return run(members, updates, state, params, inplace, extra_args)

    first = named_transforms[0][1] if named_transforms else None
    set_leading_clip(update_fn, _leading_clip(first, members, lambda state: state[names[0]], run))

    kind = GradientTransformationExtraArgs if any(member.extra for member in members) else GradientTransformation
    gate = step_gates.sequence(
        [step_gates.gate_of(tx) for _, tx in named_transforms], lambda state: [state[name] for name in names]
    )
    return kind(init_fn, step_gates.set_gate(_marked(update_fn, members), gate))
