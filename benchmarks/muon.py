"""Sharded Muon: gradtx's exact orthogonalization of sharded matrices against the naive approach.

World size 4 on CPU (gloo), the block matrices of a GPT-style model (``common.gpt_shapes``; the
embeddings and vectors would take AdamW in ``muon`` and are elementwise, so they are left out),
in two layouts: tensor parallel over 4 ranks (attention qkv and MLP fc column-parallel, split along
dim 0; both projections row-parallel, along dim 1) as plain tensors with a ``ShardingSpec``, and
FSDP2's ``Shard(0)`` as DTensors. Candidates, all giving the same numbers:

- ``gather``: ``scale_by_muon(spec=..., strategy="gather")``: one all-gather per step for the whole
  tree, every rank orthogonalizes every matrix, keeps its slice;
- ``owner``: ``strategy="owner"``: one rank per matrix (balanced), two all-to-alls per step;
- ``naive``: each leaf gathered on its own (``all_gather`` per leaf, or ``full_tensor()`` for a
  DTensor), the dense ``scale_by_muon`` run on the whole tree, this rank's slice kept.

Reported: median time per step over interleaved rounds (each step ends in a barrier, so it is the
slowest rank's time), the collectives per step (gloo events of a ``torch.profiler`` trace) and the
bytes each rank receives per step (counted from the collectives' buffers).

Run:  python benchmarks/muon.py               (2 layers of width 256; a few minutes on 2 cores)
      python benchmarks/muon.py --width 128   (quicker)
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
from common import gpt_shapes, interleaved  # noqa: E402

from gradtx.contrib import scale_by_muon  # noqa: E402
from gradtx.sharding import Shard, ShardingSpec  # noqa: E402

WORLD = 4
COLUMN = ("attn.c_attn.weight", "mlp.c_fc.weight")  # split along dim 0 under TP
ROW = ("attn.c_proj.weight", "mlp.c_proj.weight")  # split along dim 1 under TP


class Received:
    """Counts the bytes this rank receives from other ranks in the collectives gradtx and the naive
    approach call (all_gather, all_gather_single / all_gather_into_tensor, all_to_all_single)."""

    def __init__(self):
        self.bytes = 0
        self._saved = {}

    def __enter__(self):
        me = dist.get_rank

        def wrap(name, count):
            original = getattr(dist, name)
            self._saved[name] = original

            def counted(*args, **kwargs):
                self.bytes += count(*args, **kwargs)
                return original(*args, **kwargs)

            setattr(dist, name, counted)

        size = lambda t: t.numel() * t.element_size()  # noqa: E731
        group_size = lambda kw: dist.get_world_size(kw.get("group"))  # noqa: E731
        wrap("all_gather", lambda out, inp, **kw: sum(size(t) for t in out) - size(inp))
        for name in ("all_gather_single", "all_gather_into_tensor"):
            if hasattr(dist, name):
                wrap(name, lambda out, inp, **kw: size(out) - size(inp))

        def a2a(out, inp, out_splits=None, in_splits=None, group=None, **kw):
            mine = dist.get_group_rank(group, me()) if group is not None else me()
            own = out_splits[mine] if out_splits else out.numel() // dist.get_world_size(group)
            return (out.numel() - own) * out.element_size()

        wrap("all_to_all_single", a2a)
        del group_size
        return self

    def __exit__(self, *exc):
        for name, original in self._saved.items():
            setattr(dist, name, original)


def count_collectives(fn) -> int:
    from torch.profiler import ProfilerActivity, profile

    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return sum(1 for event in prof.events() if event.name.startswith("gloo:"))


def matrices(width: int, layers: int) -> dict[str, tuple[int, ...]]:
    shapes = gpt_shapes(n_layer=layers, d_model=width, vocab=8, n_ctx=8)
    return {k: s for k, s in shapes.items() if k.startswith("h.") and len(s) == 2}


def worker(rank: int, store_path: str, width: int, layers: int, rounds: int) -> None:
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
    dense_tx = scale_by_muon()
    dense_state = dense_tx.init(dense)

    def tp_dim(name):
        return 0 if name.endswith(COLUMN) else 1

    tp = {k: torch.tensor_split(x, WORLD, tp_dim(k))[rank].clone() for k, x in dense.items()}
    spec = ShardingSpec(mesh, lambda path, t: Shard("tp", dim=tp_dim(path)))
    fsdp = {k: distribute_tensor(x, mesh, [DShard(0)]) for k, x in dense.items()}

    def naive_tp():
        whole = {}
        for k, x in tp.items():
            parts = [torch.empty_like(x) for _ in range(WORLD)]
            dist.all_gather(parts, x)
            whole[k] = torch.cat(parts, tp_dim(k))
        out, _ = dense_tx.update(whole, dense_state)
        return {k: torch.tensor_split(v, WORLD, tp_dim(k))[rank] for k, v in out.items()}

    def naive_fsdp():
        whole = {k: x.full_tensor() for k, x in fsdp.items()}
        out, _ = dense_tx.update(whole, dense_state)
        return {k: torch.chunk(v, WORLD, 0)[rank] if rank < len(torch.chunk(v, WORLD, 0)) else v[:0] for k, v in out.items()}

    results = {}
    for layout, tree, naive, tx_spec in (("TP (plain + spec)", tp, naive_tp, spec), ("FSDP2 Shard(0) (DTensor)", fsdp, naive_fsdp, None)):
        gather_tx = scale_by_muon(spec=tx_spec, strategy="gather")
        owner_tx = scale_by_muon(spec=tx_spec, strategy="owner")
        gather_state, owner_state = gather_tx.init(tree), owner_tx.init(tree)
        candidates = {
            "naive (gather each leaf, dense Muon)": naive,
            "gradtx strategy='gather'": lambda tx=gather_tx, t=tree, st=gather_state: tx.update(t, st)[0],
            "gradtx strategy='owner'": lambda tx=owner_tx, t=tree, st=owner_state: tx.update(t, st)[0],
        }
        # the same numbers
        reference = naive()
        for name, fn in candidates.items():
            got = fn()
            for k in shapes:
                value = got[k].to_local() if hasattr(got[k], "to_local") else got[k]
                torch.testing.assert_close(value, reference[k], rtol=1e-5, atol=1e-6, msg=f"{name} {k}")
        counts, received = {}, {}
        for name, fn in candidates.items():
            counts[name] = count_collectives(fn)
            with Received() as r:
                fn()
            received[name] = r.bytes
        # DTensor.full_tensor() runs functional collectives, which the counter does not see: the naive
        # approach receives every other rank's piece of every leaf
        local_bytes = sum((v.to_local() if hasattr(v, "to_local") else v).numel() for v in tree.values()) * 4
        total_bytes = sum(x.numel() for x in dense.values()) * 4
        if received[next(iter(candidates))] == 0:
            received[next(iter(candidates))] = total_bytes - local_bytes
        stepped = {name: (lambda fn=fn: (fn(), dist.barrier())) for name, fn in candidates.items()}
        times = interleaved(stepped, rounds=rounds, warmup=1)
        results[layout] = (times, counts, received)

    if rank == 0:
        n = sum(x.numel() for x in dense.values())
        print(f"world {WORLD} (gloo, CPU, 1 thread per rank), {len(dense)} matrices of a GPT-style model "
              f"({layers} layers, width {width}), {n / 1e6:.2f}M elements, float32; {rounds} interleaved rounds")
        for layout, (times, counts, received) in results.items():
            print(f"\n{layout}: per step")
            for name, ts in times.items():
                print(f"  {name:40s} median {statistics.median(ts) * 1e3:9.1f} ms   collectives {counts[name]:3d}   "
                      f"received {received[name] / 2**20:7.2f} MiB per rank")
    dist.barrier()
    gc.collect()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    store = tempfile.mktemp(prefix="gradtx_bench_muon_")
    mp.spawn(worker, args=(store, args.width, args.layers, args.rounds), nprocs=WORLD)


if __name__ == "__main__":
    main()
