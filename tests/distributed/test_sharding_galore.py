"""GaLore under sharding: every rank's update is its slice of the dense GaLore update of the whole
logical matrix, over steps that span a projector refresh, for tensor-parallel row and column shards
(a ShardingSpec on plain tensors, 2-D and 3-D leaves, left and right projectors), FSDP2's DTensor
``Shard(0)`` with uneven shards, HSDP, TP x FSDP on a 2-D mesh and a replicated-only spec; with the
number of collectives on a plain step and on a refresh step, and errors raised alike on every rank
before any data moves."""

from __future__ import annotations

import importlib

import pytest
import torch

import _world
from _layouts import close, dense_tree
from _world import case
from gradtx.contrib import GaLoreDimensionNumbers, GaLoreState, galore, scale_by_galore
from gradtx.sharding import Replicate, Shard, ShardingSpec
from test_sharding_collectives import count_collectives
from test_sharding_muon import _dtensors, _everyone_raises, _plain, _same_layout

galore_lib = importlib.import_module("gradtx.contrib.galore")  # the module (its name is also the function's)
STEPS = 3
GAP = 2  # refreshes at steps 0 and 2: step 1 is a plain step, step 2 a refresh on a state it changed


def _run(make, shapes, to_local, from_local, *, steps=STEPS, plain=None, refresh=None):
    """Dense and sharded runs side by side; every step's local update equals the dense one's slice,
    the pure update mutates nothing and the donated (in-place) one gives the same numbers.

    ``plain`` / ``refresh``: the gloo collectives expected at step 1 (no refresh) and step 2 (a
    refresh); the plans and their cross-rank checks are built at step 0.
    """
    dense_tx, tx = make(None), make(True)
    dense_params = dense_tree(shapes, seed=1)
    params = to_local(dense_params)
    dense_state, state, donated_state = dense_tx.init(dense_params), tx.init(params), tx.init(params)
    expected_counts = {1: plain, 2: refresh}
    for step in range(steps):
        grads = dense_tree(shapes, seed=100 + step)
        dense_updates, dense_state = dense_tx.update(grads, dense_state, dense_params)
        local_grads = to_local(grads)
        if expected_counts.get(step) is not None:
            copy = dict(local_grads)
            found = count_collectives(lambda: tx.update(copy, state, params))
            assert found == expected_counts[step], f"step {step}: {found} collectives, expected {expected_counts[step]}"
        before = {k: from_local(v).clone() for k, v in local_grads.items()}
        updates, state = tx.update(local_grads, state, params)
        donated, donated_state = tx.update(to_local(grads), donated_state, params, inplace=True)
        expected = to_local(dense_updates)
        for name in shapes:
            what = f"step {step} update {name!r}"
            _same_layout(updates[name], expected[name], what)
            _same_layout(donated[name], expected[name], f"step {step} donated update {name!r}")
            close(from_local(updates[name]), from_local(expected[name]), what, rtol=1e-5, atol=1e-6)
            assert torch.equal(from_local(local_grads[name]), before[name]), f"the pure update mutated {name!r}"
            assert torch.equal(from_local(donated[name]), from_local(updates[name])), f"in-place differs for {name!r}"
        # the projectors are whole (replicated) and those of the dense run
        for name, p in _galore_state(state).projector.items():
            close(p, _galore_state(dense_state).projector[name], f"step {step} projector {name!r}", rtol=1e-5, atol=1e-6)
        dense_params = {k: dense_params[k] + dense_updates[k] for k in shapes}
        params = to_local(dense_params)


def _galore_state(state):
    return state if isinstance(state, GaLoreState) else state[0]


# Each rank holds the same pieces at any size (the shapes grow with it) on a 1-D mesh: the world of 2
# runs what 4 ranks would; the 2-D meshes and uneven shards run in the world of 4 below.
@case(2)
def galore_tp_row_and_column_parallel(world):
    mesh = world.mesh((world.size,), ("tp",))
    k = world.size
    shapes = {
        "tall_rows": (3 * k, 6),  # left projector (m >= n), rows split
        "tall_cols": (16, 2 * k),  # left projector, columns split
        "wide_rows": (k, 12),  # right projector (m < n), rows split
        "wide_cols": (6, 4 * k),  # right projector, columns split
        "attn": (8, 2, k),  # (embed, heads, head_dim) as 8 x 2k, split along head_dim: scattered columns
        "conv": (3, k, 5),  # rows (0, 1) = 3k, columns 5, split along dim 1: scattered rows
        "bias": (6,),
    }
    dims = {
        "tall_rows": GaLoreDimensionNumbers(),
        "tall_cols": GaLoreDimensionNumbers(),
        "wide_rows": GaLoreDimensionNumbers(),
        "wide_cols": GaLoreDimensionNumbers(),
        "attn": GaLoreDimensionNumbers(0, (1, 2)),
        "conv": GaLoreDimensionNumbers((0, 1), 2),
        "bias": None,
    }
    split = {"tall_rows": 0, "tall_cols": 1, "wide_rows": 0, "wide_cols": 1, "attn": 2, "conv": 1}
    layout = {name: ((("tp",), dim),) for name, dim in split.items()}
    spec = ShardingSpec(mesh, [*((n, Shard("tp", dim=d)) for n, d in split.items()), ("*", Replicate())])
    to_local, from_local = _plain(world, mesh, layout)
    make = lambda s: galore(  # noqa: E731
        0.05, rank=2, update_proj_gap=GAP, weight_decay=0.1, weight_dimension_numbers=dims, spec=spec if s else None
    )
    # every projected matrix splits over "tp": one all_reduce of the low-rank shares, and on a
    # refresh step one all_gather of the whole gradients first
    _run(make, shapes, to_local, from_local, plain=1, refresh=2)
    # the default dimension numbers (2-D leaves only), rank above min(m, n), and a scale
    shapes2 = {k_: v for k_, v in shapes.items() if len(v) == 2 or k_ == "bias"}
    spec2 = ShardingSpec(mesh, [*((n, Shard("tp", dim=split[n])) for n in shapes2 if n != "bias"), ("*", Replicate())])
    make = lambda s: scale_by_galore(rank=4, update_proj_gap=GAP, scale=0.5, spec=spec2 if s else None)  # noqa: E731
    _run(make, shapes2, to_local, from_local, plain=1, refresh=2)
    # where the step cannot be read on the host (torch.compile, torch.func), every step computes
    # the SVDs and selects: every step gathers
    saved = galore_lib._refresh_on_host
    galore_lib._refresh_on_host = lambda count, gap: None
    try:
        _run(make, shapes2, to_local, from_local, plain=2, refresh=2)
    finally:
        galore_lib._refresh_on_host = saved


@case(2, 4)
def galore_fsdp2_dtensor_uneven_shards(world):
    from torch.distributed.tensor import Shard as S

    mesh = world.mesh((world.size,), ("dp",))
    # 5 rows over 2 ranks: 3 + 2; over 4: 2 + 2 + 1 + 0 (torch.chunk, as FSDP2 splits)
    shapes = {"a.weight": (5, 3), "b.weight": (7, 9), "c.weight": (3, 10), "b.bias": (7,)}
    to_local, from_local = _dtensors(mesh, {k: [S(0)] for k in shapes})
    _run(lambda s: galore(0.05, rank=2, update_proj_gap=GAP, weight_decay=0.1), shapes, to_local, from_local, plain=1, refresh=2)


@case(4)
def galore_hsdp_and_tp_by_fsdp(world):
    from torch.distributed.tensor import Replicate as R, Shard as S

    shapes = {"a.weight": (5, 6), "b.weight": (8, 6), "c.weight": (6, 4), "n.bias": (6,)}
    hsdp = world.mesh((2, 2), ("rep", "shard"))
    to_local, from_local = _dtensors(hsdp, {k: [R(), S(0)] for k in shapes})
    _run(lambda s: galore(0.05, rank=2, update_proj_gap=GAP), shapes, to_local, from_local, plain=1, refresh=2)

    mesh = world.mesh((2, 2), ("dp", "tp"))
    placements = {"a.weight": [S(0), S(0)], "b.weight": [S(0), S(1)], "c.weight": [S(1), S(0)], "n.bias": [S(0), R()]}
    to_local, from_local = _dtensors(mesh, placements)
    # every matrix over both axes (blocks of rows and columns): one group
    _run(lambda s: galore(0.05, rank=3, update_proj_gap=GAP), shapes, to_local, from_local, plain=1, refresh=2)

    # plain tensors under a spec: rows over dp and columns over tp; another leaf over tp only
    layout = {"a.weight": ((("dp",), 0), (("tp",), 1)), "b.weight": ((("tp",), 0),)}
    spec = ShardingSpec(
        mesh, [("a.weight", Shard("dp", "tp", dim=(0, 1))), ("b.weight", Shard("tp", dim=0)), ("*", Replicate())]
    )
    to_local, from_local = _plain(world, mesh, layout)
    shapes = {**shapes, "a.weight": (6, 6)}
    # two groups, (dp, tp) and (tp,): an all_reduce each, and an all_gather each on a refresh
    make = lambda s: galore(0.05, rank=2, update_proj_gap=GAP, spec=spec if s else None)  # noqa: E731
    _run(make, shapes, to_local, from_local, plain=2, refresh=4)


@case(2)  # nothing is sharded: no size to vary
def galore_replicated_only_spec(world):
    mesh = world.mesh((world.size,), ("dp",))
    shapes = {"w": (6, 5), "v": (3, 7), "b": (5,)}
    spec = ShardingSpec(mesh, default=Replicate())
    to_local, from_local = _plain(world, mesh, {})
    make = lambda s: galore(0.05, rank=2, update_proj_gap=GAP, spec=spec if s else None)  # noqa: E731
    _run(make, shapes, to_local, from_local, plain=0, refresh=0)


@case(2, 4)
def galore_errors_before_any_collective(world):
    mesh = world.mesh((world.size,), ("tp",))
    last = world.size - 1
    odd = world.rank == last
    dims = {"w": GaLoreDimensionNumbers(), "b": GaLoreDimensionNumbers()}
    # a 1-D leaf claimed as a matrix on the last rank only: every rank gets its error
    tree = {"w": torch.ones(4, 3), "b": torch.ones(2) if odd else torch.ones(2, 2)}
    spec = ShardingSpec(mesh, [("w", Shard("tp", dim=0)), ("b", Shard("tp", dim=0))])
    tx = scale_by_galore(rank=1, weight_dimension_numbers=dims, spec=spec)
    state = tx.init({"w": torch.ones(4, 3), "b": torch.ones(2, 2)})
    _everyone_raises(world, lambda: tx.update(tree, state), rf"rank {last} cannot run.*'b'.*rank >= 2")
    # a plain shard whose split dim is unknown
    tx = scale_by_galore(rank=1, spec=ShardingSpec(mesh, [("w", Shard("tp"))]))
    tree = {"w": torch.ones(4, 3)}
    with pytest.raises(ValueError, match=r"'w'.*unknown tensor dim"):
        tx.init(tree)
    # plain shards of unequal size: an error, not a wrong sum
    tx = scale_by_galore(rank=1, spec=ShardingSpec(mesh, [("w", Shard("tp", dim=0))]))
    state = tx.init({"w": torch.ones(2, 3)})
    tree = {"w": torch.ones(3 if odd else 2, 3)}
    _everyone_raises(world, lambda: tx.update(tree, state), r"disagree")


@pytest.mark.parametrize("size,name", _world.params_for(__name__))
def test_sharding_galore(size, name):
    _world.check(size, name)
