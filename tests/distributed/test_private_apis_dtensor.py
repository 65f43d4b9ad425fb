"""DTensor and DeviceMesh internals gradtx reads (``_local_tensor``, ``_spec``, ``_get_root_mesh``)
exist on real DTensors, and where a torch lacks them the public fallbacks (``to_local``,
``from_local``, the DTensor's own mesh) give the same steps."""

from __future__ import annotations

import contextlib

import pytest
import torch

import _world
from _layouts import close
from _world import case
import gradtx as gtx
from gradtx.sharding import dtensor as dtensor_lib
from gradtx.sharding import plan as plan_lib


@contextlib.contextmanager
def _without_dtensor_internals():
    """As on a torch whose DTensor has neither attribute and whose DeviceMesh has no ``_get_root_mesh``."""
    saved = dtensor_lib._LOCAL_TENSOR, dtensor_lib._SPEC, plan_lib._ROOT_MESH
    dtensor_lib._LOCAL_TENSOR, dtensor_lib._SPEC, plan_lib._ROOT_MESH = "_no_local_tensor", "_no_spec", "_no_root_mesh"
    try:
        yield
    finally:
        dtensor_lib._LOCAL_TENSOR, dtensor_lib._SPEC, plan_lib._ROOT_MESH = saved


def _step(world):
    """Three clipped AdamW steps on a Shard(0) and a Replicate DTensor: params and local moments."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = world.mesh((2,), ("dp",))
    generator = torch.Generator().manual_seed(0)
    dense = {"w": torch.randn(6, 3, generator=generator), "b": torch.randn(4, generator=generator)}
    layout = {"w": [Shard(0)], "b": [Replicate()]}
    params = {k: distribute_tensor(v, mesh, layout[k]) for k, v in dense.items()}
    grads = {k: distribute_tensor(v.flip(0) * 0.5, mesh, layout[k]) for k, v in dense.items()}
    tx = gtx.chain(gtx.clip_by_global_norm(0.3), gtx.adamw(0.1, weight_decay=0.01))
    state = tx.init(params)
    for _ in range(3):
        updates, state = tx.update(grads, state, params)
        params = gtx.apply_updates(params, updates)
    for k in dense:
        assert params[k].placements == tuple(layout[k]), k
    return {k: v.to_local() for k, v in params.items()}, state


@case(2)
def private_dtensor_apis_exist(world):
    """(``tests/test_torch_private_apis.py`` checks the class attributes; here, on a real DTensor.)"""
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = world.mesh((2,), ("dp",))
    x = distribute_tensor(torch.arange(8.0), mesh, [Shard(0)])
    with torch.no_grad():
        assert x._local_tensor is x.to_local()
    rebuilt = type(x)(x._local_tensor * 2, x._spec, requires_grad=False)
    assert rebuilt.placements == x.placements and torch.equal(rebuilt.to_local(), x.to_local() * 2)


@case(2)
def dtensor_steps_without_dtensor_internals(world):
    with _without_dtensor_internals():  # first: a plan cached by the other run would hide the fallbacks
        assert dtensor_lib.local(torch.zeros(1)).shape == (1,)
        params, state = _step(world)
    expected_params, expected_state = _step(world)
    for k, v in expected_params.items():
        close(params[k], v, f"param {k!r}", rtol=0, atol=0)
    mu, expected_mu = state[1][0].mu["w"], expected_state[1][0].mu["w"]
    assert type(mu) is type(expected_mu) and mu.placements == expected_mu.placements
    close(mu.to_local(), expected_mu.to_local(), "mu", rtol=0, atol=0)


@pytest.mark.distributed
@pytest.mark.parametrize("size,name", _world.params_for(__name__))
def test_private_dtensor_apis(size, name):
    _world.check(size, name)
