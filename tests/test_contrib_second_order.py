"""gradtx.contrib's Sophia and Hutchinson's Hessian-diagonal estimator.

The references are float64 re-implementations of optax.contrib's definitions with the Hessian
written out by hand (no torch.func): the probes are the documented stream (a ``torch.Generator``
seeded as given, one Rademacher tensor per leaf in flattening order, ``randint(0, 2) * 2 - 1``).
"""

from __future__ import annotations

import io

import pytest
import torch

import gradtx as gtx
from gradtx.contrib import HutchinsonState, SophiaState, hutchinson_estimator_diag_hessian, sophia
from gradtx.contrib.second_order import scale_by_sophia
from optimizer_helpers import assert_trees_close, assert_trees_equal, clone_tree

DTYPE = torch.float64
SHAPES = {"a": (3, 2), "b": (4,), "c": ()}  # sorted keys: flattening order is a, b, c
SIZE = 11


def _problem(seed=0):
    gen = torch.Generator().manual_seed(seed)
    m = torch.randn(SIZE, SIZE, generator=gen, dtype=DTYPE)
    q = m @ m.T / SIZE + 0.5 * torch.eye(SIZE, dtype=DTYPE)
    c = torch.randn(SIZE, generator=gen, dtype=DTYPE)
    params = {k: torch.randn(s, generator=gen, dtype=DTYPE) for k, s in SHAPES.items()}
    return q, c, params


Q, C, PARAMS = _problem()


def flat(params):
    return torch.cat([params[k].reshape(-1) for k in sorted(params)])


def unflat(x):
    out, offset = {}, 0
    for k in sorted(SHAPES):
        n = int(torch.Size(SHAPES[k]).numel())
        out[k] = x[offset : offset + n].reshape(SHAPES[k])
        offset += n
    return out


def objective(params):
    """``0.5 x'Qx + c'x + 0.25 sum x^4``: coupled leaves, so Hutchinson's estimate is random."""
    x = flat(params)
    return 0.5 * x @ Q @ x + C @ x + 0.25 * (x**4).sum()


def gradient(params):
    x = flat(params)
    return unflat(Q @ x + C + x**3)


def hessian(params):
    x = flat(params)
    return Q + torch.diag(3 * x**2)


def probes(generator):
    return unflat(torch.cat([
        (torch.randint(0, 2, SHAPES[k], generator=generator, dtype=torch.int8).to(torch.float32) * 2 - 1)
        .to(DTYPE).reshape(-1)
        for k in sorted(SHAPES)
    ]))


def reference_hutchinson(params, generator):
    z = flat(probes(generator))
    return unflat(z * (hessian(params) @ z))


def reference_sophia(params, steps, *, lr, b1, b2, eps, weight_decay, mask, gamma, clip, interval, seed):
    """optax.contrib.sophia step by step: momentum, bias correction, division by max(gamma nu, eps),
    clipping, the Hessian's EMA on the steps whose previous count is a multiple of the interval,
    then decoupled weight decay and the learning rate."""
    generator = torch.Generator().manual_seed(seed)
    p = {k: v.clone() for k, v in params.items()}
    mu = {k: torch.zeros_like(v) for k, v in p.items()}
    nu = {k: torch.zeros_like(v) for k, v in p.items()}
    for t in range(1, steps + 1):
        g = gradient(p)
        mu = {k: b1 * mu[k] + (1 - b1) * g[k] for k in p}
        u = {k: (mu[k] / (1 - b1**t)) / torch.clamp(gamma * nu[k], min=eps) for k in p}
        if clip is not None:
            u = {k: v.clamp(-clip, clip) for k, v in u.items()}
        if (t - 1) % interval == 0:
            h = reference_hutchinson(p, generator)
            nu = {k: b2 * nu[k] + (1 - b2) * h[k] for k in p}
        u = {k: u[k] + (weight_decay * p[k] if mask[k] else 0.0) for k in p}
        p = {k: p[k] - lr * u[k] for k in p}
    return p


def run(tx, params, steps, *, inplace=False, key="obj_fn"):
    p = {k: v.clone() for k, v in params.items()}
    state = tx.init(p)
    for _ in range(steps):
        g = torch.func.grad(objective)(p)
        updates, state = tx.update(g, state, p, inplace=inplace, **{key: objective})
        p = gtx.apply_updates(p, updates)
    return p, state


def test_hutchinson_is_exact_on_a_separable_objective():
    def separable(p):
        return sum((torch.arange(1.0, v.numel() + 1, dtype=DTYPE).reshape(v.shape) * v**4).sum() for v in p.values())

    tx = hutchinson_estimator_diag_hessian(random_seed=5)
    diag, state = tx.update(None, tx.init(PARAMS), PARAMS, obj_fn=separable)
    for k, v in PARAMS.items():
        weights = torch.arange(1.0, v.numel() + 1, dtype=DTYPE).reshape(v.shape)
        torch.testing.assert_close(diag[k], 12 * weights * v**2, rtol=1e-12, atol=0)
    assert isinstance(state, HutchinsonState) and state.key.dtype == torch.uint8


def test_hutchinson_matches_the_documented_probes_and_advances_the_key():
    tx = hutchinson_estimator_diag_hessian(random_seed=7)
    state = tx.init(PARAMS)
    generator = torch.Generator().manual_seed(7)
    p = PARAMS
    for step in range(4):
        diag, state = tx.update(None, state, p, obj_fn=objective)
        assert_trees_close(diag, reference_hutchinson(p, generator), rtol=1e-12, atol=1e-12, msg=f"step {step}")
        p = {k: v + 0.1 for k, v in p.items()}


def test_hutchinson_is_unbiased():
    tx = hutchinson_estimator_diag_hessian(random_seed=0)
    state = tx.init(PARAMS)
    total = torch.zeros(SIZE, dtype=DTYPE)
    draws = 100
    for _ in range(draws):
        diag, state = tx.update(None, state, PARAMS, obj_fn=objective)
        total += flat(diag)
    h = hessian(PARAMS)
    # z_i (Hz)_i = H_ii + sum_{j != i} z_i z_j H_ij: the noise's variance is the off-diagonal row's square sum
    std = torch.sqrt(((h**2).sum(1) - torch.diag(h) ** 2) / draws)
    assert ((total / draws - torch.diag(h)).abs() < 5 * std + 1e-12).all()


def test_hutchinson_seed_and_generator_are_reproducible():
    a = hutchinson_estimator_diag_hessian(random_seed=3)
    b = hutchinson_estimator_diag_hessian(random_seed=torch.Generator().manual_seed(3))
    c = hutchinson_estimator_diag_hessian(random_seed=4)
    da, _ = a.update(None, a.init(PARAMS), PARAMS, obj_fn=objective)
    db, _ = b.update(None, b.init(PARAMS), PARAMS, obj_fn=objective)
    dc, _ = c.update(None, c.init(PARAMS), PARAMS, obj_fn=objective)
    assert_trees_equal(da, db)
    assert any(not torch.equal(da[k], dc[k]) for k in da)


def test_hutchinson_value_fn_receives_its_own_extra_arguments():
    def value_fn(params, scale):
        return scale * objective(params)

    tx = hutchinson_estimator_diag_hessian(random_seed=1)
    by_value_fn, _ = tx.update(None, tx.init(PARAMS), PARAMS, value_fn=value_fn, scale=2.0, value=1.0, grad=None)
    by_obj_fn, _ = tx.update(None, tx.init(PARAMS), PARAMS, obj_fn=objective)
    assert_trees_close(by_value_fn, {k: 2 * v for k, v in by_obj_fn.items()}, rtol=1e-12)


def test_hutchinson_errors():
    tx = hutchinson_estimator_diag_hessian()
    with pytest.raises(ValueError, match="params"):
        tx.update(None, tx.init(PARAMS), None, obj_fn=objective)
    with pytest.raises(ValueError, match="obj_fn"):
        tx.update(None, tx.init(PARAMS), PARAMS)


SOPHIA_CASES = {
    # clipping active on the first steps (nu = 0), then some elements inside the threshold
    "default_clip": dict(lr=0.05, b1=0.9, b2=0.8, eps=1e-8, weight_decay=1e-2, gamma=0.5, clip=1.0, interval=2),
    "no_clip": dict(lr=0.01, b1=0.965, b2=0.5, eps=1e-3, weight_decay=0.0, gamma=2.0, clip=None, interval=1),
    # gamma * nu stays below the momentum: every update is clipped (a sign-like step)
    "all_clipped": dict(lr=0.02, b1=0.5, b2=0.9, eps=1e-8, weight_decay=0.1, gamma=0.01, clip=0.5, interval=3),
}


@pytest.mark.parametrize("name", sorted(SOPHIA_CASES))
@pytest.mark.parametrize("inplace", [False, True], ids=["pure", "donated"])
def test_sophia_matches_the_reference(name, inplace):
    hp = SOPHIA_CASES[name]
    mask = {"a": True, "b": False, "c": True}
    tx = sophia(
        hp["lr"], b1=hp["b1"], b2=hp["b2"], eps=hp["eps"], weight_decay=hp["weight_decay"], weight_decay_mask=mask,
        gamma=hp["gamma"], clip_threshold=hp["clip"], update_interval=hp["interval"],
        hessian_diagonal_fn=hutchinson_estimator_diag_hessian(random_seed=11),
    )
    assert isinstance(tx, gtx.GradientTransformationExtraArgs)
    got, _ = run(tx, PARAMS, 7, inplace=inplace)
    expected = reference_sophia(PARAMS, 7, mask=mask, seed=11, **hp)
    assert_trees_close(got, expected, rtol=1e-9, atol=1e-12)
    moved = max(float((got[k] - PARAMS[k]).abs().max()) for k in got)
    assert moved > 1e-2


def test_sophia_clips_and_reads_the_hessian_only_on_its_interval():
    calls = []
    inner = hutchinson_estimator_diag_hessian(random_seed=0)

    def counting_update(updates, state, params=None, **extra):
        calls.append(1)
        return inner.update(updates, state, params, **extra)

    tx = scale_by_sophia(update_interval=3, hessian_diagonal_fn=gtx.GradientTransformationExtraArgs(inner.init, counting_update))
    state = tx.init(PARAMS)
    for step in range(7):
        updates, state = tx.update(gradient(PARAMS), state, PARAMS, obj_fn=objective)
        assert max(float(u.abs().max()) for u in updates.values()) <= 1.0
    assert len(calls) == 3  # counts 0, 3 and 6
    assert isinstance(state, SophiaState) and int(state.count) == 7


def test_sophia_pure_equals_donated_and_mutates_nothing():
    tx = sophia(0.05, update_interval=2, gamma=0.5, mu_dtype=torch.float32)
    pure_state, donated_state = tx.init(PARAMS), tx.init(PARAMS)
    p = clone_tree(PARAMS)
    for step in range(5):
        g = gradient(p)
        before = (clone_tree(g), clone_tree(pure_state), clone_tree(p))
        pure_updates, new_state = tx.update(g, pure_state, p, obj_fn=objective)
        assert_trees_equal((g, pure_state, p), before, f"step {step}: the pure update mutated its inputs")
        donated_updates, donated_state = tx.update(clone_tree(g), donated_state, p, inplace=True, obj_fn=objective)
        assert_trees_equal(donated_updates, pure_updates, f"step {step}")
        assert_trees_equal(donated_state, new_state, f"step {step}")
        assert new_state[0].mu["a"].dtype == torch.float32
        pure_state, p = new_state, gtx.apply_updates(p, pure_updates)


def test_sophia_state_round_trips_through_torch_save():
    tx = sophia(0.05, update_interval=1)
    p = clone_tree(PARAMS)
    state = tx.init(p)
    for _ in range(2):
        updates, state = tx.update(gradient(p), state, p, obj_fn=objective)
        p = gtx.apply_updates(p, updates)
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    a, _ = tx.update(gradient(p), state, p, obj_fn=objective)
    b, _ = tx.update(gradient(p), loaded, p, obj_fn=objective)
    assert_trees_equal(a, b)


def test_sophia_takes_the_objective_through_a_chain():
    tx = gtx.chain(gtx.scale(1.0), sophia(0.05, update_interval=1))  # a plain member does not see value_fn
    got, _ = run(tx, PARAMS, 3, key="value_fn")
    expected = reference_sophia(
        PARAMS, 3, lr=0.05, b1=0.965, b2=0.99, eps=1e-8, weight_decay=1e-4, mask={k: True for k in SHAPES},
        gamma=0.01, clip=1.0, interval=1, seed=0,
    )
    assert_trees_close(got, expected, rtol=1e-9, atol=1e-12)


def test_sophia_win_rate_is_printed(capsys):
    tx = sophia(0.05, update_interval=1, verbose=True, print_win_rate_every_n_steps=2)
    run(tx, PARAMS, 4)
    lines = [line for line in capsys.readouterr().out.splitlines() if "win rate" in line]
    assert len(lines) == 2


def test_sophia_needs_params_and_the_objective():
    tx = sophia(0.1)
    with pytest.raises(ValueError, match="params"):
        tx.update(gradient(PARAMS), tx.init(PARAMS), None, obj_fn=objective)
    with pytest.raises(ValueError, match="obj_fn"):
        tx.update(gradient(PARAMS), tx.init(PARAMS), PARAMS)


def test_hutchinson_pure_equals_donated_and_mutates_nothing():
    tx = hutchinson_estimator_diag_hessian(random_seed=9)
    pure_state, donated_state = tx.init(PARAMS), tx.init(PARAMS)
    for step in range(3):
        before = (clone_tree(pure_state), clone_tree(PARAMS))
        pure, new_state = tx.update(None, pure_state, PARAMS, obj_fn=objective)
        assert_trees_equal((pure_state, PARAMS), before, f"step {step}: the pure update mutated its inputs")
        assert new_state.key.untyped_storage().data_ptr() != pure_state.key.untyped_storage().data_ptr()
        key = donated_state.key
        donated, donated_state = tx.update(None, donated_state, PARAMS, inplace=True, obj_fn=objective)
        assert donated_state.key is key  # the donated generator state is reused
        assert_trees_equal(donated, pure, f"step {step}")
        assert_trees_equal(donated_state, new_state, f"step {step}")
        pure_state = new_state
