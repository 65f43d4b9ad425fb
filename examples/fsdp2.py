"""FSDP2 (``fully_shard``) with gradtx clipping: the global norm of DTensor gradients, exact.

After ``fully_shard`` every parameter and gradient is a DTensor: each rank holds one shard
(``Shard(0)``) and, with a 2-D (HSDP) mesh, identical copies along the replicate axis
(``Replicate()``). gradtx reads those placements, sums ``|g|^2`` over the pieces this rank owns
(a copy only at replicate coordinate 0) and runs one all-reduce, so ``clip_by_global_norm`` needs
no spec. A norm of the local shards alone would be wrong; the script prints both.

To show the numbers are the right ones, every rank also trains a dense twin of the model (plain
tensors, the full global batch, ``torch.nn.utils.clip_grad_norm_`` + ``torch.optim.AdamW``) and
compares its norm every step, and the parameters at the end.

Run:  torchrun --standalone --nproc_per_node 2 examples/fsdp2.py   (1-D mesh: 2 shards)
      torchrun --standalone --nproc_per_node 4 examples/fsdp2.py   (2-D mesh: 2 replicas x 2 shards)
      python examples/fsdp2.py                                       (a world of one, for a quick look)
      GRADTX_EXAMPLES_QUICK=1 ...  a few steps, as the tests run it
"""

from __future__ import annotations

import copy
import gc
import os

import torch
import torch.distributed as dist
from sklearn.datasets import load_digits
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from tqdm import tqdm

import gradtx as gtx

QUICK = os.environ.get("GRADTX_EXAMPLES_QUICK") == "1"
EPOCHS = 1 if QUICK else 4
STEPS_LIMIT = 5 if QUICK else None
GLOBAL_BATCH = 64
MAX_NORM = 0.5
LR = 2e-3


def setup() -> tuple[int, int]:
    """Joins the torchrun world on gloo (CPU); run as plain ``python``, makes a world of one."""
    if "RANK" in os.environ:
        dist.init_process_group("gloo")
    else:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return dist.get_rank(), dist.get_world_size()


def build_mesh(world_size: int):
    """1-D ``("shard",)`` mesh, or for 4, 6, 8... ranks a 2-D ``("replicate", "shard")`` (HSDP) mesh."""
    if world_size >= 4 and world_size % 2 == 0:
        return init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("replicate", "shard"))
    return init_device_mesh("cpu", (world_size,), mesh_dim_names=("shard",))


def build_model() -> nn.Module:
    return nn.Sequential(
        nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 10)
    )


def main() -> int:
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)
    rank, world_size = setup()
    mesh = build_mesh(world_size)
    torch.manual_seed(0)

    digits = load_digits()
    x_all = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y_all = torch.tensor(digits.target)
    train_x, train_y, test_x, test_y = x_all[:1500], y_all[:1500], x_all[1500:], y_all[1500:]

    model = build_model()
    dense = copy.deepcopy(model)  # the twin: the same initial weights, never sharded
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)

    # The FSDP2 model: gradients are DTensors; the clip finds their layout itself.
    optimizer = gtx.wrap(torch.optim.AdamW(model.parameters(), lr=LR), gtx.clip_by_global_norm(MAX_NORM), model=model)
    dense_optimizer = torch.optim.AdamW(dense.parameters(), lr=LR)

    if rank == 0:
        weight = next(model.parameters())
        print(f"world size {world_size}, mesh {tuple(mesh.mesh_dim_names)} {tuple(mesh.shape)}; "
              f"first weight: global {tuple(weight.shape)}, local {tuple(weight.to_local().shape)}, "
              f"placements {weight.placements}")

    local_batch = GLOBAL_BATCH // world_size
    steps_per_epoch = len(train_x) // GLOBAL_BATCH
    total = steps_per_epoch * EPOCHS if STEPS_LIMIT is None else STEPS_LIMIT
    generator = torch.Generator().manual_seed(0)  # the same batches on every rank
    worst_norm_error = 0.0
    progress = tqdm(total=total, desc="training", unit="step", disable=rank != 0, dynamic_ncols=True)
    step = 0
    while step < total:
        order = torch.randperm(len(train_x), generator=generator)
        for i in range(steps_per_epoch):
            if step == total:
                break
            batch = order[i * GLOBAL_BATCH : (i + 1) * GLOBAL_BATCH]
            mine = batch[rank * local_batch : (rank + 1) * local_batch]  # this rank's part

            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(model(train_x[mine]), train_y[mine])
            loss.backward()  # FSDP2 reduce-scatters: each rank keeps its shard of the mean gradient
            local_norm = torch.linalg.vector_norm(
                torch.stack([torch.linalg.vector_norm(p.grad.to_local()) for p in model.parameters()])
            )
            optimizer.step()  # gradtx: one all-reduce for the exact global norm, clip, then AdamW
            norm = optimizer.tx_state.norm  # the norm before clipping

            dense_optimizer.zero_grad()
            dense_loss = nn.functional.cross_entropy(dense(train_x[batch]), train_y[batch])
            dense_loss.backward()
            dense_norm = torch.nn.utils.clip_grad_norm_(dense.parameters(), MAX_NORM)
            dense_optimizer.step()

            worst_norm_error = max(worst_norm_error, abs(norm.item() - dense_norm.item()) / dense_norm.item())
            progress.set_postfix(loss=f"{loss.item():.3f}", gradtx_norm=f"{norm.item():.4f}",
                                 dense_norm=f"{dense_norm.item():.4f}", local_shards=f"{local_norm.item():.4f}")
            progress.update()
            step += 1
    progress.close()

    full = {name: p.full_tensor() for name, p in model.named_parameters()}  # all-gathers (every rank joins)
    param_error = max((full[name] - p).abs().max().item() for name, p in dense.named_parameters())
    with torch.no_grad():
        logits = torch.func.functional_call(dense, full, (test_x,))
        accuracy = (logits.argmax(1) == test_y).float().mean().item()
    if rank == 0:
        print(f"last step: gradtx norm {norm.item():.6f}, dense norm {dense_norm.item():.6f}, "
              f"norm of this rank's shards alone {local_norm.item():.6f}")
        print(f"largest relative norm difference over {total} steps: {worst_norm_error:.2e}")
        print(f"largest parameter difference from the dense twin: {param_error:.2e}")
        print(f"test accuracy {accuracy:.3f}")
        ok = worst_norm_error < 1e-4 and param_error < 1e-4
        print("FSDP2 + gradtx matches dense training with clip_grad_norm_" if ok else "MISMATCH")
    return 0 if worst_norm_error < 1e-4 and param_error < 1e-4 else 1


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
    status = main()
    shutdown()
    raise SystemExit(status)
