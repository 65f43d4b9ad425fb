"""A step the chain skips moves nothing: ``wrap(opt, MultiSteps(...))`` on its mini-steps and
``wrap(opt, apply_if_finite(...))`` on a non-finite step leave the parameters, the inner optimizer's
state and its step count exactly as they were, for every torch optimizer, fused ones included.

References: a plain torch loop that accumulates (or drops) gradients by hand and steps only on the
steps the chain applies, and the pure path with the same optimizer inside the chain (``from_torch``).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import gradtx as gtx

K = 2  # MultiSteps' mini-steps per applied step
STEPS = 6
NAN_AT = 2  # the step whose gradients hold a NaN, for apply_if_finite
MAX_NORM = 0.5

OPTIMIZERS = {
    "SGD-momentum-wd": (torch.optim.SGD, dict(lr=0.1, momentum=0.9, weight_decay=0.1)),
    "SGD-fused": (torch.optim.SGD, dict(lr=0.1, momentum=0.9, weight_decay=0.1, fused=True)),
    "Adam": (torch.optim.Adam, dict(lr=1e-2)),
    "AdamW": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    "AdamW-fused": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1, fused=True)),
    "AdamW-foreach-amsgrad": (torch.optim.AdamW, dict(lr=1e-2, amsgrad=True, foreach=True)),
    "Adagrad-fused": (torch.optim.Adagrad, dict(lr=0.1, fused=True)),
    "Adadelta": (torch.optim.Adadelta, dict(lr=1.0, weight_decay=0.1)),
    "Adamax": (torch.optim.Adamax, dict(lr=1e-2)),
    "ASGD": (torch.optim.ASGD, dict(lr=1e-2, t0=1)),
    "NAdam": (torch.optim.NAdam, dict(lr=1e-2, weight_decay=0.1)),
    "RAdam": (torch.optim.RAdam, dict(lr=1e-2, decoupled_weight_decay=True, weight_decay=0.1)),
    "RMSprop": (torch.optim.RMSprop, dict(lr=1e-2, momentum=0.5, centered=True)),
    "Rprop": (torch.optim.Rprop, dict(lr=1e-2)),
    "Adafactor": (torch.optim.Adafactor, dict(lr=1e-2)),
}


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))


def grads_at(model: nn.Module, step: int) -> list[torch.Tensor]:
    """The gradients of step ``step`` (a NaN in the first weight on ``NAN_AT`` when ``poison``)."""
    model.zero_grad()
    gen = torch.Generator().manual_seed(step)
    x, y = torch.randn(8, 5, generator=gen), torch.randint(0, 3, (8,), generator=gen)
    nn.functional.cross_entropy(model(x), y).mul(1 + step).backward()
    return [p.grad for p in model.parameters()]


def poison(model: nn.Module, step: int) -> None:
    if step == NAN_AT:
        next(model.parameters()).grad[0, 0] = float("nan")


def inner_state(opt: torch.optim.Optimizer) -> list[dict]:
    return [copy.deepcopy(opt.state[p]) for group in opt.param_groups for p in group["params"]]


def assert_states_equal(a: list[dict], b: list[dict]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for key in x:
            torch.testing.assert_close(x[key], y[key], rtol=1e-6, atol=1e-7, msg=f"inner state {key!r}")


def assert_params_equal(model: nn.Module, reference: nn.Module) -> None:
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def torch_multisteps(cls, hyper) -> tuple[nn.Module, torch.optim.Optimizer]:
    """Accumulates the running mean of ``K`` gradients by hand, clips it, steps once per ``K`` calls."""
    model = mlp()
    opt = cls(model.parameters(), **hyper)
    acc = [torch.zeros_like(p) for p in model.parameters()]
    for step in range(STEPS):
        n = step % K
        for a, g in zip(acc, grads_at(model, step)):
            a.lerp_(g, 1.0 / (n + 1))
        if n == K - 1:
            for p, a in zip(model.parameters(), acc):
                p.grad = a.clone()
                a.zero_()
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
            opt.step()
    return model, opt


def torch_skip_nonfinite(cls, hyper) -> tuple[nn.Module, torch.optim.Optimizer]:
    """Clips and steps, except on the step with a NaN, where nothing runs."""
    model = mlp()
    opt = cls(model.parameters(), **hyper)
    for step in range(STEPS):
        grads_at(model, step)
        poison(model, step)
        if step == NAN_AT:
            continue
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
    return model, opt


def wrapped_run(cls, hyper, tx, *, nan: bool, check_skips: bool = True) -> tuple[nn.Module, gtx.ChainedOptimizer]:
    model = mlp()
    opt = gtx.wrap(cls(model.parameters(), **hyper), tx, model=model)
    for step in range(STEPS):
        grads_at(model, step)
        if nan:
            poison(model, step)
        before_params = [p.detach().clone() for p in model.parameters()]
        before_state = inner_state(opt.optimizer)
        opt.step()
        skipped = step == NAN_AT if nan else step % K != K - 1
        assert opt.last_step_skipped is skipped
        if skipped and check_skips:
            assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before_params))
            assert_states_equal(inner_state(opt.optimizer), before_state)
    return model, opt


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_multisteps_mini_steps_do_not_step_the_inner_optimizer(name):
    cls, hyper = OPTIMIZERS[name]
    tx = gtx.MultiSteps(gtx.clip_by_global_norm(MAX_NORM), K)
    model, opt = wrapped_run(cls, hyper, tx, nan=False)
    reference, ref_opt = torch_multisteps(cls, hyper)
    assert_params_equal(model, reference)
    assert_states_equal(inner_state(opt.optimizer), inner_state(ref_opt))


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_apply_if_finite_skips_the_inner_step_on_a_nonfinite_step(name):
    cls, hyper = OPTIMIZERS[name]
    # the clip last, so a fused optimizer takes the fold path (the gate then sits in the chain's head)
    tx = gtx.chain(gtx.apply_if_finite(gtx.identity(), 3), gtx.clip_by_global_norm(MAX_NORM))
    model, opt = wrapped_run(cls, hyper, tx, nan=True)
    reference, ref_opt = torch_skip_nonfinite(cls, hyper)
    assert_params_equal(model, reference)
    assert_states_equal(inner_state(opt.optimizer), inner_state(ref_opt))


def test_a_wrapped_skip_equals_the_pure_path_step_for_step():
    """wrap(AdamW, MultiSteps(apply_if_finite(clip))) against MultiSteps(apply_if_finite(chain(clip, AdamW)))."""
    hyper = dict(lr=1e-2, weight_decay=0.1)
    inner = gtx.apply_if_finite(gtx.clip_by_global_norm(MAX_NORM), 3)
    model = mlp()
    opt = gtx.wrap(torch.optim.AdamW(model.parameters(), **hyper), gtx.MultiSteps(inner, K), model=model)
    pure_model = mlp()
    params = {k: v.detach().clone() for k, v in pure_model.named_parameters()}
    pure = gtx.MultiSteps(gtx.apply_if_finite(gtx.chain(gtx.clip_by_global_norm(MAX_NORM), gtx.from_torch(torch.optim.AdamW, **hyper)), 3), K)
    state = pure.init(params)
    for step in range(2 * STEPS):
        grads_at(model, step)
        if step == 2 * NAN_AT + 1:  # the NaN lands in an accumulated step: the applied step is dropped
            poison(model, NAN_AT)
        grads = {k: v.grad.clone() for k, v in model.named_parameters()}
        opt.step()
        updates, state = pure.update(grads, state, params)
        params = gtx.apply_updates(params, updates)
        for name, p in model.named_parameters():
            torch.testing.assert_close(p.detach(), params[name], rtol=1e-6, atol=1e-7, msg=f"step {step} {name}")
    # one of the applied steps dropped by the inner apply_if_finite: AdamW stepped one time less
    assert int(opt.optimizer.state[next(model.parameters())]["step"]) == STEPS - 1


def test_a_closure_step_that_the_chain_skips_returns_the_loss_and_steps_nothing():
    model = mlp()
    opt = gtx.wrap(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), gtx.MultiSteps(gtx.identity(), K), model=model)
    evaluations = []

    def closure():
        evaluations.append(1)
        grads_at(model, 0)
        return torch.tensor(3.0)

    before = [p.detach().clone() for p in model.parameters()]
    assert opt.step(closure).item() == 3.0
    assert opt.last_step_skipped and len(evaluations) == 1 and not opt.optimizer.state
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    assert opt.step(closure).item() == 3.0  # applied: the inner step gets the loss of the one evaluation
    assert not opt.last_step_skipped and len(evaluations) == 2 and opt.optimizer.state


def test_lbfgs_behind_a_gated_chain_evaluates_as_before():
    """The inner step re-evaluates the closure after the first call; each evaluation is transformed."""
    torch.manual_seed(0)
    x = torch.randn(4, requires_grad=True)
    target = torch.randn(4)
    opt = gtx.wrap(torch.optim.LBFGS([x], lr=0.5, max_iter=5), gtx.apply_if_finite(gtx.identity(), 2))
    y = x.detach().clone().requires_grad_()
    ref = torch.optim.LBFGS([y], lr=0.5, max_iter=5)

    def closure_of(v, o):
        def closure():
            o.zero_grad()
            loss = (v - target).pow(2).sum()
            loss.backward()
            return loss

        return closure

    for _ in range(3):
        torch.testing.assert_close(opt.step(closure_of(x, opt)), ref.step(closure_of(y, ref)))
    torch.testing.assert_close(x, y)


@pytest.mark.parametrize(
    "make",
    [
        lambda: gtx.partition({"a": gtx.apply_if_finite(gtx.identity(), 2), "b": gtx.identity()}, lambda p: {k: "a" if k.startswith("0") else "b" for k in p}),
        lambda: gtx.masked(gtx.MultiSteps(gtx.identity(), 2).gradient_transformation(), lambda p: {k: k.startswith("0") for k in p}),
    ],
    ids=["apply_if_finite-in-partition", "multisteps-in-masked"],
)
def test_a_skip_of_some_leaves_only_is_refused(make):
    model = mlp()
    with pytest.raises(ValueError, match="top of the chain"):
        gtx.wrap(torch.optim.SGD(model.parameters(), lr=0.1), make(), model=model)


def test_nested_gates_compose():
    """apply_if_finite around MultiSteps, and MultiSteps around apply_if_finite: a skip by either skips the step."""
    tx = gtx.apply_if_finite(gtx.MultiSteps(gtx.apply_if_finite(gtx.identity(), 5), K).gradient_transformation(), 5)
    model = mlp()
    opt = gtx.wrap(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), tx, model=model)
    skipped = []
    for step in range(6):
        grads_at(model, step)
        if step == 4:
            poison(model, NAN_AT)
        opt.step()
        skipped.append(opt.last_step_skipped)
    assert skipped == [True, False, True, False, True, True]
