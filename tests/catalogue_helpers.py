"""Shared pieces of the catalogue tests: running a transformation against a float64 reference."""

from __future__ import annotations

from typing import Any, Callable

import torch

import gradtx as gtx
from optimizer_helpers import assert_trees_close, clone_tree, grad_sequence, tree


def leafwise(fn: Callable[..., Any], *trees: dict) -> dict:
    """``fn`` applied to the matching leaves of dicts of tensors."""
    return {k: fn(*(t[k] for t in trees)) for k in trees[0]}


def check_against_reference(
    tx: gtx.GradientTransformation,
    ref_init: Callable[[dict], dict],
    ref_step: Callable[[dict, dict, dict], tuple[dict, dict]],
    *,
    steps: int = 6,
    params: dict | None = None,
    grads: list | None = None,
    rtol: float = 1e-9,
    atol: float = 1e-12,
    inplace: bool = False,
) -> None:
    """Runs ``tx`` and the reference side by side for ``steps`` steps, comparing the updates and every
    state field the reference keeps (a dict field name -> tree or number) at every step."""
    params = tree(0) if params is None else params
    grads = grad_sequence(steps) if grads is None else grads
    state, ref_state = tx.init(params), ref_init(params)
    for step, g in enumerate(grads):
        updates, state = tx.update(clone_tree(g), state, params, inplace=inplace)
        ref_updates, ref_state = ref_step(g, ref_state, params)
        assert_trees_close(updates, ref_updates, rtol=rtol, atol=atol, msg=f"step {step} updates")
        for field, expected in ref_state.items():
            actual = getattr(state, field)
            if isinstance(expected, dict):
                assert_trees_close(actual, expected, rtol=rtol, atol=atol, msg=f"step {step} state.{field}")
            else:
                torch.testing.assert_close(
                    torch.as_tensor(actual).to(torch.float64), torch.as_tensor(expected, dtype=torch.float64),
                    rtol=rtol, atol=atol, msg=lambda m: f"step {step} state.{field}: {m}",
                )
        params = gtx.apply_updates(params, updates)


def compiled_matches_eager(tx: gtx.GradientTransformation, *, steps: int = 3, dtype=torch.float32) -> None:
    """One ``update`` under ``torch.compile(fullgraph=True)`` (one graph, no recompiles) gives the eager numbers."""
    torch._dynamo.reset()
    counter = {"graphs": 0}

    def backend(gm, example_inputs):
        counter["graphs"] += 1
        return gm.forward

    step = torch.compile(lambda g, s, p: tx.update(g, s, p), backend=backend, fullgraph=True)
    params = tree(0, dtype)
    state, eager_state = tx.init(params), tx.init(params)
    for g in grad_sequence(steps, dtype):
        updates, state = step(clone_tree(g), state, params)
        expected, eager_state = tx.update(clone_tree(g), eager_state, params)
        assert_trees_close(updates, expected, rtol=1e-6, atol=1e-7)
    assert counter["graphs"] == 1
