"""apply_every, conditionally_transform, conditionally_mask, flatten and lookahead against their
definitions (optax's), with optax's state fields; pure/donated agreement and torch.compile."""

from __future__ import annotations

import pytest
import torch

import gradtx as gtx
from catalogue_helpers import compiled_matches_eager
from optimizer_helpers import assert_trees_close, check_pure_and_donated, clone_tree, grad_sequence, tree


def _run(tx, grads, params=None, *, inplace=False):
    params = tree(0) if params is None else params
    state = tx.init(params)
    outs = []
    for g in grads:
        u, state = tx.update(clone_tree(g), state, params, inplace=inplace)
        outs.append(u)
    return outs, state


# --------------------------------------------------------------------------- apply_every


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("inplace", [False, True])
def test_apply_every_emits_sums(k, inplace):
    grads = grad_sequence(7)
    outs, state = _run(gtx.apply_every(k), grads, inplace=inplace)
    total = {key: torch.zeros_like(v) for key, v in grads[0].items()}
    for step, (g, u) in enumerate(zip(grads, outs)):
        total = {key: total[key] + g[key] for key in g}
        if step % k == k - 1:
            assert_trees_close(u, total, rtol=1e-14, atol=1e-15)
            total = {key: torch.zeros_like(v) for key, v in g.items()}
        else:
            assert all(torch.count_nonzero(v) == 0 for v in u.values())
    assert type(state)._fields == ("count", "grad_acc") and int(state.count) == 7 % k


def test_apply_every_checks_and_compiles():
    with pytest.raises(ValueError, match="k"):
        gtx.apply_every(0)
    check_pure_and_donated(gtx.apply_every(2), tree(0), grad_sequence(5))
    compiled_matches_eager(gtx.apply_every(2), steps=4)


# --------------------------------------------------------------------------- conditionally_*


def _every_other(step):
    return step % 2 == 0


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("inplace", [False, True])
def test_conditionally_applies_inner_on_chosen_steps(masked, inplace):
    combinator = gtx.conditionally_mask if masked else gtx.conditionally_transform
    grads = grad_sequence(5)
    outs, state = _run(combinator(gtx.scale_by_adam(), _every_other), grads, inplace=inplace)
    # the reference: Adam run on the chosen steps only, its state untouched by the others
    adam = gtx.scale_by_adam()
    adam_state = adam.init(tree(0))
    for step, (g, u) in enumerate(zip(grads, outs)):
        if step % 2 == 0:
            expected, adam_state = adam.update(g, adam_state)
        else:
            expected = {k: torch.zeros_like(v) for k, v in g.items()} if masked else g
        assert_trees_close(u, expected, rtol=1e-12, atol=1e-14)
    assert_trees_close(state.inner_state, adam_state, rtol=1e-12, atol=1e-14)
    assert int(state.step) == 5
    fields = ("step", "inner_state") if masked else ("inner_state", "step")
    assert type(state)._fields == fields


@pytest.mark.parametrize("combinator", [gtx.conditionally_mask, gtx.conditionally_transform])
def test_conditionally_with_a_python_condition_and_compiled(combinator):
    never = combinator(gtx.scale(3.0), lambda step: False)
    g = grad_sequence(1)[0]
    u, _ = never.update(g, never.init(tree(0)))
    expected = {k: torch.zeros_like(v) for k, v in g.items()} if combinator is gtx.conditionally_mask else g
    assert_trees_close(u, expected, rtol=0, atol=0)
    always = combinator(gtx.scale(3.0), lambda step: True)
    u, _ = always.update(g, always.init(tree(0)))
    assert_trees_close(u, {k: 3.0 * v for k, v in g.items()}, rtol=1e-15)
    check_pure_and_donated(combinator(gtx.scale_by_adam(), _every_other), tree(0), grad_sequence(4))
    compiled_matches_eager(combinator(gtx.scale_by_adam(), _every_other), steps=3)


def test_conditionally_forwards_extra_arguments_to_the_condition_only_when_asked():
    seen, inner_seen = [], []

    def condition(step, **extra):
        seen.append(extra)
        return True

    def inner_update(updates, state, params=None, *, inplace=False, **extra):
        inner_seen.append(extra)
        return updates, state

    inner = gtx.GradientTransformation(gtx.init_empty_state, inner_update)
    for forward in (False, True):
        tx = gtx.conditionally_transform(inner, condition, forward_extra_args=forward)
        tx.update(grad_sequence(1)[0], tx.init(tree(0)), value=3.0)
    assert seen == [{}, {"value": 3.0}]
    assert inner_seen == [{"value": 3.0}, {"value": 3.0}]


# --------------------------------------------------------------------------- flatten


@pytest.mark.parametrize("inplace", [False, True])
def test_flatten_equals_elementwise_inner(inplace):
    grads = grad_sequence(4)
    flat_outs, flat_state = _run(gtx.flatten(gtx.scale_by_adam(b1=0.5)), grads, inplace=inplace)
    outs, state = _run(gtx.scale_by_adam(b1=0.5), grads)
    for a, b in zip(flat_outs, outs):
        assert_trees_close(a, b, rtol=1e-14, atol=1e-15)
    assert flat_state.mu.shape == (sum(v.numel() for v in tree(0).values()),)
    assert type(flat_state) is gtx.ScaleByAdamState


def test_flatten_passes_flat_params_and_keeps_none():
    params = tree(0)
    tx = gtx.flatten(gtx.add_decayed_weights(0.5))
    g = dict(grad_sequence(1)[0])
    u, _ = tx.update(g, tx.init(params), params)
    assert_trees_close(u, {k: g[k] + 0.5 * params[k] for k in g}, rtol=1e-15)
    check_pure_and_donated(gtx.flatten(gtx.scale_by_adam()), params, grad_sequence(3))


# --------------------------------------------------------------------------- lookahead


def _lookahead_reference(params, grads, lr, sync_period, alpha):
    fast, slow = dict(params), dict(params)
    for step, g in enumerate(grads):
        fast = {k: fast[k] - lr * g[k] for k in g}
        if step % sync_period == sync_period - 1:
            slow = {k: slow[k] + alpha * (fast[k] - slow[k]) for k in g}
            fast = dict(slow)
    return fast, slow


@pytest.mark.parametrize("inplace", [False, True])
def test_lookahead_matches_definition(inplace):
    params, grads = tree(0), grad_sequence(7)
    tx = gtx.lookahead(gtx.sgd(0.1), sync_period=3, slow_step_size=0.5)
    lp = gtx.LookaheadParams.init_synced(params)
    state = tx.init(lp)
    assert type(state)._fields == ("fast_state", "steps_since_sync")
    assert gtx.LookaheadParams._fields == ("fast", "slow")
    for g in grads:
        updates, state = tx.update(clone_tree(g), state, lp, inplace=inplace)
        assert isinstance(updates, gtx.LookaheadParams)
        lp = gtx.apply_updates(lp, updates)
    fast, slow = _lookahead_reference(params, grads, 0.1, 3, 0.5)
    assert_trees_close(lp.fast, fast, rtol=1e-12, atol=1e-14)
    assert_trees_close(lp.slow, slow, rtol=1e-12, atol=1e-14)
    assert int(state.steps_since_sync) == 7 % 3


def test_lookahead_reset_state_and_errors():
    params, grads = tree(0), grad_sequence(4)
    tx = gtx.lookahead(gtx.sgd(0.1, momentum=0.9), sync_period=2, slow_step_size=0.5, reset_state=True)
    lp = gtx.LookaheadParams.init_synced(params)
    state = tx.init(lp)
    for step, g in enumerate(grads):
        updates, state = tx.update(g, state, lp)
        lp = gtx.apply_updates(lp, updates)
        trace = state.fast_state[0].trace
        if step % 2 == 1:  # just synchronised: the momentum starts again from zero
            assert all(torch.count_nonzero(v) == 0 for v in trace.values())
        else:
            assert any(torch.count_nonzero(v) > 0 for v in trace.values())
    with pytest.raises(ValueError, match="sync_period"):
        gtx.lookahead(gtx.sgd(0.1), sync_period=0, slow_step_size=0.5)
    with pytest.raises(ValueError, match="LookaheadParams"):
        tx.update(grads[0], state, params)


# --------------------------------------------------------------------------- inject_stateful_hyperparams


def test_inject_stateful_hyperparams_is_the_deprecated_inject_hyperparams():
    with pytest.warns(DeprecationWarning, match="inject_hyperparams"):
        factory = gtx.inject_stateful_hyperparams(gtx.sgd, static_args="nesterov")
    tx = factory(learning_rate=gtx.linear_schedule(0.1, 0.01, 2), momentum=0.9)
    reference = gtx.inject_hyperparams(gtx.sgd, static_args="nesterov")(learning_rate=gtx.linear_schedule(0.1, 0.01, 2), momentum=0.9)
    ours, state = _run(tx, grad_sequence(3))
    theirs, reference_state = _run(reference, grad_sequence(3))
    for a, b in zip(ours, theirs):
        assert_trees_close(a, b, rtol=0, atol=0)
    assert type(state) is type(reference_state)
    assert_trees_close(state.hyperparams, reference_state.hyperparams, rtol=0, atol=0)
