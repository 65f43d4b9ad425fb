"""Clip by global norm: gradtx against ``torch.nn.utils.clip_grad_norm_``, and against the memory floor.

Gradient trees with GPT-2's shapes (148 leaves, 124M float32) and the 41.7M tree of ``common.py``.
Candidates, timed in interleaved rounds (``common.interleaved``), as median ratios to torch:

- ``torch clip_grad_norm_``: on real ``nn.Parameter``s whose ``.grad`` holds the gradients (the baseline);
- ``gradtx donated``: ``clip_by_global_norm(1.0).update(grads, state, inplace=True)``, the path
  ``wrap`` and in-place training loops take (target: ratio <= 1.05);
- ``gradtx pure``: the same with nothing mutated: every call writes a new gradient tree;
- ``floor``: ``torch._foreach_norm`` (one read of every gradient) and ``torch._foreach_mul_`` by the
  clip coefficient (one read and one write), with nothing else around them.

A third table times the same 148 leaves with 4 elements each, and a fourth 10,000 leaves with 16
elements each: the fixed per-call cost (flattening, checks, grouping, one new tensor per leaf on the
pure path) that the large trees hide under memory traffic. There a fifth candidate,
``floor, pure``, is what any pure clip must do with torch's kernels: the same norm, then
``torch._foreach_mul`` into new tensors (no pytree, no checks).

The scale always runs (``clip_grad_norm_`` and gradtx multiply by the clamped coefficient rather
than branch on it), so every round does the same work whatever the norm: the in-place candidates
bring their gradients to norm ``max_norm`` on the first call and keep multiplying by ~1 after that.

Run from the repository root::

    python benchmarks/clip.py [--quick] [--rounds N]
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from typing import Callable

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(_ROOT, "src"), _ROOT]  # runs from a checkout

import torch  # noqa: E402

import gradtx as gtx  # noqa: E402
from benchmarks.common import GPT2_124M, GPT_41M, gpt_shapes, interleaved, make_tree, report  # noqa: E402

MAX_NORM = 1.0
EPS = 1e-6
BASELINE = "torch clip_grad_norm_"
TINY: dict = {}  # GPT-2's 148 leaf names with 4 elements each: the fixed cost of one call
MANY: dict = {}  # 10,000 leaves with 16 elements each: the per-leaf cost of one call
CONFIGS = {
    "GPT-2 124M": GPT2_124M,
    "GPT 41.7M (4 layers, 16k vocab)": GPT_41M,
    "GPT-2 leaves, 4 elements each": TINY,
    "10,000 leaves, 16 elements each": MANY,
}


def gradients(config: dict) -> dict[str, torch.Tensor]:
    if config is TINY:
        gen = torch.Generator().manual_seed(1)
        return {name: torch.randn(4, generator=gen) for name in gpt_shapes(**GPT2_124M)}
    if config is MANY:
        gen = torch.Generator().manual_seed(1)
        return {f"leaf{i}": torch.randn(16, generator=gen) for i in range(10_000)}
    return make_tree(config, seed=1)  # standard normal: a global norm in the thousands


def torch_clip(config: dict) -> Callable[[], object]:
    params = []
    for grad in gradients(config).values():
        # a parameter needs the gradient's shape, not its memory: a zero-stride view of one element
        param = torch.nn.Parameter(torch.zeros(1).expand(grad.shape))
        param.grad = grad
        params.append(param)
    return lambda: torch.nn.utils.clip_grad_norm_(params, MAX_NORM)


def gradtx_clip(config: dict, *, donated: bool) -> Callable[[], object]:
    tx = gtx.clip_by_global_norm(MAX_NORM)
    grads = gradients(config)
    box = {"state": tx.init(grads)}

    def donate() -> None:
        # the gradient buffers are donated: a training loop's backward would refill them
        _, box["state"] = tx.update(grads, box["state"], inplace=True)

    def pure() -> None:
        _, box["state"] = tx.update(grads, box["state"])

    return donate if donated else pure


def floor(config: dict, *, pure: bool = False) -> Callable[[], object]:
    grads = list(gradients(config).values())

    def run() -> object:
        norms = torch._foreach_norm(grads, 2.0)
        coef = torch.clamp(MAX_NORM / (torch.linalg.vector_norm(torch.stack(norms)) + EPS), max=1.0)
        if pure:
            return torch._foreach_mul(grads, coef)
        torch._foreach_mul_(grads, coef)
        return None

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 rounds")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--configs", nargs="+", choices=sorted(CONFIGS), help="run these trees only")
    args = parser.parse_args()
    rounds = args.rounds or (3 if args.quick else 15)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {rounds} rounds, max_norm {MAX_NORM}")
    for title, config in CONFIGS.items():
        if args.configs and title not in args.configs:
            continue
        shapes = [g.shape for g in gradients(config).values()]
        print(f"\n{title}: {len(shapes)} leaves, {sum(math.prod(s) for s in shapes) / 1e6:.1f}M float32")
        with torch.no_grad():
            candidates = {
                BASELINE: torch_clip(config),
                "gradtx donated (inplace=True)": gradtx_clip(config, donated=True),
                "gradtx pure": gradtx_clip(config, donated=False),
                "floor (_foreach_norm + _foreach_mul_)": floor(config),
            }
            if config is MANY:
                candidates["floor, pure (_foreach_norm + _foreach_mul)"] = floor(config, pure=True)
            if config is TINY:  # microseconds: many more rounds for a stable median
                times = interleaved(candidates, rounds=rounds * 20, warmup=20)
            elif config is MANY:
                times = interleaved(candidates, rounds=rounds * 4, warmup=3)
            else:
                times = interleaved(candidates, rounds=rounds, warmup=2)
        del candidates
        report(f"{title}: clip_by_global_norm({MAX_NORM}), one call", times, BASELINE)


if __name__ == "__main__":
    main()
