"""What ranks must agree on beyond their trees, and what happens when one rank strays mid-run.

- Shapes: a replicated (or stage-local) leaf's shape, and a sharded leaf's shape outside its split
  dims, are part of the cross-rank check: a rank holding another shape is an error on every rank,
  never a norm that counts one rank's copy.
- Rules: a rule that matches no leaf path on any rank (a typo) is an error naming it and the
  nearest paths; a rule used on some pipeline stages only is fine, and
  ``allow_unused_rules=True`` accepts generic rule sets.
- Options that change which collectives run (Muon's ``strategy``, GaLore's ``rank``, Adafactor's
  ``factored``) are checked: ranks that differ get an error naming the option, not a hang.
- Uneven plain shards under Muon: an error saying what is uneven and what to do.
- A bad leaf on one rank in a steady-state step: that rank joins the norm's all-reduce with an error
  bit, so every rank raises the same error; ranks out of step (one ran the reduction more often)
  are found from the call counts in that all-reduce, and a call the others never join is bounded
  by ``ShardingSpec(timeout=...)``.
"""

from __future__ import annotations

import math
import time

import pytest
import torch
import torch.distributed as dist

import _world
from _layouts import Piece, cut
from _world import case
import gradtx as gtx
from gradtx.sharding import Replicate, Shard, ShardingSpec
from test_sharding_collectives import count_collectives
from test_sharding_disagreement import FAST_S, _everyone_raises


def _still_in_step(world, mesh):
    grads = {"w": torch.full((2,), float(world.rank + 1))}
    norm = gtx.global_norm(grads, ShardingSpec(mesh, [("w", Shard(mesh.mesh_dim_names[-1]))]), norm_type=1.0)
    assert float(norm) == 2.0 * sum(range(1, world.size + 1))


def _tp(world):
    return world.mesh((world.size,), ("tp",)), world.rank == world.size - 1, world.size - 1


# --------------------------------------------------------------------------- shapes


@case(2, 4)
def replicated_leaf_shapes_must_agree(world):
    mesh, odd, last = _tp(world)
    rules = [("w", Shard("tp", dim=0)), ("b", Replicate())]
    grads = {"w": torch.ones(2, 4), "b": torch.ones(5 if odd else 3)}
    for run in (
        lambda: gtx.global_norm(grads, ShardingSpec(mesh, rules)),
        lambda: gtx.clip_by_global_norm(1.0, ShardingSpec(mesh, rules)).update(grads, None),
        lambda: gtx.sharding.leaf_norms(grads, ShardingSpec(mesh, rules)),
    ):
        _everyone_raises(world, run, rf"leaf 'b' is a torch.float32 tensor of shape \(5,\) replicated on rank {last} but .* of shape \(3,\)")
    # a sharded leaf may differ along its split dim (uneven pieces), not along the others
    grads = {"w": torch.ones(2, 3 if odd else 4), "b": torch.ones(3)}
    _everyone_raises(world, lambda: gtx.global_norm(grads, ShardingSpec(mesh, rules)), rf"leaf 'w' .* of shape \(\*, 3\) sharded .* rank {last} .*\(\*, 4\)")
    uneven = {"w": torch.ones(3 if odd else 2, 4), "b": torch.ones(3)}
    norm = gtx.global_norm(uneven, ShardingSpec(mesh, rules))
    rows = 2 * (world.size - 1) + 3
    torch.testing.assert_close(norm, torch.tensor(float(rows * 4 + 3) ** 0.5))
    # a flat (ZeRO) shard with no dim may hold any number of elements
    flat = {"w": torch.ones(5 if odd else 2), "b": torch.ones(3)}
    norm = gtx.global_norm(flat, ShardingSpec(mesh, [("w", Shard("tp")), ("b", Replicate())]))
    torch.testing.assert_close(norm, torch.tensor(float(2 * (world.size - 1) + 5 + 3) ** 0.5))
    _still_in_step(world, mesh)


@case(4)
def stage_local_leaf_shapes_agree_within_their_stage(world):
    mesh = world.mesh((2, 2), ("pp", "tp"))
    stage, tp = mesh.get_coordinate()
    spec_rules = [("layer.w", Shard("tp", dim=0)), ("layer.b", Replicate())]
    # stages hold different leaves under the same paths: their shapes may differ between stages
    grads = {"layer.w": torch.ones(2, 3 + stage), "layer.b": torch.ones(4 + stage)}
    norm = gtx.global_norm(grads, ShardingSpec(mesh, spec_rules, stage_axis="pp"))
    dense = sum(2 * 2 * (3 + s) + 4 + s for s in range(2))
    torch.testing.assert_close(norm, torch.tensor(float(dense) ** 0.5))
    # within a stage they may not: the last rank's copy of stage 1's bias is longer
    grads = {"layer.w": torch.ones(2, 3 + stage), "layer.b": torch.ones(4 + stage + (world.rank == 3))}
    _everyone_raises(
        world,
        lambda: gtx.global_norm(grads, ShardingSpec(mesh, spec_rules, stage_axis="pp")),
        r"ranks of pipeline stage 1 .* leaf 'layer.b' is a torch.float32 tensor of shape \(6,\) replicated on rank 3 but .*\(5,\) replicated on rank 2",
    )


# --------------------------------------------------------------------------- rules


def _model_grads(world):
    """A column-parallel qkv weight (2 of its rows per rank) and a replicated norm weight."""
    return {"layers.0.qkv.weight": torch.full((2, 4), 1.0), "layers.0.norm.weight": torch.full((4,), 1.0)}


@case(2, 4)
def a_rule_that_matches_nothing_is_an_error(world):
    mesh, odd, last = _tp(world)
    grads = _model_grads(world)
    typo = [("*.qvk.*", Shard("tp", dim=0)), ("*.norm.*", Replicate())]
    # before: the qkv weight fell to the default and was counted as a copy (sqrt(8 + 4) on every size)
    text = _everyone_raises(world, lambda: gtx.global_norm(grads, ShardingSpec(mesh, typo, default=Replicate())), r"rule '\*\.qvk\.\*' matches no leaf path on any rank")
    assert "nearest: 'layers.0.qkv.weight'" in text and "allow_unused_rules=True" in text
    # without a default, the leaf nobody matches is reported too (the plan cannot be built)
    _everyone_raises(world, lambda: gtx.global_norm(grads, ShardingSpec(mesh, typo)), r"no rule matches leaf 'layers.0.qkv.weight'")
    # through clip_by_global_norm too
    spec = ShardingSpec(mesh, [*typo, ("*", Replicate())])
    _everyone_raises(world, lambda: gtx.clip_by_global_norm(1.0, spec).update(grads, None), r"rule '\*\.qvk\.\*' matches no leaf")
    # a rule an earlier one shadows still matches: not reported (a catch-all "*" after the others, say)
    spec = ShardingSpec(mesh, [("*.qkv.*", Shard("tp", dim=0)), ("*.norm.*", Replicate()), ("*", Replicate())])
    torch.testing.assert_close(gtx.global_norm(grads, spec), torch.tensor(float(8 * world.size + 4) ** 0.5))
    # the explicit opt-out: a generic rule set, the norm as the rules and the default say
    generic = ShardingSpec(mesh, [*typo, ("*.qkv.*", Shard("tp", dim=0)), ("embedding.*", Shard("tp", dim=0))], allow_unused_rules=True)
    torch.testing.assert_close(gtx.global_norm(grads, generic), torch.tensor(float(8 * world.size + 4) ** 0.5))
    # a rule that matches a leaf with no gradient (None) decides it: used
    tree = {**grads, "layers.0.norm.weight": None}
    spec = ShardingSpec(mesh, [("*.qkv.*", Shard("tp", dim=0)), ("*.norm.*", Replicate())])
    torch.testing.assert_close(gtx.global_norm(tree, spec), torch.tensor(float(8 * world.size) ** 0.5))
    # without the check, every rank finds the unused rule on its own (no stage axis: same leaves everywhere)
    unchecked = ShardingSpec(mesh, typo, default=Replicate(), check_consistency=False)
    _everyone_raises(world, lambda: gtx.global_norm(grads, unchecked), r"rule '\*\.qvk\.\*' matches no leaf path of the tree")
    _still_in_step(world, mesh)


@case(4)
def a_rule_used_on_some_stages_only_is_fine(world):
    mesh = world.mesh((2, 2), ("pp", "tp"))
    stage = mesh.get_coordinate()[0]
    grads = {"embedding.weight": torch.ones(3, 4)} if stage == 0 else {"head.weight": torch.ones(5, 4)}
    rules = [("embedding.*", Shard("tp", dim=0)), ("head.*", Shard("tp", dim=0)), ("*.typo.*", Replicate())]
    _everyone_raises(world, lambda: gtx.global_norm(grads, ShardingSpec(mesh, rules, stage_axis="pp")), r"rule '\*\.typo\.\*' matches no leaf path on any rank \(the nearest: ")
    spec = ShardingSpec(mesh, rules[:2], stage_axis="pp")
    norm = gtx.global_norm(grads, spec)  # each rule matches on one stage: used
    torch.testing.assert_close(norm, torch.tensor(float(2 * 12 + 2 * 20) ** 0.5))
    assert count_collectives(lambda: gtx.global_norm(grads, spec)) == 1  # checked once, then trusted
    # the verdict is kept: a new reduction on the plan is checked in one all_gather, as usual
    assert count_collectives(lambda: gtx.sharding.leaf_norms(grads, spec)) == 2


# --------------------------------------------------------------------------- options


@case(2, 4)
def options_that_change_the_collectives_are_checked(world):
    mesh, odd, last = _tp(world)
    spec = ShardingSpec(mesh, [("w", Shard("tp", dim=0))])
    params = {"w": torch.randn(2, 4, generator=torch.Generator().manual_seed(world.rank))}
    muon = gtx.contrib.scale_by_muon(spec=spec, strategy="gather" if odd else "owner")
    _everyone_raises(world, lambda: muon.update(params, muon.init(params)), rf"rank {last} is about to run scale_by_muon: whole tensors \(strategy='gather'\) while rank 0 runs .*\(strategy='owner'\)")
    galore = gtx.contrib.scale_by_galore(rank=1 if odd else 2, spec=ShardingSpec(mesh, [("w", Shard("tp", dim=0))]))
    _everyone_raises(world, lambda: galore.update(params, galore.init(params)), r"scale_by_galore: local pieces \(rank=\d, update_proj_gap=200\)")
    factored = gtx.scale_by_factored_rms(factored=not odd, min_dim_size_to_factor=1, spec=ShardingSpec(mesh, [("w", Shard("tp", dim=0))]))
    _everyone_raises(world, lambda: factored.update(params, factored.init(params)), r"scale_by_factored_rms \(factored=False, min_dim_size_to_factor=1\)")
    # with the same options everywhere each runs, and is checked once per plan
    for tx in (gtx.contrib.scale_by_muon(spec=spec), gtx.scale_by_factored_rms(factored=False, spec=spec)):
        state = tx.init(params)
        tx.update(params, state)
        tx.update(params, state)
    _still_in_step(world, mesh)


@case(2, 4)
def muon_over_uneven_plain_shards_says_what_to_do(world):
    mesh, odd, last = _tp(world)
    spec = ShardingSpec(mesh, [("w", Shard("tp", dim=0))])
    grads = {"w": torch.ones(3 if odd else 2, 4)}
    tx = gtx.contrib.muon(0.02, spec=spec)
    text = _everyone_raises(world, lambda: tx.update(grads, tx.init(grads), grads), r"whole shape of leaf 'w'")
    assert f"rank {last}'s (3, 4) piece makes a ({3 * world.size}, 4) tensor" in text
    assert f"rank 0's (2, 4) piece a ({2 * world.size}, 4) one" in text
    assert "must be split evenly" in text and "DTensors" in text
    assert "different transformations" not in text
    _still_in_step(world, mesh)


# --------------------------------------------------------------------------- steady state


@case(2, 4)
def a_bad_leaf_on_one_rank_raises_on_every_rank(world):
    mesh, odd, last = _tp(world)
    spec = ShardingSpec(mesh, [("w", Shard("tp")), ("b", Replicate())])
    good = {"w": torch.ones(2), "b": torch.ones(3)}
    for p in (2.0, math.inf):
        tx = gtx.chain(gtx.clip_by_global_norm(1.0, spec, norm_type=p), gtx.sgd(0.1))
        state = tx.init(good)
        tx.update(good, state, good)  # the plan is checked: what follows is a steady-state step
        for bad, error in (
            (torch.ones(2, dtype=torch.int64), rf"rank {last} cannot run global_norm\(p={p}\): leaf 'w' is a torch.int64 tensor"),
            (2.0, rf"rank {last} cannot run global_norm\(p={p}\): global_norm: leaf 'w' is a float, expected a torch.Tensor"),
        ):
            grads = {**good, "w": bad} if odd else good
            _everyone_raises(world, lambda: tx.update(grads, state, good), error, TypeError)
        # the world is in step: the next steady-state step runs on every rank
        updates, _ = tx.update(good, state, good)
        torch.testing.assert_close(updates["b"], -0.1 * torch.ones(3) * min(1.0, 1.0 / (float(gtx.global_norm(good, spec, norm_type=p)) + 1e-6)))
    _still_in_step(world, mesh)


@case(2, 4)
def ranks_out_of_step_are_found_by_their_call_counts(world):
    mesh, odd, last = _tp(world)
    spec = ShardingSpec(mesh, [("w", Shard("tp")), ("b", Replicate())])
    a = {"w": torch.ones(2), "b": torch.ones(3)}
    b = {"w": torch.ones(2), "b": torch.ones(3), "c": None}  # another tree: another plan, counted apart
    for tree in (a, b):
        gtx.global_norm(tree, spec)  # both plans checked on every rank
    gtx.global_norm(a, spec)
    # rank 0 runs the first reduction once more; the others run the second: mixed steps
    run = (lambda: gtx.global_norm(a, spec)) if world.rank == 0 else (lambda: gtx.global_norm(b, spec))
    others = ", ".join(f"rank {r} at call 2" for r in range(1, world.size))
    _everyone_raises(world, run, rf"ran global_norm\(p=2.0\) a different number of times \(rank 0 at call 3, {others}\)", RuntimeError)
    _still_in_step(world, mesh)


@case(2, 4)
def a_call_the_others_never_join_is_bounded(world):
    from torch.distributed.device_mesh import DeviceMesh

    ranks = list(range(world.size))
    group, sync = dist.new_group(ranks), dist.new_group(ranks)  # the call left pending stays on `group`
    mesh = DeviceMesh.from_group(group, "cpu", mesh_dim_names=("tp",))
    spec = ShardingSpec(mesh, [("w", Shard("tp")), ("b", Replicate())], timeout=1.0)
    tx = gtx.clip_by_global_norm(1.0, spec)
    grads = {"w": torch.ones(2), "b": torch.ones(3)}
    state = tx.init(grads)
    for _ in range(2):
        tx.update(grads, state)
    if world.rank == 0:  # one call too many
        start = time.perf_counter()
        with pytest.raises(RuntimeError, match=r"rank 0 waited 1 s in its call 3 of global_norm\(p=2.0\) .*they completed call 2 with it.*same number of times on every rank.*stop the run.*timeout=") as info:
            tx.update(grads, state)
        assert time.perf_counter() - start < FAST_S, str(info.value)
    dist.barrier(group=sync)
    if world.rank != 0:  # complete rank 0's pending all-reduce: its norm's partial sum and its packed count
        dist.all_reduce(torch.zeros(2, dtype=torch.float64), group=group)
    dist.barrier(group=sync)
    with pytest.raises(ValueError, match="timeout must be a positive number"):
        ShardingSpec(mesh, timeout=0)
    assert ShardingSpec(mesh).timeout == 600.0 and ShardingSpec(mesh, timeout=None).timeout is None


@case(2, 4)
def reductions_without_the_norms_flags_are_bounded_too(world):
    """Per-leaf norms, a decision over every rank's gradients, global sums and the maximum over a
    quantized state's shared blocks carry no error bit or call count, but a call the other ranks
    never join is bounded by the spec's timeout all the same (it waited for gloo's own 30 minutes),
    with an error naming what was being reduced."""
    from torch.distributed.device_mesh import DeviceMesh

    from gradtx.sharding.sums import global_sums

    ranks = list(range(world.size))
    sync = dist.new_group(ranks)
    calls = [
        ("per-leaf norms", lambda spec, grads: gtx.sharding.leaf_rms(grads, spec)),
        ("a decision over every rank's gradients", lambda spec, grads: gtx.sharding.all_finite(grads, spec)),
        ("bounded sums", lambda spec, grads: global_sums(lambda x: (x * x).sum(), grads, spec=spec, what="bounded sums")),
    ]
    # a quantized state whose leaf is cut inside its blocks (along its last dim): the blocks two
    # ranks share take the maximum of both pieces' absmax
    columns = Piece("cols", ((("tp",), 1),))
    built: dict = {}  # per spec: the transformation, its state (init reduces too) and the local piece

    def quantized_step(spec, grads):
        if id(spec) not in built:
            tx = gtx.quantize_state(gtx.adamw(1e-2), 8, block_size=8, min_size=0, spec=spec)
            local = {"cols": cut(torch.ones(2, 20), columns, spec.mesh)}
            built[id(spec)] = (tx, tx.init(local), local)
        tx, state, local = built[id(spec)]
        tx.update(local, state, local)

    calls.append(("quantize_state's shared blocks", quantized_step))
    for what, call in calls:
        group = dist.new_group(ranks)  # the call left pending stays on `group`
        mesh = DeviceMesh.from_group(group, "cpu", mesh_dim_names=("tp",))
        rules = [("cols", columns.spec())] if call is quantized_step else [("w", Shard("tp")), ("b", Replicate())]
        spec = ShardingSpec(mesh, rules, timeout=1.0)
        grads = {"w": torch.ones(2), "b": torch.ones(3)}
        for _ in range(2):
            call(spec, grads)
        if world.rank == 0:  # one call too many
            start = time.perf_counter()
            with pytest.raises(RuntimeError, match=rf"rank 0 waited 1 s in its call of {what}.*stop the run.*timeout=") as info:
                call(spec, grads)
            assert time.perf_counter() - start < FAST_S, str(info.value)
        dist.barrier(group=sync)
        if world.rank != 0:  # the same call, which completes rank 0's pending reduction
            call(spec, grads)
        dist.barrier(group=sync)


@pytest.mark.distributed
@pytest.mark.parametrize("size,name", _world.params_for(__name__))
def test_agreement(size, name):
    _world.check(size, name)
