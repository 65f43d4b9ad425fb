"""Properties of clipping that hold for any gradient tree (hypothesis)."""

from __future__ import annotations

import math

import hypothesis.extra.numpy as hnp
import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import gradtx as gtx
from gradtx import tree as tree_lib

SETTINGS = settings(max_examples=40, deadline=None)
NORM_TYPES = st.sampled_from([1.0, 2.0, 3.0, math.inf])


@st.composite
def grad_trees(draw, dtype=np.float32):
    """A dict of 1 to 4 small arrays (rank 0 to 3), possibly with a ``None`` leaf.

    Magnitudes are 0 or in [2**-20, 1e4], so the p-th powers a norm sums neither underflow nor
    overflow float32 (where any p-norm of float32 values, torch's too, loses its accuracy).
    """
    n_leaves = draw(st.integers(1, 4))
    tree = {}
    width = np.finfo(dtype).bits
    magnitudes = st.floats(2.0**-20 if width > 16 else 2.0**-10, 1e4, width=width)
    elements = st.one_of(st.just(0.0), magnitudes, magnitudes.map(lambda x: -x))
    for i in range(n_leaves):
        shape = draw(hnp.array_shapes(min_dims=0, max_dims=3, min_side=1, max_side=5))
        tree[f"leaf{i}"] = torch.from_numpy(draw(hnp.arrays(dtype, shape, elements=elements)))
    if draw(st.booleans()):
        tree["frozen"] = None
    return tree


def present(tree):
    return [leaf for leaf in tree_lib.leaves(tree) if leaf is not None]


def fp64_norm(tree, norm_type):
    flat = [t.double().reshape(-1) for t in present(tree)]
    return torch.linalg.vector_norm(torch.cat(flat), norm_type).item()


MAX_NORMS = st.one_of(st.just(0.0), st.floats(1e-6, 1e3))  # not so small that max_norm / norm is subnormal


@SETTINGS
@given(grad_trees(), MAX_NORMS, NORM_TYPES)
def test_clipped_norm_is_at_most_max_norm(grads, max_norm, norm_type):
    updates, state = gtx.clip_by_global_norm(max_norm, norm_type=norm_type).update(grads, None)
    assert fp64_norm(updates, norm_type) <= max_norm * (1 + 1e-6)
    assert math.isclose(state.norm.item(), fp64_norm(grads, norm_type), rel_tol=1e-5, abs_tol=1e-30)
    if fp64_norm(grads, norm_type) * (1 + 1e-6) + 1e-6 <= max_norm:  # clear of float32 rounding
        assert all(torch.equal(u, g) for u, g in zip(present(updates), present(grads)))  # nothing to clip


@SETTINGS
@given(grad_trees(), st.floats(1e-3, 1e3), NORM_TYPES)
def test_direction_is_kept(grads, max_norm, norm_type):
    """``clipped = c * g`` with one ``c`` in (0, 1] for every leaf."""
    updates, _ = gtx.clip_by_global_norm(max_norm, norm_type=norm_type).update(grads, None)
    g = torch.cat([t.double().reshape(-1) for t in present(grads)])
    u = torch.cat([t.double().reshape(-1) for t in present(updates)])
    if not g.any():
        assert not u.any()
        return
    c = (torch.dot(u, g) / torch.dot(g, g)).item()
    assert 0.0 < c <= 1.0 + 1e-7
    torch.testing.assert_close(u, c * g, rtol=1e-6, atol=1e-6 * c * g.abs().max().item())


@SETTINGS
@given(grad_trees(), st.floats(1e-2, 1e3), NORM_TYPES)
def test_clipping_twice_is_clipping_once(grads, max_norm, norm_type):
    tx = gtx.clip_by_global_norm(max_norm, norm_type=norm_type)
    once, _ = tx.update(grads, None)
    twice, _ = tx.update(once, None)
    # the 1e-6 in the coefficient's denominator moves a clipped tree by up to 1e-6 / max_norm, and the
    # second norm is taken of float32-rounded values, summed in float32 (up to ~1e-5 for 300 elements)
    rtol = 1e-6 / max_norm + 1e-5
    for a, b in zip(present(twice), present(once)):
        torch.testing.assert_close(a, b, rtol=rtol, atol=0)


@SETTINGS
@given(grad_trees(), st.floats(1e-2, 1e2), NORM_TYPES)
def test_scaling_the_gradients_scales_the_reported_norm(grads, s, norm_type):
    tx = gtx.clip_by_global_norm(1.0, norm_type=norm_type)
    _, state = tx.update(grads, None)
    _, scaled_state = tx.update(tree_lib.tree_map(lambda g: g.double() * s, grads), None)
    assert math.isclose(scaled_state.norm.item(), s * state.norm.item(), rel_tol=1e-5, abs_tol=1e-30)


@SETTINGS
@given(grad_trees(), st.integers(-8, 8))
def test_power_of_two_scaling_scales_the_2_norm_exactly(grads, k):
    _, state = gtx.clip_by_global_norm(1.0).update(grads, None)
    _, scaled_state = gtx.clip_by_global_norm(1.0).update(tree_lib.tree_map(lambda g: g * 2.0**k, grads), None)
    assert scaled_state.norm.item() == state.norm.item() * 2.0**k


@SETTINGS
@given(grad_trees(np.float16), st.floats(0.0, 10.0), NORM_TYPES)
def test_donated_update_equals_pure_update(grads, max_norm, norm_type):
    tx = gtx.chain(gtx.clip_by_value(5e3), gtx.clip_by_global_norm(max_norm, norm_type=norm_type))
    pure, pure_state = tx.update(grads, tx.init(grads))
    donated, donated_state = tx.update(tree_lib.tree_map(torch.clone, grads), tx.init(grads), inplace=True)
    assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(present(pure), present(donated)))
    assert torch.equal(pure_state[1].norm, donated_state[1].norm)


@SETTINGS
@given(grad_trees(), st.floats(0.0, 1e4))
def test_clip_by_value_bounds_and_keeps_small_elements(grads, max_delta):
    updates, _ = gtx.clip_by_value(max_delta).update(grads, None)
    for u, g in zip(present(updates), present(grads)):
        assert torch.all(u.abs() <= max_delta)
        small = g.abs() <= max_delta
        assert torch.equal(u[small], g[small])
        assert torch.equal(u[~small], torch.sign(g[~small]) * max_delta)
