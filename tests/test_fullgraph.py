"""A pure step of every optimizer (``update`` + ``apply_updates``) compiles with
``torch.compile(fullgraph=True)``: no graph break of gradtx's own, one graph that serves three
steps (no recompilation), and the compiled step gives the eager numbers. Dynamo's ``eager``
backend is enough to find graph breaks and keeps this fast."""

from __future__ import annotations

import pytest
import torch

import gradtx as gtx
from test_differentiable import CASES

# Not compilable as one graph, by design:
NOT_ONE_GRAPH = {
    "noisy_sgd": "draws its noise from a torch.Generator whose state lives on the host",
    "dpsgd": "draws its noise from a torch.Generator whose state lives on the host",
    "lbfgs": "its memory slot is a data-dependent index into the history",
    "scale_by_backtracking_linesearch": "decides each trial step on the host (a line search)",
    "contrib.sophia": "decides on the host whether to refresh the Hessian, whose probes come from a host-side torch.Generator",
}


def _objective(params):
    return sum((p - 0.5).square().sum() for p in params.values())


@pytest.mark.parametrize("name", sorted(set(CASES) - set(NOT_ONE_GRAPH)))
def test_a_pure_step_compiles_to_one_graph(name):
    gen = torch.Generator().manual_seed(0)
    _check_one_graph(name, {"w": torch.randn(4, 3, generator=gen), "b": torch.randn(3, generator=gen)})


@pytest.mark.parametrize("name", ["adam", "contrib.adopt", "contrib.madgrad", "contrib.momo_adam", "contrib.prodigy"])
def test_a_pure_step_on_transposed_params_compiles_to_one_graph(name):
    """Each divides into (or takes a square root into) a buffer of its own, laid out like the
    param: Dynamo traces an ``out=`` kernel only into a contiguous one."""
    gen = torch.Generator().manual_seed(0)
    _check_one_graph(name, {"w": torch.randn(3, 4, generator=gen).t(), "b": torch.randn(3, generator=gen)})


def _check_one_graph(name: str, params: dict[str, torch.Tensor]) -> None:
    torch._dynamo.reset()
    tx = CASES[name]()
    extra = isinstance(tx, gtx.GradientTransformationExtraArgs)

    def step(grads, state, params):
        kwargs = {"value": _objective(params), "grad": grads, "value_fn": _objective} if extra else {}
        updates, state = tx.update(grads, state, params, **kwargs)
        return gtx.apply_updates(params, updates), state

    graphs = []

    def counting_backend(gm, example_inputs):  # Dynamo's "eager" backend, counting graphs
        graphs.append(gm)
        return gm.forward

    compiled = torch.compile(step, fullgraph=True, backend=counting_backend)
    eager_params, compiled_params = params, params
    eager_state = compiled_state = tx.init(params)
    for _ in range(3):
        grads = {k: 2.0 * (v - 0.5) for k, v in eager_params.items()}
        eager_params, eager_state = step(grads, eager_state, eager_params)
        grads = {k: 2.0 * (v - 0.5) for k, v in compiled_params.items()}
        compiled_params, compiled_state = compiled(grads, compiled_state, compiled_params)
    for key in params:
        torch.testing.assert_close(compiled_params[key], eager_params[key], rtol=1e-5, atol=1e-6)
    assert len(graphs) == 1, f"{name}: recompiled over three steps ({len(graphs)} graphs)"


def test_the_exclusions_are_still_cases():
    assert set(NOT_ONE_GRAPH) <= set(CASES)
