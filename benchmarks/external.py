"""gradtx against optax (jit, CPU) and torchopt on the same GPT-style tree: clip by global norm, then AdamW.

Not part of the package or its tests: optax, JAX and torchopt live only in a separate benchmark
environment. Run from the repository root with that environment's interpreter::

    /path/to/benchenv/bin/python benchmarks/external.py [--rounds N]

Every candidate does one full step, clip + AdamW + apply, on the GPT_41M tree (68.2M elements) of
``benchmarks/common.py``; ratios are medians over interleaved rounds against the in-place torch step
(``clip_grad_norm_`` + ``AdamW(fused=True).step()``).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import gradtx as gtx  # noqa: E402
from benchmarks.common import GPT_41M, interleaved, make_tree, median_ratio, n_elements, report  # noqa: E402

LR, WEIGHT_DECAY, MAX_NORM = 1e-4, 0.01, 1.0


def torch_candidate():
    params = [p.requires_grad_() for p in make_tree(GPT_41M, seed=0).values()]
    for p, g in zip(params, make_tree(GPT_41M, seed=1).values()):
        p.grad = g
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY, fused=True)

    def step():
        torch.nn.utils.clip_grad_norm_(params, MAX_NORM)
        opt.step()

    return step


def gradtx_candidates():
    tx = gtx.chain(
        gtx.clip_by_global_norm(MAX_NORM), gtx.from_torch(torch.optim.AdamW, lr=LR, weight_decay=WEIGHT_DECAY, fused=True)
    )
    grads = make_tree(GPT_41M, seed=1)
    pure = {"params": make_tree(GPT_41M, seed=0)}
    pure["state"] = tx.init(pure["params"])
    donated_params, donated_grads = make_tree(GPT_41M, seed=0), make_tree(GPT_41M, seed=1)
    donated = {"state": tx.init(donated_params)}

    def pure_step():
        updates, pure["state"] = tx.update(grads, pure["state"], pure["params"])
        pure["params"] = gtx.apply_updates(pure["params"], updates)

    def donated_step():
        updates, donated["state"] = tx.update(donated_grads, donated["state"], donated_params, inplace=True)
        gtx.apply_updates(donated_params, updates, inplace=True)

    return pure_step, donated_step


def gradtx_native_candidates():
    """gradtx's own ``chain(clip_by_global_norm, adamw)``: pure, and donated (``inplace=True``)."""
    tx = gtx.chain(gtx.clip_by_global_norm(MAX_NORM), gtx.adamw(LR, weight_decay=WEIGHT_DECAY))
    grads = make_tree(GPT_41M, seed=1)
    pure = {"params": make_tree(GPT_41M, seed=0)}
    pure["state"] = tx.init(pure["params"])
    donated_params, donated_grads = make_tree(GPT_41M, seed=0), make_tree(GPT_41M, seed=1)
    donated = {"state": tx.init(donated_params)}

    def pure_step():
        updates, pure["state"] = tx.update(grads, pure["state"], pure["params"])
        pure["params"] = gtx.apply_updates(pure["params"], updates)

    def donated_step():
        updates, donated["state"] = tx.update(donated_grads, donated["state"], donated_params, inplace=True)
        gtx.apply_updates(donated_params, updates, inplace=True)

    return pure_step, donated_step


def gradtx_compiled_candidate():
    """The same pure chain and ``apply_updates`` in one ``torch.compile(fullgraph=True)`` function,
    which fuses the elementwise work as XLA does for optax."""
    tx = gtx.chain(gtx.clip_by_global_norm(MAX_NORM), gtx.adamw(LR, weight_decay=WEIGHT_DECAY))
    grads = make_tree(GPT_41M, seed=1)
    box = {"params": make_tree(GPT_41M, seed=0)}
    box["state"] = tx.init(box["params"])

    @torch.compile(fullgraph=True)
    def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return gtx.apply_updates(params, updates), state

    def run():
        box["params"], box["state"] = step(box["params"], box["state"], grads)

    return run


def optax_candidate():
    import jax
    import optax

    tx = optax.chain(optax.clip_by_global_norm(MAX_NORM), optax.adamw(LR, weight_decay=WEIGHT_DECAY))
    box = {"params": {k: jax.numpy.asarray(v.numpy()) for k, v in make_tree(GPT_41M, seed=0).items()}}
    grads = {k: jax.numpy.asarray(v.numpy()) for k, v in make_tree(GPT_41M, seed=1).items()}
    box["state"] = tx.init(box["params"])

    @jax.jit
    def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    def run():
        box["params"], box["state"] = step(box["params"], box["state"], grads)
        jax.block_until_ready(box["params"])

    return run


def torchopt_candidates():
    import torchopt

    tx = torchopt.chain(torchopt.clip_grad_norm(MAX_NORM), torchopt.adamw(LR, weight_decay=WEIGHT_DECAY))
    grads = make_tree(GPT_41M, seed=1)
    pure = {"params": make_tree(GPT_41M, seed=0)}
    pure["state"] = tx.init(pure["params"])
    inplace_params, inplace_grads = make_tree(GPT_41M, seed=0), make_tree(GPT_41M, seed=1)
    inplace = {"state": tx.init(inplace_params)}

    def pure_step():
        updates, pure["state"] = tx.update(grads, pure["state"], params=pure["params"], inplace=False)
        pure["params"] = torchopt.apply_updates(pure["params"], updates, inplace=False)

    def inplace_step():
        updates, inplace["state"] = tx.update(inplace_grads, inplace["state"], params=inplace_params, inplace=True)
        torchopt.apply_updates(inplace_params, updates, inplace=True)

    return pure_step, inplace_step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=11)
    args = parser.parse_args()
    print(f"GPT_41M tree: {n_elements(make_tree(GPT_41M)) / 1e6:.1f}M elements, torch {torch.__version__}")
    baseline = "torch clip_grad_norm_ + AdamW(fused).step"
    candidates = {baseline: torch_candidate()}
    candidates["gradtx pure chain(clip, from_torch(AdamW))"], candidates["gradtx donated (inplace=True)"] = gradtx_candidates()
    native_pure, native_donated = "gradtx pure chain(clip, adamw)", "gradtx chain(clip, adamw), donated"
    candidates[native_pure], candidates[native_donated] = gradtx_native_candidates()
    native_compiled = "gradtx pure chain(clip, adamw), torch.compile"
    candidates[native_compiled] = gradtx_compiled_candidate()
    try:
        candidates["optax chain(clip, adamw), jit, CPU"] = optax_candidate()
    except ImportError as error:
        print(f"optax not available: {error}")
    try:
        candidates["torchopt chain(clip, adamw), pure"], candidates["torchopt, inplace=True"] = torchopt_candidates()
    except ImportError as error:
        print(f"torchopt not available: {error}")
    times = interleaved(candidates, rounds=args.rounds)
    report("clip + AdamW + apply, one step", times, baseline)
    for other, target in (("optax chain(clip, adamw), jit, CPU", 0.5), ("torchopt chain(clip, adamw), pure", 0.25)):
        if other in times:
            for ours in (native_pure, native_compiled):
                print(f"{ours} / {other}: {median_ratio(times, ours, other):.3f} (target <= {target})")


if __name__ == "__main__":
    main()
