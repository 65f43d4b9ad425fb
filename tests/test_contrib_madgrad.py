"""MADGRAD (gradtx.contrib) against a float64 reference written from optax's definition, which is
also the algorithm of the authors' PyTorch code (``lamb = (lr + eps) * sqrt(k + 1)``, cube-root
denominator, iterate averaging with ``x0``, L2 weight decay added to the gradient)."""

from __future__ import annotations


import pytest
import torch

import gradtx as gtx
from gradtx import contrib
from optimizer_helpers import assert_trees_close, check_pure_and_donated, clone_tree, gradtx_trajectory, tree

SHAPES = {"w": (4, 3), "b": (3,), "s": ()}
STEPS = 6


def params0():
    return tree(0, shapes=SHAPES)


def grad_list(steps=STEPS):
    return [tree(100 + i, shapes=SHAPES) for i in range(steps)]


def reference(params, grads, lr, momentum=0.9, weight_decay=0.0, eps=1e-6):
    x0 = clone_tree(params)
    params = clone_tree(params)
    sum_sq = {k: torch.zeros_like(p) for k, p in params.items()}
    sums = {k: torch.zeros_like(p) for k, p in params.items()}
    for k_step, grads_k in enumerate(grads):
        rate = float(lr(torch.tensor(k_step, dtype=torch.int32))) if callable(lr) else lr
        lamb = (rate + eps) * (k_step + 1) ** 0.5
        for k, p in params.items():
            g = grads_k[k] + weight_decay * p
            sum_sq[k] = sum_sq[k] + lamb * g * g
            sums[k] = sums[k] + lamb * g
            z = x0[k] - sums[k] / (sum_sq[k] ** (1.0 / 3.0) + eps)
            params[k] = (1 - momentum) * z + momentum * p
    return params


SCHEDULE = gtx.linear_schedule(0.05, 0.01, 4)
CASES = {
    "default": (lambda: contrib.madgrad(0.05), dict(lr=0.05)),
    "decay": (lambda: contrib.madgrad(0.05, momentum=0.5, weight_decay=0.1, eps=1e-4), dict(lr=0.05, momentum=0.5, weight_decay=0.1, eps=1e-4)),
    "schedule": (lambda: contrib.madgrad(SCHEDULE, weight_decay=0.01), dict(lr=SCHEDULE, weight_decay=0.01)),
    "no_momentum": (lambda: contrib.madgrad(0.05, momentum=0.0), dict(lr=0.05, momentum=0.0)),
}


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_float64_reference(name, inplace):
    make, kwargs = CASES[name]
    expected = reference(params0(), grad_list(), **kwargs)
    got, state = gradtx_trajectory(make(), params0(), grad_list(), inplace=inplace)
    assert_trees_close(got, expected, rtol=1e-9, atol=1e-12)
    madgrad_state = state[1]
    assert isinstance(madgrad_state, contrib.MadgradState) and int(madgrad_state.count) == STEPS
    assert_trees_close(madgrad_state.x0, params0(), rtol=0, atol=0)


@pytest.mark.parametrize("name", sorted(CASES))
def test_pure_equals_donated_and_mutates_nothing(name):
    check_pure_and_donated(CASES[name][0](), params0(), grad_list())


def test_float32_close_to_the_float64_reference():
    expected = reference(params0(), grad_list(), lr=0.05)
    p32 = gtx.tree.tree_map(lambda x: x.float(), params0())
    g32 = [gtx.tree.tree_map(lambda x: x.float(), g) for g in grad_list()]
    got, _ = gradtx_trajectory(contrib.madgrad(0.05), p32, g32)
    for k in expected:
        assert got[k].dtype == torch.float32
        torch.testing.assert_close(got[k].double(), expected[k], rtol=1e-5, atol=1e-6)


def test_x0_is_a_copy_and_params_are_required():
    p = params0()
    tx = contrib.scale_by_madgrad(0.05)
    state = tx.init(p)
    assert all(state.x0[k].data_ptr() != p[k].data_ptr() for k in p)
    with pytest.raises(ValueError, match="params"):
        tx.update(grad_list(1)[0], state)


def test_none_leaves_pass_through():
    p = params0()
    tx = contrib.madgrad(0.05)
    updates, _ = tx.update(dict(grad_list(1)[0], b=None), tx.init(p), p)
    assert updates["b"] is None
