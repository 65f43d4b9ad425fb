"""Adam variants from optax.contrib: ADOPT, AdEMAMix, simplified AdEMAMix and ACProp.

Names, arguments, defaults and states are optax.contrib's; each ``scale_by_*`` keeps optax's state
NamedTuple (ADOPT and ACProp reuse ``ScaleByAdamState`` and ``ScaleByBeliefState``). Step-dependent
factors (bias corrections, ADOPT's first-step switch and clipping bound, scheduled ``b3``/``alpha``)
are 0-d tensors computed from the counters, never read on the host.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional, Union

import torch
from torch import Tensor

from gradtx import tree as tree_lib
from gradtx.base import GradientTransformation
from gradtx.chains import chain
from gradtx.numerics import ScalarOrSchedule
from gradtx.optimizers._common import check_learning_rate
from gradtx.state_signs import nonnegative
from gradtx.transforms import _foreach as fe
from gradtx.transforms.adam import ScaleByAdamState, ScaleByBeliefState
from gradtx.transforms.scaling import scale_by_learning_rate
from gradtx.transforms.weight_decay import add_decayed_weights


def _inv_correction(decay: float, count: Tensor) -> Tensor:
    """``1 / (1 - decay ** count)`` (float64, 0-d)."""
    return 1.0 / (1.0 - fe.decay_power(decay, count))


def _value(hyperparameter: Any, count: Tensor) -> Union[float, Tensor]:
    """A hyperparameter that may be a schedule, at ``count``."""
    if callable(hyperparameter):
        return fe.schedule_value(hyperparameter, count)
    return fe.number_or_tensor(hyperparameter)


def _second_moment(nu: list[Tensor], g: list[Tensor], decay: Any, *, inplace: bool) -> list[Tensor]:
    """``decay * nu + (1 - decay) * |g|^2`` (``decay`` a number or a 0-d tensor)."""
    nu = fe.mul(nu, fe.on(decay, nu), inplace=inplace)
    return fe.add_squares(nu, fe.cast(g, nu[0].dtype), fe.on(1.0 - decay, nu), inplace=True)


def _rms_denominator(nu: list[Tensor], inv_bc: Tensor, eps: float, eps_root: float, dtype: torch.dtype) -> list[Tensor]:
    """``sqrt(nu / bc + eps_root) + eps`` in new tensors of ``dtype``."""
    d = fe.mul(fe.cast(nu, dtype), fe.on(inv_bc, nu), inplace=False)
    if eps_root:
        d = fe.add(d, eps_root, inplace=True)
    return fe.add(fe.sqrt(d, inplace=True), eps, inplace=True)


def _clamp(xs: list[Tensor], bound: Tensor) -> list[Tensor]:
    """``clip(xs, -bound, bound)`` for a 0-d tensor ``bound``, in place into our own ``xs`` where no
    graph is recorded."""
    bound = fe.on(bound, xs)
    if tree_lib.needs_graph(xs, bound):
        return [torch.clamp(x, -bound, bound) for x in xs]
    return [x.clamp_(-bound, bound) for x in xs]


# --------------------------------------------------------------------------- ADOPT


def _adopt_clip_value(count: Tensor) -> Tensor:
    """ADOPT's default clipping bound ``count ** 0.25`` (in float64)."""
    return torch.as_tensor(count).to(torch.float64) ** 0.25


def scale_by_adopt(
    b1: float = 0.9,
    b2: float = 0.9999,
    eps: float = 1e-6,
    mu_dtype: Optional[torch.dtype] = None,
    *,
    nesterov: bool = False,
    use_clipping: bool = True,
    clip_value_fn: Callable[[Tensor], Any] = _adopt_clip_value,
) -> GradientTransformation:
    """Rescales updates as ADOPT (Taniguchi et al., 2024): the gradient is normalised by the second
    moment of the *previous* steps, then averaged into the momentum.

    At step ``t`` (``t = 0`` first): ``u = clip(g / max(sqrt(nu), eps), -c(t), c(t))`` with the old
    ``nu``; ``mu = b1 * mu + (1 - b1) * u``; ``nu = b2 * nu + (1 - b2) * g^2``; the update is ``mu``
    (``b1 * mu + (1 - b1) * u`` with ``nesterov``). The first step only initialises ``nu = g^2``
    and its update is zero. ``c = clip_value_fn(count)`` (``count ** 0.25`` by default) bounds the
    normalised gradient when ``use_clipping`` (a number is a fixed bound). State:
    :class:`~gradtx.transforms.ScaleByAdamState`.
    """
    b1, b2, eps = float(b1), float(b2), float(eps)

    def init_fn(params: Any) -> ScaleByAdamState:
        if use_clipping:
            tree_lib.refuse_complex(params, owner="scale_by_adopt", why="its clipping needs ordered numbers (use_clipping=False has a complex form)")
        return ScaleByAdamState(
            count=fe.zero_count(params), mu=fe.zeros_like_tree(params, mu_dtype), nu=fe.zeros_like_tree(params)
        )

    def update_fn(updates, state, params=None, *, inplace=False):
        del params
        leaves = fe.leaves_of(updates, what="scale_by_adopt")
        mu = leaves.aligned(state.mu, what="scale_by_adopt: state.mu")
        nu = leaves.aligned(state.nu, what="scale_by_adopt: state.nu")
        later = (state.count > 0).to(torch.float64)
        b1_t = 1.0 - (1.0 - b1) * later  # 1 on the first step: mu stays 0
        b2_t = b2 * later  # 0 on the first step: nu = g^2
        bound = None
        if use_clipping:  # (a number is taken as a fixed bound: inject_hyperparams passes the bound's value)
            value = clip_value_fn(state.count) if callable(clip_value_fn) else clip_value_fn
            bound = fe.as_scalar_tensor(value, state.count)

        def group(g, m, v):
            d = fe.clamp_min(fe.sqrt(fe.cast(v, g[0].dtype), inplace=False), eps, inplace=True)
            u = fe.div_into(g, d)
            if bound is not None:
                u = _clamp(u, bound)
            v = _second_moment(v, g, b2_t, inplace=inplace)
            # the momentum step in the wider of mu_dtype and the gradients' dtype (the direction is
            # taken before mu is rounded to mu_dtype, as in optax)
            stored = m[0].dtype
            m = fe.cast(m, torch.promote_types(stored, u[0].dtype))
            m = fe.lerp(m, fe.cast(u, m[0].dtype), fe.on(1.0 - b1_t, m), inplace=inplace)
            if nesterov:
                out = fe.lerp(u, fe.cast(m, u[0].dtype), fe.on(b1_t, u), inplace=True)
            else:
                out = [x.to(dtype=g[0].dtype, copy=True) for x in m]  # updates never alias the state
            return fe.finish(out, g), fe.cast(m, stored), v

        new_updates, new_mu, new_nu = fe.map_groups(group, leaves.tensors, mu, nu, outputs=3)
        count = fe.increment(state.count, inplace=inplace)
        new_state = ScaleByAdamState(
            count=count, mu=leaves.rebuild(new_mu, like=state.mu), nu=leaves.rebuild(new_nu, like=state.nu)
        )
        return leaves.rebuild(new_updates), new_state

    return GradientTransformation(init_fn, update_fn)


def adopt(
    learning_rate: ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.9999,
    eps: float = 1e-6,
    mu_dtype: Optional[torch.dtype] = None,
    *,
    nesterov: bool = False,
    use_clipping: bool = True,
    clip_value_fn: Callable[[Tensor], Any] = _adopt_clip_value,
) -> GradientTransformation:
    """ADOPT: Adam that normalises by the previous steps' second moment, then takes momentum.

    At step ``t``, the gradient is divided by the root of the second moment of the steps before
    it (floored at ``eps``), ``u = g / max(sqrt(nu), eps)``, clipped to
    ``[-c(t), c(t)]``; then ``mu = b1 * mu + (1 - b1) * u``,
    ``nu = b2 * nu + (1 - b2) * g^2``, and the update is ``-learning_rate * mu``. Leaving the
    current gradient out of its own denominator, and normalising before the momentum, makes
    the method converge for any ``b2``, where Adam needs ``b2`` tuned to the problem. The first
    step only sets ``nu = g^2`` and its update is zero. See :func:`scale_by_adopt`.

    Args:
      learning_rate: the step size: a number, a 0-d tensor, or a schedule called with the step
        count (see :mod:`gradtx.schedules`).
      b1: the decay rate of the momentum of the normalised gradients.
      b2: the decay rate of the second moment.
      eps: the floor of ``sqrt(nu)`` in the division.
      mu_dtype: the dtype of the momentum's buffer (``None``: the params' dtype).
      nesterov: use Nesterov's momentum: the update is ``b1 * mu + (1 - b1) * u``.
      use_clipping: clip the normalised gradient (the paper's stabilised version).
      clip_value_fn: the clipping bound ``c`` as a function of the step count (``count^0.25``
        by default), or a number for a fixed bound.

    Returns:
      The optimizer, a :class:`~gradtx.GradientTransformation`.

    References:
      Taniguchi et al., `ADOPT: Modified Adam Can Converge with Any beta2 with the Optimal Rate
      <https://arxiv.org/abs/2411.02853>`_, NeurIPS, 2024

    Examples:
      >>> import torch
      >>> import gradtx as gtx
      >>> def f(params):  # a quadratic, smallest at w = 0
      ...     return (params["w"] ** 2).sum()
      >>> params = {"w": torch.tensor([1.0, 2.0, 3.0])}
      >>> tx = gtx.contrib.adopt(learning_rate=0.1)
      >>> state = tx.init(params)
      >>> for _ in range(5):
      ...     grads = torch.func.grad(f)(params)
      ...     updates, state = tx.update(grads, state, params)
      ...     params = gtx.apply_updates(params, updates)
      ...     print(f"{f(params):.4f}")
      14.0000
      13.8803
      13.6551
      13.3390
      12.9465
    """
    check_learning_rate(learning_rate, "adopt")
    return chain(
        scale_by_adopt(
            b1, b2, eps, mu_dtype, nesterov=nesterov, use_clipping=use_clipping, clip_value_fn=clip_value_fn
        ),
        scale_by_learning_rate(learning_rate),
    )


# --------------------------------------------------------------------------- AdEMAMix


@nonnegative("nu")
class ScaleByAdemamixState(NamedTuple):
    """``count``: steps (0-d int32) for the fast EMA and the second moment; ``count_m2``: steps for
    the slow EMA and the schedules of ``b3`` and ``alpha``; ``m1``, ``m2``: fast and slow EMAs of
    the gradients; ``nu``: EMA of their squares."""

    count: Tensor
    count_m2: Tensor
    m1: Any
    m2: Any
    nu: Any


def scale_by_ademamix(
    b1: float = 0.9,
    b2: float = 0.999,
    b3: ScalarOrSchedule = 0.9999,
    alpha: ScalarOrSchedule = 6.0,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    mu_dtype: Optional[torch.dtype] = None,
) -> GradientTransformation:
    """Rescales updates as AdEMAMix (Pagliardini et al., 2024): Adam's numerator plus ``alpha``
    times a slow EMA of the gradients.

    ``m1 = b1 * m1 + (1 - b1) * g``, ``m2 = b3 * m2 + (1 - b3) * g``, ``nu = b2 * nu + (1 - b2) *
    g^2``; the update is ``(m1 / bc1 + alpha * m2) / (sqrt(nu / bc2 + eps_root) + eps)`` (``m2``
    is not bias-corrected). ``b3`` and ``alpha`` may be schedules of ``count_m2``. ``mu_dtype``
    sets the dtype of all three moments, as in optax.
    """
    b1, b2, eps, eps_root = float(b1), float(b2), float(eps), float(eps_root)

    def init_fn(params: Any) -> ScaleByAdemamixState:
        zeros = lambda: fe.zeros_like_tree(params, mu_dtype)  # noqa: E731
        return ScaleByAdemamixState(
            count=fe.zero_count(params), count_m2=fe.zero_count(params), m1=zeros(), m2=zeros(), nu=zeros()
        )

    def update_fn(updates, state, params=None, *, inplace=False):
        del params
        leaves = fe.leaves_of(updates, what="scale_by_ademamix")
        m1 = leaves.aligned(state.m1, what="scale_by_ademamix: state.m1")
        m2 = leaves.aligned(state.m2, what="scale_by_ademamix: state.m2")
        nu = leaves.aligned(state.nu, what="scale_by_ademamix: state.nu")
        b3_t, alpha_t = _value(b3, state.count_m2), _value(alpha, state.count_m2)
        count = fe.increment(state.count, inplace=inplace)
        count_m2 = fe.increment(state.count_m2, inplace=inplace)
        inv_bc1, inv_bc2 = _inv_correction(b1, count), _inv_correction(b2, count)

        def group(g, a, b, v):
            a = fe.lerp(a, fe.cast(g, a[0].dtype), 1.0 - b1, inplace=inplace)
            b = fe.lerp(b, fe.cast(g, b[0].dtype), fe.on(1.0 - b3_t, b), inplace=inplace)
            v = _second_moment(v, g, b2, inplace=inplace)
            numer = fe.mul(fe.cast(a, g[0].dtype), fe.on(inv_bc1, g), inplace=False)
            numer = fe.add(numer, fe.cast(b, g[0].dtype), alpha=fe.on(alpha_t, g), inplace=True)
            out = fe.div(numer, _rms_denominator(v, inv_bc2, eps, eps_root, g[0].dtype), inplace=True)
            return out, a, b, v

        new_updates, new_m1, new_m2, new_nu = fe.map_groups(group, leaves.tensors, m1, m2, nu, outputs=4)
        new_state = ScaleByAdemamixState(
            count=count,
            count_m2=count_m2,
            m1=leaves.rebuild(new_m1, like=state.m1),
            m2=leaves.rebuild(new_m2, like=state.m2),
            nu=leaves.rebuild(new_nu, like=state.nu),
        )
        return leaves.rebuild(new_updates), new_state

    return GradientTransformation(init_fn, update_fn)


def ademamix(
    learning_rate: ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    b3: ScalarOrSchedule = 0.9999,
    alpha: ScalarOrSchedule = 5.0,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    mu_dtype: Optional[torch.dtype] = None,
    weight_decay: ScalarOrSchedule = 0.0,
    mask: Any = None,
) -> GradientTransformation:
    """AdEMAMix: Adam whose numerator adds a slow moving average of the gradients.

    ``m1 = b1 * m1 + (1 - b1) * g`` (fast), ``m2 = b3 * m2 + (1 - b3) * g`` (slow, not
    bias-corrected), ``nu = b2 * nu + (1 - b2) * g^2``, and the update is
    ``-learning_rate * ((m1_hat + alpha * m2) / (sqrt(nu_hat + eps_root) + eps) + weight_decay * param)``.
    With ``b3`` near 1 the slow average remembers gradients from tens of thousands of steps
    back, which the paper finds still useful. The paper warms ``alpha`` and ``b3`` up with
    schedules (a large ``b3`` is unstable early); both take one here, as in optax, called with
    the step count. See :func:`scale_by_ademamix`.

    Args:
      learning_rate: the step size: a number, a 0-d tensor, or a schedule called with the step
        count (see :mod:`gradtx.schedules`).
      b1: the decay rate of the fast moving average.
      b2: the decay rate of the second moment.
      b3: the decay rate of the slow moving average: a number, a 0-d tensor or a schedule.
      alpha: the weight of the slow average in the numerator: a number, a 0-d tensor or a
        schedule.
      eps: added to the square root of the second moment.
      eps_root: added to the second moment inside the square root.
      mu_dtype: the dtype of all three moments' buffers (``None``: the params' dtype), as in
        optax.
      weight_decay: the rate of the decoupled weight decay: each step also subtracts
        ``learning_rate * weight_decay * param``. A number, a 0-d tensor or a schedule.
      mask: the leaves to decay: a tree of bools like the params (or a prefix of it), or a
        callable ``params -> such a tree``; ``None`` decays every leaf.

    Returns:
      The optimizer, a :class:`~gradtx.GradientTransformation`.

    References:
      Pagliardini, Ablin & Grangier, `The AdEMAMix Optimizer: Better, Faster, Older
      <https://arxiv.org/abs/2409.03137>`_, 2024

    Examples:
      >>> import torch
      >>> import gradtx as gtx
      >>> def f(params):  # a quadratic, smallest at w = 0
      ...     return (params["w"] ** 2).sum()
      >>> params = {"w": torch.tensor([1.0, 2.0, 3.0])}
      >>> tx = gtx.contrib.ademamix(learning_rate=0.1, alpha=gtx.linear_schedule(0.0, 5.0, 100))
      >>> state = tx.init(params)
      >>> for _ in range(5):
      ...     grads = torch.func.grad(f)(params)
      ...     updates, state = tx.update(grads, state, params)
      ...     params = gtx.apply_updates(params, updates)
      ...     print(f"{f(params):.4f}")
      12.8300
      11.7218
      10.6764
      9.6942
      8.7756
    """
    check_learning_rate(learning_rate, "ademamix")
    return chain(
        scale_by_ademamix(b1, b2, b3, alpha, eps, eps_root, mu_dtype),
        add_decayed_weights(weight_decay, mask),
        scale_by_learning_rate(learning_rate),
    )


@nonnegative("n")
class ScaleBySimplifiedAdEMAMixState(NamedTuple):
    """``t``: steps so far (0-d int32); ``m``: the (undamped) sum ``b1 * m + g``; ``n``: the EMA of
    the squared gradients."""

    t: Tensor
    m: Any
    n: Any


def scale_by_simplified_ademamix(
    b1: float = 0.99,
    b2: float = 0.95,
    alpha: ScalarOrSchedule = 0.0,
    eps: float = 1e-8,
    eps_root: float = 0.0,
) -> GradientTransformation:
    """Rescales updates as simplified AdEMAMix (Morwani et al., 2025): one momentum buffer.

    ``m = b1 * m + g`` (no ``1 - b1`` damping), ``n = b2 * n + (1 - b2) * g^2``; the update is
    ``(m + alpha * g) / (sqrt(n / bc2 + eps_root) + eps)``. ``alpha`` may be a schedule of ``t``.
    """
    b1, b2, eps, eps_root = float(b1), float(b2), float(eps), float(eps_root)

    def init_fn(params: Any) -> ScaleBySimplifiedAdEMAMixState:
        # optax squares a complex g as g * g here, not as |g|^2
        tree_lib.refuse_complex(params, owner="scale_by_simplified_ademamix", why="its second moment is defined for real numbers")
        return ScaleBySimplifiedAdEMAMixState(
            t=fe.zero_count(params), m=fe.zeros_like_tree(params), n=fe.zeros_like_tree(params)
        )

    def update_fn(updates, state, params=None, *, inplace=False):
        del params
        leaves = fe.leaves_of(updates, what="scale_by_simplified_ademamix")
        m = leaves.aligned(state.m, what="scale_by_simplified_ademamix: state.m")
        n = leaves.aligned(state.n, what="scale_by_simplified_ademamix: state.n")
        alpha_t = _value(alpha, state.t)
        t = fe.increment(state.t, inplace=inplace)
        inv_bc2 = _inv_correction(b2, t)

        def group(g, a, v):
            a = fe.add(fe.mul(a, b1, inplace=inplace), fe.cast(g, a[0].dtype), inplace=True)
            v = _second_moment(v, g, b2, inplace=inplace)
            numer = fe.add(fe.cast(a, g[0].dtype), g, alpha=fe.on(alpha_t, g), inplace=False)
            out = fe.div(numer, _rms_denominator(v, inv_bc2, eps, eps_root, g[0].dtype), inplace=True)
            return out, a, v

        new_updates, new_m, new_n = fe.map_groups(group, leaves.tensors, m, n, outputs=3)
        new_state = ScaleBySimplifiedAdEMAMixState(
            t=t, m=leaves.rebuild(new_m, like=state.m), n=leaves.rebuild(new_n, like=state.n)
        )
        return leaves.rebuild(new_updates), new_state

    return GradientTransformation(init_fn, update_fn)


def simplified_ademamix(
    learning_rate: ScalarOrSchedule,
    b1: float = 0.99,
    b2: float = 0.95,
    alpha: ScalarOrSchedule = 0.0,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    weight_decay: ScalarOrSchedule = 0.0,
    mask: Any = None,
) -> GradientTransformation:
    """Simplified AdEMAMix: one undamped momentum buffer plus a weighted current gradient.

    ``m = b1 * m + g`` (no ``1 - b1`` damping), ``n = b2 * n + (1 - b2) * g^2`` and the update is
    ``-learning_rate * ((m + alpha * g) / (sqrt(n_hat + eps_root) + eps) + weight_decay * param)``:
    AdEMAMix's long memory from a single buffer, with no schedule needed for ``alpha``. With
    ``alpha = 0`` it is Adam up to a rescaling of the learning rate and ``b1``. See
    :func:`scale_by_simplified_ademamix`.

    Args:
      learning_rate: the step size: a number, a 0-d tensor, or a schedule called with the step
        count (see :mod:`gradtx.schedules`).
      b1: the decay of the undamped momentum.
      b2: the decay rate of the second moment.
      alpha: the weight of the current gradient added to the momentum: a number, a 0-d tensor or
        a schedule.
      eps: added to the square root of the second moment.
      eps_root: added to the second moment inside the square root.
      weight_decay: the rate of the decoupled weight decay: each step also subtracts
        ``learning_rate * weight_decay * param``. A number, a 0-d tensor or a schedule.
      mask: the leaves to decay: a tree of bools like the params (or a prefix of it), or a
        callable ``params -> such a tree``; ``None`` decays every leaf.

    Returns:
      The optimizer, a :class:`~gradtx.GradientTransformation`.

    References:
      Morwani et al., `Connections between Schedule-Free Optimizers, AdEMAMix, and Accelerated
      SGD Variants <https://arxiv.org/abs/2502.02431>`_, 2025

    Examples:
      >>> import torch
      >>> import gradtx as gtx
      >>> def f(params):  # a quadratic, smallest at w = 0
      ...     return (params["w"] ** 2).sum()
      >>> params = {"w": torch.tensor([1.0, 2.0, 3.0])}
      >>> tx = gtx.contrib.simplified_ademamix(learning_rate=0.01, b1=0.9, alpha=2.0)
      >>> state = tx.init(params)
      >>> for _ in range(5):
      ...     grads = torch.func.grad(f)(params)
      ...     updates, state = tx.update(grads, state, params)
      ...     params = gtx.apply_updates(params, updates)
      ...     print(f"{f(params):.4f}")
      13.6427
      13.1880
      12.6532
      12.0543
      11.4068
    """
    check_learning_rate(learning_rate, "simplified_ademamix")
    return chain(
        scale_by_simplified_ademamix(b1, b2, alpha, eps, eps_root),
        add_decayed_weights(weight_decay, mask),
        scale_by_learning_rate(learning_rate),
    )


# --------------------------------------------------------------------------- ACProp


def scale_by_acprop(
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-16,
    eps_root: float = 1e-16,
) -> GradientTransformation:
    """Rescales updates as ACProp (Zhuang et al., 2021): AdaBelief's centred second moment, taken
    asynchronously (the denominator uses the steps before the current gradient).

    ``mu = b1 * mu + (1 - b1) * g``, ``nu = b2 * nu + (1 - b2) * |g - mu_old|^2 + eps_root``; the
    update is ``g / (sqrt(nu_old / (1 - b2^(t-1))) + eps)``, and ``g / (1 + eps)`` on the first
    step, as optax computes it. State: :class:`~gradtx.transforms.ScaleByBeliefState`.
    """
    b1, b2, eps, eps_root = float(b1), float(b2), float(eps), float(eps_root)

    def init_fn(params: Any) -> ScaleByBeliefState:
        return ScaleByBeliefState(count=fe.zero_count(params), mu=fe.zeros_like_tree(params), nu=fe.zeros_like_tree(params))

    def update_fn(updates, state, params=None, *, inplace=False):
        del params
        leaves = fe.leaves_of(updates, what="scale_by_acprop")
        mu = leaves.aligned(state.mu, what="scale_by_acprop: state.mu")
        nu = leaves.aligned(state.nu, what="scale_by_acprop: state.nu")
        first = (state.count == 0).to(torch.float64)
        # nu_hat = nu / (1 - b2^count), and exactly 1 on the first step (where count is taken as 1)
        inv_bc = (1.0 - first) * _inv_correction(b2, torch.clamp(state.count, min=1))

        def group(g, m, v):
            d = fe.mul(fe.cast(v, g[0].dtype), fe.on(inv_bc, g), inplace=False)
            d = fe.add(fe.sqrt(fe.add(d, fe.on(first, g), inplace=True), inplace=True), eps, inplace=True)
            error = fe.add(fe.cast(g, m[0].dtype), m, alpha=-1.0, inplace=False)
            m = fe.lerp(m, fe.cast(g, m[0].dtype), 1.0 - b1, inplace=inplace)
            v = fe.add_squares(fe.mul(v, b2, inplace=inplace), error, 1.0 - b2, inplace=True)
            v = fe.add(v, eps_root, inplace=True)
            out = fe.div_into(g, d)
            return out, m, v

        new_updates, new_mu, new_nu = fe.map_groups(group, leaves.tensors, mu, nu, outputs=3)
        count = fe.increment(state.count, inplace=inplace)
        new_state = ScaleByBeliefState(
            count=count, mu=leaves.rebuild(new_mu, like=state.mu), nu=leaves.rebuild(new_nu, like=state.nu)
        )
        return leaves.rebuild(new_updates), new_state

    return GradientTransformation(init_fn, update_fn)


def acprop(
    learning_rate: ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-16,
    eps_root: float = 1e-16,
    weight_decay: ScalarOrSchedule = 0.0,
    mask: Any = None,
) -> GradientTransformation:
    """ACProp: AdaBelief's centred second moment, used asynchronously.

    ``mu = b1 * mu + (1 - b1) * g`` and ``nu = b2 * nu + (1 - b2) * |g - mu_old|^2 + eps_root``,
    the spread of the gradients around their mean; the gradient is divided by the root of the
    spread of the steps *before* it, ``g / (sqrt(nu_old / (1 - b2^(t-1))) + eps)``
    (``g / (1 + eps)`` on the first step), and the update is ``-learning_rate`` times that plus
    ``weight_decay * param``, as optax computes it. Keeping the current gradient out of its own
    denominator (the "asynchronous" update) is what lets the paper prove convergence under weaker
    conditions than Adam's. See :func:`scale_by_acprop`.

    Args:
      learning_rate: the step size: a number, a 0-d tensor, or a schedule called with the step
        count (see :mod:`gradtx.schedules`).
      b1: the decay rate of the moving average of the gradients.
      b2: the decay rate of the spread around it.
      eps: added to the square root of the spread.
      eps_root: added to the spread at every step.
      weight_decay: the rate of the decoupled weight decay: each step also subtracts
        ``learning_rate * weight_decay * param``. A number, a 0-d tensor or a schedule.
      mask: the leaves to decay: a tree of bools like the params (or a prefix of it), or a
        callable ``params -> such a tree``; ``None`` decays every leaf.

    Returns:
      The optimizer, a :class:`~gradtx.GradientTransformation`.

    References:
      Zhuang et al., `Momentum Centering and Asynchronous Update for Adaptive Gradient Methods
      <https://arxiv.org/abs/2110.05454>`_, NeurIPS, 2021

    Examples:
      >>> import torch
      >>> import gradtx as gtx
      >>> def f(params):  # a quadratic, smallest at w = 0
      ...     return (params["w"] ** 2).sum()
      >>> params = {"w": torch.tensor([1.0, 2.0, 3.0])}
      >>> tx = gtx.contrib.acprop(learning_rate=0.1)
      >>> state = tx.init(params)
      >>> for _ in range(5):
      ...     grads = torch.func.grad(f)(params)
      ...     updates, state = tx.update(grads, state, params)
      ...     params = gtx.apply_updates(params, updates)
      ...     print(f"{f(params):.4f}")
      8.9600
      8.2112
      7.4304
      6.6656
      5.9348
    """
    check_learning_rate(learning_rate, "acprop")
    return chain(
        scale_by_acprop(b1, b2, eps, eps_root),
        add_decayed_weights(weight_decay, mask),
        scale_by_learning_rate(learning_rate),
    )
