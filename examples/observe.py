"""Watching an optimizer with ``gtx.observe``: per-layer gradient norms find an injected spike.

A tiny GPT (token and position embeddings, two pre-norm transformer blocks, an lm head) trains
functionally on a synthetic language (a random first token, then ``next = (5 * token + 3) % 64``)
with ``observe(chain(clip_by_global_norm(1.0), adamw(...)), groups=2)``: one group per top-level
module and per block (``"blocks.0"``, ``"blocks.1"``, ``"tokens.weight"``, ...). At one known step
the gradients of one block are multiplied by 1000, as a bad batch or a numerical blow-up would do.
Reading ``gtx.observations(state)`` after every step, the largest per-group gradient norm of the
whole run is found, and it is at the injected step and block; the clip catches it (its coefficient
drops far below 1 there). The per-group norms over steps, with the clip's coefficient and rate, are
saved as a heatmap with :func:`gradtx.plot.observed_heatmap` (matplotlib: ``pip install
'gradtx[plot]'``).

Run:  python examples/observe.py [--out observe_heatmap.png]
      GRADTX_EXAMPLES_QUICK=1 python examples/observe.py     (a few steps, as the tests run it)
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch
from torch import nn

import _tiny_gpt as tiny_gpt  # the model and language (examples/_tiny_gpt.py)
import gradtx as gtx
from gradtx import plot

QUICK = os.environ.get("GRADTX_EXAMPLES_QUICK") == "1"
STEPS = 12 if QUICK else 200
SPIKE_STEP, SPIKE_GROUP, SPIKE_FACTOR = (7 if QUICK else 120), "blocks.1", 1000.0
VOCAB, CONTEXT, WIDTH, HEADS, BATCH = 64, 16, 32, 4, 16


def sequences(generator: torch.Generator) -> torch.Tensor:
    return tiny_gpt.sequences(generator, BATCH, VOCAB, CONTEXT)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default_out = os.path.join(tempfile.gettempdir(), "gradtx_observe_heatmap.png") if QUICK else "observe_heatmap.png"
    parser.add_argument("--out", default=default_out, help="where to save the heatmap (PNG)")
    args = parser.parse_args()

    torch.manual_seed(0)
    model = tiny_gpt.GPT(VOCAB, CONTEXT, WIDTH, HEADS, 4 * WIDTH)
    params = {name: p.detach() for name, p in model.named_parameters()}

    def loss_fn(params: dict, tokens: torch.Tensor) -> torch.Tensor:
        logits = torch.func.functional_call(model, params, (tokens[:, :-1],))
        return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))

    tx = gtx.observe(gtx.chain(gtx.clip_by_global_norm(1.0), gtx.adamw(3e-3, weight_decay=0.01)), groups=2)
    state = tx.init(params)
    grad_fn = torch.func.grad_and_value(loss_fn)
    generator = torch.Generator().manual_seed(1)
    history: list[dict[str, float]] = []
    for step in range(STEPS):
        grads, loss = grad_fn(params, sequences(generator))
        if step == SPIKE_STEP:  # a gradient spike in one block
            grads = {k: g * SPIKE_FACTOR if k.startswith(SPIKE_GROUP + ".") else g for k, g in grads.items()}
        updates, state = tx.update(grads, state, params)
        params = gtx.apply_updates(params, updates)
        logged = gtx.observations(state)
        history.append(logged)
        if step % max(1, STEPS // 6) == 0 or step == SPIKE_STEP:
            print(
                f"step {step:3d}  loss {float(loss):.3f}  grad norm {logged['grad_norm']:10.3f}  "
                f"clip coefficient {logged['clip/coefficient']:.4f}"
            )

    names, values = plot.group_norms(history)
    group, step = divmod(int(torch.as_tensor(values).nan_to_num(-1.0).argmax()), len(history))
    print(f"largest per-group gradient norm: {values[group, step]:.1f} at step {step} in group {names[group]!r}")
    print(f"(injected: step {SPIKE_STEP}, group {SPIKE_GROUP!r}, x{SPIKE_FACTOR:g})")
    found = step == SPIKE_STEP and names[group] == SPIKE_GROUP
    print(f"largest per-group gradient norm at the injected step and layer: {found}")
    try:
        plot.observed_heatmap(history, path=args.out, title="gradient norm per group (tiny GPT, spike injected)")
        print(f"heatmap saved to {args.out}")
    except ImportError as error:
        print(f"no heatmap: {error}")
    if not found:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
