"""The resolved layout of a gradient tree: per leaf, the axes it is split over and whether this
rank's piece enters global sums; for the tree, the one group a global norm all-reduces over.

A plan is built once per tree structure (and DTensor layout) and cached, on the ``ShardingSpec``
or, for DTensors without a spec, per reference mesh; building it validates everything, so a bad
spec fails on every rank before any collective.

Under ``torch.compile`` nothing is built or checked: the tracer finds the plan an eager call built
and checked before (``compile_step`` makes that call; see :mod:`gradtx.sharding.compiling`), looked
up by leaf paths, which it can hash (it cannot hash a tree structure).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Optional, Sequence, Union

import torch

from gradtx import tree as tree_lib
from gradtx.sharding import compiling, consistency
from gradtx.sharding import dtensor as dtensor_lib
from gradtx.sharding.mesh import MeshAxes, _world_key
from gradtx.sharding.placements import Shard
from gradtx.sharding.spec import DEFAULT_TIMEOUT_S, ShardingSpec, explain_unused

_PLAIN, _ABSENT = 1, 0
_MAX_CACHED_PLANS = 64

CheckMode = Union[bool, Literal["once"]]


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
    """A resolved layout.

    ``unused``: the globs of the rules that match none of this rank's leaf paths;
    ``timeout``: the spec's bound on waits; ``checked``: the reductions already checked across
    ranks ("once" mode); ``calls``: per reduction, how many times this rank has run it (carried in
    its collective, so ranks that run it a different number of times are found out).

    Plans of one tree structure and reduction group share ``checked`` and ``calls``: trees that
    differ only in which leaves are ``None`` (a stage's frozen params, then their missing gradients)
    count as one, so ranks whose trees differ so and ranks whose trees do not check and count alike.
    """

    mesh: MeshAxes
    layouts: list[Optional[LeafLayout]]  # None for None leaves
    global_axes: tuple[str, ...]
    stage_axis: Optional[str]
    unused: tuple[str, ...] = ()
    timeout: Optional[float] = DEFAULT_TIMEOUT_S
    checked: set[Any] = field(default_factory=set)
    calls: dict[str, int] = field(default_factory=dict)
    _group: Any = field(default=None, repr=False)

    def global_group(self) -> Optional[Any]:
        """The group a global reduction spans (found once; a traced graph reads the cached one)."""
        if self._group is None and self.global_axes:
            self._group = self.mesh.group(self.global_axes)
        return self._group

    def pieces(self, tree_leaves: Sequence[Any], *, counted_only: bool = False) -> list[Any]:
        """This rank's local tensors of the present leaves (of those entering global sums only, with
        ``counted_only``), DTensors seen as their local shards."""
        return [
            dtensor_lib.local(leaf)
            for leaf, layout in zip(tree_leaves, self.layouts)
            if layout is not None and (layout.counted or not counted_only)
        ]


# DTensor-only trees (no ShardingSpec): reference meshes and plans, per default process group.
_DTENSOR_MESHES: dict[Any, MeshAxes] = {}
_DTENSOR_PLANS: dict[Any, Plan] = {}
# The same plans by (leaf paths, layout key), for the tracer of torch.compile.
_DTENSOR_TRACED: dict[Any, Plan] = {}
# Per (structure, reduction group): the checks and call counts its plans share (see Plan).
_DTENSOR_SHARED: dict[Any, tuple[set[Any], dict[str, int]]] = {}


def _layout_key(tree_leaves: Sequence[Any]) -> tuple[Any, ...]:
    if dtensor_lib.dtensor_type() is None:
        return tuple(_ABSENT if leaf is None else _PLAIN for leaf in tree_leaves)
    return tuple(
        _ABSENT if leaf is None else (dtensor_lib.describe(leaf) or _PLAIN) for leaf in tree_leaves
    )


def plan_for(
    tree: Any,
    spec: Optional[ShardingSpec],
    *,
    what: str,
    op: Optional[str] = None,
    check: bool = True,
    validate: Optional[Callable[[Plan, list[Any]], None]] = None,
    pieces: Optional[Callable[[], tuple[Any, ...]]] = None,
) -> tuple[Plan, list[Any]]:
    """The (cached) plan of ``tree`` under ``spec`` and the tree's leaves (``None`` included).

    ``op`` names the reduction about to run (``"global_norm(p=2.0)"``); ranks are checked to agree
    on it, the plan and the mesh before it runs: on a new plan (``check_consistency="once"``, the
    default), at every call (``True``) or never (``False``); ``check=False`` only looks the plan up
    (an error then raises here, on this rank). ``validate(plan, leaves)``, when given, runs on every
    call after the plan is found and may raise a ``ValueError`` / ``TypeError`` that is reported
    like a plan's own error (on every rank, when the check runs). A plan that cannot be built (no rule
    for a leaf, a ``Partial`` DTensor, an axis the mesh lacks) is an error on every rank when the
    check runs, raised by all of them alike, so no rank is left waiting in a collective.

    ``pieces()``, when given, runs after ``validate`` and returns what the ranks of one pipeline
    stage must also agree on: per leaf the reduction moves whole, ``(path, axes, logical shape,
    local shape)`` (local shapes may differ: uneven DTensor shards). Checked with the plan; a new
    answer (shapes changed) is checked again in "once" mode.
    """
    if torch.compiler.is_compiling():
        plan, tree_leaves = _traced_plan(tree, spec, what=what, op=op or what, check=check)
        if validate is not None:
            validate(plan, tree_leaves)
        return plan, tree_leaves
    compiling.note_plan_use()
    tree_leaves, treedef = tree_lib.flatten(tree)
    layout_key = _layout_key(tree_leaves)
    key: tuple[Any, ...] = (treedef, layout_key)
    cache = spec.plans if spec is not None else _DTENSOR_PLANS
    mesh: Optional[MeshAxes] = spec.axes if spec is not None else None
    plan: Optional[Plan] = None
    error: Optional[Exception] = None
    try:
        given: Optional[list[Optional[Shard]]] = None
        if spec is not None and spec.looks_at_tensors:
            # a callable may look at shapes or dtypes: the plan is cached by what it answers
            tree_lib.check_tensors(tree, tree_leaves, what=what)
            given = spec.resolve(tree, tree_leaves, tree_lib.paths(tree))
            key += (tuple(given),)
        if spec is None:
            key = (_world_key(),) + key
        plan = cache.get(key)
        if plan is None:
            tree_lib.check_tensors(tree, tree_leaves, what=what)
            if mesh is None:
                mesh = _reference_mesh(tree_leaves)
            plan = _build(tree, tree_leaves, spec, mesh, given)
            shared = spec.shared_counts if spec is not None else _DTENSOR_SHARED
            structure = treedef if spec is not None else (_world_key(), treedef)
            plan.checked, plan.calls = shared.setdefault((structure, plan.global_axes), (set(), {}))
            traced = spec.traced_plans if spec is not None else _DTENSOR_TRACED
            if len(cache) >= _MAX_CACHED_PLANS:
                cache.clear()
                traced.clear()
            cache[key] = plan
            traced[_traced_key(tree, layout_key, given)] = plan
        if validate is not None:
            validate(plan, tree_leaves)
        moved = pieces() if pieces is not None else None
    except (ValueError, TypeError) as exc:
        error = exc
        moved = None
    if check:
        where = mesh or (plan.mesh if plan is not None else None)
        _check_if_due(where, plan, tree_leaves, spec, op=op or what, error=error, pieces=moved)
    elif error is not None:
        raise error
    return plan, tree_leaves  # type: ignore[return-value]


def ensure_checked(plan: Plan, tree_leaves: Sequence[Any], spec: Optional[ShardingSpec], *, op: str) -> None:
    """The check :func:`plan_for` runs, for a plan it returned with ``check=False``."""
    if torch.compiler.is_compiling():
        _require_checked(plan, spec, op)
        return
    _check_if_due(plan.mesh, plan, tree_leaves, spec, op=op, error=None)


def _traced_key(tree: Any, layout_key: tuple[Any, ...], given: Optional[list[Optional[Shard]]]) -> tuple[Any, ...]:
    key = (tuple(tree_lib.paths(tree)), layout_key)
    return key if given is None else key + (tuple(given),)


def _traced_plan(tree: Any, spec: Optional[ShardingSpec], *, what: str, op: str, check: bool) -> tuple[Plan, list[Any]]:
    """The plan an eager call built for ``tree``, found while ``torch.compile`` traces: by leaf
    paths, and checked across ranks for ``op`` before (unless ``check`` is off or the spec never checks)."""
    tree_leaves = tree_lib.leaves(tree)
    # the uncached function: the tracer warns about (and skips) an lru_cache anyway
    key = (tree_lib._structure_paths.__wrapped__(tree_lib.structure(tree)), _layout_key(tree_leaves))
    if spec is not None and spec.looks_at_tensors:
        key += (tuple(spec.resolve(tree, tree_leaves, list(key[0]))),)
    plan = (spec.traced_plans if spec is not None else _DTENSOR_TRACED).get(key)
    if plan is None:
        raise ValueError(
            f"gradtx.sharding: {what} under torch.compile met a gradient tree no eager call has resolved; the "
            "cross-rank check cannot run inside a graph, so run the step once eagerly before compiling "
            "(gradtx.compile_step does this for you)"
        )
    if check:
        _require_checked(plan, spec, op)
    return plan, tree_leaves


def _require_checked(plan: Plan, spec: Optional[ShardingSpec], op: str) -> None:
    """The plan was checked across ranks by an eager call. Any reduction's check will do: the eager
    call that checked it ran the very step being traced (which may differ in its reductions' names
    only where eager mode folds a flag the graph reduces apart, as ``apply_if_finite``'s)."""
    mode: CheckMode = spec.check_consistency if spec is not None else "once"
    if mode is not False and not plan.checked:
        raise ValueError(
            f"gradtx.sharding: {op} under torch.compile has not been checked across ranks; the check cannot "
            "run inside a graph, so run the step once eagerly before compiling (gradtx.compile_step does "
            "this for you), or pass check_consistency=False to the ShardingSpec"
        )


def _check_if_due(
    mesh: Optional[MeshAxes],
    plan: Optional[Plan],
    tree_leaves: Sequence[Any],
    spec: Optional[ShardingSpec],
    *,
    op: str,
    error: Optional[Exception],
    pieces: Optional[tuple[Any, ...]] = None,
) -> None:
    mode: CheckMode = spec.check_consistency if spec is not None else "once"
    key = op if pieces is None else (op, pieces)
    if mode is True or (mode == "once" and (plan is None or key not in plan.checked)):
        if mesh is None:  # no mesh to check over (not even a DTensor's): nothing to fold the error into
            raise error  # type: ignore[misc]
        consistency.check(mesh, plan, tree_leaves, op=op, mode=mode, spec=spec, error=error, pieces=pieces)
        if plan is not None:
            plan.checked.update((op, key))
    elif error is not None:
        raise error


_ROOT_MESH = "_get_root_mesh"  # DeviceMesh's; where torch lacks it, a DTensor's own mesh is its root


def _reference_mesh(tree_leaves: Sequence[Any]) -> MeshAxes:
    """For DTensors without a spec: the largest root mesh among theirs, as named axes."""
    roots = []
    for leaf in tree_leaves:
        if leaf is not None and dtensor_lib.is_dtensor(leaf):
            mesh = leaf.device_mesh
            root = getattr(mesh, _ROOT_MESH, None)  # the mesh it was sliced or flattened from
            roots.append(root() if root is not None else mesh)
    root = max(roots, key=lambda m: (m.size(), m.ndim))
    key = (_world_key(), root)
    axes = _DTENSOR_MESHES.get(key)
    if axes is None:
        axes = MeshAxes(root, require_names=False, owner="gradtx.sharding")
        _DTENSOR_MESHES[key] = axes
    return axes


def _build(
    tree: Any, tree_leaves: Sequence[Any], spec: Optional[ShardingSpec], mesh: MeshAxes, given: Optional[list[Optional[Shard]]]
) -> Plan:
    paths = tree_lib.paths(tree)
    if given is None:
        given = spec.resolve(tree, tree_leaves, paths) if spec is not None else [None] * len(paths)
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
    if spec is None:
        return Plan(mesh, layouts, global_axes, stage_axis)
    unused = spec.unused_rules(paths)
    if unused and spec.check_consistency is False and (stage_axis is None or mesh.sizes[stage_axis] == 1):
        # no check decides across ranks, but every rank holds the same leaves: this rank's verdict is theirs
        raise ValueError(explain_unused(unused, paths, where="of the tree"))
    return Plan(mesh, layouts, global_axes, stage_axis, unused=unused, timeout=spec.timeout)

