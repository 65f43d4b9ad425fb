"""Torch interop speed: wrap and from_torch against torch itself, on the 41.7M-parameter GPT_41M tree.

1. ``opt.clip_grad_by_norm(1.0)`` on a wrapped optimizer vs ``torch.nn.utils.clip_grad_norm_``.
2. ``wrap(AdamW(fused=True), clip_by_global_norm(1.0)).step()`` vs ``clip_grad_norm_`` followed by
   ``AdamW(fused=True).step()``: the clip's coefficient rides in the fused kernel's ``grad_scale``,
   saving the separate pass over the gradients (``fold=False`` shown for comparison).
3. The pure ``chain(clip_by_global_norm(1.0), from_torch(AdamW, fused=True))`` + ``apply_updates``,
   and its donated (``inplace=True``) form, vs the in-place torch step. The pure form copies what
   it must not modify (parameters, optimizer state), so it pays for purity in memory traffic.

Run: ``python benchmarks/wrap.py [--rounds N]``. Ratios are medians over interleaved rounds.
"""

from __future__ import annotations

import argparse

import torch

import gradtx as gtx
from common import GPT_41M, interleaved, make_tree, n_elements, report


def leaf_params(seed: int) -> list[torch.Tensor]:
    """Parameters with gradients, as a model would hold them after backward."""
    params = [p.requires_grad_() for p in make_tree(GPT_41M, seed=seed).values()]
    for p, g in zip(params, make_tree(GPT_41M, seed=seed + 1).values()):
        p.grad = g
    return params


def bench_clip_grad_by_norm(rounds: int) -> dict[str, float]:
    torch_params, wrapped_params = leaf_params(0), leaf_params(0)
    wrapped = gtx.wrap(torch.optim.SGD(wrapped_params, lr=0.1))
    times = interleaved(
        {
            "torch clip_grad_norm_": lambda: torch.nn.utils.clip_grad_norm_(torch_params, 1.0),
            "wrapped clip_grad_by_norm": lambda: wrapped.clip_grad_by_norm(1.0),
        },
        rounds=rounds,
    )
    return report("clip_grad_by_norm vs clip_grad_norm_ (in place)", times, "torch clip_grad_norm_")


def bench_wrapped_adamw_step(rounds: int) -> dict[str, float]:
    torch_params = leaf_params(0)
    torch_opt = torch.optim.AdamW(torch_params, lr=1e-4, fused=True)
    folded = gtx.wrap(torch.optim.AdamW(leaf_params(0), lr=1e-4, fused=True), gtx.clip_by_global_norm(1.0))
    unfolded = gtx.wrap(torch.optim.AdamW(leaf_params(0), lr=1e-4, fused=True), gtx.clip_by_global_norm(1.0), fold=False)

    def torch_step():
        torch.nn.utils.clip_grad_norm_(torch_params, 1.0)
        torch_opt.step()

    baseline = "torch clip_grad_norm_ + AdamW(fused).step"
    ratios = {}
    # One pair at a time: A, B, A, B, ... keeps the comparison free of a third candidate's position.
    for name, step in (("wrap(...).step (folded)", folded.step), ("wrap(..., fold=False).step", unfolded.step)):
        times = interleaved({baseline: torch_step, name: step}, rounds=rounds)
        ratios.update(report("clip + AdamW(fused=True) step", times, baseline))
    return ratios


def bench_pure_chain(rounds: int) -> dict[str, float]:
    torch_params = leaf_params(0)
    torch_opt = torch.optim.AdamW(torch_params, lr=1e-4, fused=True)
    tx = gtx.chain(gtx.clip_by_global_norm(1.0), gtx.from_torch(torch.optim.AdamW, lr=1e-4, fused=True))
    params = make_tree(GPT_41M, seed=0)
    grads = make_tree(GPT_41M, seed=1)
    pure = {"params": params, "state": tx.init(params)}
    donated_params = make_tree(GPT_41M, seed=0)
    donated = {"state": tx.init(donated_params)}
    donated_grads = make_tree(GPT_41M, seed=1)

    def torch_step():
        torch.nn.utils.clip_grad_norm_(torch_params, 1.0)
        torch_opt.step()

    def pure_step():
        updates, pure["state"] = tx.update(grads, pure["state"], pure["params"])
        pure["params"] = gtx.apply_updates(pure["params"], updates)

    def donated_step():
        # The gradients are donated (clipped in place), as a training loop that owns them may do.
        updates, donated["state"] = tx.update(donated_grads, donated["state"], donated_params, inplace=True)
        gtx.apply_updates(donated_params, updates, inplace=True)

    baseline = "torch clip_grad_norm_ + AdamW(fused).step"
    ratios = {}
    for name, step in (("pure chain + apply_updates", pure_step), ("donated chain + apply_updates(inplace)", donated_step)):
        times = interleaved({baseline: torch_step, name: step}, rounds=rounds)
        ratios.update(report("chain(clip, from_torch(AdamW fused)) vs the in-place torch step", times, baseline))
    return ratios


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    print(f"GPT_41M tree: {n_elements(make_tree(GPT_41M)) / 1e6:.1f}M elements, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    bench_clip_grad_by_norm(args.rounds)
    bench_wrapped_adamw_step(args.rounds)
    bench_pure_chain(args.rounds)


if __name__ == "__main__":
    main()
