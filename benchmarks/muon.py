"""Sharded Muon: gradtx's exact orthogonalization of sharded matrices against naive gathering and
against pytorch-optimizer's DistributedMuon and HeavyBall's Muon.

Method. World size 4 on CPU (gloo, one thread per rank), the block matrices of a GPT-style model
(``common.gpt_shapes``, default 4 layers of width 192; embeddings and vectors would take AdamW in
``muon`` and are elementwise, so they are left out), float32, the same matrices for every
candidate (as gradients; the peers also get random weights). Two layouts: tensor parallel over 4
ranks (attention qkv and MLP fc column-parallel, split along dim 0; both projections row-parallel,
along dim 1) as plain tensors with a ``ShardingSpec``, and FSDP2's ``Shard(0)`` as DTensors.
Candidates:

- ``owner``: ``scale_by_muon(spec=..., strategy="owner")``: one rank per matrix (balanced), two
  all-to-alls per step, each rank gets its slice of the result;
- ``gather``: ``strategy="gather"``: one all-gather per step for the whole tree, every rank
  orthogonalizes every matrix, keeps its slice;
- ``naive``: the same optimizer gathered naively: each leaf gathered on its own (``all_gather`` per
  leaf, ``full_tensor()`` for a DTensor) on every rank, the dense ``scale_by_muon`` on the whole
  tree, this rank's slice kept. These three give the same numbers (checked every run).
- pytorch-optimizer ``DistributedMuon`` in its setting, replicated (DDP) parameters and gradients:
  each rank runs momentum, Newton-Schulz and the parameter update for every ``world``-th matrix of
  a group and all-gathers the updated parameters (whole matrices). gloo's all_gather needs equal
  shapes within each run of ``world`` tensors, so the matrices go in one group per shape (4 layers:
  one matrix of each shape per rank, balanced). The same in both layouts (timed in each).
- HeavyBall ``Muon``, three ways. Under TP it runs on the full, replicated matrices on every rank
  (it cannot take column-/row-split plain pieces: no communication, all the work on every rank).
  Under FSDP2 (a) on the DTensors: for each matrix it ``full_tensor()``s the update, the gradient
  and the parameter on every rank, orthogonalizes the whole matrix on every rank and writes its
  shard back; (b) its owner path, the one it takes under FSDP1 (``use_orig_params``): FSDP1 itself
  fails on CPU ("RuntimeError: FSDP needs a non-CPU accelerator device, but no accelerator device
  is detected."), so each rank holds its ``Shard(0)`` rows flattened (a contiguous piece, as FSDP1's)
  and ``orig_shapes`` carries what FSDP1's auto-detection would (shape, offset, owner by HeavyBall's
  own greedy balance); the owner receives the pieces of parameter and gradient by all-to-all,
  steps the whole matrix and sends the pieces back.

Equal work: every candidate runs 5 Newton-Schulz steps in float32 (3 matmuls each, on the wide
side). Both peers default to bfloat16 iterations; here pytorch-optimizer's
``zero_power_via_newton_schulz_5`` is given ``dtype=float32`` and HeavyBall's stochastic rounding
to bfloat16 is bypassed, and HeavyBall runs eagerly (``heavyball.utils.compile_mode = None``; its
default compiles with inductor, which took minutes per process here). DistributedMuon uses Jordan's
coefficients ``(3.4445, -4.7750, 2.0315)``, optax's default; HeavyBall's are fixed per-step rows
(``HEAVYBALL_ROWS``, modded-nanogpt's). What they compute is checked on a fresh optimizer's first
step: the step divided by ``lr * sqrt(max(1, rows/cols))`` (their shape scaling) against the dense
``scale_by_muon`` (for HeavyBall with its rows as ``ns_coeffs``), printed as max relative error.
The peers' steps include their momentum and parameter update (elementwise, small next to
Newton-Schulz); the gradients are re-attached before each step (HeavyBall drops them).

Reported, per step: median time over interleaved rounds (every candidate once per round, each step
ending in a barrier, so it is the slowest rank's time), the median over rounds of
``time(owner) / time(candidate)`` (below 1: owner is faster), the collectives (gloo events of a
``torch.profiler`` trace) and the bytes each rank receives from others (counted from the buffers
of ``torch.distributed``'s collectives, patched for one step, and of the functional collectives
DTensor runs, seen by a dispatch mode). Last, in one process, the per-rank kernel: gradtx's dense
``scale_by_muon`` against pytorch-optimizer's float32 Newton-Schulz on one layer's matrices.

Run:  python benchmarks/muon.py            (4 layers of width 192, 13 rounds; about 4 minutes on 2 cores)
      python benchmarks/muon.py --quick    (width 64, 3 rounds: about a minute)
"""

from __future__ import annotations

import argparse
import datetime
import gc
import math
import os
import statistics
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))
from common import gpt_shapes, interleaved, median_ratio  # noqa: E402

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
        # pytorch-optimizer's DistributedMuon binds ``all_gather`` at import
        from pytorch_optimizer.optimizer.muon import distributed_muon

        self._module_saved = distributed_muon.all_gather
        distributed_muon.all_gather = dist.all_gather
        # DTensor's full_tensor()/redistribute run functional collectives: seen by a dispatch mode
        self._mode = _FunctionalCollectives(self)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        self._mode.__exit__(*exc)
        from pytorch_optimizer.optimizer.muon import distributed_muon

        distributed_muon.all_gather = self._module_saved
        for name, original in self._saved.items():
            setattr(dist, name, original)


class _FunctionalCollectives(TorchDispatchMode):
    """Adds to ``counter.bytes`` what the functional collectives under DTensor receive."""

    def __init__(self, counter):
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func)
        if name.startswith("_c10d_functional.all_gather_into_tensor"):
            inputs = args[0] if isinstance(args[0], (list, tuple)) else [args[0]]
            self.counter.bytes += sum(t.numel() * t.element_size() for t in inputs) * (int(args[1]) - 1)
        elif name.startswith("_c10d_functional.all_to_all_single"):
            inp, out_splits = args[0], args[1]
            row = inp.numel() // max(inp.shape[0], 1) if inp.dim() else 1
            if out_splits:
                received = (sum(out_splits) - out_splits[dist.get_rank()]) * row
            else:
                received = inp.numel() * (dist.get_world_size() - 1) // dist.get_world_size()
            self.counter.bytes += received * inp.element_size()
        elif name.startswith("_c10d_functional.") and any(c in name for c in ("reduce", "broadcast", "all_to_all", "gather")):
            raise NotImplementedError(f"bytes of {name} are not counted")
        return func(*args, **kwargs)


def count_collectives(fn) -> int:
    from torch.profiler import ProfilerActivity, profile

    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return sum(1 for event in prof.events() if event.name.startswith("gloo:"))


def matrices(width: int, layers: int) -> dict[str, tuple[int, ...]]:
    shapes = gpt_shapes(n_layer=layers, d_model=width, vocab=8, n_ctx=8)
    return {k: s for k, s in shapes.items() if k.startswith("h.") and len(s) == 2}


# HeavyBall's Newton-Schulz rows (five steps, one row each); gradtx takes them as ``ns_coeffs`` for the
# check of what HeavyBall computes
HEAVYBALL_ROWS = ((4.0848, -6.8946, 2.9270), (3.9505, -6.3029, 2.6377), (3.7418, -5.5913, 2.3037),
                  (2.8769, -3.1427, 1.2046), (2.8366, -3.0525, 1.2012))
LR = 0.02


def peers_in_float32() -> None:
    """Equal work: both peers iterate Newton-Schulz in bfloat16 by default (pytorch-optimizer casts to
    bfloat16, HeavyBall rounds stochastically to it); here they run in float32, as gradtx does, and
    HeavyBall runs eagerly (its default compiles with inductor, minutes per process on this machine)."""
    import functools

    import heavyball.utils as hb
    import pytorch_optimizer.optimizer.muon.base as pto_base

    pto_base.zero_power_via_newton_schulz_5 = functools.partial(pto_base.zero_power_via_newton_schulz_5, dtype=torch.float32)
    hb.compile_mode = None
    rounding = hb.stochastic_round_

    def keep_float32(ref, source=None):
        return ref if source is None else rounding(ref, source)

    hb.stochastic_round_ = keep_float32


def with_grads(values: dict, grads: dict) -> dict:
    params = {k: torch.nn.Parameter(v.clone() if not hasattr(v, "to_local") else v) for k, v in values.items()}
    for k, p in params.items():
        p.grad = grads[k].clone() if not hasattr(grads[k], "to_local") else grads[k]
    return params


def distributed_muon(params: dict):
    """DistributedMuon in its setting: replicated parameters and gradients (DDP). It all-gathers the
    parameters of each group in runs of ``world`` tensors, which gloo requires to have one shape, so
    the matrices go into one group per shape."""
    from pytorch_optimizer import DistributedMuon

    by_shape: dict = {}
    for p in params.values():
        by_shape.setdefault(tuple(p.shape), []).append(p)
    groups = [{"params": ps, "use_muon": True} for ps in by_shape.values()]
    return DistributedMuon(groups, lr=LR, momentum=0.95, nesterov=True, ns_steps=5, ns_coeffs="original")


def heavyball_muon(params: dict):
    import heavyball

    return heavyball.Muon(list(params.values()), lr=LR, betas=(0.95, 0.99), nesterov=True)


def heavyball_owner(params: dict, shapes: dict, rank: int):
    """HeavyBall's own sharded path, the one it takes under FSDP1 (``use_orig_params``): each param is
    this rank's contiguous piece of the flattened matrix; ``orig_shapes`` gives the matrix shape, the
    piece's offset and an owner per matrix (HeavyBall's greedy balance by bytes); the owner receives
    the pieces of parameter and gradient by all-to-all, steps the whole matrix and sends the pieces
    back. FSDP1 itself does not run on CPU, so the map is built here as its auto-detection would."""
    import heavyball
    import heavyball.chainable as hc

    entries = [(p, shapes[k], math.prod(shapes[k]), None) for k, p in params.items()]
    owners = hc._assign_fsdp_owners(entries, torch.ones(len(entries), WORLD), WORLD)
    infos = {}
    for i, (k, p) in enumerate(params.items()):
        rows, cols = shapes[k]
        start = sum(c.shape[0] for c in torch.chunk(torch.empty(rows, 0), WORLD, 0)[:rank]) * cols
        infos[id(p)] = hc._ShapeInfo(tuple(shapes[k]), start, rows * cols, owner=owners[i], param_idx=i)
    return heavyball.Muon(list(params.values()), lr=LR, betas=(0.95, 0.99), nesterov=True, orig_shapes=infos)


def step_direction(make, values: dict, grads: dict, shapes: dict | None = None) -> dict:
    """``-(p_after - p_before) / (lr * sqrt(max(1, rows / cols)))`` of a fresh optimizer's first step:
    the orthogonalized direction, comparable to ``scale_by_muon``'s update."""
    params = with_grads(values, grads)
    before = {k: (p.to_local() if hasattr(p, "to_local") else p).detach().clone() for k, p in params.items()}
    make(params).step()
    out = {}
    for k, p in params.items():
        after = (p.to_local() if hasattr(p, "to_local") else p).detach()
        rows, cols = shapes[k] if shapes else (p.shape[0], p.numel() // p.shape[0])
        out[k] = (before[k] - after) / (LR * max(1.0, rows / cols) ** 0.5)
    return out


def max_relative_error(got: dict, want: dict) -> float:
    return max(float((got[k] - want[k]).abs().max() / want[k].abs().max()) for k in want)


def worker(rank: int, store_path: str, width: int, layers: int, rounds: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", store=dist.FileStore(store_path, WORLD), rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=600)
    )
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard as DShard
    from torch.distributed.tensor import distribute_tensor

    peers_in_float32()
    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("tp",))
    shapes = matrices(width, layers)
    gen = torch.Generator().manual_seed(0)
    dense = {k: torch.randn(s, generator=gen) for k, s in shapes.items()}
    weights = {k: torch.randn(s, generator=gen) for k, s in shapes.items()}
    dense_tx = scale_by_muon()
    dense_state = dense_tx.init(dense)

    def tp_dim(name):
        return 0 if name.endswith(COLUMN) else 1

    tp = {k: torch.tensor_split(x, WORLD, tp_dim(k))[rank].clone() for k, x in dense.items()}
    spec = ShardingSpec(mesh, lambda path, t: Shard("tp", dim=tp_dim(path)))
    fsdp = {k: distribute_tensor(x, mesh, [DShard(0)]) for k, x in dense.items()}
    fsdp_weights = {k: distribute_tensor(x, mesh, [DShard(0)]) for k, x in weights.items()}

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

    flat_weights = {k: torch.chunk(x, WORLD, 0)[rank].reshape(-1).clone() for k, x in weights.items()}
    flat_grads = {k: torch.chunk(x, WORLD, 0)[rank].reshape(-1).clone() for k, x in dense.items()}

    def hb_owner_make(params):
        return heavyball_owner(params, shapes, rank)

    # what the peers compute, from their first step on the same matrices (as gradients)
    dense_ref = dense_tx.update(dense, dense_state)[0]
    hb_tx = scale_by_muon(ns_coeffs=HEAVYBALL_ROWS)
    hb_ref = hb_tx.update(dense, hb_tx.init(dense))[0]
    checks = {
        "DistributedMuon vs dense Muon": max_relative_error(step_direction(distributed_muon, weights, dense), dense_ref),
        "HeavyBall (full) vs dense Muon with its rows": max_relative_error(step_direction(heavyball_muon, weights, dense), hb_ref),
        "HeavyBall (DTensor) vs dense Muon with its rows": max_relative_error(
            step_direction(heavyball_muon, fsdp_weights, fsdp),
            {k: torch.chunk(v, WORLD, 0)[rank] for k, v in hb_ref.items()}),
        "HeavyBall (owner path) vs dense Muon with its rows": max_relative_error(
            step_direction(hb_owner_make, flat_weights, flat_grads, shapes),
            {k: torch.chunk(v, WORLD, 0)[rank].reshape(-1) for k, v in hb_ref.items()}),
    }

    # the peers' long-lived optimizers (their steps go on from step to step, as in training)
    def stepper(make, values, grads):
        """A step on the same gradients each time (HeavyBall drops ``p.grad`` after a step); the
        peers write into their gradients, so they get copies."""
        grads = {k: g.clone() for k, g in grads.items()}
        params = with_grads(values, grads)
        opt = make(params)

        def step():
            for k, p in params.items():
                p.grad = grads[k]
            opt.step()

        return step

    dm = stepper(distributed_muon, weights, dense)
    hb_full = stepper(heavyball_muon, weights, dense)
    hb_fsdp = stepper(heavyball_muon, fsdp_weights, fsdp)
    hb_owner = stepper(hb_owner_make, flat_weights, flat_grads)

    results = {}
    layouts = (("TP (plain + spec)", tp, naive_tp, spec, {"HeavyBall Muon (full params, every rank)": hb_full}),
               ("FSDP2 Shard(0) (DTensor)", fsdp, naive_fsdp, None, {"HeavyBall Muon (FSDP2 DTensors)": hb_fsdp,
                                                                    "HeavyBall Muon (owner path, flat row pieces)": hb_owner}))
    for layout, tree, naive, tx_spec, hb_candidates in layouts:
        gather_tx = scale_by_muon(spec=tx_spec, strategy="gather")
        owner_tx = scale_by_muon(spec=tx_spec, strategy="owner")
        gather_state, owner_state = gather_tx.init(tree), owner_tx.init(tree)
        candidates = {
            "gradtx strategy='owner'": lambda tx=owner_tx, t=tree, st=owner_state: tx.update(t, st)[0],
            "gradtx strategy='gather'": lambda tx=gather_tx, t=tree, st=gather_state: tx.update(t, st)[0],
            "naive (full gather each leaf, dense Muon)": naive,
        }
        # the same numbers
        reference = naive()
        for name, fn in candidates.items():
            got = fn()
            for k in shapes:
                value = got[k].to_local() if hasattr(got[k], "to_local") else got[k]
                torch.testing.assert_close(value, reference[k], rtol=1e-5, atol=1e-6, msg=f"{name} {k}")
        candidates["pytorch-optimizer DistributedMuon (replicated)"] = dm
        candidates.update(hb_candidates)
        counts, received = {}, {}
        for name, fn in candidates.items():
            counts[name] = count_collectives(fn)
            with Received() as r:
                fn()
            received[name] = r.bytes
        stepped = {name: (lambda fn=fn: (fn(), dist.barrier())) for name, fn in candidates.items()}
        times = interleaved(stepped, rounds=rounds, warmup=1)
        results[layout] = (times, counts, received)

    all_checks = [None] * WORLD
    dist.all_gather_object(all_checks, checks)
    if rank == 0:
        n = sum(x.numel() for x in dense.values())
        print(f"world {WORLD} (gloo, CPU, 1 thread per rank), {len(dense)} matrices of a GPT-style model "
              f"({layers} layers, width {width}), {n / 1e6:.2f}M elements ({n * 4 / 2**20:.2f} MiB), float32; "
              f"{rounds} interleaved rounds; load average before: {os.getloadavg()[0]:.1f}")
        print("first-step direction against gradtx's dense scale_by_muon (max relative error over leaves and ranks):")
        for name in checks:
            print(f"  {name:50s} {max(c[name] for c in all_checks):.1e}")
        owner = "gradtx strategy='owner'"
        for layout, (times, counts, received) in results.items():
            print(f"\n{layout}: per step")
            print(f"  {'candidate':48s} {'median ms':>10s} {'owner/this':>10s} {'collectives':>11s} {'MiB recv/rank':>13s}")
            for name, ts in times.items():
                print(f"  {name:48s} {statistics.median(ts) * 1e3:10.1f} {median_ratio(times, owner, name):10.2f} "
                      f"{counts[name]:11d} {received[name] / 2**20:13.2f}")
    dist.barrier()
    gc.collect()
    dist.destroy_process_group()


def kernels(width: int, rounds: int) -> None:
    """One process, one thread: gradtx's dense ``scale_by_muon`` on one layer's matrices against
    pytorch-optimizer's float32 Newton-Schulz on the same (the per-rank work of both)."""
    from pytorch_optimizer.optimizer.utils.matrix import zero_power_via_newton_schulz_5

    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    layer = {k: torch.randn(s, generator=gen) for k, s in matrices(width, 1).items()}
    tx = scale_by_muon()
    state = tx.init(layer)
    times = interleaved({
        "gradtx scale_by_muon (dense)": lambda: tx.update(layer, state),
        "pytorch-optimizer Newton-Schulz (float32)": lambda: [
            zero_power_via_newton_schulz_5(x, 5, dtype=torch.float32) for x in layer.values()],
    }, rounds=3 * rounds, warmup=2)
    print(f"\nper-rank kernel, one process and thread, one layer's {len(layer)} matrices:")
    for name, ts in times.items():
        print(f"  {name:48s} {statistics.median(ts) * 1e3:10.1f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=192)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=13)
    parser.add_argument("--quick", action="store_true", help="width 64, 3 rounds (a smoke run)")
    args = parser.parse_args()
    if args.quick:
        args.width, args.rounds = 64, 3
    store = tempfile.mktemp(prefix="gradtx_bench_muon_")
    mp.spawn(worker, args=(store, args.width, args.layers, args.rounds), nprocs=WORLD)
    kernels(args.width, args.rounds)
    print(f"load average after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
