"""Low-memory training: 8-bit and 4-bit AdamW state, and bfloat16 params, against fp32 AdamW.

A small GPT (token and position embeddings, two pre-norm transformer blocks, an lm head) learns a
synthetic language (a random first token, then ``next = (5 * token + 3) % VOCAB``) with AdamW in
every variant, from the same initial weights and the same batches:

- ``fp32``: float32 params and moments (``gtx.adamw``), the reference: 8 bytes of state per param;
- ``8-bit`` / ``4-bit``: ``gtx.quantize_state(adamw, bits)``, every matrix's moments stored
  block-wise (``min_size`` 1024, so the weights are quantized; norms and biases stay float32):
  about 2 / 1 bytes per param;
- ``bf16 plain``: bfloat16 params, each step's ``p + u`` rounded to nearest; updates below half a
  bfloat16 spacing of their param are lost, and training stalls at a small learning rate;
- ``bf16 + SR`` / ``bf16 + Kahan``: the same, ending the chain in ``gtx.stochastic_rounding`` (no
  state) or ``gtx.kahan_summation`` (a float32 compensation per param);
- ``bf16 + master``: ``gtx.master_weights(adamw)``: float32 master copies, which AdamW steps.

The bfloat16 runs compute forward and backward in bfloat16 and give the optimizer float32
gradients; their AdamW keeps its first moment in float32 (``mu_dtype``) and its second in the
params' dtype (``master_weights`` keeps both in float32). Every variant is scored by the same
float32 evaluation: the loss on 256 held-out sequences, with the params cast to float32. The fp32
run is repeated with other seeds (other initial weights and batches) to measure the seed-to-seed
spread, which says how far apart two runs of the same method land (``--all-seeds``: every variant
at every seed).

Run:  python examples/low_memory.py [--steps N] [--seeds S] [--all-seeds] [--plot low_memory.png]
      GRADTX_EXAMPLES_QUICK=1 python examples/low_memory.py   (a few steps, one seed, no plot)
The plot needs matplotlib (the ``examples`` extra); without it the tables are printed only.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import tempfile
import time
from typing import Callable

import torch
from torch import nn

import _tiny_gpt as tiny_gpt  # the model and language (examples/_tiny_gpt.py)
import gradtx as gtx

QUICK = os.environ.get("GRADTX_EXAMPLES_QUICK") == "1"
VOCAB, CONTEXT, WIDTH, HEADS = 64, 16, 64, 4
BATCH, EVAL_BATCH = 32, 256
LEARNING_RATE, WEIGHT_DECAY = 1e-3, 0.01
MIN_SIZE = 1024  # the matrices (4096 to 16384 elements) are quantized; norms and biases (64 to 256) are not


def sequences(generator: torch.Generator, batch: int) -> torch.Tensor:
    return tiny_gpt.sequences(generator, batch, VOCAB, CONTEXT)


def loss_of(model: nn.Module, params: dict, tokens: torch.Tensor) -> torch.Tensor:
    logits = torch.func.functional_call(model, params, (tokens[:, :-1],))
    return nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


# --------------------------------------------------------------------------- the variants


def adamw(**kwargs) -> gtx.GradientTransformation:
    return gtx.adamw(LEARNING_RATE, weight_decay=WEIGHT_DECAY, **kwargs)


def bf16_adamw() -> gtx.GradientTransformation:
    return adamw(mu_dtype=torch.float32)


# name -> (param dtype, optimizer)
VARIANTS: dict[str, tuple[torch.dtype, Callable[[int], gtx.GradientTransformation]]] = {
    "fp32": (torch.float32, lambda seed: adamw()),
    "8-bit": (torch.float32, lambda seed: gtx.quantize_state(adamw(), bits=8, min_size=MIN_SIZE)),
    "4-bit": (torch.float32, lambda seed: gtx.quantize_state(adamw(), bits=4, min_size=MIN_SIZE)),
    "bf16 plain": (torch.bfloat16, lambda seed: bf16_adamw()),
    "bf16 + SR": (torch.bfloat16, lambda seed: gtx.chain(bf16_adamw(), gtx.stochastic_rounding(seed))),
    "bf16 + Kahan": (torch.bfloat16, lambda seed: gtx.chain(bf16_adamw(), gtx.kahan_summation())),
    "bf16 + master": (torch.bfloat16, lambda seed: gtx.master_weights(adamw())),
}


def state_bytes(state) -> int:
    """Bytes of every tensor in an optimizer state."""
    return sum(t.numel() * t.element_size() for t in torch.utils._pytree.tree_leaves(state) if isinstance(t, torch.Tensor))


def train(variant: str, seed: int, steps: int, log_every: int) -> tuple[list[tuple[int, float]], float]:
    """Trains one variant from seed ``seed``'s initial weights on seed ``seed``'s batches; returns
    the evaluation losses ``[(step, loss), ...]`` and the state's bytes per parameter."""
    dtype, make = VARIANTS[variant]
    torch.manual_seed(seed)
    model = tiny_gpt.GPT(VOCAB, CONTEXT, WIDTH, HEADS, 4 * WIDTH)
    params = {name: p.detach().to(dtype) for name, p in model.named_parameters()}
    tx = make(seed)
    state = tx.init(params)
    n = sum(p.numel() for p in params.values())
    data = torch.Generator().manual_seed(seed)
    held_out = sequences(torch.Generator().manual_seed(10_000 + seed), EVAL_BATCH)

    def evaluate() -> float:
        with torch.no_grad():
            return float(loss_of(model, {k: p.float() for k, p in params.items()}, held_out))

    curve = [(0, evaluate())]
    for step in range(1, steps + 1):
        grads = torch.func.grad(lambda p: loss_of(model, p, sequences(data, BATCH)))(params)
        grads = {k: g.float() for k, g in grads.items()}  # the optimizer works in float32
        updates, state = tx.update(grads, state, params)
        params = gtx.apply_updates(params, updates)
        if step % log_every == 0 or step == steps:
            curve.append((step, evaluate()))
    return curve, state_bytes(state) / n


def plot(curves: dict[str, list[tuple[int, float]]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, curve in curves.items():
        ax.plot([s for s, _ in curve], [v for _, v in curve], label=name, linestyle="--" if name.startswith("bf16") else "-")
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("held-out loss (float32 evaluation)")
    ax.set_title(f"AdamW(lr {LEARNING_RATE}) on a small GPT, seed 0")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2 if QUICK else 300)
    parser.add_argument("--seeds", type=int, default=1 if QUICK else 3, help="fp32 runs, seeds 0.. (their spread is the run-to-run noise)")
    parser.add_argument("--all-seeds", action="store_true", help="run every variant at every seed, not fp32 only")
    parser.add_argument("--log-every", type=int, default=2 if QUICK else 25)
    quick_plot = os.path.join(tempfile.gettempdir(), "gradtx_low_memory.png")
    parser.add_argument("--plot", default=quick_plot if QUICK else "low_memory.png", help="where to write the PNG plot")
    args = parser.parse_args()
    torch.set_num_threads(1)

    started = time.perf_counter()
    curves: dict[tuple[str, int], list[tuple[int, float]]] = {}
    per_param: dict[str, float] = {}
    runs = [(variant, 0) for variant in VARIANTS]
    runs += [(variant, seed) for seed in range(1, args.seeds) for variant in (VARIANTS if args.all_seeds else ["fp32"])]
    for variant, seed in runs:
        curves[(variant, seed)], per_param[variant] = train(variant, seed, args.steps, args.log_every)
        if not QUICK:
            print(f"  {variant}, seed {seed}: {curves[(variant, seed)][-1][1]:.4f} ({time.perf_counter() - started:.0f} s)", flush=True)

    names = list(VARIANTS)
    print(f"held-out loss every {args.log_every} steps, seed 0 (AdamW lr {LEARNING_RATE}, batch {BATCH}):")
    print("  step " + "".join(f"{name:>15s}" for name in names))
    for i, (step, _) in enumerate(curves[(names[0], 0)]):
        print(f"  {step:4d} " + "".join(f"{curves[(name, 0)][i][1]:15.4f}" for name in names))

    finals = {name: [curves[(name, seed)][-1][1] for seed in range(args.seeds) if (name, seed) in curves] for name in names}
    reference = finals["fp32"]
    noise = statistics.stdev(reference) if len(reference) > 1 else float("nan")
    print(f"\nfinal held-out loss per variant after {args.steps} steps (fp32 at seeds 0..{args.seeds - 1}, "
          f"{'every variant at every seed' if args.all_seeds else 'the others at seed 0'}):")
    print(f"  {'variant':14s} {'state B/param':>13s} {'mean':>9s} {'per seed':>24s} {'- fp32, same seeds':>19s}")
    for name in names:
        paired = statistics.mean(a - b for a, b in zip(finals[name], reference))
        within = ""
        if noise == noise:
            within = "  within the seed-to-seed spread" if abs(paired) <= 2 * noise else "  outside the seed-to-seed spread"
        seeds = " ".join(f"{v:.4f}" for v in finals[name])
        print(f"  {name:14s} {per_param[name]:13.2f} {statistics.mean(finals[name]):9.4f} {seeds:>24s} {paired:+19.4f}{within}")
    if noise == noise:
        print(f"  run-to-run noise: the standard deviation of fp32's final loss over {len(reference)} seeds (other initial "
              f"weights and batches) is {noise:.4f}; 'within' means the difference from fp32 is at most 2 of it")
    if args.plot:
        if importlib.util.find_spec("matplotlib") is None:
            print("matplotlib is not installed (pip install -e \".[examples]\"): no plot written")
        else:
            plot({name: curves[(name, 0)] for name in names}, args.plot)
    print(f"done in {time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    main()
