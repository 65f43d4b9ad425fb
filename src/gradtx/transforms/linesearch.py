"""Line searches: pick the step size along the incoming updates by evaluating the objective.

As optax's ``scale_by_backtracking_linesearch`` (sufficient decrease, Armijo) and
``scale_by_zoom_linesearch`` (strong Wolfe, Algorithms 3.5 and 3.6 of Nocedal and Wright, with
Hager and Zhang's approximate decrease near a minimum): same arguments, defaults, states and
decisions. Both are :class:`~gradtx.GradientTransformationExtraArgs` whose ``update`` takes

- ``value=``: the objective at ``params``,
- ``grad=``: its gradient at ``params`` (a tree shaped like them),
- ``value_fn=``: the objective, a torch function ``value_fn(params, **kwargs) -> 0-d tensor``,
- and any keyword argument ``value_fn`` takes (``x=``, ``y=``, a batch...), passed on to it.

The search itself runs eagerly: each trial point is evaluated, then a Python branch decides the
next, so a step of the search reads one number back from the device. Gradients of ``value_fn``
are taken with ``torch.autograd`` (``value_fn`` may call a module through
``torch.func.functional_call``). :func:`value_and_grad_from_state` reuses the value and gradient
the search computed at the accepted point, so a deterministic objective costs no extra pass.
"""

from __future__ import annotations

import inspect
import math
from typing import Any, Callable, NamedTuple, Optional

import numpy as np
import torch
from torch import Tensor

from gradtx import tree as tree_lib
from gradtx.base import GradientTransformationExtraArgs, unsharded_only

PyTree = Any


# --------------------------------------------------------------------------- tree arithmetic


def _vdot(a: PyTree, b: PyTree) -> Tensor:
    """``sum_i Re <a_i, b_i>`` over the leaves present in both (conjugated for complex leaves: the
    slope along ``a`` of a real objective whose gradient is ``b``), in float32 at least."""
    pairs = [(x, y) for x, y in zip(tree_lib.leaves(a), tree_lib.leaves(b)) if x is not None and y is not None]
    if not pairs:
        return torch.zeros((), dtype=torch.float64)
    dtype = tree_lib.accumulation_dtype([x.dtype for x, _ in pairs] + [y.dtype for _, y in pairs])
    device = pairs[0][0].device
    return sum(
        (tree_lib.real_inner(x, y, dtype).to(device) for x, y in pairs),
        torch.zeros((), dtype=dtype, device=device),
    )


def _add_scale(params: PyTree, stepsize: float, updates: PyTree) -> PyTree:
    """``params + stepsize * updates`` leaf by leaf, in the params' dtypes (``None`` updates: the param)."""

    def one(p, u):
        if u is None:
            return p
        return (p + stepsize * u.to(p.device)).to(p.dtype)

    return tree_lib.tree_map(one, params, updates)


def _scale(stepsize: Tensor, updates: PyTree) -> PyTree:
    return tree_lib.tree_map(lambda u: u * stepsize.to(u.device, u.dtype), updates)


def _value_dtype(params: PyTree) -> torch.dtype:
    """The dtype of the objective's values and step sizes: the first floating leaf's (the real
    dtype of a complex one: values are real)."""
    dtypes = tree_lib.real_dtypes(params)
    return dtypes[0] if dtypes else torch.get_default_dtype()


def _as_float(x: Any) -> float:
    return float(x.detach()) if isinstance(x, Tensor) else float(x)


def value_and_grad(value_fn: Callable[..., Any]) -> Callable[..., tuple[Tensor, PyTree]]:
    """``params, *args, **kwargs -> (value, grad)`` for a scalar torch function of a params tree.

    The gradient (with respect to the floating-point and complex leaves of ``params``, the first
    argument; for a complex leaf torch's conjugate Wirtinger gradient, the direction of steepest ascent) is
    taken with ``torch.autograd`` on detached copies, so it works on params that do not require
    grad and builds no graph into them. A leaf the value does not depend on gets a zero gradient;
    non-floating and ``None`` leaves get ``None``.
    """

    def fn(params: PyTree, *args: Any, **kwargs: Any) -> tuple[Tensor, PyTree]:
        leaves, treedef = tree_lib.flatten(params)
        differentiable = [i for i, x in enumerate(leaves) if isinstance(x, Tensor) and (x.is_floating_point() or x.is_complex())]
        with torch.enable_grad():
            inputs = [leaves[i].detach().requires_grad_(True) for i in differentiable]
            new_leaves = list(leaves)
            for i, x in zip(differentiable, inputs):
                new_leaves[i] = x
            value = value_fn(tree_lib.unflatten(treedef, new_leaves), *args, **kwargs)
            if not isinstance(value, Tensor) or value.numel() != 1:
                raise ValueError(f"value_fn must return a scalar tensor, got {type(value).__name__} {getattr(value, 'shape', '')}")
            grads = torch.autograd.grad(value.reshape(()), inputs, allow_unused=True) if inputs else ()
        grad_leaves: list[Any] = [None] * len(leaves)
        for i, x, g in zip(differentiable, inputs, grads):
            grad_leaves[i] = torch.zeros_like(x) if g is None else g.detach()
        return value.detach().reshape(()), tree_lib.unflatten(treedef, grad_leaves)

    return fn


def _extract_fn_kwargs(value_fn: Callable[..., Any], extra_args: dict[str, Any], owner: str) -> dict[str, Any]:
    """The extra arguments for ``value_fn``: each must be one it takes by name (or through its
    ``**kwargs``); any other one is a ``TypeError``, as in optax."""
    try:
        parameters = inspect.signature(value_fn).parameters.values()
    except (TypeError, ValueError):
        parameters = []
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return dict(extra_args)
    names = {p.name for p in parameters}
    unknown = sorted(k for k in extra_args if k not in names)
    if unknown:
        raise TypeError(
            f"{owner}.update: keyword arguments {unknown} are not arguments of value_fn; "
            "every extra keyword argument must be one value_fn takes"
        )
    return dict(extra_args)


# --------------------------------------------------------------------------- backtracking


class BacktrackingLinesearchInfo(NamedTuple):
    """``num_linesearch_steps``: evaluations of the objective in the last search (0-d int);
    ``decrease_error``: by how much the accepted step misses sufficient decrease (0 = it does not)."""

    num_linesearch_steps: Tensor
    decrease_error: Tensor


class ScaleByBacktrackingLinesearchState(NamedTuple):
    """As ``optax.ScaleByBacktrackingLinesearchState``.

    Attributes:
      learning_rate: the step size the last search accepted (0-d).
      value: the objective at the accepted point (``inf`` after ``init``).
      grad: its gradient there when ``store_grad``, else ``None``.
      info: a :class:`BacktrackingLinesearchInfo`.
    """

    learning_rate: Tensor
    value: Tensor
    grad: Optional[PyTree]
    info: BacktrackingLinesearchInfo


def scale_by_backtracking_linesearch(
    max_backtracking_steps: int,
    slope_rtol: float = 1e-4,
    decrease_factor: float = 0.8,
    increase_factor: float = 1.5,
    max_learning_rate: float = 1.0,
    atol: float = 0.0,
    rtol: float = 0.0,
    store_grad: bool = False,
    verbose: bool = False,
) -> GradientTransformationExtraArgs:
    r"""Backtracking line search: the largest tried step with sufficient decrease (Armijo).

    Accepts the step size :math:`\eta` when

    .. math:: f(w + \eta u) \le (1 + \text{rtol}) f(w) + \eta\, \text{slope\_rtol} \langle u, \nabla f(w)\rangle + \text{atol}

    Each search starts from ``min(increase_factor * previous step, max_learning_rate)`` and
    multiplies by ``decrease_factor`` until the criterion holds, for at most
    ``max_backtracking_steps`` reductions. If the last point's value is NaN or infinite, the step
    is 0. The updates are multiplied by the accepted step. ``u`` should be a descent direction
    (``<u, grad> < 0``): put this after ``sgd(1.0)`` or a preconditioner, for instance.

    Args:
      max_backtracking_steps: the most reductions of the step per search.
      slope_rtol: the fraction of the predicted decrease asked for.
      decrease_factor: the factor reducing the step.
      increase_factor: the factor growing the previous step into the next search's first guess.
      max_learning_rate: the largest step.
      atol, rtol: absolute and relative slack in the criterion.
      store_grad: also compute the gradient at the accepted point and keep it in the state, for
        :func:`value_and_grad_from_state`.
      verbose: print a diagnostic when a search fails.

    The ``update`` takes ``value=``, ``grad=``, ``value_fn=`` and ``value_fn``'s own keyword
    arguments (see the module docstring).
    """

    def init_fn(params: PyTree) -> ScaleByBacktrackingLinesearchState:
        dtype = _value_dtype(params)
        device = tree_lib.first_device(params)
        grad = tree_lib.tree_map(torch.zeros_like, params) if store_grad else None
        return ScaleByBacktrackingLinesearchState(
            learning_rate=torch.ones((), dtype=dtype, device=device),
            value=torch.full((), math.inf, dtype=dtype, device=device),
            grad=grad,
            info=BacktrackingLinesearchInfo(
                num_linesearch_steps=torch.zeros((), dtype=torch.int32, device=device),
                decrease_error=torch.full((), math.inf, dtype=dtype, device=device),
            ),
        )

    def decrease_error_of(stepsize: float, slope: float, value: float, new_value: float) -> float:
        error = new_value - (1.0 + rtol) * value - stepsize * slope_rtol * slope
        return math.inf if math.isnan(error) else max(error, 0.0)

    def update_fn(updates, state, params, *, inplace=False, value, grad, value_fn, **extra_args):
        del inplace
        fn_kwargs = _extract_fn_kwargs(value_fn, extra_args, "scale_by_backtracking_linesearch")
        slope = _as_float(_vdot(updates, grad))
        value0 = _as_float(value)
        learning_rate = min(increase_factor * _as_float(state.learning_rate), max_learning_rate)
        decrease_error, iter_num = math.inf, 0
        new_value: Any = value
        while not (decrease_error <= atol) and iter_num <= max_backtracking_steps:
            if iter_num > 0:
                learning_rate = decrease_factor * learning_rate
            with torch.no_grad():
                new_value = value_fn(_add_scale(params, learning_rate, updates), **fn_kwargs)
            decrease_error = decrease_error_of(learning_rate, slope, value0, _as_float(new_value))
            iter_num += 1
        new_grad = None
        if store_grad:
            new_value, new_grad = value_and_grad(value_fn)(_add_scale(params, learning_rate, updates), **fn_kwargs)
        if verbose and decrease_error > atol:
            print(
                "scale_by_backtracking_linesearch: no step with sufficient decrease found "
                f"(value {value0}, slope {slope}, step {learning_rate}, decrease error {decrease_error})"
            )
        final_rate = 0.0 if math.isinf(decrease_error) else learning_rate
        like = state.learning_rate
        new_learning_rate = torch.full((), final_rate, dtype=like.dtype, device=like.device)
        new_state = ScaleByBacktrackingLinesearchState(
            learning_rate=new_learning_rate,
            value=torch.as_tensor(new_value).detach().to(state.value.dtype).to(state.value.device).reshape(()),
            grad=new_grad,
            info=BacktrackingLinesearchInfo(
                num_linesearch_steps=torch.full((), iter_num, dtype=torch.int32, device=like.device),
                decrease_error=torch.full((), decrease_error, dtype=like.dtype, device=like.device),
            ),
        )
        return _scale(new_learning_rate, updates), new_state

    return GradientTransformationExtraArgs(init_fn, unsharded_only(update_fn, "scale_by_backtracking_linesearch", "the slope's inner product"))


# --------------------------------------------------------------------------- zoom


class ZoomLinesearchInfo(NamedTuple):
    """``num_linesearch_steps``: evaluations in the last search (0-d int); ``decrease_error`` and
    ``curvature_error``: by how much the accepted step misses sufficient decrease and small
    curvature (0 = it does not)."""

    num_linesearch_steps: Tensor
    decrease_error: Tensor
    curvature_error: Tensor


class ScaleByZoomLinesearchState(NamedTuple):
    """As ``optax.ScaleByZoomLinesearchState``.

    Attributes:
      learning_rate: the step size the last search accepted (0-d).
      value: the objective at the accepted point (``inf`` after ``init``).
      grad: its gradient there (zeros after ``init``).
      info: a :class:`ZoomLinesearchInfo`.
    """

    learning_rate: Tensor
    value: Tensor
    grad: PyTree
    info: ZoomLinesearchInfo


def _cubicmin(a, fa, fpa, b, fb, c, fc) -> float:
    """The critical point of the cubic through ``(a, fa)``, ``(b, fb)``, ``(c, fc)`` with slope ``fpa`` at ``a`` (NaN if none)."""
    with np.errstate(all="ignore"):
        a, fa, fpa, b, fb, c, fc = (np.float64(v) for v in (a, fa, fpa, b, fb, c, fc))
        db, dc = b - a, c - a
        denom = (db * dc) ** 2 * (db - dc)
        rhs0, rhs1 = fb - fa - fpa * db, fc - fa - fpa * dc
        big_a = (dc**2 * rhs0 - db**2 * rhs1) / denom
        big_b = (-(dc**3) * rhs0 + db**3 * rhs1) / denom
        radical = big_b * big_b - 3.0 * big_a * fpa
        return float(a + (-big_b + np.sqrt(radical)) / (3.0 * big_a))


def _quadmin(a, fa, fpa, b, fb) -> float:
    """The critical point of the parabola through ``(a, fa)``, ``(b, fb)`` with slope ``fpa`` at ``a``."""
    with np.errstate(all="ignore"):
        a, fa, fpa, b, fb = (np.float64(v) for v in (a, fa, fpa, b, fb))
        db = b - a
        curvature = (fb - fa - fpa * db) / (db**2)
        return float(a - fpa / (2.0 * curvature))


class _Point(NamedTuple):
    stepsize: float
    value: float
    slope: float


def scale_by_zoom_linesearch(
    max_linesearch_steps: int,
    max_learning_rate: Optional[float] = None,
    tol: float = 0.0,
    increase_factor: float = 2.0,
    slope_rtol: float = 1e-4,
    curv_rtol: float = 0.9,
    approx_dec_rtol: Optional[float] = 1e-6,
    stepsize_precision: float = 1e-5,
    initial_guess_strategy: str = "keep",
    verbose: bool = False,
) -> GradientTransformationExtraArgs:
    r"""Line search for a step with sufficient decrease and small curvature (strong Wolfe).

    Looks for :math:`\eta` with

    .. math::
        f(w + \eta u) \le f(w) + c_1 \eta \langle u, \nabla f(w) \rangle + \text{tol}, \qquad
        |\langle \nabla f(w + \eta u), u \rangle| \le c_2 |\langle \nabla f(w), u \rangle| + \text{tol}

    (``c_1 = slope_rtol``, ``c_2 = curv_rtol``): first grows the step by ``increase_factor`` until
    an interval holding such a step is found, then shrinks that interval by cubic, quadratic or
    bisection steps. Near a minimum, where values stop resolving the decrease, the decrease test
    switches to Hager and Zhang's approximate one on slopes (``approx_dec_rtol``; ``None`` turns
    it off). If no step satisfies both within ``max_linesearch_steps`` evaluations, the best one
    with sufficient decrease is taken, if any.

    Args:
      max_linesearch_steps: the most evaluations of the objective per search.
      max_learning_rate: the largest step (``None``: no bound).
      tol: slack in both criteria.
      increase_factor: the growth of the step while looking for an interval.
      slope_rtol: ``c_1``.
      curv_rtol: ``c_2``.
      approx_dec_rtol: the relative change of value below which the approximate decrease test
        may be used.
      stepsize_precision: an interval shorter than this ends the search, when some step with
        sufficient decrease is known.
      initial_guess_strategy: ``"keep"`` starts from the previous step (for SGD-like directions),
        ``"one"`` from 1 (for Newton-like directions such as L-BFGS's).
      verbose: print a diagnostic when a search fails.

    The ``update`` takes ``value=``, ``grad=``, ``value_fn=`` and ``value_fn``'s own keyword
    arguments; every evaluation computes the value and the gradient of ``value_fn``, and the
    state keeps both at the accepted point (see :func:`value_and_grad_from_state`).
    """
    if initial_guess_strategy not in ("one", "keep"):
        raise ValueError(f"scale_by_zoom_linesearch: unknown initial_guess_strategy {initial_guess_strategy!r}")

    def init_fn(params: PyTree) -> ScaleByZoomLinesearchState:
        dtype = _value_dtype(params)
        device = tree_lib.first_device(params)
        inf = torch.full((), math.inf, dtype=dtype, device=device)
        return ScaleByZoomLinesearchState(
            learning_rate=torch.ones((), dtype=dtype, device=device),
            value=inf,
            grad=tree_lib.tree_map(torch.zeros_like, params),
            info=ZoomLinesearchInfo(
                num_linesearch_steps=torch.zeros((), dtype=torch.int32, device=device),
                decrease_error=inf.clone(),
                curvature_error=inf.clone(),
            ),
        )

    def decrease_error_of(stepsize: float, value_step: float, slope_step: float, value_init: float, slope_init: float) -> float:
        with np.errstate(all="ignore"):
            error = np.float64(value_step) - value_init - slope_rtol * stepsize * slope_init
            if approx_dec_rtol is not None:
                approx = np.float64(slope_step) - (2 * slope_rtol - 1.0) * slope_init
                delta_values = np.float64(value_step) - value_init - approx_dec_rtol * abs(value_init)
                error = np.minimum(np.maximum(approx, delta_values), error)
            error = np.maximum(error, 0.0)
        return math.inf if np.isnan(error) else float(error)

    def curvature_error_of(slope_step: float, slope_init: float) -> float:
        with np.errstate(all="ignore"):
            error = np.maximum(np.abs(np.float64(slope_step)) - curv_rtol * abs(slope_init), 0.0)
        return math.inf if np.isnan(error) else float(error)

    def search(params, updates, value, grad, slope_init, stepsize_guess, value_and_grad_fn):
        """Returns ``(stepsize, value, grad, evaluations, decrease_error, curvature_error)``."""
        value_init = _as_float(value)

        def evaluate(stepsize: float):
            step_value, step_grad = value_and_grad_fn(_add_scale(params, stepsize, updates))
            return _as_float(step_value), step_value, step_grad, _as_float(_vdot(step_grad, updates))

        count = 0
        current = _Point(0.0, value_init, slope_init)
        current_value, current_grad = value, grad
        decrease_error = curvature_error = math.inf
        interval_found = done = failed = False
        low = high = cubic_ref = _Point(0.0, value_init, slope_init)
        safe_stepsize, safe_value, safe_value_t, safe_grad = 0.0, value_init, value, grad
        while not (done or failed):
            if not interval_found:  # Algorithm 3.5: grow the step until an interval is bracketed
                new_stepsize = stepsize_guess if count == 0 else increase_factor * current.stepsize
                max_reached = False
                if max_learning_rate is not None:
                    max_reached = new_stepsize >= max_learning_rate
                    new_stepsize = min(new_stepsize, max_learning_rate)
                new_value, new_value_t, new_grad, new_slope = evaluate(new_stepsize)
                decrease_error = decrease_error_of(new_stepsize, new_value, new_slope, value_init, slope_init)
                curvature_error = curvature_error_of(new_slope, slope_init)
                error = max(decrease_error, curvature_error)
                if decrease_error <= tol:
                    safe_stepsize, safe_value, safe_value_t, safe_grad = new_stepsize, new_value, new_value_t, new_grad
                set_high_to_new = decrease_error > 0.0 or (new_value >= current.value and count > 0)
                set_low_to_new = new_slope >= 0.0 and not set_high_to_new
                new = _Point(new_stepsize, new_value, new_slope)
                low, high = (new, current) if set_low_to_new else (current, new)
                cubic_ref = low
                interval_found = set_high_to_new or set_low_to_new or error <= tol
                done = error <= tol or (max_reached and not interval_found)
                failed = count + 1 >= max_linesearch_steps and not done
                current, current_value, current_grad = new, new_value_t, new_grad
            else:  # Algorithm 3.6: shrink the interval [low, high]
                delta = abs(high.stepsize - low.stepsize)
                left, right = min(high.stepsize, low.stepsize), max(high.stepsize, low.stepsize)
                too_small = delta <= stepsize_precision
                middle_cubic = _cubicmin(
                    low.stepsize, low.value, low.slope, high.stepsize, high.value, cubic_ref.stepsize, cubic_ref.value
                )
                middle_quad = _quadmin(low.stepsize, low.value, low.slope, high.stepsize, high.value)
                if left + 0.2 * delta < middle_cubic < right - 0.2 * delta:
                    middle_stepsize = middle_cubic
                elif left + 0.1 * delta < middle_quad < right - 0.1 * delta:
                    middle_stepsize = middle_quad
                else:
                    middle_stepsize = (low.stepsize + high.stepsize) / 2.0
                new_value, new_value_t, new_grad, new_slope = evaluate(middle_stepsize)
                decrease_error = decrease_error_of(middle_stepsize, new_value, new_slope, value_init, slope_init)
                curvature_error = curvature_error_of(new_slope, slope_init)
                error = max(decrease_error, curvature_error)
                if decrease_error <= tol and new_value < safe_value:
                    safe_stepsize, safe_value, safe_value_t, safe_grad = middle_stepsize, new_value, new_value_t, new_grad
                done = error <= tol
                middle = _Point(middle_stepsize, new_value, new_slope)
                set_high_to_middle = decrease_error > 0.0 or new_value >= low.value
                set_high_to_low = new_slope * (high.stepsize - low.stepsize) >= 0.0 and not set_high_to_middle
                old_low, old_high = low, high
                if set_high_to_middle:
                    high = middle
                elif set_high_to_low:
                    high = old_low
                if not set_high_to_middle:
                    low = middle
                cubic_ref = old_high if (set_high_to_middle or set_high_to_low) else old_low
                failed = (count + 1 >= max_linesearch_steps or (too_small and safe_stepsize > 0.0)) and not done
                current, current_value, current_grad = middle, new_value_t, new_grad
            count += 1
            if failed:  # fall back on the best step with sufficient decrease, if any
                outside_domain = math.isinf(decrease_error)
                if verbose:
                    print(
                        "scale_by_zoom_linesearch: no step satisfying both criteria found "
                        f"(value {value_init}, slope {slope_init}, step {current.stepsize}, "
                        f"decrease error {decrease_error}, curvature error {curvature_error}); "
                        + (f"taking step {safe_stepsize} with sufficient decrease" if safe_stepsize > 0.0 else "")
                    )
                if safe_stepsize > 0.0 or outside_domain:
                    current = _Point(safe_stepsize, safe_value, current.slope)
                    current_value, current_grad = safe_value_t, safe_grad
        return current.stepsize, current_value, current_grad, count, decrease_error, curvature_error

    def update_fn(updates, state, params, *, inplace=False, value, grad, value_fn, **extra_args):
        del inplace
        fn_kwargs = _extract_fn_kwargs(value_fn, extra_args, "scale_by_zoom_linesearch")
        evaluate = value_and_grad(value_fn)
        stepsize_guess = 1.0 if initial_guess_strategy == "one" else _as_float(state.learning_rate)
        slope_init = _as_float(_vdot(updates, grad))
        stepsize, new_value, new_grad, count, decrease_error, curvature_error = search(
            params,
            updates,
            torch.as_tensor(value),
            grad,
            slope_init,
            stepsize_guess,
            lambda p: evaluate(p, **fn_kwargs),
        )
        like = state.learning_rate
        learning_rate = torch.full((), stepsize, dtype=like.dtype, device=like.device)
        new_state = ScaleByZoomLinesearchState(
            learning_rate=learning_rate,
            value=torch.as_tensor(new_value).detach().to(device=state.value.device, dtype=state.value.dtype).reshape(()),
            grad=tree_lib.tree_map(lambda g, old: g.detach().to(old.dtype), new_grad, state.grad),
            info=ZoomLinesearchInfo(
                num_linesearch_steps=torch.full((), count, dtype=torch.int32, device=like.device),
                decrease_error=torch.full((), decrease_error, dtype=like.dtype, device=like.device),
                curvature_error=torch.full((), curvature_error, dtype=like.dtype, device=like.device),
            ),
        )
        return _scale(learning_rate, updates), new_state

    return GradientTransformationExtraArgs(init_fn, unsharded_only(update_fn, "scale_by_zoom_linesearch", "the slopes' inner products"))


# --------------------------------------------------------------------------- reuse


def _find_fields(node: Any, name: str, found: list[Any]) -> None:
    if isinstance(node, tuple) and hasattr(node, "_fields"):
        if name in node._fields:
            found.append(getattr(node, name))
        children = list(node)
    elif isinstance(node, dict):
        children = list(node.values())
    elif isinstance(node, (tuple, list)):
        children = list(node)
    else:
        return
    for child in children:
        _find_fields(child, name, found)


def _unique_field(state: Any, name: str) -> Any:
    found: list[Any] = []
    _find_fields(state, name, found)
    if len(found) != 1:
        raise ValueError(
            f"value_and_grad_from_state: the state holds {len(found)} fields named {name!r}, expected exactly one "
            "(a line search that keeps the value and gradient it computed)"
        )
    return found[0]


def value_and_grad_from_state(value_fn: Callable[..., Any]) -> Callable[..., tuple[Tensor, PyTree]]:
    """Like :func:`value_and_grad`, but reuses the value and gradient a line search kept in its state.

    Returns ``fn(params, *args, state, **kwargs) -> (value, grad)``. ``state`` (the whole optimizer
    state) must hold exactly one NamedTuple field ``value`` and one ``grad`` (the state of
    :func:`scale_by_zoom_linesearch`, or of :func:`scale_by_backtracking_linesearch` with
    ``store_grad=True``); else a ``ValueError``. When the stored value is finite they are returned
    as they are (they were computed at the params the last step moved to); otherwise (after
    ``init``) ``value_fn(params, *args, **kwargs)`` and its gradient are computed.
    """
    compute = value_and_grad(value_fn)

    def fn(params: PyTree, *args: Any, state: Any, **kwargs: Any) -> tuple[Tensor, PyTree]:
        value = _unique_field(state, "value")
        grad = _unique_field(state, "grad")
        if value is None or grad is None:
            raise ValueError(
                "value_and_grad_from_state: the state's value or grad is None "
                "(a backtracking line search keeps its gradient only with store_grad=True)"
            )
        if bool(torch.isfinite(torch.as_tensor(value))):
            return value, grad
        return compute(params, *args, **kwargs)

    return fn
