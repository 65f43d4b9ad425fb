"""The number of collectives, counted from the gloo events of a ``torch.profiler`` trace: one per
global norm (any p, any mix of layouts, DTensors included), one per distinct group for per-leaf
norms, none without sharding; the consistency check adds one on a new plan (the default), one at
every call (``check_consistency=True``) or none (``False``)."""

from __future__ import annotations

import math
import os

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import _world
from _layouts import local_tree, rules
from _world import case
from test_sharding_layouts import moe_model, tp_model
import gradtx as gtx
from gradtx.sharding import ShardingSpec

# Kineto, the profiler's backend, prints "USDT: ... profiler_start/stop" lines for every trace at its
# default log level. These tests only count events: quiet it (read at the first trace; forked ranks
# inherit it). Kineto ranks USDT above its errors, so this hides those too; a failed trace would
# fail the count anyway.
os.environ.setdefault("KINETO_LOG_LEVEL", "6")


def count_collectives(fn) -> int:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    # The trace's raw events, read by name: building the profiler's FunctionEvent tree from them
    # (``prof.events()``, the fallback) takes several times as long as the step it counts.
    results = getattr(prof.profiler, "kineto_results", None)
    names = [event.name() for event in results.events()] if results is not None else [e.name for e in prof.events()]
    return sum(1 for name in names if name.startswith("gloo:"))


def _assert_one_per_norm(grads, spec):
    for p in (1.0, 2.0, math.inf):
        gtx.global_norm(grads, spec, norm_type=p)  # first call: builds the plan and the group
        assert count_collectives(lambda: gtx.global_norm(grads, spec, norm_type=p)) == 1, f"p={p}"
        tx = gtx.clip_by_global_norm(1.0, spec, norm_type=p)
        state = tx.init(grads)
        assert count_collectives(lambda: tx.update(grads, state)) == 1, f"clip p={p}"


@case(8)
def one_collective_pp_dp_tp_and_moe(world):
    mesh = world.mesh((2, 2, 2), ("pp", "dp", "tp"))
    shapes, pieces = tp_model(4, stages=2, tied=True, zero=("dp",))
    dense = {k: torch.randn(s) for k, s in shapes.items()}
    spec = ShardingSpec(mesh, rules(pieces), stage_axis="pp")
    _assert_one_per_norm(local_tree(dense, pieces, mesh, "pp"), spec)

    mesh = world.mesh((2, 2, 2), ("dp", "ep", "tp"))
    shapes, pieces = moe_model()
    dense = {k: torch.randn(s) for k, s in shapes.items()}
    spec = ShardingSpec(mesh, rules(pieces))
    grads = local_tree(dense, pieces, mesh)
    _assert_one_per_norm(grads, spec)
    # Per-leaf norms: leaves over tp and leaves over ep x tp -> two groups, two collectives.
    gtx.sharding.leaf_norms(grads, spec)
    assert count_collectives(lambda: gtx.sharding.leaf_norms(grads, spec)) == 2
    # the first block-RMS call meets a new reduction: checked once, then never again
    assert count_collectives(lambda: gtx.clip_by_block_rms(0.1, spec).update(grads, None)) == 3
    assert count_collectives(lambda: gtx.clip_by_block_rms(0.1, spec).update(grads, None)) == 2


@case(8)
def groups_over_several_axes_whatever_groups_ranks_made_before(world):
    """Ranks 4 and 5 make a group of their own before the spec exists; then each pipeline stage
    reduces a leaf split over dp x tp. Torch names a group by how many its creator has made, so a
    group made on demand would be named differently on ranks 4, 5 and 6, 7, and never form; and
    from torch 2.14 a group only its members create moves that count on them alone, so even groups
    every rank creates at once (the spec's, over dp x tp) would not form unless the ranks agree on it.

    The mesh comes first: on torch 2.14 ``init_device_mesh`` itself hangs after such a group."""
    import torch.distributed as dist
    from gradtx.sharding import mesh as mesh_lib

    mesh = world.mesh((2, 2, 2), ("pp", "dp", "tp"))
    mesh_lib._GROUPS.clear()  # forget the groups earlier cases made, as a fresh job would have none
    rank = dist.get_rank()
    if rank in (4, 5):
        state = dist.distributed_c10d._world
        before = state.group_count
        dist.new_group([4, 5], use_local_synchronization=True)
        state.group_count = max(state.group_count, before + 1)  # as torch 2.14 counts it, on any torch
    spec = ShardingSpec(mesh, [("*", gtx.Shard("dp", "tp", dim=(0, 1)))], stage_axis="pp")
    stage, dp, tp = mesh.get_coordinate()
    dense = torch.Generator().manual_seed(stage)
    whole = torch.randn(4, 6, generator=dense)
    grads = {f"stage{stage}": whole[2 * dp : 2 * dp + 2, 3 * tp : 3 * tp + 3]}
    norms = gtx.sharding.leaf_norms(grads, spec)
    torch.testing.assert_close(norms[f"stage{stage}"], torch.linalg.vector_norm(whole))


@case(4)
def one_collective_dtensors_mixed(world):
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = world.mesh((2, 2), ("dp", "tp"))
    grads = {
        "a": distribute_tensor(torch.randn(8, 4), mesh, [Shard(0), Shard(1)]),
        "b": distribute_tensor(torch.randn(6, 4), mesh["dp"], [Shard(0)]),
        "c": distribute_tensor(torch.randn(5), mesh, [Replicate(), Replicate()]),
        "d": torch.randn(3),
    }
    _assert_one_per_norm(grads, None)
    _assert_one_per_norm(grads, ShardingSpec(mesh))
    # Unit norms of grads and params together: 'a' is split along dim 1 over tp (one group);
    # 'b' along dim 0 only (no communication).
    gtx.adaptive_grad_clip(0.1).update(grads, None, grads)
    assert count_collectives(lambda: gtx.adaptive_grad_clip(0.1).update(grads, None, grads)) == 1


@case(2)  # the check's cost per mode does not depend on the number of ranks
def consistency_check_costs_by_mode(world):
    mesh = world.mesh((world.size,), ("tp",))
    grads = {"w": torch.randn(4, 4), "b": torch.randn(4)}
    rule_list = [("w", gtx.sharding.Shard("tp")), ("b", gtx.sharding.Replicate())]
    once = ShardingSpec(mesh, rule_list, default=gtx.sharding.Replicate())
    assert count_collectives(lambda: gtx.global_norm(grads, once)) == 2  # new plan: check + norm
    assert count_collectives(lambda: gtx.global_norm(grads, once)) == 1
    # a leaf without gradient: the same structure, checked already (frozen params on some ranks only
    # must not make those ranks check where the others do not)
    assert count_collectives(lambda: gtx.global_norm({**grads, "b": None}, once)) == 1
    assert count_collectives(lambda: gtx.global_norm({**grads, "c": torch.ones(2)}, once)) == 2  # a new structure: checked
    always = ShardingSpec(mesh, rule_list, check_consistency=True)
    for _ in range(2):
        assert count_collectives(lambda: gtx.global_norm(grads, always)) == 2
    never = ShardingSpec(mesh, rule_list, check_consistency=False)
    assert count_collectives(lambda: gtx.global_norm(grads, never)) == 1


@case(2)
def no_collective_without_sharding(world):
    mesh = world.mesh((2,), ("dp",))
    grads = {"w": torch.randn(4, 4), "b": torch.randn(4)}
    for spec in (None, ShardingSpec(mesh)):  # replicated over dp only: a local norm
        gtx.global_norm(grads, spec)
        assert count_collectives(lambda: gtx.global_norm(grads, spec)) == 0
        torch.testing.assert_close(gtx.global_norm(grads, spec), torch.nn.utils.get_total_norm(list(grads.values())))


@pytest.mark.distributed
@case(2, 4)
def a_sharded_clip_hands_its_coefficient_to_the_adam_step(world):
    """``chain(clip_by_global_norm(max_norm, spec), adamw)`` on plain pieces under a spec: the clip
    hands the coefficient of the global norm to the Adam step (no scaling pass of its own), with one
    collective per step, and the updates and state are those of the clip scaling on its own (a
    member between them), bit for bit, on every rank, pure and donated; pipeline stages too."""
    from gradtx import tree as tree_lib
    from gradtx.native import adam as native_adam

    mesh = world.mesh((2, world.size // 2), ("pp", "tp")) if world.size == 4 else world.mesh((2,), ("tp",))
    stage_axis = "pp" if world.size == 4 else None
    shapes, pieces = tp_model(2, stages=2 if stage_axis else 1)
    dense = {k: torch.randn(s, generator=torch.Generator().manual_seed(7)) * 5 for k, s in shapes.items()}
    spec = ShardingSpec(mesh, rules(pieces), stage_axis=stage_axis)
    grads = {k: g.reshape(-1).clone().view(g.shape) for k, g in local_tree(dense, pieces, mesh, stage_axis).items()}  # row-major
    params = {k: torch.randn(g.shape) for k, g in grads.items()}
    handed = gtx.chain(gtx.clip_by_global_norm(1.0, spec), gtx.adamw(1e-2, weight_decay=0.1))
    alone = gtx.chain(gtx.clip_by_global_norm(1.0, spec), gtx.identity(), gtx.adamw(1e-2, weight_decay=0.1))
    kernel = native_adam.usable() is not None  # checked first: its check runs the ATen ops, which scale
    scales = []
    original = tree_lib.scale_
    tree_lib.scale_ = lambda *args, **kwargs: (scales.append(1), original(*args, **kwargs))[1]
    try:
        for inplace in (False, True):
            got = handed.update({k: g.clone() for k, g in grads.items()}, handed.init(params), params, inplace=inplace)
            assert not (kernel and scales), "a scaling pass ran where the Adam kernel takes the product"
            want = alone.update({k: g.clone() for k, g in grads.items()}, alone.init(params), params, inplace=inplace)
            assert scales, "the member between them makes the clip scale"
            scales.clear()
            for a, b in zip(gtx.tree.leaves((got[0], got[1][0], got[1][1])), gtx.tree.leaves((want[0], want[1][0], want[1][2]))):
                assert torch.equal(a, b), (inplace, a, b)
            assert float(got[1][0].norm) > 1.0  # clipped
    finally:
        tree_lib.scale_ = original
    state = handed.init(params)
    handed.update(grads, state, params)
    assert count_collectives(lambda: handed.update(grads, state, params)) == 1


@pytest.mark.parametrize("size,name", _world.params_for(__name__))
def test_collectives(size, name):
    _world.check(size, name)
