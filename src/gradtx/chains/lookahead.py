"""Lookahead (Zhang et al., 2019): a slow copy of the parameters pulled toward the fast ones every
``sync_period`` steps, as optax's ``lookahead`` with its ``LookaheadParams`` and ``LookaheadState``."""

from __future__ import annotations

import logging
from typing import Any, NamedTuple

import torch
from torch import Tensor

from gradtx import tree as tree_lib
from gradtx.base import GradientTransformation, with_inplace, runs_inner
from gradtx.chains._select import counter, where_tree

PyTree = Any
_LOG = logging.getLogger(__name__)


class LookaheadState(NamedTuple):
    """``fast_state``: the fast optimizer's state; ``steps_since_sync``: 0-d int32."""

    fast_state: Any
    steps_since_sync: Tensor


class LookaheadParams(NamedTuple):
    """The fast and the slow parameters, two trees of the same structure."""

    fast: Any
    slow: Any

    @classmethod
    def init_synced(cls, params: PyTree) -> "LookaheadParams":
        """A pair of synchronised parameters: fast and slow both start as copies of ``params``."""
        return cls(fast=tree_lib.tree_map(torch.clone, params), slow=tree_lib.tree_map(torch.clone, params))


def lookahead(
    fast_optimizer: GradientTransformation, sync_period: int, slow_step_size: float, reset_state: bool = False
) -> GradientTransformation:
    """Wraps ``fast_optimizer``: ``params`` and the returned updates are :class:`LookaheadParams`.

    Between synchronisations the fast parameters take the fast optimizer's steps and the slow ones
    stay. On every ``sync_period``-th step, with ``d = fast + update - slow``, the slow parameters
    move by ``slow_step_size * d`` and the fast ones land on the new slow ones; with
    ``reset_state`` the fast optimizer's state is re-initialised there. Apply the updates with
    ``apply_updates(params, updates)``; the gradients are those of the fast parameters.
    """
    if sync_period < 1:
        raise ValueError(f"lookahead: sync_period must be >= 1, got {sync_period!r}")
    slow_step_size = float(slow_step_size)
    fast_update = with_inplace(fast_optimizer)

    def init_fn(params: PyTree) -> LookaheadState:
        fast = getattr(params, "fast", None)
        if fast is None:
            _LOG.warning("lookahead: params has no attribute `fast`; initialising on params as the fast parameters")
            fast = params
        return LookaheadState(fast_state=fast_optimizer.init(fast), steps_since_sync=counter(fast))

    def update_fn(updates, state, params=None, *, inplace=False):
        if not isinstance(params, LookaheadParams):
            raise ValueError("lookahead: params must be LookaheadParams (use LookaheadParams.init_synced(params))")
        updates, fast_state = fast_update(updates, state.fast_state, params.fast, inplace=inplace)
        sync = state.steps_since_sync == sync_period - 1
        update_leaves, treedef = tree_lib.flatten(updates)
        fast_leaves = tree_lib.flatten_like(
            params.fast, treedef, updates, what="lookahead: params.fast", like="updates"
        )
        slow_leaves = tree_lib.flatten_like(
            params.slow, treedef, updates, what="lookahead: params.slow", like="updates"
        )
        fast_out, slow_out = [], []
        for u, f, s in zip(update_leaves, fast_leaves, slow_leaves):
            if u is None:
                fast_out.append(None)
                slow_out.append(None)
                continue
            flag = sync.to(u.device)
            difference = f + u - s
            slow_out.append(torch.where(flag, slow_step_size * difference, 0.0).to(u.dtype))
            fast_out.append(torch.where(flag, u - (1.0 - slow_step_size) * difference, u).to(u.dtype))
        if reset_state:
            fast_state = where_tree(sync, fast_optimizer.init(params.fast), fast_state, what="lookahead")
        steps = torch.remainder(state.steps_since_sync + 1, sync_period)
        return LookaheadParams(
            fast=tree_lib.unflatten(treedef, fast_out), slow=tree_lib.unflatten(treedef, slow_out)
        ), LookaheadState(fast_state, steps)

    return GradientTransformation(init_fn, runs_inner(update_fn, fast_optimizer))
