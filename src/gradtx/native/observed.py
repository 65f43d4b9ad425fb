"""What :func:`gradtx.observe` reads of float32 CPU tensors, taken in passes the step makes anyway.

Eagerly, observing a step costs passes over memory of its own: ``max |g|`` and the non-finite
count over the gradients, and the norms of the params and of the updates. Here they ride along:

- :func:`scale_observed`: a leading clip's scaling (``g * coef``, the ATen product's bits) with
  ``max |g|`` and the non-finite count of ``g`` read in the same pass (``observed.c``);
- :func:`tallying`: within it, the Adam kernel (:mod:`gradtx.native.adam`) adds up the squares of
  the params it reads and of the updates it writes, and records them by tensor;
- :func:`squares`: the same sums (``squares.h``'s order, so the same bits) for a tensor no kernel
  tallied: float32 within blocks of 2048 values, float64 across them;
- :func:`squares_extremes`: those sums with ``max |g|`` and the non-finite count, in one pass: under
  sharding all three must be ready for the one all-reduce before the step runs, and a sharded
  2-norm adds up the same sums (:func:`gradtx.sharding.reductions.piece_squares`).

Before its first use the kernel is checked on probe values against ATen's product and ``aminmax``
and a float64 sum, and kept only if the product and the extremes agree in every bit and the sum
within its rounding.
"""

from __future__ import annotations

import contextlib
import ctypes
from typing import Optional, Sequence

import torch
from torch import Tensor

from gradtx import buffer_pool
from gradtx import tree as tree_lib
from gradtx.native import checks

class _Kernel:
    def __init__(self, lib: ctypes.CDLL):
        scale = lib.gradtx_scale_observed_list_f32
        scale.argtypes = [ctypes.c_void_p, ctypes.c_float, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
        scale.restype = None
        sums = lib.gradtx_squares_f64
        sums.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
        sums.restype = ctypes.c_double
        both = lib.gradtx_squares_extremes_list_f32
        both.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
        both.restype = None
        self.scale_fn, self.squares_fn, self.both_fn = scale, sums, both
        self.calls = self.scaled = self.squared = 0  # calls in all, of scale and of squares (alone or with extremes)

    def scale(self, xs: Sequence[Tensor], factor: float, outs: Sequence[Tensor]) -> tuple[Tensor, Tensor]:
        """``outs[k] = xs[k] * factor``, by one call; returns ``max |x|`` (float32) and the non-finite
        count (int64) of each ``x``."""
        count = len(xs)
        self.calls += 1
        self.scaled += count
        largest, bad = torch.empty(count, dtype=torch.float32), torch.empty(count, dtype=torch.int64)
        pointers = ctypes.c_void_p * count
        self.scale_fn(
            pointers(*[x.data_ptr() for x in xs]), factor, pointers(*[o.data_ptr() for o in outs]),
            (ctypes.c_int64 * count)(*[x.numel() for x in xs]), count, largest.data_ptr(), bad.data_ptr(),
            torch.get_num_threads(),
        )
        return largest, bad

    def squares_extremes(self, xs: Sequence[Tensor]) -> tuple[Tensor, Tensor, Tensor]:
        """Each ``x``'s sum of squares (float64, -1 where it could not be taken), ``max |x|``
        (float32) and non-finite count (int64), by one call."""
        count = len(xs)
        self.calls += 1
        self.squared += count
        sums, largest, bad = torch.empty(count, dtype=torch.float64), torch.empty(count, dtype=torch.float32), torch.empty(count, dtype=torch.int64)
        self.both_fn(
            (ctypes.c_void_p * count)(*[x.data_ptr() for x in xs]), (ctypes.c_int64 * count)(*[x.numel() for x in xs]), count,
            sums.data_ptr(), largest.data_ptr(), bad.data_ptr(), torch.get_num_threads(),
        )
        return sums, largest, bad

    def squares(self, x: Tensor) -> float:
        self.calls += 1
        self.squared += 1
        return self.squares_fn(x.data_ptr(), x.numel(), torch.get_num_threads())


def status() -> str:
    """``"in use"``, or why observe keeps to the ATen ops."""
    return _kernel.status()


def usable() -> Optional[_Kernel]:
    """The checked kernel, or ``None``."""
    return _kernel.usable()


def plain(tensors: Sequence[object]) -> bool:
    """Plain float32 CPU tensors, each contiguous (the kernels read and write them as one run of
    values; ``empty_like`` gives such a tensor's products the same strides)."""
    return all(
        type(t) is Tensor and t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous()  # type: ignore[union-attr]
        for t in tensors
    )


def scale_observed(tensors: Sequence[Tensor], factor: Tensor, *, inplace: bool) -> Optional[tuple[list[Tensor], Tensor, Tensor]]:
    """``(tensors * factor, max |x| per tensor, non-finite count per tensor)`` in one pass each, or
    ``None`` where the kernel does not apply (the caller then scales with the ATen ops). ``factor``:
    a 0-d float32 CPU tensor (in place, when ``inplace``, only a finite ``|factor| <= 1``, as a clip's
    coefficient is); ``tensors``: plain float32 CPU tensors sharing no memory. The products are
    ATen's (``torch.mul``), bit for bit."""
    if torch.compiler.is_compiling() or not isinstance(factor, Tensor) or factor.dtype != torch.float32 or factor.device.type != "cpu":
        return None
    kernel = checks.under_check(_Kernel) or usable()
    if kernel is None or not plain(tensors) or tree_lib.needs_graph(list(tensors), factor):
        return None
    storages = {t.untyped_storage().data_ptr() for t in tensors if t.numel()}
    if len(storages) != sum(1 for t in tensors if t.numel()):
        return None
    value = factor.item()
    if inplace and not abs(value) <= 1.0:  # the count reads the products (observed.c): NaN and |c| > 1 stay out
        return None
    (outs,) = buffer_pool.outputs("observed", (tensors, inplace))
    largest, bad = kernel.scale(tensors, value, outs)
    if inplace and outs:  # written in place: changed, as ATen's in-place ops mark it
        torch.autograd.graph.increment_version(outs)
    return outs, largest, bad.to(torch.float64)


def squares(x: Tensor) -> Optional[float]:
    """The sum of squares of ``x`` (a plain float32 CPU tensor) in the tally's order (float32
    within blocks, float64 across them), or ``None`` where the kernel is not there."""
    kernel = usable()
    if kernel is None or torch.compiler.is_compiling() or not plain((x,)) or tree_lib.needs_graph(x):
        return None
    total = kernel.squares(x)
    return None if total < 0.0 else total  # -1: no memory for the blocks' sums


def squares_extremes(tensors: Sequence[Tensor]) -> Optional[tuple[Tensor, Tensor, Tensor]]:
    """Per tensor of ``tensors`` (plain float32 CPU tensors), in one pass each: the sum of squares
    (float64, :func:`squares`' bits), ``max |x|`` (float32, aminmax's) and the non-finite count
    (float64); ``None`` where the kernel does not apply to all of them."""
    kernel = usable()
    if kernel is None or torch.compiler.is_compiling() or not tensors or not plain(tensors) or tree_lib.needs_graph(list(tensors)):
        return None
    sums, largest, bad = kernel.squares_extremes(tensors)
    if bool((sums < 0.0).any()):  # no memory for some tensor's blocks' sums
        return None
    return sums, largest, bad.to(torch.float64)


# --------------------------------------------------------------------------- the tally


class Tally:
    """Sums of squares a kernel took of the tensors it read or wrote, by tensor: a sum holds while
    the tensor is the one recorded and unchanged since (its version counter; gradtx's kernels bump
    it when they write a tensor in place)."""

    def __init__(self) -> None:
        self._sums: dict[int, tuple[Tensor, int, float]] = {}

    def record(self, tensor: Tensor, total: float) -> None:
        # -1: the kernel could not take it (a NaN is a sum: the tensor holds one); an inference
        # tensor has no version counter, so a change to it could not be seen
        if not total < 0.0 and not tensor.is_inference():
            self._sums[id(tensor)] = (tensor, tensor._version, total)

    def squares(self, tensor: Tensor) -> Optional[float]:
        found = self._sums.get(id(tensor))
        if found is None or found[0] is not tensor or found[1] != tensor._version:
            return None
        return found[2]


def tallying() -> contextlib.AbstractContextManager[Tally]:
    """Within it, this thread's Adam kernel records the sums of squares of the params it reads and
    the updates it writes, in the :class:`Tally` it yields."""
    return checks.thread_setting("tally", Tally())


def current_tally() -> Optional[Tally]:
    """This thread's :class:`Tally`, within :func:`tallying`; else ``None``."""
    return checks.thread_value("tally")


# --------------------------------------------------------------------------- the check


def _build_and_check() -> tuple[Optional[_Kernel], str]:
    return checks.built_and_checked("observed", _Kernel, _mismatch, against="ATen's mul and aminmax")


def _mismatch(kernel: _Kernel) -> str:
    """The first case where the kernel differs from ATen's ``mul`` or ``aminmax`` in any bit, or
    from a float64 sum of squares by more than its rounding, or ``""``."""
    for case, n in enumerate((0, 1, 7, 2049, 66001)):
        x = checks.probe(max(n, 1), 200 + case)[:n]
        finite = torch.nan_to_num(x, nan=0.0, posinf=1.0, neginf=-1.0)
        for values in (x, finite):
            for factor in (0.37, 1.0, 0.0, 1e-30, 3.5e-5):
                coef = torch.tensor(factor, dtype=torch.float32)
                out = torch.empty_like(values)
                largest, counts = kernel.scale([values], coef.item(), [out])
                top, bad = float(largest[0]), int(counts[0])
                want = torch.mul(values, coef)
                if not checks.first_difference([{"x": want}], [{"x": out}]) == "":
                    return f"x * {factor} over {n} values"
                low, high = torch.aminmax(values) if n else (torch.zeros(()), torch.zeros(()))
                expected = torch.maximum(low.abs(), high.abs())
                same = (torch.tensor(top) == expected) | (torch.tensor(top).isnan() & expected.isnan())
                if not bool(same):
                    return f"max |x| over {n} values: {top} against {float(expected)}"
                if bad != int((~torch.isfinite(values)).sum()):
                    return f"the non-finite count over {n} values"
        modest = finite.clamp(-1e15, 1e15)  # squares that float32 holds
        total = kernel.squares(modest)
        exact = float(modest.double().square().sum())
        if not abs(total - exact) <= 1e-5 * exact:  # float32 sums of at most 128 squares each
            return f"the sum of squares over {n} values: {total} against {exact}"
        sums, largest, counts = kernel.squares_extremes([modest, x])
        expected = torch.tensor([float(torch.maximum(*(v.abs() for v in torch.aminmax(v)))) if n else 0.0 for v in (modest, x)])
        if sums[0].item() != total or not torch.equal(largest.isnan(), expected.isnan()) or not torch.equal(largest.nan_to_num(), expected.nan_to_num()):
            return f"the sum of squares and max |x| over {n} values, in one pass"
        if counts.tolist() != [0, int((~torch.isfinite(x)).sum())]:
            return f"the non-finite count over {n} values, in one pass"
    return ""


_kernel = checks.Lazy(_build_and_check)
