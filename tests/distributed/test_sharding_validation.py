"""Bad specs fail fast with a clear ValueError on every rank, before any collective (so nobody
hangs and the next collective still works); the opt-in consistency check turns ranks that
disagree into an error instead of a wrong norm."""

from __future__ import annotations

import math
import time

import pytest
import torch

import _world
from _layouts import close, dense_tree
from _world import case
import gradtx as gtx
from gradtx.sharding import Replicate, Shard, ShardingSpec

FAST_S = 5.0  # far below the 30 s collective timeout: an error raised after a collective would hang


def _fails_fast(fn, match: str, error=ValueError):
    start = time.perf_counter()
    with pytest.raises(error, match=match):
        fn()
    assert time.perf_counter() - start < FAST_S


def _still_in_step(world, mesh):
    """A collective right after the errors completes: no rank is stuck in a half-started one."""
    grads = {"w": torch.full((2,), float(world.rank + 1))}
    norm = gtx.global_norm(grads, ShardingSpec(mesh, [("w", Shard(mesh.mesh_dim_names[-1]))]), norm_type=1.0)
    assert float(norm) == 2.0 * sum(range(1, world.size + 1))


@case(2)
def bad_specs_fail_fast(world):
    mesh = world.mesh((2,), ("tp",))
    grads = {"w": torch.ones(4, 2), "b": torch.ones(4)}
    _fails_fast(lambda: ShardingSpec(world.mesh((2,), None)), r"no axis names")
    _fails_fast(lambda: ShardingSpec(mesh, [("w", Shard("pp"))]), r"rule 'w'.*axis 'pp'")
    _fails_fast(lambda: ShardingSpec(mesh, stage_axis="pp"), r"stage_axis.*'pp'")
    _fails_fast(lambda: ShardingSpec(mesh, [("w", Shard("tp"))], stage_axis="tp"), r"stage axis 'tp'")
    _fails_fast(lambda: ShardingSpec(mesh, [("w", "tp")]), r"rule 'w'", TypeError)
    _fails_fast(lambda: Shard("tp", dim=(0, 1)), r"2 dims for 1 axes")
    # Found while resolving the tree: named by leaf path (and axis).
    _fails_fast(lambda: gtx.global_norm(grads, ShardingSpec(mesh, {"w": Shard("ep"), "b": Replicate()})), r"'w'.*'ep'")
    _fails_fast(lambda: gtx.global_norm(grads, ShardingSpec(mesh, [("w", Shard("tp"))])), r"no rule matches leaf 'b'")
    _fails_fast(lambda: gtx.global_norm(grads, ShardingSpec(mesh, [])), r"no rule matches leaf 'b'")
    _fails_fast(lambda: gtx.global_norm(grads, ShardingSpec(mesh, {"w": Shard("tp")})), r"'b' is not covered")
    _fails_fast(
        lambda: gtx.global_norm(grads, ShardingSpec(mesh, {"w": Shard("tp"), "b": Replicate(), "c": Replicate()})),
        r"do not fit",
    )
    _fails_fast(lambda: gtx.global_norm(grads, ShardingSpec(mesh, lambda path, t: "tp")), r"leaf 'b'", TypeError)
    _fails_fast(lambda: gtx.global_norm(grads, ShardingSpec(mesh), norm_type=0.0), r"norm_type")
    _fails_fast(lambda: gtx.clip_by_global_norm(1.0, "tp").update(grads, None), r"ShardingSpec", TypeError)
    agc = gtx.adaptive_grad_clip(0.1, spec=ShardingSpec(mesh, [("w", Shard("tp")), ("b", Replicate())]))
    _fails_fast(lambda: agc.update(grads, None, grads), r"'w'.*axis 'tp'.*dim=")
    _still_in_step(world, mesh)


@case(2)
def partial_dtensor_is_an_error(world):
    from torch.distributed.tensor import DTensor, Partial

    mesh = world.mesh((2,), ("tp",))
    grads = {"ok": torch.ones(3), "layer.grad": DTensor.from_local(torch.ones(3), mesh, [Partial()], run_check=False)}
    _fails_fast(lambda: gtx.global_norm(grads), r"'layer.grad'.*Partial.*axis 'tp'.*reduce")
    _fails_fast(lambda: gtx.clip_by_global_norm(1.0, ShardingSpec(mesh)).update(grads, None), r"'layer.grad'.*Partial")
    _still_in_step(world, mesh)


def _staged(world, mesh, extra_leaf: bool):
    """Stage 0 has tensor-parallel leaves, stage 1 only replicated ones."""
    coord = dict(zip(mesh.mesh_dim_names, mesh.get_coordinate()))
    dense = dense_tree({"s0.w": (4, 2), "s1.b": (3,)})
    if coord["pp"] == 0:
        grads = {"s0.w": torch.tensor_split(dense["s0.w"], 2, 0)[coord["tp"]].clone()}
        if extra_leaf and coord["tp"] == 1:
            grads["s0.extra"] = torch.ones(2)
    else:
        grads = {"s1.b": dense["s1.b"].clone()}
    return dense, grads


def _spec_by_callable(path, tensor):
    return Shard("tp") if path.startswith("s0.w") else Replicate()


@case(4)
def consistency_check(world):
    mesh = world.mesh((2, 2), ("pp", "tp"))
    # Trees that differ inside a stage: a clear error on every rank, not a wrong norm.
    _, grads = _staged(world, mesh, extra_leaf=True)
    spec = ShardingSpec(mesh, [("s0.*", Shard("tp")), ("s1.*", Replicate())], stage_axis="pp", default=Replicate(), check_consistency=True)
    _fails_fast(lambda: gtx.global_norm(grads, spec), r"different gradient trees")
    # Stages that shard over different axes, given by a callable: they disagree on the group.
    dense, grads = _staged(world, mesh, extra_leaf=False)
    spec = ShardingSpec(mesh, _spec_by_callable, stage_axis="pp", check_consistency=True)
    _fails_fast(lambda: gtx.global_norm(grads, spec), r"disagree on the reduction group.*reduce_axes")
    # reduce_axes puts every rank in the same group; the check then passes and the norm is exact.
    spec = ShardingSpec(mesh, _spec_by_callable, stage_axis="pp", reduce_axes=("tp",), check_consistency=True)
    for p in (1.0, 2.0, math.inf):
        close(gtx.global_norm(grads, spec, norm_type=p), gtx.global_norm(dense, norm_type=p), f"p={p}")
    # A rule list declares its axes, so stages agree without help.
    spec = ShardingSpec(mesh, [("s0.*", Shard("tp")), ("s1.*", Replicate())], stage_axis="pp", check_consistency=True)
    close(gtx.global_norm(grads, spec), gtx.global_norm(dense), "rules")


@case(2)
def callable_spec_is_asked_again_for_each_tree(world):
    """A callable that looks at the tensor is not served the plan of another tree of the same structure."""
    mesh = world.mesh((2,), ("tp",))
    spec = ShardingSpec(mesh, lambda path, t: Shard("tp") if t.ndim == 2 else Replicate())
    matrix = torch.full((2, 3), 1.0)  # this rank's half of a (4, 3) matrix of ones
    vector = torch.full((6,), 1.0)  # the same structure, replicated: every rank holds all of it
    assert float(gtx.global_norm({"x": matrix}, spec, norm_type=1.0)) == 12.0
    assert float(gtx.global_norm({"x": vector}, spec, norm_type=1.0)) == 6.0
    assert float(gtx.global_norm({"x": matrix}, spec, norm_type=1.0)) == 12.0


@pytest.mark.distributed
@pytest.mark.parametrize("size,name", _world.params_for(__name__))
def test_validation(size, name):
    _world.check(size, name)
