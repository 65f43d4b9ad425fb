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


def check_inner_fits(optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> None:
    """Raises ``ValueError`` when ``optimizer.load_state_dict(state_dict)`` would load something its
    next step cannot use, before anything is loaded.

    Checked: the param groups' number and sizes (as torch checks them), that every hyperparameter
    of ``optimizer.defaults`` is in each loaded group once the optimizer's own ``__setstate__`` has
    filled in what older checkpoints lack, that each loaded state entry holds every key the
    optimizer keeps for its parameter, and that each loaded state tensor has the shape the
    optimizer gives that entry. The expected shapes come from a probe: a copy of the optimizer, its
    parameters replaced by meta tensors and its groups by the loaded ones, stepped once on meta zero
    gradients (no memory, no compute). Where the probe cannot run (an optimizer that needs a closure
    or reads values on the host), the live state of the same parameter is the reference, if any.
    """
    groups = optimizer.param_groups
    saved_groups = state_dict.get("param_groups")
    if not isinstance(saved_groups, (list, tuple)) or not isinstance(state_dict.get("state"), dict):
        raise ValueError("wrap: an optimizer state dict needs a 'state' dict and a 'param_groups' list")
    if len(saved_groups) != len(groups):
        raise ValueError(f"wrap: the state dict has {len(saved_groups)} param groups, the optimizer {len(groups)}")
    for i, (group, saved) in enumerate(zip(groups, saved_groups)):
        if len(saved.get("params", ())) != len(group["params"]):
            raise ValueError(
                f"wrap: param group {i} of the state dict has {len(saved.get('params', ()))} parameters, "
                f"the optimizer's has {len(group['params'])}"
            )
    probe = _probe(optimizer, saved_groups)
    if probe is not None:
        for i, group in enumerate(probe.param_groups):
            missing = sorted(k for k in optimizer.defaults if k not in group)
            if missing:
                raise ValueError(
                    f"wrap: param group {i} of the state dict lacks the hyperparameter {missing[0]!r} "
                    f"of {type(optimizer).__name__}, which its step reads"
                )
    live_params = [p for group in groups for p in group["params"]]
    saved_ids = [pid for saved in saved_groups for pid in saved["params"]]
    probe_params = [p for group in probe.param_groups for p in group["params"]] if probe is not None else []
    for index, (pid, param) in enumerate(zip(saved_ids, live_params)):
        entry = state_dict["state"].get(pid)
        if not isinstance(entry, dict):
            continue
        expected = probe.state.get(probe_params[index], {}) if probe is not None else {}
        reference = expected or optimizer.state.get(param, {})
        absent = sorted(key for key in expected if key not in entry) if entry else []
        if absent:  # the inner optimizer's load would take it, and its step (or __setstate__) fail
            raise ValueError(
                f"wrap: the state dict's entry of parameter {index} (shape {tuple(param.shape)}) lacks {absent[0]!r}, "
                f"which {type(optimizer).__name__} keeps for it"
            )
        for key, value in entry.items():
            want = reference.get(key)
            if isinstance(value, Tensor) and isinstance(want, Tensor) and value.shape != want.shape:
                raise ValueError(
                    f"wrap: the state dict's {key!r} of parameter {index} (shape {tuple(param.shape)}) is "
                    f"{tuple(value.shape)}, where {type(optimizer).__name__} keeps {tuple(want.shape)}"
                )


def _probe(optimizer: torch.optim.Optimizer, saved_groups: Any) -> Optional[torch.optim.Optimizer]:
    """A copy of ``optimizer`` on meta parameters with the saved groups' hyperparameters, stepped once;
    None when it cannot be built or stepped."""
    import copy
    from collections import defaultdict

    params = [p for group in optimizer.param_groups for p in group["params"]]
    if not all(isinstance(p, Tensor) for p in params):
        return None
    metas = [torch.nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad) for p in params]
    memo: dict[int, Any] = {id(p): m for p, m in zip(params, metas)}
    memo[id(optimizer.state)] = defaultdict(dict)
    try:
        probe = copy.deepcopy(optimizer, memo)
        groups, start = [], 0
        for group, saved in zip(probe.param_groups, saved_groups):
            count = len(group["params"])
            hyper = {k: copy.deepcopy(v) for k, v in saved.items() if k not in ("params", STATE_KEY)}
            groups.append({**hyper, "params": metas[start : start + count]})
            start += count
        probe.__setstate__({"state": defaultdict(dict), "param_groups": groups})
    except Exception:  # noqa: BLE001 - an optimizer that cannot be copied this way is checked less
        return None
    for meta in metas:
        meta.grad = torch.zeros_like(meta)
    step = getattr(type(probe).step, "__wrapped__", type(probe).step)  # without torch's step hooks
    try:
        step(probe)
    except Exception:  # noqa: BLE001 - a step that reads a value on the host fails on meta tensors,
        pass  # usually after it made its state: the entries it made are the optimizer's own shapes
    return probe
