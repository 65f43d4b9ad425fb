"""gradtx against real optax, number for number: every optimizer and transform, 8 steps, both paths.

Not part of the tests (they must not need JAX): run with the benchmark environment's interpreter,
``/path/to/benchenv/bin/python benchmarks/optax_agreement.py [--float64]``. Prints the largest
relative difference of the final parameters per case (relative to ``|optax| + 1e-6``).

In float64 every case agrees to about 1e-8 or better. In float32 most agree to a few 1e-6; RAdam
differs by ~3e-5 because optax computes its ``rho_t`` in float32, where the early steps lose three
digits to cancellation (gradtx uses float64 and agrees with torch.optim.RAdam to 1e-10), and
centered RMSProp with bias correction by ~3e-5, its variance ``nu_hat - mu_hat^2`` being a difference
of nearly equal numbers (gradtx scales by ``1 / bc`` where optax divides by ``bc``).

The catalogue's names (``CATALOGUE`` below) run only where the installed optax has them. In float64
they agree to about 1e-15 except: Adafactor (~2e-7), whose decay rate optax computes in float32;
the one-cycle schedules (~4e-7), which gradtx evaluates in float32 for a tensor step count, as all
its schedules. ``sm3`` runs on the leaves with a dimension (optax keeps no accumulator for a 0-d leaf).

gradtx.contrib's names are listed as ``"contrib.<name>"``. In float64 they agree to about 1e-15,
except MADGRAD (~5e-8), where optax takes ``sqrt(count + 1)`` of an int32 count in float32 even
under x64. In float32, ADOPT without clipping (~8e-5), AdEMAMix with schedules (~5e-4), simplified
AdEMAMix and ACProp (~1e-5) differ on elements near zero because optax forms ``1 - b2`` (``b2 =
0.9999``) and ``b ** t`` in float32: against a float64 run from the same float32 inputs, gradtx's
float32 result is within 4e-6 and optax's within 5e-4. ``--only TEXT`` runs the cases whose name
contains TEXT.

The learning-rate-free ones (Prodigy, D-Adaptation, DoG, DoWG, COCOB, Mechanic) and
MoMo (given ``value=``, a fixed sequence of losses) agree to ~1e-14 in float64; in float32 D-Adaptation AdamW (~1e-5) and Mechanic over Adam (~2e-5) differ most, because optax computes
``1 - b2^t`` in float32, where it loses digits to cancellation (gradtx uses float64: computing it in
float32 brings D-Adaptation to ~2e-6; Mechanic over SGD with momentum agrees to ~2e-6).

GaLore agrees to ~5e-7 in float64 (optax takes its SVD in float32 even under x64; gradtx in the
gradient's dtype if wider) and ~2e-6 in float32, but only where both SVDs pick the same signs for
the singular vectors: nothing fixes them, and the base optimizer's state carries over a refresh, so
a sign flip at a refresh changes the trajectory. JAX's and torch's CPU SVDs of the same float32
matrix choose opposite signs for some left singular vectors of tall matrices (for wide ones they
agree): ``galore_left`` with ``update_proj_gap=2`` (refreshes at steps 0, 2, 4, 6) differs by 0.25,
and is therefore run with one refresh, where the signs cancel (``P f(P^T G)`` is invariant under
``P -> -P`` for an odd base optimizer such as Adam or Lion).

Muon (every
preconditioning, the "dion" preset, adaptive, consistent RMS) agrees to ~2e-15 in float64 and
~1.6e-6 in float32.

optax.contrib's names that take the objective (``sophia``, ``hutchinson_estimator_diag_hessian``,
``reduce_on_plateau``, ``sam`` in opaque mode) run on a separable objective's gradients (``EXTRA_CASES``):
there Hutchinson's ``z * (H z)`` is the exact Hessian diagonal for any Rademacher probe, so the
randomized estimators agree number for number although JAX and torch draw different probes.
"""

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))

parser = argparse.ArgumentParser()
parser.add_argument("--float64", action="store_true")
parser.add_argument("--only", default="", help="run only the cases whose name contains this text")
ARGS = parser.parse_args()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
import torch  # noqa: E402

import gradtx as gtx  # noqa: E402
import gradtx.contrib  # noqa: E402,F401 - gtx.contrib for the catalogue's contrib names
from gradtx.base import apply_updates  # noqa: E402

jax.config.update("jax_platforms", "cpu")
if ARGS.float64:
    jax.config.update("jax_enable_x64", True)
DTYPE = np.float64 if ARGS.float64 else np.float32


rng = np.random.default_rng(0)
shapes = {"w": (5, 7), "b": (7,), "s": ()}
params0 = {k: rng.standard_normal(s).astype(DTYPE) for k, s in shapes.items()}
grads = [{k: rng.standard_normal(s).astype(DTYPE) for k, s in shapes.items()} for _ in range(8)]


values = np.random.default_rng(1).uniform(1.0, 2.0, len(grads)).astype(DTYPE)  # losses, for value=


def run_optax(tx, with_value=False):
    p = {k: jnp.asarray(v) for k, v in params0.items()}
    state = tx.init(p)
    for g, value in zip(grads, values):
        extra = {"value": jnp.asarray(value)} if with_value else {}
        updates, state = tx.update({k: jnp.asarray(v) for k, v in g.items()}, state, p, **extra)
        p = optax.apply_updates(p, updates)
    return {k: np.asarray(v) for k, v in p.items()}


def run_gtx(tx, inplace, with_value=False):
    p = {k: torch.tensor(v) for k, v in params0.items()}
    state = tx.init(p)
    for g, value in zip(grads, values):
        extra = {"value": torch.tensor(value)} if with_value else {}
        updates, state = tx.update({k: torch.tensor(v) for k, v in g.items()}, state, p, inplace=inplace, **extra)
        p = apply_updates(p, updates)
    return {k: v.numpy() for k, v in p.items()}


sched_o, sched_t = optax.linear_schedule(1e-2, 1e-3, 5), gtx.linear_schedule(1e-2, 1e-3, 5)
cases = {
 "sgd": (optax.sgd(0.1), gtx.sgd(0.1)),
 "sgd_mom": (optax.sgd(0.1, 0.9), gtx.sgd(0.1, 0.9)),
 "sgd_nest": (optax.sgd(0.1, 0.9, True), gtx.sgd(0.1, 0.9, True)),
 "sgd_sched": (optax.sgd(sched_o, 0.9), gtx.sgd(sched_t, 0.9)),
 "adam": (optax.adam(1e-2), gtx.adam(1e-2)),
 "adam_sched": (optax.adam(sched_o), gtx.adam(sched_t)),
 "adam_root": (optax.adam(1e-2, eps_root=1e-3), gtx.adam(1e-2, eps_root=1e-3)),
 "nadam": (optax.nadam(1e-2), gtx.nadam(1e-2)),
 "adamw": (optax.adamw(1e-2, weight_decay=0.1), gtx.adamw(1e-2, weight_decay=0.1)),
 "adamw_mask": (optax.adamw(1e-2, weight_decay=0.1, mask={"w": True, "b": False, "s": True}), gtx.adamw(1e-2, weight_decay=0.1, mask={"w": True, "b": False, "s": True})),
 "adamw_sched": (optax.adamw(sched_o, weight_decay=sched_o), gtx.adamw(sched_t, weight_decay=sched_t)),
 "nadamw": (optax.nadamw(1e-2, weight_decay=0.1), gtx.nadamw(1e-2, weight_decay=0.1)),
 "amsgrad": (optax.amsgrad(1e-2), gtx.amsgrad(1e-2)),
 "amsgrad_nobc": (optax.amsgrad(1e-2, bias_correction_nu=False, eps_root=1e-4), gtx.amsgrad(1e-2, bias_correction_nu=False, eps_root=1e-4)),
 "adamax": (optax.adamax(1e-2), gtx.adamax(1e-2)),
 "radam": (optax.radam(1e-2), gtx.radam(1e-2)),
 "radam_nest": (optax.radam(1e-2, nesterov=True), gtx.radam(1e-2, nesterov=True)),
 "adabelief": (optax.adabelief(1e-2), gtx.adabelief(1e-2)),
 "adabelief_nest": (optax.adabelief(1e-2, nesterov=True), gtx.adabelief(1e-2, nesterov=True)),
 "lamb": (optax.lamb(1e-2, weight_decay=0.1), gtx.lamb(1e-2, weight_decay=0.1)),
 "lars": (optax.lars(1e-1, weight_decay=0.1), gtx.lars(1e-1, weight_decay=0.1)),
 "lars_nest": (optax.lars(1e-1, nesterov=True, trust_coefficient=0.5, eps=0.1), gtx.lars(1e-1, nesterov=True, trust_coefficient=0.5, eps=0.1)),
 "lion": (optax.lion(1e-2, weight_decay=0.1), gtx.lion(1e-2, weight_decay=0.1)),
 "rmsprop": (optax.rmsprop(1e-2), gtx.rmsprop(1e-2)),
 "rmsprop_out": (optax.rmsprop(1e-2, eps_in_sqrt=False, initial_scale=0.1), gtx.rmsprop(1e-2, eps_in_sqrt=False, initial_scale=0.1)),
 "rmsprop_c_m": (optax.rmsprop(1e-2, centered=True, momentum=0.9, nesterov=True), gtx.rmsprop(1e-2, centered=True, momentum=0.9, nesterov=True)),
 "rmsprop_bc": (optax.rmsprop(1e-2, bias_correction=True), gtx.rmsprop(1e-2, bias_correction=True)),
 "rmsprop_c_bc": (optax.rmsprop(1e-2, centered=True, bias_correction=True, eps_in_sqrt=False, decay=0.5, initial_scale=0.1), gtx.rmsprop(1e-2, centered=True, bias_correction=True, eps_in_sqrt=False, decay=0.5, initial_scale=0.1)),
 "adagrad": (optax.adagrad(1e-1), gtx.adagrad(1e-1)),
 "adagrad0": (optax.adagrad(1e-1, initial_accumulator_value=0.0), gtx.adagrad(1e-1, initial_accumulator_value=0.0)),
 "ema": (optax.ema(0.9), gtx.ema(0.9)),
 "ema_nodebias": (optax.ema(0.9, debias=False), gtx.ema(0.9, debias=False)),
 "trust": (optax.chain(optax.scale_by_trust_ratio(min_norm=0.5, trust_coefficient=0.3, eps=0.1), optax.scale(-0.1)), gtx.chain(gtx.scale_by_trust_ratio(min_norm=0.5, trust_coefficient=0.3, eps=0.1), gtx.scale(-0.1))),
 "lion_smooth": (optax.chain(optax.scale_by_lion(mode="smooth", smooth_beta=2.0), optax.scale(-0.01)), gtx.chain(gtx.scale_by_lion(mode="smooth", smooth_beta=2.0), gtx.scale(-0.01))),
 "lion_refined": (optax.chain(optax.scale_by_lion(mode="refined"), optax.scale(-0.01)), gtx.chain(gtx.scale_by_lion(mode="refined"), gtx.scale(-0.01))),
 "centralize": (optax.chain(optax.centralize(), optax.scale(-0.1)), gtx.chain(gtx.centralize(), gtx.scale(-0.1))),
}
# The catalogue's names, each run only where the installed optax has it.
CATALOGUE = {
 "sign_sgd": ("sign_sgd", lambda m: m.sign_sgd(0.1)),
 "signum": ("signum", lambda m: m.signum(0.1, beta=0.8)),
 "adadelta": ("adadelta", lambda m: m.adadelta(1.0, weight_decay=0.1)),
 "adadelta_norate": ("adadelta", lambda m: m.adadelta(rho=0.8, eps=1e-4)),
 "yogi": ("yogi", lambda m: m.yogi(1e-2)),
 "scale_by_yogi": ("scale_by_yogi", lambda m: m.chain(m.scale_by_yogi(b1=0.5, eps_root=1e-3, initial_accumulator_value=0.1), m.scale(-0.01))),
 "rprop": ("rprop", lambda m: m.rprop(1e-2)),
 "adan": ("adan", lambda m: m.adan(1e-2, weight_decay=0.1)),
 "scale_by_adan": ("scale_by_adan", lambda m: m.chain(m.scale_by_adan(b1=0.7, b2=0.6, b3=0.8, eps_root=1e-4), m.scale(-0.01))),
 "novograd": ("novograd", lambda m: m.novograd(1e-2, weight_decay=0.1)),
 "optimistic_gd": ("optimistic_gradient_descent", lambda m: m.optimistic_gradient_descent(1e-2, alpha=0.5, beta=0.8)),
 "optimistic_adam": ("optimistic_adam", lambda m: m.optimistic_adam(1e-2, optimism=0.02)),
 "optimistic_adam_v2": ("optimistic_adam_v2", lambda m: m.optimistic_adam_v2(1e-2, alpha=0.5, beta=0.8)),
 "adamaxw": ("adamaxw", lambda m: m.adamaxw(1e-2, weight_decay=0.1)),
 "fromage": ("fromage", lambda m: m.fromage(1e-2)),
 "param_block_norm": ("scale_by_param_block_norm", lambda m: m.chain(m.scale_by_param_block_norm(), m.scale(-0.01))),
 "param_block_rms": ("scale_by_param_block_rms", lambda m: m.chain(m.scale_by_param_block_rms(min_scale=0.5), m.scale(-0.01))),
 "normalize_update": ("normalize_by_update_norm", lambda m: m.chain(m.normalize_by_update_norm(0.5), m.scale(-0.01))),
 "nonnegative": ("keep_params_nonnegative", lambda m: m.chain(m.scale(-0.5), m.keep_params_nonnegative())),
 "sgd_onecycle_cos": ("cosine_onecycle_schedule", lambda m: m.sgd(m.cosine_onecycle_schedule(6, 0.1, pct_start=0.3))),
 "sgd_onecycle_lin": ("linear_onecycle_schedule", lambda m: m.sgd(m.linear_onecycle_schedule(6, 0.1))),
 "sgd_warmup_exp": ("warmup_exponential_decay_schedule", lambda m: m.sgd(m.warmup_exponential_decay_schedule(0.0, 0.1, 2, 3, 0.5, staircase=True))),
 "adafactor": ("adafactor", lambda m: m.adafactor()),
 "adafactor_fact": ("adafactor", lambda m: m.adafactor(1e-2, min_dim_size_to_factor=2, momentum=0.9, weight_decay_rate=1e-3)),
 "factored_rms": ("scale_by_factored_rms", lambda m: m.chain(m.scale_by_factored_rms(min_dim_size_to_factor=5, decay_rate=0.5), m.scale(-0.01))),
 "sm3": ("sm3", lambda m: m.masked(m.sm3(1e-2), {"w": True, "b": True, "s": False})),  # optax's sm3 has no 0-d accumulator
 "apply_every": ("apply_every", lambda m: m.chain(m.apply_every(3), m.sgd(0.1))),
 "cond_transform": ("conditionally_transform", lambda m: m.conditionally_transform(m.adam(1e-2), lambda step: step % 3 != 1)),
 "cond_mask": ("conditionally_mask", lambda m: m.conditionally_mask(m.adam(1e-2), lambda step: step % 3 != 1)),
 "flatten": ("flatten", lambda m: m.flatten(m.adam(1e-2))),
 "dog": ("scale_by_distance_over_gradients", lambda m: m.chain(m.scale_by_distance_over_gradients(reps_rel=1e-2, global_scale=-1.0))),
 # optax.contrib: learning-rate free
 "prodigy": ("contrib.prodigy", lambda m: m.contrib.prodigy(1.0, estim_lr0=1e-2, weight_decay=0.1)),
 "prodigy_safeguard": ("contrib.prodigy", lambda m: m.contrib.prodigy(0.5, beta3=0.9, estim_lr0=1e-2, safeguard_warmup=True)),
 "dadapt_adamw": ("contrib.dadapt_adamw", lambda m: m.contrib.dadapt_adamw(1.0, estim_lr0=1e-2, weight_decay=0.1)),
 "contrib_dog": ("contrib.dog", lambda m: m.contrib.dog(init_step=("heuristic", 1e-2), weight_decay=0.1)),
 "contrib_dog_lr": ("contrib.dog", lambda m: m.contrib.dog(0.5, init_step=("learning_rate", 0.1))),
 "dowg": ("contrib.dowg", lambda m: m.contrib.dowg(init_estim_sq_dist=1e-2, weight_decay=0.1)),
 "cocob": ("contrib.cocob", lambda m: m.contrib.cocob(weight_decay=0.1)),
 "mechanize": ("contrib.mechanize", lambda m: m.contrib.mechanize(m.adam(1.0), s_init=1e-2)),
 # optax.contrib: MoMo (given value=, the loss)
 "momo": ("contrib.momo", lambda m: m.contrib.momo(0.5, weight_decay=0.1)),
 "momo_adapt_lb": ("contrib.momo", lambda m: m.contrib.momo(0.5, lower_bound=0.5, adapt_lower_bound=True)),
 "momo_adam": ("contrib.momo_adam", lambda m: m.contrib.momo_adam(0.1, weight_decay=0.1)),
 "momo_adam_adapt_lb": ("contrib.momo_adam", lambda m: m.contrib.momo_adam(0.1, lower_bound=0.5, adapt_lower_bound=True)),
 "sf_sgd": ("contrib.schedule_free_sgd", lambda m: m.contrib.schedule_free_sgd(0.1, weight_decay=0.1)),
 "sf_sgd_warmup": ("contrib.schedule_free_sgd", lambda m: m.contrib.schedule_free_sgd(0.1, warmup_steps=3, b1=0.8)),
 "sf_adamw": ("contrib.schedule_free_adamw", lambda m: m.contrib.schedule_free_adamw(1e-2, weight_decay=0.1)),
 "sf_adamw_warmup": ("contrib.schedule_free_adamw", lambda m: m.contrib.schedule_free_adamw(1e-2, warmup_steps=3, weight_lr_power=1.0)),
 "sf_adam_b1_0": ("contrib.schedule_free", lambda m: m.contrib.schedule_free(m.adam(m.linear_schedule(1e-2, 1e-3, 5), b1=0.0), m.linear_schedule(1e-2, 1e-3, 5), b1=0.95)),
 "adopt": ("contrib.adopt", lambda m: m.contrib.adopt(1e-2)),
 "adopt_nesterov": ("contrib.adopt", lambda m: m.contrib.adopt(m.linear_schedule(1e-2, 1e-3, 5), b2=0.9, nesterov=True)),
 "adopt_noclip": ("contrib.adopt", lambda m: m.contrib.adopt(1e-2, use_clipping=False)),
 "ademamix": ("contrib.ademamix", lambda m: m.contrib.ademamix(1e-2, b3=0.99, weight_decay=0.1)),
 "ademamix_sched": ("contrib.ademamix", lambda m: m.contrib.ademamix(1e-2, b3=m.linear_schedule(0.9, 0.999, 5), alpha=m.linear_schedule(0.0, 5.0, 5), eps_root=1e-8)),
 "simplified_ademamix": ("contrib.simplified_ademamix", lambda m: m.contrib.simplified_ademamix(1e-2, b1=0.9, alpha=2.0, weight_decay=0.1)),
 "simpl_ademamix_sch": ("contrib.simplified_ademamix", lambda m: m.contrib.simplified_ademamix(m.linear_schedule(1e-2, 1e-3, 5), alpha=m.linear_schedule(0.0, 2.0, 5))),
 "madgrad": ("contrib.madgrad", lambda m: m.contrib.madgrad(1e-2, weight_decay=0.1)),
 "madgrad_sched": ("contrib.madgrad", lambda m: m.contrib.madgrad(m.linear_schedule(1e-2, 1e-3, 5), momentum=0.5)),
 "acprop": ("contrib.acprop", lambda m: m.contrib.acprop(1e-2, weight_decay=0.1)),
 "acprop_sched": ("contrib.acprop", lambda m: m.contrib.acprop(m.linear_schedule(1e-2, 1e-3, 5), b2=0.9, eps=1e-8)),
 # "w" is 5 x 7: a right projector; the projector is refreshed (an SVD) at steps 0, gap, 2 gap, ...
 "galore": ("contrib.galore", lambda m: m.contrib.galore(1e-2, rank=2, update_proj_gap=3)),
 "galore_wd_scale": ("contrib.galore", lambda m: m.contrib.galore(1e-2, rank=3, update_proj_gap=4, scale=0.5, weight_decay=0.1)),
 # a left projector (w seen as 7 x 5), refreshed once only: see the module docstring for why
 "galore_left": ("contrib.galore", lambda m: m.contrib.galore(1e-2, rank=2, update_proj_gap=8, weight_dimension_numbers={"w": m.contrib.GaLoreDimensionNumbers(1, 0), "b": None, "s": None})),
 "galore_lion": ("contrib.galore", lambda m: m.contrib.galore(1e-2, rank=2, update_proj_gap=5, base_optimizer=m.scale_by_lion())),
 "galore_full_rank": ("contrib.galore", lambda m: m.chain(m.contrib.scale_by_galore(update_proj_gap=8, base_optimizer=m.scale_by_rms()), m.scale(-0.01))),
 "muon": ("contrib.muon", lambda m: m.contrib.muon(1e-2)),
 "muon_plain": ("contrib.muon", lambda m: m.contrib.muon(1e-2, nesterov=False, beta=0.8, weight_decay=0.1)),
 "muon_adaptive": ("contrib.muon", lambda m: m.contrib.muon(1e-2, adaptive=True, consistent_rms=0.2, adam_learning_rate=3e-3)),
 "muon_dion": ("contrib.muon", lambda m: m.contrib.muon(1e-2, ns_coeffs="dion")),
 "muon_spectral": ("contrib.muon", lambda m: m.contrib.muon(1e-2, preconditioning="spectral", ns_steps=3)),
 "muon_aol": ("contrib.muon", lambda m: m.contrib.muon(1e-2, preconditioning="aol")),
 "muon_schatten": ("contrib.muon", lambda m: m.contrib.muon(1e-2, preconditioning="schatten")),
}
WITH_VALUE = {"momo", "momo_adapt_lb", "momo_adam", "momo_adam_adapt_lb"}  # cases whose update takes value=


def _has(module, dotted):
    for part in dotted.split("."):
        if not hasattr(module, part):
            return False
        module = getattr(module, part)
    return True


for _name, (_attr, _make) in CATALOGUE.items():
    if _has(optax, _attr) and _has(gtx, _attr):
        cases[_name] = (_make(optax), _make(gtx))
    else:
        print(f"{_name:16s} skipped: {_attr} missing from optax or gradtx")
cases = {name: pair for name, pair in cases.items() if ARGS.only in name}
worst = 0
for name, (o, t) in cases.items():
    ref = run_optax(o, name in WITH_VALUE)
    for inplace in (False, True):
        try:
            got = run_gtx(t, inplace, name in WITH_VALUE)
        except Exception as e:  # noqa: BLE001 - report and go on
            print(f"{name:16s} inplace={inplace!s:5s} ERROR {e!r}")
            continue
        err = max(float(np.max(np.abs(got[k] - ref[k]) / (np.abs(ref[k]) + 1e-6))) for k in ref)
        worst = max(worst, err)
        print(f"{name:16s} inplace={inplace!s:5s} max rel err {err:.2e}" + ("  <-- above 1e-5" if err > 1e-5 else ""))
if hasattr(optax, "lookahead"):  # its params and updates are (fast, slow) pairs
    def run_lookahead(module, tx, to, back, inplace=None):
        p = to(params0)
        pair = module.LookaheadParams(fast=p, slow=p)
        state = tx.init(pair)
        for g in grads:
            kwargs = {} if inplace is None else {"inplace": inplace}
            updates, state = tx.update(to(g), state, pair, **kwargs)
            pair = module.apply_updates(pair, updates)
        return back(pair.fast), back(pair.slow)

    to_jax = lambda t: {k: jnp.asarray(v) for k, v in t.items()}  # noqa: E731
    to_torch = lambda t: {k: torch.tensor(v) for k, v in t.items()}  # noqa: E731
    ref = run_lookahead(optax, optax.lookahead(optax.adam(1e-2), 3, 0.5, reset_state=True), to_jax, lambda t: {k: np.asarray(v) for k, v in t.items()})
    for inplace in (False, True):
        got = run_lookahead(gtx, gtx.lookahead(gtx.adam(1e-2), 3, 0.5, reset_state=True), to_torch, lambda t: {k: v.numpy() for k, v in t.items()}, inplace)
        err = max(float(np.max(np.abs(a[k] - b[k]) / (np.abs(b[k]) + 1e-6))) for a, b in zip(got, ref) for k in b)
        worst = max(worst, err)
        print(f"{'lookahead':16s} inplace={inplace!s:5s} max rel err {err:.2e}" + ("  <-- above 1e-5" if err > 1e-5 else ""))


# Transformations that take the objective (extra arguments) or complex updates: the gradients are
# the objective's at the current params. The objective is separable, so Hutchinson's estimate
# z * (H z) is the exact Hessian diagonal whatever the probes: optax's JAX keys and gradtx's torch
# generator draw different probes, and these cases still compare number for number.
weights = {k: 1.0 + i for i, k in enumerate(sorted(shapes))}
targets = {k: rng.standard_normal(s).astype(DTYPE) for k, s in shapes.items()}
values = [3.0, 2.0, 2.5, 2.4, 2.6, 2.2, 2.3, 2.3]  # reduce_on_plateau's monitored values


def objective(target, p):
    return sum((weights[k] * (p[k] - target[k]) ** 2 + 0.1 * p[k] ** 4).sum() for k in sorted(p))


def run_extra(module, tx, extra, to, back, grad, params=params0, updates_given=None, inplace=None):
    p = to(params)
    state = tx.init(p)
    for i in range(8):
        g = to(updates_given[i]) if updates_given is not None else grad(p)
        kwargs = {} if inplace is None else {"inplace": inplace}
        updates, state = tx.update(g, state, p, **extra(i), **kwargs)
        p = module.apply_updates(p, updates)
    return back(p)


to_jax = lambda t: {k: jnp.asarray(v) for k, v in t.items()}  # noqa: E731
to_torch = lambda t: {k: torch.tensor(v) for k, v in t.items()}  # noqa: E731
from_jax = lambda t: {k: np.asarray(v) for k, v in t.items()}  # noqa: E731
from_torch = lambda t: {k: v.detach().numpy() for k, v in t.items()}  # noqa: E731
jax_f = lambda p: objective(to_jax(targets), p)  # noqa: E731
torch_f = lambda p: objective(to_torch(targets), p)  # noqa: E731
jax_grad, torch_grad = jax.grad(jax_f), torch.func.grad(torch_f)
complex_params = {k: (rng.standard_normal(s) + 1j * rng.standard_normal(s)).astype(np.complex128 if ARGS.float64 else np.complex64) for k, s in shapes.items()}
complex_grads = [{k: (rng.standard_normal(s) + 1j * rng.standard_normal(s)).astype(complex_params[k].dtype) for k, s in shapes.items()} for _ in range(8)]
EXTRA_CASES = {
    # name: (optax module path, factory of module, extra arguments of step i for (optax, gradtx), kwargs)
    "sophia": ("contrib.sophia", lambda m: m.contrib.sophia(1e-2, b2=0.5, update_interval=2, gamma=1.0, clip_threshold=5.0), (lambda i: {"obj_fn": jax_f}, lambda i: {"obj_fn": torch_f}), {}),
    "sophia_noclip": ("contrib.sophia", lambda m: m.contrib.sophia(1e-2, b2=0.5, update_interval=1, gamma=2.0, eps=0.5, clip_threshold=None, weight_decay=0.1), (lambda i: {"obj_fn": jax_f}, lambda i: {"value_fn": torch_f}), {}),
    "hutchinson": ("contrib.hutchinson_estimator_diag_hessian", lambda m: m.chain(m.contrib.hutchinson_estimator_diag_hessian(), m.scale(-1e-2)), (lambda i: {"obj_fn": jax_f}, lambda i: {"obj_fn": torch_f}), {}),
    "reduce_on_plateau": ("contrib.reduce_on_plateau", lambda m: m.chain(m.sgd(1e-2), m.contrib.reduce_on_plateau(factor=0.5, patience=2, cooldown=1)), (lambda i: {"value": values[i]}, lambda i: {"value": values[i]}), {}),
    "reduce_on_plateau_acc": ("contrib.reduce_on_plateau", lambda m: m.chain(m.adam(1e-2), m.contrib.reduce_on_plateau(factor=0.5, patience=1, accumulation_size=2, rtol=0.0, atol=0.05)), (lambda i: {"value": values[i]}, lambda i: {"value": values[i]}), {}),
    "sam_opaque": ("contrib.sam", lambda m: m.contrib.sam(m.sgd(1e-2, 0.9), m.chain(m.contrib.normalize(), m.sgd(0.05)), sync_period=3, opaque_mode=True), (lambda i: {"grad_fn": lambda p, j: jax_grad(p)}, lambda i: {"grad_fn": lambda p, j: torch_grad(p)}), {}),
    "split_real_imag": ("contrib.split_real_and_imaginary", lambda m: m.contrib.split_real_and_imaginary(m.adam(1e-2)), (lambda i: {}, lambda i: {}), {"params": complex_params, "updates_given": complex_grads}),
}
for name, (attr, make, (extra_o, extra_t), kw) in EXTRA_CASES.items():
    if _resolve(optax, attr) is None or _resolve(gtx, attr) is None:
        print(f"{name:16s} skipped: {attr} missing from optax or gradtx")
        continue
    ref = run_extra(optax, make(optax), extra_o, to_jax, from_jax, jax_grad, **kw)
    for inplace in (False, True):
        try:
            got = run_extra(gtx, make(gtx), extra_t, to_torch, from_torch, torch_grad, inplace=inplace, **kw)
        except Exception as e:  # noqa: BLE001 - report and go on
            print(f"{name:16s} inplace={inplace!s:5s} ERROR {e!r}")
            continue
        err = max(float(np.max(np.abs(got[k] - ref[k]) / (np.abs(ref[k]) + 1e-6))) for k in ref)
        worst = max(worst, err)
        print(f"{name:16s} inplace={inplace!s:5s} max rel err {err:.2e}" + ("  <-- above 1e-5" if err > 1e-5 else ""))
# ---- optax's top-level helpers that are not transformations (moments, tree_map_params, linear
# algebra, multi_normal, microbatch): each gradtx result against optax's on the same numbers.
def _helper_cases():
    r = np.random.default_rng(1)
    j = lambda t: jax.tree.map(jnp.asarray, t)  # noqa: E731
    t = lambda tr: {k: torch.tensor(v) for k, v in tr.items()}  # noqa: E731
    g, m = grads[0], grads[1]
    yield "update_moment", optax.update_moment(j(g), j(m), 0.9, 2), gtx.update_moment(t(g), t(m), 0.9, 2)
    yield "update_moment_pen", optax.update_moment_per_elem_norm(j(g), j(m), 0.9, 3), gtx.update_moment_per_elem_norm(t(g), t(m), 0.9, 3)
    yield "update_inf_moment", optax.update_infinity_moment(j(g), j(m), 0.9, 1e-3), gtx.update_infinity_moment(t(g), t(m), 0.9, 1e-3)
    yield "bias_correction", optax.bias_correction(j(m), 0.9, jnp.asarray(3)), gtx.bias_correction(t(m), 0.9, torch.tensor(3))
    so, st = optax.adam(1e-2).init(j(params0)), gtx.adam(1e-2).init(t(params0))
    so = optax.adam(1e-2).update(j(g), so, j(params0))[1]
    st = gtx.adam(1e-2).update(t(g), st, t(params0))[1]
    yield "tree_map_params", optax.tree_map_params(optax.adam(1e-2), lambda x: 2 * x + 1, so)[0].nu, gtx.tree_map_params(gtx.adam(1e-2), lambda x: 2 * x + 1, st)[0].nu
    a = r.standard_normal((6, 6)).astype(DTYPE)
    spd = (a @ a.T / 6 + 0.5 * np.eye(6)).astype(DTYPE)
    yield "power_iteration", optax.power_iteration(jnp.asarray(spd), num_iters=500)[0], gtx.power_iteration(torch.tensor(spd), num_iters=500)[0]
    for p in (2, 4, 3):  # p=3: optax raises its iterate to the 4th power (nearest unrolled power of two)
        yield f"inv_pth_root_p{p}", optax.matrix_inverse_pth_root(jnp.asarray(spd), p)[0], gtx.matrix_inverse_pth_root(torch.tensor(spd), p)[0]
    loc, log_scale, x = (r.standard_normal(s).astype(DTYPE) for s in ((3,), (3,), (5, 3)))
    yield "multi_normal_logp", optax.multi_normal(jnp.asarray(loc), jnp.asarray(log_scale)).log_prob(jnp.asarray(x)), gtx.multi_normal(torch.tensor(loc), torch.tensor(log_scale)).log_prob(torch.tensor(x))
    w, xs = r.standard_normal(4).astype(DTYPE), r.standard_normal((12, 4)).astype(DTYPE)
    fun = lambda w, x: (x @ w, (x @ w).sum(), (x @ w).mean(), (x @ w).mean())  # noqa: E731
    kinds = lambda mb: (mb.AccumulationType.CONCAT, mb.AccumulationType.SUM, mb.AccumulationType.MEAN, mb.AccumulationType.RUNNING_MEAN)  # noqa: E731
    yield "microbatch", optax.microbatch(fun, 1, 3, kinds(optax.microbatching))(jnp.asarray(w), jnp.asarray(xs)), gtx.microbatch(fun, 1, 3, kinds(gtx.microbatching))(torch.tensor(w), torch.tensor(xs))
    sq = lambda w, x: (x @ w) ** 2  # noqa: E731
    yield "micro_vmap", optax.microbatching.micro_vmap(sq, (None, 0), microbatch_size=4)(jnp.asarray(w), jnp.asarray(xs)), gtx.microbatching.micro_vmap(sq, (None, 0), microbatch_size=4)(torch.tensor(w), torch.tensor(xs))
    ys = r.standard_normal(12).astype(DTYPE)
    lo, lt = (lambda w, x, y: ((x @ w - y) ** 2).mean()), (lambda w, x, y: ((x @ w - y) ** 2).mean())
    yield "micro_grad", optax.microbatching.micro_grad(lo, batch_argnums=(1, 2), microbatch_size=3, transform_fn=lambda g: g / jnp.maximum(1.0, jnp.linalg.norm(g)))(jnp.asarray(w), jnp.asarray(xs), jnp.asarray(ys)), gtx.microbatching.micro_grad(lt, batch_argnums=(1, 2), microbatch_size=3, transform_fn=lambda g: g / torch.clamp(torch.linalg.norm(g), min=1.0))(torch.tensor(w), torch.tensor(xs), torch.tensor(ys))


for _name, _ref, _got in _helper_cases():
    _ref = [np.asarray(v) for v in jax.tree.leaves(_ref)]
    _got = [v.detach().numpy() for v in gtx.tree.leaves(_got) if v is not None]  # None: an empty node in JAX
    _err = max(float(np.max(np.abs(a - b) / (np.abs(b) + 1e-6))) for a, b in zip(_got, _ref))
    if _name != "inv_pth_root_p3":
        worst = max(worst, _err)
    print(f"{_name:16s} max rel err {_err:.2e}" + ("  <-- above 1e-5" if _err > 1e-5 else ""))
# ---- end of the top-level helpers
print("worst", worst)
