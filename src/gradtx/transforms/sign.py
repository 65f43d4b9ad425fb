"""Sign-based and step-size-adaptive transforms: ``scale_by_sign`` (signSGD) and ``scale_by_rprop``."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from gradtx import tree as tree_lib
from gradtx.base import GradientTransformation, init_empty_state
from gradtx.state_signs import nonnegative
from gradtx.transforms import _foreach as fe


def scale_by_sign() -> GradientTransformation:
    """Replaces every update by its sign (``-1``, ``0`` or ``+1``), as optax's ``scale_by_sign``."""

    def update_fn(updates, state, params=None, *, inplace=False):
        del params
        leaves = fe.leaves_of(updates, what="scale_by_sign")
        (signs,) = fe.map_groups(lambda g: (fe.sign(g, inplace=inplace),), leaves.tensors, outputs=1)
        return leaves.rebuild(signs), state

    return GradientTransformation(init_empty_state, update_fn)


@nonnegative("step_sizes")
class ScaleByRpropState(NamedTuple):
    """``step_sizes``: the per-element step sizes; ``prev_updates``: ``step_size * sign(g)`` of the
    last step (zero where the gradient changed sign), like the params."""

    step_sizes: Any
    prev_updates: Any


def scale_by_rprop(
    learning_rate: float,
    eta_minus: float = 0.5,
    eta_plus: float = 1.2,
    min_step_size: float = 1e-6,
    max_step_size: float = 50.0,
) -> GradientTransformation:
    """Rprop's sign-driven step sizes, with optax's definition and state.

    With ``s = g * prev_updates``: each step size is multiplied by ``eta_plus`` where ``s > 0`` and
    by ``eta_minus`` where ``s < 0`` (then clipped to ``[min_step_size, max_step_size]``), and kept
    where ``s == 0``; ``prev_updates`` becomes ``step_size * sign(g)``, zero where ``s < 0``.

    As in optax, the update returned is the *previous* step's ``prev_updates`` (zero where ``s < 0``),
    so the first update is zero and the search lags one step behind the state. torch's
    ``Rprop`` takes ``-prev_updates`` of the current step: ``state.prev_updates`` after each step is
    exactly the negated step ``torch.optim.Rprop`` takes on the same gradients.
    """
    owner = "scale_by_rprop"
    learning_rate = float(learning_rate)
    eta_minus, eta_plus = float(eta_minus), float(eta_plus)
    min_step_size, max_step_size = float(min_step_size), float(max_step_size)

    def init_fn(params: Any) -> ScaleByRpropState:
        tree_lib.refuse_complex(params, owner=owner, why="Rprop compares the signs of successive gradients")
        return ScaleByRpropState(step_sizes=fe.full_like_tree(params, learning_rate), prev_updates=fe.zeros_like_tree(params))

    def update_fn(updates, state, params=None, *, inplace=False):
        del params
        leaves = fe.leaves_of(updates, what=owner)
        steps = leaves.aligned(state.step_sizes, what=f"{owner}: state.step_sizes")
        prevs = leaves.aligned(state.prev_updates, what=f"{owner}: state.prev_updates")
        outs, new_steps, new_prevs = [], [], []
        for g, step, prev in zip(leaves.tensors, steps, prevs):
            s = g * prev.to(g.dtype)
            grown = torch.clamp(torch.where(s > 0, step * eta_plus, step * eta_minus), min_step_size, max_step_size)
            new_step = torch.where(s == 0, step, grown)
            new_prev = torch.where(s < 0, 0.0, new_step * torch.sign(g).to(new_step.dtype))
            out = torch.where(s < 0, 0.0, prev).to(g.dtype)
            if inplace:
                new_step, new_prev, out = step.copy_(new_step), prev.copy_(new_prev), g.copy_(out)
            outs.append(out)
            new_steps.append(new_step)
            new_prevs.append(new_prev)
        return leaves.rebuild(outs), ScaleByRpropState(
            step_sizes=leaves.rebuild(new_steps, like=state.step_sizes),
            prev_updates=leaves.rebuild(new_prevs, like=state.prev_updates),
        )

    return GradientTransformation(init_fn, update_fn)


__all__ = ["ScaleByRpropState", "scale_by_rprop", "scale_by_sign"]
