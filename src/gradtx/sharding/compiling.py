"""Sharded steps under ``torch.compile``: the cross-rank check runs eagerly, before tracing.

Inside a graph the tracer can run a plan's collective (the global norm's all-reduce becomes a
functional collective in the graph) but not the cross-rank check: that decides in Python on what
the ranks sent, and hashes what it sends. So a traced reduction only looks up a plan an eager call
built and checked (by leaf paths, see :mod:`gradtx.sharding.plan`), and raises a ``ValueError``
saying so when there is none. :class:`Preflight` is how ``gradtx.compile_step`` makes that eager
call: once for each new gradient tree structure, until a call shows that the step uses no
sharding at all (then never again). The eager call is the pure ``update`` itself, its result
discarded; a plain ``torch.compile`` of a sharded ``update`` needs one eager call of its own first.

What only runs eagerly: the check, the error bits, call counts and bounded waits of
:mod:`gradtx.sharding.waiting`, and the finiteness flag that ``apply_if_finite`` folds into the norm.
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import Any, Callable, Optional

from gradtx import tree as tree_lib

_RECORDING: ContextVar[Optional[list[bool]]] = ContextVar("gradtx_plan_use", default=None)


def note_plan_use() -> None:
    """Called by every eager plan lookup: tells a running :meth:`Preflight.run` that its step is sharded."""
    used = _RECORDING.get()
    if used is not None and not used:
        used.append(True)


class Preflight:
    """Runs a step eagerly before it is traced, so that every plan it uses is built and checked."""

    def __init__(self) -> None:
        self.sharded: Optional[bool] = None  # unknown until a step has run
        self._seen: set[Any] = set()

    def due(self, updates: Any) -> bool:
        """Whether the step about to be traced for ``updates`` must run eagerly first: its tree
        structure is new, and no earlier eager run found the step unsharded."""
        if self.sharded is False:
            return False
        return tree_lib.structure(updates) not in self._seen

    def run(self, updates: Any, step: Callable[[], Any]) -> None:
        """Runs ``step`` eagerly (every cross-rank check it needs happens here, on every rank alike)."""
        used: list[bool] = []
        token = _RECORDING.set(used)
        try:
            step()
        finally:
            _RECORDING.reset(token)
        self.sharded = bool(used)
        self._seen.add(tree_lib.structure(updates))
