"""A pure update returns a state that shares no storage with the state it was given.

With ``inplace=False`` the caller keeps the old state: donating the new one to a later
``inplace=True`` update, or editing it (``state.hyperparams["learning_rate"].fill_(...)``), must not
change the old one. Every public transformation and combinator is run for a few steps and each
tensor of the new state is checked against the storages of the old state.
"""

from __future__ import annotations

import functools
import inspect

import pytest
import torch

import gradtx as gtx
from gradtx import contrib
from gradtx.contrib import galore
import gradtx.contrib
from optimizer_helpers import without_deprecation_warning
from combinator_helpers import running_sum

SHAPES = {"layer.weight": (4, 3), "layer.bias": (4,), "head.weight": (2, 4)}
STEPS = 4


def params() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {name: torch.randn(shape, generator=gen) for name, shape in SHAPES.items()}


def grads(step: int, batch: tuple[int, ...] = ()) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return {name: torch.randn(batch + shape, generator=gen) for name, shape in SHAPES.items()}


PER_EXAMPLE = {"differentially_private_aggregate", "dpsgd"}  # their updates are per-example gradients


def adam() -> gtx.GradientTransformation:
    return gtx.scale_by_adam()


LABELS = {"layer.weight": "a", "layer.bias": "b", "head.weight": "a"}
MASK = {"layer.weight": True, "layer.bias": False, "head.weight": True}
# How to build each public factory cheaply; a stateful inner (running_sum, Adam) where one nests.
FACTORIES = {
    "contrib.muon": lambda: contrib.muon(1e-2, weight_decay=0.1),
    "contrib.scale_by_muon": lambda: gtx.masked(contrib.scale_by_muon(), MASK),
    "adabelief": lambda: gtx.adabelief(1e-2),
    "adagrad": lambda: gtx.adagrad(1e-2),
    "adam": lambda: gtx.adam(1e-2),
    "adamax": lambda: gtx.adamax(1e-2),
    "adamw": lambda: gtx.adamw(1e-2, weight_decay=0.1),
    "adaptive_grad_clip": lambda: gtx.adaptive_grad_clip(0.1),
    "add_decayed_weights": lambda: gtx.add_decayed_weights(0.1, mask=MASK),
    "add_noise": lambda: gtx.add_noise(0.1, 0.55, key=0),
    "amsgrad": lambda: gtx.amsgrad(1e-2),
    "stochastic_rounding": lambda: gtx.chain(gtx.adam(1e-2), gtx.stochastic_rounding(3)),
    "kahan_summation": lambda: gtx.chain(gtx.adam(1e-2), gtx.kahan_summation()),
    "master_weights": lambda: gtx.master_weights(gtx.adam(1e-2)),
    "observe": lambda: gtx.observe(gtx.adam(1e-2), groups=1),
    "apply_if_finite": lambda: gtx.apply_if_finite(running_sum(), 2),
    "centralize": gtx.centralize,
    "chain": lambda: gtx.chain(gtx.clip_by_global_norm(1.0), running_sum(), adam()),
    "clip": lambda: gtx.clip(0.5),
    "clip_by_block_rms": lambda: gtx.clip_by_block_rms(0.5),
    "clip_by_global_norm": lambda: gtx.clip_by_global_norm(1.0),
    "clip_by_value": lambda: gtx.clip_by_value(0.5),
    "differentially_private_aggregate": lambda: gtx.differentially_private_aggregate(1.0, 0.1, key=0),
    "dpsgd": lambda: gtx.dpsgd(1e-2, 1.0, 0.1, seed=0, momentum=0.9),
    "ema": lambda: gtx.ema(0.9),
    "freeze": lambda: gtx.freeze(MASK),
    "from_torch": lambda: gtx.from_torch(torch.optim.Adam, lr=1e-2),
    "identity": gtx.identity,
    "inject_hyperparams": lambda: gtx.inject_hyperparams(gtx.adamw)(
        learning_rate=gtx.linear_schedule(1e-2, 1e-3, 3), weight_decay=0.1
    ),
    "lamb": lambda: gtx.lamb(1e-2),
    "lars": lambda: gtx.lars(1e-2, weight_decay=0.1),
    "lion": lambda: gtx.lion(1e-3),
    "masked": lambda: gtx.masked(running_sum(), MASK),
    "measure_with_ema": lambda: gtx.measure_with_ema(lambda params: gtx.global_norm(params), 0.9),
    "monitor": lambda: gtx.monitor({"norm": lambda params: gtx.global_norm(params)}),
    "multi_transform": lambda: gtx.multi_transform({"a": running_sum(), "b": adam()}, LABELS),
    "nadam": lambda: gtx.nadam(1e-2),
    "nadamw": lambda: gtx.nadamw(1e-2),
    "named_chain": lambda: gtx.named_chain(("sum", running_sum()), ("adam", adam())),
    "noisy_sgd": lambda: gtx.noisy_sgd(1e-2, key=0),
    "partition": lambda: gtx.partition({"a": running_sum(), "b": adam()}, LABELS),
    "quantize_state": lambda: gtx.quantize_state(gtx.adam(1e-2), min_size=4),
    "radam": lambda: gtx.radam(1e-2),
    "rmsprop": lambda: gtx.rmsprop(1e-2, momentum=0.9, centered=True),
    "scale": lambda: gtx.scale(0.5),
    "scale_by_adam": adam,
    "scale_by_lbfgs": lambda: gtx.scale_by_lbfgs(memory_size=3),
    "scale_by_adamax": gtx.scale_by_adamax,
    "scale_by_amsgrad": gtx.scale_by_amsgrad,
    "scale_by_belief": gtx.scale_by_belief,
    "scale_by_learning_rate": lambda: gtx.scale_by_learning_rate(gtx.linear_schedule(1.0, 0.1, 3)),
    "scale_by_lion": gtx.scale_by_lion,
    "scale_by_radam": gtx.scale_by_radam,
    "scale_by_rms": lambda: gtx.scale_by_rms(bias_correction=True),
    "scale_by_rss": gtx.scale_by_rss,
    "scale_by_schedule": lambda: gtx.scale_by_schedule(gtx.cosine_decay_schedule(1.0, 3)),
    "scale_by_stddev": lambda: gtx.scale_by_stddev(bias_correction=True),
    "scale_by_trust_ratio": gtx.scale_by_trust_ratio,
    "selective_transform": lambda: gtx.selective_transform(running_sum(), freeze_mask=MASK),
    "set_to_zero": gtx.set_to_zero,
    "sgd": lambda: gtx.sgd(1e-2, momentum=0.9, nesterov=True),
    "snapshot": lambda: gtx.snapshot("norm", lambda params: gtx.global_norm(params)),
    "stateless": lambda: gtx.stateless(lambda updates, params: updates),
    "stateless_with_tree_map": lambda: gtx.stateless_with_tree_map(lambda g: g * 2),
    "trace": lambda: gtx.trace(0.9, nesterov=True),
    "zero_nans": gtx.zero_nans,
    "scale_by_sign": gtx.scale_by_sign,
    "scale_by_rprop": lambda: gtx.scale_by_rprop(0.1),
    "scale_by_adadelta": gtx.scale_by_adadelta,
    "scale_by_yogi": gtx.scale_by_yogi,
    "scale_by_adan": gtx.scale_by_adan,
    "scale_by_novograd": lambda: gtx.scale_by_novograd(weight_decay=0.1),
    "scale_by_optimistic_gradient": gtx.scale_by_optimistic_gradient,
    "scale_by_param_block_norm": gtx.scale_by_param_block_norm,
    "scale_by_param_block_rms": gtx.scale_by_param_block_rms,
    "normalize_by_update_norm": gtx.normalize_by_update_norm,
    "keep_params_nonnegative": gtx.keep_params_nonnegative,
    "scale_by_distance_over_gradients": gtx.scale_by_distance_over_gradients,
    "scale_by_factored_rms": lambda: gtx.scale_by_factored_rms(min_dim_size_to_factor=2),
    "scale_by_sm3": gtx.scale_by_sm3,
    "sign_sgd": lambda: gtx.sign_sgd(1e-2),
    "signum": lambda: gtx.signum(1e-2),
    "adadelta": lambda: gtx.adadelta(1.0, weight_decay=0.1),
    "yogi": lambda: gtx.yogi(1e-2),
    "rprop": lambda: gtx.rprop(1e-2),
    "adan": lambda: gtx.adan(1e-2, weight_decay=0.1),
    "novograd": lambda: gtx.novograd(1e-2),
    "optimistic_gradient_descent": lambda: gtx.optimistic_gradient_descent(1e-2),
    "optimistic_adam": lambda: gtx.optimistic_adam_v2(1e-2),  # the deprecated first version is the same chain
    "optimistic_adam_v2": lambda: gtx.optimistic_adam_v2(1e-2),
    "adamaxw": lambda: gtx.adamaxw(1e-2),
    "fromage": lambda: gtx.fromage(1e-2),
    "sm3": lambda: gtx.sm3(1e-2),
    "adafactor": lambda: gtx.adafactor(1e-2, min_dim_size_to_factor=2, momentum=0.9, weight_decay_rate=1e-3),
    # rank 2 of the (4, 3) and (2, 4) matrices, refreshed every other step; the bias unprojected
    "contrib.galore": lambda: galore(1e-2, rank=2, update_proj_gap=2, weight_decay=0.1),
    "contrib.scale_by_galore": lambda: contrib.scale_by_galore(rank=2, update_proj_gap=2),
    "apply_every": lambda: gtx.apply_every(2),
    "conditionally_transform": lambda: gtx.conditionally_transform(adam(), lambda step: step % 2 == 0),
    "conditionally_mask": lambda: gtx.conditionally_mask(adam(), lambda step: step % 2 == 0),
    "flatten": lambda: gtx.flatten(adam()),
    "lookahead": lambda: _on_fast_params(gtx.lookahead(adam(), sync_period=2, slow_step_size=0.5)),
    "inject_stateful_hyperparams": lambda: without_deprecation_warning(gtx.inject_stateful_hyperparams)(gtx.adamw)(
        learning_rate=gtx.linear_schedule(1e-2, 1e-3, 3), weight_decay=0.1
    ),
    "with_extra_args_support": lambda: gtx.with_extra_args_support(adam()),
    # the extra-arguments family: each update is given value=, grad= and value_fn= (see EXTRA_ARGS)
    "scale_by_polyak": lambda: gtx.chain(gtx.scale(-1.0), gtx.scale_by_polyak(max_learning_rate=0.5)),
    "polyak_sgd": lambda: gtx.polyak_sgd(max_learning_rate=0.5),
    "scale_by_backtracking_linesearch": lambda: gtx.chain(
        gtx.scale(-1.0), gtx.scale_by_backtracking_linesearch(max_backtracking_steps=15, store_grad=True)
    ),
    "scale_by_zoom_linesearch": lambda: gtx.chain(
        gtx.scale(-1.0), gtx.scale_by_zoom_linesearch(max_linesearch_steps=15)
    ),
    "lbfgs": lambda: gtx.lbfgs(memory_size=3),
    # optax.contrib
    "contrib.prodigy": lambda: contrib.prodigy(weight_decay=0.1),
    "contrib.dadapt_adamw": lambda: contrib.dadapt_adamw(weight_decay=0.1),
    "contrib.dog": lambda: contrib.dog(weight_decay=0.1),
    "contrib.scale_by_dog": lambda: contrib.scale_by_dog(("learning_rate", 0.1)),
    "contrib.dowg": lambda: contrib.dowg(weight_decay=0.1),
    "contrib.scale_by_dowg": contrib.scale_by_dowg,
    "contrib.cocob": lambda: contrib.cocob(weight_decay=0.1),
    "contrib.scale_by_cocob": contrib.scale_by_cocob,
    "contrib.mechanize": lambda: contrib.mechanize(adam()),
    "contrib.momo": lambda: contrib.momo(adapt_lower_bound=True),
    "contrib.momo_adam": lambda: contrib.momo_adam(adapt_lower_bound=True),
    # gradtx.contrib
    "contrib.adopt": lambda: contrib.adopt(1e-2, nesterov=True),
    "contrib.scale_by_adopt": contrib.scale_by_adopt,
    "contrib.ademamix": lambda: contrib.ademamix(1e-2, weight_decay=0.1),
    "contrib.scale_by_ademamix": lambda: contrib.scale_by_ademamix(b3=gtx.linear_schedule(0.9, 0.999, 3)),
    "contrib.simplified_ademamix": lambda: contrib.simplified_ademamix(1e-2, alpha=1.0),
    "contrib.scale_by_simplified_ademamix": contrib.scale_by_simplified_ademamix,
    "contrib.acprop": lambda: contrib.acprop(1e-2, weight_decay=0.1),
    "contrib.scale_by_acprop": contrib.scale_by_acprop,
    "contrib.madgrad": lambda: contrib.madgrad(1e-2, weight_decay=0.1),
    "contrib.scale_by_madgrad": lambda: contrib.scale_by_madgrad(1e-2),
    "contrib.schedule_free": lambda: contrib.schedule_free(gtx.chain(running_sum(), gtx.scale(-1e-2)), 1e-2),
    "contrib.schedule_free_sgd": lambda: contrib.schedule_free_sgd(1e-2, warmup_steps=2, weight_decay=0.1),
    "contrib.schedule_free_adamw": lambda: contrib.schedule_free_adamw(1e-2, state_dtype=torch.float64),
    "contrib.sophia": lambda: gtx.contrib.sophia(1e-2, update_interval=2),
    "contrib.hutchinson_estimator_diag_hessian": lambda: gtx.chain(
        gtx.contrib.hutchinson_estimator_diag_hessian(random_seed=0), gtx.scale(-1e-2)
    ),
    "contrib.reduce_on_plateau": lambda: gtx.chain(adam(), gtx.contrib.reduce_on_plateau(patience=1)),
    "contrib.sam": lambda: gtx.contrib.sam(adam(), gtx.chain(gtx.contrib.normalize(), gtx.sgd(0.1, momentum=0.9)), 3),
    "contrib.sam(keep_state)": lambda: gtx.contrib.sam(
        adam(), gtx.chain(gtx.contrib.normalize(), gtx.sgd(0.1, momentum=0.9)), 2, reset_state=False
    ),
    "contrib.normalize": gtx.contrib.normalize,
    "contrib.split_real_and_imaginary": lambda: gtx.contrib.split_real_and_imaginary(adam()),
}


def _on_fast_params(tx):
    """A lookahead transformation driven with plain params (fast and slow both taken to be them)."""

    def update_fn(updates, state, params=None, *, inplace=False):
        pair = gtx.LookaheadParams(fast=params, slow=params)
        out, state = tx.update(updates, state, pair, inplace=inplace)
        return out.fast, state

    return gtx.GradientTransformation(tx.init, update_fn)
# MultiSteps is a class; its transformation is built in several configurations.
MULTISTEPS = {
    "MultiSteps": lambda: gtx.MultiSteps(running_sum(), 2).gradient_transformation(),
    "MultiSteps(inner adam)": lambda: gtx.MultiSteps(adam(), 2).gradient_transformation(),
    "MultiSteps(skip_not_finite)": lambda: gtx.MultiSteps(
        running_sum(), 2, should_skip_update_fn=gtx.skip_not_finite
    ).gradient_transformation(),
    "MultiSteps(schedule)": lambda: gtx.MultiSteps(
        running_sum(), lambda step: 1 + (step >= 1).to(torch.int32), use_grad_mean=False
    ).gradient_transformation(),
    "inject_hyperparams(scale, tensor)": lambda: gtx.inject_hyperparams(gtx.scale)(step_size=torch.tensor(0.5)),
    "inject_hyperparams(clip_by_global_norm)": lambda: gtx.inject_hyperparams(gtx.clip_by_global_norm)(max_norm=1.0),
    "apply_if_finite(inject_hyperparams)": lambda: gtx.apply_if_finite(
        gtx.inject_hyperparams(gtx.sgd)(learning_rate=0.1, momentum=0.9), 2
    ),
}
CASES = {**FACTORIES, **MULTISTEPS}

# Cases whose update takes the objective: their gradients are the objective's, not random ones.
EXTRA_ARGS = {
    "scale_by_polyak", "polyak_sgd", "scale_by_backtracking_linesearch", "scale_by_zoom_linesearch", "lbfgs",
    "contrib.sophia", "contrib.hutchinson_estimator_diag_hessian", "contrib.reduce_on_plateau",
    "contrib.momo", "contrib.momo_adam",
}
# Cases whose state keeps the value and gradient at the accepted point: the next step reads them
# back (gtx.value_and_grad_from_state) and hands them in, as a training loop does.
FROM_STATE = {"scale_by_backtracking_linesearch", "scale_by_zoom_linesearch", "lbfgs"}
_TARGETS = {name: 0.5 * g for name, g in grads(50).items()}


def objective(params):
    """A smooth, anisotropic, non-quadratic objective (so line searches and L-BFGS do real work)."""
    return sum(
        ((1.0 + i) * (p - _TARGETS[name]).square() + 0.1 * p.pow(4)).sum()
        for i, (name, p) in enumerate(params.items())
    )


def extra_args(name, params, state):
    """``(grads, extra arguments)`` for the update of a case that takes the objective."""
    if name in FROM_STATE:
        value, grad = gtx.value_and_grad_from_state(objective)(params, state=state)
    else:
        value, grad = torch.func.grad_and_value(objective)(params)[::-1]
    return grad, {"value": value, "grad": grad, "value_fn": objective}


def public_factories() -> set[str]:
    """Every public gradtx (and gradtx.contrib) function whose declared result is a ``GradientTransformation``."""
    names = set()
    contrib_objects = {
        id(obj) for obj in map(functools.partial(getattr, gtx.contrib), gtx.contrib.__all__)
        if getattr(obj, "__module__", "").startswith("gradtx.contrib")
    }
    top_level = [(gtx, n) for n in dir(gtx) if id(getattr(gtx, n)) not in contrib_objects]  # contrib's: below
    for module, name in top_level + [(gtx.contrib, n) for n in gtx.contrib.__all__]:
        obj = getattr(module, name)
        if name.startswith("_") or not inspect.isfunction(obj):
            continue
        target = obj.__wrapped__ if isinstance(obj, functools.partial) else obj
        annotation = inspect.signature(target).return_annotation
        if "GradientTransformation" in getattr(annotation, "__name__", str(annotation)):
            names.add(name if module is gtx else f"contrib.{name}")
    return names


def test_every_public_factory_is_covered():
    # gradtx.contrib re-exports these gradtx objects (optax.contrib does too): covered by their own cases
    same_objects = {"contrib.dpsgd", "contrib.differentially_private_aggregate"}
    missing = public_factories() - set(FACTORIES) - same_objects
    assert not missing, f"add these public transformations to FACTORIES: {sorted(missing)}"


def storages(tree) -> dict[int, str]:
    """data_ptr of every tensor's storage -> the tensor's path (tensors with no elements skipped)."""
    out = {}
    for path, leaf in zip(gtx.tree.paths(tree), gtx.tree.leaves(tree)):
        if isinstance(leaf, torch.Tensor) and leaf.untyped_storage().nbytes() > 0:
            out[leaf.untyped_storage().data_ptr()] = path
    return out


@pytest.mark.parametrize("name", sorted(CASES))
def test_pure_update_returns_a_state_sharing_no_storage_with_the_old_one(name):
    tx = CASES[name]()
    p = params()
    state = tx.init(p)
    for step in range(STEPS):
        g = grads(step, (2,) if name in PER_EXAMPLE else ())
        if step == 2 and "finite" in name:
            g["layer.bias"] = torch.full_like(g["layer.bias"], float("nan"))  # a skipped step too
        extra = {}
        if name in EXTRA_ARGS:
            g, extra = extra_args(name, p, state)
        updates, new_state = tx.update(g, state, p, **extra)
        old = storages(state)
        for path, leaf in zip(gtx.tree.paths(new_state), gtx.tree.leaves(new_state)):
            if isinstance(leaf, torch.Tensor) and leaf.untyped_storage().nbytes() > 0:
                ptr = leaf.untyped_storage().data_ptr()
                assert ptr not in old, f"step {step}: new state {path!r} shares storage with old state {old[ptr]!r}"
        if name != "measure_with_ema":  # its output is the measurement, not updates
            p = gtx.apply_updates(p, updates)
        state = new_state
