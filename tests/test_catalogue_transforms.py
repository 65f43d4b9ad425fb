"""The catalogue's transformations against float64 references written from optax's definitions,
against torch.optim where torch has the same algorithm, pure/donated agreement, state fields and
torch.compile."""

from __future__ import annotations

import math

import pytest
import torch

import gradtx as gtx
from catalogue_helpers import check_against_reference, compiled_matches_eager, leafwise
from optimizer_helpers import assert_trees_close, check_pure_and_donated, clone_tree, grad_sequence, tree

# --------------------------------------------------------------------------- references (optax's definitions)


def _zeros(params):
    return leafwise(torch.zeros_like, params)


def ref_sign():
    return (lambda p: {}), (lambda g, s, p: (leafwise(torch.sign, g), s))


def ref_adadelta(rho=0.9, eps=1e-6):
    def init(p):
        return {"e_g": _zeros(p), "e_x": _zeros(p)}

    def step(g, s, p):
        e_g = leafwise(lambda gi, e: (1 - rho) * gi**2 + rho * e, g, s["e_g"])
        u = leafwise(lambda gi, eg, ex: torch.sqrt(ex + eps) / torch.sqrt(eg + eps) * gi, g, e_g, s["e_x"])
        e_x = leafwise(lambda ui, e: (1 - rho) * ui**2 + rho * e, u, s["e_x"])
        return u, {"e_g": e_g, "e_x": e_x}

    return init, step


def ref_yogi(b1=0.9, b2=0.999, eps=1e-3, eps_root=0.0, initial_accumulator_value=1e-6):
    initial = initial_accumulator_value
    def init(p):
        full = leafwise(lambda x: torch.full_like(x, initial), p)
        return {"count": 0, "mu": full, "nu": dict(full)}

    def step(g, s, p):
        t = s["count"] + 1
        mu = leafwise(lambda gi, m: (1 - b1) * gi + b1 * m, g, s["mu"])
        nu = leafwise(lambda gi, v: v - (1 - b2) * torch.sign(v - gi**2) * gi**2, g, s["nu"])
        u = leafwise(lambda m, v: (m / (1 - b1**t)) / (torch.sqrt(v / (1 - b2**t) + eps_root) + eps), mu, nu)
        return u, {"count": t, "mu": mu, "nu": nu}

    return init, step


def ref_rprop(lr, eta_minus=0.5, eta_plus=1.2, min_step_size=1e-6, max_step_size=50.0):
    min_step, max_step = min_step_size, max_step_size
    def init(p):
        return {"step_sizes": leafwise(lambda x: torch.full_like(x, lr), p), "prev_updates": _zeros(p)}

    def step(g, s, p):
        prod = leafwise(torch.mul, g, s["prev_updates"])
        steps = leafwise(
            lambda q, st: torch.where(
                q == 0, st, torch.clamp(st * torch.where(q > 0, torch.full_like(st, eta_plus), torch.full_like(st, eta_minus)), min_step, max_step)
            ),
            prod,
            s["step_sizes"],
        )
        prev = leafwise(lambda q, gi, st: torch.where(q < 0, 0.0, st * torch.sign(gi)), prod, g, steps)
        u = leafwise(lambda q, old: torch.where(q < 0, 0.0, old), prod, s["prev_updates"])
        return u, {"step_sizes": steps, "prev_updates": prev}

    return init, step


def ref_adan(b1=0.98, b2=0.92, b3=0.99, eps=1e-8, eps_root=0.0):
    def init(p):
        return {"m": _zeros(p), "v": _zeros(p), "n": _zeros(p), "g": _zeros(p), "t": 0}

    def step(g, s, p):
        diff = leafwise(lambda gi, pi: torch.zeros_like(gi) if s["t"] == 0 else gi - pi, g, s["g"])
        m = leafwise(lambda gi, x: (1 - b1) * gi + b1 * x, g, s["m"])
        v = leafwise(lambda di, x: (1 - b2) * di + b2 * x, diff, s["v"])
        n = leafwise(lambda gi, di, x: (1 - b3) * (gi + (1 - b2) * di) ** 2 + b3 * x, g, diff, s["n"])
        t = s["t"] + 1
        u = leafwise(
            lambda mi, vi, ni: (mi / (1 - b1**t) + (1 - b2) * vi / (1 - b2**t)) / (torch.sqrt(ni / (1 - b3**t) + eps_root) + eps),
            m, v, n,
        )
        return u, {"m": m, "v": v, "n": n, "g": dict(g), "t": t}

    return init, step


def ref_novograd(b1=0.9, b2=0.25, eps=1e-8, eps_root=0.0, weight_decay=0.0):
    def init(p):
        return {"count": 0, "mu": _zeros(p), "nu": leafwise(lambda x: torch.zeros((), dtype=x.dtype), p)}

    def step(g, s, p):
        sq = leafwise(lambda gi: torch.linalg.norm(gi.flatten()) ** 2, g)
        if s["count"] == 0:
            nu = sq
            mu = leafwise(lambda gi, pi, vi: gi / (torch.sqrt(vi + eps_root) + eps) + weight_decay * pi, g, p, nu)
        else:
            nu = leafwise(lambda q, vi: (1 - b2) * q + b2 * vi, sq, s["nu"])
            mu = leafwise(
                lambda gi, pi, vi, mi: b1 * mi + (gi / (torch.sqrt(vi + eps_root) + eps) + weight_decay * pi), g, p, nu, s["mu"]
            )
        return dict(mu), {"count": s["count"] + 1, "mu": mu, "nu": nu}

    return init, step


def ref_optimistic(alpha=1.0, beta=1.0):
    def init(p):
        return {"is_initial_step": 1.0, "previous_gradient": _zeros(p)}

    def step(g, s, p):
        prev = g if s["is_initial_step"] else s["previous_gradient"]
        u = leafwise(lambda gi, pi: (alpha + beta) * gi - beta * pi, g, prev)
        return u, {"is_initial_step": 0.0, "previous_gradient": dict(g)}

    return init, step


def _floor_at(value, low):
    return torch.where(value <= low, torch.full_like(value, low), value)


def ref_param_block_norm(min_scale=1e-3):
    def step(g, s, p):
        return leafwise(lambda gi, pi: gi * _floor_at(torch.sqrt(torch.sum(pi**2)), min_scale), g, p), s

    return (lambda p: {}), step


def ref_param_block_rms(min_scale=1e-3):
    def step(g, s, p):
        return leafwise(lambda gi, pi: gi * _floor_at(torch.sqrt(torch.mean(pi**2)), min_scale), g, p), s

    return (lambda p: {}), step


def ref_normalize(scale_factor=1.0, eps=1e-6):
    def step(g, s, p):
        norm = torch.sqrt(sum(torch.sum(x**2) for x in g.values()))
        return leafwise(lambda gi: gi / ((norm + eps) / scale_factor), g), s

    return (lambda p: {}), step


def ref_nonnegative():
    return (lambda p: {}), (lambda g, s, p: (leafwise(lambda gi, pi: torch.where(pi + gi < 0, -pi, gi), g, p), s))


def ref_dog(reps_rel=1e-6, eps=1e-8, global_scale=1.0):
    def init(p):
        return {
            "max_dist": leafwise(lambda x: reps_rel * (1 + torch.sqrt(torch.sum(x**2))), p),
            "grad_sum_of_squares": leafwise(lambda x: torch.zeros(1, dtype=x.dtype), p),
            "init_params": leafwise(torch.clone, p),
        }

    def step(g, s, p):
        d = leafwise(lambda di, x, x0: torch.maximum(di, torch.sqrt(torch.sum((x - x0) ** 2))), s["max_dist"], p, s["init_params"])
        sos = leafwise(lambda q, gi: q + torch.sum(gi**2), s["grad_sum_of_squares"], g)
        u = leafwise(lambda gi, di, q: global_scale * (di / torch.sqrt(q + eps)).reshape(()) * gi, g, d, sos)
        return u, {"max_dist": d, "grad_sum_of_squares": sos, "init_params": s["init_params"]}

    return init, step


CASES = {
    "sign": (gtx.scale_by_sign, ref_sign, {}),
    "adadelta": (gtx.scale_by_adadelta, ref_adadelta, {}),
    "adadelta_args": (gtx.scale_by_adadelta, ref_adadelta, {"rho": 0.5, "eps": 1e-3}),
    "yogi": (gtx.scale_by_yogi, ref_yogi, {}),
    "yogi_args": (
        gtx.scale_by_yogi,
        ref_yogi,
        {"b1": 0.5, "b2": 0.9, "eps": 1e-2, "eps_root": 1e-4, "initial_accumulator_value": 0.3},
    ),
    "rprop": (lambda **kw: gtx.scale_by_rprop(0.1, **kw), lambda **kw: ref_rprop(0.1, **kw), {}),
    "rprop_args": (
        lambda **kw: gtx.scale_by_rprop(0.1, **kw),
        lambda **kw: ref_rprop(0.1, **kw),
        {"eta_minus": 0.3, "eta_plus": 2.0, "min_step_size": 0.05, "max_step_size": 0.3},
    ),
    "adan": (gtx.scale_by_adan, ref_adan, {}),
    "adan_args": (gtx.scale_by_adan, ref_adan, {"b1": 0.7, "b2": 0.6, "b3": 0.8, "eps": 1e-3, "eps_root": 1e-4}),
    "novograd": (gtx.scale_by_novograd, ref_novograd, {}),
    "novograd_args": (
        gtx.scale_by_novograd,
        ref_novograd,
        {"b1": 0.5, "b2": 0.7, "eps": 1e-3, "eps_root": 1e-2, "weight_decay": 0.1},
    ),
    "optimistic": (gtx.scale_by_optimistic_gradient, ref_optimistic, {}),
    "optimistic_args": (gtx.scale_by_optimistic_gradient, ref_optimistic, {"alpha": 0.3, "beta": 2.0}),
    "param_block_norm": (gtx.scale_by_param_block_norm, ref_param_block_norm, {}),
    "param_block_norm_args": (gtx.scale_by_param_block_norm, ref_param_block_norm, {"min_scale": 0.9}),
    "param_block_rms": (gtx.scale_by_param_block_rms, ref_param_block_rms, {}),
    "param_block_rms_args": (gtx.scale_by_param_block_rms, ref_param_block_rms, {"min_scale": 0.9}),
    "normalize_by_update_norm": (gtx.normalize_by_update_norm, ref_normalize, {}),
    "normalize_by_update_norm_args": (gtx.normalize_by_update_norm, ref_normalize, {"scale_factor": 0.3, "eps": 0.5}),
    "keep_params_nonnegative": (gtx.keep_params_nonnegative, ref_nonnegative, {}),
    "distance_over_gradients": (
        lambda **kw: gtx.scale_by_distance_over_gradients(param_dtype=torch.float64, **kw),
        ref_dog,
        {},
    ),
    "distance_over_gradients_args": (
        lambda **kw: gtx.scale_by_distance_over_gradients(param_dtype=None, **kw),
        ref_dog,
        {"reps_rel": 1e-2, "eps": 1e-3, "global_scale": -0.5},
    ),
}

FIELDS = {
    "param_block_norm": (),
    "param_block_rms": (),
    "normalize_by_update_norm": (),
    "keep_params_nonnegative": (),
    "distance_over_gradients": ("max_dist", "grad_sum_of_squares", "init_params"),
    "adan": ("m", "v", "n", "g", "t"),
    "novograd": ("count", "mu", "nu"),
    "optimistic": ("is_initial_step", "previous_gradient"),
    "sign": (),
    "adadelta": ("e_g", "e_x"),
    "yogi": ("count", "mu", "nu"),
    "rprop": ("step_sizes", "prev_updates"),
}


def _grads_with_sign_flips(steps):
    """Gradients whose signs repeat and flip, so every Rprop branch is taken."""
    base = grad_sequence(1)[0]
    signs = [1.0, 1.0, -1.0, -1.0, 1.0, 0.0, 1.0, 1.0]
    noise = grad_sequence(steps)
    return [{k: signs[i % len(signs)] * v.abs() * (1 + 0.1 * noise[i][k].abs()) for k, v in base.items()} for i in range(steps)]


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("inplace", [False, True])
def test_matches_reference(name, inplace):
    make, make_ref, kwargs = CASES[name]
    grads = _grads_with_sign_flips(8) if name.startswith("rprop") else grad_sequence(6)
    check_against_reference(make(**kwargs), *make_ref(**kwargs), grads=grads, inplace=inplace)


@pytest.mark.parametrize("name", sorted(CASES))
def test_pure_and_donated_agree(name):
    make, _, kwargs = CASES[name]
    grads = _grads_with_sign_flips(6) if name.startswith("rprop") else grad_sequence(4)
    check_pure_and_donated(make(**kwargs), tree(0), grads)


@pytest.mark.parametrize("name", sorted(FIELDS))
def test_state_fields_are_optax(name):
    make, _, _ = CASES[name]
    state = make().init(tree(0))
    assert tuple(getattr(type(state), "_fields", ())) == FIELDS[name]
    if name in ("sign", "param_block_norm", "param_block_rms", "normalize_by_update_norm"):
        assert isinstance(state, gtx.EmptyState)
    if name == "keep_params_nonnegative":
        assert type(state).__name__ == "NonNegativeParamsState"


# The others compile inside their optimizer, in tests/test_fullgraph.py (one graph over three
# steps, the eager numbers): sign in sign_sgd, adadelta, yogi, rprop, adan, novograd, optimistic in
# optimistic_gradient_descent, keep_params_nonnegative after sgd.
@pytest.mark.parametrize("name", ["param_block_rms", "normalize_by_update_norm", "distance_over_gradients"])
def test_compiles_to_one_graph(name):
    make, _, _ = CASES[name]
    compiled_matches_eager(make())


def test_none_leaves_pass_through():
    params = tree(0)
    makers = (
        gtx.scale_by_sign,
        gtx.scale_by_adadelta,
        gtx.scale_by_yogi,
        lambda: gtx.scale_by_rprop(0.1),
        gtx.scale_by_adan,
        lambda: gtx.scale_by_novograd(weight_decay=0.1),
        gtx.scale_by_optimistic_gradient,
        gtx.scale_by_param_block_norm,
        gtx.normalize_by_update_norm,
        gtx.keep_params_nonnegative,
        gtx.scale_by_distance_over_gradients,
    )
    for make in makers:
        tx = make()
        state = tx.init(params)
        g = dict(grad_sequence(1)[0], scale=None)
        updates, _ = tx.update(g, state, params)
        assert updates["scale"] is None and updates["layer.weight"] is not None


# --------------------------------------------------------------------------- torch.optim


def _torch_trajectory(make_optimizer, params, grads):
    names = list(params)
    tensors = [params[k].clone().requires_grad_(True) for k in names]
    opt = make_optimizer(tensors)
    deltas = []
    for g in grads:
        before = [t.detach().clone() for t in tensors]
        for t, k in zip(tensors, names):
            t.grad = g[k].clone()
        opt.step()
        deltas.append({k: t.detach() - b for k, t, b in zip(names, tensors, before)})
    return deltas


def test_rprop_state_is_torch_step():
    """optax's Rprop keeps in ``prev_updates`` the negated step torch's Rprop takes, and returns it a step later."""
    params, grads = tree(0), _grads_with_sign_flips(8)
    deltas = _torch_trajectory(lambda ps: torch.optim.Rprop(ps, lr=0.1, foreach=False), params, grads)
    tx = gtx.scale_by_rprop(0.1)
    state = tx.init(params)
    previous = None
    for g, delta in zip(grads, deltas):
        updates, state = tx.update(g, state, params)
        assert_trees_close(state.prev_updates, {k: -v for k, v in delta.items()}, rtol=1e-12, atol=1e-14)
        if previous is not None:  # the lag: what comes out now is last step's torch step, zeroed on a sign flip
            flipped = {k: (g[k] * -previous[k]) < 0 for k in g}
            expected = {k: torch.where(flipped[k], 0.0, -previous[k]) for k in g}
            assert_trees_close(updates, expected, rtol=1e-12, atol=1e-14)
        previous = {k: v for k, v in delta.items()}


def test_novograd_norms_accumulate_in_float32_for_bfloat16():
    params = tree(0, torch.bfloat16)
    g = {k: torch.full_like(v, 3.0) for k, v in params.items()}
    updates, state = gtx.scale_by_novograd().update(g, gtx.scale_by_novograd().init(params), params)
    assert state.nu["layer.weight"].dtype == torch.bfloat16 and updates["layer.weight"].dtype == torch.bfloat16
    torch.testing.assert_close(state.nu["layer.weight"].float(), torch.tensor(9.0 * 12), rtol=1e-2, atol=0)


def test_param_block_scalings_floor_small_params():
    params = {"zero": torch.zeros(3, dtype=torch.float64), "big": torch.full((4,), 2.0, dtype=torch.float64)}
    g = {k: torch.ones_like(v) for k, v in params.items()}
    by_norm, _ = gtx.scale_by_param_block_norm(min_scale=0.25).update(g, gtx.EmptyState(), params)
    by_rms, _ = gtx.scale_by_param_block_rms(min_scale=0.25).update(g, gtx.EmptyState(), params)
    assert torch.equal(by_norm["zero"], torch.full((3,), 0.25, dtype=torch.float64))
    assert torch.equal(by_norm["big"], torch.full((4,), 4.0, dtype=torch.float64))
    assert torch.equal(by_rms["big"], torch.full((4,), 2.0, dtype=torch.float64))


def test_keep_params_nonnegative_lands_on_zero():
    params = {"w": torch.tensor([1.0, 0.5, 0.0, 2.0], dtype=torch.float64)}
    step = {"w": torch.tensor([-2.0, -0.25, -1.0, 1.0], dtype=torch.float64)}
    updates, _ = gtx.keep_params_nonnegative().update(step, gtx.keep_params_nonnegative().init(params), params)
    assert torch.equal(gtx.apply_updates(params, updates)["w"], torch.tensor([0.0, 0.25, 0.0, 3.0], dtype=torch.float64))


def test_parameter_scalings_need_params():
    for tx in (gtx.scale_by_param_block_norm(), gtx.keep_params_nonnegative(), gtx.scale_by_distance_over_gradients()):
        with pytest.raises(ValueError, match="params are required"):
            tx.update(grad_sequence(1)[0], tx.init(tree(0)), None)


# --------------------------------------------------------------------------- Adafactor's factored moments

FACTOR_SHAPES = {"mat": (3, 5), "tall": (6, 2), "cube": (2, 4, 3), "square": (4, 4), "vec": (5,), "s": ()}


def _factored_dims_reference(shape, min_dim):
    if len(shape) < 2:
        return None
    order = sorted(range(len(shape)), key=lambda d: (shape[d], d))
    return (order[-2], order[-1]) if shape[order[-2]] >= min_dim else None


def ref_factored_rms(decay_rate=0.8, step_offset=0, min_dim_size_to_factor=128, epsilon=1e-30):
    def init(p):
        rows, cols, full = {}, {}, {}
        for k, x in p.items():
            dims = _factored_dims_reference(tuple(x.shape), min_dim_size_to_factor)
            if dims is None:
                rows[k], cols[k], full[k] = torch.zeros(1, dtype=x.dtype), torch.zeros(1, dtype=x.dtype), torch.zeros_like(x)
            else:
                d1, d0 = dims
                rows[k], cols[k], full[k] = x.sum(d0) * 0, x.sum(d1) * 0, torch.zeros(1, dtype=x.dtype)
        return {"count": 0, "v_row": rows, "v_col": cols, "v": full}

    def step(g, s, p):
        beta = 1.0 - (s["count"] - step_offset + 1.0) ** (-decay_rate)
        u, rows, cols, full = {}, {}, {}, {}
        for k, gi in g.items():
            sq = gi**2 + epsilon
            dims = _factored_dims_reference(tuple(gi.shape), min_dim_size_to_factor)
            if dims is None:
                full[k] = beta * s["v"][k] + (1 - beta) * sq
                rows[k], cols[k] = torch.zeros(1, dtype=gi.dtype), torch.zeros(1, dtype=gi.dtype)
                u[k] = gi / torch.sqrt(full[k])
            else:
                d1, d0 = dims
                rows[k] = beta * s["v_row"][k] + (1 - beta) * sq.mean(d0)
                cols[k] = beta * s["v_col"][k] + (1 - beta) * sq.mean(d1)
                full[k] = torch.zeros(1, dtype=gi.dtype)
                # the second moment estimate v_ij = row_i * col_j / mean(row), the mean taken over the
                # factored pair only (one per slice of any other dimensions)
                row_mean = rows[k].unsqueeze(d0).mean(dim=d1, keepdim=True)
                estimate = rows[k].unsqueeze(d0) * cols[k].unsqueeze(d1) / row_mean
                u[k] = gi / torch.sqrt(estimate)
        return u, {"count": s["count"] + 1, "v_row": rows, "v_col": cols, "v": full}

    return init, step


@pytest.mark.parametrize("min_dim", [1, 3, 128])
@pytest.mark.parametrize("inplace", [False, True])
def test_factored_rms_matches_reference(min_dim, inplace):
    params, grads = tree(0, shapes=FACTOR_SHAPES), grad_sequence(5, shapes=FACTOR_SHAPES)
    kwargs = {"decay_rate": 0.7, "step_offset": 0, "min_dim_size_to_factor": min_dim, "epsilon": 1e-30}
    check_against_reference(
        gtx.scale_by_factored_rms(**kwargs), *ref_factored_rms(**kwargs), params=params, grads=grads, inplace=inplace
    )


def test_factored_rms_state_and_purity():
    params, grads = tree(0, shapes=FACTOR_SHAPES), grad_sequence(3, shapes=FACTOR_SHAPES)
    tx = gtx.scale_by_factored_rms(min_dim_size_to_factor=2)
    state = tx.init(params)
    assert type(state)._fields == ("count", "v_row", "v_col", "v")
    assert state.v_row["mat"].shape == (3,) and state.v_col["mat"].shape == (5,) and state.v["mat"].shape == (1,)
    assert state.v_row["cube"].shape == (2, 3) and state.v_col["cube"].shape == (2, 4)
    assert state.v["vec"].shape == (5,) and state.v_row["vec"].shape == (1,)
    check_pure_and_donated(tx, params, grads)
    offset = gtx.scale_by_factored_rms(min_dim_size_to_factor=2, step_offset=-2, decay_rate=0.5)
    check_against_reference(offset, *ref_factored_rms(0.5, -2, 2), params=params, grads=grads)
    compiled_matches_eager(gtx.scale_by_factored_rms(min_dim_size_to_factor=2))


# --------------------------------------------------------------------------- SM3

SM3_SHAPES = {"cube": (3, 4, 2), "mat": (4, 3), "vec": (5,)}


def ref_sm3(b1=0.9, b2=1.0, eps=1e-8):
    c0 = 1.0 if b2 == 1.0 else 1.0 - b2

    def init(p):
        return {"nu": _zeros(p), "mu": {k: [torch.zeros(n, dtype=x.dtype) for n in x.shape] for k, x in p.items()}}

    def step(g, s, p):
        nu, mu = {}, {}
        for k, gi in g.items():
            acc = torch.empty_like(gi)
            for index in torch.cartesian_prod(*[torch.arange(n) for n in gi.shape]).reshape(-1, gi.ndim).tolist():
                bound = min(float(s["mu"][k][axis][i]) for axis, i in enumerate(index))
                acc[tuple(index)] = c0 * gi[tuple(index)] ** 2 + b2 * bound
            scaled = torch.where(acc > 0, gi / torch.sqrt(acc + eps), torch.zeros_like(gi))
            nu[k] = (1 - b1) * scaled + b1 * s["nu"][k]
            mu[k] = [
                torch.stack([acc.select(axis, i).max() for i in range(gi.shape[axis])]) for axis in range(gi.ndim)
            ]
        return dict(nu), {"nu": nu, "mu": mu}

    return init, step


def _check_sm3_mu(actual, expected):
    for k in expected:
        assert len(actual[k]) == len(expected[k])
        for a, e in zip(actual[k], expected[k]):
            torch.testing.assert_close(a, e, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("kwargs", [{}, {"b1": 0.5, "b2": 0.9, "eps": 1e-3}])
@pytest.mark.parametrize("inplace", [False, True])
def test_sm3_matches_reference(kwargs, inplace):
    params, grads = tree(0, shapes=SM3_SHAPES), grad_sequence(4, shapes=SM3_SHAPES)
    tx, (ref_init, ref_step) = gtx.scale_by_sm3(**kwargs), ref_sm3(**kwargs)
    state, ref_state = tx.init(params), ref_init(params)
    assert type(state)._fields == ("mu", "nu")
    for g in grads:
        updates, state = tx.update(clone_tree(g), state, params, inplace=inplace)
        ref_updates, ref_state = ref_step(g, ref_state, params)
        assert_trees_close(updates, ref_updates, rtol=1e-10, atol=1e-13)
        assert_trees_close(state.nu, ref_state["nu"], rtol=1e-10, atol=1e-13)
        _check_sm3_mu(state.mu, ref_state["mu"])


def test_sm3_pure_donated_scalar_leaf_and_compile():
    shapes = dict(SM3_SHAPES, s=())
    check_pure_and_donated(gtx.scale_by_sm3(), tree(0, shapes=shapes), grad_sequence(3, shapes=shapes))
    # a 0-d leaf is a vector of one element
    tx = gtx.scale_by_sm3(b1=0.0)
    updates, state = tx.update({"s": torch.tensor(2.0, dtype=torch.float64)}, tx.init({"s": torch.tensor(1.0, dtype=torch.float64)}))
    torch.testing.assert_close(updates["s"], torch.tensor(2.0 / math.sqrt(4.0 + 1e-8), dtype=torch.float64))
    assert state.mu["s"][0].shape == () and float(state.mu["s"][0]) == 4.0
    compiled_matches_eager(gtx.scale_by_sm3())


# --------------------------------------------------------------------------- differentiable pure path

DIFFERENTIABLE = {
    "adadelta": gtx.scale_by_adadelta,
    "yogi": gtx.scale_by_yogi,
    "adan": gtx.scale_by_adan,
    "novograd": lambda: gtx.scale_by_novograd(weight_decay=0.1),
    "optimistic": lambda: gtx.scale_by_optimistic_gradient(0.5, 2.0),
    "factored_rms": lambda: gtx.scale_by_factored_rms(min_dim_size_to_factor=2),
    "sm3": lambda: gtx.scale_by_sm3(b2=0.9),
    "param_block_rms": gtx.scale_by_param_block_rms,
    "distance_over_gradients": lambda: gtx.scale_by_distance_over_gradients(param_dtype=None),
}


@pytest.mark.parametrize("name", sorted(DIFFERENTIABLE))
def test_pure_update_is_differentiable(name):
    """gradcheck of two steps with respect to the second gradient and the params."""
    tx = DIFFERENTIABLE[name]()
    shapes = {"w": (3, 2), "b": (2,)}
    params, first, second = tree(0, shapes=shapes), tree(1, shapes=shapes), tree(2, shapes=shapes)
    _, state = tx.update(first, tx.init(params), params)

    def step(w_grad, b_grad, w_param):
        p = dict(params, w=w_param)
        updates, _ = tx.update({"w": w_grad, "b": b_grad}, state, p)
        return updates["w"], updates["b"]

    inputs = tuple(x.clone().requires_grad_(True) for x in (second["w"], second["b"], params["w"]))
    assert torch.autograd.gradcheck(step, inputs)
