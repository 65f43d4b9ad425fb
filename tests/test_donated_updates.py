"""The pure step's own buffers: a chain donates the fresh updates between its members
(``inplace="updates"``: updates donated, state not), and ``apply_updates(..., donate_updates=True)``
sums into the updates' buffers. Same numbers as the plain paths, and nothing the caller holds is
written."""

from __future__ import annotations

import copy
from typing import NamedTuple

import pytest
import torch

import gradtx as gtx
from gradtx import base
from gradtx import tree as tree_lib


def _tree(seed: int, scale: float = 1.0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(6, 4, generator=gen) * scale,
        "b": torch.randn(4, generator=gen) * scale,
        "frozen": None,
    }


def _leaves(tree) -> list[torch.Tensor]:
    return [x for x in tree_lib.leaves(tree) if isinstance(x, torch.Tensor)]


def _assert_same(a, b) -> None:
    la, lb = tree_lib.leaves(a), tree_lib.leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        assert (x is None and y is None) or torch.equal(x, y)


CHAINS = {
    "clip+adamw": lambda: gtx.chain(gtx.clip_by_global_norm(1.0), gtx.adamw(1e-2, weight_decay=0.1)),
    "clip+nadamw": lambda: gtx.chain(gtx.clip_by_global_norm(1.0), gtx.nadamw(1e-2, weight_decay=0.1)),
    "clip+adam(mu bf16)": lambda: gtx.chain(gtx.clip_by_global_norm(0.5), gtx.adam(1e-2, mu_dtype=torch.bfloat16)),
    "value+adam parts+schedule": lambda: gtx.chain(
        gtx.clip_by_value(0.5),
        gtx.scale_by_adam(eps_root=1e-8),
        gtx.add_decayed_weights(0.1),
        gtx.scale_by_learning_rate(lambda count: 0.1 / (1.0 + count)),
    ),
    "adamw schedules": lambda: gtx.chain(
        gtx.clip_by_global_norm(1.0),
        gtx.adamw(lambda c: 1e-2 / (1.0 + c), weight_decay=lambda c: 0.1 * (1.0 + c)),
    ),
    "trace then scale": lambda: gtx.chain(gtx.trace(0.9), gtx.scale(-0.1)),
    "identity then scale": lambda: gtx.chain(gtx.identity(), gtx.scale(-0.1), gtx.add_decayed_weights(0.1)),
    "named": lambda: gtx.named_chain(("clip", gtx.clip_by_global_norm(1.0)), ("opt", gtx.adamw(1e-2, weight_decay=0.1))),
    # quantized state after a clip: handed "updates", it must not advance the caller's step count
    "clip+quantize_state(adamw, 4)": lambda: gtx.chain(
        gtx.clip_by_global_norm(1.0), gtx.quantize_state(gtx.adamw(1e-2, weight_decay=0.1), 4, min_size=1)
    ),
    "clip+quantize_state(lion, 8)": lambda: gtx.chain(gtx.clip_by_global_norm(1.0), gtx.quantize_state(gtx.lion(1e-3), 8, min_size=1)),
}


def _run(tx, *, mode: str, steps: int = 3):
    params = _tree(0)
    state = tx.init(params)
    for step in range(steps):
        grads = _tree(10 + step, scale=3.0)
        if mode == "inplace":
            updates, state = tx.update(grads, state, params, inplace=True)
            gtx.apply_updates(params, updates, inplace=True)
            continue
        held = copy.deepcopy((grads, state, params))
        pointers = [t.data_ptr() for t in _leaves((grads, state, params)) if t.numel()]  # not empty placeholders
        updates, new_state = tx.update(grads, state, params)
        new_params = gtx.apply_updates(params, updates, donate_updates=(mode == "donate"))
        _assert_same((grads, state, params), held)  # nothing the caller passed was written
        # nothing returned shares memory with what was passed in
        assert not {t.data_ptr() for t in _leaves((new_state, new_params)) if t.numel()} & set(pointers)
        state, params = new_state, new_params
    return params, state


@pytest.mark.parametrize("name", sorted(CHAINS))
def test_pure_donated_and_inplace_steps_agree_bit_for_bit(name):
    plain = _run(CHAINS[name](), mode="pure")
    donated = _run(CHAINS[name](), mode="donate")
    inplace = _run(CHAINS[name](), mode="inplace")
    _assert_same(plain, donated)
    _assert_same(plain, inplace)


def test_members_after_the_first_work_in_the_chains_buffers():
    seen = []

    def spy_update(updates, state, params=None, *, inplace=False):
        seen.append(inplace)
        return updates, state

    spy = gtx.GradientTransformation(base.init_empty_state, base.supports_donated_updates(spy_update))
    plain = gtx.GradientTransformation(base.init_empty_state, lambda u, s, p=None, *, inplace=False: (u, s))
    grads, params = _tree(1), _tree(0)
    tx = gtx.chain(spy, gtx.clip_by_global_norm(1.0), spy, plain, spy, gtx.scale(2.0), spy)
    tx.update(grads, tx.init(params), params)
    # the caller's grads go in pure; after clip the updates are the chain's own until a member
    # that does not say its output is new (plain), then again after scale
    assert seen == [False, "updates", False, "updates"]
    seen.clear()
    tx.update(grads, tx.init(params), params, inplace=True)
    assert seen == [True] * 4
    seen.clear()
    tx.update(grads, tx.init(params), params, inplace="updates")
    assert seen == ["updates", "updates", False, "updates"]


def test_a_member_whose_update_is_its_state_is_not_overwritten():
    class Remember(NamedTuple):
        last: dict

    def update_fn(updates, state, params=None, *, inplace=False):
        new = {k: None if v is None else v * 2.0 for k, v in updates.items()}
        return new, Remember(last=new)  # the update and the state share tensors

    # marked as taking donated updates, but not as returning new ones: the next member gets it pure
    aliasing = gtx.GradientTransformation(
        lambda p: Remember(last=p), base.supports_donated_updates(update_fn, returns_new_updates=False)
    )
    tx = gtx.chain(aliasing, gtx.scale(-1.0))
    grads = _tree(2)
    updates, (remembered, _) = tx.update(grads, tx.init(grads))
    for k in ("w", "b"):
        assert torch.equal(remembered.last[k], grads[k] * 2.0)
        assert torch.equal(updates[k], -grads[k] * 2.0)


def test_chain_marks_follow_its_last_member():
    assert base.takes_donated_updates(gtx.chain(gtx.clip_by_global_norm(1.0), gtx.adamw(1e-3)))
    assert base.returns_new_updates(gtx.chain(gtx.clip_by_global_norm(1.0), gtx.adamw(1e-3)))
    assert not base.returns_new_updates(gtx.chain(gtx.adamw(1e-3), gtx.add_decayed_weights(0.0)))
    assert not base.takes_donated_updates(gtx.trace(0.9))


def test_inplace_takes_bools_and_updates_only():
    assert base.donation(False) == (False, False)
    assert base.donation(True) == (True, True)
    assert base.donation("updates") == (True, False)
    with pytest.raises(ValueError, match="inplace must be a bool or 'updates'"):
        base.donation("state")


def test_donated_updates_mode_leaves_the_state_alone():
    tx = gtx.adamw(1e-2, weight_decay=0.1)
    params, grads = _tree(0), _tree(1)
    state = tx.init(params)
    state = tx.update(grads, state, params)[1]
    held = copy.deepcopy(state)
    donated = copy.deepcopy(grads)
    pointers = {k: v.data_ptr() for k, v in donated.items() if v is not None}
    updates, new_state = tx.update(donated, state, params, inplace="updates")
    _assert_same(state, held)
    expected, expected_state = tx.update(grads, held, params)
    _assert_same(updates, expected)
    _assert_same(new_state, expected_state)
    assert {k: v.data_ptr() for k, v in updates.items() if v is not None} == pointers


# --------------------------------------------------------------------------- apply_updates


def test_apply_updates_into_the_donated_updates():
    params, updates = _tree(0), _tree(1)
    held = copy.deepcopy(params)
    expected = gtx.apply_updates(params, updates)
    new = gtx.apply_updates(params, updates, donate_updates=True)
    _assert_same(params, held)
    _assert_same(new, expected)
    assert new["w"] is updates["w"] and new["b"] is updates["b"] and new["frozen"] is None


def test_apply_updates_donated_where_the_buffer_does_not_fit():
    gen = torch.Generator().manual_seed(3)
    params = {
        "half": torch.randn(8, generator=gen).to(torch.bfloat16),
        "t": torch.randn(3, 5, generator=gen).t(),  # transposed: strides (1, 5)
        "same": torch.randn(4, generator=gen),
    }
    updates = {
        "half": torch.randn(8, generator=gen) * 1e-2,  # float32 update, bfloat16 parameter
        "t": torch.randn(5, 3, generator=gen),  # contiguous: strides (3, 1)
        "same": torch.randn(4, generator=gen),
    }
    expected = gtx.apply_updates(params, updates)
    held_updates = copy.deepcopy(updates)
    new = gtx.apply_updates(params, updates, donate_updates=True)
    _assert_same(new, expected)
    assert new["half"].dtype == torch.bfloat16 and new["t"].stride() == (1, 5)
    assert new["same"] is updates["same"]
    assert torch.equal(updates["half"], held_updates["half"]) and torch.equal(updates["t"], held_updates["t"])


def test_apply_updates_donated_records_a_graph_when_one_is_needed():
    params = {"w": torch.randn(3, requires_grad=True)}
    updates = {"w": torch.randn(3, requires_grad=True)}
    new = gtx.apply_updates(params, updates, donate_updates=True)
    new["w"].sum().backward()
    assert torch.equal(params["w"].grad, torch.ones(3)) and torch.equal(updates["w"].grad, torch.ones(3))


def test_a_pure_step_with_donation_compiles_to_one_graph():
    torch._dynamo.reset()
    tx = gtx.chain(gtx.clip_by_global_norm(1.0), gtx.adamw(1e-2, weight_decay=0.1))

    def step(grads, state, params):
        updates, state = tx.update(grads, state, params)
        return gtx.apply_updates(params, updates, donate_updates=True), state

    compiled = torch.compile(step, fullgraph=True, backend="eager")
    params, grads = _tree(0), _tree(1)
    eager = step(grads, tx.init(params), params)
    held = copy.deepcopy((grads, params))
    got = compiled(grads, tx.init(params), params)
    _assert_same((grads, params), held)
    for x, y in zip(_leaves(got), _leaves(eager)):
        torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-7)



_LOW_PRECISION_GRADIENTS = ["sgd", "sgd_nesterov", "adam", "adamw", "nadam", "amsgrad", "adamax", "radam", "adabelief",
                            "lion", "rmsprop", "adagrad", "yogi", "adan", "novograd", "lamb"]
@pytest.mark.parametrize("name,mode", [(name, mode) for name in _LOW_PRECISION_GRADIENTS for mode in ("updates", True)])
def test_donated_bfloat16_gradients_beside_float32_state_give_the_pure_steps_numbers(name, mode):
    """A donated gradient buffer of another dtype than the state is no working buffer for the
    state's values, and a number multiplies bfloat16 in place as out of place: the donated step
    equals the pure one bit for bit (AMSGrad rounded its corrected second moment to bfloat16; in
    place, torch's ``_foreach_mul_`` rounded a learning rate to bfloat16 first)."""
    from test_differentiable import CASES

    gen = torch.Generator().manual_seed(3)
    params = {"w": torch.randn(6, 40, generator=gen), "b": torch.randn(40, generator=gen)}
    grads = [{k: torch.randn(p.shape, generator=gen).to(torch.bfloat16) for k, p in params.items()} for _ in range(3)]
    results = []
    for inplace in (False, mode):
        tx = CASES[name]()
        state, out = tx.init({k: v.clone() for k, v in params.items()}), []
        for g in grads:
            updates, state = tx.update({k: v.clone() for k, v in g.items()}, state, params, inplace=inplace)
            out.append(updates)
        results.append(_leaves((out, state)))
    assert len(results[1]) == len(results[0])
    for a, b in zip(*results):
        assert a.dtype == b.dtype and torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8)), name
    init_dtypes = [x.dtype for x in _leaves(CASES[name]().init(params))]
    assert [x.dtype for x in _leaves(state)] == init_dtypes, f"{name}: the state changed dtype"
