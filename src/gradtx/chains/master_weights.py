"""``master_weights``: a float32 copy of every bfloat16 / float16 param, which the optimizer steps.

Mixed-precision training keeps the model in a low-precision dtype and the optimizer's view of it in
float32: the inner transformation sees float32 gradients and float32 master params, its updates are
added to the masters in float32, and the low-precision params follow as the masters rounded to
nearest. The state holds the masters (4 bytes per low-precision element) and the inner state.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor

from gradtx import tree as tree_lib
from gradtx.base import GradientTransformation, GradientTransformationExtraArgs, takes_extra_args, with_inplace, runs_inner
from gradtx.sharding import dtensor as dtensor_lib
from gradtx.state_check import named
from gradtx.transforms import low_precision


class MasterWeightsState(NamedTuple):
    """``master``: per bfloat16 / float16 param its float32 master copy (``None`` for the other
    leaves); ``inner_state``: the inner transformation's state."""

    master: Any
    inner_state: Any


def master_weights(inner: GradientTransformation, *, dtype: low_precision.UpdatesDtype = None) -> GradientTransformation:
    """Runs ``inner`` on float32 master copies of the bfloat16 / float16 params.

    ``inner`` sees the gradients of low-precision params in float32 and, as its params, the
    float32 masters (the other params as they are). Its updates are added to the masters in float32,
    and the emitted update of a low-precision param is ``u' = round(master_new) - p``, computed in
    float32 and exact (see :mod:`gradtx.transforms.low_precision`), so ``apply_updates`` sets the
    param to its new master rounded to nearest. Params of float32 or wider get ``inner``'s updates
    as they are. Extra arguments (``value=``, ...) are passed on to ``inner`` when it takes them.

    Args:
      inner: the transformation to run (an optimizer such as ``adamw``, a chain, ...).
      dtype: the dtype of the emitted updates, as for :func:`~gradtx.stochastic_rounding`
        (``"param"`` under :func:`~gradtx.wrap`).
    """
    dtype = low_precision.check_updates_dtype(dtype, owner="master_weights")
    inner_update = with_inplace(inner)

    def masters_of(params: Any, master: Any) -> Any:
        """The params ``inner`` sees: the masters where there are some, the params elsewhere."""
        param_leaves, treedef = tree_lib.flatten(params)
        master_leaves = tree_lib.flatten_like(master, treedef, params, what="master_weights: state.master", like="params")
        return tree_lib.unflatten(treedef, [p if m is None else m for p, m in zip(param_leaves, master_leaves)])

    def init_fn(params: Any) -> MasterWeightsState:
        flags = low_precision.low_precision_flags(params, owner="master_weights")
        param_leaves, treedef = tree_lib.flatten(params)
        master = tree_lib.unflatten(
            treedef, [p.detach().to(torch.float32) if flag else None for p, flag in zip(param_leaves, flags)]
        )
        return MasterWeightsState(master=master, inner_state=inner.init(masters_of(params, master)))

    def update_fn(updates, state, params=None, *, inplace=False, **extra_args):
        tree_lib.require_params(updates, params, owner="master_weights", why=" (it keeps their float32 copies)")
        update_leaves, treedef, present = tree_lib.tensor_leaves(updates, what="master_weights")
        if params is None:  # no update at all
            new_updates, inner_state = inner_update(updates, state.inner_state, None, inplace=inplace, **extra_args)
            return new_updates, MasterWeightsState(master=state.master, inner_state=inner_state)
        flags = low_precision.low_precision_flags(params, owner="master_weights")
        master_leaves = tree_lib.flatten_like(state.master, treedef, updates, what="master_weights: state.master", like="updates")
        grads = list(update_leaves)
        for i in present:
            if flags[i]:
                if master_leaves[i] is None:
                    raise ValueError(f"master_weights: leaf {tree_lib.path_at(updates, i)!r} has no master copy in the state")
                # a floating-point update laid out as the master copy (no Partial, not yet reduced, gradient)
                low_precision.check_update(update_leaves[i], master_leaves[i], owner="master_weights", path=tree_lib.path_at(updates, i))
                grads[i] = update_leaves[i].to(torch.float32)
        masters = masters_of(params, state.master)
        inner_updates, inner_state = inner_update(
            tree_lib.unflatten(treedef, grads), state.inner_state, masters, inplace=inplace, **extra_args
        )
        inner_leaves = tree_lib.flatten_like(inner_updates, treedef, updates, what="master_weights: inner updates", like="updates")
        param_leaves = tree_lib.flatten_like(params, treedef, updates, what="master_weights: params", like="updates")
        out, new_master = list(inner_leaves), list(master_leaves)
        for i, (u, m, p) in enumerate(zip(inner_leaves, master_leaves, param_leaves)):
            if not flags[i] or u is None:
                continue
            (m_local, u_local, p_local), rewrap = dtensor_lib.locals_of([m, u, p])
            moved = m_local + u_local.to(torch.float32)
            emitted = low_precision.updates_to(moved.to(p.dtype), p_local, dtype)
            new_master[i], out[i], _ = rewrap([moved, emitted, p_local])
        state = MasterWeightsState(master=tree_lib.unflatten(treedef, new_master), inner_state=inner_state)
        return tree_lib.unflatten(treedef, out), state

    runs_inner(update_fn, inner)
    if takes_extra_args(inner):
        return GradientTransformationExtraArgs(init_fn, named(update_fn, "master_weights"))

    def plain_update(updates, state, params=None, *, inplace=False):
        return update_fn(updates, state, params, inplace=inplace)

    return GradientTransformation(init_fn, named(runs_inner(plain_update, inner), "master_weights"))
