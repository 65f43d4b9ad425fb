"""Muon under FSDP2: each rank's update is its slice of Muon's update of the whole matrix.

Muon orthogonalizes each weight matrix's momentum (Newton-Schulz iterations), which needs the
whole matrix, while FSDP2 (``fully_shard``) leaves each rank one ``Shard(0)`` slice of it (with an
HSDP mesh, identical copies along the replicate axis). ``gradtx.contrib.muon`` reads the DTensor
placements and, for each matrix, brings the slices to one owner rank, orthogonalizes there and sends
every rank its slice back (``gradtx.sharding.matrices``): the result is exact, whatever the shard
sizes (the MLP's 75 hidden units split unevenly over 2 shards here).

A small GPT (token and position embeddings, two pre-norm transformer blocks, an lm head) trains on
synthetic sequences (a random first token, then a fixed rule). ``gtx.partition`` routes the blocks'
2-D weights to Muon and everything else (embeddings, lm head, norms, biases) to AdamW; the chain runs
functionally on the DTensor parameters. Every rank also trains a dense twin (plain tensors, the full
global batch, the same chain) and compares the parameters after every step.

Run:  torchrun --standalone --nproc_per_node 4 examples/muon_fsdp2.py   (HSDP: 2 replicas x 2 shards)
      torchrun --standalone --nproc_per_node 2 examples/muon_fsdp2.py   (1-D mesh: 2 shards)
      python examples/muon_fsdp2.py                                       (a world of one)
      GRADTX_EXAMPLES_QUICK=1 ...  a few steps, as the tests run it
"""

from __future__ import annotations

import copy
import gc
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import _tiny_gpt as tiny_gpt  # the model and language (examples/_tiny_gpt.py)
import gradtx as gtx
from gradtx.contrib import muon

QUICK = os.environ.get("GRADTX_EXAMPLES_QUICK") == "1"
STEPS = 4 if QUICK else 60
VOCAB, CONTEXT, WIDTH, HEADS, MLP_HIDDEN = 64, 16, 32, 4, 75
GLOBAL_BATCH = 16
TOLERANCE = 1e-4


def label(name: str, param: torch.Tensor) -> str:
    """Muon for the blocks' matrices, AdamW for embeddings, the lm head, norms and biases."""
    return "muon" if name.startswith("blocks.") and param.ndim == 2 else "adamw"


def optimizer(labels: dict[str, str]) -> gtx.GradientTransformation:
    return gtx.partition(
        {"muon": muon(learning_rate=0.02, weight_decay=0.01), "adamw": gtx.adamw(3e-3, weight_decay=0.01)},
        labels,
    )


def loss_fn(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def sequences(generator: torch.Generator) -> torch.Tensor:
    return tiny_gpt.sequences(generator, GLOBAL_BATCH, VOCAB, CONTEXT)


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


def main() -> int:
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)
    rank, world_size = setup()
    mesh = build_mesh(world_size)
    torch.manual_seed(0)
    model = tiny_gpt.GPT(VOCAB, CONTEXT, WIDTH, HEADS, MLP_HIDDEN)
    dense = copy.deepcopy(model)  # the twin: the same initial weights, never sharded
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)

    labels = {name: label(name, p) for name, p in model.named_parameters()}
    params = dict(model.named_parameters())  # DTensors, updated in place below
    tx = optimizer(labels)
    state = tx.init({name: p.detach() for name, p in params.items()})
    dense_params = {name: p.detach().clone() for name, p in dense.named_parameters()}
    dense_tx = optimizer(labels)
    dense_state = dense_tx.init(dense_params)

    if rank == 0:
        fc1 = model.blocks[0].fc1.weight
        print(f"world size {world_size}, mesh {tuple(mesh.mesh_dim_names)} {tuple(mesh.shape)}; blocks.0.fc1.weight: "
              f"global {tuple(fc1.shape)}, local {tuple(fc1.to_local().shape)}, placements {fc1.placements}; "
              f"{sum(v == 'muon' for v in labels.values())} matrices on Muon, "
              f"{sum(v == 'adamw' for v in labels.values())} tensors on AdamW")

    local_batch = GLOBAL_BATCH // world_size
    generator = torch.Generator().manual_seed(0)  # the same batches on every rank
    worst = 0.0
    for step in range(STEPS):
        batch = sequences(generator)
        mine = batch[rank * local_batch : (rank + 1) * local_batch]

        model.zero_grad()
        loss = loss_fn(model, mine)
        loss.backward()  # FSDP2 reduce-scatters: each rank keeps its shard of the mean gradient
        grads = {name: p.grad for name, p in params.items()}
        with torch.no_grad():
            updates, state = tx.update(grads, state, {name: p.detach() for name, p in params.items()})
            gtx.apply_updates(params, updates, inplace=True)

        dense_loss, dense_grads = torch.func.grad_and_value(
            lambda p: loss_fn(lambda idx: torch.func.functional_call(dense, p, (idx,)), batch)
        )(dense_params)[::-1]
        dense_updates, dense_state = dense_tx.update(dense_grads, dense_state, dense_params)
        dense_params = gtx.apply_updates(dense_params, dense_updates)

        with torch.no_grad():
            full = {name: p.full_tensor() for name, p in params.items()}  # all-gathers (every rank joins)
        error = max(
            float((full[name] - dense_params[name]).abs().max() / dense_params[name].abs().max().clamp_min(1e-12))
            for name in full
        )
        worst = max(worst, error)
        if rank == 0 and (QUICK or step % 10 == 0 or step == STEPS - 1):
            print(f"step {step:3d}  loss {float(dense_loss):.4f}  largest relative difference from the dense twin {error:.2e}")

    if rank == 0:
        print(f"largest relative parameter difference over {STEPS} steps: {worst:.2e}")
        print("Muon under FSDP2 matches the dense twin" if worst < TOLERANCE else "MISMATCH")
    return 0 if worst < TOLERANCE else 1


def shutdown() -> None:
    """Leaves the process group cleanly: every rank waits for the others, then the group goes."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        gc.collect()
        dist.destroy_process_group()


if __name__ == "__main__":
    status = main()
    shutdown()
    raise SystemExit(status)
