"""Gradient clipping: by global norm (torch-compatible numbers), by value, by block RMS, and AGC.

``clip_by_global_norm`` computes exactly what ``torch.nn.utils.clip_grad_norm_`` computes:
``norm = ||all leaves||_p``, ``coef = min(1, max_norm / (norm + 1e-6))``, every leaf times ``coef``,
with no data-dependent Python branch, so it runs under ``torch.func.vmap`` (per-example clipping)
and ``torch.compile(fullgraph=True)``. Norms accumulate in float32 or wider whatever the gradient
dtype, and the norm before clipping is kept in the state for logging.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple, Optional, Sequence, Union

import torch
from torch import Tensor

from gradtx import sharding
from gradtx import tree as tree_lib
from gradtx.base import (
    takes_spec,
    EmptyState,
    GradientTransformation,
    LeadingClip,
    Scaling,
    donation,
    init_empty_state,
    real_empty_state,
    set_leading_clip,
    supports_donated_updates,
)
from gradtx.transforms import _foreach as fe
from gradtx.tree import unitwise_norm

_EPS = 1e-6  # the same epsilon as torch.nn.utils.clip_grad_norm_


def _check_non_negative(name: str, value: float | Tensor, owner: str, *, keep_tensor: bool = False) -> float | Tensor:
    """``value`` as a float, or with ``keep_tensor`` a one-element tensor as a 0-d tensor
    (``inject_hyperparams`` passes one each step).

    A tensor is checked in eager mode only: under ``torch.compile`` reading it on the host would
    break the graph at every step.
    """
    if keep_tensor and isinstance(value, Tensor) and value.numel() == 1:
        if not torch.compiler.is_compiling() and not bool(value >= 0.0):
            raise ValueError(f"{owner}: {name} must be >= 0, got {value.item()}")
        return value.reshape(())
    value = float(value)
    if not value >= 0.0:  # also rejects NaN
        raise ValueError(f"{owner}: {name} must be >= 0, got {value}")
    return value


def _norm_state_dtype(params: Any) -> tuple[torch.dtype, torch.device]:
    tensors = [leaf for leaf in tree_lib.leaves(params) if isinstance(leaf, Tensor)]
    dtype = tree_lib.accumulation_dtype([t.dtype for t in tensors])
    device = tensors[0].device if tensors else torch.device("cpu")
    return dtype, device


def global_norm(tree: Any, spec: Optional[sharding.ShardingSpec] = None, *, norm_type: float = 2.0) -> Tensor:
    """The ``norm_type``-norm of every non-``None`` leaf of ``tree`` taken together (a 0-d tensor).

    Equal to ``torch.nn.utils.get_total_norm`` on the same tensors, but accumulated in float32 or
    wider whatever their dtype. ``norm_type`` may be ``inf``. With a ``spec`` (or DTensor leaves),
    the norm of the logical gradient across ranks, every element counted once, with one collective
    (see :func:`gradtx.sharding.global_norm`).
    """
    return sharding.global_norm(tree, spec, norm_type=norm_type)


class ClipByGlobalNormState(NamedTuple):
    """``norm``: the global norm of the last gradients *before* clipping (0-d tensor)."""

    norm: Tensor


@takes_spec
def clip_by_global_norm(
    max_norm: float,
    spec: Optional[sharding.ShardingSpec] = None,
    *,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
) -> GradientTransformation:
    """Scales all updates by ``min(1, max_norm / (norm + 1e-6))``, as ``clip_grad_norm_`` does.

    Args:
      max_norm: the largest global norm let through; ``0`` turns every update into zeros.
      spec: how the gradients are sharded (a :class:`gradtx.sharding.ShardingSpec`): the norm is then
        that of the logical gradient, with one collective, and every rank scales by the same
        coefficient. DTensor gradients need no spec.
      norm_type: the p of the p-norm (``inf`` allowed).
      error_if_nonfinite: raise ``RuntimeError`` when the norm is NaN or infinite (this reads the
        norm on the host, so leave it off under ``vmap`` / ``torch.compile``). Otherwise a
        non-finite norm behaves as in torch; wrap the chain in ``apply_if_finite`` to skip such steps.
    """
    max_norm = _check_non_negative("max_norm", max_norm, "clip_by_global_norm", keep_tensor=True)
    norm_type = float(norm_type)

    def init_fn(params: Any) -> ClipByGlobalNormState:
        dtype, device = _norm_state_dtype(params)
        return ClipByGlobalNormState(norm=torch.zeros((), dtype=dtype, device=device))

    def clip_coefficient(norm: Tensor) -> Tensor:
        """``min(1, max_norm / (norm + 1e-6))``: the factor a gradient of global norm ``norm`` is scaled by."""
        if isinstance(max_norm, Tensor):
            # a float divided by a tensor is the reciprocal times the float: the same numbers
            return torch.clamp(torch.reciprocal(norm + _EPS) * max_norm.to(norm.device, norm.dtype), max=1.0)
        return torch.clamp(max_norm / (norm + _EPS), max=1.0)

    def coefficient(updates, grads, groups=None, given=None) -> tuple[Tensor, Tensor]:
        if given is not None:
            norm = given
        elif groups is None and sharding.is_sharded(grads, spec):
            norm = sharding.global_norm(updates, spec, norm_type=norm_type)
        else:
            norm = tree_lib.total_norm(grads, norm_type, groups=groups)
        if error_if_nonfinite and not bool(torch.isfinite(norm)):
            raise RuntimeError(
                f"clip_by_global_norm: the total norm of order {norm_type} of the gradients is non-finite "
                f"({norm.item()}), so it cannot be clipped. Pass error_if_nonfinite=False to scale by it "
                "anyway, or wrap the chain in apply_if_finite to skip such steps."
            )
        return fe.realized(clip_coefficient(norm), norm)  # compiled: the coefficient is computed once, not per vector

    def leaves_of(updates: Any) -> tuple[list[Any], Any, list[int]]:
        try:
            return tree_lib.tensor_leaves(updates, what="clip_by_global_norm")
        except TypeError:
            if spec is None:
                raise
            # under a spec, the norm's all-reduce carries this rank's error to every rank, which all raise
            sharding.global_norm(updates, spec, norm_type=norm_type)
            raise

    def coefficient_of(updates, grads, given: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Optional[list[list[int]]]]:
        """``(coef, norm, groups)``: plain unsharded tensors are grouped once (``groups``, which
        the scaling reuses); sharded ones (``groups`` ``None``) take the global norm, one
        all-reduce unless ``given``."""
        if grads and not sharding.is_sharded(grads, spec):
            groups = tree_lib.torch_groups(grads)
            return (*coefficient(updates, grads, groups, given), groups)
        return (*coefficient(updates, grads, given=given), None)

    def clipped_by(updates, inplace, given: Optional[Tensor] = None, scale: Optional[Scaling] = None):
        own_updates, _ = donation(inplace)  # the state is new either way
        tree_leaves, treedef, present = leaves_of(updates)
        grads = tree_leaves if len(present) == len(tree_leaves) else [tree_leaves[i] for i in present]
        coef, norm, groups = coefficient_of(updates, grads, given)
        if groups is not None:  # plain tensors: one grouping serves the norm and the scaling
            clipped = scale(grads, coef, own_updates) if scale is not None else tree_lib.scale_(grads, coef, inplace=own_updates, groups=groups)
        else:
            local_grads, rewrap = sharding.locals_of(grads)
            clipped = rewrap(scale(local_grads, coef, own_updates) if scale is not None else tree_lib.scale_(local_grads, coef, inplace=own_updates))
        new_updates = tree_lib.unflatten(treedef, tree_lib.replace_present(tree_leaves, present, clipped))
        return new_updates, ClipByGlobalNormState(norm=norm)

    def update_fn(updates, state, params=None, *, inplace=False):
        del params, state
        return clipped_by(updates, inplace)

    def given(norm: Tensor, scale: Optional[Scaling] = None):
        """``update`` with ``norm`` (reduced by the caller, as :func:`gradtx.sharding.global_norm`
        would reduce it) taken as the global norm: no reduction of its own; and ``scale``, when
        given, multiplying the gradients by the coefficient (see :class:`gradtx.base.LeadingClip`)."""

        def update_given(updates, state, params=None, *, inplace=False, **extra_args):
            del params, state, extra_args
            return clipped_by(updates, inplace, norm, scale)

        return update_given

    def scalar_factor(updates, state, params=None):
        """``(coef, new_state)`` without touching ``updates``: ``update`` is ``updates * coef``.

        Lets a caller with a fused kernel that scales gradients itself (``gradtx.wrap`` over a
        ``fused=True`` optimizer) apply ``coef`` there instead of in a separate pass.
        """
        del params, state
        tree_leaves, _, present = leaves_of(updates)
        coef, norm = coefficient(updates, [tree_leaves[i] for i in present])
        return coef, ClipByGlobalNormState(norm=norm)

    def handed_factor(updates, state, params=None, *, given: Optional[Tensor] = None):
        """``(coef, new_state)`` for a chain that hands ``coef`` to the member after the clip (see
        :func:`gradtx.base.takes_scaled_gradients`) instead of scaling here, or ``None`` where the
        clip scales the gradients itself: DTensor, sparse or graph-recording gradients, and while
        compiling (the compiler fuses the product into the next loop on its own). Plain pieces laid
        out by a spec are handed it too: the coefficient of the global norm is the same on every
        rank, and each rank's pieces are scaled by it as the clip scales them. ``given``: the global
        norm, reduced by the caller."""
        del params, state
        if torch.compiler.is_compiling():
            return None
        tree_leaves, _, present = leaves_of(updates)
        grads = [tree_leaves[i] for i in present]
        plain = all(type(g) in (Tensor, torch.nn.Parameter) and g.layout == torch.strided for g in grads)
        if not grads or not plain or tree_lib.needs_graph(grads, max_norm, given):
            return None
        coef, norm, _ = coefficient_of(updates, grads, given)
        return coef, ClipByGlobalNormState(norm=norm)

    update_fn.scalar_factor = scalar_factor
    update_fn.handed_factor = handed_factor
    update_fn.clip_coefficient = clip_coefficient  # lets gradtx.observe report the factor from the state's norm
    set_leading_clip(
        update_fn, LeadingClip(spec, norm_type, lambda state: state.norm, lambda state, norm: clip_coefficient(norm), given)
    )
    return GradientTransformation(init_fn, supports_donated_updates(update_fn))


def _clamp_all(tensors: list[Tensor], low: float, high: float, *, inplace: bool) -> list[Tensor]:
    try:
        clamped = tree_lib.foreach("clamp_min", tensors, low, inplace=inplace)
        return tree_lib.foreach("clamp_max", clamped, high, inplace=True)
    except NotImplementedError:  # torch has no clamp for sparse tensors: found at no cost to dense ones
        if all(t.layout == torch.strided for t in tensors):
            raise
    # clamping is idempotent, so dense tensors already clamped in place above may be clamped again
    return [_clamp_one(t, low, high) for t in tensors]


def _clamp_one(tensor: Tensor, low: float, high: float) -> Tensor:
    """``tensor`` clamped; a sparse COO tensor by its coalesced values (duplicates summed first)."""
    if tensor.layout == torch.strided:
        return tensor.clamp(low, high)
    if tensor.layout != torch.sparse_coo:
        raise TypeError(f"clip_by_value: a {tensor.layout} gradient is not supported (sparse COO and dense are)")
    coalesced = tensor.coalesce()
    values = coalesced.values().clamp(low, high)
    return torch.sparse_coo_tensor(coalesced.indices(), values, coalesced.shape, is_coalesced=True)


def clip_by_value(max_delta: float) -> GradientTransformation:
    """Clamps every update element into ``[-max_delta, max_delta]`` (as ``clip_grad_value_``)."""
    max_delta = _check_non_negative("max_delta", max_delta, "clip_by_value")


    def update_fn(updates, state, params=None, *, inplace=False):
        del params
        own_updates, _ = donation(inplace)  # stateless
        tree_leaves, treedef, present = tree_lib.tensor_leaves(updates, what="clip_by_value")
        grads = [tree_leaves[i] for i in present]
        clipped: list[Optional[Tensor]] = [None] * len(grads)
        for indices, (group,) in tree_lib.grouped(grads):
            for i, value in zip(indices, _clamp_all(group, -max_delta, max_delta, inplace=own_updates)):
                clipped[i] = value
        return tree_lib.unflatten(treedef, tree_lib.replace_present(tree_leaves, present, clipped)), state

    init_fn = real_empty_state("clip_by_value", "complex numbers have no order to clamp in")
    return GradientTransformation(init_fn, supports_donated_updates(update_fn))


clip = clip_by_value

ClipState = EmptyState
"""The state of :func:`clip_by_value` (alias :func:`clip`): it keeps nothing, as optax's alias says."""


@takes_spec
def clip_by_block_rms(threshold: float, spec: Optional[sharding.ShardingSpec] = None) -> GradientTransformation:
    """Scales each leaf by ``1 / max(1, rms(leaf) / threshold)``, as ``optax.clip_by_block_rms``.

    ``threshold`` must be positive: every leaf's root-mean-square ends up ``<= threshold``. With a
    ``spec`` (or DTensor leaves) the RMS is that of the whole logical leaf, each leaf reduced over
    its own shard axes, batched into one collective per distinct group.
    """
    threshold = float(threshold)
    if not fe.symbolic_hyperparams() and not threshold > 0.0:
        raise ValueError(f"clip_by_block_rms: threshold must be > 0, got {threshold}")


    def update_fn(updates, state, params=None, *, inplace=False):
        del params
        tree_leaves, treedef, present = tree_lib.tensor_leaves(updates, what="clip_by_block_rms")
        grads = [tree_leaves[i] for i in present]
        if sharding.is_sharded(grads, spec):
            rms = tree_lib.leaves(sharding.leaf_rms(updates, spec))
            factors = [1.0 / torch.clamp(rms[i] / threshold, min=1.0) for i in present]
        else:
            norms = tree_lib.local_norms(grads, 2.0)
            factors = [
                1.0 / torch.clamp(n / (math.sqrt(max(g.numel(), 1)) * threshold), min=1.0)
                for n, g in zip(norms, grads)
            ]
        local_grads, rewrap = sharding.locals_of(grads)
        out: list[Optional[Tensor]] = [None] * len(grads)
        for indices, (group, group_factors) in tree_lib.grouped(local_grads, factors):
            for i, value in zip(indices, tree_lib.foreach_mul(group, group_factors, inplace=inplace)):
                out[i] = value
        out = rewrap(out)
        return tree_lib.unflatten(treedef, tree_lib.replace_present(tree_leaves, present, out)), state

    return GradientTransformation(init_empty_state, update_fn)


@takes_spec
def adaptive_grad_clip(
    clipping: float,
    eps: float = 1e-3,
    spec: Optional[sharding.ShardingSpec] = None,
    *,
    axis: Union[None, int, Sequence[int]] = None,
) -> GradientTransformation:
    """Adaptive gradient clipping (Brock et al., 2021), as ``optax.adaptive_grad_clip``.

    Each unit's gradient norm is capped at ``clipping * max(||param unit||, eps)``; units under the
    cap are left as they are. Needs ``params``. By default unit norms follow torch's output-first
    layout (see :func:`unitwise_norm`); ``axis`` (an int or a tuple, the same for every leaf, as
    optax's) names the dims each unit norm reduces over instead: ``axis=0`` gives optax's default
    for JAX's ``(in, out)`` matrices. A complex leaf's norms are those of its moduli. With a
    ``spec`` (or DTensor leaves) unit norms are those of the logical tensors: a leaf split along a
    dim the norm keeps needs no communication, one split along a reduced dim (with the default,
    a row-parallel ``Shard("tp", dim=1)``) reduces its per-unit sums over those axes, all batched
    into one collective per distinct group (see :func:`gradtx.sharding.unitwise_norms`).
    """
    clipping = _check_non_negative("clipping", clipping, "adaptive_grad_clip")
    eps = _check_non_negative("eps", eps, "adaptive_grad_clip")
    if spec is not None and not isinstance(spec, sharding.ShardingSpec):
        raise TypeError(
            f"adaptive_grad_clip: spec must be a gradtx.sharding.ShardingSpec, got {spec!r}; "
            "give the unit axes as axis= (optax's third argument is gradtx's keyword axis=)"
        )


    def update_fn(updates, state, params=None, *, inplace=False):
        tree_lib.require_params(updates, params, owner="adaptive_grad_clip")
        tree_leaves, treedef, present = tree_lib.tensor_leaves(updates, what="adaptive_grad_clip")
        param_leaves = tree_lib.flatten_like(params, treedef, updates, what="adaptive_grad_clip: params", like="updates")
        for i in present:
            grad, param = tree_leaves[i], param_leaves[i]
            if not isinstance(param, Tensor):
                raise TypeError(f"adaptive_grad_clip: params leaf {tree_lib.path_at(updates, i)!r} is not a tensor")
            if param.shape != grad.shape:
                raise ValueError(
                    f"adaptive_grad_clip: leaf {tree_lib.path_at(updates, i)!r} has gradient shape "
                    f"{tuple(grad.shape)} but parameter shape {tuple(param.shape)}"
                )
        grads = [tree_leaves[i] for i in present]
        if sharding.is_sharded(grads, spec) or sharding.is_sharded([param_leaves[i] for i in present], None):
            grad_tree, param_tree = sharding.unitwise_norms(updates, params, spec=spec, axis=axis)
            all_grad_norms, all_param_norms = tree_lib.leaves(grad_tree), tree_lib.leaves(param_tree)
            grad_norms = [all_grad_norms[i] for i in present]
            param_norms = [all_param_norms[i] for i in present]
        else:
            for i in present:  # a bad axis names its leaf
                tree_lib.unit_dims(tuple(tree_leaves[i].shape), axis, what=f"adaptive_grad_clip: leaf {tree_lib.path_at(updates, i)!r}")
            grad_norms = [unitwise_norm(g, axis) for g in grads]
            param_norms = [unitwise_norm(param_leaves[i], axis) for i in present]
        local_grads, rewrap = sharding.locals_of(grads)
        clipped = []
        for grad, grad_norm, param_norm in zip(local_grads, grad_norms, param_norms):
            max_norm = torch.clamp(param_norm, min=eps) * clipping
            factor = torch.where(grad_norm < max_norm, 1.0, max_norm / torch.clamp(grad_norm, min=_EPS))
            factor = factor.to(grad.dtype)
            clipped.append(grad.mul_(factor) if inplace and not tree_lib.needs_graph(grad, factor) else grad * factor)
        clipped = rewrap(clipped)
        return tree_lib.unflatten(treedef, tree_lib.replace_present(tree_leaves, present, clipped)), state

    return GradientTransformation(init_empty_state, update_fn)


AdaptiveGradClipState = EmptyState
"""The state of :func:`adaptive_grad_clip`: it keeps nothing, as optax's alias says."""
