"""Adafactor's factored moments under sharding: every rank's update and state are its slices of the
dense single-process ones, step after step, for TP row/column splits of plain tensors, FSDP2-style
DTensors (uneven shards too), HSDP and TP x FSDP 2-D meshes, a matrix whose local piece is below
``min_dim_size_to_factor`` though the logical matrix is not, and a replicated-only spec; so is the
whole ``adafactor`` chain. A mesh split along one axis costs one collective per step."""

from __future__ import annotations

import pytest
import torch

import _world
from _layouts import Piece, close, cut, dense_tree
from _world import case
import gradtx as gtx
from gradtx.sharding import Replicate, Shard, ShardingSpec
from test_sharding_collectives import count_collectives

STEPS = 3
MIN_DIM = 6  # small, so that the local pieces of several matrices are below it


def _grads(shapes, step):
    return dense_tree(shapes, seed=100 + step)


def _state_piece(piece: Piece, dense_leaf_ndim: int, reduced_dim: int) -> Piece:
    """The piece of a factored moment (the leaf averaged along ``reduced_dim``) a rank holds."""
    splits = []
    for axes, dim in piece.splits:
        dim = dim % dense_leaf_ndim
        if dim == reduced_dim:
            continue
        splits.append((axes, dim - 1 if dim > reduced_dim else dim))
    return Piece(piece.source, tuple(splits))


def _factored_pair(shape):
    order = sorted(range(len(shape)), key=lambda d: shape[d])
    if len(shape) < 2 or shape[order[-2]] < MIN_DIM:
        return None
    return order[-2], order[-1]


def _check_plain(world, mesh, shapes, pieces, *, collectives=None):
    """Sharded (plain tensors + spec) vs dense, pure and donated, over several steps."""
    spec = ShardingSpec(mesh, [(name, piece.spec()) for name, piece in pieces.items()])
    tx = gtx.scale_by_factored_rms(min_dim_size_to_factor=MIN_DIM, spec=spec)
    dense_tx = gtx.scale_by_factored_rms(min_dim_size_to_factor=MIN_DIM)
    local = lambda tree: {name: cut(tree[name], piece, mesh) for name, piece in pieces.items()}  # noqa: E731
    state = tx.init(local(dense_tree(shapes, seed=1)))
    donated_state = tx.init(local(dense_tree(shapes, seed=1)))
    dense_state = dense_tx.init(dense_tree(shapes, seed=1))
    for step in range(STEPS):
        dense = _grads(shapes, step)
        grads = local(dense)
        expected, dense_state = dense_tx.update(dense, dense_state)
        if collectives is not None and step == STEPS - 1:
            n = count_collectives(lambda: tx.update(grads, state))
            assert n == collectives, f"{n} collectives per step, expected {collectives}"
        updates, state = tx.update(grads, state)
        for name, value in local(dense).items():
            assert torch.equal(grads[name], value), f"the input {name!r} was modified"
        donated = {k: v.clone() for k, v in grads.items()}
        donated_updates, donated_state = tx.update(donated, donated_state, inplace=True)
        for name, piece in pieces.items():
            close(updates[name], cut(expected[name], piece, mesh), f"step {step} update {name!r}", rtol=1e-5)
            assert torch.equal(donated_updates[name], updates[name]), f"step {step}: in-place update {name!r} differs"
            pair = _factored_pair(shapes[name])
            if pair is None:
                close(state.v[name], cut(dense_state.v[name], piece, mesh), f"step {step} v {name!r}", rtol=1e-5)
                assert state.v_row[name].shape == (1,)
                continue
            d1, d0 = pair
            ndim = len(shapes[name])
            row_piece, col_piece = _state_piece(piece, ndim, d0), _state_piece(piece, ndim, d1)
            close(state.v_row[name], cut(dense_state.v_row[name], row_piece, mesh), f"step {step} v_row {name!r}", rtol=1e-5)
            close(state.v_col[name], cut(dense_state.v_col[name], col_piece, mesh), f"step {step} v_col {name!r}", rtol=1e-5)
            for field in ("v_row", "v_col"):
                assert torch.equal(getattr(donated_state, field)[name], getattr(state, field)[name]), f"in-place {field}"
    assert int(state.count) == STEPS


def _tp_shapes_and_pieces():
    shapes = {
        "qkv.weight": (16, 12),  # column-parallel: split along dim 0 (d0, the largest)
        "proj.weight": (12, 16),  # row-parallel: split along dim 1 (d0 again)
        "up.weight": (24, 8),  # split along dim 1: the factored d1 (the smaller one)
        "small.weight": (8, 8),  # logical 8 >= MIN_DIM, local 4 or 2 < MIN_DIM
        "experts.weight": (4, 12, 8),  # 3-D, split along a dim that is not factored
        "stacked.weight": (3, 8, 16),  # 3-D, split along the factored d1
        "proj.bias": (12,),  # replicated vector
        "qkv.bias": (16,),  # split vector, no dim named: dim 0
        "scale": (),  # 0-d, replicated
    }
    pieces = {
        "qkv.weight": Piece("qkv.weight", ((("tp",), 0),)),
        "proj.weight": Piece("proj.weight", ((("tp",), 1),)),
        "up.weight": Piece("up.weight", ((("tp",), 1),)),
        "small.weight": Piece("small.weight", ((("tp",), 1),)),
        "experts.weight": Piece("experts.weight", ((("tp",), 0),)),
        "stacked.weight": Piece("stacked.weight", ((("tp",), 1),)),
        "proj.bias": Piece("proj.bias"),
        "qkv.bias": Piece("qkv.bias", ((("tp",), 0),)),
        "scale": Piece("scale"),
    }
    return shapes, pieces


@case(2, 4)
def factored_tp_rows_and_columns(world):
    mesh = world.mesh((world.size,), ("tp",))
    shapes, pieces = _tp_shapes_and_pieces()
    # every matrix is split along one axis, tp: its row sums, column sums and totals share one group
    _check_plain(world, mesh, shapes, pieces, collectives=1)
    spec = ShardingSpec(mesh, [(name, piece.spec()) for name, piece in pieces.items()])
    # the local piece of "small.weight" is too small to be factored on its own: the state is factored
    state = gtx.scale_by_factored_rms(min_dim_size_to_factor=MIN_DIM, spec=spec).init(
        {name: cut(x, pieces[name], mesh) for name, x in dense_tree(shapes).items()}
    )
    assert state.v_row["small.weight"].shape == (8,) and state.v_col["small.weight"].shape == (8 // world.size,)


@case(2)  # nothing is sharded: no size to vary
def factored_replicated_only_spec(world):
    mesh = world.mesh((world.size,), ("tp",))
    shapes = {"w": (12, 8), "b": (8,), "t": (2, 7, 9)}
    pieces = {name: Piece(name) for name in shapes}
    _check_plain(world, mesh, shapes, pieces, collectives=0)


@case(4)
def factored_tp_x_fsdp_plain(world):
    mesh = world.mesh((2, 2), ("dp", "tp"))
    shapes = {"row.weight": (8, 12), "col.weight": (16, 8), "both.weight": (12, 8), "b": (6,)}
    pieces = {
        "row.weight": Piece("row.weight", ((("dp",), 0), (("tp",), 1))),  # FSDP dim 0, TP row-parallel dim 1
        "col.weight": Piece("col.weight", ((("dp", "tp"), 0),)),  # FSDP and TP both on dim 0
        "both.weight": Piece("both.weight", ((("tp",), 1), (("dp",), 0))),
        "b": Piece("b", ((("dp",), 0),)),
    }
    # row sums over one axis, column sums over the other, totals over both: three groups
    _check_plain(world, mesh, shapes, pieces, collectives=3)


@case(4)
def factored_hsdp_plain(world):
    mesh = world.mesh((2, 2), ("replicate", "shard"))
    shapes = {"w": (10, 8), "v": (8, 14), "b": (6,)}
    pieces = {
        "w": Piece("w", ((("shard",), 0),)),
        "v": Piece("v", ((("shard",), 0),)),
        "b": Piece("b"),
    }
    _check_plain(world, mesh, shapes, pieces, collectives=1)


def _local(x):
    from torch.distributed.tensor import DTensor

    return x.to_local() if isinstance(x, DTensor) else x


def _check_dtensors(world, layouts, shapes, *, spec=None, collectives=None):
    """DTensor gradients (each leaf ``(mesh, placements)`` or ``None`` for a plain replicated tensor)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    def distribute(tree):
        return {k: distribute_tensor(v, *layouts[k], src_data_rank=None) if layouts.get(k) else v.clone() for k, v in tree.items()}

    def same_layout(dense, like):
        """The dense tensor cut as ``like`` is (its local piece), or itself for a plain tensor."""
        if not isinstance(like, DTensor):
            return dense
        return distribute_tensor(dense, like.device_mesh, like.placements, src_data_rank=None).to_local()

    tx = gtx.scale_by_factored_rms(min_dim_size_to_factor=MIN_DIM, spec=spec)
    dense_tx = gtx.scale_by_factored_rms(min_dim_size_to_factor=MIN_DIM)
    params = distribute(dense_tree(shapes, seed=1))
    state, donated_state = tx.init(params), tx.init(params)
    dense_state = dense_tx.init(dense_tree(shapes, seed=1))
    for step in range(STEPS):
        dense = _grads(shapes, step)
        grads = distribute(dense)
        expected, dense_state = dense_tx.update(dense, dense_state)
        if collectives is not None and step == STEPS - 1:
            n = count_collectives(lambda: tx.update(grads, state))
            assert n == collectives, f"{n} collectives per step, expected {collectives}"
        updates, state = tx.update(grads, state)
        donated_updates, donated_state = tx.update(distribute(dense), donated_state, inplace=True)
        for name in shapes:
            assert type(updates[name]) is type(grads[name]), name
            if isinstance(grads[name], DTensor):
                assert updates[name].placements == grads[name].placements, name
            assert torch.equal(_local(grads[name]), same_layout(dense[name], grads[name])), f"input {name!r} modified"
            close(_local(updates[name]), same_layout(expected[name], grads[name]), f"step {step} update {name!r}", rtol=1e-5)
            assert torch.equal(_local(donated_updates[name]), _local(updates[name])), f"in-place update {name!r}"
            for field in ("v_row", "v_col", "v"):
                mine, reference = getattr(state, field)[name], getattr(dense_state, field)[name]
                assert mine.shape == reference.shape, f"{field} {name!r}: {tuple(mine.shape)} vs {tuple(reference.shape)}"
                close(_local(mine), same_layout(reference, mine), f"step {step} {field} {name!r}", rtol=1e-5)
                assert torch.equal(_local(getattr(donated_state, field)[name]), _local(mine)), f"in-place {field}"


@case(2, 4)
def factored_fsdp2_dtensors_uneven(world):
    from torch.distributed.tensor import Shard as S

    mesh = world.mesh((world.size,), ("dp",))
    shapes = {
        "a.weight": (10, 7),  # uneven over 4 (3, 3, 3, 1); local rows 3 < MIN_DIM, logical 10
        "b.weight": (7, 9),  # split along d1 (the smaller dim), uneven
        "c.weight": (3, 8, 6),  # 3 rows over 4 ranks: one rank holds nothing
        "d.weight": (13, 6),
        "bias": (5,),
        "plain": (6, 6),  # a plain tensor among DTensors: replicated
    }
    layouts = {name: (mesh, [S(0)]) for name in shapes if name != "plain"}
    _check_dtensors(world, layouts, shapes, collectives=1)


@case(4)
def factored_hsdp_dtensors(world):
    from torch.distributed.tensor import Replicate as R, Shard as S

    mesh = world.mesh((2, 2), ("replicate", "shard"))
    shapes = {"w": (11, 8), "v": (7, 12), "b": (6,)}
    layouts = {name: (mesh, [R(), S(0)]) for name in shapes}
    _check_dtensors(world, layouts, shapes, collectives=1)


@case(4)
def factored_tp_x_fsdp_dtensors(world):
    from torch.distributed.tensor import Replicate as R, Shard as S

    mesh = world.mesh((2, 2), ("dp", "tp"))
    shapes = {"row.weight": (9, 12), "col.weight": (14, 8), "dp_only.weight": (6, 10), "norm": (8,)}
    layouts = {
        "row.weight": (mesh, [S(0), S(1)]),
        "col.weight": (mesh, [S(0), S(0)]),
        "dp_only.weight": (mesh["dp"], [S(0)]),
        "norm": (mesh, [R(), R()]),
    }
    _check_dtensors(world, layouts, shapes)
    _check_dtensors(world, layouts, shapes, spec=ShardingSpec(mesh, default=Replicate()))


@case(2, 4)
def factored_unknown_split_dim_is_an_error(world):
    mesh = world.mesh((world.size,), ("tp",))
    spec = ShardingSpec(mesh, [("w", Shard("tp")), ("b", Shard("tp"))])
    grads = {"w": torch.ones(8, 4), "b": torch.ones(4)}
    tx = gtx.scale_by_factored_rms(min_dim_size_to_factor=2, spec=spec)
    with pytest.raises(ValueError, match=r"'w'.*'tp'.*dim="):
        tx.init(grads)
    with pytest.raises(ValueError, match=r"'w'.*'tp'.*dim="):
        tx.update(grads, gtx.scale_by_factored_rms(min_dim_size_to_factor=2).init(grads))
    # unfactored, the split dim does not matter
    gtx.scale_by_factored_rms(factored=False, spec=spec).update(grads, gtx.scale_by_factored_rms(factored=False).init(grads))


@case(2)
def factored_uneven_plain_pieces_are_an_error_on_every_rank(world):
    """Plain pieces must be even: a matrix split 4 + 3 makes each rank rebuild another logical
    shape (so other means, or a factoring on one rank only: different collectives). Every rank
    raises the cross-rank check's error naming the leaf, before any reduction, instead of silently
    wrong numbers, an abort in gloo, or a wait."""
    mesh = world.mesh((2,), ("tp",))
    spec = ShardingSpec(mesh, [("w", Shard("tp", dim=1)), ("b", Shard("tp", dim=0))])
    width = 4 if world.rank == 0 else 3
    grads = {"w": torch.ones(8, width), "b": torch.ones(width)}
    for make in (lambda: gtx.scale_by_factored_rms(min_dim_size_to_factor=2, spec=spec), lambda: gtx.adafactor(1e-2, min_dim_size_to_factor=2, spec=spec)):
        tx = make()
        with pytest.raises(ValueError, match=r"ranks disagree on the whole shape of leaf 'w'.*must be split evenly"):
            tx.update(grads, tx.init(grads), grads)
    even = {"w": torch.ones(8, 4), "b": torch.ones(4)}  # the same transformation on even pieces runs
    tx = gtx.scale_by_factored_rms(min_dim_size_to_factor=2, spec=spec)
    tx.update(even, tx.init(even))


@case(2, 4)
def adafactor_with_a_spec_matches_dense(world):
    mesh = world.mesh((world.size,), ("tp",))
    shapes, pieces = _tp_shapes_and_pieces()
    spec = ShardingSpec(mesh, [(name, piece.spec()) for name, piece in pieces.items()])
    local = lambda tree: {name: cut(tree[name], piece, mesh) for name, piece in pieces.items()}  # noqa: E731
    kwargs = dict(learning_rate=0.05, min_dim_size_to_factor=MIN_DIM, momentum=0.9, weight_decay_rate=1e-3)
    tx, dense_tx = gtx.adafactor(**kwargs, spec=spec), gtx.adafactor(**kwargs)
    dense_params = dense_tree(shapes, seed=1)
    params = local(dense_params)
    state, dense_state = tx.init(params), dense_tx.init(dense_params)
    for step in range(STEPS):
        dense = _grads(shapes, step)
        # large gradients, so that clip_by_block_rms clips
        dense = {k: 10.0 * v for k, v in dense.items()}
        updates, state = tx.update(local(dense), state, params)
        dense_updates, dense_state = dense_tx.update(dense, dense_state, dense_params)
        params, dense_params = gtx.apply_updates(params, updates), gtx.apply_updates(dense_params, dense_updates)
        for name, value in local(dense_params).items():
            close(params[name], value, f"step {step} param {name!r}", rtol=1e-5)


@case(4)
def adafactor_fsdp_dtensors_match_dense(world):
    from torch.distributed.tensor import Shard as S, distribute_tensor

    mesh = world.mesh((2, 2), ("dp", "tp"))
    shapes = {"row.weight": (9, 12), "col.weight": (14, 8), "bias": (5,)}
    layouts = {"row.weight": [S(0), S(1)], "col.weight": [S(0), S(0)], "bias": [S(0), S(0)]}
    distribute = lambda tree: {k: distribute_tensor(v, mesh, layouts[k], src_data_rank=None) for k, v in tree.items()}  # noqa: E731
    kwargs = dict(learning_rate=0.05, min_dim_size_to_factor=MIN_DIM)
    tx, dense_tx = gtx.adafactor(**kwargs), gtx.adafactor(**kwargs)
    dense_params = dense_tree(shapes, seed=1)
    params = distribute(dense_params)
    state, dense_state = tx.init(params), dense_tx.init(dense_params)
    for step in range(STEPS):
        dense = _grads(shapes, step)
        updates, state = tx.update(distribute(dense), state, params)
        dense_updates, dense_state = dense_tx.update(dense, dense_state, dense_params)
        params, dense_params = gtx.apply_updates(params, updates), gtx.apply_updates(dense_params, dense_updates)
        for name, value in distribute(dense_params).items():
            close(params[name].to_local(), value.to_local(), f"step {step} param {name!r}", rtol=1e-5)


@case(2)
def galore_takes_sharded_matrices_whole(world):
    """GaLore on a DTensor matrix projects the whole logical matrix (not local SVDs): its projector
    has the logical shape (test_sharding_galore checks the numbers)."""
    from torch.distributed.tensor import Shard as S, distribute_tensor

    from gradtx.contrib import galore

    mesh = world.mesh((world.size,), ("dp",))
    params = {"w": distribute_tensor(torch.ones(8, 4), mesh, [S(0)]), "b": torch.ones(4)}
    state = galore(0.1, rank=2).init(params)
    assert tuple(state[0].projector["w"].shape) == (8, 2)
    assert tuple(state[0].base_optimizer_state.mu["w"].shape) == (2, 4)


@pytest.mark.distributed
@pytest.mark.parametrize("size,name", _world.params_for(__name__))
def test_factored(size, name):
    _world.check(size, name)
