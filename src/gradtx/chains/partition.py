"""Partitioning: a different transformation for each labelled group of leaves.

``partition({"decay": adamw(...), "no_decay": adam(...)}, labels)`` runs each transformation on
the leaves carrying its label, as ``optax.partition`` (formerly ``multi_transform``) does. Each
group's state is a :class:`~gradtx.chains.masking.MaskedState` covering its own leaves only.
"""

from __future__ import annotations

from typing import Any, Callable, Hashable, Mapping, NamedTuple, Union

from gradtx import tree as tree_lib
from gradtx.base import GradientTransformation, GradientTransformationExtraArgs, takes_extra_args, with_inplace, runs_inner
from gradtx.chains.masking import LeafSelector, MaskedState, freeze, init_selected, update_selected

PyTree = Any
Labels = Union[PyTree, Callable[[PyTree], PyTree]]


class PartitionState(NamedTuple):
    """One ``MaskedState`` per label, keyed by label."""

    inner_states: dict[Hashable, MaskedState]


MultiTransformState = PartitionState
"""The state of :func:`multi_transform` (optax's former name for :func:`partition`): the same class."""


def _label_resolver(transforms: Mapping[Hashable, GradientTransformation]) -> Callable[[Any, PyTree], list[Any]]:
    known = list(transforms)

    def resolve(spec: Any, tree: PyTree) -> list[Any]:
        labels = spec(tree) if callable(spec) else spec
        label_leaves = tree_lib.leaves(labels)
        for index, label in enumerate(label_leaves):
            try:
                ok = label is None or label in transforms
            except TypeError:  # unhashable
                ok = False
            if not ok:
                raise ValueError(
                    f"partition: label {label!r} (at {tree_lib.path_at(labels, index)!r}) has no transformation; "
                    f"transformations are given for {known!r}"
                )
        tree_leaves = tree_lib.leaves(tree)
        # one label per leaf of ``tree`` (a label at a node covers every leaf below it), read off the
        # labels as they were given: no tree is built here, so a compiled step traces this as it is
        per_leaf = tree_lib.fitted_leaves(labels, tree, what="partition: param_labels")
        for index, (leaf, label) in enumerate(zip(tree_leaves, per_leaf)):
            if leaf is not None and label is None:
                raise ValueError(f"partition: leaf {tree_lib.path_at(tree, index)!r} has no label (None)")
        return per_leaf

    return resolve


def partition(
    transforms: Mapping[Hashable, GradientTransformation],
    param_labels: Labels,
    *,
    mask_compatible_extra_args: bool = False,
) -> GradientTransformation:
    """Applies ``transforms[label]`` to the leaves labelled ``label``.

    Args:
      transforms: a mapping from label to transformation.
      param_labels: a tree of labels with the params' structure or a prefix of it (a label at a
        node covers every leaf below), or a callable ``tree -> such a tree`` (called on the params
        at ``init`` and on the updates at ``update``). A label with no transformation is a
        ``ValueError`` naming it.
      mask_compatible_extra_args: also mask the extra arguments that have the updates' tree
        structure, as each group's updates are (see :func:`~gradtx.masked`).

    Extra arguments given to ``update`` reach the transformations that take them; the result is a
    ``GradientTransformationExtraArgs`` when any of them is.
    """
    transforms = dict(transforms)
    for label, tx in transforms.items():
        if not isinstance(tx, GradientTransformation):
            raise TypeError(f"partition: the transformation for {label!r} is a {type(tx).__name__}")
    updaters = {label: (with_inplace(tx), takes_extra_args(tx)) for label, tx in transforms.items()}
    selector = LeafSelector(param_labels, _label_resolver(transforms))

    def init_fn(params: PyTree) -> PartitionState:
        leaf_labels = selector(params)
        return PartitionState(
            {
                label: MaskedState(init_selected(tx.init, params, [lab == label for lab in leaf_labels]))
                for label, tx in transforms.items()
            }
        )

    def update_fn(updates, state, params=None, *, inplace=False, **extra_args):
        leaf_labels = selector(updates)
        new_states = {}
        for label, (update, extra) in updaters.items():
            updates, new_states[label] = update_selected(
                update,
                [lab == label for lab in leaf_labels],
                updates,
                state.inner_states[label].inner_state,
                params,
                inplace=inplace,
                owner=f"partition[{label!r}]",
                extra_args=extra_args if extra else None,
                mask_compatible_extra_args=mask_compatible_extra_args,
            )
            new_states[label] = MaskedState(new_states[label])
        return updates, PartitionState(new_states)

    kind = GradientTransformationExtraArgs if any(extra for _, extra in updaters.values()) else GradientTransformation
    return kind(init_fn, runs_inner(update_fn, *transforms.values()))


multi_transform = partition


def selective_transform(optimizer: GradientTransformation, *, freeze_mask: Any) -> GradientTransformation:
    """Runs ``optimizer`` on the leaves ``freeze_mask`` leaves out and zeroes the others (as optax).

    Unlike ``chain(freeze(mask), optimizer)``, the optimizer keeps no state for frozen leaves.
    ``freeze_mask`` is a bool, a tree of bools (``True`` freezes) or a callable building one.
    """

    def to_labels(mask: Any) -> Any:
        return tree_lib.tree_map(lambda frozen: "freeze" if frozen else "train", mask)

    labels = (lambda tree: to_labels(freeze_mask(tree))) if callable(freeze_mask) else to_labels(freeze_mask)
    return partition({"train": optimizer, "freeze": freeze(True)}, labels)
