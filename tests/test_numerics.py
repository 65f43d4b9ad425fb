"""optax's numerics and update helpers: safe norms (value and a finite derivative at zero), saturating
counters, scale_gradient, incremental and periodic updates, against their definitions."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import gradtx as gtx


def test_safe_norm_values_match_the_definition():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 5, generator=gen, dtype=torch.float64)
    n = x.numpy()
    assert float(gtx.safe_norm(x, 0.0)) == pytest.approx(np.linalg.norm(n.ravel()), rel=1e-12)
    assert float(gtx.safe_norm(x, 1e3)) == 1e3  # below the floor: the floor
    by_row = gtx.safe_norm(x, 0.0, axis=1)
    np.testing.assert_allclose(by_row.numpy(), np.linalg.norm(n, axis=1), rtol=1e-12)
    kept = gtx.safe_norm(x, 0.0, ord=1, axis=0, keepdims=True)
    assert kept.shape == (1, 5)
    np.testing.assert_allclose(kept.numpy(), np.linalg.norm(n, ord=1, axis=0, keepdims=True), rtol=1e-12)
    x[1] = 0.0  # one row under the floor
    floored = gtx.safe_norm(x, 0.5, axis=1)
    expected = np.maximum(np.linalg.norm(x.numpy(), axis=1), 0.5)
    np.testing.assert_allclose(floored.numpy(), expected, rtol=1e-12)


def test_safe_norms_have_finite_gradients_at_zero():
    zero = torch.zeros(3, dtype=torch.float64, requires_grad=True)
    (grad,) = torch.autograd.grad(gtx.safe_norm(zero, 1e-6), zero)
    assert torch.equal(grad, torch.zeros(3, dtype=torch.float64))
    (grad,) = torch.autograd.grad(gtx.safe_root_mean_squares(zero, 1e-6), zero)
    assert torch.equal(grad, torch.zeros(3, dtype=torch.float64))
    (plain,) = torch.autograd.grad(zero.square().mean().sqrt(), zero)
    assert torch.isnan(plain).all()  # what the safe versions avoid
    x = torch.tensor([3.0, 4.0], dtype=torch.float64, requires_grad=True)
    (grad,) = torch.autograd.grad(gtx.safe_norm(x, 1e-6), x)
    torch.testing.assert_close(grad, x.detach() / 5.0)


def test_safe_root_mean_squares_matches_the_definition():
    x = torch.tensor([1.0, -2.0, 2.0], dtype=torch.float64)
    assert float(gtx.safe_root_mean_squares(x, 0.0)) == pytest.approx(np.sqrt(np.mean(x.numpy() ** 2)), rel=1e-15)
    assert float(gtx.safe_root_mean_squares(x, 10.0)) == 10.0


def test_safe_increment_saturates():
    top = torch.tensor(torch.iinfo(torch.int32).max, dtype=torch.int32)
    assert gtx.safe_increment(top) == top and gtx.safe_int32_increment(top) == top
    assert gtx.safe_increment(torch.tensor(4, dtype=torch.int32)) == 5
    assert gtx.safe_increment(torch.tensor(2.5)) == 3.5
    with pytest.raises(ValueError, match="int32"):
        gtx.safe_int32_increment(torch.tensor(1, dtype=torch.int64))


def test_scale_gradient_keeps_values_and_scales_gradients():
    x = torch.tensor([1.5, -2.0, 3.25], requires_grad=True)
    tree = {"a": x, "b": [x * 2.0], "none": None}
    scaled = gtx.scale_gradient(tree, 0.25)
    assert scaled["none"] is None
    assert torch.equal(scaled["a"], x) and torch.equal(scaled["b"][0], x * 2.0)
    (grad,) = torch.autograd.grad(scaled["a"].sum() + scaled["b"][0].sum(), x)
    torch.testing.assert_close(grad, torch.full((3,), 0.25 * 3.0))
    (stopped,) = torch.autograd.grad(gtx.scale_gradient(x, 0.0).sum() + x.sum(), x)
    assert torch.equal(stopped, torch.ones(3))
    plain = torch.ones(2)
    assert gtx.scale_gradient(plain, 0.5) is plain  # nothing to scale without a graph
    # under torch.func too
    (fgrad,) = (torch.func.grad(lambda t: gtx.scale_gradient(t, 3.0).sum())(torch.ones(2)),)
    assert torch.equal(fgrad, torch.full((2,), 3.0))


def test_incremental_update_is_a_polyak_average():
    new = {"w": torch.tensor([1.0, 2.0]), "b": None}
    old = {"w": torch.tensor([3.0, 6.0]), "b": None}
    out = gtx.incremental_update(new, old, 0.25)
    assert torch.equal(out["w"], 0.25 * new["w"] + 0.75 * old["w"]) and out["b"] is None
    assert torch.equal(old["w"], torch.tensor([3.0, 6.0]))  # pure


def test_periodic_update_selects_on_the_period():
    new, old = {"w": torch.ones(2)}, {"w": torch.zeros(2)}
    for step in range(5):
        for steps in (step, torch.tensor(step)):
            out = gtx.periodic_update(new, old, steps, 2)
            assert torch.equal(out["w"], new["w"] if step % 2 == 0 else old["w"]), (step, type(steps))
    with pytest.raises(ValueError, match="update_period"):
        gtx.periodic_update(new, old, 1, 0)
    compiled = torch.compile(lambda s: gtx.periodic_update(new, old, s, 3), fullgraph=True)
    assert torch.equal(compiled(torch.tensor(3))["w"], new["w"])
