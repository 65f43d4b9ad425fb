"""MAML on sine waves: differentiating through gradtx's inner-loop updates.

Model-agnostic meta-learning (Finn et al., 2017) learns an initialisation from which a few gradient
steps on a new task's handful of examples already fit that task. Each task here is the classic
sine-wave regression: ``y = A sin(x - phi)`` with amplitude ``A`` in [0.1, 5] and phase ``phi`` in
[0, pi], ``x`` in [-5, 5]; a task gives K = 10 support points to adapt on and 10 query points to
score the adapted model. The model is a small MLP (1-40-40-1, ReLU).

What it shows: the inner loop is gradtx's pure functional API over a params dict,
``torch.func.functional_call`` for the forward pass, ``torch.autograd.grad(create_graph=True)`` for
the task gradient, ``tx.update`` and ``gtx.apply_updates`` for the step, so the query loss after
adaptation is a differentiable function of the initial parameters. Its gradient (the
meta-gradient, second-order terms included) flows back through the optimizer's update into the
model's parameters, which an ordinary ``torch.optim.Adam`` then steps (the outer loop). The inner
optimizer is ``gtx.sgd`` by default or ``gtx.adam`` (``--inner adam``: the meta-gradient then
also flows through Adam's moments; ``eps_root > 0`` keeps it finite where a gradient is exactly 0).

The script prints the meta-loss (the mean query loss after adaptation, on a fixed set of held-out
tasks) before and after meta-training; it must decrease.

Run:  python examples/maml.py [--inner sgd|adam] [--meta-steps N]   (by default under a minute on 2 cores)
      python examples/maml.py --quick   (or GRADTX_EXAMPLES_QUICK=1: a few meta-steps of 10 tasks, as the tests run it)
"""

from __future__ import annotations

import argparse
import math
import os

import torch
from torch import nn
from torch.func import functional_call
from tqdm import tqdm

import gradtx as gtx

K_SHOT = 10
INNER_STEPS = 1
INNER_LR = {"sgd": 0.01, "adam": 0.01}
META_LR = 1e-3
META_STEPS = {"sgd": 600, "adam": 250}  # about 30 s each on 2 CPU cores (second order through Adam costs more)
META_BATCH = 25
EVAL_TASKS = 100


def sample_tasks(n: int, generator: torch.Generator) -> tuple[torch.Tensor, ...]:
    """``n`` sine tasks: support and query inputs/targets, each ``(n, K_SHOT, 1)``."""
    amplitude = torch.empty(n, 1, 1).uniform_(0.1, 5.0, generator=generator)
    phase = torch.empty(n, 1, 1).uniform_(0.0, math.pi, generator=generator)
    x = torch.empty(n, 2 * K_SHOT, 1).uniform_(-5.0, 5.0, generator=generator)
    y = amplitude * torch.sin(x - phase)
    return x[:, :K_SHOT], y[:, :K_SHOT], x[:, K_SHOT:], y[:, K_SHOT:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--inner", choices=sorted(INNER_LR), default="sgd")
    parser.add_argument("--meta-steps", type=int, default=None)
    parser.add_argument("--quick", action="store_true", help="a few meta-steps (as the tests run it)")
    args = parser.parse_args()
    quick = args.quick or os.environ.get("GRADTX_EXAMPLES_QUICK") == "1"
    meta_steps = args.meta_steps or (20 if quick else META_STEPS[args.inner])
    meta_batch = 10 if quick else META_BATCH
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)  # a model this small runs fastest on one thread

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1, 40), nn.ReLU(), nn.Linear(40, 40), nn.ReLU(), nn.Linear(40, 1))
    if args.inner == "sgd":
        inner_tx = gtx.sgd(INNER_LR["sgd"])
    else:
        # eps_root > 0 keeps the square root's derivative finite where a gradient is exactly zero
        # (a dead ReLU unit): with eps_root=0, d sqrt(nu) / d nu is infinite there and the
        # meta-gradient NaN, in gradtx, optax and torchopt alike.
        inner_tx = gtx.adam(INNER_LR["adam"], eps_root=1e-10)
    meta_opt = torch.optim.Adam(model.parameters(), lr=META_LR)

    def mse(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(functional_call(model, params, (x,)), y)

    def adapt(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor, *, create_graph: bool):
        """``INNER_STEPS`` steps of the inner optimizer on one task's support set, purely functional."""
        state = inner_tx.init(params)
        for _ in range(INNER_STEPS):
            grads = torch.autograd.grad(mse(params, x, y), list(params.values()), create_graph=create_graph)
            updates, state = inner_tx.update(dict(zip(params, grads)), state, params)
            params = gtx.apply_updates(params, updates)
        return params

    def meta_loss(tasks: tuple[torch.Tensor, ...], *, create_graph: bool) -> torch.Tensor:
        """The mean query loss after adapting to each task, from the model's current parameters."""
        params = dict(model.named_parameters())
        losses = [
            mse(adapt(params, xs, ys, create_graph=create_graph), xq, yq) for xs, ys, xq, yq in zip(*tasks)
        ]
        return torch.stack(losses).mean()

    generator = torch.Generator().manual_seed(1)
    held_out = sample_tasks(EVAL_TASKS, torch.Generator().manual_seed(12345))

    def evaluate() -> float:
        return meta_loss(held_out, create_graph=False).item()  # adaptation still needs autograd

    before = evaluate()
    print(f"inner optimizer: gtx.{args.inner}(lr={INNER_LR[args.inner]}), {INNER_STEPS} step(s) on {K_SHOT} shots")
    print(f"meta-loss before meta-training: {before:.4f}")
    progress = tqdm(range(1, meta_steps + 1), desc="meta-training", unit="meta-step", dynamic_ncols=True)
    for step in progress:
        loss = meta_loss(sample_tasks(meta_batch, generator), create_graph=True)
        meta_opt.zero_grad()
        loss.backward()  # through the inner update, into the initial parameters
        meta_opt.step()
        if step % max(1, meta_steps // 20) == 0:
            progress.set_postfix(meta_batch_loss=f"{loss.item():.4f}")
    progress.close()
    after = evaluate()
    print(f"meta-loss after {meta_steps} meta-steps: {after:.4f}")
    print(f"meta-loss decreased: {after < before} ({before:.4f} -> {after:.4f})")
    if not after < before:
        raise SystemExit("the meta-loss did not decrease")


if __name__ == "__main__":
    main()
