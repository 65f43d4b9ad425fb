"""multi_normal: a diagonal Gaussian from its log scale, checked against the closed-form density."""

from __future__ import annotations

import math

import pytest
import torch

import gradtx as gtx
from gradtx.distributions import MultiNormalDiagFromLogScale

F64 = torch.float64


def log_density(x, loc, log_scale):
    """Sum over the parameter's axes of the univariate normal log densities, written out."""
    scale = math.e ** log_scale
    z = (x - loc) / scale
    terms = -0.5 * z * z - log_scale - 0.5 * math.log(2 * math.pi)
    return terms.flatten(start_dim=x.ndim - loc.ndim).sum(-1)


def test_log_prob_and_shapes():
    loc = torch.tensor([[0.5, -1.0, 2.0], [0.0, 0.25, -0.5]], dtype=F64)
    log_scale = torch.tensor([0.1, -0.3, 0.7], dtype=F64)  # broadcasts over loc's first axis
    dist = gtx.multi_normal(loc, log_scale)
    assert isinstance(dist, MultiNormalDiagFromLogScale) and isinstance(dist, torch.distributions.Distribution)
    assert dist.event_shape == (2, 3) and dist.batch_shape == ()
    x = torch.randn(4, 2, 3, dtype=F64, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(dist.log_prob(x), log_density(x, loc, log_scale.expand(2, 3)), rtol=1e-14, atol=1e-14)
    assert dist.log_scale is log_scale
    assert dist.params[0] is loc and dist.params[1] is log_scale


def test_sample_is_seeded_reparametrised_and_has_the_right_moments():
    loc = torch.tensor([1.0, -2.0], dtype=F64, requires_grad=True)
    log_scale = torch.tensor([0.0, math.log(3.0)], dtype=F64, requires_grad=True)
    dist = gtx.multi_normal(loc, log_scale)
    draws = dist.sample((20000,), key=0)
    assert draws.shape == (20000, 2) and draws.dtype == F64
    assert torch.equal(draws, dist.sample((20000,), key=torch.Generator().manual_seed(0)))
    assert not torch.equal(draws, dist.sample((20000,), key=1))
    mean, std = draws.detach().mean(0), draws.detach().std(0)
    torch.testing.assert_close(mean, torch.tensor([1.0, -2.0], dtype=F64), rtol=0, atol=0.07)
    torch.testing.assert_close(std, torch.tensor([1.0, 3.0], dtype=F64), rtol=0.03, atol=0)
    # d(sample)/d(loc) = 1 and d(sample)/d(log_scale) = sample - loc, per coordinate
    draws.sum().backward()
    torch.testing.assert_close(loc.grad, torch.full((2,), 20000.0, dtype=F64))
    torch.testing.assert_close(log_scale.grad, (draws - loc).detach().sum(0))
    assert dist.rsample((3,)).shape == (3, 2)


def test_scalar_parameters_and_errors():
    dist = gtx.multi_normal(0.0, 0.0)
    assert dist.sample((5,), key=2).shape == (5,)
    torch.testing.assert_close(dist.log_prob(torch.tensor(0.0)), torch.tensor(-0.5 * math.log(2 * math.pi)))
    with pytest.raises(ValueError, match=r"loc of shape \(2,\) and log_scale of shape \(3,\) do not broadcast"):
        gtx.multi_normal(torch.zeros(2), torch.zeros(3))
    with pytest.raises(TypeError, match="key must be"):
        dist.sample((2,), key="seed")
