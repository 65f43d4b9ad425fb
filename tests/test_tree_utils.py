"""gradtx.tree_utils against optax.tree_utils' definitions, written out in numpy float64.

Every reference works on the leaves as float64 numpy arrays (reductions on their concatenation),
independently of the code under test.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import gradtx
from gradtx import tree as tree_lib
from gradtx import tree_utils as tu

# optax 0.2.8's optax.tree_utils: its public names, and its deprecated aliases (kept here).
OPTAX_NAMES = {
    "NamedTupleKey", "tree_add", "tree_add_scale", "tree_allclose", "tree_batch_shape", "tree_bias_correction",
    "tree_cast", "tree_cast_like", "tree_clip", "tree_conj", "tree_div", "tree_dtype", "tree_full_like",
    "tree_get", "tree_get_all_with_path", "tree_map_params", "tree_max", "tree_min", "tree_mul", "tree_norm",
    "tree_ones_like", "tree_random_like", "tree_real", "tree_scale", "tree_set", "tree_size",
    "tree_split_key_like", "tree_sub", "tree_sum", "tree_unwrap_random_key_data", "tree_update_infinity_moment",
    "tree_update_moment", "tree_update_moment_per_elem_norm", "tree_vdot", "tree_where", "tree_zeros_like",
}
OPTAX_DEPRECATED = {"tree_scalar_mul", "tree_add_scalar_mul", "tree_l1_norm", "tree_l2_norm", "tree_linf_norm"}


class Pair(NamedTuple):
    mu: object
    nu: object


def make_tree(seed: int = 0, *, low_precision: bool = False):
    """A nested dict / list / tuple / NamedTuple tree with a None leaf and float32/float64 leaves."""
    g = torch.Generator().manual_seed(seed)
    low = torch.bfloat16 if low_precision else torch.float32
    return {
        "w": torch.randn(3, 4, generator=g),
        "layers": [
            {"kernel": torch.randn(2, 3, generator=g, dtype=torch.float64), "bias": None},
            (torch.randn(5, generator=g).to(low), torch.randn((), generator=g)),
        ],
        "state": Pair(mu=torch.randn(2, generator=g, dtype=torch.float64), nu=torch.randn(1, 2, generator=g)),
    }


def np_leaves(tree):
    """The non-None leaves as float64 (or complex128) numpy arrays, in flattening order."""
    out = []
    for leaf in tree_lib.leaves(tree):
        if leaf is None:
            continue
        t = leaf.detach()
        out.append(t.to(torch.complex128).numpy() if t.is_complex() else t.to(torch.float64).numpy())
    return out


def flat(tree):
    arrays = np_leaves(tree)
    return np.concatenate([a.reshape(-1) for a in arrays]) if arrays else np.zeros(0)


def tolerance(dtype):
    return {torch.float64: 1e-12, torch.float32: 1e-6, torch.bfloat16: 1e-2, torch.float16: 1e-3}[dtype]


def assert_tree_matches(result, expected_arrays, reference_tree):
    """``result`` has ``reference_tree``'s structure, None leaves and dtypes, and values ``expected_arrays``."""
    assert tree_lib.structure(result) == tree_lib.structure(reference_tree)
    expected = iter(expected_arrays)
    for got, ref in zip(tree_lib.leaves(result), tree_lib.leaves(reference_tree)):
        if ref is None:
            assert got is None
            continue
        assert got.dtype == ref.dtype and got.shape == ref.shape
        want = next(expected)
        tol = tolerance(got.dtype)
        np.testing.assert_allclose(got.to(torch.float64).numpy(), want, rtol=tol, atol=tol)


# --------------------------------------------------------------------------- names and docs


def test_every_optax_name_is_here_and_documented():
    assert set(tu.__all__) == OPTAX_NAMES | OPTAX_DEPRECATED
    for name in tu.__all__:
        obj = getattr(tu, name)
        assert obj.__doc__ and obj.__doc__.strip(), name
    assert gradtx.tree_utils is tu


def test_deprecated_aliases_are_the_new_functions():
    a, b = make_tree(0), make_tree(1)
    for got, want in [
        (tu.tree_scalar_mul(2.0, a), tu.tree_scale(2.0, a)),
        (tu.tree_add_scalar_mul(a, 0.5, b), tu.tree_add_scale(a, 0.5, b)),
    ]:
        assert bool(tu.tree_allclose(got, want, rtol=0, atol=0))
    assert tu.tree_l1_norm(a) == tu.tree_norm(a, ord=1)
    assert tu.tree_l2_norm(a, squared=True) == tu.tree_norm(a, squared=True)
    assert tu.tree_linf_norm(a) == tu.tree_norm(a, ord="inf")


# --------------------------------------------------------------------------- arithmetic


@pytest.mark.parametrize(
    "fn, op",
    [(tu.tree_sub, np.subtract), (tu.tree_mul, np.multiply), (tu.tree_div, np.divide)],
)
def test_binary_ops(fn, op):
    a, b = make_tree(0), make_tree(1)
    result = fn(a, b)
    assert_tree_matches(result, [op(x, y) for x, y in zip(np_leaves(a), np_leaves(b))], a)


def test_tree_add_several_trees():
    a, b, c = make_tree(0), make_tree(1), make_tree(2)
    expected = [x + y + z for x, y, z in zip(np_leaves(a), np_leaves(b), np_leaves(c))]
    assert_tree_matches(tu.tree_add(a, b, c), expected, a)
    assert_tree_matches(tu.tree_add(a, b), [x + y for x, y in zip(np_leaves(a), np_leaves(b))], a)


def test_low_precision_leaves_keep_their_dtype():
    a, b = make_tree(0, low_precision=True), make_tree(1, low_precision=True)
    assert_tree_matches(tu.tree_add(a, b), [x + y for x, y in zip(np_leaves(a), np_leaves(b))], a)
    assert_tree_matches(tu.tree_scale(torch.tensor(0.3, dtype=torch.float64), a), [0.3 * x for x in np_leaves(a)], a)


@pytest.mark.parametrize("scalar", [0.5, torch.tensor(-1.5), torch.tensor(2.0, dtype=torch.float64)])
def test_tree_scale_and_add_scale(scalar):
    a, b = make_tree(0), make_tree(1)
    s = float(scalar)
    assert_tree_matches(tu.tree_scale(scalar, a), [s * x for x in np_leaves(a)], a)
    assert_tree_matches(tu.tree_add_scale(a, scalar, b), [x + s * y for x, y in zip(np_leaves(a), np_leaves(b))], a)


def test_single_tensor_tree_with_a_number():
    x = torch.tensor([1.0, 2.0])
    torch.testing.assert_close(tu.tree_add(x, 1.0), torch.tensor([2.0, 3.0]))
    torch.testing.assert_close(tu.tree_mul(x, 3), torch.tensor([3.0, 6.0]))


def test_none_in_first_tree_gives_none_whatever_the_other_holds():
    a = {"x": torch.ones(2), "y": None}
    b = {"x": torch.ones(2), "y": torch.ones(3)}
    out = tu.tree_add(a, b)
    assert out["y"] is None
    torch.testing.assert_close(out["x"], torch.full((2,), 2.0))


def test_conj_and_real():
    tree = {"c": torch.tensor([1 + 2j, -3j], dtype=torch.complex64), "r": torch.tensor([1.0, -2.0]), "n": None}
    conj, real = tu.tree_conj(tree), tu.tree_real(tree)
    np.testing.assert_array_equal(conj["c"].numpy(), np.conj(tree["c"].numpy()))
    np.testing.assert_array_equal(real["c"].numpy(), np.real(tree["c"].numpy()))
    assert real["c"].dtype == torch.float32 and conj["r"] is tree["r"] and real["n"] is None


def test_tree_clip():
    a = make_tree(0)
    assert_tree_matches(tu.tree_clip(a, -0.5, 0.25), [np.clip(x, -0.5, 0.25) for x in np_leaves(a)], a)
    assert_tree_matches(tu.tree_clip(a, min_value=0.0), [np.maximum(x, 0.0) for x in np_leaves(a)], a)
    bound = torch.tensor(0.1, dtype=torch.float64)
    assert_tree_matches(tu.tree_clip(a, max_value=bound), [np.minimum(x, 0.1) for x in np_leaves(a)], a)
    assert_tree_matches(tu.tree_clip(a), np_leaves(a), a)
    # crossed bounds: jnp.clip's order, the upper bound wins
    assert_tree_matches(tu.tree_clip(a, 1.0, -1.0), [np.full_like(x, -1.0) for x in np_leaves(a)], a)


def test_tree_where():
    a, b = make_tree(0), make_tree(1)
    assert_tree_matches(tu.tree_where(True, a, b), np_leaves(a), a)
    assert_tree_matches(tu.tree_where(torch.tensor(False), a, b), np_leaves(b), a)


# --------------------------------------------------------------------------- reductions


def test_reductions_against_numpy_on_the_concatenated_leaves():
    a, b = make_tree(0), make_tree(1)
    fa, fb = flat(a), flat(b)
    cases = [
        (tu.tree_sum(a), fa.sum()),
        (tu.tree_sum(a, associative_reduction=True), fa.sum()),
        (tu.tree_max(a), fa.max()),
        (tu.tree_min(a), fa.min()),
        (tu.tree_vdot(a, b), np.vdot(fa, fb)),
        (tu.tree_norm(a), np.linalg.norm(fa)),
        (tu.tree_norm(a, ord=2), np.linalg.norm(fa)),
        (tu.tree_norm(a, squared=True), np.sum(fa**2)),
        (tu.tree_norm(a, ord=1), np.abs(fa).sum()),
        (tu.tree_norm(a, ord=1, squared=True), np.abs(fa).sum() ** 2),
        (tu.tree_norm(a, ord=math.inf), np.abs(fa).max()),
        (tu.tree_norm(a, ord="inf", squared=True), np.abs(fa).max() ** 2),
    ]
    for got, want in cases:
        assert isinstance(got, torch.Tensor) and got.ndim == 0
        assert got.dtype == torch.float64  # a float64 leaf: everything in float64
        np.testing.assert_allclose(got.item(), want, rtol=1e-6)  # the float32 leaves' rounding
    assert tu.tree_size(a) == fa.size


def test_reductions_accumulate_low_precision_in_float32():
    ones = {"a": torch.ones(1 << 12, dtype=torch.bfloat16), "b": torch.ones(1 << 12, dtype=torch.bfloat16)}
    total = tu.tree_sum(ones)
    assert total.dtype == torch.float32 and total.item() == 2 ** 13  # bfloat16 stops counting at 256
    assert tu.tree_vdot(ones, ones).item() == 2 ** 13
    big = {"a": torch.full((4,), 300.0, dtype=torch.float16)}  # squares overflow float16
    norm = tu.tree_norm(big)
    assert norm.dtype == torch.float32 and norm.item() == pytest.approx(600.0)
    assert tu.tree_norm(big, squared=True).item() == pytest.approx(360000.0)


def test_integer_and_complex_leaves():
    ints = {"a": torch.tensor([1, -2, 3]), "b": torch.tensor([[4]], dtype=torch.int32)}
    assert tu.tree_sum(ints).item() == 6 and tu.tree_sum(ints).dtype == torch.int64
    assert tu.tree_max(ints).item() == 4 and tu.tree_min(ints).item() == -2
    assert tu.tree_vdot(ints, ints).item() == 30
    assert tu.tree_norm(ints, ord=1).item() == 10
    c = {"z": torch.tensor([3 + 4j, 1j], dtype=torch.complex128)}
    np.testing.assert_allclose(tu.tree_norm(c).item(), np.linalg.norm(c["z"].numpy()))
    np.testing.assert_allclose(tu.tree_norm(c, ord=1).item(), 6.0)
    d = {"z": torch.tensor([1 - 1j, 2j], dtype=torch.complex128)}
    np.testing.assert_allclose(tu.tree_vdot(c, d).item(), np.vdot(c["z"].numpy(), d["z"].numpy()))


def test_empty_and_all_none_trees():
    for empty in ({}, {"a": None, "b": [None]}, {"a": torch.zeros(0)}):
        assert tu.tree_sum(empty).item() == 0
        assert tu.tree_norm(empty).item() == 0
        assert tu.tree_max(empty).item() == -math.inf and tu.tree_min(empty).item() == math.inf
        assert tu.tree_size(empty) == 0
        assert bool(tu.tree_allclose(empty, empty))
    assert tu.tree_vdot({"a": None}, {"a": None}).item() == 0


def test_tree_norm_rejects_other_orders():
    with pytest.raises(ValueError, match="ord"):
        tu.tree_norm(make_tree(0), ord=3)


def test_tree_allclose():
    a = make_tree(0)
    b = tu.tree_add_scale(a, 1e-7, tu.tree_ones_like(a))
    assert bool(tu.tree_allclose(a, b, atol=1e-6)) and not bool(tu.tree_allclose(a, b, rtol=0, atol=1e-9))
    nan = {"x": torch.tensor([float("nan"), 1.0])}
    assert not bool(tu.tree_allclose(nan, nan)) and bool(tu.tree_allclose(nan, nan, equal_nan=True))
    assert bool(tu.tree_allclose({"x": torch.ones(2)}, {"x": torch.ones(2, dtype=torch.float64)}))
    assert tu.tree_allclose(a, a).dtype == torch.bool


@settings(max_examples=40, deadline=None)
@given(
    # (numpy's 2-norm squares without rescaling: tiny values would underflow in the reference only)
    st.lists(st.lists(st.floats(-1e3, 1e3).filter(lambda v: v == 0 or abs(v) > 1e-100), max_size=6), min_size=1, max_size=5),
    st.sampled_from([None, 1, 2, math.inf]),
)
def test_tree_norm_property(chunks, ord):
    tree = [torch.tensor(c, dtype=torch.float64) for c in chunks]
    values = np.concatenate([np.asarray(c, dtype=np.float64) for c in chunks])
    want = np.linalg.norm(values, ord=2 if ord is None else ord) if values.size else 0.0
    np.testing.assert_allclose(tu.tree_norm(tree, ord=ord).item(), want, rtol=1e-12, atol=1e-300)


# --------------------------------------------------------------------------- constructors and casts


def test_zeros_ones_full_like():
    a = make_tree(0)
    assert_tree_matches(tu.tree_zeros_like(a), [np.zeros_like(x) for x in np_leaves(a)], a)
    assert_tree_matches(tu.tree_ones_like(a), [np.ones_like(x) for x in np_leaves(a)], a)
    assert_tree_matches(tu.tree_full_like(a, 2.5), [np.full_like(x, 2.5) for x in np_leaves(a)], a)
    assert_tree_matches(tu.tree_full_like(a, torch.tensor(-1.0)), [np.full_like(x, -1.0) for x in np_leaves(a)], a)
    halves = tu.tree_zeros_like(a, dtype=torch.float16)
    assert all(x.dtype == torch.float16 for x in tree_lib.leaves(halves) if x is not None)
    assert tu.tree_full_like(a, 3, dtype=torch.int64)["w"].dtype == torch.int64


def test_tree_full_like_is_differentiable_in_a_tensor_fill_value():
    value = torch.tensor(2.0, requires_grad=True)
    out = tu.tree_full_like({"a": torch.zeros(3), "b": torch.zeros(2, 2)}, value)
    tu.tree_sum(out).backward()
    assert value.grad.item() == 7.0


def test_tree_batch_shape():
    a = make_tree(0)
    out = tu.tree_batch_shape(a, (2, 3))
    assert_tree_matches(
        out, [np.broadcast_to(x, (2, 3, *x.shape)) for x in np_leaves(a)], tu.tree_batch_shape(tu.tree_zeros_like(a), (2, 3))
    )
    out["w"].add_(1.0)  # a new tensor, not a view: writing into it is allowed and leaves ``a`` alone
    assert not torch.equal(out["w"][0, 0], a["w"])


def test_cast_and_cast_like():
    a = make_tree(0)
    as_half = tu.tree_cast(a, torch.float16)
    assert {x.dtype for x in tree_lib.leaves(as_half) if x is not None} == {torch.float16}
    assert tu.tree_cast(a, None) is a
    back = tu.tree_cast_like(as_half, a)
    assert [x.dtype for x in tree_lib.leaves(back) if x is not None] == [x.dtype for x in tree_lib.leaves(a) if x is not None]


def test_tree_dtype():
    assert tu.tree_dtype({"a": torch.ones(1), "b": [torch.ones(2), None]}) == torch.float32
    mixed = {"a": {"b": torch.ones(1, dtype=torch.float16)}, "c": torch.ones(1, dtype=torch.float32)}
    with pytest.raises(ValueError, match=r"'c'"):
        tu.tree_dtype(mixed)
    assert tu.tree_dtype(mixed, "lowest") == torch.float16
    assert tu.tree_dtype(mixed, "highest") == torch.float32
    assert tu.tree_dtype(mixed, "promote") == torch.float32
    incomparable = {"a": torch.ones(1, dtype=torch.bfloat16), "b": torch.ones(1, dtype=torch.float16)}
    assert tu.tree_dtype(incomparable, "promote") == torch.float32
    with pytest.raises(ValueError, match="neither promotes"):
        tu.tree_dtype(incomparable, "highest")
    with pytest.raises(ValueError, match="mixed_dtype_handler"):
        tu.tree_dtype(mixed, "widest")
    assert tu.tree_dtype({}) == torch.get_default_dtype()


# --------------------------------------------------------------------------- moments


def test_update_moment_orders():
    g, m = make_tree(0), make_tree(1)
    for order in (1, 2, 3):
        out = tu.tree_update_moment(g, m, 0.9, order)
        expected = [(1 - 0.9) * x**order + 0.9 * y for x, y in zip(np_leaves(g), np_leaves(m))]
        assert_tree_matches(out, expected, g)


def test_update_moment_with_a_tensor_decay_and_none_updates():
    g = {"a": torch.tensor([1.0, -2.0]), "b": None}
    m = {"a": torch.tensor([0.5, 0.5]), "b": torch.ones(3)}
    out = tu.tree_update_moment(g, m, torch.tensor(0.8), 2)
    np.testing.assert_allclose(out["a"].numpy(), [0.2 * 1 + 0.8 * 0.5, 0.2 * 4 + 0.8 * 0.5], rtol=1e-6)
    assert out["b"] is None


def test_update_moment_per_elem_norm_real_and_complex():
    g = {"c": torch.tensor([3 + 4j, 1 - 1j], dtype=torch.complex128), "r": torch.tensor([-2.0, 0.5], dtype=torch.float64)}
    m = {"c": torch.tensor([1.0, 2.0], dtype=torch.float64), "r": torch.tensor([1.0, 1.0], dtype=torch.float64)}
    for order in (1, 2, 3):
        out = tu.tree_update_moment_per_elem_norm(g, m, 0.7, order)
        c = g["c"].numpy()
        np.testing.assert_allclose(out["c"].numpy(), 0.3 * (np.abs(c) ** 2) ** (order / 2) + 0.7 * m["c"].numpy())
        np.testing.assert_allclose(out["r"].numpy(), 0.3 * g["r"].numpy() ** order + 0.7 * m["r"].numpy())
        assert out["c"].dtype == torch.float64


def test_update_infinity_moment():
    g, m = make_tree(0), make_tree(1)
    out = tu.tree_update_infinity_moment(g, m, 0.9, 1e-3)
    expected = [np.maximum(np.abs(x) + 1e-3, 0.9 * y) for x, y in zip(np_leaves(g), np_leaves(m))]
    assert_tree_matches(out, expected, g)


def test_bias_correction():
    m = make_tree(0)
    for count in (1, 5, torch.tensor(10, dtype=torch.int32)):
        expected = [x / (1 - 0.9 ** int(count)) for x in np_leaves(m)]
        assert_tree_matches(tu.tree_bias_correction(m, 0.9, count), expected, m)


def test_bias_correction_of_low_precision_moments_stays_finite():
    # 0.999 rounds to 1 in bfloat16: 1 - decay**count must not be computed in the moment's dtype
    m = {"a": torch.ones(3, dtype=torch.bfloat16)}
    for decay in (0.999, torch.tensor(0.999)):
        out = tu.tree_bias_correction(m, decay, torch.tensor(1))
        assert out["a"].dtype == torch.bfloat16 and torch.isfinite(out["a"]).all()
        np.testing.assert_allclose(out["a"].float().numpy(), 1000.0, rtol=1e-2)


# --------------------------------------------------------------------------- randomness


def test_random_like_is_reproducible_and_advances_the_generator():
    target = make_tree(0)
    first = tu.tree_random_like(torch.Generator().manual_seed(3), target)
    again = tu.tree_random_like(torch.Generator().manual_seed(3), target)
    assert bool(tu.tree_allclose(first, again, rtol=0, atol=0))
    assert bool(tu.tree_allclose(tu.tree_random_like(3, target), first, rtol=0, atol=0))  # an int seed
    generator = torch.Generator().manual_seed(3)
    tu.tree_random_like(generator, target)
    second = tu.tree_random_like(generator, target)
    assert not bool(tu.tree_allclose(first, second))
    for got, ref in zip(tree_lib.leaves(first), tree_lib.leaves(target)):
        assert (got is None) == (ref is None)
        if ref is not None:
            assert got.shape == ref.shape and got.dtype == ref.dtype
    # leaves of the same shape get different numbers
    pair = tu.tree_random_like(0, {"a": torch.zeros(100), "b": torch.zeros(100)})
    assert not torch.equal(pair["a"], pair["b"])


def test_random_like_sampler_and_dtype():
    target = {"a": torch.zeros(2000), "b": None}
    uniform = tu.tree_random_like(0, target, sampler=torch.rand)
    assert 0 <= uniform["a"].min() and uniform["a"].max() < 1 and uniform["b"] is None
    normal = tu.tree_random_like(0, target, dtype=torch.float64)
    assert normal["a"].dtype == torch.float64 and abs(normal["a"].std().item() - 1) < 0.1
    bits = tu.tree_random_like(0, target, sampler=functools.partial(torch.randint, 0, 2), dtype=torch.int64)
    assert set(bits["a"].unique().tolist()) == {0, 1}


def test_split_key_like_and_unwrap():
    keys = tu.tree_split_key_like(torch.Generator().manual_seed(0), make_tree(0))
    assert tree_lib.structure(keys) == tree_lib.structure(make_tree(0))
    generators = [k for k in tree_lib.leaves(keys) if k is not None]
    assert all(isinstance(k, torch.Generator) for k in generators) and keys["layers"][0]["bias"] is None
    assert len({k.initial_seed() for k in generators}) == len(generators)
    data = tu.tree_unwrap_random_key_data(keys)
    assert all(isinstance(d, torch.Tensor) and d.dtype == torch.uint8 for d in tree_lib.leaves(data) if d is not None)
    again = tu.tree_unwrap_random_key_data(tu.tree_split_key_like(torch.Generator().manual_seed(0), make_tree(0)))
    assert bool(tu.tree_allclose(data, again, rtol=0, atol=0))
    with pytest.raises(TypeError, match="rng_key"):
        tu.tree_split_key_like("seed", make_tree(0))


# --------------------------------------------------------------------------- state lookup


def adam_state():
    params = {"w": torch.ones(2), "b": torch.zeros(1)}
    tx = gradtx.chain(gradtx.add_noise(0.1, 0.5, 0), gradtx.scale_by_adam(), gradtx.scale(-0.1))
    return tx, params, tx.init(params)


def test_tree_get_all_with_path_named_tuple_keys():
    tx, params, state = adam_state()
    found = tu.tree_get_all_with_path(state, "count")
    assert [tree_lib.join_path(p) for p, _ in found] == ["0.AddNoiseState.count", "1.ScaleByAdamState.count"]
    assert found[1][0] == (1, tu.NamedTupleKey("ScaleByAdamState", "count"))
    adam_only = tu.tree_get_all_with_path(
        state, "count", lambda path, _: isinstance(path[-1], tu.NamedTupleKey) and path[-1].tuple_name == "ScaleByAdamState"
    )
    assert len(adam_only) == 1 and adam_only[0][1] is state[1].count
    assert tu.tree_get(state, "ScaleByAdamState") is state[1]  # a NamedTuple by its class name
    with pytest.raises(KeyError, match="several"):
        tu.tree_get(state, "count")
    assert tu.tree_get(state, "missing", default=7) == 7
    nested = {"a": {"k": 1, "b": {"k": 2}}, "c": [{"k": 3}]}
    # optax's order: the outermost matches first, then those inside them
    assert tu.tree_get_all_with_path(nested, "k") == [(("a", "k"), 1), (("c", 0, "k"), 3), (("a", "b", "k"), 2)]
    assert tu.tree_get(nested, "k", filtering=lambda path, v: path == ("c", 0, "k")) == 3


def test_tree_set():
    tx, params, state = adam_state()
    new = tu.tree_set(state, lambda path, _: path[-1].tuple_name == "ScaleByAdamState", count=torch.tensor(4))
    assert new[1].count.item() == 4 and new[0].count is state[0].count
    assert new[1].mu is state[1].mu and type(new[1]) is type(state[1])
    replaced = tu.tree_set(state, ScaleByAdamState=None)
    assert replaced[1] is None and replaced[0] is state[0]
    nested = {"a": {"k": 1, "b": {"k": 2}}, "c": [{"k": 3}], "d": (4,)}
    assert tu.tree_set(nested, k=0) == {"a": {"k": 0, "b": {"k": 0}}, "c": [{"k": 0}], "d": (4,)}
    assert nested["a"]["k"] == 1  # pure
    with pytest.raises(KeyError, match="missing"):
        tu.tree_set(state, missing=1)
    with pytest.raises(KeyError, match="filtering"):
        tu.tree_set(state, lambda path, v: False, count=1)


def test_tree_map_params():
    tx, params, state = adam_state()
    specs = {"w": "row", "b": "replicated"}
    mapped = tu.tree_map_params(tx, lambda p, spec: (tuple(p.shape), spec), state, specs)
    assert mapped[1].mu == {"w": ((2,), "row"), "b": ((1,), "replicated")} and mapped[1].nu == mapped[1].mu
    assert mapped[1].count is state[1].count
    cleared = tu.tree_map_params(tx.init, lambda p: p, state, transform_non_params=lambda _: None)
    assert cleared[1].count is None and cleared[0].rng_key is None
    assert cleared[1].mu["w"] is state[1].mu["w"] and cleared[1].nu["b"] is state[1].nu["b"]
    with_none = {"w": torch.ones(2), "b": None}
    none_state = tx.init(with_none)
    assert tu.tree_map_params(tx, lambda p: p * 2, none_state)[1].mu["b"] is None


# --------------------------------------------------------------------------- errors


def test_errors_name_the_leaf_path():
    a = make_tree(0)
    missing = make_tree(1)
    del missing["state"]
    with pytest.raises(ValueError, match=r"tree_add: tree_y does not match tree_x: tree_x has leaves 'state\.mu', 'state\.nu' that tree_y lacks"):
        tu.tree_add(a, missing)
    holes = make_tree(1)
    holes["layers"][1] = (None, holes["layers"][1][1])
    with pytest.raises(ValueError, match=r"tree_vdot: leaf 'layers\.1\.0' is None in tree_y"):
        tu.tree_vdot(a, holes)
    with pytest.raises(ValueError, match=r"moments .* has leaves? 'layers\.0\.bias'.* that .* lacks"):
        tu.tree_update_moment(a, {"w": a["w"]}, 0.9, 2)
    with pytest.raises(TypeError, match=r"tree_sum: tree: leaf 'x\.0' is a str"):
        tu.tree_sum({"x": ["oops"]})
    with pytest.raises(ValueError, match=r"leaf 'w' has shape"):
        tu.tree_vdot({"w": torch.ones(2)}, {"w": torch.ones(3)})


# --------------------------------------------------------------------------- torch.func


def test_helpers_under_vmap_and_grad():
    # (torch.func does not take None inputs: the None leaf is added inside each function)
    batch = {"w": torch.randn(4, 3, dtype=torch.float64), "v": torch.randn(4, 2, dtype=torch.float64)}
    other = tu.tree_random_like(1, batch)

    def with_none(tree):
        return {"w": tree["w"], "v": [tree["v"], None]}

    def rows(tree, k):
        return tree_lib.tree_map(lambda x: x[k], tree)

    functions = {
        "norm": lambda x, y: tu.tree_norm(x),
        "l1": lambda x, y: tu.tree_norm(x, ord=1),
        "linf": lambda x, y: tu.tree_norm(x, ord="inf"),
        "vdot": lambda x, y: tu.tree_vdot(x, y),
        "sum": lambda x, y: tu.tree_sum(x),
        "max": lambda x, y: tu.tree_max(x),
        "add_scale": lambda x, y: tu.tree_sum(tu.tree_add_scale(x, 0.3, y)),
        "moment": lambda x, y: tu.tree_sum(tu.tree_update_moment(x, y, 0.9, 2)),
        "inf_moment": lambda x, y: tu.tree_sum(tu.tree_update_infinity_moment(x, y, 0.9, 1e-3)),
        "clip": lambda x, y: tu.tree_sum(tu.tree_clip(x, -0.2, 0.3)),
        "div": lambda x, y: tu.tree_sum(tu.tree_div(x, tu.tree_add(tu.tree_mul(y, y), tu.tree_ones_like(y)))),
        "where": lambda x, y: tu.tree_sum(tu.tree_where(tu.tree_sum(x) > 0, x, y)),
        "bias": lambda x, y: tu.tree_sum(tu.tree_bias_correction(x, 0.9, 3)),
    }
    for name, fn in functions.items():
        def on_trees(x, y, fn=fn):
            return fn(with_none(x), with_none(y))

        batched = torch.func.vmap(on_trees)(batch, other)
        looped = torch.stack([on_trees(rows(batch, k), rows(other, k)) for k in range(4)])
        torch.testing.assert_close(batched, looped, msg=name)
    grads = torch.func.grad(lambda x: tu.tree_norm(with_none(x), squared=True))(batch)
    torch.testing.assert_close(grads["w"], 2 * batch["w"])
    per_example = torch.func.vmap(torch.func.grad(lambda x: tu.tree_vdot(with_none(x), with_none(x))))(batch)
    torch.testing.assert_close(per_example["v"], 2 * batch["v"])


def test_autograd_through_tensor_scalars():
    tree = {"a": torch.ones(3, dtype=torch.float64), "b": [torch.ones(2, dtype=torch.float64), None]}

    def grad_of(fn, value):
        x = torch.tensor(value, dtype=torch.float64, requires_grad=True)
        (g,) = torch.autograd.grad(tu.tree_sum(fn(x)), x)
        return g.item()

    assert grad_of(lambda s: tu.tree_scale(s, tree), 2.0) == 5.0
    assert grad_of(lambda s: tu.tree_add_scale(tree, s, tree), 2.0) == 5.0
    assert grad_of(lambda m: tu.tree_clip(tree, max_value=m), 0.5) == 5.0
    assert grad_of(lambda d: tu.tree_update_moment(tree, tu.tree_scale(3.0, tree), d, 2), 0.9) == 10.0
    # d/dd of 5 / (1 - d**2) = 10 d / (1 - d**2)**2
    assert grad_of(lambda d: tu.tree_bias_correction(tree, d, 2), 0.9) == pytest.approx(9 / 0.19**2)
    assert grad_of(lambda v: tu.tree_full_like(tree, v), 1.0) == 5.0
