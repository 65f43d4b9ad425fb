"""The contrib optimizers whose step sizes come from global sums (Prodigy, D-Adaptation, DoG, DoWG,
Mechanic, MoMo) are exact under sharding: with a ``spec``, each rank's params are its slice of the
dense run's, step after step, and the scalar states (step-size estimates) equal the dense ones on
every rank; likewise with DTensor params and gradients and no spec. Without the spec, the same
plain pieces give different numbers (the sums would be local)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import _world
from _layouts import close, dense_tree
from _world import case
import gradtx as gtx
from gradtx import contrib
from gradtx.sharding import Replicate, Shard, ShardingSpec

SHAPES = {"w": (8, 3), "b": (5,), "s": ()}
STEPS = 5

OPTIMIZERS = {
    "prodigy": (lambda spec: contrib.prodigy(1.0, estim_lr0=1e-3, weight_decay=0.1, spec=spec), "estim_lr"),
    "dadapt_adamw": (lambda spec: contrib.dadapt_adamw(1.0, estim_lr0=1e-3, weight_decay=0.1, spec=spec), "estim_lr"),
    "dog": (lambda spec: contrib.dog(0.5, init_step=("heuristic", 1e-2), weight_decay=0.1, spec=spec), "max_dist"),
    "dowg": (lambda spec: contrib.dowg(0.5, init_estim_sq_dist=1e-2, spec=spec), "estim_sq_dist"),
    "mechanize": (lambda spec: contrib.mechanize(gtx.sgd(0.5, momentum=0.9), s_init=1e-2, spec=spec), "s"),
    "momo": (lambda spec: contrib.momo(0.5, weight_decay=0.1, adapt_lower_bound=True, lower_bound=-1.0, spec=spec), "gamma"),
    "momo_adam": (lambda spec: contrib.momo_adam(0.1, weight_decay=0.1, spec=spec), "gamma"),
}
WITH_VALUE = {"momo", "momo_adam"}


def _spec_and_cut(world):
    mesh = world.mesh((world.size,), ("tp",))
    spec = ShardingSpec(mesh, [("w", Shard("tp", dim=0)), ("b", Replicate()), ("s", Replicate())])

    def cut(tree):
        return {"w": torch.tensor_split(tree["w"], world.size, 0)[world.rank].clone(), "b": tree["b"].clone(), "s": tree["s"].clone()}

    return spec, cut


def _scalar_state(state, field):
    for leaf_state in state if isinstance(state, tuple) and not hasattr(state, "_fields") else (state,):
        if hasattr(leaf_state, field):
            return getattr(leaf_state, field)
    raise AssertionError(f"no {field} in the state")


def _same_on_every_rank(value: torch.Tensor, what: str) -> None:
    gathered = [torch.empty_like(value) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, value.contiguous())
    for rank, other in enumerate(gathered):
        torch.testing.assert_close(other, value, rtol=0, atol=0, msg=f"{what} differs from rank {rank}'s")


def _runs(name, spec, cut):
    """Sharded (pieces + spec) and dense runs side by side; yields after each step."""
    make, field = OPTIMIZERS[name]
    tx, dense_tx = make(spec), make(None)
    dense_params = dense_tree(SHAPES, seed=1, dtype=torch.float64)
    params = cut(dense_params)
    state, dense_state = tx.init(params), dense_tx.init(dense_params)
    # the gradients of sum(a * (x - t)^2 / 2): elementwise, so each rank computes its slice of them
    weights = {k: 0.5 + v.abs() for k, v in dense_tree(SHAPES, seed=2, dtype=torch.float64).items()}
    targets = dense_tree(SHAPES, seed=3, dtype=torch.float64)
    local_weights, local_targets = cut(weights), cut(targets)
    for step in range(STEPS):
        grads = {k: weights[k] * (dense_params[k] - targets[k]) for k in SHAPES}
        local_grads = {k: local_weights[k] * (params[k] - local_targets[k]) for k in SHAPES}
        value = sum((weights[k] * (dense_params[k] - targets[k]) ** 2).sum() / 2 for k in SHAPES)
        extra = {"value": value} if name in WITH_VALUE else {}
        updates, state = tx.update(local_grads, state, params, **extra)
        dense_updates, dense_state = dense_tx.update(grads, dense_state, dense_params, **extra)
        params, dense_params = gtx.apply_updates(params, updates), gtx.apply_updates(dense_params, dense_updates)
        yield step, params, dense_params, _scalar_state(state, field), _scalar_state(dense_state, field)


@case(2)
def contrib_sharded_runs_equal_the_dense_run(world):
    spec, cut = _spec_and_cut(world)
    for name in OPTIMIZERS:
        for step, params, dense_params, scalar, dense_scalar in _runs(name, spec, cut):
            for leaf, value in cut(dense_params).items():
                close(params[leaf], value, f"{name} step {step} param {leaf!r}", rtol=1e-10, atol=1e-12)
            close(scalar, dense_scalar, f"{name} step {step} scalar state", rtol=1e-10, atol=1e-14)
            _same_on_every_rank(scalar, f"{name} step {step} scalar state")
        _same_on_every_rank(params["b"], f"{name}: replicated param")
        if name in ("prodigy", "dadapt_adamw"):  # the estimate grew: the sums decided the steps
            assert float(dense_scalar) > 1.2e-3, f"{name}: the step-size estimate never moved"


@case(2)
def contrib_without_the_spec_the_sums_are_local(world):
    """The control: the same pieces with no spec give other numbers (so the spec is what makes them exact)."""
    _, cut = _spec_and_cut(world)
    for name in ("prodigy", "dog"):
        *_, (step, params, dense_params, scalar, dense_scalar) = _runs(name, None, cut)
        assert not torch.allclose(scalar, dense_scalar, rtol=1e-6, atol=0), f"{name}: local sums matched the global ones"


def _dtensor_tools(world):
    from torch.distributed.tensor import DTensor, Replicate as R, Shard as S, distribute_tensor

    mesh = world.mesh((world.size,), ("tp",))
    layout = {"w": [S(0)], "b": [R()]}

    def distribute(tree):
        return {k: distribute_tensor(v, mesh, layout[k], src_data_rank=None) if k in layout else v.clone() for k, v in tree.items()}

    def local(tree):
        return {k: v.to_local() if isinstance(v, DTensor) else v for k, v in tree.items()}

    return distribute, local


@case(2)
def contrib_dtensor_runs_equal_the_dense_run(world):
    """DTensor params and gradients describe their own layout: no spec needed. (The gradients are
    the dense run's, distributed: each rank's slice.)"""
    distribute, local = _dtensor_tools(world)
    _, cut = _spec_and_cut(world)
    weights = {k: 0.5 + v.abs() for k, v in dense_tree(SHAPES, seed=2, dtype=torch.float64).items()}
    targets = dense_tree(SHAPES, seed=3, dtype=torch.float64)
    for name, (make, field) in OPTIMIZERS.items():
        tx, dense_tx = make(None), make(None)
        dense_params = dense_tree(SHAPES, seed=1, dtype=torch.float64)
        params = distribute(dense_params)
        state, dense_state = tx.init(params), dense_tx.init(dense_params)
        for step in range(STEPS):
            grads = {k: weights[k] * (dense_params[k] - targets[k]) for k in SHAPES}
            value = sum((weights[k] * (dense_params[k] - targets[k]) ** 2).sum() / 2 for k in SHAPES)
            extra = {"value": value} if name in WITH_VALUE else {}
            updates, state = tx.update(distribute(grads), state, params, **extra)
            dense_updates, dense_state = dense_tx.update(grads, dense_state, dense_params, **extra)
            params, dense_params = gtx.apply_updates(params, updates), gtx.apply_updates(dense_params, dense_updates)
            for leaf, value in cut(dense_params).items():
                close(local(params)[leaf], value, f"{name} step {step} param {leaf!r}", rtol=1e-10, atol=1e-12)
            scalar = _scalar_state(state, field)
            close(scalar, _scalar_state(dense_state, field), f"{name} step {step} scalar", rtol=1e-10, atol=1e-14)


@case(2)
def global_sums_count_every_logical_element_once(world):
    """Sharded leaves add up, copies count once, a duplicate (a tied weight's second copy) not at all."""
    mesh = world.mesh((world.size,), ("tp",))
    spec = ShardingSpec(
        mesh, [("w", Shard("tp", dim=0)), ("b", Replicate()), ("tied", Shard("tp", dim=0, duplicate=True))]
    )
    shapes = {"w": (8, 3), "b": (5,), "tied": (8, 3)}
    x, y = dense_tree(shapes, seed=4, dtype=torch.float64), dense_tree(shapes, seed=5, dtype=torch.float64)
    x["tied"], y["tied"] = x["w"].clone(), y["w"].clone()

    def cut(tree):
        return {k: torch.tensor_split(v, world.size, 0)[world.rank].clone() if k != "b" else v.clone() for k, v in tree.items()}

    fn = lambda a, b: torch.stack([(a * b).sum(), a.abs().sum(), (a * a).sum()])  # noqa: E731
    got = gtx.sharding.global_sums(fn, cut(x), cut(y), spec=spec)
    expected = gtx.sharding.global_sums(fn, {k: x[k] for k in ("w", "b")}, {k: y[k] for k in ("w", "b")})
    close(got, expected, "global sums", rtol=1e-12, atol=1e-12)
    _same_on_every_rank(got, "global sums")

# after every case above: the parameters are read when this is defined
@pytest.mark.distributed
@pytest.mark.parametrize("size,name", _world.params_for(__name__))
def test_contrib_sharded(size, name):
    _world.check(size, name)
