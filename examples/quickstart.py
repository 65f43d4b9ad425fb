"""gradtx quickstart: a small CNN on scikit-learn's handwritten digits, trained functionally.

The parameters are a plain dict of tensors. ``torch.func.grad_and_value`` gives the gradients as a
dict with the same keys (and the loss), and one gradtx chain turns them into updates:

    clip_by_global_norm(1.0)                      torch.nn.utils.clip_grad_norm_'s numbers
    adamw(learning_rate=<warmup + cosine decay>)  optax's AdamW; the schedule lives in its state

Nothing is mutated along the way: ``tx.update`` returns new updates and a new state, and
``apply_updates`` returns new parameters. The norm of the gradients *before* clipping is kept in
the clip's state, so it is logged without a second pass over the gradients.

Run:  python examples/quickstart.py          (about 10 s on 2 CPU cores; no download)
      GRADTX_EXAMPLES_QUICK=1 python examples/quickstart.py   (a few steps, as the tests run it)
"""

from __future__ import annotations

import os

import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn
from torch.func import functional_call, grad_and_value
from tqdm import tqdm

import gradtx as gtx

QUICK = os.environ.get("GRADTX_EXAMPLES_QUICK") == "1"
EPOCHS = 1 if QUICK else 12
BATCH_SIZE = 64
MAX_NORM = 1.0


def load_data() -> tuple[torch.Tensor, ...]:
    """The 1797 8x8 digit images of scikit-learn (shipped with the package), split 80/20."""
    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0  # (N, 1, 8, 8) in [0, 1]
    labels = torch.tensor(digits.target, dtype=torch.int64)
    train_x, test_x, train_y, test_y = train_test_split(
        images, labels, test_size=0.2, random_state=0, stratify=labels
    )
    return train_x, train_y, test_x, test_y


def make_model() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 16, kernel_size=3, padding=1),
        nn.ReLU(),
        nn.Conv2d(16, 32, kernel_size=3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),  # 8x8 -> 4x4
        nn.Flatten(),
        nn.Linear(32 * 4 * 4, 64),
        nn.ReLU(),
        nn.Linear(64, 10),
    )


def main() -> None:
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)  # a model this small runs fastest on one thread
    torch.manual_seed(0)
    train_x, train_y, test_x, test_y = load_data()
    model = make_model()
    params = {name: p.detach() for name, p in model.named_parameters()}

    def loss_fn(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = functional_call(model, params, (x,))
        return nn.functional.cross_entropy(logits, y)

    @torch.no_grad()
    def accuracy(params: dict[str, torch.Tensor]) -> float:
        predictions = functional_call(model, params, (test_x,)).argmax(dim=1)
        return (predictions == test_y).float().mean().item()

    steps_per_epoch = len(train_x) // BATCH_SIZE
    total_steps = EPOCHS * steps_per_epoch
    schedule = gtx.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=3e-3, warmup_steps=max(total_steps // 10, 1), decay_steps=total_steps
    )
    tx = gtx.chain(
        gtx.clip_by_global_norm(MAX_NORM),
        gtx.adamw(learning_rate=schedule, weight_decay=1e-4),
    )
    opt_state = tx.init(params)
    grad_fn = grad_and_value(loss_fn)  # (gradients as a dict like params, loss)

    print(f"digits: {len(train_x)} train / {len(test_x)} test images, {sum(p.numel() for p in params.values())} parameters")
    print(f"test accuracy before training: {accuracy(params):.3f}")
    progress = tqdm(total=total_steps, desc="training", unit="step", dynamic_ncols=True)
    for epoch in range(EPOCHS):
        order = torch.randperm(len(train_x))
        for i in range(steps_per_epoch):
            batch = order[i * BATCH_SIZE : (i + 1) * BATCH_SIZE]
            x, y = train_x[batch], train_y[batch]
            grads, loss = grad_fn(params, x, y)
            updates, opt_state = tx.update(grads, opt_state, params)  # pure: returns new things
            params = gtx.apply_updates(params, updates)
            grad_norm = opt_state[0].norm  # the global norm before clipping, from the clip's state
            progress.set_postfix(loss=f"{loss.item():.3f}", grad_norm=f"{grad_norm.item():.3f}")
            progress.update()
        with torch.no_grad():
            train_loss = loss_fn(params, train_x, train_y).item()
        progress.write(
            f"epoch {epoch + 1:2d}  train loss {train_loss:.4f}  test accuracy {accuracy(params):.3f}  "
            f"grad norm before clipping {grad_norm.item():.3f} (max {MAX_NORM})"
        )
    progress.close()
    print(f"final test accuracy: {accuracy(params):.3f}")


if __name__ == "__main__":
    main()
