"""gradtx against torch, optax (jit, CPU) and torchopt on one GPT-style tree: clip by global norm, then AdamW.

Not part of the package or its tests: optax, JAX and torchopt live only in a separate benchmark
environment. Run from the repository root with that environment's interpreter::

    /path/to/benchenv/bin/python benchmarks/external.py [--rounds N] [--steps K] [--quick]

Every candidate does one full step, clip + AdamW + apply, on the GPT_41M tree of
``benchmarks/common.py`` (52 float32 leaves, 41.7M elements).

Method. Each candidate runs in a process of its own (``external.py --worker NAME``), which builds
its trees, takes a few warm-up steps, times ``K`` steps and prints their times as JSON. Sharing one
process is not fair: JAX's XLA thread pool keeps threads spinning after a jitted call and starves
torch's kernels that run next (torch's own fused AdamW step measured several times slower there).
The parent launches the workers interleaved at the process level (A, B, C, ..., A, B, C, ...) for
``N`` rounds; a round's time for a candidate is the median of its ``K`` steps, and the report gives
the median over rounds and the median over rounds of per-round ratios.

Every candidate runs under each of three allocator settings, added to its worker's environment:

- ``default``: as is. glibc hands large freed blocks back to the OS, so a pure step's new tensors
  (moments, updates, params) are page-faulted in again, 4 KiB at a time, every step;
- ``THP``: ``THP_MEM_ALLOC_ENABLE=1``, read by c10 at its first allocation: large CPU allocations are
  2 MiB-aligned and marked ``MADV_HUGEPAGE`` (fewer, larger faults; affects torch's allocations only);
- ``malloc``: ``MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=2**40``: glibc serves every block from its
  heap and never returns freed memory to the OS, so after the first step the pure paths reuse
  memory that is already mapped (no faults at all; the process keeps its peak footprint).

Before the rounds a ``bandwidth`` worker measures this machine's memory bandwidth and prints the
floor of one step: 5 reads and 3 writes of 167 MB, which no implementation, fused or not, can beat.

Each worker reports, per step, wall-clock time, the process's CPU time (``time.process_time``: on a
shared machine the CPU time a step needs is steadier than its wall-clock time, which counts the time
other processes hold the cores) and its minor page faults. ``--threads 1`` runs every library on one
thread (torch's intra-op pool and XLA's, ``--xla_cpu_multi_thread_eigen=false
intra_op_parallelism_threads=1``), so CPU time is the work done. After the rounds one more worker per
candidate runs a step under torch's profiler and reports the peak tensor memory the step allocated
above its inputs, next to the minimum a pure step needs: new params and new state (3 trees for AdamW).

Pure gradtx candidates: ``gradtx-pure`` (``apply_updates(params, updates)``), ``gradtx-pure-into-updates``
(``apply_updates(params, updates, donate_updates=True)``: the sums go into the updates' buffers, which
the step itself made) and ``gradtx-compiled`` (the whole pure step in one ``torch.compile(fullgraph=True)``
function). In every pure chain, the members after the clip work in the buffers of the updates the
clip made (``inplace="updates"``), never in the state's. ``gradtx-compile-step`` is
``gtx.compile_step(tx)``: the same compiled step, with the new params and state stored by the
generated loop straight into buffers recycled from the outputs the loop dropped two steps before;
its memory line adds the bytes those buffers keep between steps (the caller's current trees and
the previous step's, which a pure step holds at its peak anyway). ``gradtx-compile-step-donated`` is
``gtx.compile_step(tx, donate=True)``: the same loop storing the new params and state into the
buffers of the old ones, as ``jax.jit`` does with donated arguments and torch's step does in place.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Callable, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "src"))
sys.path.insert(0, ROOT)

LR, WEIGHT_DECAY, MAX_NORM = 1e-4, 0.01, 1.0


# --------------------------------------------------------------------------- candidates (built in a worker)


def _trees():
    from benchmarks.common import GPT_41M, make_tree

    return make_tree(GPT_41M, seed=0), make_tree(GPT_41M, seed=1)


def torch_fused() -> Callable[[], None]:
    """``clip_grad_norm_`` + ``AdamW(fused=True).step()``: torch's in-place step."""
    import torch

    params, grads = _trees()
    params = [p.requires_grad_() for p in params.values()]
    for p, g in zip(params, grads.values()):
        p.grad = g
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY, fused=True)

    def step():
        torch.nn.utils.clip_grad_norm_(params, MAX_NORM)
        opt.step()

    return step


def _gradtx_pure(tx) -> Callable[[], None]:
    import gradtx as gtx

    params, grads = _trees()
    box = {"params": params, "state": tx.init(params)}

    def step():
        updates, box["state"] = tx.update(grads, box["state"], box["params"])
        box["params"] = gtx.apply_updates(box["params"], updates)

    return step


def _gradtx_donated(tx) -> Callable[[], None]:
    """Gradients and state donated (``inplace=True``); the gradient buffers, which hold the updates
    afterwards, serve as the next step's gradients (a backward pass would refill them)."""
    import gradtx as gtx

    params, grads = _trees()
    box = {"state": tx.init(params)}

    def step():
        updates, box["state"] = tx.update(grads, box["state"], params, inplace=True)
        gtx.apply_updates(params, updates, inplace=True)

    return step


def _native_chain():
    import gradtx as gtx

    return gtx.chain(gtx.clip_by_global_norm(MAX_NORM), gtx.adamw(LR, weight_decay=WEIGHT_DECAY))


def _from_torch_chain():
    import torch

    import gradtx as gtx

    return gtx.chain(
        gtx.clip_by_global_norm(MAX_NORM), gtx.from_torch(torch.optim.AdamW, lr=LR, weight_decay=WEIGHT_DECAY, fused=True)
    )


def gradtx_pure() -> Callable[[], None]:
    return _gradtx_pure(_native_chain())


def gradtx_pure_aten() -> Callable[[], None]:
    """The pure step with gradtx's C Adam kernel off (``GRADTX_NATIVE=0``): one ATen kernel per operation."""
    os.environ["GRADTX_NATIVE"] = "0"
    return _gradtx_pure(_native_chain())


def gradtx_pure_into_updates() -> Callable[[], None]:
    """The pure step with the new params summed into the updates' buffers, which the step made
    itself (``apply_updates(..., donate_updates=True)``): nothing the caller holds is written."""
    import gradtx as gtx

    tx = _native_chain()
    params, grads = _trees()
    box = {"params": params, "state": tx.init(params)}

    def step():
        updates, box["state"] = tx.update(grads, box["state"], box["params"])
        box["params"] = gtx.apply_updates(box["params"], updates, donate_updates=True)

    return step


def gradtx_donated() -> Callable[[], None]:
    return _gradtx_donated(_native_chain())


def gradtx_compiled() -> Callable[[], None]:
    """The pure chain and ``apply_updates`` in one ``torch.compile(fullgraph=True)`` function."""
    import torch

    import gradtx as gtx

    tx = _native_chain()
    params, grads = _trees()
    box = {"params": params, "state": tx.init(params)}

    @torch.compile(fullgraph=True)
    def compiled(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return gtx.apply_updates(params, updates), state

    def step():
        box["params"], box["state"] = compiled(box["params"], box["state"], grads)

    return step


def gradtx_compile_step() -> Callable[[], None]:
    """``gtx.compile_step``: the same compiled pure step, writing its outputs into buffers recycled
    from the outputs the loop dropped two steps before (nothing large is allocated after two steps)."""
    import gradtx as gtx

    params, grads = _trees()
    tx = _native_chain()
    step_fn = gtx.compile_step(tx)
    box = {"params": params, "state": tx.init(params)}

    def step():
        box["params"], box["state"] = step_fn(grads, box["state"], box["params"])

    step.pool = step_fn.pool  # the memory report adds what the pool keeps between steps
    return step


def gradtx_compile_step_donated() -> Callable[[], None]:
    """``gtx.compile_step(tx, donate=True)``: the compiled step storing the new params and state
    into the buffers of the ones it reads, as torch's in-place step does."""
    import gradtx as gtx

    params, grads = _trees()
    tx = _native_chain()
    step_fn = gtx.compile_step(tx, donate=True)
    box = {"params": params, "state": tx.init(params)}

    def step():
        box["params"], box["state"] = step_fn(grads, box["state"], box["params"])

    return step


def from_torch_pure() -> Callable[[], None]:
    return _gradtx_pure(_from_torch_chain())


def from_torch_donated() -> Callable[[], None]:
    return _gradtx_donated(_from_torch_chain())


def optax_jit() -> Callable[[], None]:
    import jax
    import optax

    params, grads = _trees()
    tx = optax.chain(optax.clip_by_global_norm(MAX_NORM), optax.adamw(LR, weight_decay=WEIGHT_DECAY))
    box = {"params": {k: jax.numpy.asarray(v.numpy()) for k, v in params.items()}}
    grads = {k: jax.numpy.asarray(v.numpy()) for k, v in grads.items()}
    box["state"] = tx.init(box["params"])

    @jax.jit
    def jitted(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    def step():
        box["params"], box["state"] = jitted(box["params"], box["state"], grads)
        jax.block_until_ready(box["params"])

    return step


def _torchopt_chain():
    import torchopt

    return torchopt.chain(torchopt.clip_grad_norm(MAX_NORM), torchopt.adamw(LR, weight_decay=WEIGHT_DECAY))


def torchopt_pure() -> Callable[[], None]:
    import torchopt

    tx = _torchopt_chain()
    params, grads = _trees()
    box = {"params": params, "state": tx.init(params)}

    def step():
        updates, box["state"] = tx.update(grads, box["state"], params=box["params"], inplace=False)
        box["params"] = torchopt.apply_updates(box["params"], updates, inplace=False)

    return step


def torchopt_inplace() -> Callable[[], None]:
    import torchopt

    tx = _torchopt_chain()
    params, grads = _trees()
    box = {"state": tx.init(params)}

    def step():
        updates, box["state"] = tx.update(grads, box["state"], params=params, inplace=True)
        torchopt.apply_updates(params, updates, inplace=True)

    return step


CANDIDATES: dict[str, tuple[str, Callable[[], Callable[[], None]]]] = {
    "torch": ("torch clip_grad_norm_ + AdamW(fused), in place", torch_fused),
    "gradtx-pure": ("gradtx chain(clip, adamw), pure", gradtx_pure),
    "gradtx-pure-aten": ("gradtx chain(clip, adamw), pure, GRADTX_NATIVE=0", gradtx_pure_aten),
    "gradtx-pure-into-updates": ("gradtx chain(clip, adamw), pure, apply_updates(donate_updates=True)", gradtx_pure_into_updates),
    "gradtx-compiled": ("gradtx chain(clip, adamw), pure, torch.compile", gradtx_compiled),
    "gradtx-compile-step": ("gradtx chain(clip, adamw), pure, gtx.compile_step (recycled outputs)", gradtx_compile_step),
    "gradtx-compile-step-donated": ("gradtx chain(clip, adamw), gtx.compile_step(donate=True)", gradtx_compile_step_donated),
    "gradtx-donated": ("gradtx chain(clip, adamw), donated", gradtx_donated),
    "from-torch-pure": ("gradtx chain(clip, from_torch(AdamW)), pure", from_torch_pure),
    "from-torch-donated": ("gradtx chain(clip, from_torch(AdamW)), donated", from_torch_donated),
    "optax": ("optax chain(clip, adamw), jit, CPU", optax_jit),
    "torchopt-pure": ("torchopt chain(clip, adamw), pure", torchopt_pure),
    "torchopt-inplace": ("torchopt chain(clip, adamw), inplace=True", torchopt_inplace),
}
QUICK = (
    "torch", "gradtx-pure", "gradtx-pure-into-updates", "gradtx-compiled", "gradtx-compile-step",
    "gradtx-compile-step-donated", "optax", "torchopt-pure",
)
BASELINE = "torch"
# (ours, theirs, target): the ratios the report checks; "best-pure" is the fastest gradtx pure candidate.
TARGETS = (
    ("gradtx-pure", "torchopt-pure", 0.5),
    ("gradtx-pure", "torch", 2.0),
    ("gradtx-pure-into-updates", "torchopt-pure", 0.5),
    ("gradtx-compiled", "optax", 0.5),
    ("gradtx-compile-step", "optax", 0.5),
    ("best-pure", "torch", 1.5),
    ("from-torch-pure", "torch", None),
    ("gradtx-compile-step", "torch", 1.0),
    ("gradtx-compile-step-donated", "torch", 1.0),
)
PURE = ("gradtx-pure", "gradtx-pure-into-updates", "gradtx-compiled", "gradtx-compile-step", "from-torch-pure")
# What a step must hold beyond its inputs, in trees of the params' size: new params and new state.
MINIMUM_TREES = {"torch": 0, "gradtx-donated": 0, "gradtx-compile-step-donated": 0, "from-torch-donated": 0, "torchopt-inplace": 0}
TREE_BYTES = 41_680_896 * 4


# --------------------------------------------------------------------------- memory floor


def bandwidth(steps: int) -> dict[str, float]:
    """Memory bandwidth on tensors the size of the tree (41.7M float32 = 167 MB each), warm, and the
    extra cost of writing into a fresh allocation instead of an existing buffer."""
    import torch

    from benchmarks.common import interleaved

    n = 41_680_896
    a, b, c = torch.rand(n), torch.rand(n), torch.rand(n)

    def best(fn) -> float:
        return statistics.median(interleaved({"fn": fn}, rounds=steps, warmup=1)["fn"])

    pass_bytes = 4 * n
    read = best(lambda: a.sum())
    copy = best(lambda: c.copy_(a))
    triad = best(lambda: torch.add(a, b, alpha=0.5, out=c))
    in_place = best(lambda: torch.mul(a, 2.0, out=c))
    fresh = best(lambda: torch.mul(a, 2.0))
    return {
        "read_ms": read * 1e3,
        "copy_ms": copy * 1e3,
        "read_GBps": pass_bytes / read / 1e9,
        "copy_GBps": 2 * pass_bytes / copy / 1e9,
        "triad_GBps": 3 * pass_bytes / triad / 1e9,
        "fresh_extra_ms": (fresh - in_place) * 1e3,
    }


# --------------------------------------------------------------------------- worker


def _peak_bytes(step: Callable[[], None]) -> int:
    """The peak, during ``step()``, of the CPU tensor memory allocated above what was live before it,
    from torch's profiler (each top-level op's allocations less its frees, in time order; blocks
    freed that were allocated before, the step's inputs, are not counted, so they are held to the end)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = sorted((e for e in prof.events() if e.cpu_parent is None), key=lambda e: e.time_range.start)
    live = peak = 0
    for event in events:
        live += event.cpu_memory_usage
        peak = max(peak, live)
    return peak


def worker(name: str, steps: int, warmup: int, threads: int, memory: bool) -> None:
    """Builds one candidate, warms it up, times ``steps`` steps; prints ``{"times": [...], "cpu": [...],
    "faults": [...]}`` (wall seconds, process CPU seconds, minor page faults per step). With
    ``memory``, instead runs one step under torch's profiler and prints the peak of the tensor memory
    it allocated above its inputs (``peak_mb``; torch's allocations only, so not XLA's)."""
    import resource

    import torch

    if threads:
        torch.set_num_threads(threads)
    if name == "bandwidth":
        print(json.dumps({"name": name, **bandwidth(steps)}))
        return
    with torch.no_grad():
        step = CANDIDATES[name][1]()
        for _ in range(warmup):
            step()
        if memory:
            answer = {"name": name, "peak_mb": _peak_bytes(step) / 1e6}
            if hasattr(step, "pool"):  # recycled buffers: allocated steps before, kept between steps
                answer["kept_mb"] = step.pool.kept_bytes() / 1e6
            print(json.dumps(answer))
            return
        times, cpu, faults = [], [], []
        for _ in range(steps):
            flt = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            start, start_cpu = time.perf_counter(), time.process_time()
            step()
            times.append(time.perf_counter() - start)
            cpu.append(time.process_time() - start_cpu)
            faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - flt)
    print(json.dumps({"name": name, "times": times, "cpu": cpu, "faults": faults}))


# --------------------------------------------------------------------------- parent

# How each worker's allocator is set up (environment variables added to the worker's environment).
ENVIRONMENTS: dict[str, dict[str, str]] = {
    "default": {},
    # c10: 2 MiB-aligned large CPU allocations marked MADV_HUGEPAGE.
    "THP": {"THP_MEM_ALLOC_ENABLE": "1"},
    # glibc: never hand freed memory back to the OS, so the next step's tensors reuse it unfaulted.
    "malloc": {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(1 << 40)},
}
_ALLOCATOR_VARIABLES = sorted({k for env in ENVIRONMENTS.values() for k in env})


def run_worker(name: str, environment: str, steps: int, warmup: int, threads: int = 0, memory: bool = False) -> Optional[dict]:
    """One worker process; returns its JSON answer, or None if it failed."""
    from benchmarks.common import run_worker as run_process

    args = ["--worker", name, "--steps", str(steps), "--warmup", str(warmup), "--threads", str(threads)]
    env = dict(ENVIRONMENTS[environment])
    if threads == 1:  # XLA's own pool too
        env["XLA_FLAGS"] = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
    if memory:
        args.append("--memory")
    return run_process(__file__, args, label=f"{name} ({environment})", env=env, unset=_ALLOCATOR_VARIABLES + ["XLA_FLAGS"])


def available(names: list[str]) -> list[str]:
    """Drops the candidates whose library is not installed in this environment."""
    import importlib.util

    needs = {"optax": "optax", "torchopt-pure": "torchopt", "torchopt-inplace": "torchopt"}
    kept = []
    for name in names:
        module = needs.get(name)
        if module is not None and importlib.util.find_spec(module) is None:
            print(f"{name}: {module} is not installed here, left out")
            continue
        kept.append(name)
    return kept


def print_floor(steps: int) -> None:
    """The memory-traffic floor of one clip + AdamW step on this machine: whatever fuses it, a step
    reads the gradients twice (the norm, then the update) and the params and both moments once,
    and writes the params and both moments (one float32 pass = 167 MB)."""
    answer = run_worker("bandwidth", "default", steps, 1)
    if answer is None:
        return
    read, copy = answer["read_ms"], answer["copy_ms"]
    floor = 5 * read + 3 * (copy - read)
    print(
        f"memory floor: read {answer['read_GBps']:.1f} GB/s, copy {answer['copy_GBps']:.1f} GB/s; "
        f"5 reads + 3 writes of 167 MB = {floor:.1f} ms per step"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", choices=sorted(CANDIDATES) + ["bandwidth"], help=argparse.SUPPRESS)
    parser.add_argument("--memory", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rounds", type=int, help="process-level interleaved rounds (default 5, quick 2)")
    parser.add_argument("--steps", type=int, help="timed steps per worker (default 7, quick 3)")
    parser.add_argument("--warmup", type=int, help="untimed steps per worker (default 3, quick 2)")
    parser.add_argument("--threads", type=int, default=0, help="torch (and XLA) threads per worker (default: as is)")
    parser.add_argument("--quick", action="store_true", help="the target candidates only, fewer rounds and steps")
    parser.add_argument("--only", nargs="+", choices=sorted(CANDIDATES), help="run these candidates only")
    parser.add_argument("--envs", nargs="+", choices=sorted(ENVIRONMENTS), default=list(ENVIRONMENTS),
                        help="allocator settings to run every candidate under (default: all)")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory workers")
    args = parser.parse_args()
    defaults = (2, 3, 2) if args.quick else (5, 7, 3)
    args.rounds, args.steps, args.warmup = (
        given if given is not None else default for given, default in zip((args.rounds, args.steps, args.warmup), defaults)
    )
    if args.worker:
        worker(args.worker, args.steps, args.warmup, args.threads, args.memory)
        return
    names = available(list(args.only or (QUICK if args.quick else CANDIDATES)))

    import torch

    from benchmarks.common import report

    print(
        f"GPT_41M tree, 41.7M float32 elements; torch {torch.__version__}, {os.cpu_count()} CPUs, "
        f"{args.threads or 'default'} threads per worker; {args.rounds} rounds x "
        f"{len(names)} candidates x {len(args.envs)} allocator settings, {args.warmup} warm-up + {args.steps} timed steps each"
    )
    for environment in args.envs:
        print(f"  {environment}: {' '.join(f'{k}={v}' for k, v in ENVIRONMENTS[environment].items()) or '(as is)'}")
    print_floor(args.steps)
    settings = [(name, environment) for name in names for environment in args.envs]
    times: dict[tuple[str, str], list[float]] = {s: [] for s in settings}
    cpu: dict[tuple[str, str], list[float]] = {s: [] for s in settings}
    faults: dict[tuple[str, str], list[float]] = {s: [] for s in settings}
    started = time.perf_counter()
    for r in range(args.rounds):
        for name, environment in settings:
            answer = run_worker(name, environment, args.steps, args.warmup, args.threads)
            nan = float("nan")
            times[(name, environment)].append(statistics.median(answer["times"]) if answer else nan)
            cpu[(name, environment)].append(statistics.median(answer["cpu"]) if answer else nan)
            faults[(name, environment)].append(statistics.median(answer["faults"]) if answer else nan)
        print(f"  round {r + 1}/{args.rounds} done, {time.perf_counter() - started:.0f} s", flush=True)

    labels = {name: CANDIDATES[name][0] for name in names}
    for environment in args.envs:
        if BASELINE in names:
            for what, table in (("wall-clock", times), ("process CPU time", cpu)):
                per_env = {labels[name]: table[(name, environment)] for name in names}
                report(f"clip + AdamW + apply, one step, {environment} allocator, {what}", per_env, labels[BASELINE])
        print(f"\nminor page faults per step ({environment}):")
        for name in names:
            print(f"  {name:26s} {statistics.median(faults[(name, environment)]):10.0f}")
    for what, table in (("wall-clock", times), ("process CPU time", cpu)):
        print(f"\nratios, {what} (median over rounds of per-round ratios, same allocator setting):")
        for ours, theirs, target in TARGETS:
            candidates = [n for n in PURE if n in names and n != "from-torch-pure"] if ours == "best-pure" else [ours]
            if not candidates or theirs not in names or any(c not in names for c in candidates):
                continue
            parts = []
            for e in args.envs:
                best = min(candidates, key=lambda c: statistics.median(table[(c, e)]))
                parts.append(f"{e} {_median_ratio(table[(best, e)], table[(theirs, e)]):.3f}" + (f" ({best})" if ours == "best-pure" else ""))
            print(f"  {ours} / {theirs}: {', '.join(parts)}" + (f" (target <= {target})" if target else ""))
    if not args.no_memory:
        print(f"\npeak tensor memory of one step above its inputs (MB, torch's profiler; minimum = new params + new state, {TREE_BYTES / 1e6:.0f} MB a tree):")
        for name in names:
            if name == "optax":
                print(f"  {name:26s} (XLA allocates outside torch: not measured)")
                continue
            answer = run_worker(name, "default", 1, args.warmup, args.threads, memory=True)
            minimum = MINIMUM_TREES.get(name, 3) * TREE_BYTES / 1e6
            peak = f"{answer['peak_mb']:8.0f}" if answer else "  failed"
            kept = f"   recycled buffers kept between steps {answer['kept_mb']:.0f}" if answer and "kept_mb" in answer else ""
            print(f"  {name:26s} peak {peak}   minimum {minimum:6.0f}{kept}")


def _median_ratio(a: list[float], b: list[float]) -> float:
    pairs = [x / y for x, y in zip(a, b) if x == x and y == y]
    return statistics.median(pairs) if pairs else float("nan")


if __name__ == "__main__":
    main()
