"""What the cross-rank consistency check costs: the first step of a plan, and every later step.

World sizes 2 and 4 on CPU (gloo), a 1-D ``tp`` mesh, the gradient tree of a GPT-style model with
its matrices split over ``tp`` (a rule list) and its vectors replicated; each rank holds its piece.
Timed per call of ``gtx.global_norm`` (the one all-reduce of a clip), interleaved rounds
(``benchmarks/common.py``), medians on rank 0:

- first call, ``check_consistency="once"`` (the default): a fresh spec each round, so the plan is
  resolved and the ranks compare it (one ``all_gather`` of a fixed 7-int64 record a rank);
- first call, ``check_consistency=False``: resolving alone, no check;
- steady state with ``"once"`` (nothing more than the norm), with ``True`` (the check at every
  call) and with ``False``.

Ratios are against the steady-state call with ``False``.

Run:  python benchmarks/consistency.py [--small] [--rounds N]
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import GPT_41M, interleaved, make_tree, report  # noqa: E402

import gradtx as gtx  # noqa: E402
from gradtx.sharding import Replicate, Shard, ShardingSpec  # noqa: E402

SMALL = dict(n_layer=4, d_model=256, vocab=8192, n_ctx=512)


def worker(rank: int, world: int, store_path: str, config: dict, rounds: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120)
    )
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    dense = make_tree(config, seed=0)
    local = {k: (torch.tensor_split(x, world, 0)[rank].clone() if x.ndim == 2 else x) for k, x in dense.items()}
    matrices = {k for k, x in dense.items() if x.ndim == 2}
    rules = [(k, Shard("tp")) for k in sorted(matrices)] + [("*", Replicate())]

    once = ShardingSpec(mesh, rules)
    always = ShardingSpec(mesh, rules, check_consistency=True)
    never = ShardingSpec(mesh, rules, check_consistency=False)
    candidates = {
        "first call, check once (default)": lambda: gtx.global_norm(local, ShardingSpec(mesh, rules)),
        "first call, no check": lambda: gtx.global_norm(local, ShardingSpec(mesh, rules, check_consistency=False)),
        "steady, check once (default)": lambda: gtx.global_norm(local, once),
        "steady, check every call": lambda: gtx.global_norm(local, always),
        "steady, no check": lambda: gtx.global_norm(local, never),
    }
    times = interleaved(candidates, rounds=rounds)
    if rank == 0:
        print(f"\nworld {world}, {len(local)} leaves")
        report(f"global_norm per call, world {world} (rank 0)", times, "steady, no check")
        first = statistics.median(times["first call, check once (default)"]) - statistics.median(times["first call, no check"])
        print(f"  the check itself on a first call: {first * 1e3:.2f} ms (difference of medians)")
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="a smaller model, for a quick look")
    parser.add_argument("--quick", action="store_true", help="the smaller model and fewer rounds")
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    config = SMALL if (args.small or args.quick) else GPT_41M
    rounds = 10 if args.quick else args.rounds
    for world in (2, 4):
        store = tempfile.mktemp(prefix="gradtx_bench_")
        mp.spawn(worker, args=(world, store, config, rounds), nprocs=world)


if __name__ == "__main__":
    main()
