"""Quantized and low-precision AdamW state: bytes per parameter, peak memory and step time.

Not part of the package or its tests. torchao and bitsandbytes, the other libraries timed here, are
not gradtx dependencies: run with an interpreter that has them (those missing are left out, saying
so), from the repository root::

    python benchmarks/memory.py [--config gpt2-124m|small] [--threads 1 2] [--rounds N] [--steps K] [--quick]
    python benchmarks/memory.py --profile     # where a quantized step's time goes

Every candidate is one AdamW(1e-3, weight_decay 0.01) step on a GPT-2 tree of
``benchmarks/common.py`` (``GPT2_124M``: 148 float32 leaves, 124.4M elements; ``--config small``:
2 layers of width 256, 8k vocabulary, 3.7M elements, for a quick run), with random gradients.

Method. Each candidate runs in a process of its own (``memory.py --worker NAME``), which builds its
trees, takes warm-up steps (a compiled candidate compiles in them), then times ``K`` steps and
prints their wall-clock and process CPU times as JSON. The parent launches the workers interleaved
at the process level (A, B, C, ..., A, B, C, ...) for ``N`` rounds at each thread count (torch's
intra-op threads); a round's time is the median of its ``K`` steps; the report gives medians over
rounds and the median over rounds of per-round ratios, all from this one run.

Memory, from one more worker per candidate (after its warm-up steps):

- *state bytes per parameter*: the bytes of every tensor in the optimizer's state (codes, scales,
  step counts, gradtx's empty placeholders, torchao's and bitsandbytes' code books; a storage
  shared by several leaves counted once), over the tree's parameter count;
- *peak tensor MB above inputs*: the peak, during one step, of the CPU tensor memory allocated above
  what was live before it, from torch's profiler (as ``external.py`` measures it);
- *peak RSS MB above the step's start*: the process's resident-set high-water mark (``VmHWM``,
  reset through ``/proc/self/clear_refs`` just before the step) minus its resident set then: memory
  the step faulted in, whoever allocated it (glibc reuses resident pages it kept, so this can be
  below the tensor peak);
- *resident MB above params and grads*: the resident set after the warm-up steps minus the one
  before the optimizer was built: the state and whatever the step keeps between steps.

Candidates: gradtx pure steps, eager (``tx.update`` + ``apply_updates``) and ``gtx.compile_step``,
with fp32 state (``adamw``) and ``quantize_state(adamw, bits)`` for 8, 4, bfloat16 and float8
(e4m3fn); torch's fused in-place AdamW (reference); ``torchao.optim.AdamW8bit`` /
``AdamW4bit`` (in place, ``torch.compile`` on their first step); ``bitsandbytes.optim.AdamW8bit``
(in place, its CPU kernels). Every quantized candidate keeps tensors under 4096 elements in fp32
(gradtx's ``min_size``, bitsandbytes' ``min_8bit_size``, torchao's own threshold).
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

LR, WEIGHT_DECAY = 1e-3, 0.01
SMALL = dict(n_layer=2, d_model=256, vocab=8192, n_ctx=256)


def _config(name: str) -> dict:
    from benchmarks.common import GPT2_124M

    return {"gpt2-124m": GPT2_124M, "small": SMALL}[name]


# --------------------------------------------------------------------------- candidates (built in a worker)


class Step:
    """One candidate: ``step()`` runs one optimizer step; ``state()`` is its optimizer state now."""

    def __init__(self, step: Callable[[], None], state: Callable[[], object]) -> None:
        self.step, self.state = step, state


def _gradtx(storage, compiled: bool, clip: bool = False) -> Callable[[dict, dict], Step]:
    """AdamW with ``storage`` for its moments (``None``: float32), after a global-norm clip of 1.0
    where ``clip`` (the random gradients' norm is far above it: every step clips)."""

    def build(params: dict, grads: dict) -> Step:
        import torch

        import gradtx as gtx

        tx = gtx.adamw(LR, weight_decay=WEIGHT_DECAY)
        if storage is not None:
            tx = gtx.quantize_state(tx, bits=getattr(torch, storage) if isinstance(storage, str) else storage)
        if clip:
            tx = gtx.chain(gtx.clip_by_global_norm(1.0), tx)
        box = {"params": params, "state": tx.init(params)}
        if compiled:
            step_fn = gtx.compile_step(tx)

            def step() -> None:
                box["params"], box["state"] = step_fn(grads, box["state"], box["params"])

        else:

            def step() -> None:
                updates, box["state"] = tx.update(grads, box["state"], box["params"])
                box["params"] = gtx.apply_updates(box["params"], updates, donate_updates=True)

        return Step(step, lambda: box["state"])

    return build


def _in_place(make_optimizer: Callable[[list], object]) -> Callable[[dict, dict], Step]:
    def build(params: dict, grads: dict) -> Step:
        import torch

        leaves = [torch.nn.Parameter(p) for p in params.values()]
        for p, g in zip(leaves, grads.values()):
            p.grad = g
        opt = make_optimizer(leaves)
        return Step(opt.step, lambda: [opt.state[p] for p in leaves])

    return build


def _torch_fused(leaves):
    import torch

    return torch.optim.AdamW(leaves, lr=LR, weight_decay=WEIGHT_DECAY, fused=True)


def _torchao(bits: int):
    def make(leaves):
        from torchao.optim import AdamW4bit, AdamW8bit

        return (AdamW8bit if bits == 8 else AdamW4bit)(leaves, lr=LR, weight_decay=WEIGHT_DECAY)

    return make


def _bnb8(leaves):
    import bitsandbytes as bnb

    return bnb.optim.AdamW8bit(leaves, lr=LR, weight_decay=WEIGHT_DECAY)


CANDIDATES: dict[str, tuple[str, Callable[[dict, dict], Step]]] = {
    "gradtx-fp32": ("gradtx adamw, fp32 state, eager pure", _gradtx(None, False)),
    "gradtx-8bit": ("gradtx quantize_state(adamw, 8), eager pure", _gradtx(8, False)),
    "gradtx-4bit": ("gradtx quantize_state(adamw, 4), eager pure", _gradtx(4, False)),
    "gradtx-bf16": ("gradtx quantize_state(adamw, bfloat16), eager pure", _gradtx("bfloat16", False)),
    "gradtx-fp8": ("gradtx quantize_state(adamw, float8_e4m3fn), eager pure", _gradtx("float8_e4m3fn", False)),
    "gradtx-fp32-clip": ("gradtx chain(clip_by_global_norm, adamw), fp32 state, eager pure", _gradtx(None, False, clip=True)),
    "gradtx-8bit-clip": ("gradtx chain(clip_by_global_norm, quantize_state(adamw, 8)), eager pure", _gradtx(8, False, clip=True)),
    "gradtx-fp32-cs": ("gradtx compile_step(adamw), fp32 state", _gradtx(None, True)),
    "gradtx-8bit-cs": ("gradtx compile_step(quantize_state(adamw, 8))", _gradtx(8, True)),
    "gradtx-4bit-cs": ("gradtx compile_step(quantize_state(adamw, 4))", _gradtx(4, True)),
    "torch-fused": ("torch AdamW(fused=True), in place, fp32 state", _in_place(_torch_fused)),
    "torchao-8bit": ("torchao.optim.AdamW8bit, in place", _in_place(_torchao(8))),
    "torchao-4bit": ("torchao.optim.AdamW4bit, in place", _in_place(_torchao(4))),
    "bnb-8bit": ("bitsandbytes.optim.AdamW8bit, in place", _in_place(_bnb8)),
}
QUICK = ("gradtx-fp32", "gradtx-8bit", "gradtx-4bit", "gradtx-fp32-cs", "torch-fused", "torchao-8bit", "bnb-8bit")
BASELINE = "gradtx-fp32"
COMPILED = ("gradtx-fp32-cs", "gradtx-8bit-cs", "gradtx-4bit-cs", "torchao-8bit", "torchao-4bit")
NEEDS = {"torchao-8bit": "torchao", "torchao-4bit": "torchao", "bnb-8bit": "bitsandbytes"}
# (ours, theirs, target): the per-round ratios the report checks (lower is faster).
TARGETS = (
    ("gradtx-8bit", "gradtx-fp32", 1.3),
    ("gradtx-4bit", "gradtx-fp32", None),
    ("gradtx-8bit-clip", "gradtx-fp32-clip", None),
    ("gradtx-8bit-cs", "gradtx-fp32-cs", 1.3),
    ("gradtx-4bit-cs", "gradtx-fp32-cs", None),
    ("gradtx-8bit", "torchao-8bit", 1.0),
    ("gradtx-8bit-cs", "torchao-8bit", 1.0),
    ("gradtx-4bit", "torchao-4bit", 1.0),
    ("gradtx-4bit-cs", "torchao-4bit", 1.0),
    ("gradtx-8bit", "bnb-8bit", None),
    ("gradtx-8bit-cs", "bnb-8bit", None),
    ("torch-fused", "gradtx-fp32", None),
)


# --------------------------------------------------------------------------- measurements


def state_bytes(state: object) -> int:
    """Bytes of every tensor in ``state`` (tensor subclasses by their inner tensors; a storage
    several leaves share counted once)."""
    import torch

    seen: set[int] = set()
    total = 0

    def count(t: torch.Tensor) -> None:
        nonlocal total
        if type(t) is not torch.Tensor and hasattr(t, "__tensor_flatten__"):
            for name in t.__tensor_flatten__()[0]:
                count(getattr(t, name))
            return
        storage = t.untyped_storage()
        if storage.nbytes() and storage.data_ptr() in seen:
            return
        seen.add(storage.data_ptr())
        total += storage.nbytes() if t.numel() else 0

    for leaf in torch.utils._pytree.tree_leaves(state):
        if isinstance(leaf, torch.Tensor):
            count(leaf)
    return total


def _status() -> dict[str, int]:
    """``VmRSS`` and ``VmHWM`` of this process, in bytes."""
    found = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS", "VmHWM")):
                key, value = line.split(":")
                found[key] = int(value.split()[0]) * 1024
    return found


def _peak_rss_above_start(step: Callable[[], None]) -> int:
    """The resident-set high-water mark during ``step()`` above the resident set at its start."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current VmRSS
    start = _status()["VmRSS"]
    step()
    return _status()["VmHWM"] - start


def worker(name: str, config: str, steps: int, warmup: int, threads: int, memory: bool) -> None:
    """Builds one candidate, warms it up, then times ``steps`` steps (prints ``{"times", "cpu"}``) or,
    with ``memory``, measures one step's memory (prints bytes per parameter and peaks)."""
    import torch

    from benchmarks.common import make_tree, n_elements
    from benchmarks.external import _peak_bytes

    torch.set_num_threads(threads)
    params, grads = make_tree(_config(config), seed=0), make_tree(_config(config), seed=1, scale=1e-2)
    n = n_elements(params)
    with torch.no_grad():
        before = _status()["VmRSS"]
        candidate = CANDIDATES[name][1](params, grads)
        if name in COMPILED:  # compile_step reaches its steady state (recycled buffers) on its third call
            warmup = max(warmup, 2)
        for _ in range(warmup):
            candidate.step()
        if memory:
            answer = {
                "name": name,
                "bytes_per_param": state_bytes(candidate.state()) / n,
                "resident_mb": (_status()["VmRSS"] - before) / 1e6,
                "peak_tensor_mb": _peak_bytes(candidate.step) / 1e6,
                "peak_rss_mb": _peak_rss_above_start(candidate.step) / 1e6,
            }
            print(json.dumps(answer))
            return
        times, cpu = [], []
        for _ in range(steps):
            start, start_cpu = time.perf_counter(), time.process_time()
            candidate.step()
            times.append(time.perf_counter() - start)
            cpu.append(time.process_time() - start_cpu)
    print(json.dumps({"name": name, "times": times, "cpu": cpu}))


# --------------------------------------------------------------------------- where the time goes


def profile(config: str, threads: int, bits_list: list) -> None:
    """One quantized AdamW step taken apart: dequantize (every stored leaf), the inner AdamW update
    on the float32 moments, quantize (every new moment), and within quantize the block absmax
    and the code lookup; then the ops that take the time (the compiled loops for leaves of 2**16
    values and more, unless GRADTX_QUANTIZE_COMPILE=0)."""
    import torch
    from torch.profiler import ProfilerActivity, profile as torch_profile

    import gradtx as gtx
    from benchmarks.common import interleaved, make_tree
    from gradtx.quantization import blocks
    from gradtx.quantization.placement import WHOLE
    from gradtx.quantization.storage import decode, encode_all, storage_format

    def encode(moment, fmt):  # one whole leaf, read with the signed map
        return encode_all([moment], fmt, [WHOLE], None, [True])[0]

    torch.set_num_threads(threads)
    params, grads = make_tree(_config(config), seed=0), make_tree(_config(config), seed=1, scale=1e-2)
    inner = gtx.adamw(LR, weight_decay=WEIGHT_DECAY)
    inner_state = inner.init(params)
    _, inner_state = inner.update(grads, inner_state, params)
    moments = [t for t in (*inner_state[0].mu.values(), *inner_state[0].nu.values()) if t.numel() >= 4096]

    def timed(fn: Callable[[], object], repeat: int = 3) -> float:
        return statistics.median(interleaved({"fn": fn}, rounds=repeat, warmup=1)["fn"]) * 1e3

    print(f"\nwhere a quantized AdamW step's time goes ({config}, {threads} thread(s), ms, median of 3; "
          f"{len(moments)} stored moments, {sum(m.numel() for m in moments) / 1e6:.1f}M values)")
    inner_ms = timed(lambda: inner.update(grads, inner_state, params))
    print(f"  fp32 AdamW update (inner, pure):             {inner_ms:9.1f}")
    for bits in bits_list:
        fmt = storage_format(bits, None)
        stored = [encode(m, fmt) for m in moments]
        placeholders = [m.new_empty((*m.shape, 0)) for m in moments]
        row = {"encode (quantize)": timed(lambda: [encode(m, fmt) for m in moments]),
               "decode (dequantize)": timed(lambda: [decode(c, s, p, fmt) for (c, s), p in zip(stored, placeholders)])}
        if fmt.codec is not None:
            geos = [blocks.geometry(m.shape, fmt.block_size) for m in moments]
            scales = [s.reshape(-1, g.blocks) for (_, s), g in zip(stored, geos)]
            row["  of encode: block absmax"] = timed(lambda: [blocks.block_absmax(m, g) for m, g in zip(moments, geos)])
            row["  of encode: codes (divide + lookup)"] = timed(
                lambda: [blocks.quantize(m, s, g, fmt.codec) for m, s, g in zip(moments, scales, geos)]
            )
            if fmt.packed:
                codes = [blocks.quantize(m, s, g, fmt.codec) for m, s, g in zip(moments, scales, geos)]
                row["  of encode: pack two codes per byte"] = timed(lambda: [blocks.pack_nibbles(c) for c in codes])
        print(f"  storage {bits}:")
        for what, ms in row.items():
            print(f"    {what:42s} {ms:9.1f}   ({ms / inner_ms:5.1f}x the inner update)")
        with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
            [decode(c, s, p, fmt) for (c, s), p in zip(stored, placeholders)]
            [encode(m, fmt) for m in moments]
        print("    top ATen ops of one decode + encode of every moment (self CPU time):")
        for event in sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:8]:
            print(f"      {event.key:34s} {event.self_cpu_time_total / 1e3:9.1f} ms  ({event.count} calls)")


# --------------------------------------------------------------------------- parent


def run_worker(name: str, config: str, steps: int, warmup: int, threads: int, memory: bool = False) -> Optional[dict]:
    from benchmarks.common import run_worker as run_process

    args = ["--worker", name, "--config", config, "--steps", str(steps), "--warmup", str(warmup), "--threads", str(threads)]
    if memory:
        args.append("--memory")
    return run_process(__file__, args, label=f"{name} ({threads} thread(s))")


def available(names: list[str]) -> list[str]:
    """Drops the candidates whose library is missing or does not import here, saying why."""
    import importlib

    kept, failed = [], {}
    for name in names:
        module = NEEDS.get(name)
        if module is not None:
            if module not in failed:
                try:
                    importlib.import_module(module)
                    failed[module] = None
                except Exception as error:  # not installed, or its native parts do not load
                    failed[module] = f"{type(error).__name__}: {error}"
            if failed[module] is not None:
                print(f"{name}: did not run: `import {module}` failed here ({failed[module]})")
                continue
        kept.append(name)
    return kept


def _median_ratio(a: list[float], b: list[float]) -> float:
    pairs = [x / y for x, y in zip(a, b) if x == x and y == y]
    return statistics.median(pairs) if pairs else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", choices=sorted(CANDIDATES), help=argparse.SUPPRESS)
    parser.add_argument("--memory", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--config", choices=("gpt2-124m", "small"), help="the tree (default gpt2-124m; --quick: small)")
    parser.add_argument("--rounds", type=int, help="process-level interleaved rounds (default 3; --quick: 2)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per worker (default 3)")
    parser.add_argument("--warmup", type=int, default=2,
                        help="untimed steps per worker (default 2; at least 2 for the compiled candidates)")
    parser.add_argument("--threads", type=int, nargs="+", help="torch threads per worker (default: 1 2; --quick: 1)")
    parser.add_argument("--quick", action="store_true", help="the main candidates on the small tree, 2 rounds, 1 thread")
    parser.add_argument("--only", nargs="+", choices=sorted(CANDIDATES), help="run these candidates only")
    parser.add_argument("--no-memory", action="store_true", help="skip the memory workers")
    parser.add_argument("--no-timing", action="store_true", help="skip the timed rounds")
    parser.add_argument("--profile", action="store_true", help="only take a quantized step apart (in this process)")
    args = parser.parse_args()
    quick_defaults = {"config": "small", "rounds": 2, "threads": [1]}
    full_defaults = {"config": "gpt2-124m", "rounds": 3, "threads": [1, 2]}
    for key, value in (quick_defaults if args.quick else full_defaults).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.worker:
        worker(args.worker, args.config, args.steps, args.warmup, args.threads[0], args.memory)
        return
    if args.profile:
        import torch

        for threads in args.threads:
            profile(args.config, threads, [8, 4, torch.bfloat16, torch.float8_e4m3fn])
        return
    names = available(list(args.only or (QUICK if args.quick else CANDIDATES)))

    import torch

    from benchmarks.common import gpt_shapes, report

    n = sum(torch.Size(s).numel() for s in gpt_shapes(**_config(args.config)).values())
    print(
        f"{args.config} tree, {n / 1e6:.1f}M float32 parameters; AdamW({LR}, weight_decay {WEIGHT_DECAY}); torch "
        f"{torch.__version__}, {os.cpu_count()} CPUs; threads per worker {args.threads}; {args.rounds} rounds x "
        f"{len(names)} candidates, each in a process of its own, {args.warmup} warm-up + {args.steps} timed steps"
    )
    labels = {name: CANDIDATES[name][0] for name in names}
    for threads in args.threads if not args.no_timing else []:
        times: dict[str, list[float]] = {name: [] for name in names}
        cpu: dict[str, list[float]] = {name: [] for name in names}
        started = time.perf_counter()
        for r in range(args.rounds):
            for name in names:
                answer = run_worker(name, args.config, args.steps, args.warmup, threads)
                times[name].append(statistics.median(answer["times"]) if answer else float("nan"))
                cpu[name].append(statistics.median(answer["cpu"]) if answer else float("nan"))
            print(f"  {threads} thread(s): round {r + 1}/{args.rounds} done, {time.perf_counter() - started:.0f} s", flush=True)
        ran = [name for name in names if any(t == t for t in times[name])]
        for what, table in (("wall-clock", times), ("process CPU time", cpu)):
            if BASELINE in ran:
                report(f"one AdamW step, {threads} thread(s), {what}", {labels[k]: table[k] for k in ran}, labels[BASELINE])
        print(f"\nratios, {threads} thread(s), median over rounds of per-round ratios (wall-clock; CPU time in brackets):")
        for ours, theirs, target in TARGETS:
            if ours in ran and theirs in ran:
                wall, cpu_ratio = _median_ratio(times[ours], times[theirs]), _median_ratio(cpu[ours], cpu[theirs])
                goal = f"   target <= {target}: {'met' if wall <= target else 'not met'}" if target else ""
                print(f"  {ours} / {theirs}: {wall:.3f} [{cpu_ratio:.3f}]{goal}")
    if not args.no_memory:
        print(f"\nmemory of one step ({args.config}; after {args.warmup} warm-up steps (compiled: at least 2), 1 thread; MB = 1e6 bytes):")
        print(f"  {'candidate':16s} {'state B/param':>13s} {'resident above params+grads':>28s} "
              f"{'peak tensor MB above inputs':>28s} {'peak RSS MB above start':>24s}")
        for name in names:
            answer = run_worker(name, args.config, 1, args.warmup, 1, memory=True)
            if answer is None:
                print(f"  {name:16s} failed")
                continue
            print(f"  {name:16s} {answer['bytes_per_param']:13.3f} {answer['resident_mb']:28.0f} "
                  f"{answer['peak_tensor_mb']:28.0f} {answer['peak_rss_mb']:24.0f}")


if __name__ == "__main__":
    main()
