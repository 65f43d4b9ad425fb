"""Complex parameters, where the catalogue sweep (test_complex_catalogue.py) does not reach: L-BFGS
and line searches against the real-equivalent problem, torch.optim's own conventions, per-example
clipping, unit-wise norms with optax's ``axis``, the state dtypes kept for complex params, and the
tree helpers that order complex numbers."""

from __future__ import annotations

import pytest
import torch

import gradtx as gtx
import gradtx.contrib
from optimizer_helpers import gradtx_trajectory, torch_trajectory

C128 = torch.complex128


def _complex_tree(seed: int, dtype=C128) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(3, 2, generator=gen, dtype=dtype), "b": torch.randn(2, generator=gen, dtype=dtype)}


# --------------------------------------------------------------------------- L-BFGS and line searches

A = torch.tensor([[1, -2], [3, 4], [-4 + 2j, 5 - 3j], [-2 - 2j, 6], [0.5j, 1 + 1j]], dtype=C128)
B = torch.tensor([1 + 1j, -2, 0.5j, 3 - 1j, 1], dtype=C128)


def _least_squares(p):
    return (A @ p["z"] - B).abs().square().sum()


def _real_least_squares(p):
    """The same objective of the real and imaginary parts, stacked on a leading axis of 2."""
    return _least_squares({"z": torch.complex(p["x"][0], p["x"][1])})


def _solve(f, params, linesearch, steps=25):
    opt = gtx.lbfgs(linesearch=linesearch)
    state = opt.init(params)
    structure = gtx.tree.structure(state)
    dtypes = [x.dtype for x in gtx.tree.leaves(state)]
    value_and_grad = gtx.value_and_grad_from_state(f)
    values = []
    for _ in range(steps):
        value, grad = value_and_grad(params, state=state)
        updates, state = opt.update(grad, state, params, value=value, grad=grad, value_fn=f)
        params = gtx.apply_updates(params, updates)
        values.append(float(f(params)))
        # the state keeps one structure and dtypes (the line search's values are real)
        assert gtx.tree.structure(state) == structure
        assert [x.dtype for x in gtx.tree.leaves(state)] == dtypes
    return params, values


@pytest.mark.parametrize(
    "linesearch",
    [
        lambda: gtx.scale_by_zoom_linesearch(max_linesearch_steps=20),
        lambda: gtx.scale_by_backtracking_linesearch(max_backtracking_steps=20, store_grad=True),
    ],
    ids=["zoom", "backtracking"],
)
def test_complex_least_squares_converges_like_its_real_equivalent(linesearch):
    z0 = torch.tensor([1 - 1j, 0.5j], dtype=C128)
    solution = torch.linalg.lstsq(A, B.unsqueeze(-1)).solution.squeeze(-1)
    complex_params, complex_values = _solve(_least_squares, {"z": z0.clone()}, linesearch())
    real_params, real_values = _solve(_real_least_squares, {"x": torch.stack([z0.real, z0.imag])}, linesearch())
    # every inner product is the real one of the stacked parts: the same steps, to rounding
    torch.testing.assert_close(torch.tensor(complex_values), torch.tensor(real_values), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(complex_params["z"], torch.complex(real_params["x"][0], real_params["x"][1]), rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(complex_params["z"], solution, rtol=1e-8, atol=1e-8)


def test_zoom_linesearch_state_keeps_its_structure_on_complex_params():
    params = {"z": torch.tensor([1 - 1j, 0.5j], dtype=C128)}
    tx = gtx.chain(gtx.sgd(1.0), gtx.scale_by_zoom_linesearch(max_linesearch_steps=10))
    state = tx.init(params)
    value, grad = gtx.transforms.linesearch.value_and_grad(_least_squares)(params)
    _, new_state = tx.update(grad, state, params, value=value, grad=grad, value_fn=_least_squares)
    assert gtx.tree.structure(new_state) == gtx.tree.structure(state)
    zoom = new_state[1]
    assert zoom.grad["z"].dtype == C128 and zoom.value.dtype == torch.float64 and zoom.learning_rate.dtype == torch.float64
    # the gradient kept is the objective's at the accepted point (torch's conjugate Wirtinger gradient)
    accepted = {"z": params["z"] - zoom.learning_rate * grad["z"]}
    expected = 2 * A.conj().T @ (A @ accepted["z"] - B)
    torch.testing.assert_close(zoom.grad["z"], expected, rtol=1e-12, atol=1e-12)


# --------------------------------------------------------------------------- torch's conventions

TORCH_CASES = {
    "Adam": (torch.optim.Adam, {"lr": 0.1}),
    "AdamW": (torch.optim.AdamW, {"lr": 0.1, "weight_decay": 0.1}),
    "Adam_amsgrad": (torch.optim.Adam, {"lr": 0.1, "amsgrad": True}),
    "SGD": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True}),
    "RMSprop": (torch.optim.RMSprop, {"lr": 0.1, "centered": True}),
    "Adagrad": (torch.optim.Adagrad, {"lr": 0.1}),
    "NAdam": (torch.optim.NAdam, {"lr": 0.1}),
}


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("name", sorted(TORCH_CASES))
def test_from_torch_keeps_torch_numbers_on_complex_params(name, inplace):
    cls, hyperparams = TORCH_CASES[name]
    params, grads = _complex_tree(0), [_complex_tree(10 + i) for i in range(3)]
    expected = torch_trajectory(lambda ps: cls(ps, **hyperparams), params, grads)
    got, _ = gradtx_trajectory(gtx.from_torch(cls, **hyperparams), params, grads, inplace=inplace)
    for k in expected:
        torch.testing.assert_close(got[k], expected[k], rtol=1e-14, atol=1e-15)


def test_wrap_keeps_torch_numbers_on_complex_params():
    def model():
        torch.manual_seed(1)
        return torch.nn.Linear(3, 2, dtype=torch.complex64)

    grads = [[torch.randn(2, 3, dtype=torch.complex64) * 3, torch.randn(2, dtype=torch.complex64)] for _ in range(3)]
    wrapped, plain = model(), model()
    opt = gtx.wrap(torch.optim.Adam(wrapped.parameters(), lr=0.1), gtx.chain(gtx.clip_by_global_norm(1.0), gtx.scale(0.5)), model=wrapped)
    reference = torch.optim.Adam(plain.parameters(), lr=0.1)
    for g in grads:
        for p, q, gi in zip(wrapped.parameters(), plain.parameters(), g):
            p.grad, q.grad = gi.clone(), gi.clone()
        opt.step()
        torch.nn.utils.clip_grad_norm_(list(plain.parameters()), 1.0)
        for q in plain.parameters():
            q.grad.mul_(0.5)
        reference.step()
    for p, q in zip(wrapped.parameters(), plain.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    with pytest.raises(TypeError, match="leaf 'weight' is complex"):
        opt.clip_grad_by_value(0.5)


def test_sgd_on_complex_params_matches_torch():
    # linear in the gradient: optax (the catalogue sweep) and torch agree
    params, grads = _complex_tree(0), [_complex_tree(10 + i) for i in range(4)]
    expected = torch_trajectory(lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.1), params, grads)
    got, _ = gradtx_trajectory(gtx.chain(gtx.add_decayed_weights(0.1), gtx.sgd(0.1, 0.9, nesterov=True)), params, grads)
    for k in expected:
        torch.testing.assert_close(got[k], expected[k], rtol=1e-14, atol=1e-15)


@pytest.mark.parametrize(
    "make_torch, tx, rtol",
    [
        (lambda ps: torch.optim.Adam(ps, lr=0.1), lambda: gtx.adam(0.1), 1e-12),
        (lambda ps: torch.optim.AdamW(ps, lr=0.1, weight_decay=0.1), lambda: gtx.adamw(0.1, weight_decay=0.1), 1e-12),
        (lambda ps: torch.optim.Adamax(ps, lr=0.1), lambda: gtx.adamax(0.1), 1e-12),
        # torch's rectified step adds eps to sqrt(nu) before the bias correction, optax's after
        (lambda ps: torch.optim.RAdam(ps, lr=0.1), lambda: gtx.radam(0.1), 1e-8),
        (lambda ps: torch.optim.RMSprop(ps, lr=0.1, eps=1e-8), lambda: gtx.rmsprop(0.1, decay=0.99, eps=1e-8, eps_in_sqrt=False), 1e-12),
    ],
    ids=["Adam", "AdamW", "Adamax", "RAdam", "RMSprop"],
)
def test_torch_adaptive_optimizers_are_split_real_and_imaginary(make_torch, tx, rtol):
    """torch.optim's adaptive optimizers treat a complex parameter as two real ones (its moments are
    per part); gradtx follows optax (``|g|^2`` moments), and gives torch's numbers under
    ``split_real_and_imaginary``. (Seven steps: RAdam rectifies from the sixth.)"""
    params, grads = _complex_tree(0), [_complex_tree(10 + i) for i in range(7)]
    expected = torch_trajectory(make_torch, params, grads)
    got, _ = gradtx_trajectory(gtx.contrib.split_real_and_imaginary(tx()), params, grads)
    for k in expected:
        torch.testing.assert_close(got[k], expected[k], rtol=rtol, atol=1e-14)
    modulus, _ = gradtx_trajectory(tx(), params, grads)
    assert not torch.allclose(modulus["w"], expected["w"], rtol=1e-3)  # the two conventions differ


# --------------------------------------------------------------------------- per-example clipping


def _batch(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    scales = torch.tensor([0.1, 1.0, 4.0, 8.0], dtype=torch.float64)
    return [
        torch.randn(4, 3, 2, generator=gen, dtype=C128) * scales[:, None, None],
        torch.randn(4, 2, generator=gen, dtype=C128) * scales[:, None],
    ]


def test_per_example_clips_use_moduli():
    """A complex example is clipped as its real and imaginary parts seen as one real vector."""
    batch = _batch(0)
    as_real = [torch.view_as_real(t) for t in batch]
    summed, clipped = gtx.per_example_global_norm_clip(batch, 2.0)
    real_summed, real_clipped = gtx.per_example_global_norm_clip(as_real, 2.0)
    assert int(clipped) == int(real_clipped) == 3
    for s, r in zip(summed, real_summed):
        assert s.dtype == C128
        torch.testing.assert_close(torch.view_as_real(s), r, rtol=1e-14, atol=1e-15)
    for uniform in (True, False):
        layer, counts = gtx.per_example_layer_norm_clip(batch, 2.0, uniform)
        real_layer, real_counts = gtx.per_example_layer_norm_clip(as_real, 2.0, uniform)
        assert [int(c) for c in counts] == [int(c) for c in real_counts]
        for s, r in zip(layer, real_layer):
            torch.testing.assert_close(torch.view_as_real(s), r, rtol=1e-14, atol=1e-15)
    # without noise, DP aggregation is the clipped mean, and DP-SGD steps against it
    params = [t[0] for t in batch]
    for tx, factor in ((gtx.differentially_private_aggregate(2.0, 0.0, 0), 0.25), (gtx.contrib.dpsgd(1.0, 2.0, 0.0, 0), -0.25)):
        updates, _ = tx.update([t.clone() for t in batch], tx.init(params), params)
        for u, s in zip(updates, summed):
            torch.testing.assert_close(u, factor * s, rtol=1e-14, atol=1e-15)


# --------------------------------------------------------------------------- unit-wise norms with optax's axis

X = torch.tensor([[[1.0, -2.0], [0.5, 3.0]], [[-1.5, 0.25], [2.0, -0.75]]], dtype=torch.float64)
Z = X + 1j * torch.tensor([[[0.5, 1.0], [-2.0, 0.0]], [[1.0, -1.0], [0.25, 2.0]]], dtype=torch.float64)
# optax 0.2.8 (jax 0.10.2, x64): optax.transforms._clipping.unitwise_norm(x, axis=axis), which
# broadcasts to x's shape; gradtx's keeps the reduced dims of size 1
OPTAX_UNITWISE = {
    ("x", 0): [[[1.8027756377319946, 2.0155644370746373], [2.0615528128088303, 3.092329219213245]]] * 2,
    ("x", (1, 2)): [[[3.774917217635375] * 2] * 2, [[2.622022120425379] * 2] * 2],
    ("x", -1): [[[2.23606797749979] * 2, [3.0413812651491097] * 2], [[1.5206906325745548] * 2, [2.1360009363293826] * 2]],
    ("z", 0): [[[2.1213203435596424, 2.462214450449026], [2.883140648667699, 3.6827299656640586]]] * 2,
    ("z", (1, 2)): [[[4.415880433163924] * 2] * 2, [[3.59687364248454] * 2] * 2],
    ("z", -1): [[[2.5] * 2, [3.640054944640259] * 2], [[2.0766559657295187] * 2, [2.9368350311176825] * 2]],
}
# optax.adaptive_grad_clip(0.2, axis=-1).update(g, state, p) with p = {"w": z, "b": [0.5 - 1j, 2]},
# g = {"w": 3 * z[::-1], "b": [4 + 1j, -0.1j]}
OPTAX_AGC = {
    "b": [0.4444444444444444 + 0.1111111111111111j, -0.011111111111111112j],
    "w": [
        [[-0.36115755925730764 + 0.24077170617153842j, 0.060192926542884606 - 0.24077170617153842j],
         [0.49577928703131136 + 0.06197241087891392j, -0.18591723263674176 + 0.49577928703131136j]],
        [[0.16613247725836153 + 0.08306623862918076j, -0.33226495451672305 + 0.16613247725836153j],
         [0.08068106321971812 - 0.32272425287887246j, 0.48408637931830867 + 0j]],
    ],
}


@pytest.mark.parametrize("key", sorted(OPTAX_UNITWISE, key=str))
def test_unitwise_norm_axis_matches_optax(key):
    name, axis = key
    x = {"x": X, "z": Z}[name]
    norm = gtx.unitwise_norm(x, axis=axis)
    assert norm.dtype == torch.float64
    torch.testing.assert_close(norm.expand_as(x), torch.tensor(OPTAX_UNITWISE[key], dtype=torch.float64), rtol=1e-14, atol=0)


@pytest.mark.parametrize("inplace", [False, True])
def test_adaptive_grad_clip_axis_matches_optax_on_complex_params(inplace):
    params = {"w": Z, "b": torch.tensor([0.5 - 1j, 2.0], dtype=C128)}
    grads = {"w": 3 * Z.flip(0), "b": torch.tensor([4 + 1j, -0.1j], dtype=C128)}
    tx = gtx.adaptive_grad_clip(0.2, axis=-1)
    updates, _ = tx.update({k: v.clone() for k, v in grads.items()}, tx.init(params), params, inplace=inplace)
    for k, expected in OPTAX_AGC.items():
        torch.testing.assert_close(updates[k], torch.tensor(expected, dtype=C128), rtol=1e-14, atol=1e-16)


def test_axis_errors_name_the_leaf_and_the_argument():
    tx = gtx.adaptive_grad_clip(0.1, axis=1)
    params = {"w": torch.ones(2, 3), "b": torch.ones(3)}
    with pytest.raises(ValueError, match=r"leaf 'b'.*axis 1 is out of range for a tensor of shape \(3,\)"):
        tx.update(params, tx.init(params), params)
    with pytest.raises(TypeError, match="axis="):  # optax's third positional argument is gradtx's keyword
        gtx.adaptive_grad_clip(0.1, 1e-3, 0)
    with pytest.raises(ValueError, match="axis 3 is out of range"):
        gtx.unitwise_norm(torch.ones(2, 3), axis=(0, 3))


def test_default_units_are_unchanged():
    # torch's layout: rows of a matrix, one unit for a vector (0-d result)
    w = torch.tensor([[3.0, 4.0], [0.0, 1.0]])
    torch.testing.assert_close(gtx.unitwise_norm(w), torch.tensor([[5.0], [1.0]]))
    assert gtx.unitwise_norm(torch.tensor([3.0, 4.0])).shape == ()
    torch.testing.assert_close(gtx.unitwise_norm(torch.tensor([[3 + 4j, 0]])), torch.tensor(5.0))


# --------------------------------------------------------------------------- other places complex numbers reach


def test_skip_large_updates_measures_moduli():
    updates = {"w": torch.tensor([3 + 4j, 1j], dtype=C128), "b": torch.tensor([2.0 + 0j], dtype=C128)}
    skip, info = gtx.skip_large_updates(updates, torch.tensor(0), None, max_squared_norm=31.0)
    assert info["norm_squared"].dtype == torch.float64 and float(info["norm_squared"]) == 30.0
    assert not bool(skip)
    skip, _ = gtx.skip_large_updates(updates, torch.tensor(0), None, max_squared_norm=29.0)
    assert bool(skip)


def test_tree_max_and_min_order_complex_numbers_as_optax():
    # optax.tree.max / optax.tree.min (0.2.8) on these trees: NumPy's order, real part first
    tree = {"a": torch.tensor([1 + 5j, 2 - 1j, 2 + 0.5j]), "b": torch.tensor(-3 + 9j), "c": torch.tensor([0.5, 1.5])}
    assert complex(gtx.tree_utils.tree_max(tree)) == 2 + 0.5j
    assert complex(gtx.tree_utils.tree_min(tree)) == -3 + 9j
    assert complex(gtx.tree_utils.tree_max({"a": torch.tensor([1 + 5j, 1 + 7j, 1 - 2j])})) == 1 + 7j
    assert complex(gtx.tree_utils.tree_min({"a": torch.tensor([1 + 5j, 1 + 7j, 1 - 2j])})) == 1 - 2j
    assert float(gtx.tree_utils.tree_max({"c": torch.tensor([0.5, 1.5])})) == 1.5


def test_safe_root_mean_squares_of_complex_numbers_is_that_of_their_moduli():
    x = torch.tensor([3 + 4j, 0j, 1j], dtype=C128)
    torch.testing.assert_close(gtx.safe_root_mean_squares(x, 0.1), torch.tensor((26 / 3) ** 0.5, dtype=torch.float64))
    assert float(gtx.safe_root_mean_squares(torch.zeros(2, dtype=C128), 0.1)) == 0.1


# --------------------------------------------------------------------------- state dtypes for complex params


def test_a_real_state_dtype_names_a_precision_for_complex_params():
    params = _complex_tree(0)
    assert gtx.adam(0.1, mu_dtype=torch.float32).init(params)[0].mu["w"].dtype == torch.complex64
    assert gtx.ema(0.9, accumulator_dtype=torch.float32).init(params).ema["w"].dtype == torch.complex64
    steps = gtx.MultiSteps(gtx.sgd(0.1), 2)  # optax's default accumulator_dtype, float32
    assert steps.init(params).acc_grads["w"].dtype == torch.complex64
    with pytest.raises(TypeError, match="leaf '[wb]' is complex .* no complex dtype of torch.bfloat16's precision"):
        gtx.adam(0.1, mu_dtype=torch.bfloat16).init(params)
    # the imaginary part is kept (optax drops it where its accumulator is real)
    grads = [_complex_tree(10 + i) for i in range(2)]
    got, _ = gradtx_trajectory(steps, params, grads)
    expected = {k: params[k] - 0.1 * (grads[0][k] + grads[1][k]) / 2 for k in params}
    for k in params:
        torch.testing.assert_close(got[k], expected[k], rtol=1e-6, atol=1e-7)


def test_scalar_states_of_complex_params_keep_their_precision():
    params = _complex_tree(0)
    assert gtx.contrib.dog().init(params)[1].max_dist.dtype == torch.float64
    assert gtx.contrib.schedule_free_sgd(0.1).init(params).b1.dtype == torch.float64
    assert gtx.inject_hyperparams(gtx.adam)(learning_rate=0.1).init(params).hyperparams["learning_rate"].dtype == torch.float64
    zoom = gtx.scale_by_zoom_linesearch(10).init(params)
    assert zoom.value.dtype == zoom.learning_rate.dtype == torch.float64


# --------------------------------------------------------------------------- extra arguments and single tensors


@pytest.mark.parametrize("name", ["adam", "adamw", "nadam", "nadamw"])
def test_adam_aliases_take_and_ignore_extra_args(name):
    tx = getattr(gtx, name)(0.1)
    params, grads = _complex_tree(0), _complex_tree(1)
    plain, _ = tx.update(grads, tx.init(params), params)
    value = torch.tensor(1.5, dtype=torch.float64)
    extra, _ = tx.update(grads, tx.init(params), params, value=value, grad=grads, value_fn=lambda p: value)
    for k in plain:
        assert torch.equal(plain[k], extra[k])
    # so they sit where any optimizer may: after a line search's arguments in a chain that forwards them
    chained = gtx.chain(tx, gtx.scale_by_polyak(max_learning_rate=0.5))
    chained.update(grads, chained.init(params), params, value=value)


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_muon_takes_a_single_tensor(weight_decay):
    matrix, vector = torch.randn(4, 3, dtype=torch.float64), torch.randn(3, dtype=torch.float64)
    for param in (matrix, vector, matrix.to(C128)):
        grad = torch.randn_like(param)
        tx = gtx.contrib.muon(0.1, weight_decay=weight_decay, adam_weight_decay=weight_decay)
        alone, _ = tx.update(grad.clone(), tx.init(param), param)
        in_tree, _ = tx.update({"p": grad.clone()}, tx.init({"p": param}), {"p": param})
        torch.testing.assert_close(alone, in_tree["p"], rtol=0, atol=0)


def test_a_branch_that_selects_nothing_needs_no_params():
    param = torch.randn(3)
    for branch in (gtx.adamw(0.1, weight_decay=0.1), gtx.add_decayed_weights(0.1), gtx.adaptive_grad_clip(0.1), gtx.lars(0.1)):
        tx = gtx.partition({"used": gtx.sgd(0.1), "unused": branch}, "used")
        updates, _ = tx.update(param.clone(), tx.init(param), param)
        torch.testing.assert_close(updates, -0.1 * param)
    with pytest.raises(ValueError, match="adamw: params are required for weight decay"):
        gtx.adamw(0.1).update(param, gtx.adamw(0.1).init(param))
