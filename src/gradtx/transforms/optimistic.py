"""Optimistic gradient descent (Daskalakis et al., 2018; Mokhtari et al., 2019), as in optax."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor

from gradtx import tree as tree_lib
from gradtx.base import GradientTransformation
from gradtx.transforms import _foreach as fe


class ScaleByOptimisticGradientState(NamedTuple):
    """``is_initial_step``: a 0-d bool tensor, true before the first step; ``previous_gradient``:
    the last updates seen, like the params."""

    is_initial_step: Tensor
    previous_gradient: Any


def scale_by_optimistic_gradient(alpha: float = 1.0, beta: float = 1.0) -> GradientTransformation:
    """``(alpha + beta) * g - beta * g_prev``, the previous gradient taken to be ``g`` at the first step.

    ``alpha``/``beta`` are numbers or 0-d tensors (as ``inject_hyperparams`` passes them).
    """
    owner = "scale_by_optimistic_gradient"
    alpha, beta = fe.number_or_tensor(alpha), fe.number_or_tensor(beta)

    def init_fn(params: Any) -> ScaleByOptimisticGradientState:
        return ScaleByOptimisticGradientState(
            is_initial_step=torch.ones((), dtype=torch.bool, device=tree_lib.first_device(params)),
            previous_gradient=fe.zeros_like_tree(params),
        )

    def update_fn(updates, state, params=None, *, inplace=False):
        del params
        leaves = fe.leaves_of(updates, what=owner)
        prev = leaves.aligned(state.previous_gradient, what=f"{owner}: state.previous_gradient")
        initial = state.is_initial_step

        def group(g, p):
            flag = initial.to(g[0].device)
            previous = [torch.where(flag, gi, pi.to(gi.dtype)) for gi, pi in zip(g, p)]
            out = fe.mul(g, fe.on(alpha + beta, g), inplace=False)
            out = fe.add(out, previous, alpha=-beta, inplace=True)
            new_prev = fe.copy_into(p, g) if inplace else [x.clone() for x in g]
            return (fe.copy_into(g, out) if inplace else out), new_prev

        new_updates, new_prev = fe.map_groups(group, leaves.tensors, prev, outputs=2)
        done = initial.fill_(False) if inplace else torch.zeros_like(initial)
        return leaves.rebuild(new_updates), ScaleByOptimisticGradientState(
            is_initial_step=done, previous_gradient=leaves.rebuild(new_prev, like=state.previous_gradient)
        )

    return GradientTransformation(init_fn, update_fn)
