"""Complex gradients get torch's norms: ``|z|`` elementwise, in the complex dtype's real dtype, as
``torch.nn.utils.clip_grad_norm_`` computes them (``torch.linalg.vector_norm`` / ``_foreach_norm``),
whether the leaves are complex64, complex128 or mixed with real ones."""

from __future__ import annotations

import math

import pytest
import torch

import gradtx as gtx

NORM_TYPES = [1.0, 2.0, math.inf, 3.0]


def leaves() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        "a": torch.randn(3, 4, dtype=torch.complex64, generator=gen),
        "b": torch.randn(5, generator=gen),
        "c": torch.randn(2, 2, dtype=torch.complex128, generator=gen) * 3,
        "d": torch.randn(3, dtype=torch.float64, generator=gen),
        "e": torch.randn(6, dtype=torch.complex64, generator=gen) / 4,
    }


def torch_clip(tensors: list[torch.Tensor], max_norm: float, norm_type: float) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``clip_grad_norm_`` on parameters whose ``.grad`` are copies of ``tensors``."""
    params = [torch.zeros_like(t, requires_grad=True) for t in tensors]
    for p, t in zip(params, tensors):
        p.grad = t.clone()
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type=norm_type)
    return norm, [p.grad for p in params]


@pytest.mark.parametrize("keys", ["a", "ae", "abcde", "c", "bd"])
@pytest.mark.parametrize("norm_type", NORM_TYPES)
def test_global_norm_and_clip_by_global_norm_match_torch(norm_type, keys):
    tree = {k: v for k, v in leaves().items() if k in keys}
    want, clipped = torch_clip(list(tree.values()), 0.5, norm_type)
    assert torch.equal(gtx.global_norm(tree, norm_type=norm_type), want)
    tx = gtx.clip_by_global_norm(0.5, norm_type=norm_type)
    for inplace in (False, True):
        donated = {k: v.clone() for k, v in tree.items()}
        out, state = tx.update(donated, tx.init(tree), inplace=inplace)
        assert torch.equal(state.norm, want)
        for key, expected in zip(tree, clipped):
            assert out[key].dtype == tree[key].dtype and torch.equal(out[key], expected), key


@pytest.mark.parametrize("norm_type", NORM_TYPES)
def test_wrapped_optimizer_clips_complex_gradients_as_torch(norm_type):
    tensors = list(leaves().values())
    params = [torch.nn.Parameter(torch.zeros_like(t)) for t in tensors]
    opt = gtx.wrap(torch.optim.SGD(params, lr=0.1))
    for p, t in zip(params, tensors):
        p.grad = t.clone()
    want, clipped = torch_clip(tensors, 0.5, norm_type)
    assert torch.equal(opt.clip_grad_by_norm(0.5, norm_type=norm_type), want)
    assert all(torch.equal(p.grad, g) for p, g in zip(params, clipped))
    # and the same clip run inside step
    wrapped = gtx.wrap(torch.optim.SGD(params, lr=0.1), gtx.clip_by_global_norm(0.5, norm_type=norm_type))
    for p, t in zip(params, tensors):
        p.grad = t.clone()
    wrapped.step()
    assert torch.equal(wrapped.tx_state.norm, want)
