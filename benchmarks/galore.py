"""Sharded GaLore: gradtx's exact projection of sharded matrices against gathering every matrix.

World size 4 on CPU (gloo), the block matrices of a GPT-style model (``common.gpt_shapes``), in
the layouts of ``benchmarks/muon.py``: tensor parallel over 4 ranks (qkv and MLP fc split along
dim 0, both projections along dim 1) as plain tensors with a ``ShardingSpec``, and FSDP2's
``Shard(0)`` as DTensors. Candidates, all giving the same numbers:

- ``gradtx``: ``scale_by_galore(spec=...)``: on a plain step, each rank multiplies its block of
  the gradient by its rows of the projector and the ``r x n`` (or ``m x r``) shares are all-reduced
  (one ``all_reduce``); on a refresh step the whole gradients are gathered first for the SVDs (one
  ``all_gather`` more);
- ``naive``: every leaf gathered on its own at every step (``all_gather`` per leaf, or
  ``full_tensor()`` for a DTensor), the dense ``scale_by_galore`` run on the whole tree, this
  rank's slice kept.

Reported: median time per step over interleaved rounds (each step ends in a barrier), the
collectives per step and the bytes each rank receives per step (gathers: the other ranks' pieces;
all-reduces: the buffer, counted once, which a ring all-reduce receives about ``2 (k-1)/k`` of).

Run:  python benchmarks/galore.py               (2 layers of width 256, rank 32)
      python benchmarks/galore.py --width 128   (quicker)
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import statistics
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))
from common import interleaved  # noqa: E402
from muon import COLUMN, WORLD, Received, count_collectives, matrices  # noqa: E402

from gradtx.contrib import scale_by_galore  # noqa: E402
from gradtx.sharding import Shard, ShardingSpec  # noqa: E402


class ReceivedWithReduce(Received):
    """Also counts each ``all_reduce`` buffer (once)."""

    def __enter__(self):
        super().__enter__()
        original = dist.all_reduce
        self._saved["all_reduce"] = original

        def counted(tensor, *args, **kwargs):
            self.bytes += tensor.numel() * tensor.element_size()
            return original(tensor, *args, **kwargs)

        dist.all_reduce = counted
        return self


def worker(rank: int, store_path: str, width: int, layers: int, rounds: int, low_rank: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", store=dist.FileStore(store_path, WORLD), rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=300)
    )
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard as DShard
    from torch.distributed.tensor import distribute_tensor

    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("tp",))
    shapes = matrices(width, layers)
    gen = torch.Generator().manual_seed(0)
    dense = {k: torch.randn(s, generator=gen) for k, s in shapes.items()}
    make = lambda spec=None: scale_by_galore(rank=low_rank, update_proj_gap=2, spec=spec)  # noqa: E731
    dense_tx = make()
    dense_state0 = dense_tx.init(dense)
    dense_state1 = dense_tx.update(dense, dense_state0)[1]  # count 1: the next step does not refresh

    def tp_dim(name):
        return 0 if name.endswith(COLUMN) else 1

    tp = {k: torch.tensor_split(x, WORLD, tp_dim(k))[rank].clone() for k, x in dense.items()}
    spec = ShardingSpec(mesh, lambda path, t: Shard("tp", dim=tp_dim(path)))
    fsdp = {k: distribute_tensor(x, mesh, [DShard(0)]) for k, x in dense.items()}

    def naive_tp(state):
        whole = {}
        for k, x in tp.items():
            parts = [torch.empty_like(x) for _ in range(WORLD)]
            dist.all_gather(parts, x)
            whole[k] = torch.cat(parts, tp_dim(k))
        out, _ = dense_tx.update(whole, state)
        return {k: torch.tensor_split(v, WORLD, tp_dim(k))[rank] for k, v in out.items()}

    def naive_fsdp(state):
        whole = {k: x.full_tensor() for k, x in fsdp.items()}
        out, _ = dense_tx.update(whole, state)
        return {k: torch.chunk(v, WORLD, 0)[rank] for k, v in out.items()}

    results = {}
    for layout, tree, naive, tx_spec in (("TP (plain + spec)", tp, naive_tp, spec), ("FSDP2 Shard(0) (DTensor)", fsdp, naive_fsdp, None)):
        tx = make(tx_spec)
        state0 = tx.init(tree)
        state1 = tx.update(tree, state0)[1]
        candidates = {
            "naive, plain step": lambda: naive(dense_state1),
            "gradtx, plain step": lambda tx=tx, t=tree, st=state1: tx.update(t, st)[0],
            "naive, refresh step": lambda: naive(dense_state0),
            "gradtx, refresh step": lambda tx=tx, t=tree, st=state0: tx.update(t, st)[0],
        }
        references = {"plain": naive(dense_state1), "refresh": naive(dense_state0)}
        for name, fn in candidates.items():
            got = fn()
            reference = references["plain" if "plain" in name else "refresh"]
            for k in shapes:
                value = got[k].to_local() if hasattr(got[k], "to_local") else got[k]
                torch.testing.assert_close(value, reference[k], rtol=1e-5, atol=1e-6, msg=f"{name} {k}")
        counts, received = {}, {}
        local_bytes = sum((v.to_local() if hasattr(v, "to_local") else v).numel() for v in tree.values()) * 4
        total_bytes = sum(x.numel() for x in dense.values()) * 4
        for name, fn in candidates.items():
            counts[name] = count_collectives(fn)
            with ReceivedWithReduce() as r:
                fn()
            # DTensor.full_tensor() runs functional collectives, which the counter does not see
            received[name] = r.bytes if r.bytes or not name.startswith("naive") else total_bytes - local_bytes
        stepped = {name: (lambda fn=fn: (fn(), dist.barrier())) for name, fn in candidates.items()}
        times = interleaved(stepped, rounds=rounds, warmup=1)
        results[layout] = (times, counts, received)

    if rank == 0:
        n = sum(x.numel() for x in dense.values())
        print(f"world {WORLD} (gloo, CPU, 1 thread per rank), {len(dense)} matrices of a GPT-style model "
              f"({layers} layers, width {width}), {n / 1e6:.2f}M elements, float32, GaLore rank {low_rank}; "
              f"{rounds} interleaved rounds")
        for layout, (times, counts, received) in results.items():
            print(f"\n{layout}: per step")
            for name, ts in times.items():
                print(f"  {name:24s} median {statistics.median(ts) * 1e3:9.1f} ms   collectives {counts[name]:3d}   "
                      f"received {received[name] / 2**20:7.2f} MiB per rank")
    dist.barrier()
    gc.collect()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    store = tempfile.mktemp(prefix="gradtx_bench_galore_")
    mp.spawn(worker, args=(store, args.width, args.layers, args.rounds, args.rank), nprocs=WORLD)


if __name__ == "__main__":
    main()
