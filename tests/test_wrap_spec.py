"""``wrap(..., spec=)`` serves the wrapper's own clipping; a sharding-aware member of the chain that
was given no spec of its own is an error at ``wrap`` time, not a norm of this rank's pieces."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import gradtx as gtx


@pytest.fixture()
def spec():
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
        yield gtx.sharding.ShardingSpec(mesh, default=gtx.sharding.Replicate())
    finally:
        dist.destroy_process_group()


def _optimizer(model):
    return torch.optim.SGD(model.parameters(), lr=0.1)


@pytest.mark.parametrize(
    "make, name",
    [
        (lambda s: gtx.clip_by_global_norm(1.0), "clip_by_global_norm"),
        (lambda s: gtx.chain(gtx.clip_by_value(1.0), gtx.clip_by_block_rms(0.5)), "clip_by_block_rms"),
        (lambda s: gtx.chain(gtx.adaptive_grad_clip(0.1), gtx.sgd(0.1)), "adaptive_grad_clip"),
        (lambda s: gtx.apply_if_finite(gtx.clip_by_global_norm(1.0, s), 3), "apply_if_finite"),
        # spec-taking members besides the clips, and members inside combinators, at any depth
        (lambda s: gtx.chain(gtx.normalize_by_update_norm(), gtx.sgd(0.1)), "normalize_by_update_norm"),
        (lambda s: gtx.chain(gtx.scale_by_trust_ratio(), gtx.sgd(0.1)), "scale_by_trust_ratio"),
        (lambda s: gtx.lamb(1e-3), "lamb"),
        (lambda s: gtx.novograd(1e-3), "novograd"),
        (lambda s: gtx.adafactor(1e-3), "adafactor"),
        (lambda s: gtx.contrib.normalize(), "normalize"),
        (lambda s: gtx.contrib.muon(1e-3), "muon"),
        (lambda s: gtx.masked(gtx.clip_by_global_norm(1.0), {"weight": True, "bias": False}), "clip_by_global_norm"),
        (lambda s: gtx.partition({"a": gtx.sgd(0.1), "b": gtx.chain(gtx.scale_by_trust_ratio(), gtx.sgd(0.1))},
                                 {"weight": "a", "bias": "b"}), "scale_by_trust_ratio"),
        (lambda s: gtx.MultiSteps(gtx.chain(gtx.clip_by_global_norm(1.0), gtx.sgd(0.1)), 2), "clip_by_global_norm"),
        (lambda s: gtx.inject_hyperparams(gtx.lars)(learning_rate=0.1), "lars"),
        (lambda s: gtx.observe(gtx.chain(gtx.clip_by_global_norm(1.0, s), gtx.scale_by_factored_rms()), spec=s), "scale_by_factored_rms"),
    ],
)
def test_a_member_without_the_spec_is_an_error(spec, make, name):
    model = torch.nn.Linear(3, 2)
    with pytest.raises(ValueError, match=rf"spec= was given, but the chain.s {name}( \(and [^)]*\))? has no spec"):
        gtx.wrap(_optimizer(model), make(spec), model=model, spec=spec)


def test_members_with_the_spec_are_accepted(spec):
    model = torch.nn.Linear(3, 2)
    tx = gtx.apply_if_finite(gtx.chain(gtx.clip_by_global_norm(1.0, spec), gtx.clip_by_value(1.0)), 3, spec)
    opt = gtx.wrap(_optimizer(model), tx, model=model, spec=spec)
    model(torch.ones(4, 3)).sum().backward()
    opt.step()
    assert gtx.wrap(_optimizer(model), gtx.clip_by_global_norm(1.0), model=model) is not None  # no spec: fine
    nested = gtx.masked(gtx.chain(gtx.scale_by_trust_ratio(spec=spec), gtx.clip_by_global_norm(1.0, spec)), {"weight": True, "bias": False})
    assert gtx.wrap(_optimizer(model), gtx.chain(nested, gtx.lamb(1e-3, spec=spec)), model=model, spec=spec) is not None


def test_a_missing_attribute_names_the_wrapper_and_the_inner_optimizer():
    model = torch.nn.Linear(3, 2)
    opt = gtx.wrap(_optimizer(model))
    with pytest.raises(AttributeError, match=r"'ChainedOptimizer' object has no attribute 'nope' \(nor has the SGD"):
        opt.nope
    assert not hasattr(opt, "consolidate_state_dict")


@pytest.mark.parametrize(
    "make, name",
    [
        (lambda: gtx.lbfgs(), "scale_by_lbfgs"),
        (lambda: gtx.chain(gtx.clip_by_global_norm(1.0), gtx.scale_by_lbfgs(), gtx.scale(-1.0)), "scale_by_lbfgs"),
        (lambda: gtx.scale_by_backtracking_linesearch(10), "scale_by_backtracking_linesearch"),
        (lambda: gtx.masked(gtx.scale_by_zoom_linesearch(10), {"weight": True, "bias": False}), "scale_by_zoom_linesearch"),
    ],
)
def test_a_member_that_reduces_over_the_tree_without_a_spec_of_its_own_is_an_error(spec, make, name):
    """L-BFGS and the line searches take inner products over the whole tree and have no spec: on
    sharded params each rank would use its own pieces' (a direction and step sizes that differ
    between ranks), so ``wrap(..., spec=)`` refuses them, naming the member, at any depth."""
    model = torch.nn.Linear(3, 2)
    with pytest.raises(ValueError, match=rf"spec= was given, but the chain.s {name} computes .* takes no spec"):
        gtx.wrap(_optimizer(model), make(), model=model, spec=spec)
    assert gtx.wrap(_optimizer(model), make(), model=model) is not None  # without a spec: unsharded, fine
