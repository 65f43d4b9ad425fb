"""What the tests of gradtx's C kernels share: a bit-for-bit comparison and a clipped, applied run."""

from __future__ import annotations

import torch

import gradtx as gtx


def equal_bits(want: torch.Tensor, got: torch.Tensor) -> bool:
    """Same shape, dtype and values, NaN where NaN."""
    return want.shape == got.shape and want.dtype == got.dtype and bool(((want == got) | (want.isnan() & got.isnan())).all())


def applied(tx: gtx.GradientTransformation, params: dict, grads: dict, steps: int = 3) -> dict:
    """The params after ``steps`` steps of ``tx`` on the same ``grads``, each applied."""
    p, state = params, tx.init(params)
    for _ in range(steps):
        updates, state = tx.update(grads, state, p)
        p = gtx.apply_updates(p, updates)
    return p
