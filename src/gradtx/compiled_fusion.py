"""Inductor's fusion heuristics for a whole optimizer step, as :func:`gradtx.compile_step` compiles it.

Inductor keeps two nodes more than 64 apart in graph order out of one loop
(``Scheduler.are_long_distant_nodes``): in a model's forward, fusing far-apart nodes can keep
buffers alive longer and raise the peak. An optimizer step's graph grows with its leaves (each
foreach op is a node per leaf), so past a few leaves a reduction that only reads what an update
loop reads (the parameters' norm, ``max |g|``, the updates' norm of :func:`gradtx.observe`) gets a
pass over memory of its own, although the tensors it reads are live for the whole step anyway.

:func:`fusing_reductions` lets a reduction join a loop that shares its inputs however far apart
the two are; every other decision stays Inductor's. It is a heuristic, never needed for the
numbers: where this torch lacks the hook (``torch._inductor.virtualized.V.set_choices_handler``),
the step compiles with Inductor's own choices.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, ContextManager, Optional


@functools.lru_cache(maxsize=None)
def _choices_class() -> Optional[type]:
    """The :class:`InductorChoices` subclass, or ``None`` where this torch has no such hook."""
    try:
        from torch._inductor import config
        from torch._inductor.choices import InductorChoices
        from torch._inductor.virtualized import V
    except ImportError:
        return None
    if not hasattr(V, "set_choices_handler") or not hasattr(InductorChoices, "can_fuse_horizontal"):
        return None

    class FusingReductions(InductorChoices):  # type: ignore[misc, valid-type]
        """Inductor's choices, except that a reduction may share a loop with another node that reads
        enough of the same data however far apart they are in the graph."""

        def uuid(self) -> str:  # part of the compiled-graph cache key
            return "gradtx.compiled_fusion.FusingReductions/1"

        @staticmethod
        def can_fuse_horizontal(scheduler: Any, node1: Any, node2: Any, shared_data_score: int) -> bool:
            if (node1.is_reduction() or node2.is_reduction()) and shared_data_score >= config.score_fusion_memory_threshold:
                return True
            return InductorChoices.can_fuse_horizontal(scheduler, node1, node2, shared_data_score)

    return FusingReductions


def cache_options() -> dict[str, Any]:
    """Inductor options naming the choices, so that a cached graph compiled with them is told
    apart from one compiled without them (empty where the hook is missing)."""
    choices = _choices_class()
    return {} if choices is None else {"inductor_choices_class": choices}


def fusing_reductions() -> ContextManager[Any]:
    """A context in which Inductor compiles with :class:`FusingReductions` (this thread only)."""
    choices = _choices_class()
    if choices is None:
        return contextlib.nullcontext()
    from torch._inductor.virtualized import V

    return V.set_choices_handler(choices())
