"""Masking: apply a transformation to some leaves only (``masked``), or zero some leaves (``freeze``).

A mask is an optax-style tree of bools with the structure of the parameters or a prefix of it, or a
callable building one from the tree (see :func:`gradtx.tree.mask_leaves`). The inner
transformation sees a tree with ``None`` ("no gradient") at every masked-out leaf, so its state
holds entries for the selected leaves only, as ``optax.MaskedState`` does; masked-out leaves pass
through untouched.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional, Sequence, Union

import torch

from gradtx import tree as tree_lib
from gradtx.base import (
    runs_inner,
    GradientTransformation,
    GradientTransformationExtraArgs,
    init_empty_state,
    takes_extra_args,
    with_inplace,
)
from gradtx.chains._select import zeros_like_tree
from gradtx.state_check import named

PyTree = Any
Mask = Union[PyTree, Callable[[PyTree], PyTree]]


class MaskedState(NamedTuple):
    """The inner transformation's state, covering the selected leaves only."""

    inner_state: Any


class MaskedNode(NamedTuple):
    """optax's marker for a masked-out leaf: a pytree node with no leaves.

    gradtx's own combinators mark masked-out leaves with ``None`` ("no gradient", which every
    transformation passes through) rather than with this node, so a gradtx state never holds one.
    It is here for code that builds or tests for optax's marker: being an empty node, a tree
    holding it flattens to the other leaves only, as in optax.
    """


class LeafSelector:
    """Resolves a mask (or any prefix tree) to one value per leaf of a tree.

    A static mask depends only on the tree's structure, so it is resolved once per structure and
    cached; a callable mask is called on every tree it is asked about (as in optax).
    """

    def __init__(self, spec: Any, resolve: Callable[[Any, PyTree], list[Any]]):
        self._spec = spec
        self._resolve = resolve
        self._cache: dict[Any, list[Any]] = {}

    def __call__(self, tree: PyTree) -> list[Any]:
        if callable(self._spec) or torch.compiler.is_compiling():  # a compiled graph resolves it once anyway
            return self._resolve(self._spec, tree)
        treedef = tree_lib.structure(tree)
        found = self._cache.get(treedef)
        if found is None:
            found = self._cache[treedef] = self._resolve(self._spec, tree)
        return found


def keep_selected(tree_leaves: Sequence[Any], selected: Sequence[bool]) -> list[Any]:
    """The leaves where ``selected``, ``None`` elsewhere."""
    return [leaf if keep else None for leaf, keep in zip(tree_leaves, selected)]


def init_selected(init_fn: Callable[[PyTree], Any], params: PyTree, selected: Sequence[bool]) -> Any:
    """``init_fn`` on ``params`` with every unselected leaf replaced by ``None``."""
    param_leaves, treedef = tree_lib.flatten(params)
    return init_fn(tree_lib.unflatten(treedef, keep_selected(param_leaves, selected)))


def update_selected(
    update_fn: Callable[..., tuple[PyTree, Any]],
    selected: Sequence[bool],
    updates: PyTree,
    inner_state: Any,
    params: Optional[PyTree],
    *,
    inplace: bool,
    owner: str,
    extra_args: Optional[dict[str, Any]] = None,
    mask_compatible_extra_args: bool = False,
) -> tuple[PyTree, Any]:
    """Runs ``update_fn`` on the selected leaves only; unselected leaves come back as they were.

    ``extra_args`` are passed on (``update_fn`` must take them); with ``mask_compatible_extra_args``
    those with the updates' tree structure are masked as the updates are.
    """
    update_leaves, treedef = tree_lib.flatten(updates)
    sub_updates = tree_lib.unflatten(treedef, keep_selected(update_leaves, selected))
    sub_params = None
    if params is not None:
        param_leaves = tree_lib.flatten_like(params, treedef, updates, what=f"{owner}: params", like="updates")
        sub_params = tree_lib.unflatten(treedef, keep_selected(param_leaves, selected))
    if extra_args:
        if mask_compatible_extra_args:
            extra_args = {name: _mask_if_alike(value, treedef, selected) for name, value in extra_args.items()}
        new_sub_updates, new_inner_state = update_fn(sub_updates, inner_state, sub_params, inplace=inplace, **extra_args)
    else:
        new_sub_updates, new_inner_state = update_fn(sub_updates, inner_state, sub_params, inplace=inplace)
    new_leaves = tree_lib.flatten_like(
        new_sub_updates, treedef, updates, what=f"{owner}: inner updates", like="updates"
    )
    merged = [new if keep else old for new, old, keep in zip(new_leaves, update_leaves, selected)]
    return tree_lib.unflatten(treedef, merged), new_inner_state


def _mask_if_alike(value: Any, treedef: Any, selected: Sequence[bool]) -> Any:
    """``value`` with its unselected leaves replaced by ``None`` if it has the structure ``treedef``."""
    value_leaves, value_def = tree_lib.flatten(value)
    if value_def != treedef:
        return value
    return tree_lib.unflatten(treedef, keep_selected(value_leaves, selected))


def mask_selector(mask: Mask, owner: str) -> LeafSelector:
    """Resolves ``mask`` per leaf; a ``None`` in the mask (``tree_map`` over a ``None`` leaf) selects nothing."""

    def resolve(spec: Any, tree: PyTree) -> list[bool]:
        spec = spec(tree) if callable(spec) else spec
        spec = tree_lib.unflatten(*none_as_false(spec))
        return tree_lib.mask_leaves(spec, tree, what=f"{owner}: mask")

    return LeafSelector(mask, resolve)


def none_as_false(mask: PyTree) -> tuple[Any, list[Any]]:
    mask_leaves, mask_def = tree_lib.flatten(mask)
    return mask_def, [False if leaf is None else leaf for leaf in mask_leaves]


def masked(inner: GradientTransformation, mask: Mask, *, mask_compatible_extra_args: bool = False) -> GradientTransformation:
    """Applies ``inner`` to the leaves ``mask`` selects; the others pass through untouched.

    Example: weight decay on matrices only,
    ``masked(add_decayed_weights(1e-4), lambda p: tree_map(lambda x: x.ndim > 1, p))``.

    Args:
      inner: the transformation to apply to the selected leaves.
      mask: a tree of bools (the params' structure or a prefix of it; ``True`` selects) or a
        callable ``tree -> such a tree``, called on the params at ``init`` and on the updates at
        ``update``.
      mask_compatible_extra_args: also mask the extra arguments that have the updates' tree
        structure (a ``grad=`` tree, say), as the updates are.

    Extra arguments given to ``update`` reach ``inner`` when it takes them (it is then a
    ``GradientTransformationExtraArgs``, and so is the result). The state is ``MaskedState(inner_state)``, with ``None`` in the inner state wherever a leaf is
    masked out.
    """
    selector = mask_selector(mask, "masked")
    inner_update = with_inplace(inner)
    extra = takes_extra_args(inner)

    def init_fn(params: PyTree) -> MaskedState:
        return MaskedState(inner_state=init_selected(inner.init, params, selector(params)))

    def update_fn(updates, state, params=None, *, inplace=False, **extra_args):
        new_updates, inner_state = update_selected(
            inner_update,
            selector(updates),
            updates,
            state.inner_state,
            params,
            inplace=inplace,
            owner="masked",
            extra_args=extra_args if extra else None,
            mask_compatible_extra_args=mask_compatible_extra_args,
        )
        return new_updates, MaskedState(inner_state=inner_state)

    return (GradientTransformationExtraArgs if extra else GradientTransformation)(init_fn, runs_inner(update_fn, inner))


def _zero_updates() -> GradientTransformation:

    def update_fn(updates, state, params=None, *, inplace=False):
        del params
        return zeros_like_tree(updates, inplace=inplace), state

    return GradientTransformation(init_empty_state, named(update_fn, "freeze"))


def freeze(mask: Union[bool, Mask]) -> GradientTransformation:
    """Zeroes the updates of the leaves ``mask`` selects, so those parameters stay as they are.

    ``mask`` is a bool (freeze everything or nothing), a tree of bools, or a callable (see
    :func:`masked`). As ``optax.freeze``: ``masked(set_to_zero(), mask)``.
    """
    return masked(_zero_updates(), mask)

