"""Ranks that disagree get the same ``ValueError``, never a hang and never a silently wrong number.

Before a reduction runs on a new plan (or at every call with ``check_consistency=True``), every
rank of the mesh contributes a fixed-size record to one ``all_gather``: whether it could build its
plan at all, its check mode, the mesh and stage axis, the reduction it is about to run (with every
option of the transformation that changes which collectives run, which callers put in its name),
the reduction group, its pipeline stage, a fingerprint of its leaves (paths, layouts, duplicate
flags, tensor kinds, dtypes, and the shapes that must agree: whole for a replicated or stage-local
leaf, outside the split dims for a sharded one), a fingerprint of the whole tensors the reduction
rebuilds (their logical shapes), and whether some rule of the spec matches none of its leaves. The
record's size does not depend on the spec, the tree or the number of stages, so ranks that
disagree on any of those still complete the collective. Every rank then reads the same records and
takes the same decision; only when they disagree (or some rank has an unused rule) does a second
collective gather the readable descriptions, from which every rank builds the same message naming
the rank, the leaf and the axis. A rule unused on some ranks is fine if another rank uses it (it
matches on another pipeline stage); one that no rank uses is an error.
"""

from __future__ import annotations

import hashlib
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from gradtx.sharding import dtensor as dtensor_lib
from gradtx.sharding import waiting
from gradtx.sharding.mesh import MeshAxes
from gradtx.sharding.spec import explain_unused

_FIELDS = ("error", "mode", "mesh", "op", "group", "stage", "leaves", "pieces", "unused")
_PER_STAGE = ("leaves", "pieces")  # ranks of one pipeline stage must agree on these
_FLAGS = ("error", "unused")  # 0/1 per rank


def hash_text(text: str) -> int:
    """A stable 62-bit hash (the same on every rank, unlike ``hash``), so its negation fits int64."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 2


def _agreed_shape(layout: Any, leaf: Any, sizes: dict[str, int]) -> Optional[tuple[Any, ...]]:
    """The part of a leaf's shape every rank of its stage must share: a DTensor's global shape; a
    plain tensor's local shape with the dims it is split along left out (``None``), or nothing at
    all when a split dim is unknown (a flat ZeRO shard may hold any number of elements)."""
    if dtensor_lib.is_dtensor(leaf):
        return tuple(leaf.shape)
    shape: list[Any] = list(leaf.shape)
    for axis, dim in zip(layout.axes, layout.dims):
        if sizes[axis] <= 1:
            continue
        if dim is None or not -len(shape) <= dim < len(shape):
            return None
        shape[dim] = None
    return tuple(shape)


def _leaf_descriptions(plan: Any, tree_leaves: Sequence[Any]) -> list[Any]:
    """Per leaf: what ranks of one stage must agree on (local shapes may differ along split dims)."""
    if plan is None:
        return []
    out = []
    for layout, leaf in zip(plan.layouts, tree_leaves):
        if layout is None:
            out.append(None)
            continue
        kind = "DTensor" if dtensor_lib.is_dtensor(leaf) else "tensor"
        shape = _agreed_shape(layout, leaf, plan.mesh.sizes)
        out.append((layout.path, kind, layout.axes, layout.dims, layout.duplicate, str(leaf.dtype), shape))
    return out


def _describe(
    mesh: MeshAxes, plan: Any, tree_leaves: Sequence[Any], *, op: str, mode: Any, spec: Any, error: Any, pieces: Any
) -> dict:
    stage_axis = spec.stage_axis if spec is not None else None
    return {
        "rank": dist.get_rank(),
        "error": None if error is None else (type(error).__name__, str(error)),
        "mode": repr(mode),
        "mesh": (mesh.names, tuple(mesh.sizes[n] for n in mesh.names), stage_axis),
        "op": op,
        "group": None if plan is None else plan.global_axes,
        "stage": mesh.coordinate[stage_axis] if stage_axis is not None else 0,
        "leaves": _leaf_descriptions(plan, tree_leaves),
        # the logical shapes must agree; the local ones (each rank's piece) may not
        "pieces": None if pieces is None else tuple((path, axes, whole) for path, axes, whole, _ in pieces),
        "piece_shapes": None if pieces is None else tuple(local for *_, local in pieces),
        "unused": () if plan is None else plan.unused,
    }


def _record(description: dict) -> list[int]:
    values = []
    for name in _FIELDS:
        value = description[name]
        if name in _FLAGS:
            values.append(1 if value else 0)
        elif name == "stage":
            values.append(int(value))
        else:
            values.append(hash_text(repr(value)))
    return values


def check(
    mesh: MeshAxes,
    plan: Any,
    tree_leaves: Sequence[Any],
    *,
    op: str,
    mode: Any,
    spec: Any,
    error: Optional[Exception],
    pieces: Optional[tuple[Any, ...]] = None,
) -> None:
    """Raises the same error on every rank of ``mesh`` when they disagree, any failed, or a rule
    of the spec matches no leaf on any rank.

    A ``ValueError``, or a ``TypeError`` when the first rank that failed found a value of the wrong
    type (a callable spec returning a string, say). ``pieces``: see :func:`gradtx.sharding.plan.plan_for`.
    """
    group = mesh.group(mesh.names)
    if group is None:  # a mesh of one rank: nobody to disagree with
        if error is not None:
            raise error
        if plan is not None and plan.unused:
            raise ValueError(explain_unused(plan.unused, [l.path for l in plan.layouts if l is not None], where="of the tree"))
        return
    description = _describe(mesh, plan, tree_leaves, op=op, mode=mode, spec=spec, error=error, pieces=pieces)
    record = torch.tensor(_record(description), dtype=torch.int64, device=mesh.device())
    records = [torch.empty_like(record) for _ in range(dist.get_world_size(group))]
    timeout = spec.timeout if spec is not None else (plan.timeout if plan is not None else None)
    try:
        waiting.wait(dist.all_gather(records, record, group=group, async_op=True), record, timeout)
    except RuntimeError as failure:  # other ranks are not in this check (a timeout): say what this rank found
        found = f"; this rank found: {error}" if error is not None else ""
        raise RuntimeError(
            f"gradtx.sharding: the cross-rank check before {op} failed ({failure}){found}. Ranks run their "
            "checks at different steps when the tree changes on some ranks only mid-run, when a rank calls "
            "update more times than the others, or when check_consistency differs between ranks (False on "
            "some): call update the same number of times on every rank, and use check_consistency=True on "
            "every rank if trees change on some ranks only"
        ) from (error or failure)
    rows = [r.tolist() for r in records]
    if not _needs_descriptions(rows):
        return
    descriptions: list[Any] = [None] * len(rows)
    dist.all_gather_object(descriptions, description, group=group)
    message = explain(descriptions)
    if message is None:  # each unused rule is used on some other rank (another pipeline stage)
        if plan is not None:
            plan.unused = ()  # decided, alike on every rank: later checks of this plan need no second collective
        return
    first_error = next((d["error"] for d in descriptions if d["error"] is not None), None)
    kind = TypeError if first_error is not None and first_error[0] == "TypeError" else ValueError
    raise kind(message) from error


def _needs_descriptions(rows: Sequence[Sequence[int]]) -> bool:
    index = {name: i for i, name in enumerate(_FIELDS)}
    if any(row[index[name]] for row in rows for name in _FLAGS):
        return True
    for name in ("mode", "mesh", "op", "group"):
        if len({row[index[name]] for row in rows}) > 1:
            return True
    for name in _PER_STAGE:
        by_stage: dict[int, set[int]] = {}
        for row in rows:
            by_stage.setdefault(row[index["stage"]], set()).add(row[index[name]])
        if any(len(fingerprints) > 1 for fingerprints in by_stage.values()):
            return True
    return False


def _format_shape(shape: Any) -> str:
    return "(" + ", ".join("*" if s is None else str(s) for s in shape) + ("," if len(shape) == 1 else "") + ")"


def _format_leaf(leaf: Any) -> str:
    if leaf is None:
        return "no gradient (None)"
    path, kind, axes, dims, duplicate, dtype, shape = leaf
    layout = f"sharded over {axes}" if axes else "replicated"
    if any(d is not None for d in dims):
        layout += f" along dims {dims}"
    extra = ", a duplicate" if duplicate else ""
    of_shape = "" if shape is None else f" of shape {_format_shape(shape)}"
    return f"a {dtype} {kind}{of_shape} {layout}{extra}"


def _leaf_difference(reference: dict, other: dict) -> str:
    ref_leaves = {leaf[0]: leaf for leaf in reference["leaves"] if leaf is not None}
    other_leaves = {leaf[0]: leaf for leaf in other["leaves"] if leaf is not None}
    for path in list(ref_leaves) + [p for p in other_leaves if p not in ref_leaves]:
        mine, theirs = ref_leaves.get(path), other_leaves.get(path)
        if mine == theirs:
            continue
        if mine is None:
            return f"rank {other['rank']} has leaf {path!r} ({_format_leaf(theirs)}), which rank {reference['rank']} lacks"
        if theirs is None:
            return f"rank {other['rank']} lacks leaf {path!r}, which rank {reference['rank']} has ({_format_leaf(mine)})"
        return (
            f"leaf {path!r} is {_format_leaf(theirs)} on rank {other['rank']} but "
            f"{_format_leaf(mine)} on rank {reference['rank']}"
        )
    return f"ranks {reference['rank']} and {other['rank']} hold their gradient leaves in a different structure"


def explain(descriptions: Sequence[dict]) -> Optional[str]:
    """One message, the same on every rank, for the first disagreement found (in a fixed order);
    ``None`` when the ranks agree and every rule matches a leaf on some rank."""
    prefix = "gradtx.sharding: ranks disagree "
    failed = [d for d in descriptions if d["error"] is not None]
    if failed:
        first = failed[0]
        others = f" (and on {len(failed) - 1} more rank(s))" if len(failed) > 1 else ""
        return f"gradtx.sharding: rank {first['rank']} cannot run {first['op']}{others}: {first['error'][1]}"
    reference = descriptions[0]
    for d in descriptions[1:]:
        if d["mode"] != reference["mode"]:
            return (
                prefix + f"on check_consistency: it is {d['mode']} on rank {d['rank']} but {reference['mode']} on rank "
                f"{reference['rank']}; give every rank the same value"
            )
    for d in descriptions[1:]:
        if d["mesh"] != reference["mesh"]:
            return (
                prefix + f"on the mesh: rank {d['rank']} has mesh axes/sizes/stage axis {d['mesh']} but rank {reference['rank']} "
                f"has {reference['mesh']}"
            )
    for d in descriptions[1:]:
        if d["op"] != reference["op"]:
            return (
                prefix + f"on the reduction to run: rank {d['rank']} is about to run {d['op']} while rank {reference['rank']} runs "
                f"{reference['op']} (the ranks run different transformations, or one transformation with different "
                "options; give every rank the same ones)"
            )
    first_of_stage: dict[int, dict] = {}
    for d in descriptions:
        ref = first_of_stage.setdefault(d["stage"], d)
        if d["leaves"] != ref["leaves"]:
            where = f" of pipeline stage {d['stage']}" if reference["mesh"][2] is not None else ""
            return (
                prefix + f"on the gradients: ranks{where} hold different gradient trees or leaf specs: "
                + _leaf_difference(ref, d)
            )
    first_of_stage = {}
    for d in descriptions:
        ref = first_of_stage.setdefault(d["stage"], d)
        if d["pieces"] != ref["pieces"]:
            return prefix + _pieces_difference(ref, d)
    for d in descriptions[1:]:
        if d["group"] != reference["group"]:
            return (
                prefix + f"on the reduction group of the global norm: rank {d['rank']} spans axes {d['group']}, rank "
                f"{reference['rank']} spans {reference['group']}; pass reduce_axes= to the ShardingSpec, or "
                "declare the sharded axes in a rule list, so that every rank joins the same collective"
            )
    unused = _unused_everywhere(descriptions)
    if unused:
        paths = sorted({leaf[0] for d in descriptions for leaf in d["leaves"] if leaf is not None})
        return explain_unused(unused, paths, where="on any rank")
    return prefix + "on what they are about to reduce" if _hashes_differ(descriptions) else None


def _hashes_differ(descriptions: Sequence[dict]) -> bool:
    """Whether the records differed in a field the readable comparison above found equal (only a
    fingerprint collision, or a repr that differs for equal values, gets here)."""
    rows = [_record(d) for d in descriptions]
    return _needs_descriptions([[0 if name in _FLAGS else v for name, v in zip(_FIELDS, row)] for row in rows])


def _unused_everywhere(descriptions: Sequence[dict]) -> list[str]:
    """The rules no rank uses (each rank lists those it does not)."""
    return [glob for glob in descriptions[0]["unused"] if all(glob in d["unused"] for d in descriptions[1:])]


def _pieces_difference(reference: dict, other: dict) -> str:
    """Ranks of one stage rebuild whole tensors of different shapes: name the leaf and the pieces."""
    mine = {entry[0]: (entry, local) for entry, local in zip(reference["pieces"] or (), reference["piece_shapes"] or ())}
    theirs = {entry[0]: (entry, local) for entry, local in zip(other["pieces"] or (), other["piece_shapes"] or ())}
    for path in list(mine) + [p for p in theirs if p not in mine]:
        if path not in mine or path not in theirs:
            has, lacks = (other, reference) if path not in mine else (reference, other)
            return (
                f"on the whole tensors {other['op']} rebuilds: rank {has['rank']} rebuilds leaf {path!r} from its "
                f"pieces and rank {lacks['rank']} does not (their leaves are split differently)"
            )
        (entry_a, local_a), (entry_b, local_b) = mine[path], theirs[path]
        if entry_a == entry_b:
            continue
        _, axes, whole_a = entry_a
        whole_b = entry_b[2]
        if entry_a[1] != entry_b[1]:
            return (
                f"on the whole tensors {other['op']} rebuilds: leaf {path!r} is split over {entry_b[1]} on rank "
                f"{other['rank']} but over {axes} on rank {reference['rank']}"
            )
        return (
            f"on the whole shape of leaf {path!r} in {other['op']}: split evenly over {axes}, rank "
            f"{other['rank']}'s {_format_shape(local_b)} piece makes a {_format_shape(whole_b)} tensor but rank "
            f"{reference['rank']}'s {_format_shape(local_a)} piece a {_format_shape(whole_a)} one. Plain tensors "
            "under a ShardingSpec must be split evenly (every rank of the shard group "
            "holding an equal piece); give the ranks equal pieces, or pass DTensors, which carry their "
            "global shape and may be split unevenly (DTensor.from_local(piece, mesh, placements, shape=..., "
            "stride=...))"
        )
    return f"on the whole tensors {other['op']} rebuilds (ranks {reference['rank']} and {other['rank']})"
