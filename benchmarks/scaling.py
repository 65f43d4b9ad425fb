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

Method. Each library runs in worker processes of its own (``scaling.py --worker LIB --size NAME``):
JAX's XLA thread pool keeps spinning after a jitted call and starves torch's kernels that run in the
same process (see ``benchmarks/external.py``), so optax and torchopt each get their own worker, and
torch and gradtx (which do not disturb each other) share one. A worker builds its candidates,
interleaves them (``common.interleaved``) for a few warm-up and ``K`` timed steps, and prints every
step's time as JSON. For each size the parent launches the workers interleaved at the process level
(torch, optax, torchopt, torch, optax, ...) for ``N`` rounds; a candidate's time in a round is the
median of its ``K`` steps, and the report gives the median over rounds and the median over rounds of
per-round ratios against torch's fused step. Run from the repository root::

    python benchmarks/scaling.py [--quick] [--rounds N] [--steps K] [--json PATH]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
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
from benchmarks.common import GPT_41M, gpt_shapes, interleaved, make_tree, n_elements, report, run_worker  # noqa: E402

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


def torch_candidates(config: dict) -> dict[str, Callable[[], None]]:
    return {
        "torch (clip_grad_norm_ + AdamW fused)": torch_step(config, fused=True),
        "torch (clip_grad_norm_ + AdamW default)": torch_step(config),
        "gradtx wrap(AdamW fused, clip)": gradtx_wrap_step(config),
        "gradtx chain(clip, adamw), donated": gradtx_chain_step(config, donated=True),
        "gradtx chain(clip, adamw), pure": gradtx_chain_step(config, donated=False),
    }


# Worker groups: candidates that share a process. (builder, the module it needs).
GROUPS: dict[str, tuple[Callable[[dict], dict[str, Callable[[], None]]], str]] = {
    "torch": (torch_candidates, "torch"),
    "optax": (lambda config: {"optax chain(clip, adamw), jit": optax_step(config)}, "optax"),
    "torchopt": (lambda config: {"torchopt chain(clip, adamw), inplace": torchopt_step(config)}, "torchopt"),
}
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
    for module in ("jax", "optax", "torchopt"):  # versions only: JAX is never imported next to torch's timings
        try:
            info[module] = importlib.metadata.version(module)
        except importlib.metadata.PackageNotFoundError:
            pass
    return info


def worker(group: str, size: str, steps: int, warmup: int) -> None:
    """Builds one group's candidates for one size, times them interleaved; prints ``{name: [seconds]}``."""
    with torch.no_grad():
        times = interleaved(GROUPS[group][0](SIZES[size]), rounds=steps, warmup=warmup)
    print(json.dumps(times))


def available_groups() -> list[str]:
    kept = []
    for group, (_, module) in GROUPS.items():
        if importlib.util.find_spec(module) is None:
            print(f"{group}: not installed here, left out")
        else:
            kept.append(group)
    return kept


def time_size(size: str, groups: list[str], *, rounds: int, steps: int, warmup: int) -> dict[str, list[float]]:
    """Per candidate, the median step time of each round; the groups' workers interleaved per round."""
    times: dict[str, list[float]] = {}
    for r in range(rounds):
        for group in groups:
            args = ["--worker", group, "--size", size, "--steps", str(steps), "--warmup", str(warmup)]
            answer = run_worker(__file__, args, label=f"{group} ({size})")
            for name, step_times in (answer or {}).items():
                times.setdefault(name, [float("nan")] * r).append(statistics.median(step_times))
        for name, ts in times.items():  # a worker that failed this round
            ts += [float("nan")] * (r + 1 - len(ts))
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the three smaller sizes, fewer rounds and steps")
    parser.add_argument("--rounds", type=int, default=None, help="process-level interleaved rounds (default 5, quick 3)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per worker (default 7, quick 5)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per worker")
    parser.add_argument("--json", default=None, help="write the medians here (for benchmarks/run_all.py)")
    parser.add_argument("--worker", choices=sorted(GROUPS), help=argparse.SUPPRESS)
    parser.add_argument("--size", choices=sorted(SIZES), help=argparse.SUPPRESS)
    args = parser.parse_args()
    rounds = args.rounds or (3 if args.quick else 5)
    steps = args.steps or (5 if args.quick else 7)
    if args.worker:
        worker(args.worker, args.size, steps, args.warmup)
        return
    names = QUICK_SIZES if args.quick else tuple(SIZES)
    info = machine()
    groups = available_groups()
    print(
        f"{info['cpu']}, {info['cores']} cores, {info['threads']} threads, torch {info['torch']}; "
        f"workers {', '.join(groups)}: {rounds} rounds, {args.warmup} warm-up + {steps} timed steps each"
    )
    results = []
    for name in names:
        config = SIZES[name]
        n_params = n_elements({k: torch.empty(s, device="meta") for k, s in gpt_shapes(**config).items()})
        times = time_size(name, groups, rounds=rounds, steps=steps, warmup=args.warmup)
        if BASELINE not in times:
            raise SystemExit(f"{name}: the torch worker failed")
        ratios = report(f"{name} ({n_params / 1e6:.1f}M parameters): clip + AdamW + apply, one step", times, BASELINE)
        results.append(
            {
                "size": name,
                "n_params": n_params,
                "median_ms": {c: statistics.median(t) * 1e3 for c, t in times.items()},
                "ratio": ratios,
            }
        )
    if args.json:
        method = f"separate processes per library, {rounds} interleaved rounds x {steps} steps, medians"
        with open(args.json, "w") as f:
            json.dump({"machine": info, "rounds": rounds, "steps": steps, "method": method, "baseline": BASELINE,
                       "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
