"""GaLore against a float64 reference written from optax.contrib's definition (its own Adam, its own
reshapes), the pure and donated paths, the resolution of ``weight_dimension_numbers``, the errors,
and the compiled / ``torch.func`` path (which refreshes by selection instead of on the host)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import gradtx as gtx
from gradtx.contrib import GaLoreDimensionNumbers, GaLoreState, galore, scale_by_galore
from optimizer_helpers import assert_trees_close, check_pure_and_donated

DTYPE = torch.float64
SHAPES = {
    "tall": (8, 5),  # m >= n: left projector (8, r)
    "wide": (4, 9),  # m < n: right projector (9, r)
    "attn": (6, 2, 3),  # 3-D: projected only when its dimension numbers say so
    "bias": (5,),
    "scalar": (),
}


def _tree(seed, shapes=SHAPES, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return {k: scale * torch.randn(s, generator=gen, dtype=DTYPE) for k, s in shapes.items()}


def _grads(steps, shapes=SHAPES):
    return [_tree(100 + i, shapes) for i in range(steps)]


def reference_galore(params, grads, *, lr, rank, gap, scale=1.0, weight_decay=0.0, matrices=None,
                     b1=0.9, b2=0.999, eps=1e-8):
    """optax.contrib.galore with its default base optimizer, step by step, in float64.

    ``matrices``: leaf -> (row axes, column axes) for the projected leaves (default: the 2-D ones).
    """
    if matrices is None:
        matrices = {k: ((0,), (1,)) for k, v in params.items() if v.ndim == 2}
    params = {k: v.clone() for k, v in params.items()}
    mu, nu, proj = {}, {}, {}
    for t, g in enumerate(grads):
        new = {}
        for k, p in params.items():
            x = g[k]
            if k in matrices:
                rows, cols = matrices[k]
                perm = rows + cols
                pshape = tuple(x.shape[a] for a in perm)
                m, n = math.prod(x.shape[a] for a in rows), math.prod(x.shape[a] for a in cols)
                mat = x.permute(perm).reshape(m, n)
                r = min(rank, m, n)
                if t % gap == 0:
                    u, _, vh = torch.linalg.svd(mat, full_matrices=False)
                    proj[k] = u[:, :r] if m >= n else vh[:r].T
                low = proj[k].T @ mat if m >= n else mat @ proj[k]
            else:
                low = x
            mu[k] = b1 * mu.get(k, torch.zeros_like(low)) + (1 - b1) * low
            nu[k] = b2 * nu.get(k, torch.zeros_like(low)) + (1 - b2) * low**2
            adam = (mu[k] / (1 - b1 ** (t + 1))) / (torch.sqrt(nu[k] / (1 - b2 ** (t + 1))) + eps)
            if k in matrices:
                full = proj[k] @ adam if m >= n else adam @ proj[k].T
                inverse = sorted(range(len(perm)), key=lambda i: perm[i])
                u_full = scale * full.reshape(pshape).permute(inverse)
            else:
                u_full = adam  # optax does not scale what it does not project
            new[k] = p - lr * (u_full + weight_decay * p)
        params = new
    return params


def _run(tx, params, grads, inplace=False):
    state = tx.init(params)
    p = {k: v.clone() for k, v in params.items()}
    for g in grads:
        updates, state = tx.update({k: v.clone() for k, v in g.items()}, state, p, inplace=inplace)
        p = gtx.apply_updates(p, updates)
    return p, state


@pytest.mark.parametrize("inplace", [False, True])
def test_matches_reference_default_dimension_numbers(inplace):
    params, grads = _tree(0), _grads(5)
    ours, state = _run(galore(0.05, rank=3, update_proj_gap=2, scale=0.5, weight_decay=0.1), params, grads, inplace)
    expected = reference_galore(params, grads, lr=0.05, rank=3, gap=2, scale=0.5, weight_decay=0.1)
    assert_trees_close(ours, expected, rtol=1e-10, atol=1e-12)
    galore_state = state[0]
    assert isinstance(galore_state, GaLoreState) and int(galore_state.count) == 5
    assert galore_state.projector["tall"].shape == (8, 3) and galore_state.projector["wide"].shape == (9, 3)
    assert galore_state.projector["attn"].shape == (0, 0) and galore_state.projector["bias"].shape == (0, 0)
    adam = galore_state.base_optimizer_state
    assert adam.mu["tall"].shape == (3, 5) and adam.mu["wide"].shape == (4, 3) and adam.mu["attn"].shape == (6, 2, 3)


def test_matches_reference_with_dimension_numbers_and_large_rank():
    params, grads = _tree(1), _grads(4)
    dim_nums = {"tall": GaLoreDimensionNumbers(1, 0), "wide": None, "attn": GaLoreDimensionNumbers(0, (1, 2)),
                "bias": None, "scalar": None}
    # rank 100 is capped at min(m, n) per matrix
    ours, _ = _run(galore(0.05, rank=100, update_proj_gap=3, weight_dimension_numbers=dim_nums), params, grads)
    matrices = {"tall": ((1,), (0,)), "attn": ((0,), (1, 2))}
    expected = reference_galore(params, grads, lr=0.05, rank=100, gap=3, matrices=matrices)
    assert_trees_close(ours, expected, rtol=1e-10, atol=1e-12)


def test_one_dimension_numbers_for_every_leaf_of_rank_two_or_more():
    shapes = {"tall": (8, 5), "wide": (4, 9), "bias": (5,), "scalar": ()}
    params, grads = _tree(2, shapes), _grads(3, shapes)
    dim_nums = GaLoreDimensionNumbers(reduction_axis=-1, output_axis=0)  # every matrix transposed
    ours, _ = _run(scale_and_descend(dim_nums), params, grads)
    matrices = {"tall": ((1,), (0,)), "wide": ((1,), (0,))}
    expected = reference_galore(params, grads, lr=0.1, rank=2, gap=2, matrices=matrices)
    assert_trees_close(ours, expected, rtol=1e-10, atol=1e-12)
    # and as a callable of the params
    ours_fn, _ = _run(scale_and_descend(lambda tree: {k: dim_nums if v.ndim >= 2 else None for k, v in tree.items()}), params, grads)
    assert_trees_close(ours_fn, ours, rtol=0, atol=0)


def scale_and_descend(dim_nums):
    return gtx.chain(scale_by_galore(rank=2, update_proj_gap=2, weight_dimension_numbers=dim_nums), gtx.scale(-0.1))


def test_a_low_rank_update_lies_in_the_projected_subspace():
    """The first update of a tall matrix is P (P^T-projected Adam): its column space is that of
    the gradient's top singular vectors."""
    g = _tree(3)
    tx = scale_by_galore(rank=2, update_proj_gap=10)
    updates, state = tx.update(g, tx.init(g))
    u, _, _ = torch.linalg.svd(g["tall"], full_matrices=False)
    top = u[:, :2]
    torch.testing.assert_close(top @ (top.T @ updates["tall"]), updates["tall"], rtol=1e-10, atol=1e-12)
    assert torch.linalg.matrix_rank(updates["tall"]) == 2
    # the projector is orthonormal
    p = state.projector["tall"]
    torch.testing.assert_close(p.T @ p, torch.eye(2, dtype=DTYPE), rtol=0, atol=1e-12)


def test_projector_refreshes_every_gap_and_keeps_adam_state():
    params, grads = _tree(4), _grads(4)
    tx = scale_by_galore(rank=2, update_proj_gap=2)
    state = tx.init(params)
    seen = []
    for g in grads:
        _, state = tx.update(g, state)
        seen.append(state.projector["tall"].clone())
    assert torch.equal(seen[0], seen[1]) and torch.equal(seen[2], seen[3]) and not torch.equal(seen[1], seen[2])


def test_a_refreshed_projector_is_laid_out_as_init_lays_it_out():
    """A refresh keeps the state's strides (the SVD's singular vectors are a strided slice): a
    compiled step is traced once, not again after the first refresh."""
    params, grads = _tree(3), _grads(3)
    tx = scale_by_galore(rank=2, update_proj_gap=1)
    state = tx.init(params)
    strides = {k: v.stride() for k, v in state.projector.items()}
    for g in grads:
        _, state = tx.update(g, state)
        assert {k: v.stride() for k, v in state.projector.items()} == strides


def test_pure_and_donated_paths_agree_and_pure_mutates_nothing():
    params, grads = _tree(5), _grads(5)
    check_pure_and_donated(galore(0.05, rank=3, update_proj_gap=2, weight_decay=0.1), params, grads)
    check_pure_and_donated(
        gtx.chain(scale_by_galore(rank=2, update_proj_gap=3, base_optimizer=gtx.scale_by_lion()), gtx.scale(-0.1)),
        params,
        grads,
    )


def test_float32_and_bfloat16_leaves():
    for dtype, rtol in ((torch.float32, 1e-4), (torch.bfloat16, 5e-2)):
        params = {k: v.to(dtype) for k, v in _tree(6).items()}
        grads = [{k: v.to(dtype) for k, v in g.items()} for g in _grads(3)]
        ours, state = _run(galore(0.05, rank=2, update_proj_gap=2), params, grads)
        assert all(v.dtype == dtype for v in ours.values())
        assert state[0].projector["tall"].dtype == dtype
        expected = reference_galore(_tree(6), _grads(3), lr=0.05, rank=2, gap=2)
        if dtype == torch.float32:
            for k in ours:
                torch.testing.assert_close(ours[k].to(DTYPE), expected[k], rtol=rtol, atol=1e-5)


def test_functorch_path_equals_eager():
    """Under torch.func (and torch.compile: tests/test_fullgraph.py) the refresh is a selection:
    every step runs the SVD and keeps the old projector where no refresh is due."""
    shapes = {"tall": (8, 5), "wide": (4, 9), "bias": (5,)}
    params, grads = _tree(7, shapes), _grads(4, shapes)
    tx = galore(0.05, rank=2, update_proj_gap=2)

    def train(p, state):
        for g in grads:
            g = {k: v + 0.1 * p[k] for k, v in g.items()}  # batched gradients: batched SVDs
            updates, state = tx.update(g, state, p)
            p = gtx.apply_updates(p, updates)
        return p

    def loop(p):
        return train(p, tx.init(p))

    # the state (its counter included) is batched too: the refresh cannot be read on the host
    stacked = gtx.tree.tree_map(lambda x: torch.stack([x, x]), tx.init(params))
    ensemble = torch.func.vmap(train)({k: torch.stack([v, v + 1.0]) for k, v in params.items()}, stacked)
    for i, shift in enumerate((0.0, 1.0)):
        expected = loop({k: v + shift for k, v in params.items()})
        for k in expected:
            torch.testing.assert_close(ensemble[k][i], expected[k], rtol=1e-10, atol=1e-12)


def test_errors():
    with pytest.raises(TypeError, match="rank"):
        scale_by_galore(rank=2.0)
    with pytest.raises(ValueError, match="rank"):
        scale_by_galore(rank=0)
    with pytest.raises(ValueError, match="update_proj_gap"):
        scale_by_galore(update_proj_gap=0)
    params = _tree(0)
    with pytest.raises(ValueError, match=r"'bias'.*rank >= 2"):
        scale_by_galore(weight_dimension_numbers={**{k: None for k in params}, "bias": GaLoreDimensionNumbers()}).init(params)
    with pytest.raises(ValueError, match=r"'attn'.*every axis"):
        scale_by_galore(weight_dimension_numbers={**{k: None for k in params}, "attn": GaLoreDimensionNumbers()}).init(params)
    with pytest.raises(ValueError, match=r"'tall'.*overlap"):
        scale_by_galore(weight_dimension_numbers={**{k: None for k in params}, "tall": GaLoreDimensionNumbers(0, 0)}).init(params)
    with pytest.raises(TypeError, match=r"'tall'.*GaLoreDimensionNumbers"):
        scale_by_galore(weight_dimension_numbers={**{k: None for k in params}, "tall": (0, 1)}).init(params)
    with pytest.raises(ValueError, match="do not fit"):
        scale_by_galore(weight_dimension_numbers={"tall": None}).init(params)


def test_none_leaves_pass_through():
    params = {"w": torch.ones(4, 3, dtype=DTYPE), "frozen": None}
    tx = galore(0.1, rank=2)
    state = tx.init(params)
    updates, _ = tx.update({"w": torch.ones(4, 3, dtype=DTYPE), "frozen": None}, state, params)
    assert updates["frozen"] is None and updates["w"].shape == (4, 3)


@settings(max_examples=25, deadline=None)
@given(
    shape=st.lists(st.integers(1, 4), min_size=2, max_size=3),
    rows=st.integers(1, 2),
    parts=st.lists(st.integers(1, 3), min_size=3, max_size=3),
    rank=st.integers(1, 4),
    seed=st.integers(0, 2**16),
)
def test_sharded_pieces_sum_to_the_whole_projection(shape, rows, parts, rank, seed):
    """The shares of the pieces of any box partition (chunked as DTensor splits) sum to ``P^T G``
    (or ``G P``), and the pieces' blocks of ``P U`` (or ``U P^T``) tile the whole: what each rank
    computes under sharding, without communication."""
    from gradtx.contrib.galore import _matrix_of, _project_piece, _unproject_piece
    from gradtx.sharding.matrices import Piece

    rows = min(rows, len(shape) - 1)
    dims = GaLoreDimensionNumbers(tuple(range(rows)), tuple(range(rows, len(shape))))
    mat = _matrix_of("x", shape, dims, "test")
    r, left = min(rank, mat.m, mat.n), mat.m >= mat.n
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(shape, generator=gen, dtype=DTYPE)
    projector = torch.randn(mat.m if left else mat.n, r, generator=gen, dtype=DTYPE)
    update = torch.randn((r, mat.n) if left else (mat.m, r), generator=gen, dtype=DTYPE)
    whole = mat.to_matrix(g)
    expected_low = projector.mT @ whole if left else whole @ projector
    expected_full = mat.from_matrix(projector @ update if left else update @ projector.mT)

    per_dim = []
    for d, size in enumerate(shape):
        k = parts[d]
        full = -(-size // k)
        starts = [min(i * full, size) for i in range(k)]  # torch.chunk's split, the last ones short or empty
        per_dim.append([(start, min(start + full, size) - start) for start in starts])
    total = torch.zeros_like(expected_low)
    rebuilt = torch.full_like(g, float("nan"))
    for box in itertools.product(*per_dim):
        offset, size = tuple(b[0] for b in box), tuple(b[1] for b in box)
        piece = Piece(tuple(shape), size, offset, ("tp",))
        region = tuple(slice(o, o + s) for o, s in zip(offset, size))
        local = g[region]
        total = total + _project_piece(local, projector, mat, piece, left)
        rebuilt[region] = _unproject_piece(update, projector, mat, piece, left, local)
    torch.testing.assert_close(total, expected_low, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(rebuilt, expected_full, rtol=1e-10, atol=1e-12)
