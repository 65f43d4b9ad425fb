"""MAML meta-steps: gradtx's pure inner loop against torchopt's MetaSGD / MetaAdam and hand-written torch.

The task is examples/maml.py's sine-wave regression (amplitude in [0.1, 5], phase in [0, pi], K = 10
shots, an MLP 1-40-40-1). One meta-step takes a meta-batch of tasks; for each, a few inner steps on
the support set with ``create_graph=True``, the query loss (divided by the meta-batch size) and its
backward into the initial parameters. Candidates, from the same initial parameters and tasks:

- ``gradtx``: ``functional_call`` over a params dict, ``tx.update`` and ``gtx.apply_updates``
  (``gtx.sgd(lr)`` or ``gtx.adam(lr, eps_root=1e-10)``);
- ``torchopt``: ``torchopt.MetaSGD(net, lr)`` / ``torchopt.MetaAdam(net, lr, eps_root=1e-10)`` stepping
  the module, with ``extract_state_dict`` / ``recover_state_dict`` between tasks, as in its MAML example;
- ``torch by hand``: the same inner update written out with plain tensor ops (``p - lr * g``, or
  Adam's moments and bias corrections), the floor any library can approach.

It first checks that the three give the same meta-gradient (in float32 and float64; the largest
absolute difference from gradtx's is printed, next to the gradient's scale). In float32 torchopt's
Adam differs by about 1e-5 relative: it takes ``1 - b2^t`` in float32, where ``1 - 0.999`` keeps only
a few digits, while gradtx (and the hand-written loop, with Python floats) take the bias corrections
in float64; in float64 (the default dtype set to it, which torchopt's corrections follow) all three
agree to rounding. Then it times meta-steps in interleaved
rounds (A, B, C, A, B, C, ...) and reports medians and median per-round ratios against gradtx.
torchopt is not a dependency of gradtx; without it, its rows are left out (saying so).

Run:  python benchmarks/maml.py [--rounds N] [--inner-steps S] [--meta-batch B] [--quick]
"""

from __future__ import annotations

import argparse
import copy
import math
from typing import Callable

import torch
from torch import nn
from torch.func import functional_call

import gradtx as gtx
from common import interleaved, report

K_SHOT = 10
INNER_LR = 0.01
EPS_ROOT = 1e-10  # keeps Adam's meta-gradient finite where a gradient is exactly 0 (dead ReLU units)

try:
    import torchopt
except Exception as error:  # noqa: BLE001 - any import failure means "not available here"
    torchopt = None
    TORCHOPT_MISSING = f"{type(error).__name__}: {error}"


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(1, 40), nn.ReLU(), nn.Linear(40, 40), nn.ReLU(), nn.Linear(40, 1))


def sample_tasks(n: int, seed: int) -> list[tuple[torch.Tensor, ...]]:
    gen = torch.Generator().manual_seed(seed)
    amplitude = torch.empty(n, 1, 1).uniform_(0.1, 5.0, generator=gen)
    phase = torch.empty(n, 1, 1).uniform_(0.0, math.pi, generator=gen)
    x = torch.empty(n, 2 * K_SHOT, 1).uniform_(-5.0, 5.0, generator=gen)
    y = amplitude * torch.sin(x - phase)
    return list(zip(x[:, :K_SHOT], y[:, :K_SHOT], x[:, K_SHOT:], y[:, K_SHOT:]))


def mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out, target)


# --------------------------------------------------------------------------- candidates
# Each returns a function that runs one meta-step's forward and backward (gradients land in
# ``model``'s .grad) on ``tasks``.


def gradtx_meta_step(model: nn.Module, inner: str, steps: int) -> Callable[[list], None]:
    tx = gtx.sgd(INNER_LR) if inner == "sgd" else gtx.adam(INNER_LR, eps_root=EPS_ROOT)

    def meta_step(tasks):
        for xs, ys, xq, yq in tasks:
            params = dict(model.named_parameters())
            state = tx.init(params)
            for _ in range(steps):
                loss = mse(functional_call(model, params, (xs,)), ys)
                grads = torch.autograd.grad(loss, list(params.values()), create_graph=True)
                updates, state = tx.update(dict(zip(params, grads)), state, params)
                params = gtx.apply_updates(params, updates)
            (mse(functional_call(model, params, (xq,)), yq) / len(tasks)).backward()

    return meta_step


def torchopt_meta_step(model: nn.Module, inner: str, steps: int) -> Callable[[list], None]:
    if inner == "sgd":
        opt = torchopt.MetaSGD(model, lr=INNER_LR)
    else:
        opt = torchopt.MetaAdam(model, lr=INNER_LR, eps_root=EPS_ROOT)

    def meta_step(tasks):
        net_state = torchopt.extract_state_dict(model)
        opt_state = torchopt.extract_state_dict(opt)
        for xs, ys, xq, yq in tasks:
            for _ in range(steps):
                opt.step(mse(model(xs), ys))
            (mse(model(xq), yq) / len(tasks)).backward()
            torchopt.recover_state_dict(model, net_state)
            torchopt.recover_state_dict(opt, opt_state)

    return meta_step


def by_hand_meta_step(model: nn.Module, inner: str, steps: int) -> Callable[[list], None]:
    b1, b2, eps = 0.9, 0.999, 1e-8

    def meta_step(tasks):
        for xs, ys, xq, yq in tasks:
            params = dict(model.named_parameters())
            mu = {k: torch.zeros_like(v) for k, v in params.items()}
            nu = {k: torch.zeros_like(v) for k, v in params.items()}
            for t in range(1, steps + 1):
                loss = mse(functional_call(model, params, (xs,)), ys)
                grads = dict(zip(params, torch.autograd.grad(loss, list(params.values()), create_graph=True)))
                if inner == "sgd":
                    params = {k: p - INNER_LR * grads[k] for k, p in params.items()}
                    continue
                mu = {k: b1 * mu[k] + (1 - b1) * grads[k] for k in params}
                nu = {k: b2 * nu[k] + (1 - b2) * grads[k] * grads[k] for k in params}
                bc1, bc2 = 1 - b1**t, 1 - b2**t
                params = {
                    k: p - INNER_LR * (mu[k] / bc1) / (torch.sqrt(nu[k] / bc2 + EPS_ROOT) + eps) for k, p in params.items()
                }
            (mse(functional_call(model, params, (xq,)), yq) / len(tasks)).backward()

    return meta_step


CANDIDATES = {"gradtx": gradtx_meta_step, "torchopt": torchopt_meta_step, "torch by hand": by_hand_meta_step}


def meta_gradient(make: Callable, model: nn.Module, inner: str, steps: int, tasks: list) -> list[torch.Tensor]:
    model.zero_grad()
    make(model, inner, steps)(tasks)
    return [p.grad.clone() for p in model.parameters()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--inner-steps", type=int, default=5)
    parser.add_argument("--meta-batch", type=int, default=10)
    parser.add_argument("--quick", action="store_true", help="5 rounds")
    args = parser.parse_args()
    rounds = 5 if args.quick else args.rounds
    torch.set_num_threads(1)  # a model this small runs fastest on one thread

    names = [name for name in CANDIDATES if name != "torchopt" or torchopt is not None]
    if torchopt is None:
        print(f"torchopt is not installed here ({TORCHOPT_MISSING}): comparing against hand-written torch only")
    else:
        print(f"torchopt {torchopt.__version__}, torch {torch.__version__}")
    tasks = sample_tasks(args.meta_batch, seed=1)
    base = make_model()
    for inner in ("sgd", "adam"):
        title = f"MAML meta-step: {args.meta_batch} tasks x {args.inner_steps} inner {inner} steps (MLP 1-40-40-1)"
        print(f"\n{title}: meta-gradient agreement")
        for dtype in (torch.float32, torch.float64):
            cast = [tuple(t.to(dtype) for t in task) for task in tasks]
            torch.set_default_dtype(dtype)  # torchopt's bias corrections are taken in the default dtype
            grads = {
                name: meta_gradient(CANDIDATES[name], copy.deepcopy(base).to(dtype), inner, args.inner_steps, cast)
                for name in names
            }
            torch.set_default_dtype(torch.float32)
            scale = max(float(g.abs().max()) for g in grads["gradtx"])
            for name in names:
                if name != "gradtx":
                    diff = max(float((a - b).abs().max()) for a, b in zip(grads[name], grads["gradtx"]))
                    print(f"  {str(dtype)[6:]:8s} {name:15s} max abs difference from gradtx: {diff:.3e}"
                          f"  (largest |meta-gradient| {scale:.3e})")
        models = {name: copy.deepcopy(base) for name in names}
        steps = {name: CANDIDATES[name](models[name], inner, args.inner_steps) for name in names}
        times = interleaved({name: (lambda fn=steps[name]: fn(tasks)) for name in names}, rounds=rounds)
        report(title, times, "gradtx")


if __name__ == "__main__":
    main()
