"""Adam and its relatives: Adam (and NAdam), AMSGrad, AdaBelief, Adamax, RAdam, as in optax.

States and numbers are optax's: ``ScaleByAdamState(count, mu, nu)`` with ``mu``/``nu`` the raw
(uncorrected) moments and ``count`` a 0-d int32 tensor. The bias corrections are folded into
scalars, ``mu_hat / (sqrt(nu_hat + eps_root) + eps) = (sqrt(bc2) / bc1) * mu / (sqrt(nu + eps_root
* bc2) + eps * sqrt(bc2))``, computed as 0-d tensors from ``count`` (no host sync, no
recompilation), so a step makes few passes over memory. On the donated path the gradient buffers
hold the result and nothing is allocated; the pure path runs the same ops on new tensors.

:func:`fused_adam` is ``chain(scale_by_adam, [add_decayed_weights,] scale_by_learning_rate)`` in
one pass per op, with that chain's state; the ``adam``/``adamw``/``nadam`` aliases use it.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional, Union

import torch
from torch import Tensor

from gradtx import tree as tree_lib
from gradtx.base import (
    GradientTransformation,
    donation,
    set_elementwise,
    supports_donated_updates,
    takes_scaled_gradients,
)
from gradtx.native import adam as native_adam
from gradtx.native import amsgrad as native_amsgrad
from gradtx.native import stored_adam
from gradtx.native.checks import float32 as checks_float32
from gradtx.numerics import ScalarOrSchedule
from gradtx.sharding import dtensor as dtensor_lib
from gradtx.state_check import named
from gradtx.state_signs import nonnegative
from gradtx.transforms import _foreach as fe
from gradtx.transforms.scaling import FoldedLearningRate, with_learning_rate
from gradtx.transforms.weight_decay import WeightDecayTerm, add_decay_term


@nonnegative("nu")
class ScaleByAdamState(NamedTuple):
    """``count``: steps so far (0-d int32); ``mu``, ``nu``: first and second moments, like the params."""

    count: Tensor
    mu: Any
    nu: Any


@nonnegative("nu", "nu_max")
class ScaleByAmsgradState(NamedTuple):
    """As :class:`ScaleByAdamState`, plus ``nu_max``: the running maximum of the corrected ``nu``."""

    count: Tensor
    mu: Any
    nu: Any
    nu_max: Any


@nonnegative("nu")
class ScaleByBeliefState(NamedTuple):
    """``nu`` holds the moving average of the squared prediction error ``(g - mu)^2``."""

    count: Tensor
    mu: Any
    nu: Any


def _check_decay(name: str, value: Any, owner: str) -> Union[float, Tensor]:
    """A decay rate in [0, 1]; a 0-d tensor (from ``inject_hyperparams``) is taken as it is."""
    value = fe.number_or_tensor(value)
    if isinstance(value, float) and not 0.0 <= value <= 1.0:
        raise ValueError(f"{owner}: {name} must be in [0, 1], got {value}")
    return value


def _correction(decay: float, count: Tensor) -> Tensor:
    """``1 - decay ** count`` (float64, 0-d)."""
    return 1.0 - fe.decay_power(decay, count)


# --------------------------------------------------------------------------- shared steps


def first_moment(mu: list[Tensor], grads: list[Tensor], b1: Any, *, inplace: bool) -> list[Tensor]:
    """``b1 * mu + (1 - b1) * g`` (in ``mu``'s dtype)."""
    return fe.lerp(mu, fe.cast(grads, mu[0].dtype), 1.0 - b1, inplace=inplace)


def second_moment(nu: list[Tensor], grads: list[Tensor], b2: Any, *, inplace: bool) -> list[Tensor]:
    """``b2 * nu + (1 - b2) * |g|^2`` (``|g|^2`` is ``g * g`` for real ``g``, the squared modulus
    for complex ``g``: ``nu`` stays real-valued, as optax's)."""
    nu = fe.mul(nu, fe.on(b2, nu), inplace=inplace)
    return fe.add_squares(nu, grads, 1.0 - b2, inplace=True)


def denominator(
    second: list[Tensor], eps: Any, root_shift: Any, dtype: torch.dtype, *, into: Optional[list[Tensor]]
) -> list[Tensor]:
    """``sqrt(second + root_shift) + eps`` in ``dtype``, written into ``into`` when it is donated."""
    second = fe.cast(second, dtype)
    if root_shift is None:
        d = fe.sqrt_of(second, into=into)
    else:
        d = fe.fresh(second, into=into)
        d = fe.sqrt(fe.add(d, root_shift, inplace=True), inplace=True)
    return fe.add(d, eps, inplace=True)


def divide(numer: list[Tensor], numer_is_buffer: bool, d: list[Tensor], step: Any) -> list[Tensor]:
    """``step * numer / d``, in the buffer of ``numer`` when it is ours, else in that of ``d``."""
    if numer_is_buffer:
        out = fe.div(numer, d, inplace=True)
    else:
        out = fe.div_into(fe.cast(numer, d[0].dtype), d)
    return fe.mul(out, step, inplace=True)


def nesterov_numerator(grads: list[Tensor], mu: list[Tensor], ratio: Any, *, inplace: bool) -> list[Tensor]:
    """``mu + ratio * g``: the Nesterov numerator up to a scalar factor, in the gradients' buffer."""
    numer = fe.mul(grads, ratio, inplace=inplace)
    return fe.add(numer, fe.cast(mu, numer[0].dtype), inplace=True)


class _Scalars(NamedTuple):
    """The per-step factors of an Adam-like update, as 0-d float64 tensors."""

    hat: Tensor  # mu_hat == hat * numer: 1 / bc1, or c_a with Nesterov
    step: Tensor  # hat * sqrt(bc2): multiplies numer / d
    eps: Tensor  # eps * sqrt(bc2), added outside the square root
    root_shift: Optional[Tensor]  # eps_root * bc2, added inside the square root
    nesterov_ratio: Optional[Tensor]  # c_b / c_a


def _adam_scalars(b1: Any, b2: Any, eps: Any, eps_root: Any, nesterov: bool, count: Tensor) -> _Scalars:
    bc1, bc2 = _correction(b1, count), _correction(b2, count)
    sqrt_bc2 = torch.sqrt(bc2)
    hat, ratio = 1.0 / bc1, None
    if nesterov:
        # b1 * mu / (1 - b1^(t+1)) + (1 - b1) * g / (1 - b1^t) == c_a * (mu + (c_b / c_a) * g)
        c_a = b1 / _correction(b1, count + 1)
        c_b = (1.0 - b1) / bc1
        hat, ratio = c_a, c_b / c_a
    root_shift = None if fe.known_zero(eps_root) else eps_root * bc2
    return _Scalars(*fe.realized(hat, hat * sqrt_bc2, eps * sqrt_bc2, root_shift, ratio))


# --------------------------------------------------------------------------- Adam


class _Adam:
    """The Adam step shared by :func:`scale_by_adam` and :func:`fused_adam`."""

    def __init__(self, owner, b1, b2, eps, eps_root, mu_dtype, nesterov):
        self.owner = owner
        self.b1 = _check_decay("b1", b1, owner)
        self.b2 = _check_decay("b2", b2, owner)
        self.eps, self.eps_root = fe.number_or_tensor(eps), fe.number_or_tensor(eps_root)
        self.mu_dtype = mu_dtype
        # With b1 == 0 the Nesterov estimate equals the plain one (mu == g), and c_a below is 0.
        self.nesterov = bool(nesterov) and not (isinstance(self.b1, float) and self.b1 == 0.0)

    def init(self, params: Any) -> ScaleByAdamState:
        return ScaleByAdamState(
            count=fe.zero_count(params), mu=fe.zeros_like_tree(params, self.mu_dtype), nu=fe.zeros_like_tree(params)
        )

    def update(self, updates, state, *, inplace, lr_scale=None, decay=None, grad_scale=None, scaling=None):
        """``lr_scale`` (a number or 0-d tensor) multiplies the Adam direction; ``decay`` is
        ``(factor, flags, params)``: ``factor * param`` is added where ``flags`` is true.
        ``inplace`` as in ``update``: ``True``, ``False`` or ``"updates"`` (only they are donated).
        ``grad_scale`` (a 0-d tensor): the step of ``updates * grad_scale``, with the numbers of
        scaling first (by ``scaling``, a :data:`~gradtx.base.Scaling`, else ``tree_lib.scale_``);
        the C kernel takes the product where it reads the gradients, so no scaled copy is made."""
        own_updates, inplace = donation(inplace)  # from here on ``inplace`` is about the state
        if grad_scale is not None and stored_adam.current() is not None and (scaling is not None or tree_lib.needs_graph(grad_scale)):
            # stored moments, and a scaling of the caller's or a coefficient with a graph: scaled first
            updates, grad_scale = fe.scaled_tree(updates, grad_scale, scaling, inplace=own_updates), None
        leaves = fe.leaves_of(updates, what=self.owner)
        mu = leaves.aligned(state.mu, what=f"{self.owner}: state.mu")
        nu = leaves.aligned(state.nu, what=f"{self.owner}: state.nu")
        count = fe.increment(state.count, inplace=inplace)
        s = _adam_scalars(self.b1, self.b2, self.eps, self.eps_root, self.nesterov, count)
        step = s.step if lr_scale is None else s.step * lr_scale
        factor, flags, param_values = decay if decay is not None else (None, [False] * len(mu), [None] * len(mu))
        step, factor = fe.realized(step, factor)  # a scheduled learning rate joins them here

        def group(g, m, v, decayed, p):
            owned = own_updates
            if not (self.nesterov or s.root_shift is not None or torch.compiler.is_compiling()):
                # one pass over memory for plain float32 CPU tensors, with the ATen ops' numbers
                done = native_adam.step(
                    g, m, v, decayed, p, b1=self.b1, b2=self.b2, eps=s.eps, step=step, factor=factor,
                    inplace=inplace, own_updates=own_updates, grad_scale=grad_scale, scaling=scaling,
                )
                if done is not None:
                    return done
            if grad_scale is not None:  # the scaled gradients are new or donated: ours either way
                g, owned = fe.scaled(list(g), grad_scale, scaling, inplace=own_updates), True
            m = first_moment(m, g, self.b1, inplace=inplace)
            v = second_moment(v, g, self.b2, inplace=inplace)
            if self.nesterov:
                numer = nesterov_numerator(g, m, fe.on(s.nesterov_ratio, g), inplace=owned)
                into = None
            else:
                numer, into = m, (g if owned else None)
            d = denominator(v, fe.on(s.eps, g), fe.on(s.root_shift, g), g[0].dtype, into=into)
            out = divide(numer, self.nesterov, d, fe.on(step, g))
            out = add_decay_term(out, p, decayed, factor, inplace=True)  # our own buffers
            return fe.finish(out, g), m, v

        stored = stored_adam.current()
        if stored is not None:  # quantize_state's stored moments: stepped where they lie, the rest below
            return self._update_stored(
                stored, leaves, state, count, group, mu, nu, flags, param_values, step, factor, s.eps, own_updates, grad_scale
            )
        # handed a clip's coefficient, unpacked, as the clip's new gradients were (donated to this
        # step); a scaling that reads the gradients sees them as given
        pack = not (inplace or own_updates or grad_scale is not None)
        new_updates, new_mu, new_nu = fe.map_groups(group, leaves.tensors, mu, nu, flags, param_values, outputs=3, pack=pack)
        new_state = ScaleByAdamState(
            count=count, mu=leaves.rebuild(new_mu, like=state.mu), nu=leaves.rebuild(new_nu, like=state.nu)
        )
        return leaves.rebuild(new_updates), new_state

    def _update_stored(self, stored, leaves, state, count, group, mu, nu, flags, param_values, step, factor, eps, own_updates, grad_scale):
        """:meth:`update` where some moments are stored in 8 bits (:mod:`gradtx.native.stored_adam`):
        their leaves' updates and new codes by its kernel (which takes ``grad_scale``, a clip's
        coefficient, where it reads the gradients), the other leaves' by ``group``."""
        n = len(leaves.tensors)
        new_updates, new_mu, new_nu = [None] * n, list(mu), list(nu)
        decay_kind = native_adam.DECAY_PRODUCT if isinstance(factor, Tensor) else native_adam.DECAY_FMA
        floats = (1.0 - self.b1, self.b2, 1.0 - self.b2, checks_float32(eps), checks_float32(step),
                  checks_float32(factor) if any(flags) else 0.0)
        scale = None if grad_scale is None else checks_float32(grad_scale)
        rest, taken, kernel_leaves = [], [], []
        for i, g in enumerate(leaves.tensors):
            entry = stored.moments.get(id(mu[i]))
            if entry is None:
                rest.append(i)
                continue
            moments, _, nu_placeholder = entry
            if nu[i] is not nu_placeholder:
                raise RuntimeError(f"{self.owner}: a stored first moment came without its second moment")
            p = param_values[i] if flags[i] else None
            taken.append(i)
            kernel_leaves.append(stored_adam.Leaf(g, p, moments, decay_kind if flags[i] else native_adam.DECAY_NONE))
        if kernel_leaves:
            results = stored_adam.steps(kernel_leaves, floats=floats, own_update=own_updates, grad_scale=scale)
            for i, (update, codes) in zip(taken, results):
                new_updates[i], stored.results[id(mu[i])] = update, codes
        if rest:
            pick = lambda values: [values[i] for i in rest]  # noqa: E731
            outs = fe.map_groups(group, pick(leaves.tensors), pick(mu), pick(nu), pick(flags), pick(param_values), outputs=3, pack=False)
            for j, i in enumerate(rest):
                new_updates[i], new_mu[i], new_nu[i] = outs[0][j], outs[1][j], outs[2][j]
        new_state = ScaleByAdamState(
            count=count, mu=leaves.rebuild(new_mu, like=state.mu), nu=leaves.rebuild(new_nu, like=state.nu)
        )
        return leaves.rebuild(new_updates), new_state


def scale_by_adam(
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    mu_dtype: Optional[torch.dtype] = None,
    *,
    nesterov: bool = False,
) -> GradientTransformation:
    """Rescales updates by Adam's ``mu_hat / (sqrt(nu_hat + eps_root) + eps)`` (Kingma & Ba, 2014).

    ``nesterov=True`` gives NAdam's numerator (Dozat, 2016) as optax computes it:
    ``b1 * mu / (1 - b1^(t+1)) + (1 - b1) * g / (1 - b1^t)``. ``mu_dtype`` sets the dtype of the
    first moment (``nu`` keeps the parameters' dtype); updates keep the gradients' dtype.

    Differentiating through the update (meta-learning) needs ``eps_root > 0`` wherever a gradient
    can be exactly zero: the derivative of ``sqrt(nu)`` at ``nu == 0`` is infinite, and the
    meta-gradient would be NaN.
    """
    adam = _Adam("scale_by_adam", b1, b2, eps, eps_root, mu_dtype, nesterov)

    def update_fn(updates, state, params=None, *, inplace=False):
        del params
        return adam.update(updates, state, inplace=inplace)

    def scaled_update(updates, state, params=None, *, inplace=False, grad_scale, scaling=None):
        del params
        return adam.update(updates, state, inplace=inplace, grad_scale=grad_scale, scaling=scaling)

    update_fn = set_elementwise(supports_donated_updates(update_fn))
    return GradientTransformation(adam.init, takes_scaled_gradients(update_fn, scaled_update))


def fused_adam(
    learning_rate: Optional[ScalarOrSchedule],
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    mu_dtype: Optional[torch.dtype] = None,
    *,
    nesterov: bool = False,
    weight_decay: Optional[ScalarOrSchedule] = None,
    mask: Any = None,
) -> GradientTransformation:
    """``chain(scale_by_adam(...), [add_decayed_weights(weight_decay, mask),] scale_by_learning_rate(lr))``.

    One transformation with exactly that chain's state (a tuple ``(ScaleByAdamState, [decay
    state,] learning-rate state)``) and the same numbers, up to rounding: the learning rate is
    folded into Adam's step factor and the decay term is added to the direction in its buffer, so
    the donated path makes a few passes over memory and allocates nothing. ``weight_decay=None``
    leaves the decay step out of the chain (Adam); a number or a schedule puts it in (AdamW).
    Like that chain, ``update`` takes extra keyword arguments (``value=``, ``grad=``, ...) and
    ignores them, so the optimizer can stand wherever another one may.
    """
    adam = _Adam("adamw" if weight_decay is not None else "adam", b1, b2, eps, eps_root, mu_dtype, nesterov)
    term = None if weight_decay is None else WeightDecayTerm(weight_decay, mask, adam.owner, why=" for weight decay")
    rate = FoldedLearningRate(learning_rate)

    def init_fn(params: Any) -> tuple:
        lr_state = rate.init(params)
        if term is None:
            return (adam.init(params), lr_state)
        return (adam.init(params), term.init(params), lr_state)

    def update_fn(updates, state, params=None, *, inplace=False, **extra_args):
        del extra_args  # value=, grad=, ...: taken and ignored, as by optax's aliases (the chain it stands for)
        return run(updates, state, params, inplace)

    def scaled_update(updates, state, params=None, *, inplace=False, grad_scale, scaling=None):
        return run(updates, state, params, inplace, grad_scale, scaling)

    def run(updates, state, params, inplace, grad_scale=None, scaling=None):
        adam_state = state[0]
        _, own_state = donation(inplace)
        lr_scale, lr_state = rate.step(state[-1], inplace=own_state)
        decay, decay_state = None, None
        if term is not None:
            decay, decay_state = term.step(updates, state[1], params, inplace=own_state)
            if decay is not None and lr_scale is not None:
                wd, flags, param_values = decay
                decay = (lr_scale * wd, flags, param_values)
        new_updates, new_adam_state = adam.update(
            updates, adam_state, inplace=inplace, lr_scale=lr_scale, decay=decay, grad_scale=grad_scale, scaling=scaling
        )
        if term is not None:
            return new_updates, (new_adam_state, decay_state, lr_state)
        return new_updates, (new_adam_state, lr_state)

    update_fn = set_elementwise(supports_donated_updates(update_fn), not callable(mask))  # a mask made from the params sees them all
    no_root_shift = isinstance(adam.eps_root, float) and adam.eps_root == 0.0
    plain = no_root_shift and not adam.nesterov and isinstance(adam.b1, float) and isinstance(adam.b2, float)
    update_fn = stored_adam.declare(update_fn, plain and mu_dtype in (None, torch.float32))
    return GradientTransformation(init_fn, named(takes_scaled_gradients(update_fn, scaled_update), adam.owner))


# --------------------------------------------------------------------------- AMSGrad


def _amsgrad_step(updates, state, b1, b2, eps, eps_root, bias_correction_mu, bias_correction_nu, *, own_updates, own_state,
                  grad_scale=None, scaling=None, update_scale=None, owner="scale_by_amsgrad"):
    """One AMSGrad step: the updates (multiplied by ``update_scale`` where given) and the new state;
    ``own_updates``/``own_state``: the gradients'/the state's buffers may be written; ``grad_scale``:
    the step of ``updates * grad_scale`` (see :func:`~gradtx.base.takes_scaled_gradients`)."""
    leaves = fe.leaves_of(updates, what=owner)
    mu = leaves.aligned(state.mu, what=f"{owner}: state.mu")
    nu = leaves.aligned(state.nu, what=f"{owner}: state.nu")
    nu_max = leaves.aligned(state.nu_max, what=f"{owner}: state.nu_max")
    count = fe.increment(state.count, inplace=own_state)
    inv_bc1 = 1.0 / _correction(b1, count) if bias_correction_mu else None
    inv_bc2 = 1.0 / _correction(b2, count) if bias_correction_nu else None

    def group(g, m, v, v_max):
        factor = grad_scale
        if factor is not None and scaling is not None:  # a scaling that reads the gradients (observe's) scales them
            g, factor = fe.scaled(list(g), factor, scaling, inplace=own_updates), None
        if not (torch.compiler.is_compiling() or eps_root):  # one pass for plain float32 CPU tensors, the same numbers
            done = native_amsgrad.step(
                g, m, v, v_max, b1=b1, b2=b2, inv_bc2=inv_bc2, eps=eps, hat=1.0 if inv_bc1 is None else inv_bc1,
                step=update_scale, inplace=own_state, own_updates=own_updates, grad_scale=factor,
            )
            if done is not None:
                return done
        if factor is not None:
            g = fe.scaled(list(g), factor, None, inplace=own_updates)
        m = first_moment(m, g, b1, inplace=own_state)
        v = second_moment(v, g, b2, inplace=own_state)
        corrected = fe.fresh(v, into=g if own_updates else None)
        if inv_bc2 is not None:
            corrected = fe.mul(corrected, fe.on(inv_bc2, corrected), inplace=True)
        v_max = fe.maximum(v_max, fe.cast(corrected, v_max[0].dtype), inplace=own_state)
        root = None if fe.known_zero(eps_root) else eps_root
        d = denominator(v_max, eps, root, g[0].dtype, into=corrected if own_updates else None)
        out = divide(m, False, d, 1.0 if inv_bc1 is None else fe.on(inv_bc1, d))
        if update_scale is not None:  # ``out`` is new, or the donated gradients
            out = fe.mul(out, fe.on(update_scale, out), inplace=True)
        return fe.finish(out, g), m, v, v_max

    pack = not (own_updates or own_state or scaling is not None)  # a scaling that reads the gradients sees them as given
    new_updates, new_mu, new_nu, new_max = fe.map_groups(group, leaves.tensors, mu, nu, nu_max, outputs=4, pack=pack)
    return leaves.rebuild(new_updates), ScaleByAmsgradState(
        count=count,
        mu=leaves.rebuild(new_mu, like=state.mu),
        nu=leaves.rebuild(new_nu, like=state.nu),
        nu_max=leaves.rebuild(new_max, like=state.nu_max),
    )


def scale_by_amsgrad(
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    mu_dtype: Optional[torch.dtype] = None,
    bias_correction_mu: bool = True,
    bias_correction_nu: bool = True,
) -> GradientTransformation:
    """AMSGrad (Reddi et al., 2018): Adam with ``nu_hat`` replaced by its running maximum.

    As in optax, ``nu_max = max(nu_max, nu / (1 - b2^t))`` (the bias-corrected second moment,
    unless ``bias_correction_nu=False``) and the update is ``mu_hat / (sqrt(nu_max + eps_root) + eps)``.
    torch's ``Adam(amsgrad=True)`` keeps the maximum of the *uncorrected* ``nu`` instead.
    """
    owner = "scale_by_amsgrad"
    b1, b2 = _check_decay("b1", b1, owner), _check_decay("b2", b2, owner)
    eps, eps_root = float(eps), float(eps_root)
    hyper = (b1, b2, eps, eps_root, bias_correction_mu, bias_correction_nu)

    def init_fn(params: Any) -> ScaleByAmsgradState:
        return _amsgrad_init(params, mu_dtype)

    def update_fn(updates, state, params=None, *, inplace=False):
        del params
        own_updates, own_state = donation(inplace)
        return _amsgrad_step(updates, state, *hyper, own_updates=own_updates, own_state=own_state)

    return GradientTransformation(init_fn, update_fn)


def _amsgrad_init(params: Any, mu_dtype: Optional[torch.dtype]) -> ScaleByAmsgradState:
    return ScaleByAmsgradState(
        count=fe.zero_count(params),
        mu=fe.zeros_like_tree(params, mu_dtype),
        nu=fe.zeros_like_tree(params),
        nu_max=fe.zeros_like_tree(params),
    )


def fused_amsgrad(
    learning_rate: ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    mu_dtype: Optional[torch.dtype] = None,
    bias_correction_mu: bool = True,
    bias_correction_nu: bool = True,
) -> GradientTransformation:
    """``chain(scale_by_amsgrad(...), scale_by_learning_rate(learning_rate))`` as one transformation,
    for :func:`gradtx.amsgrad`: that chain's state (a tuple ``(ScaleByAmsgradState, learning-rate
    state)``) and its numbers bit for bit. Eagerly, for float32 CPU tensors, one C kernel makes the
    step in one pass over memory, and a ``clip_by_global_norm`` before it in a :func:`~gradtx.chain`
    hands it its coefficient (see :func:`~gradtx.base.takes_scaled_gradients`)."""
    owner = "amsgrad"
    b1, b2 = _check_decay("b1", b1, owner), _check_decay("b2", b2, owner)
    hyper = (b1, b2, float(eps), float(eps_root), bias_correction_mu, bias_correction_nu)

    def step(updates, state, **how):
        return _amsgrad_step(updates, state, *hyper, owner=owner, **how)

    return with_learning_rate(lambda params: _amsgrad_init(params, mu_dtype), step, learning_rate, owner)


# --------------------------------------------------------------------------- AdaBelief


def scale_by_belief(
    b1: float = 0.9, b2: float = 0.999, eps: float = 1e-16, eps_root: float = 1e-16, *, nesterov: bool = False
) -> GradientTransformation:
    """AdaBelief (Zhuang et al., 2020): Adam with ``nu`` tracking ``(g - mu)^2 + eps_root``.

    As in optax, ``eps_root`` is added to the stored ``nu`` every step and the update is
    ``mu_hat / (sqrt(nu_hat) + eps)``.
    """
    owner = "scale_by_belief"
    b1, b2 = _check_decay("b1", b1, owner), _check_decay("b2", b2, owner)
    eps, eps_root = float(eps), float(eps_root)
    nesterov = bool(nesterov) and b1 != 0.0

    def init_fn(params: Any) -> ScaleByBeliefState:
        return ScaleByBeliefState(count=fe.zero_count(params), mu=fe.zeros_like_tree(params), nu=fe.zeros_like_tree(params))

    def update_fn(updates, state, params=None, *, inplace=False):
        del params
        leaves = fe.leaves_of(updates, what=owner)
        mu = leaves.aligned(state.mu, what=f"{owner}: state.mu")
        nu = leaves.aligned(state.nu, what=f"{owner}: state.nu")
        count = fe.increment(state.count, inplace=inplace)
        s = _adam_scalars(b1, b2, eps, 0.0, nesterov, count)

        def group(g, m, v):
            m = first_moment(m, g, b1, inplace=inplace)
            # The prediction error g - mu lands in the gradients' buffer unless Nesterov still needs g.
            error = fe.add(g, fe.cast(m, g[0].dtype), alpha=-1.0, inplace=inplace and not nesterov)
            v = second_moment(v, error, b2, inplace=inplace)
            v = fe.add(v, eps_root, inplace=True)
            # error is ours on both paths, so the denominator can overwrite it.
            numer = nesterov_numerator(g, m, fe.on(s.nesterov_ratio, g), inplace=inplace) if nesterov else m
            d = denominator(v, fe.on(s.eps, g), None, g[0].dtype, into=error)
            return fe.finish(divide(numer, nesterov, d, fe.on(s.step, g)), g), m, v

        grads = dtensor_lib.without_partial(leaves.tensors)  # DTensor cannot run its square root on a Partial error
        new_updates, new_mu, new_nu = fe.map_groups(group, grads, mu, nu, outputs=3, pack=not inplace)
        return leaves.rebuild(new_updates), ScaleByBeliefState(
            count=count, mu=leaves.rebuild(new_mu, like=state.mu), nu=leaves.rebuild(new_nu, like=state.nu)
        )

    return GradientTransformation(init_fn, update_fn)


# --------------------------------------------------------------------------- Adamax


def scale_by_adamax(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8) -> GradientTransformation:
    """Adamax (Kingma & Ba, 2014): ``mu_hat / nu`` with ``nu = max(b2 * nu, |g| + eps)``.

    The state is a :class:`ScaleByAdamState` (``nu`` holds the infinity-norm moment), as in optax.
    """
    owner = "scale_by_adamax"
    b1, b2, eps = _check_decay("b1", b1, owner), _check_decay("b2", b2, owner), float(eps)

    def init_fn(params: Any) -> ScaleByAdamState:
        return ScaleByAdamState(count=fe.zero_count(params), mu=fe.zeros_like_tree(params), nu=fe.zeros_like_tree(params))

    def update_fn(updates, state, params=None, *, inplace=False):
        del params
        leaves = fe.leaves_of(updates, what=owner)
        mu = leaves.aligned(state.mu, what=f"{owner}: state.mu")
        nu = leaves.aligned(state.nu, what=f"{owner}: state.nu")
        count = fe.increment(state.count, inplace=inplace)
        inv_bc1 = 1.0 / _correction(b1, count)

        def group(g, m, v):
            m = first_moment(m, g, b1, inplace=inplace)
            magnitude = fe.add(fe.abs(g, inplace=inplace), eps, inplace=True)
            v = fe.maximum(fe.mul(v, b2, inplace=inplace), fe.cast(magnitude, v[0].dtype), inplace=True)
            out = fe.div(fe.fresh(fe.cast(m, g[0].dtype), into=magnitude), fe.cast(v, g[0].dtype), inplace=True)
            return fe.finish(fe.mul(out, fe.on(inv_bc1, out), inplace=True), g), m, v

        new_updates, new_mu, new_nu = fe.map_groups(group, leaves.tensors, mu, nu, outputs=3, pack=not inplace)
        return leaves.rebuild(new_updates), ScaleByAdamState(
            count=count, mu=leaves.rebuild(new_mu, like=state.mu), nu=leaves.rebuild(new_nu, like=state.nu)
        )

    return GradientTransformation(init_fn, update_fn)


# --------------------------------------------------------------------------- RAdam


def scale_by_radam(
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    threshold: float = 5.0,
    *,
    nesterov: bool = False,
) -> GradientTransformation:
    """Rectified Adam (Liu et al., 2020): Adam scaled by the variance rectification ``r_t`` once the
    approximated SMA length ``rho_t`` reaches ``threshold``, plain ``mu_hat`` before (optax's rule).

    The choice is made with tensor ops on the step count, so it neither syncs nor recompiles.
    torch's ``RAdam`` switches at ``rho_t > 5`` instead of ``>= threshold``, which agrees for the
    default ``b2`` (``rho_t`` is never exactly 5 there).
    """
    owner = "scale_by_radam"
    b1, b2 = _check_decay("b1", b1, owner), _check_decay("b2", b2, owner)
    eps, eps_root, threshold = float(eps), float(eps_root), float(threshold)
    nesterov = bool(nesterov) and b1 != 0.0
    rho_inf = 2.0 / (1.0 - b2) - 1.0

    def init_fn(params: Any) -> ScaleByAdamState:
        return ScaleByAdamState(count=fe.zero_count(params), mu=fe.zeros_like_tree(params), nu=fe.zeros_like_tree(params))

    def update_fn(updates, state, params=None, *, inplace=False):
        del params
        leaves = fe.leaves_of(updates, what=owner)
        mu = leaves.aligned(state.mu, what=f"{owner}: state.mu")
        nu = leaves.aligned(state.nu, what=f"{owner}: state.nu")
        count = fe.increment(state.count, inplace=inplace)
        s = _adam_scalars(b1, b2, eps, eps_root, nesterov, count)
        b2_t = fe.decay_power(b2, count)
        t = count.to(torch.float64)
        rho = rho_inf - 2.0 * t * b2_t / (1.0 - b2_t)
        rectified = rho >= threshold
        r = torch.sqrt(((rho - 4.0) * (rho - 2.0) * rho_inf) / ((rho_inf - 4.0) * (rho_inf - 2.0) * rho))
        r = torch.where(rectified, r, 0.0)  # r is NaN while rho < 4, where it is not used

        def group(g, m, v):
            m = first_moment(m, g, b1, inplace=inplace)
            v = second_moment(v, g, b2, inplace=inplace)
            if nesterov:
                numer = nesterov_numerator(g, m, fe.on(s.nesterov_ratio, g), inplace=inplace)
                into = None
            else:
                numer, into = m, (g if inplace else None)
            mu_hat = fe.mul(fe.cast(numer, g[0].dtype), fe.on(s.hat, g), inplace=False)
            d = denominator(v, fe.on(s.eps, g), fe.on(s.root_shift, g), g[0].dtype, into=into)
            out = divide(numer, nesterov, d, fe.on(s.step * r, g))
            use_rectified = rectified.to(out[0].device)
            if tree_lib.needs_graph(out, mu_hat):
                out = [torch.where(use_rectified, o, plain) for o, plain in zip(out, mu_hat)]
            else:
                out = [o.copy_(torch.where(use_rectified, o, plain)) for o, plain in zip(out, mu_hat)]
            return fe.finish(out, g), m, v

        new_updates, new_mu, new_nu = fe.map_groups(group, leaves.tensors, mu, nu, outputs=3, pack=not inplace)
        return leaves.rebuild(new_updates), ScaleByAdamState(
            count=count, mu=leaves.rebuild(new_mu, like=state.mu), nu=leaves.rebuild(new_nu, like=state.nu)
        )

    return GradientTransformation(init_fn, update_fn)
