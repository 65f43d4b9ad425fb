"""The eager AMSGrad step (``gradtx.amsgrad``, ``scale_by_amsgrad``) of float32 CPU tensors in one
pass over memory, with the ATen path's numbers.

The ATen path makes a dozen passes: the two moments, the corrected second moment, its running
maximum, the square root, ``eps``, the division and the factors. ``adam.c``'s
``gradtx_amsgrad_f32`` does the same operations per element, each rounded as ATen rounds it, the
square root by the function torch's ``sqrt`` kernel calls (as :mod:`gradtx.native.adam`). It is
checked against the ATen ops on probe values before its first use, and used only for plain float32
CPU tensors with row-major strides and no gradient or state tensor sharing memory with another
tensor of the step.
"""

from __future__ import annotations

import ctypes
from typing import Any, Optional, Sequence

import torch
from torch import Tensor

from gradtx import buffer_pool
from gradtx import tree as tree_lib
from gradtx.native import checks
from gradtx.native.adam import _MKL_MODE, built_and_checked


class _Kernel:
    def __init__(self, lib: ctypes.CDLL, vector_sqrt: Optional[int]):
        fn = lib.gradtx_amsgrad_f32
        fn.argtypes = (
            [ctypes.c_void_p] * 8 + [ctypes.c_int64, ctypes.c_float, ctypes.c_float, ctypes.c_float, ctypes.c_int]
            + [ctypes.c_float] * 3 + [ctypes.c_int, ctypes.c_float, ctypes.c_int, ctypes.c_float]
            + [ctypes.c_void_p, ctypes.c_longlong, ctypes.c_void_p, ctypes.c_int]
        )
        fn.restype = None
        self.fn, self.vector_sqrt, self.calls = fn, vector_sqrt, 0
        self.set_local_threads = checks.torch_symbol("mkl_set_num_threads_local") if vector_sqrt is not None else None

    def __call__(self, g: Tensor, m: Tensor, v: Tensor, vm: Tensor, mo: Tensor, vo: Tensor, vmo: Tensor, uo: Tensor,
                 w1: float, b2: float, c2: float, ibc2: Optional[float], eps: float, hat: float,
                 step: Optional[float] = None, grad_scale: Optional[float] = None) -> None:
        """One leaf's step: ``ibc2`` (else ``None``) corrects the second moment before its
        maximum; ``hat`` multiplies the direction, then ``step`` (else ``None``); with
        ``grad_scale`` (a float32 value), the step of ``g * grad_scale``."""
        self.calls += 1
        self.fn(
            *(x.data_ptr() for x in (g, m, v, vm, mo, vo, vmo, uo)), g.numel(), w1, b2, c2,
            ibc2 is not None, 1.0 if ibc2 is None else ibc2, eps, hat, step is not None, 1.0 if step is None else step,
            grad_scale is not None, 1.0 if grad_scale is None else grad_scale,
            self.vector_sqrt, _MKL_MODE, self.set_local_threads, torch.get_num_threads(),
        )


def status() -> str:
    """``"in use"``, or why the eager AMSGrad step keeps to the ATen ops."""
    return _kernel.status()


def usable() -> Optional[_Kernel]:
    """The checked kernel, or ``None``."""
    return _kernel.usable()


def _build_and_check() -> tuple[Optional[_Kernel], str]:
    return built_and_checked(_Kernel, _mismatch)


def step(
    g: Sequence[Tensor], m: Sequence[Tensor], v: Sequence[Tensor], vm: Sequence[Tensor], *, b1: Any, b2: Any,
    inv_bc2: Any, eps: float, hat: Any, step: Any, inplace: bool, own_updates: bool, grad_scale: Any = None,
) -> Optional[tuple[list[Tensor], list[Tensor], list[Tensor], list[Tensor]]]:
    """``(updates, mu, nu, nu_max)`` of one group of an AMSGrad step by the kernel, or ``None``
    where it does not apply (the caller then runs the ATen ops). ``inv_bc2``, ``hat`` and ``step``
    (0-d tensors or numbers; ``inv_bc2`` and ``step`` may be ``None``) as ``scale_by_amsgrad`` and
    the learning rate apply them; ``inplace``: the state is written in its buffers, ``own_updates``:
    the updates in the gradients'; ``grad_scale``: the step of ``g * grad_scale``."""
    if not (isinstance(b1, float) and isinstance(b2, float)) or torch.compiler.is_compiling():
        return None
    kernel = checks.under_check(_Kernel) or usable()
    if kernel is None or not _plain(g, m, v, vm) or tree_lib.needs_graph(grad_scale, step, hat, inv_bc2):
        return None
    scalars = (
        1.0 - b1, b2, 1.0 - b2, None if inv_bc2 is None else checks.float32(inv_bc2), checks.float32(eps),
        checks.float32(hat), None if step is None else checks.float32(step), None if grad_scale is None else checks.float32(grad_scale),
    )
    uo, mo, vo, vmo = buffer_pool.outputs("amsgrad", (g, own_updates), (m, inplace), (v, inplace), (vm, inplace))
    for i in range(len(g)):
        kernel(g[i], m[i], v[i], vm[i], mo[i], vo[i], vmo[i], uo[i], *scalars)
    # written in place: marked changed, as ATen's in-place ops mark them
    changed = [x for x in (mo + vo + vmo if inplace else []) + (uo if own_updates else []) if x.numel()]
    if changed:
        torch.autograd.graph.increment_version(changed)
    return uo, mo, vo, vmo


def _plain(g, m, v, vm) -> bool:
    """:func:`checks.plain_and_apart`, each gradient and its state written; nothing that records a graph."""
    if tree_lib.needs_graph(list(g), list(m), list(v), list(vm)):
        return False
    return checks.plain_and_apart(list(zip(g, m, v, vm)), [None] * len(g))


def _mismatch(kernel: _Kernel) -> str:
    """The first case where the kernel's step differs from the ATen ops' in any bit, or ``""``."""
    from gradtx.chains.chain import chain
    from gradtx.transforms.adam import fused_amsgrad
    from gradtx.transforms.clipping import clip_by_global_norm

    cases = [  # (b1, b2, eps, learning rate, bias corrections): both lerp branches, each correction
        (0.9, 0.999, 1e-8, 1e-3, (True, True)),
        (0.3, 0.5, 1e-3, lambda count: 1e-2 / (1.0 + count), (False, True)),
        (0.6, 0.95, 1e-6, 0.5, (True, False)),
    ]
    for number, (b1, b2, eps, lr, (mu_correction, nu_correction)) in enumerate(cases):
        tx = fused_amsgrad(lr, b1, b2, eps, bias_correction_mu=mu_correction, bias_correction_nu=nu_correction)
        difference = checks.difference_from_aten(kernel, tx, number, lambda out, state: (out, state[0].mu, state[0].nu, state[0].nu_max))
        if difference:
            return f"b1={b1}, b2={b2}, eps={eps}: {difference}"
    # a clip's coefficient handed to the step (gradtx.chain): the product taken in the kernel
    clipped = chain(clip_by_global_norm(0.37), fused_amsgrad(1e-3))
    difference = checks.difference_from_aten(kernel, clipped, 0, lambda out, state: (out, state[1][0].nu_max))
    return f"with a clip's coefficient: {difference}" if difference else ""


_kernel = checks.Lazy(_build_and_check)
