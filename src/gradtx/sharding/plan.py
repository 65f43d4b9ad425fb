"""The resolved layout of a gradient tree: per leaf, the axes it is split over and whether this
rank's piece enters global sums; for the tree, the one group a global norm all-reduces over.

A plan is built once per tree structure (and DTensor layout) and cached, on the ``ShardingSpec``
or, for DTensors without a spec, per reference mesh; building it validates everything, so a bad
spec fails on every rank before any collective.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from gradtx import tree as tree_lib
from gradtx.sharding import dtensor as dtensor_lib
from gradtx.sharding.mesh import MeshAxes, _world_key
from gradtx.sharding.placements import Shard
from gradtx.sharding.spec import ShardingSpec

_PLAIN, _ABSENT = 1, 0
_MAX_CACHED_PLANS = 64


@dataclass(frozen=True)
class LeafLayout:
    """One leaf on this rank.

    ``axes``: mesh axes whose ranks hold disjoint pieces (with ``dims``, the tensor dim split along
    each, ``None`` when unknown); ``counted``: whether this rank's piece enters global sums (not a
    duplicate, and at coordinate 0 of every copy axis inside the global group).
    """

    path: str
    axes: tuple[str, ...]
    dims: tuple[Optional[int], ...]
    duplicate: bool
    counted: bool


@dataclass
class Plan:
    mesh: MeshAxes
    layouts: list[Optional[LeafLayout]]  # None for None leaves
    global_axes: tuple[str, ...]
    stage_axis: Optional[str]
    check_consistency: bool
    fingerprint: Optional[int] = None

    def global_group(self) -> Optional[Any]:
        return self.mesh.group(self.global_axes)


# DTensor-only trees (no ShardingSpec): reference meshes and plans, per default process group.
_DTENSOR_MESHES: dict[Any, MeshAxes] = {}
_DTENSOR_PLANS: dict[Any, Plan] = {}


def _layout_key(tree_leaves: Sequence[Any]) -> tuple[Any, ...]:
    if dtensor_lib.dtensor_type() is None:
        return tuple(_ABSENT if leaf is None else _PLAIN for leaf in tree_leaves)
    return tuple(
        _ABSENT if leaf is None else (dtensor_lib.describe(leaf) or _PLAIN) for leaf in tree_leaves
    )


def plan_for(tree: Any, spec: Optional[ShardingSpec], *, what: str) -> tuple[Plan, list[Any]]:
    """The (cached) plan of ``tree`` under ``spec`` and the tree's leaves (``None`` included)."""
    tree_leaves, treedef = tree_lib.flatten(tree)
    key = (treedef, _layout_key(tree_leaves))
    if spec is not None:
        plan = spec.plans.get(key)
        if plan is None:
            tree_lib.check_tensors(tree, tree_leaves, what=what)
            plan = _build(tree, tree_leaves, spec, spec.axes, key)
            if len(spec.plans) >= _MAX_CACHED_PLANS:
                spec.plans.clear()
            spec.plans[key] = plan
        return plan, tree_leaves
    world_key = (_world_key(), key)
    plan = _DTENSOR_PLANS.get(world_key)
    if plan is None:
        tree_lib.check_tensors(tree, tree_leaves, what=what)
        plan = _build(tree, tree_leaves, None, _reference_mesh(tree_leaves), key)
        if len(_DTENSOR_PLANS) >= _MAX_CACHED_PLANS:
            _DTENSOR_PLANS.clear()
        _DTENSOR_PLANS[world_key] = plan
    return plan, tree_leaves


def _reference_mesh(tree_leaves: Sequence[Any]) -> MeshAxes:
    """For DTensors without a spec: the largest root mesh among theirs, as named axes."""
    roots = []
    for leaf in tree_leaves:
        if leaf is not None and dtensor_lib.is_dtensor(leaf):
            mesh = leaf.device_mesh
            root = mesh._get_root_mesh() if hasattr(mesh, "_get_root_mesh") else mesh
            roots.append(root)
    root = max(roots, key=lambda m: (m.size(), m.ndim))
    key = (_world_key(), root)
    axes = _DTENSOR_MESHES.get(key)
    if axes is None:
        axes = MeshAxes(root, require_names=False, owner="gradtx.sharding")
        _DTENSOR_MESHES[key] = axes
    return axes


def _build(tree: Any, tree_leaves: Sequence[Any], spec: Optional[ShardingSpec], mesh: MeshAxes, key: Any) -> Plan:
    paths = tree_lib.paths(tree)
    given: list[Optional[Shard]] = spec.resolve(tree, tree_leaves, paths) if spec is not None else [None] * len(paths)
    shards: list[Optional[tuple[tuple[str, ...], tuple[Optional[int], ...], bool]]] = []
    for path, leaf, leaf_spec in zip(paths, tree_leaves, given):
        if leaf is None:
            shards.append(None)
            continue
        described = dtensor_lib.describe(leaf)
        if described is not None:
            dmesh, placements = described
            axes, dims = dtensor_lib.placement_layout(
                dmesh,
                placements,
                lambda d, dmesh=dmesh, path=path: mesh.axes_of_mesh_dim(dmesh, d, where=f"leaf {path!r}"),
                path=path,
            )
            if spec is not None and spec.stage_axis in axes:
                raise ValueError(f"leaf {path!r} is a DTensor sharded over the stage axis {spec.stage_axis!r}")
            if leaf_spec is not None and leaf_spec.axes and set(leaf_spec.axes) != set(axes):
                raise ValueError(
                    f"ShardingSpec: leaf {path!r} is a DTensor sharded over {axes or 'no axis'}, but its rule says "
                    f"{leaf_spec!r}; DTensors describe themselves (a rule may only add duplicate=True)"
                )
            shards.append((axes, dims, bool(leaf_spec is not None and leaf_spec.duplicate)))
        elif spec is None:
            shards.append(((), (), False))
        elif leaf_spec is None and spec.leaves is not None:
            raise ValueError(
                f"ShardingSpec: no rule matches leaf {path!r} (a {tuple(leaf.shape)} tensor); add a rule or a default="
            )
        else:
            leaf_spec = leaf_spec or Shard()
            order = {a: d for a, d in zip(leaf_spec.axes, leaf_spec.dims)}
            axes = mesh.ordered(leaf_spec.axes)
            shards.append((axes, tuple(order[a] for a in axes), leaf_spec.duplicate))

    stage_axis = spec.stage_axis if spec is not None else None
    spanned = [a for entry in shards if entry is not None for a in entry[0]]
    if spec is not None:
        spanned += list(spec.declared_axes)
    if stage_axis is not None:
        spanned.append(stage_axis)
    global_axes = tuple(a for a in mesh.ordered(spanned) if mesh.sizes[a] > 1)

    layouts: list[Optional[LeafLayout]] = []
    for path, entry in zip(paths, shards):
        if entry is None:
            layouts.append(None)
            continue
        axes, dims, duplicate = entry
        copies = [a for a in global_axes if a not in axes and a != stage_axis]
        counted = not duplicate and all(mesh.coordinate[a] == 0 for a in copies)
        layouts.append(LeafLayout(path, axes, dims, duplicate, counted))
    plan = Plan(mesh, layouts, global_axes, stage_axis, bool(spec is not None and spec.check_consistency))
    if plan.check_consistency:
        plan.fingerprint = _fingerprint(plan)
    return plan


def hash_text(text: str) -> int:
    """A stable 62-bit hash (the same on every rank, unlike ``hash``), so its negation fits int64."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 2


def _fingerprint(plan: Plan) -> int:
    """What ranks of one stage must agree on: leaf paths, layouts and duplicate flags."""
    return hash_text(repr([None if l is None else (l.path, l.axes, l.dims, l.duplicate) for l in plan.layouts]))
