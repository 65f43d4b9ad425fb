"""Small helpers shared by the contrib optimizers: scalar hyperparameters as 0-d tensors, the
dtype of optax's scalar state, copies of parameter trees, and donated buffers."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch import Tensor

from gradtx import sharding
from gradtx import tree as tree_lib
from gradtx.transforms import _foreach as fe

DOUBLE_EPS = float(torch.finfo(torch.float64).eps)  # optax's jnp.finfo(float).eps


def lowest_dtype(params: Any) -> torch.dtype:
    """The floating dtype of the least precision among the leaves (optax's ``tree.dtype(params, 'lowest')``);
    scalar states (learning-rate estimates, sums) are kept in it. float32 when no leaf is floating."""
    dtypes = tree_lib.real_dtypes(params)
    if not dtypes:
        return torch.float32
    return min(dtypes, key=lambda d: (torch.finfo(d).bits, -torch.finfo(d).eps))


def scalar(value: Any, dtype: torch.dtype, device: torch.device) -> Tensor:
    """A number or one-element tensor as a 0-d tensor of ``dtype`` (a tensor keeps its graph)."""
    if isinstance(value, Tensor):
        return value.reshape(()).to(device=device, dtype=dtype)
    return torch.full((), float(value), dtype=dtype, device=device)


def hyper(value: Any, count: Tensor, dtype: torch.dtype) -> Tensor:
    """A hyperparameter that may be a schedule of the step ``count``, as a 0-d tensor of ``dtype``."""
    if callable(value):
        return fe.schedule_value(value, count).to(dtype)
    return scalar(value, dtype, count.device)


def copy_params(params: Any) -> Any:
    """A copy of ``params`` kept in a state (the initial point): it keeps the graph where one is
    recorded (a meta-gradient sees the initial point move with the params), else it is detached."""

    def copy(p):
        if p is None:
            return None
        if tree_lib.needs_graph(p):
            return p.clone()
        return p.detach().clone()

    return tree_lib.tree_map(copy, params)


def keep(buffers: Sequence[Tensor], values: Sequence[Tensor], donate: bool) -> list[Tensor]:
    """``values``, written into the donated ``buffers`` when ``donate`` (same numbers either way)."""
    if not donate:
        return list(values)
    return fe.copy_into(buffers, values)


def on(value: Tensor, like: Tensor) -> Tensor:
    """A 0-d factor in the dtype and on the device of ``like``."""
    return fe.on(value, (like,))


def safe_sqrt(x: Tensor) -> Tensor:
    """``sqrt(x)`` whose derivative at ``x == 0`` is taken as 0 (not infinite), so a meta-gradient
    through a quantity that is exactly zero (the first step's distance) stays finite."""
    positive = x > 0
    return torch.where(positive, torch.sqrt(torch.where(positive, x, torch.ones_like(x))), torch.zeros_like(x))


def sums(fn: Callable[..., list[Tensor]], *trees: Any, spec: Any, dtype: torch.dtype, what: str) -> Tensor:
    """Exact global sums of ``fn``'s per-leaf scalars (:func:`gradtx.sharding.global_sums`), as a
    1-D tensor of ``dtype``, accumulated in float32 at least."""
    acc = torch.promote_types(dtype, torch.float32)
    return sharding.global_sums(lambda *x: torch.stack([s.to(acc) for s in fn(*x)]), *trees, spec=spec, what=what).to(dtype)


def vdot(x: Tensor, y: Tensor) -> Tensor:
    """The real inner product ``<x, y>``: ``Re(sum(conj(x) * y))`` for complex leaves."""
    if x.is_complex() or y.is_complex():
        return (x.conj() * y).real.sum()
    return (x * y).sum()
