"""A pipeline stage that holds no gradient (``{}``, or every leaf ``None``) still joins the
reductions of every transformation that takes a ``spec``: no rank hangs, the stage with gradients
gets the dense numbers, and scalar states agree across stages. Polyak's step size counts the logical
updates under a spec or DTensors (one step size on every rank)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import _world
from _layouts import close, dense_tree
from _world import case
import gradtx as gtx
from gradtx import tree as tree_lib
from gradtx import contrib
from gradtx.sharding import Replicate, Shard, ShardingSpec

SHAPES = {"s0.w": (6, 4), "s0.b": (4,)}

# every factory whose step needs a sum over the whole tree (a global reduction of its own)
GLOBAL = {
    "clip_by_global_norm": lambda spec: gtx.clip_by_global_norm(0.5, spec),
    "normalize_by_update_norm": lambda spec: gtx.normalize_by_update_norm(spec=spec),
    "contrib.normalize": lambda spec: contrib.normalize(spec=spec),
    "polyak_sgd": lambda spec: gtx.polyak_sgd(max_learning_rate=0.5, spec=spec),
    "prodigy": lambda spec: contrib.prodigy(1.0, spec=spec),
    "dadapt_adamw": lambda spec: contrib.dadapt_adamw(1.0, spec=spec),
    "dog": lambda spec: contrib.dog(0.5, spec=spec),  # its first step reduces over the params at init
    "dowg": lambda spec: contrib.dowg(0.5, spec=spec),
    "mechanize": lambda spec: contrib.mechanize(gtx.sgd(0.1, momentum=0.9), spec=spec),
    "momo": lambda spec: contrib.momo(0.5, spec=spec),
    "momo_adam": lambda spec: contrib.momo_adam(0.1, spec=spec),
    "observe": lambda spec: gtx.observe(gtx.chain(gtx.clip_by_global_norm(0.5, spec), gtx.adam(0.1)), spec=spec),
    "apply_if_finite": lambda spec: gtx.apply_if_finite(gtx.sgd(0.1), 3, spec=spec),
    "lamb": lambda spec: gtx.lamb(0.1, spec=spec),
}
WITH_VALUE = {"polyak_sgd", "momo", "momo_adam"}
STEPS = 2


def _zero_d_floats(state) -> list[torch.Tensor]:
    return [x for x in tree_lib.leaves(state) if isinstance(x, torch.Tensor) and x.ndim == 0 and x.is_floating_point()]


def _same_scalars_on_every_rank(state, what: str) -> None:
    """The 0-d states (step sizes, counts, norms) of this rank's stage equal the other stage's."""
    scalars = torch.stack([x.to(torch.float64) for x in _zero_d_floats(state)] or [torch.zeros(())])
    sizes = [torch.zeros((), dtype=torch.int64) for _ in range(dist.get_world_size())]
    dist.all_gather(sizes, torch.tensor(scalars.numel()))
    assert len({int(s) for s in sizes}) == 1, f"{what}: stages keep different numbers of scalars"
    gathered = [torch.empty_like(scalars) for _ in sizes]
    dist.all_gather(gathered, scalars)
    for rank, other in enumerate(gathered):
        torch.testing.assert_close(other, scalars, rtol=0, atol=0, msg=f"{what}: scalar states differ from rank {rank}'s")


def _run(name, spec, grads_of, params):
    tx = GLOBAL[name](spec)
    state = tx.init(params)
    for step in range(STEPS):
        extra = {"value": torch.tensor(3.0 - step)} if name in WITH_VALUE else {}
        updates, state = tx.update(grads_of(step), state, params, **extra)
        params = gtx.apply_updates(params, updates)
    return params, state


@case(2)
def a_stage_without_gradients_joins_every_reduction(world):
    mesh = world.mesh((2,), ("pp",))
    stage = world.rank
    dense_params = dense_tree(SHAPES, seed=1)  # float32: a stage without leaves keeps float32 scalars
    frozen_params = dense_tree({"s1.frozen": (3,)}, seed=5)

    def dense_grads(step):
        return {k: v * (step + 1) for k, v in dense_tree(SHAPES, seed=2).items()}

    for frozen in (False, True):  # stage 1 holds no leaf, or only leaves without gradients
        # a spec each: its plans are checked across ranks when new, so a tree must not change on one stage only
        spec = ShardingSpec(mesh, [("s0.*", Replicate())] + [("s1.*", Replicate())] * frozen, stage_axis="pp")
        if stage == 0:
            params, grads_of = dict(dense_params), dense_grads
        elif frozen:
            params, grads_of = dict(frozen_params), lambda step: {"s1.frozen": None}
        else:
            params, grads_of = {}, lambda step: {}
        what = "frozen params" if frozen else "no leaves"
        for name in GLOBAL:
            got, state = _run(name, spec, grads_of, params)
            _same_scalars_on_every_rank(state, f"{name}, a stage with {what}")
            if stage == 0:
                union = {**dense_params, **frozen_params} if frozen else dict(dense_params)
                none = {"s1.frozen": None} if frozen else {}
                expected, _ = _run(name, None, lambda step: {**dense_grads(step), **none}, union)
                for leaf in SHAPES:
                    close(got[leaf], expected[leaf], f"{name}, other stage with {what}: {leaf!r}", rtol=0, atol=0)
            else:
                assert all(got[k] is params[k] for k in got), f"{name}: the stage without gradients changed its params"


def _polyak_runs(spec, grads, params, value):
    tx = gtx.polyak_sgd(max_learning_rate=10.0, spec=spec)
    updates, _ = tx.update(grads, tx.init(params), params, value=value)
    return updates


@case(2)
def polyak_step_size_counts_the_logical_updates(world):
    from torch.distributed.tensor import DTensor, distribute_tensor, Replicate as R, Shard as S

    mesh = world.mesh((2,), ("tp",))
    spec = ShardingSpec(mesh, [("w", Shard("tp", dim=0)), ("b", Replicate())])
    dense = dense_tree({"w": (5, 3), "b": (4,)}, seed=3, dtype=torch.float64)
    params = dense_tree({"w": (5, 3), "b": (4,)}, seed=4, dtype=torch.float64)
    value = torch.tensor(2.5, dtype=torch.float64)
    expected = _polyak_runs(None, dense, params, value)

    def cut(tree):
        return {"w": torch.tensor_split(tree["w"], 2, 0)[world.rank].clone(), "b": tree["b"].clone()}

    got = _polyak_runs(spec, cut(dense), cut(params), value)
    for leaf, want in cut(expected).items():
        close(got[leaf], want, f"polyak_sgd with a spec: {leaf!r}", rtol=1e-12, atol=1e-14)
    alone = _polyak_runs(None, cut(dense), cut(params), value)  # the control: this rank's pieces alone
    assert not torch.allclose(alone["w"], cut(expected)["w"], rtol=1e-6, atol=0)
    placements = {"w": [S(0)], "b": [R()]}  # uneven: 5 rows over 2 ranks
    dt = {k: distribute_tensor(v, mesh, placements[k], src_data_rank=None) for k, v in dense.items()}
    dp = {k: distribute_tensor(v, mesh, placements[k], src_data_rank=None) for k, v in params.items()}
    got = _polyak_runs(None, dt, dp, value)
    for leaf, want in expected.items():
        assert isinstance(got[leaf], DTensor)
        close(got[leaf].full_tensor(), want, f"polyak_sgd on DTensors: {leaf!r}", rtol=1e-12, atol=1e-14)


# after every case above: the parameters are read when this is defined
@pytest.mark.distributed
@pytest.mark.parametrize("size,name", _world.params_for(__name__))
def test_sharding_stages(size, name):
    _world.check(size, name)
