"""DP-SGD: per-example gradients with ``torch.func.vmap``, clipped and noised by gradtx.

Differentially private SGD (Abadi et al., 2016) bounds how much any one example can move the
model: each example's gradient is clipped to L2 norm ``C``, the clipped gradients are summed,
Gaussian noise of standard deviation ``C * noise_multiplier`` is added, and the sum is divided by
the batch size. ``torch.func.vmap(torch.func.grad(loss))`` gives every example's gradient in one
call (a leading batch dimension on every leaf) and ``gtx.dpsgd`` does the rest.

The script trains the same model twice on scikit-learn's digits, without privacy (``gtx.sgd``) and
with it (``gtx.dpsgd``), and prints the fraction of examples the clip scaled down (from
``gtx.per_example_global_norm_clip``, the function inside ``dpsgd``).

Run:  python examples/per_example_dp.py
      GRADTX_EXAMPLES_QUICK=1 python examples/per_example_dp.py   (a few steps, as the tests run it)
"""

from __future__ import annotations

import os

import torch
from sklearn.datasets import load_digits
from torch import nn
from torch.func import functional_call, grad, vmap
from tqdm import tqdm

import gradtx as gtx

QUICK = os.environ.get("GRADTX_EXAMPLES_QUICK") == "1"
EPOCHS = 1 if QUICK else 15
BATCH_SIZE = 128
L2_NORM_CLIP = 1.0
NOISE_MULTIPLIER = 1.0
LEARNING_RATE = 0.5


def main() -> None:
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)  # a model this small runs fastest on one thread
    torch.manual_seed(0)
    digits = load_digits()
    x_all = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y_all = torch.tensor(digits.target)
    train_x, train_y, test_x, test_y = x_all[:1500], y_all[:1500], x_all[1500:], y_all[1500:]

    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 10))
    initial = {name: p.detach().clone() for name, p in model.named_parameters()}

    def example_loss(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The loss of ONE example (vmap adds the batch dimension)."""
        logits = functional_call(model, params, (x.unsqueeze(0),))
        return nn.functional.cross_entropy(logits, y.unsqueeze(0))

    # One gradient per example: every leaf gets a leading batch dimension.
    per_example_grads = vmap(grad(example_loss), in_dims=(None, 0, 0))

    def accuracy(params: dict[str, torch.Tensor]) -> float:
        with torch.no_grad():
            return (functional_call(model, params, (test_x,)).argmax(1) == test_y).float().mean().item()

    def train(tx: gtx.GradientTransformation, private: bool, label: str) -> dict[str, torch.Tensor]:
        params = dict(initial)
        state = tx.init(params)
        steps_per_epoch = len(train_x) // BATCH_SIZE
        progress = tqdm(total=EPOCHS * steps_per_epoch, desc=label, unit="step", dynamic_ncols=True)
        for epoch in range(EPOCHS):
            order = torch.randperm(len(train_x))
            clipped = 0
            for i in range(steps_per_epoch):
                batch = order[i * BATCH_SIZE : (i + 1) * BATCH_SIZE]
                grads = per_example_grads(params, train_x[batch], train_y[batch])  # leaves: (B, *shape)
                if private:
                    # dpsgd clips each example, sums, adds noise and averages: updates have no batch dim.
                    _, num_clipped = gtx.per_example_global_norm_clip(grads, L2_NORM_CLIP)  # for the log only
                    clipped += int(num_clipped)
                else:
                    grads = {name: g.mean(0) for name, g in grads.items()}  # the ordinary batch gradient
                updates, state = tx.update(grads, state, params)
                params = gtx.apply_updates(params, updates)
                progress.update()
            if (epoch + 1) % 3 == 0 or epoch + 1 == EPOCHS:
                text = f"{label}: epoch {epoch + 1:2d}  test accuracy {accuracy(params):.3f}"
                if private:
                    text += f"  examples clipped this epoch {clipped / (steps_per_epoch * BATCH_SIZE):.0%}"
                progress.write(text)
        progress.close()
        return params

    baseline = train(gtx.sgd(learning_rate=LEARNING_RATE, momentum=0.9), private=False, label="sgd  ")
    private = train(
        gtx.dpsgd(
            learning_rate=LEARNING_RATE,
            l2_norm_clip=L2_NORM_CLIP,
            noise_multiplier=NOISE_MULTIPLIER,
            seed=0,
            momentum=0.9,
        ),
        private=True,
        label="dpsgd",
    )
    print(f"test accuracy without privacy {accuracy(baseline):.3f}, with DP-SGD "
          f"(clip {L2_NORM_CLIP}, noise multiplier {NOISE_MULTIPLIER}) {accuracy(private):.3f}")


if __name__ == "__main__":
    main()
