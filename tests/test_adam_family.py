"""Adam and relatives against torch.optim trajectories and against their published formulas."""

import pytest
import torch

import gradtx as gtx
from optimizer_helpers import (
    SHAPES,
    assert_trees_close,
    check_pure_and_donated,
    grad_sequence,
    gradtx_trajectory,
    torch_trajectory,
    tree,
)

STEPS = 8


# --------------------------------------------------------------------------- torch.optim agreement

TORCH_CASES = {
    "adam": (lambda: gtx.adam(1e-2), lambda ps: torch.optim.Adam(ps, lr=1e-2, foreach=True)),
    "adam_b": (
        lambda: gtx.adam(3e-2, b1=0.8, b2=0.95, eps=1e-6),
        lambda ps: torch.optim.Adam(ps, lr=3e-2, betas=(0.8, 0.95), eps=1e-6),
    ),
    "adamw": (
        lambda: gtx.adamw(1e-2, weight_decay=0.1),
        lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=True),
    ),
    # torch's NAdam with a vanishing momentum-decay schedule is optax's nadam.
    "nadam": (lambda: gtx.nadam(1e-2), lambda ps: torch.optim.NAdam(ps, lr=1e-2, momentum_decay=1e9)),
    "nadamw": (
        lambda: gtx.nadamw(1e-2, weight_decay=0.1),
        lambda ps: torch.optim.NAdam(ps, lr=1e-2, momentum_decay=1e9, weight_decay=0.1, decoupled_weight_decay=True),
    ),
    # torch's RAdam adds eps to sqrt(nu) before the bias correction; with eps=0 both are mu_hat / sqrt(nu_hat).
    "radam": (lambda: gtx.radam(1e-2, eps=0.0), lambda ps: torch.optim.RAdam(ps, lr=1e-2, eps=0.0)),
    "adamax": (lambda: gtx.adamax(1e-2), lambda ps: torch.optim.Adamax(ps, lr=1e-2)),
}


@pytest.mark.parametrize("name", sorted(TORCH_CASES))
@pytest.mark.parametrize("inplace", [False, True])
def test_same_trajectory_as_torch_in_float64(name, inplace):
    make_tx, make_opt = TORCH_CASES[name]
    params, grads = tree(0), grad_sequence(STEPS)
    ours, _ = gradtx_trajectory(make_tx(), params, grads, inplace=inplace)
    theirs = torch_trajectory(make_opt, params, grads)
    # torch's NAdam keeps its running product of momenta in a float32 tensor.
    rtol = 1e-7 if name.startswith("nadam") else 1e-10
    assert_trees_close(ours, theirs, rtol=rtol, atol=rtol * 1e-2)


@pytest.mark.parametrize("name", ["adam", "adamw", "nadam", "adamax"])
def test_same_trajectory_as_torch_in_float32(name):
    make_tx, make_opt = TORCH_CASES[name]
    params, grads = tree(0, torch.float32), grad_sequence(STEPS, torch.float32)
    ours, _ = gradtx_trajectory(make_tx(), params, grads, inplace=True)
    theirs = torch_trajectory(make_opt, params, grads)
    assert_trees_close(ours, theirs, rtol=1e-5, atol=1e-6)


def test_radam_switches_to_the_rectified_update_where_torch_does():
    # rho_t crosses 5 at step 6 with b2 = 0.999: the first 5 steps are plain momentum steps.
    params, grads = tree(0), grad_sequence(7)
    for steps in (5, 6, 7):
        ours, _ = gradtx_trajectory(gtx.radam(1e-2, eps=0.0), params, grads[:steps])
        theirs = torch_trajectory(lambda ps: torch.optim.RAdam(ps, lr=1e-2, eps=0.0), params, grads[:steps])
        assert_trees_close(ours, theirs, rtol=1e-10, atol=1e-12)


# --------------------------------------------------------------------------- formulas (optax's definitions)


def _adam_reference(grads, b1, b2, eps, eps_root=0.0, nesterov=False):
    """optax.scale_by_adam written out leaf by leaf; returns the list of updates."""
    mu = {k: torch.zeros_like(v) for k, v in grads[0].items()}
    nu = {k: torch.zeros_like(v) for k, v in grads[0].items()}
    out = []
    for t, g in enumerate(grads, start=1):
        step = {}
        for k in g:
            mu[k] = b1 * mu[k] + (1 - b1) * g[k]
            nu[k] = b2 * nu[k] + (1 - b2) * g[k] ** 2
            if nesterov:
                mu_hat = b1 * mu[k] / (1 - b1 ** (t + 1)) + (1 - b1) * g[k] / (1 - b1**t)
            else:
                mu_hat = mu[k] / (1 - b1**t)
            nu_hat = nu[k] / (1 - b2**t)
            step[k] = mu_hat / (torch.sqrt(nu_hat + eps_root) + eps)
        out.append(step)
    return out


def _run_updates(tx, grads, params=None, inplace=False):
    state = tx.init(params if params is not None else grads[0])
    out = []
    for g in grads:
        u, state = tx.update({k: v.clone() for k, v in g.items()}, state, params, inplace=inplace)
        out.append(u)
    return out, state


@pytest.mark.parametrize("nesterov", [False, True])
@pytest.mark.parametrize("eps_root", [0.0, 1e-3])
def test_scale_by_adam_matches_its_formula(nesterov, eps_root):
    grads = grad_sequence(STEPS)
    ours, state = _run_updates(gtx.scale_by_adam(0.8, 0.9, 1e-3, eps_root, nesterov=nesterov), grads, inplace=True)
    expected = _adam_reference(grads, 0.8, 0.9, 1e-3, eps_root, nesterov)
    for a, e in zip(ours, expected):
        assert_trees_close(a, e, rtol=1e-10, atol=1e-13)
    assert state.count.dtype == torch.int32 and state.count.ndim == 0 and int(state.count) == STEPS


def test_scale_by_amsgrad_keeps_the_max_of_the_corrected_second_moment():
    b1, b2, eps = 0.9, 0.99, 1e-4
    grads = [tree(i, scale=1.0 / (1 + i)) for i in range(STEPS)]  # shrinking gradients: nu_hat falls
    ours, _ = _run_updates(gtx.scale_by_amsgrad(b1, b2, eps), grads)
    mu = {k: torch.zeros_like(v) for k, v in grads[0].items()}
    nu, nu_max = dict(mu), dict(mu)
    for t, (g, u) in enumerate(zip(grads, ours), start=1):
        for k in g:
            mu[k] = b1 * mu[k] + (1 - b1) * g[k]
            nu[k] = b2 * nu[k] + (1 - b2) * g[k] ** 2
            nu_max[k] = torch.maximum(nu_max[k], nu[k] / (1 - b2**t))
            torch.testing.assert_close(u[k], mu[k] / (1 - b1**t) / (torch.sqrt(nu_max[k]) + eps), rtol=1e-10, atol=1e-13)


def test_scale_by_belief_matches_its_formula():
    b1, b2, eps, eps_root = 0.9, 0.999, 1e-16, 1e-16
    grads = grad_sequence(STEPS)
    ours, state = _run_updates(gtx.scale_by_belief(), grads, inplace=True)
    mu = {k: torch.zeros_like(v) for k, v in grads[0].items()}
    s = dict(mu)
    for t, (g, u) in enumerate(zip(grads, ours), start=1):
        for k in g:
            mu[k] = b1 * mu[k] + (1 - b1) * g[k]
            s[k] = b2 * s[k] + (1 - b2) * (g[k] - mu[k]) ** 2 + eps_root
            expected = (mu[k] / (1 - b1**t)) / (torch.sqrt(s[k] / (1 - b2**t)) + eps)
            torch.testing.assert_close(u[k], expected, rtol=1e-9, atol=1e-12)
    assert_trees_close(state.nu, s, rtol=1e-12)


def test_lion_matches_its_formula():
    b1, b2 = 0.9, 0.99
    grads = grad_sequence(STEPS)
    ours, _ = _run_updates(gtx.scale_by_lion(b1, b2), grads)
    mu = {k: torch.zeros_like(v) for k, v in grads[0].items()}
    for g, u in zip(grads, ours):
        for k in g:
            torch.testing.assert_close(u[k], torch.sign((1 - b1) * g[k] + b1 * mu[k]))
            mu[k] = (1 - b2) * g[k] + b2 * mu[k]


@pytest.mark.parametrize("mode, fn", [("smooth", lambda x: torch.tanh(2.0 * x)), ("refined", lambda x: x.clamp(-1, 1))])
def test_lion_modes(mode, fn):
    grads = [tree(1, scale=3.0)]
    (u,), _ = _run_updates(gtx.scale_by_lion(b1=0.0, mode=mode, smooth_beta=2.0), grads)
    assert_trees_close(u, {k: fn(v) for k, v in grads[0].items()}, rtol=1e-12)
    with pytest.raises(ValueError, match="mode"):
        gtx.scale_by_lion(mode="soft")


def test_adamax_state_is_an_adam_state_with_the_infinity_moment():
    grads = grad_sequence(3)
    _, state = _run_updates(gtx.scale_by_adamax(b2=0.5, eps=0.0), grads)
    expected = {k: torch.zeros_like(v) for k, v in grads[0].items()}
    for g in grads:
        expected = {k: torch.maximum(0.5 * expected[k], g[k].abs()) for k in g}
    assert isinstance(state, gtx.ScaleByAdamState)
    assert_trees_close(state.nu, expected, rtol=0)


# --------------------------------------------------------------------------- fused Adam / AdamW


def test_fused_adamw_equals_the_optax_chain_and_has_its_state():
    params, grads = tree(0), grad_sequence(STEPS)
    mask = {"layer.weight": True, "layer.bias": False, "scale": True}
    schedule = gtx.linear_schedule(1e-2, 1e-3, 5)
    fused = gtx.adamw(schedule, weight_decay=0.05, mask=mask)
    unfused = gtx.chain(
        gtx.scale_by_adam(), gtx.add_decayed_weights(0.05, mask), gtx.scale_by_learning_rate(schedule)
    )
    ours, fused_state = gradtx_trajectory(fused, params, grads, inplace=True)
    reference, chain_state = gradtx_trajectory(unfused, params, grads)
    assert_trees_close(ours, reference, rtol=1e-12)
    assert gtx.tree.structure(fused_state) == gtx.tree.structure(chain_state)
    assert_trees_close(fused_state, chain_state, rtol=1e-12)


def test_adam_weight_decay_schedule_and_nesterov():
    params, grads = tree(0), grad_sequence(4)
    decay = lambda count: 0.1 / (1.0 + count)  # noqa: E731
    fused = gtx.adamw(1e-2, weight_decay=decay, nesterov=True)
    unfused = gtx.chain(
        gtx.scale_by_adam(nesterov=True), gtx.add_decayed_weights(decay), gtx.scale_by_learning_rate(1e-2)
    )
    assert_trees_close(gradtx_trajectory(fused, params, grads)[0], gradtx_trajectory(unfused, params, grads)[0], rtol=1e-12)


def test_adamw_needs_params():
    tx = gtx.adamw(1e-3)
    grads = tree(1)
    with pytest.raises(ValueError, match="params are required"):
        tx.update(grads, tx.init(grads))


def test_mu_dtype_keeps_the_first_moment_in_that_dtype():
    params = tree(0, torch.bfloat16)
    grads = grad_sequence(3, torch.bfloat16)
    tx = gtx.adam(1e-2, mu_dtype=torch.float32)
    out, state = gradtx_trajectory(tx, params, grads, inplace=True)
    adam_state = state[0]
    assert all(m.dtype == torch.float32 for m in adam_state.mu.values())
    assert all(v.dtype == torch.bfloat16 for v in adam_state.nu.values())
    assert all(p.dtype == torch.bfloat16 for p in out.values())
    reference, _ = gradtx_trajectory(gtx.adam(1e-2), {k: v.double() for k, v in params.items()}, [
        {k: v.double() for k, v in g.items()} for g in grads
    ])
    assert_trees_close({k: v.double() for k, v in out.items()}, reference, rtol=2e-2, atol=2e-2)
    check_pure_and_donated(tx, params, grads)


@pytest.mark.parametrize(
    "make",
    [
        lambda: gtx.scale_by_adam(nesterov=True, eps_root=1e-8),
        lambda: gtx.scale_by_amsgrad(),
        lambda: gtx.scale_by_amsgrad(bias_correction_mu=False, bias_correction_nu=False),
        lambda: gtx.scale_by_belief(nesterov=True),
        lambda: gtx.scale_by_adamax(),
        lambda: gtx.scale_by_radam(nesterov=True),
        lambda: gtx.scale_by_lion(mode="smooth"),
    ],
)
def test_pure_and_donated_paths_agree_and_pure_mutates_nothing(make):
    check_pure_and_donated(make(), tree(0, torch.float32), grad_sequence(7, torch.float32))


def test_count_saturates_instead_of_overflowing():
    tx = gtx.scale_by_adam()
    grads = tree(1)
    state = tx.init(grads)._replace(count=torch.tensor(torch.iinfo(torch.int32).max, dtype=torch.int32))
    _, state = tx.update(grads, state)
    assert int(state.count) == torch.iinfo(torch.int32).max


def test_adam_compiles_once_with_a_schedule():
    torch._dynamo.reset()
    tx = gtx.adamw(gtx.cosine_decay_schedule(1e-2, 10), weight_decay=1e-2)
    params = tree(0, torch.float32)
    counter = {"n": 0}

    def backend(gm, example_inputs):
        counter["n"] += 1
        return gm.forward

    @torch.compile(backend=backend, fullgraph=True)
    def step(grads, state, params):
        return tx.update(grads, state, params)

    state = tx.init(params)
    for g in grad_sequence(4, torch.float32):
        updates, state = step(g, state, params)
        params = gtx.apply_updates(params, updates)
    assert counter["n"] == 1
    expected, _ = gradtx_trajectory(tx, tree(0, torch.float32), grad_sequence(4, torch.float32))
    assert_trees_close(params, expected, rtol=1e-6, atol=1e-7)


def test_bad_hyperparameters_and_state_are_named():
    with pytest.raises(ValueError, match="b1"):
        gtx.scale_by_adam(b1=1.5)
    tx = gtx.scale_by_adam()
    params = tree(0)
    state = tx.init(params)
    bad = state._replace(mu={**state.mu, "layer.bias": None})
    with pytest.raises(TypeError, match="layer.bias"):
        tx.update(tree(1), bad)
    with pytest.raises(TypeError, match="scale"):
        tx.update({**tree(1), "scale": 3.0}, state)


@pytest.mark.parametrize(
    "make", [lambda: gtx.adamw(1e-2, weight_decay=0.1), lambda: gtx.adamax(1e-2), lambda: gtx.radam(1e-2), lambda: gtx.amsgrad(1e-2)]
)
def test_runs_under_vmap_over_a_batch_of_models(make):
    tx, batch = make(), 3
    params = {k: torch.stack([tree(i)[k] for i in range(batch)]) for k in SHAPES}
    grads = [{k: torch.stack([g[k] * (i + 1) for i in range(batch)]) for k, _ in SHAPES.items()} for g in grad_sequence(6)]
    states = torch.func.vmap(tx.init)(params)
    batched = params
    for g in grads:
        updates, states = torch.func.vmap(lambda u, s, p: tx.update(u, s, p))(g, states, batched)
        batched = gtx.apply_updates(batched, updates)
    for i in range(batch):
        single, _ = gradtx_trajectory(tx, tree(i), [{k: v[i] for k, v in g.items()} for g in grads])
        assert_trees_close({k: v[i] for k, v in batched.items()}, single, rtol=1e-10, atol=1e-12)
