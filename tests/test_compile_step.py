"""``compile_step``: the pure step as one compiled graph whose large outputs land in recycled buffers.

Checked: the numbers and layouts are the eager pure step's, for every param layout (permuted,
sliced, expanded, self-overlapping, 0-d, empty, mixed dtypes); the inputs are never written and no
output shares memory with anything the caller still holds, weak references included; after two
steps the outputs reuse the buffers the caller dropped; the generated code allocates nothing large
and computes Adam's per-step factors once; one graph serves every step; each step has a recompile
limit of its own and says so when it hits it; where a graph is recorded the step is differentiable.
"""

from __future__ import annotations

import re
import warnings
import weakref
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch._dynamo.utils import counters
from torch.multiprocessing.reductions import StorageWeakRef

import gradtx as gtx
from gradtx import buffer_pool, compiled_step
from gradtx.buffer_pool import RECYCLE_MIN_BYTES
from gradtx.tree import leaves, paths

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
    """Also: the generated code allocates no large buffer (the pool hands them in), only the
    small leaf's new tensors."""
    from torch._inductor.utils import run_and_get_code

    tx = _adamw_chain()
    step = gtx.compile_step(tx)
    params = eager_params = _tree(0)
    state = eager_state = tx.init(params)
    handed_out: list[set[int]] = []
    for i in range(5):
        grads = {k: v * (i + 1) for k, v in _tree(10 + i).items()}
        if i == 0:
            (params, state), codes = run_and_get_code(step, grads, state, params)
            code = "\n".join(codes)
            assert "empty_strided_cpu((7, ), (1, ), torch.float32)" in code  # the small leaf: new tensors
            assert f"empty_strided_cpu(({2 * BIG // 64}, 64)" not in code
            assert f"empty_strided_cpu(({2 * BIG}, )" not in code
        else:
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
    from gradtx import compiled_fusion

    assert seen["options"] == {
        "realize_reads_threshold": 1, "inductor_choices_class": compiled_fusion._choices_class(), "max_fusion_size": 8
    }
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


# --------------------------------------------------------------------------- every param layout


def _plain_step(tx, grads, state, params):
    updates, state = tx.update(grads, state, params)
    return gtx.apply_updates(params, updates), state


def _strided(shape, strides, dtype, seed: int) -> torch.Tensor:
    """A tensor of ``shape`` and ``strides`` (any, overlapping ones included) over random values."""
    span = 1 + sum((n - 1) * s for n, s in zip(shape, strides)) if all(shape) else 0
    base = torch.randn(span + 3, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)
    return base.as_strided(shape, strides, 2)


def _dense_strides(shape, order) -> tuple[int, ...]:
    """Contiguous strides for the dimensions of ``shape`` taken in ``order`` (innermost last)."""
    strides, step = [0] * len(shape), 1
    for dim in reversed(order):
        strides[dim], step = step, step * max(shape[dim], 1)
    return tuple(strides)


@st.composite
def _layouts(draw, shape):
    """Strides for ``shape``: a dense permutation, or any strides in 0..5 (slices with gaps,
    ``expand``'s zeros, self-overlapping ``as_strided`` views)."""
    if draw(st.booleans()):
        return _dense_strides(shape, draw(st.permutations(range(len(shape)))))
    return tuple(draw(st.lists(st.integers(0, 5), min_size=len(shape), max_size=len(shape))))


@st.composite
def _param_and_grad(draw):
    shape = tuple(draw(st.lists(st.integers(0, 4), max_size=3)))
    dtype = draw(st.sampled_from([torch.float32, torch.float64, torch.bfloat16]))
    seed = draw(st.integers(0, 2**16))
    return _strided(shape, draw(_layouts(shape)), dtype, seed), _strided(shape, draw(_layouts(shape)), dtype, seed + 1)


_TRANSFORMATIONS = {
    "sgd with momentum": lambda: gtx.sgd(0.1, momentum=0.9),
    "adamw": lambda: gtx.adamw(1e-2, weight_decay=0.1),
    "clip, then adamw": lambda: gtx.chain(gtx.clip_by_global_norm(0.5), gtx.adamw(1e-2, weight_decay=0.1)),
}


def _check_against_plain_step(make_tx, params, grads_per_step, **compile_options) -> list[set[int]]:
    """Steps of ``compile_step`` (every leaf pooled, however small) against the plain step: the
    same numbers (to rounding) and the same layouts; nothing passed in is written; no output shares
    memory with an input. Returns the addresses of each step's output storages."""
    tx = make_tx()
    step = gtx.compile_step(tx, **compile_options)
    trees = plain = (params, tx.init(params))
    storages = []
    with mock.patch.object(buffer_pool, "RECYCLE_MIN_BYTES", 1):
        for grads in grads_per_step:
            trees, plain = _step_and_check(step, tx, grads, trees, plain)
            storages.append({x.untyped_storage().data_ptr() for x in leaves(trees) if x.numel() > 1})
    return storages


def _step_and_check(step, tx, grads, trees, plain):
    """One step of each (in a function of its own, so that nothing here outlives it and keeps a
    buffer from the pool)."""
    inputs = (grads, *trees)
    snapshot = [x.clone() for x in leaves(inputs)]
    new_trees = step(grads, trees[1], trees[0])
    new_plain = _plain_step(tx, grads, plain[1], plain[0])
    for path, got, want in zip(paths(new_trees), leaves(new_trees), leaves(new_plain)):
        # To rounding: the compiled clip may round its factor differently (float64 leaves).
        torch.testing.assert_close(got, want, msg=lambda m: f"{path}: {m}")
        assert got.stride() == want.stride() or got.numel() <= 1, (path, got.stride(), want.stride())
    for before, after in zip(snapshot, leaves(inputs)):
        assert torch.equal(before, after)
    input_storages = {x.untyped_storage().data_ptr() for x in leaves(inputs) if x.numel()}
    assert not {x.untyped_storage().data_ptr() for x in leaves(new_trees) if x.numel()} & input_storages
    return new_trees, new_plain


@settings(max_examples=4, deadline=None)
@given(st.lists(_param_and_grad(), min_size=1, max_size=4), st.sampled_from(sorted(_TRANSFORMATIONS)))
def test_any_param_layout_gets_the_plain_steps_numbers_and_layout(drawn, name):
    """One step (one compilation) per example: the output buffers are laid out from the inputs
    on every step, so the first step exercises what every later one does. Each example costs a
    trace; every kind of layout is also checked by name below (``_odd_layouts``), so a few
    random trees of them suffice here."""
    params = {f"p{i}": param for i, (param, _) in enumerate(drawn)}
    grads = {f"p{i}": grad for i, (_, grad) in enumerate(drawn)}
    _check_against_plain_step(_TRANSFORMATIONS[name], params, [grads], backend="eager")


def _odd_layouts() -> dict[str, torch.Tensor]:
    """One param of each layout a caller may pass (each large enough to be pooled)."""
    big = torch.randn(2 * BIG + 8, generator=torch.Generator().manual_seed(0))
    return {
        "contiguous": big[:BIG].clone(),
        "transposed": big[:BIG].clone().view(64, -1).t(),
        "permuted": big[:BIG].clone().view(16, 4, -1).permute(2, 0, 1),
        "sliced": big.view(-1, 2)[:BIG, :1],
        "expanded": big[: BIG // 4].view(-1, 1).expand(-1, 4),
        "expanded, transposed": big[: BIG // 4].view(-1, 1).expand(-1, 4).t(),
        "overlapping": big.as_strided((BIG, 4), (1, 1)),
        "zero stride": big.as_strided((BIG, 4), (1, 0)),
        "0-d": big[0].clone(),
        "empty": big[:0].view(0, 3),
        "float64": big[:BIG].double(),
        "bfloat16": big[:BIG].bfloat16().view(-1, 8).t(),
    }


def _grads_for(params, steps: int) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [{k: torch.randn(v.shape, generator=gen).to(v.dtype) for k, v in params.items()} for _ in range(steps)]


def test_permuted_and_self_overlapping_params_with_adamw():
    """Adam's division into a permuted buffer traces (Dynamo refuses a non-contiguous ``out=``);
    self-overlapping params are never written into."""
    params = _odd_layouts()
    _check_against_plain_step(_TRANSFORMATIONS["clip, then adamw"], params, _grads_for(params, 1), backend="eager")


def _keep_doubled_gradients() -> gtx.GradientTransformation:
    """Passes the gradients on and keeps twice them as its state, laid out as they are."""
    def init(params):
        return {k: torch.zeros_like(v) for k, v in params.items()}

    def update(updates, state, params=None, **_):
        return updates, {k: 2 * u for k, u in updates.items()}

    return gtx.GradientTransformation(init, update)


def test_an_output_keeps_the_layout_the_transformation_gives_it():
    """Buffers are laid out like the inputs; a state the transformation lays out otherwise (here
    contiguous, where the param and its initial state are transposed) is not written into one, so
    it keeps its own layout, as in the plain step."""
    params = {"w": torch.randn(16, 8).t()}
    grads = [{"w": torch.randn(8, 16)} for _ in range(2)]
    _check_against_plain_step(_keep_doubled_gradients, params, grads, backend="eager")


def test_every_param_layout_under_inductor_and_recycled_from_the_second_step():
    """Self-overlapping params (``expand``, ``as_strided`` with a zero or repeated stride) get the
    new dense tensor the plain step gives them, as do sliced ones, and permuted ones keep their
    layout; from the second step on every param's buffers are recycled."""
    params = _odd_layouts()
    del params["bfloat16"]  # Inductor keeps bfloat16 intermediates in float32: other numbers
    storages = _check_against_plain_step(_TRANSFORMATIONS["sgd with momentum"], params, _grads_for(params, 4))
    assert storages[3] == storages[1] and not storages[3] & storages[2]


# --------------------------------------------------------------------------- recompile limits


def _tree_of(n: int) -> dict[str, torch.Tensor]:
    return {str(i): torch.ones(2) for i in range(n)}


def test_each_step_has_a_recompile_limit_of_its_own():
    """Steps on different tree structures, more of them than the limit: each compiles its own."""
    tx = gtx.sgd(0.1)
    with torch._dynamo.config.patch(recompile_limit=1):
        for n in range(1, 4):
            step = gtx.compile_step(tx, backend="eager")
            params = _tree_of(n)
            new_params, _ = step(params, tx.init(params), params)
            assert torch.equal(new_params[str(n - 1)], torch.full((2,), 0.9))


def test_a_step_past_its_recompile_limit_says_so_and_keeps_recycling():
    tx = gtx.sgd(0.1)
    step = gtx.compile_step(tx, backend="eager")
    params = _tree(0)
    with torch._dynamo.config.patch(recompile_limit=2):
        params, state = step(_tree(1), tx.init(params), params)
        step(_tree_of(1), tx.init(_tree_of(1)), _tree_of(1))
        with pytest.raises(RuntimeError, match="this step hit its recompile limit") as caught:
            step(_tree_of(3), tx.init(_tree_of(3)), _tree_of(3))
        message = str(caught.value)
        assert "compiled 2 variants" in message and "recompile_limit = 2" in message
        assert "one compile_step per tree structure" in message
        del caught
        handed_out = []
        for i in range(4):  # the variants compiled still serve, and still recycle
            params, state = step(_tree(2 + i), state, params)
            handed_out.append({params[k].data_ptr() for k in ("w", "v")})
    assert handed_out[2] == handed_out[0] and handed_out[3] == handed_out[1]


# --------------------------------------------------------------------------- weak references


@pytest.mark.parametrize(
    ("make_ref", "read"),
    [
        (lambda s: weakref.ref(s), lambda ref: ref()),
        (StorageWeakRef, lambda ref: torch.UntypedStorage._new_with_weak_ptr(ref.cdata)),
    ],
    ids=["weakref", "StorageWeakRef"],
)
def test_a_weak_reference_to_an_output_never_sees_a_later_step(make_ref, read):
    """A weak reference to an output's storage keeps the storage out of the pool: it reads the
    output's values while the pool still keeps the storage, then dies with it (as it would after
    an eager step), where recycling would have shown it a later step's values."""
    tx = gtx.sgd(0.1)
    step = gtx.compile_step(tx, backend="eager")
    params = _tree(0)
    state = tx.init(params)
    params, state = step(_tree(1), state, params)
    ref = make_ref(params["v"].untyped_storage())
    expected = params["v"].clone()
    params, state = step(_tree(2), state, params)  # the output is dropped; the pool keeps its storage
    storage = read(ref)
    assert torch.equal(torch.empty(0).set_(storage, 0, expected.shape, expected.stride()), expected)
    del storage
    for i in range(3):
        params, state = step(_tree(3 + i), state, params)
    assert read(ref) is None


@pytest.mark.parametrize(
    "labels",
    [
        {"w": "adam", "v": "adam", "b": "sgd"},
        lambda tree: {key: "sgd" if key == "b" else "adam" for key in tree},
    ],
    ids=["dict", "callable"],
)
def test_partition_by_labels_compiles_to_the_eager_numbers(labels):
    """Labels given as a tree (not only as a callable) resolve inside the traced step."""
    tx = gtx.partition({"adam": gtx.adam(1e-2), "sgd": gtx.sgd(1e-2, momentum=0.9)}, labels)
    params = _tree(3, big=64)
    grads = {key: torch.ones_like(value) for key, value in params.items()}
    step = gtx.compile_step(tx, backend="eager")
    state = eager_state = tx.init(params)
    compiled_params = eager_params = params
    for _ in range(2):
        compiled_params, state = step(grads, state, compiled_params)
        updates, eager_state = tx.update(grads, eager_state, eager_params)
        eager_params = gtx.apply_updates(eager_params, updates)
    for key in params:
        assert torch.equal(compiled_params[key], eager_params[key]), key


# --------------------------------------------------------------------------- empty containers


@pytest.mark.parametrize("make", [_adamw_chain, lambda: gtx.observe(_adamw_chain())], ids=["adamw", "observe"])
def test_a_tree_holding_an_empty_dict_compiles(make):
    """A module with no params flattens to an empty dict, and ``observe`` without groups keeps an
    empty one in its state. optree 0.20 flattens an empty dict into metadata Dynamo cannot hold (an
    error before any step), hence ``optree<0.20`` in the requirements; this keeps the two apart."""
    tx = make()
    params = {"layer": {"w": torch.ones(3, 2)}, "frozen": {}}
    grads = {"layer": {"w": torch.full((3, 2), 0.5)}, "frozen": {}}
    state = eager_state = tx.init(params)
    step = gtx.compile_step(tx, backend="eager")
    eager_params = params
    for _ in range(2):
        params, state = step(grads, state, params)
        updates, eager_state = tx.update(grads, eager_state, eager_params)
        eager_params = gtx.apply_updates(eager_params, updates)
    assert params["frozen"] == {}
    torch.testing.assert_close(params["layer"]["w"], eager_params["layer"]["w"])


# --------------------------------------------------------------------------- donated params and state


def test_a_donated_step_stores_the_new_values_into_the_old_buffers():
    """Under Inductor: the numbers are the pure compiled step's bit for bit, every leaf of the new
    params and state is the tensor passed in (small and 0-d ones too), the generated code allocates
    none of them, and nothing is pooled."""
    from torch._inductor.utils import run_and_get_code

    tx = _adamw_chain()
    donating, pure = gtx.compile_step(tx, donate=True), gtx.compile_step(tx)
    params = _tree(0)
    state = tx.init(params)
    pure_params, pure_state = {k: v.clone() for k, v in params.items()}, tx.init(params)
    for i in range(4):
        grads = {k: v * (i + 1) for k, v in _tree(10 + i).items()}
        old = leaves((params, state))
        if i == 0:
            (params, state), codes = run_and_get_code(donating, grads, state, params)
            code = "\n".join(codes)
            assert "empty_strided_cpu((7, ), (1, ), torch.float32)" not in code
            assert f"empty_strided_cpu(({2 * BIG // 64}, 64)" not in code
        else:
            params, state = donating(grads, state, params)
        pure_params, pure_state = pure(grads, pure_state, pure_params)
        for path, new, before in zip(paths((params, state)), leaves((params, state)), old):
            if isinstance(before, torch.Tensor):
                assert new is before, path
        for path, got, want in zip(paths((params, state)), leaves((params, state)), leaves((pure_params, pure_state))):
            assert torch.equal(got, want), path
    assert donating.pool.kept_bytes() == 0


def _keep_params() -> gtx.GradientTransformation:
    """SGD whose state holds the param ``a`` itself (the very tensor), as a careless ``init`` might."""
    def init(params):
        return {"a": params["a"]}

    def update(updates, state, params=None, **_):
        return {k: -0.1 * u for k, u in updates.items()}, state

    return gtx.GradientTransformation(init, update)


def _shared_memory_cases():
    """Params (and a transformation) where some leaves share memory with another input leaf."""
    base = torch.randn(2 * BIG)
    tied = torch.randn(BIG)
    return {
        "tied weight held twice": (lambda: gtx.sgd(0.1, momentum=0.9), {"a": tied, "b": tied, "c": torch.randn(BIG)}, ()),
        "two views of one buffer": (lambda: gtx.adam(1e-2), {"a": base[:BIG], "b": base[BIG:], "c": torch.randn(BIG)}, ()),
        "a state leaf that is a param": (_keep_params, {"a": torch.randn(BIG), "c": torch.randn(BIG)}, ("a",)),
        "a gradient that is a param": (lambda: gtx.sgd(0.1, momentum=0.9), {"a": torch.randn(BIG), "c": torch.randn(BIG)}, ("a",)),
    }


@pytest.mark.parametrize("case", sorted(_shared_memory_cases()))
def test_a_leaf_sharing_memory_with_another_input_is_not_donated(case):
    """Writing it would change another leaf the step reads or returns: it gets a new tensor, the
    memory it shares keeps its values, a warning names it, and the numbers are the plain step's;
    ``c`` is donated."""
    make_tx, params, aliased = _shared_memory_cases()[case]
    tx = make_tx()
    grads = {k: torch.randn(v.shape) for k, v in params.items()}
    for key in aliased:
        if case == "a gradient that is a param":
            grads[key] = params[key]
    state = tx.init(params)
    snapshot = {k: v.clone() for k, v in params.items()}
    want_params, want_state = _plain_step(tx, grads, state, params)
    step = gtx.compile_step(tx, donate=True, backend="eager")
    with pytest.warns(UserWarning, match="not donated") as caught:
        new_params, new_state = step(grads, state, params)
    (message,) = [str(w.message) for w in caught]
    for key in params:
        assert (f"params.{key} (shares memory with another leaf of the inputs)" in message) == (key != "c"), message
        torch.testing.assert_close(new_params[key], want_params[key], rtol=0, atol=0)
        if key == "c":
            assert new_params[key] is params[key]
        else:
            assert new_params[key] is not params[key] and torch.equal(params[key], snapshot[key]), key
    for got, want in zip(leaves(new_state), leaves(want_state)):
        assert torch.equal(got, want)


def test_donated_params_of_every_layout():
    """Dense layouts (contiguous, transposed, permuted, 0-d, float64, bfloat16) take their new values
    in place; the views of one shared buffer (sliced, expanded, self-overlapping) and the empty param
    get new tensors and leave that buffer as it was, then take the next step's in place; the numbers
    are the plain step's."""
    params = _odd_layouts()
    big = params["sliced"]._base
    before = big.clone()
    tx = gtx.sgd(0.1, momentum=0.9)
    grads = _grads_for(params, 2)
    step = gtx.compile_step(tx, donate=True, backend="eager")
    trees, plain = (params, tx.init(params)), (_odd_layouts(), tx.init(_odd_layouts()))
    for i, g in enumerate(grads):
        old = dict(trees[0])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trees = step(g, trees[1], trees[0])
        if i == 0:
            (warning,) = caught
            assert "params.sliced (shares memory with another leaf of the inputs)" in str(warning.message)
        else:
            assert not caught
        plain = _plain_step(tx, g, plain[1], plain[0])
        for key, new in trees[0].items():
            torch.testing.assert_close(new, plain[0][key], rtol=0, atol=0, msg=lambda m: f"{key}: {m}")
            assert new.stride() == plain[0][key].stride() or new.numel() <= 1, key
            # from the second step on, every param with elements is a dense tensor of its own
            in_place = key in ("contiguous", "transposed", "permuted", "0-d", "float64", "bfloat16") or (i and key != "empty")
            assert (new is old[key]) == bool(in_place), key
    assert torch.equal(big, before)


def test_nothing_is_donated_where_a_graph_is_recorded():
    params = {k: v.requires_grad_() for k, v in _tree(0).items()}
    tx = gtx.adam(1e-2)
    step = gtx.compile_step(tx, donate=True, backend="aot_eager")
    state = tx.init(params)
    snapshot = [x.detach().clone() for x in leaves((params, state))]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no leaf is refused: a graph is recorded, nothing donated
        new_params, new_state = step(_tree(1), state, params)
    assert all(new_params[k] is not params[k] and new_params[k].requires_grad for k in params)
    for before, after in zip(snapshot, leaves((params, state))):
        assert torch.equal(before, after)


def test_donating_a_models_parameters_under_no_grad_trains_it_in_place():
    """The torch-style loop: the model's own parameters take the new values, which are the pure
    compiled step's bit for bit, and one graph serves every step of each."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    twin = {k: v.detach().clone() for k, v in model.named_parameters()}
    tx = _adamw_chain()
    step, pure = gtx.compile_step(tx, donate=True, backend="eager"), gtx.compile_step(tx, backend="eager")
    params = dict(model.named_parameters())
    state, twin_state = tx.init(params), tx.init(twin)
    data = torch.randn(32, 8), torch.randn(32, 1)
    counters.clear()
    for _ in range(3):
        model.zero_grad()
        torch.nn.functional.mse_loss(model(data[0]), data[1]).backward()
        grads = {k: p.grad for k, p in model.named_parameters()}
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("error")
            new_params, state = step(grads, state, params)
        assert all(new_params[k] is p for k, p in model.named_parameters())
        twin, twin_state = pure(grads, twin_state, twin)
        for k, p in model.named_parameters():
            torch.testing.assert_close(p.detach(), twin[k], rtol=0, atol=0)
    assert counters["stats"]["unique_graphs"] == 2  # one for each step, over the three steps


def test_a_tensor_subclass_is_not_donated_and_the_warning_says_why():
    class Tagged(torch.Tensor):
        pass

    tagged = torch.randn(4).as_subclass(Tagged)
    plain = torch.randn(4)
    assert compiled_step.donatable([tagged, plain], [torch.randn(4)]) == [False, True]
    assert compiled_step._refusal(tagged) == "a Tagged, not a plain tensor"


# --------------------------------------------------------------------------- fusion of statistics


def test_statistics_share_the_update_loops_however_many_leaves():
    """observe's norms and maxima read what the update reads: under compile_step they join its
    loops. Inductor alone keeps reductions more than 64 graph nodes apart out of one loop, which on
    8 leaves of 2048 values gave 20 loops over whole leaves (2.5 a leaf, one more pass over memory
    for most statistics) against 12 here; and this thread's own Inductor choices are back after."""
    import re

    from torch._inductor.utils import run_and_get_code
    from torch._inductor.virtualized import V

    tx = gtx.observe(_adamw_chain(), groups=lambda path: path)  # a group per leaf
    params = {f"w{i}": torch.randn(64, 32) for i in range(8)}
    grads = {k: torch.randn_like(v) for k, v in params.items()}
    with torch._inductor.config.patch(fx_graph_cache=False):
        _, codes = run_and_get_code(gtx.compile_step(tx, recycle=False), grads, tx.init(params), params)
    bounds = re.findall(r"for\(int64_t x0=static_cast<int64_t>\(0L\); x0<static_cast<int64_t>\((\d+)L\)", "\n".join(codes))
    whole_leaf_loops = sum(1 for bound in bounds if int(bound) >= 512)
    assert 8 <= whole_leaf_loops <= 14, whole_leaf_loops
    assert type(V.choices).__name__ != "FusingReductions"


def test_a_state_for_other_params_after_a_good_step_names_the_leaf():
    """Traced anew for new shapes, the step would fail inside a fake tensor's broadcast: it runs
    once eagerly instead, whose check names the state's leaf."""
    tx = gtx.adam(1e-2)
    params, grads = {"w": torch.ones(3)}, {"w": torch.ones(3)}
    step = gtx.compile_step(tx, backend="eager")
    step(grads, tx.init(params), params)
    with pytest.raises(ValueError, match=r"adam: state\[0\]\.mu\['w'\] has shape \(4,\), where init makes \(3,\)"):
        step(grads, tx.init({"w": torch.ones(4)}), params)


@pytest.mark.parametrize(
    "name, make",
    [
        ("add_noise", lambda: gtx.noisy_sgd(0.1)),
        ("add_noise", lambda: gtx.chain(gtx.clip_by_global_norm(1.0), gtx.masked(gtx.add_noise(0.1, 0.5), {"w": True}))),
        ("differentially_private_aggregate", lambda: gtx.dpsgd(0.1, 1.0, 0.1, seed=0)),
        ("hutchinson_estimator_diag_hessian", lambda: gtx.contrib.sophia(0.1)),
    ],
)
def test_a_step_drawing_from_a_generator_is_refused_up_front_by_name(name, make):
    """torch.compile cannot trace a generator built from a state tensor: compile_step names the
    member at any depth before tracing, instead of Dynamo's error from inside the graph."""
    with pytest.raises(ValueError, match=rf"compile_step: {name} draws .*torch\.Generator.*run this step eagerly"):
        gtx.compile_step(make())
