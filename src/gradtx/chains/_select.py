"""Tensor-only control flow for combinators: select whole trees with ``torch.where``, count safely.

Combinators that decide per step (skip a non-finite step, emit only every k-th step) compute both
outcomes and select between them leaf by leaf with a 0-d boolean tensor, so the decision never
reaches the host: no synchronisation, and ``torch.compile`` traces one graph for every step.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from gradtx import torch_internals
from gradtx import tree as tree_lib
from gradtx.numerics import safe_increment  # noqa: F401 - the combinators' saturating counter

PyTree = Any


def counter(tree: PyTree, dtype: torch.dtype = torch.int32) -> Tensor:
    """A 0-d zero counter on ``tree``'s device."""
    return torch.zeros((), dtype=dtype, device=tree_lib.first_device(tree))


class _OnDevice:
    """A 0-d condition, copied to each device it is needed on once."""

    def __init__(self, condition: Tensor):
        self._by_device = {condition.device: condition}

    def on(self, device: torch.device) -> Tensor:
        found = self._by_device.get(device)
        if found is None:
            found = self._by_device[device] = self._by_device[next(iter(self._by_device))].to(device)
        return found


def where_tree(condition: Tensor, if_true: PyTree, if_false: PyTree, *, what: str) -> PyTree:
    """``torch.where(condition, a, b)`` leaf by leaf, each result in ``b``'s dtype.

    ``None`` leaves stay ``None``. A leaf that is not a tensor (a Python number in some state)
    must be equal in both trees, since it cannot be selected without reading ``condition``;
    otherwise this is a ``TypeError`` naming its path.
    """
    selector = _OnDevice(condition)
    true_leaves, treedef = tree_lib.flatten(if_true)
    false_leaves = tree_lib.flatten_like(
        if_false, treedef, if_true, what=f"{what}: the kept value", like="the new value"
    )
    out = []
    for index, (a, b) in enumerate(zip(true_leaves, false_leaves)):
        if isinstance(a, Tensor) and isinstance(b, Tensor):
            selected = torch.where(selector.on(b.device), a.to(b.device), b)
            out.append(selected if selected.dtype == b.dtype else selected.to(b.dtype))
        elif a is None and b is None:
            out.append(None)
        elif _same(a, b):
            out.append(a)
        else:
            raise TypeError(
                f"{what}: state leaf {tree_lib.path_at(if_true, index)!r} is a {type(a).__name__} that changed "
                f"({b!r} -> {a!r}); only tensor leaves can be selected without reading the condition on the host"
            )
    return tree_lib.unflatten(treedef, out)


def where_or_zero(condition: Tensor, tree: PyTree) -> PyTree:
    """Each tensor leaf where ``condition`` holds, zeros (same dtype) where not; ``None`` stays ``None``."""
    selector = _OnDevice(condition)
    return tree_lib.tree_map(lambda t: _where_or_zero(selector.on(t.device), t), tree)


def _where_or_zero(condition: Tensor, tensor: Tensor) -> Tensor:
    if tensor.layout == torch.strided:
        return torch.where(condition, tensor, 0)
    if tensor.layout != torch.sparse_coo:
        raise TypeError(f"a {tensor.layout} update cannot be selected (sparse COO and dense can)")
    # a sparse tensor selects its stored values: the implicit zeros are zeros either way
    coalesced = tensor.coalesce()
    values = torch.where(condition, coalesced.values(), 0)
    return torch.sparse_coo_tensor(coalesced.indices(), values, coalesced.shape, is_coalesced=True, check_invariants=False)


def _same(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - anything uncomparable is not the same
        return a is b


def zeros_like_tree(tree: PyTree, *, inplace: bool = False) -> PyTree:
    """Zeros shaped like every tensor leaf (``None`` stays ``None``); overwrites them when ``inplace``."""
    tensors = [leaf for leaf in tree_lib.leaves(tree) if isinstance(leaf, Tensor)]
    if not inplace or tree_lib.needs_graph(tensors):  # no in-place write on a recorded graph
        return tree_lib.tree_map(torch.zeros_like, tree)
    for _, (group,) in tree_lib.grouped(tensors):
        torch_internals.foreach_kernel("zero_")(group)
    return tree
