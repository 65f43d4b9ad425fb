"""gradtx.checkpoint under real gloo worlds: a run saved with DCP on one layout and resumed on
another equals an uninterrupted dense run (float32, 1e-6 relative), for every optimizer family.

Layouts (each case emulates the next layout on the same ranks with another mesh or spec):
TP 2 x PP 2 -> TP 1 x PP 2 -> dense; ZeRO flat over dp 4 -> dp 2 (uneven flat pieces); TP 2 x
FSDP 2 DTensors -> FSDP 4 DTensors (uneven); experts over ep 2 -> ep 1; uneven plain TP pieces ->
uneven FSDP2-style DTensors; a replicated run with a generator state -> dense. The params are
saved and loaded through the same API (a params tree is a state shaped like the params).
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import pytest
import torch
import torch.distributed as dist

import _world
from _layouts import Piece, close, cut, dense_tree, local_tree, rules
from _world import case
import gradtx as gtx
from gradtx.sharding import ShardingSpec

N_STEPS, M_STEPS, K_STEPS = 2, 2, 1
RTOL, ATOL = 1e-6, 1e-7


def shared_dir(world) -> str:
    """A temporary directory every rank sees: made by rank 0, its name broadcast."""
    name = [tempfile.mkdtemp(prefix="gradtx_ckpt_") if world.rank == 0 else None]
    dist.broadcast_object_list(name, src=0)
    return name[0]


def remove_dir(world, path: str) -> None:
    dist.barrier()
    if world.rank == 0:
        shutil.rmtree(path, ignore_errors=True)


# --------------------------------------------------------------------------- layouts


@dataclass
class Layout:
    """How the params lie on this rank: plain pieces under a spec (``pieces``), DTensors
    (``placements`` per leaf), or whole on every rank (neither)."""

    mesh: Any = None
    pieces: Optional[dict[str, Piece]] = None
    stage_axis: Optional[str] = None
    placements: Optional[dict[str, tuple]] = None
    spec: Optional[ShardingSpec] = field(default=None, init=False)

    def __post_init__(self):
        if self.pieces is not None:
            self.spec = ShardingSpec(self.mesh, rules(self.pieces), stage_axis=self.stage_axis)

    def local(self, dense: dict) -> dict:
        if self.placements is not None:
            from torch.distributed.tensor import distribute_tensor

            return {n: distribute_tensor(x, self.mesh, self.placements[n], src_data_rank=None) for n, x in dense.items()}
        if self.pieces is not None:
            return local_tree(dense, self.pieces, self.mesh, self.stage_axis)
        return {n: x.clone() for n, x in dense.items()}


def local_of(x):
    return x.to_local() if hasattr(x, "to_local") else x


def check_params(params, dense, layout: Layout, what: str) -> None:
    trees = [(params, dense)] if not isinstance(params, gtx.LookaheadParams) else [(params.fast, dense.fast), (params.slow, dense.slow)]
    for mine, theirs in trees:
        expected = layout.local(theirs)
        assert sorted(mine) == sorted(expected), what
        for name in expected:
            close(local_of(mine[name]), local_of(expected[name]), f"{what}: {name}", rtol=RTOL, atol=ATOL)


# --------------------------------------------------------------------------- families


@dataclass(frozen=True)
class Family:
    make: Callable[[Optional[ShardingSpec]], Any]
    extra: Callable[[int], dict] = lambda step: {}
    lookahead: bool = False


FAMILIES = {
    "adamw": Family(lambda spec: gtx.chain(gtx.clip_by_global_norm(1.0, spec), gtx.adamw(1e-2, weight_decay=0.1))),
    "adafactor": Family(lambda spec: gtx.adafactor(1e-2, min_dim_size_to_factor=4, spec=spec)),
    "muon_owner": Family(lambda spec: gtx.contrib.muon(1e-2, spec=spec, strategy="owner")),
    "muon_gather": Family(lambda spec: gtx.contrib.muon(1e-2, spec=spec, strategy="gather")),
    "galore": Family(lambda spec: gtx.contrib.galore(1e-2, rank=2, update_proj_gap=2, spec=spec)),
    "schedule_free_adamw": Family(lambda spec: gtx.contrib.schedule_free_adamw(1e-2, warmup_steps=2)),
    "multi_steps": Family(lambda spec: gtx.MultiSteps(gtx.adamw(1e-2), every_k_schedule=2, spec=spec).gradient_transformation()),
    "inject_hyperparams": Family(lambda spec: gtx.inject_hyperparams(gtx.adamw)(learning_rate=gtx.linear_schedule(1e-2, 1e-3, 8))),
    "lookahead": Family(lambda spec: gtx.lookahead(gtx.adam(1e-2), sync_period=2, slow_step_size=0.5), lookahead=True),
    "reduce_on_plateau": Family(
        lambda spec: gtx.chain(gtx.adam(1e-2), gtx.contrib.reduce_on_plateau(factor=0.5, patience=1)),
        extra=lambda step: {"value": torch.tensor(float(step % 3 == 0) + 1.0)},
    ),
}


def grads_at(shapes, step):
    return dense_tree(shapes, seed=1000 + step)


def params_of(family: Family, plain: dict):
    return gtx.LookaheadParams.init_synced(plain) if family.lookahead else plain


def plain_of(params):
    return params.fast if isinstance(params, gtx.LookaheadParams) else params


def run_steps(tx, family: Family, layout: Layout, shapes, params, state, steps):
    for step in steps:
        grads = layout.local(grads_at(shapes, step))
        updates, state = tx.update(grads, state, params, **family.extra(step))
        params = gtx.apply_updates(params, updates)
    return params, state


def dense_run(family: Family, shapes, steps):
    tx = family.make(None)
    params = params_of(family, dense_tree(shapes, seed=7))
    return run_steps(tx, family, Layout(), shapes, params, tx.init(params), steps)[0]


def save(path: str, params, state, layout: Layout) -> None:
    import torch.distributed.checkpoint as dcp

    plain = plain_of(params)
    sd = {
        "state": gtx.checkpoint.state_dict(state, plain, layout.spec),
        "params": gtx.checkpoint.state_dict(params, plain, layout.spec),
    }
    dcp.save(sd, checkpoint_id=path)


def load(path: str, tx, family: Family, layout: Layout, shapes):
    """The new layout's template (params and state of other values), filled from the checkpoint."""
    import torch.distributed.checkpoint as dcp

    params = params_of(family, layout.local(dense_tree(shapes, seed=99)))
    state = tx.init(params)
    plain = plain_of(params)
    sd = {
        "state": gtx.checkpoint.state_dict(state, plain, layout.spec),
        "params": gtx.checkpoint.state_dict(params, plain, layout.spec),
    }
    dcp.load(sd, checkpoint_id=path)
    new_params = gtx.checkpoint.load_state_dict(params, sd["params"], plain, layout.spec)
    new_state = gtx.checkpoint.load_state_dict(state, sd["state"], plain_of(new_params), layout.spec)
    return new_params, new_state


def resume_chain(world, family_names, shapes, layouts: list[Layout], steps: list[int]) -> None:
    """For each family: ``steps[0]`` steps on ``layouts[0]``, saved; loaded on ``layouts[1]``,
    ``steps[1]`` more, saved; ... Every stretch ends equal to the dense run of as many steps."""
    root = shared_dir(world)
    try:
        for name in family_names:
            family = FAMILIES[name]
            done = 0
            params = state = None
            for i, (layout, count) in enumerate(zip(layouts, steps)):
                tx = family.make(layout.spec)
                if i == 0:
                    params = params_of(family, layout.local(dense_tree(shapes, seed=7)))
                    state = tx.init(params)
                else:
                    params, state = load(f"{root}/{name}_{i - 1}", tx, family, layout, shapes)
                    check_params(params, dense_run(family, shapes, range(done)), layout, f"{name}: loaded on layout {i}")
                params, state = run_steps(tx, family, layout, shapes, params, state, range(done, done + count))
                done += count
                check_params(params, dense_run(family, shapes, range(done)), layout, f"{name}: layout {i} after {done} steps")
                if i + 1 < len(layouts):
                    save(f"{root}/{name}_{i}", params, state, layout)
    finally:
        remove_dir(world, root)


# --------------------------------------------------------------------------- TP x PP -> PP -> dense

GPT_SHAPES = {
    f"layers.{i}.{leaf}": shape
    for i in range(4)
    for leaf, shape in (("qkv.weight", (8, 6)), ("proj.weight", (6, 8)), ("proj.bias", (6,)), ("norm.weight", (6,)))
}


def gpt_pieces(tp: bool) -> dict[str, Piece]:
    pieces = {}
    for name in GPT_SHAPES:
        stage = int(name.split(".")[1]) // 2
        if tp and name.endswith("qkv.weight"):
            pieces[name] = Piece(name, ((("tp",), 0),), stage=stage)
        elif tp and name.endswith("proj.weight"):
            pieces[name] = Piece(name, ((("tp",), 1),), stage=stage)
        else:
            pieces[name] = Piece(name, (), stage=stage)
    return pieces


@case(4)
def tp2_pp2_to_pp2_to_dense(world):
    tp_pp = Layout(world.mesh((2, 2), ("pp", "tp")), gpt_pieces(tp=True), stage_axis="pp")
    pp = Layout(world.mesh((2, 2), ("pp", "dp")), gpt_pieces(tp=False), stage_axis="pp")
    resume_chain(world, list(FAMILIES), GPT_SHAPES, [tp_pp, pp, Layout()], [N_STEPS, M_STEPS, K_STEPS])


@pytest.mark.parametrize("size,name", _world.params_for(__name__))
def test_checkpoint_reshard(size, name):
    _world.check(size, name)
