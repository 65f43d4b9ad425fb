"""Euclidean projections of pytrees onto convex sets, with optax.projections' names and numbers.

Each function returns the point of a set closest to its input in the Euclidean norm, the input
being a pytree of tensors taken as one vector (its leaves' elements concatenated): the simplex and
the norm balls constrain all leaves together, as in optax. ``None`` leaves are "no value": they
stay ``None`` and take no part. Results keep each leaf's dtype, shape and device.

Sorting, sums and norms run in float32 at least (float64 when a leaf is float64), so
half-precision trees are projected with float32 arithmetic and rounded once at the end. Every
function is made of tensor ops without host synchronisation or data-dependent Python branches, so
it works under ``torch.func`` (``vmap``, ``grad``) and ``torch.compile``; the derivative of
:func:`projection_simplex` is the one optax defines for it (zero outside the support, the mean
removed inside), which autograd gives from the sort-based formula.
"""

from __future__ import annotations

import numbers
from typing import Any, Callable, Union

import torch
from torch import Tensor

from gradtx import tree as tree_lib
from gradtx import tree_utils

__all__ = [
    "projection_box",
    "projection_halfspace",
    "projection_hypercube",
    "projection_hyperplane",
    "projection_l1_ball",
    "projection_l1_sphere",
    "projection_l2_ball",
    "projection_l2_sphere",
    "projection_linf_ball",
    "projection_non_negative",
    "projection_simplex",
    "projection_vector",
]

PyTree = Any
Scalar = Union[Tensor, float, int]


def _is_scalar(value: Any) -> bool:
    return isinstance(value, (numbers.Number, Tensor))


# --------------------------------------------------------------------------- boxes


def projection_non_negative(tree: PyTree) -> PyTree:
    r"""Projection onto the non-negative orthant: :math:`\max(x, 0)` elementwise (``relu``).

    Args:
      tree: the tree to project.

    Returns:
      the projected tree, with the structure of ``tree``.
    """
    tree_lib.tensor_leaves(tree, what="projection_non_negative: tree")
    return tree_lib.tree_map(torch.relu, tree)


def _bound_side(fn: str, name: str, tree: PyTree, bound: Any, side: str) -> PyTree:
    """Clamps ``tree`` from one side by a scalar (foreach) or by a tree of bounds (leafwise)."""
    if _is_scalar(bound):
        if side == "min":
            return tree_utils.tree_clip(tree, min_value=bound)
        return tree_utils.tree_clip(tree, max_value=bound)
    tree_leaves, treedef, present, (column,) = tree_utils._operands(fn, ("tree", tree), (name, bound))
    op = torch.maximum if side == "min" else torch.minimum
    values = []
    for i, b in zip(present, column):
        x = tree_leaves[i]
        values.append(op(x, torch.as_tensor(b, dtype=x.dtype, device=x.device)))
    return tree_utils._rebuild(tree_leaves, treedef, present, values)


def projection_box(tree: PyTree, lower: Any, upper: Any) -> PyTree:
    r"""Projection onto the box :math:`\text{lower} \le p \le \text{upper}`.

    Elementwise ``min(max(x, lower), upper)`` (``jnp.clip``'s order: ``upper`` wins where the
    bounds cross).

    Args:
      tree: the tree to project.
      lower: the lower bound: a number, a tensor broadcastable to every leaf, or a tree with the
        structure of ``tree``.
      upper: the upper bound, likewise.

    Returns:
      the projected tree, with the structure of ``tree``.
    """
    tree_lib.tensor_leaves(tree, what="projection_box: tree")
    lowered = _bound_side("projection_box", "lower", tree, lower, "min")
    return _bound_side("projection_box", "upper", lowered, upper, "max")


def projection_hypercube(tree: PyTree, scale: Any = 1) -> PyTree:
    r"""Projection onto the hypercube :math:`0 \le p \le \text{scale}` (the unit cube by default).

    Args:
      tree: the tree to project.
      scale: the cube's side: a number, a tensor broadcastable to every leaf, or a tree.

    Returns:
      the projected tree, with the structure of ``tree``.
    """
    return projection_box(tree, lower=0, upper=scale)


def projection_linf_ball(tree: PyTree, scale: Scalar = 1) -> PyTree:
    r"""Projection onto the :math:`\ell_\infty` ball :math:`\|p\|_\infty \le \text{scale}`.

    Args:
      tree: the tree to project.
      scale: the ball's radius (a number or a 0-d tensor).

    Returns:
      the projected tree, with the structure of ``tree``.
    """
    return projection_box(tree, lower=-scale, upper=scale)


# --------------------------------------------------------------------------- the tree as a vector


def _as_vector(fn: str, tree: PyTree) -> tuple[Tensor, Callable[[Tensor], PyTree]]:
    """The tree's elements as one vector (float32 at least), and the function that puts a vector back.

    The vector is on the first leaf's device; putting back restores each leaf's shape, dtype and
    device, and keeps ``None`` leaves.
    """
    tree_leaves, treedef, present = tree_lib.tensor_leaves(tree, what=f"{fn}: tree")
    tensors = [tree_leaves[i] for i in present]
    dtype = torch.float32
    for t in tensors:
        if t.is_complex():
            raise TypeError(f"{fn}: leaf {tree_lib.path_at(tree, present[tensors.index(t)])!r} is complex")
        dtype = torch.promote_types(dtype, t.dtype)
    device = tensors[0].device if tensors else torch.device("cpu")
    vector = (
        torch.cat([t.reshape(-1).to(device=device, dtype=dtype) for t in tensors])
        if tensors
        else torch.zeros(0, dtype=dtype, device=device)
    )
    sizes = [t.numel() for t in tensors]

    def unflatten(values: Tensor) -> PyTree:
        pieces = values.split(sizes) if tensors else []
        restored = [p.reshape(t.shape).to(device=t.device, dtype=t.dtype) for p, t in zip(pieces, tensors)]
        return tree_utils._rebuild(tree_leaves, treedef, present, restored)

    return vector, unflatten


def _projection_unit_simplex(values: Tensor) -> Tensor:
    """The projection of a vector onto the unit simplex, by sorting (Held et al.; Condat, 2016).

    With ``u`` the values sorted in decreasing order and ``k`` the number of indices ``j`` (from 1)
    with ``1/j + u_j - (u_1 + ... + u_j)/j > 0``, the result is ``relu(values - tau)`` where
    ``tau = (u_1 + ... + u_k - 1) / k``.
    """
    n = values.shape[0]
    u = torch.sort(values, descending=True).values
    cumsum_u = torch.cumsum(u, dim=0)
    ind = torch.arange(1, n + 1, dtype=values.dtype, device=values.device)
    cond = 1 / ind + (u - cumsum_u / ind) > 0
    idx = cond.sum()
    top_sum = cumsum_u.gather(0, (idx - 1).reshape(1))
    count = idx.to(values.dtype)
    return torch.relu(1 / count + (values - top_sum / count))


def _simplex_vector(values: Tensor, scale: Scalar) -> Tensor:
    if values.numel() == 0:
        return values
    return scale * _projection_unit_simplex(values / scale)


def projection_simplex(tree: PyTree, scale: Scalar = 1) -> PyTree:
    r"""Projection onto the simplex :math:`p \ge 0,\ \sum p = \text{scale}` (all leaves together).

    The sort-based algorithm, on the tree's elements concatenated (``O(n log n)``).

    Args:
      tree: the tree to project.
      scale: the value the projected tree sums to (a positive number or 0-d tensor; default 1, the
        probability simplex).

    Returns:
      the projected tree, with the structure of ``tree``.
    """
    vector, unflatten = _as_vector("projection_simplex", tree)
    return unflatten(_simplex_vector(vector, scale))


def _l1_sphere_vector(values: Tensor, scale: Scalar) -> Tensor:
    return torch.sign(values) * _simplex_vector(values.abs(), scale)


def projection_l1_sphere(tree: PyTree, scale: Scalar = 1) -> PyTree:
    r"""Projection onto the :math:`\ell_1` sphere :math:`\|p\|_1 = \text{scale}`.

    The signs of ``tree`` times the projection of its absolute values onto the simplex.

    Args:
      tree: the tree to project.
      scale: the sphere's radius.

    Returns:
      the projected tree, with the structure of ``tree``.
    """
    vector, unflatten = _as_vector("projection_l1_sphere", tree)
    return unflatten(_l1_sphere_vector(vector, scale))


def projection_l1_ball(tree: PyTree, scale: Scalar = 1) -> PyTree:
    r"""Projection onto the :math:`\ell_1` ball :math:`\|p\|_1 \le \text{scale}`.

    ``tree`` itself when its :math:`\ell_1` norm is at most ``scale``, else its projection onto the
    sphere (chosen with ``torch.where``: no host synchronisation).

    Args:
      tree: the tree to project.
      scale: the ball's radius.

    Returns:
      the projected tree, with the structure of ``tree``.
    """
    vector, unflatten = _as_vector("projection_l1_ball", tree)
    if vector.numel() == 0:
        return unflatten(vector)
    inside = vector.abs().sum() <= scale
    return unflatten(torch.where(inside, vector, _l1_sphere_vector(vector, scale)))


# --------------------------------------------------------------------------- l2


def projection_l2_sphere(tree: PyTree, scale: Scalar = 1) -> PyTree:
    r"""Projection onto the :math:`\ell_2` sphere :math:`\|p\|_2 = \text{scale}`: ``tree`` rescaled.

    Args:
      tree: the tree to project (a zero tree has no projection: its leaves become NaN, as in optax).
      scale: the sphere's radius.

    Returns:
      the projected tree, with the structure of ``tree``.
    """
    factor = scale / tree_utils.tree_norm(tree)
    return tree_utils.tree_scale(factor, tree)


def projection_l2_ball(tree: PyTree, scale: Scalar = 1) -> PyTree:
    r"""Projection onto the :math:`\ell_2` ball :math:`\|p\|_2 \le \text{scale}`.

    ``tree`` times ``scale / max(||tree||_2, scale)`` (computed from the squared norm, as optax).

    Args:
      tree: the tree to project.
      scale: the ball's radius.

    Returns:
      the projected tree, with the structure of ``tree``.
    """
    squared_norm = tree_utils.tree_norm(tree, squared=True)
    radius = torch.as_tensor(scale, dtype=squared_norm.dtype, device=squared_norm.device)
    factor = radius / torch.sqrt(torch.maximum(squared_norm, radius * radius))
    return tree_utils.tree_scale(factor, tree)


# --------------------------------------------------------------------------- affine sets


def _check_pair(fn: str, x: PyTree, a: PyTree) -> None:
    tree_utils._operands(fn, ("x", x), ("a", a))


def projection_vector(x: PyTree, a: PyTree) -> PyTree:
    r"""Projection onto the line spanned by ``a``: :math:`\frac{\langle x, a\rangle}{\langle a, a\rangle} a`.

    Args:
      x: the tree to project.
      a: the direction, a tree with the structure of ``x``.

    Returns:
      a tree with the structure of ``x``.
    """
    _check_pair("projection_vector", x, a)
    scalar = tree_utils.tree_vdot(x, a) / tree_utils.tree_vdot(a, a)
    return tree_utils.tree_scale(scalar, a)


def projection_hyperplane(x: PyTree, a: PyTree, b: Scalar) -> PyTree:
    r"""Projection onto the hyperplane :math:`\langle a, p\rangle = b`.

    :math:`x + \frac{b - \langle x, a\rangle}{\langle a, a\rangle} a`.

    Args:
      x: the tree to project.
      a: the hyperplane's normal, a tree with the structure of ``x``.
      b: the hyperplane's offset, a number or 0-d tensor.

    Returns:
      a tree with the structure of ``x``.
    """
    _check_pair("projection_hyperplane", x, a)
    scalar = (b - tree_utils.tree_vdot(x, a)) / tree_utils.tree_vdot(a, a)
    return tree_utils.tree_add_scale(x, scalar, a)


def projection_halfspace(x: PyTree, a: PyTree, b: Scalar) -> PyTree:
    r"""Projection onto the halfspace :math:`\langle a, p\rangle \le b`.

    ``x`` itself inside; otherwise its projection onto the hyperplane :math:`\langle a, p\rangle = b`.

    Args:
      x: the tree to project.
      a: the halfspace's outward normal, a tree with the structure of ``x``.
      b: the halfspace's offset, a number or 0-d tensor.

    Returns:
      a tree with the structure of ``x``.
    """
    _check_pair("projection_halfspace", x, a)
    scalar = (b - tree_utils.tree_vdot(x, a)) / tree_utils.tree_vdot(a, a)
    return tree_utils.tree_add_scale(x, torch.clamp(scalar, max=0), a)
