"""What the tests of gradtx's C kernels share: the skip mark, probe values, a bit-for-bit
comparison, a run with donated updates and an applied run."""

from __future__ import annotations

import sys

import pytest
import torch

import gradtx as gtx
from gradtx.native import build, checks

# Skipped only where nothing can be built; a kernel refused by its check fails the tests.
NEEDS_KERNELS = pytest.mark.skipif(
    not build.enabled() or build.compiler() is None or sys.platform == "win32", reason="no C kernels here"
)


def probe_values(shape, seed: int) -> torch.Tensor:
    """:func:`gradtx.native.checks.probe` values (extremes included) of ``shape``."""
    n = int(torch.Size(shape).numel())
    return (checks.probe(n, seed) if n else torch.empty(0)).reshape(shape)


def lerp_at_one_safe(grads: dict) -> dict:
    """``grads`` with every -0.0 made +0.0. At weight 1 (Adam's ``b1 = 0``) torch's own ``lerp``
    gives a -0.0 end two signs of zero: +0.0 in its vectorized body, -0.0 in its scalar tail
    (``test_torchs_lerp_at_weight_one_signs_a_zero_by_position``), so whichever sign a kernel
    gives differs from ATen's somewhere; a test that compares bits gives that case no -0.0."""
    return {k: torch.where(g == 0, torch.zeros_like(g), g) for k, g in grads.items()}


def equal_bits(want: torch.Tensor, got: torch.Tensor) -> bool:
    """Same shape, dtype and values, a zero's sign included, NaN where NaN (the kernels' own check)."""
    return want.shape == got.shape and want.dtype == got.dtype and checks.first_difference([{"x": want}], [{"x": got}]) == ""


def same_results(want: tuple, got: tuple) -> None:
    """Asserts two ``(updates, state)`` results have one tree structure and equal bits leaf by leaf."""
    from gradtx import tree as tree_lib

    assert tree_lib.structure(want) == tree_lib.structure(got)
    want_leaves = [x for x in tree_lib.leaves(want) if isinstance(x, torch.Tensor)]
    got_leaves = [x for x in tree_lib.leaves(got) if isinstance(x, torch.Tensor)]
    assert len(want_leaves) == len(got_leaves)
    for a, b in zip(want_leaves, got_leaves):
        assert equal_bits(a, b)


def applied(tx: gtx.GradientTransformation, params: dict, grads: dict, steps: int = 3) -> dict:
    """The params after ``steps`` steps of ``tx`` on the same ``grads``, each applied."""
    p, state = params, tx.init(params)
    for _ in range(steps):
        updates, state = tx.update(grads, state, p)
        p = gtx.apply_updates(p, updates)
    return p


def donated_run(tx: gtx.GradientTransformation, params: dict, grads_per_step: list, inplace) -> tuple:
    """The last ``(updates, state)`` of one step of ``tx`` per gradient tree, each a fresh copy
    (donated updates are overwritten), with ``inplace`` as ``update`` takes it."""
    state, out = tx.init(params), None
    for grads in grads_per_step:
        grads = {k: g.clone() for k, g in grads.items()}
        out, state = tx.update(grads, state, params, inplace=inplace)
    return out, state


KERNEL_REFUSALS = ("a recorded graph", "bfloat16 leaves", "a transposed leaf", "one gradient twice")
"""Gradients no elementwise kernel may take: the ATen ops run, or a number could change."""


def refused_gradients(case: str, g: torch.Tensor) -> dict:
    """The gradients of one of :data:`KERNEL_REFUSALS`, from the float32 matrix ``g``: ``"one
    gradient twice"`` holds it under two keys (stepped donated, the first position's update would be
    the second's gradient)."""
    return {
        "a recorded graph": lambda: {"w": g.requires_grad_()},
        "bfloat16 leaves": lambda: {"w": g.bfloat16()},
        "a transposed leaf": lambda: {"w": g.t()},
        "one gradient twice": lambda: {"w": g, "x": g},
    }[case]()


def in_threads(fn, count: int) -> list:
    """``[fn(0), ..., fn(count - 1)]``, each run on a Python thread of its own, all at once."""
    import threading

    results: list = [None] * count

    def run(i):
        results[i] = fn(i)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results
