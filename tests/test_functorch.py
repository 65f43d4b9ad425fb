"""Clipping under torch.func (vmap for per-example clipping, grad) and torch.compile(fullgraph=True)."""

from __future__ import annotations

import math

import pytest
import torch
from torch.func import functional_call, grad, vmap

import gradtx as gtx
from gradtx import tree as tree_lib


def small_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 3))


def loss_fn(model, params, x, y):
    logits = functional_call(model, params, (x.unsqueeze(0),))
    return torch.nn.functional.cross_entropy(logits, y.unsqueeze(0)) * 20.0


def batch(n=6):
    gen = torch.Generator().manual_seed(1)
    return torch.randn(n, 5, generator=gen), torch.randint(0, 3, (n,), generator=gen)


@pytest.mark.parametrize("norm_type", [2.0, math.inf])
def test_per_example_clipping_under_vmap_equals_a_loop(norm_type):
    model = small_model()
    params = {k: v.detach() for k, v in model.named_parameters()}
    x, y = batch()
    tx = gtx.clip_by_global_norm(0.5, norm_type=norm_type)

    def clipped_grad(x1, y1):
        g = grad(lambda p: loss_fn(model, p, x1, y1))(params)
        updates, state = tx.update(g, tx.init(params))
        return updates, state.norm

    batched, norms = vmap(clipped_grad)(x, y)
    assert norms.shape == (len(x),)
    for i in range(len(x)):
        # the reference: torch's own clip_grad_norm_ on a real backward pass for example i
        model.zero_grad()
        loss_fn(model, dict(model.named_parameters()), x[i], y[i]).backward()
        torch_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5, norm_type=norm_type)
        torch.testing.assert_close(norms[i], torch_norm, rtol=1e-5, atol=1e-6)
        for name, p in model.named_parameters():
            torch.testing.assert_close(batched[name][i], p.grad, rtol=1e-5, atol=1e-7)
        # and gradtx outside vmap, leaf by leaf
        looped, looped_norm = clipped_grad(x[i], y[i])
        torch.testing.assert_close(norms[i], looped_norm, rtol=1e-6, atol=0)
        for name in params:
            torch.testing.assert_close(batched[name][i], looped[name], rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize(
    "tx", [gtx.clip_by_value(0.05), gtx.clip_by_block_rms(0.02), gtx.adaptive_grad_clip(0.01)], ids=["value", "block_rms", "agc"]
)
def test_other_clips_under_vmap_equal_a_loop(tx):
    gen = torch.Generator().manual_seed(2)
    params = {"w": torch.randn(4, 3, generator=gen), "b": torch.randn(4, generator=gen), "s": torch.randn((), generator=gen)}
    per_example = {k: torch.randn(5, *v.shape, generator=gen) * 0.3 for k, v in params.items()}
    per_example["frozen"] = None
    params["frozen"] = torch.ones(2)
    in_dims = ({"w": 0, "b": 0, "s": 0, "frozen": None},)
    passed_through = []

    def clip_one(g):
        updates, _ = tx.update(g, tx.init(params), params)
        passed_through.append(updates.pop("frozen") is None)  # vmap cannot return None
        return updates

    batched = vmap(clip_one, in_dims=in_dims)(per_example)
    assert passed_through == [True]
    for i in range(5):
        one = {k: (v[i] if v is not None else None) for k, v in per_example.items()}
        looped, _ = tx.update(one, tx.init(params), params)
        for k in ("w", "b", "s"):
            torch.testing.assert_close(batched[k][i], looped[k], rtol=1e-6, atol=1e-8)


def test_vmap_keeps_dtypes_and_none():
    grads = {"h": torch.randn(3, 4).half() * 100, "s": torch.randn(3).bfloat16(), "n": None}
    in_dims = ({"h": 0, "s": 0, "n": None},)
    tx = gtx.clip_by_global_norm(1.0)
    passed_through = []

    def clip_one(g):
        updates, state = tx.update(g, tx.init(g))
        passed_through.append(updates.pop("n") is None)  # vmap cannot return None
        return updates, state.norm

    out, norms = vmap(clip_one, in_dims=in_dims)(grads)
    assert out["h"].dtype == torch.float16 and out["s"].dtype == torch.bfloat16 and passed_through == [True]
    assert norms.dtype == torch.float32
    expected = torch.sqrt(grads["h"].float().pow(2).sum(1) + grads["s"].float().pow(2))
    torch.testing.assert_close(norms, expected, rtol=1e-6, atol=0)


def test_grad_differentiates_through_clip_by_global_norm():
    """d/dg of <w, clip(g)>, via torch.func.grad through gradtx, equals autograd through plain torch ops."""
    gen = torch.Generator().manual_seed(3)
    g = {"a": torch.randn(4, 3, generator=gen, dtype=torch.float64), "b": torch.randn(5, generator=gen, dtype=torch.float64)}
    w = {k: torch.randn(v.shape, generator=gen, dtype=torch.float64) for k, v in g.items()}
    tx = gtx.clip_by_global_norm(1.5)

    def objective(grads):
        clipped, _ = tx.update(grads, tx.init(grads))
        return sum((clipped[k] * w[k]).sum() for k in grads)

    actual = grad(objective)(g)

    leaves = {k: v.clone().requires_grad_() for k, v in g.items()}
    norm = torch.sqrt(sum(v.pow(2).sum() for v in leaves.values()))
    coef = torch.clamp(1.5 / (norm + 1e-6), max=1.0)
    reference = sum((leaves[k] * coef * w[k]).sum() for k in leaves)
    expected = torch.autograd.grad(reference, list(leaves.values()))
    assert norm.item() > 1.5  # the clipping branch, where the coefficient depends on g
    for k, e in zip(leaves, expected):
        torch.testing.assert_close(actual[k], e, rtol=1e-10, atol=1e-12)


def test_compiled_clip_chain_with_fullgraph_equals_eager():
    tx = gtx.chain(gtx.clip_by_global_norm(1.0), gtx.clip_by_value(0.2), gtx.clip_by_block_rms(0.1))
    gen = torch.Generator().manual_seed(4)

    def grads(scale):
        return {
            "w": torch.randn(8, 4, generator=gen) * scale,
            "b": torch.randn(4, generator=gen) * scale,
            "h": (torch.randn(16, generator=gen) * scale).half(),
            "s": torch.randn((), generator=gen) * scale,
            "frozen": None,
        }

    first = grads(5.0)
    state = tx.init(first)
    compiled = torch.compile(lambda u, s: tx.update(u, s), fullgraph=True)

    def check(g):
        eager_updates, eager_state = tx.update(g, state)
        updates, new_state = compiled(g, state)
        assert updates["frozen"] is None
        for k in ("w", "b", "h", "s"):
            assert updates[k].dtype == g[k].dtype
            torch.testing.assert_close(updates[k], eager_updates[k], rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(new_state[0].norm, eager_state[0].norm, rtol=1e-6, atol=0)
        assert tree_lib.structure(new_state) == tree_lib.structure(state)

    check(first)
    with torch.compiler.set_stance("fail_on_recompile"):  # new values of the same shapes reuse the graph
        check(grads(0.01))
