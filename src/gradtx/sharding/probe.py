"""Folding a finiteness flag into a norm that is computed anyway.

``apply_if_finite`` must know whether the logical gradient is finite, identically on every rank.
When the transformation it wraps takes the global norm of the very same gradients (a chain that
starts with ``clip_by_global_norm``), that norm's one all-reduce can carry the flag too: the
wrapper opens a probe for its gradients, the norm finds it (same tensors, same spec), adds one
element to its buffer and leaves the reduced flag in the probe. Otherwise the wrapper reduces the
flag itself. The probe lives in a ``ContextVar``: per thread and per context, never process-wide.
"""

from __future__ import annotations

import contextlib
from contextvars import ContextVar
from typing import Any, Iterator, Optional, Sequence

import torch
from torch import Tensor

from gradtx import tree as tree_lib

_ACTIVE: ContextVar[Optional["FiniteProbe"]] = ContextVar("gradtx_finite_probe", default=None)


class FiniteProbe:
    """Waits for a global norm over exactly ``tree``'s tensors under ``spec``; holds the flag it reduced."""

    def __init__(self, tree: Any, spec: Any):
        self._tensors = [leaf for leaf in tree_lib.leaves(tree) if leaf is not None]
        self._spec = spec
        self.finite: Optional[Tensor] = None

    def wants(self, tree_leaves: Sequence[Any], spec: Any) -> bool:
        if self.finite is not None or spec is not self._spec:
            return False
        tensors = [leaf for leaf in tree_leaves if leaf is not None]
        return len(tensors) == len(self._tensors) and all(a is b for a, b in zip(tensors, self._tensors))


@contextlib.contextmanager
def finiteness_probe(tree: Any, spec: Any) -> Iterator[FiniteProbe]:
    """A context in which a global norm of exactly ``tree``'s tensors under ``spec`` also reduces
    whether they are all finite, in its own all-reduce; the probe's ``finite`` holds that flag
    (``None`` if no such norm ran, and then the caller reduces the flag itself)."""
    probe = FiniteProbe(tree, spec)
    if torch.compiler.is_compiling():  # the tracer cannot set a ContextVar: the flag is reduced apart
        yield probe
        return
    token = _ACTIVE.set(probe)
    try:
        yield probe
    finally:
        _ACTIVE.reset(token)


def waiting_probe(tree_leaves: Sequence[Any], spec: Any) -> Optional[FiniteProbe]:
    """The open probe that a global norm of ``tree_leaves`` under ``spec`` should answer, if any
    (none while ``torch.compile`` traces: it cannot read a ``ContextVar``)."""
    if torch.compiler.is_compiling():
        return None
    probe = _ACTIVE.get()
    return probe if probe is not None and probe.wants(tree_leaves, spec) else None
