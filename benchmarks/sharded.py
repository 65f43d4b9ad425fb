"""gradtx's sharded global norm against torch's ``clip_grad_norm_`` on the same DTensor gradients.

World size 4 on CPU (gloo), a 2 x 2 (dp, tp) mesh, the gradients of a GPT-style model (``GPT_41M``)
as DTensors laid out as FSDP2 + TP leaves them: matrices split over dp (dim 0) and tp (dim 1),
vectors over dp only. Both sides clip in place; both give the same norm. Reported: median time
per call (interleaved rounds, ``benchmarks/common.py``) and the number of collectives per call,
counted from the gloo events of a ``torch.profiler`` trace. A plain-tensor variant with a
``ShardingSpec`` describing the same layout is timed too.

Run:  python benchmarks/sharded.py            (spawns 4 processes; about a minute on 2 cores)
      python benchmarks/sharded.py --small    (the GPT-2 shapes at a quarter width, quicker)
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import GPT_41M, interleaved, make_tree, n_elements, report  # noqa: E402

import gradtx as gtx  # noqa: E402
from gradtx.sharding import Shard, ShardingSpec  # noqa: E402

WORLD = 4
SMALL = dict(n_layer=4, d_model=256, vocab=8192, n_ctx=512)


def count_collectives(fn) -> int:
    from torch.profiler import ProfilerActivity, profile

    os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # no "USDT: profiler_start/stop" lines per trace

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return sum(1 for event in prof.events() if event.name.startswith("gloo:"))


def worker(rank: int, store_path: str, config: dict, rounds: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", store=dist.FileStore(store_path, WORLD), rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=120)
    )
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor
    from torch.distributed.tensor import Shard as DShard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dense = make_tree(config, seed=0)

    def placements(x):
        return [DShard(0), DShard(1)] if x.ndim == 2 else [DShard(0), Replicate()]

    params = [torch.nn.Parameter(distribute_tensor(torch.zeros_like(x), mesh, placements(x))) for x in dense.values()]
    grads = {k: distribute_tensor(x, mesh, placements(x)) for k, x in dense.items()}
    for p, g in zip(params, grads.values()):
        p.grad = g.clone()
    # The same layout as plain tensors, declared by a spec.
    local = {k: g.to_local().clone() for k, g in grads.items()}
    spec = ShardingSpec(
        mesh, lambda path, t: Shard("dp", "tp", dim=(0, 1)) if dense[path].ndim == 2 else Shard("dp", dim=0)
    )

    tx = gtx.clip_by_global_norm(1.0)
    tx_spec = gtx.clip_by_global_norm(1.0, spec)
    state, state_spec = tx.init(grads), tx_spec.init(local)

    torch_norm = torch.nn.utils.clip_grad_norm_(params, 1.0)
    torch_norm = float(torch_norm.full_tensor() if hasattr(torch_norm, "full_tensor") else torch_norm)
    ours = float(gtx.global_norm(grads))
    ours_plain = float(gtx.global_norm(local, spec))
    candidates = {
        "torch clip_grad_norm_ (DTensor grads)": lambda: torch.nn.utils.clip_grad_norm_(params, 1.0),
        "gradtx clip_by_global_norm (DTensor, inplace)": lambda: tx.update(grads, state, inplace=True),
        "gradtx clip_by_global_norm (plain + spec, inplace)": lambda: tx_spec.update(local, state_spec, inplace=True),
        "gradtx global_norm (DTensor)": lambda: gtx.global_norm(grads),
    }
    counts = {name: count_collectives(fn) for name, fn in candidates.items()}
    times = interleaved(candidates, rounds=rounds)
    if rank == 0:
        print(f"world {WORLD}, mesh (dp=2, tp=2), {len(dense)} leaves, {n_elements(dense) / 1e6:.1f}M elements")
        print(f"norms: torch {torch_norm:.6f}  gradtx (DTensor) {ours:.6f}  gradtx (plain + spec) {ours_plain:.6f}")
        report("clip by global norm, per call (rank 0)", times, "torch clip_grad_norm_ (DTensor grads)")
        print("\ncollectives per call (gloo events in a torch.profiler trace)")
        for name, count in counts.items():
            print(f"  {name:52s} {count}")
    dist.barrier()  # nobody tears down while another rank still talks to it
    gc.collect()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="a smaller model, for a quick look")
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    config = SMALL if args.small else GPT_41M
    store = tempfile.mktemp(prefix="gradtx_bench_")
    mp.spawn(worker, args=(store, config, args.rounds), nprocs=WORLD)


if __name__ == "__main__":
    main()
