"""Checkpoints that outlive the mesh: a transformation's state as ``torch.distributed.checkpoint``
(DCP) saves it, keyed by logical path, loadable on any other layout.

::

    import torch.distributed.checkpoint as dcp

    dcp.save(gtx.checkpoint.state_dict(state, params, spec), checkpoint_id=path)
    # ... later, on another mesh, another TP/PP/DP degree, or one process:
    state = tx.init(params)                                   # the new layout's template
    sd = gtx.checkpoint.state_dict(state, params, spec)
    dcp.load(sd, checkpoint_id=path)
    state = gtx.checkpoint.load_state_dict(state, sd, params, spec)

Keys are the state leaves' paths (``"1.mu.layers.3.qkv.weight"``, ``"0.count"``), the same on every
layout. Values are what DCP reshards: DTensor leaves as they are; a plain piece of a sharded leaf
as a DTensor over the spec's mesh (or, for uneven or flat ZeRO pieces, a
:class:`~gradtx.sharding.checkpointing.Pieces` carrying DCP's chunk metadata); whole leaves as
plain tensors; Python numbers as they are. One more key, :data:`MANIFEST`, holds every leaf's
dtype and logical shape, so a checkpoint of another chain, tree or dtype is caught on load.

**Which layout a state leaf has.** Parts of the state shaped like the params (the same tree
structure: a moment, a momentum buffer, an accumulator, as optax's ``tree_map_params`` finds them)
hold one leaf per param. Such a leaf with the param's local shape is laid out as the param (the
spec's rule, or the DTensor's placements); a 0-d one is whole. A leaf of another shape takes the
layout its state type declares (:func:`gradtx.state_dims.state_dims`: Adafactor's row and column
moments drop a dim, GaLore's projectors are whole); with no declaration it is whole if its param
is whole on every rank, and otherwise a ``ValueError`` naming its path (never a guess). Every other
leaf (counters, hyperparameters, generator states) is whole, and checked to be equal on every rank.

**Collectives.** With a spec or DTensors, each call makes one ``all_gather_object`` over the mesh:
the pieces' sizes (so uneven pieces get their offsets), the fingerprints of the checked leaves,
and any error a rank found, so that every rank raises the same ``ValueError`` (naming the path)
before anything is returned. Without a spec and without DTensors nothing is communicated.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Mapping, NamedTuple, Optional

from torch import Tensor

from gradtx import tree as tree_lib
from gradtx.sharding import checkpointing as ckpt_lib
from gradtx.sharding import dtensor as dtensor_lib
from gradtx.sharding.checkpointing import Layout, Pieces
from gradtx.sharding.spec import ShardingSpec
from gradtx.state_dims import Dims, ParamLeaf, rank_shares, rules_of, same, state_dims, whole, without_rank_shares

__all__ = ["MANIFEST", "ParamLeaf", "Pieces", "load_state_dict", "rank_shares", "same", "state_dict", "state_dims", "whole"]

MANIFEST = "__gradtx_checkpoint__"
"""The key of the manifest: every state leaf's kind, dtype and logical shape, on every layout alike."""

_FORMAT = 1
_NUMBERS = (bool, int, float, complex, str)


# --------------------------------------------------------------------------- which leaf follows which param


@dataclass(frozen=True)
class _Context:
    """A state that declares the dims of a field, met on the way down to a leaf: the field's rule,
    and where each of the state's params-shaped fields starts among the state's leaves."""

    rule: Any
    field_starts: Mapping[str, int]


def _field_names(spec: Any) -> list[Optional[str]]:
    fields = getattr(spec.type, "_fields", None)
    entries = spec.entries()
    if fields is not None:
        return [fields[e] if isinstance(e, int) and e < len(fields) else None for e in entries]
    return [e if isinstance(e, str) else None for e in entries]


def _walk(spec: Any, start: int, params_spec: Any, contexts: tuple[_Context, ...], found: dict[int, tuple[int, tuple[_Context, ...]]]) -> None:
    """Records, for every state leaf inside a params-shaped subtree, its param's index and the
    declaring states above it (outermost first)."""
    if spec == params_spec:
        for i in range(spec.num_leaves):
            found[start + i] = (i, contexts)
        return
    if spec.is_leaf():
        return
    children = spec.children()
    names = _field_names(spec)
    rules = rules_of(spec.type)
    field_starts, offset = {}, start
    for child, name in zip(children, names):
        if name is not None and child == params_spec:
            field_starts[name] = offset
        offset += child.num_leaves
    offset = start
    for child, name in zip(children, names):
        inner = contexts + (_Context(rules[name], field_starts),) if name in rules else contexts
        _walk(child, offset, params_spec, inner, found)
        offset += child.num_leaves


def _shape(x: Any) -> Optional[tuple[int, ...]]:
    return None if x is None else tuple(dtensor_lib.local(x).shape) if isinstance(x, Tensor) else ()


def _normalized(dims: Any, leaf_shape: tuple[int, ...], param_ndim: int, *, path: str) -> Dims:
    if not isinstance(dims, tuple) or len(dims) != len(leaf_shape):
        raise ValueError(f"state leaf {path!r}: its declared dims {dims!r} must be a tuple of one entry per dim of the leaf {leaf_shape}")
    out = []
    for d in dims:
        if d is None:
            out.append(None)
        elif isinstance(d, int) and not isinstance(d, bool) and -param_ndim <= d < param_ndim:
            out.append(d % param_ndim)
        else:
            raise ValueError(f"state leaf {path!r}: its declared dims {dims!r} name {d!r}, not a dim of its {param_ndim}-dim param")
    named = [d for d in out if d is not None]
    if len(set(named)) != len(named):
        raise ValueError(f"state leaf {path!r}: its declared dims {dims!r} name a param dim twice")
    return tuple(out)


@dataclass
class _Resolved:
    """A state's leaves on this rank: paths, values, layouts (``None`` for ``None`` leaves and numbers)."""

    mesh: Any
    treedef: Any
    paths: list[str]
    leaves: list[Any]
    layouts: list[Optional[Layout]]
    error: Optional[Exception]


def _resolve(state: Any, params: Any, spec: Optional[ShardingSpec], *, owner: str, has_params: bool = True) -> _Resolved:
    """Every state leaf's layout. An error (a leaf whose layout is unknown, a bad spec) is kept,
    not raised: the exchange carries it to every rank."""
    leaves, treedef = tree_lib.flatten(state)
    paths = tree_lib.paths(state)
    layouts: list[Optional[Layout]] = [None] * len(leaves)
    mesh = None
    try:
        mesh = ckpt_lib.mesh_of(params if has_params else state, spec)
        if MANIFEST in paths:
            raise ValueError(f"a state leaf's path is {MANIFEST!r}, the key the checkpoint's manifest takes")
        found: dict[int, tuple[int, tuple[_Context, ...]]] = {}
        if has_params:
            param_leaves, params_def = tree_lib.flatten(params)
            found_layouts = ckpt_lib.param_layouts(params, spec, what=owner)
            mesh = found_layouts.mesh or mesh
            _walk(treedef, 0, params_def, (), found)
        for index, (path, leaf) in enumerate(zip(paths, leaves)):
            if leaf is None:
                continue
            if not isinstance(leaf, Tensor):
                if not isinstance(leaf, _NUMBERS):
                    raise TypeError(f"state leaf {path!r} is a {type(leaf).__name__}; a checkpoint holds tensors and numbers")
                continue
            if dtensor_lib.is_dtensor(leaf):
                layouts[index] = ckpt_lib.AS_IS
                continue
            owned = found.get(index)
            param = param_leaves[owned[0]] if owned is not None else None
            if param is None:
                layouts[index] = ckpt_lib.CHECKED
                continue
            i, contexts = owned  # type: ignore[misc]
            param_layout = found_layouts.layouts[i]
            dims = _dims_of(leaf, param, i, contexts, leaves, found_layouts, path=path, param_path=tree_lib.path_at(params, i))
            layouts[index] = ckpt_lib.derived(param, param_layout, found_layouts.mesh, dims, _shape(leaf), path=path)  # type: ignore[arg-type]
        error = None
    except (ValueError, TypeError) as exc:
        error = exc
    return _Resolved(mesh, treedef, paths, leaves, layouts, error)


def _dims_of(leaf: Tensor, param: Any, index: int, contexts: tuple[_Context, ...], leaves: list[Any], layouts: Any, *, path: str, param_path: str) -> Dims:
    """A param-made leaf's dims: declared by the states above it (outermost first), else the default."""
    leaf_shape, local_shape = _shape(leaf), _shape(param)
    param_shape = layouts.shapes[index]
    for context in contexts:
        fields = {name: _shape(leaves[start + index]) for name, start in context.field_starts.items()}
        declared = context.rule(ParamLeaf(param_shape, local_shape, leaf_shape, fields))  # type: ignore[arg-type]
        if declared is not None:
            return _normalized(declared, leaf_shape, len(param_shape), path=path)  # type: ignore[arg-type]
    if leaf.ndim == 0:
        return ()
    if leaf_shape == local_shape:
        return tuple(range(leaf.ndim))
    if not ckpt_lib.is_split(param, layouts.layouts[index], layouts.mesh):
        return (None,) * leaf.ndim
    raise ValueError(
        f"state leaf {path!r} ({leaf_shape} on this rank) was made from param {param_path!r} ({local_shape} on this rank, "
        f"split across ranks), but has another shape, and no state type above it declares how its dims follow the "
        "param's for this layout; a transformation declares that with gradtx.state_dims.state_dims on its state type. "
        "quantize_state's codes and scales follow a param split along any dim but its last (its blocks run along "
        "the last dim, and a piece of it may hold part of a block another rank holds too): shard such a param along "
        "another dim, or keep it out of quantize_state (a min_size above its size)"
    )


# --------------------------------------------------------------------------- records every rank shares


def _manifest_entry(value: Any, shape: Optional[tuple[int, ...]]) -> tuple[Any, ...]:
    if isinstance(value, Tensor):
        return ("tensor", str(value.dtype), shape)
    return ("number", type(value).__name__)


class _Record(NamedTuple):
    """What a rank says about one present leaf in the exchange: its ``path``; its layout's ``kind``
    (``"number"`` for numbers); its manifest ``entry`` (the logical shape is ``None`` for a split
    leaf: all ranks' pieces give it); its ``local`` shape and ``splits``; the ``box`` (local
    shape, offsets) it expects where that is known locally; the ``digest`` of a checked leaf; the
    ``dtensor`` description of the DTensor it is or becomes."""

    path: str
    kind: str
    entry: tuple[Any, ...]
    local: Optional[tuple[int, ...]]
    splits: tuple[tuple[str, int], ...]
    box: Optional[tuple[tuple[int, ...], tuple[int, ...]]]
    digest: Optional[str]
    dtensor: Optional[tuple[Any, ...]]


def _records(resolved: _Resolved, values: Optional[Mapping[str, Any]] = None) -> list[_Record]:
    """This rank's records; the digests are of ``values`` (the loaded ones) where given."""
    out = []
    for path, leaf, layout in zip(resolved.paths, resolved.leaves, resolved.layouts):
        if leaf is None:
            continue
        checked = layout is None or layout.checked
        digest = ckpt_lib.digest(leaf if values is None else values[path]) if checked else None
        if layout is None:
            out.append(_Record(path, "number", _manifest_entry(leaf, None), None, (), None, digest, None))
            continue
        local = _shape(leaf)
        described = None
        if layout.kind == "split":
            shape, box = None, None
        elif layout.kind == "whole":
            shape, box = local, (local, (0,) * len(local))  # type: ignore[arg-type]
        else:
            source = ckpt_lib.layout_of_dtensor(leaf) if layout.kind == "dtensor" else layout
            shape, box, described = source.shape, _box_or_none(source), ckpt_lib.describe_layout(source)
        out.append(_Record(path, layout.kind, _manifest_entry(leaf, shape), local, layout.splits, box, digest, described))
    return out


def _box_or_none(layout: Layout) -> Optional[tuple[tuple[int, ...], tuple[int, ...]]]:
    try:
        return ckpt_lib.dtensor_box(layout)
    except ValueError:  # a strided shard (FSDP2 over TP): DCP knows its chunks, gradtx does not need them
        return None


@dataclass
class _Agreed:
    """What every rank decided from the exchange: per split leaf of this rank ``(shape, offsets,
    even)``; per ``(rank, path)`` the expected box; the manifest of the whole state."""

    split: dict[str, tuple[tuple[int, ...], tuple[int, ...], bool]]
    boxes: dict[tuple[int, str], Optional[tuple[tuple[int, ...], tuple[int, ...]]]]
    manifest: dict[str, tuple[Any, ...]]


def _raise_first(gathered: list[tuple[int, Any]], *, owner: str) -> None:
    for rank, payload in gathered:
        if payload["error"] is not None:
            kind, message = payload["error"]
            where = f" (found on rank {rank})" if len(gathered) > 1 else ""
            raise (TypeError if kind == "TypeError" else ValueError)(f"{owner}: {message}{where}")


def _agree(gathered: list[tuple[int, Any]], mesh: Any, me: int, *, owner: str) -> _Agreed:
    """The decisions every rank takes alike from the exchanged records (or the same ``ValueError``)."""
    _raise_first(gathered, owner=owner)
    holders: dict[str, dict[int, _Record]] = {}
    for rank, payload in gathered:
        for record in payload["records"]:
            holders.setdefault(record.path, {})[rank] = record
    ranks = [rank for rank, _ in gathered]
    split, boxes, manifest = {}, {}, {}
    for path in sorted(holders):
        held = holders[path]
        first_rank, first = min(held.items())
        if first.kind == "split" and all(r.kind == "split" for r in held.values()):
            shape, offsets, even = ckpt_lib.tile(mesh, {r: (rec.splits, rec.local) for r, rec in held.items()}, path=path)
            entry = first.entry[:2] + (shape,)
            for r, rec in held.items():
                boxes[(r, path)] = (rec.local, offsets[r])
            if me in held:
                split[path] = (shape, offsets[me], even)
        else:
            entry = first.entry
            for r, rec in held.items():
                boxes[(r, path)] = rec.box
        for r, rec in held.items():
            theirs = rec.entry if rec.kind != "split" else rec.entry[:2] + (entry[2],)
            if rec.kind != first.kind or theirs != entry:
                raise ValueError(
                    f"{owner}: state leaf {path!r} is {_entry_text(entry)} ({first.kind}) on rank {first_rank} but "
                    f"{_entry_text(theirs)} ({rec.kind}) on rank {r}"
                )
        if first.digest is not None:
            missing = [r for r in ranks if r not in held]
            if missing:
                raise ValueError(
                    f"{owner}: state leaf {path!r} is kept whole on every rank (it is outside every params-shaped part "
                    f"of the state), but rank {missing[0]} has no such leaf"
                )
            differing = [r for r, rec in held.items() if rec.digest != first.digest]
            if differing:
                raise ValueError(_differs(owner, path, first_rank, differing[0]))
        manifest[path] = entry
    return _Agreed(split, boxes, manifest)


def _differs(owner: str, path: str, first: int, other: int) -> str:
    return (
        f"{owner}: state leaf {path!r} differs between rank {first} and rank {other}; it is kept whole on every rank "
        "(outside every params-shaped part of the state: a counter, a hyperparameter, a generator state), so every "
        "copy must be equal. A generator state drawn from by different amounts on different ranks (noise on local "
        "pieces) cannot be one checkpoint value"
    )


def _entry_text(entry: tuple[Any, ...]) -> str:
    if entry[0] == "number":
        return f"a {entry[1]}"
    return f"{entry[1].replace('torch.', '')} of logical shape {tuple(entry[2]) if entry[2] is not None else '?'}"


def _payload(resolved: _Resolved, records: Optional[list[Any]], error: Optional[Exception], **extra: Any) -> dict[str, Any]:
    return {"error": None if error is None else (type(error).__name__, str(error)), "records": records or [], **extra}


def _me() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


# --------------------------------------------------------------------------- saving


def state_dict(state: Any, params: Any, spec: Optional[ShardingSpec] = None, *, copy: bool = False) -> dict[str, Any]:
    """``state`` as a flat dict DCP saves and loads, keyed by each leaf's path (see the module's docstring).

    Args:
      state: a transformation's state on this rank (plain local pieces, DTensors, numbers).
      params: the params the state was made for, on this rank, in the tree the spec describes
        (the layout of param-made leaves comes from theirs).
      spec: the params' :class:`~gradtx.sharding.ShardingSpec` (``None``: plain leaves are whole,
        DTensors describe themselves).
      copy: give the dict its own storage. By default its tensors share the state's storage, so a
        save copies nothing, and ``dcp.load`` into a dict made from a template writes into the
        template's tensors (no second copy of the state in memory); with ``copy=True`` the
        template stays as it was whatever ``dcp.load`` or :func:`load_state_dict` find.

    With a spec or DTensors every rank must call this (one ``all_gather_object``); a leaf whose
    layout is unknown, pieces that do not tile their logical tensor, or checked copies that differ
    are the same ``ValueError`` on every rank, naming the path.
    """
    owner = "gradtx.checkpoint.state_dict"
    if spec is not None or dtensor_lib.has_dtensor(tree_lib.leaves(params)):
        state = without_rank_shares(state)  # this rank's shares of sums no other layout could take back
    resolved = _resolve(state, params, spec, owner=owner)
    error = resolved.error
    records = None
    if error is None:
        try:
            records = _records(resolved)
        except (ValueError, TypeError) as exc:
            error = exc
    gathered = ckpt_lib.exchange(resolved.mesh, _payload(resolved, records, error))
    agreed = _agree(gathered, resolved.mesh, _me(), owner=owner)
    out: dict[str, Any] = {}
    for path, leaf, layout in zip(resolved.paths, resolved.leaves, resolved.layouts):
        if leaf is None:
            continue
        if layout is None:
            out[path] = leaf
            continue
        local = dtensor_lib.local(leaf)
        if copy:
            local = local.detach().clone()
        if layout.kind == "whole":
            out[path] = local
        elif layout.kind == "dtensor":
            out[path] = leaf if not copy else dtensor_lib._like(type(leaf), leaf, local)
        else:
            shape, offsets, even = agreed.split.get(path, (layout.shape, (), True))
            out[path] = ckpt_lib.checkpointable(local, layout, resolved.mesh, shape, offsets, even)
    out[MANIFEST] = _manifest_text(agreed.manifest)
    return out


def _manifest_text(manifest: Mapping[str, tuple[Any, ...]]) -> str:
    """The manifest as one JSON string: DCP stores a string as one value (a dict it would split
    into one entry per key, and a partial load would then mix the saved one with the template's)."""
    return json.dumps({"format": _FORMAT, "leaves": {p: [e[0], e[1], list(e[2]) if len(e) > 2 and e[2] is not None else None] for p, e in manifest.items()}}, sort_keys=True)


# --------------------------------------------------------------------------- loading


def _describe_value(value: Any) -> tuple[Any, ...]:
    """What a rank says about one loaded value: its kind, dtype and where its piece lies."""
    if isinstance(value, Pieces):
        return ("pieces", str(value.dtype), tuple(value.shape), tuple(value.local.shape), tuple(value.offsets), None)
    if dtensor_lib.is_dtensor(value):
        box = _box_or_none(ckpt_lib.layout_of_dtensor(value))
        local, offsets = box if box is not None else (tuple(dtensor_lib.local(value).shape), None)
        return ("dtensor", str(value.dtype), tuple(value.shape), local, offsets, ckpt_lib.describe_dtensor(value))
    if isinstance(value, Tensor):
        return ("tensor", str(value.dtype), tuple(value.shape), tuple(value.shape), (0,) * value.ndim, None)
    return ("number", type(value).__name__)


def _value_problem(record: _Record, value: tuple[Any, ...], shape: Any, box: Any) -> Optional[str]:
    """Why a loaded value (as :func:`_describe_value` says) cannot be the leaf ``record`` describes."""
    path, entry = record.path, record.entry
    if record.kind == "number":
        if value[0] != "number" or value[1] != entry[1]:
            return f"state leaf {path!r} is a {entry[1]}, but the loaded value is {_value_text(value)}"
        return None
    if value[0] == "number":
        return f"state leaf {path!r} is a tensor, but the loaded value is a {value[1]}"
    if value[1] != entry[1]:
        return f"state leaf {path!r} is {entry[1]}, but the loaded value is {value[1]}"
    if value[2] != shape:
        return f"state leaf {path!r} has logical shape {shape}, but the loaded value's is {value[2]}"
    if value[0] == "tensor":
        return None  # the whole logical tensor: this rank's piece is cut from it
    if value[5] is not None and value[5] == record.dtensor:
        return None  # a DTensor laid out as the template's
    if box is None or (value[3], value[4]) != tuple(box):
        return (
            f"state leaf {path!r}: the loaded {value[0]} holds the piece {value[3]} at {value[4]}, where this rank's "
            f"piece is {box[0] if box else '?'} at {box[1] if box else '?'}; build the dict to load into with "
            "gradtx.checkpoint.state_dict on this layout"
        )
    return None


def _value_text(value: tuple[Any, ...]) -> str:
    return f"a {value[1]}" if value[0] == "number" else f"a {value[1].replace('torch.', '')} {value[0]}"


def _local_errors(resolved: _Resolved, loaded: Any) -> Optional[str]:
    """Keys missing from or foreign to ``loaded``, found on this rank."""
    if not isinstance(loaded, Mapping):
        return f"the loaded state is a {type(loaded).__name__}, expected the dict gradtx.checkpoint.state_dict made"
    expected = [p for p, leaf in zip(resolved.paths, resolved.leaves) if leaf is not None]
    known = set(expected) | {MANIFEST}
    missing = [p for p in expected if p not in loaded]
    extra = sorted(str(k) for k in loaded if k not in known)
    if missing:
        return f"the loaded state lacks state leaf {missing[0]!r}" + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
    if extra:
        return f"the loaded state holds {extra[0]!r}, which this state lacks (a state of another transformation or params?)"
    return None


def _manifest_problem(stored: Any, manifest: dict[str, tuple[Any, ...]]) -> Optional[str]:
    """Why the checkpoint's manifest does not fit this state's (``None`` when it does)."""
    try:
        parsed = json.loads(stored) if isinstance(stored, str) else None
    except ValueError:
        parsed = None
    if not isinstance(parsed, dict) or parsed.get("format") != _FORMAT or not isinstance(parsed.get("leaves"), dict):
        return f"the loaded {MANIFEST!r} is not a gradtx checkpoint manifest (format {_FORMAT})"
    saved = {p: (e[0], e[1], tuple(e[2]) if isinstance(e[2], list) else e[2]) for p, e in parsed["leaves"].items()}
    manifest = {p: (e[0], e[1], e[2] if len(e) > 2 else None) for p, e in manifest.items()}
    extra = sorted(set(saved) - set(manifest))
    missing = sorted(set(manifest) - set(saved))
    if extra:
        return f"the checkpoint holds state leaf {extra[0]!r}, which this state lacks (a checkpoint of another transformation or params?)"
    if missing:
        return f"the checkpoint lacks state leaf {missing[0]!r} (a checkpoint of another transformation or params?)"
    for path in sorted(manifest):
        mine, theirs = manifest[path], saved[path]
        if mine[:2] != theirs[:2]:
            return f"state leaf {path!r} was saved as {_entry_text(theirs)}, but this state holds {_entry_text(mine)}"
        if mine != theirs:
            return f"state leaf {path!r} was saved with logical shape {theirs[2]}, but this state's is {mine[2]}"
    return None


def load_state_dict(template_state: Any, loaded: Mapping[str, Any], params: Any = None, spec: Optional[ShardingSpec] = None) -> Any:
    """A new state: ``template_state``'s structure, dtypes, devices and layouts, holding ``loaded``'s values.

    ``loaded`` is the dict :func:`state_dict` made from ``template_state`` (on this layout) after
    ``dcp.load`` filled it; a dict of whole logical tensors (``dcp_to_torch_save``'s, say) works
    too, each rank keeping its piece. ``params`` and ``spec`` are the template's, as for
    :func:`state_dict` (``params`` may be left out when nothing is split by a spec).

    A checkpoint of another transformation or params (paths missing or extra), a leaf saved with
    another dtype or logical shape, a value that is not this rank's piece, or whole leaves (counters,
    generator states) that differ between ranks: the same ``ValueError`` on every rank, naming the
    path, decided in one ``all_gather_object`` before anything is returned. The template is never
    written to (``dcp.load`` writes into the dict's tensors: see ``copy`` in :func:`state_dict`).
    """
    owner = "gradtx.checkpoint.load_state_dict"
    if params is None and spec is not None:
        raise ValueError(f"{owner}: a spec lays out params; pass the params it describes")
    resolved = _resolve(template_state, params, spec, owner=owner, has_params=params is not None)
    error: Optional[Exception] = resolved.error
    records, values, manifest_hash = None, None, None
    if error is None:
        try:
            problem = _local_errors(resolved, loaded)
            if problem is not None:
                raise ValueError(problem)
            records = _records(resolved, values=loaded)
            values = {r.path: _describe_value(loaded[r.path]) for r in records}
            if MANIFEST in loaded:
                manifest_hash = hashlib.blake2b(str(loaded[MANIFEST]).encode(), digest_size=16).hexdigest()
        except (ValueError, TypeError) as exc:
            error = exc
    gathered = ckpt_lib.exchange(resolved.mesh, _payload(resolved, records, error, values=values, manifest=manifest_hash))
    agreed = _agree(gathered, resolved.mesh, _me(), owner=owner)
    if len({payload["manifest"] for _, payload in gathered}) > 1:
        raise ValueError(f"{owner}: the ranks loaded different manifests (different checkpoints?)")
    if manifest_hash is not None:
        problem = _manifest_problem(loaded[MANIFEST], agreed.manifest)
        if problem is not None:
            raise ValueError(f"{owner}: {problem}")
    for rank, payload in gathered:
        for record in payload["records"]:
            shape = agreed.manifest[record.path][2] if record.kind != "number" else None
            problem = _value_problem(record, payload["values"][record.path], shape, agreed.boxes.get((rank, record.path)))
            if problem is not None:
                where = f" (on rank {rank})" if len(gathered) > 1 else ""
                raise ValueError(f"{owner}: {problem}{where}")
    return _rebuild(resolved, loaded, agreed)


def _rebuild(resolved: _Resolved, loaded: Mapping[str, Any], agreed: _Agreed) -> Any:
    me = _me()
    new = []
    for path, leaf, layout in zip(resolved.paths, resolved.leaves, resolved.layouts):
        if leaf is None:
            new.append(None)
            continue
        value = loaded[path]
        if layout is None:
            new.append(value)
            continue
        template_local = dtensor_lib.local(leaf)
        if isinstance(value, Pieces) or dtensor_lib.is_dtensor(value):
            if layout.kind == "dtensor" and dtensor_lib.is_dtensor(value) and ckpt_lib.describe_dtensor(value) == ckpt_lib.describe_dtensor(leaf):
                piece = dtensor_lib.local(value)
            else:
                piece = ckpt_lib.local_piece(value)
        else:
            size, offsets = agreed.boxes[(me, path)]  # type: ignore[misc]
            region = tuple(slice(o, o + s) for s, o in zip(size, offsets))
            piece = value[region]
            if piece.shape != value.shape:
                piece = piece.clone()
        piece = piece.detach().to(device=template_local.device)
        if layout.kind == "dtensor":
            new.append(dtensor_lib._like(type(leaf), leaf, piece))
        else:
            new.append(piece)
    return tree_lib.unflatten(resolved.treedef, new)
