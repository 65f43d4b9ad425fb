"""Compile latency: the first call of a compiled clip + AdamW step on a 148-leaf GPT-2 tree.

1. gradtx: ``compile_step(chain(clip_by_global_norm(1.0), adamw(1e-3, weight_decay=0.1)))``.
2. torch: ``torch.compile`` of ``clip_grad_norm_(params, 1.0)`` then ``AdamW(...).step()``, the
   compiled optimizer step torch's tutorials show.

The tree has GPT-2 small's 148 leaves at width 64 (vocabulary 1000): a compile's cost grows with the
number of leaves Dynamo traces through, not with their size. Each candidate's first call runs in a
process of its own, interleaved (gradtx, torch, gradtx, torch, ...), every process on an Inductor
cache directory of its own that the previous process of the same candidate filled (the first round
of each is cold: Inductor's C++ compiles; later ones find the compiled code and skip it). Reported:
the first call's wall-clock time and Dynamo's ``bytecode_tracing`` (its walk of the Python code),
medians over the warm rounds.

Run: ``python benchmarks/compile_time.py [--rounds N | --quick]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

SHAPES = dict(n_layer=12, d_model=64, vocab=1000, n_ctx=128)


def first_call(which: str) -> dict[str, float]:
    """Builds the tree and the step, and times the step's first call (in this process)."""
    import torch

    from common import gpt_shapes

    gen = torch.Generator().manual_seed(0)
    shapes = gpt_shapes(**SHAPES)
    params = {k: torch.randn(s, generator=gen) for k, s in shapes.items()}
    grads = {k: torch.randn(s, generator=gen) for k, s in shapes.items()}
    if which == "gradtx":
        import gradtx as gtx

        tx = gtx.chain(gtx.clip_by_global_norm(1.0), gtx.adamw(1e-3, weight_decay=0.1))
        step, state = gtx.compile_step(tx), tx.init(params)
        start = time.perf_counter()
        step(grads, state, params)
    else:
        leaves = [torch.nn.Parameter(p.clone()) for p in params.values()]
        for leaf, grad in zip(leaves, grads.values()):
            leaf.grad = grad.clone()
        opt = torch.optim.AdamW(leaves, lr=1e-3, weight_decay=0.1)

        @torch.compile
        def torch_step() -> None:
            torch.nn.utils.clip_grad_norm_(leaves, 1.0)
            opt.step()

        start = time.perf_counter()
        torch_step()
    seconds = time.perf_counter() - start
    metrics = torch._dynamo.utils.compilation_time_metrics
    return {"first_call_s": seconds, "tracing_s": sum(metrics.get("bytecode_tracing", [0.0])), "leaves": len(shapes)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3, help="warm rounds after the cold one")
    parser.add_argument("--quick", action="store_true", help="one warm round")
    parser.add_argument("--child", choices=["gradtx", "torch"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(first_call(args.child)))
        return
    if args.quick:
        args.rounds = 1
    candidates = ("gradtx", "torch")
    caches = {name: tempfile.mkdtemp(prefix=f"compile_time_{name}_") for name in candidates}
    results: dict[str, list[dict[str, float]]] = {name: [] for name in candidates}
    for round_ in range(args.rounds + 1):
        for name in candidates:
            env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=caches[name])
            out = subprocess.run(
                [sys.executable, __file__, "--child", name], env=env, check=True, capture_output=True, text=True
            ).stdout
            result = json.loads(out.strip().splitlines()[-1])
            results[name].append(result)
            state = "cold" if round_ == 0 else "warm"
            print(f"round {round_} ({state}) {name:6s} first call {result['first_call_s']:6.1f} s, tracing {result['tracing_s']:5.1f} s")
    print(f"\nCompile latency, {results['gradtx'][0]['leaves']:.0f} leaves, median of {args.rounds} warm rounds:")
    median = {name: {key: statistics.median(r[key] for r in results[name][1:]) for key in ("first_call_s", "tracing_s")} for name in candidates}
    for name in candidates:
        cold = results[name][0]["first_call_s"]
        print(f"  {name:6s} first call {median[name]['first_call_s']:6.1f} s (cold {cold:.1f} s), tracing {median[name]['tracing_s']:5.1f} s")
    print(f"  ratio gradtx / torch, first call: {median['gradtx']['first_call_s'] / median['torch']['first_call_s']:.2f}")


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main()
