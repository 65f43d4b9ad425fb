"""Data-dependent decisions taken on the logical gradient, so every rank takes the same one.

Skipping a non-finite step or a too-large update is a decision about the whole gradient; with a
``ShardingSpec`` or DTensor leaves each rank sees only its pieces, so the local verdicts are turned
into one global verdict by an all-reduce of 0/1 flags (never of raw values: gloo's MIN and MAX
drop NaN) over the whole mesh: copies that should be equal but are not (a fault on one replica)
still make every rank take the same decision. Without a spec and without DTensors these are the
local computations, with no communication.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from gradtx import tree as tree_lib
from gradtx.sharding import waiting
from gradtx.sharding.plan import plan_for
from gradtx.sharding.reductions import is_sharded
from gradtx.sharding.spec import ShardingSpec

_FLAG_DTYPE = torch.float64


def _count_not_finite(tensors: list[Tensor]) -> Tensor:
    return sum((~torch.isfinite(t)).sum() for t in tensors) if tensors else torch.zeros((), dtype=torch.int64)


def _reduce(plan: Any, values: list[Tensor]) -> Tensor:
    buffer = torch.stack([v.to(_FLAG_DTYPE) for v in values])
    group = plan.mesh.group(plan.mesh.names)
    if group is not None:
        waiting.all_reduce_bounded(buffer, dist.ReduceOp.SUM, group, what="a decision over every rank's gradients", timeout=plan.timeout)
    return buffer


def all_finite(tree: Any, spec: Optional[ShardingSpec] = None, *, device: Optional[torch.device] = None) -> Tensor:
    """Whether every element of the logical gradient is finite (a 0-d bool, equal on every rank)."""
    tree_leaves = tree_lib.leaves(tree)
    if not is_sharded(tree_leaves, spec):
        return tree_lib.all_finite(tree, device=device)
    plan, tree_leaves = plan_for(tree, spec, what="all_finite", op="all_finite")
    local = tree_lib.all_finite(plan.pieces(tree_leaves), device=device)
    return (_reduce(plan, [~local])[0] == 0).to(local.device)


def count_not_finite(tree: Any, spec: Optional[ShardingSpec] = None) -> tuple[Tensor, Tensor]:
    """``(all finite, number of non-finite elements)`` of the logical gradient, each element counted
    once (copies and duplicates are not counted again), equal on every rank, in one all-reduce."""
    tree_leaves = tree_lib.leaves(tree)
    tensors = [leaf for leaf in tree_leaves if isinstance(leaf, Tensor)]
    if not is_sharded(tree_leaves, spec):
        return tree_lib.all_finite(tensors), torch.as_tensor(_count_not_finite(tensors))
    plan, tree_leaves = plan_for(tree, spec, what="count_not_finite", op="count_not_finite")
    present = plan.pieces(tree_leaves)
    local = tree_lib.all_finite(present)
    # copies along axes outside the norm's group are counted by their first replica only
    first_replica = all(
        plan.mesh.coordinate[a] == 0 for a in plan.mesh.names if a not in plan.global_axes and plan.mesh.sizes[a] > 1
    )
    owned = plan.pieces(tree_leaves, counted_only=True) if first_replica else []
    reduced = _reduce(plan, [~local, torch.as_tensor(_count_not_finite(owned), device=local.device)])
    return (reduced[0] == 0).to(local.device), reduced[1].to(torch.int64).to(local.device)


def any_rank(flag: Tensor, tree: Any, spec: Optional[ShardingSpec] = None) -> Tensor:
    """Whether ``flag`` (a 0-d bool computed by each rank from its pieces of ``tree``) holds on any
    rank of the mesh; ``flag`` itself without sharding."""
    tree_leaves = tree_lib.leaves(tree)
    if not is_sharded(tree_leaves, spec):
        return flag
    plan, _ = plan_for(tree, spec, what="any_rank", op="any_rank")
    return (_reduce(plan, [flag])[0] > 0).to(flag.device)
