"""gtx.observe under sharding: per-group statistics equal those of the dense tree (observed
unsharded) under TP (dims 0 and 1), ZeRO flat pieces, PP x TP with stage-local groups and a tied
duplicate, experts over ep, and FSDP2/HSDP DTensors; every rank holds the same dict, a NaN on one
rank counts on all, one collective per step, and grouping errors raise alike on every rank."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

import _world
from _layouts import Piece, dense_tree, local_tree, rules
from _world import case
from test_sharding_collectives import count_collectives
from test_sharding_dtensor import _dtensor_tree
from test_sharding_layouts import moe_model, tp_model
import gradtx as gtx
from gradtx.sharding import ShardingSpec

RTOL = 2e-5  # float32 leaves: per-piece sums accumulate in float32, everything after in float64


def _inner(spec, max_norm=1.0):
    return gtx.chain(gtx.clip_by_global_norm(max_norm, spec), gtx.adamw(1e-2, weight_decay=0.1))


def _logical(tree, pieces):
    """The dense tree under the local leaf names, duplicates (tied copies) left out."""
    return {name: tree[p.source] for name, p in pieces.items() if not p.duplicate}


def _same_on_every_rank(logged):
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, logged)
    for rank, theirs in enumerate(everyone):
        assert theirs.keys() == logged.keys(), f"rank {rank} has other keys"
        for key in logged:
            a, b = theirs[key], logged[key]
            assert a == b or (math.isnan(a) and math.isnan(b)), f"{key}: rank {rank} has {a}, this rank {b}"


def _two_steps(tx, grads, params):
    """Two observed steps (the second at the params the first gave, its gradients halved): the
    second step's state, whose update statistics are the first step's."""
    updates, state = tx.update(grads, tx.init(params), params)
    halved = {k: None if g is None else g * 0.5 for k, g in grads.items()}
    return tx.update(halved, state, gtx.apply_updates(params, updates))[1]


def _check_against_dense(local_grads, local_params, dense_grads, dense_params, spec, groups, duplicates=()):
    tx = gtx.observe(_inner(spec), groups=groups, spec=spec)
    state = _two_steps(tx, local_grads, local_params)
    dense_tx = gtx.observe(_inner(None), groups=groups)
    dense_state = _two_steps(dense_tx, dense_grads, dense_params)
    logged, expected = gtx.observations(state), gtx.observations(dense_state)
    assert not math.isnan(expected["prev_update_norm"])
    for key, value in expected.items():
        both_nan = math.isnan(logged[key]) and math.isnan(value)  # a group of None gradients: ratio 0/0
        assert both_nan or math.isclose(logged[key], value, rel_tol=RTOL, abs_tol=1e-7), f"{key}: sharded {logged[key]}, dense {value}"
    for key in set(logged) - set(expected):  # only a duplicate's own group: it counts nothing
        assert any(key.endswith("/" + d) for d in duplicates), key
        assert logged[key] == 0.0 or math.isnan(logged[key]), key
    _same_on_every_rank(logged)
    return tx, state


def _check_layout(world, mesh, shapes, pieces, stage_axis=None, groups=2):
    spec = ShardingSpec(mesh, rules(pieces), stage_axis=stage_axis)
    dense, params = dense_tree(shapes), dense_tree(shapes, seed=1)
    local, local_params = local_tree(dense, pieces, mesh, stage_axis), local_tree(params, pieces, mesh, stage_axis)
    duplicates = [name for name, p in pieces.items() if p.duplicate]
    _check_against_dense(local, local_params, _logical(dense, pieces), _logical(params, pieces), spec, groups, duplicates)
    return spec, local, local_params


@case(2)
def observe_tp_dims_0_and_1(world):
    mesh = world.mesh((2,), ("tp",))
    shapes, pieces = tp_model(2)  # column-parallel (dim 0), row-parallel (dim 1), replicated
    _check_layout(world, mesh, shapes, pieces)
    _check_layout(world, mesh, shapes, pieces, groups="module")


@case(2)
def observe_zero_flat_pieces(world):
    mesh = world.mesh((2,), ("dp",))
    shapes, pieces = tp_model(1)
    pieces = {name: Piece(p.source, ((("dp",), None),)) for name, p in pieces.items()}  # flat, uneven
    _check_layout(world, mesh, shapes, pieces, groups=[("*.qkv.*", "qkv"), "layers.*"])


@case(4)
def observe_pp_tp_stage_local_groups_and_tied(world):
    mesh = world.mesh((2, 2), ("pp", "tp"))
    shapes, pieces = tp_model(2, stages=2, tied=True)
    spec, local, _ = _check_layout(world, mesh, shapes, pieces, stage_axis="pp")
    # layers.0 lives on stage 0 only, layers.1 on stage 1 only: every rank still lists both
    tx = gtx.observe(gtx.sgd(0.1), groups=2, spec=spec)
    assert {"layers.0", "layers.1", "embed.weight", "ln_f.weight"} <= set(tx.init(local).groups)
    # a glob that matches on one stage only is used
    gtx.observe(gtx.sgd(0.1), groups=["layers.1.*"], spec=spec).init(local)


@case(4)
def observe_experts_over_ep(world):
    mesh = world.mesh((2, 2), ("ep", "tp"))
    shapes, pieces = moe_model()
    _check_layout(world, mesh, shapes, pieces, groups=[("experts.*", "experts"), ("router.*", "router")])


@case(4)
def observe_fsdp2_hsdp_dtensors(world):
    mesh, dense, params, distribute = _dtensor_tree(world)
    sharded, sharded_params = distribute(dense), distribute(params)
    _check_against_dense(sharded, sharded_params, dict(dense, absent=None), dict(params, absent=None), None, "module")


@case(2)
def observe_dtensors_in_place_and_under_wrap_with_fully_shard(world):
    """Donated (``inplace=True``) steps on DTensor leaves, and ``wrap`` (which donates) around an
    observed clip on a ``fully_shard`` model: the same statistics as the pure step and the dense twin."""
    from test_sharding_decisions import _backward, _sharded_model

    reference, model = _sharded_model()
    _backward(model, reference, 0)
    grads = {n: p.grad for n, p in model.named_parameters()}
    weights = {n: p.detach() for n, p in model.named_parameters()}
    pure_tx = gtx.observe(_inner(None), groups="module")
    pure_updates, pure_state = pure_tx.update(grads, pure_tx.init(weights), weights)
    donated = {n: g.clone() for n, g in grads.items()}
    updates, state = pure_tx.update(donated, pure_tx.init(weights), weights, inplace=True)
    logged, expected = gtx.observations(state), gtx.observations(pure_state)
    assert logged.keys() == expected.keys()
    for key, value in expected.items():  # NaN: the update statistics before the first step
        assert logged[key] == value or (math.isnan(logged[key]) and math.isnan(value)), key
    for name, u in updates.items():
        assert torch.equal(u.to_local(), pure_updates[name].to_local()), name
    dense_tx = gtx.observe(_inner(None), groups="module")
    dense_grads = {n: p.grad for n, p in reference.named_parameters()}
    dense_weights = {n: p.detach() for n, p in reference.named_parameters()}
    _, dense_state = dense_tx.update(dense_grads, dense_tx.init(dense_weights), dense_weights)
    opt = gtx.wrap(torch.optim.SGD(model.parameters(), lr=0.1), gtx.observe(gtx.clip_by_global_norm(1.0), groups="module"), model=model)
    opt.step()
    logged, expected = gtx.observations(opt), gtx.observations(dense_state)
    for key in ("grad_norm", "grad_norm/0", "grad_norm/2", "grad_max", "grad_nonfinite", "clip/norm"):
        assert math.isclose(logged[key], expected[key], rel_tol=RTOL), f"{key}: wrap {logged[key]}, dense {expected[key]}"
    _same_on_every_rank(logged)
    opt.step()  # reports the params of the step before: the dense weights
    _, dense_state = dense_tx.update(dense_grads, dense_state, dense_weights)
    logged, expected = gtx.observations(opt), gtx.observations(dense_state)
    for key in ("prev_param_norm", "prev_param_norm/0", "prev_param_norm/2"):
        assert math.isclose(logged[key], expected[key], rel_tol=RTOL), f"{key}: wrap {logged[key]}, dense {expected[key]}"
    _same_on_every_rank(logged)


def _pipeline(world):
    """A 2-stage x 2-way TP model: its spec, this rank's gradients, the dense shapes."""
    mesh = world.mesh((2, 2), ("pp", "tp"))
    shapes, pieces = tp_model(2, stages=2)
    spec = ShardingSpec(mesh, rules(pieces), stage_axis="pp")
    return spec, local_tree(dense_tree(shapes), pieces, mesh, "pp"), shapes


@case(4)
def observe_nan_on_one_rank_counts_everywhere(world):
    spec, local, _ = _pipeline(world)
    if dist.get_rank() == 3:  # stage 1, tp rank 1: its piece of a column-parallel weight
        local["layers.1.fc1.weight"][0, 0] = math.nan
    tx = gtx.observe(gtx.sgd(0.1), groups=2, spec=spec)
    _, state = tx.update(local, tx.init(local), local)
    logged = gtx.observations(state)
    assert logged["grad_nonfinite"] == 1.0 and logged["grad_nonfinite/layers.1"] == 1.0
    assert logged["grad_nonfinite/layers.0"] == 0.0
    assert math.isnan(logged["grad_max/layers.1"]) and math.isnan(logged["grad_norm"])
    assert not math.isnan(logged["grad_norm/layers.0"])
    _same_on_every_rank(logged)


def _fused_clips(spec):
    """Inner transformations whose clip comes first, however it is wrapped, and the clip alone."""
    adamw = gtx.adamw(1e-2, weight_decay=0.1)
    return {
        "chain": (_inner(spec), lambda state: state[0].norm),
        "clip alone": (gtx.clip_by_global_norm(1.0, spec), lambda state: state.norm),
        "named_chain": (gtx.named_chain(("clip", gtx.clip_by_global_norm(1.0, spec)), ("adamw", adamw)), lambda state: state["clip"].norm),
        "inject_hyperparams": (
            gtx.chain(gtx.inject_hyperparams(gtx.clip_by_global_norm)(1.0, spec), adamw),
            lambda state: state[0].inner_state.norm,
        ),
        "p=inf": (gtx.chain(gtx.clip_by_global_norm(1.0, spec, norm_type=math.inf), adamw), lambda state: state[0].norm),
        "p=1": (gtx.chain(gtx.clip_by_global_norm(1.0, spec, norm_type=1.0), adamw), lambda state: state[0].norm),
    }


@case(4)
def observe_costs_one_collective_per_step(world):
    spec, local, shapes = _pipeline(world)
    tx = gtx.observe(gtx.sgd(0.1), groups="module", spec=spec)
    state = tx.init(local)  # agrees on the groups (and checks the plan) once
    _, state = tx.update(local, state, local)
    assert count_collectives(lambda: tx.update(local, state, local)) == 1
    # with a sharded clip first in inner: its norm comes from the statistics' all-reduce, bit for bit
    # the norm it reduces alone, and so are the updates
    local = {k: g * 100.0 for k, g in local.items()}  # large gradients: the clip clips
    for name, (inner, norm_of) in _fused_clips(spec).items():
        tx = gtx.observe(inner, groups="module", spec=spec)
        state = tx.init(local)
        _, state = tx.update(local, state, local)
        assert count_collectives(lambda: tx.update(local, state, local)) == 1, name
        updates, observed = tx.update(local, state, local)
        plain, plain_state = inner.update(local, state.inner_state, local)
        assert torch.equal(norm_of(observed.inner_state), norm_of(plain_state)), name
        assert all(torch.equal(a, b) for a, b in zip(gtx.tree.leaves(updates), gtx.tree.leaves(plain))), name
        assert torch.equal(observed.clip.norm, norm_of(plain_state).to(observed.clip.norm.dtype)), name
        assert bool(observed.clip.clipped), name
    # a clip that does not come first keeps its own all-reduce (it clips what inner made of the gradients)
    tx = gtx.observe(gtx.chain(gtx.scale(2.0), gtx.clip_by_global_norm(1.0, spec)), groups="module", spec=spec)
    state = tx.init(local)
    _, state = tx.update(local, state, local)
    assert count_collectives(lambda: tx.update(local, state, local)) == 2
    # nothing sharded: nothing communicated
    dense = dense_tree(shapes)
    tx = gtx.observe(_inner(None), groups="module")
    state = tx.init(dense)
    assert count_collectives(lambda: tx.update(dense, state, dense)) == 0


@case(2)
def observe_compiled_with_a_clip_is_one_all_reduce(world):
    from test_sharding_compile import Recorder, _setup

    spec, params, grads = _setup(world)
    grads["w"] = grads["w"] * 10.0  # the clip clips
    tx = gtx.observe(_inner(spec), groups="module", spec=spec)
    state = tx.init(params)
    recorder = Recorder()
    step = gtx.compile_step(tx, backend=recorder)
    new_params, new_state = step(grads, state, params)
    assert recorder.collectives().count("_c10d_functional.all_reduce") == 1
    updates, eager_state = tx.update(grads, state, params)
    plain_updates, plain_state = _inner(spec).update(grads, _inner(spec).init(params), params)
    assert torch.equal(new_state.inner_state[0].norm, plain_state[0].norm)  # the clip's own number, bit for bit
    assert torch.equal(eager_state.inner_state[0].norm, plain_state[0].norm)
    torch.testing.assert_close(new_params, gtx.apply_updates(params, plain_updates), rtol=0, atol=0)
    compiled, eager = gtx.observations(new_state), gtx.observations(eager_state)
    for key, value in compiled.items():
        assert value == eager[key] or (math.isnan(value) and math.isnan(eager[key])), key


@case(4)
def observe_grouping_errors_raise_alike_on_every_rank(world):
    spec, local, _ = _pipeline(world)
    with pytest.raises(ValueError, match=r"glob '\*\.qvk\.\*' matches no leaf path \(the nearest: 'layers"):
        gtx.observe(gtx.sgd(0.1), groups=["*.qkv.*", "*.qvk.*"], spec=spec).init(local)
    def groups(path):  # wrong on the ranks of stage 1 only
        return 7 if (path == "layers.1.qkv.weight") else "g"

    with pytest.raises(TypeError, match=r"on rank 2: observe: the groups callable returned 7 \(a int\) for leaf 'layers.1.qkv.weight'"):
        gtx.observe(gtx.sgd(0.1), groups=groups, spec=spec).init(local)
    # the world is still in step: a good observe works afterwards
    tx = gtx.observe(gtx.sgd(0.1), groups=2, spec=spec)
    tx.update(local, tx.init(local), local)


@case(2)
def observe_state_checkpointed_under_sharding_reads_unknown_update_norms(world):
    """gtx.checkpoint saves a sharded observe state (its pending update and param norms are this
    rank's shares, which no layout could take back: saved as NaN); the loaded state's next step
    reports them NaN on every rank, everything else as the uninterrupted run."""
    mesh = world.mesh((2,), ("tp",))
    spec = ShardingSpec(mesh, [("w", gtx.sharding.Shard("tp", dim=0)), ("b", gtx.sharding.Replicate())])
    gen = torch.Generator().manual_seed(dist.get_rank())
    params = {"w": torch.randn(2, 3, generator=gen), "b": torch.ones(3)}
    grads = {"w": torch.randn(2, 3, generator=gen), "b": torch.full((3,), 0.5)}
    tx = gtx.observe(_inner(spec), spec=spec)
    _, state = tx.update(grads, tx.init(params), params)
    saved = gtx.checkpoint.state_dict(state, params, spec, copy=True)
    loaded = gtx.checkpoint.load_state_dict(tx.init(params), saved, params, spec)
    _, straight = tx.update(grads, state, params)
    _, resumed = tx.update(grads, loaded, params)
    logged, expected = gtx.observations(resumed), gtx.observations(straight)
    for key in ("prev_update_norm", "prev_param_norm", "prev_update_ratio"):
        assert math.isnan(logged[key]) and not math.isnan(expected[key]), key
    for key, value in expected.items():
        if not key.startswith("prev_"):
            assert logged[key] == value or (math.isnan(logged[key]) and math.isnan(value)), key
    _same_on_every_rank(logged)


@case(2)
def observe_a_bad_input_on_one_rank_raises_alike_on_every_rank(world):
    """A gradient of an integer dtype, or params without a leaf, on rank 1 only: every rank raises
    that rank's error from the one all-reduce (its error bit), none waits; the ranks stay in step."""
    mesh = world.mesh((2,), ("tp",))
    spec = ShardingSpec(mesh, [("w", gtx.sharding.Shard("tp", dim=0)), ("b", gtx.sharding.Replicate())], timeout=60)
    grads = {"w": torch.ones(2, 3), "b": torch.ones(3)}
    tx = gtx.observe(_inner(spec), groups=["w", "b"], spec=spec)
    _, state = tx.update(grads, tx.init(grads), grads)
    bad = {"w": torch.ones(2, 3, dtype=torch.int64), "b": torch.ones(3)} if dist.get_rank() == 1 else grads
    with pytest.raises(TypeError, match=r"rank 1 cannot run observe: leaf 'w' is a torch.int64 tensor; observe's gradients"):
        tx.update(bad, state, grads)
    params = {"w": torch.ones(2, 3)} if dist.get_rank() == 1 else grads
    with pytest.raises(ValueError, match=r"rank 1 cannot run observe: observe: params do not match updates: updates has leaf 'b'"):
        tx.update(grads, state, params)
    _, state = tx.update(grads, state, grads)
    _same_on_every_rank(gtx.observations(state))
    with pytest.raises(ValueError, match=r"leading clip_by_global_norm has a ShardingSpec and observe has none"):
        gtx.observe(_inner(spec))


@case(2)
def observe_reads_each_sharded_gradient_once(world):
    """Under sharding the gradients' sums of squares, maxima and non-finite counts (all needed
    before the one all-reduce) come from one pass over each gradient, by one kernel call for all;
    the clip's global norm follows from those sums bit for bit, as it reduces them alone; a NaN
    is counted and its maximum is NaN on every rank."""
    from gradtx.native import observed as native_observed
    from gradtx.sharding import statistics as stats_lib

    kernel = native_observed.usable()
    assert kernel is not None, native_observed.status()
    mesh = world.mesh((2,), ("dp",))
    spec = ShardingSpec(mesh, [("*", gtx.sharding.Shard("dp", dim=0))])
    gen = torch.Generator().manual_seed(dist.get_rank())
    grads = {"w": torch.randn(300, 70, generator=gen), "b": torch.randn(4100, generator=gen), "e": torch.zeros(0, 3)}
    params = {k: torch.randn(g.shape, generator=gen) for k, g in grads.items()}
    tx = gtx.observe(_inner(spec, max_norm=0.5), groups=1, spec=spec)
    state = tx.init(params)
    _, state = tx.update(grads, state, params)
    separate = stats_lib.extremes_of

    def refused(*args):
        raise AssertionError("a pass of its own over the gradients' extremes")

    one_pass, calls = kernel.squares_extremes, []

    def counted(xs):
        calls.append(len(xs))
        return one_pass(xs)

    stats_lib.extremes_of, kernel.squares_extremes = refused, counted
    before = state
    try:
        updates, state = tx.update(grads, state, params)
    finally:
        stats_lib.extremes_of = separate
        del kernel.squares_extremes
    assert calls == [len(grads)]  # every gradient, by one call
    plain_updates, plain_state = _inner(spec, max_norm=0.5).update(grads, before.inner_state, params)
    assert torch.equal(state.inner_state[0].norm, plain_state[0].norm)
    assert all(torch.equal(updates[k], plain_updates[k]) for k in grads)
    dense = {k: torch.cat(_gather(g)) for k, g in grads.items()}
    expected = torch.sqrt(sum(g.double().square().sum() for g in dense.values()))
    assert math.isclose(float(state.total.grad_norm), float(expected), rel_tol=1e-6)
    assert float(state.total.grad_max) == max(float(g.abs().max()) for g in dense.values() if g.numel())
    if dist.get_rank() == 1:
        grads["b"][7] = float("nan")
    _, state = tx.update(grads, state, params)
    logged = gtx.observations(state)
    assert logged["grad_nonfinite"] == 1 and math.isnan(logged["grad_max/b"]) and not math.isnan(logged["grad_max/w"])
    _same_on_every_rank(logged)


@case(2)
def observe_sharded_reads_the_params_in_the_adam_kernels_pass(world):
    """Under a spec the params' sums of squares are not read before the step (their all-reduce is
    the next step's): the Adam kernel tallies them where it reads each param, pure and donated, and
    the next step reports the logical params' norm, the same on every rank."""
    from gradtx.native import adam as native_adam
    from gradtx.native import observed as native_observed

    mesh = world.mesh((2,), ("tp",))
    shapes, pieces = tp_model(2)
    spec = ShardingSpec(mesh, rules(pieces))
    grads = local_tree(dense_tree(shapes), pieces, mesh)
    params = local_tree(dense_tree(shapes, seed=1), pieces, mesh)
    kernel = native_adam.usable() is not None and native_observed.usable() is not None
    for inplace in (False, True):
        tx = gtx.observe(_inner(spec), groups=1, spec=spec)
        state = tx.init(params)
        read = []
        original = native_observed.squares
        native_observed.squares = lambda t: (read.append(t), original(t))[1]
        try:
            _, state = tx.update({k: g.clone() for k, g in grads.items()}, state, params, inplace=inplace)
        finally:
            native_observed.squares = original
        passes = [t for t in read if any(t is p for p in params.values())]
        assert not (kernel and passes), f"{len(passes)} params read in passes of their own (inplace={inplace})"
        assert math.isnan(float(state.total.prev_param_norm))  # reported at the next step
        _, state = tx.update(grads, state, params)
        expected = gtx.sharding.global_norm(params, spec)
        assert math.isclose(float(state.total.prev_param_norm), float(expected), rel_tol=RTOL), inplace
        _same_on_every_rank(gtx.observations(state))


def _gather(tensor):
    pieces = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(pieces, tensor.contiguous())
    return pieces


@pytest.mark.distributed
@pytest.mark.parametrize("size,name", _world.params_for(__name__))
def test_observe_sharded(size, name):
    _world.check(size, name)
