"""gradtx.checkpoint in one process: keys are logical paths, a DCP round trip resumes exactly, which
state leaves follow which params (and what their state types declare), the pieces' offsets, and
bad input (a clear error naming the path, the template untouched). Layouts across ranks are tested
in tests/distributed/test_checkpoint_reshard.py."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from types import SimpleNamespace
from typing import Any, NamedTuple

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import given, settings
from hypothesis import strategies as st

import gradtx as gtx
from gradtx import checkpoint as ckpt
from gradtx.sharding import checkpointing as ckpt_lib
from gradtx.state_dims import ParamLeaf

SHAPES = {"layers": [{"w": (4, 3), "b": (3,)}, {"w": (3, 5), "b": (5,)}], "head": (5,)}


def tree(seed: int, shapes: Any = SHAPES) -> Any:
    return _build(shapes, torch.Generator().manual_seed(seed))


def _build(shapes: Any, gen: torch.Generator) -> Any:
    if isinstance(shapes, dict):
        return {k: _build(v, gen) for k, v in shapes.items()}
    if isinstance(shapes, list):
        return [_build(v, gen) for v in shapes]
    return torch.randn(shapes, generator=gen)


def run(tx, params, state, steps, extra=lambda step: {}):
    for step in steps:
        grads = tree(100 + step)
        updates, state = tx.update(grads, state, params, **extra(step))
        params = gtx.apply_updates(params, updates)
    return params, state


def assert_trees_equal(a, b) -> None:
    leaves_a, leaves_b = gtx.tree.leaves(a), gtx.tree.leaves(b)
    assert gtx.tree.structure(a) == gtx.tree.structure(b)
    for x, y in zip(leaves_a, leaves_b):
        if isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and torch.equal(x, y)
        else:
            assert x == y


# --------------------------------------------------------------------------- keys and values


def test_keys_are_the_state_paths_and_values_share_the_state_storage():
    params = tree(0)
    tx = gtx.chain(gtx.clip_by_global_norm(1.0), gtx.adamw(1e-2))
    _, state = run(tx, params, tx.init(params), range(2))
    sd = ckpt.state_dict(state, params)
    paths = [p for p, leaf in zip(gtx.tree.paths(state), gtx.tree.leaves(state)) if leaf is not None]
    assert list(sd) == paths + [ckpt.MANIFEST]
    assert "1.0.mu.layers.1.w" in sd and "1.0.count" in sd and "0.norm" in sd
    for path, leaf in zip(gtx.tree.paths(state), gtx.tree.leaves(state)):
        assert sd[path] is leaf  # nothing copied
    copied = ckpt.state_dict(state, params, copy=True)
    assert all(copied[p] is not sd[p] and torch.equal(copied[p], sd[p]) for p in paths)
    manifest = json.loads(sd[ckpt.MANIFEST])
    assert manifest["format"] == 1
    assert manifest["leaves"]["1.0.mu.layers.0.w"] == ["tensor", "torch.float32", [4, 3]]
    assert manifest["leaves"]["1.0.count"] == ["tensor", "torch.int32", []]


FAMILIES = {
    "adamw": (lambda: gtx.adamw(1e-2, weight_decay=0.1), {}),
    "adafactor": (lambda: gtx.adafactor(1e-2, min_dim_size_to_factor=3), {}),
    "muon": (lambda: gtx.contrib.muon(1e-2), {}),
    "galore": (lambda: gtx.contrib.galore(1e-2, rank=2, update_proj_gap=2), {}),
    "schedule_free_adamw": (lambda: gtx.contrib.schedule_free_adamw(1e-2, warmup_steps=2), {}),
    "multi_steps": (lambda: gtx.MultiSteps(gtx.adam(1e-2), 3).gradient_transformation(), {}),
    "inject_hyperparams": (lambda: gtx.inject_hyperparams(gtx.adamw)(learning_rate=gtx.linear_schedule(1e-2, 0.0, 8)), {}),
    "reduce_on_plateau": (lambda: gtx.chain(gtx.adam(1e-2), gtx.contrib.reduce_on_plateau(factor=0.5, patience=1)), {"value": True}),
    "noisy_sgd": (lambda: gtx.noisy_sgd(1e-2, eta=0.5, key=4), {}),
    "sophia": (lambda: gtx.contrib.sophia(1e-2), {"obj_fn": True}),
}


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_a_dcp_round_trip_resumes_exactly(name, tmp_path):
    make, needs = FAMILIES[name]

    def extra(step):
        out = {}
        if "value" in needs:
            out["value"] = torch.tensor(float(step % 2))
        if "obj_fn" in needs:
            out["obj_fn"] = lambda p: sum((x**2).sum() for x in gtx.tree.leaves(p))
        return out

    tx = make()
    params = tree(0)
    straight, straight_state = run(tx, params, tx.init(params), range(5), extra)
    params, state = run(tx, params, tx.init(params), range(3), extra)
    dcp.save({"params": ckpt.state_dict(params, params), "state": ckpt.state_dict(state, params)}, checkpoint_id=str(tmp_path))
    template_params = tree(9)
    template = tx.init(template_params)
    sd = {"params": ckpt.state_dict(template_params, template_params), "state": ckpt.state_dict(template, template_params)}
    dcp.load(sd, checkpoint_id=str(tmp_path))
    params = ckpt.load_state_dict(template_params, sd["params"], template_params)
    state = ckpt.load_state_dict(template, sd["state"], params)
    assert_trees_equal(state, run(tx, tree(0), tx.init(tree(0)), range(3), extra)[1])
    params, state = run(tx, params, state, range(3, 5), extra)
    assert_trees_equal(params, straight)
    assert_trees_equal(state, straight_state)


def test_numbers_and_none_leaves():
    class WithNumbers(NamedTuple):
        step: int
        rate: float
        tag: str
        nothing: Any
        mu: Any

    params = {"w": torch.ones(2), "frozen": None}
    state = WithNumbers(3, 0.5, "warm", None, {"w": torch.zeros(2), "frozen": None})
    sd = ckpt.state_dict(state, params)
    assert sd["step"] == 3 and sd["rate"] == 0.5 and sd["tag"] == "warm" and "nothing" not in sd and "mu.frozen" not in sd
    loaded = {**sd, "step": 7, "mu.w": torch.full((2,), 2.0)}
    new = ckpt.load_state_dict(state, loaded, params)
    assert new.step == 7 and new.nothing is None and new.mu["frozen"] is None and torch.equal(new.mu["w"], torch.full((2,), 2.0))
    with pytest.raises(ValueError, match=r"state leaf 'step' is a int, but the loaded value is a float"):
        ckpt.load_state_dict(state, {**sd, "step": 7.0}, params)
    with pytest.raises(TypeError, match=r"state leaf 'mu\.w' is a object"):
        ckpt.state_dict(state._replace(mu={"w": object(), "frozen": None}), params)


# --------------------------------------------------------------------------- which leaf follows which param


def layouts_of(state, params) -> dict[str, Any]:
    resolved = ckpt._resolve(state, params, None, owner="test")
    assert resolved.error is None, resolved.error
    return {p: l for p, l, leaf in zip(resolved.paths, resolved.layouts, resolved.leaves) if leaf is not None}


def test_params_shaped_parts_of_the_state_are_found_at_any_depth():
    params = tree(0)
    labels = {"layers": [{"w": "a", "b": "b"}, {"w": "a", "b": "b"}], "head": "b"}
    tx = gtx.chain(
        gtx.clip_by_global_norm(1.0),
        gtx.masked(gtx.trace(0.9), {"layers": [{"w": True, "b": False}, {"w": True, "b": False}], "head": False}),
        gtx.partition({"a": gtx.adam(1e-2), "b": gtx.inject_hyperparams(gtx.sgd)(learning_rate=0.1, momentum=0.9)}, labels),
        gtx.MultiSteps(gtx.lion(1e-3), 2).gradient_transformation(),
    )
    layouts = layouts_of(tx.init(params), params)
    followers = {p for p, l in layouts.items() if l is ckpt_lib.WHOLE}
    checked = {p for p, l in layouts.items() if l is ckpt_lib.CHECKED}
    # every leaf of a params-shaped part follows its param (whole here: nothing is split)...
    assert "1.inner_state.trace.layers.0.w" in followers
    assert "2.inner_states.a.inner_state.0.mu.layers.1.w" in followers
    assert "2.inner_states.b.inner_state.inner_state.0.trace.head" in followers
    assert "3.acc_grads.head" in followers and "3.inner_opt_state.0.mu.layers.0.b" in followers
    # ... every other leaf is whole and checked across ranks
    assert checked == {
        "0.norm",
        "2.inner_states.a.inner_state.0.count",
        "2.inner_states.b.inner_state.count",
        "2.inner_states.b.inner_state.hyperparams.learning_rate",
        "2.inner_states.b.inner_state.hyperparams.momentum",
        "3.mini_step",
        "3.gradient_step",
        "3.inner_opt_state.0.count",
    }, checked
    assert set(layouts) == followers | checked


def test_a_params_tree_is_a_state_shaped_like_the_params():
    params = tree(0)
    layouts = layouts_of(gtx.LookaheadParams.init_synced(params), params)
    assert all(l is ckpt_lib.WHOLE for l in layouts.values()) and "slow.layers.1.w" in layouts


class Outer(NamedTuple):
    inner: Any
    side: Any


class Inner(NamedTuple):
    mu: Any


def test_declarations_apply_outermost_first_and_none_defers():
    calls = []

    def outer_rule(leaf: ParamLeaf):
        calls.append(("outer", leaf.leaf_shape, dict(leaf.fields)))
        return None if leaf.fields["side"] == (0,) else gtx.checkpoint.whole(leaf)

    def inner_rule(leaf: ParamLeaf):
        calls.append(("inner", leaf.leaf_shape))
        return gtx.checkpoint.same(leaf)

    outer_type = gtx.checkpoint.state_dims(inner=outer_rule)(type("DeclaredOuter", (Outer,), {}))
    inner_type = gtx.checkpoint.state_dims(mu=inner_rule)(type("DeclaredInner", (Inner,), {}))
    params = {"w": torch.zeros(4, 3), "b": torch.zeros(3)}
    state = outer_type(inner_type({"w": torch.zeros(4, 3), "b": torch.zeros(2)}), {"w": torch.zeros(0), "b": torch.zeros(5)})
    layouts_of(state, params)
    # "b" (first: keys are sorted): the outer rule answers; "w": it defers (its side leaf is (0,)), the inner one answers
    assert calls == [
        ("outer", (2,), {"side": (5,)}),
        ("outer", (4, 3), {"side": (0,)}),
        ("inner", (4, 3)),
    ], calls


def test_state_dims_checks_what_it_is_given():
    with pytest.raises(TypeError, match="has no field 'nu'"):
        gtx.checkpoint.state_dims(nu=gtx.checkpoint.whole)(Inner)
    with pytest.raises(TypeError, match="is not a NamedTuple"):
        gtx.checkpoint.state_dims(mu=gtx.checkpoint.whole)(dict)
    with pytest.raises(TypeError, match="not a callable"):
        gtx.checkpoint.state_dims(mu=(0,))(Inner)
    assert not hasattr(Inner, "__state_dims__")


def test_a_declared_dims_tuple_is_checked():
    bad = gtx.checkpoint.state_dims(mu=lambda leaf: (0, 0))(type("Twice", (Inner,), {}))
    params = {"w": torch.zeros(4, 3)}
    resolved = ckpt._resolve(bad({"w": torch.zeros(4, 3)}), params, None, owner="test")
    assert isinstance(resolved.error, ValueError) and "name a param dim twice" in str(resolved.error) and "'mu.w'" in str(resolved.error)


def test_adafactor_declares_its_factored_moments():
    rules = gtx.FactoredState.__state_dims__
    # a (6, 8) param split along its rows: v_row (a mean along dim 1, the largest) keeps dim 0
    factored = ParamLeaf((6, 8), (3, 8), (6,), {"v_row": (6,), "v_col": (8,), "v": (1,)})
    assert rules["v_row"](factored) == (0,)
    assert rules["v_col"](replace(factored, leaf_shape=(8,))) == (1,)
    assert rules["v"](replace(factored, leaf_shape=(1,))) == (None,)
    # stacked experts (4, 6, 8): the moments keep the expert dim
    experts = ParamLeaf((4, 6, 8), (2, 6, 8), (2, 6), {"v_row": (2, 6), "v_col": (2, 8), "v": (1,)})
    assert rules["v_row"](experts) == (0, 1) and rules["v_col"](replace(experts, leaf_shape=(2, 8))) == (0, 2)
    # unfactored: the full moment follows the param, the placeholders are whole
    vector = ParamLeaf((8,), (4,), (1,), {"v_row": (1,), "v_col": (1,), "v": (4,)})
    assert rules["v_row"](vector) == (None,) and rules["v"](replace(vector, leaf_shape=(4,))) == (0,)


def test_galore_declares_its_projectors_and_low_rank_state_whole():
    rules = gtx.contrib.GaLoreState.__state_dims__
    projected = ParamLeaf((8, 4), (4, 4), (2, 4), {"projector": (8, 2)})
    assert rules["projector"](replace(projected, leaf_shape=(8, 2))) == (None, None)
    assert rules["base_optimizer_state"](projected) == (None, None)  # (4, 4) locally would have fooled the default
    assert rules["base_optimizer_state"](ParamLeaf((8,), (4,), (4,), {"projector": (0, 0)})) is None


# --------------------------------------------------------------------------- pieces and their offsets


def fake_mesh(names, sizes):
    import itertools

    grid = list(itertools.product(*(range(s) for s in sizes)))
    return SimpleNamespace(names=tuple(names), sizes=dict(zip(names, sizes)), _rank_coordinate={r: c for r, c in enumerate(grid)})


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.integers(1, 3), min_size=1, max_size=3),
    st.data(),
)
def test_uneven_pieces_tile_their_logical_tensor(sizes, data):
    names = [f"a{i}" for i in range(len(sizes))]
    mesh = fake_mesh(names, sizes)
    ndim = data.draw(st.integers(1, 3))
    split_dims = {a: data.draw(st.integers(0, ndim - 1)) for a, s in zip(names, sizes) if s > 1 and data.draw(st.booleans())}
    splits = tuple((a, split_dims[a]) for a in names if a in split_dims)
    # per dim, the sizes of the pieces along it (indexed by the combined coordinate of its axes)
    extents = {}
    for d in range(ndim):
        count = math.prod(mesh.sizes[a] for a, dd in splits if dd == d)
        extents[d] = data.draw(st.lists(st.integers(0, 4), min_size=count, max_size=count))
    holders = {}
    for rank, coordinate in mesh._rank_coordinate.items():
        coord = dict(zip(names, coordinate))
        local = []
        for d in range(ndim):
            index = 0
            for a, dd in splits:
                if dd == d:
                    index = index * mesh.sizes[a] + coord[a]
            local.append(extents[d][index])
        holders[rank] = (splits, tuple(local))
    shape, offsets, even = ckpt_lib.tile(mesh, holders, path="x")
    assert shape == tuple(sum(extents[d]) for d in range(ndim))
    covered = torch.zeros(shape, dtype=torch.int64)
    seen = set()
    for rank, (_, local) in holders.items():
        box = (local, offsets[rank])
        if box in seen:  # a copy (ranks along an axis that does not split the leaf)
            continue
        seen.add(box)
        covered[tuple(slice(o, o + s) for s, o in zip(local, offsets[rank]))] += 1
    assert bool((covered == 1).all()), "the pieces must cover the logical tensor exactly once"
    chunked = all(
        ckpt_lib._box(shape, [(d, mesh.sizes[a], dict(zip(names, mesh._rank_coordinate[r]))[a]) for a, d in splits]) == (local, offsets[r])
        for r, (_, local) in holders.items()
    )
    assert even == chunked


def test_pieces_that_do_not_form_a_grid_are_an_error_naming_the_path():
    mesh = fake_mesh(["dp", "tp"], [2, 2])
    splits = (("tp", 0),)
    holders = {0: (splits, (3, 4)), 1: (splits, (2, 4)), 2: (splits, (2, 4)), 3: (splits, (2, 4))}  # rank 2 copies rank 0
    with pytest.raises(ValueError, match=r"state leaf '1\.mu\.w': the pieces do not form a grid: dim 0 has 3 elements on one rank and 2 on rank 2"):
        ckpt_lib.tile(mesh, holders, path="1.mu.w")
    with pytest.raises(ValueError, match=r"split as \(\('dp', 0\),\) .* on rank 1"):
        ckpt_lib.tile(mesh, {0: (splits, (3, 4)), 1: ((("dp", 0),), (3, 4))}, path="w")


def test_pieces_are_what_dcp_saves_and_nothing_else(tmp_path):
    local = torch.arange(6.0).reshape(2, 3)
    pieces = ckpt.Pieces(local, (2, 3), (0, 0))
    assert tuple(pieces.shape) == (2, 3) and pieces.local is local and "offsets=(0, 0)" in repr(pieces)
    with pytest.raises(TypeError, match=r"holds one rank's piece .* \(its \.local is the piece\)"):
        pieces.sum()
    dcp.save({"x": pieces}, checkpoint_id=str(tmp_path))
    target = torch.zeros(2, 3)
    dcp.load({"x": ckpt.Pieces(target, (2, 3), (0, 0))}, checkpoint_id=str(tmp_path))
    assert torch.equal(target, local)


# --------------------------------------------------------------------------- bad input


@pytest.fixture
def saved():
    params = tree(0)
    tx = gtx.adamw(1e-2)
    _, state = run(tx, params, tx.init(params), range(2))
    return tx, params, ckpt.state_dict(state, params, copy=True)


def untouched(template):
    before = [x.clone() for x in gtx.tree.leaves(template)]
    return lambda: all(torch.equal(a, b) for a, b in zip(gtx.tree.leaves(template), before))


def test_another_tree_missing_or_extra_keys(saved):
    tx, params, sd = saved
    template = tx.init(params)
    same = untouched(template)
    short = {k: v for k, v in sd.items() if k != "0.nu.head"}
    with pytest.raises(ValueError, match=r"gradtx\.checkpoint\.load_state_dict: the loaded state lacks state leaf '0\.nu\.head'"):
        ckpt.load_state_dict(template, short, params)
    with pytest.raises(ValueError, match=r"holds 'extra', which this state lacks"):
        ckpt.load_state_dict(template, {**sd, "extra": torch.zeros(1)}, params)
    with pytest.raises(ValueError, match="the loaded state is a list"):
        ckpt.load_state_dict(template, [], params)
    bigger = {**params, "more": torch.zeros(2)}
    with pytest.raises(ValueError, match=r"lacks state leaf '0\.mu\.more'"):
        ckpt.load_state_dict(tx.init(bigger), sd, bigger)
    assert same()


def test_a_checkpoint_manifest_that_does_not_fit(saved):
    tx, params, sd = saved
    manifest = json.loads(sd[ckpt.MANIFEST])
    template = tx.init(params)
    same = untouched(template)
    extra = dict(manifest, leaves={**manifest["leaves"], "0.mu.gone": ["tensor", "torch.float32", [2]]})
    with pytest.raises(ValueError, match=r"the checkpoint holds state leaf '0\.mu\.gone', which this state lacks"):
        ckpt.load_state_dict(template, {**sd, ckpt.MANIFEST: json.dumps(extra)}, params)
    wider = dict(manifest, leaves={**manifest["leaves"], "0.mu.head": ["tensor", "torch.float32", [6]]})
    with pytest.raises(ValueError, match=r"'0\.mu\.head' was saved with logical shape \(6,\), but this state's is \(5,\)"):
        ckpt.load_state_dict(template, {**sd, ckpt.MANIFEST: json.dumps(wider)}, params)
    other = dict(manifest, leaves={**manifest["leaves"], "0.mu.head": ["tensor", "torch.bfloat16", [5]]})
    with pytest.raises(ValueError, match=r"'0\.mu\.head' was saved as bfloat16 of logical shape \(5,\), but this state holds float32"):
        ckpt.load_state_dict(template, {**sd, ckpt.MANIFEST: json.dumps(other)}, params)
    with pytest.raises(ValueError, match="is not a gradtx checkpoint manifest"):
        ckpt.load_state_dict(template, {**sd, ckpt.MANIFEST: {"format": 1}}, params)
    assert same()


def test_a_value_of_another_dtype_or_shape(saved):
    tx, params, sd = saved
    template = tx.init(params)
    same = untouched(template)
    with pytest.raises(ValueError, match=r"'0\.mu\.head' is torch\.float32, but the loaded value is torch\.float64"):
        ckpt.load_state_dict(template, {**sd, "0.mu.head": sd["0.mu.head"].double()}, params)
    with pytest.raises(ValueError, match=r"'0\.mu\.head' has logical shape \(5,\), but the loaded value's is \(4,\)"):
        ckpt.load_state_dict(template, {**sd, "0.mu.head": torch.zeros(4)}, params)
    assert same()


def test_bad_arguments():
    params = {"w": torch.zeros(2)}
    state = gtx.adam(1e-2).init(params)
    with pytest.raises(ValueError, match="pass the params it describes"):
        ckpt.load_state_dict(state, {}, None, spec=object())
    with pytest.raises(ValueError, match="the key the checkpoint's manifest takes"):
        ckpt.state_dict({ckpt.MANIFEST: torch.zeros(1)}, params)


def test_rank_shares_are_saved_as_nan_only_under_sharding():
    """A field declared with rank_shares (observe's pending update and param norms) is NaN in a sharded
    checkpoint and kept as it is unsharded, where it is the whole sum."""
    from gradtx.state_dims import rank_shares, without_rank_shares

    params = {"w": torch.randn(3, 2)}
    tx = gtx.observe(gtx.sgd(0.1))
    _, state = tx.update({"w": torch.ones(3, 2)}, tx.init(params), params)
    nan_state = without_rank_shares({"opt": state, "n": 3})
    assert torch.isnan(nan_state["opt"].pending_sq).all() and nan_state["n"] == 3
    assert not torch.isnan(state.pending_sq).any()  # the state itself untouched
    for kept, given in zip(gtx.tree.leaves(nan_state["opt"].inner_state), gtx.tree.leaves(state.inner_state)):
        assert kept is given
    saved = gtx.checkpoint.state_dict(state, params)  # unsharded: the pending sums are whole
    assert torch.equal(saved["pending_sq"], state.pending_sq)
    with pytest.raises(TypeError, match="has no field 'nope'"):
        rank_shares("nope")(type(state))
