"""Shared pieces of the benchmarks: GPT-style gradient trees and interleaved A/B timing.

This machine is small and noisy, so candidates are timed in interleaved rounds (A, B, A, B, ...)
and compared by the median of their per-round ratios.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from typing import Callable, Iterable, Mapping, Optional

import torch


def gpt_shapes(n_layer: int, d_model: int, vocab: int, n_ctx: int) -> dict[str, tuple[int, ...]]:
    """Parameter shapes of a GPT-2 style model (torch ``Linear`` layout: ``(out, in)``)."""
    shapes: dict[str, tuple[int, ...]] = {"wte.weight": (vocab, d_model), "wpe.weight": (n_ctx, d_model)}
    for i in range(n_layer):
        p = f"h.{i}."
        shapes.update(
            {
                p + "ln_1.weight": (d_model,),
                p + "ln_1.bias": (d_model,),
                p + "attn.c_attn.weight": (3 * d_model, d_model),
                p + "attn.c_attn.bias": (3 * d_model,),
                p + "attn.c_proj.weight": (d_model, d_model),
                p + "attn.c_proj.bias": (d_model,),
                p + "ln_2.weight": (d_model,),
                p + "ln_2.bias": (d_model,),
                p + "mlp.c_fc.weight": (4 * d_model, d_model),
                p + "mlp.c_fc.bias": (4 * d_model,),
                p + "mlp.c_proj.weight": (d_model, 4 * d_model),
                p + "mlp.c_proj.bias": (d_model,),
            }
        )
    shapes.update({"ln_f.weight": (d_model,), "ln_f.bias": (d_model,)})
    return shapes


# GPT-2 small: 148 leaves, 124M parameters.
GPT2_124M = dict(n_layer=12, d_model=768, vocab=50257, n_ctx=1024)
# A 41.7M-parameter model: 4 layers of width 768, 16k vocabulary (52 leaves).
GPT_41M = dict(n_layer=4, d_model=768, vocab=16384, n_ctx=1024)


def make_tree(config: dict, *, dtype: torch.dtype = torch.float32, seed: int = 0, scale: float = 1.0) -> dict[str, torch.Tensor]:
    """A dict of random tensors with the shapes of ``config`` (a gradient or a parameter tree)."""
    gen = torch.Generator().manual_seed(seed)
    return {k: torch.randn(s, generator=gen, dtype=dtype) * scale for k, s in gpt_shapes(**config).items()}


def n_elements(tree: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() for t in tree.values())


def interleaved(
    candidates: dict[str, Callable[[], object]], *, rounds: int = 15, warmup: int = 2, before: Optional[Callable[[], object]] = None
) -> dict[str, list[float]]:
    """Times each candidate once per round, ``rounds`` times; returns seconds per call.

    Every other round runs the candidates in reverse order (A B, B A, A B, ...), so that something
    that comes back every other call (a full garbage collection once per round, say) falls on
    each candidate in turn instead of always on the same one. ``before`` runs, untimed, before
    each timed call (a barrier, so that every rank of a world starts a call together)."""
    for _ in range(warmup):
        for fn in candidates.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in candidates}
    order = list(candidates.items())
    for round_index in range(rounds):
        for name, fn in order if round_index % 2 == 0 else reversed(order):
            if before is not None:
                before()
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return times


def median_ratio(times: dict[str, list[float]], numerator: str, denominator: str) -> float:
    """Median over rounds of ``numerator / denominator`` (robust to a slow round hitting both)."""
    return statistics.median(a / b for a, b in zip(times[numerator], times[denominator]))


def report(title: str, times: dict[str, list[float]], baseline: str) -> dict[str, float]:
    """Prints medians (ms) and median ratios against ``baseline``; returns the ratios."""
    print(f"\n{title}")
    ratios = {}
    for name, ts in times.items():
        ratio = median_ratio(times, name, baseline)
        ratios[name] = ratio
        print(f"  {name:45s} median {statistics.median(ts) * 1e3:9.2f} ms   ratio vs {baseline}: {ratio:5.3f}")
    return ratios


def run_worker(
    script: str, args: list[str], *, label: str, env: Optional[Mapping[str, str]] = None, unset: Iterable[str] = ()
) -> Optional[dict]:
    """Runs ``script`` with ``args`` in a fresh process of this interpreter; returns the JSON object on
    the last line it prints, or None (after saying why) if it failed.

    Benchmarks time libraries that must not share a process (JAX's XLA thread pool starves torch's
    kernels that run next to it) with one worker process per candidate. ``env`` is added to the
    worker's environment after the variables named in ``unset`` are removed from it.
    """
    worker_env = {k: v for k, v in os.environ.items() if k not in set(unset)}
    worker_env.update(env or {})
    done = subprocess.run([sys.executable, os.path.abspath(script), *args], env=worker_env, capture_output=True, text=True)
    if done.returncode != 0:
        last = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else ""
        print(f"  {label} failed: {last}")
        return None
    return json.loads(done.stdout.strip().splitlines()[-1])
