"""A wrapped optimizer through ``accelerate``: ``Accelerator.prepare(model, wrap(...))`` on the CPU.

Single process: the prepared wrapped optimizer trains as a plain torch loop with ``clip_grad_norm_``
does, bit for bit. DDP on 2 gloo ranks (processes started here, with the environment accelerate
reads): the ranks agree, match a single-process run on the whole batch, and
``save_state`` / ``load_state`` into fresh objects resume exactly, with a chain whose state changes
the numbers.
"""

from __future__ import annotations

import datetime
import gc
import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

import gradtx as gtx
from _ranks import free_port, run_ranks

accelerate = pytest.importorskip("accelerate")

WORLD = 2
STEPS = 6
SAVE_AT = 3
MAX_NORM = 0.1


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def data(rank: int, step: int):
    gen = torch.Generator().manual_seed(10 * step + rank)
    return torch.randn(4, 6, generator=gen), torch.randint(0, 3, (4,), generator=gen)


def full_batch(step: int):
    parts = [data(r, step) for r in range(WORLD)]
    return torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts])


def make_accelerator(distributed: bool = True):
    """An accelerator on the CPU; in the ranks' processes, over gloo with a short collective timeout."""
    if not distributed:
        return accelerate.Accelerator(cpu=True)
    from accelerate.utils import InitProcessGroupKwargs

    handler = InitProcessGroupKwargs(backend="gloo", timeout=datetime.timedelta(seconds=30))
    return accelerate.Accelerator(cpu=True, kwargs_handlers=[handler])


def make_stateful(model: nn.Module) -> gtx.ChainedOptimizer:
    scheduled = gtx.inject_hyperparams(gtx.scale)(step_size=gtx.linear_schedule(1.0, 0.2, STEPS))
    return gtx.wrap(
        torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9),
        gtx.chain(gtx.clip_by_global_norm(MAX_NORM), scheduled),
        model=model,
    )


def train(accelerator, model, opt, rank: int, steps: range) -> None:
    for step in steps:
        x, y = data(rank, step)
        opt.zero_grad()
        accelerator.backward(nn.functional.cross_entropy(model(x), y))
        opt.step()


def test_prepared_wrapped_optimizer_matches_a_plain_loop():
    accelerator = make_accelerator(distributed=False)
    model = make_model()
    opt = gtx.wrap(torch.optim.AdamW(model.parameters(), lr=1e-2), gtx.clip_by_global_norm(MAX_NORM), model=model)
    model, opt = accelerator.prepare(model, opt)
    train(accelerator, model, opt, 0, range(STEPS))

    reference = make_model()
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    for step in range(STEPS):
        x, y = data(0, step)
        ref_opt.zero_grad()
        nn.functional.cross_entropy(reference(x), y).backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), MAX_NORM)
        ref_opt.step()
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p, q)


def check_ddp(rank: int, checkpoint_dir: str) -> None:
    accelerator = make_accelerator()
    assert accelerator.num_processes == WORLD and accelerator.process_index == rank
    model = make_model()
    model, opt = accelerator.prepare(model, make_stateful(model))
    assert isinstance(model, nn.parallel.DistributedDataParallel)
    train(accelerator, model, opt, rank, range(STEPS))
    expected = [p.detach().clone() for p in model.parameters()]

    gathered = [torch.zeros_like(expected[0]) for _ in range(WORLD)]
    dist.all_gather(gathered, expected[0])
    assert torch.equal(gathered[0], gathered[1]), "ranks diverged"
    reference = make_model()
    ref_opt = make_stateful(reference)
    for step in range(STEPS):
        x, y = full_batch(step)
        ref_opt.zero_grad()
        nn.functional.cross_entropy(reference(x), y).backward()
        ref_opt.step()
    for p, q in zip(expected, reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)

    accelerator = make_accelerator()
    model = make_model()
    model, opt = accelerator.prepare(model, make_stateful(model))
    train(accelerator, model, opt, rank, range(SAVE_AT))
    accelerator.save_state(checkpoint_dir)
    accelerator.wait_for_everyone()

    accelerator = make_accelerator()
    model = make_model(seed=7)
    wrapped = make_stateful(model)
    model, opt = accelerator.prepare(model, wrapped)
    accelerator.load_state(checkpoint_dir)
    assert int(wrapped.tx_state[1].count) == SAVE_AT
    train(accelerator, model, opt, rank, range(SAVE_AT, STEPS))
    for p, q in zip(model.parameters(), expected):
        assert torch.equal(p, q), "the resumed run differs from the uninterrupted one"


def ddp_worker(rank: int, port: int, checkpoint_dir: str) -> None:
    from accelerate.state import AcceleratorState, GradientState

    # OMP_NUM_THREADS: accelerate leaves torch's thread count alone (one thread: a rank forked from a
    # process that has run OpenMP regions must not start its own)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD),
        OMP_NUM_THREADS="1",
    )
    # Forked from the test process: accelerate's process-wide state, if a single-process test set
    # it up there, starts afresh, and the accelerators below set it up from this environment.
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    torch.set_num_threads(1)
    try:
        check_ddp(rank, checkpoint_dir)
        dist.barrier()
    finally:
        gc.collect()  # DDP's reducer sits in reference cycles: no gloo thread may outlive the group
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.mark.distributed
def test_ddp_on_two_ranks_and_save_state_load_state_resume(tmp_path):
    run_ranks(ddp_worker, (free_port(), str(tmp_path / "state")), nprocs=WORLD, preload=("torch._dynamo",))
