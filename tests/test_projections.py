"""gradtx.projections against optax.projections' definitions written out in numpy float64, and the
properties every Euclidean projection has (checked with hypothesis on float64 trees)."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import gradtx
from gradtx import projections as pj
from gradtx import tree as tree_lib
from gradtx import tree_utils as tu

OPTAX_NAMES = {
    "projection_box", "projection_halfspace", "projection_hypercube", "projection_hyperplane",
    "projection_l1_ball", "projection_l1_sphere", "projection_l2_ball", "projection_l2_sphere",
    "projection_linf_ball", "projection_non_negative", "projection_simplex", "projection_vector",
}


class Pair(NamedTuple):
    mu: object
    nu: object


# --------------------------------------------------------------------------- numpy references


def ref_unit_simplex(v):
    """optax's sort-based projection onto the unit simplex, in numpy float64."""
    u = np.sort(v)[::-1]
    cumsum = np.cumsum(u)
    ind = np.arange(1, v.size + 1)
    k = np.count_nonzero(1 / ind + (u - cumsum / ind) > 0)
    return np.maximum(1 / k + (v - cumsum[k - 1] / k), 0)


def ref_simplex(v, s):
    return s * ref_unit_simplex(v / s)


def bisection_simplex(v, s):
    """The same projection found another way: ``relu(v - tau)`` with ``tau`` bisected so it sums to ``s``."""
    lo, hi = v.min() - s / v.size - 1, v.max()
    for _ in range(200):
        mid = (lo + hi) / 2
        if np.maximum(v - mid, 0).sum() > s:
            lo = mid
        else:
            hi = mid
    return np.maximum(v - (lo + hi) / 2, 0)


def ref_l1_sphere(v, s):
    return np.sign(v) * ref_simplex(np.abs(v), s)


def ref_l1_ball(v, s):
    return v if np.abs(v).sum() <= s else ref_l1_sphere(v, s)


def ref_l2_sphere(v, s):
    return s / np.linalg.norm(v) * v


def ref_l2_ball(v, s):
    return s / np.sqrt(max(np.sum(v * v), s * s)) * v


def ref_linf_ball(v, s):
    return np.clip(v, -s, s)


def ref_vector(x, a):
    return np.dot(x, a) / np.dot(a, a) * a


def ref_hyperplane(x, a, b):
    return x + (b - np.dot(x, a)) / np.dot(a, a) * a


def ref_halfspace(x, a, b):
    return x + min((b - np.dot(x, a)) / np.dot(a, a), 0) * a


# --------------------------------------------------------------------------- trees as vectors


def split_tree(values, sizes, dtypes=(torch.float64, torch.float64, torch.float64)):
    """A dict / list / tuple / NamedTuple tree with a None leaf holding ``values`` split by ``sizes``."""
    pieces = np.split(np.asarray(values, dtype=np.float64), np.cumsum(sizes)[:-1])
    a, b, c = (torch.tensor(p, dtype=d) for p, d in zip(pieces, dtypes))
    return {"a": a.reshape(-1, 1) if a.numel() else a, "b": [b, None, (Pair(mu=c, nu=None),)]}


def vec(tree):
    leaves = [leaf.detach().to(torch.float64).reshape(-1) for leaf in tree_lib.leaves(tree) if leaf is not None]
    return torch.cat(leaves).numpy() if leaves else np.zeros(0)


def assert_same_layout(result, tree):
    assert tree_lib.structure(result) == tree_lib.structure(tree)
    for got, ref in zip(tree_lib.leaves(result), tree_lib.leaves(tree)):
        assert (got is None) == (ref is None)
        if ref is not None:
            assert got.shape == ref.shape and got.dtype == ref.dtype and got.device == ref.device


def mixed_tree(seed):
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(3, 4, generator=g) * 2,
        "layers": [{"kernel": torch.randn(2, 3, generator=g, dtype=torch.float64), "bias": None}],
        "state": Pair(mu=torch.randn(5, generator=g, dtype=torch.float64), nu=torch.randn((), generator=g)),
    }


SCALAR_CASES = {
    "simplex": (pj.projection_simplex, ref_simplex),
    "l1_sphere": (pj.projection_l1_sphere, ref_l1_sphere),
    "l1_ball": (pj.projection_l1_ball, ref_l1_ball),
    "l2_sphere": (pj.projection_l2_sphere, ref_l2_sphere),
    "l2_ball": (pj.projection_l2_ball, ref_l2_ball),
    "linf_ball": (pj.projection_linf_ball, ref_linf_ball),
    "hypercube": (pj.projection_hypercube, lambda v, s: np.clip(v, 0, s)),
}


# --------------------------------------------------------------------------- names and docs


def test_every_optax_name_is_here_and_documented():
    assert set(pj.__all__) == OPTAX_NAMES
    for name in pj.__all__:
        assert getattr(pj, name).__doc__.strip(), name
    assert gradtx.projections is pj


# --------------------------------------------------------------------------- numbers


@pytest.mark.parametrize("name", sorted(SCALAR_CASES))
@pytest.mark.parametrize("scale", [0.5, 1.0, 3.0, 100.0])
def test_against_reference_on_a_mixed_tree(name, scale):
    fn, ref = SCALAR_CASES[name]
    tree = mixed_tree(0)
    result = fn(tree, scale)
    assert_same_layout(result, tree)
    # float32 leaves are upcast, projected together with the float64 ones, and rounded back once
    np.testing.assert_allclose(vec(result), ref(vec(tree), scale), rtol=1e-6, atol=1e-6)
    result64 = fn(tu.tree_cast(tree, torch.float64), scale)
    np.testing.assert_allclose(vec(result64), ref(vec(tree), scale), rtol=1e-12, atol=1e-12)


def test_non_negative_and_box():
    tree, low = mixed_tree(0), mixed_tree(1)
    np.testing.assert_array_equal(vec(pj.projection_non_negative(tree)), np.maximum(vec(tree), 0))
    high = tu.tree_add(low, tu.tree_full_like(low, 1.0))
    boxed = pj.projection_box(tree, low, high)
    assert_same_layout(boxed, tree)
    np.testing.assert_allclose(vec(boxed), np.minimum(np.maximum(vec(tree), vec(low)), vec(high)), rtol=1e-7)
    # scalar and tensor bounds broadcast; a scalar on one side and a tree on the other
    np.testing.assert_allclose(vec(pj.projection_box(tree, -0.5, 0.5)), np.clip(vec(tree), -0.5, 0.5), rtol=1e-7)
    np.testing.assert_allclose(vec(pj.projection_box(tree, torch.tensor(-0.25), high)), np.minimum(np.maximum(vec(tree), -0.25), vec(high)), rtol=1e-7)
    np.testing.assert_allclose(vec(pj.projection_hypercube(tree, high)), np.minimum(np.maximum(vec(tree), 0), vec(high)), rtol=1e-7)


def test_affine_projections():
    x, a = tu.tree_cast(mixed_tree(0), torch.float64), tu.tree_cast(mixed_tree(1), torch.float64)
    vx, va = vec(x), vec(a)
    np.testing.assert_allclose(vec(pj.projection_vector(x, a)), ref_vector(vx, va), rtol=1e-12)
    for b in (-3.0, 0.0, 2.5, torch.tensor(1.0, dtype=torch.float64)):
        np.testing.assert_allclose(vec(pj.projection_hyperplane(x, a, b)), ref_hyperplane(vx, va, float(b)), rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(vec(pj.projection_halfspace(x, a, b)), ref_halfspace(vx, va, float(b)), rtol=1e-12, atol=1e-12)
    mixed_x, mixed_a = mixed_tree(0), mixed_tree(1)
    result = pj.projection_hyperplane(mixed_x, mixed_a, 1.0)
    assert_same_layout(result, mixed_x)
    np.testing.assert_allclose(vec(result), ref_hyperplane(vec(mixed_x), vec(mixed_a), 1.0), rtol=1e-5, atol=1e-6)


def test_simplex_matches_bisection_and_tensor_scale():
    rng = np.random.default_rng(0)
    for _ in range(20):
        v = rng.normal(size=rng.integers(1, 30)) * rng.uniform(0.1, 10)
        s = rng.uniform(0.1, 5)
        tree = split_tree(v, [v.size // 3, v.size // 3, v.size - 2 * (v.size // 3)])
        got = vec(pj.projection_simplex(tree, torch.tensor(s, dtype=torch.float64)))
        np.testing.assert_allclose(got, bisection_simplex(v, s), atol=1e-9)


def test_low_precision_tree_is_projected_in_float32():
    tree = {"a": torch.linspace(-3, 3, 64, dtype=torch.bfloat16), "b": torch.full((64,), 0.01, dtype=torch.bfloat16)}
    result = pj.projection_simplex(tree)
    assert_same_layout(result, tree)
    want = ref_simplex(vec(tree), 1.0)
    np.testing.assert_allclose(vec(result), want, atol=1e-2)
    assert abs(vec(result).sum() - 1) < 2e-2
    ball = pj.projection_l2_ball(tree, 1.0)
    np.testing.assert_allclose(vec(ball), ref_l2_ball(vec(tree), 1.0), atol=1e-2)


def test_empty_and_none_trees():
    for empty in ({}, {"a": None}):
        for fn, _ in SCALAR_CASES.values():
            assert fn(empty, 1.0) == empty
    result = pj.projection_simplex({"a": torch.zeros(0), "b": torch.tensor([2.0, 0.0])})
    assert result["a"].shape == (0,)
    torch.testing.assert_close(result["b"], torch.tensor([1.0, 0.0]))


# --------------------------------------------------------------------------- properties

finite = st.floats(-10, 10, allow_nan=False, allow_infinity=False, allow_subnormal=False)


@st.composite
def tree_and_scale(draw):
    n = draw(st.integers(1, 12))
    values = draw(st.lists(finite, min_size=n, max_size=n))
    cut1 = draw(st.integers(0, n))
    cut2 = draw(st.integers(cut1, n))
    scale = draw(st.floats(0.1, 20))
    return split_tree(values, [cut1, cut2 - cut1, n - cut2]), scale


def in_set(name, v, s, tol=1e-9):
    if name == "simplex":
        return abs(v.sum() - s) <= tol * max(1, s) and (v >= 0).all()
    if name == "l1_sphere":
        return abs(np.abs(v).sum() - s) <= tol * max(1, s)
    if name == "l1_ball":
        return np.abs(v).sum() <= s + tol * max(1, s)
    if name == "l2_sphere":
        return abs(np.linalg.norm(v) - s) <= tol * max(1, s)
    if name == "l2_ball":
        return np.linalg.norm(v) <= s + tol * max(1, s)
    if name == "linf_ball":
        return np.abs(v).max(initial=0) <= s
    if name == "hypercube":
        return (v >= 0).all() and (v <= s).all()
    raise AssertionError(name)


def has_zero(tree):
    return (vec(tree) == 0).any()


@pytest.mark.parametrize("name", sorted(SCALAR_CASES))
@settings(max_examples=60, deadline=None)
@given(data=tree_and_scale(), others=st.lists(st.lists(finite, min_size=12, max_size=12), min_size=3, max_size=3))
def test_projection_properties(name, data, others):
    tree, scale = data
    fn, _ = SCALAR_CASES[name]
    if name.endswith("sphere"):
        assume(not has_zero(tree))  # a sphere's projection of 0 (or of a zero coordinate) is not unique
        assume(np.abs(vec(tree)).max() > 1e-100)  # (squares of tinier values underflow: 1 / 0)
    p = fn(tree, scale)
    assert_same_layout(p, tree)
    vp = vec(p)
    assert in_set(name, vp, scale)
    # projecting twice changes nothing
    np.testing.assert_allclose(vec(fn(p, scale)), vp, atol=1e-9 * max(1, scale))
    # the projection is no farther from the point than other points of the set
    n = vp.size
    candidates = [vp * 0.5 if name not in ("simplex", "l1_sphere", "l2_sphere") else vp]
    for other in others:
        q = fn(split_tree(np.asarray(other[:n]) + 1e-3, [n, 0, 0]), scale)  # (+1e-3: no zero coordinate)
        candidates.append(vec(q))
    distance = np.linalg.norm(vec(tree) - vp)
    for q in candidates:
        assert in_set(name, q, scale)
        assert distance <= np.linalg.norm(vec(tree) - q) + 1e-9 * max(1, scale)


@pytest.mark.parametrize("name", ["l1_ball", "l2_ball", "linf_ball", "hypercube"])
@settings(max_examples=40, deadline=None)
@given(data=tree_and_scale(), shrink=st.floats(0, 0.999))
def test_points_inside_are_returned_unchanged(name, data, shrink):
    tree, scale = data
    v = vec(tree)
    if name == "hypercube":
        inside = np.clip(np.abs(v), 0, scale) * shrink
    else:
        norm = {"l1_ball": np.abs(v).sum(), "l2_ball": np.linalg.norm(v), "linf_ball": np.abs(v).max()}[name]
        inside = v * (shrink * scale / norm) if norm > 0 else v
    inside_tree = split_tree(inside, [v.size, 0, 0])
    fn, _ = SCALAR_CASES[name]
    np.testing.assert_allclose(vec(fn(inside_tree, scale)), inside, rtol=1e-12, atol=1e-300)


@settings(max_examples=60, deadline=None)
@given(data=tree_and_scale(), normal=st.lists(finite, min_size=12, max_size=12), b=finite)
def test_affine_properties(data, normal, b):
    tree, _ = data
    v = vec(tree)
    a = np.asarray(normal[: v.size])
    assume(np.dot(a, a) > 1e-6)
    a_tree = split_tree(a, [v.size, 0, 0])
    x_tree = split_tree(v, [v.size, 0, 0])
    plane = vec(pj.projection_hyperplane(x_tree, a_tree, b))
    assert abs(np.dot(a, plane) - b) <= 1e-9 * max(1, abs(b), np.abs(a).sum() * np.abs(plane).max())
    np.testing.assert_allclose(vec(pj.projection_hyperplane(split_tree(plane, [v.size, 0, 0]), a_tree, b)), plane, atol=1e-9)
    half = vec(pj.projection_halfspace(x_tree, a_tree, b))
    assert np.dot(a, half) <= b + 1e-9 * max(1, abs(b), np.abs(a).sum() * np.abs(half).max())
    if np.dot(a, v) <= b:
        np.testing.assert_array_equal(half, v)  # inside: unchanged
    line = vec(pj.projection_vector(x_tree, a_tree))
    np.testing.assert_allclose(np.dot(v - line, a), 0, atol=1e-9 * max(1, np.abs(v).sum() * np.abs(a).sum()))
    # the closest point: no other point of the plane / halfspace is nearer
    for t in np.linspace(-2, 2, 5):
        direction = np.roll(a, 1) - np.dot(np.roll(a, 1), a) / np.dot(a, a) * a  # along the plane
        q = plane + t * direction
        assert np.linalg.norm(v - plane) <= np.linalg.norm(v - q) + 1e-9 * max(1, np.linalg.norm(v))


# --------------------------------------------------------------------------- torch.func and errors


def test_under_vmap_and_the_simplex_derivative():
    batch = {"w": torch.randn(5, 3, dtype=torch.float64), "v": torch.randn(5, 4, dtype=torch.float64)}
    direction = {"w": torch.randn(5, 3, dtype=torch.float64), "v": torch.randn(5, 4, dtype=torch.float64)}
    calls = {name: (lambda x, fn=fn: fn(x, 0.7)) for name, (fn, _) in SCALAR_CASES.items()}
    calls["box"] = lambda x: pj.projection_box(x, -0.3, 0.2)
    calls["non_negative"] = pj.projection_non_negative
    calls["hyperplane"] = lambda x: pj.projection_hyperplane(x, tu.tree_ones_like(x), 1.0)
    calls["halfspace"] = lambda x: pj.projection_halfspace(x, tu.tree_ones_like(x), -1.0)
    calls["vector"] = lambda x: pj.projection_vector(x, tu.tree_full_like(x, 2.0))
    for name, fn in calls.items():
        batched = torch.func.vmap(fn)(batch)
        for k in range(5):
            row = fn({key: value[k] for key, value in batch.items()})
            for key in batch:
                torch.testing.assert_close(batched[key][k], row[key], msg=name)
    # optax's derivative of the simplex projection: zero off the support, the mean removed on it
    for k in range(5):
        x = {key: value[k] for key, value in batch.items()}
        t = {key: value[k] for key, value in direction.items()}
        p, tangent = torch.func.jvp(pj.projection_simplex, (x,), (t,))
        supp = torch.cat([p["w"], p["v"]]) > 0
        td = torch.cat([t["w"], t["v"]])
        want = supp * td - (torch.dot(supp.to(td.dtype), td) / supp.sum()) * supp
        torch.testing.assert_close(torch.cat([tangent["w"], tangent["v"]]), want)


def test_errors_name_the_leaf_path():
    tree = mixed_tree(0)
    bounds = mixed_tree(1)
    bounds["layers"][0]["bias"] = torch.zeros(1)
    del bounds["state"]
    with pytest.raises(ValueError, match=r"projection_box: lower does not match tree: tree has leaves 'state\.mu', 'state\.nu' that lower lacks"):
        pj.projection_box(tree, bounds, 1.0)
    with pytest.raises(ValueError, match=r"projection_hyperplane: a does not match x: x has leaf 'w' that a lacks"):
        pj.projection_hyperplane({"w": torch.ones(2), "v": torch.ones(1)}, {"v": torch.ones(1)}, 0.0)
    with pytest.raises(ValueError, match=r"projection_vector: leaf 'v' is None in a"):
        pj.projection_vector({"w": torch.ones(2), "v": torch.ones(1)}, {"w": torch.ones(2), "v": None})
    with pytest.raises(TypeError, match=r"projection_simplex: tree: leaf 'layers\.0' is a str"):
        pj.projection_simplex({"layers": ["oops"]})
    with pytest.raises(TypeError, match=r"projection_simplex: leaf 'z' is complex"):
        pj.projection_simplex({"z": torch.ones(2, dtype=torch.complex64)})
