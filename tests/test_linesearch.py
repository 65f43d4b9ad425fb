"""Line searches, Polyak's step and value_and_grad_from_state, against float64 references of their definitions."""

from __future__ import annotations

import math

import pytest
import torch

import gradtx as gtx

F64 = torch.float64


def rosenbrock(p):
    x = p["w"]
    return (1 - x[0]) ** 2 + 100 * (x[1] - x[0] ** 2) ** 2


HESSIAN = torch.tensor([[3.0, 0.5, 0.0], [0.5, 1.0, 0.2], [0.0, 0.2, 0.1]], dtype=F64)
TARGET = torch.tensor([1.0, -2.0, 0.5], dtype=F64)


def quadratic(p):
    d = p["w"] - TARGET
    return 0.5 * d @ HESSIAN @ d


def grad_of(fn, params):
    return gtx.transforms.linesearch.value_and_grad(fn)(params)


# --------------------------------------------------------------------------- backtracking


def reference_backtracking(fn, w, u, g, lr_prev, *, max_steps, slope_rtol=1e-4, decrease=0.8, increase=1.5, max_lr=1.0):
    """The Armijo backtracking search, from its definition, in python floats."""
    value = float(fn({"w": w}))
    slope = float(u @ g)
    lr = min(increase * lr_prev, max_lr)
    for i in range(max_steps + 1):
        if i > 0:
            lr *= decrease
        new_value = float(fn({"w": w + lr * u}))
        if new_value <= value + lr * slope_rtol * slope:
            return lr, i + 1
    return lr, max_steps + 1


@pytest.mark.parametrize("fn, start", [(quadratic, [4.0, 3.0, -1.0]), (rosenbrock, [-1.2, 1.0])])
def test_backtracking_matches_the_armijo_reference(fn, start):
    params = {"w": torch.tensor(start, dtype=F64)}
    tx = gtx.chain(gtx.sgd(1.0), gtx.scale_by_backtracking_linesearch(max_backtracking_steps=30))
    assert isinstance(tx, gtx.GradientTransformationExtraArgs)
    state = tx.init(params)
    lr_prev = 1.0
    for _ in range(6):
        value, grad = grad_of(fn, params)
        expected_lr, expected_steps = reference_backtracking(
            fn, params["w"], -grad["w"], grad["w"], lr_prev, max_steps=30
        )
        updates, state = tx.update(grad, state, params, value=value, grad=grad, value_fn=fn)
        ls = state[1]
        assert math.isclose(float(ls.learning_rate), expected_lr, rel_tol=1e-12)
        assert int(ls.info.num_linesearch_steps) == expected_steps
        assert float(ls.info.decrease_error) == 0.0
        torch.testing.assert_close(updates["w"], -expected_lr * grad["w"])
        new_params = gtx.apply_updates(params, updates)
        assert math.isclose(float(ls.value), float(fn(new_params)), rel_tol=1e-12)
        assert ls.grad is None
        params, lr_prev = new_params, expected_lr


def test_backtracking_store_grad_and_value_and_grad_from_state():
    params = {"w": torch.tensor([4.0, 3.0, -1.0], dtype=F64)}
    tx = gtx.chain(gtx.sgd(1.0), gtx.scale_by_backtracking_linesearch(max_backtracking_steps=15, store_grad=True))
    state = tx.init(params)
    value_and_grad = gtx.value_and_grad_from_state(quadratic)
    value, grad = value_and_grad(params, state=state)  # value is inf after init: computed
    assert math.isclose(float(value), float(quadratic(params)))
    for _ in range(4):
        updates, state = tx.update(grad, state, params, value=value, grad=grad, value_fn=quadratic)
        params = gtx.apply_updates(params, updates)
        value, grad = value_and_grad(params, state=state)
        assert value is state[1].value and grad is state[1].grad  # reused, not recomputed
        fresh_value, fresh_grad = grad_of(quadratic, params)
        torch.testing.assert_close(value, fresh_value)
        torch.testing.assert_close(grad, fresh_grad)


def test_backtracking_takes_no_step_when_every_trial_is_nan():
    def fn(p):
        return torch.where(p["w"].sum() > 0, p["w"].sum() * float("nan"), p["w"].sum() ** 2)

    params = {"w": torch.tensor([-1.0, -1.0], dtype=F64)}
    tx = gtx.scale_by_backtracking_linesearch(max_backtracking_steps=3)
    state = tx.init(params)
    direction = {"w": torch.tensor([10.0, 10.0], dtype=F64)}
    value, grad = grad_of(fn, params)
    updates, state = tx.update(direction, state, params, value=value, grad=grad, value_fn=fn)
    assert float(state.learning_rate) == 0.0 and math.isinf(float(state.info.decrease_error))
    torch.testing.assert_close(updates["w"], torch.zeros(2, dtype=F64))


def test_value_fn_keyword_arguments_pass_through_the_chain():
    def fn(params, x, y):
        return ((x @ params["w"] - y) ** 2).mean()

    x, y = torch.randn(5, 3, dtype=F64), torch.randn(5, dtype=F64)
    params = {"w": torch.zeros(3, dtype=F64)}
    tx = gtx.chain(gtx.sgd(1.0), gtx.scale_by_zoom_linesearch(max_linesearch_steps=15))
    state = tx.init(params)
    value, grad = gtx.transforms.linesearch.value_and_grad(fn)(params, x=x, y=y)
    updates, state = tx.update(grad, state, params, value=value, grad=grad, value_fn=fn, x=x, y=y)
    assert float(fn(gtx.apply_updates(params, updates), x, y)) < float(value)
    with pytest.raises(TypeError, match="not arguments of value_fn"):
        tx.update(grad, state, params, value=value, grad=grad, value_fn=fn, x=x, y=y, z=1)


# --------------------------------------------------------------------------- zoom


def check_strong_wolfe(fn, params, direction, grad, value, stepsize, c1=1e-4, c2=0.9):
    slope0 = float(direction @ grad)
    new = {"w": params + stepsize * direction}
    new_value, new_grad = grad_of(fn, new)
    assert stepsize > 0
    assert float(new_value) <= float(value) + c1 * stepsize * slope0 + 1e-12
    assert abs(float(new_grad["w"] @ direction)) <= c2 * abs(slope0) + 1e-12
    return new_value, new_grad


@pytest.mark.parametrize(
    "fn, start",
    [(rosenbrock, [-1.2, 1.0]), (rosenbrock, [2.0, 2.0]), (rosenbrock, [0.0, 0.0]), (quadratic, [4.0, 3.0, -1.0])],
)
@pytest.mark.parametrize("direction_kind", ["gradient", "lbfgs"])
def test_zoom_satisfies_strong_wolfe(fn, start, direction_kind):
    params = {"w": torch.tensor(start, dtype=F64)}
    first = gtx.sgd(1.0) if direction_kind == "gradient" else gtx.chain(gtx.scale_by_lbfgs(), gtx.scale(-1.0))
    tx = gtx.chain(first, gtx.scale_by_zoom_linesearch(max_linesearch_steps=30, approx_dec_rtol=None))
    state = tx.init(params)
    for _ in range(5):
        value, grad = grad_of(fn, params)
        if float(grad["w"].norm()) < 1e-8:
            break
        updates, state = tx.update(grad, state, params, value=value, grad=grad, value_fn=fn)
        ls = state[-1]
        direction = updates["w"] / ls.learning_rate
        new_value, new_grad = check_strong_wolfe(fn, params["w"], direction, grad["w"], value, float(ls.learning_rate))
        assert float(ls.info.decrease_error) == 0.0 and float(ls.info.curvature_error) == 0.0
        assert 1 <= int(ls.info.num_linesearch_steps) <= 30
        # the state keeps the value and gradient at the accepted point
        torch.testing.assert_close(ls.value, new_value)
        torch.testing.assert_close(ls.grad, new_grad)
        params = gtx.apply_updates(params, updates)


def test_zoom_state_and_defaults():
    params = {"w": torch.tensor([4.0, 3.0, -1.0], dtype=F64)}
    tx = gtx.scale_by_zoom_linesearch(max_linesearch_steps=10)
    state = tx.init(params)
    assert isinstance(state, gtx.ScaleByZoomLinesearchState)
    assert float(state.learning_rate) == 1.0 and math.isinf(float(state.value))
    assert state.learning_rate.dtype == F64
    torch.testing.assert_close(state.grad["w"], torch.zeros(3, dtype=F64))
    assert isinstance(state.info, gtx.ZoomLinesearchInfo)
    with pytest.raises(ValueError):
        gtx.scale_by_zoom_linesearch(10, initial_guess_strategy="two")


def test_zoom_respects_max_learning_rate():
    params = {"w": torch.tensor([4.0, 3.0, -1.0], dtype=F64)}
    tx = gtx.chain(gtx.sgd(1.0), gtx.scale_by_zoom_linesearch(max_linesearch_steps=10, max_learning_rate=0.01))
    state = tx.init(params)
    value, grad = grad_of(quadratic, params)
    updates, state = tx.update(grad, state, params, value=value, grad=grad, value_fn=quadratic)
    assert 0 < float(state[1].learning_rate) <= 0.01


def test_value_and_grad_from_state_errors():
    params = {"w": torch.zeros(3, dtype=F64)}
    with pytest.raises(ValueError, match="None"):
        state = gtx.scale_by_backtracking_linesearch(5).init(params)
        gtx.value_and_grad_from_state(quadratic)(params, state=state)
    with pytest.raises(ValueError, match="exactly one"):
        gtx.value_and_grad_from_state(quadratic)(params, state=gtx.sgd(0.1).init(params))


# --------------------------------------------------------------------------- Polyak


def reference_polyak(value, g, f_min=0.0, max_lr=1.0, eps=0.0, variant="sps"):
    gap = value - f_min
    if variant == "sps+":
        gap = max(gap, 0.0)
    sq = float(g @ g)
    if sq + eps <= torch.finfo(F64).eps:
        return 0.0
    return min(gap / (sq + eps), max_lr)


@pytest.mark.parametrize(
    "kwargs", [{}, {"f_min": 0.5, "max_learning_rate": 0.05}, {"eps": 1.0}, {"variant": "sps+", "f_min": 100.0}]
)
def test_scale_by_polyak_matches_the_formula(kwargs):
    g = torch.tensor([0.3, -1.2, 2.0], dtype=F64)
    tx = gtx.scale_by_polyak(**kwargs)
    assert isinstance(tx, gtx.GradientTransformationExtraArgs)
    for value in (0.2, 3.0, 40.0):
        updates, _ = tx.update({"w": g}, tx.init({"w": g}), value=torch.tensor(value, dtype=F64))
        expected = reference_polyak(
            value,
            g,
            kwargs.get("f_min", 0.0),
            kwargs.get("max_learning_rate", 1.0),
            kwargs.get("eps", 0.0),
            kwargs.get("variant", "sps"),
        )
        torch.testing.assert_close(updates["w"], expected * g, rtol=1e-14, atol=0)


def test_scale_by_polyak_zero_gradient_gives_zero_step():
    tx = gtx.scale_by_polyak()
    updates, _ = tx.update({"w": torch.zeros(3)}, tx.init({"w": torch.zeros(3)}), value=1.0)
    assert torch.equal(updates["w"], torch.zeros(3))
    with pytest.raises(ValueError):
        gtx.scale_by_polyak(variant="sps++")


def test_polyak_sgd_is_optax_chain_and_converges():
    params = {"w": torch.tensor([1.0, 2.0, 3.0], dtype=F64)}

    def fn(p):
        return (p["w"] ** 2).sum()

    opt = gtx.polyak_sgd()
    state = opt.init(params)
    values = []
    for _ in range(5):
        value, grad = grad_of(fn, params)
        updates, state = opt.update(grad, state, params, value=value)
        # sgd(1) then Polyak on u = -g: step = f / ||g||^2 = 14 / 56 on the first call
        params = gtx.apply_updates(params, updates)
        values.append(float(fn(params)))
    # on sum(x^2) the Polyak step f/||g||^2 = 1/4 scales x by 1/2 each step: f is divided by 4
    assert values == pytest.approx([3.5, 0.875, 0.21875, 0.0546875, 0.013671875], rel=1e-12)


def test_value_fn_with_var_keyword_takes_any_extra_argument():
    def fn(params, **batch):
        return ((batch["x"] @ params["w"] - batch["y"]) ** 2).mean()

    x, y = torch.randn(5, 3, dtype=F64), torch.randn(5, dtype=F64)
    params = {"w": torch.zeros(3, dtype=F64)}
    tx = gtx.chain(gtx.sgd(1.0), gtx.scale_by_backtracking_linesearch(max_backtracking_steps=10))
    value, grad = gtx.transforms.linesearch.value_and_grad(fn)(params, x=x, y=y)
    updates, _ = tx.update(grad, tx.init(params), params, value=value, grad=grad, value_fn=fn, x=x, y=y)
    assert float(fn(gtx.apply_updates(params, updates), x=x, y=y)) < float(value)
