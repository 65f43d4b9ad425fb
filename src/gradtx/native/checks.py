"""What every C kernel of gradtx shares: when it may run, and the check of its numbers.

A kernel replaces a sequence of ATen ops only where that changes nothing but the speed; before its
first use it runs beside those ops on probe values and is kept only if every bit agrees.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence

import torch
from torch import Tensor

from gradtx import torch_internals
from gradtx.buffer_pool import row_major
from gradtx.native import build

# Per thread: ``reference`` (ATen ops only, :func:`aten_only`), ``checking`` (the kernel under check).
_state = threading.local()


class Lazy:
    """A kernel built and checked on first use, once per process: ``make()`` returns it and ``""``,
    or ``None`` and why not."""

    def __init__(self, make: Callable[[], tuple[Optional[Any], str]]):
        self._make, self._lock, self._result = make, threading.RLock(), None

    def result(self) -> tuple[Optional[Any], str]:
        if self._result is None:
            with self._lock:
                if self._result is None:
                    self._result = self._make()
        return self._result

    def status(self) -> str:
        """``"in use"``, or why the step keeps to the ATen ops."""
        kernel, why = self.result()
        return "in use" if kernel is not None else why

    def usable(self) -> Optional[Any]:
        """The checked kernel, or ``None``: also within :func:`aten_only`, and while a ``torch.func``
        transform runs (its tensors are wrappers, and the check's random probes would fail under
        ``vmap``: it is not run there, and runs at the next use outside)."""
        if reference_only() or torch_internals.functorch_active():
            return None
        return self.result()[0]


@contextlib.contextmanager
def thread_setting(name: str, value: Any, default: Any = None) -> Iterator[Any]:
    """This thread's ``name`` set to ``value`` within it (which it yields), and as it was after:
    the kernels' per-thread switches and records."""
    before = getattr(_state, name, default)
    setattr(_state, name, value)
    try:
        yield value
    finally:
        setattr(_state, name, before)


def thread_value(name: str, default: Any = None) -> Any:
    """This thread's ``name``, as :func:`thread_setting` set it, else ``default``."""
    return getattr(_state, name, default)


def aten_only() -> contextlib.AbstractContextManager:
    """Within it, this thread's steps run the ATen ops one at a time, never a C kernel nor a loop
    compiled by Inductor (the checks and the tests)."""
    return thread_setting("reference", True, False)


def reference_only() -> bool:
    return thread_value("reference", False)


def checking(kernel: Any) -> contextlib.AbstractContextManager:
    """Within it, this thread's steps run ``kernel``, before it is known to be right (another
    kernel's check, started within it, leaves it as it was)."""
    return thread_setting("checking", kernel)


def built_and_checked(
    source: str, make: Callable[[Any], Any], mismatch: Callable[[Any], str], against: str = "the ATen ops"
) -> tuple[Optional[Any], str]:
    """The kernel ``make(library)`` of ``<source>.c`` and ``""`` when ``mismatch(kernel)`` finds no
    difference from ``against``, else ``None`` and why (no library, or the first difference)."""
    lib, why = build.load(source)
    if lib is None:
        return None, why
    kernel = make(lib)
    difference = mismatch(kernel)
    return (None, f"its numbers differ from {against} on this machine ({difference})") if difference else (kernel, "")


def under_check(kind: type) -> Optional[Any]:
    kernel = thread_value("checking")
    return kernel if isinstance(kernel, kind) else None


def float32(value: Any) -> float:
    """The value ATen multiplies by: a 0-d tensor or a number, rounded to float32."""
    if isinstance(value, Tensor):
        return value.to(torch.float32).item()
    return float(torch.tensor(value, dtype=torch.float32))


def plain_float32(tensors: Sequence[Any], n: int, strides: tuple[int, ...]) -> bool:
    """Whether each of ``tensors`` is a plain float32 CPU tensor of ``n`` values with ``strides``."""
    for x in tensors:
        if type(x) is not Tensor or x.dtype != torch.float32 or x.device.type != "cpu":
            return False
        if x.numel() != n or x.stride() != strides:
            return False
    return True


def plain_and_apart(written: Sequence[Sequence[Any]], read: Sequence[Optional[Any]]) -> bool:
    """Whether each position ``i`` holds plain float32 CPU tensors of one size with row-major
    strides (a size-1 dimension's stride too: new outputs get those): those a kernel writes,
    ``written[i]``, and the one it only reads, ``read[i]`` (or ``None``); and no written tensor
    shares memory with another tensor of the group (the ATen ops go a list at a time, a kernel a
    position at a time: where a buffer one writes is read elsewhere, the order would show). Read
    tensors may repeat (tied params)."""
    written_storages: set[int] = set()
    read_storages: set[int] = set()
    count = 0
    for roles, only_read in zip(written, read):
        n = roles[0].numel()
        if not plain_float32(tuple(roles) if only_read is None else (*roles, only_read), n, row_major(roles[0].shape)):
            return False
        if n:
            count += len(roles)
            written_storages.update(x.untyped_storage().data_ptr() for x in roles)
            if only_read is not None:
                read_storages.add(only_read.untyped_storage().data_ptr())
    return len(written_storages) == count and not written_storages & read_storages


def torch_symbol(name: str) -> Optional[int]:
    """The address of an MKL function in torch's CPU library, where torch links MKL and exports it."""
    if not torch.backends.mkl.is_available():
        return None
    try:
        lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
        return ctypes.cast(getattr(lib, name), ctypes.c_void_p).value
    except (OSError, AttributeError):
        return None


def probe(n: int, seed: int) -> Tensor:
    """Check values: normal and extreme magnitudes, with zeros, infinities, NaNs and subnormals."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=gen) * torch.exp(torch.randn(n, generator=gen) * 6)
    extremes = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e-40, -1e-44, 3e38, -3e38, 1e-19])
    where = torch.randint(0, n, (n // 40,), generator=gen)
    x[where] = extremes[torch.randint(0, len(extremes), (len(where),), generator=gen)]
    return x


def first_difference(want: Sequence[Mapping[str, Tensor]], got: Sequence[Mapping[str, Tensor]]) -> str:
    """``""`` where the trees of tensors agree in every bit (NaN where NaN; a zero's sign too, which
    ``==`` does not see), else what differs."""
    for want_tree, got_tree in zip(want, got):
        for key in want_tree:
            a, b = want_tree[key], got_tree[key]
            same = ((a == b) & (torch.signbit(a) == torch.signbit(b))) | (a.isnan() & b.isnan())
            if not bool(same.all()):
                return f"{int((~same).sum())} of {same.numel()} values of {key!r}"
    return ""


def difference_from_aten(kernel: Any, tx: Any, case: int, read: Callable[[Any, Any], Sequence[Mapping[str, Tensor]]]) -> str:
    """Two steps of the transformation ``tx`` on probe values (seeded by ``case``; case 0 adds a
    leaf long enough for the kernel's threads; the second step starts from a state that is not 0),
    once by the ATen ops and once by ``kernel``: ``""`` where every bit of ``read(updates, state)``
    agrees, else what differs."""
    params = {"a": probe(4099, case)}
    if not case:
        params["b"] = probe(66001, 10)
    results = []
    for reference in (True, False):
        with aten_only() if reference else checking(kernel):
            state, out = tx.init(params), None
            for step in range(2):
                grads = {k: probe(x.numel(), 100 * step + case) for k, x in params.items()}
                out, state = tx.update(grads, state, params)
        results.append(read(out, state))
    if not kernel.calls:
        return "the check never reached the kernel"
    return first_difference(results[0], results[1])
