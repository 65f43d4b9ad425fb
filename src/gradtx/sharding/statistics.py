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
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from gradtx import torch_internals
from gradtx import tree as tree_lib
from gradtx.native import observed as native_observed
from gradtx.sharding import dtensor as dtensor_lib
from gradtx.sharding import waiting
from gradtx.sharding.plan import Plan, plan_for
from gradtx.sharding.reductions import _finish_norm, _local_norms, _norm_buffer, _squares, is_sharded, piece_squares, taken_squares
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
    # eagerly: the slots of a set of leaves (see _group_index), by leaf indices and device
    slot_cache: dict[Any, Tensor] = field(default_factory=dict, repr=False, compare=False)


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


def relayout(known: GroupLayout, tree: Any, spec: Optional[ShardingSpec], assign: Callable[[Sequence[str]], Assignment],
             check_unused: Callable[[set[str], Sequence[str]], Optional[Exception]], *, what: str) -> GroupLayout:
    """The layout of ``tree``, whose leaf paths are ``known``'s but whose ``None`` leaves differ (the
    gradients of a stage with frozen params, after its params): ``known``'s groups, which depend on
    the paths only, with ``tree``'s own plan, and no collective of its own when the reduction group
    is the same (so ranks whose trees differ in ``None`` leaves and ranks whose trees do not stay in
    step). Otherwise :func:`layout_groups`."""
    tree_leaves = tree_lib.leaves(tree)
    if known.plan is not None and is_sharded(tree_leaves, spec):
        plan, _ = plan_for(tree, spec, what=what, op=f"{what}: groups")
        if plan.global_axes == known.plan.global_axes:
            return GroupLayout(known.names, known.leaf_groups, plan, known.slot, known.slots, known.paths)
    return layout_groups(tree, spec, assign, check_unused, what=what)


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
    if plan is None:  # nothing sharded: every present tensor leaf, each its own local tensor
        return [(i, leaf) for i, leaf in enumerate(tree_leaves) if isinstance(leaf, Tensor)]
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


def _group_index(layout: GroupLayout, indices: list[int], device: torch.device) -> Tensor:
    """Each leaf of ``indices``'s slot in ``[total, group 0, group 1, ...]`` (its group's index + 1);
    eagerly, made once per set of leaves and device."""
    if torch.compiler.is_compiling():
        return torch.tensor([layout.leaf_groups[i] + 1 for i in indices], device=device)
    key = (tuple(indices), device)
    found = layout.slot_cache.get(key)
    if found is None:
        found = layout.slot_cache[key] = torch.tensor([layout.leaf_groups[i] + 1 for i in indices], device=device)
    return found


def _per_group(layout: GroupLayout, groups: Optional[Tensor], values: Optional[Tensor], reduce: str, device: torch.device) -> Tensor:
    """``values`` (one per leaf, ``groups`` their slots) gathered into ``[total, group 0, group 1, ...]``."""
    out = torch.zeros(len(layout.names) + 1, dtype=_DTYPE, device=device)
    if values is None or groups is None:
        return out
    if reduce == "sum":
        total = values.sum().reshape(1)
        grouped = out.index_add(0, groups, values)
    else:
        total = values.amax().reshape(1)
        grouped = out.scatter_reduce(0, groups, values, "amax", include_self=True)
    return torch.cat([total, grouped[1:]])


def larger(a: float, b: float) -> float:
    """The larger of two host floats, NaN if either is (``amax``'s rule)."""
    if a != a or b != b:
        return math.nan
    return b if b > a else a


def grouped_values(layout: GroupLayout, indices: Sequence[int], values: Sequence[float], reduce: str) -> list[float]:
    """:func:`_per_group` of host floats (one per leaf of ``indices``), without a tensor op: each
    group's sum added in leaf order, as ``index_add`` adds it (the total too, where ``sum`` may
    add in another order: its last bits may differ), or the maxima over zero, a NaN winning. For a
    step's few dozen leaves this costs less than the ops."""
    out = [0.0] * (len(layout.names) + 1)
    slots = layout.leaf_groups
    total = 0.0
    if reduce == "sum":
        for i, value in zip(indices, values):
            total += value
            out[slots[i] + 1] += value
    else:
        total = values[0] if values else 0.0
        for i, value in zip(indices, values):
            total = larger(total, value)
            out[slots[i] + 1] = larger(out[slots[i] + 1], value)
    out[0] = total
    return out


def host_squares(tensors: list[Tensor], tally: Optional[native_observed.Tally] = None) -> list[float]:
    """:func:`leaf_squares` of CPU tensors as host floats: the same sums (a kernel's tally, the
    native pass, else the squares of their 2-norms), without building a tensor of them."""
    found = taken_squares(tensors, [tally.squares(t) for t in tensors] if tally is not None else None)
    rest = [i for i, total in enumerate(found) if total is None]
    if rest:
        cpu = torch.device("cpu")
        for i, total in zip(rest, _squares(_fusable_norms([tensors[i] for i in rest]), cpu).tolist()):
            found[i] = total
    return found  # type: ignore[return-value]


def host_squared_sums(layout: GroupLayout, tree_leaves: Sequence[Any], tally: Optional[native_observed.Tally] = None) -> list[float]:
    """:func:`squared_sums` of a tree of CPU tensors, as host floats."""
    counted = _counted(layout, tree_leaves)
    return grouped_values(layout, [i for i, _ in counted], host_squares([t for _, t in counted], tally), "sum")


def _compiled_reductions(tensors: Sequence[Tensor]) -> bool:
    """Whether the statistics of ``tensors`` are taken as plain reductions Inductor lowers (under
    ``torch.compile``, for dense real non-empty tensors) instead of torch's per-list kernels."""
    return torch.compiler.is_compiling() and all(t.layout == torch.strided and not t.is_complex() and t.numel() > 0 for t in tensors)


def leaf_maxima(tensors: Sequence[Tensor], device: torch.device) -> Tensor:
    """Per-tensor ``max |x|`` (float32, or float64 if any tensor is), stacked on ``device``: the
    values of ``_local_norms(tensors, inf)``, from one ``aminmax`` pass per dense real tensor
    (``max(|min|, |max|)``; CPU's inf-norm kernel is several times slower than its 2-norm one).
    A NaN gives NaN, an infinity infinity, an empty tensor 0."""
    dtype = tree_lib.accumulation_dtype([t.dtype for t in tensors])
    if _compiled_reductions(tensors):
        # one max of |x| per tensor: a reduction Inductor can fuse into the optimizer's loop over x
        return torch.stack([t.abs().amax().to(device=device, dtype=dtype) for t in tensors])
    lows, highs = [], []
    for t in tensors:
        if t.numel() == 0:
            low = high = torch.zeros((), dtype=dtype, device=device)
        elif t.layout == torch.strided and not t.is_complex():
            low, high = torch.aminmax(t)
        else:  # sparse (its stored values) or complex (its moduli): the norm kernel
            low = high = _local_norms([t], math.inf)[0]
        lows.append(low.to(device=device, dtype=dtype))
        highs.append(high.to(device=device, dtype=dtype))
    return torch.maximum(torch.stack(lows).abs(), torch.stack(highs).abs())


def _count_nonfinite(tensor: Tensor) -> Tensor:
    if torch.compiler.is_compiling() and tensor.layout == torch.strided and tensor.numel() < 2**31:
        return (~torch.isfinite(tensor)).sum(dtype=torch.int32)  # compiled: a 32-bit count vectorizes
    if tensor.layout == torch.strided:  # one bool temporary, not two
        return tensor.numel() - torch.isfinite(tensor).sum()
    return (~torch.isfinite(tensor)).sum()


def _nonfinite_counts(tensors: list[Tensor], maxima: Tensor, device: torch.device) -> Tensor:
    """Per-tensor counts of NaN and infinite elements (float64), given their ``max |x|``.

    A finite maximum means no such element, so on the CPU, eagerly, where ``maxima`` can be read
    without waiting for a device, only the tensors with a non-finite maximum are counted: a finite
    gradient costs no pass of its own. Elsewhere every tensor is counted (no host sync; compiled,
    the count fuses with the other reductions)."""
    host = (
        not torch.compiler.is_compiling()
        and maxima.device.type == "cpu"
        and all(t.device.type == "cpu" for t in tensors)
        and not torch_internals.functorch_active()
    )
    if not host:
        return torch.stack([_count_nonfinite(t).to(device=device, dtype=_DTYPE) for t in tensors])
    counts = torch.zeros(len(tensors), dtype=_DTYPE, device=device)
    for i in (~torch.isfinite(maxima)).nonzero().flatten().tolist():
        counts[i] = _count_nonfinite(tensors[i]).to(_DTYPE)
    return counts


def _fusable_norms(tensors: list[Tensor]) -> list[Tensor]:
    """Per-tensor 2-norms as :func:`_local_norms` takes them, except under ``torch.compile``, where
    dense real tensors get ``torch.linalg.vector_norm``: a reduction Inductor can fuse into the
    loops that already read the tensor (the optimizer's own), where ``_foreach_norm`` stays a
    separate kernel call and reads every tensor once more. Only for statistics: a clip's norm keeps its kernel."""
    if not _compiled_reductions(tensors):
        return _local_norms(tensors, 2.0)
    dtype = tree_lib.accumulation_dtype([t.dtype for t in tensors])
    return [torch.linalg.vector_norm(t, 2.0, dtype=tree_lib.accumulation_dtype([t.dtype])).to(dtype) for t in tensors]


def squared_sums(layout: GroupLayout, tree_leaves: Sequence[Any], device: torch.device, tally: Optional[native_observed.Tally] = None) -> Tensor:
    """This rank's ``[total, per group]`` sums of squares of ``tree_leaves`` (laid out as the layout's
    tree); ``tally``: sums a kernel already took in a pass of the step (see :func:`leaf_squares`)."""
    counted = _counted(layout, tree_leaves)
    if not counted:
        return _per_group(layout, None, None, "sum", device)
    groups = _group_index(layout, [i for i, _ in counted], device)
    return _per_group(layout, groups, leaf_squares([t for _, t in counted], device, tally), "sum", device)


def leaf_squares(tensors: list[Tensor], device: torch.device, tally: Optional[native_observed.Tally] = None) -> Tensor:
    """Per-tensor sums of squares (float64, on ``device``). Eagerly, for plain float32 CPU tensors,
    the sums of :mod:`gradtx.native.observed` (float32 within blocks of 2048 values, float64 across
    them; from ``tally`` where the step's own pass took them, else a pass of their own: the same
    bits either way); else the squares of the tensors' 2-norms (:func:`_fusable_norms`)."""
    if torch.compiler.is_compiling() or native_observed.usable() is None:
        return _squares(_fusable_norms(tensors), device)
    known = [tally.squares(t) for t in tensors] if tally is not None else None
    return piece_squares(tensors, device, norms=_fusable_norms, known=known)


class GradientPartials(NamedTuple):
    """This rank's ``[total, per group]`` sums of squares (``sq``), non-finite counts and ``max |g|``
    of the gradients; and, per leaf that entered them (in leaf order), its 2-norm (``norms``, as
    :func:`_local_norms` takes it; empty under sharding, whose sums are taken directly) and its
    ``max |g|`` (``maxima``, 1-D), from which a clip's global norm follows without reading the
    gradients again."""

    sq: Tensor
    nonfinite: Tensor
    max: Tensor
    norms: list[Tensor]
    maxima: Optional[Tensor]


def gradient_partials(
    layout: GroupLayout,
    tree_leaves: Sequence[Any],
    device: torch.device,
    norms: Optional[list[Tensor]] = None,
    extremes: Optional[Callable[[list[Tensor]], tuple[Tensor, Tensor]]] = None,
) -> GradientPartials:
    """The gradients' statistics on this rank, reading each gradient twice: one 2-norm and one
    ``aminmax`` (non-finite elements are counted only in a leaf whose maximum is not finite, where
    that can be known without a host sync: see :func:`_nonfinite_counts`). ``norms`` (of the
    counted tensors, as :func:`counted_norms` takes them) and ``extremes(tensors)`` (their
    ``max |g|`` and non-finite counts), when given, are taken instead of reading the gradients.

    Under sharding the sums of squares are those a sharded 2-norm adds up
    (:func:`~gradtx.sharding.reductions.piece_squares`), so a clip's global norm follows from them
    bit for bit; eagerly, for plain float32 CPU pieces, they and the extremes come from one pass
    over each gradient (``norms`` is then empty)."""
    counted = _counted(layout, tree_leaves)
    if not counted:
        zeros = _per_group(layout, None, None, "sum", device)
        return GradientPartials(zeros, zeros, zeros, [], None)
    indices, tensors = [i for i, _ in counted], [t for _, t in counted]
    groups = _group_index(layout, indices, device)
    if layout.plan is not None and norms is None and extremes is None:
        found = native_observed.squares_extremes(tensors)
        if found is not None:
            sums, maxima, counts = (x.to(device) for x in found)
        else:
            sums = piece_squares(tensors, device)
            maxima, counts = extremes_of(tensors, device)
        return GradientPartials(
            _per_group(layout, groups, sums, "sum", device),
            _per_group(layout, groups, counts, "sum", device),
            _per_group(layout, groups, maxima.to(_DTYPE), "max", device),
            [],
            maxima,
        )
    if norms is None:
        norms = _local_norms(tensors, 2.0)
    maxima, counts = extremes_of(tensors, device) if extremes is None else extremes(tensors)
    return GradientPartials(
        _per_group(layout, groups, _squares(norms, device), "sum", device),
        _per_group(layout, groups, counts, "sum", device),
        _per_group(layout, groups, maxima.to(_DTYPE), "max", device),
        norms,
        maxima,
    )


def host_gradient_partials(
    layout: GroupLayout, tree_leaves: Sequence[Any], norms: list[Tensor], extremes: Callable[[list[Tensor]], tuple[list[float], list[float]]]
) -> tuple[list[float], list[float], list[float]]:
    """:func:`gradient_partials` of CPU leaves, given their ``norms`` (:func:`counted_norms`) and
    ``extremes`` (their ``max |g|`` and non-finite counts), as host floats: the sums of squares,
    the non-finite counts and the maxima, each ``[total, per group]``."""
    counted = _counted(layout, tree_leaves)
    indices, tensors = [i for i, _ in counted], [t for _, t in counted]
    squares = [value * value for value in torch.stack(norms).tolist()] if norms else []  # _squares' float64 products
    maxima, counts = extremes(tensors) if tensors else ([], [])
    return grouped_values(layout, indices, squares, "sum"), grouped_values(layout, indices, counts, "sum"), grouped_values(layout, indices, maxima, "max")


def counted_norms(layout: GroupLayout, tree_leaves: Sequence[Any]) -> list[Tensor]:
    """The 2-norms :func:`gradient_partials` takes of the leaves it counts (none when none counts)."""
    tensors = [t for _, t in _counted(layout, tree_leaves)]
    return _local_norms(tensors, 2.0) if tensors else []


def extremes_of(tensors: list[Tensor], device: torch.device) -> tuple[Tensor, Tensor]:
    """Per-tensor ``max |x|`` (as :func:`leaf_maxima`) and non-finite counts (float64)."""
    maxima = leaf_maxima(tensors, device)
    return maxima, _nonfinite_counts(tensors, maxima, device)


def reduce_statistics(
    layout: GroupLayout, sums: Tensor, maxima: Tensor, *, what: str, error: Optional[BaseException] = None
) -> tuple[Tensor, Tensor]:
    """``sums`` (any shape) summed and ``maxima`` (1-D) maxed over the reduction group, in one
    SUM all-reduce (float64), identical on every rank; the local values when there is no group.

    ``error``: what went wrong on this rank while computing its share (its ``sums`` and ``maxima``
    are then placeholders of the right shapes); it rides in the all-reduce as an error bit, with the
    call count of ``what``, so every rank of the group raises the same error, naming the rank (see
    :func:`gradtx.sharding.waiting.all_reduce`)."""
    plan = layout.plan
    group = plan.global_group() if plan is not None else None
    if group is None:
        if error is not None:
            raise error
        return sums, maxima
    slots = torch.zeros(layout.slots, maxima.numel(), dtype=_DTYPE, device=maxima.device)
    slots[layout.slot] = maxima
    buffer = torch.cat([sums.reshape(-1).to(_DTYPE), slots.reshape(-1)])
    buffer = waiting.all_reduce(buffer, dist.ReduceOp.SUM, group, what=what, calls=plan.calls, error=error, timeout=plan.timeout)
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
