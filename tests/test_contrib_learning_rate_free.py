"""Prodigy, D-Adaptation AdamW, DoG, DoWG, COCOB and Mechanic against float64 references written
from their definitions (optax.contrib's), plus the pure/donated/mutation contract and the states."""

from __future__ import annotations

import math

import pytest
import torch

import gradtx as gtx
from contrib_helpers import (
    assert_close_history,
    assert_pure_equals_inplace,
    assert_pure_update_does_not_mutate,
    initial_params,
    run,
    run_reference,
    value_and_grad,
)
from gradtx import contrib

STEPS = 6


def _norm_sq(tree):
    return sum(float((t * t).sum()) for t in tree.values())


def _vdot(a, b):
    return sum(float((a[k] * b[k]).sum()) for k in a)


def _rate(learning_rate, step):
    return float(learning_rate(torch.tensor(step))) if callable(learning_rate) else learning_rate


# --------------------------------------------------------------------------- references


class Prodigy:
    def __init__(self, x, lr=1.0, betas=(0.9, 0.999), beta3=None, eps=1e-8, d0=1e-6, coef=1.0, wd=0.0, safeguard=False):
        self.lr, (self.b1, self.b2), self.eps, self.d0, self.coef, self.wd = lr, betas, eps, d0, coef, wd
        self.b3 = math.sqrt(self.b2) if beta3 is None else beta3
        self.safeguard = safeguard
        self.m = {k: torch.zeros_like(v) for k, v in x.items()}
        self.v = {k: torch.zeros_like(v) for k, v in x.items()}
        self.s = {k: torch.zeros_like(v) for k, v in x.items()}
        self.x0 = {k: v.clone() for k, v in x.items()}
        self.d, self.r, self.t = d0, 0.0, 0

    def step(self, g, x, value):
        lr = _rate(self.lr, self.t)
        self.t += 1
        d = self.d
        dlr = d * lr * math.sqrt(1 - self.b2**self.t) / (1 - self.b1**self.t)
        inner = _vdot(g, {k: self.x0[k] - x[k] for k in x})
        for k in x:
            self.m[k] = self.b1 * self.m[k] + (1 - self.b1) * d * g[k]
            self.v[k] = self.b2 * self.v[k] + (1 - self.b2) * (d * g[k]) ** 2
            self.s[k] = self.b3 * self.s[k] + (d if self.safeguard else dlr) * d * g[k] / self.d0
        self.r = self.b3 * self.r + (d / self.d0) * dlr * inner
        self.d = max(d, self.coef * self.r / sum(float(s.abs().sum()) for s in self.s.values()))
        return {k: -self.wd * dlr * x[k] - dlr * self.m[k] / (self.v[k].sqrt() + self.d * self.eps) for k in x}


class DAdaptAdamW:
    def __init__(self, x, lr=1.0, betas=(0.9, 0.999), eps=1e-8, d0=1e-6, wd=0.0):
        self.lr, (self.b1, self.b2), self.eps, self.wd = lr, betas, eps, wd
        self.m = {k: torch.zeros_like(v) for k, v in x.items()}
        self.v = {k: torch.zeros_like(v) for k, v in x.items()}
        self.s = {k: torch.zeros_like(v) for k, v in x.items()}
        self.d, self.r, self.t = d0, 0.0, 0

    def step(self, g, x, value):
        lr = _rate(self.lr, self.t)
        self.t += 1
        sb2 = math.sqrt(self.b2)
        dlr = self.d * lr * math.sqrt(1 - self.b2**self.t) / (1 - self.b1**self.t)
        inner = _vdot(g, {k: self.s[k] / (self.v[k].sqrt() + self.eps) for k in x})
        for k in x:
            self.m[k] = self.b1 * self.m[k] + (1 - self.b1) * dlr * g[k]
            self.v[k] = self.b2 * self.v[k] + (1 - self.b2) * g[k] ** 2
            self.s[k] = sb2 * self.s[k] + (1 - sb2) * dlr * g[k]
        self.r = sb2 * self.r + (1 - sb2) * dlr * inner
        self.d = max(self.d, self.r / ((1 - sb2) * sum(float(s.abs().sum()) for s in self.s.values())))
        return {k: -self.wd * dlr * x[k] - self.m[k] / (self.v[k].sqrt() + self.eps) for k in x}


class DoG:
    def __init__(self, x, lr=1.0, init=("heuristic", 1e-6), eps=1e-8, wd=None):
        self.lr, self.init, self.eps, self.wd = lr, init, eps, wd
        self.x0 = {k: v.clone() for k, v in x.items()}
        kind, value = init
        self.rbar = {"distance": value, "heuristic": value * (1 + math.sqrt(_norm_sq(x))), "learning_rate": 0.0}[kind]
        self.G, self.t = 0.0, 0

    def step(self, g, x, value):
        u = {k: g[k] + (self.wd * x[k] if self.wd is not None else 0.0) for k in x}
        self.rbar = max(self.rbar, math.sqrt(_norm_sq({k: x[k] - self.x0[k] for k in x})))
        self.G += _norm_sq(u)
        eta = self.rbar / math.sqrt(self.G + self.eps)
        if self.init[0] == "learning_rate" and self.t == 0:
            eta = self.init[1]
        lr = _rate(self.lr, self.t)
        self.t += 1
        return {k: -lr * eta * u[k] for k in x}


class DoWG:
    def __init__(self, x, lr=1.0, r2=None, eps=1e-4, wd=None):
        self.lr, self.eps, self.wd = lr, eps, wd
        self.x0 = {k: v.clone() for k, v in x.items()}
        self.r2 = eps if r2 is None else r2
        self.v, self.t = 0.0, 0

    def step(self, g, x, value):
        u = {k: g[k] + (self.wd * x[k] if self.wd is not None else 0.0) for k in x}
        self.r2 = max(self.r2, _norm_sq({k: x[k] - self.x0[k] for k in x}))
        self.v += self.r2 * _norm_sq(u)
        eta = self.r2 / (math.sqrt(self.v) + self.eps)
        lr = _rate(self.lr, self.t)
        self.t += 1
        return {k: -lr * eta * u[k] for k in x}


class COCOB:
    """Orabona & Tommasi's COCOB-Backprop (Algorithm 2), coordinate-wise."""

    def __init__(self, x, lr=1.0, alpha=100.0, eps=1e-8, wd=0.0):
        self.lr, self.alpha, self.wd = lr, alpha, wd
        self.x0 = {k: v.clone() for k, v in x.items()}
        self.L = {k: torch.full_like(v, eps) for k, v in x.items()}  # the largest |gradient| seen
        self.G = {k: torch.zeros_like(v) for k, v in x.items()}  # the sum of |gradients|
        self.R = {k: torch.zeros_like(v) for k, v in x.items()}  # the reward (wealth)
        self.theta = {k: torch.zeros_like(v) for k, v in x.items()}  # minus the sum of gradients
        self.t = 0

    def step(self, g, x, value):
        lr = _rate(self.lr, self.t)
        self.t += 1
        out = {}
        for k in x:
            c = lr * (g[k] + self.wd * x[k])
            self.L[k] = torch.maximum(self.L[k], c.abs())
            self.G[k] = self.G[k] + c.abs()
            self.R[k] = (self.R[k] - c * (x[k] - self.x0[k])).clamp(min=0.0)
            self.theta[k] = self.theta[k] - c
            L, G = self.L[k], self.G[k]
            bet = self.theta[k] / (L * torch.maximum(G + L, self.alpha * L)) * (L + self.R[k])
            out[k] = self.x0[k] + bet - x[k]
        return out


class Mechanic:
    """Mechanic over SGD with momentum (``-lr * trace``, the trace ``g + momentum * trace``)."""

    def __init__(self, x, lr=0.5, momentum=0.9, wd=1e-2, eps=1e-8, s_init=1e-6, n=6):
        self.lr, self.momentum, self.wd, self.eps, self.s_init, self.n = lr, momentum, wd, eps, s_init, n
        self.trace = {k: torch.zeros_like(v) for k, v in x.items()}
        self.x0 = {k: v.clone() for k, v in x.items()}
        self.r, self.m, self.v, self.s = [0.0] * n, [0.0] * n, [0.0] * n, [s_init] * n
        self.betas = [1 - 0.1**i for i in range(1, n + 1)]

    def step(self, g, x, value):
        self.trace = {k: g[k] + self.momentum * self.trace[k] for k in x}
        base = {k: -self.lr * self.trace[k] for k in x}
        s_sum = sum(self.s)
        coef = self.wd * s_sum * math.sqrt(_norm_sq(g)) / (math.sqrt(_norm_sq(x)) + self.eps)
        u = {k: g[k] + coef * x[k] for k in x}
        delta_prev = {k: (self.x0[k] - x[k]) / (s_sum + self.eps) for k in x}
        h = _vdot(u, delta_prev)
        for i, b in enumerate(self.betas):
            clipped = min(max(h, -self.m[i]), self.m[i])
            self.m[i] = max(b * self.m[i], abs(h) + self.eps)
            self.v[i] = b * b * self.v[i] + h * h
            self.r[i] = b * self.r[i] + clipped * self.s[i]
            wealth = self.s_init / self.n * self.m[i] + max(0.0, self.r[i])
            self.s[i] = wealth / (math.sqrt(self.v[i]) + self.eps)
        total = sum(self.s)
        return {k: self.x0[k] - total * (delta_prev[k] - base[k]) - x[k] for k in x}


SCHEDULE = gtx.linear_schedule(1.0, 0.5, 4)
CASES = {
    "prodigy": (lambda: contrib.prodigy(), lambda x: Prodigy(x)),
    "prodigy/options": (
        lambda: contrib.prodigy(SCHEDULE, betas=(0.8, 0.99), beta3=0.9, eps=1e-6, estim_lr0=1e-2, estim_lr_coef=2.0, weight_decay=0.1),
        lambda x: Prodigy(x, SCHEDULE, (0.8, 0.99), 0.9, 1e-6, 1e-2, 2.0, 0.1),
    ),
    "prodigy/safeguard_warmup": (
        lambda: contrib.prodigy(0.5, estim_lr0=1e-2, safeguard_warmup=True), lambda x: Prodigy(x, 0.5, d0=1e-2, safeguard=True)
    ),
    "dadapt_adamw": (lambda: contrib.dadapt_adamw(), lambda x: DAdaptAdamW(x)),
    "dadapt_adamw/options": (
        lambda: contrib.dadapt_adamw(SCHEDULE, betas=(0.8, 0.99), eps=1e-6, estim_lr0=1e-2, weight_decay=0.1),
        lambda x: DAdaptAdamW(x, SCHEDULE, (0.8, 0.99), 1e-6, 1e-2, 0.1),
    ),
    "dog": (lambda: contrib.dog(), lambda x: DoG(x)),
    "dog/distance": (
        lambda: contrib.dog(SCHEDULE, init_step=("distance", 0.1), weight_decay=0.1),
        lambda x: DoG(x, SCHEDULE, ("distance", 0.1), wd=0.1),
    ),
    "dog/learning_rate": (
        lambda: contrib.dog(0.5, init_step=("learning_rate", 0.05), eps=1e-6),
        lambda x: DoG(x, 0.5, ("learning_rate", 0.05), eps=1e-6),
    ),
    "dowg": (lambda: contrib.dowg(), lambda x: DoWG(x)),
    "dowg/options": (
        lambda: contrib.dowg(SCHEDULE, init_estim_sq_dist=1e-2, eps=1e-6, weight_decay=0.1),
        lambda x: DoWG(x, SCHEDULE, 1e-2, 1e-6, 0.1),
    ),
    "cocob": (lambda: contrib.cocob(), lambda x: COCOB(x)),
    "cocob/options": (
        lambda: contrib.cocob(SCHEDULE, alpha=5.0, eps=1e-4, weight_decay=0.1), lambda x: COCOB(x, SCHEDULE, 5.0, 1e-4, 0.1)
    ),
    "mechanize": (lambda: contrib.mechanize(gtx.sgd(0.5, momentum=0.9)), lambda x: Mechanic(x)),
    "mechanize/options": (
        lambda: contrib.mechanize(gtx.sgd(0.5, momentum=0.9), weight_decay=0.1, eps=1e-6, s_init=1e-3, num_betas=3),
        lambda x: Mechanic(x, wd=0.1, eps=1e-6, s_init=1e-3, n=3),
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_the_reference(name):
    make, reference = CASES[name]
    got, got_params, _ = run(make(), STEPS)
    expected, expected_params = run_reference(reference, STEPS)
    assert_close_history(got, expected)
    assert_close_history([got_params], [expected_params])
    moved = max(float((got_params[k] - initial_params()[k]).abs().max()) for k in got_params)
    assert moved > 1e-6  # the comparison is not between two standing points


@pytest.mark.parametrize("name", sorted(CASES))
def test_pure_equals_donated(name):
    assert_pure_equals_inplace(CASES[name][0])


@pytest.mark.parametrize("name", sorted(CASES))
def test_pure_update_does_not_mutate_its_inputs(name):
    assert_pure_update_does_not_mutate(CASES[name][0])


def test_states_are_optax_named_tuples():
    fields = {
        contrib.ProdigyState: ("exp_avg", "exp_avg_sq", "grad_sum", "params0", "estim_lr", "numerator_weighted", "count"),
        contrib.DAdaptAdamWState: ("exp_avg", "exp_avg_sq", "grad_sum", "estim_lr", "numerator_weighted", "count"),
        contrib.DoGState: ("is_init_step", "init_params", "max_dist", "sum_sq_norm_grads"),
        contrib.DoWGState: ("init_params", "weighted_sq_norm_grads", "estim_sq_dist"),
        contrib.COCOBState: ("init_particles", "cumulative_gradients", "scale", "subgradients", "reward"),
        contrib.MechanicState: ("base_optimizer_state", "count", "r", "m", "v", "s", "x0"),
    }
    for cls, names in fields.items():
        assert cls._fields == names
    params = initial_params()
    assert isinstance(contrib.prodigy().init(params), contrib.ProdigyState)
    assert isinstance(contrib.dadapt_adamw().init(params), contrib.DAdaptAdamWState)
    assert isinstance(contrib.dog().init(params)[1], contrib.DoGState)
    assert isinstance(contrib.dowg().init(params)[1], contrib.DoWGState)
    assert isinstance(contrib.cocob().init(params)[2], contrib.COCOBState)
    state = contrib.mechanize(gtx.adam(1.0)).init(params)
    assert isinstance(state, contrib.MechanicState) and state.s.shape == (6,)
    assert state.count.dtype == torch.int32


def test_scalar_states_take_the_lowest_precision_of_the_params():
    params = {"a": torch.ones(3, dtype=torch.float64), "b": torch.ones(2, dtype=torch.float32)}
    assert contrib.prodigy().init(params).estim_lr.dtype == torch.float32
    assert contrib.dog().init(params)[1].max_dist.dtype == torch.float32
    state = contrib.prodigy().init({"a": torch.ones(3, dtype=torch.float64)})
    assert state.estim_lr.dtype == torch.float64


def test_extra_args_kinds_follow_optax():
    for tx in (contrib.prodigy(), contrib.dadapt_adamw(), contrib.mechanize(gtx.sgd(0.1))):
        assert isinstance(tx, gtx.GradientTransformationExtraArgs)
    params = initial_params()
    _, grads = value_and_grad(params)
    tx = contrib.mechanize(gtx.sgd(0.1))  # extra arguments reach the base optimizer and are ignored there
    tx.update(grads, tx.init(params), params, value=torch.tensor(1.0))


@pytest.mark.parametrize(
    "make",
    [contrib.prodigy, contrib.dadapt_adamw, contrib.dog, contrib.dowg, contrib.cocob, lambda: contrib.mechanize(gtx.sgd(0.1))],
)
def test_params_are_required(make):
    tx = make()
    params = initial_params()
    with pytest.raises(ValueError, match="params"):
        tx.update(value_and_grad(params)[1], tx.init(params), None)


def test_dog_rejects_an_unknown_init_step():
    with pytest.raises(ValueError, match="init_step"):
        contrib.scale_by_dog(("guess", 1.0))


def test_dog_heuristic_starts_from_the_norm_of_the_params():
    params = initial_params()
    state = contrib.scale_by_dog(("heuristic", 1e-3)).init(params)
    expected = 1e-3 * (1 + math.sqrt(_norm_sq(params)))
    assert float(state.max_dist) == pytest.approx(expected, rel=1e-12)
    assert bool(state.is_init_step)


def test_none_leaves_pass_through():
    params = initial_params()
    _, grads = value_and_grad(params)
    grads["b"] = None
    for tx in (contrib.prodigy(), contrib.dog(), contrib.cocob(), contrib.dowg(), contrib.dadapt_adamw(), contrib.mechanize(gtx.sgd(0.1))):
        updates, _ = tx.update(grads, tx.init(params), params)
        assert updates["b"] is None and updates["w"].shape == (4, 3)


def test_float32_runs_and_keeps_dtypes():
    params = initial_params(dtype=torch.float32)
    for make in (contrib.prodigy, contrib.dadapt_adamw, contrib.dog, contrib.dowg, contrib.cocob):
        _, final, state = run(make(), 3, params=params)
        assert all(v.dtype == torch.float32 and torch.isfinite(v).all() for v in final.values())



@pytest.mark.parametrize(
    "name,kwargs",
    [
        ("prodigy", {"learning_rate": 0.5, "weight_decay": 0.1, "estim_lr0": 1e-2}),
        ("dog", {"learning_rate": 0.5}),
        ("dadapt_adamw", {"learning_rate": 0.5, "estim_lr0": 1e-2}),
    ],
)
def test_injected_hyperparameters_give_the_same_numbers(name, kwargs):
    factory = getattr(contrib, name)
    got, _, _ = run(gtx.inject_hyperparams(factory)(**kwargs), 4)
    expected, _, _ = run(factory(**kwargs), 4)
    assert_close_history(got, expected, rtol=1e-12)


def test_gradients_in_another_dtype_than_the_params():
    """float32 gradients of float64 params (a mixed-precision backward): the updates keep the
    gradients' dtype, the state the params'."""
    params = initial_params()
    _, grads = value_and_grad(params)
    grads = {k: v.float() for k, v in grads.items()}
    for make in (contrib.prodigy, contrib.dadapt_adamw, contrib.dog, contrib.dowg, contrib.cocob, lambda: contrib.mechanize(gtx.sgd(0.1))):
        tx = make()
        for inplace in (False, True):
            updates, state = tx.update({k: v.clone() for k, v in grads.items()}, tx.init(params), params, inplace=inplace)
            assert all(u.dtype == torch.float32 and torch.isfinite(u).all() for u in updates.values())
