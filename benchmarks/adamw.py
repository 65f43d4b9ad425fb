"""AdamW step on the 41.7M-parameter GPT tree: gradtx's donated path against torch.optim.AdamW(foreach=True).

- ``gradtx adamw, donated``: ``tx.update(grads, state, params, inplace=True)`` then
  ``apply_updates(params, updates, inplace=True)``, as ``gradtx.wrap`` runs it. The gradient buffers
  are donated and hold the updates afterwards; the next step reuses them as its gradients (a
  training loop's backward would refill them), so no copy is timed.
- ``gradtx clip+adamw, pure``: ``chain(clip_by_global_norm(1.0), adamw(1e-3, weight_decay=0.01))``
  and ``apply_updates``, nothing mutated (new state, new params every step).
- ``torch AdamW foreach``: ``optimizer.step()`` with the same hyperparameters.

Run: ``python benchmarks/adamw.py [--rounds N] [--small]``.
"""

from __future__ import annotations

import argparse

import torch

import gradtx as gtx
from common import GPT_41M, interleaved, make_tree, n_elements, report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--small", action="store_true", help="a 4x smaller tree, for a quick check")
    args = parser.parse_args()
    config = dict(GPT_41M, vocab=4096, d_model=512) if args.small else GPT_41M
    lr, wd = 1e-3, 0.01

    params = make_tree(config, seed=0, scale=0.02)
    grads = make_tree(config, seed=1, scale=1e-3)
    print(f"{len(params)} leaves, {n_elements(params) / 1e6:.1f}M parameters, float32, {torch.get_num_threads()} threads")

    # torch.optim.AdamW(foreach=True)
    torch_params = [p.clone() for p in params.values()]
    for p, g in zip(torch_params, grads.values()):
        p.grad = g.clone()
    torch_opt = torch.optim.AdamW(torch_params, lr=lr, weight_decay=wd, foreach=True)

    # gradtx adamw, donated
    donated_params = {k: v.clone() for k, v in params.items()}
    donated_grads = {k: v.clone() for k, v in grads.items()}
    adamw = gtx.adamw(lr, weight_decay=wd)
    donated = {"state": adamw.init(donated_params)}

    def gradtx_donated():
        updates, donated["state"] = adamw.update(donated_grads, donated["state"], donated_params, inplace=True)
        gtx.apply_updates(donated_params, updates, inplace=True)

    # gradtx chain(clip, adamw), pure
    chain = gtx.chain(gtx.clip_by_global_norm(1.0), gtx.adamw(lr, weight_decay=wd))
    pure = {"params": {k: v.clone() for k, v in params.items()}}
    pure["state"] = chain.init(pure["params"])

    def gradtx_pure_chain():
        updates, pure["state"] = chain.update(grads, pure["state"], pure["params"])
        pure["params"] = gtx.apply_updates(pure["params"], updates)

    # Two A/B comparisons, so the pure chain's allocations do not disturb the donated timing.
    times = interleaved({"torch AdamW foreach": torch_opt.step, "gradtx adamw, donated": gradtx_donated}, rounds=args.rounds)
    ratios = report("AdamW step (median of interleaved rounds)", times, "torch AdamW foreach")
    times = interleaved({"torch AdamW foreach": torch_opt.step, "gradtx clip+adamw, pure": gradtx_pure_chain}, rounds=args.rounds)
    report("clip + AdamW, pure chain (median of interleaved rounds)", times, "torch AdamW foreach")
    print(f"\ndonated adamw / torch AdamW(foreach=True): {ratios['gradtx adamw, donated']:.3f} (target <= 1.05)")


if __name__ == "__main__":
    with torch.no_grad():
        main()
