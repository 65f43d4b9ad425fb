"""Optimizers that use the objective itself, through the extra arguments (``value=``, ``grad=``,
``value_fn=``): L-BFGS with a zoom line search, and SGD with Polyak's step size.

Each optimizer is the chain optax builds, with that chain's tuple state; ``learning_rate`` is a
number, a 0-d tensor or a schedule (a callable of the 0-d step count), and an optimizer inside
another ``chain`` keeps its own tuple state.
"""

from __future__ import annotations

from typing import Optional

from gradtx.base import GradientTransformation, GradientTransformationExtraArgs, identity, takes_spec
from gradtx.chains.chain import chain
from gradtx.optimizers.sgd_like import sgd
from gradtx.transforms.lbfgs import scale_by_lbfgs
from gradtx.transforms.linesearch import scale_by_zoom_linesearch
from gradtx.transforms.polyak import scale_by_polyak
from gradtx.sharding import ShardingSpec
from gradtx.transforms.scaling import ScalarOrSchedule, scale, scale_by_learning_rate


def lbfgs(
    learning_rate: Optional[ScalarOrSchedule] = None,
    memory_size: int = 10,
    scale_init_precond: bool = True,
    linesearch: Optional[GradientTransformation] = scale_by_zoom_linesearch(
        max_linesearch_steps=20, initial_guess_strategy="one"
    ),
) -> GradientTransformationExtraArgs:
    """L-BFGS: quasi-Newton steps from the last few gradient differences, with a line search.

    The direction is the gradient times the L-BFGS estimate of the inverse Hessian, built by the
    two-loop recursion from the last ``memory_size`` pairs of parameter and gradient
    differences (on top of a scaled identity); it is negated and, by default, given its length
    by a zoom line search that looks for a step satisfying the strong Wolfe conditions, starting
    from 1: ``chain(scale_by_lbfgs(...), scale(-1) or scale_by_learning_rate(learning_rate),
    linesearch)``. ``update`` then takes ``value=``, ``grad=`` and ``value_fn=`` (and
    ``value_fn``'s own keyword arguments), and :func:`gradtx.value_and_grad_from_state` hands
    back the value and gradient the search computed at the point it accepted.
    ``linesearch=None`` gives fixed steps and a transformation that needs no extra arguments.

    Args:
      learning_rate: scales the direction before the line search: a number, a 0-d tensor, a
        schedule called with the step count, or ``None`` (the default, as in optax), which is
        ``scale(-1)``, a learning rate of 1: the chain still negates the direction, so the
        params descend, and the line search (if any) chooses the step's length.
      memory_size: the number of past pairs of differences kept.
      scale_init_precond: start the estimate from ``gamma * I``, ``gamma`` the curvature of the
        newest pair (``<dw, dg> / ||dg||^2``), rather than from ``I``.
      linesearch: the transformation applied last, a line search taking ``value=``, ``grad=``
        and ``value_fn=`` (by default :func:`~gradtx.scale_by_zoom_linesearch` with 20 steps,
        starting from a step of 1); ``None`` for none.

    Returns:
      The optimizer, a :class:`~gradtx.GradientTransformationExtraArgs`.

    References:
      Liu & Nocedal, `On the limited memory BFGS method for large scale optimization
      <https://doi.org/10.1007/BF01589116>`_, Mathematical Programming, 1989

      Nocedal & Wright, `Numerical Optimization <https://doi.org/10.1007/978-0-387-40065-5>`_
      (Algorithms 3.5, 3.6 and 7.4), Springer, 2006

    Examples:
      >>> import torch
      >>> import gradtx as gtx
      >>> def f(params):  # Rosenbrock's valley, smallest at (1, 1)
      ...     x, y = params["x"], params["y"]
      ...     return (1 - x) ** 2 + 10 * (y - x**2) ** 2
      >>> params = {"x": torch.tensor(-1.0, dtype=torch.float64), "y": torch.tensor(1.5, dtype=torch.float64)}
      >>> tx = gtx.lbfgs()
      >>> state = tx.init(params)
      >>> value_and_grad = gtx.value_and_grad_from_state(f)
      >>> for _ in range(5):
      ...     value, grads = value_and_grad(params, state=state)
      ...     updates, state = tx.update(grads, state, params, value=value, grad=grads, value_fn=f)
      ...     params = gtx.apply_updates(params, updates)
      ...     print(f"{f(params):.4f}")
      4.9304
      4.6765
      4.6449
      4.5070
      1.7067
    """
    base_scaling = scale(-1.0) if learning_rate is None else scale_by_learning_rate(learning_rate)
    return chain(
        scale_by_lbfgs(memory_size=memory_size, scale_init_precond=scale_init_precond),
        base_scaling,
        identity() if linesearch is None else linesearch,
    )


@takes_spec
def polyak_sgd(
    max_learning_rate: float = 1.0,
    scaling: ScalarOrSchedule = 1.0,
    f_min: float = 0.0,
    eps: float = 0.0,
    variant: str = "sps",
    *,
    spec: Optional[ShardingSpec] = None,
) -> GradientTransformationExtraArgs:
    """SGD with Polyak's step size: the step that would reach the optimal value on a linear model.

    With the updates ``u = -scaling * g`` of ``sgd(learning_rate=scaling)``, the step is
    ``min((f(x) - f_min) / (||u||^2 + eps), max_learning_rate)`` times ``u``: the gap to the
    lowest value, over the squared norm, capped. ``update`` takes ``value=``, the objective at
    the current params. ``f_min`` must be a lower bound of the objective (0 for a model that
    can interpolate its data); ``variant="sps+"`` clips the gap at 0 from below. As in optax:
    ``chain(sgd(learning_rate=scaling), scale_by_polyak(...))``.

    Args:
      max_learning_rate: the largest step allowed.
      scaling: the learning rate of the ``sgd`` the step multiplies: a number, a 0-d tensor or
        a schedule.
      f_min: a lower bound of the objective, ``f*``.
      eps: added to the squared norm in the denominator.
      variant: ``"sps"`` (the paper's SPS_max) or ``"sps+"`` (the gap clipped at 0).
      spec: how the gradients are sharded (a :class:`gradtx.sharding.ShardingSpec`): the norm is
        then that of the logical gradient, so every rank takes the same step; ``value`` must then be
        the whole objective on every rank. DTensor gradients need no spec.

    Returns:
      The optimizer, a :class:`~gradtx.GradientTransformationExtraArgs` whose ``update`` takes
      ``value=``.

    References:
      Loizou, Vaswani, Laradji & Lacoste-Julien, `Stochastic Polyak Step-size for SGD: An
      Adaptive Learning Rate for Fast Convergence <https://arxiv.org/abs/2002.10542>`_,
      AISTATS, 2021

    Examples:
      >>> import torch
      >>> import gradtx as gtx
      >>> def f(params):  # a quadratic, smallest at w = 0 where it is 0
      ...     return (params["w"] ** 2).sum()
      >>> params = {"w": torch.tensor([1.0, 2.0, 3.0])}
      >>> tx = gtx.polyak_sgd()
      >>> state = tx.init(params)
      >>> for _ in range(5):
      ...     value, grads = f(params), torch.func.grad(f)(params)
      ...     updates, state = tx.update(grads, state, params, value=value)
      ...     params = gtx.apply_updates(params, updates)
      ...     print(f"{f(params):.4f}")
      3.5000
      0.8750
      0.2188
      0.0547
      0.0137
    """
    return chain(
        sgd(learning_rate=scaling),
        scale_by_polyak(max_learning_rate=max_learning_rate, f_min=f_min, eps=eps, variant=variant, spec=spec),
    )
