"""wrap as a drop-in for what real training code hands it and does with it: a MultiSteps object,
Opacus's DPOptimizer, attributes of the inner optimizer it does not define itself, torch's
optimizer step hooks, and GradScaler's contract for fused optimizers."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import gradtx as gtx


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
