"""gradtx.sharding.global_sums without a mesh: the local sums, differentiable, and clear errors."""

from __future__ import annotations

import pytest
import torch

from gradtx.sharding import global_sums


def _trees():
    gen = torch.Generator().manual_seed(0)
    x = {"a": torch.randn(4, 3, generator=gen, dtype=torch.float64), "b": torch.randn(3, generator=gen, dtype=torch.float64), "c": None}
    y = {"a": torch.randn(4, 3, generator=gen, dtype=torch.float64), "b": torch.randn(3, generator=gen, dtype=torch.float64), "c": None}
    return x, y


def test_sums_several_quantities_over_the_leaves():
    x, y = _trees()
    sums = global_sums(lambda a, b: torch.stack([(a * b).sum(), a.abs().sum()]), x, y)
    inner = sum(float((x[k] * y[k]).sum()) for k in ("a", "b"))
    l1 = sum(float(x[k].abs().sum()) for k in ("a", "b"))
    torch.testing.assert_close(sums, torch.tensor([inner, l1], dtype=torch.float64), rtol=1e-14, atol=0)


def test_is_differentiable_without_a_mesh():
    x, y = _trees()
    x = {k: None if v is None else v.clone().requires_grad_() for k, v in x.items()}
    total = global_sums(lambda a, b: (a * b).sum().reshape(1), x, y)[0]
    grads = torch.autograd.grad(total, [x["a"], x["b"]])
    torch.testing.assert_close(grads[0], y["a"])
    torch.testing.assert_close(grads[1], y["b"])


def test_errors_name_the_problem():
    x, y = _trees()
    with pytest.raises(TypeError, match="ShardingSpec"):
        global_sums(lambda a: a.sum().reshape(1), x, spec="tp")
    with pytest.raises(ValueError, match="no tensor leaf"):
        global_sums(lambda a: a.sum().reshape(1), {"c": None})
    with pytest.raises(ValueError, match="no tree"):
        global_sums(lambda a: a.sum().reshape(1))
