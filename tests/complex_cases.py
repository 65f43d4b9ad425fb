"""Complex parameters across the catalogue: the cases, written once for both libraries.

Each case's ``factory(m)`` builds a transformation from ``m``, which is ``gradtx`` in the tests and
``optax`` in ``benchmarks/optax_agreement.py --sections complex`` (run by hand, in an environment
with JAX: it also writes ``optax_complex_reference.py``, the numbers the tests compare against).
Nothing here imports JAX: the library-specific pieces (arrays, dtypes, the objective) are built
through ``m``.

- ``CASES``: transformations that take complex parameters; optax's final params after the
  ``STEPS`` gradients are recorded, and gradtx must give them. ``kind`` says how each step's
  update is called: ``"updates"`` (the fixed ``GRADS``), ``"objective"`` (the gradient of
  :func:`objective` at the current params, with ``value=``, ``grad=`` and ``value_fn=``) or
  ``"grad_fn"`` (SAM's opaque mode: ``grad_fn=`` besides). Gradients follow torch's convention
  (the conjugate Wirtinger gradient, the direction of steepest ascent); JAX's are conjugated to it.
- ``REFUSED``: transformations with no complex form; their ``init`` must raise a ``TypeError``
  naming a leaf.
- ``ELSEWHERE``: names whose complex behaviour is tested by a dedicated test (named in the value).
- ``NOT_TRANSFORMATIONS``: public callables that are not transformations or optimizers.

``tests/test_complex_catalogue.py`` checks that every public callable of ``gradtx`` and
``gradtx.contrib`` falls in one of these.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

STEPS = 3

PARAMS = {
    "w": [[0.06j, 0.3 + 1.34j, -0.27 - 0.49j], [-0.89 - 0.62j, -0.45 + 0.49j, -0.99 + 0.36j]],
    "b": [0.11 + 0.7j, -0.93 - 1.34j, -0.03 - 0.46j],
    "s": -1.9 - 1.29j,
}
GRADS = [
    {
        "w": [[-1.84 - 2.52j, -0.24 - 0.54j, -1.27 - 0.05j], [0.27 + 0.11j, 0.16 - 1.53j, -0.19 - 0.48j]],
        "b": [-0.98 - 0.81j, -0.81 - 0.03j, 1.06 + 0.88j],
        "s": -0.58 - 0.11j,
    },
    {
        "w": [[0.11 + 0.86j, 0.06 + 0.12j, -1.23 - 0.64j], [0.08 + 2j, 1.36 + 0.76j, -1.55 - 1.2j]],
        "b": [0.07 + 0.68j, 0.58 - 0.07j, -0.19 + 0.67j],
        "s": 1.44 - 0.68j,
    },
    {
        "w": [[0.2 + 0.9j, -0.46 + 1.15j, 0.13 - 1.32j], [-1.19 - 0.79j, -0.58 + 0.65j, -0.2 - 1.99j]],
        "b": [-0.46 + 0.69j, -0.1 - 0.33j, 1.26 - 0.37j],
        "s": -0.25 + 1.52j,
    },
]
TARGETS = {"w": [[1 - 1j, 0.5j, -0.5], [2j, -1 + 1j, 0.25]], "b": [1j, -1.0, 0.5 + 0.5j], "s": 1 + 1j}
WEIGHTS = {"b": 1.0, "s": 2.0, "w": 3.0}


def is_gradtx(m: Any) -> bool:
    return m.__name__.split(".")[0] == "gradtx"


def complex128(m: Any) -> Any:
    """The complex128 dtype of library ``m``."""
    if is_gradtx(m):
        import torch

        return torch.complex128
    import jax.numpy as jnp  # only in the benchmark's environment

    return jnp.complex128


def array(m: Any, value: Any) -> Any:
    """A complex128 array of library ``m``."""
    if is_gradtx(m):
        import torch

        return torch.tensor(value, dtype=torch.complex128)
    import jax.numpy as jnp

    return jnp.asarray(value, dtype=jnp.complex128)


def tree(m: Any, values: dict) -> dict:
    return {k: array(m, v) for k, v in values.items()}


def _abs_sq(z: Any) -> Any:
    return z.real**2 + z.imag**2


def objective(m: Any) -> Callable[[dict], Any]:
    """``sum_k w_k |p_k - t_k|^2 + 0.1 |p_k|^4``: a real function of complex params, written for both libraries."""
    targets = tree(m, TARGETS)

    def f(params: dict) -> Any:
        return sum((WEIGHTS[k] * _abs_sq(params[k] - targets[k]) + 0.1 * _abs_sq(params[k]) ** 2).sum() for k in sorted(params))

    return f


class Case(NamedTuple):
    factory: Callable[[Any], Any]
    kind: str = "updates"
    # optax's counterpart when it is not the same expression (optax lacks the name, or cannot run
    # it on complex numbers, and this one gives the numbers gradtx's must equal)
    reference: Any = None
    steps: int = STEPS


def _c(factory, kind="updates", reference=None, steps=STEPS) -> Case:
    return Case(factory, kind, reference, steps)


def _multisteps(m, inner, k, **kw):
    return m.MultiSteps(inner, k, accumulator_dtype=complex128(m), **kw)


CASES: dict[str, Case] = {
    # sgd and momentum: linear in the gradient
    "sgd": _c(lambda m: m.sgd(0.1, 0.9, nesterov=True)),
    "sgd_schedule": _c(lambda m: m.sgd(m.linear_schedule(0.1, 0.01, 2))),
    "trace": _c(lambda m: m.chain(m.trace(0.9), m.scale(-0.1))),
    "ema": _c(lambda m: m.chain(m.ema(0.8), m.scale(-0.1))),
    "ema_complex_accumulator": _c(lambda m: m.chain(m.ema(0.8, debias=False, accumulator_dtype=complex128(m)), m.scale(-0.1))),
    "noisy_sgd_eta0": _c(lambda m: m.noisy_sgd(0.1, eta=0.0)),
    "add_noise_eta0": _c(lambda m: m.chain(m.add_noise(0.0, 0.55, 0), m.sgd(0.1))),
    "optimistic_gradient_descent": _c(lambda m: m.optimistic_gradient_descent(0.1, alpha=0.5, beta=0.8)),
    "scale_by_optimistic_gradient": _c(lambda m: m.chain(m.scale_by_optimistic_gradient(alpha=0.5, beta=0.8), m.scale(-0.1))),
    "scale_by_schedule": _c(lambda m: m.chain(m.scale_by_schedule(m.exponential_decay(0.1, 2, 0.5)), m.scale(-1.0))),
    "scale_by_learning_rate": _c(lambda m: m.chain(m.scale_by_learning_rate(m.polynomial_schedule(0.1, 0.01, 2.0, 3)))),
    "add_decayed_weights": _c(lambda m: m.chain(m.add_decayed_weights(0.1), m.sgd(0.1))),
    "centralize": _c(lambda m: m.chain(m.centralize(), m.sgd(0.1))),
    "identity": _c(lambda m: m.chain(m.identity(), m.sgd(0.1))),
    "zero_nans": _c(lambda m: m.chain(m.zero_nans(), m.sgd(0.1))),
    "set_to_zero": _c(lambda m: m.set_to_zero()),
    "stateless": _c(lambda m: m.chain(m.stateless(lambda u, p: {k: 0.5 * u[k] + 0.1 * p[k] for k in u}), m.sgd(0.1))),
    "stateless_with_tree_map": _c(lambda m: m.chain(m.stateless_with_tree_map(lambda g, p: 0.5 * g + 0.1 * p), m.sgd(0.1))),
    "schedule_free_sgd": _c(lambda m: m.contrib.schedule_free_sgd(0.1, warmup_steps=2, weight_decay=0.1)),
    # Adam and its family: |g|^2 second moments, the complex direction kept
    "adam": _c(lambda m: m.adam(0.1)),
    "adam_eps_root": _c(lambda m: m.adam(0.1, b1=0.8, eps_root=1e-3)),
    "adam_schedule": _c(lambda m: m.adam(m.linear_schedule(0.1, 0.01, 2))),
    "adamw": _c(lambda m: m.adamw(0.1, weight_decay=0.1)),
    "adamw_mask": _c(lambda m: m.adamw(0.1, weight_decay=0.1, mask={"w": True, "b": False, "s": True})),
    "nadam": _c(lambda m: m.nadam(0.1)),
    "nadamw": _c(lambda m: m.nadamw(0.1, weight_decay=0.1)),
    "scale_by_adam": _c(lambda m: m.chain(m.scale_by_adam(b1=0.8, b2=0.9, eps_root=1e-4), m.scale(-0.1))),
    "scale_by_adam_nesterov": _c(lambda m: m.chain(m.scale_by_adam(nesterov=True), m.scale(-0.1))),
    "amsgrad": _c(lambda m: m.amsgrad(0.1, b2=0.9)),
    "scale_by_amsgrad": _c(lambda m: m.chain(m.scale_by_amsgrad(b2=0.5, bias_correction_nu=False, eps_root=1e-4), m.scale(-0.1))),
    "adamax": _c(lambda m: m.adamax(0.1)),
    "adamaxw": _c(lambda m: m.adamaxw(0.1, b2=0.5, weight_decay=0.1)),
    "scale_by_adamax": _c(lambda m: m.chain(m.scale_by_adamax(b1=0.8, b2=0.5), m.scale(-0.1))),
    "adabelief": _c(lambda m: m.adabelief(0.1)),
    "adabelief_nesterov": _c(lambda m: m.adabelief(0.1, nesterov=True)),
    "scale_by_belief": _c(lambda m: m.chain(m.scale_by_belief(b1=0.8), m.scale(-0.1))),
    # six steps: the rectified step starts at the sixth (rho_t reaches 5)
    "radam": _c(lambda m: m.radam(0.1, b2=0.9), steps=6),
    "radam_nesterov": _c(lambda m: m.radam(0.1, b2=0.9, nesterov=True), steps=6),
    "scale_by_radam": _c(lambda m: m.chain(m.scale_by_radam(b1=0.8, b2=0.9), m.scale(-0.1)), steps=6),
    "yogi": _c(lambda m: m.yogi(0.1)),
    "scale_by_yogi": _c(lambda m: m.chain(m.scale_by_yogi(b1=0.5, eps_root=1e-3, initial_accumulator_value=0.1), m.scale(-0.1))),
    "lamb": _c(lambda m: m.lamb(0.1, weight_decay=0.1)),
    "adan": _c(lambda m: m.adan(0.1, weight_decay=0.1)),
    "scale_by_adan": _c(lambda m: m.chain(m.scale_by_adan(b1=0.7, b2=0.6, b3=0.8, eps_root=1e-4), m.scale(-0.1))),
    "novograd": _c(lambda m: m.novograd(0.1, weight_decay=0.1)),
    "scale_by_novograd": _c(lambda m: m.chain(m.scale_by_novograd(b1=0.8), m.scale(-0.1))),
    "optimistic_adam": _c(lambda m: m.optimistic_adam(0.1, optimism=0.2)),
    "optimistic_adam_v2": _c(lambda m: m.optimistic_adam_v2(0.1, alpha=0.5, beta=0.8)),
    "ademamix": _c(lambda m: m.contrib.ademamix(0.1, b3=0.9, alpha=2.0, weight_decay=0.1)),
    "scale_by_ademamix": _c(lambda m: m.chain(m.contrib.scale_by_ademamix(b3=0.9, alpha=m.linear_schedule(0.0, 5.0, 2), eps_root=1e-8), m.scale(-0.1))),
    "acprop": _c(lambda m: m.contrib.acprop(0.1, weight_decay=0.1)),
    "scale_by_acprop": _c(lambda m: m.chain(m.contrib.scale_by_acprop(b2=0.9, eps=1e-8), m.scale(-0.1))),
    "adopt_without_clipping": _c(lambda m: m.contrib.adopt(0.1, b2=0.9, use_clipping=False, nesterov=True)),
    "scale_by_adopt_without_clipping": _c(lambda m: m.chain(m.contrib.scale_by_adopt(b2=0.9, use_clipping=False), m.scale(-0.1))),
    "schedule_free_adamw": _c(lambda m: m.contrib.schedule_free_adamw(0.1, warmup_steps=2, weight_decay=0.1)),
    "schedule_free": _c(lambda m: m.contrib.schedule_free(m.adam(0.1, b1=0.0), 0.1, b1=0.9)),
    # RMSProp and AdaGrad
    "rmsprop": _c(lambda m: m.rmsprop(0.1)),
    "rmsprop_centered_momentum": _c(lambda m: m.rmsprop(0.1, centered=True, momentum=0.9, nesterov=True)),
    "rmsprop_bias_correction": _c(lambda m: m.rmsprop(0.1, centered=True, bias_correction=True, eps_in_sqrt=False, decay=0.5, initial_scale=0.1)),
    "scale_by_rms": _c(lambda m: m.chain(m.scale_by_rms(decay=0.8), m.scale(-0.1))),
    "scale_by_stddev": _c(lambda m: m.chain(m.scale_by_stddev(decay=0.8), m.scale(-0.1))),
    "adagrad": _c(lambda m: m.adagrad(0.1)),
    "adagrad_from_zero": _c(lambda m: m.adagrad(0.1, initial_accumulator_value=0.0, eps=0.0)),
    "scale_by_rss": _c(lambda m: m.chain(m.scale_by_rss(), m.scale(-0.1))),
    # Adafactor: factored |g|^2 moments (a complex momentum dtype: optax drops the imaginary part of a real one)
    "adafactor": _c(lambda m: m.adafactor(0.1, min_dim_size_to_factor=2, momentum=0.9, weight_decay_rate=1e-3, dtype_momentum=complex128(m))),
    "scale_by_factored_rms": _c(lambda m: m.chain(m.scale_by_factored_rms(min_dim_size_to_factor=2, decay_rate=0.5), m.scale(-0.1))),
    # signs: x / |x| for a complex x (numpy's and JAX's sign)
    "sign_sgd": _c(lambda m: m.sign_sgd(0.1)),
    "signum": _c(lambda m: m.signum(0.1, beta=0.8)),
    "scale_by_sign": _c(lambda m: m.chain(m.scale_by_sign(), m.scale(-0.1))),
    "lion": _c(lambda m: m.lion(0.1, weight_decay=0.1)),
    "scale_by_lion_smooth": _c(lambda m: m.chain(m.scale_by_lion(mode="smooth", smooth_beta=2.0), m.scale(-0.1))),
    "scale_by_lion_refined": _c(lambda m: m.chain(m.scale_by_lion(mode="refined"), m.scale(-0.1))),
    # norms and trust ratios: moduli
    "clip_by_global_norm": _c(lambda m: m.chain(m.clip_by_global_norm(1.0), m.sgd(0.1))),
    "clip_by_block_rms": _c(lambda m: m.chain(m.clip_by_block_rms(0.5), m.sgd(0.1))),
    "adaptive_grad_clip": _c(lambda m: m.chain(m.masked(m.adaptive_grad_clip(0.1, axis=-1), {"w": True, "b": True, "s": False}), m.sgd(0.1))),
    "scale_by_trust_ratio": _c(lambda m: m.chain(m.scale_by_trust_ratio(min_norm=0.5, trust_coefficient=0.3, eps=0.1), m.scale(-0.1))),
    "lars": _c(lambda m: m.lars(0.1, weight_decay=0.1, nesterov=True)),
    "fromage": _c(lambda m: m.fromage(0.1)),
    "scale_by_param_block_norm": _c(lambda m: m.chain(m.scale_by_param_block_norm(), m.scale(-0.1))),
    "scale_by_param_block_rms": _c(lambda m: m.chain(m.scale_by_param_block_rms(min_scale=0.5), m.scale(-0.1))),
    "normalize_by_update_norm": _c(lambda m: m.chain(m.normalize_by_update_norm(0.5), m.scale(-0.1))),
    "normalize": _c(lambda m: m.chain(m.contrib.normalize(), m.sgd(0.1))),
    "dog": _c(lambda m: m.contrib.dog(init_step=("heuristic", 1e-2), weight_decay=0.1)),
    "scale_by_dog": _c(
        lambda m: m.chain(m.contrib.scale_by_dog(("learning_rate", 0.1)), m.scale(-1.0)),
        reference=lambda m: m.contrib.dog(1.0, init_step=("learning_rate", 0.1)),
    ),
    "dowg": _c(lambda m: m.contrib.dowg(init_estim_sq_dist=1e-2, weight_decay=0.1)),
    "scale_by_dowg": _c(lambda m: m.chain(m.contrib.scale_by_dowg(), m.scale(-1.0)), reference=lambda m: m.contrib.dowg(1.0)),
    # Muon: Newton-Schulz with X X^H
    "muon": _c(lambda m: m.contrib.muon(0.1)),
    "muon_adaptive": _c(lambda m: m.contrib.muon(0.1, nesterov=False, adaptive=True, consistent_rms=0.2, weight_decay=0.1)),
    "muon_aol": _c(lambda m: m.contrib.muon(0.1, preconditioning="aol")),
    # combinators over complex-capable members
    "chain": _c(lambda m: m.chain(m.clip_by_global_norm(2.0), m.adam(0.1))),
    "named_chain": _c(lambda m: m.named_chain(("clip", m.clip_by_global_norm(2.0)), ("adam", m.adam(0.1)))),
    "masked": _c(lambda m: m.masked(m.adam(0.1), {"w": True, "b": False, "s": True})),
    "partition": _c(lambda m: m.partition({"a": m.lion(0.1), "s": m.sgd(0.1, 0.9)}, {"w": "s", "b": "a", "s": "a"})),
    "multi_transform": _c(lambda m: m.multi_transform({"a": m.adam(0.1), "z": m.set_to_zero()}, {"w": "a", "b": "z", "s": "a"})),
    "freeze": _c(lambda m: m.chain(m.freeze({"w": False, "b": True, "s": False}), m.adam(0.1))),
    "selective_transform": _c(lambda m: m.selective_transform(m.adam(0.1), freeze_mask={"w": False, "b": True, "s": True})),
    "flatten": _c(lambda m: m.flatten(m.adam(0.1))),
    "apply_every": _c(lambda m: m.chain(m.apply_every(2), m.sgd(0.1))),
    "conditionally_transform": _c(lambda m: m.conditionally_transform(m.adam(0.1), lambda step: step % 2 == 0)),
    "conditionally_mask": _c(lambda m: m.conditionally_mask(m.adam(0.1), lambda step: step % 2 == 0)),
    "lookahead": _c(lambda m: m.lookahead(m.adam(0.1), 2, 0.5), "lookahead"),
    "inject_hyperparams": _c(lambda m: m.inject_hyperparams(m.adam)(learning_rate=m.linear_schedule(0.1, 0.01, 2), b1=0.8)),
    "inject_stateful_hyperparams": _c(lambda m: m.inject_stateful_hyperparams(m.adamw)(learning_rate=m.linear_schedule(0.1, 0.01, 2), weight_decay=0.1)),
    "monitor": _c(lambda m: m.chain(m.monitor({"norm": m.global_norm, "ema": m.measure_with_ema(m.global_norm, 0.8)}), m.adam(0.1))),
    "snapshot": _c(lambda m: m.chain(m.adam(0.1), m.snapshot("norm", m.global_norm))),
    "with_extra_args_support": _c(lambda m: m.with_extra_args_support(m.scale_by_adam())),
    "split_real_and_imaginary": _c(lambda m: m.contrib.split_real_and_imaginary(m.adam(0.1))),
    # the accumulator holds complex gradients: a real accumulator_dtype is read as a precision in
    # gradtx (float32: complex64), where optax drops the imaginary part; complex128 in both here
    "MultiSteps": _c(lambda m: _multisteps(m, m.adam(0.1), 2)),
    "MultiSteps_sum": _c(lambda m: _multisteps(m, m.sgd(0.1, 0.9), 2, use_grad_mean=False)),
    "skip_not_finite": _c(lambda m: _multisteps(m, m.adam(0.1), 1, should_skip_update_fn=m.skip_not_finite)),
    # optax's apply_if_finite cannot run on complex updates (its cond's branches differ in type);
    # on finite gradients it is the inner optimizer
    "apply_if_finite": _c(lambda m: m.apply_if_finite(m.adam(0.1), 2), reference=lambda m: m.adam(0.1)),
    # the objective's gradient at each step, with value=, grad=, value_fn=
    "lbfgs": _c(lambda m: m.lbfgs(), "objective"),
    "lbfgs_fixed_step": _c(lambda m: m.lbfgs(0.1, linesearch=None), "objective"),
    "scale_by_lbfgs": _c(lambda m: m.chain(m.scale_by_lbfgs(memory_size=2), m.scale(-0.1)), "objective"),
    "scale_by_zoom_linesearch": _c(lambda m: m.chain(m.sgd(1.0), m.scale_by_zoom_linesearch(10, initial_guess_strategy="one")), "objective"),
    "polyak_sgd": _c(lambda m: m.polyak_sgd(max_learning_rate=0.5, f_min=0.5), "objective"),
    "scale_by_polyak": _c(lambda m: m.chain(m.scale_by_polyak(max_learning_rate=0.5), m.scale(-1.0)), "objective"),
    "reduce_on_plateau": _c(lambda m: m.chain(m.adam(0.1), m.contrib.reduce_on_plateau(factor=0.5, patience=0)), "objective"),
    "sam": _c(lambda m: m.contrib.sam(m.sgd(0.1, 0.9), m.chain(m.contrib.normalize(), m.sgd(0.05)), sync_period=2, opaque_mode=True), "grad_fn"),
}

# init refuses complex params (TypeError naming a leaf): ordered comparisons, or a complex g * g
# where a modulus is meant (optax either fails on complex numbers there or computes that product).
REFUSED: dict[str, Callable[[Any], Any]] = {
    "stochastic_rounding": lambda m: m.chain(m.sgd(0.1), m.stochastic_rounding(0)),
    "kahan_summation": lambda m: m.chain(m.sgd(0.1), m.kahan_summation()),
    "master_weights": lambda m: m.master_weights(m.sgd(0.1)),
    "clip_by_value": lambda m: m.clip_by_value(1.0),
    "clip": lambda m: m.clip(1.0),
    "keep_params_nonnegative": lambda m: m.chain(m.sgd(0.1), m.keep_params_nonnegative()),
    "rprop": lambda m: m.rprop(0.1),
    "scale_by_rprop": lambda m: m.scale_by_rprop(0.1),
    "sm3": lambda m: m.sm3(0.1),
    "scale_by_sm3": lambda m: m.scale_by_sm3(),
    "adadelta": lambda m: m.adadelta(1.0),
    "scale_by_adadelta": lambda m: m.scale_by_adadelta(),
    "scale_by_distance_over_gradients": lambda m: m.scale_by_distance_over_gradients(),
    "adopt": lambda m: m.contrib.adopt(0.1),
    "scale_by_adopt": lambda m: m.contrib.scale_by_adopt(),
    "simplified_ademamix": lambda m: m.contrib.simplified_ademamix(0.1),
    "scale_by_simplified_ademamix": lambda m: m.contrib.scale_by_simplified_ademamix(),
    "madgrad": lambda m: m.contrib.madgrad(0.1),
    "scale_by_madgrad": lambda m: m.contrib.scale_by_madgrad(0.1),
    "prodigy": lambda m: m.contrib.prodigy(),
    "dadapt_adamw": lambda m: m.contrib.dadapt_adamw(),
    "cocob": lambda m: m.contrib.cocob(),
    "scale_by_cocob": lambda m: m.contrib.scale_by_cocob(),
    "mechanize": lambda m: m.contrib.mechanize(m.adam(0.1)),
    "momo": lambda m: m.contrib.momo(),
    "momo_adam": lambda m: m.contrib.momo_adam(),
    "galore": lambda m: m.contrib.galore(0.1),
    "scale_by_galore": lambda m: m.contrib.scale_by_galore(),
    "sophia": lambda m: m.contrib.sophia(0.1),
    "hutchinson_estimator_diag_hessian": lambda m: m.contrib.hutchinson_estimator_diag_hessian(),
}

# complex behaviour tested on its own, in the test named
ELSEWHERE = {
    "quantize_state": "test_quantize_state_keeps_complex_moments_as_its_inner_transformation_does",
    "observe": "test_observe_keeps_the_inner_numbers_and_measures_complex_leaves_by_moduli",
    "scale_by_backtracking_linesearch": "test_complex_least_squares_converges_like_its_real_equivalent (optax's slope there is not the conjugated one its zoom search takes)",
    "value_and_grad_from_state": "test_complex_least_squares_converges_like_its_real_equivalent",
    "from_torch": "test_from_torch_keeps_torch_numbers_on_complex_params",
    "wrap": "test_wrap_keeps_torch_numbers_on_complex_params",
    "per_example_global_norm_clip": "test_per_example_clips_use_moduli",
    "per_example_layer_norm_clip": "test_per_example_clips_use_moduli",
    "dpsgd": "test_per_example_clips_use_moduli",
    "differentially_private_aggregate": "test_per_example_clips_use_moduli",
    "unitwise_norm": "test_unitwise_norm_axis_matches_optax",
    "skip_large_updates": "test_skip_large_updates_measures_moduli (optax squares complex entries there)",
    "scale_by_muon": "test_complex_params_give_optax_numbers (the muon cases: the alias runs it on the matrix leaves; optax's cannot run on a tree with vectors)",
}


def value_and_grad(m: Any, f: Callable[[dict], Any]) -> Callable[[dict], tuple[Any, dict]]:
    """``params -> (f(params), gradient)`` in library ``m``, the gradient in torch's convention
    (JAX's is conjugated to it)."""
    if is_gradtx(m):
        from gradtx.transforms.linesearch import value_and_grad as torch_value_and_grad

        return torch_value_and_grad(f)
    import jax

    def fn(params: dict) -> tuple[Any, dict]:
        value, grad = jax.value_and_grad(f)(params)
        return value, jax.tree.map(lambda g: g.conj(), grad)

    return fn


def run(m: Any, tx: Any, kind: str, *, steps: int = STEPS, **update_kwargs: Any) -> dict:
    """The params after ``steps`` updates of ``tx`` from ``PARAMS`` (see the module docstring for
    ``kind``; ``"lookahead"``: the params are a ``LookaheadParams`` pair, returned as
    ``{"fast.w": ..., "slow.w": ..., ...}``)."""
    params = tree(m, PARAMS)
    if kind == "lookahead":
        params = m.LookaheadParams(fast=params, slow=tree(m, PARAMS))
    state = tx.init(params)
    f = objective(m)
    vg = value_and_grad(m, f)
    for i in range(steps):
        extra: dict = {}
        if kind in ("updates", "lookahead"):
            grad = tree(m, GRADS[i % len(GRADS)])
        else:
            value, grad = vg(params)
            extra = {"value": value, "grad": grad, "value_fn": f}
            if kind == "grad_fn":
                extra = {"grad_fn": lambda p, j: vg(p)[1]}
            grad = {k: g + 0 for k, g in grad.items()}  # the updates may be donated: grad= stays as it was
        updates, state = tx.update(grad, state, params, **extra, **update_kwargs)
        params = m.apply_updates(params, updates)
    if kind == "lookahead":
        return {f"{part}.{k}": v for part in ("fast", "slow") for k, v in getattr(params, part).items()}
    return params
