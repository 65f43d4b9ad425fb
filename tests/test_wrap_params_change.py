"""The chain's state follows the parameters it is applied to, when they change after ``wrap``.

The rule: the state is built anew by ``tx.init`` for the current parameters, and every old leaf
whose path and logical shape are unchanged keeps its value, converted to the dtype, device and
layout ``tx.init`` gives that leaf. (Parameters swapped for DTensor shards, as accelerate's FSDP2
preparation does: ``tests/integrations/test_dcp_fsdp2.py``.) A device move (``model.to("cuda")``
replaces each parameter's data, as ``model.double()`` does) takes the same path as the dtype change
tested here; this machine has no second device to move to.
"""

from __future__ import annotations

import torch
from torch import nn

import gradtx as gtx


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 2))


def grads_of(model: nn.Module, step: int) -> dict[str, torch.Tensor]:
    model.zero_grad()
    gen = torch.Generator().manual_seed(step)
    dtype = next(model.parameters()).dtype
    x = torch.randn(6, 4, generator=gen).to(dtype)
    model(x).pow(2).mean().backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def chain() -> gtx.GradientTransformation:
    return gtx.chain(gtx.clip_by_global_norm(0.5), gtx.scale_by_adam(), gtx.trace(decay=0.5))


def test_after_model_double_the_state_is_float64_and_keeps_its_values():
    model = mlp()
    opt = gtx.wrap(torch.optim.SGD(model.parameters(), lr=0.1), chain(), model=model)
    pure = chain()
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    state = pure.init(params)
    for step in range(4):
        if step == 2:
            model.double()
            params = {k: v.double() for k, v in params.items()}
            state = gtx.tree.tree_map(lambda t: t.double() if t.is_floating_point() else t, state)
        grads = grads_of(model, step)
        opt.step()
        updates, state = pure.update(grads, state, params)
        params = gtx.apply_updates(params, gtx.tree.tree_map(lambda u: -0.1 * u, updates))
    for name, p in model.named_parameters():
        assert p.dtype == torch.float64
        torch.testing.assert_close(p.detach(), params[name], rtol=1e-6, atol=1e-7)  # SGD adds with alpha=-lr
    assert opt.tx_state[1].mu["0.weight"].dtype == torch.float64
    assert opt.tx_state[2].trace["0.weight"].dtype == torch.float64
    torch.testing.assert_close(opt.tx_state[1].mu["0.weight"], state[1].mu["0.weight"], rtol=1e-12, atol=1e-12)
    assert int(opt.tx_state[1].count) == 4  # counters keep counting, in their own dtype
    assert opt.tx_state[1].count.dtype == state[1].count.dtype


def test_a_state_dtype_the_transformation_fixes_stays_fixed():
    model = mlp()
    opt = gtx.wrap(torch.optim.SGD(model.parameters(), lr=0.1), gtx.scale_by_adam(mu_dtype=torch.bfloat16), model=model)
    grads_of(model, 0)
    opt.step()
    mu = opt.tx_state.mu["0.weight"].clone()
    model.double()
    grads_of(model, 1)
    opt.step()
    assert opt.tx_state.mu["0.weight"].dtype == torch.bfloat16  # what tx.init gives for float64 params
    assert opt.tx_state.nu["0.weight"].dtype == torch.float64
    assert not torch.equal(opt.tx_state.mu["0.weight"], torch.zeros_like(mu))


def test_clip_grad_by_norm_after_model_double_takes_the_float64_norm():
    model = mlp()
    opt = gtx.wrap(torch.optim.SGD(model.parameters(), lr=0.1), model=model)
    model.double()
    grads_of(model, 0)
    expected = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
    norm = opt.clip_grad_by_norm(1e9)
    assert norm.dtype == torch.float64 and torch.equal(norm, expected)
