"""gradtx against real optax, number for number: every optimizer and transform (8 steps, both paths),
the optimizers that take the objective through extra arguments, ``tree_utils`` and ``projections``.

Not part of the tests (they must not need JAX): run with the benchmark environment's interpreter,
``/path/to/benchenv/bin/python benchmarks/optax_agreement.py [--float64] [--sections a,b]``, the
sections being ``optimizers``, ``extra_args``, ``tree_utils``, ``projections`` and ``complex`` (all
by default).
Prints the largest relative difference per case (relative to ``|optax| + 1e-6``); a name missing
from either library, or a case optax itself cannot run, is printed as skipped. The run ends with
every public name of ``optax``, ``optax.tree_utils`` and ``optax.projections`` (not
``optax.contrib``) that gradtx also has and that no case exercised, so that coverage cannot drift
unnoticed: in a full run, every shared name of ``tree_utils`` and ``projections`` has a case, and
of the 192 shared top-level names only ``MaskedNode`` has none (gradtx marks a masked-out leaf
``None`` and never builds one); type aliases and ``typing.Protocol`` classes are listed apart. A
state class counts as covered when some case's final gradtx state holds an instance of it, under
every public name gradtx gives the class (``MultiTransformState`` is ``PartitionState``; optax's
per-transform names of an empty state, ``ClipState`` or ``ScaleState``, are ``EmptyState``).
Observed with optax 0.2.8 (jax on CPU) and torch 2.13:

**optimizers** (final params after 8 steps). In float64 every case agrees to about 1e-14 except
Adafactor (~2e-7; ``factored_rms`` ~5e-9), whose decay rate optax computes in float32, and the
schedules with a non-linear or piecewise shape (one-cycle ~4e-7, cosine decay ~3e-7, piecewise
constant and interpolated ~3e-7 and ~4e-7, SGDR ~2e-7, warmup cosine decay ~1.2e-6), which gradtx
evaluates in float32 for a tensor step count, as all its schedules. ``adaptive_grad_clip`` is
compared on the vector and scalar leaves by default (for a matrix, gradtx's units follow torch's
``(out, in)`` layout, dim 0, and optax's JAX's ``(in, out)``, the last dim, by design), and with
``axis=0`` on the matrix too (``agc_axis``). In
float32 most agree to a few 1e-6; RAdam (and ``scale_by_radam``) differs by ~3e-5 because
optax computes its ``rho_t`` in float32, where the early steps lose three digits to cancellation
(gradtx uses float64 and agrees with torch.optim.RAdam to 1e-10); centered RMSProp with bias
correction by ~3e-5, its variance ``nu_hat - mu_hat^2`` being a difference of nearly equal numbers
(gradtx scales by ``1 / bc`` where optax divides by ``bc``); ``param_block_norm`` (~3e-5),
``clip_block_rms`` (~1.4e-5) and ``cond_transform`` (~2e-5) differ by one or two float32 ulps of
their leaf's largest elements (1e-7 to 5e-7), which land on an element about 1e-3 times smaller.
``sm3`` runs on the leaves with a dimension (optax keeps no accumulator for a 0-d leaf).

Combinators, wrappers and the rest of the top-level API (the catalogue's second half, the helper
cases, the gradient and noise checks): ``clip_by_global_norm``, ``freeze``, ``selective_transform``,
``multi_transform`` and ``partition`` (labels as a tree and as a function), ``named_chain``,
``stateless``, ``stateless_with_tree_map`` (with the params: optax calls ``f(update, param)``),
``inject_hyperparams`` (schedules, ``static_args``) and ``inject_stateful_hyperparams``,
``monitor``/``measure_with_ema``/``snapshot``, ``scale_by_adam``, ``scale_by_schedule``,
``scale_by_sm3``, ``apply_if_finite`` and ``MultiSteps`` (mean and sum, ``skip_not_finite``,
``skip_large_updates``) on gradients with NaN and inf steps, ``add_noise``/``noisy_sgd`` with
``eta=0``; for the wrappers with counters or measurements the final state is compared whole
(injected hyperparams as float64: optax keeps a scheduled one in float32 even under x64, and its
state has ``hyperparams_states`` besides). ``global_norm``, ``incremental_update``,
``periodic_update``, ``safe_increment``/``safe_int32_increment`` (saturating at 2**31 - 1),
``safe_norm`` (ords, axes, rows below the floor, zero), ``safe_root_mean_squares``,
``WrappedSchedule``, ``per_example_global_norm_clip``, ``per_example_layer_norm_clip`` (uniform or
not) compare outputs; ``scale_gradient``, ``safe_norm`` and ``safe_root_mean_squares`` compare
gradients (``jax.grad`` against ``torch.autograd``, zero inputs included). ``add_noise`` and
``noisy_sgd`` draw different numbers (JAX keys, torch generators): besides ``eta=0``, each step's
noise on a 400 x 500 leaf must have mean 0 and standard deviation ``sqrt(eta / (t + 1) ** gamma)``
(times the learning rate for ``noisy_sgd``) within six standard errors, in both libraries. In
float64 all of these agree to 2e-14 except ``clip_by_global_norm`` when it clips (9.5e-8): gradtx
scales by ``max_norm / (norm + 1e-6)``, torch's ``clip_grad_norm_`` coefficient, where optax scales
by ``max_norm / norm``, so each clipped update is smaller by the factor ``norm / (norm + 1e-6)``,
1 - 1.4e-7 for the norm 7.0 of the first step (``clip_gnorm_coef`` prints the measured ratio,
equal to the prediction to 2e-16), 1 - 1.3e-7 to 1 - 1.6e-7 over the 8 steps; when it does not
clip they agree exactly. In float32 they agree to 6e-6 except ``per_example_layer_norm_clip`` with
``uniform=False`` (~1.6e-5): its output is a sum over the examples of terms of both signs, and the
difference sits on an element near zero; relative to the largest element both libraries are about
1e-7 from a float64 evaluation of the same float32 inputs. ``inject_stateful_hyperparams`` takes
stateless schedules only in gradtx (a ``WrappedSchedule``, a schedule with state of its own, is not
accepted), so its case uses a plain schedule.

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

**extra_args**: L-BFGS (with the zoom and the backtracking searches, ``value_fn`` keyword
arguments, ``value_and_grad_from_state``, a fixed step), the two line searches after ``sgd(1)``,
Polyak's step and ``with_extra_args_support``, 10 steps on an ill-conditioned logistic regression
written once for both libraries; the final params and every state field (step sizes, values,
gradients, evaluation counts, decrease and curvature errors, L-BFGS memories; each relative to its
largest magnitude) are compared. In float64: params to 1e-13, state fields to 1.4e-12 (the kept
gradient of ``zoom_keep``; the others to 1e-13). In float32: params to ~1e-5 except Adam under
``with_extra_args_support`` (6.5e-5); state fields to ~6e-6 except the L-BFGS cases (up to
9.6e-5), the zoom searches (1.4e-5) and Adam's moments (1.9e-5). Reasons, each checked against
a float64 run: Adam's float32 trajectory in optax is itself about 1e-4 from the float64 one,
gradtx's 3e-7 (without JAX's x64 mode
optax computes in float32 what gradtx computes in float64, likely its bias corrections, as in
``tree_bias_correction`` below). L-BFGS
amplifies float32 rounding through ``1 / <dy, ds>``: each float32 run is 1e-5 to 4e-5 from the
float64 trajectory, optax's as gradtx's. The largest state differences sit in the gradients kept
in the state: near the optimum a gradient component is a sum of terms of both signs about 1e3
times larger, which XLA and torch round differently (they agree to one ulp at the start). Past
float32's resolution of the objective the searches' accept/reject decisions compare values one
ulp apart and the two libraries part ways; the problem is conditioned so that 10 steps stay clear
of that. With ``inplace=True`` the updates given to ``update`` are donated (a transformation may
overwrite them, as ``sgd`` does), so the cases give a copy of the gradient there and the gradient
itself as ``grad=``: passing the same tensors as both lets ``chain(sgd(1), zoom)`` read a gradient
that ``sgd`` has already scaled (the final params then differ by 0.1).

**complex** (with ``--float64``: JAX computes complex128 only under x64): the cases of
``tests/complex_cases.py``, every transformation that takes complex params, on complex128 params for
three steps (six for RAdam), final params against optax's, pure and donated; and the names gradtx
refuses, each checked to raise a ``TypeError`` naming a leaf at ``init`` (optax's behaviour is printed
beside: it fails on most, and on the others squares complex numbers where a modulus is meant or
drops imaginary parts). ``--write-complex-reference tests/optax_complex_reference.py`` records optax's
numbers as the tests' constants. With optax 0.2.8 every case agrees to 2.4e-15 (most to 3e-16), except
the known differences of the real cases: ``clip_by_global_norm`` and the chains clipping with it
(1e-7, 5e-9), Adafactor and ``scale_by_factored_rms`` (3e-9, 3e-8). Where optax cannot run a name on
complex numbers, or gives other numbers than its own definition would (a real accumulator dtype
dropping the imaginary part), the case names an optax counterpart that does the same thing
(``apply_if_finite``: the inner optimizer on finite gradients; ``MultiSteps``: a complex128 accumulator).

**tree_utils**: every function on random nested trees (complex and integer ones where optax
takes them), states of ``chain(scale_by_adam(), scale_by_schedule(...))`` for the path functions.
Float64: to 2.3e-16 (most exactly equal); float32: to 4e-7, except
``tree_bias_correction(m, 0.999, 1)`` (1.3e-5), where optax rounds the Python ``decay`` to
float32 before ``1 - decay**count`` (a difference of nearly equal numbers) and gradtx computes it
in float64. ``tree_split_key_like`` and
``tree_unwrap_random_key_data`` are compared on structure only (keys are not numbers in common),
``tree_random_like`` on shapes, dtypes and sample mean and standard deviation only (random).

**projections**: all twelve on random trees and edge cases (inside the set, on its boundary,
ties, a zero vector, one element, scale 0, a large scale). Float64: to 1.4e-15; float32: to 4e-6
(simplex with scale 2.5). optax's ``projection_box`` takes scalar bounds, and
``projection_hypercube`` works, only for a single array (``jax.tree.map`` over a scalar prefix),
so those cases use one array.
"""

import argparse
import functools
import inspect
import os
import sys
import warnings

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))

parser = argparse.ArgumentParser()
parser.add_argument("--float64", action="store_true")
parser.add_argument("--only", default="", help="run only the cases whose name contains this text")
SECTIONS = ("optimizers", "extra_args", "tree_utils", "projections", "complex")
parser.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated subset of " + ", ".join(SECTIONS))
parser.add_argument("--write-complex-reference", default="", metavar="PATH",
                    help="with --float64 and the complex section: write optax's numbers for the tests' complex cases to PATH")
ARGS = parser.parse_args()
RUN = set(ARGS.sections.split(","))
if RUN - set(SECTIONS):
    parser.error(f"unknown sections {sorted(RUN - set(SECTIONS))}")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
import torch  # noqa: E402

import gradtx as _gradtx  # noqa: E402
import gradtx.projections as _gradtx_projections  # noqa: E402
import gradtx.tree_utils as _gradtx_tree_utils  # noqa: E402
import optax.projections as optax_projections  # noqa: E402
import optax.tree_utils as optax_tree_utils  # noqa: E402
import gradtx.contrib  # noqa: E402,F401 - gtx.contrib for the catalogue's contrib names
from gradtx.base import apply_updates  # noqa: E402


class _Recorder:
    """A module whose attribute reads are recorded: the names the cases below exercise."""

    def __init__(self, module):
        self._module, self.used = module, set()

    def __getattr__(self, name):
        value = getattr(self._module, name)
        self.used.add(name)
        return value


gtx = _Recorder(_gradtx)
gtu = _Recorder(_gradtx_tree_utils)
gpr = _Recorder(_gradtx_projections)


_STATE_NAMES = {}  # gradtx class -> its public names (an alias such as MultiTransformState = PartitionState too)
for _n in dir(_gradtx):
    if not _n.startswith("_") and isinstance(getattr(_gradtx, _n), type):
        _STATE_NAMES.setdefault(getattr(_gradtx, _n), []).append(_n)


def note_state_types(node):
    """Records the gradtx state classes (NamedTuples) met in a state: running a case covers them,
    under every public name gradtx gives the class (optax's per-transform names for an empty state,
    ``AdaptiveGradClipState`` or ``ScaleState``, are gradtx's ``EmptyState``)."""
    gtx.used.update(_STATE_NAMES.get(type(node), ()))
    if isinstance(node, tuple) and hasattr(node, "_fields"):
        children = list(node)
    elif isinstance(node, dict):
        children = list(node.values())
    elif isinstance(node, (tuple, list)):
        children = list(node)
    else:
        return
    for child in children:
        note_state_types(child)

warnings.filterwarnings("ignore", category=DeprecationWarning, message=".*optax.* is deprecated")
warnings.filterwarnings("ignore", category=DeprecationWarning, message="inject_stateful_hyperparams is deprecated")
jax.config.update("jax_platforms", "cpu")
if ARGS.float64:
    jax.config.update("jax_enable_x64", True)
DTYPE = np.float64 if ARGS.float64 else np.float32


rng = np.random.default_rng(0)
shapes = {"w": (5, 7), "b": (7,), "s": ()}
params0 = {k: rng.standard_normal(s).astype(DTYPE) for k, s in shapes.items()}
grads = [{k: rng.standard_normal(s).astype(DTYPE) for k, s in shapes.items()} for _ in range(8)]


values = np.random.default_rng(1).uniform(1.0, 2.0, len(grads)).astype(DTYPE)  # losses, for value=


def run_optax(tx, with_value=False, gs=grads):
    p = {k: jnp.asarray(v) for k, v in params0.items()}
    state = tx.init(p)
    for g, value in zip(gs, values):
        extra = {"value": jnp.asarray(value)} if with_value else {}
        updates, state = tx.update({k: jnp.asarray(v) for k, v in g.items()}, state, p, **extra)
        p = optax.apply_updates(p, updates)
    return {k: np.asarray(v) for k, v in p.items()}, state


def run_gtx(tx, inplace, with_value=False, gs=grads):
    p = {k: torch.tensor(v) for k, v in params0.items()}
    state = tx.init(p)
    for g, value in zip(gs, values):
        extra = {"value": torch.tensor(value)} if with_value else {}
        updates, state = tx.update({k: torch.tensor(v) for k, v in g.items()}, state, p, inplace=inplace, **extra)
        p = apply_updates(p, updates)
    note_state_types(state)
    return {k: v.numpy() for k, v in p.items()}, state


# ----------------------------------------------------------------------------- comparing outputs
# The sections below compare whole outputs (trees, numbers, dtypes, state fields), not only params.


def _key_name(entry):
    """A path entry of either library as a plain value: dict key, index, attribute, or 'Tuple.field'."""
    if hasattr(entry, "tuple_name") and hasattr(entry, "name"):
        return f"{entry.tuple_name}.{entry.name}"
    for attr in ("key", "idx", "name"):
        if hasattr(entry, attr) and type(entry).__module__.startswith("jax"):
            return getattr(entry, attr)
    return entry


def _is_dtype(x):
    return isinstance(x, (torch.dtype, np.dtype)) or (isinstance(x, type) and issubclass(x, np.generic))


def _dtype_name(x):
    return str(x).replace("torch.", "") if isinstance(x, torch.dtype) else np.dtype(x).name


def _as_numpy(x):
    if isinstance(x, torch.Tensor):
        x = x.detach()
        return x.numpy() if x.dtype != torch.bfloat16 else x.float().numpy()
    return np.asarray(x)


def _norm_out(out):
    """Any output as a flat list of numpy arrays and strings (dtypes, paths), in a common leaf order."""
    if isinstance(out, str):
        return [out]
    if _is_dtype(out):
        return [_dtype_name(out)]
    if isinstance(out, (torch.Generator,)) or type(out).__name__ == "PRNGKeyArray":
        return ["<key>"]
    if isinstance(out, list) and out and isinstance(out[0], tuple) and len(out[0]) == 2 and isinstance(out[0][0], tuple):
        flat = []  # a list of (path, value), as tree_get_all_with_path returns
        for path, value in out:
            flat.append("/".join(str(_key_name(e)) for e in path))
            flat.extend(_norm_out(value))
        return flat
    if isinstance(out, (torch.Tensor, jax.Array, np.ndarray, np.generic, bool, int, float, complex)):
        return [_as_numpy(out)]
    if out is None:
        return []
    if isinstance(out, tuple) and hasattr(out, "_fields"):
        return [v for child in out for v in _norm_out(child)]
    if isinstance(out, dict):
        return [v for k in sorted(out) for v in _norm_out(out[k])]
    if isinstance(out, (tuple, list)):
        return [v for child in out for v in _norm_out(child)]
    return [f"<{type(out).__name__}>"]


def _leaf_err(a, b, normwise=False):
    """Largest ``|a - b| / (|b| + 1e-6)`` (``normwise``: over ``max |b| + 1e-6``, the array's scale);
    equal values (inf, NaN included) count 0; inf where they cannot match."""
    if isinstance(a, str) or isinstance(b, str):
        return 0.0 if a == b else float("inf")
    if a.shape != b.shape:
        return float("inf")
    if a.dtype.kind != b.dtype.kind and not {a.dtype.kind, b.dtype.kind} <= {"i", "u"}:
        return float("inf")
    if a.dtype.kind in "fc" and a.dtype != b.dtype:
        return float("inf")
    if a.size == 0:
        return 0.0
    a64 = a.astype(np.complex128 if a.dtype.kind == "c" else np.float64)
    b64 = b.astype(np.complex128 if b.dtype.kind == "c" else np.float64)
    same = (a64 == b64) | (np.isnan(a64) & np.isnan(b64))
    with np.errstate(invalid="ignore"):
        scale = np.max(np.abs(np.where(np.isfinite(b64), b64, 0))) if normwise else np.abs(b64)
        rel = np.abs(a64 - b64) / (scale + 1e-6)
    rel = np.where(same, 0.0, np.where(np.isnan(rel), np.inf, rel))
    return float(np.max(rel))


def compare(got, ref):
    """Max relative error between two outputs (inf where structure, shape, dtype or a string differs)."""
    g, r = _norm_out(got), _norm_out(ref)
    if len(g) != len(r):
        return float("inf")
    return max([_leaf_err(a, b) for a, b in zip(g, r)], default=0.0)


def report(name, err, label=""):
    global worst
    worst = max(worst, err)
    print(f"{name:16s} {label:14s} max rel err {err:.2e}" + ("  <-- above 1e-5" if err > 1e-5 else ""))


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
 "clip": ("clip", lambda m: m.chain(m.clip(0.5), m.sgd(0.1))),
 "clip_block_rms": ("clip_by_block_rms", lambda m: m.chain(m.clip_by_block_rms(0.5), m.sgd(0.1))),
 "agc": ("adaptive_grad_clip", lambda m: m.chain(m.masked(m.adaptive_grad_clip(0.1), {"w": False, "b": True, "s": True}), m.sgd(0.1))),  # units of a matrix: torch's layout (out, in) in gradtx, jax's (in, out) in optax
 "agc_axis": ("adaptive_grad_clip", lambda m: m.chain(m.masked(m.adaptive_grad_clip(0.1, axis=0), {"w": True, "b": True, "s": False}), m.sgd(0.1))),  # axis=0: optax's units of the matrix, in both
 "trace": ("trace", lambda m: m.chain(m.trace(0.9, nesterov=True), m.scale(-0.1))),
 "add_decayed": ("add_decayed_weights", lambda m: m.chain(m.add_decayed_weights(0.1), m.sgd(0.1))),
 "scale_by_rms": ("scale_by_rms", lambda m: m.chain(m.scale_by_rms(decay=0.8), m.scale(-0.01))),
 "scale_by_stddev": ("scale_by_stddev", lambda m: m.chain(m.scale_by_stddev(decay=0.8), m.scale(-0.01))),
 "scale_by_rss": ("scale_by_rss", lambda m: m.chain(m.scale_by_rss(), m.scale(-0.1))),
 "scale_by_sign": ("scale_by_sign", lambda m: m.chain(m.scale_by_sign(), m.scale(-0.01))),
 "scale_by_adamax": ("scale_by_adamax", lambda m: m.chain(m.scale_by_adamax(b1=0.8), m.scale(-0.01))),
 "scale_by_amsgrad": ("scale_by_amsgrad", lambda m: m.chain(m.scale_by_amsgrad(b2=0.9), m.scale(-0.01))),
 "scale_by_belief": ("scale_by_belief", lambda m: m.chain(m.scale_by_belief(b1=0.8), m.scale(-0.01))),
 "scale_by_radam": ("scale_by_radam", lambda m: m.chain(m.scale_by_radam(b1=0.8), m.scale(-0.01))),
 "scale_by_novograd": ("scale_by_novograd", lambda m: m.chain(m.scale_by_novograd(b1=0.8), m.scale(-0.01))),
 "scale_by_adadelta": ("scale_by_adadelta", lambda m: m.chain(m.scale_by_adadelta(rho=0.8), m.scale(-1.0))),
 "scale_by_rprop": ("scale_by_rprop", lambda m: m.chain(m.scale_by_rprop(0.01), m.scale(-1.0))),
 "scale_by_optimistic": ("scale_by_optimistic_gradient", lambda m: m.chain(m.scale_by_optimistic_gradient(alpha=0.5, beta=0.8), m.scale(-0.01))),
 "scale_by_lr": ("scale_by_learning_rate", lambda m: m.chain(m.scale_by_learning_rate(m.exponential_decay(0.1, 2, 0.5)))),
 "set_to_zero": ("set_to_zero", lambda m: m.set_to_zero()),
 "identity": ("identity", lambda m: m.chain(m.identity(), m.sgd(0.1))),
 "zero_nans": ("zero_nans", lambda m: m.chain(m.zero_nans(), m.sgd(0.1))),
 "sgd_cosine": ("cosine_decay_schedule", lambda m: m.sgd(m.cosine_decay_schedule(0.1, 6, alpha=0.1, exponent=2.0))),
 "sgd_poly": ("polynomial_schedule", lambda m: m.sgd(m.polynomial_schedule(0.1, 0.01, 2.0, 5, transition_begin=1))),
 "sgd_piecewise": ("piecewise_constant_schedule", lambda m: m.sgd(m.piecewise_constant_schedule(0.1, {2: 0.5, 5: 0.1}))),
 "sgd_interp": ("piecewise_interpolate_schedule", lambda m: m.sgd(m.piecewise_interpolate_schedule("cosine", 0.1, {2: 0.5, 5: 0.1}))),
 "sgd_warm_cos": ("warmup_cosine_decay_schedule", lambda m: m.sgd(m.warmup_cosine_decay_schedule(0.0, 0.1, 2, 7, 0.01))),
 "sgd_warm_const": ("warmup_constant_schedule", lambda m: m.sgd(m.warmup_constant_schedule(0.0, 0.1, 3))),
 "sgd_sgdr": ("sgdr_schedule", lambda m: m.sgd(m.sgdr_schedule([{"init_value": 0.0, "peak_value": 0.1, "warmup_steps": 1, "decay_steps": 4, "end_value": 0.01}] * 2))),
 "sgd_join": ("join_schedules", lambda m: m.sgd(m.join_schedules([m.constant_schedule(0.1), m.linear_schedule(0.05, 0.0, 4)], [3]))),
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
 # combinators, wrappers and the remaining transformations
 "clip_gnorm": ("clip_by_global_norm", lambda m: m.chain(m.clip_by_global_norm(1.0), m.sgd(0.1))),  # clips every step (norms 6 to 8): see the module docstring
 "clip_gnorm_idle": ("clip_by_global_norm", lambda m: m.chain(m.clip_by_global_norm(100.0), m.sgd(0.1))),  # never clips
 "freeze": ("freeze", lambda m: m.chain(m.freeze({"w": False, "b": True, "s": False}), m.adam(1e-2))),
 "selective": ("selective_transform", lambda m: m.selective_transform(m.adam(1e-2), freeze_mask={"w": False, "b": True, "s": True})),
 "multi_transform": ("multi_transform", lambda m: m.multi_transform({"a": m.adam(1e-2), "s": m.sgd(0.1, 0.9)}, {"w": "a", "b": "s", "s": "a"})),
 "multi_transf_fn": ("multi_transform", lambda m: m.multi_transform({"a": m.adam(1e-2), "z": m.set_to_zero()}, lambda p: {k: "z" if k == "s" else "a" for k in p})),
 "partition": ("partition", lambda m: m.partition({"a": m.lion(1e-2), "s": m.sgd(0.1, 0.9, True)}, {"w": "s", "b": "a", "s": "a"})),
 "named_chain": ("named_chain", lambda m: m.named_chain(("clip", m.clip(0.5)), ("adam", m.adam(1e-2)))),
 "stateless": ("stateless", lambda m: m.chain(m.stateless(lambda u, p: {k: 0.5 * u[k] + 0.1 * p[k] for k in u}), m.sgd(0.1))),
 "stateless_tree_map": ("stateless_with_tree_map", lambda m: m.chain(m.stateless_with_tree_map(lambda g, p: 0.3 * g * g * g + 0.1 * p), m.sgd(0.1))),
 "inject_hyper": ("inject_hyperparams", lambda m: m.inject_hyperparams(m.adam)(learning_rate=m.linear_schedule(1e-2, 1e-3, 5), b1=0.8)),
 "inject_hyper_static": ("inject_hyperparams", lambda m: m.inject_hyperparams(m.sgd, static_args="nesterov")(0.1, momentum=m.linear_schedule(0.5, 0.9, 4), nesterov=True)),
 "inject_stateful": ("inject_stateful_hyperparams", lambda m: m.inject_stateful_hyperparams(m.sgd)(learning_rate=m.linear_schedule(0.1, 0.01, 4), momentum=0.9)),  # gradtx's takes stateless schedules only (no WrappedSchedule)
 "monitor": ("monitor", lambda m: m.chain(m.monitor({"norm": m.global_norm, "ema": m.measure_with_ema(m.global_norm, 0.8)}), m.sgd(0.1))),
 "measure_ema_nodeb": ("measure_with_ema", lambda m: m.chain(m.sgd(0.1), m.monitor({"ema": m.measure_with_ema(m.global_norm, 0.5, debias=False, accumulator_dtype=_dtype_of(m))}))),
 "snapshot": ("snapshot", lambda m: m.chain(m.sgd(0.1, 0.9), m.snapshot("norm", m.global_norm))),
 "scale_by_adam": ("scale_by_adam", lambda m: m.chain(m.scale_by_adam(b1=0.8, b2=0.9, eps_root=1e-4), m.scale(-0.01))),
 "scale_by_adam_nest": ("scale_by_adam", lambda m: m.chain(m.scale_by_adam(nesterov=True), m.scale(-0.01))),
 "scale_by_schedule": ("scale_by_schedule", lambda m: m.chain(m.scale_by_schedule(m.exponential_decay(0.1, 2, 0.5)), m.scale(-1.0))),
 "scale_by_sm3": ("scale_by_sm3", lambda m: m.masked(m.chain(m.scale_by_sm3(b1=0.5), m.scale(-0.01)), {"w": True, "b": True, "s": False})),
 "add_noise_eta0": ("add_noise", lambda m: m.chain(m.add_noise(0.0, 0.55, 0), m.sgd(0.1))),  # deterministic part only: random below
 "noisy_sgd_eta0": ("noisy_sgd", lambda m: m.noisy_sgd(0.1, eta=0.0, key=0)),
 "apply_if_finite": ("apply_if_finite", lambda m: m.apply_if_finite(m.adam(1e-2), 2)),  # NaN/inf steps 2, 3 and 6 skipped
 "multi_steps": ("MultiSteps", lambda m: m.MultiSteps(m.adam(1e-2), 3, accumulator_dtype=_dtype_of(m))),
 "multi_steps_sum": ("MultiSteps", lambda m: m.MultiSteps(m.sgd(0.1, 0.9), lambda step: 2, use_grad_mean=False, accumulator_dtype=_dtype_of(m)).gradient_transformation()),
 "multi_steps_large": ("skip_large_updates", lambda m: m.MultiSteps(m.adam(1e-2), 2, should_skip_update_fn=functools.partial(m.skip_large_updates, max_squared_norm=45.0), accumulator_dtype=_dtype_of(m))),  # steps 0, 4, 5 skipped
 "multi_steps_nan": ("skip_not_finite", lambda m: m.MultiSteps(m.adam(1e-2), 2, should_skip_update_fn=m.skip_not_finite, accumulator_dtype=_dtype_of(m))),  # NaN/inf steps skipped
}
if "optimizers" not in RUN:
    cases, CATALOGUE = {}, {}
WITH_VALUE = {"momo", "momo_adapt_lb", "momo_adam", "momo_adam_adapt_lb"}  # cases whose update takes value=
# Gradients with a NaN at step 2, an inf at step 3 and a NaN at step 6, for the wrappers that skip them.
grads_nan = [{k: v.copy() for k, v in g.items()} for g in grads]
grads_nan[2]["w"][1, 2], grads_nan[3]["b"][4], grads_nan[6]["s"] = np.nan, np.inf, np.asarray(np.nan, DTYPE)
NAN_CASES = {"apply_if_finite", "multi_steps_nan"}
def _injected(state):
    """An injected state's count, hyperparams (as float64: optax keeps a scheduled one in float32 even
    under x64) and inner state; optax's also has ``hyperparams_states``, gradtx's has not."""
    return state.count, {k: np.asarray(_as_numpy(v), np.float64) for k, v in state.hyperparams.items()}, state.inner_state


STATE_PART = {"inject_hyper": _injected, "inject_hyper_static": _injected, "inject_stateful": _injected}
# Cases whose final state is compared too (the measurements, counters and accumulators), whole.
STATE_CASES = {"monitor", "measure_ema_nodeb", "snapshot", "inject_hyper", "inject_hyper_static", "inject_stateful",
               "apply_if_finite", "multi_steps", "multi_steps_sum", "multi_steps_large", "multi_steps_nan", "scale_by_sm3", "partition", "named_chain"}


def _dtype_of(m):
    """The run's float dtype in the library of module ``m`` (accumulator_dtype= arguments)."""
    return jnp.dtype(DTYPE) if m is optax else (torch.float64 if ARGS.float64 else torch.float32)


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
# The classes: a GradientTransformation in optax is one in gradtx, and one that takes extra arguments
# in gradtx (GradientTransformationExtraArgs) does in optax. Not the converse: optax 0.2.8 makes
# every chain and alias a GradientTransformationExtraArgs; gradtx only those whose parts take some.
_kind_differs, _n_extra = [], 0
for name, (o, t) in cases.items():
    if isinstance(o, optax.GradientTransformation):
        _n_extra += isinstance(t, gtx.GradientTransformationExtraArgs)
        if not isinstance(t, gtx.GradientTransformation):
            _kind_differs.append(f"{name} (not a GradientTransformation)")
        elif isinstance(t, gtx.GradientTransformationExtraArgs) and not isinstance(o, optax.GradientTransformationExtraArgs):
            _kind_differs.append(f"{name} (ExtraArgs in gradtx only)")
    gs = grads_nan if name in NAN_CASES else grads
    ref, ref_state = run_optax(o, name in WITH_VALUE, gs)
    for inplace in (False, True):
        try:
            got, got_state = run_gtx(t, inplace, name in WITH_VALUE, gs)
        except Exception as e:  # noqa: BLE001 - report and go on
            print(f"{name:16s} inplace={inplace!s:5s} ERROR {e!r}")
            continue
        err = max(float(np.max(np.abs(got[k] - ref[k]) / (np.abs(ref[k]) + 1e-6))) for k in ref)
        state_note = ""
        if name in STATE_CASES:  # every array of the state, in the same leaf order (inf if the structures differ)
            part = STATE_PART.get(name, lambda state: state)
            err_state = compare(part(got_state), part(ref_state))
            state_note = f" (params {err:.1e}, state {err_state:.1e})"
            err = max(err, err_state)
        worst = max(worst, err)
        print(f"{name:16s} inplace={inplace!s:5s} max rel err {err:.2e}{state_note}" + ("  <-- above 1e-5" if err > 1e-5 else ""))
if cases:
    print(f"{'kinds':16s} GradientTransformation classes of {len(cases)} cases ({_n_extra} ExtraArgs in gradtx): "
          + (f"DIFFER for {len(_kind_differs)}: {', '.join(_kind_differs)}  <-- disagreement" if _kind_differs else "consistent"))
    if _kind_differs:
        worst = float("inf")
if hasattr(optax, "lookahead") and "optimizers" in RUN:  # its params and updates are (fast, slow) pairs
    def run_lookahead(module, tx, to, back, inplace=None):
        p = to(params0)
        pair = module.LookaheadParams(fast=p, slow=p)
        state = tx.init(pair)
        for g in grads:
            kwargs = {} if inplace is None else {"inplace": inplace}
            updates, state = tx.update(to(g), state, pair, **kwargs)
            pair = module.apply_updates(pair, updates)
        note_state_types(state)
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
    if not (_has(optax, attr) and _has(gtx, attr)):
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

    # tree helpers and numerics
    yield "global_norm", optax.global_norm(j(g)), gtx.global_norm(t(g))
    yield "incremental_update", optax.incremental_update(j(g), j(m), 0.3), gtx.incremental_update(t(g), t(m), 0.3)
    for step in (6, 7):  # a multiple of the period takes the new tensors, any other step keeps the old
        yield f"periodic_update_{step}", optax.periodic_update(j(g), j(m), jnp.asarray(step), 3), gtx.periodic_update(t(g), t(m), torch.tensor(step), 3)
    for c in (5, 2**31 - 1):  # saturates at int32's largest value
        yield f"safe_increment_{c}", optax.safe_increment(jnp.asarray(c, jnp.int32)), gtx.safe_increment(torch.tensor(c, dtype=torch.int32))
        yield f"safe_i32_incr_{c}", optax.safe_int32_increment(jnp.asarray(c, jnp.int32)), gtx.safe_int32_increment(torch.tensor(c, dtype=torch.int32))
    yield "safe_increment_f", optax.safe_increment(jnp.asarray(2.5, DTYPE)), gtx.safe_increment(torch.tensor(2.5, dtype=_dtype_of(gtx)))
    x, zero = g["w"], np.zeros((5, 7), DTYPE)
    for label, kw in (("", {}), ("_ord1_ax0", {"ord": 1, "axis": 0}), ("_inf_keep", {"ord": np.inf, "axis": 1, "keepdims": True}), ("_fro", {"ord": "fro"})):
        yield f"safe_norm{label}", optax.safe_norm(jnp.asarray(x), 0.5, **kw), gtx.safe_norm(torch.tensor(x), 0.5, **kw)
    yield "safe_norm_zero", optax.safe_norm(jnp.asarray(zero), 0.5, axis=1), gtx.safe_norm(torch.tensor(zero), 0.5, axis=1)
    yield "safe_norm_small", optax.safe_norm(jnp.asarray(0.01 * x), 0.5, axis=1), gtx.safe_norm(torch.tensor(0.01 * x), 0.5, axis=1)  # some rows below min_norm
    yield "safe_rms", optax.safe_root_mean_squares(jnp.asarray(x), 0.1), gtx.safe_root_mean_squares(torch.tensor(x), 0.1)
    yield "safe_rms_zero", optax.safe_root_mean_squares(jnp.asarray(zero), 0.1), gtx.safe_root_mean_squares(torch.tensor(zero), 0.1)
    ws_o, ws_t = optax.WrappedSchedule(optax.linear_schedule(0.1, 0.01, 4)), gtx.WrappedSchedule(gtx.linear_schedule(0.1, 0.01, 4))
    so_, st_, vo, vt = ws_o.init(), ws_t.init(), [], []
    for _ in range(6):  # its value at the state's count, then the count moves on
        vo.append(ws_o(so_)), vt.append(ws_t(st_))
        so_, st_ = ws_o.update(so_), ws_t.update(st_)
    yield "wrapped_schedule", [*vo, so_.count], [*vt, st_.count]
    # per-example clipping: a batch of 6 examples' gradients, two leaves, norms on both sides of the clip
    batch = [r.standard_normal((6, 5, 7)).astype(DTYPE) * np.asarray([0.1, 0.5, 1, 2, 4, 8], DTYPE)[:, None, None],
             r.standard_normal((6, 7)).astype(DTYPE)]
    yield "per_ex_global_clip", optax.per_example_global_norm_clip([jnp.asarray(b) for b in batch], 5.0), gtx.per_example_global_norm_clip([torch.tensor(b) for b in batch], 5.0)
    for uniform in (True, False):
        yield f"per_ex_layer_clip_{'u' if uniform else 'nu'}", optax.per_example_layer_norm_clip([jnp.asarray(b) for b in batch], 5.0, uniform), gtx.per_example_layer_norm_clip([torch.tensor(b) for b in batch], 5.0, uniform)


for _name, _ref, _got in _helper_cases():
    _ref = [np.asarray(v) for v in jax.tree.leaves(_ref)]
    _got = [v.detach().numpy() for v in gtx.tree.leaves(_got) if v is not None]  # None: an empty node in JAX
    _err = max(float(np.max(np.abs(a - b) / (np.abs(b) + 1e-6))) for a, b in zip(_got, _ref))
    if len(_got) != len(_ref) or any(a.shape != b.shape for a, b in zip(_got, _ref)):
        _err = float("inf")
    if _name != "inv_pth_root_p3":
        worst = max(worst, _err)
    print(f"{_name:16s} max rel err {_err:.2e}" + ("  <-- above 1e-5" if _err > 1e-5 else ""))
if "optimizers" in RUN:
    # init_empty_state: an empty state of the same name
    _eo, _et = optax.init_empty_state(params0), gtx.init_empty_state({k: torch.tensor(v) for k, v in params0.items()})
    report("init_empty_state", 0.0 if type(_eo).__name__ == type(_et).__name__ and len(_et) == len(_eo) == 0 else float("inf"), "(structure)")

    # clip_by_global_norm: gradtx scales by torch's clip_grad_norm_ coefficient max_norm / (norm + 1e-6),
    # optax by max_norm / norm (when norm > max_norm): one clipped step, their ratio against the
    # predicted norm / (norm + 1e-6), whose distance from 1 (1.3e-7 to 1.6e-7 here) the 8 steps carry.
    _g0 = grads[0]
    _n0 = float(np.sqrt(sum(float((v.astype(np.float64) ** 2).sum()) for v in _g0.values())))
    _uo = optax.clip_by_global_norm(1.0).update({k: jnp.asarray(v) for k, v in _g0.items()}, optax.EmptyState())[0]
    _ut = gtx.clip_by_global_norm(1.0).update({k: torch.tensor(v) for k, v in _g0.items()}, gtx.EmptyState())[0]
    _ratio = _as_numpy(_ut["w"]).astype(np.float64) / _as_numpy(_uo["w"]).astype(np.float64)
    _pred = _n0 / (_n0 + 1e-6)
    _err = float(np.max(np.abs(_ratio - _pred)))
    print(f"{'clip_gnorm_coef':16s} {'(one step)':14s} gradtx/optax update ratio - 1: {float(np.median(_ratio)) - 1:.2e}, "
          f"predicted -1e-6 / (norm + 1e-6) = {_pred - 1:.2e}, max deviation from it {_err:.1e}")
    # Gradients through scale_gradient (identity forward, gradient times scale), safe_norm and
    # safe_root_mean_squares (finite gradients where the norm is below its floor, 0 included):
    # jax.grad against torch.autograd on the same function, written once for both.
    def _grad_pair(fn, x):
        ref = jax.grad(lambda v: fn(optax, jnp, v))(jnp.asarray(x))
        v = torch.tensor(x, requires_grad=True)
        got, = torch.autograd.grad(fn(gtx, torch, v), v)
        return compare(got, ref)

    _x = grads[0]["w"]
    _half_zero = np.where(np.arange(5)[:, None] < 2, 0.0, _x).astype(DTYPE)  # two rows of zeros
    for _label, _fn, _arg in (
        ("scale_gradient", lambda m, xp, v: (xp.sin(m.scale_gradient({"a": v}, 0.3)["a"]) * v).sum(), _x),
        ("scale_grad_neg", lambda m, xp, v: (m.scale_gradient(v * v, -2.0) * v).sum(), _x),
        ("safe_norm_grad", lambda m, xp, v: (m.safe_norm(v, 1.0, axis=1) ** 2).sum(), _half_zero),
        ("safe_norm_grad0", lambda m, xp, v: m.safe_norm(v, 0.5), np.zeros_like(_x)),
        ("safe_rms_grad", lambda m, xp, v: m.safe_root_mean_squares(v, 1.5) + m.safe_root_mean_squares(v, 0.1), _x),
        ("safe_rms_grad0", lambda m, xp, v: m.safe_root_mean_squares(v, 0.1), np.zeros_like(_x)),
    ):
        report(_label, _grad_pair(_fn, _arg), "(gradient)")

    # add_noise and noisy_sgd are random (JAX keys and torch generators draw different numbers):
    # eta=0 above compares their deterministic part number for number; here, on zero gradients
    # (a 400 x 500 leaf), each step's noise must have mean 0 and the standard deviation
    # sqrt(eta / (step + 1) ** gamma) (noisy_sgd: times the learning rate), within six standard
    # errors, in both libraries.
    _zeros = np.zeros((400, 500), DTYPE)
    for _label, _make, _sd in (
        ("add_noise", lambda m: m.add_noise(0.3, 0.55, 0), lambda k: np.sqrt(0.3 / (k + 1) ** 0.55)),
        ("noisy_sgd", lambda m: m.noisy_sgd(0.1, eta=0.5, gamma=0.8, key=0), lambda k: 0.1 * np.sqrt(0.5 / (k + 1) ** 0.8)),
    ):
        _ok = True
        for _lib, _m, _to in (("optax", optax, jnp.asarray), ("gradtx", gtx, torch.tensor)):
            _tx = _make(_m)
            _state = _tx.init({"a": _to(_zeros)})
            for _k in range(4):
                _u, _state = _tx.update({"a": _to(_zeros)}, _state, {"a": _to(_zeros)})
                _a = _as_numpy(_u["a"]).astype(np.float64)
                _n = _a.size
                _ok &= abs(_a.mean()) <= 6 * _sd(_k) / np.sqrt(_n) and abs(_a.std() - _sd(_k)) <= 6 * _sd(_k) / np.sqrt(2 * _n)
            if _lib == "gradtx":
                note_state_types(_state)
        print(f"{_label + '_stats':16s} {_label:14s} noise mean/std per step {'within 6 standard errors of the law' if _ok else 'OUT OF RANGE'} in both (random: not compared number for number)"
              + ("" if _ok else "  <-- disagreement"))
        if not _ok:
            worst = float("inf")
# ---- end of the top-level helpers
# ----------------------------------------------------------------------------- extra arguments
# Optimizers that take the objective through update's extra arguments (value=, grad=, value_fn=):
# a regularised, ill-conditioned logistic regression, written once for jax.numpy and torch, 10 steps.
# Compared: the final params (elementwise, as above) and every state field both libraries keep
# (line-search step sizes, values, gradients, evaluation counts, decrease and curvature errors,
# L-BFGS memories), each relative to its largest magnitude: the memories hold differences of
# gradients and of params, whose smallest elements are at the rounding level of the largest.
print("--- extra arguments (value=, grad=, value_fn=) ---")
_X = (rng.standard_normal((30, 4)) * np.asarray([3.0, 1.0, 0.3, 0.1])).astype(DTYPE)  # ill-conditioned: 10 steps stay
# well above float32's resolution of the objective (past it, the searches' decisions are rounding)
_Y = np.sign(rng.standard_normal(30)).astype(DTYPE)
_p0 = {"w": (0.5 * rng.standard_normal(4)).astype(DTYPE), "b": np.asarray(0.3, dtype=DTYPE)}


def logistic_loss(xp, p, X, y):
    z = X @ p["w"] + p["b"]
    return xp.mean(xp.log1p(xp.exp(-y * z))) + 0.005 * xp.sum(p["w"] * p["w"])


def _jax_problem():
    X, y = jnp.asarray(_X), jnp.asarray(_Y)
    return (lambda p: logistic_loss(jnp, p, X, y)), (lambda p, X, y: logistic_loss(jnp, p, X, y)), X, y


def _torch_problem():
    X, y = torch.tensor(_X), torch.tensor(_Y)
    return (lambda p: logistic_loss(torch, p, X, y)), (lambda p, X, y: logistic_loss(torch, p, X, y)), X, y


def _torch_value_and_grad(fn):
    def vg(p):
        q = {k: v.detach().requires_grad_(True) for k, v in p.items()}
        value = fn(q)
        grads = torch.autograd.grad(value, list(q.values()))
        return value.detach(), {k: g for k, g in zip(q, grads)}

    return vg


def _state_fields(node, path=(), out=None):
    """Every array in a state, keyed by its path of NamedTuple field names and indices."""
    out = {} if out is None else out
    if isinstance(node, tuple) and hasattr(node, "_fields"):
        for field, child in zip(node._fields, node):
            _state_fields(child, (*path, field), out)
    elif isinstance(node, dict):
        for k in node:
            _state_fields(node[k], (*path, k), out)
    elif isinstance(node, (tuple, list)):
        for i, child in enumerate(node):
            _state_fields(child, (*path, i), out)
    elif node is not None:
        out["/".join(map(str, path))] = _as_numpy(node)
    return out


def run_objective(lib, make, mode, steps=10, inplace=None):
    """``steps`` updates on the logistic loss; ``mode`` says which extra arguments update takes."""
    m = optax if lib == "optax" else gtx
    fn, fn_kw, X, y = _jax_problem() if lib == "optax" else _torch_problem()
    to = (lambda a: jnp.asarray(a)) if lib == "optax" else (lambda a: torch.tensor(a))
    p = {k: to(v) for k, v in _p0.items()}
    tx = make(m)
    state = tx.init(p)
    value_and_grad = jax.value_and_grad(fn) if lib == "optax" else _torch_value_and_grad(fn)
    for _ in range(steps):
        if mode == "from_state":
            value, grad = m.value_and_grad_from_state(fn)(p, state=state)
        else:
            value, grad = value_and_grad(p)
        kwargs = {} if inplace is None else {"inplace": inplace}
        if mode in ("search", "from_state"):
            kwargs.update(value=value, grad=grad, value_fn=fn)
        elif mode == "search_kw":  # value_fn's own keyword arguments go through update
            kwargs.update(value=value, grad=grad, value_fn=fn_kw, X=X, y=y)
        elif mode == "value":
            kwargs.update(value=value)
        # inplace=True donates the updates' buffers: the chain may overwrite them (sgd scales them in
        # place), so the updates given must not be the very tensors passed as grad=, which the line
        # search reads after the earlier transformations ran
        donated = {k: v.clone() for k, v in grad.items()} if inplace else grad
        updates, state = tx.update(donated, state, p, **kwargs)
        p = m.apply_updates(p, updates)
    if lib != "optax":
        note_state_types(state)
    return {k: _as_numpy(v) for k, v in p.items()}, _state_fields(state)


EXTRA_ARGS = {  # name: (names it needs, factory over the module, mode)
 "lbfgs": (("lbfgs",), lambda m: m.lbfgs(), "search"),
 "lbfgs_kwargs": (("lbfgs",), lambda m: m.lbfgs(memory_size=3, scale_init_precond=False), "search_kw"),
 "lbfgs_from_state": (("lbfgs", "value_and_grad_from_state"), lambda m: m.lbfgs(), "from_state"),
 "lbfgs_fixed_lr": (("lbfgs",), lambda m: m.lbfgs(learning_rate=0.3, memory_size=4, linesearch=None), "none"),
 "lbfgs_backtrack": (("lbfgs", "scale_by_backtracking_linesearch"), lambda m: m.lbfgs(linesearch=m.scale_by_backtracking_linesearch(15, store_grad=True)), "from_state"),
 "scale_by_lbfgs": (("scale_by_lbfgs",), lambda m: m.chain(m.scale_by_lbfgs(memory_size=5), m.scale(-0.5)), "none"),
 "backtracking": (("scale_by_backtracking_linesearch",), lambda m: m.chain(m.sgd(1.0), m.scale_by_backtracking_linesearch(max_backtracking_steps=15, increase_factor=2.0)), "search"),
 "backtrack_grad": (("scale_by_backtracking_linesearch", "value_and_grad_from_state"), lambda m: m.chain(m.sgd(1.0), m.scale_by_backtracking_linesearch(15, decrease_factor=0.5, store_grad=True, atol=1e-3)), "from_state"),
 "zoom_keep": (("scale_by_zoom_linesearch",), lambda m: m.chain(m.sgd(1.0), m.scale_by_zoom_linesearch(max_linesearch_steps=15)), "search"),
 "zoom_one_maxlr": (("scale_by_zoom_linesearch",), lambda m: m.chain(m.sgd(1.0), m.scale_by_zoom_linesearch(15, max_learning_rate=2.0, initial_guess_strategy="one", approx_dec_rtol=None)), "search_kw"),
 "polyak_sgd": (("polyak_sgd",), lambda m: m.polyak_sgd(max_learning_rate=2.0), "value"),
 "polyak_sgd_plus": (("polyak_sgd",), lambda m: m.polyak_sgd(max_learning_rate=0.5, scaling=0.5, f_min=0.2, eps=1e-3, variant="sps+"), "value"),
 "scale_by_polyak": (("scale_by_polyak",), lambda m: m.chain(m.scale_by_polyak(f_min=0.1, max_learning_rate=3.0), m.scale(-1.0)), "value"),
 "extra_args_adam": (("with_extra_args_support",), lambda m: m.with_extra_args_support(m.adam(1e-1)), "value"),
 "extra_args_chain": (("with_extra_args_support", "scale_by_polyak"), lambda m: m.chain(m.with_extra_args_support(m.scale_by_adam()), m.scale_by_polyak(max_learning_rate=0.1), m.scale(-1.0)), "value"),
}
for name, (needs, make, mode) in (EXTRA_ARGS if "extra_args" in RUN else {}).items():
    missing = [n for n in needs if not hasattr(optax, n) or not hasattr(_gradtx, n)]
    if missing:
        print(f"{name:16s} skipped: {', '.join(missing)} missing from optax or gradtx")
        continue
    try:
        ref_p, ref_s = run_objective("optax", make, mode)
    except Exception as e:  # noqa: BLE001 - optax cannot run this case
        print(f"{name:16s} skipped: optax raises {e!r:.100}")
        continue
    for inplace in (False, True):
        try:
            got_p, got_s = run_objective("gradtx", make, mode, inplace=inplace)
        except Exception as e:  # noqa: BLE001 - report and go on
            print(f"{name:16s} inplace={inplace!s:5s} ERROR {e!r}")
            continue
        err_p = max(_leaf_err(got_p[k], ref_p[k]) for k in ref_p)
        common = sorted(set(ref_s) & set(got_s))
        field_errs = {k: _leaf_err(got_s[k], ref_s[k], normwise=True) for k in common}
        err_s, worst_field = max(((e, k) for k, e in field_errs.items()), default=(0.0, None))
        only = sorted(set(ref_s) ^ set(got_s))
        worst = max(worst, err_p, err_s)
        print(f"{name:16s} inplace={inplace!s:5s} max rel err {max(err_p, err_s):.2e} (params {err_p:.1e}, {len(common)} state fields {err_s:.1e}"
              + (f" at {worst_field})" if err_s > 0 else ")")
              + (f" fields in one library only: {only}" if only else "")
              + ("  <-- above 1e-5" if max(err_p, err_s) > 1e-5 else ""))


# ----------------------------------------------------------------------------- tree_utils
# Each function of optax.tree_utils on random trees (nested dicts and lists, a 0-d leaf), its
# output compared whole: values, shapes, dtypes, paths. Random keys and samples cannot match
# number for number: tree_split_key_like / tree_unwrap_random_key_data are compared on structure
# (which leaves get a key), tree_random_like on shapes, dtypes and sample statistics only.
print("--- tree_utils ---")
_shapes_t = {"a": (3, 4), "b": [(5,), ()], "c": {"d": (2, 1, 3)}}


def _random_tree(shapes, fn):
    if isinstance(shapes, dict):
        return {k: _random_tree(v, fn) for k, v in shapes.items()}
    if isinstance(shapes, list):
        return [_random_tree(v, fn) for v in shapes]
    return fn(shapes)


_np_trees = {
    "x": _random_tree(_shapes_t, lambda s: rng.standard_normal(s).astype(DTYPE)),
    "y": _random_tree(_shapes_t, lambda s: rng.standard_normal(s).astype(DTYPE)),
    "z": _random_tree(_shapes_t, lambda s: rng.standard_normal(s).astype(DTYPE)),
    "ypos": _random_tree(_shapes_t, lambda s: (np.abs(rng.standard_normal(s)) + 0.5).astype(DTYPE)),
    "c": _random_tree(_shapes_t, lambda s: (rng.standard_normal(s) + 1j * rng.standard_normal(s)).astype(np.complex128 if ARGS.float64 else np.complex64)),
    "c2": _random_tree(_shapes_t, lambda s: (rng.standard_normal(s) + 1j * rng.standard_normal(s)).astype(np.complex128 if ARGS.float64 else np.complex64)),
    "i": _random_tree(_shapes_t, lambda s: rng.integers(-5, 5, s).astype(np.int32)),
    "mixed": {"f": rng.standard_normal(3).astype(DTYPE), "h": rng.standard_normal(2).astype(np.float16), "i": np.arange(3, dtype=np.int32)},
}
_np_trees["x_near"] = jax.tree_util.tree_map(lambda v: (v * (1 + 1e-7)).astype(DTYPE), _np_trees["x"])


class _Side:
    """One library's view of the inputs: its tree_utils module, top-level module, arrays and dtypes."""

    def __init__(self, lib):
        self.lib = lib
        self.tu = optax_tree_utils if lib == "optax" else gtu
        self.m = optax if lib == "optax" else gtx
        self.arr = jnp.asarray if lib == "optax" else torch.tensor
        self.map = jax.tree_util.tree_map if lib == "optax" else (lambda f, t: _map_np(f, t))
        for k, v in _np_trees.items():
            setattr(self, k, self.map(self.arr, v))
        self.inf = jnp.inf if lib == "optax" else float("inf")
        params = {"w": self.arr(_np_trees["x"]["a"]), "b": self.arr(_np_trees["x"]["b"][0])}
        self.params = params
        self.opt = self.m.chain(self.m.scale_by_adam(), self.m.scale_by_schedule(lambda count: 0.1 * count))
        grads = {"w": self.arr(_np_trees["y"]["a"]), "b": self.arr(_np_trees["y"]["b"][0])}
        _, self.state = self.opt.update(grads, self.opt.init(params), params)
        self.count = self.arr(np.asarray(3, dtype=np.int32))
        self.scalar = self.arr(np.asarray(0.7, dtype=DTYPE))

    def dt(self, name):
        return jnp.dtype(name) if self.lib == "optax" else getattr(torch, name)

    def key(self, seed):
        return jax.random.PRNGKey(seed) if self.lib == "optax" else torch.Generator().manual_seed(seed)

    def in_adam(self, path, value):
        del value
        return any(getattr(e, "tuple_name", None) == "ScaleByAdamState" for e in path)


def _map_np(f, t):
    if isinstance(t, dict):
        return {k: _map_np(f, v) for k, v in t.items()}
    if isinstance(t, list):
        return [_map_np(f, v) for v in t]
    return f(t)


TREE_UTILS = {  # case: (name, fn(side) -> output)
 "add": ("tree_add", lambda s: s.tu.tree_add(s.x, s.y)),
 "add3": ("tree_add", lambda s: s.tu.tree_add(s.x, s.y, s.z)),
 "add_complex": ("tree_add", lambda s: s.tu.tree_add(s.c, s.c2)),
 "sub": ("tree_sub", lambda s: s.tu.tree_sub(s.x, s.y)),
 "mul": ("tree_mul", lambda s: s.tu.tree_mul(s.x, s.y)),
 "div": ("tree_div", lambda s: s.tu.tree_div(s.x, s.ypos)),
 "scale": ("tree_scale", lambda s: s.tu.tree_scale(0.3, s.x)),
 "scale_array": ("tree_scale", lambda s: s.tu.tree_scale(s.scalar, s.x)),
 "add_scale": ("tree_add_scale", lambda s: s.tu.tree_add_scale(s.x, -0.7, s.y)),
 "add_scale_arr": ("tree_add_scale", lambda s: s.tu.tree_add_scale(s.x, s.scalar, s.y)),
 "conj": ("tree_conj", lambda s: s.tu.tree_conj(s.c)),
 "conj_real": ("tree_conj", lambda s: s.tu.tree_conj(s.x)),
 "real": ("tree_real", lambda s: s.tu.tree_real(s.c)),
 "clip": ("tree_clip", lambda s: s.tu.tree_clip(s.x, -0.5, 0.7)),
 "clip_max": ("tree_clip", lambda s: s.tu.tree_clip(s.x, None, 0.2)),
 "clip_min": ("tree_clip", lambda s: s.tu.tree_clip(s.x, -0.1)),
 "where_true": ("tree_where", lambda s: s.tu.tree_where(True, s.x, s.y)),
 "where_array": ("tree_where", lambda s: s.tu.tree_where(s.arr(np.asarray(False)), s.x, s.y)),
 "sum": ("tree_sum", lambda s: s.tu.tree_sum(s.x)),
 "sum_assoc": ("tree_sum", lambda s: s.tu.tree_sum(s.x, associative_reduction=True)),
 "sum_int": ("tree_sum", lambda s: s.tu.tree_sum(s.i)),
 "max": ("tree_max", lambda s: s.tu.tree_max(s.x)),
 "min": ("tree_min", lambda s: s.tu.tree_min(s.x)),
 "size": ("tree_size", lambda s: s.tu.tree_size(s.x)),
 "vdot": ("tree_vdot", lambda s: s.tu.tree_vdot(s.x, s.y)),
 "vdot_complex": ("tree_vdot", lambda s: s.tu.tree_vdot(s.c, s.c2)),
 "norm": ("tree_norm", lambda s: s.tu.tree_norm(s.x)),
 "norm_sq": ("tree_norm", lambda s: s.tu.tree_norm(s.x, squared=True)),
 "norm_l1": ("tree_norm", lambda s: s.tu.tree_norm(s.x, ord=1)),
 "norm_l1_sq": ("tree_norm", lambda s: s.tu.tree_norm(s.x, ord=1, squared=True)),
 "norm_inf": ("tree_norm", lambda s: s.tu.tree_norm(s.x, ord=s.inf)),
 "norm_inf_str": ("tree_norm", lambda s: s.tu.tree_norm(s.x, ord="inf")),
 "norm_complex": ("tree_norm", lambda s: s.tu.tree_norm(s.c)),
 "allclose_yes": ("tree_allclose", lambda s: s.tu.tree_allclose(s.x, s.x_near)),
 "allclose_no": ("tree_allclose", lambda s: s.tu.tree_allclose(s.x, s.y)),
 "allclose_tol": ("tree_allclose", lambda s: s.tu.tree_allclose(s.x, s.tu.tree_scale(1.01, s.x), rtol=0.02, atol=0.0)),
 "zeros_like": ("tree_zeros_like", lambda s: s.tu.tree_zeros_like(s.x)),
 "zeros_like_int": ("tree_zeros_like", lambda s: s.tu.tree_zeros_like(s.x, dtype=s.dt("int32"))),
 "ones_like": ("tree_ones_like", lambda s: s.tu.tree_ones_like(s.x)),
 "ones_like_f16": ("tree_ones_like", lambda s: s.tu.tree_ones_like(s.x, dtype=s.dt("float16"))),
 "full_like": ("tree_full_like", lambda s: s.tu.tree_full_like(s.x, 3.5)),
 "full_like_int": ("tree_full_like", lambda s: s.tu.tree_full_like(s.x, 2, dtype=s.dt("int32"))),
 "batch_shape": ("tree_batch_shape", lambda s: s.tu.tree_batch_shape(s.x, (2, 3))),
 "cast": ("tree_cast", lambda s: s.tu.tree_cast(s.x, s.dt("float16"))),
 "cast_none": ("tree_cast", lambda s: s.tu.tree_cast(s.x, None)),
 "cast_like": ("tree_cast_like", lambda s: s.tu.tree_cast_like(s.x, s.i)),
 "dtype": ("tree_dtype", lambda s: s.tu.tree_dtype(s.x)),
 "dtype_promote": ("tree_dtype", lambda s: s.tu.tree_dtype({"f": s.mixed["f"], "h": s.mixed["h"]}, "promote")),
 "dtype_highest": ("tree_dtype", lambda s: s.tu.tree_dtype({"f": s.mixed["f"], "h": s.mixed["h"]}, "highest")),
 "dtype_lowest": ("tree_dtype", lambda s: s.tu.tree_dtype({"f": s.mixed["f"], "h": s.mixed["h"]}, "lowest")),
 "moment_1": ("tree_update_moment", lambda s: s.tu.tree_update_moment(s.x, s.y, 0.9, 1)),
 "moment_2": ("tree_update_moment", lambda s: s.tu.tree_update_moment(s.x, s.y, 0.99, 2)),
 "moment_3": ("tree_update_moment", lambda s: s.tu.tree_update_moment(s.x, s.y, 0.5, 3)),
 "moment_complex": ("tree_update_moment", lambda s: s.tu.tree_update_moment(s.c, s.c2, 0.9, 1)),
 "inf_moment": ("tree_update_infinity_moment", lambda s: s.tu.tree_update_infinity_moment(s.x, s.ypos, 0.9, 1e-3)),
 "elem_norm_2": ("tree_update_moment_per_elem_norm", lambda s: s.tu.tree_update_moment_per_elem_norm(s.x, s.ypos, 0.9, 2)),
 "elem_norm_1": ("tree_update_moment_per_elem_norm", lambda s: s.tu.tree_update_moment_per_elem_norm(s.x, s.ypos, 0.9, 1)),
 "elem_norm_cplx": ("tree_update_moment_per_elem_norm", lambda s: s.tu.tree_update_moment_per_elem_norm(s.c, s.ypos, 0.9, 2)),
 "bias_corr": ("tree_bias_correction", lambda s: s.tu.tree_bias_correction(s.x, 0.9, s.count)),
 "bias_corr_int": ("tree_bias_correction", lambda s: s.tu.tree_bias_correction(s.x, 0.999, 1)),
 "get": ("tree_get", lambda s: s.tu.tree_get(s.state, "mu")),
 "get_default": ("tree_get", lambda s: s.tu.tree_get(s.state, "absent", default=s.scalar)),
 "get_filtered": ("tree_get", lambda s: s.tu.tree_get(s.state, "count", filtering=s.in_adam)),
 "get_namedtuple": ("tree_get", lambda s: s.tu.tree_get(s.state, "ScaleByAdamState")),
 "get_all": ("tree_get_all_with_path", lambda s: s.tu.tree_get_all_with_path(s.state, "count")),
 "get_all_nested": ("tree_get_all_with_path", lambda s: s.tu.tree_get_all_with_path({"outer": s.state, "w": s.x}, "w")),
 "namedtuplekey": ("NamedTupleKey", lambda s: [s.tu.NamedTupleKey("ScaleByAdamState", "mu").tuple_name, s.tu.NamedTupleKey("ScaleByAdamState", "mu").name] + [p[-1] == s.tu.NamedTupleKey("ScaleByAdamState", "count") for p, _ in s.tu.tree_get_all_with_path(s.state, "count")]),
 "set": ("tree_set", lambda s: s.tu.tree_set(s.state, mu=s.tu.tree_zeros_like(s.params))),
 "set_filtered": ("tree_set", lambda s: s.tu.tree_set(s.state, s.in_adam, count=s.count)),
 "map_params": ("tree_map_params", lambda s: s.tu.tree_map_params(s.opt, lambda v: 2.0 * v + 1.0, s.state)),
 "map_params_rest": ("tree_map_params", lambda s: s.tu.tree_map_params(s.opt, lambda v, w: v * w, s.state, s.params, transform_non_params=lambda v: v + 1)),
 "split_key_like": ("tree_split_key_like", lambda s: s.map(lambda k: "<key>", s.tu.tree_split_key_like(s.key(0), s.x))),
 "unwrap_key_data": ("tree_unwrap_random_key_data", lambda s: s.map(lambda k: "<key data>", s.tu.tree_unwrap_random_key_data(s.tu.tree_split_key_like(s.key(1), s.x)))),
}
for _name in ("tree_scalar_mul", "tree_add_scalar_mul", "tree_l1_norm", "tree_l2_norm", "tree_linf_norm"):  # optax's old aliases
    TREE_UTILS[_name[5:]] = (_name, lambda s, _name=_name: getattr(s.tu, _name)(*((0.3, s.x) if _name == "tree_scalar_mul" else (s.x, 0.3, s.y) if _name == "tree_add_scalar_mul" else (s.x,))))
_sides = {}
for name, (attr, fn) in (TREE_UTILS if "tree_utils" in RUN else {}).items():
    if not hasattr(optax_tree_utils, attr) or not hasattr(_gradtx_tree_utils, attr):
        print(f"{name:16s} skipped: tree_utils.{attr} missing from optax or gradtx")
        continue
    if not _sides:
        _sides = {"optax": _Side("optax"), "gradtx": _Side("gradtx")}
    try:
        ref = fn(_sides["optax"])
    except Exception as e:  # noqa: BLE001 - optax cannot run this case
        print(f"{name:16s} skipped: optax raises {e!r:.100}")
        continue
    try:
        got = fn(_sides["gradtx"])
    except Exception as e:  # noqa: BLE001 - report and go on
        print(f"{name:16s} {attr:14.14s} ERROR {e!r}")
        continue
    report(name, compare(got, ref), attr)

# tree_random_like: shapes and dtypes must match; the samples themselves can only agree in law.
if "tree_utils" in RUN and hasattr(optax_tree_utils, "tree_random_like") and hasattr(_gradtx_tree_utils, "tree_random_like"):
    _big = {"a": np.zeros((200, 100), DTYPE), "b": [np.zeros(5000, DTYPE), np.zeros((), DTYPE)]}
    for label, kw_o, kw_t, (mean, std) in (
        ("normal", {}, {}, (0.0, 1.0)),
        ("uniform", {"sampler": jax.random.uniform}, {"sampler": torch.rand}, (0.5, 12 ** -0.5)),
        ("normal_f16", {"dtype": jnp.float16}, {"dtype": torch.float16}, (0.0, 1.0)),
    ):
        ref = optax_tree_utils.tree_random_like(jax.random.PRNGKey(0), jax.tree_util.tree_map(jnp.asarray, _big), **kw_o)
        got = gtu.tree_random_like(torch.Generator().manual_seed(0), _map_np(torch.tensor, _big), **kw_t)
        r, g = _norm_out(ref), _norm_out(got)
        layout_ok = len(r) == len(g) and all(a.shape == b.shape and a.dtype == b.dtype for a, b in zip(g, r))
        stats = []
        for a in g:
            if a.size > 1:
                a = a.astype(np.float64)
                bound = 6 * std / np.sqrt(a.size)  # six standard errors of the sample mean
                stats.append(abs(a.mean() - mean) <= bound and abs(a.std() - std) <= 6 * std / np.sqrt(2 * a.size) + 2e-3)
        ok = layout_ok and all(stats)
        print(f"{'random_like_' + label:16s} {'tree_random_like':14s} shapes/dtypes {'match' if layout_ok else 'DIFFER'}, sample mean/std "
              f"{'within 6 standard errors of the law' if all(stats) else 'OUT OF RANGE'} (random: not compared number for number)"
              + ("" if ok else "  <-- disagreement"))
        if not ok:
            worst = float("inf")


# ----------------------------------------------------------------------------- projections
# Each of optax.projections on random inputs and edge cases: points already inside the set, on
# its boundary, ties and repeated values (simplex, l1), a zero vector, a one-element tree, a
# scale of 0 and a large one.
print("--- projections ---")
_shapes_p = {"a": (3, 4), "b": [(5,), ()]}
_pt = {
    "x": _random_tree(_shapes_p, lambda s: (2 * rng.standard_normal(s)).astype(DTYPE)),
    "a": _random_tree(_shapes_p, lambda s: rng.standard_normal(s).astype(DTYPE)),
    "lo": _random_tree(_shapes_p, lambda s: (-np.abs(rng.standard_normal(s))).astype(DTYPE)),
    "hi": _random_tree(_shapes_p, lambda s: np.abs(rng.standard_normal(s)).astype(DTYPE)),
    "small": _random_tree(_shapes_p, lambda s: (0.01 * rng.standard_normal(s)).astype(DTYPE)),
    "zeros": _random_tree(_shapes_p, lambda s: np.zeros(s, DTYPE)),
    "ties": _random_tree(_shapes_p, lambda s: np.full(s, 0.25, DTYPE)),
    "dups": {"a": np.asarray([3.0, 3.0, -1.0, 3.0, 0.5], DTYPE), "b": np.asarray([3.0, -1.0], DTYPE)},
    "vec": rng.standard_normal(7).astype(DTYPE),
    "one": {"a": np.asarray([5.0], DTYPE)},
    "on_simplex": {"a": np.asarray([0.2, 0.3, 0.1], DTYPE), "b": np.asarray([0.4, 0.0], DTYPE)},
    "big": {"a": (1e4 * rng.standard_normal(6)).astype(DTYPE)},
}


class _PSide:
    def __init__(self, lib):
        self.pr = optax_projections if lib == "optax" else gpr
        conv = jnp.asarray if lib == "optax" else torch.tensor
        for k, v in _pt.items():
            setattr(self, k, _map_np(conv, v))
        self.scalar = conv(np.asarray(0.4, DTYPE))


def _inside_half(s):  # b above <a, x>: x already in the halfspace
    return float(np.sum([np.sum(u * v) for u, v in zip(_norm_out(s.a), _norm_out(s.x))])) + 1.0


PROJECTIONS = {
 "non_negative": ("projection_non_negative", lambda s: s.pr.projection_non_negative(s.x)),
 "box": ("projection_box", lambda s: s.pr.projection_box(s.x, s.lo, s.hi)),
 "box_point": ("projection_box", lambda s: s.pr.projection_box(s.x, s.lo, s.lo)),
 "box_scalars": ("projection_box", lambda s: s.pr.projection_box(s.vec, -0.3, 0.5)),  # optax: scalar bounds for one array only
 "hypercube": ("projection_hypercube", lambda s: s.pr.projection_hypercube(s.vec)),  # optax: one array only
 "hypercube_0.4": ("projection_hypercube", lambda s: s.pr.projection_hypercube(s.vec, s.scalar)),
 "linf_ball": ("projection_linf_ball", lambda s: s.pr.projection_linf_ball(s.x)),
 "linf_ball_in": ("projection_linf_ball", lambda s: s.pr.projection_linf_ball(s.small, 0.5)),
 "simplex": ("projection_simplex", lambda s: s.pr.projection_simplex(s.x)),
 "simplex_2.5": ("projection_simplex", lambda s: s.pr.projection_simplex(s.x, 2.5)),
 "simplex_vec": ("projection_simplex", lambda s: s.pr.projection_simplex(s.vec)),
 "simplex_ties": ("projection_simplex", lambda s: s.pr.projection_simplex(s.ties)),
 "simplex_dups": ("projection_simplex", lambda s: s.pr.projection_simplex(s.dups, 2.0)),
 "simplex_on": ("projection_simplex", lambda s: s.pr.projection_simplex(s.on_simplex)),
 "simplex_one": ("projection_simplex", lambda s: s.pr.projection_simplex(s.one, 3.0)),
 "simplex_zeros": ("projection_simplex", lambda s: s.pr.projection_simplex(s.zeros)),
 "simplex_big": ("projection_simplex", lambda s: s.pr.projection_simplex(s.big, 1e3)),
 "l1_sphere": ("projection_l1_sphere", lambda s: s.pr.projection_l1_sphere(s.x)),
 "l1_sphere_3": ("projection_l1_sphere", lambda s: s.pr.projection_l1_sphere(s.x, 3.0)),
 "l1_sphere_small": ("projection_l1_sphere", lambda s: s.pr.projection_l1_sphere(s.small)),
 "l1_sphere_dups": ("projection_l1_sphere", lambda s: s.pr.projection_l1_sphere(s.dups)),
 "l1_ball": ("projection_l1_ball", lambda s: s.pr.projection_l1_ball(s.x)),
 "l1_ball_in": ("projection_l1_ball", lambda s: s.pr.projection_l1_ball(s.small)),
 "l1_ball_100": ("projection_l1_ball", lambda s: s.pr.projection_l1_ball(s.x, 100.0)),
 "l1_ball_zeros": ("projection_l1_ball", lambda s: s.pr.projection_l1_ball(s.zeros)),
 "l1_ball_vec": ("projection_l1_ball", lambda s: s.pr.projection_l1_ball(s.vec, 0.5)),
 "l2_sphere": ("projection_l2_sphere", lambda s: s.pr.projection_l2_sphere(s.x)),
 "l2_sphere_0.5": ("projection_l2_sphere", lambda s: s.pr.projection_l2_sphere(s.small, 0.5)),
 "l2_sphere_zero": ("projection_l2_sphere", lambda s: s.pr.projection_l2_sphere(s.zeros)),
 "l2_ball": ("projection_l2_ball", lambda s: s.pr.projection_l2_ball(s.x)),
 "l2_ball_in": ("projection_l2_ball", lambda s: s.pr.projection_l2_ball(s.small)),
 "l2_ball_zeros": ("projection_l2_ball", lambda s: s.pr.projection_l2_ball(s.zeros, 2.0)),
 "l2_ball_scale0": ("projection_l2_ball", lambda s: s.pr.projection_l2_ball(s.x, 0.0)),
 "vector": ("projection_vector", lambda s: s.pr.projection_vector(s.x, s.a)),
 "vector_self": ("projection_vector", lambda s: s.pr.projection_vector(s.a, s.a)),
 "vector_zero_a": ("projection_vector", lambda s: s.pr.projection_vector(s.x, s.zeros)),
 "hyperplane": ("projection_hyperplane", lambda s: s.pr.projection_hyperplane(s.x, s.a, 1.5)),
 "hyperplane_vec": ("projection_hyperplane", lambda s: s.pr.projection_hyperplane(s.vec, s.vec, -2.0)),
 "halfspace_out": ("projection_halfspace", lambda s: s.pr.projection_halfspace(s.x, s.a, -3.0)),
 "halfspace_in": ("projection_halfspace", lambda s: s.pr.projection_halfspace(s.x, s.a, _inside_half(s))),
}
_psides = {}
for name, (attr, fn) in (PROJECTIONS if "projections" in RUN else {}).items():
    if not hasattr(optax_projections, attr) or not hasattr(_gradtx_projections, attr):
        print(f"{name:16s} skipped: projections.{attr} missing from optax or gradtx")
        continue
    if not _psides:
        _psides = {"optax": _PSide("optax"), "gradtx": _PSide("gradtx")}
    try:
        ref = fn(_psides["optax"])
    except Exception as e:  # noqa: BLE001 - optax cannot run this case
        print(f"{name:16s} skipped: optax raises {e!r:.100}")
        continue
    try:
        got = fn(_psides["gradtx"])
    except Exception as e:  # noqa: BLE001 - report and go on
        print(f"{name:16s} {attr[11:]:14.14s} ERROR {e!r}")
        continue
    report(name, compare(got, ref), attr[11:])


# ----------------------------------------------------------------------------- complex parameters
# The cases of tests/complex_cases.py (written once for both libraries), on complex128 params: the
# final params after each case's steps, optax's against gradtx's (pure and donated); the names
# gradtx refuses must raise a TypeError naming a leaf at init (what optax does with them is printed).
# --write-complex-reference PATH records optax's numbers as the tests' constants.
def _complex_section():
    global worst
    if not ARGS.float64:
        print("complex: skipped (JAX computes in complex128 only with --float64)")
        return
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
    import complex_cases as cc  # noqa: E402

    def numbers(tree):
        return {k: np.asarray(_as_numpy(v)).tolist() for k, v in sorted(tree.items())}

    reference = {}
    for name, case in cc.CASES.items():
        if not any(o in name for o in ARGS.only.split(",")):
            continue
        try:
            ref = numbers(cc.run(optax, (case.reference or case.factory)(optax), case.kind, steps=case.steps))
        except Exception as e:  # noqa: BLE001 - report and go on
            print(f"{name:28s} optax ERROR {type(e).__name__}: {str(e)[:100]}")
            continue
        reference[name] = ref
        for inplace in (False, True):
            try:
                got = numbers(cc.run(gtx, case.factory(gtx), case.kind, steps=case.steps, inplace=inplace))
            except Exception as e:  # noqa: BLE001
                print(f"{name:28s} inplace={inplace!s:5s} ERROR {e!r}")
                worst = float("inf")
                continue
            err = max(float(np.max(np.abs(np.asarray(got[k]) - np.asarray(ref[k])) / (np.abs(np.asarray(ref[k])) + 1e-6))) for k in ref)
            worst = max(worst, err)
            print(f"{name:28s} inplace={inplace!s:5s} max rel err {err:.2e}" + ("  <-- above 1e-5" if err > 1e-5 else ""))
    g = np.asarray([-4 - 2j, 22 + 2j, -2j])
    first = optax.adam(0.1).update(jnp.asarray(g), optax.adam(0.1).init(jnp.zeros(3, jnp.complex128)))[0]
    reference["adam_first_update"] = {"g": g.tolist(), "update": np.asarray(first).tolist()}
    for name, make in cc.REFUSED.items():
        try:
            make(gtx).init(cc.tree(_gradtx, cc.PARAMS))
            verdict = "NOT REFUSED  <-- disagreement"
            worst = float("inf")
        except TypeError as e:
            verdict = "refused" if "leaf" in str(e) else f"refused without naming a leaf: {e}"
        try:
            cc.run(optax, make(optax), "updates")
            optax_note = "optax runs it"
        except Exception as e:  # noqa: BLE001
            optax_note = f"optax: {type(e).__name__}: {str(e)[:70]}"
        print(f"{name:28s} {verdict} ({optax_note})")
    if ARGS.write_complex_reference:
        with open(ARGS.write_complex_reference, "w") as out:
            out.write(
                '"""optax\'s numbers for the cases of complex_cases.py: the params after each case\'s steps.\n\n'
                "Written by ``benchmarks/optax_agreement.py --float64 --sections complex --write-complex-reference\n"
                f"tests/optax_complex_reference.py`` with optax {optax.__version__} and jax {jax.__version__} (CPU, x64,\n"
                "complex128). ``adam_first_update``: ``optax.adam(0.1)``'s first update of the gradient ``g``.\n"
                'Do not edit by hand: regenerate.\n"""\n\n'
                f"OPTAX_VERSION = {optax.__version__!r}\n\nREFERENCE = {{\n"
            )
            for name, value in reference.items():
                out.write(f"    {name!r}: {value!r},\n")
            out.write("}\n")
        print(f"wrote {len(reference)} cases to {ARGS.write_complex_reference}")


if "complex" in RUN:
    _complex_section()


# ----------------------------------------------------------------------------- coverage
# Every public name of optax, optax.tree_utils and optax.projections (optax.contrib aside) that
# gradtx also has, and that no case above exercised: a name added to gradtx without a case shows
# up here. Type aliases carry no numbers; they are listed apart.
print("--- coverage ---" + ("" if RUN == set(SECTIONS) else " (of the sections run)"))


def _uncovered(module_o, module_t, used):
    names = [n for n in dir(module_o) if not n.startswith("_") and n != "contrib"
             and not inspect.ismodule(getattr(module_o, n)) and hasattr(module_t, n)]
    functions, others = [], []
    for n in sorted(set(names) - used):
        value = getattr(module_t, n)
        named = inspect.isfunction(value) or (inspect.isclass(value) and value.__module__.startswith("gradtx")
                                               and not getattr(value, "_is_protocol", False))  # a Protocol: a type
        (functions if named else others).append(n)
    return names, functions, others


for label, module_o, module_t, recorder in (
    ("optax", optax, _gradtx, gtx), ("optax.tree_utils", optax_tree_utils, _gradtx_tree_utils, gtu),
    ("optax.projections", optax_projections, _gradtx_projections, gpr),
):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        names, functions, others = _uncovered(module_o, module_t, recorder.used)
    print(f"{label}: {len(names)} names shared with gradtx, {len(names) - len(functions) - len(others)} covered")
    print(f"  functions and classes no case covers ({len(functions)}): {', '.join(functions) or 'none'}")
    if others:
        print(f"  type aliases and protocols (nothing to compare) ({len(others)}): {', '.join(others)}")

print("worst", worst)
