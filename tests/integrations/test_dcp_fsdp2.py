"""A wrapped optimizer under FSDP2, checkpointed through torch.distributed.checkpoint: 2 gloo ranks.

Each rank trains its FSDP2-sharded model (``fully_shard``: parameters and gradients are DTensors)
with a wrapped optimizer whose chain keeps counters (a clip, a scheduled scale, accumulation over 2
calls, a finite check). At step k the run saves with ``get_state_dict`` + ``dcp.save`` and goes on;
fresh model and optimizer objects then load with ``dcp.load`` + ``set_state_dict`` and go on too.
Both must end bit for bit where the uninterrupted run does, on every rank; so must a chain holding
``quantize_state``, whose codes and scales are plain pieces of the DTensor params' state. And a wrapped optimizer
built before the model is sharded, its parameters swapped for DTensor shards afterwards as
accelerate does, trains on with its chain's state following the parameters.
"""

from __future__ import annotations

import datetime
import gc
import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

from _ranks import run_ranks

pytestmark = pytest.mark.distributed

WORLD = 2
STEPS = 6
SAVE_AT = 3  # mid-accumulation: MultiSteps holds one gradient


def make_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def shard(model: nn.Module, mesh) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def make_optimizer(model: nn.Module, inner: str):
    import gradtx as gtx

    scheduled = gtx.inject_hyperparams(gtx.scale)(step_size=gtx.linear_schedule(1.0, 0.25, STEPS))
    tx = gtx.apply_if_finite(
        gtx.MultiSteps(gtx.chain(gtx.clip_by_global_norm(0.5), scheduled), 2).gradient_transformation(), 3
    )
    if inner == "quantized":  # the chain keeps 8-bit moments: plain pieces of DTensor params' state
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        return gtx.wrap(opt, gtx.chain(gtx.quantize_state(gtx.adam(1e-2), 8, min_size=64), gtx.scale(-1.0)), model=model)
    if inner == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    else:  # stateless: DCP's initialising step runs on the live optimizer when it saves
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return gtx.wrap(opt, tx, model=model)


def train(model: nn.Module, opt, rank: int, steps: range) -> None:
    for step in steps:
        gen = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(4, 6, generator=gen), torch.randint(0, 3, (4,), generator=gen)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    opt.zero_grad()


def full_params(model: nn.Module) -> list[torch.Tensor]:
    return [p.full_tensor().detach().clone() for p in model.parameters()]


def check(rank: int, mesh, inner: str, checkpoint_dir: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    straight = shard(make_model(0), mesh)
    opt = make_optimizer(straight, inner)
    train(straight, opt, rank, range(STEPS))
    expected = full_params(straight)

    saving = shard(make_model(0), mesh)
    opt = make_optimizer(saving, inner)
    train(saving, opt, rank, range(SAVE_AT))
    model_sd, optim_sd = get_state_dict(saving, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=checkpoint_dir)
    train(saving, opt, rank, range(SAVE_AT, STEPS))
    for got, want in zip(full_params(saving), expected):
        assert torch.equal(got, want), f"{inner}: saving changed the run that saved"

    resumed = shard(make_model(7), mesh)
    opt = make_optimizer(resumed, inner)
    model_sd, optim_sd = get_state_dict(resumed, opt)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=checkpoint_dir)
    set_state_dict(resumed, opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
    if inner != "quantized":
        assert int(opt.tx_state.inner_state.mini_step) == 1
    train(resumed, opt, rank, range(SAVE_AT, STEPS))
    for got, want in zip(full_params(resumed), expected):
        assert torch.equal(got, want), f"{inner}: the resumed run differs from the uninterrupted one"


def accelerate_style_prepare(model: nn.Module, opt, mesh) -> nn.Module:
    """What accelerate's FSDP2 preparation does to an optimizer that exists already: its parameters
    become placeholders remembering the old addresses, the model is sharded, and accelerate's own
    ``fsdp2_switch_optimizer_parameters`` puts the new DTensor parameters in their place."""
    from accelerate.utils.fsdp_utils import fsdp2_switch_optimizer_parameters

    old = {name: p.data_ptr() for name, p in model.named_parameters()}
    for group in opt.param_groups:
        for i, p in enumerate(group["params"]):
            placeholder = torch.empty(1, dtype=p.dtype, device=p.device)
            placeholder.data_ptr = p.data_ptr()
            group["params"][i] = placeholder
    model = shard(model, mesh)
    new = dict(model.named_parameters())
    fsdp2_switch_optimizer_parameters(opt, {ptr: new[name] for name, ptr in old.items()})
    return model


def check_accelerate_swap(rank: int, mesh) -> None:
    """A wrapped optimizer built before the model is sharded (HF Trainer + accelerate + FSDP2): the
    chain's per-parameter state (a momentum trace) follows the swap to DTensor shards, keeps its
    values, and the run equals a dense one on the whole batch."""
    import gradtx as gtx

    def make(model):
        # a stateless inner optimizer: accelerate does not move an inner optimizer's state (it prepares
        # before the first step); the chain's momentum is what must follow the parameters here
        tx = gtx.chain(gtx.clip_by_global_norm(0.5), gtx.trace(decay=0.9))
        return gtx.wrap(torch.optim.SGD(model.parameters(), lr=0.1, weight_decay=0.1), tx, model=model)

    def data(step: int, r: int):
        gen = torch.Generator().manual_seed(100 * step + r)
        return torch.randn(4, 6, generator=gen), torch.randint(0, 3, (4,), generator=gen)

    def step_on(model, opt, batches) -> None:
        opt.zero_grad()
        x, y = (torch.cat(parts) for parts in zip(*batches))
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    dense, model = make_model(0), make_model(0)
    dense_opt, opt = make(dense), make(model)
    for m, o in ((dense, dense_opt), (model, opt)):  # one step before sharding, the same on every rank
        step_on(m, o, [data(0, 0)])
    model = accelerate_style_prepare(model, opt, mesh)
    for step in range(1, 4):
        step_on(model, opt, [data(step, rank)])
        step_on(dense, dense_opt, [data(step, r) for r in range(WORLD)])  # FSDP2 averages the ranks' means
    trace = opt.tx_state[1].trace
    assert all(type(t).__name__ == "DTensor" for t in trace.values())
    for got, want in zip(full_params(model), dense.parameters()):
        torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-6)
    for name, t in trace.items():
        torch.testing.assert_close(t.full_tensor(), dense_opt.tx_state[1].trace[name], rtol=1e-5, atol=1e-6)


def worker(rank: int, init_file: str, checkpoint_root: str) -> None:
    timeout = datetime.timedelta(seconds=30)
    dist.distributed_c10d.default_pg_timeout = timeout
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD, timeout=timeout)
    try:
        torch.set_num_threads(1)
        mesh = dist.device_mesh.init_device_mesh("cpu", (WORLD,))  # no axis names, as fully_shard's default
        for inner in ("adamw", "sgd", "quantized"):
            check(rank, mesh, inner, os.path.join(checkpoint_root, inner))
        check_accelerate_swap(rank, mesh)
        dist.barrier()
    finally:
        gc.collect()
        dist.destroy_process_group()


def test_fsdp2_dcp_save_and_resume_equal_the_uninterrupted_run(tmp_path):
    preload = ("torch._dynamo", "torch.distributed.checkpoint.state_dict", "torch.distributed.fsdp", "accelerate.utils.fsdp_utils")
    run_ranks(worker, (str(tmp_path / "rendezvous"), str(tmp_path)), nprocs=WORLD, preload=preload)
