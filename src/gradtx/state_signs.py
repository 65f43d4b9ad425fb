"""Which fields of a state type never hold a negative value: second moments, sums of squares.

Storage that quantizes a state (:func:`gradtx.quantize_state`) reads such a field with an
unsigned code book, which spends no code on negative values and, at 4 bits, none on zero (a
second moment read back as zero would blow up ``1 / sqrt(nu)``); every other field (a first
moment, a momentum buffer) gets a signed code book with a zero. The choice belongs to the state
type, not to the values a field happens to hold: a momentum whose entries are all positive for a
while is still read with the signed book, whose small values stay small. A state type declares
its non-negative fields with :func:`nonnegative`::

    @nonnegative("nu")
    class ScaleByAdamState(NamedTuple):
        count: Tensor
        mu: Any
        nu: Any

A declared field covers every leaf below it. Nothing checks the values: a declared field that
does hold a negative value is stored by its magnitude.
"""

from __future__ import annotations

from typing import Any, Callable

from gradtx.state_dims import check_fields

ATTRIBUTE = "__nonnegative_fields__"


def nonnegative(*fields: str) -> Callable[[type], type]:
    """Class decorator for a state type (a NamedTuple): the names of its fields that are never negative."""

    def declare(cls: type) -> type:
        check_fields("nonnegative", cls, fields)
        setattr(cls, ATTRIBUTE, frozenset(fields))
        return cls

    return declare


def nonnegative_fields(node_type: Any) -> frozenset[str]:
    """The fields a state type declares non-negative (empty when it declares none)."""
    return getattr(node_type, ATTRIBUTE, None) or frozenset()
