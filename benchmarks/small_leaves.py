"""Many small leaves: 100,000 two-element float32 leaves, where a step's cost is per tensor, not per element.

1. AdamW alone: gradtx's pure ``adamw(...).update`` + ``apply_updates`` (new state, new params
   every step) vs ``torch.optim.AdamW(foreach=True).step()`` in place.
2. Clip + AdamW: ``gtx.wrap(AdamW(foreach=True), clip_by_global_norm(1.0)).step()`` vs
   ``clip_grad_norm_`` followed by ``AdamW(foreach=True).step()``.

Each pair is timed alone, interleaved (A, B, A, B, ...), in a process of its own: timed in the
process that had just run the AdamW pair (400,000 tensors made and freed), ``wrap(clip)`` measured
1.15-1.21x torch, against 1.00-1.11x in fresh processes with the same code. Ratios are medians of
per-round ratios. With this many tensors a foreach kernel is a C++ loop over them, so what counts is
what runs once per leaf in Python (tree flattening, grouping, per-tensor calls).

Run: ``python benchmarks/small_leaves.py [--rounds N] [--leaves N] [--threads N] [--only adamw|clip]``.
"""

from __future__ import annotations

import argparse
import subprocess
import sys

import torch

import gradtx as gtx
from common import interleaved, report

LR, WEIGHT_DECAY, MAX_NORM = 1e-3, 0.01, 1.0


def small_tree(leaves: int, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {f"p{i}": torch.randn(2, generator=gen) for i in range(leaves)}


def with_grads(leaves: int) -> list[torch.Tensor]:
    """Parameters with gradients, as a model holds them after backward."""
    params = [p.requires_grad_() for p in small_tree(leaves, 0).values()]
    for p, g in zip(params, small_tree(leaves, 1).values()):
        p.grad = g
    return params


def bench_pure_adamw(leaves: int, rounds: int) -> dict[str, float]:
    torch_opt = torch.optim.AdamW(with_grads(leaves), lr=LR, weight_decay=WEIGHT_DECAY, foreach=True)
    tx = gtx.adamw(LR, weight_decay=WEIGHT_DECAY)
    params, grads = small_tree(leaves, 0), small_tree(leaves, 1)
    box = {"params": params, "state": tx.init(params)}

    def pure_step():
        updates, box["state"] = tx.update(grads, box["state"], box["params"])
        box["params"] = gtx.apply_updates(box["params"], updates)

    baseline = "torch AdamW(foreach).step"
    times = interleaved({baseline: torch_opt.step, "gradtx adamw, pure + apply_updates": pure_step}, rounds=rounds)
    return report(f"AdamW, {leaves} two-element leaves", times, baseline)


def bench_wrapped_clip(leaves: int, rounds: int) -> dict[str, float]:
    torch_params = with_grads(leaves)
    torch_opt = torch.optim.AdamW(torch_params, lr=LR, weight_decay=WEIGHT_DECAY, foreach=True)
    wrapped = gtx.wrap(
        torch.optim.AdamW(with_grads(leaves), lr=LR, weight_decay=WEIGHT_DECAY, foreach=True), gtx.clip_by_global_norm(MAX_NORM)
    )

    def torch_step():
        torch.nn.utils.clip_grad_norm_(torch_params, MAX_NORM)
        torch_opt.step()

    baseline = "torch clip_grad_norm_ + AdamW(foreach).step"
    times = interleaved({baseline: torch_step, "wrap(AdamW(foreach), clip).step": wrapped.step}, rounds=rounds)
    return report(f"clip + AdamW, {leaves} two-element leaves", times, baseline)


BENCHMARKS = {"adamw": bench_pure_adamw, "clip": bench_wrapped_clip}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--leaves", type=int, default=100_000)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: as is)")
    parser.add_argument("--only", choices=sorted(BENCHMARKS), help="run this benchmark in this process (default: each in a process of its own)")
    args = parser.parse_args()
    if args.only is None:
        for name in BENCHMARKS:
            options = ["--rounds", str(args.rounds), "--leaves", str(args.leaves), "--threads", str(args.threads)]
            subprocess.run([sys.executable, __file__, "--only", name, *options], check=True)
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"{args.leaves} leaves of 2 float32 elements, torch {torch.__version__}, {torch.get_num_threads()} threads")
    with torch.no_grad():
        BENCHMARKS[args.only](args.leaves, args.rounds)


if __name__ == "__main__":
    main()
