"""gradtx.sharding without a process group: leaf specs, and the local behaviour (no spec, no
DTensor) that must stay exactly torch's numbers."""

from __future__ import annotations

import math

import pytest
import torch

import gradtx as gtx
from gradtx.sharding import Replicate, Shard


def test_leaf_specs():
    assert Replicate() == Shard() and Replicate(duplicate=True) == Shard(duplicate=True)
    assert isinstance(Replicate(), Shard)
    assert Shard("dp", "tp", dim=1).dims == (1, 1)
    assert Shard("dp", "tp", dim=(0, None)).dims == (0, None)
    assert repr(Shard("tp", duplicate=True, dim=0)) == "Shard('tp', duplicate=True, dim=0)"
    assert repr(Replicate()) == "Replicate()"
    assert len({Shard("tp"), Shard("tp"), Shard("dp")}) == 2
    with pytest.raises(ValueError, match="named twice"):
        Shard("tp", "tp")
    with pytest.raises(TypeError, match="names"):
        Shard(0)
    with pytest.raises(ValueError, match="2 dims for 1 axes"):
        Shard("tp", dim=(0, 1))
    with pytest.raises(TypeError, match="dim"):
        Shard("tp", dim="0")
    with pytest.raises(ValueError, match=r"names no mesh axis.*Shard\('dp', dim=0\)"):
        Shard(dim=0)  # a DTensor habit: it would silently mean Replicate()


@pytest.mark.parametrize("p", [1.0, 2.0, 3.0, math.inf])
def test_without_spec_norms_are_torchs(p):
    gen = torch.Generator().manual_seed(0)
    tree = {"a": torch.randn(5, 3, generator=gen), "b": [torch.randn(7, generator=gen), None], "c": torch.randn(2, generator=gen, dtype=torch.float64)}
    tensors = [tree["a"], tree["b"][0], tree["c"]]
    assert torch.equal(gtx.global_norm(tree, norm_type=p), gtx.tree.total_norm(tensors, p))
    torch.testing.assert_close(gtx.global_norm(tree, norm_type=p), torch.nn.utils.get_total_norm(tensors, p).double())
    norms = gtx.sharding.leaf_norms(tree, norm_type=p)
    assert norms["b"][1] is None
    for x, n in zip(tensors, [norms["a"], norms["b"][0], norms["c"]]):
        torch.testing.assert_close(n, torch.linalg.vector_norm(x, p), check_dtype=False)
    rms = gtx.sharding.leaf_rms(tree)
    torch.testing.assert_close(rms["a"], tree["a"].pow(2).mean().sqrt(), check_dtype=False)


def test_local_path_needs_no_distributed():
    grads = {"w": torch.ones(4), "none": None}
    assert not gtx.sharding.is_sharded(list(grads.values()), None)
    assert not gtx.sharding.has_dtensor([torch.ones(2), None])
    locals_, rewrap = gtx.sharding.locals_of([grads["w"]])
    assert locals_[0] is grads["w"] and rewrap(locals_)[0] is grads["w"]
    (g_norms, p_norms) = gtx.sharding.unitwise_norms({"w": torch.ones(3, 4)}, {"w": 2 * torch.ones(3, 4)})
    torch.testing.assert_close(g_norms["w"], torch.full((3, 1), 2.0))
    torch.testing.assert_close(p_norms["w"], torch.full((3, 1), 4.0))


def test_spec_must_be_a_sharding_spec():
    with pytest.raises(TypeError, match="ShardingSpec"):
        gtx.global_norm({"w": torch.ones(2)}, "tp")
    with pytest.raises(TypeError, match="ShardingSpec"):
        gtx.sharding.leaf_norms({"w": torch.ones(2)}, spec=object())
