"""``flatten``: run a transformation on all leaves concatenated into one vector, as optax's."""

from __future__ import annotations

from typing import Any

import torch

from gradtx import tree as tree_lib
from gradtx.base import GradientTransformation, with_inplace

PyTree = Any


def _flat(tree: PyTree) -> torch.Tensor:
    leaves = [leaf for leaf in tree_lib.leaves(tree) if leaf is not None]
    return torch.cat([leaf.reshape(-1) for leaf in leaves])


def flatten(inner: GradientTransformation) -> GradientTransformation:
    """``inner`` sees one 1-D tensor, the leaves (``None`` left out) raveled and concatenated in tree
    order; its updates are split back into the leaves' shapes and dtypes.

    Useful for transforms that are cheaper on one large vector. The leaves must concatenate (one
    device; mixed dtypes promote), and the same leaves must be present at every step, as the inner
    state is sized at ``init``.
    """
    inner_update = with_inplace(inner)

    def init_fn(params: PyTree):
        return inner.init(_flat(params))

    def update_fn(updates, state, params=None, *, inplace=False):
        flat_params = None if params is None else _flat(params)
        leaves, treedef = tree_lib.flatten(updates)
        present = [leaf for leaf in leaves if leaf is not None]
        flat_updates, state = inner_update(_flat(updates), state, flat_params, inplace=inplace)
        pieces = iter(torch.split(flat_updates, [leaf.numel() for leaf in present]))
        out = [None if leaf is None else next(pieces).reshape(leaf.shape).to(leaf.dtype) for leaf in leaves]
        return tree_lib.unflatten(treedef, out), state

    return GradientTransformation(init_fn, update_fn)
