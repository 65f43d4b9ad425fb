"""``BufferPool``: a storage goes out again only once nothing but the pool references it, so a
tensor the caller can still reach (directly, through a view, a NumPy array, a storage object or a
weak reference to one, or from another process through shared memory) is never handed out to be
overwritten; buffers are only ever laid out densely, never over overlapping memory."""

from __future__ import annotations

import importlib.util
import re
import sys
import threading
import weakref

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.multiprocessing.reductions import StorageWeakRef

from gradtx import buffer_pool
from gradtx.buffer_pool import RECYCLE_MIN_BYTES, BufferPool, dense, recyclable

BIG = RECYCLE_MIN_BYTES // 4  # float32 elements of the smallest pooled buffer


def _template(n: int = BIG, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.empty(n, dtype=dtype)


def test_buffers_have_the_templates_shape_strides_and_dtype():
    pool = BufferPool()
    templates = [torch.empty(256, 512).t(), torch.empty(BIG, dtype=torch.float64), None]
    buffers = pool.take(templates)
    assert buffers[2] is None
    for buffer, template in zip(buffers[:2], templates[:2]):
        assert buffer.shape == template.shape and buffer.stride() == template.stride()
        assert buffer.dtype == template.dtype and buffer.device == template.device


def test_a_dropped_buffer_is_reused_two_calls_later():
    pool = BufferPool()
    first = pool.take([_template()])[0]
    address = first.data_ptr()
    second = pool.take([_template()])[0]  # ``first`` is still held: a new buffer
    assert second.data_ptr() != address
    del first
    third = pool.take([_template()])[0]
    assert third.data_ptr() == address
    assert second.data_ptr() != third.data_ptr()


@pytest.mark.parametrize(
    "keep",
    [
        lambda t: t,
        lambda t: t[1:],  # a view
        lambda t: t.view(2, -1),
        lambda t: t.detach(),
        lambda t: t.numpy(),
        lambda t: t.untyped_storage(),
    ],
    ids=["tensor", "slice", "reshaped view", "detached", "numpy", "storage"],
)
def test_anything_still_referencing_a_buffer_keeps_it_out_of_the_pool(keep):
    pool = BufferPool()
    buffer = pool.take([_template()])[0]
    buffer.fill_(7.0)
    address = buffer.data_ptr()
    held = keep(buffer)
    del buffer
    for _ in range(3):
        other = pool.take([_template()])[0]
        assert other.data_ptr() != address
        other.fill_(-1.0)
    values = torch.empty(0).set_(held) if isinstance(held, torch.UntypedStorage) else torch.as_tensor(held)
    assert values.eq(7.0).all()


def test_a_buffer_moved_to_shared_memory_is_never_reused():
    pool = BufferPool()
    buffer = pool.take([_template()])[0]
    buffer.share_memory_()  # another process may map it, whatever the count here says
    address = buffer.data_ptr()
    del buffer
    for _ in range(3):
        assert pool.take([_template()])[0].data_ptr() != address


def test_only_large_plain_cpu_tensors_are_pooled():
    class Subclass(torch.Tensor):
        pass

    assert recyclable(torch.empty(BIG))
    assert recyclable(torch.nn.Parameter(torch.empty(BIG)))
    assert not recyclable(torch.empty(BIG - 1))
    assert not recyclable(torch.empty(BIG).as_subclass(Subclass))
    assert not recyclable(None)
    assert not recyclable(torch.empty(BIG, device="meta"))


@pytest.mark.parametrize(
    ("make", "pooled"),
    [
        (lambda: torch.empty(64, BIG // 64).t(), True),
        (lambda: torch.empty(4, 8, BIG // 32).permute(2, 0, 1), True),
        (lambda: torch.empty(BIG, 1).expand(BIG, 4), False),
        (lambda: torch.empty(2 * BIG).as_strided((BIG, 4), (1, 1)), False),
        (lambda: torch.empty(BIG, 2)[:, :1], False),
    ],
    ids=["transposed", "permuted", "expanded", "overlapping", "sliced"],
)
def test_only_dense_layouts_are_pooled(make, pooled):
    template = make()
    assert recyclable(template) is pooled
    if pooled:
        (buffer,) = BufferPool().take([template])
        assert buffer.stride() == template.stride()
    else:
        with pytest.raises(ValueError, match=re.escape(f"template 0 (shape {tuple(template.shape)}, strides {template.stride()})")):
            BufferPool().take([template])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 4), st.integers(0, 6)), max_size=4))
def test_dense_means_each_element_has_its_own_place_and_no_place_is_left_over(sizes_and_strides):
    """Against brute force: the offsets of all elements are 0, 1, ..., numel - 1 in some order."""
    shape = [n for n, _ in sizes_and_strides]
    strides = [s for _, s in sizes_and_strides]
    offsets = torch.arange(4096).as_strided(shape, strides)
    brute_force = torch.equal(offsets.flatten().sort().values, torch.arange(offsets.numel()))
    assert dense(offsets) == brute_force


def test_this_torch_lays_out_reference_counts_as_expected():
    """Else nothing is pooled (the pool cannot tell whether a weak reference is left)."""
    assert buffer_pool._COUNTS_READABLE


def test_where_the_counts_cannot_be_read_nothing_is_pooled(monkeypatch):
    monkeypatch.setattr(buffer_pool, "_COUNTS_READABLE", False)
    assert not recyclable(_template())
    pool = BufferPool()
    addresses = set()
    for _ in range(4):
        addresses.add(pool.take([_template()])[0].data_ptr())
        pool.take([_template(2 * BIG)])  # in between: keeps the freed block from coming straight back
    assert len(addresses) > 1


@pytest.mark.parametrize(
    ("make_ref", "read"),
    [
        (weakref.ref, lambda ref: ref()),
        (StorageWeakRef, lambda ref: torch.UntypedStorage._new_with_weak_ptr(ref.cdata)),
    ],
    ids=["weakref", "StorageWeakRef"],
)
def test_a_weak_reference_keeps_a_buffer_out_of_the_pool(make_ref, read):
    """A weak reference that outlives its buffer sees the buffer's own values until the storage
    dies (two calls later, when the pool lets go of it), never a later call's."""
    pool = BufferPool()
    buffer = pool.take([_template()])[0]
    buffer.fill_(7.0)
    ref = make_ref(buffer.untyped_storage())
    del buffer
    for _ in range(3):
        pool.take([_template()])[0].fill_(-1.0)
        storage = read(ref)
        if storage is not None:
            assert torch.empty(0).set_(storage).eq(7.0).all()
        del storage
    assert read(ref) is None


def test_the_pool_keeps_at_most_two_calls_worth():
    pool = BufferPool()
    nbytes = BIG * 4
    for _ in range(10):
        held = pool.take([_template(), _template()])
    assert pool.kept_bytes() <= 4 * nbytes
    del held
    pool.clear()
    assert pool.kept_bytes() == 0


def test_threads_never_share_a_live_buffer():
    pool = BufferPool()
    live: dict[int, int] = {}
    lock = threading.Lock()
    errors: list[str] = []

    def worker(seed: int) -> None:
        for i in range(60):
            buffers = pool.take([_template(), _template()])
            with lock:
                for b in buffers:
                    if b.data_ptr() in live:
                        errors.append(f"thread {seed} step {i}: buffer of thread {live[b.data_ptr()]} handed out")
                    live[b.data_ptr()] = seed
            for b in buffers:
                b.fill_(float(seed))
            for b in buffers:
                if not b.eq(float(seed)).all():
                    errors.append(f"thread {seed} step {i}: buffer overwritten")
            with lock:
                for b in buffers:
                    del live[b.data_ptr()]
            del buffers

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:3]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 3), st.lists(st.booleans(), min_size=3, max_size=3)), min_size=1, max_size=12))
def test_a_held_buffer_is_never_handed_out_again(calls):
    """Random calls, each taking 1-3 buffers of two sizes and then dropping some of what is held:
    every buffer still held keeps its contents, whatever the pool handed out since."""
    pool = BufferPool()
    held: list[tuple[torch.Tensor, float]] = []
    value = 0.0
    for count, drops in calls:
        sizes = [BIG if i % 2 == 0 else 2 * BIG for i in range(count)]
        for buffer in pool.take([_template(n) for n in sizes]):
            value += 1.0
            buffer.fill_(value)
            held.append((buffer, value))
        held = [pair for pair, drop in zip(held, drops + [False] * len(held)) if not drop]
        for buffer, expected in held:
            assert buffer.eq(expected).all()
        addresses = [b.data_ptr() for b, _ in held]
        assert len(addresses) == len(set(addresses))


def _tracer(frame, event, arg):
    frame.f_locals  # materializes the frame's locals: one more reference to each
    return _tracer


def test_references_are_counted_alike_under_a_tracer_that_reads_frame_locals():
    """A tracer (a debugger, a coverage tool) that reads ``frame.f_locals`` adds a reference per
    frame to what each frame holds; the pool counts its own references on the same path as a probe
    of its own, so a dropped buffer is still reused and a storage object still held is not."""
    pool = BufferPool()
    dropped = pool.take([_template()])[0]
    address = dropped.data_ptr()
    held = pool.take([_template()])[0]
    held.fill_(3.0)
    held_storage = held.untyped_storage()
    held_address = held.data_ptr()
    del dropped, held
    sys.settrace(_tracer)
    try:
        again = pool.take([_template(), _template()])
    finally:
        sys.settrace(None)
    addresses = {b.data_ptr() for b in again}
    assert address in addresses and held_address not in addresses
    assert torch.empty(0).set_(held_storage).eq(3.0).all()


def test_a_pool_imported_under_a_tracer_still_never_hands_out_a_held_storage():
    """Nothing about the counts is measured once, at import, under whatever the interpreter was
    doing then: a module loaded under a tracer, used without one, still sees a storage object the
    caller holds."""
    spec = importlib.util.spec_from_file_location("buffer_pool_under_a_tracer", buffer_pool.__file__)
    module = importlib.util.module_from_spec(spec)
    sys.settrace(_tracer)
    try:
        spec.loader.exec_module(module)
    finally:
        sys.settrace(None)
    pool = module.BufferPool()
    buffer = pool.take([_template()])[0]
    buffer.fill_(3.0)
    storage = buffer.untyped_storage()
    del buffer
    for _ in range(3):
        pool.take([_template()])[0].fill_(-1.0)
    assert torch.empty(0).set_(storage).eq(3.0).all()
