"""Pieces the named optimizers share.
"""

from __future__ import annotations

from typing import Any, Optional

from gradtx.base import GradientTransformation, identity, kept_whole
from gradtx.transforms.momentum import trace


def _one(tx: GradientTransformation) -> GradientTransformation:
    """``tx`` as a single transformation, so an enclosing chain nests its state instead of splicing it."""

    def init_fn(params: Any):
        return tx.init(params)

    return type(tx)(kept_whole(init_fn, tx), tx.update)


def _momentum(momentum: Optional[float], nesterov: bool) -> GradientTransformation:
    return trace(decay=momentum, nesterov=nesterov) if momentum is not None else identity()


def check_learning_rate(learning_rate: Any, owner: str) -> None:
    """Refuses ``learning_rate=None`` where the signature does not take it.

    ``scale_by_learning_rate(None)`` is the identity, so an optimizer built on it would silently
    return the unscaled direction, which ``apply_updates`` adds: the params would climb. Only the
    optimizers whose signatures say so (``adadelta``, ``adafactor``, ``lbfgs``, as in optax) take
    ``None``, and each documents what it does.
    """
    if learning_rate is None:
        raise TypeError(f"{owner}: learning_rate must be a number, a 0-d tensor or a schedule, got None")


def check_number_learning_rate(learning_rate: Any, owner: str, *, instead: str = "") -> None:
    """Refuses ``None`` and schedules where the learning rate must be a number or a 0-d tensor.

    optax types these learning rates ``float`` (``rprop``'s initial step sizes, ``sm3``'s
    constant scale, ``optimistic_adam``'s optimism): a schedule would otherwise fail later with
    an error that names neither the optimizer nor the argument. ``instead`` says what takes a
    schedule.
    """
    if learning_rate is None:
        raise TypeError(f"{owner}: learning_rate must be a number or a 0-d tensor, got None")
    if callable(learning_rate):
        hint = f" ({instead})" if instead else ""
        raise TypeError(f"{owner}: learning_rate must be a number or a 0-d tensor, got a schedule{hint}")
