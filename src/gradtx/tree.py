"""Pytree helpers: flattening with string paths, mapping, (device, dtype) groups, foreach norms.

The backend is ``optree`` (measured faster than ``torch.utils._pytree`` for unflatten, map and
flatten-with-path on a 500-leaf dict; see the README). ``None`` is a leaf meaning "no gradient":
it keeps the tree's structure equal to the parameters' and is skipped by every computation.

Foreach kernels (``torch._foreach_*``) do the arithmetic, one call per (device, dtype) group, in
place where the caller owns the buffers. Where a graph must be recorded (autograd is on and a tensor
requires grad, or a ``torch.func`` transform such as ``grad`` or ``vmap`` wraps one) the same
functions run one ordinary, out-of-place op per tensor instead, so every result is differentiable.
"""

from __future__ import annotations

import collections
import functools
import itertools
import math
import sys
from typing import Any, Callable, Iterator, Optional, Sequence, Union

import numpy as np
import optree
import torch
from torch import Tensor

from gradtx import torch_internals

PyTree = Any
TreeSpec = optree.PyTreeSpec

_NONE_IS_LEAF = True
_NAMESPACE = "gradtx"


# --------------------------------------------------------------------------- structure


def flatten(tree: PyTree) -> tuple[list[Any], TreeSpec]:
    """Flattens ``tree`` into its leaves (``None`` included) and its structure."""
    return optree.tree_flatten(tree, none_is_leaf=_NONE_IS_LEAF, namespace=_NAMESPACE)


def unflatten(treedef: TreeSpec, leaves: Sequence[Any]) -> PyTree:
    """Inverse of :func:`flatten` (and of :func:`tensor_leaves`, whose structure may be a
    :class:`_PlainStructure` while ``torch.compile`` traces)."""
    if type(treedef) is _PlainStructure:
        return treedef.unflatten(leaves)
    if treedef.type is collections.OrderedDict and treedef.num_nodes == treedef.num_leaves + 1 == len(leaves) + 1:
        # One OrderedDict of leaves (``wrap``'s trees): built from its keys directly. optree builds
        # it from a (key, value) tuple per leaf, which with many leaves costs several times more
        # and, as the tuples are tracked objects, sets off the garbage collector's full passes.
        return collections.OrderedDict(zip(treedef.entries(), leaves))
    return optree.tree_unflatten(treedef, leaves)


def flatten_to_rebuild(tree: PyTree) -> tuple[list[Any], Union[TreeSpec, "_PlainStructure"]]:
    """:func:`flatten`, for a caller that only hands the structure back to :func:`unflatten`: while
    ``torch.compile`` traces, a plain tree's structure is a :class:`_PlainStructure`, which Dynamo
    walks in far fewer steps than it runs optree's flatten."""
    if torch.compiler.is_compiling():
        found = _plain_leaves(tree)
        if found is not None:
            return found, _PlainStructure(tree, len(found))
    return flatten(tree)


def leaves(tree: PyTree) -> list[Any]:
    """The leaves of ``tree``, ``None`` included."""
    if torch.compiler.is_compiling():
        found = _plain_leaves(tree)
        if found is not None:
            return found
    return optree.tree_leaves(tree, none_is_leaf=_NONE_IS_LEAF, namespace=_NAMESPACE)


def leaves_until(tree: PyTree, stop: Callable[[Any], bool]) -> list[Any]:
    """The leaves of ``tree``, where a node for which ``stop`` is true counts as one leaf."""
    return optree.tree_leaves(tree, is_leaf=stop, none_is_leaf=_NONE_IS_LEAF, namespace=_NAMESPACE)


def structure(tree: PyTree) -> TreeSpec:
    return optree.tree_structure(tree, none_is_leaf=_NONE_IS_LEAF, namespace=_NAMESPACE)


def tree_map(fn: Callable[..., Any], tree: PyTree, *rest: PyTree, names: Sequence[str] = ()) -> PyTree:
    """Maps ``fn`` over the leaves of ``tree`` (and the matching leaves of ``rest``).

    ``None`` leaves of ``tree`` stay ``None`` and ``fn`` is not called for them. A tree of ``rest``
    that does not have the structure of ``tree`` (or ``tree`` as a prefix) is the ``ValueError`` of
    :func:`mismatch_error`, the trees called by ``names`` (``("adamw: updates", "params")``: the
    first names ``tree``, the others ``rest``), found only once the map has failed.
    """

    def visit(x, *xs):
        return None if x is None else fn(x, *xs)

    if torch.compiler.is_compiling():  # see _plain_columns: the same map, traced in far fewer steps
        columns = _plain_columns(tree, rest, strict=False)
        if columns is not None:
            if False not in instances(columns[0], Tensor):  # no None to skip
                return _plain_rebuild(tree, list(map(fn, *columns)))
            return _plain_rebuild(tree, [visit(*leaves) for leaves in zip(*columns)])
    try:
        return optree.tree_map(visit, tree, *rest, none_is_leaf=_NONE_IS_LEAF, namespace=_NAMESPACE)
    except (ValueError, TypeError) as error:
        spec = structure(tree)
        for index, other in enumerate(rest, 1):
            try:
                spec.flatten_up_to(other)
            except (ValueError, TypeError):
                owner, _, first = (names[0] if names else "the first tree").rpartition(": ")
                name = names[index] if index < len(names) else f"tree {index}"
                what = f"{owner}: {name}" if owner else name
                raise mismatch_error(other, tree, what=what, like=first) from error
        raise


def first_device(tree: PyTree) -> torch.device:
    """The device of the first tensor leaf (CPU for a tree with none): where step counters live."""
    for leaf in leaves(tree):
        if isinstance(leaf, Tensor):
            return leaf.device
    return torch.device("cpu")


def join_path(path: Sequence[Any]) -> str:
    """``("layers", 0, "qkv", "weight")`` -> ``"layers.0.qkv.weight"``."""
    return ".".join(str(part) for part in path)


def _path_part(entry: optree.PyTreeEntry) -> Any:
    """A dict key, a sequence index, or a field name (NamedTuple, dataclass, attribute)."""
    if isinstance(entry, (optree.NamedTupleEntry, optree.StructSequenceEntry)):
        return entry.field
    if isinstance(entry, optree.GetAttrEntry):
        return entry.name
    return entry.entry


@functools.lru_cache(maxsize=256)
def _structure_paths(treedef: TreeSpec) -> tuple[str, ...]:
    return tuple(join_path([_path_part(e) for e in accessor]) for accessor in treedef.accessors())


def paths(tree: PyTree) -> list[str]:
    """The dotted path of every leaf, in flattening order (NamedTuple fields by name: ``"0.mu.w"``)."""
    if torch.compiler.is_compiling():  # dynamo traces through the cache (and warns): build them anew
        return list(_structure_paths.__wrapped__(structure(tree)))
    return list(_structure_paths(structure(tree)))


def path_at(tree: PyTree, index: int) -> str:
    """The dotted path of leaf number ``index`` (used to build error messages)."""
    all_paths = paths(tree)
    return all_paths[index] if 0 <= index < len(all_paths) else f"<leaf {index}>"


def flatten_like(tree: PyTree, treedef: TreeSpec, reference: PyTree, *, what: str, like: str) -> list[Any]:
    """Flattens ``tree``, which must have structure ``treedef`` (that of ``reference``).

    ``what`` names ``tree``, after its owner where there is one (``"adamw: state.mu"``); ``like``
    names ``reference`` (``"params"``, ``"updates"``). A mismatch is a ``ValueError`` saying which
    side has a leaf the other lacks, or where their containers differ (:func:`describe_mismatch`).
    """
    if torch.compiler.is_compiling():  # see _plain_columns: the same check, traced in far fewer steps
        columns = _plain_columns(reference, [tree], strict=True)
        if columns is not None:
            return columns[1]
    tree_leaves, tree_def = flatten(tree)
    if tree_def != treedef:
        raise mismatch_error(tree, reference, what=what, like=like)
    return tree_leaves


_LEAF_TYPES = (Tensor, type(None))


def instances(values: Sequence[Any], kind: Union[type, tuple[type, ...]]) -> list[bool]:
    """``isinstance(value, kind)`` per value, in one native ``map``: no per-value Python step,
    eagerly or for Dynamo to trace (a generator or comprehension is traced value by value)."""
    return list(map(isinstance, values, [kind] * len(values)))


def _all_leaves(values: list[Any]) -> bool:
    """Whether every value is a tensor or ``None``."""
    return False not in instances(values, _LEAF_TYPES)


def _all_str(keys: list[Any]) -> bool:
    """Whether every key is a ``str`` (exactly: optree orders other keys its own way)."""
    return list(map(type, keys)) == [str] * len(keys)


def _plain_children(node: Any) -> Optional[tuple[list[Any], list[Any]]]:
    """The keys and children of a plain container in optree's order (a dict by sorted key, an
    ``OrderedDict`` as inserted, a list, tuple or gradtx state by position); ``None`` for any other
    node, and for a dict with a key that is not a string (optree orders mixed keys its own way)."""
    kind = type(node)
    if kind is dict or kind is collections.OrderedDict:
        keys = list(node)
        if not _all_str(keys):
            return None
        if kind is dict:
            keys = sorted(keys)
        return keys, list(map(node.__getitem__, keys))
    if kind is list or kind is tuple or _is_own_namedtuple(kind):
        return list(range(len(node))), list(node)
    return None


def _is_own_namedtuple(kind: type) -> bool:
    """A state ``NamedTuple`` of gradtx's (never registered as a custom node, so optree flattens
    it field by field); a user's namedtuple might be registered, and goes through optree."""
    return issubclass(kind, tuple) and hasattr(kind, "_fields") and kind.__module__.startswith("gradtx.")


def _children_like(kind: type, keys: list[Any], match: Any, *, strict: bool) -> Optional[list[Any]]:
    """The children of ``match`` lined up with those of a ``kind`` node with ``keys`` (in optree's
    order), or ``None`` when ``match`` is not the same container with the same keys (with ``strict``,
    an ``OrderedDict``'s keys in the same order)."""
    if type(match) is not kind or len(match) != len(keys):
        return None
    if kind is dict or kind is collections.OrderedDict:
        own = list(match)
        if not _all_str(own):
            return None
        if kind is dict:
            same = sorted(own) == keys
        else:
            same = own == keys if strict else sorted(own) == sorted(keys)
        return list(map(match.__getitem__, keys)) if same else None
    return list(match)


def _plain_columns(tree: PyTree, others: Sequence[PyTree], *, strict: bool) -> Optional[list[list[Any]]]:
    """The leaves of ``tree`` in optree's order, then, for each other tree, its nodes at those
    leaves (one list per tree), when ``tree`` is a nesting of plain containers (:func:`_plain_children`)
    over tensors and ``None`` and every other tree has the same containers with the same keys;
    else ``None``.

    ``strict``: the others' nodes at ``tree``'s leaves must be leaves too (equal structures, as
    :func:`flatten_like` needs), and an ``OrderedDict`` must have ``tree``'s key order; otherwise
    they may be any subtree (``tree`` as a prefix, as :func:`tree_map` allows).

    Used while ``torch.compile`` traces: Dynamo runs optree's flatten as Python, building a spec
    object per node, and a transform lines up several trees per step. This walk checks the same
    structure with builtins Dynamo runs natively (``list(map(...))``, ``sorted``, list equality and
    slices), in the same few traced steps per node whatever its number of children, and takes a
    node whose children are all leaves (a dict of tensors) whole, so a step traces in far fewer.
    Anything else returns ``None`` and goes through optree, which decides and words any error.
    """
    columns: list[list[Any]] = [[]]
    for _ in others:
        columns.append([])
    return columns if _fill_columns(tree, list(others), strict, columns) else None


def _fill_columns(node: Any, matches: list[Any], strict: bool, columns: list[list[Any]]) -> bool:
    """Appends the leaves under ``node``, and the nodes of ``matches`` at them, to ``columns``."""
    if node is None or isinstance(node, Tensor):
        if strict and not _all_leaves(matches):
            return False
        columns[0].append(node)
        for column, match in zip(columns[1:], matches):
            column.append(match)
        return True
    found = _plain_children(node)
    if found is None:
        return False
    keys, children = found
    kind = type(node)
    flat = _all_leaves(children)
    rows = []
    for match in matches:
        row = _children_like(kind, keys, match, strict=strict)
        if row is None or (strict and flat and not _all_leaves(row)):
            return False
        rows.append(row)
    if flat:  # the common node, a dict of tensors: every column takes its row whole
        columns[0].extend(children)
        for column, row in zip(columns[1:], rows):
            column.extend(row)
        return True
    for index in range(len(children)):
        if not _fill_columns(children[index], [row[index] for row in rows], strict, columns):
            return False
    return True


def _plain_leaves(tree: PyTree) -> Optional[list[Any]]:
    """The leaves of ``tree`` in optree's order when it is a plain tree (:func:`_plain_columns`),
    else ``None``: what the traced paths of :func:`leaves`, :func:`flatten_to_rebuild` and
    :func:`tensor_leaves` take instead of optree's flatten, in far fewer traced steps."""
    columns = _plain_columns(tree, (), strict=True)
    return None if columns is None else columns[0]


def _plain_rebuild(tree: PyTree, values: Sequence[Any]) -> PyTree:
    """A tree with ``tree``'s plain containers (key order kept) and ``values`` at its leaves, in
    optree's order; ``tree`` has passed :func:`_plain_columns`."""
    return _rebuild_from(tree, values, 0)[0]


def _rebuild_from(tree: PyTree, values: Sequence[Any], start: int) -> tuple[PyTree, int]:
    """:func:`_plain_rebuild` from ``values[start]`` on; also returns where the next leaf's value is."""
    if tree is None or isinstance(tree, Tensor):
        return values[start], start + 1
    kind = type(tree)
    keys, children = _plain_children(tree)
    if _all_leaves(children):
        built = list(values[start : start + len(children)])
        start += len(children)
    else:
        built = []
        for child in children:
            value, start = _rebuild_from(child, values, start)
            built.append(value)
    if kind is list or kind is tuple:
        return kind(built), start
    if issubclass(kind, tuple):  # a state NamedTuple
        return kind(*built), start
    if kind is collections.OrderedDict:  # its keys are in their own order already
        return collections.OrderedDict(zip(keys, built)), start
    rebuilt = dict.fromkeys(tree)  # the keys in their own order, then the values by key
    rebuilt.update(zip(keys, built))
    return rebuilt, start


class _PlainStructure:
    """The structure of a plain tree (see :func:`_plain_columns`) while ``torch.compile`` traces:
    it unflattens, flattens up to and compares by walking the tree it was taken from, in far fewer
    traced steps than optree's spec; anything else it is asked is optree's spec's answer."""

    __slots__ = ("tree", "num_leaves")

    def __init__(self, tree: PyTree, num_leaves: int) -> None:
        self.tree = tree
        self.num_leaves = num_leaves

    def unflatten(self, leaves: Sequence[Any]) -> PyTree:
        leaves = list(leaves)
        if len(leaves) != self.num_leaves:
            raise ValueError(f"{len(leaves)} leaves for a structure of {self.num_leaves}")
        return _plain_rebuild(self.tree, leaves)

    def flatten_up_to(self, other: PyTree) -> list[Any]:
        columns = _plain_columns(self.tree, (other,), strict=False)
        return structure(self.tree).flatten_up_to(other) if columns is None else columns[1]

    def __eq__(self, other: object) -> bool:
        if type(other) is _PlainStructure:
            return _plain_columns(self.tree, (other.tree,), strict=True) is not None
        return structure(self.tree) == other

    def __ne__(self, other: object) -> bool:
        return not self == other

    __hash__ = None  # type: ignore[assignment]

    def __getattr__(self, name: str) -> Any:  # only what the slots and methods above do not answer
        if name.startswith("_") or name in _PlainStructure.__slots__:
            raise AttributeError(name)
        return getattr(structure(self.tree), name)


def mismatch_error(tree: PyTree, reference: PyTree, *, what: str, like: str) -> ValueError:
    """The ``ValueError`` for ``tree`` (``what``: its name, after its owner) not having the structure
    of ``reference`` (called ``like``): ``"adamw: updates do not match params: params has leaf 'W'
    that updates lacks (updates is a dict, params is a dict)"``."""
    name = what.rpartition(": ")[2]
    how = describe_mismatch(tree, reference, name=name, like=like)
    return ValueError(f"{what} {_do(name)} not match {like}: {how}")


def _do(name: str) -> str:
    """The verb for ``name``: "updates do", "state.mu does"."""
    last = name.rpartition(".")[2]
    return "do" if last.endswith("s") and not last.endswith("ss") else "does"


def _node(spec: TreeSpec) -> str:
    """What a node of a structure is: ``"a dict"``, ``"a list of 3"``, ``"a ScaleByAdamState"``, ``"a leaf"``."""
    if spec.is_leaf():
        return "a leaf"
    kind = spec.type
    if kind in (list, tuple):
        return f"a {kind.__name__} of {spec.num_children}"
    name = getattr(kind, "__name__", str(kind))
    return f"an {name}" if name[:1].lower() in "aeiou" else f"a {name}"


def _first_difference(mine: TreeSpec, theirs: TreeSpec, path: tuple) -> tuple[tuple, TreeSpec, TreeSpec]:
    """The first node (pre-order) where the structures ``mine`` and ``theirs`` differ: its path and both nodes."""
    if mine.is_leaf() or theirs.is_leaf() or mine.type is not theirs.type or mine.entries() != theirs.entries():
        return path, mine, theirs
    for entry, a, b in zip(mine.entries(), mine.children(), theirs.children()):
        if a != b:
            return _first_difference(a, b, path + (entry,))
    return path, mine, theirs  # the nodes themselves differ (a namedtuple's or a defaultdict's metadata)


def _leaf_paths_below(spec: TreeSpec, path: tuple) -> list[str]:
    """The dotted paths of the leaves under the node ``spec`` at ``path``."""
    below = _structure_paths(spec)
    return [join_path(path + ((p,) if p else ())) for p in below] or [join_path(path)]


def _lacks(owner: str, other: str, paths: list[str]) -> str:
    """``"params has leaf 'W' that updates lacks"`` (up to three paths named)."""
    if len(paths) == 1:
        return f"{owner} has leaf {paths[0]!r} that {other} lacks"
    named = ", ".join(repr(p) for p in paths[:3]) + (f" and {len(paths) - 3} more" if len(paths) > 3 else "")
    return f"{owner} has leaves {named} that {other} lacks"


def describe_mismatch(tree: PyTree, reference: PyTree, *, name: str, like: str) -> str:
    """How the structure of ``tree`` (called ``name``) differs from that of ``reference`` (called ``like``).

    Finds the first node where they part: different containers there (``"updates is a list where
    params is a dict"``), or the leaves one side has and the other lacks, with both containers
    (``"params has leaf 'W' that updates lacks (updates is a dict, params is a dict)"``).
    """
    return _describe_node(*_first_difference(structure(tree), structure(reference), ()), name=name, like=like)


def _describe_node(path: tuple, mine: TreeSpec, theirs: TreeSpec, *, name: str, like: str) -> str:
    """:func:`describe_mismatch`'s sentence for the node at ``path`` where ``mine`` and ``theirs`` part."""
    where = f" at {join_path(path)!r}" if path else ""
    if mine.is_leaf() or theirs.is_leaf() or mine.type is not theirs.type:
        if path:
            return f"{name} has {_node(mine)}{where} where {like} has {_node(theirs)}"
        return f"{name} is {_node(mine)} where {like} is {_node(theirs)}"
    own_entries, their_entries = mine.entries(), theirs.entries()
    if own_entries != their_entries:
        missing, extra = [], []
        for entry, child in zip(their_entries, theirs.children()):
            if entry not in own_entries:
                missing += _leaf_paths_below(child, path + (entry,))
        for entry, child in zip(own_entries, mine.children()):
            if entry not in their_entries:
                extra += _leaf_paths_below(child, path + (entry,))
        said = [_lacks(like, name, missing)] if missing else []
        said += [_lacks(name, like, extra)] if extra else []
        if not said:  # the same keys in another order (an OrderedDict)
            said = [f"{name} has the keys{where} in the order {list(own_entries)}, {like} in {list(their_entries)}"]
        if path:
            containers = f"at {join_path(path)!r}: {name} has {_node(mine)}, {like} has {_node(theirs)}"
        else:
            containers = f"{name} is {_node(mine)}, {like} is {_node(theirs)}"
        return "; ".join(said) + f" ({containers})"
    return f"{name} and {like} have the same leaves but differ{where}: {mine} vs {theirs}"


def _uncovered(prefix: PyTree, tree: PyTree) -> str:
    """Names a leaf of ``tree`` that no node of the would-be prefix tree ``prefix`` covers, or the
    first node where ``prefix`` has a container that is not ``tree``'s there."""
    prefix_paths = paths(prefix)
    for path in paths(tree):
        if not any(p == "" or path == p or path.startswith(p + ".") for p in prefix_paths):
            return f"leaf {path!r} is not covered"
    tree_paths = paths(tree)
    for p in prefix_paths:
        if not any(path == p or path.startswith(p + ".") for path in tree_paths):
            return f"it has {p!r}, which the tree lacks"
    found = _prefix_misfit(structure(prefix), structure(tree), ())
    if found is not None:
        return _describe_node(*found, name="the prefix", like="the tree")
    return describe_mismatch(prefix, tree, name="the prefix", like="the tree")


_MAPPINGS = (dict, collections.OrderedDict, collections.defaultdict)


def _prefix_misfit(mine: TreeSpec, theirs: TreeSpec, path: tuple) -> Optional[tuple[tuple, TreeSpec, TreeSpec]]:
    """The first node (pre-order) where the prefix structure ``mine`` does not fit ``theirs``: a
    container of ``mine`` where ``theirs`` has a leaf or another container. A leaf of ``mine`` covers
    whatever is below it; dicts match by key, whatever their kind and order (as
    :func:`broadcast_leaves` matches them). ``None`` where every node fits."""
    if mine.is_leaf():
        return None
    if theirs.is_leaf():
        return path, mine, theirs
    if mine.type in _MAPPINGS and theirs.type in _MAPPINGS:
        if set(mine.entries()) != set(theirs.entries()):
            return path, mine, theirs
        below = dict(zip(theirs.entries(), theirs.children()))
        pairs = [(entry, child, below[entry]) for entry, child in zip(mine.entries(), mine.children())]
    elif mine.type is not theirs.type or mine.entries() != theirs.entries():
        return path, mine, theirs
    else:
        pairs = list(zip(mine.entries(), mine.children(), theirs.children()))
    for entry, a, b in pairs:
        found = _prefix_misfit(a, b, path + (entry,))
        if found is not None:
            return found
    return None


def check_tensors(tree: PyTree, tree_leaves: Sequence[Any], *, what: str, allow_none: bool = True) -> None:
    """Raises ``TypeError`` naming the first leaf that is neither a tensor nor (if allowed) ``None``."""
    for index, leaf in enumerate(tree_leaves):
        if isinstance(leaf, Tensor) or (allow_none and leaf is None):
            continue
        raise TypeError(
            f"{what}: leaf {path_at(tree, index)!r} is a {type(leaf).__name__}, expected a torch.Tensor"
            + (" or None" if allow_none else "")
        )


def _present(tree_leaves: list[Any]) -> list[int]:
    """The indices of the tensors among leaves that are tensors or ``None`` (no per-leaf step for
    Dynamo to trace when every leaf is a tensor)."""
    tensors = instances(tree_leaves, Tensor)
    if False not in tensors:
        return list(range(len(tree_leaves)))
    return [i for i, tensor in enumerate(tensors) if tensor]


def tensor_leaves(tree: PyTree, *, what: str) -> tuple[list[Any], TreeSpec, list[int]]:
    """Flattens ``tree``, checks its leaves, and returns the indices of the non-``None`` ones.

    While ``torch.compile`` traces, a plain tree's structure is a :class:`_PlainStructure`."""
    if torch.compiler.is_compiling():
        tree_leaves = _plain_leaves(tree)
        if tree_leaves is not None:  # its leaves are tensors and None
            return tree_leaves, _PlainStructure(tree, len(tree_leaves)), _present(tree_leaves)
    tree_leaves, treedef = flatten(tree)
    kinds = set(map(type, tree_leaves))  # a C-level pass: the check costs little on many small leaves
    if all(issubclass(kind, Tensor) for kind in kinds):
        return tree_leaves, treedef, list(range(len(tree_leaves)))
    present = [i for i, leaf in enumerate(tree_leaves) if leaf is not None]
    if len(present) != len(tree_leaves) or not all(isinstance(tree_leaves[i], Tensor) for i in present):
        check_tensors(tree, tree_leaves, what=what)
    return tree_leaves, treedef, present


def require_params(updates: PyTree, params: PyTree, *, owner: str, why: str = "") -> None:
    """Raises ``ValueError`` when ``params`` are missing but some update needs them. An updates tree
    with no tensor at all (a combinator's branch that selects no leaf: for a single-tensor tree
    it is ``None``, and so are its params) needs none."""
    if params is None and any(leaf is not None for leaf in leaves(updates)):
        raise ValueError(f"{owner}: params are required{why} (pass them to update)")


def refuse_complex(tree: PyTree, *, owner: str, why: str = "") -> None:
    """Raises ``TypeError`` naming the first complex leaf of ``tree``: for the transformations that
    have no complex form (ordered comparisons, a complex ``g * g`` where a modulus is meant), called
    from their ``init`` so that no step is ever taken with numbers other libraries would not give."""
    for index, leaf in enumerate(leaves(tree)):
        if isinstance(leaf, Tensor) and leaf.is_complex():
            raise TypeError(
                f"{owner}: leaf {path_at(tree, index)!r} is complex ({leaf.dtype}) and complex parameters are "
                f"not supported{' (' + why + ')' if why else ''}; gradtx.contrib.split_real_and_imaginary runs "
                "it on the real and imaginary parts as separate real parameters"
            )


def real_inner(x: Tensor, y: Tensor, dtype: torch.dtype) -> Tensor:
    """``Re(sum(conj(x) * y))`` accumulated in the real ``dtype``: the inner product of ``x`` and ``y``
    seen as real vectors (a complex entry as its real and imaginary parts). optax's L-BFGS and
    line searches take it as ``real(vdot)``; on real tensors it is the dot product."""
    if not (x.is_complex() or y.is_complex()):
        return torch.dot(x.reshape(-1).to(dtype), y.reshape(-1).to(dtype))
    x, y = (t if t.is_complex() else torch.complex(t, torch.zeros_like(t)) for t in (x, y))
    return torch.dot(torch.view_as_real(x).reshape(-1).to(dtype), torch.view_as_real(y).reshape(-1).to(dtype))


def real_dtypes(tree: PyTree) -> list[torch.dtype]:
    """The dtypes of the floating-point tensor leaves, a complex leaf counting with its real dtype
    (complex128: float64): the dtypes that scalars computed from the leaves (values, norms, step
    sizes, injected hyperparameters) are kept in."""
    return [
        leaf.real.dtype if leaf.is_complex() else leaf.dtype
        for leaf in leaves(tree)
        if isinstance(leaf, Tensor) and (leaf.is_floating_point() or leaf.is_complex())
    ]


_COMPLEX_OF = {torch.float16: torch.complex32, torch.float32: torch.complex64, torch.float64: torch.complex128}


def state_dtype(dtype: Optional[torch.dtype], like: Tensor, *, where: str = "") -> torch.dtype:
    """The dtype of a state leaf kept for ``like`` when a transformation is given ``dtype`` (a
    ``mu_dtype`` or ``accumulator_dtype``; ``None``: ``like``'s own).

    For a complex ``like`` a real ``dtype`` names a precision: the state is the complex dtype of that
    precision (float32 -> complex64), so that no imaginary part is dropped (optax casts such state
    to the real dtype and loses it). A precision with no complex dtype (bfloat16) is a ``TypeError``
    naming the leaf ``where``.
    """
    if dtype is None:
        return like.dtype
    if like.is_complex() and not dtype.is_complex:
        if dtype not in _COMPLEX_OF:
            raise TypeError(
                f"leaf {where!r} is complex ({like.dtype}) and there is no complex dtype of {dtype}'s precision "
                "to keep its state in"
            )
        return _COMPLEX_OF[dtype]
    return dtype


def broadcast_leaves(prefix: PyTree, tree: PyTree) -> list[Any]:
    """The leaves of ``prefix`` broadcast to ``tree``'s structure, one per leaf of ``tree``, in its order.

    Dict keys match by name: a plain-dict prefix fits an ``OrderedDict`` tree (as :func:`gradtx.wrap`
    builds, in parameter order) whatever order either was written in. Raises ``ValueError`` when
    ``prefix`` is not a prefix of ``tree``.
    """
    if isinstance(prefix, (bool, int)):  # one value for every leaf (and no optree call for torch.compile to trace)
        return [prefix] * len(leaves(tree))
    full = optree.tree_broadcast_prefix(prefix, tree, none_is_leaf=_NONE_IS_LEAF, namespace=_NAMESPACE)
    # the broadcast keeps the prefix's containers (and their key order): read it in the tree's
    return structure(tree).flatten_up_to(full)


def fitted_leaves(prefix: PyTree, tree: PyTree, *, what: str) -> list[Any]:
    """:func:`broadcast_leaves`, with a ``ValueError`` naming ``what`` and the leaves it does not fit."""
    try:
        return broadcast_leaves(prefix, tree)
    except ValueError:
        raise ValueError(f"{what} does not fit the tree: {_uncovered(prefix, tree)}") from None


def mask_leaves(mask: Any, tree: PyTree, *, what: str = "mask") -> list[bool]:
    """Resolves an optax-style mask against ``tree``: one bool per leaf of ``tree``.

    ``mask`` is a pytree of bools with the structure of ``tree`` or a prefix of it (a bool at a
    node covers every leaf below), or a callable ``tree -> such a pytree``. ``True`` selects a leaf.
    """
    if callable(mask):
        mask = mask(tree)
    values = fitted_leaves(mask, tree, what=what)
    for index, value in enumerate(values):
        if not isinstance(value, (bool, int, np.bool_)) and not (isinstance(value, Tensor) and value.numel() == 1):
            raise TypeError(f"{what}: leaf {path_at(tree, index)!r} has mask value {value!r}, expected a bool")
    return [bool(value) for value in values]


# --------------------------------------------------------------------------- groups and kernels

_DTENSOR_MODULE = "torch.distributed.tensor"


_dtensor_class: Optional[type] = None  # once found, kept: a module stays imported


def dtensor_type() -> Optional[type]:
    """The DTensor class if DTensors can exist in this process (its module is imported), else ``None``.

    Asked once per op: after the first answer that finds it, one global read (for Dynamo too)."""
    global _dtensor_class
    if _dtensor_class is None:
        module = sys.modules.get(_DTENSOR_MODULE)
        _dtensor_class = getattr(module, "DTensor", None) if module is not None else None
    return _dtensor_class


def _split_dtensors(index_lists: list[list[int]], tensors: Sequence[Tensor]) -> list[list[int]]:
    """Splits each group into its DTensors and its plain tensors (one foreach kernel cannot take both).

    Free when DTensor was never imported; otherwise one isinstance map (in C) finds out whether
    there is anything to split."""
    cls = dtensor_type()
    if cls is None or True not in instances(tensors, cls):
        return index_lists
    out = []
    for indices in index_lists:
        kinds = [isinstance(tensors[i], cls) for i in indices]
        if all(kinds) or not any(kinds):
            out.append(indices)
        else:
            out.append([i for i, k in zip(indices, kinds) if k])
            out.append([i for i, k in zip(indices, kinds) if not k])
    return out


def grouped(first: Sequence[Tensor], *others: Sequence[Tensor]) -> Iterator[tuple[list[int], tuple[list[Tensor], ...]]]:
    """Groups parallel tensor lists by the (device, dtype, DTensor or not) of ``first``.

    Yields ``(indices, (first_group, *other_groups))`` so foreach kernels see uniform lists, groups
    in the order of their first tensor. Eagerly,
    outside ``torch.func`` transforms, torch's C++ grouping finds the groups (a Python loop costs
    more than a foreach kernel on thousands of small tensors).
    """
    first = list(first)
    native = bool(first) and not torch.compiler.is_compiling() and not torch_internals.functorch_active()
    index_lists = _split_dtensors(torch_internals.device_dtype_groups(first, native=native), first)
    if len(index_lists) == 1 and len(index_lists[0]) == len(first):
        yield index_lists[0], (first, *(list(seq) for seq in others))
        return
    for indices in index_lists:
        yield indices, tuple([seq[i] for i in indices] for seq in (first, *others))


def to_devices(tensors: Sequence[Tensor], like: Sequence[Tensor]) -> list[Tensor]:
    """Each of ``tensors`` on the device of its counterpart in ``like``: the same tensors, with no
    call per tensor, when all of both lists sit on one device (a Python loop of ``.to`` calls costs
    more than a foreach kernel on many small tensors)."""
    tensors = list(tensors)
    native = not torch.compiler.is_compiling() and not torch_internals.functorch_active()
    if tensors:
        found = torch_internals.devices_of(tensors, native=native) | torch_internals.devices_of(like, native=native)
        if len(found) == 1:
            return tensors
    return [t.to(other.device) for t, other in zip(tensors, like)]


def uses_functorch(tensors: Sequence[Tensor]) -> bool:
    """Whether any tensor is wrapped by a ``torch.func`` transform (foreach kernels can't run then).

    Under ``torch.compile`` the tracer sees plain tensors, so the foreach path is always taken.
    """
    if torch.compiler.is_compiling() or not torch_internals.functorch_active():
        return False
    is_wrapped = torch_internals.wrapped_check()
    return any(is_wrapped(t) for t in tensors)


def needs_graph(*args: Any) -> bool:
    """Whether ops on ``args`` must be recorded for differentiation, so no in-place or ``out=`` kernel
    may touch them: autograd is on and some tensor requires grad, or a ``torch.func`` transform
    (``grad``, ``jvp``, ``vmap``, ...) wraps one.

    ``args`` are tensors, lists or tuples of tensors, or anything else (ignored): the tensor lists of
    an op together with its 0-d tensor factors, so a learning rate that requires grad counts.
    This is the one test that picks between the fast kernels and the differentiable ops.
    """
    grad_on = torch.is_grad_enabled()
    check_wrapped = not torch.compiler.is_compiling() and torch_internals.functorch_active()
    if not (grad_on or check_wrapped):
        return False
    if not check_wrapped and torch.compiler.is_compiling():  # a native map per list: a few traced steps
        for arg in args:
            if isinstance(arg, (list, tuple)):
                if True in list(map(getattr, arg, ["requires_grad"] * len(arg), [False] * len(arg))):
                    return True
            elif isinstance(arg, Tensor) and arg.requires_grad:
                return True
        return False
    if not check_wrapped:  # the common eager case: only requires_grad matters, read in native maps
        for arg in args:
            if isinstance(arg, (list, tuple)):
                if any(map(getattr, arg, itertools.repeat("requires_grad"), itertools.repeat(False))):
                    return True
            elif isinstance(arg, Tensor) and arg.requires_grad:
                return True
        return False
    is_wrapped = torch_internals.wrapped_check()
    for arg in args:
        for t in arg if isinstance(arg, (list, tuple)) else (arg,):
            if isinstance(t, Tensor) and ((grad_on and t.requires_grad) or is_wrapped(t)):
                return True
    return False


def accumulation_dtype(dtypes: Sequence[torch.dtype]) -> torch.dtype:
    """Float64 when any input is float64 (or complex128), else float32: norms never accumulate in half precision.

    Norms are real: a complex tensor's norm is that of its moduli ``|z|``, in its real dtype.
    """
    return torch.float64 if torch.float64 in dtypes or torch.complex128 in dtypes else torch.float32


_UPCAST_CHUNK = 1 << 16  # elements: the largest float32 temporary a CPU norm of a half tensor makes


def _chunked_norm(tensor: Tensor, ord: float, dtype: torch.dtype) -> Tensor:
    """The norm of a contiguous tensor taken over chunks, each upcast to ``dtype`` in turn.

    For ``ord > 0`` the norm of the chunks' norms is the norm of the whole.
    """
    chunks = list(tensor.view(-1).split(_UPCAST_CHUNK))
    return torch.linalg.vector_norm(torch.stack(torch_internals.foreach_kernel("norm")(chunks, ord, dtype=dtype)), ord)


def stored_values(tensor: Tensor) -> Tensor:
    """The elements a sparse tensor stores (its coalesced values: duplicates summed), or ``tensor`` itself.

    For ``ord > 0`` a sparse tensor's norm is that of these values (the implicit zeros add nothing),
    and it is finite exactly when they are.
    """
    if tensor.layout == torch.strided:
        return tensor
    if tensor.layout == torch.sparse_coo:
        return tensor.coalesce().values()
    return tensor.values()


def foreach_norm(tensors: Sequence[Tensor], ord: float, dtype: torch.dtype) -> list[Tensor]:
    """Per-tensor ``ord``-norms of same-(device, dtype) tensors, accumulated and returned in ``dtype``.

    On CPU, torch upcasts a whole half-precision tensor to accumulate in ``dtype``; large contiguous
    ones are taken in chunks instead, so no gradient-sized copy is made. Sparse tensors (an
    ``Embedding(sparse=True)`` gradient) have the norm of their stored values; torch has no norm
    kernel for them, which is how they are found: at no cost to dense ones.

    An empty tensor's ``inf``-norm is 0 (the empty maximum of non-negative values), where torch's
    kernels have no identity for it and raise, so a tree with an empty leaf clips as one without it.
    """
    if ord == math.inf and any(t.numel() == 0 for t in tensors):
        present = [t for t in tensors if t.numel() > 0]
        found = iter(foreach_norm(present, ord, dtype) if present else [])
        zero = tensors[0].new_zeros((), dtype=dtype)
        return [next(found) if t.numel() > 0 else zero for t in tensors]
    try:
        return _dense_foreach_norm(tensors, ord, dtype)
    except (NotImplementedError, RuntimeError):  # torch 2.14: "norm_sparse ... does not support 'dtype'"
        if all(t.layout == torch.strided for t in tensors):
            raise
    if ord <= 0:
        raise ValueError(f"the {ord}-norm of a sparse gradient is not defined by its stored values; use ord > 0")
    return _dense_foreach_norm([stored_values(t) for t in tensors], ord, dtype)


def _dense_foreach_norm(tensors: Sequence[Tensor], ord: float, dtype: torch.dtype) -> list[Tensor]:
    if tensors[0].is_complex():
        # torch's norms of complex tensors take |z| in the real dtype (complex64 -> float32) and accept
        # no real ``dtype``: what clip_grad_norm_ computes, without one
        if needs_graph(list(tensors)):
            norms = [torch.linalg.vector_norm(t, ord) for t in tensors]
        else:
            norms = list(torch_internals.foreach_kernel("norm")(list(tensors), ord))
        return [n if n.dtype == dtype else n.to(dtype) for n in norms]
    if needs_graph(list(tensors)):
        return [torch.linalg.vector_norm(t, ord, dtype=dtype) for t in tensors]
    if tensors[0].dtype != dtype and tensors[0].device.type == "cpu" and ord > 0 and not torch.compiler.is_compiling():
        # (CPU foreach kernels loop over the tensors anyway: one call per tensor costs the same)
        return [
            _chunked_norm(t, ord, dtype)
            if t.numel() > _UPCAST_CHUNK and t.is_contiguous()
            else torch.linalg.vector_norm(t, ord, dtype=dtype)
            for t in tensors
        ]
    return list(torch_internals.foreach_kernel("norm")(list(tensors), ord, dtype=dtype))


def _keep_dtypes(tensors: Sequence[Tensor], results: Sequence[Tensor]) -> list[Tensor]:
    """Casts back results that type promotion widened: a 0-d tensor times a wider 0-d factor.

    ``mul_`` computes such a product in the wider dtype and rounds it once into the tensor's own,
    so the cast gives the in-place path's exact numbers.
    """
    return [r if r.dtype == t.dtype else r.to(t.dtype) for t, r in zip(tensors, results)]


def foreach(name: str, selves: Sequence[Tensor], *args: Any, inplace: bool, **kwargs: Any) -> list[Tensor]:
    """``torch._foreach_<name>[_](selves, *args, **kwargs)``, or one op per tensor where a graph is needed.

    ``inplace=True`` overwrites ``selves`` and returns them; otherwise new tensors are returned.
    Where a graph is needed (:func:`needs_graph`) new tensors are returned either way, so callers
    always use the result. Arguments are numbers, 0-d tensors, or lists with one entry per tensor.
    ``name`` is elementwise: on DTensors laid out alike the kernel runs on their local shards
    (:func:`gradtx.sharding.dtensor.foreach_on_shards`).
    """
    selves = list(selves)
    if True in instances(args, tuple):
        args = tuple([list(a) if isinstance(a, tuple) else a for a in args])
    if needs_graph(selves, *args, *kwargs.values()):
        op = getattr(torch, name)
        if not any(isinstance(a, list) for a in args):  # numbers and 0-d tensors only
            return [op(s, *args, **kwargs) for s in selves]
        columns = [a if isinstance(a, list) else itertools.repeat(a, len(selves)) for a in args]
        return [op(s, *xs, **kwargs) for s, *xs in zip(selves, *columns)]
    kernel = torch_internals.foreach_kernel(f"{name}_" if inplace else name)
    dtensor = dtensor_type()
    if selves and dtensor is not None and isinstance(selves[0], dtensor):
        from gradtx.sharding.dtensor import foreach_on_shards  # (which imports this module)

        on_shards = foreach_on_shards(kernel, selves, args, kwargs, inplace=inplace)
        if on_shards is not None:
            return on_shards
    if inplace:
        if name == "mul" and _rounds_its_scalar(selves, args):
            args = (torch.tensor(args[0], dtype=torch.float32),)
        kernel(selves, *args, **kwargs)
        return selves
    return list(kernel(selves, *args, **kwargs))


_REDUCED = (torch.bfloat16, torch.float16)


def _rounds_its_scalar(selves: list[Tensor], args: tuple) -> bool:
    """Whether ``torch._foreach_mul_`` would round a number to ``selves``' dtype before the product:
    on the CPU (torch 2.13 and 2.14) it does for bfloat16 and float16, where ``mul``, ``mul_`` and
    ``_foreach_mul`` multiply by the number as a float32 (and so does ``_foreach_mul_`` given a 0-d
    float32 tensor): an in-place step would scale by a learning rate of 0.10009765625 for 0.1."""
    return (
        len(args) == 1 and isinstance(args[0], float) and bool(selves)
        and selves[0].dtype in _REDUCED and selves[0].device.type == "cpu"
    )


def foreach_mul(tensors: Sequence[Tensor], scalar: Tensor | float | Sequence[Tensor], *, inplace: bool) -> list[Tensor]:
    """``tensors * scalar`` (one scalar, or one per tensor), in place when ``inplace``; dtypes are kept."""
    results = foreach("mul", tensors, scalar, inplace=inplace)
    return results if inplace else _keep_dtypes(tensors, results)


def foreach_add(first: Sequence[Tensor], second: Sequence[Tensor], *, inplace: bool = False) -> list[Tensor]:
    """``first + second`` elementwise over two lists, in place into ``first`` when ``inplace``."""
    return foreach("add", first, second, inplace=inplace)


def local_norms(tensors: Sequence[Tensor], ord: float) -> list[Tensor]:
    """Per-tensor norms of a mixed list, grouped for foreach, in input order.

    Each group accumulates in float32, or float64 for float64 tensors (as torch does for float32 and
    float64, without copying a float32 tensor to float64), and the norms are returned in one dtype:
    float64 if any tensor is float64, else float32.
    """
    if not tensors:
        return []
    dtype = accumulation_dtype([t.dtype for t in tensors])
    norms: list[Optional[Tensor]] = [None] * len(tensors)
    for indices, (group,) in grouped(tensors):
        for i, norm in zip(indices, foreach_norm(group, ord, accumulation_dtype([group[0].dtype]))):
            norms[i] = norm if norm.dtype == dtype else norm.to(dtype)
    return norms  # type: ignore[return-value]


def norm_dtype(dtype: torch.dtype) -> torch.dtype:
    """The ``dtype=`` that makes ``torch.linalg.vector_norm`` of a ``dtype`` tensor accumulate in
    float32 at least: float32 or float64, or complex64 or complex128 for a complex tensor (whose
    norm is the real one of its moduli)."""
    if dtype.is_complex:
        return torch.complex128 if dtype == torch.complex128 else torch.complex64
    return accumulation_dtype([dtype])


def unit_dims(shape: Sequence[int], axis: Union[None, int, Sequence[int]], *, what: str = "unitwise_norm") -> Optional[tuple[int, ...]]:
    """The dims a unit-wise norm of a tensor of ``shape`` reduces over, ``None`` when the whole tensor
    is one unit.

    ``axis=None``: torch's output-first layout, every dim but the first (a tensor with at most one
    dim longer than 1 is one unit); else ``axis`` itself (an int or a sequence, negative counting from
    the end), as optax's ``axis``. A dim out of range is a ``ValueError``.
    """
    ndim = len(shape)
    if axis is None:
        return None if sum(1 for s in shape if s != 1) <= 1 else tuple(range(1, ndim))
    dims = (axis,) if isinstance(axis, int) else tuple(axis)
    for d in dims:
        if not -ndim <= d < ndim:
            raise ValueError(f"{what}: axis {d} is out of range for a tensor of shape {tuple(shape)}")
    return tuple(sorted({d % ndim for d in dims}))


def unitwise_norm(x: Tensor, axis: Union[None, int, Sequence[int]] = None) -> Tensor:
    """The L2 norm of each unit of ``x``, broadcastable against ``x``, in float32 or wider (real for a
    complex ``x``: the norm of the moduli).

    By default a unit is a slice along dim 0: torch stores weights output-first (``Linear``:
    ``(out, in)``, ``Conv2d``: ``(out, in, kh, kw)``), so the norm reduces over every other dim, and
    scalars and vectors (after squeezing) are one unit; this is optax's default in torch's layout.
    ``axis`` (an int or a tuple) names the dims to reduce over instead, as optax's ``axis``.
    """
    dims = unit_dims(tuple(x.shape), axis)
    if dims is None:
        return torch.linalg.vector_norm(x, 2, dtype=norm_dtype(x.dtype))
    return torch.linalg.vector_norm(x, 2, dim=dims, keepdim=True, dtype=norm_dtype(x.dtype))


def torch_groups(tensors: Sequence[Tensor]) -> list[list[int]]:
    """The indices of each (device, dtype) group of ``tensors``, in ``clip_grad_norm_``'s order:
    found once, they serve both :func:`total_norm` and :func:`scale_`."""
    return _torch_group_order(tensors)


def _torch_group_order(tensors: Sequence[Tensor]) -> list[list[int]]:
    """The indices of each (device, dtype) group, groups in the order ``clip_grad_norm_`` visits them.

    Torch's grouping (a hash map in C++) does not keep first appearance; the order of the groups is
    the order of the terms of the final norm, so following it keeps mixed-dtype norms bit-exact.
    """
    if torch.compiler.is_compiling() or uses_functorch(tensors):
        return [indices for indices, _ in grouped(tensors)]
    return torch_internals.clip_grad_norm_groups(tensors)


def total_norm(
    tensors: Sequence[Tensor], ord: float, *, groups: Optional[list[list[int]]] = None, norms: Optional[Sequence[Tensor]] = None
) -> Tensor:
    """The ``ord``-norm of all ``tensors`` seen as one vector, as ``torch.nn.utils.clip_grad_norm_`` computes it.

    Accumulates in float32 (float64 if any input is float64) so half-precision gradients neither
    overflow nor lose their sum. Returns a 0-d tensor on the first tensor's device. The per-tensor
    norms are stacked group by group, in torch's order, and only moved or cast when a group needs it.
    ``groups``, when given, are those of :func:`torch_groups` for ``tensors``, already found;
    ``norms``, the per-tensor ``ord``-norms when already taken (as :func:`local_norms` takes them):
    the same number without reading the tensors again.
    """
    if not tensors:
        return torch.zeros((), dtype=torch.float32)
    device = tensors[0].device
    group_norms = []
    for indices in groups if groups is not None else _torch_group_order(tensors):
        if norms is not None:
            group_norms.append([norms[i] for i in indices])
            continue
        group = list(tensors) if len(indices) == len(tensors) else [tensors[i] for i in indices]
        group_norms.append(foreach_norm(group, ord, accumulation_dtype([group[0].dtype])))
    dtype = accumulation_dtype([norms[0].dtype for norms in group_norms])
    stacked: list[Tensor] = []
    for norms in group_norms:
        if norms[0].device != device or norms[0].dtype != dtype:
            norms = [n.to(device, dtype) for n in norms]
        stacked.extend(norms)
    return torch.linalg.vector_norm(torch.stack(stacked), ord)


def scale_(
    tensors: Sequence[Tensor], factor: Tensor, *, inplace: bool, groups: Optional[list[list[int]]] = None
) -> list[Tensor]:
    """Multiplies every tensor by the 0-d ``factor`` (moved to each group's device), keeping dtypes.

    ``groups``: the (device, dtype) groups of ``tensors`` as index lists, when already found."""
    if groups is None:
        found: Any = grouped(tensors)
    elif len(groups) == 1:  # one group holds every tensor, in order
        factor = factor.to(tensors[0].device)
        results = foreach("mul", tensors, factor, inplace=inplace)
        return results if inplace or factor.dtype == tensors[0].dtype else _keep_dtypes(tensors, results)
    else:
        found = ((indices, ([tensors[i] for i in indices],)) for indices in groups)
    out: list[Optional[Tensor]] = [None] * len(tensors)
    for indices, (group,) in found:
        device_factor = factor.to(group[0].device)
        results = foreach("mul", group, device_factor, inplace=inplace)
        if not inplace and device_factor.dtype != group[0].dtype:  # a group is of one dtype: check once
            results = _keep_dtypes(group, results)
        for i, value in zip(indices, results):
            out[i] = value
    return out  # type: ignore[return-value]


def replace_present(tree_leaves: Sequence[Any], present: Sequence[int], values: Sequence[Any]) -> list[Any]:
    """A copy of ``tree_leaves`` with ``values`` placed at the ``present`` indices."""
    if len(present) == len(tree_leaves):  # every leaf present: ``present`` is 0, 1, 2, ...
        return list(values)
    out = list(tree_leaves)
    for i, value in zip(present, values):
        out[i] = value
    return out


def all_finite(tree: PyTree, *, device: Optional[torch.device] = None) -> Tensor:
    """A 0-d bool tensor: whether every element of every tensor leaf is finite.

    One ``aminmax`` pass per leaf: a NaN propagates into both extremes and an infinity shows in
    one, so the test is exact (a sum or a 2-norm would overflow on large finite values). It is also
    much faster on CPU than an ``inf``-norm.
    """
    tensors = [leaf for leaf in leaves(tree) if isinstance(leaf, Tensor) and leaf.numel() > 0]
    if not tensors:
        return torch.ones((), dtype=torch.bool, device=device or first_device(tree))
    target = device or tensors[0].device
    dtype = accumulation_dtype([t.dtype for t in tensors])  # float64 extremes must not overflow
    extremes = []
    for t in tensors:
        t = stored_values(t)
        low, high = torch.aminmax(torch.view_as_real(t) if t.is_complex() else t)
        extremes.append(torch.stack([low, high]).to(device=target, dtype=dtype))
    return torch.isfinite(torch.cat(extremes)).all()
