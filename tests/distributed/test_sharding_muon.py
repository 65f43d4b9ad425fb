"""Muon under sharding: every rank's update is its slice of the dense Muon update of the whole
logical matrix, for tensor-parallel column and row shards (a ShardingSpec on plain tensors), FSDP2's
DTensor ``Shard(0)`` with uneven shards, HSDP, TP x FSDP on a 2-D mesh, stacked experts sharded over
``ep``, and a replicated-only spec; with the number of collectives per step, and errors raised
alike on every rank before any gather."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

import _world
from _layouts import close, dense_tree
from _world import case
from gradtx.contrib import MuonDimensionNumbers, muon, scale_by_muon
from gradtx.sharding import Replicate, Shard, ShardingSpec
from test_sharding_collectives import count_collectives

STEPS = 2  # step 1 carries step 0's momentum, and is the step whose collectives are counted
FAST_S = 10.0


def _grads(shapes, step):
    return dense_tree(shapes, seed=100 + step)


def _run(make, shapes, to_local, from_local, *, steps=STEPS, collectives=None):
    """Dense and sharded runs side by side; every step's local update equals the dense one's slice,
    the pure update mutates nothing and the donated (in-place) one gives the same numbers.

    ``collectives``: the gloo collectives expected in each step after the first (plan and check built).
    """
    dense_tx, tx = make(None), make(True)
    dense_params = dense_tree(shapes, seed=1)
    params = to_local(dense_params)
    dense_state, state, donated_state = dense_tx.init(dense_params), tx.init(params), tx.init(params)
    for step in range(steps):
        grads = _grads(shapes, step)
        dense_updates, dense_state = dense_tx.update(grads, dense_state, dense_params)
        local_grads = to_local(grads)
        if collectives is not None and step == 1:
            copy = {k: v for k, v in local_grads.items()}
            found = count_collectives(lambda: tx.update(copy, state, params))
            assert found == collectives, f"step {step}: {found} collectives, expected {collectives}"
        before = {k: from_local(v).clone() for k, v in local_grads.items()}
        updates, state = tx.update(local_grads, state, params)
        donated, donated_state = tx.update(to_local(grads), donated_state, params, inplace=True)
        expected = to_local(dense_updates)
        for name in shapes:
            _same_layout(updates[name], expected[name], f"step {step} update {name!r}")
            _same_layout(donated[name], expected[name], f"step {step} donated update {name!r}")
            close(from_local(updates[name]), from_local(expected[name]), f"step {step} update {name!r}", rtol=1e-5, atol=1e-6)
            assert torch.equal(from_local(local_grads[name]), before[name]), f"the pure update mutated {name!r}"
            assert torch.equal(from_local(donated[name]), from_local(updates[name])), f"in-place differs for {name!r}"
        dense_params = {k: dense_params[k] + dense_updates[k] for k in shapes}
        params = to_local(dense_params)


def _plain(world, mesh, layout):
    """(to_local, from_local) for plain tensors cut by ``layout``: name -> ((axes, dim), ...)."""
    names = mesh.mesh_dim_names
    sizes = dict(zip(names, mesh.shape))
    coordinate = dict(zip(names, mesh.get_coordinate()))

    def to_local(tree):
        out = {}
        for name, x in tree.items():
            for axes, dim in layout.get(name, ()):
                index, count = 0, 1
                for axis in [a for a in names if a in axes]:
                    index, count = index * sizes[axis] + coordinate[axis], count * sizes[axis]
                x = torch.tensor_split(x, count, dim)[index]
            out[name] = x.clone()
        return out

    return to_local, lambda x: x


def _dtensors(mesh, placements):
    """(to_local, from_local) for DTensors placed by ``placements``. Every rank holds the same dense
    tree, so each cuts its own shard and nothing is sent; results are compared shard by shard
    (``from_local`` is the local shard), after ``_same_layout`` has checked their placements."""
    from torch.distributed.tensor import distribute_tensor

    def to_local(tree):
        return {
            k: distribute_tensor(v, mesh, placements[k], src_data_rank=None) if k in placements else v.clone()
            for k, v in tree.items()
        }

    def from_local(x):
        return x.to_local() if hasattr(x, "to_local") else x

    return to_local, from_local


def _same_layout(actual, expected, what: str) -> None:
    """``actual`` is a DTensor laid out as ``expected`` (its mesh, placements, logical shape), or
    both are plain tensors: so equal local shards on every rank mean equal logical tensors."""
    if hasattr(expected, "placements"):
        assert hasattr(actual, "placements"), f"{what}: a plain tensor where a DTensor was expected"
        got = (actual.device_mesh, tuple(actual.placements), tuple(actual.shape))
        want = (expected.device_mesh, tuple(expected.placements), tuple(expected.shape))
        assert got == want, f"{what}: laid out as {got}, expected {want}"
    else:
        assert not hasattr(actual, "placements"), f"{what}: a DTensor where a plain tensor was expected"


# A 1-D mesh of even pieces: the world of 2 runs the same collectives; a rank that owns no matrix
# (3 matrices over 4 ranks) is met in the world of 4 by muon_fsdp2_dtensor_uneven_shards (DTensors)
# and muon_hsdp_and_tp_by_fsdp (plain pieces under a spec).
@case(2)
def muon_tp_column_and_row_parallel(world):
    mesh = world.mesh((world.size,), ("tp",))
    shapes = {"qkv.weight": (12, 6), "proj.weight": (6, 8), "proj.bias": (6,), "wide.weight": (4, 16)}
    layout = {"qkv.weight": ((("tp",), 0),), "proj.weight": ((("tp",), 1),), "wide.weight": ((("tp",), 1),)}
    spec = ShardingSpec(
        mesh,
        [("qkv.weight", Shard("tp", dim=0)), ("proj.weight", Shard("tp", dim=1)), ("wide.weight", Shard("tp", dim=1)), ("*", Replicate())],
    )
    to_local, from_local = _plain(world, mesh, layout)
    # every sharded matrix splits over "tp" and is float32: one bucket, one owner per matrix, two all_to_alls
    _run(lambda s: muon(0.02, weight_decay=0.1, spec=spec if s else None), shapes, to_local, from_local, collectives=2)
    # every rank orthogonalizes every matrix: one all_gather
    make = lambda s: muon(0.02, weight_decay=0.1, spec=spec if s else None, strategy="gather")  # noqa: E731
    _run(make, shapes, to_local, from_local, collectives=1)
    _run(
        lambda s: scale_by_muon(adaptive=True, nesterov=False, preconditioning="aol", spec=spec if s else None),
        {k: v for k, v in shapes.items() if k != "proj.bias"},
        to_local,
        from_local,
        collectives=2,
    )


@case(2, 4)
def muon_fsdp2_dtensor_uneven_shards(world):
    from torch.distributed.tensor import Shard as S

    mesh = world.mesh((world.size,), ("dp",))
    # 5 rows over 2 ranks: 3 + 2; over 4: 2 + 2 + 1 + 0 (torch.chunk, as FSDP2 splits)
    shapes = {"a.weight": (5, 3), "b.weight": (7, 9), "c.weight": (3, 10), "b.bias": (7,)}
    to_local, from_local = _dtensors(mesh, {k: [S(0)] for k in shapes})
    _run(lambda s: muon(0.02, consistent_rms=0.2), shapes, to_local, from_local, collectives=2)
    _run(lambda s: muon(0.02, strategy="gather"), shapes, to_local, from_local, steps=2, collectives=1)


@case(4)
def muon_hsdp_and_tp_by_fsdp(world):
    from torch.distributed.tensor import Replicate as R, Shard as S

    shapes = {"a.weight": (5, 6), "b.weight": (8, 6), "c.weight": (6, 4), "n.bias": (6,)}
    hsdp = world.mesh((2, 2), ("rep", "shard"))
    to_local, from_local = _dtensors(hsdp, {k: [R(), S(0)] for k in shapes})
    _run(lambda s: muon(0.02), shapes, to_local, from_local, collectives=2)

    mesh = world.mesh((2, 2), ("dp", "tp"))
    placements = {"a.weight": [S(0), S(0)], "b.weight": [S(0), S(1)], "c.weight": [S(1), S(0)], "n.bias": [S(0), R()]}
    to_local, from_local = _dtensors(mesh, placements)
    # every matrix over both axes (whatever the dims): one group, two all_to_alls, or one all_gather
    _run(lambda s: muon(0.02, preconditioning="schatten"), shapes, to_local, from_local, collectives=2)
    _run(lambda s: muon(0.02, strategy="gather"), shapes, to_local, from_local, steps=2, collectives=1)

    # the same on plain tensors under a spec: rows over dp, columns over tp; another leaf over tp only
    layout = {"a.weight": ((("dp",), 0), (("tp",), 1)), "b.weight": ((("tp",), 0),)}
    spec = ShardingSpec(
        mesh, [("a.weight", Shard("dp", "tp", dim=(0, 1))), ("b.weight", Shard("tp", dim=0)), ("*", Replicate())]
    )
    to_local, from_local = _plain(world, mesh, layout)
    # two groups ((dp, tp) and (tp,)): two all_to_alls each, or one all_gather each (plain shards are
    # equal: 6 rows, not 5)
    shapes = {**shapes, "a.weight": (6, 6)}
    _run(lambda s: muon(0.02, spec=spec if s else None), shapes, to_local, from_local, collectives=4)
    _run(lambda s: muon(0.02, spec=spec if s else None, strategy="gather"), shapes, to_local, from_local, steps=2, collectives=2)


@case(2, 4)
def muon_stacked_experts_over_ep(world):
    from torch.distributed.tensor import Shard as S

    mesh = world.mesh((world.size,), ("ep",))
    experts = 2 * world.size
    shapes = {"experts.w1": (experts, 6, 4), "experts.w2": (experts, 4, 6), "router": (6, experts)}
    dims = {"experts.w1": MuonDimensionNumbers(1, 2), "experts.w2": MuonDimensionNumbers(1, 2), "router": MuonDimensionNumbers()}
    layout = {"experts.w1": ((("ep",), 0),), "experts.w2": ((("ep",), 0),)}
    spec = ShardingSpec(mesh, [("experts.*", Shard("ep", dim=0)), ("*", Replicate())])
    to_local, from_local = _plain(world, mesh, layout)
    # each expert is its own matrix: the expert dim is a batch dim, nothing to gather
    _run(lambda s: muon(0.02, muon_weight_dimension_numbers=dims, spec=spec if s else None), shapes, to_local, from_local, collectives=0)
    # adaptive scales by a sum over the whole leaf: each leaf goes whole to its owner
    make = lambda s: scale_by_muon(adaptive=True, weight_dimension_numbers=dims, spec=spec if s else None)  # noqa: E731
    _run(make, shapes, to_local, from_local, collectives=2)
    # the same as DTensors, with uneven experts (5 over the ranks)
    shapes = {"experts.w1": (5, 6, 4)}
    to_local, from_local = _dtensors(mesh, {"experts.w1": [S(0)]})
    dims = {"experts.w1": MuonDimensionNumbers(1, 2)}
    _run(lambda s: muon(0.02, muon_weight_dimension_numbers=dims), shapes, to_local, from_local, collectives=0)
    for strategy, collectives in (("owner", 2), ("gather", 1)):  # uneven 3-D pieces, gathered whole
        make = lambda s, strategy=strategy: scale_by_muon(adaptive=True, weight_dimension_numbers=dims, strategy=strategy)  # noqa: E731
        _run(make, shapes, to_local, from_local, steps=2, collectives=collectives)


@case(2)  # nothing is sharded: no size to vary
def muon_replicated_only_spec(world):
    mesh = world.mesh((world.size,), ("dp",))
    shapes = {"w": (6, 5), "v": (3, 7), "b": (5,)}
    spec = ShardingSpec(mesh, default=Replicate())
    to_local, from_local = _plain(world, mesh, {})
    _run(lambda s: muon(0.02, spec=spec if s else None), shapes, to_local, from_local, collectives=0)


def _everyone_raises(world, fn, match):
    start = time.perf_counter()
    with pytest.raises(ValueError, match=match) as info:
        fn()
    assert time.perf_counter() - start < FAST_S, "the error took as long as a collective timeout"
    messages: list = [None] * world.size
    dist.all_gather_object(messages, str(info.value))
    assert len(set(messages)) == 1, f"ranks raised different messages: {messages}"


@case(2, 4)
def muon_errors_before_any_collective(world):
    from torch.distributed.tensor import DTensor, Partial

    mesh = world.mesh((world.size,), ("tp",))
    last = world.size - 1
    odd = world.rank == last
    spec = ShardingSpec(mesh, [("w", Shard("tp", dim=0)), ("b", Shard("tp", dim=0))])
    grads = {"w": torch.ones(4, 3), "b": torch.ones(2)}
    tx = scale_by_muon(spec=spec)
    # a 1-D leaf claimed as a matrix (here on every rank)
    _everyone_raises(world, lambda: tx.update(grads, tx.init(grads)), r"'b'.*rank >= 2")
    # a 1-D leaf on the last rank only: every rank gets its error
    tree = {"w": torch.ones(4, 3), "b": torch.ones(2) if odd else torch.ones(2, 2)}
    tx = scale_by_muon(spec=ShardingSpec(mesh, [("w", Shard("tp", dim=0)), ("b", Shard("tp", dim=0))]))
    _everyone_raises(world, lambda: tx.update(tree, tx.init(tree)), rf"rank {last} cannot run.*'b'.*rank >= 2")
    # a plain shard whose split dim is unknown
    tx = scale_by_muon(spec=ShardingSpec(mesh, [("w", Shard("tp"))]))
    tree = {"w": torch.ones(4, 3)}
    _everyone_raises(world, lambda: tx.update(tree, tx.init(tree)), r"'w'.*unknown tensor dim.*dim=")
    # a Partial DTensor on the last rank only
    tree = {"w": DTensor.from_local(torch.ones(4, 3), mesh, [Partial()], run_check=False) if odd else torch.ones(4, 3)}
    tx = scale_by_muon(spec=ShardingSpec(mesh, [("w", Shard("tp", dim=0))]))
    _everyone_raises(world, lambda: tx.update(tree, tx.init(tree)), rf"{last}.*'w'.*Partial")
    # ranks that disagree on the spec
    rule = Shard("tp", dim=1) if odd else Shard("tp", dim=0)
    tx = scale_by_muon(spec=ShardingSpec(mesh, [("w", rule)]))
    _everyone_raises(world, lambda: tx.update(tree_plain(), tx.init(tree_plain())), r"disagree.*'w'")
    # plain shards of unequal size: an error, not a wrong gather
    tx = scale_by_muon(spec=ShardingSpec(mesh, [("w", Shard("tp", dim=0))]))
    tree = {"w": torch.ones(3 if odd else 2, 3)}
    _everyone_raises(world, lambda: tx.update(tree, tx.init(tree)), r"disagree")


def tree_plain():
    return {"w": torch.ones(4, 3)}


@pytest.mark.parametrize("size,name", _world.params_for(__name__))
def test_sharding_muon(size, name):
    _world.check(size, name)
