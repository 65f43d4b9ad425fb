"""How a state leaf's dims relate to its param's dims, for leaves that do not simply mirror the param.

Most state leaves made from a param have the param's shape (Adam's moments, momentum buffers,
accumulators): under sharding each rank holds the same piece of both, so a checkpoint lays the
leaf out as the param is laid out. Some leaves are made from a param but have another shape:
Adafactor's row and column statistics drop one of the param's dims, GaLore's projectors and
low-rank moments are whole on every rank. A state type declares those, per field, with
:func:`state_dims`::

    @state_dims(v_row=lambda leaf: ..., v=lambda leaf: ...)
    class FactoredState(NamedTuple):
        count: Tensor
        v_row: Any
        v: Any

A rule gets a :class:`ParamLeaf` (the param's logical and local shapes, the state leaf's local
shape, and the local shapes of the same param's leaves in the state's other fields) and returns
the leaf's :data:`Dims`: for each dim of the state leaf, the param dim it runs along (split as the
param is split along it), or ``None`` for a dim that is whole on every rank. ``whole`` and ``same``
are the two common answers; ``None`` means "no declaration here": an enclosing state's rule, then
an inner state's, then the default (see :mod:`gradtx.checkpoint`) decide.

The rules are read by :mod:`gradtx.checkpoint` only; nothing here depends on how ranks talk.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

Dims = tuple[Optional[int], ...]
"""Per dim of a state leaf: the param dim it runs along (split alike), or ``None`` (whole)."""


@dataclass(frozen=True)
class ParamLeaf:
    """What a rule sees of one state leaf and the param it was made from.

    ``shape``: the param's logical shape (a DTensor's global shape; for a plain piece under a
    ``ShardingSpec``, its local shape times the sizes of the axes splitting each dim, as the
    transformations see it); ``local_shape``: this rank's piece of the param; ``leaf_shape``: the
    state leaf's local shape; ``fields``: for every field of the declaring state that holds a tree
    shaped like the params, the local shape of this param's leaf there (``None`` where it is ``None``).
    """

    shape: tuple[int, ...]
    local_shape: tuple[int, ...]
    leaf_shape: tuple[int, ...]
    fields: Mapping[str, Optional[tuple[int, ...]]]


Rule = Callable[[ParamLeaf], Optional[Dims]]

ATTRIBUTE = "__state_dims__"


def whole(leaf: ParamLeaf) -> Dims:
    """A leaf every rank holds whole (a per-param statistic of the logical tensor, a placeholder)."""
    return (None,) * len(leaf.leaf_shape)


def same(leaf: ParamLeaf) -> Dims:
    """A leaf laid out as its param (it must have the param's shape)."""
    return tuple(range(len(leaf.shape)))


def check_fields(decorator: str, cls: type, names: Any) -> None:
    """A ``TypeError`` unless ``cls`` is a NamedTuple with every field in ``names`` (for the
    class decorators that declare something per field: this one, :func:`gradtx.state_signs.nonnegative`)."""
    fields = getattr(cls, "_fields", None)
    if fields is None:
        raise TypeError(f"{decorator}: {cls.__name__} is not a NamedTuple")
    unknown = sorted(set(names) - set(fields))
    if unknown:
        raise TypeError(f"{decorator}: {cls.__name__} has no field {unknown[0]!r} (its fields: {fields})")


def state_dims(**rules: Rule) -> Callable[[type], type]:
    """Class decorator for a state type (a NamedTuple): the :data:`Rule` of each named field.

    A field's rule covers every leaf below it that sits in a tree shaped like the params (a nested
    state's moments included). Unknown field names are a ``TypeError``.
    """

    def declare(cls: type) -> type:
        check_fields("state_dims", cls, rules)
        for name, rule in rules.items():
            if not callable(rule):
                raise TypeError(f"state_dims: the rule of {cls.__name__}.{name} is a {type(rule).__name__}, not a callable")
        setattr(cls, ATTRIBUTE, dict(rules))
        return cls

    return declare


def rules_of(node_type: Any) -> Mapping[str, Rule]:
    """The rules a state type declares (empty when it declares none)."""
    return getattr(node_type, ATTRIBUTE, None) or {}


# --------------------------------------------------------------------------- shares of a sum over ranks

SHARES_ATTRIBUTE = "__rank_shares__"


def rank_shares(*fields: str) -> Callable[[type], type]:
    """Class decorator for a state type (a NamedTuple): the named fields hold this rank's share of
    a sum over ranks that a later collective completes (``observe``'s pending update norms). Under
    sharding no other layout could take such shares back, so a checkpoint saves NaN in their place
    (see :func:`without_rank_shares`): the loaded state reads "unknown" there, the same on every
    rank, where it would otherwise hold one rank's share for all."""

    def declare(cls: type) -> type:
        check_fields("rank_shares", cls, fields)
        setattr(cls, SHARES_ATTRIBUTE, tuple(fields))
        return cls

    return declare


def without_rank_shares(state: Any) -> Any:
    """``state`` with every field :func:`rank_shares` declares filled with NaN (floating-point
    tensors; anything else as it is), for a checkpoint of a sharded state."""
    import torch

    def nan_like(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            return torch.full_like(value, float("nan"))
        return value

    def walk(node: Any) -> Any:
        if isinstance(node, tuple) and hasattr(node, "_fields"):
            shared = getattr(type(node), SHARES_ATTRIBUTE, ())
            values = {name: nan_like(value) if name in shared else walk(value) for name, value in zip(node._fields, node)}
            return type(node)(**values)
        if isinstance(node, (tuple, list)):
            return type(node)(walk(child) for child in node)
        if isinstance(node, dict):
            return type(node)((key, walk(child)) for key, child in node.items())
        return node

    return walk(state)
