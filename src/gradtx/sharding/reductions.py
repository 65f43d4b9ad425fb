"""The exact reductions: the global norm (one collective) and per-leaf norms (one per group).

Global norm: each rank sums ``|g|^p`` over the pieces it owns (see :mod:`gradtx.sharding.plan`)
in float32 or wider (for ``p = 2``, eagerly, a plain float32 CPU piece's sum of squares in one
pass that can also read its extremes: :func:`piece_squares`), then ONE all-reduce (SUM; MAX for ``p = inf``, carrying a NaN flag in the same
buffer) runs over the smallest group spanning every sharded or staged axis. Per-leaf norms reduce
each leaf over its own ``Shard`` axes only: the partial sums of all leaves sharing a group are
stacked into one buffer, so there is one all-reduce per distinct group, in a fixed order on every rank.

Without a spec and without DTensors, everything is the local computation of :mod:`gradtx.tree`.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from gradtx import tree as tree_lib
from gradtx.native import observed as native_observed
from gradtx.sharding import dtensor as dtensor_lib
from gradtx.sharding import probe as probe_lib
from gradtx.sharding import waiting
from gradtx.sharding.mesh import MeshAxes
from gradtx.sharding.plan import LeafLayout, Plan, ensure_checked, plan_for
from gradtx.sharding.spec import ShardingSpec

_REDUCE_DTYPE = torch.float64  # one scalar per leaf at most: exact enough, and equal on every rank


def _check_norm_type(norm_type: float, owner: str) -> float:
    p = float(norm_type)
    if not (p > 0.0 or p == math.inf):
        raise ValueError(f"{owner}: norm_type must be > 0 or inf under sharding, got {norm_type}")
    return p


def _check_spec(spec: Any, owner: str) -> None:
    if spec is not None and not isinstance(spec, ShardingSpec):
        raise TypeError(f"{owner}: spec must be a gradtx.sharding.ShardingSpec or None, got {type(spec).__name__}")


def _device_of(tensors: Sequence[Tensor], mesh: MeshAxes) -> torch.device:
    return tensors[0].device if tensors else mesh.device()


def _local_norms(tensors: Sequence[Tensor], p: float) -> list[Tensor]:
    """Per-tensor norms in float32 or wider; ``0`` for an empty piece (uneven shards may hold nothing)."""
    if all(t.numel() > 0 for t in tensors):
        return tree_lib.local_norms(tensors, p)
    dtype = tree_lib.accumulation_dtype([t.dtype for t in tensors])
    norms = [torch.zeros((), dtype=dtype, device=t.device) for t in tensors]
    nonempty = [i for i, t in enumerate(tensors) if t.numel() > 0]
    for i, norm in zip(nonempty, tree_lib.local_norms([tensors[i] for i in nonempty], p)):
        norms[i] = norm.to(dtype)
    return norms


def piece_squares(
    tensors: Sequence[Tensor], device: torch.device, *, norms: Callable[[list[Tensor]], list[Tensor]] = lambda ts: _local_norms(ts, 2.0),
    known: Optional[Sequence[Optional[float]]] = None,
) -> Tensor:
    """Per-piece sums of squares (float64, on ``device``), as a sharded 2-norm adds them up.

    Eagerly, a plain float32 CPU piece's sum is :func:`gradtx.native.observed.squares`' (float32
    within blocks of 2048 values, float64 across them), the order in which
    :func:`gradtx.sharding.statistics.gradient_partials` reads it with the piece's extremes in one
    pass; any other piece's is the square of its norm, taken by ``norms``. ``known``: sums already
    taken in that order (``None`` where none is)."""
    found = taken_squares(tensors, known)
    rest = [i for i, total in enumerate(found) if total is None]
    if len(rest) == len(tensors):
        return _squares(norms(list(tensors)), device) if tensors else torch.zeros(0, dtype=_REDUCE_DTYPE, device=device)
    out = torch.tensor([0.0 if total is None else total for total in found], dtype=_REDUCE_DTYPE, device=device)
    if rest:
        out[rest] = _squares(norms([tensors[i] for i in rest]), device)
    return out


def taken_squares(tensors: Sequence[Tensor], known: Optional[Sequence[Optional[float]]] = None) -> list[Optional[float]]:
    """Per tensor, its sum of squares from ``known``, else :func:`gradtx.native.observed.squares`'
    pass over it, else ``None`` (a tensor that kernel does not take)."""
    found = list(known) if known is not None else [None] * len(tensors)
    return [total if total is not None else native_observed.squares(t) for t, total in zip(tensors, found)]


def _squares(norms: list[Tensor], device: torch.device) -> Tensor:
    """The squares (float64, on ``device``) of per-piece norms: stacked, then cast once."""
    if all(n.device == device for n in norms):
        return torch.stack(norms).to(_REDUCE_DTYPE) ** 2
    return torch.stack([n.to(device=device, dtype=_REDUCE_DTYPE) for n in norms]) ** 2


def is_sharded(tree_leaves: Sequence[Any], spec: Optional[ShardingSpec]) -> bool:
    """Whether a norm of these leaves needs the sharded path (a spec, or a DTensor among them)."""
    return spec is not None or dtensor_lib.has_dtensor(tree_leaves)


# --------------------------------------------------------------------------- global norm


def global_norm(tree: Any, spec: Optional[ShardingSpec] = None, *, norm_type: float = 2.0) -> Tensor:
    """The ``norm_type``-norm of the *logical* gradient ``tree``: every element counted once.

    Plain tensors are laid out by ``spec``; DTensors by their placements. One all-reduce over the
    smallest group spanning the sharded and staged axes (none when nothing is sharded), after which
    every rank holds the same value. Without a spec and without DTensors: the local norm, exactly
    ``torch.nn.utils.get_total_norm``'s number. Accumulates in float32 or wider.

    A leaf that fails on one rank only (not a tensor, an integer dtype) still lets that rank join
    the all-reduce, with an error bit in it, so every rank of the group raises the same error; so
    do ranks that ran this reduction a different number of times (see :mod:`gradtx.sharding.waiting`).
    """
    _check_spec(spec, "global_norm")
    bad: Optional[Exception] = None
    try:
        tree_leaves, _, present = tree_lib.tensor_leaves(tree, what="global_norm")
    except TypeError as exc:  # a leaf that is no tensor: under sharding, reported on every rank
        tree_leaves, present, bad = tree_lib.leaves(tree), [], exc
    if not is_sharded(tree_leaves, spec):
        if bad is not None:
            raise bad
        return tree_lib.total_norm([tree_leaves[i] for i in present], float(norm_type))
    p = _check_norm_type(norm_type, "global_norm")
    probe = probe_lib.waiting_probe(tree_leaves, spec) if bad is None else None
    plan: Optional[Plan] = None
    if probe is not None:
        # the flag may ride in the norm's all-reduce only if that spans the whole mesh, as flags do
        try:
            plan, tree_leaves = plan_for(tree, spec, what="global_norm", check=False)
        except (ValueError, TypeError):
            probe = None  # the checked call below reports the error on every rank
        else:
            if not spans_mesh(plan):
                probe = None
    op = f"global_norm(p={p})" + (" with a finiteness flag" if probe is not None else "")
    if plan is None:
        plan, tree_leaves = plan_for(tree, spec, what="global_norm", op=op)
    else:
        ensure_checked(plan, tree_leaves, spec, op=op)
    norm, finite = norm_from_plan(plan, tree_leaves, p, with_finite=probe is not None, op=op, error=bad)
    if probe is not None:
        probe.finite = finite
    return norm


def spans_mesh(plan: Plan) -> bool:
    """Whether the global norm's group is the whole mesh (every axis of size > 1 is sharded or staged)."""
    return set(plan.global_axes) == {a for a in plan.mesh.names if plan.mesh.sizes[a] > 1}


def _bad_dtype(plan: Plan, tree_leaves: Sequence[Any], dtype: torch.dtype) -> TypeError:
    """The error for the first present leaf of ``dtype``, which is neither floating point nor complex."""
    path = next(l.path for leaf, l in zip(tree_leaves, plan.layouts) if l is not None and dtensor_lib.local(leaf).dtype == dtype)
    return TypeError(f"leaf {path!r} is a {dtype} tensor; gradients must be floating point or complex")


def _norm_buffer(plan: Plan, tree_leaves: Sequence[Any], p: float, with_finite: bool) -> tuple[Tensor, torch.dtype, Optional[Tensor]]:
    """This rank's share (float64): ``[sum |g|^p]`` or ``[max, nan flag]`` for ``inf``, then ``[not
    finite]`` with ``with_finite``; the norm's dtype; and whether its own pieces are all finite.
    A leaf that is not a floating-point or complex tensor is a ``TypeError`` naming it."""
    present = plan.pieces(tree_leaves)
    dtypes = [t.dtype for t in present]
    for kind in set(dtypes):
        if not (kind.is_floating_point or kind.is_complex):
            raise _bad_dtype(plan, tree_leaves, kind)
    owned = plan.pieces(tree_leaves, counted_only=True)
    dtype = tree_lib.accumulation_dtype(dtypes)
    device = _device_of(present, plan.mesh)
    local_finite = tree_lib.all_finite(present, device=device) if with_finite else None
    if p == 2.0:
        buffer = piece_squares(owned, device).sum().reshape(1)
    else:
        norms = [n.to(device) for n in _local_norms(owned, p)]
        stacked = torch.stack(norms) if norms else torch.zeros(1, dtype=dtype, device=device)
        if p == math.inf:
            buffer = _norm_partials([stacked.max()], p)[0].to(_REDUCE_DTYPE)
        else:
            buffer = (stacked.to(_REDUCE_DTYPE) ** p).sum().reshape(1)
    if local_finite is not None:
        buffer = torch.cat([buffer, (~local_finite).to(_REDUCE_DTYPE).reshape(1)])
    return buffer, dtype, local_finite


def norm_from_plan(
    plan: Plan,
    tree_leaves: Sequence[Any],
    p: float,
    *,
    with_finite: bool = False,
    op: str = "global_norm",
    error: Optional[Exception] = None,
) -> tuple[Tensor, Optional[Tensor]]:
    """The logical norm, and with ``with_finite`` whether every rank's pieces are all finite, reduced
    in the same all-reduce (as a 0/1 flag: gloo's MIN/MAX would drop a NaN value).

    ``error``: what this rank found wrong before (a leaf that is no tensor); it and any error met
    while computing this rank's share ride in the all-reduce as an error bit, and every rank of
    the group raises (see :func:`gradtx.sharding.waiting.all_reduce`).
    """
    group = plan.global_group()
    if group is None:
        if error is not None:
            raise error
        present = plan.pieces(tree_leaves)
        owned = plan.pieces(tree_leaves, counted_only=True)
        if len(owned) == len(present) and all(t.numel() > 0 for t in owned):
            dtype = tree_lib.accumulation_dtype([t.dtype for t in present])
            device = _device_of(present, plan.mesh)
            local_finite = tree_lib.all_finite(present, device=device) if with_finite else None
            norm = tree_lib.total_norm(owned, p).to(device=device, dtype=dtype) if owned else torch.zeros((), dtype=dtype, device=device)
            return norm, local_finite
        buffer, dtype, local_finite = _norm_buffer(plan, tree_leaves, p, with_finite)
        return _finish_norm(buffer, p, dtype), (local_finite if with_finite else None)
    try:
        if error is not None:
            raise error
        buffer, dtype, _ = _norm_buffer(plan, tree_leaves, p, with_finite)
    except (ValueError, TypeError, RuntimeError) as exc:
        if torch.compiler.is_compiling():
            raise
        error, dtype = exc, torch.float32
        width = (2 if p == math.inf else 1) + (1 if with_finite else 0)
        buffer = torch.zeros(width, dtype=_REDUCE_DTYPE, device=plan.mesh.device())
    reduce_op = dist.ReduceOp.MAX if p == math.inf else dist.ReduceOp.SUM
    buffer = waiting.all_reduce(buffer, reduce_op, group, what=op, calls=plan.calls, error=error, timeout=plan.timeout)
    finite = buffer[-1] == 0 if with_finite else None
    return _finish_norm(buffer, p, dtype), finite


# --------------------------------------------------------------------------- per-leaf reductions


def reduce_grouped(
    mesh: MeshAxes,
    items: Sequence[tuple[tuple[str, ...], Tensor]],
    op: Any,
    *,
    timeout: Optional[float] = None,
    what: str = "a per-leaf reduction",
) -> list[Tensor]:
    """All-reduces each 1-D tensor of ``items`` over the group of its axes, one collective per group.

    Tensors over the same axes are concatenated into one float64 buffer; groups run in mesh order,
    the same on every rank, so ranks that share groups never wait on each other out of order.
    """
    out: list[Tensor] = [t for _, t in items]
    by_axes: dict[tuple[str, ...], list[int]] = {}
    for index, (axes, _) in enumerate(items):
        effective = tuple(a for a in mesh.ordered(axes) if mesh.sizes[a] > 1)
        if effective:
            by_axes.setdefault(effective, []).append(index)
    order = {name: i for i, name in enumerate(mesh.names)}
    for axes in sorted(by_axes, key=lambda a: tuple(order[x] for x in a)):
        indices = by_axes[axes]
        device = items[indices[0]][1].device
        parts = [items[i][1].to(device=device, dtype=_REDUCE_DTYPE).reshape(-1) for i in indices]
        buffer = torch.cat(parts)
        waiting.all_reduce_bounded(buffer, op, mesh.group(axes), what=what, timeout=timeout)
        for i, chunk in zip(indices, torch.split(buffer, [p.numel() for p in parts])):
            out[i] = chunk.to(items[i][1].dtype).reshape(items[i][1].shape)
    return out


def _norm_partials(norms: Sequence[Tensor], p: float) -> list[Tensor]:
    """Per-leaf buffers to reduce: ``[norm^p]`` (SUM), or ``[max, nan flag]`` (MAX) for ``inf``."""
    if p == math.inf:
        return [torch.stack([torch.where(torch.isnan(n), 0.0, n), torch.isnan(n).to(n.dtype)]) for n in norms]
    return [(n.to(_REDUCE_DTYPE) ** p).reshape(1) for n in norms]


def _finish_norm(reduced: Tensor, p: float, dtype: torch.dtype) -> Tensor:
    if p == math.inf:
        return torch.where(reduced[1] > 0, math.nan, reduced[0]).to(dtype)
    return (reduced[0].to(_REDUCE_DTYPE) ** (1.0 / p)).to(dtype)


def leaf_norms(tree: Any, spec: Optional[ShardingSpec] = None, *, norm_type: float = 2.0) -> Any:
    """The ``norm_type``-norm of every leaf of ``tree`` as a whole logical tensor (0-d tensors).

    Each leaf reduces over its own ``Shard`` axes only (copies and pipeline stages do not enter), the
    partial sums of all leaves sharing a group batched into one all-reduce. ``None`` leaves stay
    ``None``. Without a spec and without DTensors: the local per-leaf norms, as
    ``torch.linalg.vector_norm`` gives them, with no communication. Norms are float32 or wider.
    """
    _check_spec(spec, "leaf_norms")
    tree_leaves, treedef, present = tree_lib.tensor_leaves(tree, what="leaf_norms")
    if not is_sharded(tree_leaves, spec):
        norms = tree_lib.local_norms([tree_leaves[i] for i in present], float(norm_type))
        return tree_lib.unflatten(treedef, tree_lib.replace_present(tree_leaves, present, norms))
    p = _check_norm_type(norm_type, "leaf_norms")
    plan, tree_leaves = plan_for(tree, spec, what="leaf_norms", op=f"leaf_norms(p={p})")
    norms = norms_from_plan(plan, tree_leaves, p)
    return tree_lib.unflatten(treedef, norms)


def norms_from_plan(plan: Plan, tree_leaves: Sequence[Any], p: float, *, with_numel: bool = False) -> list[Any]:
    """Per-leaf logical norms (``None`` for absent leaves); with ``with_numel``, ``(norm, numel)`` pairs."""
    indices = [i for i, l in enumerate(plan.layouts) if l is not None]
    locals_ = [dtensor_lib.local(tree_leaves[i]) for i in indices]
    local_norms = _local_norms(locals_, p)
    partials = _norm_partials(local_norms, p)
    if with_numel:
        partials = [torch.cat([b, b.new_full((1,), float(t.numel()))]) for b, t in zip(partials, locals_)]
    items = [(plan.layouts[i].axes, b) for i, b in zip(indices, partials)]  # type: ignore[union-attr]
    op = dist.ReduceOp.MAX if p == math.inf else dist.ReduceOp.SUM
    reduced = reduce_grouped(plan.mesh, items, op, timeout=plan.timeout, what=f"per-leaf norms (p={p})")
    out: list[Any] = [None] * len(plan.layouts)
    for i, n, r in zip(indices, local_norms, reduced):
        norm = _finish_norm(r, p, n.dtype)
        out[i] = (norm, r[-1]) if with_numel else norm
    return out


def leaf_rms(tree: Any, spec: Optional[ShardingSpec] = None) -> Any:
    """The root-mean-square of every leaf as a whole logical tensor (element counts summed exactly
    over its shards, in the same collective as the squares)."""
    _check_spec(spec, "leaf_rms")
    tree_leaves, treedef, present = tree_lib.tensor_leaves(tree, what="leaf_rms")
    if not is_sharded(tree_leaves, spec):
        grads = [tree_leaves[i] for i in present]
        norms = tree_lib.local_norms(grads, 2.0)
        rms = [n / math.sqrt(max(g.numel(), 1)) for n, g in zip(norms, grads)]
        return tree_lib.unflatten(treedef, tree_lib.replace_present(tree_leaves, present, rms))
    plan, tree_leaves = plan_for(tree, spec, what="leaf_rms", op="leaf_rms")
    pairs = norms_from_plan(plan, tree_leaves, 2.0, with_numel=True)
    rms = [None if pair is None else pair[0] / torch.clamp(pair[1], min=1.0).sqrt().to(pair[0].dtype) for pair in pairs]
    return tree_lib.unflatten(treedef, rms)


# --------------------------------------------------------------------------- unit norms


def _unit_axes(
    layout: LeafLayout, local: Tensor, logical_shape: Sequence[int], axis: Any
) -> tuple[Optional[tuple[int, ...]], tuple[str, ...]]:
    """The dims a unit's sum reduces over (``None``: the whole leaf is one unit, see
    :func:`gradtx.tree.unit_dims`), and the mesh axes those sums reduce over: the axes that split
    a reduced dim (a split kept dim gives each rank whole units of its own)."""
    dims = tree_lib.unit_dims(logical_shape, axis, what=f"unitwise_norms: leaf {layout.path!r}")
    if dims is None:
        return None, layout.axes
    axes = []
    for mesh_axis, dim in zip(layout.axes, layout.dims):
        if dim is None:
            raise ValueError(
                f"leaf {layout.path!r} is sharded over axis {mesh_axis!r} along an unknown tensor dim, and its "
                f"unit norms need it: give Shard({mesh_axis!r}, dim=...) (0 for column-parallel, 1 for row-parallel)"
            )
        if dim % max(local.ndim, 1) in dims:
            axes.append(mesh_axis)
    return dims, tuple(axes)


def _logical_shape(layout: LeafLayout, leaf: Tensor, local: Tensor, mesh: MeshAxes) -> tuple[int, ...]:
    if leaf is not local:  # a DTensor knows its global shape
        return tuple(leaf.shape)
    shape = list(local.shape)
    for axis, dim in zip(layout.axes, layout.dims):
        if dim is None:
            if sum(1 for s in shape if s != 1) <= 1:
                raise ValueError(
                    f"leaf {layout.path!r} is sharded over axis {axis!r} along an unknown tensor dim, and its "
                    f"unit norms need the whole tensor's shape: give Shard({axis!r}, dim=...)"
                )
            continue
        shape[dim % len(shape)] *= mesh.sizes[axis]
    return tuple(shape)


def unitwise_norms(*trees: Any, spec: Optional[ShardingSpec] = None, axis: Any = None) -> tuple[Any, ...]:
    """Per-unit L2 norms (as :func:`gradtx.unitwise_norm`, ``axis`` included) of the logical leaves
    of each tree.

    Every tree is laid out as the first (gradients and their parameters, say); all partial sums
    go into one all-reduce per distinct group. By default units are slices along tensor dim 0: a
    leaf split along dim 0 (column-parallel, FSDP) needs no communication, a leaf split along
    another dim (row-parallel) reduces over those axes, and a vector-like leaf over all its
    ``Shard`` axes; with ``axis``, the sums reduce over the axes that split the dims in ``axis``.
    Results have the shape of this rank's local piece (``keepdim``), or are 0-d for vector-like leaves.
    """
    if not trees:
        return ()
    _check_spec(spec, "unitwise_norms")
    if spec is None and not any(dtensor_lib.has_dtensor(tree_lib.leaves(t)) for t in trees):
        return tuple(tree_lib.tree_map(lambda x: tree_lib.unitwise_norm(x, axis), t) for t in trees)
    plan, first = plan_for(trees[0], spec, what="unitwise_norms", op=f"unitwise_norms({len(trees)} trees)")
    all_leaves = [first] + [tree_lib.flatten_like(t, tree_lib.structure(trees[0]), trees[0], what="unitwise_norms: params", like="gradients") for t in trees[1:]]
    items: list[tuple[tuple[str, ...], Tensor]] = []
    shapes: list[tuple[int, tuple[int, ...], torch.dtype]] = []
    for index, layout in enumerate(plan.layouts):
        if layout is None:
            continue
        leaf = first[index]
        local = dtensor_lib.local(leaf)
        dims, axes = _unit_axes(layout, local, _logical_shape(layout, leaf, local, plan.mesh), axis)
        for leaves in all_leaves:
            x = dtensor_lib.local(leaves[index])
            if x is None:
                raise ValueError(f"unitwise_norms: leaf {layout.path!r} is None in one tree but not in the first")
            dtype = tree_lib.accumulation_dtype([x.dtype])  # real: a complex leaf's norm is that of its moduli
            if dims is not None:
                sq = torch.linalg.vector_norm(x, 2, dim=dims, keepdim=True, dtype=tree_lib.norm_dtype(x.dtype)) ** 2
            else:
                sq = torch.linalg.vector_norm(x, 2, dtype=tree_lib.norm_dtype(x.dtype)) ** 2
            items.append((axes, sq.reshape(-1)))
            shapes.append((index, tuple(sq.shape), dtype))
    reduced = reduce_grouped(plan.mesh, items, dist.ReduceOp.SUM, timeout=plan.timeout, what="unitwise norms")
    outs = [[None] * len(plan.layouts) for _ in trees]
    position = 0
    for _ in range(sum(1 for l in plan.layouts if l is not None)):
        for t in range(len(trees)):
            index, shape, dtype = shapes[position]
            outs[t][index] = reduced[position].reshape(shape).to(dtype).sqrt()
            position += 1
    treedef = tree_lib.structure(trees[0])
    return tuple(tree_lib.unflatten(treedef, o) for o in outs)
