"""MultiSteps: gradient accumulation with optax's semantics, checked against full-batch torch training."""

import functools
import math

import pytest
import torch
from combinator_helpers import assert_same, clone, make_tree, run_both_paths, running_sum, scale_by

import gradtx as gtx


def _grads(step: int) -> dict:
    return make_tree(seed=step)


def _mean(trees):
    return gtx.tree.tree_map(lambda *xs: sum(xs) / len(xs), *trees)


def test_mini_steps_return_zeros_and_every_kth_step_applies_the_mean():
    params = make_tree()
    multi = gtx.MultiSteps(running_sum(), every_k_schedule=3)
    inner = running_sum()
    state, inner_state = multi.init(params), inner.init(params)
    emitted = []
    for step in range(6):
        updates, state = multi.update(_grads(step), state, params)
        if step % 3 < 2:
            assert all(leaf is None or (leaf == 0).all() for leaf in gtx.tree.leaves(updates))
            assert not bool(multi.has_updated(state))
        else:
            expected, inner_state = inner.update(_mean([_grads(s) for s in range(step - 2, step + 1)]), inner_state)
            for a, b in zip(gtx.tree.leaves(updates), gtx.tree.leaves(expected)):
                if a is not None:
                    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
            assert bool(multi.has_updated(state))
            emitted.append(step)
        assert updates["frozen"] is None
    assert emitted == [2, 5]
    assert int(state.gradient_step) == 2 and int(state.mini_step) == 0
    assert state.mini_step.dtype == torch.int32 and state.acc_grads["head"].dtype == torch.float32


def test_sum_instead_of_mean_and_a_schedule_for_k():
    params = {"w": torch.zeros(2)}
    # k = 1 for the first emitted step, then 2
    multi = gtx.MultiSteps(
        scale_by(1.0), every_k_schedule=lambda step: torch.where(step < 1, 1, 2), use_grad_mean=False
    )
    state = multi.init(params)
    outputs = []
    for step in range(5):
        updates, state = multi.update({"w": torch.full((2,), float(step + 1))}, state)
        outputs.append(float(updates["w"][0]))
    assert outputs == [1.0, 0.0, 2.0 + 3.0, 0.0, 4.0 + 5.0]


def test_matches_full_batch_torch_sgd_with_momentum():
    """Accumulating the mean of k micro-batch gradients is one full-batch step."""
    torch.manual_seed(0)
    x, y = torch.randn(12, 5), torch.randn(12, 1)
    model = torch.nn.Linear(5, 1)
    reference = torch.nn.Linear(5, 1)
    reference.load_state_dict(model.state_dict())
    params = {k: v.detach().clone() for k, v in model.named_parameters()}

    def loss_fn(p, xb, yb):
        return ((torch.func.functional_call(model, p, (xb,)) - yb) ** 2).mean()

    lr, k = 0.1, 3
    # SGD with momentum 0.9 as a chain: running sum with decay is torch's buffer; here lr * buffer
    momentum = _momentum(0.9)
    multi = gtx.MultiSteps(gtx.chain(momentum, scale_by(-lr)), every_k_schedule=k)
    state = multi.init(params)
    opt = torch.optim.SGD(reference.parameters(), lr=lr, momentum=0.9)
    for _ in range(3):
        for chunk in range(k):
            xb, yb = x[4 * chunk : 4 * chunk + 4], y[4 * chunk : 4 * chunk + 4]
            grads = torch.func.grad(loss_fn)(params, xb, yb)
            updates, state = multi.update(grads, state, params)
            params = gtx.apply_updates(params, updates)
        opt.zero_grad()
        ((reference(x) - y) ** 2).mean().backward()
        opt.step()
        for name, p in reference.named_parameters():
            torch.testing.assert_close(params[name], p.detach(), rtol=1e-5, atol=1e-6)


def _momentum(decay: float) -> gtx.GradientTransformation:
    """torch's SGD momentum buffer: b = decay * b + g (the first step b = g)."""

    def init_fn(params):
        return gtx.tree.tree_map(torch.zeros_like, params)

    def update_fn(updates, state, params=None):
        new = gtx.tree.tree_map(lambda b, g: decay * b + g, state, updates)
        return new, new

    return gtx.GradientTransformation(init_fn, update_fn)


def test_skip_not_finite_ignores_a_mini_step_entirely():
    params = {"w": torch.zeros(3)}
    multi = gtx.MultiSteps(scale_by(1.0), 2, should_skip_update_fn=gtx.skip_not_finite)
    state = multi.init(params)
    assert set(state.skip_state) == {"should_skip", "num_not_finite"}
    _, state = multi.update({"w": torch.tensor([1.0, 2.0, 3.0])}, state)
    before = state
    updates, state = multi.update({"w": torch.tensor([math.nan, math.inf, 0.0])}, state)
    assert (updates["w"] == 0).all()
    assert bool(state.skip_state["should_skip"]) and int(state.skip_state["num_not_finite"]) == 2
    assert_same(state.acc_grads, before.acc_grads)
    assert int(state.mini_step) == 1
    updates, state = multi.update({"w": torch.tensor([3.0, 2.0, 1.0])}, state)
    torch.testing.assert_close(updates["w"], torch.tensor([2.0, 2.0, 2.0]))


def test_skip_large_updates():
    params = {"w": torch.zeros(2)}
    skip = functools.partial(gtx.skip_large_updates, max_squared_norm=10.0)
    multi = gtx.MultiSteps(scale_by(1.0), 1, should_skip_update_fn=skip)
    state = multi.init(params)
    updates, state = multi.update({"w": torch.tensor([3.0, 4.0])}, state)  # 25 >= 10: skipped
    assert (updates["w"] == 0).all() and float(state.skip_state["norm_squared"]) == 25.0
    updates, state = multi.update({"w": torch.tensor([1.0, 2.0])}, state)
    torch.testing.assert_close(updates["w"], torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match="0-d bool"):
        bad = gtx.MultiSteps(scale_by(1.0), 1, should_skip_update_fn=lambda u, s, p: (torch.tensor(1), ()))
        bad.update({"w": torch.ones(2)}, bad.init(params))


def test_pure_and_donated_paths_agree():
    params = make_tree()
    grads = [_grads(i) for i in range(5)]
    run_both_paths(gtx.MultiSteps(running_sum(), 2).gradient_transformation(), params, grads)
    run_both_paths(
        gtx.chain(gtx.clip_by_global_norm(1.0), gtx.MultiSteps(running_sum(), 3, use_grad_mean=False).gradient_transformation()),
        params,
        grads,
    )
    run_both_paths(
        gtx.MultiSteps(running_sum(), 2, should_skip_update_fn=gtx.skip_not_finite).gradient_transformation(),
        params,
        grads,
    )


def test_bf16_gradients_accumulate_in_float32():
    params = {"w": torch.zeros(1, dtype=torch.bfloat16)}
    multi = gtx.MultiSteps(scale_by(1.0), every_k_schedule=4, use_grad_mean=False)
    state = multi.init(params)
    for value in (256.0, 1.0, 1.0, 1.0):  # 256 + 1 is not representable in bf16; the float32 sum is
        updates, state = multi.update({"w": torch.tensor([value], dtype=torch.bfloat16)}, state)
    assert updates["w"].dtype == torch.bfloat16
    assert float(updates["w"]) == float(torch.tensor(259.0).to(torch.bfloat16))
    assert state.acc_grads["w"].dtype == torch.float32


def test_compiles_once():
    from torch._dynamo.testing import CompileCounter

    params = {"w": torch.zeros(3)}
    multi = gtx.MultiSteps(running_sum(), 3)
    counter = CompileCounter()
    step = torch.compile(multi.update, backend=counter, fullgraph=True)
    state, eager_state = multi.init(params), multi.init(params)
    for i in range(7):
        grads = {"w": torch.full((3,), float(i))}
        updates, state = step(grads, state)
        expected, eager_state = multi.update(grads, eager_state)
        assert_same(updates, expected)
    assert counter.frame_count == 1


def _never_skip(updates, gradient_step, params):
    return torch.zeros((), dtype=torch.bool), ()


def test_host_and_device_decisions_agree_and_eager_runs_the_inner_on_emitting_steps_only():
    params = make_tree()
    calls = []

    def counting_sum():
        inner = running_sum()

        def update_fn(updates, state, params=None, *, inplace=False):
            calls.append(inplace)
            return inner.update(updates, state, params, inplace=inplace)

        return gtx.GradientTransformation(inner.init, update_fn)

    host = gtx.MultiSteps(counting_sum(), 3)
    device = gtx.MultiSteps(running_sum(), 3, should_skip_update_fn=_never_skip)
    assert host.init(params).mini_step.device.type == "cpu"
    host_state, device_state = host.init(params), device.init(params)
    for step in range(7):
        grads = _grads(step)
        host_updates, host_state = host.update(clone(grads), host_state, params, inplace=step % 2 == 0)
        device_updates, device_state = device.update(grads, device_state, params)
        assert_same(host_updates, device_updates)
        assert_same(host_state.inner_opt_state, device_state.inner_opt_state)
        assert_same(host_state.acc_grads, device_state.acc_grads)
        assert bool(host.has_updated(host_state)) == bool(device.has_updated(device_state))
    assert calls == [True, False]  # steps 2 (donated) and 5 (pure): the emitting ones


def test_multisteps_adamw_matches_full_batch_torch_adamw():
    torch.manual_seed(1)
    x, y = torch.randn(8, 3), torch.randn(8, 1)
    model = torch.nn.Linear(3, 1)
    reference = torch.nn.Linear(3, 1)
    reference.load_state_dict(model.state_dict())
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    multi = gtx.MultiSteps(gtx.adamw(1e-2, weight_decay=0.05), every_k_schedule=2)
    state = multi.init(params)
    opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.05)
    for _ in range(3):
        for half in (slice(0, 4), slice(4, 8)):
            grads = torch.func.grad(
                lambda p: ((torch.func.functional_call(model, p, (x[half],)) - y[half]) ** 2).mean()
            )(params)
            updates, state = multi.update(grads, state, params, inplace=True)
            params = gtx.apply_updates(params, updates)
        opt.zero_grad()
        ((reference(x) - y) ** 2).mean().backward()
        opt.step()
        for name, p in reference.named_parameters():
            torch.testing.assert_close(params[name], p.detach(), rtol=1e-5, atol=1e-6)
