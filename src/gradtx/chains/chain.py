"""Composition: ``chain`` runs transformations one after the other, ``named_chain`` names them."""

from __future__ import annotations

from typing import Any, Optional

from gradtx.base import GradientTransformation, GradientTransformationExtraArgs, takes_extra_args, with_inplace

_PARTS = "_gradtx_chain_parts"


def _flattened(transforms: tuple[GradientTransformation, ...]) -> tuple[GradientTransformation, ...]:
    out: list[GradientTransformation] = []
    for tx in transforms:
        if not isinstance(tx, GradientTransformation):
            raise TypeError(f"chain: expected GradientTransformation, got {type(tx).__name__}")
        out.extend(getattr(tx.init, _PARTS, (tx,)))
    return tuple(out)


def chain(*transforms: GradientTransformation) -> GradientTransformation:
    """Applies ``transforms`` in order; the state is a tuple with one entry per transformation.

    Nested chains are flattened, so ``chain(a, chain(b, c))`` has the state of ``chain(a, b, c)``.

    Extra keyword arguments given to ``update`` (``value=``, ``grad=``, ``value_fn=``, ...) go to the
    members that take them (the :class:`~gradtx.GradientTransformationExtraArgs`), decided once
    here; the others never see them. The chain is itself a ``GradientTransformationExtraArgs`` when
    any member is; its ``update`` accepts (and then ignores) extra arguments either way.
    """
    parts = _flattened(transforms)
    updaters = tuple((with_inplace(tx), takes_extra_args(tx)) for tx in parts)

    def init_fn(params: Any) -> tuple:
        return tuple(tx.init(params) for tx in parts)

    def update_fn(updates, state, params: Optional[Any] = None, *, inplace: bool = False, **extra_args):
        if len(state) != len(parts):
            raise ValueError(f"chain: state has {len(state)} entries for {len(parts)} transformations")
        new_state = []
        for (update, extra), tx_state in zip(updaters, state):
            if extra:
                updates, tx_state = update(updates, tx_state, params, inplace=inplace, **extra_args)
            else:
                updates, tx_state = update(updates, tx_state, params, inplace=inplace)
            new_state.append(tx_state)
        return updates, tuple(new_state)

    setattr(init_fn, _PARTS, parts)
    kind = GradientTransformationExtraArgs if any(extra for _, extra in updaters) else GradientTransformation
    return kind(init_fn, update_fn)


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

    updaters = {name: (with_inplace(tx), takes_extra_args(tx)) for name, tx in named_transforms}

    def init_fn(params: Any) -> dict:
        return {name: tx.init(params) for name, tx in named_transforms}

    def update_fn(updates, state, params: Optional[Any] = None, *, inplace: bool = False, **extra_args):
        new_state = {}
        for name, (update, extra) in updaters.items():
            if extra:
                updates, new_state[name] = update(updates, state[name], params, inplace=inplace, **extra_args)
            else:
                updates, new_state[name] = update(updates, state[name], params, inplace=inplace)
        return updates, new_state

    kind = GradientTransformationExtraArgs if any(extra for _, extra in updaters.values()) else GradientTransformation
    return kind(init_fn, update_fn)
