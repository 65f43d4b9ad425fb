"""gradtx.contrib under sharding: ``normalize(spec=...)`` divides by the logical gradient's norm on
every rank (a ``ShardingSpec`` or DTensor leaves), so SAM's adversarial step is the dense one, cut."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Replicate as DReplicate
from torch.distributed.tensor import Shard as DShard
from torch.distributed.tensor import distribute_tensor

import _world
from _layouts import close, dense_tree
from _world import case
import gradtx as gtx
from gradtx.contrib import normalize, sam
from gradtx.sharding import Replicate, Shard, ShardingSpec

SHAPES = {"w": (8, 3), "b": (5,)}


def _spec_and_cut(world):
    mesh = world.mesh((world.size,), ("tp",))
    spec = ShardingSpec(mesh, [("w", Shard("tp", dim=0)), ("b", Replicate())])

    def cut(tree):
        return {"w": torch.tensor_split(tree["w"], world.size, 0)[world.rank].clone(), "b": tree["b"].clone()}

    return spec, cut


@case(2, 4)
def normalize_with_a_spec_is_the_dense_normalize_cut(world):
    spec, cut = _spec_and_cut(world)
    dense = dense_tree(SHAPES, seed=3)
    expected, _ = normalize().update(dense, gtx.EmptyState())
    got, _ = normalize(spec=spec).update(cut(dense), gtx.EmptyState())
    for name, value in cut(expected).items():
        close(got[name], value, f"leaf {name!r}")
    # without the spec each rank divides by its own piece's norm: not the dense result
    local, _ = normalize().update(cut(dense), gtx.EmptyState())
    assert not torch.allclose(local["w"], cut(expected)["w"])


@case(2, 4)
def normalize_of_dtensor_leaves_is_the_dense_normalize(world):
    mesh = world.mesh((world.size,), ("tp",))
    dense = dense_tree(SHAPES, seed=4)
    expected, _ = normalize().update(dense, gtx.EmptyState())
    tree = {
        "w": distribute_tensor(dense["w"], mesh, [DShard(0)], src_data_rank=None),
        "b": distribute_tensor(dense["b"], mesh, [DReplicate()], src_data_rank=None),
    }
    got, _ = normalize().update(tree, gtx.EmptyState())
    for name, value in expected.items():
        close(got[name].full_tensor(), value, f"leaf {name!r}")


@case(2, 4)
def sam_with_a_sharded_adversarial_step_follows_the_dense_run(world):
    spec, cut = _spec_and_cut(world)

    def make(s):
        return sam(gtx.sgd(0.1, momentum=0.5), gtx.chain(normalize(spec=s), gtx.sgd(0.05)), sync_period=2)

    tx, dense_tx = make(spec), make(None)
    dense_params = dense_tree(SHAPES, seed=1)
    params = cut(dense_params)
    state, dense_state = tx.init(params), dense_tx.init(dense_params)
    for step in range(5):
        grads = dense_tree(SHAPES, seed=20 + step)
        updates, state = tx.update(cut(grads), state, params)
        dense_updates, dense_state = dense_tx.update(grads, dense_state, dense_params)
        params = gtx.apply_updates(params, updates)
        dense_params = gtx.apply_updates(dense_params, dense_updates)
        for name, value in cut(dense_params).items():
            close(params[name], value, f"step {step} param {name!r}")


@pytest.mark.distributed
@pytest.mark.parametrize("size,name", _world.params_for(__name__))
def test_contrib_sharding(size, name):
    _world.check(size, name)
