"""Exact norms and clips across real gloo worlds: TP, DP x TP, ZeRO, PP x TP with a tied embedding,
pp x dp x tp, MoE (dp x ep x tp). Each rank holds its pieces of one dense tree; gradtx must give the
dense numbers (p = 1, 2, inf), per-leaf norms, block RMS and AGC included."""

from __future__ import annotations

import pytest

import _world
from _layouts import Piece, check_layout, dense_tree, rules
from _world import case
from gradtx.sharding import Replicate, Shard, ShardingSpec

D, FFN, VOCAB, EXPERTS = 8, 16, 12, 4
COL, ROW = 0, 1


def tp_model(n_layers: int, *, stages: int = 1, tied: bool = False, zero: tuple[str, ...] = ()):
    """Dense shapes and Megatron-style pieces: vocab/column-parallel, row-parallel, replicated.

    With ``stages``, layers are spread over pipeline stages (embedding first, final norm last);
    ``tied`` adds ``lm_head.weight`` on the last stage, a duplicate of the embedding; ``zero``
    also splits every piece flat over those axes (ZeRO / FSDP).
    """
    shapes: dict[str, tuple[int, ...]] = {"embed.weight": (VOCAB, D)}
    pieces: dict[str, Piece] = {}
    extra = ((zero, None),) if zero else ()
    last = stages - 1

    def add(name, shape, splits, stage):
        shapes[name] = shape
        pieces[name] = Piece(name, tuple(splits) + extra, stage if stages > 1 else None)

    add("embed.weight", (VOCAB, D), ((("tp",), COL),), 0)
    for i in range(n_layers):
        stage = i * stages // n_layers
        p = f"layers.{i}."
        add(p + "ln.weight", (D,), (), stage)
        add(p + "ln.bias", (D,), (), stage)
        add(p + "qkv.weight", (3 * D, D), ((("tp",), COL),), stage)
        add(p + "qkv.bias", (3 * D,), ((("tp",), 0),), stage)
        add(p + "proj.weight", (D, D), ((("tp",), ROW),), stage)
        add(p + "proj.bias", (D,), (), stage)
        add(p + "fc1.weight", (FFN, D), ((("tp",), COL),), stage)
        add(p + "fc2.weight", (D, FFN), ((("tp",), ROW),), stage)
    add("ln_f.weight", (D,), (), last)
    if tied:
        pieces["lm_head.weight"] = Piece(
            "embed.weight", ((("tp",), COL),) + extra, last if stages > 1 else None, duplicate=True
        )
    return shapes, pieces


def only_group(spec: ShardingSpec) -> tuple[str, ...]:
    (plan,) = spec.plans.values()
    return plan.global_axes


@case(2)  # a 1-D mesh of even pieces; the 2-D and 3-D meshes below run in the worlds of 4 and 8
def tp(world):
    mesh = world.mesh((world.size,), ("tp",))
    shapes, pieces = tp_model(2, tied=True)
    spec = ShardingSpec(mesh, rules(pieces))
    check_layout(dense_tree(shapes), pieces, mesh, spec, params=dense_tree(shapes, seed=1))
    assert only_group(spec) == ("tp",)


@case(2)
def tp_globs_and_default(world):
    """The DESIGN-style glob rules with a default, and a pytree prefix, give the same layout."""
    mesh = world.mesh((2,), ("tp",))
    shapes, pieces = tp_model(2)
    globs = ShardingSpec(
        mesh,
        [
            ("embed.*", Shard("tp", dim=COL)),
            ("*.qkv.*", Shard("tp", dim=COL)),
            ("*.fc1.weight", Shard("tp", dim=COL)),
            ("*.proj.weight", Shard("tp", dim=ROW)),
            ("*.fc2.weight", Shard("tp", dim=ROW)),
        ],
        default=Replicate(),
    )
    check_layout(dense_tree(shapes), pieces, mesh, globs, params=dense_tree(shapes, seed=1), p_values=(2.0,))
    prefix = {name: piece.spec() for name, piece in pieces.items()}
    check_layout(dense_tree(shapes), pieces, mesh, ShardingSpec(mesh, prefix), p_values=(2.0,))
    by_callable = ShardingSpec(mesh, lambda path, tensor: pieces[path].spec())
    check_layout(dense_tree(shapes), pieces, mesh, by_callable, p_values=(2.0,))


@case(4)
def dp_tp(world):
    mesh = world.mesh((2, 2), ("dp", "tp"))
    shapes, pieces = tp_model(2, tied=True)
    spec = ShardingSpec(mesh, rules(pieces))
    check_layout(dense_tree(shapes), pieces, mesh, spec, params=dense_tree(shapes, seed=1))
    assert only_group(spec) == ("tp",), "data-parallel copies must not join the reduction"


@case(2)  # every flattened leaf of tp_model(1) splits evenly over 2 and over 4: the same pieces, halved
def zero_dp(world):
    mesh = world.mesh((world.size,), ("dp",))
    shapes, pieces = tp_model(1)
    pieces = {name: Piece(p.source, (((("dp",), None)),)) for name, p in pieces.items()}  # flat, uneven
    spec = ShardingSpec(mesh, rules(pieces))
    check_layout(dense_tree(shapes), pieces, mesh, spec)


@case(4)
def zero_tp(world):
    mesh = world.mesh((2, 2), ("dp", "tp"))
    shapes, pieces = tp_model(2, zero=("dp",))
    spec = ShardingSpec(mesh, rules(pieces))
    check_layout(dense_tree(shapes), pieces, mesh, spec)
    assert only_group(spec) == ("dp", "tp")


@case(4)
def pp_tp_tied(world):
    mesh = world.mesh((2, 2), ("pp", "tp"))
    shapes, pieces = tp_model(2, stages=2, tied=True)
    spec = ShardingSpec(mesh, rules(pieces), stage_axis="pp")
    check_layout(dense_tree(shapes), pieces, mesh, spec, stage_axis="pp", params=dense_tree(shapes, seed=1))
    assert only_group(spec) == ("pp", "tp")


@case(8)
def pp_dp_tp(world):
    mesh = world.mesh((2, 2, 2), ("pp", "dp", "tp"))
    shapes, pieces = tp_model(4, stages=2, tied=True)
    spec = ShardingSpec(mesh, rules(pieces), stage_axis="pp")
    check_layout(dense_tree(shapes), pieces, mesh, spec, stage_axis="pp", params=dense_tree(shapes, seed=1))
    assert only_group(spec) == ("pp", "tp")


@case(8)
def pp_dp_tp_zero(world):
    mesh = world.mesh((2, 2, 2), ("pp", "dp", "tp"))
    shapes, pieces = tp_model(4, stages=2, tied=True, zero=("dp",))
    spec = ShardingSpec(mesh, rules(pieces), stage_axis="pp")
    check_layout(dense_tree(shapes), pieces, mesh, spec, stage_axis="pp")
    assert only_group(spec) == ("pp", "dp", "tp")


def moe_model():
    shapes, pieces = tp_model(1)
    shapes["router.weight"] = (EXPERTS, D)
    pieces["router.weight"] = Piece("router.weight")
    # Stacked experts (grouped GEMM layout): experts split over ep, each expert column/row-parallel.
    shapes["experts.w1"] = (EXPERTS, FFN, D)
    pieces["experts.w1"] = Piece("experts.w1", ((("ep",), 0), (("tp",), 1)))
    shapes["experts.w2"] = (EXPERTS, D, FFN)
    pieces["experts.w2"] = Piece("experts.w2", ((("ep",), 0), (("tp",), 2)))
    shapes["experts.bias"] = (EXPERTS, FFN)
    pieces["experts.bias"] = Piece("experts.bias", ((("ep",), 0), (("tp",), 1)))
    return shapes, pieces


@case(8)
def moe_dp_ep_tp(world):
    mesh = world.mesh((2, 2, 2), ("dp", "ep", "tp"))
    shapes, pieces = moe_model()
    spec = ShardingSpec(mesh, rules(pieces))
    check_layout(dense_tree(shapes), pieces, mesh, spec, params=dense_tree(shapes, seed=1))
    assert only_group(spec) == ("ep", "tp"), "experts are copies over dp"


@pytest.mark.distributed
@pytest.mark.parametrize("size,name", _world.params_for(__name__))
def test_layout(size, name):
    _world.check(size, name)
