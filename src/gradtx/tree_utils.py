"""Arithmetic, reductions, casting, random trees and state lookup on pytrees of tensors.

The names and argument names are those of ``optax.tree_utils`` (optax 0.2.8); the numbers are
those of optax's definitions, computed with torch.

Conventions:

* Trees are anything the pytree backend knows (dict, list, tuple, NamedTuple, registered
  dataclasses). A ``None`` leaf means "no gradient": it stays ``None`` in a result tree and is
  skipped by every reduction.
* Functions of several trees take trees of the same structure. A tree that differs from the first,
  or has ``None`` where the first has a tensor, is a ``ValueError`` naming the leaf's path
  (``None`` in the first tree gives ``None`` whatever the others hold there, as optax's
  ``tree_add_scale`` does). A leaf that is neither a tensor nor ``None`` in the first tree is a
  ``TypeError`` naming its path. Leaves of the other trees may also be Python numbers.
* Reductions (:func:`tree_sum`, :func:`tree_vdot`, :func:`tree_norm`, :func:`tree_max`,
  :func:`tree_min`, :func:`tree_allclose`) return 0-d tensors on the first leaf's device.
  Sums, inner products and norms accumulate in float32 at least: half-precision leaves are
  reduced, and the result returned, in float32 (float64 when a leaf is float64).
* Elementwise arithmetic runs as ``torch._foreach_*`` kernels, one call per (device, dtype) group;
  under ``torch.func`` transforms (``vmap``, ``grad``), which have no batching rule for them, and
  where autograd records a graph, the same functions run one ordinary op per tensor, so every
  result is differentiable (with respect to tensor scalars such as ``decay`` too).

Randomness: optax threads an immutable JAX key; here the key is a ``torch.Generator`` (or an
integer seed, which makes a fresh CPU generator). :func:`tree_split_key_like` draws one seed per
leaf from it and returns a tree of new generators, each on its leaf's device;
:func:`tree_random_like` samples every leaf from such a generator. As with any torch sampler, the
generator passed in advances: the same generator gives new numbers on the next call, and the same
seed gives the same numbers. :func:`tree_unwrap_random_key_data` replaces ``torch.Generator``
leaves by their state (``Generator.get_state()``, a uint8 tensor), the form gradtx keeps in
optimizer states, so trees holding generators can be compared.

Paths (:func:`tree_get_all_with_path`, :func:`tree_get`, :func:`tree_set`): a path is a tuple
of the keys met on the way down: a dict key, a sequence index, a :class:`NamedTupleKey`
(``tuple_name``, ``name``) for a NamedTuple field, the field name for other registered nodes.
``gradtx.tree.join_path(path)`` makes it a dotted string.

optax 0.2.8's deprecated aliases are kept, without a warning: ``tree_scalar_mul`` (use
:func:`tree_scale`), ``tree_add_scalar_mul`` (:func:`tree_add_scale`), ``tree_l1_norm``,
``tree_l2_norm`` and ``tree_linf_norm`` (:func:`tree_norm` with ``ord`` 1, 2, ``inf``).

Differences from optax, each for a reason in torch:

* ``tree_sum``'s ``associative_reduction`` selects the order of the final sum over leaves: in leaf
  order (``False``, optax's default) or as one stacked ``torch.sum`` (``True``); JAX uses it to
  shorten compilation, which torch does not need.
* ``tree_dtype``'s ``'promote'``, ``'highest'`` and ``'lowest'`` follow ``torch.promote_types``
  (torch's promotion lattice, e.g. ``int32`` with ``uint8`` is ``int32``), not JAX's.
* ``tree_batch_shape`` returns materialised tensors, not broadcast views, so that a state built
  from it can be updated in place.
* ``tree_allclose`` returns a 0-d bool tensor (``bool(...)`` of it is the answer) so that it runs
  under ``vmap`` and on accelerators without a host synchronisation.

Every public name of ``optax.tree_utils`` 0.2.8 has a counterpart here; none is omitted.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, Callable, Optional, Sequence, Union

import optree
import torch
from torch import Tensor

from gradtx import tree as tree_lib

__all__ = [
    "NamedTupleKey",
    "tree_add",
    "tree_add_scalar_mul",
    "tree_add_scale",
    "tree_allclose",
    "tree_batch_shape",
    "tree_bias_correction",
    "tree_cast",
    "tree_cast_like",
    "tree_clip",
    "tree_conj",
    "tree_div",
    "tree_dtype",
    "tree_full_like",
    "tree_get",
    "tree_get_all_with_path",
    "tree_l1_norm",
    "tree_l2_norm",
    "tree_linf_norm",
    "tree_map_params",
    "tree_max",
    "tree_min",
    "tree_mul",
    "tree_norm",
    "tree_ones_like",
    "tree_random_like",
    "tree_real",
    "tree_scalar_mul",
    "tree_scale",
    "tree_set",
    "tree_size",
    "tree_split_key_like",
    "tree_sub",
    "tree_sum",
    "tree_unwrap_random_key_data",
    "tree_update_infinity_moment",
    "tree_update_moment",
    "tree_update_moment_per_elem_norm",
    "tree_vdot",
    "tree_where",
    "tree_zeros_like",
]

PyTree = Any
Scalar = Union[Tensor, float, int, bool]


# --------------------------------------------------------------------------- operands


def _tensor_leaves(fn: str, tree: PyTree, name: str = "tree") -> tuple[list[Any], Any, list[int]]:
    """Flattens ``tree`` (tensor or ``None`` leaves) and returns the indices of its tensors."""
    return tree_lib.tensor_leaves(tree, what=f"{fn}: {name}")


def _present_tensors(fn: str, tree: PyTree, name: str = "tree") -> list[Tensor]:
    tree_leaves, _, present = _tensor_leaves(fn, tree, name)
    return [tree_leaves[i] for i in present]


def _operands(
    fn: str, first: tuple[str, PyTree], *others: tuple[str, PyTree]
) -> tuple[list[Any], Any, list[int], list[list[Any]]]:
    """Flattens ``first`` and ``others`` (same structure), checks them, and lines up their leaves.

    Returns the first tree's leaves, its structure, the indices of its tensor leaves, and for each
    other tree its leaves at those indices.
    """
    first_name, first_tree = first
    tree_leaves, treedef, present = _tensor_leaves(fn, first_tree, first_name)
    columns = []
    for name, other in others:
        other_leaves, other_def = tree_lib.flatten(other)
        if other_def != treedef:
            raise tree_lib.mismatch_error(other, first_tree, what=f"{fn}: {name}", like=first_name)
        column = []
        for i in present:
            leaf = other_leaves[i]
            if leaf is None:
                raise ValueError(f"{fn}: leaf {tree_lib.path_at(first_tree, i)!r} is None in {name} but not in {first_name}")
            if not isinstance(leaf, (Tensor, numbers.Number)):
                raise TypeError(
                    f"{fn}: leaf {tree_lib.path_at(first_tree, i)!r} of {name} is a {type(leaf).__name__}, "
                    "expected a torch.Tensor, a number or None"
                )
            column.append(leaf)
        columns.append(column)
    return tree_leaves, treedef, present, columns


def _rebuild(tree_leaves: list[Any], treedef: Any, present: Sequence[int], values: Sequence[Any]) -> PyTree:
    return tree_lib.unflatten(treedef, tree_lib.replace_present(tree_leaves, present, values))


def _as_scalar(value: Any) -> Scalar:
    """A number or tensor as is; anything else (a numpy scalar, say) as a tensor."""
    if isinstance(value, (Tensor, bool, int, float, complex)):
        return value
    return torch.as_tensor(value)


def _elementwise(name: str, selves: Sequence[Tensor], *args: Any, dtype_kept: bool = False) -> list[Tensor]:
    """``torch.<name>(self, *args)`` for every tensor of ``selves``.

    List arguments hold one entry per tensor (tensors or numbers); other arguments are numbers or
    0-d tensors (moved to each group's device). Tensors are grouped by the (device, dtype) of every
    tensor operand and each group is one foreach call (one op per tensor under ``torch.func``, where
    autograd records a graph, or where a list holds numbers). ``dtype_kept`` casts results back to
    the dtype of ``selves``.
    """
    selves = list(selves)
    if not selves:
        return []
    lists = [a for a in args if isinstance(a, list)]
    groups: dict[tuple, list[int]] = {}
    for i, t in enumerate(selves):
        key = (t.device, t.dtype) + tuple(
            (a[i].device, a[i].dtype) if isinstance(a[i], Tensor) else type(a[i]) for a in lists
        )
        groups.setdefault(key, []).append(i)
    out: list[Optional[Tensor]] = [None] * len(selves)
    for indices in groups.values():
        device = selves[indices[0]].device
        group = [selves[i] for i in indices]
        group_args = [
            [a[i] for i in indices] if isinstance(a, list) else (a.to(device) if isinstance(a, Tensor) else a)
            for a in args
        ]
        if all(isinstance(a[0], Tensor) for a in group_args if isinstance(a, list)) and not _records_graph(
            group, group_args
        ):
            results = tree_lib.foreach(name, group, *group_args, inplace=False)
        else:
            columns = [a if isinstance(a, list) else [a] * len(group) for a in group_args]
            results = [getattr(torch, name)(s, *xs) for s, *xs in zip(group, *columns)]
        for i, result in zip(indices, results):
            out[i] = result.to(selves[i].dtype) if dtype_kept and result.dtype != selves[i].dtype else result
    return out  # type: ignore[return-value]


def _records_graph(tensors: Sequence[Tensor], args: Sequence[Any]) -> bool:
    """Whether autograd records these operands (foreach kernels then give way to one op per tensor:
    their derivatives do not cover every overload, a 0-d tensor factor's for one)."""
    if not torch.is_grad_enabled():
        return False
    operands = list(tensors) + [x for a in args for x in (a if isinstance(a, list) else [a])]
    return any(isinstance(x, Tensor) and x.requires_grad for x in operands)


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a sum of ``dtype`` values is taken in: float32 at least for floats, int64 for ints."""
    if dtype.is_complex:
        return torch.complex64 if dtype == torch.complex32 else dtype
    if dtype.is_floating_point:
        return dtype if torch.finfo(dtype).bits >= 32 else torch.float32
    return torch.int64


def _combine(values: Sequence[Tensor], op: Callable[[Tensor, Tensor], Tensor]) -> Tensor:
    """Folds 0-d ``values`` with ``op`` in order, in their common dtype, on the first one's device."""
    dtype = values[0].dtype
    for v in values[1:]:
        dtype = torch.promote_types(dtype, v.dtype)
    device = values[0].device
    result = values[0].to(device=device, dtype=dtype)
    for v in values[1:]:
        result = op(result, v.to(device=device, dtype=dtype))
    return result


def _first_device(tree_leaves: Sequence[Any]) -> torch.device:
    for leaf in tree_leaves:
        if isinstance(leaf, Tensor):
            return leaf.device
    return torch.device("cpu")


# --------------------------------------------------------------------------- arithmetic


def tree_add(tree_x: PyTree, tree_y: PyTree, *other_trees: PyTree) -> PyTree:
    """The leafwise sum ``tree_x + tree_y (+ other_trees...)``.

    Args:
      tree_x: first tree.
      tree_y: second tree, with the structure of ``tree_x``.
      *other_trees: further trees to add, with the same structure.

    Returns:
      a tree with the structure of ``tree_x``.
    """
    named = [("tree_y", tree_y)] + [(f"other_trees[{k}]", t) for k, t in enumerate(other_trees)]
    tree_leaves, treedef, present, columns = _operands("tree_add", ("tree_x", tree_x), *named)
    values = [tree_leaves[i] for i in present]
    for column in columns:
        values = _elementwise("add", values, column)
    return _rebuild(tree_leaves, treedef, present, values)


def _binary(fn: str, name: str, tree_x: PyTree, tree_y: PyTree) -> PyTree:
    tree_leaves, treedef, present, (column,) = _operands(fn, ("tree_x", tree_x), ("tree_y", tree_y))
    values = _elementwise(name, [tree_leaves[i] for i in present], column)
    return _rebuild(tree_leaves, treedef, present, values)


def tree_sub(tree_x: PyTree, tree_y: PyTree) -> PyTree:
    """The leafwise difference ``tree_x - tree_y`` of two trees of the same structure."""
    return _binary("tree_sub", "sub", tree_x, tree_y)


def tree_mul(tree_x: PyTree, tree_y: PyTree) -> PyTree:
    """The leafwise product ``tree_x * tree_y`` of two trees of the same structure."""
    return _binary("tree_mul", "mul", tree_x, tree_y)


def tree_div(tree_x: PyTree, tree_y: PyTree) -> PyTree:
    """The leafwise true quotient ``tree_x / tree_y`` of two trees of the same structure."""
    return _binary("tree_div", "div", tree_x, tree_y)


def tree_scale(scalar: Scalar, tree: PyTree) -> PyTree:
    """``scalar * tree``: every leaf times one number or 0-d tensor; leaves keep their dtype.

    Args:
      scalar: a number or a 0-d tensor (on any device; differentiable).
      tree: the tree to scale.

    Returns:
      a tree with the structure of ``tree``.
    """
    tree_leaves, treedef, present = _tensor_leaves("tree_scale", tree)
    values = _elementwise("mul", [tree_leaves[i] for i in present], _as_scalar(scalar), dtype_kept=True)
    return _rebuild(tree_leaves, treedef, present, values)


def tree_add_scale(tree_x: PyTree, scalar: Scalar, tree_y: PyTree) -> PyTree:
    """``tree_x + scalar * tree_y`` leafwise (``None`` where ``tree_x`` is ``None``).

    ``scalar * tree_y`` keeps ``tree_y``'s dtypes (as :func:`tree_scale`), then adds as torch does.

    Args:
      tree_x: first tree.
      scalar: a number or a 0-d tensor.
      tree_y: second tree, with the structure of ``tree_x``.

    Returns:
      a tree with the structure of ``tree_x``.
    """
    tree_leaves, treedef, present, (column,) = _operands("tree_add_scale", ("tree_x", tree_x), ("tree_y", tree_y))
    scalar = _as_scalar(scalar)
    if all(isinstance(y, Tensor) for y in column):
        scaled = _elementwise("mul", column, scalar, dtype_kept=True)
    else:
        scaled = [scalar * y for y in column]
    values = _elementwise("add", [tree_leaves[i] for i in present], scaled)
    return _rebuild(tree_leaves, treedef, present, values)


def tree_scalar_mul(scalar: Scalar, tree: PyTree) -> PyTree:
    """Alias of :func:`tree_scale` (optax's deprecated name)."""
    return tree_scale(scalar, tree)


def tree_add_scalar_mul(tree_x: PyTree, scalar: Scalar, tree_y: PyTree) -> PyTree:
    """Alias of :func:`tree_add_scale` (optax's deprecated name)."""
    return tree_add_scale(tree_x, scalar, tree_y)


def tree_conj(tree: PyTree) -> PyTree:
    """The complex conjugate of every leaf (real leaves are returned as they are)."""
    return tree_lib.tree_map(lambda x: x.conj().resolve_conj() if x.is_complex() else x, tree)


def tree_real(tree: PyTree) -> PyTree:
    """The real part of every leaf (real leaves are returned as they are)."""
    return tree_lib.tree_map(lambda x: x.real if x.is_complex() else x, tree)


def tree_clip(tree: PyTree, min_value: Optional[Scalar] = None, max_value: Optional[Scalar] = None) -> PyTree:
    """Every leaf clipped to ``[min_value, max_value]`` (``None``: no bound on that side).

    As ``jnp.clip``: ``min(max(x, min_value), max_value)``, so ``max_value`` wins when the bounds cross.

    Args:
      tree: the tree to clip.
      min_value: the lower bound, a number or a tensor broadcastable to every leaf, or ``None``.
      max_value: the upper bound, likewise.

    Returns:
      a tree with the structure of ``tree``.
    """
    tree_leaves, treedef, present = _tensor_leaves("tree_clip", tree)
    values = [tree_leaves[i] for i in present]
    if min_value is not None:
        values = _clamp_side("clamp_min", values, _as_scalar(min_value))
    if max_value is not None:
        values = _clamp_side("clamp_max", values, _as_scalar(max_value))
    return _rebuild(tree_leaves, treedef, present, values)


def _clamp_side(name: str, values: list[Tensor], bound: Scalar) -> list[Tensor]:
    if isinstance(bound, Tensor) and bound.ndim > 0:
        # foreach takes one scalar per call; a tensor bound broadcasts against each leaf
        return [getattr(torch, name)(v, bound.to(v.device)) for v in values]
    return _elementwise(name, values, bound)


def tree_where(condition: Union[bool, Tensor], tree_x: PyTree, tree_y: PyTree) -> PyTree:
    """``tree_x`` where ``condition`` holds, else ``tree_y``, leafwise (``torch.where``).

    Args:
      condition: a bool or a bool tensor broadcastable to every leaf (a 0-d flag, typically).
      tree_x: the tree taken where ``condition`` is true.
      tree_y: the tree taken where it is false, with the structure of ``tree_x``.

    Returns:
      a tree with the structure of ``tree_x``.
    """
    tree_leaves, treedef, present, (column,) = _operands("tree_where", ("tree_x", tree_x), ("tree_y", tree_y))
    values = []
    for i, y in zip(present, column):
        x = tree_leaves[i]
        if isinstance(condition, Tensor):
            cond = condition.to(x.device)
        else:
            cond = torch.tensor(bool(condition), device=x.device)
        values.append(torch.where(cond, x, y))
    return _rebuild(tree_leaves, treedef, present, values)


# --------------------------------------------------------------------------- reductions


def tree_sum(tree: PyTree, associative_reduction: bool = False) -> Tensor:
    """The sum of every element of every leaf, as a 0-d tensor.

    Each leaf is summed in float32 at least (int64 for integer and bool leaves, as ``torch.sum``);
    the leaves' sums are added in their common dtype. An empty tree sums to ``0.``.

    Args:
      tree: the tree to sum.
      associative_reduction: ``False`` adds the leaves' sums one after the other in leaf order (as
        optax); ``True`` stacks them and takes one ``torch.sum`` (another rounding order).

    Returns:
      a 0-d tensor on the first leaf's device.
    """
    tensors = _present_tensors("tree_sum", tree)
    if not tensors:
        return torch.zeros(())
    sums = [t.sum(dtype=_accumulation_dtype(t.dtype)) for t in tensors]
    if associative_reduction:
        dtype = sums[0].dtype
        for s in sums[1:]:
            dtype = torch.promote_types(dtype, s.dtype)
        return torch.stack([s.to(device=sums[0].device, dtype=dtype) for s in sums]).sum()
    return _combine(sums, torch.add)


def _lexicographic(larger: bool) -> Callable[[Tensor, Tensor], Tensor]:
    """``maximum`` (or ``minimum``) of two tensors, ordering complex numbers as NumPy and JAX do:
    by real part, then imaginary part. Real tensors use torch's own."""

    def op(a: Tensor, b: Tensor) -> Tensor:
        if not (a.is_complex() or b.is_complex()):
            return torch.maximum(a, b) if larger else torch.minimum(a, b)
        first = (a.real > b.real) | ((a.real == b.real) & (a.imag > b.imag))
        if not larger:
            first = (a.real < b.real) | ((a.real == b.real) & (a.imag < b.imag))
        return torch.where(first, a, b)

    return op


def _lexicographic_extreme(t: Tensor, larger: bool) -> Tensor:
    """The largest (or smallest) element of a complex tensor in NumPy's order, as a 0-d tensor."""
    flat = t.reshape(-1)
    real = flat.real
    best = real.amax() if larger else real.amin()
    imag = torch.where(real == best, flat.imag, torch.full_like(real, -math.inf if larger else math.inf))
    return torch.complex(best, imag.amax() if larger else imag.amin())


def _extreme(fn: str, tree: PyTree, larger: bool) -> Tensor:
    tensors = [t for t in _present_tensors(fn, tree) if t.numel() > 0]
    if not tensors:
        return torch.tensor(-math.inf if larger else math.inf)
    reduce = torch.amax if larger else torch.amin
    return _combine(
        [_lexicographic_extreme(t, larger) if t.is_complex() else reduce(t) for t in tensors], _lexicographic(larger)
    )


def tree_max(tree: PyTree) -> Tensor:
    """The largest element of the tree (``-inf`` for a tree with no element), as a 0-d tensor.

    Empty leaves are skipped; the result has the leaves' common dtype. Complex numbers are ordered
    by real part, then imaginary part (NumPy's and JAX's order).
    """
    return _extreme("tree_max", tree, larger=True)


def tree_min(tree: PyTree) -> Tensor:
    """The smallest element of the tree (``inf`` for a tree with no element), as a 0-d tensor.

    Empty leaves are skipped; the result has the leaves' common dtype. Complex numbers are ordered
    by real part, then imaginary part (NumPy's and JAX's order).
    """
    return _extreme("tree_min", tree, larger=False)


def tree_size(tree: PyTree) -> int:
    """The number of elements in the tree's leaves (a number counts one, ``None`` none)."""
    total = 0
    for leaf in tree_lib.leaves(tree):
        if isinstance(leaf, Tensor):
            total += leaf.numel()
        elif leaf is not None:
            total += torch.as_tensor(leaf).numel()
    return total


def _vdot_dtype(x: Tensor, y: Tensor) -> torch.dtype:
    dtype = torch.promote_types(x.dtype, y.dtype)
    return torch.int64 if dtype == torch.bool else _accumulation_dtype(dtype)


def tree_vdot(tree_x: PyTree, tree_y: PyTree) -> Tensor:
    """The inner product ``<tree_x, tree_y>``: the sum over leaves of ``vdot(x, y)``.

    ``tree_x`` is conjugated when complex (``numpy.vdot``'s convention). Each leaf's products are
    accumulated in float32 at least (float64 if either leaf is float64).

    Args:
      tree_x: first tree.
      tree_y: second tree, with the structure and shapes of ``tree_x``.

    Returns:
      a 0-d tensor on the first leaf's device (``0.`` for an empty tree).
    """
    tree_leaves, _, present, (column,) = _operands("tree_vdot", ("tree_x", tree_x), ("tree_y", tree_y))
    if not present:
        return torch.zeros(())
    products = []
    for i, y in zip(present, column):
        x = tree_leaves[i]
        y = torch.as_tensor(y, device=x.device)
        if x.shape != y.shape:
            raise ValueError(
                f"tree_vdot: leaf {tree_lib.path_at(tree_x, i)!r} has shape {tuple(x.shape)} in tree_x "
                f"and {tuple(y.shape)} in tree_y"
            )
        dtype = _vdot_dtype(x, y)
        products.append(torch.vdot(x.reshape(-1).to(dtype), y.reshape(-1).to(device=x.device, dtype=dtype)))
    return _combine(products, torch.add)


_ORDS = {None: 2.0, 2: 2.0, 1: 1.0, math.inf: math.inf, "inf": math.inf, "infinity": math.inf}


def tree_norm(tree: PyTree, ord: Union[int, float, str, None] = None, squared: bool = False) -> Tensor:  # noqa: A002
    """The ``ord``-norm of the tree seen as one vector, as a 0-d tensor.

    Accumulated in float32 at least (float64 if a leaf is float64) on the first leaf's device;
    complex leaves count with their modulus. An empty tree has norm ``0.``.

    Args:
      tree: the tree.
      ord: ``None`` or ``2`` (Euclidean), ``1``, or ``inf`` (also ``'inf'``, ``'infinity'``).
      squared: return the norm squared.

    Returns:
      a 0-d real tensor.
    """
    try:
        p = _ORDS[ord]
    except (KeyError, TypeError):
        raise ValueError(f"tree_norm: unsupported ord {ord!r}; use None, 1, 2 or inf") from None
    tensors = []
    for t in _present_tensors("tree_norm", tree):
        if t.numel() == 0:
            continue
        if t.is_complex():
            t = t.abs()
        elif not t.is_floating_point():
            t = t.to(torch.float32)
        tensors.append(t)
    norm = tree_lib.total_norm(tensors, p)
    return norm * norm if squared else norm


def tree_l1_norm(tree: PyTree, squared: bool = False) -> Tensor:
    """``tree_norm(tree, ord=1, squared=squared)`` (optax's deprecated name)."""
    return tree_norm(tree, ord=1, squared=squared)


def tree_l2_norm(tree: PyTree, squared: bool = False) -> Tensor:
    """``tree_norm(tree, ord=2, squared=squared)`` (optax's deprecated name)."""
    return tree_norm(tree, ord=2, squared=squared)


def tree_linf_norm(tree: PyTree, squared: bool = False) -> Tensor:
    """``tree_norm(tree, ord=inf, squared=squared)`` (optax's deprecated name)."""
    return tree_norm(tree, ord=math.inf, squared=squared)


def tree_allclose(
    a: PyTree, b: PyTree, rtol: float = 1e-05, atol: float = 1e-08, equal_nan: bool = False
) -> Tensor:
    """Whether every leaf of ``a`` is close to the matching leaf of ``b``: ``|a - b| <= atol + rtol * |b|``.

    Leaves are compared in their promoted dtype and must broadcast against each other.

    Args:
      a: a tree.
      b: a tree with the structure of ``a``.
      rtol: relative tolerance.
      atol: absolute tolerance.
      equal_nan: whether NaNs in the same place count as equal.

    Returns:
      a 0-d bool tensor (``True`` for an empty tree).
    """
    tree_leaves, _, present, (column,) = _operands("tree_allclose", ("a", a), ("b", b))
    result = torch.ones((), dtype=torch.bool, device=_first_device(tree_leaves))
    for i, y in zip(present, column):
        x = tree_leaves[i]
        y = torch.as_tensor(y, device=x.device)
        dtype = torch.promote_types(x.dtype, y.dtype)
        close = torch.isclose(x.to(dtype), y.to(dtype), rtol=rtol, atol=atol, equal_nan=equal_nan).all()
        result = result & close.to(result.device)
    return result


# --------------------------------------------------------------------------- constructors and casts


def tree_zeros_like(tree: PyTree, dtype: Optional[torch.dtype] = None) -> PyTree:
    """A tree of zeros shaped like ``tree`` (its dtypes, or ``dtype``)."""
    return tree_lib.tree_map(lambda x: torch.zeros_like(x, dtype=dtype), tree)


def tree_ones_like(tree: PyTree, dtype: Optional[torch.dtype] = None) -> PyTree:
    """A tree of ones shaped like ``tree`` (its dtypes, or ``dtype``)."""
    return tree_lib.tree_map(lambda x: torch.ones_like(x, dtype=dtype), tree)


def tree_full_like(tree: PyTree, fill_value: Scalar, dtype: Optional[torch.dtype] = None) -> PyTree:
    """A tree shaped like ``tree`` filled with ``fill_value`` (its dtypes, or ``dtype``).

    Args:
      tree: the tree whose shapes, devices and dtypes to take.
      fill_value: a number, or a tensor broadcastable to every leaf (differentiable).
      dtype: the dtype of the result's leaves, if not theirs.

    Returns:
      a tree with the structure of ``tree``.
    """
    if isinstance(fill_value, Tensor):
        return tree_lib.tree_map(lambda x: torch.empty_like(x, dtype=dtype).copy_(fill_value), tree)
    return tree_lib.tree_map(lambda x: torch.full_like(x, fill_value, dtype=dtype), tree)


def tree_batch_shape(tree: PyTree, shape: tuple[int, ...] = ()) -> PyTree:
    """Every leaf repeated along new leading dimensions ``shape`` (a new tensor, not a view).

    Args:
      tree: the tree.
      shape: the leading batch dimensions to add.

    Returns:
      a tree whose leaves have shape ``(*shape, *leaf.shape)``.
    """
    shape = tuple(shape)
    return tree_lib.tree_map(lambda x: x.expand(*shape, *x.shape).clone(), tree)


def tree_cast(tree: PyTree, dtype: Optional[torch.dtype]) -> PyTree:
    """Every leaf cast to ``dtype``; ``dtype=None`` returns ``tree`` itself."""
    if dtype is None:
        return tree
    return tree_lib.tree_map(lambda x: x.to(dtype), tree)


def tree_cast_like(tree: PyTree, other_tree: PyTree) -> PyTree:
    """Every leaf of ``tree`` cast to the dtype of the matching leaf of ``other_tree``.

    A number in ``other_tree`` (no dtype) leaves its match as it is.
    """
    tree_leaves, treedef, present, (column,) = _operands("tree_cast_like", ("tree", tree), ("other_tree", other_tree))
    values = [
        tree_leaves[i].to(o.dtype) if isinstance(o, Tensor) else tree_leaves[i] for i, o in zip(present, column)
    ]
    return _rebuild(tree_leaves, treedef, present, values)


def tree_dtype(tree: PyTree, mixed_dtype_handler: Optional[str] = None) -> torch.dtype:
    """The dtype of the tree's leaves (``None`` leaves skipped; numbers count with torch's dtype for them).

    Args:
      tree: the tree.
      mixed_dtype_handler: what to do when leaves differ: ``None`` raises a ``ValueError`` naming
        each leaf of another dtype than the first; ``'promote'`` returns their
        ``torch.promote_types``; ``'highest'`` / ``'lowest'`` return the one every other promotes
        to / the one that promotes to every other, and raise a ``ValueError`` when two of them
        promote to a third.

    Returns:
      a ``torch.dtype`` (``torch.get_default_dtype()`` for an empty tree).
    """
    tree_leaves = tree_lib.leaves(tree)
    indexed = [(i, leaf.dtype if isinstance(leaf, Tensor) else torch.as_tensor(leaf).dtype)
               for i, leaf in enumerate(tree_leaves) if leaf is not None]
    if not indexed:
        return torch.get_default_dtype()
    dtypes = [d for _, d in indexed]
    if mixed_dtype_handler is None:
        first = dtypes[0]
        errors = [f"expected dtype {first} for {tree_lib.path_at(tree, i)!r} but got {d}" for i, d in indexed if d != first]
        if errors:
            raise ValueError("tree_dtype: " + "; ".join(errors))
        return first
    if mixed_dtype_handler == "promote":
        result = dtypes[0]
        for d in dtypes[1:]:
            result = torch.promote_types(result, d)
        return result
    if mixed_dtype_handler in ("highest", "lowest"):
        result = dtypes[0]
        for d in dtypes[1:]:
            promoted = torch.promote_types(result, d)
            if promoted not in (result, d):
                raise ValueError(
                    f"tree_dtype: cannot compare {result} and {d}: neither promotes to the other (both go to {promoted})"
                )
            higher = promoted
            lower = d if higher == result else result
            result = higher if mixed_dtype_handler == "highest" else lower
        return result
    raise ValueError(
        f"tree_dtype: invalid mixed_dtype_handler={mixed_dtype_handler!r}; use None, 'promote', 'highest' or 'lowest'"
    )


# --------------------------------------------------------------------------- moments


def _moment_operands(fn: str, updates: PyTree, moments: PyTree):
    return _operands(fn, ("updates", updates), ("moments", moments))


def tree_update_moment(updates: PyTree, moments: PyTree, decay: Scalar, order: Union[int, float]) -> PyTree:
    """The exponential moving average of the ``order``-th moment: ``(1 - decay) * g**order + decay * m``.

    ``None`` where ``updates`` is ``None``.
    """
    tree_leaves, treedef, present, (column,) = _moment_operands("tree_update_moment", updates, moments)
    grads = [tree_leaves[i] for i in present]
    powered = _power(grads, order)
    values = _ema(powered, column, _as_scalar(decay))
    return _rebuild(tree_leaves, treedef, present, values)


def _power(tensors: list[Tensor], order: Union[int, float]) -> list[Tensor]:
    if order == 1:
        return tensors
    if order == 2:
        return _elementwise("mul", tensors, tensors)
    return _elementwise("pow", tensors, order)


def _ema(new: list[Tensor], old: list[Any], decay: Scalar) -> list[Tensor]:
    """``(1 - decay) * new + decay * old``, in optax's order of operations."""
    weighted_new = _elementwise("mul", new, 1 - decay)
    if all(isinstance(m, Tensor) for m in old):
        weighted_old = _elementwise("mul", old, decay)
    else:
        weighted_old = [decay * m for m in old]
    return _elementwise("add", weighted_new, weighted_old)


def tree_update_infinity_moment(updates: PyTree, moments: PyTree, decay: Scalar, eps: Scalar) -> PyTree:
    """The exponential moving average of the infinity norm: ``max(|g| + eps, decay * m)``.

    ``None`` where ``updates`` is ``None``.
    """
    tree_leaves, treedef, present, (column,) = _moment_operands("tree_update_infinity_moment", updates, moments)
    grads = [tree_leaves[i] for i in present]
    shifted = _elementwise("add", _elementwise("abs", grads), _as_scalar(eps))
    decayed = _elementwise("mul", column, _as_scalar(decay)) if all(isinstance(m, Tensor) for m in column) else [
        torch.as_tensor(_as_scalar(decay) * m, device=g.device) for g, m in zip(grads, column)
    ]
    values = _elementwise("maximum", shifted, decayed)
    return _rebuild(tree_leaves, treedef, present, values)


def tree_update_moment_per_elem_norm(
    updates: PyTree, moments: PyTree, decay: Scalar, order: Union[int, float]
) -> PyTree:
    """The exponential moving average of the ``order``-th power of each element's modulus.

    ``(1 - decay) * |g|**order + decay * m`` for complex ``g`` (taken as ``(re² + im²)**(order / 2)``),
    ``(1 - decay) * g**order + decay * m`` for real ``g``. ``None`` where ``updates`` is ``None``.
    """
    tree_leaves, treedef, present, (column,) = _moment_operands("tree_update_moment_per_elem_norm", updates, moments)
    powered = []
    for i in present:
        g = tree_leaves[i]
        if g.is_complex():
            half = order / 2
            half = int(half) if float(half).is_integer() else half
            powered.append((g.real.square() + g.imag.square()) ** half)
        else:
            powered.append(g)
    real = [k for k, i in enumerate(present) if not tree_leaves[i].is_complex()]
    for k, value in zip(real, _power([powered[k] for k in real], order)):
        powered[k] = value
    values = _ema(powered, column, _as_scalar(decay))
    return _rebuild(tree_leaves, treedef, present, values)


def tree_bias_correction(moment: PyTree, decay: Scalar, count: Union[Tensor, int]) -> PyTree:
    """The bias-corrected moment ``m / (1 - decay**count)`` (a no-op as ``count`` grows).

    ``1 - decay**count`` is computed in float64 for a number ``decay``, in float32 at least for a
    tensor one (so that it cannot round to zero in low precision), then cast to each leaf's dtype
    before the division, as optax does.
    """
    if isinstance(decay, Tensor):
        decay_t = decay.to(torch.promote_types(decay.dtype, torch.float32))
    else:
        decay_t = torch.as_tensor(decay, dtype=torch.float64)
    count_t = torch.as_tensor(count, device=decay_t.device) if not isinstance(count, Tensor) else count
    correction = 1 - decay_t.to(count_t.device) ** count_t
    tree_leaves, treedef, present = _tensor_leaves("tree_bias_correction", moment, "moment")
    values: list[Any] = [None] * len(present)
    for indices, (group,) in tree_lib.grouped([tree_leaves[i] for i in present]):
        factor = correction.to(device=group[0].device, dtype=group[0].dtype)
        for k, value in zip(indices, _elementwise("div", group, factor)):
            values[k] = value
    return _rebuild(tree_leaves, treedef, present, values)


# --------------------------------------------------------------------------- randomness


def _as_generator(rng_key: Union[torch.Generator, int]) -> torch.Generator:
    if isinstance(rng_key, torch.Generator):
        return rng_key
    if isinstance(rng_key, numbers.Integral) or (isinstance(rng_key, Tensor) and rng_key.numel() == 1):
        return torch.Generator().manual_seed(int(rng_key))
    raise TypeError(f"rng_key must be a torch.Generator or an integer seed, got a {type(rng_key).__name__}")


_SEED_BOUND = 2**62


def tree_split_key_like(rng_key: Union[torch.Generator, int], target_tree: PyTree) -> PyTree:
    """One new ``torch.Generator`` per leaf of ``target_tree``, seeded from draws of ``rng_key``.

    Each generator lives on its leaf's device (CPU for a leaf that is not a tensor); ``None``
    leaves get ``None``. ``rng_key`` (a generator, which advances, or an integer seed) gives the
    seeds: one ``torch.randint`` of as many values as the tree has leaves.

    Args:
      rng_key: a ``torch.Generator`` or an integer seed.
      target_tree: the tree whose structure to match.

    Returns:
      a tree of generators with the structure of ``target_tree``.
    """
    generator = _as_generator(rng_key)
    tree_leaves, treedef = tree_lib.flatten(target_tree)
    seeds = torch.randint(0, _SEED_BOUND, (len(tree_leaves),), generator=generator, device=generator.device).tolist()
    keys = []
    for leaf, seed in zip(tree_leaves, seeds):
        if leaf is None:
            keys.append(None)
            continue
        device = leaf.device if isinstance(leaf, Tensor) else torch.device("cpu")
        keys.append(torch.Generator(device=device).manual_seed(seed))
    return tree_lib.unflatten(treedef, keys)


def tree_random_like(
    rng_key: Union[torch.Generator, int],
    target_tree: PyTree,
    sampler: Callable[..., Tensor] = torch.randn,
    dtype: Optional[torch.dtype] = None,
) -> PyTree:
    """A tree of random tensors shaped like ``target_tree``, each leaf from its own generator.

    Args:
      rng_key: a ``torch.Generator`` (it advances) or an integer seed; see
        :func:`tree_split_key_like`.
      target_tree: the tree whose structure, shapes and devices to match (tensor or ``None`` leaves).
      sampler: called as ``sampler(shape, generator=..., dtype=..., device=...)``: ``torch.randn``
        (optax's ``jax.random.normal``), ``torch.rand``, or ``functools.partial(torch.randint, low,
        high)``, for instance.
      dtype: the dtype passed to ``sampler``; by default each leaf's.

    Returns:
      a tree with the structure of ``target_tree``.
    """
    tree_leaves, treedef, present = _tensor_leaves("tree_random_like", target_tree, "target_tree")
    keys = tree_lib.leaves(tree_split_key_like(rng_key, target_tree))
    values = [
        sampler(tuple(tree_leaves[i].shape), generator=keys[i], dtype=dtype or tree_leaves[i].dtype,
                device=tree_leaves[i].device)
        for i in present
    ]
    return _rebuild(tree_leaves, treedef, present, values)


def tree_unwrap_random_key_data(input_tree: PyTree) -> PyTree:
    """Every ``torch.Generator`` leaf replaced by its state (``get_state()``, a uint8 tensor).

    Other leaves are returned as they are. Generators compare by identity; their states compare by
    value (with :func:`tree_allclose`, say), and are what gradtx keeps in optimizer states.
    """
    return tree_lib.tree_map(lambda x: x.get_state() if isinstance(x, torch.Generator) else x, input_tree)


# --------------------------------------------------------------------------- looking up states


@dataclasses.dataclass(frozen=True)
class NamedTupleKey:
    """A path entry for a NamedTuple field: the tuple's class name and the field's name.

    Paths given to the ``filtering`` functions of :func:`tree_get_all_with_path`, :func:`tree_get`
    and :func:`tree_set` hold one for each NamedTuple field they go through, so a filter can tell
    apart equal field names in different states (``ScaleByAdamState.count`` from
    ``ScaleByScheduleState.count``). ``str()`` of it is ``"tuple_name.name"``.
    """

    tuple_name: str
    name: str

    def __str__(self) -> str:
        return f"{self.tuple_name}.{self.name}"


KeyPath = tuple


def _is_named_tuple(node: Any) -> bool:
    return isinstance(node, tuple) and hasattr(type(node), "_fields")


def _children_with_entries(node: Any) -> Optional[tuple[list[Any], list[Any]]]:
    """A node's children and their path entries, or ``None`` for a leaf."""
    if node is None or optree.tree_is_leaf(node, none_is_leaf=True, namespace=tree_lib._NAMESPACE):
        return None
    if _is_named_tuple(node):
        name = type(node).__name__
        return list(node), [NamedTupleKey(name, field) for field in node._fields]
    output = optree.tree_flatten_one_level(node, none_is_leaf=True, namespace=tree_lib._NAMESPACE)
    return list(output.children), list(output.entries)


def _node_has_key(node: Any, key: Any) -> bool:
    if _is_named_tuple(node):
        return key in node._fields or type(node).__name__ == key
    return isinstance(node, dict) and key in node


def _nodes_with_path(node: Any, path: KeyPath, stop: Callable[[Any], bool]) -> list[tuple[KeyPath, Any]]:
    """The leaves of the tree with their paths, a node for which ``stop`` holds counting as a leaf."""
    found = None if stop(node) else _children_with_entries(node)
    if found is None:
        return [(path, node)]
    out = []
    for child, entry in zip(*found):
        out.extend(_nodes_with_path(child, (*path, entry), stop))
    return out


def _search(tree: Any, path: KeyPath, key: Any) -> list[tuple[KeyPath, Any]]:
    """optax's search order: the outermost matches in flattening order, then inside each of them."""
    has_key = lambda node: _node_has_key(node, key)  # noqa: E731
    matched = [(p, node) for p, node in _nodes_with_path(tree, path, has_key) if has_key(node)]
    found = []
    for p, node in matched:
        if _is_named_tuple(node) and type(node).__name__ == key:
            found.append((p, node))
        elif _is_named_tuple(node):
            found.append(((*p, NamedTupleKey(type(node).__name__, key)), getattr(node, key)))
        else:
            found.append(((*p, key), node[key]))
    for p, node in matched:
        for child, entry in zip(*_children_with_entries(node)):
            found.extend(_search(child, (*p, entry), key))
    return found


def tree_get_all_with_path(
    tree: PyTree, key: Any, filtering: Optional[Callable[[KeyPath, Any], bool]] = None
) -> list[tuple[KeyPath, Any]]:
    """Every value in ``tree`` under ``key``, with its path.

    ``key`` matches a dict key, a NamedTuple field, or a NamedTuple's class name (the value is then
    the NamedTuple itself). Matches are searched everywhere, including inside other matches, and
    listed in optax's order: the outermost matches in flattening order, then the matches inside each.

    Args:
      tree: the tree to search.
      key: the key, field or NamedTuple class name to find.
      filtering: an optional ``filtering(path, value) -> bool`` keeping only some matches.

    Returns:
      a list of ``(path, value)``; a path is a tuple of dict keys, sequence indices and
      :class:`NamedTupleKey` entries.
    """
    found = _search(tree, (), key)
    if filtering is not None:
        found = [(path, value) for path, value in found if filtering(path, value)]
    return found


def tree_get(
    tree: PyTree, key: Any, default: Optional[Any] = None, filtering: Optional[Callable[[KeyPath, Any], bool]] = None
) -> Any:
    """The one value in ``tree`` under ``key`` (see :func:`tree_get_all_with_path`), or ``default``.

    Raises:
      KeyError: if several values match (narrow them with ``filtering``).
    """
    found = tree_get_all_with_path(tree, key, filtering=filtering)
    if len(found) > 1:
        paths = ", ".join(repr(tree_lib.join_path(path)) for path, _ in found)
        raise KeyError(f"tree_get: found several values for {key!r}, at {paths}")
    return found[0][1] if found else default


def tree_set(tree: PyTree, filtering: Optional[Callable[[KeyPath, Any], bool]] = None, /, **kwargs: Any) -> PyTree:
    """A copy of ``tree`` with the values under each key of ``kwargs`` replaced.

    A key matches as in :func:`tree_get_all_with_path` (a dict key, a NamedTuple field, or a
    NamedTuple's class name, which replaces the whole NamedTuple); every match that ``filtering``
    keeps is replaced, and a replaced value is not searched further.

    Args:
      tree: the tree.
      filtering: an optional ``filtering(path, value) -> bool`` choosing which matches to replace.
      **kwargs: the new values, by key.

    Returns:
      a tree like ``tree``: the replaced values, and everything else as it was (containers with
      nothing replaced inside are ``tree``'s own).

    Raises:
      KeyError: if a key of ``kwargs`` matches nothing (that ``filtering`` keeps).
    """
    for key in kwargs:
        if not tree_get_all_with_path(tree, key, filtering):
            extra = " that the filtering keeps" if filtering is not None else ""
            raise KeyError(f"tree_set: found no value for {key!r}{extra}")

    def keep(path: KeyPath, value: Any) -> bool:
        return filtering is None or filtering(path, value)

    def rebuild(path: KeyPath, node: Any) -> Any:
        if _is_named_tuple(node) and type(node).__name__ in kwargs and keep(path, node):
            return kwargs[type(node).__name__]
        found = _children_with_entries(node)
        if found is None:
            return node
        children, entries = found
        keyed = _is_named_tuple(node) or isinstance(node, dict)
        new_children = []
        for child, entry in zip(children, entries):
            child_path = (*path, entry)
            name = entry.name if isinstance(entry, NamedTupleKey) else entry
            if keyed and isinstance(name, str) and name in kwargs and keep(child_path, child):
                new_children.append(kwargs[name])
            else:
                new_children.append(rebuild(child_path, child))
        if all(new is old for new, old in zip(new_children, children)):
            return node
        if _is_named_tuple(node):
            return type(node)(*new_children)
        output = optree.tree_flatten_one_level(node, none_is_leaf=True, namespace=tree_lib._NAMESPACE)
        return output.unflatten_func(output.metadata, new_children)

    return rebuild((), tree)


class _ParamsPlaceholder:
    """Stands for the params in ``init``: a pytree node with no leaves, so ``init`` maps over nothing."""


optree.register_pytree_node(
    _ParamsPlaceholder,
    lambda _: ((), None),
    lambda _, __: _ParamsPlaceholder(),
    namespace=tree_lib._NAMESPACE,
)


def tree_map_params(
    initable: Any,
    f: Callable[..., Any],
    state: PyTree,
    /,
    *rest: PyTree,
    transform_non_params: Optional[Callable[..., Any]] = None,
    is_leaf: Optional[Callable[[Any], bool]] = None,
) -> PyTree:
    """Applies ``f`` to every copy of the params tree inside an optimizer state.

    The params' copies are found by calling ``init`` with a placeholder for the params: wherever
    the placeholder lands in the resulting state, the matching part of ``state`` is a params-shaped
    tree, mapped leafwise with ``f(leaf, *rest_leaves)``. Everything else (counters, say) goes
    through ``transform_non_params`` when given, and is kept otherwise.

    Args:
      initable: a ``GradientTransformation`` (anything with ``init``) or an ``init`` function.
      f: the function applied to each leaf of each params-shaped part of ``state`` (``None``
        leaves stay ``None``).
      state: the optimizer state.
      *rest: trees with the params' structure, whose leaves are passed to ``f`` too.
      transform_non_params: an optional function applied to each other leaf of ``state``.
      is_leaf: an optional predicate stopping the map over the params' trees early.

    Returns:
      a tree with the structure of ``state``.
    """
    init = initable.init if hasattr(initable, "init") else initable
    with_placeholders = init(_ParamsPlaceholder())

    def map_params(maybe_placeholder: Any, value: Any) -> Any:
        if isinstance(maybe_placeholder, _ParamsPlaceholder):
            return optree.tree_map(
                lambda x, *xs: None if x is None else f(x, *xs),
                value,
                *rest,
                is_leaf=is_leaf,
                none_is_leaf=True,
                namespace=tree_lib._NAMESPACE,
            )
        if transform_non_params is not None:
            return transform_non_params(value)
        return value

    return optree.tree_map(
        map_params,
        with_placeholders,
        state,
        is_leaf=lambda node: isinstance(node, _ParamsPlaceholder),
        none_is_leaf=True,
        namespace=tree_lib._NAMESPACE,
    )
