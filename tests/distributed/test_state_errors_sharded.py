"""A state the transformation did not make is, under sharding, the same error on every rank, raised
before any collective: the ranks given it never reach the norm's all-reduce, so none waits there."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

import _world
from _world import case
import gradtx as gtx
from gradtx.sharding import Replicate, Shard, ShardingSpec


def _raises_before_any_collective(world, fn, error, match: str) -> None:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with pytest.raises(error, match=match) as info:
            fn()
    assert not [event.name for event in prof.events() if event.name.startswith("gloo:")]
    messages: list = [None] * world.size
    dist.all_gather_object(messages, str(info.value))
    assert len(set(messages)) == 1, f"ranks raised different messages: {messages}"


@case(2)
def wrong_states_fail_before_the_global_norm(world):
    mesh = world.mesh((world.size,), ("tp",))
    grads = {"w": torch.ones(4, 2), "b": torch.ones(3)}
    spec = ShardingSpec(mesh, [("w", Shard("tp")), ("b", Replicate())])
    tx = gtx.chain(gtx.clip_by_global_norm(1.0, spec), gtx.scale_by_adam())
    state = tx.init(grads)
    tx.update(grads, state)  # resolves the layout once (its consistency check is a collective)
    clip_state, adam_state = state
    _raises_before_any_collective(
        world, lambda: tx.update(grads, (adam_state, clip_state)), TypeError,
        r"^clip_by_global_norm: state is a ScaleByAdamState, where init makes a ClipByGlobalNormState",
    )
    _raises_before_any_collective(
        world, lambda: tx.update(grads, None), TypeError,
        r"^chain\(clip_by_global_norm, scale_by_adam\): state is None, where init makes a tuple",
    )
    _raises_before_any_collective(
        world, lambda: tx.update(grads, (clip_state,)), ValueError,
        r"^chain\(clip_by_global_norm, scale_by_adam\): state is a tuple of 1, where init makes a tuple of 2",
    )
    updates, _ = tx.update(grads, state)  # the world is still in step
    assert torch.isfinite(updates["w"]).all()


@pytest.mark.distributed
@pytest.mark.parametrize("size,name", _world.params_for(__name__))
def test_state_errors_sharded(size, name):
    _world.check(size, name)
