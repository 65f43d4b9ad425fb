"""Colossal-AI's Booster gradient-clipping loop, written with gradtx.

Colossal-AI boosts a model and optimizer, then clips between backward and step::

    booster.backward(loss, optimizer)
    optimizer.clip_grad_by_norm(max_norm=GRADIENT_CLIPPING)
    optimizer.step()
    lr_scheduler.step()

gradtx keeps that loop. ``gtx.wrap`` turns any torch optimizer into a drop-in optimizer with
``clip_grad_by_norm`` / ``clip_grad_by_value``; DDP stands in for the TorchDDPPlugin, a standard
``torch.optim.lr_scheduler`` drives the learning rate, and the data are scikit-learn's digits
(no download). Under DDP every rank holds the same averaged gradients, so every rank computes the
same norm with no extra communication; for tensor / pipeline / expert parallel layouts pass
``spec=`` to ``wrap`` (see docs/sharding.md).

Run:  torchrun --standalone --nproc_per_node 2 examples/colossalai_style.py   (DDP on gloo)
      python examples/colossalai_style.py                                      (one process)
      ... --clip value          clip each element to [-0.05, 0.05] instead of the global norm
      ... --clip chain          put the clip inside the optimizer: wrap(opt, clip_by_global_norm(...))
      GRADTX_EXAMPLES_QUICK=1 ...  a few steps, as the tests run it
"""

from __future__ import annotations

import argparse
import gc
import os

import torch
import torch.distributed as dist
from sklearn.datasets import load_digits
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
from tqdm import tqdm

import gradtx as gtx

QUICK = os.environ.get("GRADTX_EXAMPLES_QUICK") == "1"
NUM_EPOCHS = 1 if QUICK else 6
BATCH_SIZE = 32  # per rank
GRADIENT_CLIPPING = 1.0
CLIP_VALUE = 0.05


def setup() -> tuple[int, int]:
    """Joins the torchrun world (gloo, CPU) if launched by torchrun; else a world of one."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group("gloo")
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def build_model() -> nn.Module:
    """A small residual CNN for 8x8 images (the seed's ResNet, sized for a CPU)."""

    class Block(nn.Module):
        def __init__(self, channels: int):
            super().__init__()
            self.conv1 = nn.Conv2d(channels, channels, 3, padding=1)
            self.conv2 = nn.Conv2d(channels, channels, 3, padding=1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.relu(x + self.conv2(torch.relu(self.conv1(x))))

    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1),
        nn.ReLU(),
        Block(16),
        nn.MaxPool2d(2),
        Block(16),
        nn.Flatten(),
        nn.Linear(16 * 4 * 4, 10),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clip", choices=["norm", "value", "chain"], default="norm")
    args = parser.parse_args()

    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)  # a model this small runs fastest on one thread per process
    rank, world_size = setup()
    torch.manual_seed(0)  # the same initial weights on every rank

    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(digits.target)
    train_dataset = TensorDataset(images[:1500], labels[:1500])
    test_x, test_y = images[1500:], labels[1500:]
    sampler = DistributedSampler(train_dataset, world_size, rank, shuffle=True, drop_last=True) if world_size > 1 else None
    train_dataloader = DataLoader(
        train_dataset, batch_size=BATCH_SIZE, sampler=sampler, shuffle=sampler is None, drop_last=True
    )

    model = build_model()
    if world_size > 1:
        model = DistributedDataParallel(model)  # the TorchDDPPlugin's job
    criterion = nn.CrossEntropyLoss()

    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)
    # The boosted optimizer: still a torch.optim.Optimizer (param_groups, state_dict, schedulers).
    chain = gtx.clip_by_global_norm(GRADIENT_CLIPPING) if args.clip == "chain" else None
    optimizer = gtx.wrap(sgd, chain, model=model)
    total_steps = NUM_EPOCHS * len(train_dataloader)
    lr_scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=total_steps)

    if rank == 0:
        print(f"world size {world_size}, {len(train_dataloader)} steps per epoch, clip mode: {args.clip}")
    progress = tqdm(total=total_steps, desc="training", unit="step", disable=rank != 0, dynamic_ncols=True)
    model.train()
    for epoch in range(NUM_EPOCHS):
        if sampler is not None:
            sampler.set_epoch(epoch)
        for img, label in train_dataloader:
            optimizer.zero_grad()
            train_loss = criterion(model(img), label)
            train_loss.backward()  # DDP averages the gradients across ranks here
            if args.clip == "norm":
                norm = optimizer.clip_grad_by_norm(max_norm=GRADIENT_CLIPPING)  # the norm before clipping
            elif args.clip == "value":
                optimizer.clip_grad_by_value(clip_value=CLIP_VALUE)
                norm = None
            else:
                norm = None  # clipped inside optimizer.step(); read it from the chain's state below
            optimizer.step()
            lr_scheduler.step()
            if args.clip == "chain":
                norm = optimizer.tx_state.norm
            postfix = {"loss": f"{train_loss.item():.3f}", "lr": f"{lr_scheduler.get_last_lr()[0]:.4f}"}
            if norm is not None:
                postfix["grad_norm"] = f"{norm.item():.3f}"
            progress.set_postfix(postfix)
            progress.update()

        ele_1st = next(model.parameters()).flatten()[0]
        model.eval()
        with torch.no_grad():
            accuracy = (model(test_x).argmax(1) == test_y).float().mean().item()
        model.train()
        if rank == 0:
            norm_text = f"  grad norm before clipping {norm.item():.3f}" if norm is not None else ""
            progress.write(
                f"epoch {epoch + 1}  loss {train_loss.item():.4f}{norm_text}  test accuracy {accuracy:.3f}  "
                f"1st element of parameters {ele_1st.item():+.5f}"
            )
    progress.close()

    if world_size > 1:
        # Every rank must have taken identical steps: compare a parameter checksum across ranks.
        checksum = torch.stack([p.detach().double().sum() for p in model.parameters()]).sum().reshape(1)
        gathered = [torch.zeros_like(checksum) for _ in range(world_size)]
        dist.all_gather(gathered, checksum)
        if rank == 0:
            same = all(torch.equal(g, gathered[0]) for g in gathered)
            print(f"parameters identical on all {world_size} ranks: {same}")


def shutdown() -> None:
    """Leaves the process group cleanly, after ``main`` returned and dropped its models.

    Every rank waits for the others (nobody tears down while a peer still talks to it), reference
    cycles are collected (DDP's reducer sits in some, and keeps gloo work alive), and only then is
    the group destroyed. Destroying it while such objects live can abort the process at exit
    ("terminate called without an active exception").
    """
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        gc.collect()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
    shutdown()
