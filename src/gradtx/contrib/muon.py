"""Muon: momentum orthogonalized by Newton-Schulz (Jordan, 2024), with optax.contrib's definition.

``scale_by_muon`` keeps a momentum, takes its (Nesterov) bias-corrected estimate, and replaces each
matrix by an approximate orthogonalization of it (a few Newton-Schulz iterations of a quintic
polynomial). ``muon`` chains it with the shape scaling, weight decay and learning rate, and runs
AdamW on the leaves that are not matrices, as optax does.

Matrix-aware under sharding: with ``spec=`` (plain local shards) or DTensor leaves, each rank's
update is its slice of the update of the whole logical matrix. The momentum is elementwise and runs
on the local shards; each sharded matrix is orthogonalized whole by one owner rank of its shard
group, which sends the slices back (:func:`gradtx.sharding.matrices.map_logical`): two
``all_to_all`` per distinct shard group and dtype per step (one ``all_gather`` with
``strategy="gather"``), none for unsharded leaves or for leaves split only along their batch dims
(stacked experts sharded over ``ep`` with each expert its own matrix) unless ``adaptive``.
"""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple, Optional, Sequence, Union

import optree
import torch
from torch import Tensor

import gradtx
from gradtx import tree as tree_lib
from gradtx.base import GradientTransformation, init_empty_state, takes_spec
from gradtx.chains import chain, partition
from gradtx.numerics import ScalarOrSchedule
from gradtx.optimizers._common import check_learning_rate
from gradtx.sharding import dtensor as dtensor_lib
from gradtx.sharding import matrices
from gradtx.sharding.spec import ShardingSpec
from gradtx.transforms import _foreach as fe

_PRECONDITIONINGS = ("frobenius", "spectral", "aol", "schatten")
_DEFAULT_NS_COEFFS = (3.4445, -4.7750, 2.0315)
_DION_NS_COEFFS = (
    (4.0848, -6.8946, 2.9270),
    (3.9505, -6.3029, 2.6377),
    (3.7418, -5.5913, 2.3037),
    (2.8769, -3.1427, 1.2046),
    (2.8366, -3.0525, 1.2012),
)
_NS_COEFFS_PRESETS = {"standard": _DEFAULT_NS_COEFFS, "dion": _DION_NS_COEFFS}
_PRECONDITION_EPS = 1e-8  # the AOL and Schatten rescalings' floor (fixed, as in optax)


class MuonDimensionNumbers(NamedTuple):
    """Which axes of a weight form the matrix Muon orthogonalizes: ``x @ W = y`` reduces over
    ``reduction_axis`` and produces ``output_axis`` (several axes are flattened together). Every
    other axis is a batch axis: each slice along it is its own matrix (a conv kernel's spatial
    axes stay in the matrix by naming them; stacked expert weights ``(experts, in, out)`` use
    ``MuonDimensionNumbers(1, 2)``)."""

    reduction_axis: Union[Sequence[int], int] = 0
    output_axis: Union[Sequence[int], int] = 1


class MuonState(NamedTuple):
    """``count``: steps taken (0-d int32); ``mu``: the momentum, like the params; ``ns_coeffs``:
    the Newton-Schulz coefficients, ``(3,)`` or ``(steps, 3)`` (float64)."""

    count: Tensor
    mu: Any
    ns_coeffs: Tensor


WeightDimNumOrFn = Union[MuonDimensionNumbers, Any, Callable[[Any], Any]]


# --------------------------------------------------------------------------- dimension numbers


def _is_dim_nums(x: Any) -> bool:
    return isinstance(x, MuonDimensionNumbers)


def _dim_nums_per_leaf(weight_dimension_numbers: Any, tree: Any, *, default: Any) -> list[Any]:
    """One ``MuonDimensionNumbers`` (or ``None``) per leaf of ``tree``: ``None`` gives ``default``
    everywhere; a tree may be a prefix of ``tree`` (a value at a node covers every leaf below)."""
    if isinstance(weight_dimension_numbers, _PerLeaf):
        return weight_dimension_numbers.fn(tree)
    given = weight_dimension_numbers(tree) if callable(weight_dimension_numbers) else weight_dimension_numbers
    if given is None:
        return [default] * len(tree_lib.leaves(tree))
    if _is_dim_nums(given):
        return [given] * len(tree_lib.leaves(tree))
    boxed = optree.tree_map(
        lambda x: _Boxed(x),
        given,
        is_leaf=lambda x: x is None or _is_dim_nums(x),
        none_is_leaf=True,
        namespace=tree_lib._NAMESPACE,
    )
    try:
        values = tree_lib.broadcast_leaves(boxed, tree)
    except ValueError:
        raise ValueError(
            f"weight_dimension_numbers do not fit the updates: {tree_lib._uncovered(boxed, tree)}"
        ) from None
    return [v.value if isinstance(v, _Boxed) else v for v in values]


class _Boxed:
    """A dimension-numbers value seen as one opaque pytree leaf (it is itself a NamedTuple)."""

    __slots__ = ("value",)

    def __init__(self, value: Any):
        self.value = value


def _normalize_axes(ndim: int, dim_nums: MuonDimensionNumbers) -> tuple[tuple[int, ...], tuple[int, ...]]:
    reduction = (dim_nums.reduction_axis,) if isinstance(dim_nums.reduction_axis, int) else dim_nums.reduction_axis
    output = (dim_nums.output_axis,) if isinstance(dim_nums.output_axis, int) else dim_nums.output_axis
    return tuple(a % ndim for a in reduction), tuple(a % ndim for a in output)


def _check_matrix(path: str, shape: Sequence[int], dim_nums: MuonDimensionNumbers, owner: str) -> None:
    if len(shape) < 2:
        raise ValueError(
            f"{owner}: leaf {path!r} has shape {tuple(shape)}; Muon orthogonalizes matrices (rank >= 2): "
            "give it None dimension numbers (muon runs AdamW on it) or leave it out"
        )
    reduction, output = _normalize_axes(len(shape), dim_nums)
    if set(reduction) & set(output):
        raise ValueError(
            f"{owner}: leaf {path!r}: reduction axes {reduction} and output axes {output} overlap "
            f"(from {dim_nums}, shape {tuple(shape)})"
        )


def _matrix_view(shape: Sequence[int], dim_nums: MuonDimensionNumbers):
    """``(permutation, (batch, rows, cols), inverse permutation, batch axes)`` of a weight's batched matrices."""
    ndim = len(shape)
    reduction, output = _normalize_axes(ndim, dim_nums)
    batch = tuple(sorted(set(range(ndim)) - set(reduction) - set(output)))
    perm = batch + reduction + output
    inverse = tuple(sorted(range(ndim), key=lambda i: perm[i]))
    flat = (
        math.prod(shape[a] for a in batch),
        math.prod(shape[a] for a in reduction),
        math.prod(shape[a] for a in output),
    )
    return perm, flat, inverse, batch


def _fans(shape: Sequence[int], dim_nums: MuonDimensionNumbers) -> tuple[int, int]:
    reduction, output = _normalize_axes(len(shape), dim_nums)
    return math.prod(shape[a] for a in reduction), math.prod(shape[a] for a in output)


# --------------------------------------------------------------------------- Newton-Schulz


def _ns_step(x: Tensor, a: Tensor, c: Any) -> Tensor:
    """``c0 X + (c1 A + c2 A A) X`` with ``A = X X^H``.

    With the coefficients as numbers (nothing to differentiate), two fused multiply-adds
    (``baddbmm``) instead of four passes of scalings and additions."""
    if isinstance(c, tuple):
        b = torch.baddbmm(a, a, a, beta=c[1], alpha=c[2])
        return torch.baddbmm(x, b, x, beta=c[0])
    b = c[1] * a + c[2] * (a @ a)
    return c[0] * x + b @ x


def _coefficient_rows(coeffs: Tensor, ns_steps: int, x: Tensor) -> list[Any]:
    """One ``(c0, c1, c2)`` per step: Python numbers where no graph or compilation needs tensors."""
    rows = [coeffs] * int(ns_steps) if coeffs.ndim == 1 else list(coeffs.unbind(0))
    if coeffs.device.type == "cpu" and not torch.compiler.is_compiling() and not tree_lib.needs_graph(coeffs, x):
        return [tuple(float(v) for v in row.tolist()) for row in rows]
    return [row.to(device=x.device, dtype=x.dtype) for row in rows]


def _orthogonalize(x: Tensor, coeffs: Tensor, ns_steps: int, preconditioning: str, eps: Any) -> Tensor:
    """The Newton-Schulz orthogonalization of a batch of matrices ``(batch, m, n)``."""
    transposed = x.shape[-2] > x.shape[-1]
    if transposed:
        x = x.mT
    if preconditioning == "frobenius":
        x = x / (torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True) + eps)
    elif preconditioning == "spectral":
        x = x / (torch.linalg.matrix_norm(x, ord=2, keepdim=True) + eps)
    rows = _coefficient_rows(coeffs, ns_steps, x)
    for i, c in enumerate(rows):
        if i == 0 and preconditioning == "aol":
            a = x @ x.mH
            s = torch.rsqrt(torch.clamp(a.abs().sum(dim=-1), min=_PRECONDITION_EPS)).unsqueeze(-1).to(x.dtype)
            x, a = x * s, a * s * s.mT
        elif i == 0 and preconditioning == "schatten":
            a = x @ x.mT
            norm = torch.linalg.vector_norm(a, dim=(-2, -1), keepdim=True)
            s = torch.rsqrt(torch.clamp(norm, min=_PRECONDITION_EPS)).to(x.dtype)
            x, a = x * s, a * s * s
        else:
            a = x @ x.mH
        x = _ns_step(x, a, c)
    return x.mT if transposed else x


def orthogonalize_via_newton_schulz(
    x: Tensor,
    ns_coeffs: Any,
    ns_steps: int = 5,
    preconditioning: str = "frobenius",
    eps: float = 1e-8,
    dimension_numbers: Optional[MuonDimensionNumbers] = None,
) -> Tensor:
    """Approximately orthogonalizes ``x`` (``U S V^T -> U S' V^T`` with ``S'`` near 1) with
    quintic Newton-Schulz iterations, as optax's function of the same name.

    ``ns_coeffs``: ``(3,)`` (used ``ns_steps`` times) or ``(n, 3)`` (one row per step, ``ns_steps``
    ignored). A tensor of rank > 2 needs ``dimension_numbers``; each batch slice is orthogonalized
    on its own.
    """
    if preconditioning not in _PRECONDITIONINGS:
        raise ValueError(f"Unknown preconditioning {preconditioning!r}; expected one of {_PRECONDITIONINGS}")
    if x.ndim != 2 and not _is_dim_nums(dimension_numbers):
        raise ValueError(
            f"orthogonalize_via_newton_schulz: input must be a matrix or dimension_numbers must be given, "
            f"got shape {tuple(x.shape)} and dimension_numbers={dimension_numbers!r}"
        )
    dim_nums = MuonDimensionNumbers() if x.ndim == 2 else dimension_numbers
    coeffs = ns_coeffs if isinstance(ns_coeffs, Tensor) else torch.tensor(ns_coeffs, dtype=torch.float64)
    if coeffs.ndim > 2 or coeffs.shape[-1] != 3:
        raise ValueError(f"Newton-Schulz coefficients must have shape (3,) or (n, 3), got {tuple(coeffs.shape)}")
    _check_matrix("x", x.shape, dim_nums, "orthogonalize_via_newton_schulz")  # type: ignore[arg-type]
    return _orthogonalize_leaf(x, dim_nums, coeffs, ns_steps, preconditioning, eps)  # type: ignore[arg-type]


def _orthogonalize_leaf(x: Tensor, dim_nums: MuonDimensionNumbers, coeffs: Tensor, ns_steps: int, preconditioning: str, eps: Any) -> Tensor:
    perm, flat, inverse, _ = _matrix_view(x.shape, dim_nums)
    unflat = tuple(x.shape[a] for a in perm)
    matrices_ = x.permute(perm).reshape(flat)
    out = _orthogonalize(matrices_, coeffs, ns_steps, preconditioning, eps)
    return out.reshape(unflat).permute(inverse)


# --------------------------------------------------------------------------- scale_by_muon


def _coeffs_tensor(ns_coeffs: Any, ns_steps: int) -> Tensor:
    if isinstance(ns_coeffs, str):
        if ns_coeffs not in _NS_COEFFS_PRESETS:
            raise ValueError(f"Unknown ns_coeffs preset {ns_coeffs!r}; presets: {tuple(_NS_COEFFS_PRESETS)}")
        ns_coeffs = _NS_COEFFS_PRESETS[ns_coeffs]
    coeffs = ns_coeffs.detach().to(torch.float64) if isinstance(ns_coeffs, Tensor) else torch.tensor(ns_coeffs, dtype=torch.float64)
    if coeffs.ndim > 2 or coeffs.ndim == 0 or coeffs.shape[-1] != 3:
        raise ValueError(f"ns_coeffs must have shape (3,) or (n, 3), got {tuple(coeffs.shape)}")
    if coeffs.ndim == 2:
        if not coeffs.shape[0] <= ns_steps:
            raise ValueError(f"Not enough coeffs to perform {ns_steps} steps")  # optax's check, as it is
        coeffs = coeffs[-ns_steps:]
    return coeffs


@takes_spec
def scale_by_muon(
    ns_coeffs: Any = _DEFAULT_NS_COEFFS,
    ns_steps: int = 5,
    beta: float = 0.95,
    eps: float = 1e-8,
    mu_dtype: Optional[torch.dtype] = None,
    *,
    nesterov: bool = True,
    adaptive: bool = False,
    preconditioning: str = "frobenius",
    weight_dimension_numbers: Optional[WeightDimNumOrFn] = None,
    spec: Optional[ShardingSpec] = None,
    strategy: str = "owner",
) -> GradientTransformation:
    """Muon's direction: the momentum, orthogonalized by Newton-Schulz iterations (optax's
    ``scale_by_muon``).

    Per step: ``mu = beta * mu + (1 - beta) * g``; the estimate is ``mu / (1 - beta^t)``, or with
    ``nesterov`` ``beta * mu / (1 - beta^(t+1)) + (1 - beta) * g / (1 - beta^t)``; each matrix of
    it (see ``weight_dimension_numbers``) is scaled to unit Frobenius norm (``preconditioning``:
    or spectral norm, or AOL / Schatten-4 rescaling in the first step) and put through the
    Newton-Schulz steps ``X <- c0 X + (c1 A + c2 A^2) X`` with ``A = X X^T`` (on the wide side).
    With ``adaptive`` the result ``O`` is scaled by ``<estimate, O>`` (the dual norm,
    Bernstein & Newhouse 2024).

    Args:
      ns_coeffs: ``(c0, c1, c2)`` for every step, or one row per step (``(n, 3)``, ``n <= ns_steps``).
      ns_steps: Newton-Schulz steps (ignored for per-step coefficients).
      beta: momentum decay. eps: added to the norm before the first rescaling.
      mu_dtype: dtype of the momentum buffer (default: the params').
      nesterov: Nesterov's estimate. adaptive: scale by the dual norm.
      preconditioning: ``"frobenius"`` (default), ``"spectral"``, ``"aol"`` or ``"schatten"``.
      weight_dimension_numbers: ``MuonDimensionNumbers`` for every leaf, a tree of them (a prefix of
        the params; ``None`` only where the update is ``None``, as ``muon`` masks its AdamW leaves),
        or a callable on the updates returning one. ``None``: every leaf is a matrix.
      spec: the sharding of plain-tensor leaves (DTensor leaves describe themselves): each rank's
        result is then its slice of the result for the whole logical matrix.
      strategy: how sharded matrices are orthogonalized (the numbers are the same): ``"owner"``
        (default), one rank of each shard group per matrix, which sends every rank its slice back
        (two all-to-alls per group and dtype per step, a ``1/k`` share of the Newton-Schulz work,
        about ``2/k`` of the matrix bytes received per rank), or ``"gather"``, every rank rebuilds
        every matrix (one all-gather, ``(k - 1)/k`` of the bytes). See
        :func:`gradtx.sharding.matrices.map_logical`.

    References: Jordan, `modded-nanogpt <https://github.com/KellerJordan/modded-nanogpt>`_, 2024;
    Bernstein & Newhouse, `Old Optimizer, New Norm <https://arxiv.org/abs/2409.20325>`_, 2024.
    """
    owner = "scale_by_muon"
    if strategy not in ("gather", "owner"):
        raise ValueError(f"{owner}: strategy must be 'gather' or 'owner', got {strategy!r}")
    if preconditioning not in _PRECONDITIONINGS:
        raise ValueError(f"{owner}: unknown preconditioning {preconditioning!r}; expected one of {_PRECONDITIONINGS}")
    ns_steps = int(ns_steps)
    beta = fe.number_or_tensor(beta)
    eps = fe.number_or_tensor(eps)
    coeffs0 = _coeffs_tensor(ns_coeffs, ns_steps)

    def init_fn(params: Any) -> MuonState:
        return MuonState(
            count=fe.zero_count(params),
            mu=fe.zeros_like_tree(params, mu_dtype),
            ns_coeffs=coeffs0.to(tree_lib.first_device(params), copy=True),
        )

    def update_fn(updates, state, params=None, *, inplace=False):
        del params
        leaves = fe.leaves_of(updates, what=owner)
        mu = leaves.aligned(state.mu, what=f"{owner}: state.mu")
        dim_nums = _dim_nums_per_leaf(weight_dimension_numbers, updates, default=MuonDimensionNumbers())
        count = fe.increment(state.count, inplace=inplace)
        graph = tree_lib.needs_graph(updates, state, beta)
        b = beta.to(torch.float64) if isinstance(beta, Tensor) else beta
        bc1 = 1.0 - torch.pow(b, count.to(torch.float64))
        bc2 = 1.0 - torch.pow(b, fe.increment(count, inplace=False).to(torch.float64))

        grads, grads_rewrap = dtensor_lib.locals_of(leaves.tensors)
        moms, moms_rewrap = dtensor_lib.locals_of(mu)
        new_mu, estimates = [], []
        for g, m in zip(grads, moms):
            dtype = torch.promote_types(g.dtype, m.dtype)
            # the same ops on both paths, so the donated one gives the same numbers
            if inplace and not graph and m.dtype == dtype:
                m_new = m.mul_(b).add_((1.0 - b) * g.to(dtype))
            else:
                m_new = b * m.to(dtype) + (1.0 - b) * g.to(dtype)
            if nesterov:
                est = b * (m_new / bc2.to(dtype)) + (1.0 - b) * (g.to(dtype) / bc1.to(dtype))
            else:
                est = m_new / bc1.to(dtype)
            new_mu.append(m_new)
            estimates.append(est.to(dtype))

        coeffs = state.ns_coeffs

        def fn(index: int, x: Tensor) -> Tensor:
            out = _orthogonalize_leaf(x, dim_nums[index], coeffs, ns_steps, preconditioning, eps)
            if adaptive:
                out = torch.sum(x.conj() * out) * out
            return out

        def validate(index: int, path: str, shape: tuple[int, ...]) -> None:
            # under sharding this runs before any collective, and every rank gets the error
            if dim_nums[index] is None:
                raise ValueError(f"{owner}: leaf {path!r} has an update but no dimension numbers (None)")
            _check_matrix(path, shape, dim_nums[index], owner)

        def separable(index: int, shape: tuple[int, ...]) -> Sequence[int]:
            return () if adaptive else _matrix_view(shape, dim_nums[index])[3]

        # the estimates in the updates' tree, so that a spec's path rules apply to them
        directions = matrices.map_logical(
            leaves.rebuild(grads_rewrap(estimates)),
            fn,
            spec,
            what=owner,
            separable=separable,
            validate=validate,
            strategy=strategy,
        )
        if mu_dtype is not None:
            new_mu = [m if m.dtype == mu_dtype else m.to(mu_dtype) for m in new_mu]
        return directions, MuonState(
            count=count,
            mu=leaves.rebuild(moms_rewrap(new_mu), like=state.mu),
            ns_coeffs=coeffs if inplace else coeffs.clone(),  # a new state shares no storage with the old
        )

    return GradientTransformation(init_fn, update_fn)


@takes_spec
def scale_by_shape(
    weight_dimension_numbers: Optional[WeightDimNumOrFn] = None,
    consistent_rms: Optional[float] = None,
    *,
    spec: Optional[ShardingSpec] = None,
) -> GradientTransformation:
    """Scales each matrix update by a factor of its logical shape (optax's ``scale_by_shape``):
    ``sqrt(max(1, fan_out / fan_in))`` (Jordan's width scaling), or with ``consistent_rms``
    ``sqrt(max(fan_in, fan_out)) * consistent_rms`` (Liu et al. 2025, RMS matching AdamW's at 0.2).
    Fans come from ``weight_dimension_numbers`` as in :func:`scale_by_muon`; under ``spec`` or
    DTensors they are those of the whole logical matrix (no communication)."""
    owner = "scale_by_shape"

    def update_fn(updates, state, params=None, *, inplace=False):
        del params
        leaves = fe.leaves_of(updates, what=owner)
        dim_nums = _dim_nums_per_leaf(weight_dimension_numbers, updates, default=MuonDimensionNumbers())
        shapes = matrices.logical_shapes(updates, spec, what=owner)
        outs = []
        for i, u in zip(leaves.present, leaves.tensors):
            if dim_nums[i] is None:
                raise ValueError(f"{owner}: leaf {tree_lib.path_at(updates, i)!r} has an update but no dimension numbers (None)")
            fan_in, fan_out = _fans(shapes[i], dim_nums[i])
            if consistent_rms is not None:
                factor = math.sqrt(max(fan_in, fan_out)) * consistent_rms
            else:
                factor = math.sqrt(max(1.0, fan_out / fan_in))
            local = dtensor_lib.local(u)
            scaled = local.mul_(factor) if inplace and not tree_lib.needs_graph(local, factor) else local * factor
            outs.append(scaled)
        _, rewrap = dtensor_lib.locals_of(leaves.tensors)
        return leaves.rebuild(rewrap(outs)), state

    return GradientTransformation(init_empty_state, update_fn)


# --------------------------------------------------------------------------- muon


@takes_spec
def muon(
    learning_rate: ScalarOrSchedule,
    ns_coeffs: Any = _DEFAULT_NS_COEFFS,
    ns_steps: int = 5,
    beta: float = 0.95,
    eps: float = 1e-8,
    weight_decay: ScalarOrSchedule = 0.0,
    weight_decay_mask: Optional[Any] = None,
    mu_dtype: Optional[torch.dtype] = None,
    *,
    nesterov: bool = True,
    adaptive: bool = False,
    preconditioning: str = "frobenius",
    adam_b1: float = 0.9,
    adam_b2: float = 0.999,
    adam_eps_root: float = 0.0,
    adam_weight_decay: ScalarOrSchedule = 0.0,
    adam_learning_rate: Optional[ScalarOrSchedule] = None,
    muon_weight_dimension_numbers: Optional[WeightDimNumOrFn] = None,
    consistent_rms: Optional[float] = None,
    spec: Optional[ShardingSpec] = None,
    strategy: str = "owner",
) -> GradientTransformation:
    """Muon: momentum orthogonalized by Newton-Schulz iterations, for the matrices of a network.

    Each matrix keeps a momentum ``mu = beta * mu + (1 - beta) * g`` and steps along its
    (Nesterov, bias-corrected) estimate made orthogonal: scaled to unit Frobenius norm, then put
    through ``ns_steps`` Newton-Schulz iterations ``X <- c0 X + (c1 A + c2 A^2) X``, ``A = X X^T``,
    which drive every singular value towards 1, approximating ``U V^T`` of the SVD ``U S V^T``
    without computing it. The result is scaled by ``sqrt(max(1, fan_out / fan_in))``, then
    ``-learning_rate`` times it and ``weight_decay * param`` is the update:
    ``chain(scale_by_muon, scale_by_shape, add_decayed_weights(weight_decay, weight_decay_mask),
    scale_by_learning_rate(learning_rate))``. Every other leaf (biases and other vectors, and
    any leaf whose dimension numbers are ``None``) takes ``adamw(adam_learning_rate or learning_rate,
    adam_b1, adam_b2, eps, adam_eps_root, mu_dtype, weight_decay=adam_weight_decay,
    nesterov=nesterov)``, as in optax.contrib's ``muon``. With ``spec`` (or DTensor leaves) every
    matrix is orthogonalized as the whole logical matrix, exactly, whatever the sharding.

    Args:
      learning_rate: the step size: a number, a 0-d tensor, or a schedule called with the step
        count (see :mod:`gradtx.schedules`).
      ns_coeffs: the Newton-Schulz coefficients ``(c0, c1, c2)`` for every step, one row per
        step (``(n, 3)``), or a preset name: ``"standard"`` (the default's) or ``"dion"`` (five
        per-step rows, from Dion).
      ns_steps: the number of Newton-Schulz steps (ignored for per-step coefficients).
      beta: the decay of the momentum.
      eps: added to the norm before the first rescaling; also AdamW's ``eps`` for the other
        leaves.
      weight_decay: the rate of the decoupled weight decay of the matrices: each step also
        subtracts ``learning_rate * weight_decay * param``. A number, a 0-d tensor or a schedule.
      weight_decay_mask: the matrices to decay: a tree of bools like the params (or a prefix of
        it), or a callable ``params -> such a tree``; ``None`` decays every matrix.
      mu_dtype: the dtype of the momentum's buffer, and of AdamW's first moment (``None``: the
        params' dtype).
      nesterov: use Nesterov's estimate of the momentum (for AdamW too).
      adaptive: scale each orthogonalized matrix ``O`` by ``<estimate, O>``, the dual norm of
        the momentum (Bernstein & Newhouse).
      preconditioning: how a matrix is normalised before the iterations: ``"frobenius"``,
        ``"spectral"`` (its spectral norm), ``"aol"`` or ``"schatten"`` (a rescaling folded into
        the first iteration).
      adam_b1: AdamW's ``b1`` for the other leaves.
      adam_b2: AdamW's ``b2`` for the other leaves.
      adam_eps_root: AdamW's ``eps_root`` for the other leaves.
      adam_weight_decay: AdamW's weight decay for the other leaves: a number, a 0-d tensor or a
        schedule.
      adam_learning_rate: AdamW's learning rate for the other leaves (``None``:
        ``learning_rate``).
      muon_weight_dimension_numbers: which leaves are matrices, and which of their axes form
        the matrix: one :class:`MuonDimensionNumbers` per leaf, a tree of them (``None`` where a
        leaf goes to AdamW), or a callable ``params -> such a tree``; ``None`` makes the 2-D
        leaves the matrices.
      consistent_rms: scale by ``sqrt(max(fan_in, fan_out)) * consistent_rms`` instead, which
        gives updates the RMS of AdamW's (``0.2``, Liu et al.); ``None`` for the default scaling.
      spec: a :class:`gradtx.sharding.ShardingSpec` describing how plain-tensor leaves are
        sharded (DTensor leaves need none): each rank's update is then its slice of Muon's
        update of the whole logical matrix.
      strategy: how a sharded matrix is orthogonalized (the numbers are the same):
        ``"owner"``, by one rank of its shard group, which sends the slices back (two
        all-to-alls per group and dtype per step), or ``"gather"``, by every rank after an
        all-gather. See :func:`scale_by_muon`.

    Returns:
      The optimizer, a :class:`~gradtx.GradientTransformation`.

    References:
      Jordan et al., `Muon: An optimizer for hidden layers in neural networks
      <https://kellerjordan.github.io/posts/muon/>`_, 2024

      Liu et al., `Muon is Scalable for LLM Training <https://arxiv.org/abs/2502.16982>`_, 2025

      Bernstein & Newhouse, `Old Optimizer, New Norm: An Anthology
      <https://arxiv.org/abs/2409.20325>`_, 2024

    Examples:
      >>> import torch
      >>> import gradtx as gtx
      >>> def f(params):  # smallest at 0; Muon moves the matrix, AdamW the vector
      ...     return (params["w"] ** 2).sum() + (params["b"] ** 2).sum()
      >>> params = {"w": torch.tensor([[1.0, 2.0], [3.0, 4.0]]), "b": torch.tensor([1.0, -1.0])}
      >>> tx = gtx.contrib.muon(learning_rate=0.1)
      >>> state = tx.init(params)
      >>> for _ in range(5):
      ...     grads = torch.func.grad(f)(params)
      ...     updates, state = tx.update(grads, state, params)
      ...     params = gtx.apply_updates(params, updates)
      ...     print(f"{f(params):.4f}")
      30.6252
      29.4897
      28.4502
      27.4871
      26.5963
    """
    check_learning_rate(learning_rate, "muon")
    if adam_learning_rate is None:
        adam_learning_rate = learning_rate
    if isinstance(ns_coeffs, str):
        if ns_coeffs not in _NS_COEFFS_PRESETS:
            raise ValueError(f"Unknown ns_coeffs preset {ns_coeffs!r}; presets: {tuple(_NS_COEFFS_PRESETS)}")
        ns_coeffs = _NS_COEFFS_PRESETS[ns_coeffs]

    if muon_weight_dimension_numbers is None:
        def dims_of(tree):
            return [MuonDimensionNumbers() if leaf is not None and leaf.ndim == 2 else None for leaf in tree_lib.leaves(tree)]
    else:
        def dims_of(tree):
            return _dim_nums_per_leaf(muon_weight_dimension_numbers, tree, default=None)

    def labels(tree):
        return tree_lib.unflatten(tree_lib.structure(tree), ["muon" if d is not None else "adam" for d in dims_of(tree)])

    dims_fn = _PerLeaf(dims_of)
    return partition(
        {
            "muon": chain(
                scale_by_muon(
                    ns_coeffs=ns_coeffs,
                    ns_steps=ns_steps,
                    beta=beta,
                    eps=eps,
                    mu_dtype=mu_dtype,
                    nesterov=nesterov,
                    adaptive=adaptive,
                    preconditioning=preconditioning,
                    weight_dimension_numbers=dims_fn,
                    spec=spec,
                    strategy=strategy,
                ),
                scale_by_shape(weight_dimension_numbers=dims_fn, consistent_rms=consistent_rms, spec=spec),
                gradtx.add_decayed_weights(weight_decay, weight_decay_mask),
                gradtx.scale_by_learning_rate(learning_rate),
            ),
            "adam": gradtx.adamw(
                learning_rate=adam_learning_rate,
                b1=adam_b1,
                b2=adam_b2,
                eps=eps,
                eps_root=adam_eps_root,
                weight_decay=adam_weight_decay,
                mu_dtype=mu_dtype,
                nesterov=nesterov,
            ),
        },
        labels,
    )


class _PerLeaf:
    """Dimension numbers already resolved to one value per leaf, by ``fn(tree) -> list``."""

    __slots__ = ("fn",)

    def __init__(self, fn: Callable[[Any], list[Any]]):
        self.fn = fn
