"""Where every element of this rank's pieces lies in its logical tensor, for any layout.

A transform whose numbers depend on an element's place in the whole leaf (stochastic rounding's
random bits, block-wise quantization's blocks) needs each local element's row-major index in the
logical tensor. :func:`element_pieces` gives, per leaf, this rank's :class:`~gradtx.sharding.matrices.Piece`
(the logical shape, the piece's size and offset), and :func:`logical_indices` the indices;
:func:`element_grid` adds the grid every rank's pieces form (where they cut each dim), which a
transform whose statistics span pieces needs (block-wise quantization's blocks that a cut falls in):

- a DTensor: its box by DTensor's chunking (``torch.chunk`` per ``Shard``), found locally;
- a plain piece under a :class:`~gradtx.sharding.ShardingSpec` split along named dims: a box of a
  grid whose pieces may have any sizes (numpy's ``array_split`` as well as DTensor's chunking);
- a flat (ZeRO) piece, ``Shard("dp")`` with no ``dim``, a 1-D run of the flattened leaf: its
  logical tensor is the flattened leaf, so its indices are its start plus ``arange`` (the
  row-major indices of the dense leaf); pieces may be uneven, and the last may be padded.

Plain pieces' offsets depend on the other ranks' piece sizes: every rank sends its own in one
``all_gather_object`` over the mesh, the first time a plan meets a set of local shapes (the answer is
cached on the plan, so steady-state steps communicate nothing), and computes every offset from them
as :mod:`gradtx.checkpoint` does (:func:`~gradtx.sharding.checkpointing.tile`). An error found on any
rank (an unknown split dim, pieces that do not tile a tensor) is raised on every rank there.
DTensor-only trees need no exchange (every rank's box follows from the placements).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from gradtx import tree as tree_lib
from gradtx.sharding import checkpointing as ckpt_lib
from gradtx.sharding import dtensor as dtensor_lib
from gradtx.sharding.matrices import Box, Piece, _dtensor_boxes, plain_splits
from gradtx.sharding.mesh import MeshAxes
from gradtx.sharding.plan import LeafLayout, Plan, plan_for
from gradtx.sharding.spec import ShardingSpec

_CACHE = "_element_pieces"

Bounds = tuple[tuple[int, ...], ...]
"""Per dim of a leaf's logical tensor, where its pieces begin and end (ascending, 0 and the dim's
size included): the grid the pieces form."""


@dataclass(frozen=True)
class Grid:
    """Where the pieces of every leaf of a tree lie (each list has one entry per leaf, ``None`` for
    ``None`` leaves): ``mesh``, the mesh the ranks talk over (``None`` when nothing is sharded);
    ``pieces``, this rank's; ``splits``, ``(mesh axis, tensor dim)`` of every axis of size > 1
    splitting the leaf (a flat piece's dim is 0); ``bounds``, the grid of every rank's pieces
    (:data:`Bounds`), the same on every rank that holds the leaf."""

    mesh: Optional[MeshAxes]
    pieces: tuple[Optional[Piece], ...]
    splits: tuple[Optional[ckpt_lib.Splits], ...]
    bounds: tuple[Optional[Bounds], ...]


Entry = tuple[Piece, ckpt_lib.Splits, Bounds]
"""One leaf's piece, splits and grid."""


def _bounds(shape: Sequence[int], boxes: Sequence[Box]) -> Bounds:
    """The grid of ``boxes`` (every piece's size and offset) of a ``shape`` tensor."""
    return tuple(
        tuple(sorted({0, size} | {o[d] for _, o in boxes} | {o[d] + s[d] for s, o in boxes}))
        for d, size in enumerate(shape)
    )


def _whole(shape: Sequence[int]) -> Entry:
    return Piece.whole(shape), (), _bounds(shape, ())


def _unsharded(tree_leaves: Sequence[Any]) -> Grid:
    found = [None if leaf is None else _whole(leaf.shape) for leaf in tree_leaves]
    return _grid(None, found)


def _grid(mesh: Optional[MeshAxes], found: Sequence[Optional[Entry]]) -> Grid:
    parts = [(None, None, None) if entry is None else entry for entry in found]
    return Grid(mesh, *(tuple(column) for column in zip(*parts))) if parts else Grid(mesh, (), (), ())


def _dtensor_entry(plan: Plan, layout: LeafLayout, leaf: Any) -> Entry:
    """A DTensor's piece, splits and grid, from its placements alone (every rank's box by DTensor's chunking)."""
    shape = tuple(leaf.shape)
    size, offset = ckpt_lib.dtensor_box(ckpt_lib.layout_of_dtensor(leaf))
    splits = tuple((a, d % len(shape)) for a, d in zip(layout.axes, layout.dims) if plan.mesh.sizes[a] > 1 and d is not None)
    boxes = _dtensor_boxes(leaf, leaf.device_mesh.mesh.reshape(-1).tolist(), layout.path) if splits else ()
    return Piece(shape, size, offset, tuple(a for a, _ in splits)), splits, _bounds(shape, boxes)


def _local(plan: Plan, tree_leaves: Sequence[Any]) -> tuple[list[Optional[Entry]], list[tuple[str, ckpt_lib.Splits, tuple[int, ...]]], list[int]]:
    """The entries known locally, and the plain split leaves' records (path, splits, local shape)."""
    found: list[Optional[Entry]] = [None] * len(tree_leaves)
    records, pending = [], []
    for index, (leaf, layout) in enumerate(zip(tree_leaves, plan.layouts)):
        if leaf is None:
            continue
        if dtensor_lib.is_dtensor(leaf):
            found[index] = _dtensor_entry(plan, layout, leaf)  # type: ignore[arg-type]
            continue
        splits = plain_splits(plan, layout, leaf, hint=" for a piece split along a dim, or pass the flat piece") if layout is not None else ()
        if not splits:
            found[index] = _whole(leaf.shape)
            continue
        records.append((layout.path, splits, tuple(leaf.shape)))  # type: ignore[union-attr]
        pending.append(index)
    return found, records, pending


def element_pieces(tree: Any, spec: Optional[ShardingSpec] = None, *, what: str) -> list[Optional[Piece]]:
    """Per leaf of ``tree`` (``None`` for ``None`` leaves): where this rank's piece lies in the
    leaf's logical tensor (a flat piece's logical tensor is the flattened leaf). See the module's
    docstring for the layouts and the one exchange of plain pieces' sizes."""
    return list(element_grid(tree, spec, what=what).pieces)


def element_grid(tree: Any, spec: Optional[ShardingSpec] = None, *, what: str) -> Grid:
    """:func:`element_pieces` with the mesh, every leaf's splits and the grid of every rank's
    pieces (:class:`Grid`); found once per plan and set of local shapes (see the module's docstring)."""
    tree_leaves = tree_lib.leaves(tree)
    if spec is None and not dtensor_lib.has_dtensor(tree_leaves):
        return _unsharded(tree_leaves)
    key = tuple(None if leaf is None else (tuple(leaf.shape), tuple(dtensor_lib.local(leaf).shape)) for leaf in tree_leaves)
    if spec is None:  # DTensors describe themselves (plain leaves beside them are whole): no exchange
        plan, tree_leaves = plan_for(tree, None, what=what, check=False)
        cached = plan.__dict__.get(_CACHE, {}).get(key)
        if cached is not None:
            return cached
        grid = _grid(plan.mesh, _local(plan, tree_leaves)[0])
        if not torch.compiler.is_compiling():
            plan.__dict__.setdefault(_CACHE, {})[key] = grid
        return grid

    plan: Optional[Plan] = None
    error: Optional[Exception] = None
    try:
        plan, tree_leaves = plan_for(tree, spec, what=what, check=False)
        cached = plan.__dict__.get(_CACHE, {}).get(key)
        if cached is not None:
            return cached
        if torch.compiler.is_compiling():
            raise ValueError(
                f"{what}: the places of this rank's pieces were not found by an eager call before compiling; run "
                "the step once eagerly first (gradtx.compile_step does)"
            )
        found, records, pending = _local(plan, tree_leaves)
    except (ValueError, TypeError) as exc:
        error, records = exc, []
    payload = {"error": None if error is None else (type(error).__name__, str(error)), "records": records}
    gathered = ckpt_lib.exchange(spec.axes, payload)
    for rank, theirs in gathered:
        if theirs["error"] is not None:
            kind, message = theirs["error"]
            where = f" (found on rank {rank})" if len(gathered) > 1 else ""
            raise (TypeError if kind == "TypeError" else ValueError)(f"{what}: {message}{where}")
    holders: dict[str, dict[int, tuple[ckpt_lib.Splits, tuple[int, ...]]]] = {}
    for rank, theirs in gathered:
        for path, splits, local in theirs["records"]:
            holders.setdefault(path, {})[rank] = (splits, local)
    me = dist.get_rank()
    try:
        for index, (path, splits, local) in zip(pending, records):
            shape, offsets, _ = ckpt_lib.tile(spec.axes, holders[path], path=path, kind="leaf")
            boxes = [(theirs, offsets[rank]) for rank, (_, theirs) in holders[path].items()]
            found[index] = (Piece(shape, local, offsets[me], tuple(axis for axis, _ in splits)), splits, _bounds(shape, boxes))
    except ValueError as exc:  # every rank tiles every rank's records alike: the same error everywhere
        raise ValueError(f"{what}: {exc}") from None
    grid = _grid(spec.axes, found)
    plan.__dict__.setdefault(_CACHE, {})[key] = grid  # type: ignore[union-attr]
    return grid


def contiguous_start(piece: Optional[Piece]) -> Optional[int]:
    """The row-major index in its logical tensor of a local piece's first element where the piece's
    elements are one run of consecutive indices (its dims after the first one longer than 1 are
    whole), else ``None``. ``piece`` ``None``: the whole tensor, from 0."""
    if piece is None:
        return 0
    longer = [d for d, n in enumerate(piece.size) if n > 1]
    if longer and any(piece.size[d] != piece.shape[d] for d in range(longer[0] + 1, len(piece.shape))):
        return None
    start, stride = 0, 1
    for dim in range(len(piece.shape) - 1, -1, -1):
        start += piece.offset[dim] * stride
        stride *= piece.shape[dim]
    return start


def logical_indices(piece: Optional[Piece], shape: Sequence[int], device: torch.device) -> Tensor:
    """The row-major index of every element of a local piece in its logical tensor (int64, of the
    local ``shape``; a flat piece's indices are its start plus ``arange``). ``piece`` ``None``:
    the piece is the whole tensor."""
    shape = tuple(shape)
    if piece is None:
        return torch.arange(int(torch.Size(shape).numel()), dtype=torch.int64, device=device).view(shape)
    index = torch.zeros(piece.size, dtype=torch.int64, device=device)
    stride = 1
    for dim in range(len(piece.shape) - 1, -1, -1):
        view = [1] * len(piece.size)
        view[dim] = piece.size[dim]
        positions = torch.arange(piece.offset[dim], piece.offset[dim] + piece.size[dim], dtype=torch.int64, device=device)
        index = index + positions.view(view) * stride
        stride *= piece.shape[dim]
    return index.view(shape)
