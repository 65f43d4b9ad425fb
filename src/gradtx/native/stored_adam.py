"""The eager Adam step on moments stored in 8 bits (``quantize_state(adamw(...), 8)``) in one pass,
with the numbers of reading the moments back, stepping and storing them again.

``quantize_state`` otherwise reads a group of leaves' moments back into float32, runs the Adam step
on them and encodes the new ones: five passes over float32 moments and a group's worth of them in
memory. ``adam.c``'s ``gradtx_adam_stored_f32`` does it a block at a time: the block's codes read
back, the Adam step of :mod:`gradtx.native.adam`, the new block's absmax and codes
(:mod:`gradtx.native.codebook`'s, from ``codebook.h``); no moment exists in float32 outside a block.

How it is reached: :func:`gradtx.quantize_state` takes this route only for an inner transformation
that declares it (:func:`declare`: ``adam``, ``adamw``, ``fused_adam`` without Nesterov, ``eps_root``
or a low-precision ``mu``), for 8-bit storage, and when every stored leaf is a plain float32 CPU
tensor the kernel takes. It calls the inner update once on the whole tree, with the stored leaves'
placeholders in its state, inside :func:`stored_moments`, which tells the Adam step (by the
placeholders' identity) which moments are stored and where their new codes go. Before its first use
the route runs beside the other one on probe values and is kept only if every bit agrees.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
from typing import Any, Callable, NamedTuple, Optional

import torch
from torch import Tensor

from gradtx import buffer_pool
from gradtx.native import adam as native_adam
from gradtx.native import checks
from gradtx.native import codebook as native_codebook

MAX_BLOCK = 2048  # the kernel's block buffers
_MARK = "_gradtx_takes_stored_moments"


class Stored(NamedTuple):
    """One stored leaf's moments: ``mu``'s and ``nu``'s codes (``uint8``, shaped as the param) and
    block scales (float32, ``rows x blocks``), whether each is stored with the signed map, the
    block length and the code book."""

    mu_codes: Tensor
    mu_scales: Tensor
    nu_codes: Tensor
    nu_scales: Tensor
    mu_signed: bool
    nu_signed: bool
    block_size: int
    book: Any


class _Step:
    """The moments of one call of an Adam update on stored state: by the id of each stored leaf's
    ``mu`` placeholder, its :class:`Stored` moments and its ``nu`` placeholder; the new codes and
    scales go to ``results``."""

    def __init__(self, moments: dict[int, tuple[Stored, Tensor, Tensor]]):
        self.moments = moments
        self.results: dict[int, tuple[Tensor, Tensor, Tensor, Tensor]] = {}


def declare(update_fn: Callable, takes: bool = True) -> Callable:
    """Marks an Adam update (when ``takes``) as one that steps moments stored in 8 bits within :func:`stored_moments`."""
    if takes:
        setattr(update_fn, _MARK, True)
    return update_fn


def declared(update_fn: Callable) -> bool:
    return bool(getattr(update_fn, _MARK, False))


def stored_moments(moments: dict[int, tuple[Stored, Tensor, Tensor]]) -> contextlib.AbstractContextManager[_Step]:
    """Within it, this thread's Adam update steps the moments whose placeholders (``mu``'s id, then
    ``(Stored, mu placeholder, nu placeholder)``) are given, writing their new codes and scales to
    the ``results`` of what it yields, by the same id."""
    return checks.thread_setting("stored_moments", _Step(moments))


def current() -> Optional[_Step]:
    """The stored moments of the Adam update being run, or ``None``."""
    return checks.thread_value("stored_moments")


class _Kernel:
    def __init__(self, lib: ctypes.CDLL, adam: native_adam._Kernel):
        fn = lib.gradtx_adam_stored_f32
        fn.argtypes = (
            [ctypes.c_void_p] * 11 + [ctypes.c_int64] * 4 + [ctypes.c_float] * 6
            + [ctypes.c_int, ctypes.c_int, ctypes.c_float, ctypes.c_void_p, ctypes.c_int32]
            + [ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p] + [ctypes.c_int32] * 4
            + [ctypes.c_void_p, ctypes.c_longlong, ctypes.c_void_p, ctypes.c_int]
        )
        fn.restype = None
        self.fn, self.adam, self.calls = fn, adam, 0

    def __call__(self, g: Tensor, p: Optional[Tensor], moments: Stored, out: tuple[Tensor, Tensor, Tensor, Tensor], uo: Tensor,
                 floats: tuple[float, ...], decay: int, tables: Any, grad_scale: Optional[float] = None) -> None:
        self.calls += 1
        columns = g.shape[-1] if g.ndim else 1
        rows = g.numel() // columns if columns else 0
        blocks = -(-columns // moments.block_size)
        mco, mso, vco, vso = out
        self.fn(
            g.data_ptr(), p.data_ptr() if p is not None else None,
            moments.mu_codes.data_ptr(), moments.mu_scales.data_ptr(), moments.nu_codes.data_ptr(), moments.nu_scales.data_ptr(),
            mco.data_ptr(), mso.data_ptr(), vco.data_ptr(), vso.data_ptr(), uo.data_ptr(),
            rows, columns, moments.block_size, blocks, *floats, decay, grad_scale is not None,
            1.0 if grad_scale is None else grad_scale, moments.book._joint.data_ptr(), 2**moments.book.bits,
            int(moments.mu_signed), int(moments.nu_signed), tables.signed.data_ptr(), tables.unsigned.data_ptr(),
            native_codebook.SHIFT, tables.low, tables.last, moments.book._zero,
            self.adam.vector_sqrt, native_adam._MKL_MODE, self.adam.set_local_threads, torch.get_num_threads(),
        )


def status() -> str:
    """``"in use"``, or why ``quantize_state`` steps Adam's stored moments by reading them back instead."""
    return _kernel.status()


def usable() -> Optional[_Kernel]:
    """The checked kernel, or ``None``."""
    return checks.under_check(_Kernel) or _kernel.usable()


class Leaf(NamedTuple):
    """One stored leaf of a step: its gradient, its param (``None`` without decay), its moments and
    the decay kind :func:`gradtx.native.adam.step` passes."""

    grad: Tensor
    param: Optional[Tensor]
    moments: Stored
    decay: int


def steps(
    leaves: list[Leaf], *, floats: tuple[float, ...], own_update: bool, grad_scale: Optional[float] = None,
) -> list[tuple[Tensor, tuple[Tensor, Tensor, Tensor, Tensor]]]:
    """Each stored leaf's update and new ``(mu codes, mu scales, nu codes, nu scales)``. ``floats``
    as :func:`gradtx.native.adam.step` passes them; ``grad_scale`` (a float32 value, else
    ``None``): the step of ``g * grad_scale``, a clip's coefficient taken where the kernel reads
    ``g``. The outputs of all the leaves come from one call of the buffer pool (one generation of
    it, so the next step finds them all free). The caller has checked the leaves (:func:`takes`)."""
    kernel = usable()
    if kernel is None:
        raise RuntimeError("gradtx: the stored-moment Adam kernel was chosen but is not there")
    stored = [t for leaf in leaves for t in (leaf.moments.mu_codes, leaf.moments.mu_scales, leaf.moments.nu_codes, leaf.moments.nu_scales)]
    new, updates = buffer_pool.outputs("stored_adam", (stored, False), ([leaf.grad for leaf in leaves], own_update))
    results = []
    for i, leaf in enumerate(leaves):
        tables = native_codebook.lookup(leaf.moments.book)
        if tables is None:
            raise RuntimeError("gradtx: the stored-moment Adam kernel was chosen but is not there")
        out, uo = tuple(new[4 * i : 4 * i + 4]), updates[i]
        kernel(leaf.grad, leaf.param, leaf.moments, out, uo, floats, leaf.decay, tables, grad_scale)
        if own_update and leaf.grad.numel():  # written in place: changed, as ATen's in-place ops mark it
            torch.autograd.graph.increment_version(uo)
        results.append((uo, out))
    return results  # type: ignore[return-value]


def takes(moments: Stored, grad: Any, param: Any) -> bool:
    """Whether the kernel takes this stored leaf: a plain float32 CPU gradient (and param, where
    given) with row-major strides, its codes and scales contiguous, blocks of at most
    :data:`MAX_BLOCK`, a code book of 8-bit tables."""
    from gradtx.quantization.maps import TableCodec

    if not isinstance(moments.book, TableCodec) or moments.book.bits != 8 or not 1 <= moments.block_size <= MAX_BLOCK:
        return False
    if native_codebook.lookup(moments.book) is None or not isinstance(grad, Tensor):
        return False
    n, strides = grad.numel(), checks.row_major(grad.shape)
    if not checks.plain_float32([grad] + ([param] if param is not None else []), n, strides):
        return False
    columns = grad.shape[-1] if grad.ndim else 1
    blocks = (n // columns if columns else 0) * -(-columns // moments.block_size)
    for codes, scales in ((moments.mu_codes, moments.mu_scales), (moments.nu_codes, moments.nu_scales)):
        if type(codes) is not Tensor or codes.dtype != torch.uint8 or codes.shape != grad.shape or not codes.is_contiguous():
            return False
        if type(scales) is not Tensor or scales.dtype != torch.float32 or scales.numel() != blocks or not scales.is_contiguous():
            return False
        if codes.device.type != "cpu" or scales.device.type != "cpu":
            return False
    return True


# --------------------------------------------------------------------------- the check


def _build_and_check() -> tuple[Optional[_Kernel], str]:
    adam = native_adam.usable()
    if adam is None:
        return None, f"the Adam kernel is not in use ({native_adam.status()})"
    return checks.built_and_checked("adam", lambda lib: _Kernel(lib, adam), _mismatch, "reading back, stepping and storing")


def _mismatch(kernel: _Kernel) -> str:
    """The first case where the route's updates, codes or scales differ from the other route's in any bit, or ``""``."""
    import gradtx as gtx
    from gradtx.base import scaled_update_of
    from gradtx.transforms.adam import fused_adam

    cases = [  # (b1, b2, learning rate, weight decay, block size, a clip's coefficient handed to the step)
        (0.9, 0.999, 1e-3, 0.1, 256, None),
        (0.3, 0.5, lambda count: 1e-2 / (1.0 + count), None, 64, 0.3711),
        (0.0, 0.95, 0.5, 0.05, 2048, 1.7),
    ]
    for number, (b1, b2, lr, wd, block_size, coefficient) in enumerate(cases):
        tx = gtx.quantize_state(fused_adam(lr, b1, b2, weight_decay=wd), 8, block_size=block_size, min_size=1)
        update = tx.update if coefficient is None else functools.partial(
            scaled_update_of(tx.update), grad_scale=torch.tensor(coefficient)
        )
        params = {"a": checks.probe(4099, number).reshape(1, 4099), "b": checks.probe(66001, 10 + number)}
        results = []
        for reference in (True, False):
            with checks.aten_only() if reference else checks.checking(kernel):
                state, out = tx.init(params), None
                for t in range(3):
                    grads = {k: checks.probe(x.numel(), 100 * t + number).reshape(x.shape) for k, x in params.items()}
                    out, state = update(grads, state, params)
            results.append([out, *state.codes, *state.scales])
        if not kernel.calls:
            return "the check never reached the kernel"
        difference = checks.first_difference(
            [{k: v.to(torch.float32) for k, v in tree.items()} for tree in results[0]],
            [{k: v.to(torch.float32) for k, v in tree.items()} for tree in results[1]],
        )
        if difference:
            return f"b1={b1}, b2={b2}, block_size={block_size}, coefficient={coefficient}: {difference}"
    return ""


_kernel = checks.Lazy(_build_and_check)
