"""MoMo and MoMo-Adam against float64 references written from their definitions (optax.contrib's),
plus the extra-arguments protocol (``value=``), the pure/donated/mutation contract and the states."""

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
EPS64 = 2.220446049250313e-16


def _vdot(a, b):
    return sum(float((a[k] * b[k]).sum()) for k in a)


def _rate(learning_rate, step):
    return float(learning_rate(torch.tensor(step))) if callable(learning_rate) else learning_rate


class Momo:
    def __init__(self, x, lr=1.0, beta=0.9, lower_bound=0.0, wd=0.0, adapt=False):
        self.lr, self.beta, self.lower, self.wd, self.adapt = lr, beta, lower_bound, wd, adapt
        self.d = {k: torch.zeros_like(v) for k, v in x.items()}
        self.fbar, self.gamma, self.lb, self.t = 0.0, 0.0, lower_bound, 0

    def step(self, g, x, value):
        beta = 0.0 if self.t == 0 else self.beta
        alpha = _rate(self.lr, self.t)
        self.t += 1
        self.fbar = beta * self.fbar + (1 - beta) * value
        self.d = {k: beta * self.d[k] + (1 - beta) * g[k] for k in x}
        self.gamma = beta * self.gamma + (1 - beta) * _vdot(g, x)
        norm_sq, inner = _vdot(self.d, self.d), _vdot(self.d, x)
        one = 1 + alpha * self.wd
        lb = self.lb
        if self.adapt:
            cap = one * (self.fbar - self.gamma) + inner
            if cap < one * self.lb:
                lb = max(cap / (2 * one), self.lower)
        tau = 0.0 if norm_sq <= EPS64 else min(alpha, max(one * (self.fbar - lb - self.gamma) + inner, 0.0) / norm_sq)
        if self.adapt:
            self.lb = max(self.fbar + inner - self.gamma - 0.5 * tau * norm_sq, self.lower)
        return {k: -(alpha * self.wd) / one * x[k] - tau * self.d[k] for k in x}


class MomoAdam:
    def __init__(self, x, lr=1e-2, b1=0.9, b2=0.999, eps=1e-8, lower_bound=0.0, wd=0.0, adapt=False):
        self.lr, self.b1, self.b2, self.eps, self.lower, self.wd, self.adapt = lr, b1, b2, eps, lower_bound, wd, adapt
        self.m = {k: torch.zeros_like(v) for k, v in x.items()}
        self.v = {k: torch.zeros_like(v) for k, v in x.items()}
        self.fbar, self.gamma, self.lb, self.t = 0.0, 0.0, lower_bound, 0

    def step(self, g, x, value):
        b1, b2 = self.b1, self.b2
        alpha = _rate(self.lr, self.t)
        self.t += 1
        bc1, bc2 = 1 - b1**self.t, 1 - b2**self.t
        self.fbar = b1 * self.fbar + (1 - b1) * value
        self.m = {k: b1 * self.m[k] + (1 - b1) * g[k] for k in x}
        self.v = {k: b2 * self.v[k] + (1 - b2) * g[k] ** 2 for k in x}
        D = {k: self.eps + (self.v[k] / bc2).sqrt() for k in x}
        norm_sq = _vdot(self.m, {k: self.m[k] / D[k] for k in x})
        self.gamma = b1 * self.gamma + (1 - b1) * _vdot(g, x)
        inner = _vdot(self.m, x)
        one = 1 + alpha * self.wd
        lb = self.lb
        if self.adapt:
            cap = one * (self.fbar - self.gamma) + inner
            if cap < one * bc1 * self.lb:
                lb = max(cap / (2 * bc1 * one), self.lower)
        gap = max(one * (self.fbar - bc1 * lb - self.gamma) + inner, 0.0)
        tau = 0.0 if norm_sq <= EPS64 else min(alpha / bc1, gap / norm_sq)
        if self.adapt:
            self.lb = max((self.fbar + inner - self.gamma - 0.5 * tau * norm_sq) / bc1, self.lower)
        return {k: -(alpha * self.wd) / one * x[k] - tau * self.m[k] / D[k] for k in x}


SCHEDULE = gtx.linear_schedule(0.5, 0.1, 4)
CASES = {
    "momo": (lambda: contrib.momo(), lambda x: Momo(x)),
    "momo/options": (
        lambda: contrib.momo(SCHEDULE, beta=0.8, lower_bound=0.5, weight_decay=0.1),
        lambda x: Momo(x, SCHEDULE, 0.8, 0.5, 0.1),
    ),
    "momo/adapt_lower_bound": (
        lambda: contrib.momo(0.5, lower_bound=-5.0, weight_decay=0.1, adapt_lower_bound=True),
        lambda x: Momo(x, 0.5, lower_bound=-5.0, wd=0.1, adapt=True),
    ),
    "momo_adam": (lambda: contrib.momo_adam(), lambda x: MomoAdam(x)),
    "momo_adam/options": (
        lambda: contrib.momo_adam(SCHEDULE, b1=0.8, b2=0.99, eps=1e-6, lower_bound=0.5, weight_decay=0.1),
        lambda x: MomoAdam(x, SCHEDULE, 0.8, 0.99, 1e-6, 0.5, 0.1),
    ),
    "momo_adam/adapt_lower_bound": (
        lambda: contrib.momo_adam(0.5, lower_bound=-5.0, weight_decay=0.1, adapt_lower_bound=True),
        lambda x: MomoAdam(x, 0.5, lower_bound=-5.0, wd=0.1, adapt=True),
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_the_reference(name):
    make, reference = CASES[name]
    got, got_params, _ = run(make(), STEPS, with_value=True)
    expected, expected_params = run_reference(reference, STEPS)
    assert_close_history(got, expected)
    assert_close_history([got_params], [expected_params])


def test_adapted_lower_bound_moves():
    _, _, state = run(CASES["momo/adapt_lower_bound"][0](), STEPS, with_value=True)
    assert float(state.lb) != -5.0
    _, _, state = run(CASES["momo_adam/adapt_lower_bound"][0](), STEPS, with_value=True)
    assert float(state.lb) != -5.0


@pytest.mark.parametrize("name", sorted(CASES))
def test_pure_equals_donated(name):
    assert_pure_equals_inplace(CASES[name][0], with_value=True)


@pytest.mark.parametrize("name", sorted(CASES))
def test_pure_update_does_not_mutate_its_inputs(name):
    assert_pure_update_does_not_mutate(CASES[name][0], with_value=True)


def test_states_are_optax_named_tuples():
    assert contrib.MomoState._fields == ("exp_avg", "barf", "gamma", "lb", "count")
    assert contrib.MomoAdamState._fields == ("exp_avg", "exp_avg_sq", "barf", "gamma", "lb", "count")
    params = initial_params()
    assert isinstance(contrib.momo().init(params), contrib.MomoState)
    assert isinstance(contrib.momo_adam().init(params), contrib.MomoAdamState)


@pytest.mark.parametrize("make", [contrib.momo, contrib.momo_adam])
def test_value_is_required_and_reaches_it_through_a_chain(make):
    tx = make()
    assert isinstance(tx, gtx.GradientTransformationExtraArgs)
    params = initial_params()
    value, grads = value_and_grad(params)
    with pytest.raises(ValueError, match="value="):
        tx.update(grads, tx.init(params), params)
    with pytest.raises(ValueError, match="params"):
        tx.update(grads, tx.init(params), None, value=value)
    chained = gtx.chain(gtx.clip_by_global_norm(1e6), make())  # no clipping here
    expected, _ = tx.update(grads, tx.init(params), params, value=value)
    got, _ = chained.update(grads, chained.init(params), params, value=value)
    for k in expected:
        torch.testing.assert_close(got[k], expected[k], rtol=1e-12, atol=0)


def test_zero_gradients_give_no_step():
    params = initial_params()
    zeros = {k: torch.zeros_like(v) for k, v in params.items()}
    for make in (contrib.momo, contrib.momo_adam):
        tx = make()
        updates, _ = tx.update(zeros, tx.init(params), params, value=torch.tensor(1.0))
        assert all(bool((u == 0).all()) for u in updates.values())


def test_float32_and_a_value_given_as_a_number():
    params = initial_params(dtype=torch.float32)
    for make in (contrib.momo, contrib.momo_adam):
        tx = make()
        state = tx.init(params)
        value, grads = value_and_grad(params)
        updates, state = tx.update(grads, state, params, value=float(value))
        assert state.barf.dtype == torch.float32 and all(u.dtype == torch.float32 for u in updates.values())
        assert math.isfinite(float(state.barf))



@pytest.mark.parametrize("name", ["momo", "momo_adam"])
def test_injected_hyperparameters_give_the_same_numbers(name):
    factory = getattr(contrib, name)
    kwargs = {"learning_rate": 0.3, "weight_decay": 0.1}
    got, _, _ = run(gtx.inject_hyperparams(factory)(**kwargs), 4, with_value=True)
    expected, _, _ = run(factory(**kwargs), 4, with_value=True)
    assert_close_history(got, expected, rtol=1e-12)


def test_none_leaves_pass_through():
    params = initial_params()
    value, grads = value_and_grad(params)
    grads["b"] = None
    for tx in (contrib.momo(), contrib.momo_adam()):
        updates, state = tx.update(grads, tx.init(params), params, value=value)
        assert updates["b"] is None and updates["w"].shape == (4, 3)
        assert torch.equal(state.exp_avg["b"], torch.zeros(3, dtype=torch.float64))


def test_gradients_in_another_dtype_than_the_params():
    params = initial_params()
    value, grads = value_and_grad(params)
    grads = {k: v.float() for k, v in grads.items()}
    for make in (contrib.momo, contrib.momo_adam):
        tx = make()
        for inplace in (False, True):
            updates, state = tx.update({k: v.clone() for k, v in grads.items()}, tx.init(params), params, inplace=inplace, value=value)
            assert all(u.dtype == torch.float32 and torch.isfinite(u).all() for u in updates.values())
            assert state.exp_avg["w"].dtype == torch.float64
