"""``wrap`` forwards extra arguments (``value=``, ...) to transformations that take them."""

from __future__ import annotations

import pytest
import torch

import gradtx as gtx

torch.manual_seed(0)
X, Y = torch.randn(16, 3, dtype=torch.float64), torch.randn(16, dtype=torch.float64)


def make_model() -> torch.nn.Linear:
    torch.manual_seed(1)
    return torch.nn.Linear(3, 1).double()


def loss_of(model: torch.nn.Module) -> torch.Tensor:
    return ((model(X).squeeze(-1) - Y) ** 2).mean()


def reference(steps: int) -> dict[str, torch.Tensor]:
    """The same Polyak steps on the functional path: ``p - step * g``."""
    model = make_model()
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    tx = gtx.scale_by_polyak(f_min=0.0, max_learning_rate=0.7)
    state = tx.init(params)

    def loss_fn(p):
        return torch.func.functional_call(model, p, (X,)).squeeze(-1).sub(Y).pow(2).mean()

    for _ in range(steps):
        value, grads = torch.func.grad_and_value(loss_fn)(params)[::-1]
        updates, state = tx.update(grads, state, params, value=value)
        params = gtx.apply_updates(params, gtx.tree_utils.tree_scale(-1.0, updates))
    return params


@pytest.mark.parametrize("with_closure", [False, True])
def test_step_forwards_value_to_the_transformation(with_closure):
    model = make_model()
    opt = gtx.wrap(torch.optim.SGD(model.parameters(), lr=1.0), gtx.scale_by_polyak(f_min=0.0, max_learning_rate=0.7), model=model)
    for _ in range(4):
        opt.zero_grad()
        if with_closure:

            def closure():
                opt.zero_grad()
                loss = loss_of(model)
                loss.backward()
                return loss

            opt.step(closure)  # the closure's loss reaches the transformation as value=
        else:
            loss = loss_of(model)
            loss.backward()
            opt.step(value=loss.detach())
    expected = reference(4)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), expected[name], rtol=1e-12, atol=1e-12)


def test_an_explicit_value_wins_over_the_closures_loss():
    model = make_model()
    opt = gtx.wrap(torch.optim.SGD(model.parameters(), lr=1.0), gtx.scale_by_polyak(f_min=0.0, max_learning_rate=10.0), model=model)
    before = {k: v.detach().clone() for k, v in model.named_parameters()}

    def closure():
        opt.zero_grad()
        loss = loss_of(model)
        loss.backward()
        return loss

    opt.step(closure, value=torch.tensor(0.0, dtype=torch.float64))  # f - f_min = 0: a zero step
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), before[name])


def test_extra_arguments_for_a_plain_transformation_are_an_error_before_anything_runs():
    model = make_model()
    opt = gtx.wrap(torch.optim.SGD(model.parameters(), lr=1.0), gtx.clip_by_global_norm(1.0), model=model)
    loss_of(model).backward()
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    with pytest.raises(TypeError, match=r"step\(\) got \['value'\].*takes no extra arguments"):
        opt.step(value=torch.tensor(1.0))
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), before[name])
