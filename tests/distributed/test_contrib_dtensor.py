"""gradtx.contrib's elementwise optimizers on DTensor leaves: FSDP-style Shard(0) (uneven), Shard(1)
and replicated leaves in one tree. Each rank's new params are its pieces of what the optimizer
gives the dense tree, on the pure and the donated path."""

from __future__ import annotations

import pytest
import torch

import _world
from _layouts import close
from _world import case
import gradtx as gtx
from gradtx import contrib

FACTORIES = {
    "adopt": lambda: contrib.adopt(0.05, nesterov=True),
    "ademamix": lambda: contrib.ademamix(0.05, b3=0.99, weight_decay=0.1),
    "simplified_ademamix": lambda: contrib.simplified_ademamix(0.05, alpha=1.0, weight_decay=0.1),
    "acprop": lambda: contrib.acprop(0.05, weight_decay=0.1),
    "madgrad": lambda: contrib.madgrad(0.05, weight_decay=0.1),
    "schedule_free_sgd": lambda: contrib.schedule_free_sgd(0.1, warmup_steps=2, weight_decay=0.1),
    "schedule_free_adamw": lambda: contrib.schedule_free_adamw(0.05, weight_decay=0.1),
}


def _tree(seed):
    gen = torch.Generator().manual_seed(seed)
    shapes = {"fsdp.weight": (5, 3), "tp.weight": (4, 6), "bias": (6,)}
    return {k: torch.randn(s, generator=gen, dtype=torch.float64) for k, s in shapes.items()}


def _run(tx, params, grads, *, inplace):
    state = tx.init(params)
    for g in grads:
        updates, state = tx.update(g, state, params, inplace=inplace)
        params = gtx.apply_updates(params, updates)
    return params, state


@case(2)
def contrib_optimizers_on_dtensor_leaves(world):
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    mesh = world.mesh((2,), ("dp",))
    layout = {"fsdp.weight": [Shard(0)], "tp.weight": [Shard(1)], "bias": [Replicate()]}

    def distribute(tree):
        return {k: distribute_tensor(v, mesh, layout[k], src_data_rank=None) for k, v in tree.items()}

    params, grads = _tree(0), [_tree(10 + i) for i in range(3)]
    for name, make in FACTORIES.items():
        expected, _ = _run(make(), params, grads, inplace=False)
        for inplace in (False, True):
            got, state = _run(make(), distribute(params), [distribute(g) for g in grads], inplace=inplace)
            for key, value in got.items():
                assert isinstance(value, DTensor), (name, key)
                want = distribute_tensor(expected[key], mesh, layout[key], src_data_rank=None).to_local()
                close(value.to_local(), want, f"{name} inplace={inplace} {key!r}", rtol=1e-12)
            if name.startswith("schedule_free"):
                x = contrib.schedule_free_eval_params(state, got)
                assert isinstance(x["fsdp.weight"], DTensor)


MIXED = {
    "adam": lambda: gtx.adam(0.05),
    "adamw": lambda: gtx.adamw(0.05, weight_decay=0.1),
    "lion": lambda: gtx.lion(0.05),
    "sgd_momentum": lambda: gtx.sgd(0.1, momentum=0.9, nesterov=True),
    "chain_clip_adamw": lambda: gtx.chain(gtx.clip_by_global_norm(0.5), gtx.adamw(0.05)),
    "adopt": lambda: contrib.adopt(0.05),
}


@case(2)
def optimizers_on_a_tree_mixing_dtensor_and_plain_leaves(world):
    """A tree with DTensor leaves and a plain (replicated, un-wrapped) one, as hand-written tensor
    parallelism or a partly wrapped model gives: each rank's result is its piece of the dense one."""
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    mesh = world.mesh((2,), ("dp",))
    layout = {"fsdp.weight": [Shard(0)], "tp.weight": [Shard(1)]}  # "bias" stays a plain tensor

    def distribute(tree):
        return {k: distribute_tensor(v, mesh, layout[k], src_data_rank=None) if k in layout else v.clone() for k, v in tree.items()}

    params, grads = _tree(0), [_tree(10 + i) for i in range(3)]
    for name, make in MIXED.items():
        expected, _ = _run(make(), params, grads, inplace=False)
        for inplace in (False, True):
            got, _ = _run(make(), distribute(params), [distribute(g) for g in grads], inplace=inplace)
            for key, value in got.items():
                assert isinstance(value, DTensor) == (key in layout), (name, key)
                want = distribute_tensor(expected[key], mesh, layout[key], src_data_rank=None).to_local() if key in layout else expected[key]
                local = value.to_local() if key in layout else value
                close(local, want, f"{name} inplace={inplace} {key!r}", rtol=1e-12)


@pytest.mark.distributed
@pytest.mark.parametrize("size,name", _world.params_for(__name__))
def test_contrib_dtensor(size, name):
    _world.check(size, name)
