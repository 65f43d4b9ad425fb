"""Ranks that disagree get the same error on every rank, within seconds: never a hang (the world's
collectives time out after 30 s, far above ``FAST_S``) and never a silently wrong number.

In each case the last rank differs from the others in one way the library can meet: its tree, a
leaf spec, ``duplicate=``, ``stage_axis``, a DTensor where the others hold a plain tensor, a dtype,
the check mode, the reduction it runs, or an error only it finds while resolving its tree. Every
rank must raise the same message, which names the odd rank and the leaf; afterwards the world is
still in step (the next collective completes).
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

import _world
from _world import case
import gradtx as gtx
from gradtx.sharding import Replicate, Shard, ShardingSpec

FAST_S = 5.0


def _everyone_raises(world, fn, match: str, error=ValueError) -> str:
    """``fn`` raises ``error`` matching ``match`` on this rank, fast, with the same text everywhere
    (returned)."""
    start = time.perf_counter()
    with pytest.raises(error, match=match) as info:
        fn()
    assert time.perf_counter() - start < FAST_S, "the error took as long as a collective timeout"
    messages: list = [None] * world.size
    dist.all_gather_object(messages, str(info.value))
    assert len(set(messages)) == 1, f"ranks raised different messages: {messages}"
    return messages[0]


def _still_in_step(world, mesh):
    grads = {"w": torch.full((2,), float(world.rank + 1))}
    spec = ShardingSpec(mesh, [("w", Shard(mesh.mesh_dim_names[-1]))])
    norm = gtx.global_norm(grads, spec, norm_type=1.0)
    per_axis = dict(zip(mesh.mesh_dim_names, mesh.shape))[mesh.mesh_dim_names[-1]]
    assert float(norm) > 0 and per_axis >= 1


def _setup(world):
    mesh = world.mesh((world.size,), ("tp",))
    odd = world.rank == world.size - 1
    grads = {"w": torch.ones(4, 2), "b": torch.ones(3)}
    rules = [("w", Shard("tp")), ("b", Replicate())]
    return mesh, odd, grads, rules


def _last(world) -> str:
    return f"rank {world.size - 1}"


@case(2, 4)
def trees_differ(world):
    mesh, odd, grads, rules = _setup(world)
    if odd:
        grads = {**grads, "extra": torch.ones(2)}
    spec = ShardingSpec(mesh, rules, default=Replicate())
    _everyone_raises(world, lambda: gtx.global_norm(grads, spec), rf"{_last(world)} has leaf 'extra'")
    _still_in_step(world, mesh)


@case(2, 4)
def leaf_specs_differ(world):
    mesh, odd, grads, rules = _setup(world)
    spec = ShardingSpec(mesh, [("w", Replicate() if odd else Shard("tp")), ("b", Replicate())], reduce_axes=("tp",))
    _everyone_raises(world, lambda: gtx.clip_by_global_norm(1.0, spec).update(grads, None), rf"leaf 'w'.*{_last(world)}")
    _still_in_step(world, mesh)


@case(2, 4)
def duplicate_flags_differ(world):
    mesh, odd, grads, rules = _setup(world)
    spec = ShardingSpec(mesh, [("w", Shard("tp", duplicate=odd)), ("b", Replicate())])
    _everyone_raises(world, lambda: gtx.global_norm(grads, spec), rf"leaf 'w'.*duplicate.*{_last(world)}|leaf 'w'.*{_last(world)}")
    _still_in_step(world, mesh)


@case(2, 4)
def stage_axes_differ(world):
    mesh = world.mesh((2, world.size // 2), ("pp", "tp"))
    odd = world.rank == world.size - 1
    grads = {"w": torch.ones(4, 2)}
    spec = ShardingSpec(mesh, [("w", Shard("tp"))], stage_axis=None if odd else "pp")
    _everyone_raises(world, lambda: gtx.global_norm(grads, spec), rf"on the mesh: {_last(world)}.*'pp'")
    _still_in_step(world, mesh)


@case(2, 4)
def dtensor_on_one_rank_plain_on_the_others(world):
    from torch.distributed.tensor import DTensor, Shard as S

    mesh, odd, grads, _ = _setup(world)
    if odd:
        grads = {**grads, "w": DTensor.from_local(grads["w"], mesh, [S(0)], run_check=False)}
    spec = ShardingSpec(mesh, default=Replicate())
    _everyone_raises(world, lambda: gtx.global_norm(grads, spec), rf"leaf 'w' is a torch.float32 DTensor.*{_last(world)}")
    _still_in_step(world, mesh)


@case(2, 4)
def dtypes_differ(world):
    mesh, odd, grads, rules = _setup(world)
    if odd:
        grads = {**grads, "w": grads["w"].double()}
    spec = ShardingSpec(mesh, rules)
    _everyone_raises(world, lambda: gtx.global_norm(grads, spec), rf"leaf 'w' is a torch.float64 tensor.*{_last(world)}")
    _still_in_step(world, mesh)


@case(2, 4)
def check_enabled_on_one_rank_only(world):
    mesh, odd, grads, rules = _setup(world)
    spec = ShardingSpec(mesh, rules, check_consistency=True if odd else "once")
    _everyone_raises(world, lambda: gtx.global_norm(grads, spec), rf"check_consistency.*{_last(world)}")
    _still_in_step(world, mesh)


@case(2, 4)
def reductions_differ(world):
    mesh, odd, grads, rules = _setup(world)
    spec = ShardingSpec(mesh, rules)
    run = (lambda: gtx.sharding.leaf_norms(grads, spec)) if odd else (lambda: gtx.global_norm(grads, spec))
    _everyone_raises(world, run, rf"{_last(world)} is about to run leaf_norms")
    _still_in_step(world, mesh)


@case(2, 4)
def an_error_found_on_one_rank_only(world):
    from torch.distributed.tensor import DTensor, Partial

    mesh, odd, grads, rules = _setup(world)
    last = _last(world)
    # an axis the mesh lacks, named by a callable on one rank only
    spec = ShardingSpec(mesh, lambda path, t: Shard("ep") if odd and path == "w" else Replicate())
    _everyone_raises(world, lambda: gtx.global_norm(grads, spec), rf"{last} cannot run global_norm.*'w'.*axis 'ep'")
    # a gradient that is not reduced yet, on one rank only
    partial = {**grads, "w": DTensor.from_local(grads["w"], mesh, [Partial()], run_check=False)} if odd else grads
    spec = ShardingSpec(mesh, default=Replicate())
    _everyone_raises(world, lambda: gtx.clip_by_global_norm(1.0, spec).update(partial, None), rf"{last}.*'w'.*Partial.*'tp'")
    # a leaf no rule matches, on one rank only
    spec = ShardingSpec(mesh, [("w", Shard("tp"))] if odd else rules)
    _everyone_raises(world, lambda: gtx.global_norm(grads, spec), rf"{last}.*no rule matches leaf 'b'")
    # a callable returning something that is not a leaf spec: a TypeError, on every rank
    spec = ShardingSpec(mesh, lambda path, t: "tp" if odd else Replicate())
    _everyone_raises(world, lambda: gtx.global_norm(grads, spec), rf"{last}.*leaf 'b'.*expected a Shard", TypeError)
    _still_in_step(world, mesh)


@case(2, 4)
def per_leaf_reductions_are_checked(world):
    """Block RMS, AGC, trust ratios and per-leaf norms reduce per leaf: checked like the global norm."""
    mesh, odd, grads, rules = _setup(world)
    params = {"w": torch.full((4, 2), 2.0), "b": torch.full((3,), 2.0)}

    def odd_spec():
        w = Shard("tp", dim=0) if not odd else Replicate()
        return ShardingSpec(mesh, [("w", w), ("b", Replicate())], reduce_axes=("tp",))

    runs = {
        "leaf_norms": lambda s: gtx.sharding.leaf_norms(grads, s),
        "leaf_rms": lambda s: gtx.sharding.leaf_rms(grads, s),
        "clip_by_block_rms": lambda s: gtx.clip_by_block_rms(0.1, s).update(grads, None),
        "adaptive_grad_clip": lambda s: gtx.adaptive_grad_clip(0.1, spec=s).update(grads, None, params),
        "lamb": lambda s: gtx.lamb(0.1, spec=s).update(grads, gtx.lamb(0.1, spec=s).init(params), params),
    }
    for name, run in runs.items():
        spec = odd_spec()
        _everyone_raises(world, lambda: run(spec), rf"leaf 'w'.*{_last(world)}")
    # with one spec everywhere, each runs (and is checked once, then trusted)
    spec = ShardingSpec(mesh, [("w", Shard("tp", dim=0)), ("b", Replicate())])
    for name, run in runs.items():
        run(spec)
        run(spec)
    _still_in_step(world, mesh)


@pytest.mark.distributed
@pytest.mark.parametrize("size,name", _world.params_for(__name__))
def test_disagreement(size, name):
    _world.check(size, name)
