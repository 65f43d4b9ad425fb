"""Pieces the named optimizers share.
"""

from __future__ import annotations

from typing import Any, Optional

from gradtx.base import GradientTransformation, identity
from gradtx.transforms.momentum import trace


def _one(tx: GradientTransformation) -> GradientTransformation:
    """``tx`` as a single transformation, so an enclosing chain nests its state instead of splicing it."""

    def init_fn(params: Any):
        return tx.init(params)

    return type(tx)(init_fn, tx.update)


def _momentum(momentum: Optional[float], nesterov: bool) -> GradientTransformation:
    return trace(decay=momentum, nesterov=nesterov) if momentum is not None else identity()
