"""What ``gtx.observe`` costs: step time with statistics on and off, and collectives per step.

1. Step time: the 41.7M-parameter GPT tree (``common.GPT_41M``, 52 float32 leaves), one step =
   ``chain(clip_by_global_norm(1.0), adamw(1e-4, weight_decay=0.01)).update(grads, state, params)``,
   against the same chain inside ``observe(..., groups=2)`` (one group per layer and per top-level
   leaf: 7 groups). Both the pure path (new updates and state) and the donated one
   (``inplace=True``, as ``wrap`` runs it), each pair (statistics off, on) timed in rounds of its
   own (``common.interleaved``: A B, B A, ...), so that a step follows a step of its own kind, as in
   a training loop, and not one that allocates or frees a whole tree; medians, and the median of
   per-round ratios (statistics on over off, timed in the same round); with 1 and 2 torch threads
   (target: ratio <= 1.05).
   With ``--compiled``, the same two steps through ``gtx.compile_step`` as well (1 thread).
2. Collectives per step in a world of 2 (gloo, one process per rank, ZeRO-style: every leaf split
   over ``dp`` along dim 0, declared by a ``ShardingSpec``): the sharded clip alone in the chain,
   against the chain with statistics (target: 1 and 1), counted from the gloo events of a
   ``torch.profiler`` trace, and the sharded step time ratio: each step is timed from a barrier
   (every rank starts it together) to a barrier after it (the slowest rank has finished it), so a
   rank that is late from the step before is not counted against the next step.

Run from the repository root::

    python benchmarks/observe.py [--rounds N] [--quick] [--compiled]
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import statistics
import sys
import tempfile
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(_ROOT, "src"), _ROOT]  # runs from a checkout

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

import gradtx as gtx  # noqa: E402
from benchmarks.common import GPT_41M, interleaved, make_tree, median_ratio, n_elements, report  # noqa: E402
from benchmarks.sharded import count_collectives  # noqa: E402

SMALL = dict(n_layer=4, d_model=256, vocab=8192, n_ctx=512)
WORLD = 2
BASELINE, OBSERVED = "chain(clip, adamw)", "observe(chain(clip, adamw), groups=2)"
DONATED_BASELINE, DONATED_OBSERVED = "chain(clip, adamw), inplace=True", "observe(...), inplace=True"
PAIRS = {"pure": (BASELINE, OBSERVED), "inplace": (DONATED_BASELINE, DONATED_OBSERVED)}


def chain(spec=None) -> gtx.GradientTransformation:
    return gtx.chain(gtx.clip_by_global_norm(1.0, spec), gtx.adamw(1e-4, weight_decay=0.01))


def candidates(grads, params, spec=None) -> dict:
    """Pure and donated steps, statistics off and on."""
    plain, observed = chain(spec), gtx.observe(chain(spec), groups=2, spec=spec)
    plain_state, observed_state = plain.init(params), observed.init(params)
    donated_plain, donated_observed = plain.init(params), observed.init(params)
    observed.update(grads, observed_state, params)  # agrees on the groups once
    grads_a = {k: g.clone() for k, g in grads.items()}
    grads_b = {k: g.clone() for k, g in grads.items()}
    return {
        BASELINE: lambda: plain.update(grads, plain_state, params),
        OBSERVED: lambda: observed.update(grads, observed_state, params),
        DONATED_BASELINE: lambda: plain.update(grads_a, donated_plain, params, inplace=True),
        DONATED_OBSERVED: lambda: observed.update(grads_b, donated_observed, params, inplace=True),
    }


def timed_pairs(steps: dict, rounds: int, before=None) -> dict[str, list[float]]:
    """Each pair of :data:`PAIRS` (statistics off, on) interleaved in rounds of its own."""
    times: dict[str, list[float]] = {}
    for off, on in PAIRS.values():
        times.update(interleaved({off: steps[off], on: steps[on]}, rounds=rounds, before=before))
    return times


def report_pairs(title: str, times: dict[str, list[float]]) -> None:
    """Medians, and statistics on / off as the median over rounds of one round's ratio."""
    print(f"\n{title}")
    for name, (off, on) in PAIRS.items():
        print(f"  {name:8s} statistics off {statistics.median(times[off]) * 1e3:8.2f} ms, on {statistics.median(times[on]) * 1e3:8.2f} ms")
    ratios = ", ".join(f"{name} {median_ratio(times, on, off):.3f}" for name, (off, on) in PAIRS.items())
    print(f"  statistics on / off: {ratios} (target <= 1.05)")


def local_timing(config: dict, rounds: int) -> None:
    grads, params = make_tree(config, seed=1, scale=1e-2), make_tree(config, seed=2)
    print(f"{len(grads)} leaves, {n_elements(grads) / 1e6:.1f}M float32 elements, 7 groups")
    for threads in (1, 2):
        torch.set_num_threads(threads)
        report_pairs(f"one step, {threads} thread(s) (unsharded)", timed_pairs(candidates(grads, params), rounds))


def compiled_timing(config: dict, rounds: int) -> None:
    """The same two steps through ``gtx.compile_step`` (Inductor), where the statistics' reductions
    can share the optimizer's loops; params and state carried from step to step, as a loop does."""
    grads, params = make_tree(config, seed=1, scale=1e-2), make_tree(config, seed=2)
    torch.set_num_threads(1)
    runs = {}
    for name, tx in ((BASELINE, chain()), (OBSERVED, gtx.observe(chain(), groups=2))):
        step, carried = gtx.compile_step(tx), [params, tx.init(params)]

        def run(step=step, carried=carried) -> None:
            carried[:] = step(grads, carried[1], carried[0])

        runs[name] = run
    start = time.perf_counter()
    for run in runs.values():  # compiles (the first call of each), then one steady-state step
        run()
        run()
    print(f"\ncompile_step: both steps compiled in {time.perf_counter() - start:.0f} s")
    times = interleaved(runs, rounds=rounds)
    ratios = report("one compile_step step, 1 thread (unsharded)", times, BASELINE)
    print(f"  statistics on / off, compile_step: {ratios[OBSERVED]:.3f} (target <= 1.05)")


def worker(rank: int, store_path: str, config: dict, rounds: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", store=dist.FileStore(store_path, WORLD), rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=120)
    )
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("dp",))
    spec = gtx.sharding.ShardingSpec(mesh, [("*", gtx.sharding.Shard("dp", dim=0))])
    dense_grads, dense_params = make_tree(config, seed=1, scale=1e-2), make_tree(config, seed=2)
    grads = {k: g.chunk(WORLD)[rank].clone() for k, g in dense_grads.items()}
    params = {k: p.chunk(WORLD)[rank].clone() for k, p in dense_params.items()}
    steps = candidates(grads, params, spec)
    for fn in steps.values():
        fn()  # plans, groups, checks: once
    counts = {name: count_collectives(fn) for name, fn in steps.items()}
    world_steps = {name: (lambda fn=fn: (fn(), dist.barrier())) for name, fn in steps.items()}
    times = timed_pairs(world_steps, rounds, before=dist.barrier)
    if rank == 0:
        print(f"\nworld {WORLD} (gloo), every leaf split over dp along dim 0, {n_elements(dense_grads) / 1e6:.1f}M elements")
        report_pairs("one sharded step (every rank from one barrier to the next, 1 thread a rank)", times)
        print("\ncollectives per step (gloo events in a torch.profiler trace)")
        for name, count in counts.items():
            print(f"  {name:45s} {count}")
    dist.barrier()
    gc.collect()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--quick", action="store_true", help="fewer rounds, a smaller tree in the world of 2")
    parser.add_argument("--compiled", action="store_true", help="also time both steps through compile_step (minutes of compilation on a CPU)")
    args = parser.parse_args()
    rounds = 5 if args.quick else args.rounds
    local_timing(GPT_41M, rounds)
    if args.compiled:
        compiled_timing(GPT_41M, rounds)
    store = tempfile.mktemp(prefix="gradtx_bench_")
    mp.spawn(worker, args=(store, SMALL if args.quick else GPT_41M, rounds), nprocs=WORLD)


if __name__ == "__main__":
    main()
