"""Composition: ``chain`` runs transformations one after the other, ``named_chain`` names them."""

from __future__ import annotations

from typing import Any, Optional

from gradtx.base import GradientTransformation, with_inplace

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
    """
    parts = _flattened(transforms)
    updaters = tuple(with_inplace(tx) for tx in parts)

    def init_fn(params: Any) -> tuple:
        return tuple(tx.init(params) for tx in parts)

    def update_fn(updates, state, params: Optional[Any] = None, *, inplace: bool = False):
        if len(state) != len(parts):
            raise ValueError(f"chain: state has {len(state)} entries for {len(parts)} transformations")
        new_state = []
        for update, tx_state in zip(updaters, state):
            updates, tx_state = update(updates, tx_state, params, inplace=inplace)
            new_state.append(tx_state)
        return updates, tuple(new_state)

    setattr(init_fn, _PARTS, parts)
    return GradientTransformation(init_fn, update_fn)


def named_chain(*named_transforms: tuple[str, GradientTransformation]) -> GradientTransformation:
    """Like :func:`chain`, with the state a dict keyed by the given names (for logging and surgery)."""
    names = [name for name, _ in named_transforms]
    if len(set(names)) != len(names):
        raise ValueError(f"named_chain: names must be unique, got {names}")
    for name, tx in named_transforms:
        if not isinstance(tx, GradientTransformation):
            raise TypeError(f"named_chain: {name!r} is a {type(tx).__name__}, expected GradientTransformation")

    updaters = {name: with_inplace(tx) for name, tx in named_transforms}

    def init_fn(params: Any) -> dict:
        return {name: tx.init(params) for name, tx in named_transforms}

    def update_fn(updates, state, params: Optional[Any] = None, *, inplace: bool = False):
        new_state = {}
        for name, update in updaters.items():
            updates, new_state[name] = update(updates, state[name], params, inplace=inplace)
        return updates, new_state

    return GradientTransformation(init_fn, update_fn)
