"""The eager momentum step (:func:`gradtx.trace`, and ``sgd`` with momentum) of float32 CPU tensors
in one pass over memory, with the ATen path's numbers.

The ATen path makes three: ``t * decay``, ``+ g``, and a copy for the update (or ``g + decay * t``
with Nesterov), and ``sgd`` a fourth, the learning rate's product. ``momentum.c`` does the same per
element, each operation rounded as ATen rounds it;
as for :mod:`gradtx.native.adam`, it is checked against the ATen ops on probe values before its
first use, and used only for plain float32 CPU tensors with row-major strides, a float ``decay``,
and no trace or gradient sharing memory with another tensor of the step.
"""

from __future__ import annotations

import ctypes
from typing import Any, Optional, Sequence

import torch
from torch import Tensor

from gradtx import buffer_pool
from gradtx import tree as tree_lib
from gradtx.native import checks


class _Kernel:
    def __init__(self, lib: ctypes.CDLL):
        fn = lib.gradtx_trace_f32
        fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64, ctypes.c_float] + [ctypes.c_int, ctypes.c_int, ctypes.c_float] + [ctypes.c_int, ctypes.c_float, ctypes.c_int]
        fn.restype = None
        self.fn, self.calls = fn, 0

    def __call__(self, g: Tensor, t: Tensor, to: Tensor, uo: Tensor, decay: float, nesterov: bool,
                 grad_scale: Optional[float] = None, update_scale: Optional[float] = None) -> None:
        """One leaf's step; with ``grad_scale`` (a float32 value), the step of ``g * grad_scale``;
        with ``update_scale`` (a float32 value), the update multiplied by it."""
        self.calls += 1
        self.fn(
            g.data_ptr(), t.data_ptr(), to.data_ptr(), uo.data_ptr(), g.numel(), decay, int(nesterov),
            grad_scale is not None, 1.0 if grad_scale is None else grad_scale,
            update_scale is not None, 1.0 if update_scale is None else update_scale, torch.get_num_threads(),
        )


def status() -> str:
    """``"in use"``, or why the eager momentum step keeps to the ATen ops."""
    return _kernel.status()


def usable() -> Optional[_Kernel]:
    """The checked kernel, or ``None``."""
    return _kernel.usable()


def _build_and_check() -> tuple[Optional[_Kernel], str]:
    return checks.built_and_checked("momentum", _Kernel, _mismatch)


def step(
    g: Sequence[Tensor], t: Sequence[Tensor], *, decay: Any, nesterov: bool, inplace: bool, own_updates: bool,
    grad_scale: Any = None, update_scale: Any = None,
) -> Optional[tuple[list[Tensor], list[Tensor]]]:
    """``(updates, traces)`` of one group of a momentum step by the kernel, or ``None`` where it
    does not apply (the caller then runs the ATen ops). ``inplace``: the traces are written in
    their buffers; ``own_updates``: the updates in the gradients'. ``grad_scale`` (a 0-d tensor or
    a number, else ``None``): the step of ``g * grad_scale``, the product taken where the kernel
    reads ``g``; ``update_scale`` (likewise): the update multiplied by it, where it is written."""
    if not isinstance(decay, float) or torch.compiler.is_compiling():
        return None
    kernel = checks.under_check(_Kernel) or usable()
    if kernel is None or not _plain(g, t) or tree_lib.needs_graph(grad_scale, update_scale):
        return None
    uo, to = buffer_pool.outputs("momentum", (g, own_updates), (t, inplace))
    factor = checks.float32(decay)
    scale = None if grad_scale is None else checks.float32(grad_scale)
    step_size = None if update_scale is None else checks.float32(update_scale)
    for i in range(len(g)):
        kernel(g[i], t[i], to[i], uo[i], factor, nesterov, scale, step_size)
    # written in place: marked changed, as ATen's in-place ops mark them
    changed = [x for x in (to if inplace else []) + (uo if own_updates else []) if x.numel()]
    if changed:
        torch.autograd.graph.increment_version(changed)
    return uo, to


def _plain(g: Sequence[Any], t: Sequence[Any]) -> bool:
    """:func:`checks.plain_and_apart`, each gradient and its trace written; nothing that records a graph."""
    if tree_lib.needs_graph(list(g), list(t)):
        return False
    return checks.plain_and_apart(list(zip(g, t)), [None] * len(g))


def _mismatch(kernel: _Kernel) -> str:
    """The first case where the kernel's step differs from the ATen ops' in any bit, or ``""``."""
    from gradtx.chains.chain import chain
    from gradtx.transforms.clipping import clip_by_global_norm
    from gradtx.transforms.momentum import fused_sgd, trace

    for number, (decay, nesterov) in enumerate([(0.9, False), (0.9, True), (0.3, True), (0.0, False)]):
        difference = checks.difference_from_aten(kernel, trace(decay, nesterov), number, lambda out, state: (out, state.trace))
        if difference:
            return f"decay={decay}, nesterov={nesterov}: {difference}"
    # a clip's coefficient handed to the step (gradtx.chain): the product taken in the kernel
    clipped = chain(clip_by_global_norm(0.37), trace(0.9, True))
    difference = checks.difference_from_aten(kernel, clipped, 0, lambda out, state: (out, state[1].trace))
    if difference:
        return f"with a clip's coefficient: {difference}"
    # sgd's learning rate, a number and a schedule, multiplied where the update is written (alone:
    # the probes' infinities make a clip's coefficient 0)
    for number, (lr, nesterov) in enumerate([(0.37, False), (lambda count: 1e-2 / (1.0 + count), True)]):
        difference = checks.difference_from_aten(kernel, fused_sgd(lr, 0.9, nesterov), number, lambda out, state: (out, state[0].trace))
        if difference:
            return f"sgd, nesterov={nesterov}: {difference}"
    return ""


_kernel = checks.Lazy(_build_and_check)
