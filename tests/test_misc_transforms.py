"""RMSProp, AdaGrad, centralize, zero_nans, set_to_zero, gradient noise and DP-SGD."""

import io
import math

import pytest
import torch

import gradtx as gtx
from optimizer_helpers import (
    assert_trees_close,
    assert_trees_equal,
    check_pure_and_donated,
    grad_sequence,
    gradtx_trajectory,
    torch_trajectory,
    tree,
)

# --------------------------------------------------------------------------- RMSProp / AdaGrad vs torch

RMSPROP_CASES = {
    "plain": (dict(), dict()),
    "centered": (dict(centered=True), dict(centered=True)),
    "momentum": (dict(momentum=0.9), dict(momentum=0.9)),
    "centered_momentum": (dict(centered=True, momentum=0.5), dict(centered=True, momentum=0.5)),
}


@pytest.mark.parametrize("name", sorted(RMSPROP_CASES))
@pytest.mark.parametrize("inplace", [False, True])
def test_rmsprop_with_eps_outside_the_root_matches_torch(name, inplace):
    ours_kw, torch_kw = RMSPROP_CASES[name]
    params, grads = tree(0), grad_sequence(6)
    tx = gtx.rmsprop(1e-2, decay=0.8, eps=1e-3, eps_in_sqrt=False, **ours_kw)
    ours, _ = gradtx_trajectory(tx, params, grads, inplace=inplace)
    theirs = torch_trajectory(lambda ps: torch.optim.RMSprop(ps, lr=1e-2, alpha=0.8, eps=1e-3, **torch_kw), params, grads)
    assert_trees_close(ours, theirs, rtol=1e-10, atol=1e-13)


def test_rmsprop_default_puts_eps_inside_the_root():
    grads = grad_sequence(3)
    tx = gtx.scale_by_rms(decay=0.9, eps=0.1)
    state = tx.init(grads[0])
    nu = {k: torch.zeros_like(v) for k, v in grads[0].items()}
    for g in grads:
        updates, state = tx.update(g, state)
        nu = {k: 0.9 * nu[k] + 0.1 * g[k] ** 2 for k in g}
        assert_trees_close(updates, {k: g[k] / torch.sqrt(nu[k] + 0.1) for k in g}, rtol=1e-12)


@pytest.mark.parametrize("centered", [False, True])
@pytest.mark.parametrize("eps_in_sqrt", [False, True])
def test_rms_bias_correction_matches_its_formula(centered, eps_in_sqrt):
    decay, eps = 0.7, 1e-2
    grads = grad_sequence(4)
    make = gtx.scale_by_stddev if centered else gtx.scale_by_rms
    tx = make(decay=decay, eps=eps, initial_scale=0.3, eps_in_sqrt=eps_in_sqrt, bias_correction=True)
    state = tx.init(grads[0])
    mu = {k: torch.zeros_like(v) for k, v in grads[0].items()}
    nu = {k: torch.full_like(v, 0.3) for k, v in grads[0].items()}
    for t, g in enumerate(grads, start=1):
        updates, state = tx.update(g, state)
        for k in g:
            mu[k] = decay * mu[k] + (1 - decay) * g[k]
            nu[k] = decay * nu[k] + (1 - decay) * g[k] ** 2
            second = nu[k] / (1 - decay**t) - (centered * (mu[k] / (1 - decay**t)) ** 2)
            d = torch.sqrt(second + eps) if eps_in_sqrt else torch.sqrt(second) + eps
            torch.testing.assert_close(updates[k], g[k] / d, rtol=1e-10, atol=1e-13)
    assert int(state.count) == 4
    check_pure_and_donated(tx, tree(0), grads)


@pytest.mark.parametrize("inplace", [False, True])
def test_adagrad_matches_torch_with_the_same_start_and_no_eps(inplace):
    params, grads = tree(0), grad_sequence(6)
    ours, state = gradtx_trajectory(gtx.adagrad(0.1, initial_accumulator_value=0.1, eps=0.0), params, grads, inplace=inplace)
    theirs = torch_trajectory(lambda ps: torch.optim.Adagrad(ps, lr=0.1, initial_accumulator_value=0.1, eps=0.0), params, grads)
    assert_trees_close(ours, theirs, rtol=1e-12, atol=1e-14)
    assert isinstance(state[0], gtx.ScaleByRssState)


def test_scale_by_rss_is_zero_where_nothing_was_accumulated():
    grads = {"a": torch.tensor([0.0, 2.0])}
    for eps in (0.0, 1e-7):
        tx = gtx.scale_by_rss(initial_accumulator_value=0.0, eps=eps)
        updates, _ = tx.update(grads, tx.init(grads))
        assert updates["a"][0] == 0.0 and not updates["a"].isnan().any()
        torch.testing.assert_close(updates["a"][1], 2.0 / torch.sqrt(torch.tensor(4.0 + eps)))


@pytest.mark.parametrize(
    "make",
    [
        lambda: gtx.scale_by_rms(),
        lambda: gtx.scale_by_rms(eps_in_sqrt=False, bias_correction=True),
        lambda: gtx.scale_by_stddev(),
        lambda: gtx.scale_by_rss(),
        lambda: gtx.centralize(),
        lambda: gtx.zero_nans(),
        lambda: gtx.set_to_zero(),
        lambda: gtx.add_noise(0.1, 0.55, key=3),
    ],
)
def test_pure_and_donated_paths_agree_and_pure_mutates_nothing(make):
    check_pure_and_donated(make(), tree(0, torch.float32), grad_sequence(4, torch.float32))


# --------------------------------------------------------------------------- elementwise


def test_centralize_subtracts_the_mean_over_all_but_the_first_dim():
    grads = {"w": torch.arange(6.0).reshape(2, 3), "conv": torch.randn(3, 2, 2, 2), "b": torch.arange(3.0), "none": None}
    tx = gtx.centralize()
    updates, _ = tx.update(grads, tx.init(grads))
    torch.testing.assert_close(updates["w"], torch.tensor([[-1.0, 0.0, 1.0], [-1.0, 0.0, 1.0]]))
    torch.testing.assert_close(updates["conv"].mean(dim=(1, 2, 3)), torch.zeros(3), atol=1e-6, rtol=0)
    assert torch.equal(updates["b"], grads["b"]) and updates["none"] is None


def test_zero_nans_zeroes_nans_keeps_infs_and_records_leaves():
    grads = {"a": torch.tensor([1.0, math.nan, math.inf]), "b": torch.ones(2), "c": None}
    tx = gtx.zero_nans()
    state = tx.init({"a": torch.zeros(3), "b": torch.zeros(2), "c": None})
    assert not state.found_nan["a"] and state.found_nan["c"] is None
    updates, state = tx.update(grads, state)
    assert torch.equal(updates["a"], torch.tensor([1.0, 0.0, math.inf]))
    assert bool(state.found_nan["a"]) and not bool(state.found_nan["b"]) and state.found_nan["c"] is None


def test_set_to_zero():
    grads = {**tree(1), "none": None}
    for inplace in (False, True):
        tx = gtx.set_to_zero()
        updates, _ = tx.update(gtx.tree.tree_map(torch.clone, grads), tx.init(grads), inplace=inplace)
        assert updates["none"] is None
        assert all(torch.equal(updates[k], torch.zeros_like(grads[k])) for k in grads if grads[k] is not None)


# --------------------------------------------------------------------------- noise


def test_add_noise_is_reproducible_saveable_and_annealed():
    eta, gamma = 0.5, 0.55
    shapes = {"big": (20000,), "small": (3,)}
    grads = {k: torch.zeros(s) for k, s in shapes.items()}
    tx = gtx.add_noise(eta, gamma, key=7)
    state = tx.init(grads)
    assert state.rng_key.dtype == torch.uint8
    buffer = io.BytesIO()
    torch.save(state, buffer)
    first, state = tx.update(grads, state)
    second, state = tx.update(grads, state)
    assert not torch.equal(first["big"], second["big"])
    torch.testing.assert_close(first["big"].std(), torch.tensor(math.sqrt(eta)), rtol=0.03, atol=0)
    torch.testing.assert_close(second["big"].std(), torch.tensor(math.sqrt(eta / 2**gamma)), rtol=0.03, atol=0)
    buffer.seek(0)
    restored = torch.load(buffer, weights_only=False)
    again, _ = tx.update(grads, restored)
    assert_trees_equal(again, first, "a restored state draws the same noise")
    other, _ = gtx.add_noise(eta, gamma, key=8).update(grads, gtx.add_noise(eta, gamma, key=8).init(grads))
    assert not torch.equal(other["big"], first["big"])


def test_add_noise_from_a_generator_and_none_leaves():
    gen = torch.Generator().manual_seed(11)
    grads = {"a": torch.ones(4), "b": None}
    tx = gtx.add_noise(1.0, 0.0, key=gen)
    updates, _ = tx.update(grads, tx.init(grads))
    expected = torch.ones(4) + torch.randn(4, generator=torch.Generator().manual_seed(11))
    torch.testing.assert_close(updates["a"], expected)
    assert updates["b"] is None


def test_noisy_sgd():
    grads = {"a": torch.ones(4)}
    tx = gtx.noisy_sgd(0.1, eta=0.0)
    updates, state = tx.update(grads, tx.init(grads))
    torch.testing.assert_close(updates["a"], torch.full((4,), -0.1))
    assert isinstance(state[0], gtx.AddNoiseState)


# --------------------------------------------------------------------------- DP-SGD


def test_dp_aggregate_without_noise_is_the_mean_of_clipped_examples():
    per_example = {"w": torch.tensor([[3.0, 4.0], [0.3, 0.4], [0.0, 0.0]]), "b": torch.tensor([[0.0], [0.0], [1.0]])}
    tx = gtx.differentially_private_aggregate(l2_norm_clip=1.0, noise_multiplier=0.0, key=0)
    updates, _ = tx.update(per_example, tx.init(per_example))
    torch.testing.assert_close(updates["w"], torch.tensor([0.6 + 0.3, 0.8 + 0.4]) / 3)
    torch.testing.assert_close(updates["b"], torch.tensor([1.0]) / 3)


def test_dpsgd_adds_noise_of_the_right_size_and_is_reproducible():
    batch, size = 4, 20000
    per_example = {"w": torch.zeros(batch, size)}
    tx = gtx.dpsgd(learning_rate=1.0, l2_norm_clip=2.0, noise_multiplier=1.5, seed=3, momentum=0.9)
    state = tx.init({"w": torch.zeros(size)})
    updates, new_state = tx.update(per_example, state)
    torch.testing.assert_close(updates["w"].std(), torch.tensor(2.0 * 1.5 / batch), rtol=0.03, atol=0)
    again, _ = tx.update(per_example, state)
    assert torch.equal(again["w"], updates["w"])
    assert isinstance(new_state[1], gtx.TraceState)
