"""Step time against model size: clip by global norm + AdamW + apply, gradtx against torch (and optax, torchopt).

One training step's optimizer work on GPT-style gradient trees of growing size (``common.gpt_shapes``):
clip the gradients to global norm 1.0, take an AdamW step (lr 1e-3, weight decay 0.01), update the
parameters. Candidates:

- ``torch``: ``clip_grad_norm_`` then ``AdamW(fused=True).step()``, in place (the fastest torch loop on CPU);
- ``torch, default AdamW``: the same with ``AdamW``'s default implementation;
- ``gradtx wrap``: ``gtx.wrap(AdamW(fused=True), gtx.clip_by_global_norm(1.0)).step()``;
- ``gradtx chain, donated``: ``chain(clip_by_global_norm, adamw).update(..., inplace=True)`` + ``apply_updates(inplace=True)``;
- ``gradtx chain, pure``: the same chain with nothing mutated (new state and parameters every step);
- ``optax`` (jit, CPU) and ``torchopt`` (in place), when they import.

Medians over interleaved rounds (``common.interleaved``). Run from the repository root::

    python benchmarks/scaling.py [--quick] [--rounds N] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
from typing import Callable

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(_ROOT, "src"), _ROOT]  # runs from a checkout, also under another interpreter

import torch  # noqa: E402

import gradtx as gtx  # noqa: E402
from benchmarks.common import GPT_41M, gpt_shapes, interleaved, make_tree, n_elements, report  # noqa: E402

LR, WEIGHT_DECAY, MAX_NORM = 1e-3, 0.01, 1.0

SIZES: dict[str, dict] = {
    "GPT 1M": dict(n_layer=2, d_model=128, vocab=4096, n_ctx=256),
    "GPT 5M": dict(n_layer=4, d_model=256, vocab=8192, n_ctx=512),
    "GPT 21M": dict(n_layer=4, d_model=512, vocab=16384, n_ctx=1024),
    "GPT 41M": GPT_41M,
}
QUICK_SIZES = ("GPT 1M", "GPT 5M", "GPT 21M")


def _leaf_params(config: dict) -> list[torch.Tensor]:
    params = [p.requires_grad_() for p in make_tree(config, seed=0, scale=0.02).values()]
    for p, g in zip(params, make_tree(config, seed=1).values()):
        p.grad = g
    return params


def torch_step(config: dict, **adamw_kwargs) -> Callable[[], None]:
    params = _leaf_params(config)
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY, **adamw_kwargs)

    def step() -> None:
        torch.nn.utils.clip_grad_norm_(params, MAX_NORM)
        opt.step()

    return step


def gradtx_wrap_step(config: dict) -> Callable[[], None]:
    params = _leaf_params(config)
    opt = gtx.wrap(torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY, fused=True), gtx.clip_by_global_norm(MAX_NORM))
    return opt.step


def gradtx_chain_step(config: dict, *, donated: bool) -> Callable[[], None]:
    tx = gtx.chain(gtx.clip_by_global_norm(MAX_NORM), gtx.adamw(LR, weight_decay=WEIGHT_DECAY))
    box = {"params": make_tree(config, seed=0, scale=0.02)}
    grads = make_tree(config, seed=1)
    box["state"] = tx.init(box["params"])

    def pure() -> None:
        updates, box["state"] = tx.update(grads, box["state"], box["params"])
        box["params"] = gtx.apply_updates(box["params"], updates)

    def in_place() -> None:
        # The gradient buffers are donated and hold the updates afterwards; a training loop's
        # backward would refill them, so no copy is timed (as in benchmarks/adamw.py).
        updates, box["state"] = tx.update(grads, box["state"], box["params"], inplace=True)
        gtx.apply_updates(box["params"], updates, inplace=True)

    return in_place if donated else pure


def optax_step(config: dict) -> Callable[[], None]:
    import jax
    import optax

    tx = optax.chain(optax.clip_by_global_norm(MAX_NORM), optax.adamw(LR, weight_decay=WEIGHT_DECAY))
    box = {"params": {k: jax.numpy.asarray(v.numpy()) for k, v in make_tree(config, seed=0, scale=0.02).items()}}
    grads = {k: jax.numpy.asarray(v.numpy()) for k, v in make_tree(config, seed=1).items()}
    box["state"] = tx.init(box["params"])

    @jax.jit
    def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    def run() -> None:
        box["params"], box["state"] = step(box["params"], box["state"], grads)
        jax.block_until_ready(box["params"])

    return run


def torchopt_step(config: dict) -> Callable[[], None]:
    import torchopt

    tx = torchopt.chain(torchopt.clip_grad_norm(MAX_NORM), torchopt.adamw(LR, weight_decay=WEIGHT_DECAY))
    params, grads = make_tree(config, seed=0, scale=0.02), make_tree(config, seed=1)
    box = {"state": tx.init(params)}

    def run() -> None:
        updates, box["state"] = tx.update(grads, box["state"], params=params, inplace=True)
        torchopt.apply_updates(params, updates, inplace=True)

    return run


def candidates(config: dict) -> dict[str, Callable[[], None]]:
    out = {
        "torch (clip_grad_norm_ + AdamW fused)": torch_step(config, fused=True),
        "torch (clip_grad_norm_ + AdamW default)": torch_step(config),
        "gradtx wrap(AdamW fused, clip)": gradtx_wrap_step(config),
        "gradtx chain(clip, adamw), donated": gradtx_chain_step(config, donated=True),
        "gradtx chain(clip, adamw), pure": gradtx_chain_step(config, donated=False),
    }
    for name, factory in (("optax chain(clip, adamw), jit", optax_step), ("torchopt chain(clip, adamw), inplace", torchopt_step)):
        try:
            out[name] = factory(config)
        except ImportError:
            pass
    return out


BASELINE = "torch (clip_grad_norm_ + AdamW fused)"


def machine() -> dict[str, str]:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    info = {
        "cpu": cpu,
        "cores": str(os.cpu_count()),
        "threads": str(torch.get_num_threads()),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
    for module in ("jax", "optax", "torchopt"):
        try:
            info[module] = __import__(module).__version__
        except ImportError:
            pass
    return info


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the three smaller sizes, 3 rounds")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--json", default=None, help="write the medians here (for benchmarks/run_all.py)")
    args = parser.parse_args()
    rounds = args.rounds or (3 if args.quick else 9)
    names = QUICK_SIZES if args.quick else tuple(SIZES)
    info = machine()
    print(f"{info['cpu']}, {info['cores']} cores, {info['threads']} threads, torch {info['torch']}")
    results = []
    for name in names:
        config = SIZES[name]
        n_params = n_elements({k: torch.empty(s, device="meta") for k, s in gpt_shapes(**config).items()})
        with torch.no_grad():
            cands = candidates(config)
            times = interleaved(cands, rounds=rounds, warmup=2)
        ratios = report(f"{name} ({n_params / 1e6:.1f}M parameters): clip + AdamW + apply, one step", times, BASELINE)
        results.append(
            {
                "size": name,
                "n_params": n_params,
                "median_ms": {c: statistics.median(t) * 1e3 for c, t in times.items()},
                "ratio": ratios,
            }
        )
        del cands
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": info, "rounds": rounds, "baseline": BASELINE, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
