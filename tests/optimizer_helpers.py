"""Shared pieces of the optimizer tests: small trees, trajectories, and tree comparisons."""

from __future__ import annotations

import warnings
from typing import Callable, Optional

import torch

import gradtx as gtx

SHAPES = {"layer.weight": (4, 3), "layer.bias": (4,), "scale": ()}


def tree(seed: int, dtype: torch.dtype = torch.float64, shapes=SHAPES, scale: float = 1.0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {k: (torch.randn(s, generator=gen, dtype=torch.float64) * scale).to(dtype) for k, s in shapes.items()}


def grad_sequence(steps: int, dtype: torch.dtype = torch.float64, shapes=SHAPES) -> list[dict[str, torch.Tensor]]:
    return [tree(100 + i, dtype, shapes) for i in range(steps)]


def gradtx_trajectory(tx: gtx.GradientTransformation, params, grads, *, inplace: bool = False):
    """Params after applying ``tx`` to each gradient in turn (params passed to every update)."""
    params = {k: v.clone() for k, v in params.items()}
    state = tx.init(params)
    for g in grads:
        g = {k: v.clone() for k, v in g.items()}
        updates, state = tx.update(g, state, params, inplace=inplace)
        params = gtx.apply_updates(params, updates)
    return params, state


def torch_trajectory(make_optimizer: Callable[[list[torch.Tensor]], torch.optim.Optimizer], params, grads):
    """Params after ``optimizer.step()`` on each gradient in turn."""
    names = list(params)
    tensors = [params[k].clone().requires_grad_(True) for k in names]
    opt = make_optimizer(tensors)
    for g in grads:
        for t, k in zip(tensors, names):
            t.grad = g[k].clone()
        opt.step()
    return {k: t.detach() for k, t in zip(names, tensors)}


def assert_trees_close(actual, expected, *, rtol: float, atol: float = 0.0, msg: Optional[str] = None):
    a_leaves, a_def = gtx.tree.flatten(actual)
    e_leaves, e_def = gtx.tree.flatten(expected)
    assert a_def == e_def, f"structures differ: {a_def} vs {e_def}"
    for path, a, e in zip(gtx.tree.paths(expected), a_leaves, e_leaves):
        if e is None or not isinstance(e, torch.Tensor):
            assert a == e, path
            continue
        torch.testing.assert_close(a, e, rtol=rtol, atol=atol, msg=lambda m: f"{msg or ''} leaf {path}: {m}")


def assert_trees_equal(actual, expected, msg: str = ""):
    """Bit-identical tensors (and equal non-tensor leaves), same structure."""
    a_leaves, a_def = gtx.tree.flatten(actual)
    e_leaves, e_def = gtx.tree.flatten(expected)
    assert a_def == e_def, f"{msg}: structures differ: {a_def} vs {e_def}"
    for path, a, e in zip(gtx.tree.paths(expected), a_leaves, e_leaves):
        if isinstance(e, torch.Tensor):
            assert isinstance(a, torch.Tensor) and a.dtype == e.dtype and a.shape == e.shape, f"{msg}: {path}"
            assert torch.equal(a, e) or (a.isnan() == e.isnan()).all() and torch.equal(a.nan_to_num(), e.nan_to_num()), (
                f"{msg}: leaf {path} differs: {a} vs {e}"
            )
        else:
            assert a == e, f"{msg}: leaf {path}: {a!r} vs {e!r}"


def clone_tree(t):
    return gtx.tree.tree_map(lambda x: x.clone(), t)


def check_pure_and_donated(tx: gtx.GradientTransformation, params, grads, *, steps: Optional[int] = None):
    """Runs ``tx`` on the pure and the donated path side by side and checks that

    - the pure path mutates neither the updates, the state nor the params it is given;
    - both paths give bit-identical updates and states at every step.
    """
    pure_state = tx.init(params)
    donated_state = tx.init(params)
    p = clone_tree(params)
    for g in grads[:steps]:
        g_before, s_before, p_before = clone_tree(g), clone_tree(pure_state), clone_tree(p)
        pure_updates, new_pure_state = tx.update(g, pure_state, p)
        assert_trees_equal(g, g_before, "pure update mutated the updates")
        assert_trees_equal(pure_state, s_before, "pure update mutated the state")
        assert_trees_equal(p, p_before, "pure update mutated the params")
        donated_updates, donated_state = tx.update(clone_tree(g), donated_state, p, inplace=True)
        assert_trees_equal(p, p_before, "donated update mutated the params")
        assert_trees_equal(donated_updates, pure_updates, "donated and pure updates differ")
        assert_trees_equal(donated_state, new_pure_state, "donated and pure states differ")
        pure_state = new_pure_state
        p = gtx.apply_updates(p, pure_updates)


def without_deprecation_warning(factory: Callable) -> Callable:
    """``factory`` called without its DeprecationWarning (a deprecated name that is itself under test)."""

    def call(*args, **kwargs):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            return factory(*args, **kwargs)

    return call
