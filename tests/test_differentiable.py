"""Differentiating through updates: meta-gradients, hypergradients, ``torch.func`` and ``vmap``.

A pure ``update`` records a graph whenever one is needed (autograd on with an input that requires
grad, or a ``torch.func`` transform), and runs its fast kernels otherwise. On a tiny float64
least-squares problem, the loss after three unrolled steps is differentiated with respect to the
initial parameters (and to the learning rate) by ``torch.autograd.grad(create_graph=True)`` and by
``torch.func.grad``; both must equal central finite differences, whose evaluations run the fast
kernels (plain tensors, nothing requires grad). So the test checks the differentiable path's
gradients and its values against the fast path at the same time.
"""

from __future__ import annotations

import functools
import inspect

import pytest
import torch
from torch.func import grad, jacrev, jvp, vmap

import gradtx as gtx
from gradtx import contrib
from gradtx.contrib import galore
import gradtx.contrib
from optimizer_helpers import without_deprecation_warning
import gradtx.optimizers

DTYPE = torch.float64
STEPS = 3
FD_STEP = 1e-6


def _problem():
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(6, 3, generator=gen, dtype=DTYPE)
    y = torch.randn(6, generator=gen, dtype=DTYPE)
    params = {"w": torch.randn(3, generator=gen, dtype=DTYPE), "b": torch.randn((), generator=gen, dtype=DTYPE)}
    return a, y, params


A, Y, PARAMS = _problem()


def residuals(params):
    return A @ params["w"] + params["b"] - Y


def loss(params):
    return (residuals(params) ** 2).mean()


def per_example_loss(params, row, target):
    return (row @ params["w"] + params["b"] - target) ** 2


def batch_gradient(params, *, create_graph):
    if create_graph:  # autograd on the outer graph
        leaves = list(params.values())
        return dict(zip(params, torch.autograd.grad(loss(params), leaves, create_graph=True)))
    return grad(loss)(params)


def per_example_gradients(params, *, create_graph):
    del create_graph  # torch.func transforms compose with an outer autograd graph
    return vmap(grad(per_example_loss), in_dims=(None, 0, 0))(params, A, Y)


# name -> (factory, gradient function). The step sizes keep every optimizer away from kinks
# (clipping thresholds, maxima, signs) over three steps, where finite differences are exact.
CASES = {
    "sgd": lambda: gtx.sgd(0.1),
    "sgd_nesterov": lambda: gtx.sgd(0.1, momentum=0.9, nesterov=True),
    "adam": lambda: gtx.adam(0.05),
    "adamw": lambda: gtx.adamw(0.05, weight_decay=0.1),
    "nadam": lambda: gtx.nadam(0.05),
    "nadamw": lambda: gtx.nadamw(0.05, weight_decay=0.1),
    "amsgrad": lambda: gtx.amsgrad(0.05),
    "adamax": lambda: gtx.adamax(0.05),
    "radam": lambda: gtx.radam(0.05),
    "adabelief": lambda: gtx.adabelief(0.05),
    "lamb": lambda: gtx.lamb(0.05, weight_decay=0.1),
    "lars": lambda: gtx.lars(0.5, weight_decay=0.1, trust_coefficient=0.1),
    # sign() has zero derivative: the meta-gradient flows through the params and the decay only
    "lion": lambda: gtx.lion(0.01, weight_decay=0.1),
    "rmsprop": lambda: gtx.rmsprop(0.05, momentum=0.5),
    "rmsprop_centered": lambda: gtx.rmsprop(0.05, centered=True),
    "adagrad": lambda: gtx.adagrad(0.1),
    # the noise is drawn from a fixed seed and does not depend on the params
    "noisy_sgd": lambda: gtx.noisy_sgd(0.1, eta=0.01, key=3),
    "dpsgd": lambda: gtx.dpsgd(0.1, l2_norm_clip=1.0, noise_multiplier=0.0, seed=0, momentum=0.5),
    "clip_adamw": lambda: gtx.chain(gtx.clip_by_global_norm(1.0), gtx.adamw(0.05, weight_decay=0.1)),
    # sign-based: sign() is piecewise constant (zero derivative away from g = 0), so the meta-gradient
    # flows through the params alone; no gradient element changes sign within a finite-difference step
    "sign_sgd": lambda: gtx.sign_sgd(0.01),
    "signum": lambda: gtx.signum(0.01, beta=0.5),
    # Rprop's step sizes move by comparing signs of successive gradients: piecewise constant too
    "rprop": lambda: gtx.rprop(0.01),
    "adadelta": lambda: gtx.adadelta(0.5, weight_decay=0.1),
    "yogi": lambda: gtx.yogi(0.05),
    "adan": lambda: gtx.adan(0.05, weight_decay=0.1),
    "novograd": lambda: gtx.novograd(0.05, weight_decay=0.1),
    "optimistic_gradient_descent": lambda: gtx.optimistic_gradient_descent(0.1, alpha=0.7, beta=0.4),
    "optimistic_adam": lambda: without_deprecation_warning(gtx.optimistic_adam)(0.05, optimism=0.5),
    "optimistic_adam_v2": lambda: gtx.optimistic_adam_v2(0.05, alpha=0.7, beta=0.4),
    # eps_root > 0: the graph path must add it as the fast path does
    "yogi_eps_root": lambda: gtx.chain(gtx.scale_by_yogi(eps_root=1e-8), gtx.scale(-0.05)),
    "adamaxw": lambda: gtx.adamaxw(0.05, weight_decay=0.1),
    "fromage": lambda: gtx.fromage(0.05),
    # one accumulator per vector or scalar leaf here; the maxima over a matrix's covers:
    # test_matrix_statistics_are_differentiable
    "sm3": lambda: gtx.sm3(0.05, momentum=0.5),
    # the leaves are a vector and a scalar (below min_dim_size_to_factor): the unfactored second
    # moment, update clipping (active: the first update's RMS is 1) and the parameter-scale
    # multiplier; the momentum in float64 (its float32 default would round what finite differences see)
    "adafactor": lambda: gtx.adafactor(
        0.05, clipping_threshold=0.5, momentum=0.5, dtype_momentum=DTYPE, weight_decay_rate=0.1
    ),
    # GaLore on a vector and a scalar projects nothing (Adam); its matrix path: MATRIX_CASES
    "contrib.galore": lambda: galore(0.05, rank=2, update_proj_gap=2, weight_decay=0.1),
    # the objective's value= goes in with its graph: d step / d value is part of the meta-gradient
    "polyak_sgd": lambda: gtx.polyak_sgd(max_learning_rate=10.0, scaling=0.5, f_min=-1.0),
    "with_extra_args_support": lambda: gtx.with_extra_args_support(gtx.sgd(0.1, momentum=0.5)),
    "keep_params_nonnegative": lambda: gtx.chain(gtx.sgd(0.1), gtx.keep_params_nonnegative()),
    # a fixed step: the L-BFGS direction, differentiated through the two-loop recursion
    "lbfgs": lambda: gtx.lbfgs(0.5, memory_size=2, linesearch=None),
    # gradtx.contrib: ADOPT's clipping bound (count ** 0.25) is not reached here after the first step
    # (which normalises nothing: its update is zero); z and MADGRAD's x0 keep the initial params' graph
    "contrib.adopt": lambda: contrib.adopt(0.05, nesterov=True),
    "contrib.ademamix": lambda: contrib.ademamix(0.05, b3=0.9, weight_decay=0.1),
    "contrib.simplified_ademamix": lambda: contrib.simplified_ademamix(0.02, b1=0.9, alpha=2.0, weight_decay=0.1),
    "contrib.acprop": lambda: contrib.acprop(0.05, weight_decay=0.1),
    "contrib.madgrad": lambda: contrib.madgrad(0.05, weight_decay=0.1),
    "contrib.schedule_free_sgd": lambda: contrib.schedule_free_sgd(0.1, warmup_steps=2, weight_decay=0.1),
    "contrib.schedule_free_adamw": lambda: contrib.schedule_free_adamw(0.05, weight_decay=0.1),
    # the accepted step is decrease_factor**k, piecewise constant in the params (1, 0.512, 0.49152
    # here): the host's decisions do not move within a finite-difference step
    "scale_by_backtracking_linesearch": lambda: gtx.chain(
        gtx.scale(-1.0), gtx.scale_by_backtracking_linesearch(max_backtracking_steps=15)
    ),
    # the Hessian diagonal comes from Hutchinson's estimator on value_fn (the probes from a fixed
    # seed): differentiated through the Hessian-vector product; the first update (nu = 0) is clipped
    "contrib.sophia": lambda: gtx.contrib.sophia(
        0.05, b2=0.5, gamma=1.0, clip_threshold=10.0, update_interval=2, weight_decay=0.1
    ),
    # an adversarial step, an outer step from the cached params, an adversarial step
    "contrib.sam": lambda: gtx.contrib.sam(
        gtx.sgd(0.1, momentum=0.5), gtx.chain(gtx.contrib.normalize(), gtx.sgd(0.05)), sync_period=2
    ),
    # optax.contrib's learning-rate-free optimizers: the step-size estimates are differentiated too
    # (their maxima are not tied over these steps); estimates start large enough to move the params
    "contrib.prodigy": lambda: contrib.prodigy(0.5, estim_lr0=1e-2, weight_decay=0.1),
    "contrib.dadapt_adamw": lambda: contrib.dadapt_adamw(0.5, estim_lr0=1e-2, weight_decay=0.1),
    "contrib.dog": lambda: contrib.dog(0.5, init_step=("heuristic", 1e-2), weight_decay=0.1),
    "contrib.dog/learning_rate": lambda: contrib.dog(init_step=("learning_rate", 0.1)),
    "contrib.dowg": lambda: contrib.dowg(0.5, init_estim_sq_dist=1e-2, weight_decay=0.1),
    "contrib.cocob": lambda: contrib.cocob(0.5, weight_decay=0.1),
    "contrib.mechanize": lambda: contrib.mechanize(gtx.adam(0.1), s_init=1e-2),
    # value= goes in with its graph (the loss at the params)
    "contrib.momo": lambda: contrib.momo(0.5, weight_decay=0.1),
    "contrib.momo/adapt_lower_bound": lambda: contrib.momo(0.5, lower_bound=-1.0, adapt_lower_bound=True),
    "contrib.momo_adam": lambda: contrib.momo_adam(0.1, weight_decay=0.1),
    "contrib.momo_adam/adapt_lower_bound": lambda: contrib.momo_adam(0.1, lower_bound=-1.0, adapt_lower_bound=True),
}
GRADIENTS = {"dpsgd": per_example_gradients}
# Every public optimizer alias must be covered here (or listed with the reason it is not).
NOT_COVERED: dict[str, str] = {}
# Cases left out of the vmap test, and why.
NOT_VMAPPED = {
    "scale_by_backtracking_linesearch": "the search reads each trial's value back to the host to decide the next",
}

# Differentiated by autograd only. A line search that evaluates value_fn's gradient (the zoom search,
# the backtracking one with store_grad=True) takes it with torch.autograd on detached copies, which
# torch.func transforms refuse (requires_grad_ inside a transform), and reads its decisions back to
# the host (no vmap). The accepted step is a host number, so its derivative is taken as 0: exact where
# the step is piecewise constant in the params (a backtracking step decrease_factor**k, or the zoom's
# initial guess accepted, as in each case here); a step the zoom search interpolates (cubic or
# quadratic minimiser of its trial values) depends continuously on the params, and that dependence is
# not differentiated: the meta-gradient then misses it (optax's search, a while_loop, has no reverse
# mode at all).
AUTOGRAD_ONLY = {
    # the strong Wolfe conditions hold at the initial guess 1 at every step here
    "scale_by_zoom_linesearch": lambda: gtx.chain(
        gtx.scale(-0.3), gtx.scale_by_zoom_linesearch(max_linesearch_steps=15, initial_guess_strategy="one")
    ),
    "scale_by_backtracking_linesearch/store_grad": lambda: gtx.chain(
        gtx.scale(-1.0), gtx.scale_by_backtracking_linesearch(max_backtracking_steps=15, store_grad=True)
    ),
    # L-BFGS's default: its zoom search accepts the step 1 at every step here
    "lbfgs/zoom_linesearch": lambda: gtx.lbfgs(memory_size=2),
}

# Transformations and combinators, each checked the same way (chained with a learning rate),
# keyed by public name (a suffix after "/" names a variant).
COMPONENTS = {
    "adaptive_grad_clip": lambda: gtx.adaptive_grad_clip(0.1),
    "add_decayed_weights": lambda: gtx.add_decayed_weights(0.1),
    "add_noise": lambda: gtx.add_noise(0.01, 0.55, key=1),
    "centralize": lambda: gtx.centralize(),
    "clip": lambda: gtx.clip(2.0),
    "clip_by_block_rms": lambda: gtx.clip_by_block_rms(0.5),
    "clip_by_global_norm": lambda: gtx.clip_by_global_norm(0.5),
    "clip_by_value": lambda: gtx.clip_by_value(2.0),
    "ema": lambda: gtx.ema(0.5),
    "fused_adam": lambda: gtx.transforms.fused_adam(-1.0, weight_decay=0.1),
    "scale": lambda: gtx.scale(0.5),
    "scale_by_adam": lambda: gtx.scale_by_adam(nesterov=True),
    "scale_by_adamax": lambda: gtx.scale_by_adamax(),
    "scale_by_amsgrad": lambda: gtx.scale_by_amsgrad(),
    "scale_by_belief": lambda: gtx.scale_by_belief(),
    "scale_by_learning_rate": lambda: gtx.scale_by_learning_rate(gtx.linear_schedule(1.0, 0.5, 3)),
    "scale_by_lion": lambda: gtx.scale_by_lion(mode="smooth"),
    "scale_by_radam": lambda: gtx.scale_by_radam(),
    "scale_by_rms": lambda: gtx.scale_by_rms(bias_correction=True),
    "scale_by_rss": lambda: gtx.scale_by_rss(),
    "scale_by_schedule": lambda: gtx.scale_by_schedule(gtx.exponential_decay(1.0, 1, 0.5)),
    "scale_by_stddev": lambda: gtx.scale_by_stddev(),
    "scale_by_trust_ratio": lambda: gtx.scale_by_trust_ratio(),
    "set_to_zero": lambda: gtx.set_to_zero(),
    "trace": lambda: gtx.trace(0.5),
    "zero_nans": lambda: gtx.zero_nans(),
    "apply_if_finite": lambda: gtx.apply_if_finite(gtx.scale_by_adam(), 2),
    "freeze": lambda: gtx.chain(gtx.scale_by_adam(), gtx.freeze({"w": False, "b": True})),
    "inject_hyperparams": lambda: gtx.inject_hyperparams(gtx.scale_by_adam)(b1=0.8),
    "master_weights": lambda: gtx.master_weights(gtx.scale_by_adam()),  # wider params: the inner as it is
    "masked": lambda: gtx.masked(gtx.scale_by_adam(), {"w": True, "b": False}),
    "measure_with_ema": lambda: gtx.chain(
        gtx.monitor({"norm": gtx.measure_with_ema(gtx.global_norm, 0.9)}), gtx.scale_by_adam()
    ),
    "monitor": lambda: gtx.chain(gtx.monitor({"norm": gtx.global_norm}), gtx.scale_by_adam()),
    "observe": lambda: gtx.observe(gtx.scale_by_adam(), groups=1),
    "multi_transform": lambda: gtx.multi_transform(
        {"adam": gtx.scale_by_adam(), "sgd": gtx.trace(0.9)}, {"w": "adam", "b": "sgd"}
    ),
    # (accumulating in float64: the default float32 accumulator would round what finite differences see)
    "MultiSteps": lambda: gtx.MultiSteps(
        gtx.scale_by_adam(), every_k_schedule=2, accumulator_dtype=None
    ).gradient_transformation(),
    "MultiSteps/skip_not_finite": lambda: gtx.MultiSteps(
        gtx.scale_by_adam(), every_k_schedule=2, should_skip_update_fn=gtx.skip_not_finite, accumulator_dtype=None
    ).gradient_transformation(),
    "MultiSteps/skip_large_updates": lambda: gtx.MultiSteps(
        gtx.scale_by_adam(),
        every_k_schedule=1,
        should_skip_update_fn=functools.partial(gtx.skip_large_updates, max_squared_norm=1e6),
        accumulator_dtype=None,
    ).gradient_transformation(),
    "named_chain": lambda: gtx.named_chain(("clip", gtx.clip_by_global_norm(1.0)), ("adam", gtx.scale_by_adam())),
    "partition": lambda: gtx.partition(
        {"adam": gtx.scale_by_adam(), "rms": gtx.scale_by_rms()}, {"w": "adam", "b": "rms"}
    ),
    "selective_transform": lambda: gtx.selective_transform(gtx.scale_by_adam(), freeze_mask={"w": False, "b": True}),
    "snapshot": lambda: gtx.chain(gtx.snapshot("norm", gtx.global_norm), gtx.scale_by_adam()),
    # sign() and Rprop's sign comparisons are piecewise constant: away from g = 0 (as here) the
    # derivative through them is 0, and the meta-gradient flows through the params alone
    "scale_by_sign": lambda: gtx.scale_by_sign(),
    "scale_by_rprop": lambda: gtx.scale_by_rprop(0.1),
    "scale_by_adadelta": lambda: gtx.scale_by_adadelta(rho=0.8),
    "scale_by_yogi": lambda: gtx.scale_by_yogi(b2=0.9),
    "scale_by_adan": lambda: gtx.scale_by_adan(),
    "scale_by_novograd": lambda: gtx.scale_by_novograd(weight_decay=0.1),
    "scale_by_optimistic_gradient": lambda: gtx.scale_by_optimistic_gradient(alpha=0.7, beta=0.4),
    "scale_by_param_block_norm": lambda: gtx.chain(gtx.scale_by_adam(), gtx.scale_by_param_block_norm()),
    "scale_by_param_block_rms": lambda: gtx.chain(gtx.scale_by_adam(), gtx.scale_by_param_block_rms()),
    "normalize_by_update_norm": lambda: gtx.normalize_by_update_norm(),
    # (in float64: the float32 default of param_dtype would round what finite differences see)
    "scale_by_distance_over_gradients": lambda: gtx.scale_by_distance_over_gradients(param_dtype=torch.float64),
    # the leaves are a vector and a scalar: the unfactored moment (the factored one and SM3's
    # maxima over a matrix's covers: test_matrix_statistics_are_differentiable)
    "scale_by_factored_rms": lambda: gtx.scale_by_factored_rms(),
    "scale_by_sm3": lambda: gtx.scale_by_sm3(b1=0.5),
    # the two-loop recursion on tensors: differentiable, no host decision
    "scale_by_lbfgs": lambda: gtx.scale_by_lbfgs(memory_size=2),
    # value= goes in with its graph; the step stays below max_learning_rate (no kink)
    "scale_by_polyak": lambda: gtx.chain(gtx.scale_by_adam(), gtx.scale_by_polyak(max_learning_rate=100.0, f_min=-1.0)),
    "apply_every": lambda: gtx.chain(gtx.scale_by_adam(), gtx.apply_every(2)),
    "conditionally_mask": lambda: gtx.conditionally_mask(gtx.scale_by_adam(), lambda step: step % 2 == 0),
    "conditionally_transform": lambda: gtx.conditionally_transform(gtx.scale_by_adam(), lambda step: step % 2 == 0),
    "flatten": lambda: gtx.flatten(gtx.scale_by_adam()),
    "contrib.normalize": lambda: gtx.contrib.normalize(),
    # updates = -0.1 * z * (H z): the estimate itself, differentiated through the Hessian-vector product
    "contrib.hutchinson_estimator_diag_hessian": lambda: gtx.contrib.hutchinson_estimator_diag_hessian(random_seed=2),
    # the scale is piecewise constant in the values: the meta-gradient flows through the updates
    "contrib.reduce_on_plateau": lambda: gtx.chain(gtx.scale_by_adam(), gtx.contrib.reduce_on_plateau(patience=1)),
    # real params pass through (complex ones: tests/test_contrib_complex.py)
    "contrib.split_real_and_imaginary": lambda: gtx.contrib.split_real_and_imaginary(gtx.scale_by_adam()),
    "inject_stateful_hyperparams": lambda: without_deprecation_warning(gtx.inject_stateful_hyperparams)(gtx.scale_by_adam)(b1=0.8),
    "contrib.scale_by_dog": lambda: contrib.scale_by_dog(("distance", 0.1)),
    "contrib.scale_by_dowg": lambda: contrib.scale_by_dowg(1e-2),
    "contrib.scale_by_cocob": lambda: contrib.scale_by_cocob(),
    "contrib.scale_by_adopt": lambda: contrib.scale_by_adopt(use_clipping=False),
    "contrib.scale_by_ademamix": lambda: contrib.scale_by_ademamix(b3=gtx.linear_schedule(0.9, 0.99, 3), alpha=2.0),
    "contrib.scale_by_simplified_ademamix": lambda: contrib.scale_by_simplified_ademamix(alpha=1.0),
    "contrib.scale_by_acprop": lambda: contrib.scale_by_acprop(),
    "contrib.scale_by_madgrad": lambda: contrib.scale_by_madgrad(gtx.linear_schedule(0.1, 0.05, 3)),
    "contrib.scale_by_galore": lambda: contrib.scale_by_galore(rank=2, update_proj_gap=2),
    "contrib.schedule_free": lambda: contrib.schedule_free(gtx.adam(0.5, b1=0.0), 0.5),
}
# Unrolled further: RAdam's rectified branch starts at the sixth step (rho_t >= 5).
LONGER = {"scale_by_radam": 7}
# Public names of gradtx.transforms and gradtx.chains that are not covered above, and why.
COMPONENTS_NOT_COVERED = {
    "stochastic_rounding": "rounds to bfloat16 / float16 values, a step function; wider params (these) pass through",
    "kahan_summation": "rounds to bfloat16 / float16 values, a step function; wider params (these) pass through",
    "differentially_private_aggregate": "takes per-example gradients: covered by the dpsgd case",
    "per_example_global_norm_clip": "a function inside differentially_private_aggregate: covered by dpsgd",
    "per_example_layer_norm_clip": "a function on per-example gradients, not a transformation",
    "global_norm": "a function, differentiated inside clip_by_global_norm and monitor",
    "unitwise_norm": "a function, differentiated inside adaptive_grad_clip",
    "chain": "every case is a chain",
    "get_measurement": "reads a state",
    "observations": "reads a state into floats, for loggers",
    "skip_not_finite": "a MultiSteps skip function: covered by MultiSteps/skip_not_finite",
    "skip_large_updates": "a MultiSteps skip function: covered by MultiSteps/skip_large_updates",
    "from_torch": "runs a torch.optim.Optimizer's step, which torch takes under no_grad: not differentiable",
    "wrap": "the imperative torch optimizer, stepped under no_grad",
    "lookahead": "its params are a (fast, slow) pair: test_lookahead_meta_gradient_equals_finite_differences",
    "value_and_grad_from_state": "a helper returning the value and gradient a line search stored, no transformation",
}


def _extra_args(tx, params, g):
    """The objective's value (with its graph), gradient and function, for a transformation that takes them."""
    if isinstance(tx, gtx.GradientTransformationExtraArgs):
        return {"value": loss(params), "grad": g, "value_fn": loss}
    return {}


def _unroll(tx, params, gradients, *, create_graph, steps=STEPS):
    state = tx.init(params)
    for _ in range(steps):
        g = gradients(params, create_graph=create_graph)
        updates, state = tx.update(g, state, params, **_extra_args(tx, params, g))
        params = gtx.apply_updates(params, updates)
    return params


def final_loss(make, params, gradients=batch_gradient, *, create_graph=False, steps=STEPS):
    return loss(_unroll(make(), params, gradients, create_graph=create_graph, steps=steps))


def finite_differences(fn, params):
    """Central differences of the scalar ``fn(params)``, one element at a time, on plain tensors."""
    out = {}
    for name, value in params.items():
        flat = torch.zeros(value.numel(), dtype=DTYPE)
        for i in range(value.numel()):
            shifted = []
            for sign in (1.0, -1.0):
                moved = value.detach().clone().reshape(-1)
                moved[i] += sign * FD_STEP
                shifted.append(fn({**params, name: moved.reshape(value.shape)}))
            flat[i] = (shifted[0] - shifted[1]) / (2 * FD_STEP)
        out[name] = flat.reshape(value.shape)
    return out


def assert_matches(computed, expected):
    scale = max(float(v.abs().max()) for v in expected.values())
    for name in expected:
        torch.testing.assert_close(computed[name], expected[name], rtol=1e-5, atol=1e-7 * scale)


def _public_aliases():
    return sorted(gradtx.optimizers.__all__)


def test_every_optimizer_alias_is_covered():
    missing = [name for name in _public_aliases() if name not in CASES and name not in NOT_COVERED]
    assert not missing, f"optimizer aliases with no differentiability test: {missing}"


def test_every_transformation_and_combinator_is_covered():
    import gradtx.chains
    import gradtx.interop
    import gradtx.transforms

    public = [
        name
        for module in (gradtx.transforms, gradtx.chains, gradtx.interop)
        for name in module.__all__
        if inspect.isfunction(getattr(module, name)) or name == "MultiSteps"
    ]
    covered = {name.split("/")[0] for name in (*COMPONENTS, *AUTOGRAD_ONLY)} | set(COMPONENTS_NOT_COVERED) | set(CASES)
    missing = [name for name in public if name not in covered]
    assert not missing, f"transformations or combinators with no differentiability test: {missing}"


# Public names of gradtx.contrib that are not covered above, and why.
CONTRIB_NOT_COVERED = {
    "dpsgd": "the same object as gradtx.dpsgd: covered by the dpsgd case",
    "differentially_private_aggregate": "the same object as gradtx's: covered by the dpsgd case",
    "schedule_free_eval_params": "a function of a state and params (an affine map of y and z), not a transformation",
}


def test_every_contrib_name_is_covered():
    public = [name for name in contrib.__all__ if inspect.isfunction(getattr(contrib, name))]
    covered = {name.split("/")[0] for name in (*CASES, *COMPONENTS, *MATRIX_CASES)} | {
        f"contrib.{n}" for n in CONTRIB_NOT_COVERED
    }
    missing = [name for name in public if f"contrib.{name}" not in covered]
    assert not missing, f"gradtx.contrib names with no differentiability test: {missing}"


@pytest.mark.parametrize("name", sorted(CASES))
def test_meta_gradient_by_autograd_equals_finite_differences(name):
    make, gradients = CASES[name], GRADIENTS.get(name, batch_gradient)
    expected = finite_differences(lambda p: final_loss(make, p, gradients), PARAMS)
    params = {k: v.clone().requires_grad_() for k, v in PARAMS.items()}
    value = final_loss(make, params, gradients, create_graph=True)
    computed = dict(zip(params, torch.autograd.grad(value, list(params.values()))))
    torch.testing.assert_close(value.detach(), final_loss(make, PARAMS, gradients), rtol=1e-12, atol=0)
    assert_matches(computed, expected)


@pytest.mark.parametrize("name", sorted(AUTOGRAD_ONLY))
def test_line_search_meta_gradient_by_autograd_equals_finite_differences(name):
    make = AUTOGRAD_ONLY[name]
    expected = finite_differences(lambda p: final_loss(make, p), PARAMS)
    params = {k: v.clone().requires_grad_() for k, v in PARAMS.items()}
    value = final_loss(make, params, create_graph=True)
    computed = dict(zip(params, torch.autograd.grad(value, list(params.values()))))
    torch.testing.assert_close(value.detach(), final_loss(make, PARAMS), rtol=1e-12, atol=0)
    assert_matches(computed, expected)


# Second-moment statistics that only a matrix has: Adafactor's row and column factors, SM3's
# per-dimension maxima (minimum over covers, maximum over the rest: no ties on this random data).
_GEN = torch.Generator().manual_seed(1)
MATRIX_X, MATRIX_Y = torch.randn(8, 4, generator=_GEN, dtype=DTYPE), torch.randn(8, 3, generator=_GEN, dtype=DTYPE)
MATRIX_PARAMS = {"W": torch.randn(4, 3, generator=_GEN, dtype=DTYPE), "bias": torch.randn(3, generator=_GEN, dtype=DTYPE)}
MATRIX_CASES = {
    "scale_by_factored_rms": lambda: gtx.chain(gtx.scale_by_factored_rms(min_dim_size_to_factor=2), gtx.scale(-0.05)),
    "scale_by_sm3": lambda: gtx.chain(gtx.scale_by_sm3(b1=0.5), gtx.scale(-0.05)),
    "adafactor": lambda: gtx.adafactor(
        0.05, min_dim_size_to_factor=2, clipping_threshold=0.5, momentum=0.5, dtype_momentum=DTYPE, weight_decay_rate=0.1
    ),
    "sm3": lambda: gtx.sm3(0.05, momentum=0.5),
    # a rank-2 projection of the (4, 3) matrix from the SVD of its gradient, refreshed at the third
    # step: differentiated through the SVD (the singular values are well apart on this data)
    "contrib.galore": lambda: galore(0.05, rank=2, update_proj_gap=2, weight_decay=0.1),
    # Muon on W (Newton-Schulz through the graph), AdamW on the bias
    "contrib.muon": lambda: contrib.muon(0.05, weight_decay=0.1, consistent_rms=0.2),
    "contrib.scale_by_muon": lambda: gtx.chain(
        gtx.masked(contrib.scale_by_muon(adaptive=True, preconditioning="aol"), {"W": True, "bias": False}), gtx.scale(-0.05)
    ),
}


def _matrix_loss(params):
    return ((MATRIX_X @ params["W"] + params["bias"] - MATRIX_Y) ** 2).mean()


def _matrix_final_loss(make, params, *, create_graph=False):
    tx = make()
    state = tx.init(params)
    for _ in range(STEPS):
        if create_graph:
            g = dict(zip(params, torch.autograd.grad(_matrix_loss(params), list(params.values()), create_graph=True)))
        else:
            g = grad(_matrix_loss)(params)
        updates, state = tx.update(g, state, params)
        params = gtx.apply_updates(params, updates)
    return _matrix_loss(params)


@pytest.mark.parametrize("name", sorted(MATRIX_CASES))
def test_matrix_statistics_are_differentiable(name):
    make = MATRIX_CASES[name]
    if name in ("scale_by_factored_rms", "adafactor"):  # the factored branch is the one taken for W
        factored = make().init(MATRIX_PARAMS)[0]
        assert factored.v["W"].numel() == 1 and factored.v_row["W"].numel() > 1
    expected = finite_differences(lambda p: _matrix_final_loss(make, p), MATRIX_PARAMS)
    params = {k: v.clone().requires_grad_() for k, v in MATRIX_PARAMS.items()}
    value = _matrix_final_loss(make, params, create_graph=True)
    computed = dict(zip(params, torch.autograd.grad(value, list(params.values()))))
    torch.testing.assert_close(value.detach(), _matrix_final_loss(make, MATRIX_PARAMS), rtol=1e-12, atol=0)
    assert_matches(computed, expected)
    assert_matches(grad(lambda p: _matrix_final_loss(make, p))(MATRIX_PARAMS), expected)


def _lookahead_final_loss(params, *, create_graph=False):
    """Loss of the fast and slow params after three lookahead steps (a synchronisation at the second)."""
    tx = gtx.lookahead(gtx.adam(0.05), sync_period=2, slow_step_size=0.5)
    pair = gtx.LookaheadParams.init_synced(params)
    state = tx.init(pair)
    for _ in range(STEPS):
        updates, state = tx.update(batch_gradient(pair.fast, create_graph=create_graph), state, pair)
        pair = gtx.apply_updates(pair, updates)
    return loss(pair.fast) + loss(pair.slow)


def test_lookahead_meta_gradient_equals_finite_differences():
    expected = finite_differences(_lookahead_final_loss, PARAMS)
    params = {k: v.clone().requires_grad_() for k, v in PARAMS.items()}
    value = _lookahead_final_loss(params, create_graph=True)
    computed = dict(zip(params, torch.autograd.grad(value, list(params.values()))))
    torch.testing.assert_close(value.detach(), _lookahead_final_loss(PARAMS), rtol=1e-12, atol=0)
    assert_matches(computed, expected)
    assert_matches(grad(_lookahead_final_loss)(PARAMS), expected)


@pytest.mark.parametrize("name", sorted(CASES))
def test_meta_gradient_by_torch_func_equals_finite_differences(name):
    make, gradients = CASES[name], GRADIENTS.get(name, batch_gradient)
    expected = finite_differences(lambda p: final_loss(make, p, gradients), PARAMS)
    assert_matches(grad(lambda p: final_loss(make, p, gradients))(PARAMS), expected)


@pytest.mark.parametrize("name", sorted(COMPONENTS))
def test_transforms_and_combinators_are_differentiable(name):
    def make():
        return gtx.chain(COMPONENTS[name](), gtx.scale(-0.1))

    steps = LONGER.get(name, STEPS)
    expected = finite_differences(lambda p: final_loss(make, p, steps=steps), PARAMS)
    params = {k: v.clone().requires_grad_() for k, v in PARAMS.items()}
    value = final_loss(make, params, create_graph=True, steps=steps)
    computed = dict(zip(params, torch.autograd.grad(value, list(params.values()))))
    assert_matches(computed, expected)
    assert_matches(grad(lambda p: final_loss(make, p, steps=steps))(PARAMS), expected)


@pytest.mark.parametrize("name", sorted(set(CASES) - set(NOT_VMAPPED)))
def test_vmap_over_an_ensemble_equals_a_loop(name):
    make, gradients = CASES[name], GRADIENTS.get(name, batch_gradient)
    ensemble = {k: torch.stack([v + 0.3 * i for i in range(3)]) for k, v in PARAMS.items()}

    def train(params):
        return _unroll(make(), params, gradients, create_graph=False)

    # the noise of noisy_sgd comes from its own seeded generator: the same for every member
    batched = vmap(train, randomness="same")(ensemble)
    for i in range(3):
        looped = train({k: v[i] for k, v in ensemble.items()})
        for k in PARAMS:
            torch.testing.assert_close(batched[k][i], looped[k], rtol=1e-12, atol=1e-14)


ENSEMBLE_CASES = {
    **{name: CASES[name] for name in ("clip_adamw", "lamb", "amsgrad", "radam", "adamax", "lion")},
    "multi_steps": lambda: gtx.MultiSteps(gtx.adam(0.05), every_k_schedule=2).gradient_transformation(),
    "apply_if_finite": lambda: gtx.apply_if_finite(gtx.adamw(0.05, weight_decay=0.1), 2),
}


@pytest.mark.parametrize("inplace", [False, True], ids=["pure", "donated"])
@pytest.mark.parametrize("name", sorted(ENSEMBLE_CASES))
def test_vmapped_init_and_steps_over_an_ensemble_equal_a_loop(name, inplace):
    """An ensemble trained as one: ``vmap(tx.init)``, then ``vmap`` of a step (the state batched,
    its counters broadcast views), and ``vmap(grad(meta_loss))``."""
    make = ENSEMBLE_CASES[name]
    tx = make()
    ensemble = {k: torch.stack([v + 0.3 * i for i in range(3)]) for k, v in PARAMS.items()}

    def step(params, state):
        updates, state = tx.update(grad(loss)(params), state, params, inplace=inplace)
        return gtx.apply_updates(params, updates), state

    params, state = ensemble, vmap(tx.init)(ensemble)
    for _ in range(STEPS):
        params, state = vmap(step)(params, state)
    meta = vmap(grad(lambda p: final_loss(make, p)))(ensemble)
    for i in range(3):
        member = {k: v[i] for k, v in ensemble.items()}
        looped = _unroll(make(), member, batch_gradient, create_graph=False)
        looped_meta = grad(lambda p: final_loss(make, p))(member)
        for k in PARAMS:
            torch.testing.assert_close(params[k][i], looped[k], rtol=1e-12, atol=1e-14)
            torch.testing.assert_close(meta[k][i], looped_meta[k], rtol=1e-10, atol=1e-12)


def _lr_hypergradient_case(factory, **hyperparams):
    def final(lr):
        tx = gtx.inject_hyperparams(factory)(learning_rate=lr, **hyperparams)
        return loss(_unroll(tx, PARAMS, batch_gradient, create_graph=False))

    return final


@pytest.mark.parametrize("factory", [gtx.sgd, gtx.adam, gtx.adamw, gtx.rmsprop], ids=lambda f: f.__name__)
def test_learning_rate_hypergradient_equals_finite_differences(factory):
    final = _lr_hypergradient_case(factory)
    lr0 = 0.05
    expected = (final(torch.tensor(lr0 + FD_STEP, dtype=DTYPE)) - final(torch.tensor(lr0 - FD_STEP, dtype=DTYPE))) / (
        2 * FD_STEP
    )
    lr = torch.tensor(lr0, dtype=DTYPE, requires_grad=True)
    (by_autograd,) = torch.autograd.grad(final(lr), lr)
    by_func = grad(final)(torch.tensor(lr0, dtype=DTYPE))
    assert abs(float(expected)) > 1e-3  # the learning rate matters to this loss
    torch.testing.assert_close(by_autograd, expected, rtol=1e-5, atol=0)
    torch.testing.assert_close(by_func, expected, rtol=1e-5, atol=0)


def test_hypergradients_of_several_hyperparameters_at_once():
    """d loss / d (learning_rate, b1, weight_decay) of AdamW, each hyperparameter a tensor that requires grad."""

    def final(lr, b1, wd):
        tx = gtx.inject_hyperparams(gtx.adamw)(learning_rate=lr, b1=b1, weight_decay=wd)
        return loss(_unroll(tx, PARAMS, batch_gradient, create_graph=False))

    point = [0.05, 0.8, 0.5]
    tensors = [torch.tensor(v, dtype=DTYPE, requires_grad=True) for v in point]
    computed = torch.autograd.grad(final(*tensors), tensors)
    for i in range(3):
        up = [torch.tensor(v + (FD_STEP if j == i else 0.0), dtype=DTYPE) for j, v in enumerate(point)]
        down = [torch.tensor(v - (FD_STEP if j == i else 0.0), dtype=DTYPE) for j, v in enumerate(point)]
        expected = (final(*up) - final(*down)) / (2 * FD_STEP)
        torch.testing.assert_close(computed[i], expected, rtol=1e-5, atol=1e-9)


def test_hyperparameter_set_in_the_state_keeps_its_graph():
    """Writing a tensor that requires grad into ``state.hyperparams`` makes the next step depend on it."""
    tx = gtx.inject_hyperparams(gtx.adam)(learning_rate=0.1)
    state = tx.init(PARAMS)
    lr = torch.tensor(0.05, dtype=DTYPE, requires_grad=True)
    state.hyperparams["learning_rate"] = lr
    updates, state = tx.update(grad(loss)(PARAMS), state, PARAMS)
    (d_lr,) = torch.autograd.grad(loss(gtx.apply_updates(PARAMS, updates)), lr)
    assert state.hyperparams["learning_rate"].requires_grad
    # one Adam step from zero moments moves each element by -lr * sign(g) (up to eps)
    g = grad(loss)(PARAMS)
    step_direction = {k: -torch.sign(v) for k, v in g.items()}
    moved = gtx.apply_updates(PARAMS, {k: 0.05 * v for k, v in step_direction.items()})
    expected = sum((grad(loss)(moved)[k] * step_direction[k]).sum() for k in PARAMS)
    torch.testing.assert_close(d_lr, expected, rtol=1e-6, atol=1e-10)


def _flat_final_params(make):
    shapes = {k: v.shape for k, v in PARAMS.items()}

    def fn(flat):
        params, offset = {}, 0
        for k, shape in shapes.items():
            n = int(torch.Size(shape).numel())
            params[k] = flat[offset : offset + n].reshape(shape)
            offset += n
        final = _unroll(make(), params, batch_gradient, create_graph=False)
        return torch.cat([final[k].reshape(-1) for k in shapes])

    return fn, torch.cat([PARAMS[k].reshape(-1) for k in shapes])


def test_jacrev_and_jvp_through_clipped_adamw():
    fn, x = _flat_final_params(CASES["clip_adamw"])
    jacobian = jacrev(fn)(x)
    expected = torch.stack(
        [(fn(x + FD_STEP * e) - fn(x - FD_STEP * e)) / (2 * FD_STEP) for e in torch.eye(len(x), dtype=DTYPE)], dim=1
    )
    torch.testing.assert_close(jacobian, expected, rtol=1e-5, atol=1e-8)
    tangent = torch.linspace(-1.0, 1.0, len(x), dtype=DTYPE)
    value, directional = jvp(fn, (x,), (tangent,))
    torch.testing.assert_close(value, fn(x), rtol=1e-12, atol=0)
    torch.testing.assert_close(directional, jacobian @ tangent, rtol=1e-10, atol=1e-12)


def test_state_and_gradients_are_differentiable_inputs():
    """d update / d (gradient, moments) of Adam by autograd, against finite differences."""
    tx = gtx.adam(0.1)
    g0 = grad(loss)(PARAMS)
    _, state = tx.update(g0, tx.init(PARAMS), PARAMS)  # nonzero moments
    mu = {k: v.clone() for k, v in state[0].mu.items()}

    def objective(g, m):
        s = state[0]._replace(mu=m)
        updates, _ = tx.update(g, (s, state[1]), PARAMS)
        return sum((u * torch.arange(1, u.numel() + 1, dtype=DTYPE).reshape(u.shape)).sum() for u in updates.values())

    g_req = {k: v.clone().requires_grad_() for k, v in g0.items()}
    m_req = {k: v.clone().requires_grad_() for k, v in mu.items()}
    d_g, d_m = torch.autograd.grad(objective(g_req, m_req), [g_req["w"], m_req["w"]])
    expected_g = finite_differences(lambda g: objective(g, mu), g0)
    expected_m = finite_differences(lambda m: objective(g0, m), mu)
    torch.testing.assert_close(d_g, expected_g["w"], rtol=1e-5, atol=1e-9)
    torch.testing.assert_close(d_m, expected_m["w"], rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize("grad_enabled", [False, True])
def test_no_graph_needed_keeps_the_donated_fast_path(grad_enabled):
    """Params that require grad, stepped under ``no_grad`` (as a torch optimizer steps), or plain
    tensors with grad mode on: nothing records a graph, so donated buffers are reused."""
    params = {k: v.clone().requires_grad_() for k, v in PARAMS.items()}
    tx = gtx.adamw(0.05, weight_decay=0.1)
    with torch.no_grad():
        state = tx.init(params)
    grads = {k: torch.ones_like(v) for k, v in PARAMS.items()}
    mu = state[0].mu
    with torch.set_grad_enabled(grad_enabled):
        updates, new_state = tx.update(grads, state, params if not grad_enabled else PARAMS, inplace=True)
    assert all(updates[k] is grads[k] for k in grads)
    assert all(new_state[0].mu[k] is mu[k] for k in mu)
    assert not any(u.requires_grad for u in updates.values())


def test_a_graph_through_the_params_alone_is_recorded():
    """AdamW reads the params only for its decay: a graph through them is kept, the inputs untouched."""
    params = {k: v.clone().requires_grad_() for k, v in PARAMS.items()}
    tx = gtx.adamw(0.05, weight_decay=0.5)
    state = tx.init(PARAMS)
    grads = {k: torch.ones_like(v) for k, v in PARAMS.items()}
    before = {k: v.clone() for k, v in grads.items()}
    updates, _ = tx.update(grads, state, params)
    (d_w,) = torch.autograd.grad(updates["w"].sum(), params["w"])
    torch.testing.assert_close(d_w, torch.full_like(d_w, -0.05 * 0.5))
    assert all(torch.equal(grads[k], before[k]) for k in grads)


def test_apply_updates_in_place_under_vmap_writes_the_params():
    """Where ops run out of place (under vmap), ``apply_updates(inplace=True)`` still writes the params."""
    ensemble = {"w": torch.zeros(3, 2, dtype=DTYPE), "b": torch.zeros(3, dtype=DTYPE)}
    steps = {"w": torch.ones(3, 2, dtype=DTYPE), "b": torch.arange(3, dtype=DTYPE)}

    def apply(params, updates):
        out = gtx.apply_updates(params, updates, inplace=True)
        assert out is params
        return out

    vmap(apply)(ensemble, steps)
    assert all(torch.equal(ensemble[k], steps[k]) for k in steps)
