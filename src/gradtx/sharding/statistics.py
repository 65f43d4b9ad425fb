"""Per-group statistics of a (possibly sharded) tree: sums and maxima over groups of leaves, every
logical element counted once, all groups and all quantities in ONE collective.

A :class:`GroupLayout` assigns each leaf to a group (or none) and fixes the groups' global order:
under pipeline parallelism a group may exist on some stages only, so the ranks agree once on the
list of every rank's groups (one small ``all_gather_object`` when a new tree structure is met, the
same moment the cross-rank check of :mod:`gradtx.sharding.plan` runs), and every rank then reduces
a buffer of the same shape. A grouping error found on any rank (a callable returning a non-string,
a glob matching no leaf on any rank) is raised by every rank alike at that moment.

Each step, every rank adds up its share over the pieces it owns (as :func:`global_norm` counts
them: copies and duplicates do not enter), and one SUM all-reduce (float64) over the global norm's
group finishes every group's sums. Maxima ride in the same all-reduce: each rank writes its
maxima into slots of its own (its rank in the group), zeros elsewhere, so the sum *is* the gather
of every rank's maxima, whose ``amax`` is then taken in the same order on every rank (a NaN
propagates; gloo's MAX would drop it). Without a group (nothing sharded) nothing is communicated.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from gradtx import tree as tree_lib
from gradtx.sharding import dtensor as dtensor_lib
from gradtx.sharding import waiting
from gradtx.sharding.plan import Plan, plan_for
from gradtx.sharding.reductions import _finish_norm, _local_norms, _norm_buffer, is_sharded
from gradtx.sharding.spec import ShardingSpec

_DTYPE = torch.float64

# (group names of this rank's leaves, one per leaf, None for "no group"; globs that matched; error)
Assignment = tuple[list[Optional[str]], set[str], Optional[Exception]]


@dataclass
class GroupLayout:
    """Groups of one tree structure.

    ``names``: every group, in the same order on every rank; ``leaf_groups``: per leaf, its group's
    index in ``names`` (``-1``: none); ``plan``: the tree's sharding plan (``None`` unsharded);
    ``slot`` / ``slots``: this rank's index in the reduction group and the group's size (the maxima's
    slots); ``paths``: the leaf paths, for error messages.
    """

    names: tuple[str, ...]
    leaf_groups: tuple[int, ...]
    plan: Optional[Plan]
    slot: int
    slots: int
    paths: tuple[str, ...]


def layout_groups(
    tree: Any,
    spec: Optional[ShardingSpec],
    assign: Callable[[Sequence[str]], Assignment],
    check_unused: Callable[[set[str], Sequence[str]], Optional[Exception]],
    *,
    what: str,
) -> GroupLayout:
    """The groups of ``tree``'s leaves, agreed on by every rank of the reduction group.

    ``assign(paths)`` names each leaf's group on this rank; ``check_unused(matched, paths)`` returns
    the error for rules no rank matched (``paths``: every rank's, for the message). Errors raise on
    every rank at once. Not under ``torch.compile``: call it eagerly first and keep the result.
    """
    tree_leaves = tree_lib.leaves(tree)
    paths = tree_lib.paths(tree)
    plan: Optional[Plan] = None
    if is_sharded(tree_leaves, spec):
        plan, _ = plan_for(tree, spec, what=what, op=f"{what}: groups")
    named, matched, error = assign(paths)
    group = plan.global_group() if plan is not None else None
    if group is None:
        if error is None:
            error = check_unused(matched, paths)
        if error is not None:
            raise error
        return GroupLayout(*_ordered([named]), plan, 0, 1, tuple(paths))  # type: ignore[misc]
    mine = (dist.get_rank(), named, sorted(matched), None if error is None else (type(error).__name__, str(error)), paths)
    reports: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(reports, mine, group=group)
    failed = [r for r in reports if r[3] is not None]
    if failed:
        rank, (kind, message) = failed[0][0], failed[0][3]
        cls = {"TypeError": TypeError, "ValueError": ValueError}.get(kind, RuntimeError)
        raise cls(f"{what}: on rank {rank}: {message}") from error
    every_path = [p for r in reports for p in r[4]]
    unused = check_unused({g for r in reports for g in r[2]}, every_path)
    if unused is not None:
        raise unused
    names, _ = _ordered([r[1] for r in reports])
    index = {name: i for i, name in enumerate(names)}
    leaf_groups = tuple(-1 if n is None else index[n] for n in named)
    return GroupLayout(names, leaf_groups, plan, dist.get_rank(group), dist.get_world_size(group), tuple(paths))


def _ordered(per_rank: Sequence[Sequence[Optional[str]]]) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """Every group name in order of first appearance (rank by rank, leaf by leaf), and the first
    rank's leaves' indices into them."""
    names: dict[str, int] = {}
    for named in per_rank:
        for name in named:
            if name is not None and name not in names:
                names[name] = len(names)
    return tuple(names), tuple(-1 if n is None else names[n] for n in per_rank[0])


def _counted(layout: GroupLayout, tree_leaves: Sequence[Any]) -> list[tuple[int, Tensor]]:
    """``(leaf index, local tensor)`` of the present leaves whose piece enters global sums here."""
    plan = layout.plan
    out = []
    for i, leaf in enumerate(tree_leaves):
        if leaf is None or not isinstance(leaf, Tensor):
            continue
        if plan is not None:
            leaf_layout = plan.layouts[i] if i < len(plan.layouts) else None
            if leaf_layout is None or not leaf_layout.counted:
                continue
        out.append((i, dtensor_lib.local(leaf)))
    return out


def _per_group(layout: GroupLayout, indices: list[int], values: Optional[Tensor], reduce: str, device: torch.device) -> Tensor:
    """``values`` (one per leaf of ``indices``) gathered into ``[total, group 0, group 1, ...]``."""
    out = torch.zeros(len(layout.names) + 1, dtype=_DTYPE, device=device)
    if values is None or not indices:
        return out
    groups = torch.tensor([layout.leaf_groups[i] + 1 for i in indices], device=device)
    if reduce == "sum":
        total = values.sum().reshape(1)
        grouped = out.index_add(0, groups, values)
    else:
        total = values.amax().reshape(1)
        grouped = out.scatter_reduce(0, groups, values, "amax", include_self=True)
    return torch.cat([total, grouped[1:]])


def _leaf_values(tensors: list[Tensor], kind: str, device: torch.device) -> Optional[Tensor]:
    if not tensors:
        return None
    if kind == "sq":
        norms = _local_norms(tensors, 2.0)
        return torch.stack([n.to(device=device, dtype=_DTYPE) for n in norms]) ** 2
    if kind == "max":
        norms = _local_norms(tensors, float("inf"))
        return torch.stack([n.to(device=device, dtype=_DTYPE) for n in norms])
    counts = [(~torch.isfinite(t)).sum() for t in tensors]  # kind == "nonfinite"
    return torch.stack([c.to(device=device, dtype=_DTYPE) for c in counts])


def squared_sums(layout: GroupLayout, tree_leaves: Sequence[Any], device: torch.device) -> Tensor:
    """This rank's ``[total, per group]`` sums of squares of ``tree_leaves`` (laid out as the layout's tree)."""
    counted = _counted(layout, tree_leaves)
    return _per_group(layout, [i for i, _ in counted], _leaf_values([t for _, t in counted], "sq", device), "sum", device)


def gradient_partials(layout: GroupLayout, tree_leaves: Sequence[Any], device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
    """This rank's ``(sums of squares, non-finite counts, max |g|)``, each ``[total, per group]``."""
    counted = _counted(layout, tree_leaves)
    indices, tensors = [i for i, _ in counted], [t for _, t in counted]
    return (
        _per_group(layout, indices, _leaf_values(tensors, "sq", device), "sum", device),
        _per_group(layout, indices, _leaf_values(tensors, "nonfinite", device), "sum", device),
        _per_group(layout, indices, _leaf_values(tensors, "max", device), "max", device),
    )


def reduce_statistics(layout: GroupLayout, sums: Tensor, maxima: Tensor, *, what: str) -> tuple[Tensor, Tensor]:
    """``sums`` (any shape) summed and ``maxima`` (1-D) maxed over the reduction group, in one
    SUM all-reduce (float64), identical on every rank; the local values when there is no group."""
    plan = layout.plan
    group = plan.global_group() if plan is not None else None
    if group is None:
        return sums, maxima
    slots = torch.zeros(layout.slots, maxima.numel(), dtype=_DTYPE, device=maxima.device)
    slots[layout.slot] = maxima
    buffer = torch.cat([sums.reshape(-1).to(_DTYPE), slots.reshape(-1)])
    if torch.compiler.is_compiling():
        dist.all_reduce(buffer, op=dist.ReduceOp.SUM, group=group)
    else:
        try:
            waiting.wait(dist.all_reduce(buffer, op=dist.ReduceOp.SUM, group=group, async_op=True), buffer, plan.timeout)
        except RuntimeError as failure:
            raise RuntimeError(f"gradtx.sharding: {what} waited for the other ranks of its group, which did not join ({failure})") from failure
    n = sums.numel()
    return buffer[:n].reshape(sums.shape), buffer[n:].reshape(layout.slots, -1).amax(0)


def norm_share(layout: GroupLayout, tree_leaves: Sequence[Any], p: float) -> Optional[Tensor]:
    """This rank's ``[sum |g|^p]`` exactly as :func:`gradtx.sharding.global_norm` computes it, for
    a ``p`` other than 2 and ``inf`` (whose shares are the statistics' own sums of squares and maxima:
    ``None``). Summed over the group, :func:`global_norm_from` finishes it."""
    if p in (2.0, math.inf) or layout.plan is None:
        return None
    return _norm_buffer(layout.plan, tree_leaves, p, False)[0]


def global_norm_from(layout: GroupLayout, tree_leaves: Sequence[Any], p: float, sums: Tensor, maxima: Tensor, share: Optional[Tensor]) -> Tensor:
    """The global ``p``-norm of ``tree_leaves``, bit for bit what :func:`gradtx.sharding.global_norm`
    returns, from the reduced statistics of :func:`gradient_partials` (``sums[0]``: the sums of
    squares, ``maxima``: the ``|g|`` maxima) or the reduced :func:`norm_share`."""
    assert layout.plan is not None
    dtype = tree_lib.accumulation_dtype([t.dtype for t in layout.plan.pieces(tree_leaves)])
    if p == 2.0:
        reduced = sums[0, 0].reshape(1)
    elif p == math.inf:
        largest = maxima[0]
        reduced = torch.stack([torch.where(torch.isnan(largest), 0.0, largest), torch.isnan(largest).to(largest.dtype)])
    else:
        assert share is not None
        reduced = share.reshape(1)
    return _finish_norm(reduced, p, dtype)


def local_device(tree_leaves: Sequence[Any], plan: Optional[Plan]) -> torch.device:
    """Where the statistics live: the first present leaf's device, else the mesh's."""
    for leaf in tree_leaves:
        if isinstance(leaf, Tensor):
            return dtensor_lib.local(leaf).device
    return plan.mesh.device() if plan is not None else torch.device("cpu")
