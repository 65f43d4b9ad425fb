"""``compile_step``: the pure step as one compiled graph whose large outputs land in recycled buffers.

Checked: the numbers are the eager pure step's; the inputs are never written and no output shares
memory with anything the caller still holds; after two steps the outputs reuse the buffers the
caller dropped; the generated code allocates nothing large and computes Adam's per-step factors
once; one graph serves every step; where a graph is recorded the step is differentiable.
"""

from __future__ import annotations

import re

import pytest
import torch
from torch._dynamo.utils import counters

import gradtx as gtx
from gradtx.buffer_pool import RECYCLE_MIN_BYTES
from gradtx.tree import leaves

BIG = RECYCLE_MIN_BYTES // 4  # float32 elements of the smallest pooled leaf


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _tree(seed: int, big: int = 2 * BIG) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(big // 64, 64, generator=gen),
        "v": torch.randn(big, generator=gen),
        "b": torch.randn(7, generator=gen),  # small: a new tensor every step
    }


def _adamw_chain() -> gtx.GradientTransformation:
    return gtx.chain(gtx.clip_by_global_norm(1.0), gtx.adamw(1e-2, weight_decay=0.1))


def _storages(tree) -> set[int]:
    return {leaf.untyped_storage().data_ptr() for leaf in leaves(tree) if leaf.numel() >= BIG}


def _big_leaves(params, state):
    return [x for x in leaves((params, state)) if isinstance(x, torch.Tensor) and x.numel() >= BIG]


def test_inductor_step_equals_the_eager_pure_step_and_recycles_after_two_steps():
    tx = _adamw_chain()
    step = gtx.compile_step(tx)
    params = eager_params = _tree(0)
    state = eager_state = tx.init(params)
    handed_out: list[set[int]] = []
    for i in range(5):
        grads = {k: v * (i + 1) for k, v in _tree(10 + i).items()}
        params, state = step(grads, state, params)
        updates, eager_state = tx.update(grads, eager_state, eager_params)
        eager_params = gtx.apply_updates(eager_params, updates)
        for got, want in zip(leaves((params, state)), leaves((eager_params, eager_state))):
            torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-7)
        handed_out.append({x.data_ptr() for x in _big_leaves(params, state)})
    assert len(handed_out[0]) == 6  # w, v, and both moments of each
    for i in range(2, 5):
        assert handed_out[i] == handed_out[i - 2]  # the trees dropped two steps before
        assert not handed_out[i] & handed_out[i - 1]


def test_the_generated_code_allocates_no_large_buffer():
    from torch._inductor.utils import run_and_get_code

    tx = _adamw_chain()
    step = gtx.compile_step(tx)
    params = _tree(0)
    state = tx.init(params)
    grads = _tree(1)
    (params, state), codes = run_and_get_code(step, grads, state, params)
    code = "\n".join(codes)
    assert "empty_strided_cpu((7, ), (1, ), torch.float32)" in code  # the small leaf: new tensors
    assert f"empty_strided_cpu(({2 * BIG // 64}, 64)" not in code
    assert f"empty_strided_cpu(({2 * BIG}, )" not in code


def _count_in_code(make_tx, n_leaves: int, word: str) -> int:
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    tx = make_tx()
    params = {str(i): torch.randn(64 + i) for i in range(n_leaves)}
    grads = {k: torch.ones_like(v) for k, v in params.items()}
    state = tx.init(params)
    compiled = torch.compile(lambda g, s, p: tx.update(g, s, p), fullgraph=True)
    _, codes = run_and_get_code(compiled, grads, state, params)
    return "\n".join(codes).count(word)


@pytest.mark.parametrize(
    ("make_tx", "word"),
    [
        (lambda: gtx.adam(1e-3), "std::pow"),
        (lambda: gtx.adamw(gtx.warmup_cosine_decay_schedule(0.0, 1e-3, 10, 100), weight_decay=0.1), "std::cos"),
        (lambda: gtx.chain(gtx.clip_by_global_norm(1.0), gtx.sgd(0.1)), "min_propagate_nan"),
    ],
    ids=["bias corrections", "cosine schedule", "clip coefficient"],
)
def test_per_step_factors_are_computed_once_per_compiled_step(make_tx, word):
    """Inductor would inline ``1 - b ** count``, a schedule's cosine or the clip's ``min(1, c /
    norm)`` into every leaf's loop (evaluated per vector); the factors are one small buffer
    instead, so their code does not grow with the tree."""
    one, four = _count_in_code(make_tx, 1, word), _count_in_code(make_tx, 4, word)
    assert 0 < one == four


def test_inputs_are_never_written_and_held_outputs_never_reused():
    tx = _adamw_chain()
    step = gtx.compile_step(tx, backend="eager")
    params = _tree(0)
    state = tx.init(params)
    history = []  # every output kept: nothing may be recycled
    for i in range(4):
        grads = _tree(20 + i)
        inputs = (grads, state, params)
        snapshot = [x.clone() for x in leaves(inputs)]
        new_params, new_state = step(grads, state, params)
        for before, after in zip(snapshot, leaves(inputs)):
            assert torch.equal(before, after)
        input_storages = {x.untyped_storage().data_ptr() for x in leaves(inputs)}
        assert not _storages((new_params, new_state)) & input_storages
        history.append(((new_params, new_state), [x.clone() for x in leaves((new_params, new_state))]))
        params, state = new_params, new_state
    for trees, values in history:
        for now, then in zip(leaves(trees), values):
            assert torch.equal(now, then)
    all_storages = [_storages(trees) for trees, _ in history]
    assert sum(len(s) for s in all_storages) == len(set().union(*all_storages))


def test_a_view_the_caller_keeps_protects_its_buffer():
    tx = gtx.adam(1e-2)
    step = gtx.compile_step(tx, backend="eager")
    params = _tree(0)
    state = tx.init(params)
    params, state = step(_tree(1), state, params)
    kept_row = params["w"][3]  # a view: the rest of the step's output is dropped
    expected = kept_row.clone()
    for i in range(4):
        params, state = step(_tree(2 + i), state, params)
    assert torch.equal(kept_row, expected)


def test_one_graph_serves_every_step():
    counters.clear()
    tx = _adamw_chain()
    step = gtx.compile_step(tx, backend="eager")
    params = _tree(0)
    state = tx.init(params)
    for i in range(5):
        params, state = step(_tree(30 + i), state, params)
    assert counters["stats"]["unique_graphs"] == 1


def test_recycle_false_uses_no_pool_and_gives_the_same_numbers():
    tx = gtx.adam(1e-2)
    plain = gtx.compile_step(tx, recycle=False, backend="eager")
    recycling = gtx.compile_step(tx, backend="eager")
    params = other_params = _tree(0)
    state = other_state = tx.init(params)
    for i in range(4):
        params, state = plain(_tree(1 + i), state, params)
        other_params, other_state = recycling(_tree(1 + i), other_state, other_params)
    assert plain.pool.kept_bytes() == 0 and recycling.pool.kept_bytes() > 0
    for a, b in zip(leaves((params, state)), leaves((other_params, other_state))):
        assert torch.equal(a, b)


def test_extra_args_reach_the_transformation():
    tx = gtx.polyak_sgd(max_learning_rate=1.0)
    step = gtx.compile_step(tx, backend="eager")
    params = {"w": torch.full((BIG,), 2.0)}
    state = tx.init(params)
    value = (params["w"] ** 2).sum()
    grads = {"w": 2 * params["w"]}
    new_params, _ = step(grads, state, params, value=value)
    updates, _ = tx.update(grads, state, params, value=value)
    torch.testing.assert_close(new_params["w"], gtx.apply_updates(params, updates)["w"])


def test_differentiable_where_a_graph_is_recorded():
    """With a learning rate that requires grad, the compiled step's meta-gradient through two steps
    equals the eager pure step's, and its outputs are new tensors (not pool buffers)."""
    def run(step_fn):
        lr = torch.tensor(0.05, dtype=torch.float64, requires_grad=True)
        tx = gtx.inject_hyperparams(gtx.adam)(learning_rate=lr)
        params = {k: v.double() for k, v in _tree(0).items()}
        state = tx.init(params)
        for i in range(2):
            grads = {k: 2 * (v - 0.5) for k, v in params.items()}
            params, state = step_fn(tx)(grads, state, params)
        loss = sum((p ** 2).sum() for p in params.values())
        return torch.autograd.grad(loss, lr)[0], params

    def eager(tx):
        def step(grads, state, params):
            updates, state = tx.update(grads, state, params)
            return gtx.apply_updates(params, updates), state
        return step

    steps = {}

    def compiled(tx):
        if id(tx) not in steps:
            steps[id(tx)] = gtx.compile_step(tx, backend="aot_eager")
        return steps[id(tx)]

    want, _ = run(eager)
    got, params = run(compiled)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)
    assert all(p.requires_grad for p in params.values())
    (only_step,) = steps.values()
    assert only_step.pool.kept_bytes() == 0


def test_inductor_options_given_are_kept(monkeypatch):
    seen = {}
    real_compile = torch.compile

    def spy(fn, **options):
        seen.update(options)
        return real_compile(fn, **options)

    monkeypatch.setattr(torch, "compile", spy)
    gtx.compile_step(gtx.sgd(0.1), options={"max_fusion_size": 8})  # compiled lazily: nothing runs
    assert seen["fullgraph"] is True
    assert seen["options"] == {"realize_reads_threshold": 1, "max_fusion_size": 8}
    seen.clear()
    gtx.compile_step(gtx.sgd(0.1), backend="eager", fullgraph=False)
    assert seen == {"backend": "eager", "fullgraph": False}


def test_the_docstring_example_runs():
    import doctest

    import gradtx.compiled_step as module

    results = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert results.attempted >= 5 and results.failed == 0


@pytest.mark.parametrize(
    ("grads", "error", "message"),
    [
        ({"w": torch.ones(3)}, ValueError, "compile_step: updates do not match params: params has leaf 'b' that updates lacks"),
        ({"w": torch.ones(3), "b": torch.ones(4)}, ValueError, "leaf 'b' has update shape (4,) but parameter shape (2,)"),
        ({"w": torch.ones(3), "b": 2.0}, TypeError, "leaf 'b' is a float"),
    ],
    ids=["missing leaf", "wrong shape", "not a tensor"],
)
def test_mismatched_gradients_are_a_clear_error_before_tracing(grads, error, message):
    counters.clear()
    tx = gtx.adam(1e-3)
    step = gtx.compile_step(tx, backend="eager")
    params = {"w": torch.ones(3), "b": torch.ones(2)}
    with pytest.raises(error, match=re.escape(message)):
        step(grads, tx.init(params), params)
    assert counters["stats"]["calls_captured"] == 0  # raised before Dynamo saw the step
