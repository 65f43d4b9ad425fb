"""The eager Lion step (``gradtx.lion``) of float32 CPU tensors in one pass over memory, with the
ATen path's numbers.

The ATen path of ``chain(scale_by_lion, add_decayed_weights, scale_by_learning_rate)`` makes a
dozen passes: the interpolation, its sign, the decay term, the learning rate's product and the
momentum's update. ``lion.c`` does the same per element, each operation rounded as ATen rounds it;
as for :mod:`gradtx.native.adam`, it is checked against the ATen ops on probe values before its
first use, and used only for plain float32 CPU tensors with row-major strides, float ``b1`` and
``b2``, and no gradient or momentum sharing memory with another tensor of the step.
"""

from __future__ import annotations

import ctypes
from typing import Any, Optional, Sequence

import torch
from torch import Tensor

from gradtx import buffer_pool
from gradtx import tree as tree_lib
from gradtx.native import checks

DECAY_NONE, DECAY_FMA, DECAY_PRODUCT = 0, 1, 2


class _Kernel:
    def __init__(self, lib: ctypes.CDLL):
        fn = lib.gradtx_lion_f32
        fn.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64, ctypes.c_float, ctypes.c_float, ctypes.c_int, ctypes.c_float,
                                                ctypes.c_float, ctypes.c_int, ctypes.c_float, ctypes.c_int]
        fn.restype = None
        self.fn, self.calls = fn, 0

    def __call__(self, g: Tensor, m: Tensor, p: Optional[Tensor], mo: Tensor, uo: Tensor, w1: float, w2: float,
                 decay: int, factor: float, step: float, grad_scale: Optional[float] = None) -> None:
        """One leaf's step (``w1 = b1``, ``w2 = 1 - b2``: the interpolations' weights); with
        ``grad_scale`` (a float32 value), the step of ``g * grad_scale``."""
        self.calls += 1
        self.fn(
            g.data_ptr(), m.data_ptr(), p.data_ptr() if p is not None else None, mo.data_ptr(), uo.data_ptr(), g.numel(),
            w1, w2, decay, factor, step, grad_scale is not None, 1.0 if grad_scale is None else grad_scale,
            torch.get_num_threads(),
        )


def status() -> str:
    """``"in use"``, or why the eager Lion step keeps to the ATen ops."""
    return _kernel.status()


def usable() -> Optional[_Kernel]:
    """The checked kernel, or ``None``."""
    return _kernel.usable()


def _build_and_check() -> tuple[Optional[_Kernel], str]:
    return checks.built_and_checked("lion", _Kernel, _mismatch)


def step(
    g: Sequence[Tensor], m: Sequence[Tensor], decayed: Sequence[bool], p: Sequence[Any], *, b1: Any, b2: Any,
    factor: Any, step: Any, inplace: bool, own_updates: bool, grad_scale: Any = None,
) -> Optional[tuple[list[Tensor], list[Tensor]]]:
    """``(updates, mu)`` of one group of a Lion step by the kernel, or ``None`` where it does not
    apply (the caller then runs the ATen ops). ``decayed[i]``: ``p[i] * factor`` is added before
    the product by ``step`` (``-learning_rate``, or ``None``); ``inplace``: the momenta are written
    in their buffers, ``own_updates``: the updates in the gradients'; ``grad_scale``: the step of
    ``g * grad_scale``, the product taken where the kernel reads ``g``."""
    if not (isinstance(b1, float) and isinstance(b2, float)) or torch.compiler.is_compiling():
        return None
    kernel = checks.under_check(_Kernel) or usable()
    if kernel is None or not _plain(g, m, decayed, p) or tree_lib.needs_graph(grad_scale, factor, step):
        return None
    decay = DECAY_PRODUCT if isinstance(factor, Tensor) else DECAY_FMA  # as add_decayed_weights adds it
    wd = checks.float32(factor) if any(decayed) else 0.0
    lr_step = 1.0 if step is None else checks.float32(step)
    scale = None if grad_scale is None else checks.float32(grad_scale)
    uo, mo = buffer_pool.outputs("lion", (g, own_updates), (m, inplace))
    for i in range(len(g)):
        kernel(g[i], m[i], p[i] if decayed[i] else None, mo[i], uo[i], b1, 1.0 - b2, decay if decayed[i] else DECAY_NONE, wd, lr_step, scale)
    # written in place: marked changed, as ATen's in-place ops mark them
    changed = [x for x in (mo if inplace else []) + (uo if own_updates else []) if x.numel()]
    if changed:
        torch.autograd.graph.increment_version(changed)
    return uo, mo


def _plain(g: Sequence[Any], m: Sequence[Any], decayed: Sequence[bool], p: Sequence[Any]) -> bool:
    """:func:`checks.plain_and_apart`, each gradient and its momentum written, a decayed param read;
    nothing that records a graph."""
    if tree_lib.needs_graph(list(g), list(m), [x for x, d in zip(p, decayed) if d]):
        return False
    return checks.plain_and_apart(list(zip(g, m)), [x if d else None for x, d in zip(p, decayed)])


def _mismatch(kernel: _Kernel) -> str:
    """The first case where the kernel's step differs from the ATen ops' in any bit, or ``""``."""
    from gradtx.chains.chain import chain
    from gradtx.transforms.clipping import clip_by_global_norm
    from gradtx.transforms.lion import fused_lion

    cases = [  # (b1, b2, learning rate, weight decay): both branches of each interpolation, each kind of decay
        (0.9, 0.99, 1e-3, 0.1),
        (0.3, 0.2, lambda count: 1e-2 / (1.0 + count), 0.0),
        (0.6, 0.7, 0.5, lambda count: 0.01 * (1.0 + count)),
    ]
    for number, (b1, b2, lr, wd) in enumerate(cases):
        tx = fused_lion(lr, b1, b2, weight_decay=wd)
        difference = checks.difference_from_aten(kernel, tx, number, lambda out, state: (out, state[0].mu))
        if difference:
            return f"b1={b1}, b2={b2}: {difference}"
    # a clip's coefficient handed to the step (gradtx.chain): the product taken in the kernel
    clipped = chain(clip_by_global_norm(0.37), fused_lion(1e-3, weight_decay=0.1))
    difference = checks.difference_from_aten(kernel, clipped, 0, lambda out, state: (out, state[1][0].mu))
    return f"with a clip's coefficient: {difference}" if difference else ""


_kernel = checks.Lazy(_build_and_check)
