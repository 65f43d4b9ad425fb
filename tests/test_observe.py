"""gtx.observe: per-group statistics against references computed here from the whole tensors
(torch.linalg.vector_norm over each group's leaves, in float64), updates untouched, groupings,
the clip's coefficient, errors, wrap and compile."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
from torch._dynamo.utils import counters
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

import gradtx as gtx
from gradtx.native import checks as native_checks
from gradtx.native import observed as native_observed
from gradtx.sharding import statistics as stats_lib

RTOL = 1e-5  # float32 leaves: per-leaf sums accumulate in float32, the rest in float64


def _tree(seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen).to(dtype)  # noqa: E731
    return {
        "embed": {"weight": r(6, 4)},
        "layers": [{"attn": {"weight": r(4, 4), "bias": r(4)}, "mlp": {"weight": r(8, 4)}} for _ in range(2)],
        "head": {"weight": r(3, 4)},
    }


def _flat(tree):
    return dict(zip(gtx.tree.paths(tree), gtx.tree.leaves(tree)))


def _norm(tensors):
    if not tensors:
        return torch.zeros((), dtype=torch.float64)
    return torch.linalg.vector_norm(torch.cat([t.reshape(-1).to(torch.float64) for t in tensors]))


def _reference(grads, params, members, prev=None):
    """Dense statistics of the leaves whose paths are in ``members``; ``prev``: the updates and params
    of the step before (the update statistics are that step's), or ``None`` at the first step."""
    g, p = _flat(grads), _flat(params)
    present = [k for k in members if g[k] is not None]
    gs = [g[k] for k in present]
    gn = _norm(gs)
    nan = torch.tensor(math.nan, dtype=torch.float64)
    un, pn, ratio = nan, nan, nan
    if prev is not None:
        u, prev_p = _flat(prev[0]), _flat(prev[1])
        un, pn = _norm([u[k] for k in present]), _norm([prev_p[k] for k in present])
        ratio = un / pn
    cat = torch.cat([t.reshape(-1).to(torch.float64) for t in gs]) if gs else torch.zeros(0, dtype=torch.float64)
    return {
        "grad_norm": gn,
        "prev_update_norm": un,
        "prev_param_norm": pn,
        "prev_update_ratio": ratio,
        "grad_max": cat.abs().max() if cat.numel() else torch.zeros((), dtype=torch.float64),
        "grad_nonfinite": (~torch.isfinite(cat)).sum().to(torch.float64),
    }


def _two_steps(tx, params, grads):
    """Two observed steps (the second's gradients are the first's halved, at the params the first
    step's updates gave): ``(state after step 1, state after step 2, updates of step 1, the second
    step's gradients and params)``."""
    state = tx.init(params)
    updates, first = tx.update(grads, state, params)
    params2 = gtx.apply_updates(params, updates)
    grads2 = gtx.tree.tree_map(lambda g: g * 0.5, grads)
    _, second = tx.update(grads2, first, params2)
    return first, second, updates, grads2, params2


def _assert_stats(stats, expected, what, rtol=RTOL):
    for name, value in zip(gtx.chains.observing.STATISTICS, stats):
        torch.testing.assert_close(
            value.to(torch.float64), expected[name], rtol=rtol, atol=1e-7, equal_nan=True, msg=lambda m: f"{what} {name}: {m}"
        )


def _inner():
    return gtx.chain(gtx.clip_by_global_norm(1.0), gtx.adamw(1e-2, weight_decay=0.1))


def test_groups_by_depth_match_dense_references_and_updates_pass_untouched():
    params, grads = _tree(0), _tree(1)
    tx = gtx.observe(_inner(), groups=2)
    updates, _ = tx.update(grads, tx.init(params), params)
    plain, _ = _inner().update(grads, _inner().init(params), params)
    for a, b in zip(gtx.tree.leaves(updates), gtx.tree.leaves(plain)):
        assert torch.equal(a, b)
    first, state, updates, grads2, params2 = _two_steps(tx, params, grads)
    paths = gtx.tree.paths(grads)
    assert list(state.groups) == ["embed.weight", "head.weight", "layers.0", "layers.1"]
    _assert_stats(first.total, _reference(grads, params, paths), "first total")
    _assert_stats(state.total, _reference(grads2, params2, paths, (updates, params)), "total")
    for name in state.groups:
        members = [p for p in paths if p == name or p.startswith(name + ".")]
        _assert_stats(first.groups[name], _reference(grads, params, members), "first " + name)
        _assert_stats(state.groups[name], _reference(grads2, params2, members, (updates, params)), name)


def test_update_statistics_are_the_step_befores():
    params, grads = _tree(0), _tree(1)
    tx = gtx.observe(gtx.sgd(1.0), groups=1)
    first, second, updates, _, _ = _two_steps(tx, params, grads)
    assert math.isnan(float(first.total.prev_update_norm)) and math.isnan(float(first.groups["layers"].prev_update_ratio))
    # sgd(1.0)'s update is -grads: the second step reports the first step's gradient norm
    torch.testing.assert_close(second.total.prev_update_norm, first.total.grad_norm, rtol=1e-6, atol=0)
    assert math.isnan(float(first.total.prev_param_norm))
    first_params = torch.linalg.vector_norm(torch.cat([p.reshape(-1).double() for p in gtx.tree.leaves(params["layers"])]))
    torch.testing.assert_close(second.groups["layers"].prev_param_norm, first_params.float(), rtol=1e-6, atol=0)
    torch.testing.assert_close(second.groups["layers"].prev_update_ratio, first.groups["layers"].grad_norm / first_params.float(), rtol=1e-6, atol=0)


@pytest.mark.parametrize(
    "groups, expected",
    [
        ("module", {"embed": ["embed.weight"], "layers.0.attn": ["layers.0.attn.bias", "layers.0.attn.weight"]}),
        (1, {"layers": [f"layers.{i}.{m}" for i in range(2) for m in ("attn.bias", "attn.weight", "mlp.weight")]}),
        (["*.attn.*", ("*.mlp.*", "mlp")], {"*.attn.*": [f"layers.{i}.attn.{w}" for i in range(2) for w in ("bias", "weight")],
                                             "mlp": ["layers.0.mlp.weight", "layers.1.mlp.weight"]}),
        (lambda path: "big" if path.endswith("weight") else None, {"big": None}),
    ],
)
def test_every_kind_of_grouping(groups, expected):
    params, grads = _tree(2), _tree(3)
    tx = gtx.observe(gtx.sgd(0.1), groups=groups)
    _, state, updates, grads2, params2 = _two_steps(tx, params, grads)
    paths = gtx.tree.paths(grads)
    for name, members in expected.items():
        if members is None:
            members = [p for p in paths if p.endswith("weight")]
        _assert_stats(state.groups[name], _reference(grads2, params2, members, (updates, params)), str(name))
    if isinstance(groups, list):
        assert list(state.groups) == ["*.attn.*", "mlp"]  # the embedding and head are in no group


def test_first_matching_glob_wins():
    params = _tree(0)
    tx = gtx.observe(gtx.sgd(0.1), groups=[("layers.0.*", "first"), ("layers.*", "rest")])
    _, state = tx.update(params, tx.init(params), params)
    flat = _flat(params)
    expected = _norm([v for k, v in flat.items() if k.startswith("layers.1")])
    torch.testing.assert_close(state.groups["rest"].grad_norm.double(), expected, rtol=RTOL, atol=0)


def test_clip_coefficient_and_flag_follow_torch():
    params, grads = _tree(0), _tree(1)
    for max_norm in (0.5, 1e3):
        inner = gtx.chain(gtx.clip_by_global_norm(max_norm), gtx.sgd(1.0))
        tx = gtx.observe(inner)
        _, state = tx.update(grads, tx.init(params), params)
        norm = torch.nn.utils.get_total_norm(gtx.tree.leaves(grads))
        coef = min(1.0, max_norm / (float(norm) + 1e-6))
        assert math.isclose(float(state.clip.norm), float(norm), rel_tol=1e-6)
        assert math.isclose(float(state.clip.coefficient), coef, rel_tol=1e-6)
        assert bool(state.clip.clipped) == (coef < 1.0)
    # the leading clip of a named_chain, or one made by inject_hyperparams, is found too
    for inner in (
        gtx.named_chain(("clip", gtx.clip_by_global_norm(0.5)), ("sgd", gtx.sgd(1.0))),
        gtx.chain(gtx.inject_hyperparams(gtx.clip_by_global_norm)(max_norm=0.5), gtx.sgd(1.0)),
    ):
        tx = gtx.observe(inner)
        _, state = tx.update(grads, tx.init(params), params)
        assert math.isclose(float(state.clip.coefficient), 0.5 / (float(norm) + 1e-6), rel_tol=1e-6)
    # a clip alone, not in a chain, is found too; no clip: no clip statistics
    assert gtx.observe(gtx.clip_by_global_norm(1.0)).init(params).clip is not None
    assert gtx.observe(gtx.sgd(0.1)).init(params).clip is None


def test_non_finite_gradients_are_counted():
    params, grads = _tree(0), _tree(1)
    grads["layers"][1]["mlp"]["weight"][0, :3] = torch.tensor([math.nan, math.inf, -math.inf])
    tx = gtx.observe(gtx.sgd(0.1), groups=2)
    _, state = tx.update(grads, tx.init(params), params)
    assert int(state.total.grad_nonfinite) == 3
    assert int(state.groups["layers.1"].grad_nonfinite) == 3
    assert int(state.groups["layers.0"].grad_nonfinite) == 0
    assert math.isnan(float(state.groups["layers.1"].grad_max))
    assert state.groups["layers.1"].grad_nonfinite.dtype == torch.int64


def _non_finite_tree():
    """Leaves of several dtypes, NaN and infinities in some, one finite leaf whose 2-norm overflows
    float32 (its maximum is finite: no element of it is counted), an empty one."""
    gen = torch.Generator().manual_seed(3)
    grads = {
        "a": {"w": torch.randn(5, 3, generator=gen), "b": torch.randn(3, generator=gen)},
        "b": {"w": torch.randn(4, 4, generator=gen).half(), "e": torch.zeros(0)},
        "c": {"w": torch.full((2, 3), 1e30), "v": torch.randn(7, generator=gen, dtype=torch.float64)},
    }
    grads["a"]["w"][1, 2], grads["a"]["w"][4, 0] = math.nan, -math.inf
    grads["b"]["w"][0, 0] = math.inf
    grads["c"]["v"][3] = math.nan
    return grads


def test_non_finite_elements_are_counted_exactly_in_every_leaf():
    grads = _non_finite_tree()
    params = gtx.tree.tree_map(torch.ones_like, grads)
    tx = gtx.observe(gtx.sgd(0.1), groups=1)
    _, state = tx.update(grads, tx.init(params), params)
    flat = _flat(grads)
    for name in ("a", "b", "c"):
        expected = sum(int((~torch.isfinite(g)).sum()) for k, g in flat.items() if k.startswith(name + "."))
        assert int(state.groups[name].grad_nonfinite) == expected, name
    assert int(state.total.grad_nonfinite) == 4
    assert math.isinf(float(state.groups["b"].grad_max)) and math.isnan(float(state.groups["c"].grad_max))
    assert math.isnan(float(state.groups["a"].grad_max)) and math.isnan(float(state.total.grad_max))


def test_non_finite_counts_without_reading_the_maxima_on_the_host_are_the_same(monkeypatch):
    # compiled, or off the CPU, every leaf is counted (no host sync): the same numbers as the
    # eager CPU path, which counts only the leaves whose maximum is not finite
    tensors = list(_flat(_non_finite_tree()).values())
    device = torch.device("cpu")
    maxima = stats_lib.leaf_maxima(tensors, device)
    expected = torch.tensor([float((~torch.isfinite(t)).sum()) for t in tensors], dtype=torch.float64)
    assert torch.equal(stats_lib._nonfinite_counts(tensors, maxima, device), expected)
    monkeypatch.setattr(stats_lib.torch.compiler, "is_compiling", lambda: True)
    assert torch.equal(stats_lib._nonfinite_counts(tensors, maxima, device), expected)


def test_leaf_maxima_are_the_inf_norms():
    tensors = list(_flat(_non_finite_tree()).values()) + [torch.zeros(3), -torch.arange(4.0), torch.randn(3, dtype=torch.complex64)]
    maxima = stats_lib.leaf_maxima(tensors, torch.device("cpu"))
    expected = torch.stack([torch.linalg.vector_norm(t, math.inf).double() if t.numel() else torch.zeros((), dtype=torch.float64) for t in tensors])
    assert maxima.dtype == torch.float64  # one leaf is float64
    torch.testing.assert_close(maxima, expected, rtol=0, atol=0, equal_nan=True)
    assert not torch.signbit(maxima[-3])  # max |0| is +0


class _Reads(TorchDispatchMode):
    """Counts the ops that take one of ``watched``'s storages as input (views, and ``empty_like``,
    which reads no value, aside)."""

    def __init__(self, watched):
        super().__init__()
        self.watched, self.count = {t.data_ptr() for t in watched}, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view and torch.Tag.view_copy not in func.tags and func is not torch.ops.aten.empty_like.default:
            inputs = [a for a in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
            self.count += sum(1 for a in inputs if a.data_ptr() in self.watched)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("native", [False, True], ids=["aten", "native"])
def test_statistics_read_a_finite_gradient_no_more_than_once_more_than_the_step(native):
    # the leading clip's norm comes from the statistics' per-leaf norms; with the ATen ops the
    # maxima take one pass (a finite gradient needs no non-finite count of its own); with the
    # native kernel they are read where the clip scales the gradients: no pass of their own
    if native and native_observed.usable() is None:
        pytest.skip(f"no native kernel: {native_observed.status()}")
    params, grads = _tree(0), _tree(1)
    inner = lambda: gtx.chain(gtx.clip_by_global_norm(0.5), gtx.sgd(1.0))  # noqa: E731
    reads = []
    with contextlib.nullcontext() if native else native_checks.aten_only():
        for tx in (inner(), gtx.observe(inner(), groups=2)):
            state = tx.init(params)
            tx.update(grads, state, params)  # groups and plans: once
            scaled = native_observed.usable().scaled if native else 0
            with _Reads(gtx.tree.leaves(grads)) as mode:
                tx.update(grads, state, params)
            reads.append(mode.count + (native_observed.usable().scaled - scaled if native else 0))
    assert reads[1] - reads[0] == (0 if native else len(gtx.tree.leaves(grads))), reads


@pytest.mark.parametrize("norm_type", [2.0, math.inf, 1.0])
def test_leading_clip_gives_its_own_numbers_bit_for_bit(norm_type):
    gen = torch.Generator().manual_seed(4)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    grads = {"h": r(4, 3).half(), "f": r(5), "d": r(2, 3).double(), "b": r(6).bfloat16(), "g": r(3, 3)}
    params = gtx.tree.tree_map(torch.ones_like, grads)
    inner = lambda: gtx.chain(gtx.clip_by_global_norm(0.1, norm_type=norm_type), gtx.sgd(1.0))  # noqa: E731
    plain, plain_state = inner().update(grads, inner().init(params), params)
    tx = gtx.observe(inner(), groups=1)
    observed, state = tx.update(grads, tx.init(params), params)
    for a, b in zip(gtx.tree.leaves(plain), gtx.tree.leaves(observed)):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert torch.equal(state.clip.norm, plain_state[0].norm) and bool(state.clip.clipped)


def test_none_gradients_are_left_out_and_params_optional():
    params, grads = _tree(0), _tree(1)
    grads["head"]["weight"] = None
    tx = gtx.observe(gtx.sgd(0.1), groups=1)
    _, state, updates, grads2, params2 = _two_steps(tx, params, grads)
    members = [p for p in gtx.tree.paths(grads) if p != "head.weight"]
    _assert_stats(state.total, _reference(grads2, params2, members, (updates, params)), "total")
    assert float(state.groups["head"].grad_norm) == 0.0
    _, state = tx.update(grads, state)  # no params: their norm is NaN at the next step, and so is the ratio
    assert not math.isnan(float(state.total.prev_param_norm))  # the step before had params
    _, state = tx.update(grads, state, params)
    assert math.isnan(float(state.total.prev_param_norm)) and math.isnan(float(state.total.prev_update_ratio))
    assert not math.isnan(float(state.total.prev_update_norm))


def test_float64_trees_are_exact_to_float64_rounding():
    params, grads = _tree(0, torch.float64), _tree(1, torch.float64)
    tx = gtx.observe(gtx.sgd(0.1), groups="module")
    _, state, updates, grads2, params2 = _two_steps(tx, params, grads)
    assert state.total.grad_norm.dtype == torch.float64
    _assert_stats(state.total, _reference(grads2, params2, gtx.tree.paths(grads), (updates, params)), "total", rtol=1e-12)


def test_donated_path_gives_the_same_updates_and_statistics():
    params, grads = _tree(0), _tree(1)
    tx = gtx.observe(_inner(), groups=2)
    state = tx.init(params)
    pure, pure_state = tx.update(grads, state, params)
    donated = gtx.tree.tree_map(torch.clone, grads)
    inplace, inplace_state = tx.update(donated, tx.init(params), params, inplace=True)
    for a, b in zip(gtx.tree.leaves((pure, pure_state)), gtx.tree.leaves((inplace, inplace_state))):
        assert torch.equal(a, b) or (a.isnan().all() and b.isnan().all())  # NaN: no step before the first


def test_observations_is_a_flat_dict_of_floats():
    params, grads = _tree(0), _tree(1)
    tx = gtx.chain(gtx.observe(_inner(), groups=1), gtx.scale(1.0))
    state = tx.init(params)
    _, state = tx.update(grads, state, params)
    logged = gtx.observations(state)
    assert all(type(v) is float for v in logged.values())
    observed = state[0]
    assert logged["grad_norm/layers"] == float(observed.groups["layers"].grad_norm)
    assert math.isnan(logged["prev_param_norm"]) and math.isnan(float(observed.total.prev_param_norm))
    assert math.isnan(logged["prev_update_ratio"])  # the first step has no step before
    assert logged["clip/coefficient"] == float(observed.clip.coefficient)
    assert logged["clip/clipped"] in (0.0, 1.0)
    assert set(gtx.observations(state, prefix="opt/")) == {"opt/" + k for k in logged}
    with pytest.raises(KeyError, match="no gradtx.observe state"):
        gtx.observations(_inner().init(params))


def test_bad_groups_name_the_problem():
    params = _tree(0)
    with pytest.raises(ValueError, match=r"glob '\*\.atn\.\*' matches no leaf path \(the nearest: 'layers"):
        gtx.observe(gtx.sgd(0.1), groups=["*.attn.*", "*.atn.*"]).init(params)
    with pytest.raises(TypeError, match=r"returned 3 \(a int\) for leaf 'embed.weight'"):
        gtx.observe(gtx.sgd(0.1), groups=lambda path: 3).init(params)
    with pytest.raises(TypeError, match="groups must be"):
        gtx.observe(gtx.sgd(0.1), groups=3.5)
    with pytest.raises(ValueError, match="only string accepted is 'module'"):
        gtx.observe(gtx.sgd(0.1), groups="layers")
    with pytest.raises(TypeError, match="group rule must be"):
        gtx.observe(gtx.sgd(0.1), groups=[("a", 1)])
    with pytest.raises(ValueError, match="depth"):
        gtx.observe(gtx.sgd(0.1), groups=0)


def test_a_gradient_of_an_integer_dtype_is_refused_by_name():
    params = _tree(0)
    grads = dict(params, embed={"weight": params["embed"]["weight"].to(torch.int64)})
    tx = gtx.observe(gtx.chain(gtx.clip_by_global_norm(1.0), gtx.sgd(0.1)))
    with pytest.raises(TypeError, match=r"leaf 'embed.weight' is a torch.int64 tensor; observe's gradients must be floating point"):
        tx.update(grads, tx.init(params), params)


def test_through_wrap():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))
    opt = gtx.wrap(torch.optim.SGD(model.parameters(), lr=0.1), gtx.observe(gtx.clip_by_global_norm(0.1), groups="module"), model=model)
    model(torch.randn(5, 4)).square().sum().backward()
    grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    opt.step()
    logged = gtx.observations(opt)
    for module in ("0", "2"):
        expected = _norm([g for k, g in grads.items() if k.startswith(module + ".")])
        assert math.isclose(logged[f"grad_norm/{module}"], float(expected), rel_tol=RTOL)
    assert logged["clip/clipped"] == 1.0
    # a wrapper holding the optimizer as .optimizer (Lightning's, accelerate's) is seen through
    outer = torch.optim.Optimizer.__new__(torch.optim.Optimizer)
    outer.optimizer = opt
    through = gtx.observations(type("Wrapper", (), {"optimizer": outer})())
    assert through.keys() == logged.keys()
    assert all(through[k] == v or (math.isnan(through[k]) and math.isnan(v)) for k, v in logged.items())


def test_compiled_step_records_the_same_statistics():
    # two groups of one and two leaves: what tracing must get right, at a small tree's trace cost
    params, grads = ({"layers": t["layers"][0], "head": t["head"]} for t in (_tree(0), _tree(1)))
    tx = gtx.observe(_inner(), groups=1)
    state = tx.init(params)
    with native_checks.aten_only():  # the ops the trace records (eagerly, the kernels sum in float64)
        eager_params, eager_state = gtx.apply_updates(params, tx.update(grads, state, params)[0]), tx.update(grads, state, params)[1]
    step = gtx.compile_step(tx, backend="eager")
    new_params, new_state = step(grads, state, params)
    compiled, eager = gtx.observations(new_state), gtx.observations(eager_state)
    assert compiled.keys() == eager.keys()
    for key, value in compiled.items():  # the same operations, traced: the same numbers
        assert value == eager[key] or (math.isnan(value) and math.isnan(eager[key])), key
    assert len([key for key in compiled if key.startswith("grad_norm/")]) == 2
    for a, b in zip(gtx.tree.leaves(new_params), gtx.tree.leaves(eager_params)):
        torch.testing.assert_close(a, b)


def test_one_compiled_graph_serves_the_first_step_and_the_later_ones():
    """The state ``init`` makes is laid out as the states the steps return (no leaf aliasing
    another), so a compiled step built on it serves every later step without compiling again."""
    params, grads = ({"layers": t["layers"][0], "head": t["head"]} for t in (_tree(0), _tree(1)))
    tx = gtx.observe(_inner(), groups=1)
    state = tx.init(params)
    step = gtx.compile_step(tx, backend="eager")
    counters.clear()
    for _ in range(3):
        params, state = step(grads, state, params)
    assert counters["stats"]["unique_graphs"] == 1


# --------------------------------------------------------------------------- properties


@st.composite
def _trees_and_groupings(draw):
    n = draw(st.integers(1, 7))
    shapes = [tuple(draw(st.lists(st.integers(0, 4), min_size=0, max_size=3))) for _ in range(n)]
    names = [f"m{draw(st.integers(0, 2))}.l{i}" for i in range(n)]
    labels = draw(st.lists(st.sampled_from(["a", "b", "c", None]), min_size=n, max_size=n))
    seed = draw(st.integers(0, 2**16))
    return dict(zip(names, shapes)), dict(zip(names, labels)), seed


@settings(max_examples=30, deadline=None)
@given(_trees_and_groupings())
def test_group_statistics_equal_dense_for_random_trees_and_groupings(drawn):
    shapes, labels, seed = drawn
    gen = torch.Generator().manual_seed(seed)
    params = {k: torch.randn(s, generator=gen) for k, s in shapes.items()}
    grads = {k: torch.randn(s, generator=gen) for k, s in shapes.items()}
    tx = gtx.observe(gtx.adam(1e-2), groups=lambda path: labels[path])
    _, state, updates, grads2, params2 = _two_steps(tx, params, grads)
    for name in set(labels.values()) - {None}:
        members = [k for k, label in labels.items() if label == name]
        _assert_stats(state.groups[name], _reference(grads2, params2, members, (updates, params)), name)
    _assert_stats(state.total, _reference(grads2, params2, list(shapes), (updates, params)), "total")


@pytest.mark.parametrize("poison", [None, math.nan, math.inf])
def test_statistics_finished_on_the_host_equal_the_tensor_ops(monkeypatch, poison):
    # eagerly on the CPU the sums and the statistics are host floats; elsewhere the same numbers
    # come from tensor ops: the groups' sums and every rounding must agree (the total's sum may add
    # the leaves in another order: its last bits may differ); 48 one-leaf groups and two-leaf ones
    gen = torch.Generator().manual_seed(3)
    params, grads = ({f"block{i}": {"w": torch.randn(1 + i, 3, generator=gen), "b": torch.randn(i, generator=gen)} for i in range(24)} for _ in range(2))
    if poison is not None:
        grads["block5"]["w"][2, 1] = poison
        grads["block9"]["b"][0] = -poison
    tx = gtx.observe(_inner(), groups="module" if poison is None else 1)

    def run():
        first, second, *_ = _two_steps(tx, params, grads)
        return second

    host = run()
    observing = gtx.chains.observing
    monkeypatch.setattr(observing, "_on_host", lambda *args: False)
    monkeypatch.setattr(  # the per-column tensor ops that compiled steps and accelerators run
        observing, "_host_stats", lambda rows, maxima, dtype: [
            observing._stats_of(torch.tensor(rows, dtype=torch.float64), torch.tensor(maxima, dtype=torch.float64), column, dtype)
            for column in range(len(maxima))
        ],
    )
    ops = run()
    for name in host.groups:
        for stat, a, b in zip(gtx.chains.observing.STATISTICS, host.groups[name], ops.groups[name]):
            assert a.dtype == b.dtype and (torch.equal(a, b) or bool(a.isnan() & b.isnan())), (name, stat, a, b)
    for stat, a, b in zip(gtx.chains.observing.STATISTICS, host.total, ops.total):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=0, equal_nan=True, msg=lambda m: f"total {stat}: {m}")
    assert torch.equal(host.pending_sq.isnan(), ops.pending_sq.isnan())
    torch.testing.assert_close(host.pending_sq, ops.pending_sq, rtol=1e-12, atol=0, equal_nan=True)
    for a, b in zip(host.clip, ops.clip):
        assert torch.equal(a, b) or bool(a.isnan() & b.isnan())
