"""gradtx's eager pure step against torch's fused in-place step, per optimizer, on the 41.7M GPT tree.

Every candidate does one full step, clip by global norm 1.0 + the optimizer + apply, on the
GPT_41M tree of ``benchmarks/common.py`` (52 float32 leaves, 41.7M elements)::

    python benchmarks/eager.py [--optimizers adamw adam sgd amsgrad lion] [--threads N] [--rounds R] [--malloc]
        [--candidates gradtx gradtx-fresh gradtx-aten]

Candidates, for each optimizer:

- ``torch``: ``clip_grad_norm_`` + ``torch.optim.<Optimizer>(fused=True).step()``, in place (Lion,
  which torch lacks: its update rule with torch's foreach ops, in place, ``ForeachLion``);
- ``gradtx``: ``chain(clip_by_global_norm, <optimizer>)`` and ``apply_updates``, pure and eager
  (new params and state every step), with gradtx's C kernels where they apply, the large new
  tensors written into the memory of those the step before returned and the caller let go of
  (``gradtx.buffer_pool``);
- ``gradtx-fresh``: the same with ``GRADTX_RECYCLE=0``: every new tensor freshly allocated;
- ``gradtx-aten``: the same with ``GRADTX_NATIVE=0``: one ATen kernel per operation.

Method: each candidate runs in a process of its own (``--worker``), which builds its trees, takes
3 warm-up steps and times 7, and prints the times as JSON; the parent starts the workers
interleaved (A, B, C, A, B, C, ...) for ``--rounds`` rounds. A round's time is the median of its
steps; the report gives medians over rounds and the median over rounds of per-round ratios to
torch. ``--malloc`` adds ``MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=2**40`` to the workers'
environment (glibc keeps freed memory mapped, so a pure step's new tensors are not page-faulted
in again every step); without it the allocator is as is.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "src"))
sys.path.insert(0, ROOT)

LR, MAX_NORM = 1e-3, 1.0
OPTIMIZERS = {  # name: (torch class and arguments, gradtx alias and arguments)
    "adamw": (("AdamW", dict(lr=LR, weight_decay=0.1)), ("adamw", dict(learning_rate=LR, weight_decay=0.1))),
    "adam": (("Adam", dict(lr=LR)), ("adam", dict(learning_rate=LR))),
    "sgd": (("SGD", dict(lr=LR, momentum=0.9)), ("sgd", dict(learning_rate=LR, momentum=0.9))),
    "amsgrad": (("Adam", dict(lr=LR, amsgrad=True)), ("amsgrad", dict(learning_rate=LR))),
    "lion": (("Lion", dict(lr=LR / 10, weight_decay=0.1)), ("lion", dict(learning_rate=LR / 10, weight_decay=0.1))),
}


class ForeachLion:
    """torch has no Lion: its update rule (Chen et al., 2023; lion-pytorch's ``update_fn``) in place
    with torch's foreach ops, the fastest torch-only Lion step on the CPU."""

    def __init__(self, params, lr: float, weight_decay: float, betas=(0.9, 0.99)):
        import torch

        self.params, self.lr, self.weight_decay, self.betas = params, lr, weight_decay, betas
        self.momenta = [torch.zeros_like(p) for p in params]

    def step(self) -> None:
        import torch

        b1, b2 = self.betas
        grads = [p.grad for p in self.params]
        torch._foreach_mul_(self.params, 1.0 - self.lr * self.weight_decay)
        direction = torch._foreach_lerp(grads, self.momenta, b1)
        torch._foreach_sign_(direction)
        torch._foreach_add_(self.params, direction, alpha=-self.lr)
        torch._foreach_lerp_(self.momenta, grads, 1.0 - b2)
CANDIDATES = ("torch", "gradtx", "gradtx-fresh", "gradtx-aten")
MALLOC = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(2**40)}


def _step(candidate: str, optimizer: str):
    import torch

    from benchmarks.common import GPT_41M, make_tree

    params, grads = make_tree(GPT_41M), make_tree(GPT_41M, seed=1, scale=0.01)
    (torch_name, torch_args), (gradtx_name, gradtx_args) = OPTIMIZERS[optimizer]
    if candidate == "torch":
        leaves = list(params.values())
        for leaf, grad in zip(leaves, grads.values()):
            leaf.grad = grad
        if torch_name == "Lion":
            opt = ForeachLion(leaves, **torch_args)
        else:
            opt = getattr(torch.optim, torch_name)(leaves, fused=True, **torch_args)

        def step():
            torch.nn.utils.clip_grad_norm_(leaves, MAX_NORM)
            opt.step()

        return step
    if candidate == "gradtx-aten":
        os.environ["GRADTX_NATIVE"] = "0"
    if candidate == "gradtx-fresh":
        os.environ["GRADTX_RECYCLE"] = "0"
    import gradtx as gtx

    tx = gtx.chain(gtx.clip_by_global_norm(MAX_NORM), getattr(gtx, gradtx_name)(**gradtx_args))
    box = {"params": params, "state": tx.init(params)}

    def step():
        updates, box["state"] = tx.update(grads, box["state"], box["params"])
        box["params"] = gtx.apply_updates(box["params"], updates)

    return step


def worker(candidate: str, optimizer: str, threads: int, warmup: int, steps: int) -> None:
    import torch

    if threads:
        torch.set_num_threads(threads)
    from benchmarks.common import interleaved

    step = _step(candidate, optimizer)
    print(json.dumps({"times": interleaved({candidate: step}, rounds=steps, warmup=warmup)[candidate]}))


def main() -> None:
    from benchmarks.common import run_worker

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--optimizers", nargs="+", choices=sorted(OPTIMIZERS), default=list(OPTIMIZERS))
    parser.add_argument("--threads", type=int, default=0, help="torch threads per worker (default: as is)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--malloc", action="store_true", help="glibc keeps freed memory mapped (see the docstring)")
    parser.add_argument("--candidates", nargs="+", choices=CANDIDATES, default=list(CANDIDATES), help="torch is always run")
    parser.add_argument("--worker", nargs=2, metavar=("CANDIDATE", "OPTIMIZER"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(*args.worker, args.threads, args.warmup, args.steps)
        return
    import torch

    print(
        f"GPT_41M tree, torch {torch.__version__}, {os.cpu_count()} CPUs, threads per worker: "
        f"{args.threads or 'as is'}, allocator: {'malloc (no trimming)' if args.malloc else 'as is'}; "
        f"{args.rounds} rounds, {args.warmup} warm-up + {args.steps} timed steps per worker"
    )
    candidates = ["torch"] + [c for c in args.candidates if c != "torch"]
    medians: dict[tuple[str, str], list[float]] = {}
    for round_ in range(args.rounds):
        for optimizer in args.optimizers:
            for candidate in candidates:
                out = run_worker(
                    __file__,
                    ["--worker", candidate, optimizer, "--threads", str(args.threads), "--warmup", str(args.warmup), "--steps", str(args.steps)],
                    label=f"{candidate} {optimizer}",
                    env=MALLOC if args.malloc else None,
                    unset=("GRADTX_NATIVE", "GRADTX_RECYCLE"),
                )
                if out is not None:
                    medians.setdefault((optimizer, candidate), []).append(statistics.median(out["times"]))
        print(f"  round {round_ + 1}/{args.rounds} done", flush=True)
    print("\nclip + optimizer + apply, one step, wall-clock (median over rounds; ratio: median of per-round ratios to torch)")
    for optimizer in args.optimizers:
        base = medians.get((optimizer, "torch"), [])
        for candidate in candidates:
            times = medians.get((optimizer, candidate), [])
            if not times or not base:
                continue
            ratio = statistics.median(t / b for t, b in zip(times, base))
            print(f"  {optimizer:6s} {candidate:12s} {statistics.median(times) * 1e3:8.1f} ms   {ratio:5.2f}x torch")


if __name__ == "__main__":
    main()
