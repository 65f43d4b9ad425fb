"""Whole logical tensors from their shards: gather, apply a function, keep this rank's slice.

A matrix-aware transform (Muon's orthogonalization, say) is not elementwise: its result on a shard
depends on the whole logical matrix. :func:`map_logical` gives each rank exactly its slice of what
the function gives the whole tensor:

- a leaf with no sharded axis (plain, replicated, or a DTensor with only ``Replicate``) runs locally,
  with no communication; replicated copies compute identically on every rank;
- a leaf whose sharded tensor dims are all ones the function treats independently (``separable``,
  e.g. the expert dim of stacked expert weights when each expert is its own matrix) runs locally too;
- every other leaf is gathered over the group of its ``Shard`` axes, rebuilt as the whole logical
  tensor, passed to the function, and this rank's slice of the result is kept.

Two strategies give the same numbers (``strategy=``):

- ``"gather"``: every rank of a shard group rebuilds every whole tensor of the group and applies the
  function (replicated copies compute identically);
- ``"owner"``: each whole tensor gets one owner rank in its group (largest first, to the least
  loaded rank); pieces travel to the owner, which applies the function and sends every rank its
  slice back. The function runs once per tensor per group instead of ``k`` times, and each rank
  receives about ``2/k`` of the bytes instead of ``(k - 1)/k``.

**Collectives per call**, among the gathered leaves, per distinct (shard group, dtype, device)
"bucket": one all-gather (``all_gather_into_tensor``) with ``"gather"``, two ``all_to_all_single``
with ``"owner"``; buckets run in a fixed order on every rank. A tensor-parallel model whose
matrices all split over ``"tp"`` has one bucket; a TP x FSDP model with leaves over ``("dp",)``,
``("tp",)`` and ``("dp", "tp")`` three. Unsharded (or batch-split only) leaves add nothing. Pieces of
all leaves of a bucket share one buffer, so uneven shards (FSDP2's ``Shard(0)`` of 5 rows over 2
ranks) need no size exchange: every rank computes every other rank's piece from the layout alone.
On a new plan (or every call with ``check_consistency=True``) the cross-rank check of
:mod:`gradtx.sharding.consistency` adds its one ``all_gather`` first, so ranks that disagree, or
find an error (a ``Partial`` DTensor, a leaf the function cannot take), raise the same error
before any data moves.

Measured (``benchmarks/muon.py``: Muon on the 8 block matrices of a 2-layer, width-256 GPT-style
model, 4 gloo ranks on CPU), per step: TP over 4 ranks, gather 2348 ms / 4.50 MiB received per rank,
owner 500 ms / 2.38 MiB; FSDP2 ``Shard(0)`` DTensors, gather 2833 ms, owner 792 ms (the naive
per-leaf gather of everything: 2388 ms and 3203 ms, 8 collectives). Muon uses the owner strategy
by default.

:func:`local_pieces` serves transforms that need less than the whole tensor: it says where this
rank's piece lies in each logical tensor (from the layout alone, checked across ranks as above),
and :meth:`LocalPieces.sum` adds per-leaf tensors over each leaf's shard group (one ``all_reduce``
per distinct group, float64). GaLore projects with it: each rank's block of ``G`` times its rows of
the projector, the small shares summed, instead of gathering ``G``.

Layouts. A DTensor's pieces follow its placements (``Shard(d)`` in mesh-dim order, chunked as
``torch.chunk`` does, which is how DTensor and FSDP2 split); ``_StridedShard`` is not supported. A
plain tensor under a :class:`~gradtx.sharding.ShardingSpec` must name its split dims
(``Shard("tp", dim=0)``; a 1-D leaf with none is a flat piece split along dim 0); its pieces are equal, and several axes over one dim split it in mesh order
(the first axis outermost). Plain shards of unequal size are not supported (use DTensors): the
logical shapes each rank infers enter the cross-rank check (per pipeline stage), so ranks that
differ get an error naming the leaf and both pieces instead of a wrong gather. The strategy, and
the options a caller declares (``options=``), enter the name of the reduction, checked on every rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from gradtx import tree as tree_lib
from gradtx.sharding import dtensor as dtensor_lib
from gradtx.sharding.plan import LeafLayout, Plan, plan_for
from gradtx.sharding.spec import ShardingSpec

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (shape, offset) of one rank's piece


@dataclass
class _Gather:
    """One leaf to gather: the group's axes, the logical shape, and every group rank's piece."""

    index: int
    axes: tuple[str, ...]
    shape: tuple[int, ...]
    ranks: list[int]  # the group's ranks, ascending
    boxes: list[Box]  # per rank of ``ranks``
    me: int  # this rank's position in ``ranks``


def _chunk(size: int, parts: int, index: int) -> tuple[int, int]:
    """``(start, length)`` of chunk ``index`` of ``size`` split in ``parts``, as ``torch.chunk``
    (and DTensor's ``Shard``) does: chunks of ``ceil(size / parts)``, the last ones short or empty."""
    full = -(-size // parts) if parts else 0
    start = min(index * full, size)
    return start, min(start + full, size) - start


def _box(shape: Sequence[int], splits: Sequence[tuple[int, int, int]]) -> Box:
    """The piece of a ``shape`` tensor after the ``(dim, parts, index)`` splits, applied in order."""
    size, offset = list(shape), [0] * len(shape)
    for dim, parts, index in splits:
        start, length = _chunk(size[dim], parts, index)
        offset[dim] += start
        size[dim] = length
    return tuple(size), tuple(offset)


def _dtensor_boxes(leaf: Any, ranks: Sequence[int], path: str) -> list[Box]:
    mesh = leaf.device_mesh
    grid = mesh.mesh.cpu()
    placements = tuple(leaf.placements)
    for placement in placements:
        if type(placement).__name__ == "_StridedShard":
            raise ValueError(
                f"leaf {path!r} is a DTensor with a strided shard placement ({placement!r}, FSDP2 over "
                "TP): its whole matrix cannot be rebuilt from its pieces here; redistribute it first"
            )
    boxes = []
    for rank in ranks:
        found = (grid == rank).nonzero()
        if found.numel() == 0:
            raise ValueError(f"leaf {path!r}: rank {rank} of its shard group is not in the DTensor's mesh {mesh}")
        coordinate = found[0].tolist()
        splits = [
            (p.dim % leaf.ndim, grid.shape[m], coordinate[m]) for m, p in enumerate(placements) if p.is_shard()
        ]
        boxes.append(_box(leaf.shape, splits))
    return boxes


def plain_splits(plan: Plan, layout: LeafLayout, leaf: Tensor, *, hint: str = "") -> tuple[tuple[str, int], ...]:
    """``(mesh axis, tensor dim)`` for every axis of size > 1 splitting a plain leaf, in the
    layout's order; a split with no dim is a flat (ZeRO) piece of a 1-D leaf, along dim 0. A
    ``ValueError`` names the leaf when a dim is unknown (``hint`` says why it is needed) or out of range."""
    splits = []
    for axis, dim in zip(layout.axes, layout.dims):
        if plan.mesh.sizes[axis] <= 1:
            continue
        if dim is None:
            if leaf.ndim != 1:
                raise ValueError(
                    f"leaf {layout.path!r} is sharded over axis {axis!r} along an unknown tensor dim (with none, it is a "
                    f"flat (ZeRO) piece, but this rank's piece is {tuple(leaf.shape)}, not 1-D); give "
                    f"Shard({axis!r}, dim=...){hint}"
                )
            dim = 0
        if leaf.ndim == 0:
            raise ValueError(f"leaf {layout.path!r} is a 0-d tensor sharded over axis {axis!r}")
        if not -leaf.ndim <= dim < leaf.ndim:
            raise ValueError(f"leaf {layout.path!r} is split along dim {dim}, but it has {leaf.ndim} dims")
        splits.append((axis, dim % leaf.ndim))
    return tuple(splits)


_WHOLE_MATRIX = ": the whole matrix is rebuilt from its pieces (0 for column-parallel weights, 1 for row-parallel ones)"


def _dims_of(plan: Plan, index: int, leaf: Any) -> tuple[int, ...]:
    """The tensor dims a leaf is split along (on axes of size > 1)."""
    if dtensor_lib.is_dtensor(leaf):
        return tuple(sorted({p.dim % leaf.ndim for p in leaf.placements if p.is_shard()}))
    splits = plain_splits(plan, plan.layouts[index], leaf, hint=_WHOLE_MATRIX)  # type: ignore[arg-type]
    return tuple(sorted({dim for _, dim in splits}))


def _plain_splits(plan: Plan, index: int, leaf: Tensor, rank: int) -> list[tuple[int, int, int]]:
    """``(dim, parts, index)`` of every split of a plain leaf, for :func:`_box`, on ``rank``."""
    mesh = plan.mesh
    coordinate = mesh._rank_coordinate[rank]
    splits = plain_splits(plan, plan.layouts[index], leaf, hint=_WHOLE_MATRIX)  # type: ignore[arg-type]
    return [(dim, mesh.sizes[axis], coordinate[mesh.names.index(axis)]) for axis, dim in splits]


def logical_shapes(tree: Any, spec: Optional[ShardingSpec] = None, *, what: str = "logical_shapes") -> list[Any]:
    """The shape of every leaf of ``tree`` as a whole logical tensor (``None`` for ``None`` leaves).

    A DTensor knows its global shape; a plain leaf under ``spec`` is its local shape times the size
    of each axis along the dim it splits (which its leaf spec must name). No communication.
    """
    tree_leaves = tree_lib.leaves(tree)
    if spec is None and not dtensor_lib.has_dtensor(tree_leaves):
        return [None if leaf is None else tuple(leaf.shape) for leaf in tree_leaves]
    plan, tree_leaves = plan_for(tree, spec, what=what, check=False)
    out: list[Any] = []
    for index, leaf in enumerate(tree_leaves):
        if leaf is None:
            out.append(None)
        elif dtensor_lib.is_dtensor(leaf):
            out.append(tuple(leaf.shape))
        else:
            _dims_of(plan, index, leaf)  # every split dim known
            shape = list(leaf.shape)
            for dim, parts, _ in _plain_splits(plan, index, leaf, dist.get_rank()):
                shape[dim] *= parts
            out.append(tuple(shape))
    return out


def _jobs(
    plan: Plan,
    tree_leaves: Sequence[Any],
    separable: Optional[Callable[[int, tuple[int, ...]], Sequence[int]]],
    validate: Optional[Callable[[int, str, tuple[int, ...]], None]],
) -> list[Optional[_Gather]]:
    """Per leaf: ``None`` to run locally, or what to gather. Raises on anything that cannot run."""
    mesh = plan.mesh
    me = dist.get_rank()
    jobs: list[Optional[_Gather]] = [None] * len(tree_leaves)
    # every rank's piece of a leaf depends on the plan and the shapes only: found once per plan
    cache: dict[Any, Any] = plan.__dict__.setdefault("_matrix_pieces", {})
    for index, (leaf, layout) in enumerate(zip(tree_leaves, plan.layouts)):
        if layout is None:
            continue
        dims = _dims_of(plan, index, leaf)
        axes = tuple(a for a in layout.axes if mesh.sizes[a] > 1)
        local = dtensor_lib.local(leaf)
        if dtensor_lib.is_dtensor(leaf):
            shape = tuple(leaf.shape)
        else:
            shape_list = list(leaf.shape)
            for dim, parts, _ in _plain_splits(plan, index, leaf, me):
                shape_list[dim] *= parts
            shape = tuple(shape_list)
        if validate is not None:
            validate(index, layout.path, shape)
        if not axes:
            continue
        if separable is not None and set(dims) <= {d % len(shape) for d in separable(index, shape)}:
            continue
        key = (index, shape, tuple(local.shape))
        found = cache.get(key)
        if found is None:
            ranks = mesh.group_ranks(axes)
            if dtensor_lib.is_dtensor(leaf):
                boxes = _dtensor_boxes(leaf, ranks, layout.path)
            else:
                boxes = [_box(shape, _plain_splits(plan, index, leaf, r)) for r in ranks]
            found = cache[key] = (ranks, boxes)
        ranks, boxes = found
        position = ranks.index(me)
        if boxes[position][0] != tuple(local.shape):
            raise ValueError(
                f"leaf {layout.path!r}: this rank holds a {tuple(local.shape)} piece, but its layout gives "
                f"{boxes[position][0]} of the whole {shape} tensor"
            )
        jobs[index] = _Gather(index, axes, shape, ranks, boxes, position)
    return jobs


def _moved(plan: Plan, jobs: Sequence[Optional[_Gather]]) -> tuple[Any, ...]:
    """What ranks of one stage must agree on before moving pieces: per gathered leaf, its path,
    axes and logical shape (and this rank's piece, for the message when they do not agree)."""
    return tuple(
        (plan.layouts[job.index].path, job.axes, job.shape, job.boxes[job.me][0])  # type: ignore[union-attr]
        for job in jobs
        if job is not None
    )


def declared(options: Optional[Mapping[str, Any]]) -> str:
    """The options a transformation declares (those that change which collectives it runs), as
    they enter the name of its reduction: ranks that disagree on them get an error naming them."""
    if not options:
        return ""
    return " (" + ", ".join(f"{name}={value!r}" for name, value in sorted(options.items())) + ")"


def map_logical(
    tree: Any,
    fn: Callable[[int, Tensor], Tensor],
    spec: Optional[ShardingSpec] = None,
    *,
    what: str,
    separable: Optional[Callable[[int, tuple[int, ...]], Sequence[int]]] = None,
    validate: Optional[Callable[[int, str, tuple[int, ...]], None]] = None,
    strategy: str = "gather",
    options: Optional[Mapping[str, Any]] = None,
) -> Any:
    """``fn`` applied to every leaf of ``tree`` as a whole logical tensor; each rank gets its slice.

    Args:
      tree: tensors, DTensors and ``None`` leaves (kept ``None``).
      fn: ``(leaf index, tensor) -> tensor of the same shape``, the index into the flattened tree.
        It sees the whole logical tensor, or a local piece where that gives the same slice.
      spec: the layout of plain tensors (DTensors describe themselves).
      what: the caller's name, for errors and the cross-rank check.
      separable: ``(leaf index, logical shape) -> dims`` along which ``fn`` treats slices
        independently; a leaf split along those dims only runs locally.
      validate: ``(leaf index, path, logical shape)``, raising ``ValueError`` for a leaf ``fn``
        cannot take; under sharding it runs before any collective, and its error reaches every rank.
      strategy: ``"gather"`` (every rank of a shard group rebuilds every whole tensor: one
        all-gather per bucket) or ``"owner"`` (one rank per whole tensor applies ``fn`` and sends
        the slices back: two all-to-alls per bucket, ``1/k`` of the work and about ``2/k`` of the
        bytes per rank on a group of ``k``; ``fn`` must then keep the dtype).
      options: the caller's options that change which collectives run (``{"rank": 4}``), checked
        to agree across ranks with the plan (the strategy is checked always).

    Results keep each input's dtype, device and (for DTensors) layout.
    """
    if strategy not in ("gather", "owner"):
        raise ValueError(f"{what}: strategy must be 'gather' or 'owner', got {strategy!r}")
    tree_leaves, treedef = tree_lib.flatten(tree)
    if spec is None and not dtensor_lib.has_dtensor(tree_leaves):
        if validate is not None:
            for index, leaf in enumerate(tree_leaves):
                if leaf is not None:
                    validate(index, tree_lib.path_at(tree, index), tuple(leaf.shape))
        return tree_lib.unflatten(treedef, [None if x is None else fn(i, x) for i, x in enumerate(tree_leaves)])

    found: list[tuple[Plan, list[Optional[_Gather]]]] = []
    plan, tree_leaves = plan_for(
        tree,
        spec,
        what=what,
        op=f"{what}: whole tensors{declared({'strategy': strategy, **(options or {})})}",
        validate=lambda plan, leaves: found.append((plan, _jobs(plan, leaves, separable, validate))),
        pieces=lambda: _moved(*found[0]),
    )
    jobs = found[0][1]
    locals_, rewrap = dtensor_lib.locals_of([x for x in tree_leaves if x is not None])
    pieces: list[Any] = [None] * len(tree_leaves)
    present = [i for i, x in enumerate(tree_leaves) if x is not None]
    for i, local in zip(present, locals_):
        pieces[i] = local
    apply = _apply_owned if strategy == "owner" else _apply_gathered
    done = apply(plan, pieces, jobs, fn)
    results = [done[i] if jobs[i] is not None else fn(i, pieces[i]) for i in present]
    return tree_lib.unflatten(treedef, tree_lib.replace_present(tree_leaves, present, rewrap(results)))


def _buckets(plan: Plan, pieces: Sequence[Any], jobs: Sequence[Optional[_Gather]]) -> list[tuple[Any, list[_Gather]]]:
    """Gathered leaves by (group axes, dtype, device), in the same order on every rank."""
    buckets: dict[tuple[Any, ...], list[_Gather]] = {}
    for job in jobs:
        if job is not None:
            local = pieces[job.index]
            buckets.setdefault((job.axes, str(local.dtype), str(local.device)), []).append(job)
    order = {name: i for i, name in enumerate(plan.mesh.names)}
    keys = sorted(buckets, key=lambda k: (tuple(order[a] for a in k[0]), k[1], k[2]))
    return [(key, buckets[key]) for key in keys]


def _group_order(group: Any, ranks: Sequence[int]) -> list[int]:
    """Positions in ``ranks`` (ascending) of the group's ranks, in the group's own rank order."""
    return [list(ranks).index(r) for r in dist.get_process_group_ranks(group)]


def _region(box: Box) -> tuple[slice, ...]:
    shape, offset = box
    return tuple(slice(o, o + s) for s, o in zip(shape, offset))


def _all_gather_flat(received: Tensor, send: Tensor, group: Any) -> None:
    """One all-gather of equal-length 1-D buffers into ``received`` (in group-rank order)."""
    gather = getattr(dist, "all_gather_single", None)  # the newer name of all_gather_into_tensor
    (gather or dist.all_gather_into_tensor)(received, send, group=group)


def _apply_gathered(plan: Plan, pieces: Sequence[Any], jobs: Sequence[Optional[_Gather]], fn: Callable) -> dict[int, Tensor]:
    """Every rank rebuilds every whole tensor (one all-gather per bucket) and applies ``fn``."""
    out: dict[int, Tensor] = {}
    for (axes, _, _), bucket in _buckets(plan, pieces, jobs):
        group = plan.mesh.group(axes)
        first = pieces[bucket[0].index]
        order = _group_order(group, bucket[0].ranks)  # group rank j is position order[j]
        totals = [sum(math.prod(job.boxes[p][0]) for job in bucket) for p in order]
        length = max(totals)
        send = torch.zeros(length, dtype=first.dtype, device=first.device)
        torch.cat([pieces[job.index].detach().reshape(-1) for job in bucket], out=send[: totals[order.index(bucket[0].me)]])
        received = torch.empty(len(order) * length, dtype=first.dtype, device=first.device)
        _all_gather_flat(received, send, group)
        cursors = [j * length for j in range(len(order))]
        for job in bucket:
            whole = torch.empty(job.shape, dtype=first.dtype, device=first.device)
            for j, p in enumerate(order):
                n = math.prod(job.boxes[p][0])
                if n:
                    whole[_region(job.boxes[p])] = received[cursors[j] : cursors[j] + n].view(job.boxes[p][0])
                cursors[j] += n
            out[job.index] = fn(job.index, whole)[_region(job.boxes[job.me])].clone()
    return out


def _owners(bucket: Sequence[_Gather], size: int) -> list[int]:
    """A group position per leaf, balancing the work (largest first, to the least loaded rank)."""
    load = [0.0] * size
    owner = [0] * len(bucket)
    for i in sorted(range(len(bucket)), key=lambda i: (-math.prod(bucket[i].shape), i)):
        position = min(range(size), key=lambda p: (load[p], p))
        owner[i] = position
        load[position] += float(math.prod(bucket[i].shape)) ** 1.5
    return owner


def _apply_owned(plan: Plan, pieces: Sequence[Any], jobs: Sequence[Optional[_Gather]], fn: Callable) -> dict[int, Tensor]:
    """One owner rank per whole tensor: pieces go to it (``all_to_all``), it applies ``fn``, and
    each rank's slice of the result comes back (a second ``all_to_all``). ``fn`` must keep the dtype."""
    out: dict[int, Tensor] = {}
    for (axes, _, _), bucket in _buckets(plan, pieces, jobs):
        group = plan.mesh.group(axes)
        first = pieces[bucket[0].index]
        dtype, device = first.dtype, first.device
        order = _group_order(group, bucket[0].ranks)
        size, me = len(order), order.index(bucket[0].me)  # group-rank indices from here on
        owner = [order.index(o) for o in _owners(bucket, size)]  # owner as a group rank
        numel = lambda job, j: math.prod(job.boxes[order[j]][0])  # noqa: E731

        # there: my pieces to each owner; from every rank, its pieces of what I own
        send_sizes = [sum(numel(job, me) for job, o in zip(bucket, owner) if o == j) for j in range(size)]
        recv_sizes = [sum(numel(job, j) for job, o in zip(bucket, owner) if o == me) for j in range(size)]
        by_owner = sorted(range(len(bucket)), key=lambda i: owner[i])  # stable: leaf order per owner
        send = torch.cat([pieces[bucket[i].index].detach().reshape(-1) for i in by_owner] or [torch.zeros(0, dtype=dtype, device=device)])
        received = torch.empty(sum(recv_sizes), dtype=dtype, device=device)
        dist.all_to_all_single(received, send, recv_sizes, send_sizes, group=group)
        starts = [sum(recv_sizes[:j]) for j in range(size)]
        results: dict[int, Tensor] = {}
        for i, job in enumerate(bucket):
            if owner[i] != me:
                continue
            whole = torch.empty(job.shape, dtype=dtype, device=device)
            for j in range(size):
                n = numel(job, j)
                if n:
                    whole[_region(job.boxes[order[j]])] = received[starts[j] : starts[j] + n].view(job.boxes[order[j]][0])
                starts[j] += n
            results[i] = fn(job.index, whole).to(dtype)

        # back: to every rank its slices of what I own; from each owner, my slices of its leaves
        back_send = [
            results[i][_region(bucket[i].boxes[order[j]])].reshape(-1)
            for j in range(size)
            for i in range(len(bucket))
            if owner[i] == me
        ]
        back_send_sizes = recv_sizes
        back_recv_sizes = send_sizes
        payload = torch.cat(back_send) if back_send else torch.zeros(0, dtype=dtype, device=device)
        back = torch.empty(sum(back_recv_sizes), dtype=dtype, device=device)
        dist.all_to_all_single(back, payload, back_recv_sizes, back_send_sizes, group=group)
        cursor = 0
        for i in by_owner:
            job = bucket[i]
            n = numel(job, me)
            out[job.index] = back[cursor : cursor + n].view(job.boxes[job.me][0]).clone()
            cursor += n
    return out


# --------------------------------------------------------------------------- local pieces


@dataclass(frozen=True)
class Piece:
    """This rank's piece of one leaf: the whole logical ``shape``, the piece's ``size`` and
    ``offset`` in it, and the mesh ``axes`` (of size > 1) over which the other pieces lie (empty
    when the piece is the whole tensor)."""

    shape: tuple[int, ...]
    size: tuple[int, ...]
    offset: tuple[int, ...]
    axes: tuple[str, ...]

    @classmethod
    def whole(cls, shape: Sequence[int]) -> "Piece":
        """A piece that is its whole ``shape`` tensor."""
        shape = tuple(shape)
        return cls(shape, shape, (0,) * len(shape), ())

    def region(self) -> tuple[slice, ...]:
        """The piece's slices of the whole tensor."""
        return _region((self.size, self.offset))


class LocalPieces:
    """Where each leaf's local piece lies in its logical tensor (``pieces``, ``None`` for ``None``
    leaves), and :meth:`sum`, which adds per-leaf tensors over each leaf's shard group."""

    def __init__(self, plan: Optional[Plan], pieces: list[Optional[Piece]]):
        self.plan, self.pieces = plan, pieces

    def sum(self, values: dict[int, Tensor]) -> dict[int, Tensor]:
        """``{leaf index: tensor}`` -> each tensor summed over the ranks of that leaf's shard group
        (its ``Piece.axes``), exactly in float64 and back to its dtype: one ``all_reduce`` per
        distinct group, in mesh order on every rank; a leaf whose piece is whole keeps its tensor.
        Every rank of a group must pass a tensor of the same shape for the leaf."""
        from gradtx.sharding.reductions import reduce_grouped

        indices = [i for i in sorted(values) if self.pieces[i] is not None and self.pieces[i].axes]  # type: ignore[union-attr]
        out = dict(values)
        if indices and self.plan is not None:
            items = [(self.pieces[i].axes, values[i]) for i in indices]  # type: ignore[union-attr]
            for i, reduced in zip(indices, reduce_grouped(self.plan.mesh, items, dist.ReduceOp.SUM, timeout=self.plan.timeout, what="sums over a leaf's pieces")):
                out[i] = reduced
        return out


def local_pieces(
    tree: Any,
    spec: Optional[ShardingSpec] = None,
    *,
    what: str,
    validate: Optional[Callable[[int, str, tuple[int, ...]], None]] = None,
    options: Optional[Mapping[str, Any]] = None,
) -> LocalPieces:
    """Where every leaf's local piece lies in its whole logical tensor, from the layout alone.

    For a transform that needs only part of a leaf's logical context: a product of the piece with
    a slice of a replicated factor, summed over the shard group with :meth:`LocalPieces.sum`
    (GaLore's projection), instead of gathering the whole tensor. ``validate(index, path, logical
    shape)`` and the layouts are checked as :func:`map_logical` checks them: on a new plan the
    cross-rank check runs (one ``all_gather``), so an error (of ``validate``, an unknown split dim,
    unequal plain shards) reaches every rank before any data moves. ``options``: as for
    :func:`map_logical`. Without a spec and without DTensors every piece is whole and nothing is
    communicated.
    """
    tree_leaves = tree_lib.leaves(tree)
    if spec is None and not dtensor_lib.has_dtensor(tree_leaves):
        pieces: list[Optional[Piece]] = []
        for index, leaf in enumerate(tree_leaves):
            if leaf is None:
                pieces.append(None)
                continue
            if validate is not None:
                validate(index, tree_lib.path_at(tree, index), tuple(leaf.shape))
            pieces.append(Piece.whole(leaf.shape))
        return LocalPieces(None, pieces)

    found: list[tuple[Plan, list[Optional[_Gather]]]] = []
    plan, tree_leaves = plan_for(
        tree,
        spec,
        what=what,
        op=f"{what}: local pieces{declared(options)}",
        validate=lambda plan, leaves: found.append((plan, _jobs(plan, leaves, None, validate))),
        pieces=lambda: _moved(*found[0]),
    )
    pieces = []
    for leaf, job in zip(tree_leaves, found[0][1]):
        if leaf is None:
            pieces.append(None)
        elif job is None:
            pieces.append(Piece.whole(leaf.shape))
        else:
            size, offset = job.boxes[job.me]
            pieces.append(Piece(job.shape, tuple(size), tuple(offset), job.axes))
    return LocalPieces(plan, pieces)
