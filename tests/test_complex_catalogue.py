"""Complex parameters across the whole catalogue: every transformation either gives optax's numbers
(recorded in optax_complex_reference.py, see complex_cases.py) or refuses complex params at init."""

from __future__ import annotations

import math

import inspect

import pytest
import torch

import gradtx as gtx
import gradtx.contrib
import complex_cases as cc
from optax_complex_reference import REFERENCE

# the deprecated names are in the catalogue too (their numbers must hold while they exist)
pytestmark = [
    pytest.mark.filterwarnings("ignore:`optimistic_adam` is deprecated:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:inject_stateful_hyperparams is deprecated:DeprecationWarning"),
]

# Known differences that are not about complex numbers (the same on real params, see
# benchmarks/optax_agreement.py): clip_by_global_norm scales by torch's max_norm / (norm + 1e-6),
# optax by max_norm / norm; optax computes Adafactor's decay rate in float32.
RTOL = {"clip_by_global_norm": 1e-6, "chain": 1e-6, "named_chain": 1e-6, "adafactor": 1e-6, "scale_by_factored_rms": 1e-6}

# public callables that are not transformations: schedules, numerics, tree helpers, types, runners
NOT_TRANSFORMATIONS = {
    "apply_updates", "bias_correction", "compile_step", "constant_schedule", "cosine_decay_schedule",
    "cosine_onecycle_schedule", "exponential_decay", "get_measurement", "global_norm", "incremental_update",
    "init_empty_state", "join_schedules", "linear_onecycle_schedule", "linear_schedule", "matrix_inverse_pth_root",
    "microbatch", "multi_normal", "observations", "periodic_update", "piecewise_constant_schedule", "piecewise_interpolate_schedule",
    "polynomial_schedule", "power_iteration", "release_buffers", "safe_increment", "safe_int32_increment", "safe_norm",
    "safe_root_mean_squares", "scale_gradient", "schedule_free_eval_params", "sgdr_schedule", "tree_map_params",
    "update_infinity_moment", "update_moment", "update_moment_per_elem_norm", "warmup_constant_schedule",
    "warmup_cosine_decay_schedule", "warmup_exponential_decay_schedule", "MaskOrFn", "ScalarOrSchedule", "Schedule",
}


def _params():
    return cc.tree(gtx, cc.PARAMS)


def _numbers(params):
    return {k: torch.as_tensor(v) for k, v in params.items()}


def _expected(name):
    return {k: torch.tensor(v, dtype=torch.complex128) for k, v in REFERENCE[name].items()}


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("name", sorted(cc.CASES))
def test_complex_params_give_optax_numbers(name, inplace):
    case = cc.CASES[name]
    got = cc.run(gtx, case.factory(gtx), case.kind, steps=case.steps, inplace=inplace)
    expected = _expected(name)
    assert set(got) == set(expected)
    for k in expected:
        assert got[k].dtype == torch.complex128, f"{name}: leaf {k} is {got[k].dtype}"
        torch.testing.assert_close(got[k], expected[k], rtol=RTOL.get(name, 1e-10), atol=1e-12, msg=lambda m: f"{name} {k}: {m}")


@pytest.mark.parametrize("name", sorted(cc.REFUSED))
def test_complex_params_are_refused_at_init_naming_the_leaf(name):
    tx = cc.REFUSED[name](gtx)
    with pytest.raises(TypeError, match=r"leaf '(w|b|s)' is complex \(torch.complex128\)"):
        tx.init(_params())
    real = {k: v.real.clone() for k, v in _params().items()}
    tx.init(real)  # real params are fine


def _public_callables():
    names = set()
    for module in (gtx, gtx.contrib):
        for name in module.__all__:
            value = getattr(module, name)
            if callable(value) and not inspect.isclass(value) or name == "MultiSteps":
                names.add(name)
    return names


class _Recorder:
    """A module whose attribute reads are recorded (``contrib`` included)."""

    def __init__(self, module, used):
        self._module, self._used = module, used
        self.__name__ = module.__name__

    def __getattr__(self, name):
        value = getattr(self._module, name)
        self._used.add(name)
        return _Recorder(value, self._used) if name == "contrib" else value


def test_every_public_transformation_is_covered():
    used: set[str] = set()
    recorder = _Recorder(gtx, used)
    for case in cc.CASES.values():
        case.factory(recorder)
    for make in cc.REFUSED.values():
        make(recorder)
    covered = used | set(cc.ELSEWHERE) | NOT_TRANSFORMATIONS
    missing = sorted(_public_callables() - covered)
    assert not missing, f"no complex case, refusal or dedicated test for: {missing}"
    assert not set(cc.REFUSED) & set(cc.CASES)
    import test_complex_params

    for name, where in cc.ELSEWHERE.items():  # each names a test that exists
        test = where.split()[0]
        assert hasattr(test_complex_params, test) or test in globals(), f"{name}: no test {test!r}"


def test_quantize_state_keeps_complex_moments_as_its_inner_transformation_does():
    """Complex moments are not stored quantized (only real floating ones are): the numbers are
    the inner optimizer's, bit for bit, and the state holds no codes."""
    params = _params()
    tx, plain = gtx.quantize_state(gtx.adam(0.1), min_size=1), gtx.adam(0.1)
    state, plain_state = tx.init(params), plain.init(params)
    for _ in range(3):
        grads = {k: v * (1 - 2j) for k, v in params.items()}
        updates, state = tx.update(grads, state, params)
        plain_updates, plain_state = plain.update(grads, plain_state, params)
        assert all(torch.equal(updates[k], plain_updates[k]) for k in params)
    assert all(c is None for tree in state.codes for c in gtx.tree.leaves(tree))


def test_observe_keeps_the_inner_numbers_and_measures_complex_leaves_by_moduli():
    params = _params()
    tx, plain = gtx.observe(gtx.adam(0.1), groups=1), gtx.adam(0.1)
    state, plain_state = tx.init(params), plain.init(params)
    grads = {k: v * (1 - 2j) for k, v in params.items()}
    updates, state = tx.update(grads, state, params)
    plain_updates, plain_state = plain.update(grads, plain_state, params)
    assert all(torch.equal(updates[k], plain_updates[k]) for k in params)
    logged = gtx.observations(state)
    for name, g in grads.items():  # the 2-norm of a complex tensor: sqrt(sum |g|^2)
        assert math.isclose(logged[f"grad_norm/{name}"], torch.linalg.vector_norm(g).item(), rel_tol=1e-12)
        assert math.isclose(logged[f"grad_max/{name}"], g.abs().max().item(), rel_tol=1e-12)


def test_adam_first_update_on_complex_gradients_matches_optax():
    # optax.adam(0.1)'s first update is -0.1 * g / |g| elementwise (0.0894+0.0447j for -4-2j): the
    # second moment is |g|^2, not g * g
    first = REFERENCE["adam_first_update"]
    g = torch.tensor(first["g"], dtype=torch.complex128)
    expected = torch.tensor(first["update"], dtype=torch.complex128)
    torch.testing.assert_close(expected, -0.1 * g / g.abs(), rtol=1e-7, atol=0)
    for tx in (gtx.adam(0.1), gtx.adamw(0.1, weight_decay=0.0), gtx.chain(gtx.scale_by_adam(), gtx.scale(-0.1))):
        for inplace in (False, True):
            updates, _ = tx.update(g.clone(), tx.init(torch.zeros_like(g)), torch.zeros_like(g), inplace=inplace)
            torch.testing.assert_close(updates, expected, rtol=1e-12, atol=1e-15)


# --------------------------------------------------------------------------- the recorded graph path

# the foreach/fused transformations, whose graph path (a gradient tensor that requires grad) runs
# other kernels than the fast path
GRAPH_CASES = [
    "adam", "adam_eps_root", "adamw", "nadam", "amsgrad", "scale_by_amsgrad", "adamax", "adabelief", "radam",
    "yogi", "rmsprop", "rmsprop_centered_momentum", "rmsprop_bias_correction", "adagrad", "adagrad_from_zero",
    "lion", "scale_by_lion_refined", "sign_sgd", "ademamix", "acprop", "adopt_without_clipping", "adan",
    "novograd", "scale_by_factored_rms", "lamb", "sgd",
]


@pytest.mark.parametrize("name", GRAPH_CASES)
def test_the_differentiable_path_gives_the_fast_path_numbers(name):
    case = cc.CASES[name]
    tx = case.factory(gtx)
    params = _params()
    fast_state, graph_state = tx.init(params), tx.init(params)
    for i in range(case.steps):
        g = cc.tree(gtx, cc.GRADS[i % len(cc.GRADS)])
        fast, fast_state = tx.update({k: v.clone() for k, v in g.items()}, fast_state, params)
        leaves = {k: v.clone().requires_grad_(True) for k, v in g.items()}
        graph, graph_state = tx.update(leaves, graph_state, params)
        assert all(u.requires_grad for u in graph.values()), f"{name}: no graph recorded"
        for k in fast:
            torch.testing.assert_close(graph[k].detach(), fast[k], rtol=1e-12, atol=1e-15, msg=lambda m: f"{name} {k}: {m}")
        graph_state = gtx.tree.tree_map(lambda x: x.detach() if isinstance(x, torch.Tensor) else x, graph_state)
        params = gtx.apply_updates(params, fast)


def test_second_moments_stay_real_valued():
    tx = gtx.adam(0.1)
    params = _params()
    state = tx.init(params)
    for g in cc.GRADS:
        _, state = tx.update(cc.tree(gtx, g), state, params)
    for nu in state[0].nu.values():
        assert nu.dtype == torch.complex128 and torch.equal(nu.imag, torch.zeros_like(nu.imag))
