"""wrap as a drop-in for what real training code hands it and does with it: a MultiSteps object,
Opacus's DPOptimizer, attributes of the inner optimizer it does not define itself, torch's
optimizer step hooks, and GradScaler's contract for fused optimizers."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import gradtx as gtx
from gradtx.interop.wrap import ChainedOptimizer


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))


def loss_of(model: nn.Module, step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(step)
    x, y = torch.randn(8, 5, generator=gen), torch.randint(0, 3, (8,), generator=gen)
    return nn.functional.cross_entropy(model(x), y) * (1 + step)


def params_of(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


# --------------------------------------------------------------------------- MultiSteps


def test_wrap_accepts_a_multisteps_object():
    model, reference = mlp(), mlp()
    opt = gtx.wrap(torch.optim.SGD(model.parameters(), lr=0.1), gtx.MultiSteps(gtx.clip_by_global_norm(0.5), 2), model=model)
    ref = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(4):
        before = params_of(model)
        opt.zero_grad()
        loss_of(model, step).backward()
        opt.step()
        if step % 2 == 0:  # a mini-step: the chain hands the optimizer zeros
            assert same(params_of(model), before)
    for step in range(0, 4, 2):  # every second step applies the clipped mean of two
        ref.zero_grad()
        grads = []
        for s in (step, step + 1):
            reference.zero_grad()
            loss_of(reference, s).backward()
            grads.append([p.grad.clone() for p in reference.parameters()])
        for p, g0, g1 in zip(reference.parameters(), *grads):
            p.grad = g0 + (g1 - g0) / 2  # the running mean MultiSteps keeps
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
        ref.step()
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    assert int(opt.tx_state.gradient_step) == 2


# --------------------------------------------------------------------------- Opacus


def dp_setup(wrapped_tx):
    from opacus import GradSampleModule
    from opacus.optimizers import DPOptimizer

    model = GradSampleModule(mlp())
    inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if wrapped_tx is not None:
        inner = gtx.wrap(inner, wrapped_tx)
    gen = torch.Generator().manual_seed(7)
    opt = DPOptimizer(inner, noise_multiplier=0.5, max_grad_norm=1.0, expected_batch_size=8, generator=gen)
    return model, opt


def test_wrapping_a_dp_optimizer_with_a_transformation_is_refused():
    from opacus.optimizers import DPOptimizer

    _, opt = dp_setup(None)
    assert isinstance(opt, DPOptimizer)
    with pytest.raises(TypeError, match=r"DPOptimizer\(gradtx.wrap"):
        gtx.wrap(opt, gtx.clip_by_global_norm(1.0))
    gtx.wrap(opt)  # nothing to ignore without a transformation


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_dp_optimizer_over_a_wrapped_optimizer_transforms_the_privatized_gradient():
    model, opt = dp_setup(gtx.clip_by_global_norm(0.05))
    reference, ref = dp_setup(None)
    for step in range(3):
        for m, o in ((model, opt), (reference, ref)):
            o.zero_grad()
            loss_of(m, step).backward()
        opt.step()
        assert ref.pre_step()  # per-sample clipping and the same seeded noise...
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05)  # ...then the chain...
        ref.original_optimizer.step()  # ...then the inner step
        assert same(params_of(model), params_of(reference))
    assert opt.original_optimizer.tx_state.norm > 0.05  # the clip engaged on the noisy gradient


# --------------------------------------------------------------------------- forwarding


class Moody(torch.optim.SGD):
    """An optimizer with methods of its own, like schedule-free optimizers' ``train`` / ``eval``."""

    def __init__(self, params, lr: float):
        super().__init__(params, lr=lr)
        self.mode = "train"
        self.scale_on_eval = 0.5

    def train(self) -> None:
        self.mode = "train"

    def eval(self) -> None:
        self.mode = "eval"


def test_unknown_attributes_are_forwarded_to_the_inner_optimizer():
    import copy
    import pickle

    inner = Moody(mlp().parameters(), lr=0.1)
    opt = gtx.wrap(inner, gtx.clip_by_global_norm(1.0))
    opt.eval()
    assert inner.mode == "eval" and opt.mode == "eval" and opt.scale_on_eval == 0.5
    opt.train()
    assert inner.mode == "train"
    assert not hasattr(opt, "consolidate_state_dict")  # absent from the inner optimizer too
    with pytest.raises(AttributeError, match="nothing_here"):
        opt.nothing_here
    # no recursion while the wrapper has no inner optimizer yet (unpickling, copying)
    bare = ChainedOptimizer.__new__(ChainedOptimizer)
    assert not hasattr(bare, "mode")
    # (transformations are closures, so only a wrapper without one pickles)
    for clone in (copy.deepcopy(opt), pickle.loads(pickle.dumps(gtx.wrap(inner)))):
        clone.eval()
        assert clone.optimizer.mode == "eval" and inner.mode == "train"


WORLD = 2


def zero_worker(rank: int, init_file: str) -> None:
    import datetime

    import torch.distributed as dist
    from torch.distributed.optim import ZeroRedundancyOptimizer

    torch.set_num_threads(1)  # forked from a process that may have run OpenMP regions: start none
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=30)
    )
    try:
        model, reference = mlp(), mlp()
        opt = gtx.wrap(
            ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-2),
            gtx.clip_by_global_norm(0.5),
        )
        ref = ZeroRedundancyOptimizer(reference.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-2)
        for step in range(2):
            for m, o in ((model, opt), (reference, ref)):
                o.zero_grad()
                loss_of(m, step).backward()
            opt.step()
            torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
            ref.step()
        # what Lightning's strategies do to checkpoint a sharded optimizer
        assert hasattr(opt, "consolidate_state_dict")
        opt.consolidate_state_dict(to=0)
        ref.consolidate_state_dict(to=0)
        if rank == 0:
            saved, expected = opt.state_dict(), ref.state_dict()
            assert "gradtx" in saved["param_groups"][0] and len(saved["state"]) == len(expected["state"]) == 4
            for index, entry in expected["state"].items():
                for key, value in entry.items():
                    assert torch.equal(saved["state"][index][key], value), (index, key)
        assert same(params_of(model), params_of(reference))
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
def test_a_wrapped_zero_redundancy_optimizer_consolidates_its_state(tmp_path):
    import torch.multiprocessing as mp

    import torch._dynamo  # noqa: F401  (DistributedDataParallel imports it: once here, not on every rank)

    # fork: the ranks start with torch, dynamo, gradtx and this module imported (a fresh
    # interpreter each costs seconds on a small machine)
    start = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
    mp.start_processes(zero_worker, args=(str(tmp_path / "rendezvous"),), nprocs=WORLD, join=True, start_method=start)


# --------------------------------------------------------------------------- step hooks


@pytest.mark.parametrize("scheduler", [None, "on the inner optimizer, before wrapping", "on the wrapper"])
def test_process_wide_step_hooks_fire_once_per_step_with_the_wrapper(scheduler):
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    model = mlp()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    if scheduler == "on the inner optimizer, before wrapping":  # it patches the inner optimizer's step
        sched = torch.optim.lr_scheduler.StepLR(inner, step_size=1, gamma=0.5)
    opt = gtx.wrap(inner, gtx.clip_by_global_norm(1.0))
    if scheduler == "on the wrapper":
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    calls = []
    handles = [
        register_optimizer_step_pre_hook(lambda o, args, kwargs: calls.append(("pre", o))),
        register_optimizer_step_post_hook(lambda o, args, kwargs: calls.append(("post", o))),
    ]
    try:
        for step in range(2):
            opt.zero_grad()
            loss_of(model, step).backward()
            opt.step()
            if scheduler is not None:
                sched.step()  # no "scheduler stepped before the optimizer" warning: the step was seen
    finally:
        for handle in handles:
            handle.remove()
    assert calls == [("pre", opt), ("post", opt)] * 2
    if scheduler is not None:
        assert sched.optimizer._opt_called and opt.param_groups[0]["lr"] == pytest.approx(0.025)


def hook_trace(wrapped: bool) -> tuple[list, list[torch.Tensor]]:
    """Per-instance hooks that see and rewrite ``step``'s arguments, on a plain or a wrapped SGD."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if wrapped:
        opt = gtx.wrap(opt)
    events = []

    def closure():
        events.append("closure")
        opt.zero_grad()
        loss = loss_of(model, 0)
        loss.backward()
        return loss

    def pre(o, args, kwargs):
        events.append(("pre", o is opt, len(args), sorted(kwargs)))
        return args, {"closure": closure}  # replaces the closure the caller passed

    def post(o, args, kwargs):
        events.append(("post", o is opt, len(args), sorted(kwargs)))

    opt.register_step_pre_hook(pre)
    opt.register_step_post_hook(post)
    loss = opt.step(closure=lambda: None)
    events.append(("loss", float(loss.detach())))
    return events, params_of(model)


def test_instance_step_hooks_behave_as_torchs():
    events, params = hook_trace(wrapped=True)
    ref_events, ref_params = hook_trace(wrapped=False)
    assert events == ref_events and same(params, ref_params)
    assert events[0] == ("pre", True, 1, ["closure"]) and "closure" in events


def test_the_inner_optimizers_own_hooks_get_what_torch_gives_them():
    model = mlp()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    opt = gtx.wrap(inner, gtx.clip_by_global_norm(1.0))
    seen = []
    inner.register_step_pre_hook(lambda o, args, kwargs: seen.append(("pre", o is inner, args[0] is inner, len(args))))
    inner.register_step_post_hook(lambda o, args, kwargs: seen.append(("post", o is inner, args[0] is inner, len(args))))
    loss_of(model, 0).backward()
    opt.step()
    assert seen == [("pre", True, True, 1), ("post", True, True, 1)]


# --------------------------------------------------------------------------- GradScaler's fused contract


def fused_scaled_run(wrapped: bool, inject_at: int = 1) -> tuple[list[list[torch.Tensor]], list[float]]:
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    if wrapped:
        opt = gtx.wrap(opt)
        assert opt._step_supports_amp_scaling  # GradScaler hands grad_scale / found_inf to the step
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    snapshots, scales = [], []
    for step in range(4):
        opt.zero_grad()
        scaler.scale(loss_of(model, step)).backward()
        if step == inject_at:
            model[0].weight.grad[1, 1] = math.inf
        scaler.step(opt)
        scaler.update()
        snapshots.append(params_of(model))
        scales.append(scaler.get_scale())
    return snapshots, scales


def test_last_step_skipped_tells_a_step_the_fused_inner_step_skipped_for_grad_scaler():
    model = mlp()
    opt = gtx.wrap(torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    seen = []
    for step in range(3):
        opt.zero_grad()
        scaler.scale(loss_of(model, step)).backward()
        if step == 1:
            model[0].weight.grad[1, 1] = math.inf
        before = params_of(model)
        scaler.step(opt)
        scaler.update()
        seen.append((opt.last_step_skipped, same(before, params_of(model))))
    assert seen == [(False, False), (True, True), (False, False)]


def test_grad_scaler_fused_path_reaches_the_inner_kernel():
    snapshots, scales = fused_scaled_run(wrapped=True)
    ref_snapshots, ref_scales = fused_scaled_run(wrapped=False)
    assert scales == ref_scales == [2.0**8, 2.0**7, 2.0**7, 2.0**7]
    assert same(snapshots[0], snapshots[1])  # the inf step changed nothing
    for got, want in zip(snapshots, ref_snapshots):
        assert same(got, want)


def test_found_inf_and_grad_scale_set_on_the_wrapper_reach_the_step():
    def run(wrapped: bool, found_inf: float, tx=None):
        model = mlp()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
        if wrapped:
            opt = gtx.wrap(opt, tx)
        loss_of(model, 0).backward()
        for p in model.parameters():
            p.grad.mul_(4.0)
        opt.grad_scale, opt.found_inf = torch.tensor(4.0), torch.tensor(found_inf)
        opt.step()
        del opt.grad_scale, opt.found_inf
        return model, opt

    model, _ = run(True, 0.0)
    reference, _ = run(False, 0.0)
    assert same(params_of(model), params_of(reference))
    skipped, opt = run(True, 1.0)
    assert same(params_of(skipped), params_of(mlp())) and int(opt.state[skipped[0].weight]["step"]) == 0
    # with a transformation (never claimed to GradScaler, but the contract still holds): the chain
    # sees unscaled gradients, and found_inf skips the chain's update too
    clipped, opt = run(True, 0.0, gtx.clip_by_global_norm(0.1))
    unscaled = mlp()
    loss_of(unscaled, 0).backward()
    assert not opt._step_supports_amp_scaling
    assert torch.equal(opt.tx_state.norm, torch.nn.utils.get_total_norm([p.grad for p in unscaled.parameters()]))
    _, opt = run(True, 1.0, gtx.clip_by_global_norm(0.1))
    assert float(opt.tx_state.norm) == 0.0 and not opt.state
