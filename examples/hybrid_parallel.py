"""Exact gradient clipping under pipeline x tensor parallelism with a tied embedding.

A tiny GPT is split over 2 pipeline stages x 2 tensor-parallel ranks (4 processes, gloo on CPU),
with hand-written Megatron-style layers: a vocabulary-parallel embedding, column-parallel QKV and
MLP-in projections, row-parallel output projections, replicated biases and norms, and an LM head
tied to the embedding (its copy lives on the last stage; the two copies' gradients are summed over
the pipeline group, as Megatron does). One ``ShardingSpec`` declares that layout, and
``clip_by_global_norm(max_norm, spec)`` clips with the norm of the *logical* gradient, computed
with a single all-reduce over the pp x tp group. Every step, rank 0 prints that norm beside the
norm of the same model's gradient computed unsharded (every rank also runs the dense model):
they are equal, and so the two models stay equal as they train.

Run:  torchrun --standalone --nproc_per_node 4 examples/hybrid_parallel.py
"""

from __future__ import annotations

import gc
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from tqdm import tqdm

import gradtx as gtx
from gradtx.sharding import Replicate, Shard, ShardingSpec

VOCAB, D, HEADS, FFN, SEQ, BATCH = 32, 16, 4, 64, 8, 4
QUICK = os.environ.get("GRADTX_EXAMPLES_QUICK") == "1"  # a few steps, as the tests run it
STEPS, LR, MAX_NORM = (2 if QUICK else 5), 0.5, 0.5
PP, TP = 2, 2

# The layout, declared once: glob rules over parameter paths, matched in order.
RULES = [
    ("embed.weight", Shard("tp", dim=0)),  # vocabulary-parallel
    ("lm_head.weight", Shard("tp", dim=0, duplicate=True)),  # tied copy of the embedding
    # column-parallel by heads: a rank holds its heads' q, k and v rows, not one block of [q; k; v]
    # rows, which norms and optimizers do not mind; a checkpoint of it resumes at TP 2 only (a
    # layout that resumes anywhere keeps each head's rows together: docs/sharding.md, checkpoints)
    ("*.qkv.*", Shard("tp", dim=0)),
    ("*.fc1.*", Shard("tp", dim=0)),  # column-parallel
    ("*.proj.weight", Shard("tp", dim=1)),  # row-parallel
    ("*.fc2.weight", Shard("tp", dim=1)),  # row-parallel
]


# --------------------------------------------------------------------------- tensor-parallel ops


class Parallel:
    """The communication of a tensor-parallel layer; ``Parallel(None)`` is the dense model's (none)."""

    def __init__(self, group):
        self.group = group

    def copy(self, x):  # column-parallel input: identity forward, all-reduce backward
        return x if self.group is None else _CopyToGroup.apply(x, self.group)

    def reduce(self, x):  # row-parallel output: all-reduce forward, identity backward
        return x if self.group is None else _ReduceFromGroup.apply(x, self.group)

    def gather(self, x):  # vocabulary-parallel logits -> all logits
        return x if self.group is None else _GatherFromGroup.apply(x, self.group)


class _CopyToGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFromGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group, ctx.rank, ctx.width = group, dist.get_rank(group), x.shape[-1]
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, grad):
        return grad[..., ctx.rank * ctx.width : (ctx.rank + 1) * ctx.width].contiguous(), None


# --------------------------------------------------------------------------- the model


def dense_params(seed: int = 0) -> dict[str, torch.Tensor]:
    """The unsharded model (two layers; the LM head is the embedding)."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=0.2):
        return torch.randn(*shape, generator=gen) * scale

    params = {"embed.weight": randn(VOCAB, D, scale=1.0)}
    for i in range(PP):
        p = f"layers.{i}."
        params.update(
            {
                p + "ln1.weight": 1 + randn(D, scale=0.1),
                p + "ln1.bias": randn(D, scale=0.1),
                p + "attn.qkv.weight": randn(3 * D, D),
                p + "attn.qkv.bias": randn(3 * D, scale=0.1),
                p + "attn.proj.weight": randn(D, D),
                p + "attn.proj.bias": randn(D, scale=0.1),
                p + "ln2.weight": 1 + randn(D, scale=0.1),
                p + "ln2.bias": randn(D, scale=0.1),
                p + "mlp.fc1.weight": randn(FFN, D),
                p + "mlp.fc1.bias": randn(FFN, scale=0.1),
                p + "mlp.fc2.weight": randn(D, FFN),
                p + "mlp.fc2.bias": randn(D, scale=0.1),
            }
        )
    params.update({"ln_f.weight": 1 + randn(D, scale=0.1), "ln_f.bias": randn(D, scale=0.1)})
    return params


def shard_params(dense: dict[str, torch.Tensor], stage: int, tp_rank: int) -> dict[str, torch.Tensor]:
    """This rank's pieces: its stage's leaves, cut for tensor parallelism as ``RULES`` declares."""
    heads = slice(tp_rank * HEADS // TP, (tp_rank + 1) * HEADS // TP)

    def rows(x):  # contiguous slice along dim 0
        return x.chunk(TP, 0)[tp_rank]

    def qkv(x):  # the q, k and v rows of this rank's heads
        return x.reshape(3, HEADS, D // HEADS, *x.shape[1:])[:, heads].reshape(-1, *x.shape[1:])

    local = {}
    for name, x in dense.items():
        if name.startswith("layers."):
            if int(name.split(".")[1]) != stage:
                continue
            if ".qkv." in name:
                x = qkv(x)
            elif ".fc1." in name:
                x = rows(x)
            elif name.endswith(("proj.weight", "fc2.weight")):
                x = x.chunk(TP, 1)[tp_rank]
        elif name == "embed.weight":
            if stage == PP - 1:
                local["lm_head.weight"] = rows(x).clone()
            if stage != 0:
                continue
            x = rows(x)
        elif name.startswith("ln_f.") and stage != PP - 1:
            continue
        local[name] = x.clone()
    return local


def embed(params, ids, tp: Parallel, tp_rank: int):
    """Vocabulary-parallel lookup: each rank embeds the ids in its slice of the vocabulary."""
    weight = params["embed.weight"]
    if tp.group is None:
        return F.embedding(ids, weight)
    start = tp_rank * weight.shape[0]
    mine = (ids >= start) & (ids < start + weight.shape[0])
    out = F.embedding(torch.where(mine, ids - start, 0), weight) * mine.unsqueeze(-1)
    return tp.reduce(out)


def block(params, i: int, x, tp: Parallel):
    p = f"layers.{i}."
    h = F.layer_norm(x, (D,), params[p + "ln1.weight"], params[p + "ln1.bias"])
    qkv = F.linear(tp.copy(h), params[p + "attn.qkv.weight"], params[p + "attn.qkv.bias"])
    q, k, v = qkv.reshape(BATCH, SEQ, 3, -1, D // HEADS).permute(2, 0, 3, 1, 4)  # local heads only
    attn = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(BATCH, SEQ, -1)
    x = x + tp.reduce(F.linear(attn, params[p + "attn.proj.weight"])) + params[p + "attn.proj.bias"]
    h = F.layer_norm(x, (D,), params[p + "ln2.weight"], params[p + "ln2.bias"])
    h = F.gelu(F.linear(tp.copy(h), params[p + "mlp.fc1.weight"], params[p + "mlp.fc1.bias"]))
    return x + tp.reduce(F.linear(h, params[p + "mlp.fc2.weight"])) + params[p + "mlp.fc2.bias"]


def head_loss(params, x, targets, tp: Parallel, head: str):
    x = F.layer_norm(x, (D,), params["ln_f.weight"], params["ln_f.bias"])
    logits = tp.gather(F.linear(tp.copy(x), params[head]))
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def dense_loss(params, ids, targets):
    dense = Parallel(None)
    x = embed(params, ids, dense, 0)
    for i in range(PP):
        x = block(params, i, x, dense)
    return head_loss(params, x, targets, dense, "embed.weight")


# --------------------------------------------------------------------------- one pipelined step


def sharded_grads(params, ids, targets, mesh, stage: int, tp_rank: int):
    """Forward and backward of one batch through the two stages; returns this rank's gradients."""
    tp = Parallel(mesh.get_group("tp"))
    coordinate = {"pp": stage, "tp": tp_rank}
    peer = int(mesh.mesh[1 - stage, tp_rank])  # the same tp rank on the other stage
    params = {k: v.detach().requires_grad_() for k, v in params.items()}
    if stage == 0:
        out = block(params, 0, embed(params, ids, tp, tp_rank), tp)
        dist.send(out.detach().contiguous(), dst=peer)
        grad_out = torch.empty_like(out)
        dist.recv(grad_out, src=peer)
        out.backward(grad_out)
    else:
        x = torch.empty(BATCH, SEQ, D)
        dist.recv(x, src=peer)
        x.requires_grad_()
        head_loss(params, block(params, 1, x, tp), targets, tp, "lm_head.weight").backward()
        dist.send(x.grad.contiguous(), dst=peer)
    grads = {k: v.grad for k, v in params.items()}
    # The tied embedding: sum the two copies' gradients over the pipeline group.
    tied = grads["embed.weight" if coordinate["pp"] == 0 else "lm_head.weight"]
    dist.all_reduce(tied, group=mesh.get_group("pp"))
    return grads


def main() -> int:
    dist.init_process_group("gloo")
    if dist.get_world_size() != PP * TP:
        raise SystemExit(f"run with --nproc_per_node {PP * TP}")
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (PP, TP), mesh_dim_names=("pp", "tp"))
    stage, tp_rank = mesh.get_coordinate()
    spec = ShardingSpec(mesh, RULES, stage_axis="pp", default=Replicate())
    clip = gtx.clip_by_global_norm(MAX_NORM, spec)
    dense_clip = gtx.clip_by_global_norm(MAX_NORM)

    dense = dense_params()
    params = shard_params(dense, stage, tp_rank)
    clip_state, dense_state = clip.init(params), dense_clip.init(dense)
    data = torch.Generator().manual_seed(1)
    worst = 0.0
    progress = tqdm(range(STEPS), desc="training", unit="step", disable=dist.get_rank() != 0)
    for step in progress:
        ids = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=data)
        inputs, targets = ids[:, :-1], ids[:, 1:]

        grads = sharded_grads(params, inputs, targets, mesh, stage, tp_rank)
        updates, clip_state = clip.update(grads, clip_state)
        params = {k: v - LR * updates[k] for k, v in params.items()}

        dense_params_now = {k: v.detach().requires_grad_() for k, v in dense.items()}
        loss = dense_loss(dense_params_now, inputs, targets)
        loss.backward()
        dense_grads = {k: v.grad for k, v in dense_params_now.items()}
        dense_updates, dense_state = dense_clip.update(dense_grads, dense_state)
        dense = {k: v - LR * dense_updates[k] for k, v in dense.items()}

        sharded_norm, unsharded_norm = float(clip_state.norm), float(dense_state.norm)
        worst = max(worst, abs(sharded_norm - unsharded_norm) / unsharded_norm)
        if dist.get_rank() == 0:
            progress.write(
                f"step {step}  loss {loss.item():.4f}  sharded norm {sharded_norm:.6f}  "
                f"unsharded norm {unsharded_norm:.6f}"
            )
    # Every rank's pieces still equal the matching pieces of the dense model.
    drift = max(float((v - shard_params(dense, stage, tp_rank)[k]).abs().max()) for k, v in params.items())
    ok = worst < 1e-5 and drift < 1e-4
    if dist.get_rank() == 0:
        print(f"largest relative norm difference {worst:.2e}; parameters drift {drift:.2e}: {'equal' if ok else 'DIFFERENT'}")
    return 0 if ok else 1


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
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    status = main()
    shutdown()
    raise SystemExit(status)
