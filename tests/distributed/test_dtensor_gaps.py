"""Optimizers whose state or draws are not shaped like a plain elementwise step, under sharding:
SM3's per-dim accumulators (DTensors, or plain pieces with a spec), ``noisy_sgd``'s noise (drawn
for the logical tensor), Yogi's and AdaBelief's steps on a ``Partial`` gradient (reduced as DTensor
reduces it for Adam), equal to the dense run; L-BFGS refuses DTensors by name."""

from __future__ import annotations

import pytest
import torch

import _world
from _layouts import close, dense_tree
from _world import case
import gradtx as gtx
from gradtx.sharding import Replicate, Shard, ShardingSpec

SHAPES = {"w": (5, 4), "v": (3, 6), "b": (7,), "s": ()}
STEPS = 3


def _dtensor_tools(mesh):
    from torch.distributed.tensor import DTensor, Replicate as R, Shard as S, distribute_tensor

    # w split unevenly along dim 0, v along dim 1, b unevenly along dim 0, s copied
    layout = {"w": [S(0)], "v": [S(1)], "b": [S(0)], "s": [R()]}

    def distribute(tree):
        return {k: distribute_tensor(v, mesh, layout[k], src_data_rank=None) for k, v in tree.items()}

    def full(tree):
        return {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in tree.items()}

    return distribute, full


def _grads(params, targets):
    return {k: params[k] - targets[k] for k in params}


def _run(tx, params, targets, grads_of=_grads):
    state = tx.init(params)
    for _ in range(STEPS):
        updates, state = tx.update(grads_of(params, targets), state, params)
        params = gtx.apply_updates(params, updates)
    return params, state


@case(2)
def sm3_and_noisy_sgd_on_dtensors_equal_the_dense_run(world):
    mesh = world.mesh((2,), ("tp",))
    distribute, full = _dtensor_tools(mesh)
    params, targets = dense_tree(SHAPES, seed=1), dense_tree(SHAPES, seed=2)
    for name, make in {"sm3": lambda: gtx.sm3(0.1), "sm3 b2<1": lambda: gtx.chain(gtx.scale_by_sm3(b1=0.5, b2=0.9), gtx.scale(-0.1)),
                       "noisy_sgd": lambda: gtx.noisy_sgd(0.1, eta=0.5, key=3)}.items():
        dense, _ = _run(make(), dict(params), targets)
        sharded, state = _run(make(), distribute(params), distribute(targets))
        for leaf, value in full(sharded).items():
            close(value, dense[leaf], f"{name}: {leaf!r}", rtol=1e-6, atol=1e-7)
        if name.startswith("sm3"):  # the accumulators are DTensors laid out as their dims are
            mu = state[0].mu if name == "sm3" else state[0].mu
            assert [str(v.placements) for v in mu["w"]] == ["(Shard(dim=0),)", "(Replicate(),)"], mu["w"]
            assert [str(v.placements) for v in mu["v"]] == ["(Replicate(),)", "(Shard(dim=0),)"], mu["v"]


@case(2)
def sm3_with_a_spec_equals_the_dense_run(world):
    mesh = world.mesh((2,), ("tp",))
    shapes = {"w": (6, 4), "v": (3, 8), "b": (7,)}
    spec = ShardingSpec(mesh, [("w", Shard("tp", dim=0)), ("v", Shard("tp", dim=1)), ("b", Replicate())])

    def cut(tree):
        return {"w": tree["w"].chunk(2, 0)[world.rank].clone(), "v": tree["v"].chunk(2, 1)[world.rank].clone(), "b": tree["b"].clone()}

    params, targets = dense_tree(shapes, seed=1), dense_tree(shapes, seed=2)
    dense, _ = _run(gtx.sm3(0.1), dict(params), targets)
    sharded, _ = _run(gtx.sm3(0.1, spec=spec), cut(params), cut(targets))
    for leaf, value in cut(dense).items():
        close(sharded[leaf], value, f"sm3 with a spec: {leaf!r}", rtol=1e-6, atol=1e-7)
    alone, _ = _run(gtx.sm3(0.1), cut(params), cut(targets))  # the control: this rank's maxima only
    assert not all(torch.allclose(alone[k], cut(dense)[k], rtol=1e-6, atol=1e-7) for k in ("w", "v"))


@case(2)
def yogi_and_adabelief_reduce_a_partial_gradient(world):
    from torch.distributed.tensor import DTensor, Partial, Replicate as R, distribute_tensor

    mesh = world.mesh((2,), ("tp",))
    shapes = {"w": (4, 3), "b": (3,)}
    params = dense_tree(shapes, seed=1)
    pieces = [dense_tree(shapes, seed=10 + r) for r in range(2)]  # each rank's unreduced share
    summed = {k: pieces[0][k] + pieces[1][k] for k in shapes}
    for name, make in {"yogi": lambda: gtx.yogi(0.1), "adabelief": lambda: gtx.adabelief(0.1)}.items():
        dense_updates, _ = make().update(summed, make().init(params), params)
        dparams = {k: distribute_tensor(v, mesh, [R()], src_data_rank=None) for k, v in params.items()}
        grads = {k: DTensor.from_local(pieces[world.rank][k].clone(), mesh, [Partial()], run_check=False) for k in shapes}
        tx = make()
        updates, _ = tx.update(grads, tx.init(dparams), dparams)
        for leaf, value in updates.items():
            close(value.full_tensor(), dense_updates[leaf], f"{name}: {leaf!r}", rtol=1e-6, atol=1e-7)


@case(2)
def refused_by_name(world):
    from torch.distributed.tensor import DTensor, Partial, Replicate as R, distribute_tensor

    mesh = world.mesh((2,), ("tp",))
    params = {"a": distribute_tensor(torch.ones(4), mesh, [R()], src_data_rank=None)}
    with pytest.raises(TypeError, match=r"scale_by_lbfgs: leaf 'a' is a DTensor"):
        gtx.lbfgs().init(params)
    noisy = gtx.noisy_sgd(0.1)
    grads = {"a": DTensor.from_local(torch.ones(4), mesh, [Partial()], run_check=False)}
    with pytest.raises(ValueError, match=r"add_noise: leaf 'a': a DTensor with a Partial placement \(a gradient not reduced yet\) cannot"):
        noisy.update(grads, noisy.init(params), params)


# after every case above: the parameters are read when this is defined
@pytest.mark.distributed
@pytest.mark.parametrize("size,name", _world.params_for(__name__))
def test_dtensor_gaps(size, name):
    _world.check(size, name)
