"""inject_hyperparams: numbers and schedules in the state, readable and writable, torch's lr schedulers as reference."""

from typing import NamedTuple

import pytest
import torch
from combinator_helpers import assert_same, make_tree, run_both_paths

import gradtx as gtx


class MomentumState(NamedTuple):
    buffer: dict


def sgd_momentum(learning_rate: float, momentum: float = 0.0, nesterov: bool = False, every: int = 1):
    """A small test optimizer: torch's SGD (momentum buffer b = m * b + g; update -lr * b)."""
    assert isinstance(nesterov, bool) and isinstance(every, int)  # static arguments stay Python values

    def init_fn(params):
        return MomentumState(gtx.tree.tree_map(torch.zeros_like, params))

    def update_fn(updates, state, params=None, *, inplace=False):
        buffer = gtx.tree.tree_map(lambda b, g: momentum * b + g, state.buffer, updates)
        step = gtx.tree.tree_map(lambda g, b: g + momentum * b, updates, buffer) if nesterov else buffer
        return gtx.tree.tree_map(lambda d: -learning_rate * d, step), MomentumState(buffer)

    return gtx.GradientTransformation(init_fn, update_fn)


def _torch_trajectory(make_scheduler, steps, **sgd_kwargs):
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(4))
    opt = torch.optim.SGD([w], **sgd_kwargs)
    scheduler = make_scheduler(opt)
    gen = torch.Generator().manual_seed(1)
    grads, values = [], []
    for _ in range(steps):
        g = torch.randn(4, generator=gen)
        grads.append(g)
        w.grad = g.clone()
        opt.step()
        scheduler.step()
        values.append(w.detach().clone())
    torch.manual_seed(0)
    return torch.randn(4), grads, values


def test_numbers_live_in_the_state_as_0d_tensors():
    params = make_tree()
    tx = gtx.inject_hyperparams(sgd_momentum)(learning_rate=0.1, momentum=0.9)
    state = tx.init(params)
    assert isinstance(state, gtx.InjectHyperparamsState)
    assert set(state.hyperparams) == {"learning_rate", "momentum"}
    for value in state.hyperparams.values():
        assert isinstance(value, torch.Tensor) and value.ndim == 0 and value.dtype == torch.float32
    torch.testing.assert_close(state.hyperparams["learning_rate"], torch.tensor(0.1))
    assert state.count.dtype == torch.int32 and int(state.count) == 0


def test_schedule_matches_torch_lr_scheduler_trajectory():
    w0, grads, expected = _torch_trajectory(
        lambda o: torch.optim.lr_scheduler.ExponentialLR(o, gamma=0.8), 6, lr=0.5, momentum=0.9
    )
    schedule = gtx.exponential_decay(init_value=0.5, transition_steps=1, decay_rate=0.8)
    tx = gtx.inject_hyperparams(sgd_momentum)(learning_rate=schedule, momentum=0.9)
    params = {"w": w0}
    state = tx.init(params)
    for step, (g, w_ref) in enumerate(zip(grads, expected)):
        updates, state = tx.update({"w": g}, state, params)
        params = gtx.apply_updates(params, updates)
        torch.testing.assert_close(params["w"], w_ref, rtol=1e-6, atol=1e-6)
        # the state shows the value used by this step
        torch.testing.assert_close(state.hyperparams["learning_rate"], torch.tensor(0.5 * 0.8**step))
    assert int(state.count) == len(grads)


def test_writing_a_hyperparameter_changes_the_next_step():
    w0, grads, _ = _torch_trajectory(lambda o: torch.optim.lr_scheduler.ConstantLR(o, factor=1.0), 4, lr=0.1)
    tx = gtx.inject_hyperparams(sgd_momentum)(learning_rate=0.1)
    params = {"w": w0.clone()}
    state = tx.init(params)
    updates, state = tx.update({"w": grads[0]}, state, params)
    torch.testing.assert_close(updates["w"], -0.1 * grads[0])
    state.hyperparams["learning_rate"] = 0.5  # a Python number
    updates, state = tx.update({"w": grads[1]}, state, params)
    torch.testing.assert_close(updates["w"], -0.5 * grads[1])
    assert isinstance(state.hyperparams["learning_rate"], torch.Tensor)
    state.hyperparams["learning_rate"].fill_(0.25)  # in place, as a logger-side tweak would
    updates, state = tx.update({"w": grads[2]}, state, params)
    torch.testing.assert_close(updates["w"], -0.25 * grads[2])


def test_scheduled_values_cannot_be_overridden_and_static_args_stay_static():
    tx = gtx.inject_hyperparams(sgd_momentum)(learning_rate=gtx.constant_schedule(0.1), nesterov=True, every=3)
    params = {"w": torch.zeros(2)}
    state = tx.init(params)
    assert set(state.hyperparams) == {"learning_rate", "momentum"}  # bools and declared ints are static
    state.hyperparams["learning_rate"] = torch.tensor(99.0)
    updates, state = tx.update({"w": torch.ones(2)}, state)
    torch.testing.assert_close(updates["w"], torch.full((2,), -0.1))
    with pytest.raises(ValueError, match="static_args"):
        gtx.inject_hyperparams(sgd_momentum, static_args=("nope",))


def test_inplace_is_passed_through_and_paths_agree():
    seen = []

    def factory(learning_rate: float):
        def update_fn(updates, state, params=None, *, inplace=False):
            seen.append(inplace)
            scaled = gtx.tree.tree_map(lambda g: g.mul_(learning_rate) if inplace else g * learning_rate, updates)
            return scaled, state

        return gtx.GradientTransformation(lambda p: gtx.EmptyState(), update_fn)

    schedule = gtx.warmup_cosine_decay_schedule(0.0, 1.0, warmup_steps=2, decay_steps=6)
    run_both_paths(gtx.inject_hyperparams(factory)(learning_rate=schedule), make_tree(), [make_tree(i) for i in range(4)])
    assert seen == [False, True] * 4
    run_both_paths(
        gtx.inject_hyperparams(sgd_momentum)(learning_rate=schedule, momentum=0.5),
        make_tree(),
        [make_tree(i) for i in range(4)],
    )


def test_float64_params_give_float64_hyperparameters():
    params = {"w": torch.zeros(2, dtype=torch.float64)}
    state = gtx.inject_hyperparams(sgd_momentum)(learning_rate=0.1).init(params)
    assert state.hyperparams["learning_rate"].dtype == torch.float64
    state = gtx.inject_hyperparams(sgd_momentum, hyperparam_dtype=torch.float32)(learning_rate=0.1).init(params)
    assert state.hyperparams["learning_rate"].dtype == torch.float32


def test_compiles_once_over_a_schedule():
    from torch._dynamo.testing import CompileCounter

    tx = gtx.inject_hyperparams(sgd_momentum)(
        learning_rate=gtx.warmup_cosine_decay_schedule(0.0, 1.0, 2, 8, 0.1), momentum=0.9
    )
    counter = CompileCounter()
    step = torch.compile(tx.update, backend=counter, fullgraph=True)
    params = {"w": torch.zeros(3)}
    state, eager_state = tx.init(params), tx.init(params)
    for i in range(6):
        grads = {"w": torch.full((3,), float(i + 1))}
        updates, state = step(grads, state)
        expected, eager_state = tx.update(grads, eager_state)
        assert_same(updates, expected)
    assert counter.frame_count == 1


@pytest.mark.parametrize(
    "factory, hyperparams",
    [
        ("sgd", {}),  # built from a chain: its members' signatures read as Dynamo can trace them
        ("amsgrad", {"eps_root": 0.0}),  # a zero eps_root, skipped when it is a number
        ("radam", {}),
        ("adagrad", {"eps": 0.0}),  # its clamp where the sum is 0 (kept: eps is symbolic)
        ("fromage", {}),  # a weight decay factor tested for 0
        ("adafactor", {}),  # clip_by_block_rms's threshold checked when built
    ],
)
def test_compiled_steps_of_injected_factories_that_test_their_numbers(factory, hyperparams):
    """Traced, ``inject_hyperparams`` builds its inner transformation from Dynamo's scalars of the
    state's values: no factory may test them in Python. The compiled steps equal the eager ones,
    over steps whose gradients are zero first (0 / 0 guarded) and then not."""
    tx = gtx.inject_hyperparams(getattr(gtx, factory))(learning_rate=0.1, **hyperparams)
    params = {"w": torch.randn(4, 3, generator=torch.Generator().manual_seed(0)), "b": torch.ones(3)}
    step = gtx.compile_step(tx, backend="eager")
    state = eager_state = tx.init(params)
    compiled_params = eager_params = params
    for i in range(3):
        grads = {k: torch.full_like(p, 0.0 if i == 0 else 0.5 * i) for k, p in params.items()}
        compiled_params, state = step(grads, state, compiled_params)
        updates, eager_state = tx.update(grads, eager_state, eager_params)
        eager_params = gtx.apply_updates(eager_params, updates)
        for k in params:
            torch.testing.assert_close(compiled_params[k], eager_params[k], rtol=1e-6, atol=1e-7)
            assert torch.isfinite(compiled_params[k]).all()


def test_adamw_with_a_scheduled_learning_rate_matches_torch_adamw_with_lambda_lr():
    torch.manual_seed(0)
    w0 = torch.randn(5)
    grads = [torch.randn(5) for _ in range(6)]
    schedule = gtx.warmup_cosine_decay_schedule(0.0, 1e-2, warmup_steps=2, decay_steps=6, end_value=1e-3)
    tx = gtx.inject_hyperparams(gtx.adamw)(learning_rate=schedule, weight_decay=0.1)
    params = {"w": w0.clone()}
    state = tx.init(params)
    w = torch.nn.Parameter(w0.clone())
    opt = torch.optim.AdamW([w], lr=1.0, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda count: schedule(count))
    for g in grads:
        updates, state = tx.update({"w": g}, state, params)
        params = gtx.apply_updates(params, updates)
        w.grad = g.clone()
        opt.step()
        scheduler.step()
        torch.testing.assert_close(params["w"], w.detach(), rtol=1e-5, atol=1e-6)
    assert "learning_rate" in state.hyperparams and "weight_decay" in state.hyperparams


def test_a_factory_taking_keyword_arguments_gets_each_one_injected():
    def factory(**hyperparams):
        return gtx.scale(hyperparams["step_size"])

    tx = gtx.inject_hyperparams(factory)(step_size=lambda count: 0.5 / (1.0 + count))
    params = {"w": torch.ones(3)}
    state = tx.init(params)
    for step in range(3):
        updates, state = tx.update({"w": torch.ones(3)}, state, params)
        assert torch.equal(updates["w"], torch.full((3,), 0.5 / (1.0 + step)))
    assert set(state.hyperparams) == {"step_size"}


def test_positional_only_and_variadic_arguments_reach_the_factory():
    def factory(step_size, /, *offsets, flip=False):
        return gtx.scale(-step_size - sum(offsets) if flip else step_size + sum(offsets))

    tx = gtx.inject_hyperparams(factory)(0.25, 1.0, 2.0, flip=True)
    updates, state = tx.update({"w": torch.ones(2)}, tx.init({"w": torch.ones(2)}))
    assert torch.equal(updates["w"], torch.full((2,), -3.25)) and set(state.hyperparams) == {"step_size"}


def test_a_torch_optimizer_in_a_chain_follows_a_scheduled_learning_rate_as_torch_does():
    """from_torch takes the optimizer class (a callable, but no schedule) and its keyword
    arguments; the learning rate scheduled in the state gives torch's own SGD's numbers."""
    schedule = lambda count: 0.1 / (1.0 + count)  # noqa: E731
    generator = torch.Generator().manual_seed(0)
    start = torch.randn(4, 3, generator=generator)
    tx = gtx.inject_hyperparams(gtx.from_torch)(torch.optim.SGD, lr=schedule, momentum=0.9)
    params = {"w": start.clone()}
    state = tx.init(params)
    reference = torch.nn.Parameter(start.clone())
    opt = torch.optim.SGD([reference], lr=0.1, momentum=0.9)
    for step in range(4):
        grad = torch.randn(4, 3, generator=generator)
        updates, state = tx.update({"w": grad}, state, params)
        params = gtx.apply_updates(params, updates)
        opt.param_groups[0]["lr"] = schedule(step)
        reference.grad = grad.clone()
        opt.step()
        assert torch.equal(params["w"], reference.detach()), step
    assert float(state.hyperparams["lr"]) == pytest.approx(schedule(3))
