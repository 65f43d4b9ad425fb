"""Complex parameters as pairs of real ones: optax.contrib's ``split_real_and_imaginary``.

An optimizer run through it treats each complex leaf as two real leaves (its real and imaginary
parts), so Adam's second moment, say, is kept per part rather than as ``|g|^2``. torch's gradient
of a real loss with respect to ``z = x + iy`` is ``dL/dx + i dL/dy`` (the direction of steepest
ascent), so, unlike in JAX, no conjugation is needed between ``torch.autograd`` and ``update``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor

from gradtx import tree as tree_lib
from gradtx.base import GradientTransformation, with_inplace


class SplitRealAndImaginaryArrays(NamedTuple):
    """The real and imaginary parts of one complex leaf, as two real tensors."""

    real: Tensor
    imaginary: Tensor


class SplitRealAndImaginaryState(NamedTuple):
    """``inner_state``: the inner transformation's state, built on the split params."""

    inner_state: Any


def _split(x: Any) -> Any:
    if isinstance(x, Tensor) and x.is_complex():
        return SplitRealAndImaginaryArrays(x.real, x.imag)
    return x


def _merge(x: Any) -> Any:
    if isinstance(x, SplitRealAndImaginaryArrays):
        return torch.complex(x.real, x.imaginary)
    return x


def split_real_and_imaginary(inner: GradientTransformation) -> GradientTransformation:
    """Runs ``inner`` on the real and imaginary parts of complex updates and params, as separate leaves.

    Each complex leaf becomes a :class:`SplitRealAndImaginaryArrays` pair of real tensors (views of
    its parts: a donated complex update may be written through them); real leaves pass unchanged.
    The pairs ``inner`` returns are merged back into complex updates. As in optax (whose issue 196
    discusses complex gradients), an optimizer then behaves on a complex parameter exactly as on
    the two real ones; in torch the split gradient is exactly the gradient with respect to them.

    Example::

        import torch
        import gradtx as gtx
        from gradtx.contrib import split_real_and_imaginary

        opt = split_real_and_imaginary(gtx.adam(0.1))
        params = {"z": torch.tensor([1.0 + 2.0j, -1.0 + 0.5j])}
        state = opt.init(params)
        grads = {"z": torch.tensor([0.5 - 1.0j, 2.0 + 0.0j])}
        updates, state = opt.update(grads, state, params)
        print(updates["z"])   # about -0.1 * (sign of each part): tensor([-0.1+0.1j, -0.1-0.0j])
    """
    update = with_inplace(inner)

    def init_fn(params: Any) -> SplitRealAndImaginaryState:
        return SplitRealAndImaginaryState(inner.init(tree_lib.tree_map(_split, params)))

    def update_fn(updates, state, params=None, *, inplace=False):
        split_updates = tree_lib.tree_map(_split, updates)
        split_params = None if params is None else tree_lib.tree_map(_split, params)
        out, inner_state = update(split_updates, state.inner_state, split_params, inplace=inplace)
        merged = tree_lib.tree_map(lambda u, o: _merge(o), updates, out)  # the updates' tree: a prefix of out's
        return merged, SplitRealAndImaginaryState(inner_state)

    return GradientTransformation(init_fn, update_fn)


__all__ = ["SplitRealAndImaginaryArrays", "SplitRealAndImaginaryState", "split_real_and_imaginary"]
