"""gradtx.contrib.split_real_and_imaginary: complex leaves optimised as pairs of real ones."""

from __future__ import annotations

import torch
from torch.func import grad

import gradtx as gtx
from gradtx.contrib import SplitRealAndImaginaryState, split_real_and_imaginary
from gradtx.contrib.complex import SplitRealAndImaginaryArrays
from optimizer_helpers import assert_trees_close, assert_trees_equal, clone_tree

CDTYPE, DTYPE = torch.complex128, torch.float64


def _tree(seed):
    gen = torch.Generator().manual_seed(seed)
    return {
        "z": torch.randn(3, 2, generator=gen, dtype=CDTYPE),
        "x": torch.randn(4, generator=gen, dtype=DTYPE),
        "s": torch.randn((), generator=gen, dtype=CDTYPE),
    }


PARAMS = _tree(0)
GRADS = [_tree(10 + i) for i in range(6)]


def reference_adam(params, grads, lr, b1=0.9, b2=0.999, eps=1e-8):
    """Adam on the real leaves and, separately, on the real and imaginary parts of the complex ones."""
    parts = {}
    for k, v in params.items():
        parts.update({(k, "re"): v.real.clone(), (k, "im"): v.imag.clone()} if v.is_complex() else {(k, ""): v.clone()})
    m = {k: torch.zeros_like(v) for k, v in parts.items()}
    n = {k: torch.zeros_like(v) for k, v in parts.items()}
    for t, g in enumerate(grads, start=1):
        split = {}
        for k, v in g.items():
            split.update({(k, "re"): v.real, (k, "im"): v.imag} if v.is_complex() else {(k, ""): v})
        for k in parts:
            m[k] = b1 * m[k] + (1 - b1) * split[k]
            n[k] = b2 * n[k] + (1 - b2) * split[k] ** 2
            parts[k] = parts[k] - lr * (m[k] / (1 - b1**t)) / (torch.sqrt(n[k] / (1 - b2**t)) + eps)
    return {
        k: torch.complex(parts[(k, "re")], parts[(k, "im")]) if v.is_complex() else parts[(k, "")]
        for k, v in params.items()
    }


def run(tx, *, inplace=False):
    p = clone_tree(PARAMS)
    state = tx.init(p)
    for g in GRADS:
        updates, state = tx.update(clone_tree(g), state, p, inplace=inplace)
        p = gtx.apply_updates(p, updates)
    return p, state


def test_adam_on_split_parts_matches_the_reference_and_torch_adam():
    for inplace in (False, True):
        got, state = run(split_real_and_imaginary(gtx.adam(0.05)), inplace=inplace)
        assert_trees_close(got, reference_adam(PARAMS, GRADS, 0.05), rtol=1e-9, atol=1e-12)
    assert isinstance(state, SplitRealAndImaginaryState)
    mu = state.inner_state[0].mu
    assert isinstance(mu["z"], SplitRealAndImaginaryArrays) and mu["z"].real.dtype == DTYPE
    assert isinstance(mu["x"], torch.Tensor)
    # torch.optim.Adam views a complex parameter as its real pairs: the same algorithm
    tensors = {k: v.clone().requires_grad_() for k, v in PARAMS.items()}
    opt = torch.optim.Adam(list(tensors.values()), lr=0.05)
    for g in GRADS:
        for k, t in tensors.items():
            t.grad = g[k].clone()
        opt.step()
    assert_trees_close(got, {k: t.detach() for k, t in tensors.items()}, rtol=1e-9, atol=1e-12)


def test_plain_adam_on_complex_leaves_differs():
    """Without the split, |g|^2 mixes the parts: the reason this wrapper exists."""
    got, _ = run(gtx.adam(0.05))
    expected = reference_adam(PARAMS, GRADS, 0.05)
    assert not torch.allclose(got["z"], expected["z"], rtol=1e-6)
    torch.testing.assert_close(got["x"], expected["x"], rtol=1e-12, atol=0)


def test_pure_equals_donated_and_mutates_nothing():
    tx = split_real_and_imaginary(gtx.chain(gtx.clip_by_global_norm(1.0), gtx.adamw(0.05, weight_decay=0.1)))
    pure_state, donated_state = tx.init(PARAMS), tx.init(PARAMS)
    p = clone_tree(PARAMS)
    for step, g in enumerate(GRADS):
        before = (clone_tree(g), clone_tree(pure_state), clone_tree(p))
        pure_updates, new_state = tx.update(g, pure_state, p)
        assert_trees_equal((g, pure_state, p), before, f"step {step}: the pure update mutated its inputs")
        donated_updates, donated_state = tx.update(clone_tree(g), donated_state, p, inplace=True)
        assert_trees_equal(donated_updates, pure_updates, f"step {step}")
        assert_trees_equal(donated_state, new_state, f"step {step}")
        assert pure_updates["z"].dtype == CDTYPE and pure_updates["x"].dtype == DTYPE
        pure_state, p = new_state, gtx.apply_updates(p, pure_updates)


def test_none_leaves_and_real_leaves_pass_through():
    tx = split_real_and_imaginary(gtx.scale(-2.0))
    g = {"z": torch.tensor([1.0 + 1.0j]), "x": torch.tensor([3.0]), "n": None}
    out, _ = tx.update(g, tx.init({"z": torch.zeros(1, dtype=torch.complex64), "x": torch.zeros(1), "n": None}))
    assert out["n"] is None
    assert torch.equal(out["z"], torch.tensor([-2.0 - 2.0j])) and torch.equal(out["x"], torch.tensor([-6.0]))


def test_meta_gradient_through_complex_parameters():
    """d loss(after 3 Adam steps on the parts) / d (real, imaginary parts of the start), against
    central differences."""
    target = torch.tensor([1.0 - 2.0j, 0.5 + 0.5j], dtype=CDTYPE)

    def loss(p):
        return ((p["z"] - target).abs() ** 2).sum()

    def final(x):
        params = {"z": torch.complex(x[0], x[1])}
        tx = split_real_and_imaginary(gtx.adam(0.1))
        state = tx.init(params)
        for _ in range(3):
            g = {"z": torch.complex(*[d for d in grad(lambda re, im: loss({"z": torch.complex(re, im)}), argnums=(0, 1))(params["z"].real, params["z"].imag)])}
            updates, state = tx.update(g, state, params)
            params = gtx.apply_updates(params, updates)
        return loss(params)

    x0 = torch.tensor([[0.3, -1.0], [2.0, 0.1]], dtype=DTYPE)
    computed = grad(final)(x0)
    expected = torch.zeros_like(x0)
    for i in range(x0.numel()):
        e = torch.zeros(x0.numel(), dtype=DTYPE)
        e[i] = 1e-6
        e = e.reshape(x0.shape)
        expected.view(-1)[i] = (final(x0 + e) - final(x0 - e)) / 2e-6
    torch.testing.assert_close(computed, expected, rtol=1e-5, atol=1e-8)


def test_torch_gradient_of_a_complex_parameter_is_the_pair_of_real_gradients():
    """The convention the module docstring relies on: no conjugation between autograd and update."""
    z = torch.tensor([0.3 - 1.0j, 2.0 + 0.1j], dtype=CDTYPE, requires_grad=True)
    target = torch.tensor([1.0 - 2.0j, 0.5 + 0.5j], dtype=CDTYPE)
    (g,) = torch.autograd.grad(((z - target).abs() ** 4).sum(), z)
    re, im = z.detach().real.clone().requires_grad_(), z.detach().imag.clone().requires_grad_()
    d_re, d_im = torch.autograd.grad(((torch.complex(re, im) - target).abs() ** 4).sum(), (re, im))
    torch.testing.assert_close(g, torch.complex(d_re, d_im), rtol=1e-12, atol=0)
