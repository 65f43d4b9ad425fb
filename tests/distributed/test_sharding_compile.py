"""Sharded steps under ``torch.compile(fullgraph=True)``: the global norm's all-reduce is a
functional collective inside the graph, the numbers are the eager ones, and the cross-rank check
runs eagerly before tracing (``compile_step`` makes that call itself; a plain ``torch.compile``
of ``update`` needs one eager call first, and says so when it has none).

The graphs are recorded by a backend that runs them as traced (no Inductor: it would only add
minutes of code generation to what these tests check, the tracing).
"""

from __future__ import annotations

import pytest
import torch

import _world
from _world import case
import gradtx as gtx
from gradtx.sharding import Replicate, Shard, ShardingSpec



class Recorder:
    """A ``torch.compile`` backend that keeps each traced graph and runs it as it is."""

    def __init__(self) -> None:
        self.graphs: list = []

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        return gm.forward

    def collectives(self) -> list[str]:
        return [str(n.target) for gm in self.graphs for n in gm.graph.nodes if "c10d" in str(n.target)]


def _setup(world):
    mesh = world.mesh((world.size,), ("tp",))
    spec = ShardingSpec(mesh, [("w", Shard("tp", dim=0)), ("b", Replicate())])
    gen = torch.Generator().manual_seed(world.rank)
    params = {"w": torch.randn(2, 3, generator=gen), "b": torch.ones(3)}
    grads = {"w": torch.randn(2, 3, generator=gen), "b": torch.full((3,), 0.5)}
    return spec, params, grads


@case(2)  # every rank traces the same graph at any world size: 4 ranks only trace it twice as often
def compile_step_of_a_sharded_chain(world):
    spec, params, grads = _setup(world)
    tx = gtx.chain(gtx.clip_by_global_norm(0.5, spec), gtx.adamw(1e-2))
    state = tx.init(params)
    recorder = Recorder()
    step = gtx.compile_step(tx, backend=recorder)  # no eager call before: the step checks first
    new_params, new_state = step(grads, state, params)
    assert recorder.collectives() == ["_c10d_functional.all_reduce", "_c10d_functional.wait_tensor"]
    eager_updates, eager_state = tx.update(grads, state, params)
    torch.testing.assert_close(new_state[0].norm, eager_state[0].norm)
    torch.testing.assert_close(new_params, gtx.apply_updates(params, eager_updates))
    # the logical norm: every rank's rows of w once, b once
    dense_w = torch.cat([torch.randn(2, 3, generator=_rank_gen(r))[None] for r in range(world.size)])
    torch.testing.assert_close(new_state[0].norm, torch.sqrt(dense_w.square().sum() + 0.75))
    new_params, _ = step(grads, new_state, new_params)  # a second step: no new trace
    assert len(recorder.graphs) == 1


def _rank_gen(rank: int) -> torch.Generator:
    gen = torch.Generator().manual_seed(rank)
    torch.randn(2, 3, generator=gen)  # the params come first
    return gen


@case(2)  # as above: every rank traces the same graph at any world size
def user_compile_of_a_sharded_update(world):
    spec, params, grads = _setup(world)
    tx = gtx.clip_by_global_norm(0.5, spec)
    recorder = Recorder()
    compiled = torch.compile(tx.update, fullgraph=True, backend=recorder)
    # with no eager call before, the tracer meets a plan nobody checked: a clear error, on every rank
    with pytest.raises(Exception, match="run the step once eagerly before compiling"):
        compiled(grads, tx.init(params))
    expected, expected_state = tx.update(grads, tx.init(params))  # the eager call builds and checks the plan
    updates, state = compiled(grads, tx.init(params))
    assert "_c10d_functional.all_reduce" in recorder.collectives()
    torch.testing.assert_close(updates, expected)
    torch.testing.assert_close(state.norm, expected_state.norm)


@pytest.mark.distributed
@pytest.mark.parametrize("size,name", _world.params_for(__name__))
def test_sharding_compile(size, name):
    _world.check(size, name)
