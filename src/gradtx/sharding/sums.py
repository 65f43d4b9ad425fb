"""Exact global sums of per-element quantities: inner products, squared norms and L1 norms over a
whole (possibly sharded) tree, several at once, in one collective.

``global_sums(fn, *trees, spec=spec)`` calls ``fn`` on each leaf's tensors (this rank's piece of
the leaf in every tree) for a 1-D tensor of partial sums, and adds them up over the *logical*
trees: each distinct element counted once, as :func:`gradtx.sharding.global_norm` counts it (the
pieces a rank owns enter; copies and duplicates do not), with one all-reduce over the same group.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from gradtx import tree as tree_lib
from gradtx.sharding import dtensor as dtensor_lib
from gradtx.sharding import waiting
from gradtx.sharding.plan import plan_for
from gradtx.sharding.reductions import _check_spec, is_sharded
from gradtx.sharding.spec import ShardingSpec


def global_sums(fn: Callable[..., Tensor], *trees: Any, spec: Optional[ShardingSpec] = None, what: str = "global_sums") -> Tensor:
    """``sum over leaves of fn(*leaf_tensors)``: a 1-D tensor of ``k`` exact sums over the logical trees.

    ``trees[0]`` sets the layout (its leaves are matched by ``spec`` or are DTensors); the other
    trees are shaped like it (parameters, states). Leaves where ``trees[0]`` is ``None`` are left
    out. Without a spec and without DTensors this is the local sum and records a graph (it is
    differentiable); under sharding, each rank adds ``fn`` over the pieces it owns and one SUM
    all-reduce (float64) runs over the group a global norm uses, so every rank gets the same sums.
    The result has ``fn``'s dtype.
    """
    if not trees:
        raise ValueError(f"{what}: no tree given")
    _check_spec(spec, what)
    first, treedef, present = tree_lib.tensor_leaves(trees[0], what=what)
    others = [
        tree_lib.flatten_like(t, treedef, trees[0], what=f"{what}: tree {i}", like="tree 0")
        for i, t in enumerate(trees[1:], 1)
    ]
    if not is_sharded(first, spec):
        parts = [fn(first[i], *(o[i] for o in others)) for i in present]
        if not parts:
            raise ValueError(f"{what}: the tree has no tensor leaf")
        return _add_up(parts)
    k_op = f"{what}({len(trees)} trees)"
    plan, first = plan_for(trees[0], spec, what=what, op=k_op)
    parts = []
    for i, layout in enumerate(plan.layouts):
        if layout is None or not layout.counted:
            continue
        locals_ = [dtensor_lib.local(first[i])] + [dtensor_lib.local(o[i]) for o in others]
        parts.append(fn(*locals_))
    if not parts:  # this rank owns nothing: its share is zero (fn on an empty piece tells the size)
        parts.append(torch.zeros_like(fn(*_empty_pieces(plan, first, others))))
    local = _add_up(parts)
    buffer = local.detach().to(torch.float64)
    group = plan.global_group()
    if group is not None:
        waiting.all_reduce_bounded(buffer, dist.ReduceOp.SUM, group, what=what, timeout=plan.timeout)
    return buffer.to(local.dtype)


def _empty_pieces(plan: Any, first: list[Any], others: list[list[Any]]) -> list[Tensor]:
    """Pieces for ``fn`` on a rank that owns no element: its first present leaf in every tree, or,
    on a pipeline stage without gradients, empty float32 tensors (``fn`` sums over elements)."""
    index = next((i for i, layout in enumerate(plan.layouts) if layout is not None), None)
    if index is None:
        device = plan.mesh.device()
        return [torch.empty(0, device=device) for _ in range(1 + len(others))]
    return [dtensor_lib.local(first[index])] + [dtensor_lib.local(o[index]) for o in others]


def _add_up(parts: list[Tensor]) -> Tensor:
    """The sum of per-leaf partial sums, on the first one's device (leaves may live on several)."""
    device = parts[0].device
    return torch.stack([p if p.device == device else p.to(device) for p in parts]).sum(0)
