"""Data-dependent decisions are global: with a NaN or an infinity in one rank's shard only,
``apply_if_finite`` and ``MultiSteps``' skip functions skip on every rank, counters agree, and
parameters stay finite and equal to the dense run, under a ``ShardingSpec`` and under FSDP2's
DTensor gradients (on its default, unnamed mesh too)."""

from __future__ import annotations

import copy
import functools
import math

import pytest
import torch
import torch.distributed as dist
from torch import nn

import _world
from _layouts import close, dense_tree
from _world import case
import gradtx as gtx
from gradtx.sharding import Replicate, Shard, ShardingSpec
from test_sharding_collectives import count_collectives

SHAPES = {"w": (8, 3), "b": (5,)}
BAD = {1: math.nan, 2: math.inf}  # step -> the value planted in the last rank's shard of "w"


def _spec_and_cut(world):
    mesh = world.mesh((world.size,), ("tp",))
    spec = ShardingSpec(mesh, [("w", Shard("tp", dim=0)), ("b", Replicate())])

    def cut(tree):
        return {"w": torch.tensor_split(tree["w"], world.size, 0)[world.rank].clone(), "b": tree["b"].clone()}

    return spec, cut


def _grads(step: int) -> dict[str, torch.Tensor]:
    dense = dense_tree(SHAPES, seed=10 + step)
    if step in BAD:
        dense["w"][-1, 0] = BAD[step]  # in the last rank's rows only
    return dense


def _same_on_every_rank(value: torch.Tensor, what: str) -> None:
    gathered = [torch.empty_like(value) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, value.contiguous())
    for rank, other in enumerate(gathered):
        torch.testing.assert_close(other, value, rtol=0, atol=0, equal_nan=True, msg=f"{what} differs from rank {rank}'s")


def _run_apply_if_finite(spec, cut, steps: int = 4):
    """Sharded run and dense run, step by step; returns the final local params and state."""
    make = lambda s: gtx.apply_if_finite(gtx.chain(gtx.clip_by_global_norm(1.0, s), gtx.sgd(0.1, momentum=0.9)), 3, s)
    tx, dense_tx = make(spec), make(None)
    dense_params = dense_tree(SHAPES, seed=1)
    params = cut(dense_params)
    state, dense_state = tx.init(params), dense_tx.init(dense_params)
    for step in range(steps):
        grads = _grads(step)
        updates, state = tx.update(cut(grads), state, params)
        dense_updates, dense_state = dense_tx.update(grads, dense_state, dense_params)
        params = gtx.apply_updates(params, updates)
        dense_params = gtx.apply_updates(dense_params, dense_updates)
        for name, value in cut(dense_params).items():
            close(params[name], value, f"step {step} param {name!r}")
            assert torch.isfinite(params[name]).all(), f"step {step}: {name!r} is not finite"
        for field in ("notfinite_count", "total_notfinite", "last_finite"):
            value = getattr(state, field)
            assert torch.equal(value, getattr(dense_state, field)), f"step {step}: {field}"
            _same_on_every_rank(value, field)
        if step in BAD:
            assert all(torch.count_nonzero(u) == 0 for u in updates.values()), f"step {step} was not skipped"
    _same_on_every_rank(params["b"], "replicated param")
    assert int(state.total_notfinite) == len(BAD)
    return tx, state, params


# A 1-D mesh of even pieces: the world of 2 runs what 4 ranks would (the flag rides in the same
# all-reduce; the 2-D and uneven layouts run in the world of 4 below).
@case(2)
def apply_if_finite_skips_everywhere_with_a_spec(world):
    spec, cut = _spec_and_cut(world)
    tx, state, params = _run_apply_if_finite(spec, cut)
    # The flag rides in clip_by_global_norm's all-reduce: one collective a step, NaN or not.
    for step in (0, 1):
        grads = cut(_grads(step))
        assert count_collectives(lambda: tx.update(grads, state, params)) == 1, f"step {step}"
    # Without a norm to ride in, one all-reduce of the flag.
    alone = gtx.apply_if_finite(gtx.sgd(0.1), 5, spec)
    alone_state = alone.init(params)
    bad = cut(_grads(1))
    alone.update(bad, alone_state, params)
    assert count_collectives(lambda: alone.update(bad, alone_state, params)) == 1
    updates, new_state = alone.update(bad, alone_state, params)
    assert not bool(new_state.last_finite) and all(torch.count_nonzero(u) == 0 for u in updates.values())


@case(2)  # a 1-D mesh of even pieces, as above
def multisteps_skips_everywhere_with_a_spec(world):
    spec, cut = _spec_and_cut(world)
    # step 3's gradients (tripled) are too large as a whole, though no rank's pieces are
    large_step = {k: 3.0 * v for k, v in _grads(3).items()}
    threshold = 0.75 * float(gtx.global_norm(large_step)) ** 2
    large = functools.partial(gtx.skip_large_updates, max_squared_norm=threshold)

    def per_rank_skip(updates, step, params):  # a user's function that knows nothing of sharding
        return ~torch.stack([torch.isfinite(u).all() for u in updates.values()]).all(), ()

    for skip_fn in (gtx.skip_not_finite, large, per_rank_skip):
        tx = gtx.MultiSteps(gtx.sgd(0.1), 2, should_skip_update_fn=skip_fn, spec=spec)
        dense_tx = gtx.MultiSteps(gtx.sgd(0.1), 2, should_skip_update_fn=skip_fn)
        dense_params = dense_tree(SHAPES, seed=1)
        params = cut(dense_params)
        assert count_collectives(lambda: tx.init(params)) == 0, "building the state issued a collective"
        state, dense_state = tx.init(params), dense_tx.init(dense_params)
        for step in range(5):
            grads = _grads(step)
            if skip_fn is large and step == 3:
                grads = large_step
            updates, state = tx.update(cut(grads), state, params)
            dense_updates, dense_state = dense_tx.update(grads, dense_state, dense_params)
            params = gtx.apply_updates(params, updates)
            dense_params = gtx.apply_updates(dense_params, dense_updates)
            for name, value in cut(dense_params).items():
                close(params[name], value, f"{skip_fn} step {step} {name!r}")
                assert torch.isfinite(params[name]).all()
            for field in ("mini_step", "gradient_step"):
                assert torch.equal(getattr(state, field), getattr(dense_state, field)), f"{skip_fn} step {step} {field}"
                _same_on_every_rank(getattr(state, field), field)
            if skip_fn is not per_rank_skip:
                skip_state = {k: v for k, v in state.skip_state.items()}
                for key, value in skip_state.items():
                    close(value, dense_state.skip_state[key], f"{skip_fn} step {step} skip_state[{key!r}]")
                    _same_on_every_rank(value, key)


@case(2)
def decisions_span_the_mesh_when_nothing_is_sharded(world):
    """A spec that shards nothing (data-parallel copies): a NaN in one rank's copy still skips everywhere."""
    mesh = world.mesh((2,), ("dp",))
    spec = ShardingSpec(mesh, default=Replicate())
    grads = {"w": torch.ones(2)}
    if world.rank == 1:
        grads["w"][0] = math.nan
    params = {"w": torch.zeros(2)}
    for tx in (
        gtx.apply_if_finite(gtx.sgd(1.0), 5, spec),
        gtx.apply_if_finite(gtx.chain(gtx.clip_by_global_norm(1.0, spec), gtx.sgd(1.0)), 5, spec),
    ):
        updates, state = tx.update(grads, tx.init(params), params)
        assert not bool(state.last_finite) and int(state.total_notfinite) == 1, f"rank {world.rank} decided alone"
        assert torch.count_nonzero(updates["w"]) == 0

    def my_skip(updates, step, params, spec=None):  # takes spec=, but decides on this rank's pieces
        return ~torch.isfinite(updates["w"]).all(), ()

    multi = gtx.MultiSteps(gtx.sgd(1.0), 1, should_skip_update_fn=my_skip, spec=spec)
    _, multi_state = multi.update(grads, multi.init(params), params)
    assert int(multi_state.gradient_step) == 0, f"rank {world.rank} applied a step another rank skipped"


@case(4)
def non_finite_elements_are_counted_once_across_replicas(world):
    """tp-sharded, dp-replicated: a NaN present in every dp copy of one tp shard is one element."""
    mesh = world.mesh((2, 2), ("dp", "tp"))
    spec = ShardingSpec(mesh, [("w", Shard("tp", dim=0)), ("b", Replicate())])
    coord = dict(zip(mesh.mesh_dim_names, mesh.get_coordinate()))
    grads = {"w": torch.ones(2, 3), "b": torch.ones(2)}
    if coord["tp"] == 1:
        grads["w"][0, 0] = math.nan  # in both dp replicas of tp shard 1
    grads["b"][1] = math.inf  # a replicated leaf: one logical element
    skip, skip_state = gtx.skip_not_finite(grads, torch.zeros((), dtype=torch.int32), None, spec=spec)
    assert bool(skip) and int(skip_state["num_not_finite"]) == 2, skip_state


def _sharded_model(mesh=None):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 3))
    model = copy.deepcopy(reference)
    fully_shard(model, mesh=mesh) if mesh is not None else fully_shard(model)
    return reference, model


def _backward(model, reference, step: int):
    gen = torch.Generator().manual_seed(step)
    x = torch.randn(4, 6, generator=gen)  # the same batch on every rank
    model(x).square().sum().backward()
    reference(x).square().sum().backward()


def _check_dense_twin(world, mesh):
    """Norms and clips of FSDP2's DTensor gradients equal the unsharded model's."""
    from torch.distributed.tensor import distribute_tensor

    reference, model = _sharded_model(mesh)
    _backward(model, reference, 0)
    grads = {n: p.grad for n, p in model.named_parameters()}
    dense = {n: p.grad for n, p in reference.named_parameters()}
    for p in (1.0, 2.0, math.inf):
        close(gtx.global_norm(grads, norm_type=p), gtx.global_norm(dense, norm_type=p), f"p={p}", rtol=1e-4)
    clipped, _ = gtx.clip_by_global_norm(0.1).update(grads, None)
    dense_clipped, _ = gtx.clip_by_global_norm(0.1).update(dense, None)
    for name, x in dense_clipped.items():
        expected = distribute_tensor(x, grads[name].device_mesh, grads[name].placements, src_data_rank=None).to_local()
        close(clipped[name].to_local(), expected, f"clipped {name!r}", rtol=1e-4)
    rms, _ = gtx.clip_by_block_rms(0.01).update(grads, None)
    dense_rms, _ = gtx.clip_by_block_rms(0.01).update(dense, None)
    for name, x in dense_rms.items():
        expected = distribute_tensor(x, grads[name].device_mesh, grads[name].placements, src_data_rank=None).to_local()
        close(rms[name].to_local(), expected, f"block rms {name!r}", rtol=1e-4)


@case(2, 4)
def fully_shard_default_unnamed_mesh(world):
    _check_dense_twin(world, None)


@case(4)
def hsdp_layout_on_an_unnamed_2d_mesh(world):
    """HSDP's layout (replicated over dim 0, sharded over dim 1) on a mesh without names. FSDP2
    itself asks for names on a 2-D mesh, so the DTensors are laid out by hand."""
    from torch.distributed.tensor import Replicate as R, Shard as S, distribute_tensor

    mesh = world.mesh((2, 2), None)
    dense = dense_tree({"w": (7, 3), "b": (5,), "s": (6, 4)})
    placements = {"w": [R(), S(0)], "b": [R(), S(0)], "s": [S(1), S(0)]}
    grads = {k: distribute_tensor(v, mesh, placements[k], src_data_rank=None) for k, v in dense.items()}
    for p in (1.0, 2.0, math.inf):
        close(gtx.global_norm(grads, norm_type=p), gtx.global_norm(dense, norm_type=p), f"p={p}")
        for name, norm in gtx.sharding.leaf_norms(grads, norm_type=p).items():
            close(norm, torch.linalg.vector_norm(dense[name], p), f"leaf norm {name!r} p={p}")
    clipped, _ = gtx.clip_by_global_norm(0.5).update(grads, None)
    dense_clipped, _ = gtx.clip_by_global_norm(0.5).update(dense, None)
    for name, x in dense_clipped.items():
        close(clipped[name].to_local(), distribute_tensor(x, mesh, placements[name], src_data_rank=None).to_local(), f"clipped {name!r}")


@case(2, 4)
def fully_shard_nan_on_one_rank_skips_everywhere(world):
    """FSDP2 gradients (DTensors, no spec): a NaN planted in one rank's local shard only."""
    reference, model = _sharded_model()
    tx = gtx.apply_if_finite(gtx.chain(gtx.clip_by_global_norm(1.0), gtx.adamw(1e-2)), 2)
    multi = gtx.MultiSteps(gtx.sgd(0.1), 2, should_skip_update_fn=gtx.skip_not_finite)
    params = {n: p.detach() for n, p in model.named_parameters()}
    state, multi_state = tx.init(params), multi.init(params)
    for step in range(3):
        model.zero_grad()
        reference.zero_grad()
        _backward(model, reference, step)
        grads = {n: p.grad for n, p in model.named_parameters()}
        if step == 1 and world.rank == world.size - 1:
            grads["0.weight"].to_local()[0, 0] = math.nan
        updates, state = tx.update(grads, state, params)
        multi_updates, multi_state = multi.update(grads, multi_state, params)
        assert bool(state.last_finite) == (step != 1), f"step {step}: finiteness decided per rank"
        _same_on_every_rank(state.notfinite_count, "notfinite_count")
        _same_on_every_rank(multi_state.mini_step, "MultiSteps mini_step")
        assert torch.equal(multi_state.skip_state["should_skip"], torch.tensor(step == 1))
        params = gtx.apply_updates(params, updates)
        for name, value in params.items():
            full = value.full_tensor()
            assert torch.isfinite(full).all(), f"step {step}: {name!r} is not finite"
            _same_on_every_rank(full, f"step {step} {name!r}")
            if step == 1:
                assert all(torch.count_nonzero(u.to_local()) == 0 for u in updates.values())


@pytest.mark.distributed
@pytest.mark.parametrize("size,name", _world.params_for(__name__))
def test_decisions(size, name):
    _world.check(size, name)
