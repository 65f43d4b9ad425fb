"""Muon (gradtx.contrib) against a float64 reference written from optax's definition, against
torch.optim.Muon where the two definitions agree (and where they do not), and the house
properties: pure == in-place, no input mutation, vmap, errors."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

import gradtx as gtx
from gradtx.contrib import MuonDimensionNumbers, MuonState, muon, scale_by_muon

DTYPE = torch.float64
STEPS = 5
STANDARD = (3.4445, -4.7750, 2.0315)
DION = (
    (4.0848, -6.8946, 2.9270),
    (3.9505, -6.3029, 2.6377),
    (3.7418, -5.5913, 2.3037),
    (2.8769, -3.1427, 1.2046),
    (2.8366, -3.0525, 1.2012),
)


# --------------------------------------------------------------------------- the reference


def ref_newton_schulz(m, rows, preconditioning, eps):
    """One matrix, loops and explicit products, as optax's orthogonalize_via_newton_schulz reads."""
    flip = m.shape[0] > m.shape[1]
    x = m.T if flip else m
    if preconditioning == "frobenius":
        x = x / (torch.sqrt((x * x).sum()) + eps)
    elif preconditioning == "spectral":
        x = x / (torch.linalg.svdvals(x)[0] + eps)
    for i, (a, b, c) in enumerate(rows):
        gram = x @ x.T
        if i == 0 and preconditioning == "aol":
            s = 1.0 / torch.sqrt(torch.clamp(gram.abs().sum(1), min=1e-8))
            x = s[:, None] * x
            gram = s[:, None] * gram * s[None, :]
        elif i == 0 and preconditioning == "schatten":
            s = 1.0 / torch.sqrt(torch.clamp(torch.sqrt((gram * gram).sum()), min=1e-8))
            x, gram = s * x, s * s * gram
        x = a * x + b * (gram @ x) + c * (gram @ (gram @ x))
    return x.T if flip else x


def ref_orthogonalize(t, dims, rows, preconditioning, eps):
    red = [dims.reduction_axis] if isinstance(dims.reduction_axis, int) else list(dims.reduction_axis)
    out = [dims.output_axis] if isinstance(dims.output_axis, int) else list(dims.output_axis)
    red, out = [a % t.ndim for a in red], [a % t.ndim for a in out]
    batch = [a for a in range(t.ndim) if a not in red + out]
    moved = t.permute(batch + red + out)
    result = torch.empty_like(moved)
    n_red = math.prod(t.shape[a] for a in red)
    for index in itertools.product(*(range(t.shape[a]) for a in batch)):
        block = moved[index]
        result[index] = ref_newton_schulz(block.reshape(n_red, -1), rows, preconditioning, eps).reshape(block.shape)
    inverse = [0] * t.ndim
    for position, axis in enumerate(batch + red + out):
        inverse[axis] = position
    return result.permute(inverse)


def ref_scale_by_muon(grads, *, beta=0.95, eps=1e-8, nesterov=True, adaptive=False, preconditioning="frobenius", coeffs=STANDARD, ns_steps=5, dims=None):
    """The directions scale_by_muon gives for one leaf's gradients, step by step."""
    dims = dims or MuonDimensionNumbers()
    rows = [coeffs] * ns_steps if isinstance(coeffs[0], float) else list(coeffs)[-ns_steps:]
    mu, outs = torch.zeros_like(grads[0]), []
    for t, g in enumerate(grads, start=1):
        mu = beta * mu + (1 - beta) * g
        if nesterov:
            est = beta * mu / (1 - beta ** (t + 1)) + (1 - beta) * g / (1 - beta**t)
        else:
            est = mu / (1 - beta**t)
        o = ref_orthogonalize(est, dims, rows, preconditioning, eps)
        if adaptive:
            o = (est * o).sum() * o
        outs.append(o)
    return outs


def ref_shape_factor(shape, dims, consistent_rms=None):
    red = [dims.reduction_axis] if isinstance(dims.reduction_axis, int) else dims.reduction_axis
    out = [dims.output_axis] if isinstance(dims.output_axis, int) else dims.output_axis
    fan_in, fan_out = math.prod(shape[a] for a in red), math.prod(shape[a] for a in out)
    if consistent_rms is not None:
        return math.sqrt(max(fan_in, fan_out)) * consistent_rms
    return math.sqrt(max(1, fan_out / fan_in))


def _grads(shape, steps=STEPS, seed=0, dtype=DTYPE):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen, dtype=dtype) for _ in range(steps)]


def _directions(tx, grads, name="w", inplace=False):
    state = tx.init({name: torch.zeros_like(grads[0])})
    outs = []
    for g in grads:
        updates, state = tx.update({name: g.clone()}, state, inplace=inplace)
        outs.append(updates[name])
    return outs


CONFIGS = {
    "default": {},
    "plain_momentum": {"nesterov": False, "beta": 0.8},
    "adaptive": {"adaptive": True},
    "spectral": {"preconditioning": "spectral", "ns_steps": 3},
    "aol": {"preconditioning": "aol", "ns_steps": 4},
    "schatten": {"preconditioning": "schatten"},
    "dion": {"coeffs": DION},
    "eps": {"eps": 1e-2},
}


def _kwargs(config):
    kw = dict(config)
    if "coeffs" in kw:
        kw["ns_coeffs"] = kw.pop("coeffs")
    return kw


@pytest.mark.parametrize("shape", [(5, 8), (8, 5), (6, 6)])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_scale_by_muon_matches_the_reference(name, shape):
    config = CONFIGS[name]
    grads = _grads(shape)
    expected = ref_scale_by_muon(grads, **config)
    got = _directions(scale_by_muon(**_kwargs(config)), grads)
    for step, (a, b) in enumerate(zip(got, expected)):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12, msg=f"step {step}")


@pytest.mark.parametrize(
    "shape,dims",
    [
        ((3, 4, 5), MuonDimensionNumbers(1, 2)),  # stacked experts: each (4, 5) its own matrix
        ((6, 3, 2, 2), MuonDimensionNumbers((1, 2, 3), 0)),  # a conv kernel (out, in, kh, kw)
        ((4, 2, 5), MuonDimensionNumbers(0, -1)),  # batch axis in the middle
    ],
)
@pytest.mark.parametrize("adaptive", [False, True])
def test_dimension_numbers_batch_and_flatten_like_the_reference(shape, dims, adaptive):
    grads = _grads(shape, steps=3)
    expected = ref_scale_by_muon(grads, dims=dims, adaptive=adaptive)
    for tx in (
        scale_by_muon(adaptive=adaptive, weight_dimension_numbers=dims),
        scale_by_muon(adaptive=adaptive, weight_dimension_numbers={"w": dims}),
        scale_by_muon(adaptive=adaptive, weight_dimension_numbers=lambda tree: {k: dims for k in tree}),
    ):
        for step, (a, b) in enumerate(zip(_directions(tx, grads), expected)):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12, msg=f"step {step}")


@pytest.mark.parametrize("consistent_rms", [None, 0.2])
def test_muon_is_scaled_muon_on_matrices_and_adamw_elsewhere(consistent_rms):
    shapes = {"w": (4, 7), "v": (7, 3), "conv": (6, 2, 3), "b": (7,), "s": ()}
    dims = {"w": MuonDimensionNumbers(), "v": MuonDimensionNumbers(), "conv": MuonDimensionNumbers((1, 2), 0), "b": None, "s": None}
    lr, wd = 0.03, 0.1
    gen = torch.Generator().manual_seed(3)
    params = {k: torch.randn(s, generator=gen, dtype=DTYPE) for k, s in shapes.items()}
    grads = [{k: torch.randn(s, generator=gen, dtype=DTYPE) for k, s in shapes.items()} for _ in range(4)]
    for weight_dims in (None, dims):
        use = dims if weight_dims is not None else {k: (MuonDimensionNumbers() if len(s) == 2 else None) for k, s in shapes.items()}
        tx = muon(lr, weight_decay=wd, consistent_rms=consistent_rms, adam_learning_rate=0.01, adam_weight_decay=0.05, muon_weight_dimension_numbers=weight_dims)
        adam = gtx.adamw(0.01, weight_decay=0.05, nesterov=True)
        p, state = dict(params), tx.init(params)
        adam_p = {k: v for k, v in params.items() if use[k] is None}
        adam_state = adam.init(adam_p)
        ref = {k: ref_scale_by_muon([g[k] for g in grads], dims=use[k]) for k in shapes if use[k] is not None}
        for step, g in enumerate(grads):
            updates, state = tx.update(g, state, p)
            adam_updates, adam_state = adam.update({k: g[k] for k in adam_p}, adam_state, adam_p)
            for k in shapes:
                if use[k] is None:
                    expected = adam_updates[k]
                else:
                    expected = -lr * (ref_shape_factor(shapes[k], use[k], consistent_rms) * ref[k][step] + wd * p[k])
                torch.testing.assert_close(updates[k], expected, rtol=1e-9, atol=1e-12, msg=f"{k} step {step}")
            p = gtx.apply_updates(p, updates)
            adam_p = {k: p[k] for k in adam_p}


# --------------------------------------------------------------------------- torch.optim.Muon


def _torch_muon_run(params, grads, **kw):
    p = torch.nn.Parameter(params.clone())
    opt = torch.optim.Muon([p], **kw)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    return p.detach()


def _gtx_run(tx, params, grads):
    p, state = {"w": params.clone()}, tx.init({"w": params})
    for g in grads:
        updates, state = tx.update({"w": g.clone()}, state, p)
        p = gtx.apply_updates(p, updates)
    return p["w"]


@pytest.mark.parametrize("adjust", [None, "match_rms_adamw"])
def test_agrees_with_torch_optim_muon_without_nesterov(adjust):
    """Where the definitions agree: plain momentum (optax's bias correction is a scale, which the
    normalization before Newton-Schulz removes), decoupled weight decay ``lr * wd * param``, and
    torch's learning-rate adjustments, which are optax's shape scalings for a torch-layout
    ``(out, in)`` weight: ``MuonDimensionNumbers(reduction_axis=1, output_axis=0)``. torch runs
    Newton-Schulz in bfloat16, hence the tolerance."""
    gen = torch.Generator().manual_seed(0)
    params = torch.randn(12, 5, generator=gen)  # torch layout: out x in, A / B = 12 / 5
    grads = [torch.randn(12, 5, generator=gen) for _ in range(4)]
    lr, wd = 0.02, 0.1
    expected = _torch_muon_run(params, grads, lr=lr, weight_decay=wd, nesterov=False, adjust_lr_fn=adjust)
    tx = muon(
        lr,
        weight_decay=wd,
        nesterov=False,
        consistent_rms=0.2 if adjust == "match_rms_adamw" else None,
        muon_weight_dimension_numbers=MuonDimensionNumbers(reduction_axis=1, output_axis=0),
    )
    got = _gtx_run(tx, params, grads)
    moved = (expected - params).abs().max()
    torch.testing.assert_close(got - params, expected - params, rtol=0, atol=0.03 * float(moved))
    # the default dimension numbers read (12, 5) as (in, out): no width scaling where torch has sqrt(12 / 5)
    if adjust is None:
        plain = _gtx_run(muon(lr, weight_decay=wd, nesterov=False), params, grads)
        assert (plain - got).abs().max() > 0.1 * moved


def test_nesterov_differs_from_torch_optim_muon_after_the_first_step():
    """optax's Nesterov estimate bias-corrects its two terms differently (``1 - beta^(t+1)`` and
    ``1 - beta^t``); torch's ``lerp(g, buf, momentum)`` does not. The first step's estimates are
    both multiples of ``g`` (same direction, same update); later ones are not."""
    gen = torch.Generator().manual_seed(1)
    params = torch.randn(6, 6, generator=gen)
    grads = [torch.randn(6, 6, generator=gen) for _ in range(3)]
    tx = lambda: muon(0.02, weight_decay=0.0)  # noqa: E731
    first = _torch_muon_run(params, grads[:1], lr=0.02, weight_decay=0.0)
    torch.testing.assert_close(_gtx_run(tx(), params, grads[:1]) - params, first - params, rtol=0, atol=0.03 * 0.02)
    later = _torch_muon_run(params, grads, lr=0.02, weight_decay=0.0)
    assert (_gtx_run(tx(), params, grads) - later).abs().max() > 0.1 * 0.02


# --------------------------------------------------------------------------- properties


def _tree(seed, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(6, 4, generator=gen, dtype=dtype), "e": torch.randn(2, 3, 5, generator=gen, dtype=dtype), "b": torch.randn(4, generator=gen, dtype=dtype)}


FACTORIES = {
    "muon": lambda: muon(0.02, weight_decay=0.1, muon_weight_dimension_numbers={"w": MuonDimensionNumbers(), "e": MuonDimensionNumbers(1, 2), "b": None}),
    "muon_adaptive_aol": lambda: muon(0.02, adaptive=True, preconditioning="aol", consistent_rms=0.2),
    "scale_by_muon_dion": lambda: gtx.masked(scale_by_muon(ns_coeffs=DION, nesterov=False, weight_dimension_numbers={"w": MuonDimensionNumbers(), "e": MuonDimensionNumbers(1, 2), "b": None}), {"w": True, "e": True, "b": False}),
    "muon_mu_dtype": lambda: muon(0.02, mu_dtype=torch.bfloat16),
}


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_pure_equals_inplace_and_mutates_nothing(name):
    tx = FACTORIES[name]()
    params = _tree(0)
    pure_state, donated_state = tx.init(params), tx.init(params)
    for step in range(3):
        grads = _tree(10 + step)
        snapshot = ({k: v.clone() for k, v in grads.items()}, torch.utils._pytree.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, pure_state))
        updates, new_state = tx.update(grads, pure_state, params)
        for k in grads:
            assert torch.equal(grads[k], snapshot[0][k]), f"the pure update mutated grads[{k!r}]"
        for a, b in zip(torch.utils._pytree.tree_leaves(pure_state), torch.utils._pytree.tree_leaves(snapshot[1])):
            if isinstance(a, torch.Tensor):
                assert torch.equal(a, b), "the pure update mutated its state"
        donated, donated_state = tx.update({k: v.clone() for k, v in grads.items()}, donated_state, params, inplace=True)
        for k in grads:
            assert torch.equal(updates[k], donated[k]), f"step {step}: in-place differs for {k!r}"
        pure_state = new_state


def test_state_and_mu_dtype():
    params = _tree(0)
    tx = scale_by_muon(mu_dtype=torch.bfloat16, ns_coeffs=DION)
    state = tx.init({"w": params["w"]})
    assert isinstance(state, MuonState) and state.count.dtype == torch.int32 and state.count.ndim == 0
    assert state.mu["w"].dtype == torch.bfloat16 and tuple(state.ns_coeffs.shape) == (5, 3)
    updates, state = tx.update({"w": params["w"]}, state)
    assert updates["w"].dtype == torch.float32 and state.mu["w"].dtype == torch.bfloat16 and int(state.count) == 1
    # optax's quirk kept: per-step rows must not outnumber ns_steps
    with pytest.raises(ValueError, match="Not enough coeffs"):
        scale_by_muon(ns_coeffs=DION, ns_steps=3)


def test_vmap_over_a_batch_of_gradients():
    tx = scale_by_muon(adaptive=True, weight_dimension_numbers={"w": MuonDimensionNumbers(), "e": MuonDimensionNumbers(1, 2)})
    grads = [{k: v for k, v in _tree(s, DTYPE).items() if k != "b"} for s in range(3)]
    state = tx.init(grads[0])
    batched = {k: torch.stack([g[k] for g in grads]) for k in grads[0]}
    got = torch.func.vmap(lambda g: tx.update(g, state)[0])(batched)
    for i, g in enumerate(grads):
        expected = tx.update(g, state)[0]
        for k in g:
            torch.testing.assert_close(got[k][i], expected[k], rtol=1e-12, atol=1e-14)


def test_errors():
    with pytest.raises(ValueError, match=r"'b'.*rank >= 2"):
        scale_by_muon().update({"b": torch.ones(3)}, scale_by_muon().init({"b": torch.ones(3)}))
    with pytest.raises(ValueError, match="overlap"):
        tx = scale_by_muon(weight_dimension_numbers=MuonDimensionNumbers(0, -2))
        tx.update({"w": torch.ones(3, 2)}, tx.init({"w": torch.ones(3, 2)}))
    with pytest.raises(ValueError, match="preconditioning"):
        scale_by_muon(preconditioning="polar")
    with pytest.raises(ValueError, match=r"shape \(3,\) or \(n, 3\)"):
        scale_by_muon(ns_coeffs=(1.0, 2.0))
    with pytest.raises(ValueError, match="preset"):
        muon(0.1, ns_coeffs="nope")
    with pytest.raises(ValueError, match=r"'w'.*no dimension numbers"):
        tx = scale_by_muon(weight_dimension_numbers={"w": None})
        tx.update({"w": torch.ones(3, 2)}, tx.init({"w": torch.ones(3, 2)}))
    with pytest.raises(ValueError, match="strategy"):
        scale_by_muon(strategy="scatter")
    with pytest.raises(ValueError, match="do not fit"):
        tx = scale_by_muon(weight_dimension_numbers={"x": MuonDimensionNumbers()})
        tx.update({"w": torch.ones(3, 2)}, tx.init({"w": torch.ones(3, 2)}))
