"""Quantized state under sharding: each rank's codes, scales and params are its pieces of the dense
run's, bit for bit, over several AdamW steps, for 8 and 4 bits: plain pieces of a ShardingSpec
split over dim 0, dim 1 (misaligned with the blocks) and flat (ZeRO), even and uneven (numpy's
array_split), FSDP2-style uneven Shard(0) DTensors, TP Shard(1) DTensors at misaligned (odd) offsets, HSDP (Replicate, Shard(0)) on a 2x2
mesh. At 4 bits the first moment is rounded stochastically, its random bits keyed by each element's
logical index, so these cases also check that every layout draws the dense run's bits. Collectives
per step: none when no piece straddles a block, one per group otherwise. A compiled sharded step
equals the eager one."""

from __future__ import annotations

import pytest
import torch

import _world
from _layouts import Piece, cut
from _world import case
from test_sharding_collectives import count_collectives
import gradtx as gtx
from gradtx import tree as tree_lib
from gradtx.quantization import blocks
from gradtx.sharding import ShardingSpec

STEPS = 3
BLOCK = 8


def _trees(shapes, seed=0):
    gen = torch.Generator().manual_seed(seed)
    params = {k: torch.randn(s, generator=gen) for k, s in shapes.items()}
    grads = [{k: torch.randn(s, generator=gen) for k, s in shapes.items()} for _ in range(STEPS)]
    return params, grads


def _tx(bits, spec=None):
    return gtx.quantize_state(gtx.adamw(1e-2, weight_decay=0.1), bits, block_size=BLOCK, min_size=0, spec=spec)


def _run(tx, params, grads):
    """The params and state after every step, and the collectives the last step made."""
    state = tx.init(params)
    collectives = None
    for step, g in enumerate(grads):
        if step == len(grads) - 1:
            collectives = count_collectives(lambda: tx.update(g, state, params))
        updates, state = tx.update(g, state, params)
        params = gtx.apply_updates(params, updates)
    return params, state, collectives


def _box(dense_shape, local_of):
    """(first row, first column) of this rank's piece, from the same cut of an index tensor."""
    numel = torch.Size(dense_shape).numel()
    index = local_of(torch.arange(numel, dtype=torch.float64).reshape(dense_shape))
    if index.numel() == 0:
        return None
    first = int(index.reshape(-1)[0])
    columns = dense_shape[-1]
    return divmod(first, columns)


def _unpacked(codes, columns, column):
    return blocks.unpack_nibbles(codes, columns, column) if codes.dtype == torch.uint8 and codes.shape[-1] != columns else codes


def _same_bits(a, b):
    return a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


def _check(dense, got, local_of, bits):
    """``got`` (params, state) holds this rank's pieces of ``dense`` (params, state), bit for bit."""
    dense_params, dense_state, _ = dense
    params, state, _ = got
    for key, value in params.items():
        want = local_of(key, dense_params[key])
        assert torch.equal(value.to_local() if hasattr(value, "to_local") else value, want), key
    for part in range(len(dense_state.codes)):
        for key, dense_codes in dense_state.codes[part].items():
            shape = tuple(dense_params[key].shape)
            codes, scales = state.codes[part][key], state.scales[part][key]
            box = _box(shape, lambda x: local_of(key, x))
            local_shape = tuple(local_of(key, dense_params[key]).shape)
            if box is None:
                assert codes.numel() == 0 and scales.numel() == 0, (key, part)
                continue
            row, column = box
            rows = blocks.row_count(local_shape)
            geo = blocks.geometry(local_shape, BLOCK, column)
            dense_scales = dense_state.scales[part][key].reshape(blocks.row_count(shape), -1)
            want = dense_scales[row : row + rows, geo.first_block : geo.first_block + geo.blocks]
            assert _same_bits(scales.reshape(rows, -1), want), (key, part, "scales")
            whole = _unpacked(dense_codes, shape[-1], 0).reshape(blocks.row_count(shape), shape[-1])
            mine = _unpacked(codes, local_shape[-1], column).reshape(rows, local_shape[-1])
            assert torch.equal(mine, whole[row : row + rows, column : column + local_shape[-1]]), (key, part, "codes")
            if bits == 4 and column % 2 == 0:  # whole bytes where the piece starts on a byte
                assert codes.dtype == torch.uint8 and codes.shape[-1] == (local_shape[-1] + 1) // 2, key


def _plain(world, pieces, shapes, bits, seed=0):
    mesh = world.mesh((world.size,), ("dp",))
    spec = ShardingSpec(mesh, [(name, piece.spec()) for name, piece in pieces.items()])
    params, grads = _trees(shapes, seed)
    dense = _run(_tx(bits), params, grads)
    local = {k: cut(v, pieces[k], mesh) for k, v in params.items()}
    got = _run(_tx(bits, spec), local, [{k: cut(v, pieces[k], mesh) for k, v in g.items()} for g in grads])
    _check(dense, got, lambda key, x: cut(x, pieces[key], mesh), bits)
    return got[2]


@case(2, 4)
def plain_pieces_over_dim_0_dim_1_and_flat_equal_dense(world):
    shapes = {"rows": (8, 20), "cols": (3, 36), "flat": (84,), "bias": (6,)}
    pieces = {
        "rows": Piece("rows", ((("dp",), 0),)),
        "cols": Piece("cols", ((("dp",), 1),)),  # 18 or 9 columns: cuts inside blocks of 8, odd ones at 4
        "flat": Piece("flat", ((("dp",), None),)),  # ZeRO: 42 or 21 elements
        "bias": Piece("bias"),
    }
    for bits in (8, 4):
        assert _plain(world, pieces, shapes, bits) == 1, bits  # cols and flat share the one "dp" group
        # split along leading dims only, or at block boundaries: no communication
        aligned = {"rows": pieces["rows"], "cols": Piece("cols", ((("dp",), 1),)), "bias": pieces["bias"]}
        assert _plain(world, aligned, {"rows": (8, 20), "cols": (3, 32), "bias": (6,)}, bits) == 0, bits


@case(2, 4)
def uneven_plain_pieces_along_dim_1_and_flat_equal_dense(world):
    # array_split, not DTensor's chunking: 37 columns as 19 + 18 or 10 + 9 + 9 + 9 (cuts inside
    # blocks of 8, at odd columns too), 85 flat elements as 43 + 42 or 22 + 21 + 21 + 21, 7 rows
    shapes = {"cols": (3, 37), "flat": (85,), "rows": (7, 20)}
    pieces = {
        "cols": Piece("cols", ((("dp",), 1),)),
        "flat": Piece("flat", ((("dp",), None),)),
        "rows": Piece("rows", ((("dp",), 0),)),
    }
    for bits in (8, 4):
        assert _plain(world, pieces, shapes, bits, seed=1) == 1, bits  # one edge exchange for the "dp" group


@case(2, 4)
def bfloat16_storage_of_pieces_cut_along_the_last_dim_equals_dense(world):
    """bfloat16 storage is a cast, with no blocks: pieces cut inside the last dim (TP's dim 1, flat
    ZeRO pieces, uneven) hold the dense run's stored moments and params bit for bit."""
    mesh = world.mesh((world.size,), ("dp",))
    shapes = {"cols": (3, 37), "flat": (85,), "rows": (8, 20)}
    pieces = {"cols": Piece("cols", ((("dp",), 1),)), "flat": Piece("flat", ((("dp",), None),)), "rows": Piece("rows", ((("dp",), 0),))}
    spec = ShardingSpec(mesh, [(name, piece.spec()) for name, piece in pieces.items()])

    def tx(spec=None):
        return gtx.quantize_state(gtx.adamw(1e-2, weight_decay=0.1), torch.bfloat16, min_size=0, spec=spec)

    params, grads = _trees(shapes)
    dense_params, dense_state, _ = _run(tx(), params, grads)
    local = {k: cut(v, pieces[k], mesh) for k, v in params.items()}
    got_params, got_state, _ = _run(tx(spec), local, [{k: cut(v, pieces[k], mesh) for k, v in g.items()} for g in grads])
    for key in shapes:
        assert torch.equal(got_params[key], cut(dense_params[key], pieces[key], mesh)), key
        for part in range(len(dense_state.codes)):
            stored = got_state.codes[part][key]
            assert stored.dtype == torch.bfloat16, (key, part)
            assert torch.equal(stored, cut(dense_state.codes[part][key], pieces[key], mesh)), (key, part)


@case(2)
def compiled_sharded_steps_equal_eager(world):
    # where the pieces lie is found by compile_step's eager call; the graph holds the edge exchange
    mesh = world.mesh((world.size,), ("dp",))
    shapes = {"cols": (3, 37), "flat": (85,), "rows": (7, 20)}
    pieces = {
        "cols": Piece("cols", ((("dp",), 1),)),
        "flat": Piece("flat", ((("dp",), None),)),
        "rows": Piece("rows", ((("dp",), 0),)),
    }
    spec = ShardingSpec(mesh, [(name, piece.spec()) for name, piece in pieces.items()])
    params, grads = _trees(shapes, seed=2)
    local = {k: cut(v, pieces[k], mesh) for k, v in params.items()}
    local_grads = [{k: cut(v, pieces[k], mesh) for k, v in g.items()} for g in grads]
    for bits in (4,):  # 4 bits: the 8-bit path plus the packing by logical column parity
        eager_params, eager_state, _ = _run(_tx(bits, spec), local, local_grads)
        tx = _tx(bits, spec)
        step = gtx.compile_step(tx, backend="aot_eager")
        got, state = {k: v.clone() for k, v in local.items()}, tx.init(local)
        for g in local_grads:
            got, state = step(g, state, got)
        for key in shapes:
            assert torch.equal(got[key], eager_params[key]), (bits, key)
        for part in range(len(state.codes)):
            for key in shapes:
                assert torch.equal(state.codes[part][key], eager_state.codes[part][key]), (bits, part, key)
                assert _same_bits(state.scales[part][key], eager_state.scales[part][key]), (bits, part, key)
        assert torch.equal(state.inner[0].count, eager_state.inner[0].count), bits


@case(2)
def a_non_finite_block_stays_non_finite_on_every_rank(world):
    mesh = world.mesh((world.size,), ("dp",))
    pieces = {"cols": Piece("cols", ((("dp",), 1),))}
    spec = ShardingSpec(mesh, [("cols", pieces["cols"].spec())])
    params, grads = _trees({"cols": (2, 20)})
    grads[0]["cols"][0, 9] = float("nan")  # rank 0's part of block 1, which rank 1 shares
    grads[0]["cols"][1, 12] = float("inf")  # rank 1's part of the same block in row 1
    for bits in (8, 4):
        tx = _tx(bits)
        dense = tx.update(grads[0], tx.init(params), params)[1]
        tx = _tx(bits, spec)
        local = {"cols": cut(params["cols"], pieces["cols"], mesh)}
        state = tx.update({"cols": cut(grads[0]["cols"], pieces["cols"], mesh)}, tx.init(local), local)[1]
        for part in range(2):
            want = dense.scales[part]["cols"][:, 1]
            got = state.scales[part]["cols"][:, 1 if world.rank == 0 else 0]
            assert torch.isnan(want[0]) and torch.isnan(got[0]) and not torch.isfinite(got[1]), (bits, part, got)
            assert _same_bits(got, want), (bits, part, got, want)


def _dtensor_run(world, mesh, placements, shapes, bits, seed=0):
    from torch.distributed.tensor import distribute_tensor

    def distribute(tree):
        return {k: distribute_tensor(v, mesh, placements[k], src_data_rank=None) for k, v in tree.items()}

    def local_of(key, x):
        return distribute_tensor(x, mesh, placements[key], src_data_rank=None).to_local()

    params, grads = _trees(shapes, seed)
    dense = _run(_tx(bits), params, grads)
    got = _run(_tx(bits), distribute(params), [distribute(g) for g in grads])
    _check(dense, got, local_of, bits)
    return got[2]


@case(2, 4)
def fsdp2_uneven_shard0_dtensors_equal_dense(world):
    from torch.distributed.tensor import Shard

    mesh = world.mesh((world.size,), ("dp",))
    for bits in (8, 4):
        # (5, 20): uneven rows, whole blocks, no communication; (7,): 4 + 3 or 2 + 2 + 2 + 1 elements share a block
        assert _dtensor_run(world, mesh, {"w": [Shard(0)]}, {"w": (5, 20)}, bits) == 0, bits
        assert _dtensor_run(world, mesh, {"w": [Shard(0)], "v": [Shard(0)]}, {"w": (5, 20), "v": (7,)}, bits) == 1, bits


@case(2, 4)
def tp_shard1_dtensors_at_misaligned_offsets_equal_dense(world):
    from torch.distributed.tensor import Shard

    mesh = world.mesh((world.size,), ("tp",))
    placements = {"w": [Shard(1)], "u": [Shard(0)]}
    for bits in (8, 4):
        # (4, 27): 14 + 13 or 7 + 7 + 7 + 6 columns (odd offsets 7 and 21 at 4 ranks: 4-bit pairs split)
        assert _dtensor_run(world, mesh, placements, {"w": (4, 27), "u": (6, 16)}, bits) == 1, bits


@case(4)
def hsdp_replicate_shard0_on_a_2x2_mesh_equals_dense(world):
    from torch.distributed.tensor import Replicate, Shard

    mesh = world.mesh((2, 2), ("rep", "dp"))
    placements = {"w": [Replicate(), Shard(0)], "v": [Replicate(), Shard(0)]}
    for bits in (8, 4):
        assert _dtensor_run(world, mesh, placements, {"w": (5, 20), "v": (7,)}, bits) == 1, bits


@case(2)
def a_clips_coefficient_handed_to_the_sharded_8bit_step_gives_the_clipped_numbers(world):
    """``chain(clip, quantize_state(adamw, 8))`` hands the clip's coefficient on; a sharded step
    scales the gradients with it first, so its numbers and collectives are those of the chain
    with a member between (where the clip scales on its own)."""
    mesh = world.mesh((world.size,), ("dp",))
    pieces = {"rows": Piece("rows", ((("dp",), 0),)), "cols": Piece("cols", ((("dp",), 1),))}
    spec = ShardingSpec(mesh, [(name, piece.spec()) for name, piece in pieces.items()])
    params, grads = _trees({"rows": (8, 20), "cols": (3, 36)}, seed=2)
    local = {k: cut(v, pieces[k], mesh) for k, v in params.items()}
    local_grads = [{k: cut(v, pieces[k], mesh) * 10 for k, v in g.items()} for g in grads]  # clipped
    results = []
    for between in (True, False):
        middle = [gtx.identity()] if between else []
        results.append(_run(gtx.chain(gtx.clip_by_global_norm(1.0, spec), *middle, _tx(8, spec)), local, local_grads))
    (want_params, want_state, want_count), (got_params, got_state, got_count) = results
    assert float(got_state[0].norm) > 1.0 and got_count == want_count
    assert all(_same_bits(want_params[k], got_params[k]) for k in params)
    want_leaves = [x for x in tree_lib.leaves((want_state[0], want_state[2])) if isinstance(x, torch.Tensor)]
    got_leaves = [x for x in tree_lib.leaves(got_state) if isinstance(x, torch.Tensor)]
    assert len(want_leaves) == len(got_leaves)
    assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(want_leaves, got_leaves))


@pytest.mark.distributed
@pytest.mark.parametrize("size,name", _world.params_for(__name__))
def test_sharding_quantization(size, name):
    _world.check(size, name)


@case(2, 4)
def checkpoint_of_fsdp2_state_reloads_dense_and_shard1_is_a_clear_error(world):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import Shard, distribute_tensor

    from test_checkpoint_reshard import everyone_raises, remove_dir, shared_dir

    mesh = world.mesh((world.size,), ("dp",))
    for bits in (8, 4):
        params, grads = _trees({"w": (5, 20)})
        _, dense, _ = _run(_tx(bits), params, grads)

        def distribute(tree, placements):
            return {k: distribute_tensor(v, mesh, placements, src_data_rank=None) for k, v in tree.items()}

        # rows split (uneven Shard(0)): codes and scales are pieces of the dense ones; save, load dense
        sharded = distribute(params, [Shard(0)])
        _, state, _ = _run(_tx(bits), sharded, [distribute(g, [Shard(0)]) for g in grads])
        root = shared_dir(world)
        try:
            dcp.save(gtx.checkpoint.state_dict(state, sharded), checkpoint_id=root)
            template = _tx(bits).init(params)
            sd = gtx.checkpoint.state_dict(template, params, copy=True)
            dcp.load(sd, checkpoint_id=root)
            loaded = gtx.checkpoint.load_state_dict(template, sd, params)
        finally:
            remove_dir(world, root)
        for part in range(2):
            assert torch.equal(loaded.codes[part]["w"], dense.codes[part]["w"]), (bits, part)
            assert _same_bits(loaded.scales[part]["w"], dense.scales[part]["w"]), (bits, part)

        # columns split at an offset inside a block: the edge blocks' scales are on two ranks
        sharded = distribute(params, [Shard(1)])
        state = _tx(bits).init(sharded)
        everyone_raises(world, lambda: gtx.checkpoint.state_dict(state, sharded), r"state leaf '(codes|scales)\.0\.w'.*split across ranks\), but has another shape")
