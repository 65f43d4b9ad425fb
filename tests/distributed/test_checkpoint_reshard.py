"""gradtx.checkpoint under real gloo worlds: a run saved with DCP on one layout and resumed on
another equals an uninterrupted dense run (float32, 1e-6 relative), for every optimizer family
(bfloat16 params with stochastic rounding, Kahan summation or master weights: exactly).

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
from typing import Any, Callable, NamedTuple, Optional

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
    per_example: int = 0  # the gradients of so many examples, stacked on a new dim 0 (DP-SGD's input)
    dtype: torch.dtype = torch.float32  # the params'


FAMILIES: dict[str, Family] = {
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

def quartic(params) -> torch.Tensor:
    return sum((x**4).sum() for x in params.values())


# Random-generator states: every rank draws the same numbers only where it holds the whole params
GENERATORS = {
    "noisy_sgd": Family(lambda spec: gtx.noisy_sgd(1e-2, eta=0.5, key=3)),
    "dpsgd": Family(lambda spec: gtx.dpsgd(1e-2, l2_norm_clip=1.0, noise_multiplier=0.5, seed=5, momentum=0.9), per_example=3),
    "sophia": Family(lambda spec: gtx.contrib.sophia(1e-2, update_interval=1), extra=lambda step: {"obj_fn": quartic}),
}
EXACT_ON_PIECES = list(FAMILIES)
FAMILIES.update(GENERATORS)

# bfloat16 params: every step lands exactly where the dense run's does (stochastic rounding's random
# bits hash the logical element index and the step count in the state)
LOW_PRECISION = {
    "stochastic_rounding": Family(lambda spec: gtx.chain(gtx.sgd(1e-2), gtx.stochastic_rounding(5, spec=spec)), dtype=torch.bfloat16),
    "kahan_summation": Family(lambda spec: gtx.chain(gtx.sgd(1e-2), gtx.kahan_summation()), dtype=torch.bfloat16),
    "master_weights": Family(lambda spec: gtx.master_weights(gtx.adamw(1e-2, weight_decay=0.1)), dtype=torch.bfloat16),
}
FAMILIES.update(LOW_PRECISION)


def grads_at(shapes, step, per_example: int = 0):
    if per_example:
        return dense_tree({name: (per_example, *shape) for name, shape in shapes.items()}, seed=1000 + step)
    return dense_tree(shapes, seed=1000 + step)


def params_of(family: Family, plain: dict):
    return gtx.LookaheadParams.init_synced(plain) if family.lookahead else plain


def plain_of(params):
    return params.fast if isinstance(params, gtx.LookaheadParams) else params


def run_steps(tx, family: Family, layout: Layout, shapes, params, state, steps):
    for step in steps:
        grads = layout.local(grads_at(shapes, step, family.per_example))
        updates, state = tx.update(grads, state, params, **family.extra(step))
        params = gtx.apply_updates(params, updates)
    return params, state


def dense_runs(family: Family, shapes, total: int) -> list:
    """The dense run's params after 0, 1, ..., ``total`` steps (one run, kept at every step)."""
    tx = family.make(None)
    params = params_of(family, dense_tree(shapes, seed=7, dtype=family.dtype))
    state = tx.init(params)
    runs = [params]
    for step in range(total):
        params, state = run_steps(tx, family, Layout(), shapes, params, state, [step])
        runs.append(params)
    return runs


def to_save(params, state, layout: Layout) -> dict:
    """What DCP saves of one run: its state and its params, each through ``gtx.checkpoint.state_dict``."""
    plain = plain_of(params)
    return {
        "state": gtx.checkpoint.state_dict(state, plain, layout.spec),
        "params": gtx.checkpoint.state_dict(params, plain, layout.spec),
    }


def template(tx, family: Family, layout: Layout, shapes) -> tuple:
    """The new layout's params and state (of other values) and the dict DCP loads them into."""
    params = params_of(family, layout.local(dense_tree(shapes, seed=99, dtype=family.dtype)))
    state = tx.init(params)
    return params, state, to_save(params, state, layout)


def filled(params, state, sd: dict, layout: Layout) -> tuple:
    """The template filled from ``sd``, which DCP has loaded."""
    new_params = gtx.checkpoint.load_state_dict(params, sd["params"], plain_of(params), layout.spec)
    new_state = gtx.checkpoint.load_state_dict(state, sd["state"], plain_of(new_params), layout.spec)
    return new_params, new_state


def resume_chain(world, family_names, shapes, layouts: list[Layout], steps: list[int], saved: Optional[Callable] = None) -> None:
    """For each family: ``steps[0]`` steps on ``layouts[0]``, saved; loaded on ``layouts[1]``,
    ``steps[1]`` more, saved; ... Every stretch ends equal to the dense run of as many steps.
    ``saved(family, layout index, dict)`` sees each dict saved.

    The families run side by side: one DCP checkpoint per layout holds every family's run, each
    under its own name (DCP's planning and file writes happen once per layout, not per family)."""
    import torch.distributed.checkpoint as dcp

    root = shared_dir(world)
    try:
        families = {name: FAMILIES[name] for name in family_names}
        dense = {name: dense_runs(family, shapes, sum(steps)) for name, family in families.items()}
        runs: dict[str, tuple] = {}
        done = 0
        for i, (layout, count) in enumerate(zip(layouts, steps)):
            txs = {name: family.make(layout.spec) for name, family in families.items()}
            if i == 0:
                for name, family in families.items():
                    params = params_of(family, layout.local(dense_tree(shapes, seed=7, dtype=family.dtype)))
                    runs[name] = (params, txs[name].init(params))
            else:
                templates = {name: template(txs[name], family, layout, shapes) for name, family in families.items()}
                dcp.load({name: sd for name, (_, _, sd) in templates.items()}, checkpoint_id=f"{root}/{i - 1}")
                for name, (params, state, sd) in templates.items():
                    runs[name] = filled(params, state, sd, layout)
                    check_params(runs[name][0], dense[name][done], layout, f"{name}: loaded on layout {i}")
            for name, family in families.items():
                params, state = runs[name]
                runs[name] = run_steps(txs[name], family, layout, shapes, params, state, range(done, done + count))
                check_params(runs[name][0], dense[name][done + count], layout, f"{name}: layout {i} after {done + count} steps")
            done += count
            if i + 1 < len(layouts):
                sds = {name: to_save(params, state, layout) for name, (params, state) in runs.items()}
                dcp.save(sds, checkpoint_id=f"{root}/{i}")
                if saved is not None:
                    for name, sd in sds.items():
                        saved(name, i, sd)
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
    resume_chain(world, EXACT_ON_PIECES, GPT_SHAPES, [tp_pp, pp, Layout()], [N_STEPS, M_STEPS, K_STEPS], saved=_gpt_saved)


def _gpt_saved(name, index, sd):
    from torch.distributed.tensor import DTensor

    if index == 0 and name == "adafactor":
        # (8, 6) split along its rows: the column moment (a mean along dim 1) is split as the rows
        # are, the row moment (a mean along dim 0) is whole
        moments = {k.split(".")[-5]: v for k, v in sd["state"].items() if k.endswith(("layers.0.qkv.weight", "layers.2.qkv.weight"))}
        assert isinstance(moments["v_col"], DTensor) and tuple(moments["v_col"].shape) == (8,), moments
        assert type(moments["v_row"]) is torch.Tensor and tuple(moments["v_row"].shape) == (6,), moments
    if index == 0 and name == "galore":
        projector = next(v for k, v in sd["state"].items() if ".projector.layers." in k and k.endswith("qkv.weight"))
        assert type(projector) is torch.Tensor, projector  # whole on every rank



# --------------------------------------------------------------------------- ZeRO flat pieces, dp 4 -> dp 2 -> dp 1

FLAT_SHAPES = {"w": (5, 3), "b": (7,), "v": (3, 3)}  # 15, 7 and 9 elements: uneven flat pieces over 4 and 2


def flat_pieces() -> dict[str, Piece]:
    return {name: Piece(name, ((("dp",), None),)) for name in FLAT_SHAPES}


@case(4)
def zero_flat_dp4_to_dp2_to_dp1(world):
    # a flat piece's logical tensor is the flattened leaf: it resumes on any flat layout
    layouts = [
        Layout(world.mesh((4,), ("dp",)), flat_pieces()),
        Layout(world.mesh((2, 2), ("rep", "dp")), flat_pieces()),
        Layout(world.mesh((4, 1), ("rep", "dp")), flat_pieces()),
    ]
    families = ["adamw", "multi_steps", "lookahead", *LOW_PRECISION]
    resume_chain(world, families, FLAT_SHAPES, layouts, [N_STEPS, M_STEPS, K_STEPS], saved=_flat_saved)


def _flat_saved(name, index, sd):
    from torch.distributed.tensor import DTensor

    # 7 elements over 4 as 2, 2, 2, 1 is DTensor's chunking; 9 as 3, 2, 2, 2 is not (over 2: 5, 4 is)
    if name == "lookahead":  # params "fast.b", "slow.b"
        return
    assert isinstance(sd["params"]["b"], DTensor) and tuple(sd["params"]["b"].shape) == (7,)
    assert isinstance(sd["params"]["v"], gtx.checkpoint.Pieces if index == 0 else DTensor), sd["params"]["v"]
    assert tuple(sd["params"]["v"].shape) == (9,)


# --------------------------------------------------------------------------- TP 2 x FSDP 2 DTensors -> FSDP 4 -> dense

DT_SHAPES = {"qkv.weight": (7, 6), "proj.weight": (10, 7), "bias": (11,)}


@case(4)
def tp2_fsdp2_dtensor_to_fsdp4_to_dense(world):
    from torch.distributed.tensor import Replicate, Shard

    two_d = {"qkv.weight": (Shard(0), Shard(1)), "proj.weight": (Shard(0), Shard(1)), "bias": (Shard(0), Replicate())}
    layouts = [
        Layout(world.mesh((2, 2), ("dp", "tp")), placements=two_d),  # uneven: 7 rows as 4 + 3, 7 columns as 4 + 3
        Layout(world.mesh((4,), ("dp",)), placements={name: (Shard(0),) for name in DT_SHAPES}),  # 7 rows as 2, 2, 2, 1
        Layout(),
    ]
    resume_chain(world, ["adamw", "adafactor", "muon_owner", "galore"], DT_SHAPES, layouts, [N_STEPS, M_STEPS, K_STEPS])


# --------------------------------------------------------------------------- experts over ep 2 -> ep 1

EXPERT_SHAPES = {"experts.w1": (4, 6, 8), "experts.w2": (4, 8, 6), "router.weight": (6, 4)}


def expert_pieces() -> dict[str, Piece]:
    return {
        "experts.w1": Piece("experts.w1", ((("ep",), 0),)),
        "experts.w2": Piece("experts.w2", ((("ep",), 0),)),
        "router.weight": Piece("router.weight"),
    }


@case(4)
def experts_ep2_to_ep1(world):
    layouts = [
        Layout(world.mesh((2, 2), ("ep", "dp")), expert_pieces()),
        Layout(world.mesh((1, 4), ("ep", "dp")), expert_pieces()),
    ]
    resume_chain(world, ["adamw", "adafactor", "multi_steps"], EXPERT_SHAPES, layouts, [N_STEPS, M_STEPS])


# --------------------------------------------------------------------------- uneven on both sides

UNEVEN_SHAPES = {"w": (5, 4), "u": (6, 3), "b": (7,)}


@case(4)
def uneven_plain_tp_to_uneven_fsdp_dtensor(world):
    from torch.distributed.tensor import Shard

    # plain pieces cut as numpy's array_split does (5 rows: 2, 1, 1, 1), which DTensor's chunking does
    # not describe, then FSDP2-style DTensors (5 rows: 2, 2, 1, 0)
    plain = {name: Piece(name, ((("tp",), 0),)) for name in UNEVEN_SHAPES}
    layouts = [
        Layout(world.mesh((4,), ("tp",)), plain),
        Layout(world.mesh((4,), ("dp",)), placements={name: (Shard(0),) for name in UNEVEN_SHAPES}),
        Layout(),
    ]
    families = ["adamw", "inject_hyperparams", *LOW_PRECISION]
    resume_chain(world, families, UNEVEN_SHAPES, layouts, [N_STEPS, M_STEPS, K_STEPS], saved=_uneven_saved)


def _uneven_saved(name, index, sd):
    from torch.distributed.tensor import DTensor

    kinds = {k: type(v) for k, v in sd["params"].items() if k != gtx.checkpoint.MANIFEST}
    if index == 0:
        assert kinds == {"w": gtx.checkpoint.Pieces, "u": gtx.checkpoint.Pieces, "b": DTensor}, kinds
    else:
        assert set(kinds.values()) == {DTensor}, kinds


# --------------------------------------------------------------------------- a generator state


@case(2)  # replicated over a 1-D mesh: two copies show what four would
def replicated_generator_state_to_dense(world):
    # every rank draws the same noise for the whole params: the generator state is one value
    replicated = {name: Piece(name) for name in FLAT_SHAPES}
    layouts = [Layout(world.mesh((world.size,), ("dp",)), replicated), Layout()]
    resume_chain(world, list(GENERATORS), FLAT_SHAPES, layouts, [N_STEPS, M_STEPS], saved=_generator_saved)


def _generator_saved(name, index, sd):
    generators = [k for k, v in sd["state"].items() if isinstance(v, torch.Tensor) and v.dtype == torch.uint8]
    assert generators, f"{name}: no generator state saved: {sorted(sd['state'])}"



# --------------------------------------------------------------------------- wrap's state_dict, TP 2 x DP 2 -> DP 4 -> dense

WRAP_SHAPES = {"w": (6, 4), "u": (4, 6), "b": (6,)}


def wrap_pieces(tp: bool) -> dict[str, Piece]:
    if not tp:
        return {name: Piece(name) for name in WRAP_SHAPES}
    return {"w": Piece("w", ((("tp",), 0),)), "u": Piece("u", ((("tp",), 1),)), "b": Piece("b")}


def wrapped(layout: Layout, values: dict):
    """Named parameters of ``values`` and a wrapped SGD whose chain keeps the state (clip + Adam)."""
    params = {name: torch.nn.Parameter(x.clone()) for name, x in values.items()}
    tx = gtx.chain(gtx.clip_by_global_norm(1.0, layout.spec), gtx.scale_by_adam())
    return params, gtx.wrap(torch.optim.SGD(list(params.items()), lr=1e-2), tx, spec=layout.spec)


def wrapped_steps(opt, params: dict, layout: Layout, steps) -> None:
    for step in steps:
        for name, grad in layout.local(grads_at(WRAP_SHAPES, step)).items():
            params[name].grad = grad
        opt.step()


@case(4)
def wrap_state_dict_with_spec_tp2_to_dp4_to_dense(world):
    import torch.distributed.checkpoint as dcp

    layouts = [
        Layout(world.mesh((2, 2), ("dp", "tp")), wrap_pieces(tp=True)),
        Layout(world.mesh((4,), ("dp",)), wrap_pieces(tp=False)),
        Layout(),
    ]
    dense_params, dense_opt = wrapped(Layout(), dense_tree(WRAP_SHAPES, seed=7))
    root = shared_dir(world)
    try:
        done = 0
        for i, (layout, count) in enumerate(zip(layouts, [N_STEPS, M_STEPS, K_STEPS])):
            params, opt = wrapped(layout, layout.local(dense_tree(WRAP_SHAPES, seed=99 if i else 7)))
            if i:
                sd = {"optim": opt.state_dict(), "params": gtx.checkpoint.state_dict(dict(params), dict(params), layout.spec)}
                dcp.load(sd, checkpoint_id=f"{root}/{i - 1}")
                with torch.no_grad():
                    for name, value in gtx.checkpoint.load_state_dict(dict(params), sd["params"], dict(params), layout.spec).items():
                        params[name].copy_(value)
                opt.load_state_dict(sd["optim"])
            wrapped_steps(opt, params, layout, range(done, done + count))
            wrapped_steps(dense_opt, dense_params, Layout(), range(done, done + count))
            done += count
            check_params({k: v.detach() for k, v in params.items()}, {k: v.detach() for k, v in dense_params.items()}, layout, f"wrap: layout {i} after {done} steps")
            if i == 0:
                chain_state = opt.state_dict()["param_groups"][0]["gradtx"]
                assert isinstance(chain_state["1.mu.w"], torch.distributed.tensor.DTensor) and tuple(chain_state["1.mu.w"].shape) == (6, 4)
                assert gtx.checkpoint.MANIFEST in chain_state
            if i + 1 < len(layouts):
                sd = {"optim": opt.state_dict(), "params": gtx.checkpoint.state_dict(dict(params), dict(params), layout.spec)}
                dcp.save(sd, checkpoint_id=f"{root}/{i}")
    finally:
        remove_dir(world, root)


# --------------------------------------------------------------------------- every optimizer of the catalogue

# SM3 keeps a list of per-dim accumulators per param (a tree not shaped like the params), so under
# tensor parallelism they are whole leaves that differ between ranks: saving them fails, naming one.
CANNOT_SAVE_SPLIT = {"sm3": r"state leaf '0\.mu\.w\.\d' differs between rank 0 and rank 1"}
LOSS = torch.tensor(1.5)  # a loss every rank agrees on, as a global loss is
UPDATE_EXTRAS = {
    "contrib.sophia": lambda params: {"obj_fn": quartic},  # separable: each rank's Hessian diagonal is exact
    "polyak_sgd": lambda params: {"value": LOSS},
    "contrib.momo": lambda params: {"value": LOSS},
    "contrib.momo_adam": lambda params: {"value": LOSS},
    "lbfgs": lambda params: {"value": LOSS, "grad": params, "value_fn": lambda p: LOSS + 0 * quartic(p)},
}
NEEDS_A_BASE = {"contrib.mechanize", "contrib.schedule_free", "contrib.sam"}  # covered through their users above


def alias_kwargs(fn, spec) -> dict:
    import inspect

    kwargs = {}
    for p in inspect.signature(fn).parameters.values():
        if p.default is inspect.Parameter.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
            kwargs[p.name] = {"l2_norm_clip": 1.0, "noise_multiplier": 0.1, "seed": 0}.get(p.name, 1e-2)
        if p.name == "spec":
            kwargs["spec"] = spec
    return kwargs


@case(2)
def every_optimizer_saves_under_tensor_parallelism(world):
    """Each optimizer's state after a step, under a TP spec, saves and loads back on its layout
    exactly, or saving fails on every rank naming the leaf: never a silent wrong checkpoint."""
    import sys
    from pathlib import Path

    tests = str(Path(__file__).resolve().parents[1])
    if tests not in sys.path:
        sys.path.append(tests)
    from test_optimizer_docstrings import discover_aliases  # the optimizers, found, not listed

    layout = bad_layout(world, {"w": (8, 6), "b": (6,)})
    params = layout.local(dense_tree({"w": (8, 6), "b": (6,)}, seed=7))
    grads = layout.local(grads_at({"w": (8, 6), "b": (6,)}, 0))
    checked = []
    for name, fn in sorted(discover_aliases().items()):
        if name in NEEDS_A_BASE:
            continue
        tx = fn(**alias_kwargs(fn, layout.spec))
        extra = UPDATE_EXTRAS.get(name, lambda params: {})(params)
        step_grads = {k: torch.stack([v, -v, 2 * v]) for k, v in grads.items()} if name == "dpsgd" else dict(grads)  # per example
        _, state = tx.update(step_grads, tx.init(params), params, **extra)
        if name in CANNOT_SAVE_SPLIT:
            everyone_raises(world, lambda: gtx.checkpoint.state_dict(state, params, layout.spec), CANNOT_SAVE_SPLIT[name])
            continue
        loaded = gtx.checkpoint.state_dict(state, params, layout.spec, copy=True)
        restored = gtx.checkpoint.load_state_dict(tx.init(params), loaded, params, layout.spec)
        for path, new, old in zip(gtx.tree.paths(state), gtx.tree.leaves(restored), gtx.tree.leaves(state)):
            if isinstance(old, torch.Tensor):
                assert torch.equal(local_of(new), local_of(old)), f"{name}: {path}"
            else:
                assert new == old, f"{name}: {path}"
        checked.append(name)
    assert len(checked) >= 45, checked


# --------------------------------------------------------------------------- bad input: the same error on every rank

BAD_SHAPES = {"w": (6, 4), "b": (3,)}


def bad_layout(world, shapes=BAD_SHAPES) -> Layout:
    pieces = {name: Piece(name, ((("tp",), 0),)) if len(shape) == 2 else Piece(name) for name, shape in shapes.items()}
    return Layout(world.mesh((world.size,), ("tp",)), pieces)


def trained(tx, layout: Layout, shapes, steps: int = 2):
    params = layout.local(dense_tree(shapes, seed=7))
    return run_steps(tx, FAMILIES["adamw"], layout, shapes, params, tx.init(params), range(steps))


def snapshot(tree) -> list:
    return [None if x is None else local_of(x).clone() for x in gtx.tree.leaves(tree)]


def assert_untouched(tree, before: list) -> None:
    for x, old in zip(gtx.tree.leaves(tree), before):
        assert (x is None and old is None) or torch.equal(local_of(x), old), "the template was changed"


def everyone_raises(world, fn, match: str, error=ValueError) -> str:
    from test_sharding_disagreement import _everyone_raises

    return _everyone_raises(world, fn, match, error)


def saved_checkpoint(world, root: str, tx, layout: Layout, shapes=BAD_SHAPES) -> tuple:
    import torch.distributed.checkpoint as dcp

    params, state = trained(tx, layout, shapes)
    dcp.save(gtx.checkpoint.state_dict(state, params, layout.spec), checkpoint_id=root)
    return params, state


def load_into(root: str, template, params, layout: Layout, *, partial: bool = False):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultLoadPlanner

    sd = gtx.checkpoint.state_dict(template, params, layout.spec, copy=True)
    dcp.load(sd, checkpoint_id=root, planner=DefaultLoadPlanner(allow_partial_load=partial))
    return gtx.checkpoint.load_state_dict(template, sd, params, layout.spec)


@case(2)
def checkpoint_of_another_chain_or_tree(world):
    from torch.distributed.checkpoint.api import CheckpointException

    root = shared_dir(world)
    try:
        layout = bad_layout(world)
        tx = gtx.adamw(1e-2)
        saved_checkpoint(world, root, tx, layout)
        # more params than were saved: DCP itself refuses, on every rank, naming the key
        bigger = bad_layout(world, {**BAD_SHAPES, "c": (2,)})
        params = bigger.local(dense_tree({**BAD_SHAPES, "c": (2,)}))
        template = tx.init(params)
        before = snapshot(template)
        with pytest.raises(CheckpointException, match=r"0\.mu\.c"):
            load_into(root, template, params, bigger)
        assert_untouched(template, before)
        # ... and with a partial load, gradtx's manifest names it
        message = everyone_raises(world, lambda: load_into(root, template, params, bigger, partial=True), r"lacks state leaf '0\.mu\.c'")
        assert "another transformation or params" in message
        assert_untouched(template, before)
        # fewer params than were saved: DCP loads what is asked; the manifest finds the rest
        smaller = bad_layout(world, {"w": (6, 4)})
        params = smaller.local(dense_tree({"w": (6, 4)}))
        template = tx.init(params)
        before = snapshot(template)
        everyone_raises(world, lambda: load_into(root, template, params, smaller), r"checkpoint holds state leaf '0\.mu\.b', which this state lacks")
        assert_untouched(template, before)
        # another chain: its paths differ ("1.0.mu.w")
        chained = gtx.chain(gtx.clip_by_global_norm(1.0, layout.spec), gtx.adamw(1e-2))
        params = layout.local(dense_tree(BAD_SHAPES))
        template = chained.init(params)
        everyone_raises(world, lambda: load_into(root, template, params, layout, partial=True), r"checkpoint holds state leaf '0\.count', which this state lacks")
    finally:
        remove_dir(world, root)


@case(2)
def changed_dtype_or_shape(world):
    from torch.distributed.checkpoint.api import CheckpointException

    root = shared_dir(world)
    try:
        layout = bad_layout(world)
        saved_checkpoint(world, root, gtx.adamw(1e-2), layout)
        params = layout.local(dense_tree(BAD_SHAPES))
        # DCP would cast a float32 moment into a bfloat16 one silently
        template = gtx.adamw(1e-2, mu_dtype=torch.bfloat16).init(params)
        before = snapshot(template)
        everyone_raises(world, lambda: load_into(root, template, params, layout), r"state leaf '0\.mu\.b' was saved as float32 .*, but this state holds bfloat16")
        assert_untouched(template, before)
        # another logical shape: DCP refuses on every rank; a dict made on another tree, gradtx
        wider = {"w": (8, 4), "b": (3,)}
        params = layout.local(dense_tree(wider))
        template = gtx.adamw(1e-2).init(params)
        with pytest.raises(CheckpointException, match="Size mismatch"):
            load_into(root, template, params, layout)
        other, other_state = trained(gtx.adamw(1e-2), layout, BAD_SHAPES)
        loaded = gtx.checkpoint.state_dict(other_state, other, layout.spec)
        before = snapshot(template)
        load = lambda loaded: lambda: gtx.checkpoint.load_state_dict(template, loaded, params, layout.spec)  # noqa: E731
        everyone_raises(world, load(loaded), r"state leaf '0\.mu\.w' was saved with logical shape \(6, 4\), but this state's is \(8, 4\)")
        # without its manifest, the values themselves
        bare = {k: v for k, v in loaded.items() if k != gtx.checkpoint.MANIFEST}
        everyone_raises(world, load(bare), r"state leaf '0\.mu\.w' has logical shape \(8, 4\), but the loaded value's is \(6, 4\)")
        assert_untouched(template, before)
    finally:
        remove_dir(world, root)


@case(2)
def a_missing_or_foreign_piece(world):
    layout = bad_layout(world)
    tx = gtx.adamw(1e-2)
    params, state = trained(tx, layout, BAD_SHAPES)
    template = tx.init(params)
    before = snapshot(template)
    loaded = gtx.checkpoint.state_dict(state, params, layout.spec)
    # one rank lacks a piece: every rank raises
    short = dict(loaded)
    if world.rank == 1:
        del short["0.nu.w"]
    message = everyone_raises(world, lambda: gtx.checkpoint.load_state_dict(template, short, params, layout.spec), r"lacks state leaf '0\.nu\.w'")
    assert "rank 1" in message
    # one rank's piece is another rank's
    from torch.distributed.tensor import DTensor

    swapped = dict(loaded)
    if world.rank == 0:
        piece = loaded["0.mu.w"]
        swapped["0.mu.w"] = gtx.checkpoint.Pieces(piece.to_local(), tuple(piece.shape), (3, 0))
    everyone_raises(world, lambda: gtx.checkpoint.load_state_dict(template, swapped, params, layout.spec), r"'0\.mu\.w': the loaded pieces holds the piece \(3, 4\) at \(3, 0\)")
    # a number where a tensor was
    numbered = {**loaded, "0.count": 3}
    everyone_raises(world, lambda: gtx.checkpoint.load_state_dict(template, numbered, params, layout.spec), r"'0\.count' is a tensor, but the loaded value is a int")
    assert_untouched(template, before)
    # whole logical tensors (dcp_to_torch_save's) load too: each rank keeps its piece
    whole = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in loaded.items()}
    restored = gtx.checkpoint.load_state_dict(template, whole, params, layout.spec)
    for new, old in zip(gtx.tree.leaves(restored), gtx.tree.leaves(state)):
        assert torch.equal(local_of(new), local_of(old))


@case(2)
def whole_leaves_that_differ_between_ranks(world):
    layout = bad_layout(world)
    tx = gtx.adamw(1e-2)
    params, state = trained(tx, layout, BAD_SHAPES)
    loaded = gtx.checkpoint.state_dict(state, params, layout.spec, copy=True)
    template = tx.init(params)
    if world.rank == 1:
        loaded["0.count"] = loaded["0.count"] + 1
    message = everyone_raises(world, lambda: gtx.checkpoint.load_state_dict(template, loaded, params, layout.spec), r"state leaf '0\.count' differs between rank 0 and rank 1")
    assert "kept whole on every rank" in message
    # generator states that drew different noise on each rank cannot be saved as one value
    noisy = gtx.noisy_sgd(1e-2, key=world.rank)
    state = noisy.init(params)
    everyone_raises(world, lambda: gtx.checkpoint.state_dict(state, params, layout.spec), r"state leaf '0\.rng_key' differs between rank 0 and rank 1")


class RowSums(NamedTuple):
    """A made-up state: per param, a sum over its dim 0 (one dim fewer than the param)."""

    sums: Any


@gtx.checkpoint.state_dims(sums=lambda leaf: tuple(range(1, len(leaf.shape))))
class DeclaredRowSums(NamedTuple):
    """The same, declaring that the sums' dims are the param's dims after the first."""

    sums: Any


def row_sums(state_type):
    def init(params):
        return state_type({k: torch.zeros(v.shape[1:]) for k, v in params.items()})

    return gtx.GradientTransformation(init, lambda updates, state, params=None, *, inplace=False: (updates, state))


@case(2)
def a_leaf_of_another_shape_needs_a_declaration(world):
    layout = bad_layout(world)
    params = layout.local(dense_tree(BAD_SHAPES))
    state = row_sums(RowSums).init(params)  # "w": (4,) from a (3, 4) piece of a (6, 4) param split along dim 0
    message = everyone_raises(world, lambda: gtx.checkpoint.state_dict(state, params, layout.spec), r"state leaf 'sums\.w' \(\(4,\) on this rank\) was made from param 'w'")
    assert "state_dims" in message
    # "b" is whole on every rank, so its (0-d) sum is too; declared, "w"'s sums follow its dim 1: whole
    sd = gtx.checkpoint.state_dict(row_sums(DeclaredRowSums).init(params), params, layout.spec)
    assert type(sd["sums.w"]) is torch.Tensor and tuple(sd["sums.w"].shape) == (4,)
    # declared along dim 0 instead (as a column sum would be), it is split as the param's rows are
    split = gtx.checkpoint.state_dims(sums=lambda leaf: (0,) if leaf.leaf_shape else ())(type("ColumnSums", (RowSums,), {}))
    sd = gtx.checkpoint.state_dict(row_sums(split).init(params), params, layout.spec)
    assert tuple(sd["sums.w"].shape) == (8,) and tuple(sd["sums.w"].to_local().shape) == (4,)

@pytest.mark.parametrize("size,name", _world.params_for(__name__))
def test_checkpoint_reshard(size, name):
    _world.check(size, name)
