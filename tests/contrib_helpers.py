"""Shared drivers for the contrib optimizer tests: a small float64 problem (a matrix, a vector and
a 0-d leaf), runs of gradtx and of a reference side by side, and the pure/donated/mutation checks."""

from __future__ import annotations

import torch

import gradtx as gtx

DTYPE = torch.float64
SHAPES = {"w": (4, 3), "b": (3,), "s": ()}


def initial_params(seed: int = 0, dtype: torch.dtype = DTYPE) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {k: torch.randn(s, generator=gen, dtype=DTYPE).to(dtype) for k, s in SHAPES.items()}


_GEN = torch.Generator().manual_seed(7)
_TARGETS = {k: torch.randn(s, generator=_GEN, dtype=DTYPE) for k, s in SHAPES.items()}
_WEIGHTS = {k: 0.5 + torch.rand(s, generator=_GEN, dtype=DTYPE) for k, s in SHAPES.items()}


def objective(params: dict[str, torch.Tensor]) -> torch.Tensor:
    """A smooth, anisotropic, non-quadratic loss (positive, so 0 is a lower bound)."""
    return sum(
        (_WEIGHTS[k].to(p.dtype) * (p - _TARGETS[k].to(p.dtype)).square() + 0.05 * p.pow(4)).sum() for k, p in params.items()
    )


def value_and_grad(params):
    value, grads = torch.func.grad_and_value(objective)(params)[::-1]
    return value, grads


def run(tx, steps: int, *, inplace: bool = False, with_value: bool = False, params=None):
    """Trains on :func:`objective`; returns the list of updates, the final params and state."""
    params = initial_params() if params is None else params
    state = tx.init(params)
    history = []
    for _ in range(steps):
        value, grads = value_and_grad(params)
        extra = {"value": value} if with_value else {}
        updates, state = tx.update(grads, state, params, inplace=inplace, **extra)
        history.append({k: v.clone() for k, v in updates.items()})
        params = gtx.apply_updates(params, updates)
    return history, params, state


def run_reference(make_reference, steps: int):
    """The same loop for a reference object with ``step(grads, params, value) -> updates``."""
    params = initial_params()
    ref = make_reference(params)
    history = []
    for _ in range(steps):
        value, grads = value_and_grad(params)
        updates = ref.step(grads, params, float(value))
        history.append(updates)
        params = {k: params[k] + updates[k] for k in params}
    return history, params


def assert_close_history(got, expected, rtol=1e-9):
    for step, (g, e) in enumerate(zip(got, expected)):
        for k in e:
            scale = float(e[k].abs().max()) + 1e-300
            torch.testing.assert_close(g[k], e[k], rtol=rtol, atol=rtol * scale, msg=lambda m: f"step {step}, leaf {k}: {m}")


def tree_tensors(tree):
    return [leaf for leaf in gtx.tree.leaves(tree) if isinstance(leaf, torch.Tensor)]


def assert_pure_equals_inplace(make, steps: int = 5, with_value: bool = False):
    pure_updates, pure_params, pure_state = run(make(), steps, inplace=False, with_value=with_value)
    donated_updates, donated_params, donated_state = run(make(), steps, inplace=True, with_value=with_value)
    for a, b in zip(pure_updates, donated_updates):
        for k in a:
            assert torch.equal(a[k], b[k]), k
    for a, b in zip(tree_tensors(pure_state), tree_tensors(donated_state)):
        assert torch.equal(a, b)
    for k in pure_params:
        assert torch.equal(pure_params[k], donated_params[k])


def assert_pure_update_does_not_mutate(make, steps: int = 3, with_value: bool = False):
    tx = make()
    params = initial_params()
    state = tx.init(params)
    for _ in range(steps):
        value, grads = value_and_grad(params)
        before = [t.clone() for t in tree_tensors((grads, state, params))]
        extra = {"value": value} if with_value else {}
        updates, new_state = tx.update(grads, state, params, **extra)
        after = tree_tensors((grads, state, params))
        assert all(torch.equal(a, b) for a, b in zip(before, after))
        params, state = gtx.apply_updates(params, updates), new_state
