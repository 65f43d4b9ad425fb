"""A wrapped optimizer in Lightning (``lightning.pytorch``), CPU, tiny random-init models.

Automatic optimization: ``configure_optimizers`` returns the wrapped optimizer, Lightning calls
``optimizer.step(closure)`` and accumulates gradients over 2 batches (``accumulate_grad_batches=2``);
the result must equal a plain loop with ``clip_grad_norm_`` bit for bit. With ``MultiSteps`` and
``apply_if_finite`` inside the wrapped optimizer, Lightning's closure steps equal a plain loop that
accumulates and skips by hand. DDP on 2 gloo ranks with a
wrapped ``ZeroRedundancyOptimizer``: Lightning checkpoints a sharded optimizer by calling its
``consolidate_state_dict`` on every rank, then ``state_dict`` on rank 0; the checkpoint must hold
ZeRO's consolidated state and the chain's.
"""

from __future__ import annotations

import datetime
import functools
import gc
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import gradtx as gtx
from gradtx.interop.wrap import STATE_KEY
from _lazy import lazy_or_skip
from _loops import accumulate_then_clip_and_step
from _ranks import free_port, run_ranks

pl = lazy_or_skip("lightning.pytorch")

WORLD = 2
BATCHES = 8
MAX_NORM = 0.1


def dataset(rank: int = 0) -> torch.utils.data.TensorDataset:
    gen = torch.Generator().manual_seed(20 + rank)
    x = torch.randn(4 * BATCHES, 6, generator=gen)
    return torch.utils.data.TensorDataset(x, torch.randint(0, 3, (4 * BATCHES,), generator=gen))


def make_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


@functools.cache
def classifier_type() -> type:
    """The Lightning module of these tests (made at first use: its base class imports Lightning)."""

    class Classifier(pl.LightningModule):
        def __init__(self, make_optimizer):
            super().__init__()
            self.net = make_net()
            self.make_optimizer = make_optimizer

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            return self.make_optimizer(self)

    return Classifier


def classifier(make_optimizer) -> "pl.LightningModule":
    return classifier_type()(make_optimizer)


def trainer(**options) -> "pl.Trainer":
    defaults = dict(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    defaults.update(options)
    return pl.Trainer(**defaults)


def test_automatic_optimization_with_closure_and_accumulation_matches_a_plain_loop():
    def make_optimizer(module):
        inner = torch.optim.AdamW(module.parameters(), lr=1e-2)
        return gtx.wrap(inner, gtx.clip_by_global_norm(MAX_NORM), model=module)

    module = classifier(make_optimizer)
    loader = torch.utils.data.DataLoader(dataset(), batch_size=4, shuffle=False)
    trainer(accumulate_grad_batches=2).fit(module, loader)

    reference = make_net()
    opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    clipped = []
    for i, (x, y) in enumerate(loader):
        (nn.functional.cross_entropy(reference(x), y) / 2).backward()
        if i % 2 == 1:
            clipped.append(float(torch.nn.utils.clip_grad_norm_(reference.parameters(), MAX_NORM)) > MAX_NORM)
            opt.step()
            opt.zero_grad()
    assert len(clipped) == BATCHES // 2 and any(clipped)
    for p, q in zip(module.net.parameters(), reference.parameters()):
        assert torch.equal(p, q)


def poisoned_classifier(make_optimizer) -> "pl.LightningModule":
    """A classifier that puts a NaN in one gradient of batch ``NAN_BATCH``, after backward,
    before the optimizer sees it."""

    class PoisonedClassifier(classifier_type()):
        def training_step(self, batch, batch_idx):
            self.batch_idx = batch_idx
            return super().training_step(batch, batch_idx)

        def on_before_optimizer_step(self, optimizer):
            if self.batch_idx == NAN_BATCH:
                self.net[0].weight.grad[0, 0] = float("nan")

    return PoisonedClassifier(make_optimizer)


ACCUMULATE = 2
NAN_BATCH = 4  # a mini-step: its window's applied step is dropped


def test_multisteps_and_apply_if_finite_inside_wrap_match_a_plain_loop():
    """Lightning steps with a closure every batch; the chain accumulates and skips, and a skipped step
    does not step AdamW (momentum, weight decay, its step count), as in a plain loop."""

    def make_optimizer(module):
        tx = gtx.MultiSteps(gtx.apply_if_finite(gtx.clip_by_global_norm(MAX_NORM), 3), ACCUMULATE)
        return gtx.wrap(torch.optim.AdamW(module.parameters(), lr=1e-2, weight_decay=0.1), tx, model=module)

    module = poisoned_classifier(make_optimizer)
    loader = torch.utils.data.DataLoader(dataset(), batch_size=4, shuffle=False)
    trainer().fit(module, loader)

    reference = make_net()
    opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1)
    acc = [torch.zeros_like(p) for p in reference.parameters()]
    for i, (x, y) in enumerate(loader):
        reference.zero_grad()
        nn.functional.cross_entropy(reference(x), y).backward()
        if i == NAN_BATCH:
            reference[0].weight.grad[0, 0] = float("nan")
        accumulate_then_clip_and_step(list(reference.parameters()), acc, i, ACCUMULATE, opt, MAX_NORM)
    wrapped = module.trainer.optimizers[0]
    applied = BATCHES // ACCUMULATE - 1
    assert int(wrapped.optimizer.state[module.net[0].weight]["step"]) == applied
    assert int(opt.state[reference[0].weight]["step"]) == applied
    for p, q in zip(module.net.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def make_zero(module):
    from torch.distributed.optim import ZeroRedundancyOptimizer

    inner = ZeroRedundancyOptimizer(module.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-2)
    return gtx.wrap(inner, gtx.clip_by_global_norm(MAX_NORM), model=module)


def check_ddp_zero(rank: int, checkpoint: str) -> None:
    from lightning.pytorch.strategies import DDPStrategy

    module = classifier(make_zero)
    loader = torch.utils.data.DataLoader(dataset(rank), batch_size=4, shuffle=False)
    strategy = DDPStrategy(process_group_backend="gloo", timeout=datetime.timedelta(seconds=30))
    fit = trainer(devices=WORLD, strategy=strategy, max_steps=3)
    fit.fit(module, loader)
    flat = torch.cat([p.detach().reshape(-1) for p in module.parameters()])
    gathered = [torch.zeros_like(flat) for _ in range(WORLD)]
    dist.all_gather(gathered, flat)
    assert torch.equal(gathered[0], gathered[1]), "ranks diverged"

    fit.save_checkpoint(checkpoint)
    dist.barrier()
    if rank == 0:
        saved = torch.load(checkpoint, weights_only=False)["optimizer_states"][0]
        assert len(saved["state"]) == len(list(module.parameters()))  # every rank's shard, consolidated
        assert STATE_KEY in saved["param_groups"][0]


def ddp_worker(rank: int, port: int, checkpoint: str) -> None:
    # Lightning takes processes started outside it when LOCAL_RANK is set.
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NODE_RANK="0", LOCAL_RANK=str(rank), RANK=str(rank),
        WORLD_SIZE=str(WORLD),
    )
    torch.set_num_threads(1)
    try:
        check_ddp_zero(rank, checkpoint)
        dist.barrier()
    finally:
        gc.collect()  # DDP's reducer sits in reference cycles: no gloo thread may outlive the group
        if dist.is_initialized():
            dist.destroy_process_group()


class StateNotConsolidated(AssertionError):
    """ZeRO's ``state_dict`` ran without ``consolidate_state_dict`` having reached it."""


@pytest.mark.distributed
def test_ddp_with_a_wrapped_zero_redundancy_optimizer_checkpoints(tmp_path):
    try:
        preload = ("lightning.pytorch", "torch._dynamo", "torch.distributed.optim")
        run_ranks(ddp_worker, (free_port(), str(tmp_path / "last.ckpt")), nprocs=WORLD, preload=preload)
    except mp.ProcessRaisedException as error:
        if "Optimizer state has not been consolidated on this rank" in str(error):
            raise StateNotConsolidated(str(error)) from None
        raise
