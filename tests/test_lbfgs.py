"""L-BFGS: the two-loop recursion against a float64 numpy reference and torch.optim.LBFGS, and lbfgs() on Rosenbrock."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import gradtx as gtx


def reference_directions(params_seq, grads_seq, memory_size, scale_init_precond=True):
    """optax's definition of scale_by_lbfgs's output, written out in numpy (plain lists, no ring buffer)."""
    pairs = []  # (s, y, rho), oldest first
    out = []
    prev_w = prev_g = None
    for k, (w, g) in enumerate(zip(params_seq, grads_seq)):
        gamma = min(1.0, 1.0 / np.linalg.norm(g)) if scale_init_precond else 1.0
        if k > 0:
            s, y = w - prev_w, g - prev_g
            sy = float(s @ y)
            pairs.append((s, y, 0.0 if sy == 0 else 1.0 / sy))
            pairs = pairs[-memory_size:]
            if scale_init_precond:
                yy = float(y @ y)
                gamma = sy / yy if yy > 0 else 1.0
        q = g.copy()
        alphas = []
        for s, y, rho in reversed(pairs):
            alpha = rho * float(s @ q)
            alphas.append(alpha)
            q = q - alpha * y
        r = gamma * q
        for (s, y, rho), alpha in zip(pairs, reversed(alphas)):
            beta = rho * float(y @ r)
            r = r + (alpha - beta) * s
        out.append(r)
        prev_w, prev_g = w, g
    return out


def split(vec):
    """A flat vector as a two-leaf tree (so the tree arithmetic is exercised)."""
    return {"a": torch.tensor(vec[:3]), "b": torch.tensor(vec[3:]).reshape(2, 2)}


def flat(tree):
    return np.concatenate([tree["a"].numpy().ravel(), tree["b"].numpy().ravel()])


@pytest.mark.parametrize("memory_size", [1, 3, 10])
@pytest.mark.parametrize("scale_init_precond", [True, False])
def test_direction_matches_numpy_two_loop(memory_size, scale_init_precond):
    rng = np.random.default_rng(0)
    params_seq = [rng.normal(size=7) for _ in range(8)]
    grads_seq = [rng.normal(size=7) for _ in range(8)]
    tx = gtx.scale_by_lbfgs(memory_size=memory_size, scale_init_precond=scale_init_precond)
    state = tx.init(split(params_seq[0]))
    expected = reference_directions(params_seq, grads_seq, memory_size, scale_init_precond)
    for k, (w, g) in enumerate(zip(params_seq, grads_seq)):
        direction, state = tx.update(split(g), state, split(w))
        np.testing.assert_allclose(flat(direction), expected[k], rtol=1e-10, atol=1e-12)
    assert int(state.count) == len(params_seq)
    assert state.weights_memory.shape == (memory_size,)
    assert state.diff_params_memory["b"].shape == (memory_size, 2, 2)


def test_inplace_path_gives_the_same_numbers():
    rng = np.random.default_rng(1)
    tx = gtx.scale_by_lbfgs(memory_size=2)
    pure_state = tx.init(split(rng.normal(size=7)))
    donated_state = tx.init(split(rng.normal(size=7)))
    for _ in range(5):
        w, g = split(rng.normal(size=7)), split(rng.normal(size=7))
        w_copy = {k: v.clone() for k, v in w.items()}
        pure, pure_state = tx.update(g, pure_state, w)
        donated, donated_state = tx.update({k: v.clone() for k, v in g.items()}, donated_state, w, inplace=True)
        torch.testing.assert_close(pure, donated, rtol=0, atol=0)
        torch.testing.assert_close(w, w_copy, rtol=0, atol=0)  # params are never written


def test_update_is_pure():
    tx = gtx.scale_by_lbfgs(memory_size=2)
    w, g = split(np.arange(7.0)), split(np.ones(7))
    state = tx.init(w)
    _, state = tx.update(g, state, w)
    before = [x.clone() for x in torch.utils._pytree.tree_leaves(state)]
    tx.update(split(np.full(7, 2.0)), state, split(np.arange(7.0) + 1))
    for x, y in zip(before, torch.utils._pytree.tree_leaves(state)):
        torch.testing.assert_close(x, y, rtol=0, atol=0)


def test_direction_matches_torch_lbfgs_on_the_same_history():
    """torch.optim.LBFGS with unit steps and no line search: same pairs, same two-loop, same
    H_diag (<s, y> / <y, y>); only the first direction differs (torch takes -g, scaled in its step)."""
    torch.manual_seed(0)
    n, memory_size = 6, 3
    a = torch.randn(n, n, dtype=torch.float64)
    hessian = a @ a.T + torch.diag(torch.logspace(-1, 1, n, dtype=torch.float64))
    b = torch.randn(n, dtype=torch.float64)

    def loss_fn(x):
        return 0.5 * x @ hessian @ x - b @ x

    x = torch.zeros(n, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS(
        [x], lr=1.0, max_iter=1, history_size=memory_size, tolerance_grad=-1.0, tolerance_change=-1.0
    )
    params_seq, grads_seq = [], []

    def closure():
        opt.zero_grad()
        loss = loss_fn(x)
        loss.backward()
        return loss

    for _ in range(7):
        params_seq.append(x.detach().clone())
        grads_seq.append((hessian @ x.detach() - b).clone())
        opt.step(closure)
    params_seq.append(x.detach().clone())
    torch_directions = [params_seq[k + 1] - params_seq[k] for k in range(7)]  # t = lr = 1 after the first step

    tx = gtx.scale_by_lbfgs(memory_size=memory_size)
    state = tx.init(params_seq[0])
    for k in range(7):
        direction, state = tx.update(grads_seq[k], state, params_seq[k])
        if k >= 1:
            torch.testing.assert_close(-direction, torch_directions[k], rtol=1e-9, atol=1e-12)


def rosenbrock(p):
    x, y = p["x"], p["y"]
    return (1 - x) ** 2 + 100 * (y - x**2) ** 2


def test_lbfgs_minimises_rosenbrock():
    params = {"x": torch.tensor(-1.2, dtype=torch.float64), "y": torch.tensor(1.0, dtype=torch.float64)}
    opt = gtx.lbfgs()
    assert isinstance(opt, gtx.GradientTransformationExtraArgs)
    state = opt.init(params)
    value_and_grad = gtx.value_and_grad_from_state(rosenbrock)
    for iteration in range(60):
        value, grad = value_and_grad(params, state=state)
        updates, state = opt.update(grad, state, params, value=value, grad=grad, value_fn=rosenbrock)
        params = gtx.apply_updates(params, updates)
        if float(rosenbrock(params)) < 1e-12:
            break
    assert iteration < 50
    assert abs(float(params["x"]) - 1.0) < 1e-6 and abs(float(params["y"]) - 1.0) < 1e-6
    # the state is optax's: (lbfgs, scale, zoom line search)
    assert isinstance(state[0], gtx.ScaleByLBFGSState) and isinstance(state[2], gtx.ScaleByZoomLinesearchState)


def test_lbfgs_with_a_fixed_learning_rate_needs_no_extra_args():
    opt = gtx.lbfgs(learning_rate=0.1, linesearch=None)
    assert not isinstance(opt, gtx.GradientTransformationExtraArgs)
    params = {"w": torch.tensor([1.0, -2.0], dtype=torch.float64)}
    state = opt.init(params)
    updates, state = opt.update({"w": params["w"] * 2}, state, params)
    # first step: -lr * min(1, 1/||g||) * g
    g = params["w"] * 2
    torch.testing.assert_close(updates["w"], -0.1 * g / g.norm())


def test_memory_size_must_be_positive():
    with pytest.raises(ValueError):
        gtx.scale_by_lbfgs(memory_size=0)


def test_none_update_leaves_are_left_out():
    """A leaf with no gradient: the others get exactly the direction they get on their own."""
    rng = np.random.default_rng(2)
    tx = gtx.scale_by_lbfgs(memory_size=2)
    alone = gtx.scale_by_lbfgs(memory_size=2)
    state = tx.init(split(rng.normal(size=7)))
    state_alone = alone.init({"a": torch.zeros(3, dtype=torch.float64)})
    for _ in range(4):
        w, g = split(rng.normal(size=7)), split(rng.normal(size=7))
        direction, state = tx.update({"a": g["a"], "b": None}, state, w)
        expected, state_alone = alone.update({"a": g["a"]}, state_alone, {"a": w["a"]})
        assert direction["b"] is None
        torch.testing.assert_close(direction["a"], expected["a"], rtol=1e-12, atol=1e-14)
