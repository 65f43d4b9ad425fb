"""``apply_updates``' new params of float32 CPU tensors, ``p + u`` stored past the cache.

A pure step writes its new params into buffers recycled from earlier steps' (see
:mod:`gradtx.buffer_pool`), which are not in cache: ATen's ``add(out=)`` reads each line in before
it writes it. ``add.c`` writes them by non-temporal stores, with ATen's numbers (one rounding),
checked against ``torch.add`` on probe values before its first use.
"""

from __future__ import annotations

import ctypes
from typing import Optional

import torch
from torch import Tensor

from gradtx.native import checks


class _Kernel:
    def __init__(self, lib: ctypes.CDLL):
        fn = lib.gradtx_add_f32
        fn.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64, ctypes.c_int]
        fn.restype = None
        self.fn, self.calls = fn, 0

    def __call__(self, p: Tensor, u: Tensor, out: Tensor) -> Tensor:
        """``out = p + u`` (float32, CPU, row-major, one size; ``out`` shares memory with neither)."""
        self.calls += 1
        self.fn(p.data_ptr(), u.data_ptr(), out.data_ptr(), p.numel(), torch.get_num_threads())
        return out


def status() -> str:
    """``"in use"``, or why ``apply_updates`` keeps to ATen's ``add``."""
    return _kernel.status()


def usable() -> Optional[_Kernel]:
    """The checked kernel, or ``None``."""
    return _kernel.usable()


def add_into(p: Tensor, u: Tensor, out: Tensor) -> Tensor:
    """``torch.add(p, u, out=out)``, by the kernel where it applies (eagerly: plain float32 CPU
    tensors of one shape, row-major, nothing that records a graph), else by ATen."""
    kernel = None if torch.compiler.is_compiling() else usable()
    if kernel is None or not _plain(p, u, out):
        return torch.add(p, u, out=out)
    kernel(p, u, out)
    torch.autograd.graph.increment_version(out)  # written as ATen's out= marks it
    return out


def _plain(p: Tensor, u: Tensor, out: Tensor) -> bool:
    if p.requires_grad or u.requires_grad or out.requires_grad:
        return False
    return checks.plain_and_apart([(out,)], [p]) and checks.plain_and_apart([(out,)], [u])


def _build_and_check() -> tuple[Optional[_Kernel], str]:
    return checks.built_and_checked("add", _Kernel, _mismatch, against="torch.add")


def _mismatch(kernel: _Kernel) -> str:
    """The first size where the kernel's sums differ from ``torch.add``'s in any bit, or ``""``."""
    for number, n in enumerate((1, 7, 8, 2047, 2048, 2049, 70001)):  # around the blocks and vector widths
        p, u = checks.probe(n, 2 * number), checks.probe(n, 2 * number + 1)
        out = torch.empty(n + 8)[8:]  # 32-byte aligned: the non-temporal stores
        kernel(p, u, out)
        odd = torch.empty(n + 1)[1:]  # not aligned: ordinary stores
        kernel(p, u, odd)
        want = torch.add(p, u)
        for got in (out, odd):
            if not torch.equal(got.view(torch.int32), want.view(torch.int32)):
                return f"{n} values: not torch.add's bits"
    return ""


_kernel = checks.Lazy(_build_and_check)
