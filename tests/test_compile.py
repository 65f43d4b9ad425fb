"""``torch.compile`` over a wrapped optimizer's step: the chain's state survives compilation (the
compiled run equals the eager run, state included, for stateful chains) and gradtx adds no graph
break beyond those torch's own optimizer step makes.

Compiled with Dynamo's ``eager`` backend: what is checked is what Dynamo traces and keeps (state
writes, graph breaks), and this keeps the tests fast on CPU.
"""

from __future__ import annotations

import functools
import math
from typing import Callable

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters

import gradtx as gtx
from gradtx import tree as tree_lib

STEPS = 3


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def model_and_data():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randn(5, 4, generator=gen) * (1 + i) for i in range(STEPS)]
    return model, batches


CHAINS: dict[str, Callable[[], gtx.GradientTransformation]] = {
    "clip_by_global_norm": lambda: gtx.clip_by_global_norm(0.3),
    "multisteps": lambda: gtx.MultiSteps(gtx.clip_by_global_norm(0.3), 2).gradient_transformation(),
    "apply_if_finite": lambda: gtx.apply_if_finite(gtx.chain(gtx.clip_by_global_norm(0.3), gtx.scale(0.5)), 2),
    "inject_hyperparams": lambda: gtx.chain(
        gtx.inject_hyperparams(gtx.clip_by_global_norm, static_args="norm_type")(max_norm=0.3),
        gtx.scale_by_schedule(gtx.linear_schedule(1.0, 0.25, STEPS)),
    ),
}
GATED = {"multisteps", "apply_if_finite"}
# last_step_skipped after each step (apply_if_finite's second gradient has a NaN)
SKIPPED = {
    "clip_by_global_norm": [False] * STEPS,
    "multisteps": [True, False, True],
    "apply_if_finite": [False, True, False],
    "inject_hyperparams": [False] * STEPS,
}


def run(chain: str, compiled: bool, inject_nan_at: int = -1):
    """Parameters, the chain's state after each of ``STEPS`` steps and whether each step was
    skipped (``last_step_skipped``), eager or compiled."""
    model, batches = model_and_data()
    opt = gtx.wrap(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), CHAINS[chain](), model=model)

    def step():
        opt.step()

    if compiled:
        step = torch.compile(step, backend="eager")
    states, skipped = [], []
    for i, x in enumerate(batches):
        opt.zero_grad()
        model(x).square().mean().backward()
        if i == inject_nan_at:
            model[0].bias.grad[0] = math.nan
        step()
        states.append([t.clone() if isinstance(t, torch.Tensor) else t for t in tree_lib.leaves(opt.tx_state)])
        skipped.append(opt.last_step_skipped)
    return [p.detach().clone() for p in model.parameters()], states, skipped


def assert_same(a, b) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        if isinstance(x, torch.Tensor):
            assert torch.equal(x, y) or (x.isnan().all() and y.isnan().all()), (x, y)
        else:
            assert x == y


@pytest.mark.parametrize("chain", list(CHAINS))
def test_compiled_step_keeps_the_chains_state(chain, torch_breaks):
    inject = 1 if chain == "apply_if_finite" else -1
    params, states, skipped = run(chain, compiled=False, inject_nan_at=inject)
    torch._dynamo.reset()
    counters.clear()
    compiled_params, compiled_states, compiled_skipped = run(chain, compiled=True, inject_nan_at=inject)
    # last_step_skipped is kept across compiled steps: what the eager steps report, as expected
    assert skipped == SKIPPED[chain] and compiled_skipped == SKIPPED[chain]
    # gradtx breaks nothing itself, except where a chain may skip a step: whether the inner optimizer
    # steps is then read on the host, once per step (as GradScaler reads found_inf)
    gate_reads = STEPS if chain in GATED else 0
    assert sum(counters["graph_break"].values()) <= torch_breaks + gate_reads
    assert_same(params, compiled_params)
    for eager, comp in zip(states, compiled_states):
        assert_same(eager, comp)
    assert any(isinstance(t, torch.Tensor) and t.is_floating_point() and t.abs().sum() > 0 for t in states[-1])


OPTIMIZERS = {
    "SGD": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
    "Adam": lambda params: torch.optim.Adam(params, lr=1e-2),
    "AdamW": lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1),
}


@functools.cache
def graph_breaks(name: str, wrapped: bool) -> int:
    """Graph breaks over two compiled steps: gradtx's clip in the wrapper, or torch's before the step
    (counted once per process: torch's SGD serves the fixture and its own test)."""
    torch._dynamo.reset()
    counters.clear()
    model, batches = model_and_data()
    opt = OPTIMIZERS[name](model.parameters())
    if wrapped:
        opt = gtx.wrap(opt, gtx.chain(gtx.clip_by_global_norm(0.3), gtx.clip_by_value(0.05)), model=model)

    @torch.compile(backend="eager")
    def step():
        if not wrapped:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.3)
            torch.nn.utils.clip_grad_value_(model.parameters(), 0.05)
        opt.step()

    for x in batches[:2]:
        opt.zero_grad()
        model(x).square().mean().backward()
        step()
    return sum(counters["graph_break"].values())


@pytest.fixture(scope="module")
def torch_breaks() -> int:
    """What torch's own clip_grad_norm_ + SGD step break, compiled."""
    return graph_breaks("SGD", False)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_wrapped_step_breaks_the_graph_no_more_than_torchs_own(name):
    ours, torchs = graph_breaks(name, True), graph_breaks(name, False)
    assert 0 < ours <= torchs, (ours, torchs)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_state_read_through_tx_state_is_never_changed_by_later_steps(compiled):
    """Logged states keep their step's values: a later step, eager or compiled, writes none of them."""
    model, batches = model_and_data()
    tx = gtx.chain(gtx.clip_by_global_norm(0.3), gtx.trace(decay=0.9))
    opt = gtx.wrap(torch.optim.SGD(model.parameters(), lr=0.1), tx, model=model)

    def step():
        opt.step()

    if compiled:
        step = torch.compile(step, backend="eager")
    held, copies = [], []
    for x in batches:
        opt.zero_grad()
        model(x).square().mean().backward()
        step()
        state = opt.tx_state  # held as is, no clone
        held.append(state)
        copies.append([t.clone() for t in tree_lib.leaves(state)])
    assert len({float(s[0].norm) for s in held}) == STEPS  # the steps' norms differ
    for state, copy in zip(held, copies):
        assert_same(tree_lib.leaves(state), copy)
