"""wrap under real data parallelism: 2 gloo processes, DistributedDataParallel and a sharded gradient.

Each rank trains on its own data; DDP averages the gradients, the wrapped optimizer clips them
(``clip_grad_by_norm`` between backward and step, or ``clip_by_global_norm`` inside ``step``), and
afterwards every rank must hold identical parameters equal to a single-process run on the whole
batch. A second case shards one gradient's rows across the ranks (ZeRO-style) and checks that the
wrapped optimizer's norm, through ``spec``, is the norm of the whole gradient.
"""

from __future__ import annotations

import datetime
import gc
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import gradtx as gtx

pytestmark = pytest.mark.distributed

WORLD = 2
STEPS = 3


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def data(rank: int, step: int):
    gen = torch.Generator().manual_seed(10 * step + rank)
    return torch.randn(8, 6, generator=gen), torch.randint(0, 3, (8,), generator=gen)


def full_batch(step: int):
    parts = [data(r, step) for r in range(WORLD)]
    return torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts])


def check_ddp(rank: int, clip_in_step: bool) -> None:
    model = make_model()
    ddp = nn.parallel.DistributedDataParallel(model)
    if clip_in_step:
        inner = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
        opt = gtx.wrap(inner, gtx.clip_by_global_norm(0.1), model=ddp)
    else:
        opt = gtx.wrap(torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4), model=ddp)
    reference = make_model()
    ref_opt = (
        torch.optim.AdamW(reference.parameters(), lr=1e-2)
        if clip_in_step
        else torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)
    )
    for step in range(STEPS):
        opt.zero_grad()
        x, y = data(rank, step)
        nn.functional.cross_entropy(ddp(x), y).backward()
        if clip_in_step:
            opt.step()
            norm = opt.tx_state.norm
        else:
            norm = opt.clip_grad_by_norm(max_norm=0.1)
            assert float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])) <= 0.1 + 1e-6
            opt.step()

        ref_opt.zero_grad()
        x, y = full_batch(step)
        nn.functional.cross_entropy(reference(x), y).backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.1)
        ref_opt.step()
        torch.testing.assert_close(norm, ref_norm, rtol=1e-5, atol=1e-7)

        norms = [torch.zeros(()) for _ in range(WORLD)]
        dist.all_gather(norms, norm.reshape(()))
        assert torch.equal(norms[0], norms[1]), norms

    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.zeros_like(flat) for _ in range(WORLD)]
    dist.all_gather(gathered, flat)
    assert torch.equal(gathered[0], gathered[1]), "ranks diverged"
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    assert opt._names[0] == "module.0.weight"


def check_sharded_rows(rank: int) -> None:
    mesh = dist.device_mesh.init_device_mesh("cpu", (WORLD,), mesh_dim_names=("dp",))
    spec = gtx.sharding.ShardingSpec(mesh, [("*", gtx.sharding.Shard("dp"))])
    gen = torch.Generator().manual_seed(5)
    full_param, full_grad = torch.randn(8, 4, generator=gen), torch.randn(8, 4, generator=gen) * 3
    rows = slice(4 * rank, 4 * rank + 4)

    # clip_grad_by_norm between backward and step, sharded through spec
    shard = full_param[rows].clone().requires_grad_()
    opt = gtx.wrap(torch.optim.SGD([shard], lr=0.1), spec=spec)
    shard.grad = full_grad[rows].clone()
    norm = opt.clip_grad_by_norm(1.0)
    opt.step()

    reference = full_param.clone().requires_grad_()
    reference.grad = full_grad.clone()
    ref_norm = torch.nn.utils.clip_grad_norm_([reference], 1.0)
    torch.optim.SGD([reference], lr=0.1).step()
    torch.testing.assert_close(norm, ref_norm, rtol=1e-6, atol=0)
    torch.testing.assert_close(shard.detach(), reference.detach()[rows], rtol=1e-6, atol=1e-7)

    # the same clip inside step, as the wrapped chain
    shard = full_param[rows].clone().requires_grad_()
    opt = gtx.wrap(torch.optim.SGD([shard], lr=0.1), gtx.clip_by_global_norm(1.0, spec))
    shard.grad = full_grad[rows].clone()
    opt.step()
    torch.testing.assert_close(opt.tx_state.norm, ref_norm, rtol=1e-6, atol=0)
    torch.testing.assert_close(shard.detach(), reference.detach()[rows], rtol=1e-6, atol=1e-7)


def worker(rank: int, init_file: str) -> None:
    torch.set_num_threads(1)  # forked from a process that may have run OpenMP regions: start none
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=60)
    )
    try:
        check_ddp(rank, clip_in_step=False)
        check_ddp(rank, clip_in_step=True)
        check_sharded_rows(rank)
        dist.barrier()  # nobody tears down while the other rank still talks to it
    finally:
        # DDP's reducer sits in reference cycles: collect it so no gloo thread outlives the group
        # (a joinable thread destroyed at interpreter exit aborts the process).
        gc.collect()
        dist.destroy_process_group()


def test_wrapped_optimizer_under_ddp_and_sharded_gradients(tmp_path):
    init_file = os.path.join(tmp_path, "rendezvous")
    import torch._dynamo  # noqa: F401  (DistributedDataParallel imports it: once here, not on every rank)

    # fork: the ranks start with torch, dynamo, gradtx and this module imported (a fresh
    # interpreter each costs seconds on a small machine)
    start = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
    mp.start_processes(worker, args=(init_file,), nprocs=WORLD, join=True, start_method=start)
