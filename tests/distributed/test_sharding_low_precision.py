"""Stochastic rounding under sharding: each rank's new params are its pieces of the dense run's,
bit for bit (plain pieces of a ShardingSpec split over dim 0 and dim 1, FSDP2-style DTensors with
an uneven Shard(0))."""

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


@case(2, 4)
def stochastic_rounding_on_uneven_fsdp_dtensors_equals_dense(world):
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    mesh = world.mesh((world.size,), ("dp",))
    shapes = {"w": (5, 3), "v": (7,)}  # uneven over 2 and 4 ranks, one rank's piece empty at 4
    gen = torch.Generator().manual_seed(1)
    params = {k: torch.randn(s, generator=gen).to(torch.bfloat16) for k, s in shapes.items()}
    grads = [{k: torch.randn(s, generator=gen) * 1e-3 for k, s in shapes.items()} for _ in range(3)]
    dense = _run(gtx.stochastic_rounding(4), params, grads)

    def distribute(tree):
        return {k: distribute_tensor(v, mesh, [Shard(0)], src_data_rank=None) for k, v in tree.items()}

    got = _run(gtx.stochastic_rounding(4), distribute(params), [distribute(g) for g in grads])
    for key, value in got.items():
        assert isinstance(value, DTensor), key
        want = distribute_tensor(dense[key], mesh, [Shard(0)], src_data_rank=None).to_local()
        assert torch.equal(value.to_local(), want), key


@pytest.mark.distributed
@pytest.mark.parametrize("size,name", _world.params_for(__name__))
def test_sharding_low_precision(size, name):
    _world.check(size, name)
