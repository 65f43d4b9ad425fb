"""Optimizers that use the objective itself, through the extra arguments (``value=``, ``grad=``,
``value_fn=``): L-BFGS with a zoom line search, and SGD with Polyak's step size.

Each optimizer is the chain optax builds, with that chain's tuple state; ``learning_rate`` is a
number or a schedule (a callable of the 0-d step count), and an optimizer inside another ``chain``
keeps its own tuple state.
"""

from __future__ import annotations

from typing import Optional

from gradtx.base import GradientTransformation, GradientTransformationExtraArgs, identity
from gradtx.chains.chain import chain
from gradtx.optimizers.sgd_like import sgd
from gradtx.transforms.lbfgs import scale_by_lbfgs
from gradtx.transforms.linesearch import scale_by_zoom_linesearch
from gradtx.transforms.polyak import scale_by_polyak
from gradtx.transforms.scaling import ScalarOrSchedule, scale, scale_by_learning_rate


def lbfgs(
    learning_rate: Optional[ScalarOrSchedule] = None,
    memory_size: int = 10,
    scale_init_precond: bool = True,
    linesearch: Optional[GradientTransformation] = scale_by_zoom_linesearch(
        max_linesearch_steps=20, initial_guess_strategy="one"
    ),
) -> GradientTransformationExtraArgs:
    """L-BFGS: ``chain(scale_by_lbfgs(...), scale(-1) or scale_by_learning_rate(lr), linesearch)``.

    By default the step size comes from a zoom line search (strong Wolfe conditions) started at 1,
    so ``update`` takes ``value=``, ``grad=`` and ``value_fn=`` (and ``value_fn``'s own keyword
    arguments); :func:`gradtx.value_and_grad_from_state` reuses the value and gradient the search
    computed at the accepted point. ``linesearch=None`` gives a fixed step (``learning_rate``, or
    1 when it is ``None``) and a transformation that needs no extra arguments.

    Args:
      learning_rate: a fixed step or schedule; ``None`` leaves the step to the line search.
      memory_size: the number of past differences kept (see :func:`gradtx.scale_by_lbfgs`).
      scale_init_precond: scale the initial inverse-Hessian estimate.
      linesearch: the line search (or any transformation) applied last; ``None`` for none.
    """
    base_scaling = scale(-1.0) if learning_rate is None else scale_by_learning_rate(learning_rate)
    return chain(
        scale_by_lbfgs(memory_size=memory_size, scale_init_precond=scale_init_precond),
        base_scaling,
        identity() if linesearch is None else linesearch,
    )


def polyak_sgd(
    max_learning_rate: float = 1.0,
    scaling: ScalarOrSchedule = 1.0,
    f_min: float = 0.0,
    eps: float = 0.0,
    variant: str = "sps",
) -> GradientTransformationExtraArgs:
    r"""SGD with Polyak's step size (Loizou et al., 2021): ``chain(sgd(scaling), scale_by_polyak(...))``.

    The step is :math:`\min\{(f(x) - f^\star) / (\|u\|^2 + \epsilon), \gamma_{\max}\}` for the
    updates :math:`u = -s\,\nabla f(x)` that ``sgd(learning_rate=scaling)`` hands on, as in optax.
    ``update`` takes ``value=``, the objective at the current params. ``f_min`` must be a lower
    bound of the objective (0 for a model that interpolates its data); ``variant="sps+"`` clips the
    gap at 0.
    """
    return chain(
        sgd(learning_rate=scaling),
        scale_by_polyak(max_learning_rate=max_learning_rate, f_min=f_min, eps=eps, variant=variant),
    )
