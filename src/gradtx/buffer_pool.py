"""Output buffers for a pure step, taken back once nobody holds them any more.

A pure step returns new params and a new state; the step before returned trees of the same shapes,
which the caller usually drops as soon as the new ones arrive. With glibc's defaults, large freed
blocks go back to the operating system, so each step page-faults its new trees in again, 4 KiB at
a time: for a 41.7M-parameter AdamW step on a CPU that costs more than the arithmetic. A
:class:`BufferPool` keeps the storages of the outputs it handed out for the last two steps and hands
a storage out again only when its use count says that the pool's own reference is the only one left:
no tensor, view, NumPy array or storage object of the caller's still points at it. A tensor the
caller can reach is therefore never written, and the step stays pure; what the caller sees is what
a caching allocator gives (an output may sit at the address of an output it has let go of).

Only plain CPU tensors of at least :data:`RECYCLE_MIN_BYTES` are pooled: smaller blocks come from
glibc's heap without faults, accelerators have caching allocators of their own (which also know
about streams), and a storage in shared memory may be read by another process whatever its count.
"""

from __future__ import annotations

import sys
import threading
from collections import deque
from typing import Any, Callable, Optional, Sequence

import torch
from torch import Tensor

# glibc's default M_MMAP_THRESHOLD: blocks below it come from the heap and are reused unfaulted.
RECYCLE_MIN_BYTES = 128 * 1024

_use_count: Optional[Callable[[int], int]] = getattr(torch._C, "_storage_Use_Count", None)


def _needed_bytes(template: Tensor) -> int:
    """Bytes of storage a tensor with ``template``'s shape and strides spans."""
    if template.numel() == 0:
        return 0
    span = 1 + sum((size - 1) * stride for size, stride in zip(template.shape, template.stride()))
    return span * template.element_size()


def _references(storage: torch.UntypedStorage) -> int:
    return sys.getrefcount(storage)


def _call_overhead() -> int:
    """What :func:`_references` counts beyond the caller's own references (its parameter and
    ``getrefcount``'s argument, as this interpreter counts them), measured on a storage held by one
    list entry and one loop variable."""
    for storage in [torch.UntypedStorage(0)]:
        return _references(storage) - 2
    raise AssertionError("unreachable")


_CALL_OVERHEAD = _call_overhead()


def _only_pool_holds(storage: torch.UntypedStorage, pool_references: int) -> bool:
    """Whether nothing outside the pool references ``storage``: no tensor or other storage handle
    (its C++ use count is that of the one Python object), no Python reference to that object beyond
    the pool's ``pool_references`` (``tensor.untyped_storage()`` hands the caller this very
    object), and no other process (shared memory)."""
    return (
        _use_count(storage._cdata) == 1
        and _references(storage) - _CALL_OVERHEAD - 1 == pool_references  # - 1: the parameter here
        and not storage.is_shared()
    )


def recyclable(template: Any) -> bool:
    """Whether an output shaped like ``template`` is served from a pool: a plain CPU tensor (not a
    subclass such as a DTensor) of at least :data:`RECYCLE_MIN_BYTES`, on a torch that counts uses."""
    return (
        _use_count is not None
        and type(template) in (Tensor, torch.nn.Parameter)
        and template.device.type == "cpu"
        and _needed_bytes(template) >= RECYCLE_MIN_BYTES
    )


class BufferPool:
    """Hands out buffers shaped like given templates, reusing the storages of its earlier buffers
    that only the pool still references (thread-safe; ``generations`` calls' worth are kept)."""

    def __init__(self, generations: int = 2) -> None:
        self._lock = threading.Lock()
        self._kept: deque[list[torch.UntypedStorage]] = deque(maxlen=generations)

    def take(self, templates: Sequence[Optional[Tensor]]) -> list[Optional[Tensor]]:
        """One new buffer per template (same shape, strides, dtype and device; contents undefined),
        ``None`` where the template is ``None``. The buffers are the caller's until it drops them."""
        with self._lock:
            occurrences: dict[int, list] = {}
            for generation in self._kept:
                for kept in generation:
                    occurrences.setdefault(id(kept), [kept, 0])[1] += 1
            free: dict[tuple, list[torch.UntypedStorage]] = {}
            for storage, times in occurrences.values():
                # The pool's own references: the kept lists (``times``), the entry and the loop variable.
                if _only_pool_holds(storage, times + 2):
                    free.setdefault((storage.nbytes(), storage.device), []).append(storage)
            del occurrences
            buffers: list[Optional[Tensor]] = []
            taken: list[torch.UntypedStorage] = []
            for template in templates:
                if template is None:
                    buffers.append(None)
                    continue
                candidates = free.get((_needed_bytes(template), template.device))
                if candidates:
                    storage = candidates.pop()
                    buffer = torch.empty(0, dtype=template.dtype, device=template.device)
                    buffer.set_(storage, 0, template.shape, template.stride())
                else:
                    buffer = torch.empty_strided(
                        template.shape, template.stride(), dtype=template.dtype, device=template.device
                    )
                    storage = buffer.untyped_storage()
                buffers.append(buffer)
                taken.append(storage)
            self._kept.append(taken)
            return buffers

    def clear(self) -> None:
        """Lets go of every kept storage (those the caller still holds stay alive with it)."""
        with self._lock:
            self._kept.clear()

    def kept_bytes(self) -> int:
        """Bytes of the distinct storages kept (held by the caller or free for the next call)."""
        with self._lock:
            unique = {id(s): s for generation in self._kept for s in generation}
            return sum(s.nbytes() for s in unique.values())
