"""Ranks that disagree get the same ``ValueError``, never a hang and never a silently wrong number.

Before a reduction runs on a new plan (or at every call with ``check_consistency=True``), every
rank of the mesh contributes a fixed-size record to one ``all_gather``: whether it could build its
plan at all, its check mode, the mesh and stage axis, the reduction it is about to run, the
reduction group, its pipeline stage, and a fingerprint of its leaves (paths, layouts, duplicate
flags, tensor kinds and dtypes). The record's size does not depend on the spec, the tree or the
number of stages, so ranks that disagree on any of those still complete the collective. Every rank
then reads the same records and takes the same decision; only when they disagree does a second
collective gather the readable descriptions, from which every rank builds the same message naming
the rank, the leaf and the axis.
"""

from __future__ import annotations

import hashlib
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from gradtx.sharding import dtensor as dtensor_lib
from gradtx.sharding.mesh import MeshAxes

_FIELDS = ("error", "mode", "mesh", "op", "group", "stage", "leaves")


def hash_text(text: str) -> int:
    """A stable 62-bit hash (the same on every rank, unlike ``hash``), so its negation fits int64."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 2


def _leaf_descriptions(plan: Any, tree_leaves: Sequence[Any]) -> list[Any]:
    """Per leaf: what ranks of one stage must agree on (local shapes may differ: uneven shards)."""
    if plan is None:
        return []
    out = []
    for layout, leaf in zip(plan.layouts, tree_leaves):
        if layout is None:
            out.append(None)
            continue
        kind = "DTensor" if dtensor_lib.is_dtensor(leaf) else "tensor"
        out.append((layout.path, kind, layout.axes, layout.dims, layout.duplicate, str(leaf.dtype)))
    return out


def _describe(mesh: MeshAxes, plan: Any, tree_leaves: Sequence[Any], *, op: str, mode: Any, spec: Any, error: Any) -> dict:
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
    }


def _record(description: dict) -> list[int]:
    values = []
    for name in _FIELDS:
        value = description[name]
        if name == "error":
            values.append(0 if value is None else 1)
        elif name == "stage":
            values.append(int(value))
        else:
            values.append(hash_text(repr(value)))
    return values


def check(mesh: MeshAxes, plan: Any, tree_leaves: Sequence[Any], *, op: str, mode: Any, spec: Any, error: Optional[Exception]) -> None:
    """Raises the same error on every rank of ``mesh`` when they disagree or any failed.

    A ``ValueError``, or a ``TypeError`` when the first rank that failed found a value of the wrong
    type (a callable spec returning a string, say).
    """
    group = mesh.group(mesh.names)
    if group is None:  # a mesh of one rank: nobody to disagree with
        if error is not None:
            raise error
        return
    description = _describe(mesh, plan, tree_leaves, op=op, mode=mode, spec=spec, error=error)
    record = torch.tensor(_record(description), dtype=torch.int64, device=mesh.device())
    records = [torch.empty_like(record) for _ in range(dist.get_world_size(group))]
    try:
        dist.all_gather(records, record, group=group)
    except RuntimeError as failure:  # other ranks are not in this check (a timeout): say what this rank found
        found = f"; this rank found: {error}" if error is not None else ""
        raise RuntimeError(
            f"gradtx.sharding: the cross-rank check before {op} failed ({failure}){found}. Ranks run their "
            "checks at different steps when the tree changes on some ranks only mid-run, or when "
            "check_consistency differs between ranks (False on some): use check_consistency=True on every rank"
        ) from (error or failure)
    rows = [r.tolist() for r in records]
    if not _disagree(rows):
        return
    descriptions: list[Any] = [None] * len(rows)
    dist.all_gather_object(descriptions, description, group=group)
    first_error = next((d["error"] for d in descriptions if d["error"] is not None), None)
    kind = TypeError if first_error is not None and first_error[0] == "TypeError" else ValueError
    raise kind(explain(descriptions)) from error


def _disagree(rows: Sequence[Sequence[int]]) -> bool:
    index = {name: i for i, name in enumerate(_FIELDS)}
    if any(row[index["error"]] for row in rows):
        return True
    for name in ("mode", "mesh", "op", "group"):
        if len({row[index[name]] for row in rows}) > 1:
            return True
    by_stage: dict[int, set[int]] = {}
    for row in rows:
        by_stage.setdefault(row[index["stage"]], set()).add(row[index["leaves"]])
    return any(len(fingerprints) > 1 for fingerprints in by_stage.values())


def _format_leaf(leaf: Any) -> str:
    if leaf is None:
        return "no gradient (None)"
    path, kind, axes, dims, duplicate, dtype = leaf
    layout = f"sharded over {axes}" if axes else "replicated"
    if any(d is not None for d in dims):
        layout += f" along dims {dims}"
    extra = ", a duplicate" if duplicate else ""
    return f"a {dtype} {kind} {layout}{extra}"


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


def explain(descriptions: Sequence[dict]) -> str:
    """One message, the same on every rank, for the first disagreement found (in a fixed order)."""
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
                f"{reference['op']} (the ranks run different transformations)"
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
    for d in descriptions[1:]:
        if d["group"] != reference["group"]:
            return (
                prefix + f"on the reduction group of the global norm: rank {d['rank']} spans axes {d['group']}, rank "
                f"{reference['rank']} spans {reference['group']}; pass reduce_axes= to the ShardingSpec, or "
                "declare the sharded axes in a rule list, so that every rank joins the same collective"
            )
    return prefix + "on what they are about to reduce"
