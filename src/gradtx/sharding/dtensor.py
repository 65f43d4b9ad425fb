"""The DTensor bridge: DTensor gradients describe their own layout, and are computed on locally.

Placements translate to leaf specs: ``Shard(d)`` on a mesh dim -> sharded over the axes that dim
spans (tensor dim ``d``), ``Replicate`` -> copies, ``Partial`` -> an error (the gradient is not
reduced yet). Arithmetic runs on the local shards, and results are wrapped back with the same mesh
and placements, so no DTensor dispatch or implicit collective happens on the hot path.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch
from torch import Tensor

from gradtx.tree import dtensor_type

# The DTensor attributes read here: its local shard and its spec (mesh, placements, shard order,
# global shape), which a DTensor is built from without going through autograd.
_LOCAL_TENSOR, _SPEC = "_local_tensor", "_spec"


def has_dtensor(tensors: Sequence[Any]) -> bool:
    """Whether any of ``tensors`` is a DTensor. Costs one dict lookup when DTensor was never imported."""
    cls = dtensor_type()
    if cls is None:
        return False
    return any(type(t) is not Tensor and isinstance(t, cls) for t in tensors)


def is_dtensor(tensor: Any) -> bool:
    cls = dtensor_type()
    return cls is not None and isinstance(tensor, cls)


def local(tensor: Tensor) -> Tensor:
    """The tensor this rank holds: the local shard of a DTensor, or the tensor itself."""
    return _local_of(tensor) if is_dtensor(tensor) else tensor


def storage_pointers(tensors: Sequence[Any]) -> set[int]:
    """The addresses of the memory ``tensors`` hold on this rank (a DTensor's local shard's), to
    tell whether two trees share memory; sparse and other unstrided tensors, and non-tensors, add none."""
    strided = torch.strided
    return {
        (t if type(t) is Tensor else local(t)).untyped_storage().data_ptr()
        for t in tensors
        if isinstance(t, Tensor) and t.layout == strided
    }


def _local_of(tensor: Any) -> Tensor:
    """A DTensor's local shard: its ``_local_tensor`` itself (no autograd node, so results written
    into it land in the DTensor), or ``to_local()`` where this torch has no such attribute."""
    found = getattr(tensor, _LOCAL_TENSOR, None)
    return found if found is not None else tensor.to_local()


def _like(cls: type, original: Any, result: Tensor) -> Any:
    """``result`` as a DTensor laid out as ``original`` (mesh, placements, shard order, global shape):
    built on ``original``'s spec, or through ``from_local`` where this torch's DTensor has no
    ``_spec`` to build on."""
    spec = getattr(original, _SPEC, None)
    if spec is not None:
        return cls(result, spec, requires_grad=result.requires_grad)  # type: ignore[call-arg]
    return cls.from_local(  # type: ignore[attr-defined]
        result, original.device_mesh, original.placements, run_check=False, shape=original.shape, stride=original.stride()
    )


def locals_of(tensors: Sequence[Tensor]) -> tuple[list[Tensor], Callable[[Sequence[Tensor]], list[Tensor]]]:
    """The local tensors of ``tensors`` and a function wrapping same-shaped results back like them.

    A result that *is* the local tensor (an in-place update) gives back the original DTensor.
    """
    cls = dtensor_type()
    if cls is None or not any(isinstance(t, cls) for t in tensors):
        return list(tensors), list
    originals = list(tensors)
    locals_ = [_local_of(t) if isinstance(t, cls) else t for t in originals]

    def rewrap(results: Sequence[Tensor]) -> list[Tensor]:
        out = []
        for original, local_tensor, result in zip(originals, locals_, results):
            if not isinstance(original, cls) or result is original:
                out.append(result)
            elif result is local_tensor:
                out.append(original)
            else:
                # results keep the layout and dtype of their input
                out.append(_like(cls, original, result))
        return out

    return locals_, rewrap


def check_one_layout(dtensors: Sequence[Any]) -> None:
    """Local pieces combine elementwise only where the DTensors are laid out alike, and none holds
    a ``Partial`` (not yet reduced) value: a ``ValueError`` otherwise, before anything is computed
    (elementwise work on the local pieces would give a silently wrong number)."""
    for t in dtensors:
        for placement in t.placements:
            if placement.is_partial():
                raise ValueError(
                    "a DTensor with a Partial placement (a gradient not reduced yet) cannot be updated elementwise "
                    "on this rank's piece; reduce it first (e.g. grad.redistribute(placements=[Replicate()]) or let "
                    "FSDP/DDP finish its reduce-scatter)"
                )
    first = dtensors[0]
    for t in dtensors[1:]:
        if t.placements != first.placements or t.device_mesh != first.device_mesh or t.shape != first.shape:
            raise ValueError(
                f"DTensors laid out differently ({list(first.placements)} of shape {tuple(first.shape)} and "
                f"{list(t.placements)} of shape {tuple(t.shape)}) cannot be combined elementwise on their local "
                "pieces; give the params, gradients and state one layout (redistribute one of them)"
            )


def without_partial(tensors: Sequence[Any]) -> list[Any]:
    """``tensors``, each DTensor with a ``Partial`` placement (a gradient not reduced yet) reduced to
    ``Replicate`` on those mesh dims: the all-reduce DTensor itself makes before a nonlinear op, for
    steps whose ops DTensor cannot run on a ``Partial`` input (an in-place sign, say)."""
    out = []
    for tensor in tensors:
        if is_dtensor(tensor) and any(p.is_partial() for p in tensor.placements):  # type: ignore[attr-defined]
            from torch.distributed.tensor import Replicate

            placements = [Replicate() if p.is_partial() else p for p in tensor.placements]  # type: ignore[attr-defined]
            tensor = tensor.redistribute(tensor.device_mesh, placements)  # type: ignore[attr-defined]
        out.append(tensor)
    return out


def foreach_on_shards(
    kernel: Callable[..., Any], selves: Sequence[Tensor], args: Sequence[Any], kwargs: dict[str, Any], *, inplace: bool
) -> Optional[list[Tensor]]:
    """An elementwise foreach ``kernel`` on DTensors, run on their local shards; ``None`` where it can't be.

    ``selves`` are DTensors sharded or replicated (no ``Partial``); each list argument holds, per
    position, a DTensor laid out as that position's (mesh, placements, global shape) or a 0-d
    tensor; other arguments are numbers or 0-d tensors (a 0-d DTensor replicated on its mesh).
    Each shard's result is then the shard of the elementwise result, the numbers DTensor's dispatch
    computes, without its sharding propagation on every call (seconds on a 2-D mesh for a step's
    first calls). Returns ``selves`` (in place) or the results laid out as ``selves``.
    """
    cls = dtensor_type()
    if (
        cls is None
        or torch.compiler.is_compiling()  # the tracer propagates once, at compile time
        or not all(isinstance(s, cls) for s in selves)
        or any(isinstance(v, Tensor) for v in kwargs.values())
    ):
        return None
    layouts = [(s.device_mesh, s.placements, s.shape) for s in selves]
    if not all(p.is_shard() or p.is_replicate() for _, placements, _ in layouts for p in placements):
        return None
    local_args: list[Any] = []
    for arg in args:
        if isinstance(arg, list):
            column = [
                _local_of(value) if isinstance(value, cls) and (value.device_mesh, value.placements, value.shape) == layout
                else _scalar(value, cls)
                for value, layout in zip(arg, layouts)
            ]
            if any(value is None for value in column):
                return None
            local_args.append(column)
        elif isinstance(arg, Tensor):
            local_args.append(_scalar(arg, cls))
            if local_args[-1] is None:
                return None
        else:
            local_args.append(arg)
    local_selves = [_local_of(s) for s in selves]
    if inplace:
        kernel(local_selves, *local_args, **kwargs)
        return list(selves)
    return [
        _like(cls, s, r) if r.dtype == s.dtype else cls.from_local(  # type: ignore[attr-defined]
            r, s.device_mesh, s.placements, run_check=False, shape=s.shape, stride=s.stride()
        )
        for s, r in zip(selves, kernel(local_selves, *local_args, **kwargs))
    ]


def _scalar(value: Any, cls: type) -> Optional[Tensor]:
    """A 0-d tensor operand as each shard uses it (a replicated 0-d DTensor's local value), else ``None``."""
    if not isinstance(value, Tensor) or value.dim() != 0:
        return None
    if not isinstance(value, cls):
        return value
    return _local_of(value) if all(p.is_replicate() for p in value.placements) else None


def describe(tensor: Tensor) -> Optional[tuple[Any, tuple[Any, ...]]]:
    """``(mesh, placements)`` of a DTensor (the part of its layout a plan depends on), else ``None``."""
    if not is_dtensor(tensor):
        return None
    return tensor.device_mesh, tuple(tensor.placements)  # type: ignore[attr-defined]


def _is_shard(placement: Any) -> bool:
    """``Shard(d)``, or the ``_StridedShard(d)`` that FSDP2 over TP produces: disjoint pieces either way."""
    if placement.is_shard():
        return True
    try:
        from torch.distributed.tensor.placement_types import _StridedShard
    except ImportError:
        return False
    return isinstance(placement, _StridedShard)


def placement_layout(mesh: Any, placements: Sequence[Any], axes_of_dim: Callable[[int], tuple[str, ...]], *, path: str):
    """Sharded axes and their tensor dims from DTensor placements; ``Partial`` is a ``ValueError``.

    ``axes_of_dim(i)`` names the reference-mesh axes that the DTensor's mesh dim ``i`` spans.
    """
    axes: list[str] = []
    dims: list[Optional[int]] = []
    names = mesh.mesh_dim_names
    for mesh_dim, placement in enumerate(placements):
        axis = names[mesh_dim] if names else f"dim{mesh_dim}"
        if _is_shard(placement):
            for spanned in axes_of_dim(mesh_dim):
                axes.append(spanned)
                dims.append(placement.dim)
        elif placement.is_replicate():
            continue
        elif placement.is_partial():
            raise ValueError(
                f"leaf {path!r} is a DTensor with a Partial placement on mesh axis {axis!r}: its gradient "
                "is not reduced yet; reduce it first (e.g. grad.redistribute(placements=[Replicate()]) or "
                "let FSDP/DDP finish its reduce-scatter) before taking norms"
            )
        else:
            raise ValueError(f"leaf {path!r}: unsupported DTensor placement {placement!r} on mesh axis {axis!r}")
    return tuple(axes), tuple(dims)


def reduced_like(tensor: Any, local_result: Tensor, dim: int) -> Any:
    """``local_result`` as this rank's piece of ``tensor`` reduced along tensor ``dim`` (keepdim off).

    Placements splitting ``dim`` become ``Replicate`` (the reduced result is whole along the axes
    that split it), those of later dims move down by one. A plain ``tensor`` gives ``local_result``.
    """
    if not is_dtensor(tensor):
        return local_result
    from torch.distributed.tensor import DTensor, Replicate

    dim = dim % tensor.ndim
    placements = []
    for placement in tensor.placements:
        if _is_shard(placement) and placement.dim == dim:
            placements.append(Replicate())
        elif _is_shard(placement) and placement.dim > dim:
            if placement.is_shard():
                placements.append(type(placement)(placement.dim - 1))
            else:  # _StridedShard keeps its split factor
                placements.append(type(placement)(placement.dim - 1, split_factor=placement.split_factor))
        else:
            placements.append(placement)
    shape = [s for i, s in enumerate(tensor.shape) if i != dim]
    stride, running = [0] * len(shape), 1
    for i in range(len(shape) - 1, -1, -1):
        stride[i], running = running, running * max(shape[i], 1)
    return DTensor.from_local(
        local_result, tensor.device_mesh, placements, run_check=False, shape=torch.Size(shape), stride=tuple(stride)
    )


def relayout(value: Tensor, template: Tensor) -> Tensor:
    """``value`` (the same logical tensor) in ``template``'s dtype, device and layout.

    A plain tensor becomes a DTensor with ``template``'s mesh and placements by keeping this rank's
    slice of it (no communication: every rank is assumed to hold the same full value, as ranks do
    before their parameters are sharded); a DTensor laid out otherwise is gathered first (a
    collective every rank makes). Raises ``ValueError`` when the result's local shape is not
    ``template``'s (a sharding this rank cannot reproduce by slicing).
    """
    if is_dtensor(value) and not (
        is_dtensor(template)
        and value.device_mesh == template.device_mesh  # type: ignore[attr-defined]
        and value.placements == template.placements  # type: ignore[attr-defined]
    ):
        value = value.full_tensor()  # type: ignore[attr-defined]
    if not is_dtensor(template):
        return value.to(dtype=template.dtype, device=template.device)
    if not is_dtensor(value):
        from torch.distributed.tensor import distribute_tensor

        value = value.to(dtype=template.dtype, device=local(template).device)
        value = distribute_tensor(value, template.device_mesh, template.placements, src_data_rank=None)  # type: ignore[attr-defined]
    else:
        value = value.to(dtype=template.dtype)
    if local(value).shape != local(template).shape:
        raise ValueError(
            f"the local piece would be {tuple(local(value).shape)} where the new layout has {tuple(local(template).shape)}"
        )
    return value


def with_empty_dim(tensor: Tensor) -> Tensor:
    """An empty tensor of shape ``(*tensor.shape, 0)`` (no memory) with ``tensor``'s dtype and device,
    laid out as ``tensor`` (a DTensor: the same mesh and placements); see :func:`without_empty_dim`."""
    piece = local(tensor)
    empty = piece.new_empty((*piece.shape, 0))
    if not is_dtensor(tensor):
        return empty
    shape = torch.Size((*tensor.shape, 0))
    return type(tensor).from_local(  # type: ignore[attr-defined]
        empty, tensor.device_mesh, tensor.placements, run_check=False, shape=shape, stride=_contiguous(shape)  # type: ignore[attr-defined]
    )


def without_empty_dim(piece: Tensor, template: Tensor) -> Tensor:
    """``piece`` (this rank's) as the tensor that ``template`` (made by :func:`with_empty_dim`)
    stands for: plain, or a DTensor of ``template``'s layout and shape without its last dim."""
    if not is_dtensor(template):
        return piece
    shape = torch.Size(template.shape[:-1])
    return type(template).from_local(  # type: ignore[attr-defined]
        piece, template.device_mesh, template.placements, run_check=False, shape=shape, stride=_contiguous(shape)  # type: ignore[attr-defined]
    )


def _contiguous(shape: torch.Size) -> tuple[int, ...]:
    return torch.empty(shape, device="meta").stride()
