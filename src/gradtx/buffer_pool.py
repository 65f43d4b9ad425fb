"""Output buffers for a pure step, taken back once nobody holds them any more.

A pure step returns new params and a new state; the step before returned trees of the same shapes,
which the caller usually drops as soon as the new ones arrive. With glibc's defaults, large freed
blocks go back to the operating system, so each step page-faults its new trees in again, 4 KiB at
a time: for a 41.7M-parameter AdamW step on a CPU that costs more than the arithmetic. A
:class:`BufferPool` keeps the storages of the outputs it handed out for the last two steps and hands
a storage out again only when its reference counts say that the pool's own reference is the only one
left: no tensor, view, NumPy array or storage object of the caller's still points at it, and no weak
reference does either (a Python ``weakref`` to the storage object, or a
``torch.multiprocessing.reductions.StorageWeakRef``), since a weak reference that outlived the
output would otherwise read the values of a later step. A tensor the caller can reach is therefore
never written, and the step stays pure; what the caller sees is what a caching allocator gives (an
output may sit at the address of an output it has let go of).

Only plain CPU tensors of at least :data:`RECYCLE_MIN_BYTES` whose layout is dense and
non-overlapping are pooled: smaller blocks come from glibc's heap without faults, accelerators have
caching allocators of their own (which also know about streams), a storage in shared memory may be
read by another process whatever its counts, and a layout with gaps or self-overlap (a slice, an
``expand``) is not one a computed result takes. The counts are read from the storage's C++ header;
where this torch build does not lay them out as expected (checked once, at import), nothing is pooled.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
import weakref
from collections import deque
from typing import Any, Optional, Sequence

import torch
from torch import Tensor

# glibc's default M_MMAP_THRESHOLD: blocks below it come from the heap and are reused unfaulted.
RECYCLE_MIN_BYTES = 128 * 1024

# c10's intrusive_ptr_target keeps one 64-bit count after its vtable pointer: strong references in
# the low 32 bits, weak references (plus one while any strong one exists) in the next 31, and a flag
# for "has a Python object" in the top bit.
_COUNT_OFFSET = ctypes.sizeof(ctypes.c_void_p)
_HAS_PYOBJECT = 1 << 63
_ONE_WEAK = 1 << 32
_ONLY_ONE = _ONE_WEAK | 1  # one strong reference and no weak one


def _counts(storage: torch.UntypedStorage) -> int:
    """The storage's combined strong and weak reference counts, without the Python-object flag."""
    return ctypes.c_uint64.from_address(storage._cdata + _COUNT_OFFSET).value & ~_HAS_PYOBJECT


def _counts_readable() -> bool:
    """Whether :func:`_counts` reads this torch's counts: checked against ``_storage_Use_Count``
    while a storage gains and loses a strong and a weak reference."""
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    if use_count is None or not hasattr(torch.UntypedStorage, "_weak_ref"):
        return False
    try:
        storage = torch.UntypedStorage(8)
        alone = _counts(storage)
        view = torch.empty(0, dtype=torch.uint8).set_(storage)
        shared = _counts(storage), use_count(storage._cdata)
        del view
        weak = storage._weak_ref()
        try:
            weakened = _counts(storage)
        finally:
            torch.UntypedStorage._free_weak_ref(weak)
        again = _counts(storage), use_count(storage._cdata)
    except (AttributeError, RuntimeError, TypeError, ValueError):
        return False
    return alone == _ONLY_ONE and shared == (_ONLY_ONE + 1, 2) and weakened == _ONLY_ONE + _ONE_WEAK and again == (_ONLY_ONE, 1)


_COUNTS_READABLE = _counts_readable()


def row_major(shape: torch.Size) -> tuple[int, ...]:
    """The strides of a new tensor of ``shape`` (what the ATen ops' outputs get)."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def dense(template: Tensor) -> bool:
    """Whether ``template``'s elements fill a block of memory exactly once, in some order of its
    dimensions (contiguous or permuted; not a slice with gaps, nor an ``expand`` or another
    self-overlapping ``as_strided`` view)."""
    if template.is_contiguous():
        return True
    expected = 1
    for size, stride in sorted(zip(template.shape, template.stride()), key=lambda pair: pair[1]):
        if size == 1:
            continue
        if stride != expected:
            return False
        expected *= size
    return True


def _free_storages(generations: Sequence[list[torch.UntypedStorage]]) -> dict[tuple, list[torch.UntypedStorage]]:
    """The storages kept in ``generations`` that nothing outside the pool references, by (bytes,
    device): no tensor or other storage handle and no C++ weak reference (the counts are those of
    the one Python object), no Python reference to that object beyond the pool's own
    (``tensor.untyped_storage()`` hands the caller this very object) and no Python weak reference
    to it, and no other process (shared memory).

    The pool's own Python references are counted against a probe storage held as a kept one is
    (one generation's list, an entry, the loop variable) and measured on this very path, so that
    whatever the interpreter adds to a count (a tracer materializing each frame's locals, say)
    cancels out."""
    occurrences: dict[int, list] = {}
    for generation in generations:
        for kept in generation:
            occurrences.setdefault(id(kept), [kept, 0])[1] += 1
    probe = [torch.UntypedStorage(0)]
    entries = [[probe[0], 1], *occurrences.values()]
    del occurrences
    free: dict[tuple, list[torch.UntypedStorage]] = {}
    baseline = None
    for storage, times in entries:
        python_references = sys.getrefcount(storage) - times
        if baseline is None:
            baseline = python_references  # the probe's
        elif (
            python_references == baseline
            and _counts(storage) == _ONLY_ONE
            and not weakref.getweakrefcount(storage)
            and not storage.is_shared()
        ):
            free.setdefault((storage.nbytes(), storage.device), []).append(storage)
    return free


def recyclable(template: Any) -> bool:
    """Whether an output shaped like ``template`` is served from a pool: a plain CPU tensor (not a
    subclass such as a DTensor) of at least :data:`RECYCLE_MIN_BYTES` with a :func:`dense` layout,
    on a torch whose reference counts can be read."""
    return (
        _COUNTS_READABLE
        and type(template) in (Tensor, torch.nn.Parameter)
        and template.is_cpu
        and template.numel() * template.element_size() >= RECYCLE_MIN_BYTES
        and dense(template)
    )


class BufferPool:
    """Hands out buffers shaped like given templates, reusing the storages of its earlier buffers
    that only the pool still references (thread-safe; ``generations`` calls' worth are kept)."""

    def __init__(self, generations: int = 2) -> None:
        self._lock = threading.Lock()
        self._kept: deque[list[torch.UntypedStorage]] = deque(maxlen=generations)

    def take(self, templates: Sequence[Optional[Tensor]]) -> list[Optional[Tensor]]:
        """One new buffer per template (same shape, strides, dtype and device; contents undefined),
        ``None`` where the template is ``None``. The buffers are the caller's until it drops them.
        A template whose layout is not :func:`dense` is a ``ValueError``: a buffer laid out like it
        would have gaps, or elements sharing memory that a write would clobber."""
        for index, template in enumerate(templates):
            if template is not None and not dense(template):
                raise ValueError(
                    f"BufferPool.take: template {index} (shape {tuple(template.shape)}, strides {template.stride()}) "
                    "is not dense and non-overlapping"
                )
        with self._lock:
            free = _free_storages(self._kept) if _COUNTS_READABLE else {}
            buffers: list[Optional[Tensor]] = []
            taken: list[torch.UntypedStorage] = []
            for template in templates:
                if template is None:
                    buffers.append(None)
                    continue
                candidates = free.get((template.numel() * template.element_size(), template.device))
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


# --------------------------------------------------------------------------- eager pure steps

# Calls of one site kept: a step may call a site once per group of leaves (dtype, device), and a
# partition or a chain of two optimizers more often; a storage kept longer is dropped.
_EAGER_GENERATIONS = 8
_eager_pools: dict[str, BufferPool] = {}
_eager_lock = threading.Lock()


def recycling() -> bool:
    """Whether eager pure steps take their large outputs from the pools of :func:`new_like`
    (``GRADTX_RECYCLE=0`` says no)."""
    return os.environ.get("GRADTX_RECYCLE", "1").strip().lower() not in ("0", "false", "no", "off")


def poolable(template: Any) -> bool:
    """Whether :func:`new_like` serves an output shaped like ``template`` from a pool: recycling is
    on, nothing is being compiled, and the template is :func:`recyclable` (and not a tensor wrapped
    by a ``torch.func`` transform)."""
    return not torch.compiler.is_compiling() and _served(template) and recycling()  # traced: no pool, nothing read


def _served(template: Any) -> bool:
    """:func:`recyclable`, and not a tensor wrapped by a ``torch.func`` transform."""
    return recyclable(template) and not torch._C._functorch.is_functorch_wrapped_tensor(template)


def new_like(templates: Sequence[Tensor], site: str) -> list[Tensor]:
    """New tensors for an eager pure step's outputs, one per template (its shape, strides, dtype,
    device; contents undefined), as ``torch.empty_like`` gives them: the :func:`recyclable` ones
    from ``site``'s pool, so that a step whose caller let go of the step before's outputs writes
    into their memory instead of page-faulting new memory in (what ``compile_step`` does with its
    own pool). ``site`` names the code asking (``"adam"``, ``"apply_updates"``, ...): one pool
    each. Called only where the outputs are computed by kernels that write every element."""
    pooled = recycling() and not torch.compiler.is_compiling()  # asked once per call, not per template
    chosen = [t if pooled and _served(t) else None for t in templates]
    if not any(t is not None for t in chosen):
        return [torch.empty_like(t) for t in templates]
    with _eager_lock:
        pool = _eager_pools.get(site)
        if pool is None:
            pool = _eager_pools[site] = BufferPool(_EAGER_GENERATIONS)
    taken = pool.take(chosen)
    return [buffer if buffer is not None else torch.empty_like(t) for buffer, t in zip(taken, templates)]


def outputs(site: str, *groups: tuple[Sequence[Tensor], bool]) -> list[list[Tensor]]:
    """A kernel's outputs, per ``(tensors, in_place)`` group: the tensors themselves where written in
    place, else new ones from :func:`new_like` (one call for all of them, one generation of the pool)."""
    wanted = [t for tensors, in_place in groups if not in_place for t in tensors]
    fresh = iter(new_like(wanted, site) if wanted else [])
    return [list(tensors) if in_place else [next(fresh) for _ in tensors] for tensors, in_place in groups]


def release_buffers() -> None:
    """Lets go of the buffers eager pure steps keep for their next outputs (those a caller still
    holds stay alive with it). With large CPU leaves, a pure step's outputs come from these pools
    (:func:`new_like`): between steps the process then keeps the memory of the outputs the caller
    dropped, as a caching allocator does, instead of handing it back to the system and faulting it
    in again at the next step. ``GRADTX_RECYCLE=0`` turns the pools off."""
    with _eager_lock:
        pools = list(_eager_pools.values())
        _eager_pools.clear()
    for pool in pools:
        pool.clear()
