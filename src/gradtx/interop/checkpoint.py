"""Checkpoint glue for :class:`~gradtx.interop.wrap.ChainedOptimizer`: the transformation's state as
plain containers inside the optimizer's state dict, and the detection of
``torch.distributed.checkpoint``'s state initialisation."""

from __future__ import annotations

import inspect
import sys
from typing import Any, Optional

import torch
from torch import Tensor

from gradtx import tree as tree_lib

STATE_KEY = "gradtx"
"""The key, in the first param group of a :class:`ChainedOptimizer` state dict, of the transformation's state.

The state travels inside ``param_groups`` because that is the part of an optimizer state dict every
checkpointing API keeps: ``torch.distributed.checkpoint.state_dict.get_state_dict`` rebuilds the
state dict from ``state`` (keyed by parameter) and ``param_groups`` only, and maps every ``state``
key to a parameter name; a group's entries other than ``params`` pass through, and ``dcp.save``
stores the tensors in them as tensors.
"""


def to_plain(state: Any) -> dict[str, Any]:
    """The state's leaves keyed by path: tensors, ``None`` and numbers only (``weights_only`` loadable)."""
    leaves = tree_lib.leaves(state)
    out = {}
    for path, leaf in zip(tree_lib.paths(state), leaves):
        if not (leaf is None or isinstance(leaf, (Tensor, bool, int, float))):
            raise TypeError(f"wrap: state leaf {path!r} is a {type(leaf).__name__}, which a state dict cannot hold")
        out[path] = leaf
    return out


def split_chain_state(state_dict: dict[str, Any]) -> tuple[Optional[dict[str, Any]], dict[str, Any]]:
    """``(the transformation's saved state or None, the inner optimizer's state dict)``.

    Reads the first param group's ``STATE_KEY`` entry, or the top-level one older checkpoints have.
    """
    state_dict = dict(state_dict)
    saved = state_dict.pop(STATE_KEY, None)
    if isinstance(saved, dict) and "tx_state" in saved:
        saved = saved["tx_state"]
    groups = state_dict.get("param_groups")
    if groups and isinstance(groups[0], dict) and STATE_KEY in groups[0]:
        first = groups[0]
        groups = [{k: v for k, v in g.items() if k != STATE_KEY} if g is first or STATE_KEY in g else g for g in groups]
        saved = first[STATE_KEY]
        state_dict["param_groups"] = groups
    return saved, state_dict


def called_by_checkpoint(function: str) -> bool:
    """Whether a function of ``torch.distributed.checkpoint.state_dict`` is a few frames up the stack."""
    if torch.compiler.is_compiling():  # checkpoint APIs do not run under torch.compile; no frame walk there
        return False
    module = sys.modules.get("torch.distributed.checkpoint.state_dict")
    fn = getattr(module, function, None)
    code = getattr(inspect.unwrap(fn), "__code__", None) if fn is not None else None
    if code is None:
        return False
    frame = sys._getframe(2)
    for _ in range(6):
        if frame is None:
            return False
        if frame.f_code is code:
            return True
        frame = frame.f_back
    return False


def in_checkpoint_init_step() -> bool:
    """Whether ``step`` was called by ``torch.distributed.checkpoint``'s state initialisation.

    ``get_state_dict`` / ``set_state_dict`` call ``_init_optim_state``, which steps an optimizer
    whose ``state`` is empty once with zero gradients and a zero learning rate (the step hooks'
    wrapper sits between it and ``step`` on the stack).
    """
    return called_by_checkpoint("_init_optim_state")


def from_plain(saved: dict[str, Any], template: Any) -> Any:
    """``template`` with every leaf replaced by a copy of the saved leaf at the same path.

    Raises ``ValueError`` (before anything is changed) when a path, a shape, a dtype or a leaf's
    kind differs from ``template``'s.
    """
    if not isinstance(saved, dict):
        raise ValueError(f"wrap: the saved transformation state is a {type(saved).__name__}, expected a dict")
    template_leaves, treedef = tree_lib.flatten(template)
    paths = tree_lib.paths(template)
    missing = [p for p in paths if p not in saved]
    extra = [p for p in saved if p not in set(paths)]
    if missing or extra:
        what = f"lacks {missing[0]!r}" if missing else f"has {extra[0]!r}, which the transformation's state lacks"
        raise ValueError(f"wrap: the saved transformation state does not fit this transformation: it {what}")
    new = []
    for path, current in zip(paths, template_leaves):
        value = saved[path]
        if isinstance(current, Tensor) != isinstance(value, Tensor):
            raise ValueError(
                f"wrap: saved transformation state {path!r} is a {type(value).__name__}, "
                f"expected a {type(current).__name__}"
            )
        if isinstance(current, Tensor):
            if value.shape != current.shape or value.dtype != current.dtype:
                raise ValueError(
                    f"wrap: saved transformation state {path!r} is {tuple(value.shape)} {value.dtype}, "
                    f"expected {tuple(current.shape)} {current.dtype}"
                )
            value = value.to(device=current.device, copy=True)
        new.append(value)
    return tree_lib.unflatten(treedef, new)
