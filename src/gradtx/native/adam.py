"""The eager Adam step of float32 CPU tensors in one pass over memory, with the ATen path's numbers.

gradtx's eager Adam step runs one ATen kernel per operation: eight passes over memory for the
moments, the direction and the decay. ``adam.c`` does the same operations per element in one pass,
each rounded as ATen rounds it, and the square root by the very function torch's ``sqrt`` kernel
calls (MKL's ``vmsSqrt`` where torch exports it). Before its first use, :func:`usable` runs both
on probe values (normal and extreme magnitudes, zeros, infinities, NaNs, subnormals; both branches
of ``lerp``; each kind of weight decay) and keeps the kernel only if every bit agrees; else, or
where it cannot be built, gradtx keeps to the ATen ops and :func:`status` says why.

Used only where it changes nothing but the speed: not while compiling or where a graph is
recorded, and only for plain float32 CPU tensors with row-major strides, float ``b1`` and ``b2``,
and no gradient or moment sharing memory with another tensor of the step.
"""

from __future__ import annotations

import ctypes
from typing import Any, Callable, Optional, Sequence

import torch
from torch import Tensor

from gradtx import buffer_pool
from gradtx import tree as tree_lib
from gradtx.native import build, checks, observed

# MKL vector math mode of torch's own calls (ATen/cpu/vml.h): VML_HA | VML_FTZDAZ_OFF | VML_ERRMODE_IGNORE
_MKL_MODE = 0x2 | 0x140000 | 0x100
DECAY_NONE, DECAY_FMA, DECAY_PRODUCT = 0, 1, 2


class _Kernel:
    def __init__(self, lib: ctypes.CDLL, vector_sqrt: Optional[int]):
        fn = lib.gradtx_adam_f32
        fn.argtypes = (
            [ctypes.c_void_p] * 7 + [ctypes.c_int64] + [ctypes.c_float] * 6
            + [ctypes.c_int, ctypes.c_int, ctypes.c_float, ctypes.c_void_p, ctypes.c_longlong, ctypes.c_void_p, ctypes.c_int]
            + [ctypes.c_void_p] * 3
        )
        fn.restype = None
        self.fn, self.vector_sqrt, self.calls = fn, vector_sqrt, 0
        self.set_local_threads = checks.torch_symbol("mkl_set_num_threads_local") if vector_sqrt is not None else None

    def __call__(self, g: Tensor, m: Tensor, v: Tensor, p: Optional[Tensor], mo: Tensor, vo: Tensor, uo: Tensor,
                 w1: float, b2: float, c2: float, eps: float, step: float, factor: float, decay: int,
                 sums: Optional[ctypes.Array] = None, grad_scale: Optional[float] = None,
                 extremes: Optional[tuple[ctypes.c_float, ctypes.c_int64]] = None) -> None:
        """One leaf's step; with ``sums`` (two doubles), also the tally of ``uo`` and ``p`` (``p`` is
        then read even without decay); with ``grad_scale`` (a float32 value), the step of
        ``g * grad_scale``; with ``extremes``, the raw ``g``'s ``max |g|`` and non-finite count."""
        self.calls += 1
        largest, nonfinite = (ctypes.byref(extremes[0]), ctypes.byref(extremes[1])) if extremes is not None else (None, None)
        self.fn(
            g.data_ptr(), m.data_ptr(), v.data_ptr(), p.data_ptr() if p is not None else None,
            mo.data_ptr(), vo.data_ptr(), uo.data_ptr(), g.numel(),
            w1, b2, c2, eps, step, factor, decay, grad_scale is not None, 1.0 if grad_scale is None else grad_scale,
            self.vector_sqrt, _MKL_MODE, self.set_local_threads, torch.get_num_threads(), sums, largest, nonfinite,
        )


def _torch_vector_sqrt() -> Optional[int]:
    """MKL's ``vmsSqrt``, which torch's CPU ``sqrt`` kernel calls where torch links MKL."""
    return checks.torch_symbol("vmsSqrt")


def status() -> str:
    """``"in use"``, or why the eager Adam step keeps to the ATen ops."""
    return _kernel.status()


def usable() -> Optional[_Kernel]:
    """The checked kernel, or ``None``."""
    return _kernel.usable()


def built_and_checked(make: Callable[[ctypes.CDLL, Optional[int]], Any], mismatch: Callable[[Any], str]) -> tuple[Optional[Any], str]:
    """A kernel of ``adam.c``, ``make(library, vector_sqrt)``, with torch's own square root if its
    numbers then match the ATen ops (``mismatch(kernel) == ""``), else with ``sqrtf`` if they do
    then, else ``None`` and why."""
    lib, why = build.load("adam")
    if lib is None:
        return None, why
    for vector_sqrt in dict.fromkeys((_torch_vector_sqrt(), None)):  # torch's own sqrt first
        kernel = make(lib, vector_sqrt)
        difference = mismatch(kernel)
        if not difference:
            return kernel, ""
    return None, f"its numbers differ from the ATen ops on this machine ({difference})"


def _build_and_check() -> tuple[Optional[_Kernel], str]:
    return built_and_checked(_Kernel, _mismatch)


_kernel = checks.Lazy(_build_and_check)


def step(
    g: Sequence[Tensor], m: Sequence[Tensor], v: Sequence[Tensor], decayed: Sequence[bool], p: Sequence[Any], *,
    b1: Any, b2: Any, eps: Tensor, step: Any, factor: Any, inplace: bool, own_updates: bool,
    grad_scale: Any = None, scaling: Any = None,
) -> Optional[tuple[list[Tensor], list[Tensor], list[Tensor]]]:
    """``(updates, mu, nu)`` of one group of a plain Adam step by the kernel, or ``None`` where it
    does not apply (the caller then runs the ATen ops). Arguments as in ``gradtx.transforms.adam``;
    ``grad_scale`` (a 0-d tensor or a number, else ``None``): the step of ``g * grad_scale``, the
    product taken where the kernel reads ``g``; ``scaling``: a :data:`gradtx.base.Scaling` the
    caller would scale by, which the kernel stands in for only when it takes the raw gradients'
    extremes (``scaling.absorbed(tensors, maxima, counts, factor)``, ``factor`` the float32 value
    it multiplied by), else ``None`` is returned."""
    if not (isinstance(b1, float) and isinstance(b2, float)) or torch.compiler.is_compiling():
        return None
    if scaling is not None and (grad_scale is None or not hasattr(scaling, "absorbed")):
        return None
    kernel = checks.under_check(_Kernel) or usable()
    if kernel is None or not _plain(g, m, v, decayed, p) or tree_lib.needs_graph(grad_scale):
        return None
    decay = DECAY_PRODUCT if isinstance(factor, Tensor) else DECAY_FMA  # as ``_add_scaled`` adds it
    factor = checks.float32(factor) if any(decayed) else 0.0
    floats = (1.0 - b1, b2, 1.0 - b2, checks.float32(eps), checks.float32(step), factor)
    scale = None if grad_scale is None else checks.float32(grad_scale)
    uo, mo, vo = buffer_pool.outputs("adam", (g, own_updates), (m, inplace), (v, inplace))
    tally = observed.current_tally()
    found: list[tuple[Tensor, Optional[Tensor], float, float]] = []  # (update, param read, their sums)
    sums = (ctypes.c_double * 2)() if tally is not None else None
    extremes = (ctypes.c_float(), ctypes.c_int64()) if scaling is not None else None
    maxima, counts = [], []
    stored = None if tally is None or all(decayed) else {x.untyped_storage().data_ptr() for x in (*g, *m, *v) if x.numel()}
    for i in range(len(g)):
        read = p[i] if decayed[i] or (stored is not None and _tallied_param(p[i], g[i], stored)) else None
        kernel(g[i], m[i], v[i], read, mo[i], vo[i], uo[i], *floats, decay if decayed[i] else DECAY_NONE, sums, scale, extremes)
        if sums is not None and g[i].numel():
            found.append((uo[i], read, sums[0], sums[1]))
        if extremes is not None:
            maxima.append(extremes[0].value)
            counts.append(extremes[1].value)
    if scaling is not None:
        scaling.absorbed(list(g), maxima, counts, scale)
    # written in place: marked changed, as ATen's in-place ops mark them (autograd, and the tally,
    # read the version counter)
    changed = (list(mo) + list(vo) if inplace else []) + (list(uo) if own_updates else [])
    if changed:
        torch.autograd.graph.increment_version(changed)
    if tally is not None:
        for update, param, update_sum, param_sum in found:
            tally.record(update, update_sum)
            if param is not None:
                tally.record(param, param_sum)
    return uo, mo, vo


def _tallied_param(p: Any, g: Tensor, written: set[int]) -> bool:
    """Whether ``p``, not otherwise read, may be read for the tally: a plain float32 tensor laid out
    as ``g``, sharing no memory with what the step writes."""
    return (
        isinstance(p, Tensor) and not p.requires_grad and checks.plain_float32((p,), g.numel(), g.stride())
        and p.untyped_storage().data_ptr() not in written
    )


def _plain(g, m, v, decayed, p) -> bool:
    """:func:`checks.plain_and_apart`, each gradient and its moments written, a decayed param read;
    nothing that records a graph."""
    if tree_lib.needs_graph(list(g), list(m), list(v), [x for x, d in zip(p, decayed) if d]):
        return False
    return checks.plain_and_apart(list(zip(g, m, v)), [x if d else None for x, d in zip(p, decayed)])


# --------------------------------------------------------------------------- the check


def _mismatch(kernel: _Kernel) -> str:
    """The first case where the kernel's step differs from the ATen ops' in any bit, or ``""``."""
    from gradtx.chains.chain import chain
    from gradtx.transforms.adam import fused_adam
    from gradtx.transforms.clipping import clip_by_global_norm

    cases = [  # (b1, b2, eps, learning rate, weight decay): both lerp branches, each kind of decay
        (0.9, 0.999, 1e-8, 1e-3, 0.1),
        (0.3, 0.5, 1e-3, 0.5, None),
        (0.0, 0.95, 1e-6, lambda count: 1e-2 / (1.0 + count), 0.05),
    ]
    for number, (b1, b2, eps, lr, wd) in enumerate(cases):
        tx = fused_adam(lr, b1, b2, eps, weight_decay=wd)
        difference = checks.difference_from_aten(kernel, tx, number, lambda out, state: (out, state[0].mu, state[0].nu))
        if difference:
            return f"b1={b1}, b2={b2}, eps={eps}: {difference}"
    # a clip's coefficient handed to the step (gradtx.chain): the product taken in the kernel; and
    # within observe's tally, whose loop writes the decayed updates itself
    clipped = chain(clip_by_global_norm(0.37), fused_adam(1e-3, weight_decay=0.1))
    with observed.tallying():
        difference = checks.difference_from_aten(kernel, clipped, 0, lambda out, state: (out, state[1][0].mu, state[1][0].nu))
    return f"with a clip's coefficient, tallied: {difference}" if difference else ""
