"""Where every element of this rank's pieces lies in its logical tensor, for any layout.

A transform whose numbers depend on an element's place in the whole leaf (stochastic rounding's
random bits, block-wise quantization's blocks) needs each local element's row-major index in the
logical tensor. :func:`element_pieces` gives, per leaf, this rank's :class:`~gradtx.sharding.matrices.Piece`
(the logical shape, the piece's size and offset), and :func:`logical_indices` the indices:

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
DTensor-only trees need no exchange.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from gradtx import tree as tree_lib
from gradtx.sharding import checkpointing as ckpt_lib
from gradtx.sharding import dtensor as dtensor_lib
from gradtx.sharding.matrices import Piece
from gradtx.sharding.plan import LeafLayout, Plan, plan_for
from gradtx.sharding.spec import ShardingSpec

_CACHE = "_element_pieces"


def _whole(shape: Sequence[int]) -> Piece:
    shape = tuple(shape)
    return Piece(shape, shape, (0,) * len(shape), ())


def _splits(plan: Plan, layout: LeafLayout, leaf: Tensor) -> ckpt_lib.Splits:
    """(axis, dim of the local piece) for every axis of size > 1 splitting a plain leaf; a flat
    piece (no dim) is split along the only dim of its 1-D local tensor."""
    splits = []
    for axis, dim in zip(layout.axes, layout.dims):
        if plan.mesh.sizes[axis] <= 1:
            continue
        if dim is None:
            if leaf.ndim != 1:
                raise ValueError(
                    f"leaf {layout.path!r} is sharded over axis {axis!r} with no tensor dim, as a flat (ZeRO) piece, "
                    f"but this rank's piece is {tuple(leaf.shape)}, not 1-D; give Shard({axis!r}, dim=...) for a "
                    "piece split along a dim, or pass the flat piece"
                )
            dim = 0
        if leaf.ndim == 0:
            raise ValueError(f"leaf {layout.path!r} is a 0-d tensor sharded over axis {axis!r}")
        if not -leaf.ndim <= dim < leaf.ndim:
            raise ValueError(f"leaf {layout.path!r} is split along dim {dim}, but it has {leaf.ndim} dims")
        splits.append((axis, dim % leaf.ndim))
    return tuple(splits)


def _local(plan: Plan, tree_leaves: Sequence[Any]) -> tuple[list[Optional[Piece]], list[tuple[str, ckpt_lib.Splits, tuple[int, ...]]], list[int]]:
    """The pieces known locally, and the plain split leaves' records (path, splits, local shape)."""
    pieces: list[Optional[Piece]] = [None] * len(tree_leaves)
    records, pending = [], []
    for index, (leaf, layout) in enumerate(zip(tree_leaves, plan.layouts)):
        if leaf is None:
            continue
        if dtensor_lib.is_dtensor(leaf):
            size, offset = ckpt_lib.dtensor_box(ckpt_lib.layout_of_dtensor(leaf))
            axes = tuple(a for a in layout.axes if plan.mesh.sizes[a] > 1) if layout is not None else ()
            pieces[index] = Piece(tuple(leaf.shape), size, offset, axes)
            continue
        splits = _splits(plan, layout, leaf) if layout is not None else ()
        if not splits:
            pieces[index] = _whole(leaf.shape)
            continue
        records.append((layout.path, splits, tuple(leaf.shape)))  # type: ignore[union-attr]
        pending.append(index)
    return pieces, records, pending


def element_pieces(tree: Any, spec: Optional[ShardingSpec] = None, *, what: str) -> list[Optional[Piece]]:
    """Per leaf of ``tree`` (``None`` for ``None`` leaves): where this rank's piece lies in the
    leaf's logical tensor (a flat piece's logical tensor is the flattened leaf). See the module's
    docstring for the layouts and the one exchange of plain pieces' sizes."""
    tree_leaves = tree_lib.leaves(tree)
    if spec is None and not dtensor_lib.has_dtensor(tree_leaves):
        return [None if leaf is None else _whole(leaf.shape) for leaf in tree_leaves]
    if spec is None:  # DTensors describe themselves; plain leaves beside them are whole
        plan, tree_leaves = plan_for(tree, None, what=what, check=False)
        return _local(plan, tree_leaves)[0]

    key = tuple(None if leaf is None else tuple(dtensor_lib.local(leaf).shape) for leaf in tree_leaves)
    plan: Optional[Plan] = None
    error: Optional[Exception] = None
    try:
        plan, tree_leaves = plan_for(tree, spec, what=what, check=False)
        cached = plan.__dict__.get(_CACHE, {}).get(key)
        if cached is not None:
            return list(cached)
        if torch.compiler.is_compiling():
            raise ValueError(
                f"{what}: the places of this rank's pieces were not found by an eager call before compiling; run "
                "the step once eagerly first (gradtx.compile_step does)"
            )
        pieces, records, pending = _local(plan, tree_leaves)
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
            axes = tuple(axis for axis, _ in splits)
            pieces[index] = Piece(shape, local, offsets[me], axes)
    except ValueError as exc:  # every rank tiles every rank's records alike: the same error everywhere
        raise ValueError(f"{what}: {exc}") from None
    plan.__dict__.setdefault(_CACHE, {})[key] = tuple(pieces)  # type: ignore[union-attr]
    return pieces


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
