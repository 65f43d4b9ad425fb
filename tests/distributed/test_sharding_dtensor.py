"""DTensor gradients describe themselves: FSDP2-style Shard(0) over dp, TP placements, meshes that
are slices (``mesh["dp"]``) or flattenings of one root, mixed with plain tensors, with or without a
ShardingSpec; and torch's own ``fully_shard`` + tensor parallelism on CPU gloo."""

from __future__ import annotations

import contextlib
import copy
import logging
import math

import pytest
import torch
from torch import nn

import _world
from _layouts import P_VALUES, close, dense_tree
from _world import case
import gradtx as gtx
from gradtx.sharding import Replicate, Shard, ShardingSpec


def _dtensor_tree(world):
    from torch.distributed.tensor import Replicate as R, Shard as S, distribute_tensor

    mesh = world.mesh((2, 2), ("dp", "tp"))
    flat = mesh["dp", "tp"]._flatten("dp_tp")
    shapes = {
        "col.weight": (10, 6),  # FSDP2 + TP column-parallel: dp and tp both on dim 0
        "row.weight": (7, 8),  # FSDP2 on dim 0 (uneven), TP row-parallel on dim 1
        "dp_only.weight": (5, 3),  # a module sharded by FSDP only: on mesh["dp"], copies over tp
        "replicated.bias": (6,),
        "flat.weight": (9, 2),  # sharded over the flattened dp x tp mesh
        "plain.norm": (4,),  # a plain tensor: replicated everywhere
        "absent": None,
    }
    dense = dense_tree({k: v for k, v in shapes.items() if v is not None})
    params = dense_tree({k: v for k, v in shapes.items() if v is not None}, seed=1)
    layout = {
        "col.weight": (mesh, [S(0), S(0)]),
        "row.weight": (mesh, [S(0), S(1)]),
        "dp_only.weight": (mesh["dp"], [S(0)]),
        "replicated.bias": (mesh, [R(), R()]),
        "flat.weight": (flat, [S(0)]),
    }

    def distribute(tree):
        out = {k: distribute_tensor(v, *layout[k], src_data_rank=None) if k in layout else v.clone() for k, v in tree.items()}
        out["absent"] = None
        return out

    return mesh, dense, params, distribute


def _local(x):
    from torch.distributed.tensor import DTensor

    return x.to_local() if isinstance(x, DTensor) else x


# Results are compared shard by shard with the dense reference cut by the same placements
# (``distribute_tensor`` slices locally). ``full_tensor()`` is avoided: in torch 2.13, once a mesh
# has been ``_flatten``-ed, it reassembles [Shard(0), Shard(0)] DTensors in the wrong order.


def _check_dtensors(world, spec_for):
    mesh, dense, params, distribute = _dtensor_tree(world)
    grads = distribute(dense)
    spec = spec_for(mesh)
    cut = lambda tree: {k: _local(v) for k, v in distribute(tree).items() if v is not None}  # noqa: E731
    for p in P_VALUES:
        expected = gtx.global_norm(dense, norm_type=p)
        close(gtx.global_norm(grads, spec, norm_type=p), expected, f"global norm p={p}")
        norms = gtx.sharding.leaf_norms(grads, spec, norm_type=p)
        assert norms["absent"] is None
        for name, x in dense.items():
            close(norms[name], torch.linalg.vector_norm(x, p), f"leaf norm {name!r} p={p}")
        tx = gtx.clip_by_global_norm(0.5 * float(expected), spec, norm_type=p)
        clipped, state = tx.update(grads, tx.init(grads))
        reference, _ = gtx.clip_by_global_norm(0.5 * float(expected), norm_type=p).update(dense, None)
        close(state.norm, expected, "state norm")
        for name, x in cut(reference).items():
            assert type(clipped[name]) is type(grads[name]), name
            if hasattr(grads[name], "placements"):
                assert clipped[name].placements == grads[name].placements, name
            close(_local(clipped[name]), x, f"clipped {name!r} p={p}")
        for name, x in cut(dense).items():
            assert torch.equal(_local(grads[name]), x), f"the input {name!r} was modified"

    blocked, _ = gtx.clip_by_block_rms(0.5, spec).update(grads, None)
    dense_blocked, _ = gtx.clip_by_block_rms(0.5).update(dense, None)
    for name, x in cut(dense_blocked).items():
        close(_local(blocked[name]), x, f"block rms {name!r}")
    agc, _ = gtx.adaptive_grad_clip(0.05, spec=spec).update(grads, None, distribute(params))
    dense_agc, _ = gtx.adaptive_grad_clip(0.05).update(dense, None, params)
    for name, x in cut(dense_agc).items():
        close(_local(agc[name]), x, f"agc {name!r}")


@case(4)
def dtensors_mixed_meshes_no_spec(world):
    _check_dtensors(world, lambda mesh: None)


@case(4)
def dtensors_mixed_meshes_with_spec(world):
    _check_dtensors(world, lambda mesh: ShardingSpec(mesh, [("plain.*", Replicate())]))


@case(4)
def dtensor_tied_duplicate_by_rule(world):
    """A DTensor rule may add duplicate=True (a tied copy); naming other axes is an error."""
    from torch.distributed.tensor import Shard as S, distribute_tensor

    mesh = world.mesh((2, 2), ("dp", "tp"))
    dense = dense_tree({"embed": (8, 4), "other": (6,)})
    grads = {
        "embed": distribute_tensor(dense["embed"], mesh, [S(0), S(1)], src_data_rank=None),
        "lm_head": distribute_tensor(dense["embed"], mesh, [S(0), S(1)], src_data_rank=None),
        "other": dense["other"].clone(),
    }
    spec = ShardingSpec(mesh, [("lm_head", Shard("dp", "tp", duplicate=True))], default=Replicate())
    for p in P_VALUES:
        close(gtx.global_norm(grads, spec, norm_type=p), gtx.global_norm(dense, norm_type=p), f"p={p}")
    bad = ShardingSpec(mesh, [("lm_head", Shard("tp", duplicate=True))], default=Replicate())
    with pytest.raises(ValueError, match=r"'lm_head'.*DTensor"):
        gtx.global_norm(grads, bad)


@contextlib.contextmanager
def _quiet_redistribute():
    """torch's own clip_grad_norm_ reduces its norm over two mesh dims one after the other, and DTensor
    logs a warning per rank suggesting a flattened mesh: advice for torch's code, not the code under test."""
    logger = logging.getLogger("torch.distributed.tensor._redistribute")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


@case(4)
def dtensors_match_torch_clip_grad_norm(world):
    from torch.distributed.tensor import Shard as S, distribute_tensor

    mesh = world.mesh((2, 2), ("dp", "tp"))
    dense = dense_tree({"a": (8, 6), "b": (4, 10), "c": (6,)})
    placements = {"a": [S(0), S(0)], "b": [S(0), S(1)], "c": [S(0), S(0)]}
    grads = {k: distribute_tensor(v, mesh, placements[k], src_data_rank=None) for k, v in dense.items()}
    for p in (2.0, math.inf):
        params = [nn.Parameter(torch.zeros_like(g)) for g in grads.values()]
        for param, g in zip(params, grads.values()):
            param.grad = g.clone()
        with _quiet_redistribute():
            theirs = torch.nn.utils.clip_grad_norm_(params, 1.0, norm_type=p)
            theirs = theirs.full_tensor() if hasattr(theirs, "full_tensor") else theirs  # replicated: no reassembly
        ours, _ = gtx.clip_by_global_norm(1.0, norm_type=p).update(grads, None)
        close(gtx.global_norm(grads, norm_type=p), theirs, f"norm p={p}")
        for param, name in zip(params, grads):
            close(ours[name].to_local(), param.grad.to_local(), f"clipped {name!r} p={p}")


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 6), nn.LayerNorm(6))


@case(4)
def fully_shard_with_tensor_parallel(world):
    """torch's FSDP2 (fully_shard over dp) on top of TP (colwise/rowwise over tp): the DTensor
    gradients it leaves give the same norm and clip as the unsharded model."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = world.mesh((2, 2), ("fsdp", "tp"))  # a root of its own: untouched by other cases' flattening
    reference = _mlp()
    model = copy.deepcopy(reference)
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fully_shard(model, mesh=mesh["fsdp"])
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(1))  # the same batch everywhere
    model(x).square().sum().backward()
    reference(x).square().sum().backward()
    grads = {name: p.grad for name, p in model.named_parameters()}
    dense = {name: p.grad for name, p in reference.named_parameters()}
    for p in P_VALUES:
        close(gtx.global_norm(grads, norm_type=p), gtx.global_norm(dense, norm_type=p), f"p={p}", rtol=1e-4)
    clipped, _ = gtx.clip_by_global_norm(0.1).update(grads, None)
    dense_clipped, _ = gtx.clip_by_global_norm(0.1).update(dense, None)
    from torch.distributed.tensor import distribute_tensor

    for name, x in dense_clipped.items():
        grad = grads[name]
        assert grad.placements == clipped[name].placements
        expected = distribute_tensor(x, grad.device_mesh, grad.placements, src_data_rank=None).to_local()
        close(clipped[name].to_local(), expected, f"clipped {name!r}", rtol=1e-4)


@pytest.mark.distributed
@pytest.mark.parametrize("size,name", _world.params_for(__name__))
def test_dtensor(size, name):
    _world.check(size, name)
