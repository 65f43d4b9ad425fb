"""The optimizer aliases: optax's state layouts, both paths, None leaves, LAMB/LARS/Lion formulas."""

import pytest
import torch

import gradtx as gtx
from optimizer_helpers import assert_trees_close, check_pure_and_donated, grad_sequence, tree

E = gtx.EmptyState

ALIASES = {
    "sgd": (lambda: gtx.sgd(0.1), (E, E)),
    "sgd_momentum": (lambda: gtx.sgd(0.1, momentum=0.9, nesterov=True), (gtx.TraceState, E)),
    "adam": (lambda: gtx.adam(1e-2), (gtx.ScaleByAdamState, E)),
    "adam_schedule": (lambda: gtx.adam(gtx.linear_schedule(1e-2, 0.0, 5)), (gtx.ScaleByAdamState, gtx.ScaleByScheduleState)),
    "adamw": (lambda: gtx.adamw(1e-2, weight_decay=0.1), (gtx.ScaleByAdamState, E, E)),
    "adamw_mask": (
        lambda: gtx.adamw(1e-2, weight_decay=lambda c: 0.1, mask={"layer": True, "scale": False, "frozen": True}),
        (gtx.ScaleByAdamState, gtx.WeightDecaySchedule, E),
    ),
    "nadam": (lambda: gtx.nadam(1e-2), (gtx.ScaleByAdamState, E)),
    "nadamw": (lambda: gtx.nadamw(1e-2), (gtx.ScaleByAdamState, E, E)),
    "amsgrad": (lambda: gtx.amsgrad(1e-2), (gtx.ScaleByAmsgradState, E)),
    "adamax": (lambda: gtx.adamax(1e-2), (gtx.ScaleByAdamState, E)),
    "radam": (lambda: gtx.radam(1e-2), (gtx.ScaleByAdamState, E)),
    "adabelief": (lambda: gtx.adabelief(1e-2), (gtx.ScaleByBeliefState, E)),
    "lamb": (lambda: gtx.lamb(1e-2, weight_decay=0.1), (gtx.ScaleByAdamState, E, E, E)),
    "lars": (lambda: gtx.lars(0.1, weight_decay=0.1), (E, gtx.MaskedState, E, gtx.TraceState)),
    "lion": (lambda: gtx.lion(1e-3), (gtx.ScaleByLionState, E, E)),
    "rmsprop": (lambda: gtx.rmsprop(1e-2), (gtx.ScaleByRmsState, E, E)),
    "rmsprop_centered": (lambda: gtx.rmsprop(1e-2, centered=True, momentum=0.9), (gtx.ScaleByRStdDevState, E, gtx.TraceState)),
    "rmsprop_corrected": (lambda: gtx.rmsprop(1e-2, bias_correction=True), (gtx.ScaleByRmsWithCountState, E, E)),
    "adagrad": (lambda: gtx.adagrad(0.1), (gtx.ScaleByRssState, E)),
    "noisy_sgd": (lambda: gtx.noisy_sgd(0.1, key=0), (gtx.AddNoiseState, E)),
}


def _params():
    return {"layer": tree(0, torch.float32), "scale": torch.tensor(0.5), "frozen": torch.ones(3)}


def _grads(steps):
    """Gradients with a ``None`` leaf: the frozen parameter gets no gradient."""
    return [{"layer": g, "scale": g["scale"] * 0.1, "frozen": None} for g in grad_sequence(steps, torch.float32)]


@pytest.mark.parametrize("name", sorted(ALIASES))
def test_state_has_optax_layout(name):
    make, layout = ALIASES[name]
    state = make().init(_params())
    assert isinstance(state, tuple) and tuple(type(s) for s in state) == layout


@pytest.mark.parametrize("name", sorted(ALIASES))
def test_pure_and_donated_agree_and_none_leaves_pass_through(name):
    make, _ = ALIASES[name]
    tx = make()
    params, grads = _params(), _grads(4)
    check_pure_and_donated(tx, params, grads)
    updates, state = tx.update(grads[0], tx.init(params), params)
    assert updates["frozen"] is None
    assert all(torch.isfinite(u).all() for u in gtx.tree.leaves(updates) if u is not None)
    # The frozen leaf's state (where it has one) is left exactly as initialised.
    fresh = tx.init(params)
    for path, before, after in zip(gtx.tree.paths(fresh), gtx.tree.leaves(fresh), gtx.tree.leaves(state)):
        if path.endswith("frozen"):
            assert torch.equal(before, after), path


def test_alias_nests_its_state_in_an_enclosing_chain_as_optax_does():
    params = _params()
    tx = gtx.chain(gtx.clip_by_global_norm(1.0), gtx.adamw(1e-3, weight_decay=0.01))
    state = tx.init(params)
    assert len(state) == 2 and isinstance(state[0], gtx.ClipByGlobalNormState)
    assert isinstance(state[1], tuple) and isinstance(state[1][0], gtx.ScaleByAdamState)
    check_pure_and_donated(tx, params, _grads(3))


def _trust(u, p, coef=1.0, eps=0.0):
    pn, un = torch.linalg.vector_norm(p), torch.linalg.vector_norm(u)
    return u if pn == 0 or un == 0 else u * (coef * pn / (un + eps))


def test_lamb_matches_its_formula():
    params, grads = tree(0), grad_sequence(5)
    lr, wd, b1, b2, eps = 1e-2, 0.1, 0.9, 0.999, 1e-6
    tx = gtx.lamb(lr, weight_decay=wd)
    state, p_ours = tx.init(params), dict(params)
    p_ref = dict(params)
    mu = {k: torch.zeros_like(v) for k, v in params.items()}
    nu = dict(mu)
    for t, g in enumerate(grads, start=1):
        updates, state = tx.update(g, state, p_ours)
        p_ours = gtx.apply_updates(p_ours, updates)
        for k in g:
            mu[k] = b1 * mu[k] + (1 - b1) * g[k]
            nu[k] = b2 * nu[k] + (1 - b2) * g[k] ** 2
            direction = mu[k] / (1 - b1**t) / (torch.sqrt(nu[k] / (1 - b2**t)) + eps) + wd * p_ref[k]
            p_ref[k] = p_ref[k] - lr * _trust(direction, p_ref[k])
    assert_trees_close(p_ours, p_ref, rtol=1e-10, atol=1e-12)


def test_lars_matches_its_formula():
    params, grads = tree(0), grad_sequence(5)
    lr, wd, coef, eps, momentum = 0.5, 0.01, 0.02, 1e-3, 0.9
    tx = gtx.lars(lr, weight_decay=wd, trust_coefficient=coef, eps=eps, momentum=momentum)
    state, p_ours, p_ref = tx.init(params), dict(params), dict(params)
    velocity = {k: torch.zeros_like(v) for k, v in params.items()}
    for g in grads:
        updates, state = tx.update(g, state, p_ours)
        p_ours = gtx.apply_updates(p_ours, updates)
        for k in g:
            step = -lr * _trust(g[k] + wd * p_ref[k], p_ref[k], coef, eps)
            velocity[k] = step + momentum * velocity[k]
            p_ref[k] = p_ref[k] + velocity[k]
    assert_trees_close(p_ours, p_ref, rtol=1e-10, atol=1e-12)


def test_lars_trust_ratio_mask():
    params, grads = tree(0), grad_sequence(1)
    mask = {"layer.weight": True, "layer.bias": False, "scale": False}
    tx = gtx.lars(1.0, trust_coefficient=0.5, trust_ratio_mask=mask, momentum=0.0)
    updates, _ = tx.update(grads[0], tx.init(params), params)
    torch.testing.assert_close(updates["layer.bias"], -grads[0]["layer.bias"])
    torch.testing.assert_close(updates["layer.weight"], -_trust(grads[0]["layer.weight"], params["layer.weight"], 0.5))


def test_lion_alias_matches_its_formula():
    params, grads = tree(0), grad_sequence(4)
    lr, wd, b1, b2 = 1e-2, 0.1, 0.9, 0.99
    tx = gtx.lion(lr, weight_decay=wd)
    state, p_ours, p_ref = tx.init(params), dict(params), dict(params)
    mu = {k: torch.zeros_like(v) for k, v in params.items()}
    for g in grads:
        updates, state = tx.update(g, state, p_ours)
        p_ours = gtx.apply_updates(p_ours, updates)
        for k in g:
            direction = torch.sign((1 - b1) * g[k] + b1 * mu[k]) + wd * p_ref[k]
            mu[k] = (1 - b2) * g[k] + b2 * mu[k]
            p_ref[k] = p_ref[k] - lr * direction
    assert_trees_close(p_ours, p_ref, rtol=1e-12, atol=1e-14)


def test_argument_names_and_defaults_follow_optax():
    import inspect

    expected = {
        gtx.adamw: "(learning_rate, b1=0.9, b2=0.999, eps=1e-08, eps_root=0.0, mu_dtype=None, weight_decay=0.0001, mask=None, *, nesterov=False)",
        gtx.sgd: "(learning_rate, momentum=None, nesterov=False, accumulator_dtype=None)",
        gtx.scale_by_adam: "(b1=0.9, b2=0.999, eps=1e-08, eps_root=0.0, mu_dtype=None, *, nesterov=False)",
        gtx.adagrad: "(learning_rate, initial_accumulator_value=0.1, eps=1e-07)",
        gtx.lion: "(learning_rate, b1=0.9, b2=0.99, mu_dtype=None, weight_decay=0.001, mask=None)",
        gtx.adabelief: "(learning_rate, b1=0.9, b2=0.999, eps=1e-16, eps_root=1e-16, *, nesterov=False)",
    }
    for fn, signature in expected.items():
        params = inspect.signature(fn).parameters.values()
        text = "(" + ", ".join(
            ("*, " if p.kind is p.KEYWORD_ONLY and i == first_kw else "")
            + (p.name if p.default is p.empty else f"{p.name}={p.default!r}")
            for i, p in enumerate(params)
            for first_kw in [next((j for j, q in enumerate(params) if q.kind is q.KEYWORD_ONLY), -1)]
        ) + ")"
        assert text == signature, fn.__name__
    rms = inspect.signature(gtx.rmsprop).parameters
    assert [(n, rms[n].default) for n in ["decay", "eps", "initial_scale", "eps_in_sqrt", "centered", "momentum", "nesterov"]] == [
        ("decay", 0.9), ("eps", 1e-8), ("initial_scale", 0.0), ("eps_in_sqrt", True), ("centered", False), ("momentum", None), ("nesterov", False)
    ]


def test_lamb_and_lars_hand_their_spec_to_the_sharded_leaf_norms():
    params, grads = tree(0), grad_sequence(1)[0]
    for tx in (gtx.lamb(1e-3, spec="tp"), gtx.lars(1e-3, spec="tp"), gtx.scale_by_trust_ratio(spec="tp")):
        with pytest.raises(TypeError, match="leaf_norms: spec must be a gradtx.sharding.ShardingSpec"):
            tx.update(grads, tx.init(params), params)


def test_injected_tensor_hyperparameters_are_used_without_host_reads_or_recompiles():
    torch._dynamo.reset()
    params, grads = tree(0, torch.float32), grad_sequence(4, torch.float32)
    tx = gtx.inject_hyperparams(gtx.adamw)(learning_rate=1e-2, weight_decay=0.1)
    frames = {"n": 0}

    def backend(gm, example_inputs):
        frames["n"] += 1
        return gm.forward

    step = torch.compile(lambda g, s, p: tx.update(g, s, p), backend=backend, fullgraph=True)
    state, p_ours, p_ref = tx.init(params), dict(params), dict(params)
    reference_state = None
    for i, g in enumerate(grads):
        lr = 1e-2 / (i + 1)
        state.hyperparams["learning_rate"].fill_(lr)
        updates, state = step(g, state, p_ours)
        p_ours = gtx.apply_updates(p_ours, updates)
        eager = gtx.adamw(lr, weight_decay=0.1)
        reference_state = eager.init(params) if reference_state is None else reference_state
        ref_updates, reference_state = eager.update(g, reference_state, p_ref)
        p_ref = gtx.apply_updates(p_ref, ref_updates)
    assert frames["n"] == 1
    assert_trees_close(p_ours, p_ref, rtol=1e-6, atol=1e-7)
