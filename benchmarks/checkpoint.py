"""Checkpoint save and load of AdamW's state at world 4: gradtx's ``gtx.checkpoint`` against torch's own.

What is saved and loaded is the optimizer state of AdamW for the GPT_41M tree of
``benchmarks/common.py`` (52 float32 leaves, 41.7M parameters: two moments of 167 MB each, and step
counts), after one step, over 4 gloo ranks on CPU (one thread each), through
``torch.distributed.checkpoint`` (DCP) in every case. Candidates:

- ``torch-fsdp2``: ``torch.optim.AdamW`` on a module (one submodule per leaf path, each block
  ``fully_shard``-ed, then the root) under FSDP2 on a 1-D mesh. Save:
  ``get_state_dict(model, optim)`` and ``dcp.save`` of its optimizer half. Load, into a fresh
  ``AdamW`` (empty state, as after a restart): ``get_state_dict`` (which first steps the optimizer
  once with zero gradients and a zero learning rate, to create the state it loads into),
  ``dcp.load``, then ``set_state_dict(model, optim, model_state_dict={}, optim_state_dict=...)``.
- ``gradtx-fsdp2``: ``gtx.adamw`` on DTensor leaves laid out as FSDP2 lays them out (``Shard(0)``
  on the same mesh). Save: ``gtx.checkpoint.state_dict(state, params, None)`` and ``dcp.save``.
  Load: ``tx.init(params)`` (a fresh state, as after a restart), ``gtx.checkpoint.state_dict`` of it
  as the template, ``dcp.load``, ``gtx.checkpoint.load_state_dict``.
- ``gradtx-tp``: the same on plain tensors under a Megatron-style tensor-parallel ``ShardingSpec``
  over the 4 ranks (QKV and MLP-in split along dim 0, both projections along dim 1, the token
  embedding by vocabulary; position embedding, norms and row-parallel biases replicated, so each
  rank holds a full copy of those, which DCP writes once).

A candidate's numbers count only its own calls: building the model and the first step are not
timed; each timed save and load starts and ends with a barrier, so a wall-clock time is the slowest
rank's. The ranks' CPU time (``time.process_time``: user and system, every thread) over the same
span is summed over the 4 ranks too: with 4 ranks on a small shared machine, the CPU time a call
needs is steadier than its wall-clock time. After every load the loaded state is compared with the
saved one (exact), untimed. Bytes written are the checkpoint folder's size after the save (all
files, metadata included).

Method. Each candidate runs in a world of its own: 4 processes forked from this one (which has
imported torch and gradtx and computed nothing, so the ranks start at once), joined by a file
store. A world builds its trees, takes one optimizer step, then saves and loads ``--warmup`` times
untimed and ``--reps`` times timed, each time into a new folder; it reports the median of its
timed reps. The parent runs the worlds interleaved (A, B, C, A, B, C, ...) for ``--rounds`` rounds
and prints the median over rounds and the median over rounds of per-round ratios against
``torch-fsdp2``. By default the checkpoint goes to a temporary folder in ``/dev/shm`` (RAM), so the
numbers are the libraries' own work (planning, collectives, copies, serialisation), not the disk's;
``--dir`` puts it elsewhere (DCP's ``FileSystemWriter`` fsyncs each file, so a real disk adds its
write time to every candidate alike).

Not part of the test suite; run by hand:

    python benchmarks/checkpoint.py [--rounds N] [--reps K] [--quick] [--only NAME ...] [--dir DIR]
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any, Callable, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "src"))
sys.path.insert(0, ROOT)

# Imported here, before any world is forked, so that no rank imports them again.
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402
from torch.distributed.tensor import Shard as DShard  # noqa: E402

import gradtx as gtx  # noqa: E402
from benchmarks.common import GPT_41M, gpt_shapes, make_tree, report  # noqa: E402
from gradtx import tree as tree_lib  # noqa: E402
from gradtx.sharding import Replicate, Shard, ShardingSpec  # noqa: E402

WORLD = 4
LR, WEIGHT_DECAY = 1e-4, 0.01
# Megatron-style tensor parallelism over the GPT_41M tree (torch Linear layout: (out, in)).
TP_RULES = [
    ("wte.weight", Shard("tp", dim=0)),  # vocabulary-parallel embedding
    ("*.attn.c_attn.*", Shard("tp", dim=0)),  # column-parallel QKV, weight and bias
    ("*.mlp.c_fc.*", Shard("tp", dim=0)),  # column-parallel MLP-in
    ("*.c_proj.weight", Shard("tp", dim=1)),  # row-parallel projections
]
CANDIDATES = {
    "torch-fsdp2": "torch AdamW, FSDP2: get_state_dict + dcp.save / dcp.load + set_state_dict",
    "gradtx-fsdp2": "gradtx adamw, DTensor Shard(0) leaves: gtx.checkpoint + dcp",
    "gradtx-tp": "gradtx adamw, plain TP pieces + ShardingSpec: gtx.checkpoint + dcp",
}
BASELINE = "torch-fsdp2"


# --------------------------------------------------------------------------- candidates (built in a world)


def _nested_module(params: dict[str, torch.Tensor]) -> nn.Module:
    """A module whose ``named_parameters()`` are ``params`` (dotted paths become submodules)."""
    root = nn.Module()
    for path, value in params.items():
        *parents, leaf = path.split(".")
        module = root
        for part in parents:
            if not hasattr(module, part):
                module.add_module(part, nn.Module())
            module = getattr(module, part)
        module.register_parameter(leaf, nn.Parameter(value))
    return root


class TorchFSDP2:
    """``torch.optim.AdamW`` under FSDP2, checkpointed with torch's ``get_state_dict`` / ``set_state_dict``."""

    def __init__(self, mesh) -> None:
        params, grads = make_tree(GPT_41M, seed=0), make_tree(GPT_41M, seed=1)
        self.model = _nested_module(params)
        for block in self.model.h.children():
            fully_shard(block, mesh=mesh)
        fully_shard(self.model, mesh=mesh)
        for name, p in self.model.named_parameters():
            p.grad = DTensor.from_local(grads[name].chunk(WORLD, 0)[mesh.get_local_rank()].clone(), mesh, [DShard(0)], run_check=False)
        del params, grads
        self.optim = torch.optim.AdamW(self.model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
        self.optim.step()
        self.optim.zero_grad(set_to_none=True)  # what a restarted optimizer sees: no gradients
        self.fresh: Optional[torch.optim.Optimizer] = None

    def save(self, path: str) -> None:
        _, optim_state = get_state_dict(self.model, self.optim)
        dcp.save({"optim": optim_state}, checkpoint_id=path)

    def reset(self) -> None:
        self.fresh = torch.optim.AdamW(self.model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)

    def load(self, path: str) -> None:
        _, optim_state = get_state_dict(self.model, self.fresh)
        dcp.load({"optim": optim_state}, checkpoint_id=path)
        set_state_dict(self.model, self.fresh, model_state_dict={}, optim_state_dict=optim_state)

    def check(self) -> None:
        for p in self.model.parameters():
            saved, loaded = self.optim.state[p], self.fresh.state[p]
            for key in ("step", "exp_avg", "exp_avg_sq"):
                _require_equal(saved[key], loaded[key], key)


class GradtxAdamW:
    """``gtx.adamw``'s state, checkpointed through ``gtx.checkpoint``: on FSDP2-style DTensor leaves
    (``spec=None``) or on plain tensor-parallel pieces under ``TP_RULES``."""

    def __init__(self, mesh, layout: str) -> None:
        rank = mesh.get_local_rank()
        params, grads = make_tree(GPT_41M, seed=0), make_tree(GPT_41M, seed=1)
        if layout == "fsdp2":
            self.spec = None

            def piece(name: str, x: torch.Tensor) -> torch.Tensor:
                return DTensor.from_local(x.chunk(WORLD, 0)[rank].clone(), mesh, [DShard(0)], run_check=False)

        else:
            self.spec = ShardingSpec(mesh, TP_RULES, default=Replicate())
            leaf_specs = self.spec.resolve(params, list(params.values()), list(params))
            dims = {name: s.dims[0] if s.axes else None for name, s in zip(params, leaf_specs)}

            def piece(name: str, x: torch.Tensor) -> torch.Tensor:
                return x.clone() if dims[name] is None else x.chunk(WORLD, dims[name])[rank].clone()

        self.params = {name: piece(name, x) for name, x in params.items()}
        grads = {name: piece(name, x) for name, x in grads.items()}
        del params
        self.tx = gtx.adamw(LR, weight_decay=WEIGHT_DECAY)
        _, self.state = self.tx.update(grads, self.tx.init(self.params), self.params)
        self.loaded: Any = None

    def save(self, path: str) -> None:
        dcp.save(gtx.checkpoint.state_dict(self.state, self.params, self.spec), checkpoint_id=path)

    def reset(self) -> None:
        self.loaded = None

    def load(self, path: str) -> None:
        api = gtx.checkpoint
        fresh = self.tx.init(self.params)
        template = api.state_dict(fresh, self.params, self.spec)
        dcp.load(template, checkpoint_id=path)
        self.loaded = api.load_state_dict(fresh, template, self.params, self.spec)

    def check(self) -> None:
        saved, loaded = tree_lib.leaves(self.state), tree_lib.leaves(self.loaded)
        for path, a, b in zip(tree_lib.paths(self.state), saved, loaded):
            _require_equal(a, b, path)


def _require_equal(saved: Any, loaded: Any, what: str) -> None:
    a, b = (x.to_local() if isinstance(x, DTensor) else x for x in (saved, loaded))
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)):
        raise AssertionError(f"the loaded {what} differs from the saved one")


BUILDERS: dict[str, Callable[[Any], Any]] = {
    "torch-fsdp2": TorchFSDP2,
    "gradtx-fsdp2": lambda mesh: GradtxAdamW(mesh, "fsdp2"),
    "gradtx-tp": lambda mesh: GradtxAdamW(mesh, "tp"),
}


def _folder_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(folder, f)) for folder, _, files in os.walk(path) for f in files)


def _timed(fn: Callable[[], None]) -> tuple[float, float]:
    """``fn()`` between two barriers: wall-clock seconds (the slowest rank's) and this rank's CPU seconds."""
    dist.barrier()
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    dist.barrier()
    return time.perf_counter() - wall, time.process_time() - cpu


def world_rank(name: str, rank: int, store: str, folder: str, reps: int, warmup: int, out: str) -> None:
    """One rank of a candidate's world: builds it, saves and loads ``warmup + reps`` times (each
    checkpoint a new folder in ``folder``); rank 0 writes the timed reps' medians to ``out`` as JSON:
    wall-clock seconds, CPU seconds summed over the ranks, bytes written."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=store, rank=rank, world_size=WORLD)
    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("tp" if name == "gradtx-tp" else "shard",))
    with torch.no_grad():
        case = BUILDERS[name](mesh)
    measured: dict[str, list[float]] = {"save": [], "load": [], "save_cpu": [], "load_cpu": [], "bytes": []}
    for i in range(warmup + reps):
        path = os.path.join(folder, f"{name}-{i}")
        save_wall, save_cpu = _timed(lambda: case.save(path))
        size = _folder_bytes(path) if rank == 0 else 0
        case.reset()
        load_wall, load_cpu = _timed(lambda: case.load(path))
        case.check()
        cpu = torch.tensor([save_cpu, load_cpu], dtype=torch.float64)
        dist.all_reduce(cpu)
        if rank == 0:
            shutil.rmtree(path)
        if i >= warmup:
            for key, value in zip(measured, (save_wall, load_wall, *cpu.tolist(), size)):
                measured[key].append(value)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({key: statistics.median(values) for key, values in measured.items()}, f)
    dist.barrier()
    dist.destroy_process_group()


def run_world(name: str, root: str, reps: int, warmup: int) -> Optional[dict]:
    """Forks the 4 ranks of one candidate's world; its answer, or None (after saying why) if a rank failed."""
    folder = tempfile.mkdtemp(prefix=f"{name}-", dir=root)
    store, out = f"file://{os.path.join(folder, 'store')}", os.path.join(folder, "result.json")
    context = multiprocessing.get_context("fork")
    ranks = [context.Process(target=world_rank, args=(name, r, store, folder, reps, warmup, out)) for r in range(WORLD)]
    for process in ranks:
        process.start()
    while any(process.is_alive() for process in ranks):  # a failed rank stops the others
        if any(process.exitcode not in (None, 0) for process in ranks):
            for process in ranks:
                process.terminate()
        time.sleep(0.05)
    if any(process.exitcode != 0 for process in ranks):
        print(f"  {name} failed: exit codes {[process.exitcode for process in ranks]}")
        return None
    with open(out) as f:
        return json.load(f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, help="interleaved rounds, a world per candidate each (default 5, quick 2)")
    parser.add_argument("--reps", type=int, help="timed saves and loads per world (default 3, quick 1)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed saves and loads per world first (default 1)")
    parser.add_argument("--quick", action="store_true", help="fewer rounds and reps")
    parser.add_argument("--only", nargs="+", choices=sorted(CANDIDATES), help="run these candidates only")
    parser.add_argument("--dir", help="where checkpoints are written (default: a temporary folder in /dev/shm, else the system's)")
    args = parser.parse_args()
    args.rounds = args.rounds or (2 if args.quick else 5)
    args.reps = args.reps or (1 if args.quick else 3)
    names = list(args.only or CANDIDATES)
    base = args.dir or ("/dev/shm" if os.path.isdir("/dev/shm") else None)
    with tempfile.TemporaryDirectory(prefix="gradtx_bench_checkpoint_", dir=base) as root:
        n = sum(math.prod(shape) for shape in gpt_shapes(**GPT_41M).values())
        print(
            f"AdamW state of the GPT_41M tree ({n / 1e6:.1f}M float32 parameters); world {WORLD} (gloo, CPU, 1 thread "
            f"per rank), torch {torch.__version__}; checkpoints in {os.path.dirname(root)}; {args.rounds} rounds x "
            f"{len(names)} candidates, {args.warmup} untimed + {args.reps} timed saves and loads per world; "
            f"load average before: {os.getloadavg()[0]:.1f}"
        )
        results: dict[str, list[dict]] = {name: [] for name in names}
        started = time.perf_counter()
        for r in range(args.rounds):
            for name in names:
                answer = run_world(name, root, args.reps, args.warmup)
                results[name].append(answer or dict.fromkeys(("save", "load", "save_cpu", "load_cpu", "bytes"), float("nan")))
            print(f"  round {r + 1}/{args.rounds} done, {time.perf_counter() - started:.0f} s", flush=True)
    print("\ncandidates:")
    for name in names:
        print(f"  {name:14s} {CANDIDATES[name]}")
    baseline = BASELINE if BASELINE in names else names[0]
    for what, title in (("save", "save, wall-clock"), ("load", "load, wall-clock"),
                        ("save_cpu", "save, CPU time of the 4 ranks together"), ("load_cpu", "load, CPU time of the 4 ranks together")):
        report(f"{title}, one checkpoint (medians over rounds)", {n: [a[what] for a in results[n]] for n in names}, baseline)
    print("\nbytes written per checkpoint, and the spread of the rounds (fastest - slowest):")
    for name in names:
        spread = {what: sorted(a[what] for a in results[name]) for what in ("save", "load")}
        print(
            f"  {name:14s} {statistics.median(a['bytes'] for a in results[name]) / 1e6:9.1f} MB   save {spread['save'][0] * 1e3:.0f} - "
            f"{spread['save'][-1] * 1e3:.0f} ms   load {spread['load'][0] * 1e3:.0f} - {spread['load'][-1] * 1e3:.0f} ms"
        )
    print(f"load average after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
