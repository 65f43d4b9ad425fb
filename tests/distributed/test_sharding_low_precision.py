"""Low-precision params under sharding: each rank's new params (and Kahan's compensations, the
master copies) are its pieces of the dense run's, bit for bit: plain pieces of a ShardingSpec split
over dim 0 and dim 1 (even, and uneven as numpy's array_split cuts them), flat ZeRO pieces (even
and uneven), FSDP2-style DTensors with an uneven Shard(0)."""

from __future__ import annotations

import pytest
import torch

import _world
from _layouts import Piece, cut
from _world import case
import gradtx as gtx
from gradtx.sharding import ShardingSpec

SHAPES = {"rows": (8, 6), "cols": (4, 8), "bias": (6,)}


def _trees(steps):
    gen = torch.Generator().manual_seed(0)
    params = {k: torch.randn(s, generator=gen).to(torch.bfloat16) for k, s in SHAPES.items()}
    grads = [{k: torch.randn(s, generator=gen) * 1e-3 for k, s in SHAPES.items()} for _ in range(steps)]
    return params, grads


def _run(tx, params, grads):
    state = tx.init(params)
    for g in grads:
        updates, state = tx.update(g, state, params)
        params = gtx.apply_updates(params, updates)
    return params


@case(2, 4)
def stochastic_rounding_on_plain_pieces_equals_dense(world):
    mesh = world.mesh((world.size,), ("dp",))
    pieces = {"rows": Piece("rows", ((("dp",), 0),)), "cols": Piece("cols", ((("dp",), 1),)), "bias": Piece("bias")}
    spec = ShardingSpec(mesh, [(name, piece.spec()) for name, piece in pieces.items()])
    params, grads = _trees(3)
    dense = _run(gtx.stochastic_rounding(9), params, grads)
    local = {k: cut(v, pieces[k], mesh) for k, v in params.items()}
    local_grads = [{k: cut(v, pieces[k], mesh) for k, v in g.items()} for g in grads]
    got = _run(gtx.stochastic_rounding(9, spec=spec), local, local_grads)
    for key in SHAPES:
        assert torch.equal(got[key], cut(dense[key], pieces[key], mesh)), key
    assert not torch.equal(dense["rows"], params["rows"])


# --------------------------------------------------------------------------- every transformation, every layout

UNEVEN_SHAPES = {"rows": (5, 4), "cols": (3, 7), "even": (8, 6), "bias": (6,)}
TRANSFORMS = {
    "stochastic_rounding": lambda spec: gtx.stochastic_rounding(3, spec=spec),
    "kahan_summation": lambda spec: gtx.kahan_summation(),
    "master_weights": lambda spec: gtx.master_weights(gtx.adamw(1e-2, weight_decay=0.1)),
}


def _per_param_state(state) -> dict:
    """The state's leaves that mirror the params (Kahan's compensation, the masters), by param name."""
    if isinstance(state, gtx.KahanSummationState):
        return state.compensation
    if isinstance(state, gtx.MasterWeightsState):
        return {**state.master, **{f"mu.{k}": v for k, v in state.inner_state[0].mu.items()}}
    return {}


def _run_with_state(tx, params, grads):
    state = tx.init(params)
    for g in grads:
        updates, state = tx.update(g, state, params)
        params = gtx.apply_updates(params, updates)
    return params, state


def _uneven_layouts(world) -> dict:
    """Plain pieces cut as numpy's array_split does (DTensor's chunking does not describe them), and
    flat ZeRO pieces of the flattened leaves (48 and 20 elements split evenly over 2 and 4, 21 and 6
    not)."""
    mesh = world.mesh((world.size,), ("dp",))
    split = {"rows": Piece("rows", ((("dp",), 0),)), "cols": Piece("cols", ((("dp",), 1),)), "even": Piece("even", ((("dp",), 0),)), "bias": Piece("bias")}
    flat = {name: Piece(name, ((("dp",), None),)) for name in UNEVEN_SHAPES}
    return {"uneven plain": (mesh, split), "flat": (mesh, flat)}


@case(2, 4)
def every_transformation_on_uneven_and_flat_plain_pieces_equals_dense(world):
    gen = torch.Generator().manual_seed(2)
    params = {k: torch.randn(s, generator=gen).to(torch.bfloat16) for k, s in UNEVEN_SHAPES.items()}
    grads = [{k: torch.randn(s, generator=gen) * 1e-3 for k, s in UNEVEN_SHAPES.items()} for _ in range(3)]
    for name, make in TRANSFORMS.items():
        dense, dense_state = _run_with_state(make(None), params, grads)
        for layout, (mesh, pieces) in _uneven_layouts(world).items():
            spec = ShardingSpec(mesh, [(key, piece.spec()) for key, piece in pieces.items()])
            local = {k: cut(v, pieces[k], mesh) for k, v in params.items()}
            local_grads = [{k: cut(v, pieces[k], mesh) for k, v in g.items()} for g in grads]
            got, state = _run_with_state(make(spec), local, local_grads)
            for key in UNEVEN_SHAPES:
                assert torch.equal(got[key], cut(dense[key], pieces[key], mesh)), (name, layout, key)
            for key, value in _per_param_state(state).items():
                want = cut(_per_param_state(dense_state)[key], pieces[key.split(".")[-1]], mesh)
                assert torch.equal(value, want), (name, layout, key)
        assert not torch.equal(dense["even"], params["even"]), name


@case(2, 4)
def every_transformation_on_uneven_fsdp_dtensors_equals_dense(world):
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    mesh = world.mesh((world.size,), ("dp",))
    shapes = {"w": (5, 3), "v": (7,)}
    gen = torch.Generator().manual_seed(5)
    params = {k: torch.randn(s, generator=gen).to(torch.bfloat16) for k, s in shapes.items()}
    grads = [{k: torch.randn(s, generator=gen) * 1e-3 for k, s in shapes.items()} for _ in range(3)]

    def distribute(tree):
        return {k: distribute_tensor(v, mesh, [Shard(0)], src_data_rank=None) for k, v in tree.items()}

    for name, make in TRANSFORMS.items():
        dense, dense_state = _run_with_state(make(None), params, grads)
        got, state = _run_with_state(make(None), distribute(params), [distribute(g) for g in grads])
        for key, value in got.items():
            assert isinstance(value, DTensor), (name, key)
            assert torch.equal(value.to_local(), distribute(dense)[key].to_local()), (name, key)
        theirs = _per_param_state(dense_state)
        for key, value in _per_param_state(state).items():
            assert isinstance(value, DTensor), (name, key)
            assert torch.equal(value.to_local(), distribute({key: theirs[key]})[key].to_local()), (name, key)


@case(2)
def a_partial_or_differently_laid_out_update_is_refused_on_every_rank(world):
    """A Partial gradient (not reduced yet) summed into a param on this rank's piece would be this
    rank's share only, and a gradient laid out otherwise than its param would pair other elements:
    every transformation that works on local pieces refuses both, on every rank, naming the leaf."""
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    mesh = world.mesh((world.size,), ("dp",))
    params = {"w": DTensor.from_local(torch.ones(4, 3, dtype=torch.bfloat16), mesh, [Replicate()], run_check=False)}
    partial = {"w": DTensor.from_local(torch.full((4, 3), 0.01), mesh, [Partial()], run_check=False)}
    sharded = {"w": DTensor.from_local(torch.full((2, 3), 0.01), mesh, [Shard(0)], run_check=False)}
    for name, make in TRANSFORMS.items():
        tx = make(None)
        state = tx.init(params)
        with pytest.raises(ValueError, match=r"leaf 'w'.*Partial placement \(a gradient not reduced yet\)|Partial placement"):
            tx.update(partial, state, params)
        with pytest.raises(ValueError, match=r"laid out differently"):
            tx.update(sharded, state, params)


@case(2)
def compiled_stochastic_rounding_on_flat_pieces_equals_dense(world):
    # the places of the pieces are found by compile_step's eager call and read from the plan in the graph
    mesh, pieces = _uneven_layouts(world)["flat"]
    spec = ShardingSpec(mesh, [(key, piece.spec()) for key, piece in pieces.items()])
    gen = torch.Generator().manual_seed(6)
    params = {k: torch.randn(s, generator=gen).to(torch.bfloat16) for k, s in UNEVEN_SHAPES.items()}
    grads = [{k: torch.randn(s, generator=gen) for k, s in UNEVEN_SHAPES.items()} for _ in range(2)]
    make = lambda spec: gtx.chain(gtx.scale(-1e-3), gtx.stochastic_rounding(3, spec=spec))  # noqa: E731
    dense, _ = _run_with_state(make(None), params, grads)
    tx = make(spec)
    step = gtx.compile_step(tx, backend="eager")
    local = {k: cut(v, pieces[k], mesh) for k, v in params.items()}
    state = tx.init(local)
    for g in grads:
        local, state = step({k: cut(v, pieces[k], mesh) for k, v in g.items()}, state, local)
    for key in UNEVEN_SHAPES:
        assert torch.equal(local[key], cut(dense[key], pieces[key], mesh)), key


@pytest.mark.distributed
@pytest.mark.parametrize("size,name", _world.params_for(__name__))
def test_sharding_low_precision(size, name):
    _world.check(size, name)
