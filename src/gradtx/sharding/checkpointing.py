"""The distributed side of :mod:`gradtx.checkpoint`: where each rank's piece of a state leaf lies in
the logical tensor, and the objects ``torch.distributed.checkpoint`` (DCP) saves and loads.

A state leaf is laid out in one of four ways (:class:`Layout`):

- ``"whole"``: every rank holds all of it (counters, replicated params' moments, placeholders);
- ``"split"``: a plain piece of a leaf split over mesh axes along known tensor dims (a spec's
  ``Shard("tp", dim=0)``; a flat ZeRO piece is a 1-D leaf split along dim 0);
- ``"dtensor"``: a DTensor, which describes itself;
- ``"like"``: a plain piece laid out as a DTensor param's pieces are (a moment of an FSDP2 param
  kept as a plain tensor), given as the mesh, placements and global shape it takes.

Split pieces may be uneven in any way that forms a grid: their sizes travel in the one
``all_gather_object`` each save or load makes (:func:`exchange`), and every rank computes every
piece's offset from them (:func:`tile`). A split piece becomes a DTensor over the spec's mesh
where DTensor's chunking (``torch.chunk`` along each split dim, the mesh's first axis outermost)
gives exactly these pieces, and a :class:`Pieces` otherwise; DCP stores both the same way, as
chunks of the logical tensor, so a checkpoint loads into any other layout.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from gradtx import tree as tree_lib
from gradtx.sharding import dtensor as dtensor_lib
from gradtx.sharding.matrices import _box
from gradtx.sharding.mesh import MeshAxes
from gradtx.sharding.plan import LeafLayout, _reference_mesh, plan_for
from gradtx.sharding.spec import ShardingSpec

Splits = tuple[tuple[str, int], ...]
"""(mesh axis, tensor dim) for every axis of size > 1 that splits a leaf, in mesh order."""


@dataclass(frozen=True)
class Layout:
    """How one state leaf lies across ranks (see the module's docstring). ``splits``: for
    ``"split"``; ``mesh``, ``placements``, ``shape``, ``stride``: the DTensor a ``"like"`` leaf
    becomes; ``checked``: a ``"whole"`` leaf that is no param's (a counter, a generator state),
    whose copies must be equal on every rank."""

    kind: str
    splits: Splits = ()
    mesh: Any = None
    placements: tuple[Any, ...] = ()
    shape: tuple[int, ...] = ()
    stride: tuple[int, ...] = ()
    checked: bool = False


WHOLE = Layout("whole")
CHECKED = Layout("whole", checked=True)
AS_IS = Layout("dtensor")


# --------------------------------------------------------------------------- DCP's chunk object


class Pieces(Tensor):
    """This rank's piece of a logical tensor, as DCP saves and loads it: the logical ``shape``, the
    piece's ``offsets`` in it, and the ``local`` tensor (its storage is what DCP writes from and
    loads into). DCP's chunk protocol (``__create_write_items__``, ``__create_chunk_list__``,
    ``__get_tensor_shard__``) is all it supports: it is a tensor of the logical shape to DCP's
    type checks and size checks, and no operation runs on it."""

    local: Tensor
    offsets: torch.Size

    @staticmethod
    def __new__(cls, local: Tensor, shape: Sequence[int], offsets: Sequence[int]) -> "Pieces":
        made = Tensor._make_wrapper_subclass(cls, torch.Size(shape), dtype=local.dtype, device=local.device, requires_grad=False)
        made.local = local
        made.offsets = torch.Size(offsets)
        return made

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise TypeError(
            f"gradtx.checkpoint.Pieces holds one rank's piece of a logical tensor for torch.distributed.checkpoint "
            f"only; {func} does not run on it (its .local is the piece)"
        )

    def __repr__(self) -> str:  # type: ignore[override]
        return f"Pieces(shape={tuple(self.shape)}, offsets={tuple(self.offsets)}, local={tuple(self.local.shape)}, dtype={self.dtype})"

    def _chunk(self) -> Any:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        return ChunkStorageMetadata(offsets=self.offsets, sizes=self.local.size())

    def __create_write_items__(self, fqn: str, obj: Any) -> list[Any]:
        from torch.distributed.checkpoint.metadata import MetadataIndex, TensorProperties
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

        return [
            WriteItem(
                index=MetadataIndex(fqn, self.offsets),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=self._chunk(), properties=TensorProperties.create_from_tensor(self.local), size=self.size()
                ),
            )
        ]

    def __create_chunk_list__(self) -> list[Any]:
        return [self._chunk()]

    def __get_tensor_shard__(self, index: Any) -> Tensor:
        return self.local


# --------------------------------------------------------------------------- params' layouts


@dataclass
class ParamLayouts:
    """The params' layouts on this rank: the mesh the ranks talk over (``None`` when nothing is
    sharded), per param leaf its :class:`LeafLayout` (``None`` for ``None`` leaves or when nothing
    is sharded) and logical shape."""

    mesh: Optional[MeshAxes]
    layouts: list[Optional[LeafLayout]]
    shapes: list[Optional[tuple[int, ...]]]


def param_layouts(params: Any, spec: Optional[ShardingSpec], *, what: str) -> ParamLayouts:
    """The layouts of ``params`` under ``spec`` (DTensors describe themselves), from the plan every
    sharded reduction uses, with no communication. Raises ``ValueError`` / ``TypeError`` (a leaf
    no rule matches, a ``Partial`` DTensor) on this rank only: :mod:`gradtx.checkpoint` carries it
    to the others in its one exchange."""
    leaves = tree_lib.leaves(params)
    if spec is None and not dtensor_lib.has_dtensor(leaves):
        return ParamLayouts(None, [None] * len(leaves), [None if x is None else tuple(x.shape) for x in leaves])
    plan, leaves = plan_for(params, spec, what=what, check=False)
    shapes: list[Optional[tuple[int, ...]]] = []
    for layout, leaf in zip(plan.layouts, leaves):
        if layout is None:
            shapes.append(None)
        elif dtensor_lib.is_dtensor(leaf):
            shapes.append(tuple(leaf.shape))
        else:
            shape = list(leaf.shape)
            for axis, dim in zip(layout.axes, layout.dims):
                size = plan.mesh.sizes[axis]
                if size > 1 and shape:
                    d = 0 if dim is None and len(shape) == 1 else dim
                    if d is not None and -len(shape) <= d < len(shape):
                        shape[d] *= size
            shapes.append(tuple(shape))
    return ParamLayouts(plan.mesh, plan.layouts, shapes)


def mesh_of(params: Any, spec: Optional[ShardingSpec]) -> Optional[MeshAxes]:
    """The mesh the ranks exchange over, found even when the params' plan cannot be built."""
    if spec is not None:
        return spec.axes
    leaves = [x for x in tree_lib.leaves(params) if x is not None]
    return _reference_mesh(leaves) if dtensor_lib.has_dtensor(leaves) else None


def is_split(param: Any, layout: Optional[LeafLayout], mesh: Optional[MeshAxes]) -> bool:
    """Whether ranks hold different pieces of ``param`` (some axis of size > 1 splits it)."""
    if dtensor_lib.is_dtensor(param):
        sizes = param.device_mesh.shape
        return any(dtensor_lib._is_shard(p) and sizes[i] > 1 for i, p in enumerate(param.placements))
    return layout is not None and mesh is not None and any(mesh.sizes[a] > 1 for a in layout.axes)


def derived(
    param: Any,
    layout: Optional[LeafLayout],
    mesh: Optional[MeshAxes],
    dims: tuple[Optional[int], ...],
    leaf_shape: tuple[int, ...],
    *,
    path: str,
) -> Layout:
    """The layout of a plain state leaf whose dim ``j`` runs along param dim ``dims[j]`` (``None``:
    whole along it). A ``ValueError`` naming ``path`` when the param's split dim is unknown (a
    matrix under ``Shard("dp")`` with no ``dim=``) or the leaf's shape cannot be such a piece."""
    same = dims == tuple(range(len(dims))) and tuple(dtensor_lib.local(param).shape) == leaf_shape
    if dtensor_lib.is_dtensor(param):
        return _like_dtensor(param, dims, leaf_shape, same=same, path=path)
    if not is_split(param, layout, mesh):
        return WHOLE
    splits = []
    for axis, dim in zip(layout.axes, layout.dims):  # type: ignore[union-attr]
        if mesh.sizes[axis] <= 1:  # type: ignore[union-attr]
            continue
        if dim is None and same and len(leaf_shape) == 1:
            dim = 0  # a flat (ZeRO) piece
        if dim is None:
            raise ValueError(
                f"state leaf {path!r}: its param {layout.path!r} is split over axis {axis!r} along a tensor dim "  # type: ignore[union-attr]
                f"the spec does not name, so where this rank's piece lies is unknown; give Shard({axis!r}, dim=...)"
            )
        dim %= max(param.ndim, 1)
        if dim in dims:
            splits.append((axis, dims.index(dim)))
    return Layout("split", tuple(splits)) if splits else WHOLE


def _contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    stride, running = [0] * len(shape), 1
    for i in range(len(shape) - 1, -1, -1):
        stride[i], running = running, running * max(shape[i], 1)
    return tuple(stride)


def _like_dtensor(param: Any, dims: tuple[Optional[int], ...], leaf_shape: tuple[int, ...], *, same: bool, path: str) -> Layout:
    from torch.distributed.tensor import Replicate, Shard

    if same:
        return Layout("like", mesh=param.device_mesh, placements=tuple(param.placements), shape=tuple(param.shape), stride=tuple(param.stride()))
    placements = []
    for placement in param.placements:
        if dtensor_lib._is_shard(placement):
            if placement.dim not in dims:
                placements.append(Replicate())
            elif placement.is_shard():
                placements.append(Shard(dims.index(placement.dim)))
            else:
                raise ValueError(
                    f"state leaf {path!r}: its param is a DTensor with a strided shard ({placement!r}) and the leaf "
                    "has another shape; redistribute the param before saving"
                )
        elif placement.is_replicate():
            placements.append(placement)
        else:
            raise ValueError(f"state leaf {path!r}: its param is a DTensor with placement {placement!r}")
    shape = tuple(param.shape[d] if d is not None else leaf_shape[j] for j, d in enumerate(dims))
    if not any(p.is_shard() for p in placements):
        return WHOLE
    layout = Layout("like", mesh=param.device_mesh, placements=tuple(placements), shape=shape, stride=_contiguous_stride(shape))
    size, _ = dtensor_box(layout)
    if size != leaf_shape:
        raise ValueError(
            f"state leaf {path!r} is {leaf_shape} on this rank, but laid out as its param (global {tuple(param.shape)}, "
            f"{tuple(param.placements)}) with dims {dims} its piece would be {size}"
        )
    return layout


def dtensor_box(layout: Layout) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(local shape, offsets)`` of this rank's piece of a DTensor laid out as ``layout`` (a
    ``"like"`` layout, or a DTensor's own), by DTensor's chunking."""
    mesh = layout.mesh
    coordinate = mesh.get_coordinate()
    splits = []
    for m, placement in enumerate(layout.placements):
        if dtensor_lib._is_shard(placement):
            if not placement.is_shard():
                raise ValueError(f"a strided shard ({placement!r}) has no box of its own")
            splits.append((placement.dim % len(layout.shape), mesh.shape[m], coordinate[m]))
    size, offset = _box(layout.shape, splits)
    return tuple(size), tuple(offset)


def layout_of_dtensor(value: Any) -> Layout:
    """A DTensor's own layout, as a ``"like"`` :class:`Layout`."""
    return Layout("like", mesh=value.device_mesh, placements=tuple(value.placements), shape=tuple(value.shape), stride=tuple(value.stride()))


# --------------------------------------------------------------------------- the one exchange


def exchange(mesh: Optional[MeshAxes], payload: Any) -> list[tuple[int, Any]]:
    """Every rank's ``payload`` as ``(rank, payload)`` pairs in rank order: one ``all_gather_object``
    over all ranks of ``mesh`` (none when there is no mesh, or it is this rank alone)."""
    group = mesh.group(mesh.names) if mesh is not None else None
    if group is None:
        return [(dist.get_rank() if dist.is_available() and dist.is_initialized() else 0, payload)]
    ranks = dist.get_process_group_ranks(group)
    gathered: list[Any] = [None] * len(ranks)
    dist.all_gather_object(gathered, payload, group=group)
    return sorted(zip(ranks, gathered), key=lambda item: item[0])


def tile(
    mesh: MeshAxes, holders: dict[int, tuple[Splits, tuple[int, ...]]], *, path: str, kind: str = "state leaf"
) -> tuple[tuple[int, ...], dict[int, tuple[int, ...]], bool]:
    """The logical shape of a split leaf, every holder's offsets in it, and whether DTensor's
    chunking gives exactly these pieces, from each holder's ``(splits, local shape)``.

    The pieces along a split dim follow the combined coordinate of the axes splitting it (the
    first axis outermost); their sizes may differ, but pieces at the same coordinate must have the
    same size, every coordinate must be held, and dims no axis splits must be alike everywhere.
    Otherwise a ``ValueError`` naming ``path`` (a ``kind``: "state leaf", "leaf"). Pure: every rank
    computes the same answer."""
    (first_rank, (splits, first_shape)), *_ = sorted(holders.items())
    for rank, (other, shape) in holders.items():
        if other != splits or len(shape) != len(first_shape):
            raise ValueError(
                f"{kind} {path!r} is split as {other} with shape {shape} on rank {rank}, but as {splits} with shape "
                f"{first_shape} on rank {first_rank}"
            )
    coordinate = {rank: dict(zip(mesh.names, mesh._rank_coordinate[rank])) for rank in holders}
    shape, offsets = [], {rank: [0] * len(first_shape) for rank in holders}
    for dim in range(len(first_shape)):
        axes = [a for a, d in splits if d == dim]
        counts = [mesh.sizes[a] for a in axes]
        sizes: dict[int, int] = {}
        for rank, (_, local) in sorted(holders.items()):
            index = 0
            for axis, count in zip(axes, counts):
                index = index * count + coordinate[rank][axis]
            if sizes.setdefault(index, local[dim]) != local[dim]:
                where = f"at the same coordinate of {tuple(axes)}" if axes else "along a dim no axis splits"
                raise ValueError(
                    f"{kind} {path!r}: the pieces do not form a grid: dim {dim} has {sizes[index]} elements on one rank "
                    f"and {local[dim]} on rank {rank}, {where}"
                )
        total = math.prod(counts)
        missing = [i for i in range(total) if i not in sizes]
        if missing:
            raise ValueError(f"{kind} {path!r}: no rank holds piece {missing[0]} of the {total} along dim {dim}")
        starts = [sum(sizes[i] for i in range(j)) for j in range(total)]
        shape.append(sum(sizes.values()))
        for rank in holders:
            index = 0
            for axis, count in zip(axes, counts):
                index = index * count + coordinate[rank][axis]
            offsets[rank][dim] = starts[index]
    even = all(
        _box(shape, [(d, mesh.sizes[a], coordinate[rank][a]) for a, d in splits]) == (tuple(local), tuple(offsets[rank]))
        for rank, (_, local) in holders.items()
    )
    return tuple(shape), {rank: tuple(o) for rank, o in offsets.items()}, even


def checkpointable(local: Tensor, layout: Layout, mesh: Optional[MeshAxes], shape: tuple[int, ...], offsets: tuple[int, ...], even: bool) -> Tensor:
    """What DCP saves for a plain piece: a DTensor over the mesh where DTensor's chunking describes
    it (``even``) or it follows a DTensor param (``"like"``), else a :class:`Pieces`. Shares
    ``local``'s storage (nothing is copied or communicated)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if layout.kind == "like":
        return DTensor.from_local(local, layout.mesh, layout.placements, run_check=False, shape=torch.Size(layout.shape), stride=layout.stride)
    if not even:
        return Pieces(local, shape, offsets)
    split = dict(layout.splits)
    placements = [Shard(split[name]) if name in split else Replicate() for name in mesh.names]  # type: ignore[union-attr]
    return DTensor.from_local(
        local, mesh.mesh, placements, run_check=False, shape=torch.Size(shape), stride=_contiguous_stride(shape)  # type: ignore[union-attr]
    )


def local_piece(value: Tensor) -> Tensor:
    """The local tensor of a DTensor or a :class:`Pieces`; a plain tensor itself."""
    if isinstance(value, Pieces):
        return value.local
    return dtensor_lib.local(value)


def describe_dtensor(value: Any) -> tuple[Any, ...]:
    """What two DTensors must share to be laid out alike: mesh (its ranks and axis names),
    placements, global shape."""
    mesh = value.device_mesh
    return (tuple(mesh.mesh.reshape(-1).tolist()), tuple(mesh.shape), mesh.mesh_dim_names, tuple(repr(p) for p in value.placements), tuple(value.shape))


def describe_layout(layout: Layout) -> tuple[Any, ...]:
    """:func:`describe_dtensor` of the DTensor a ``"like"`` layout gives."""
    mesh = layout.mesh
    return (tuple(mesh.mesh.reshape(-1).tolist()), tuple(mesh.shape), mesh.mesh_dim_names, tuple(repr(p) for p in layout.placements), tuple(layout.shape))


def digest(value: Any) -> str:
    """A fingerprint of a value, equal on two ranks exactly when their values are (bit for bit)."""
    if not isinstance(value, Tensor):
        return f"{type(value).__name__}:{value!r}"
    data = local_piece(value).detach().cpu().contiguous()
    head = f"{data.dtype}:{tuple(data.shape)}:".encode()
    raw = data.reshape(-1).view(torch.uint8).numpy().tobytes() if data.numel() else b""
    return hashlib.blake2b(head + raw, digest_size=16).hexdigest()
