"""Observing an optimizer: per-group statistics of what it sees and does, exact under sharding.

``observe(inner, groups="module", spec=spec)`` runs ``inner`` (any transformation or chain) and
records, for every group of leaves and for all leaves together: the norm of the gradients entering,
the largest ``|g|`` and the number of non-finite gradient elements; the norms of the updates
``inner`` returned at the step before and of the params that step was given, and their ratio;
and, when ``inner`` is or contains a ``clip_by_global_norm``, its norm, coefficient and whether it
clipped. The updates are ``inner``'s, untouched. :func:`observations` turns the state into a flat
``{"grad_norm/layers.3": float}`` dict for a logger (the only host sync).

Under a ``ShardingSpec`` or DTensor leaves every number is that of the logical (unsharded) tensors,
each element counted once, as :func:`gradtx.global_norm` counts it, and every rank holds the same
numbers. All statistics of a step travel in one all-reduce, run *before* ``inner``: so the update
and param statistics reported at a step are those of the step before (this rank's share of them
waits in the state until then: the params' sums are taken in the step's passes, after ``inner``,
and need no pass of their own before it), and a ``clip_by_global_norm`` that sees ``inner``'s
input first (``inner`` itself, or the first member of a ``chain`` / ``named_chain``, inside
``inject_hyperparams`` too: see :class:`gradtx.base.LeadingClip`) is handed its global norm from
that same all-reduce instead of reducing its own: one collective per step, the clip's numbers bit
for bit those it computes alone.
Nothing is communicated when nothing is sharded; such a clip (of order 2 or ``inf``) then takes its
norm from the statistics' per-leaf norms, the gradients being read for the norm once. Eagerly, with
nothing sharded and float32 CPU tensors, the other statistics ride in the step's own passes
(:mod:`gradtx.native.observed`): ``max |g|`` where a leading 2-norm clip scales the gradients, the
params' and updates' sums of squares in the Adam kernel's loop. Under sharding the gradients'
statistics are read in one pass over each (their sums of squares are the ones the sharded clip's
norm adds up), the params' and updates' in the Adam kernel's loop.
"""

from __future__ import annotations

import contextlib
import fnmatch
import math
import re
from typing import Any, Callable, Mapping, NamedTuple, Optional, Sequence, Union

import numpy as np
import torch
from torch import Tensor

from gradtx import sharding
from gradtx import torch_internals
from gradtx import tree as tree_lib
from gradtx.base import (
    runs_inner,
    takes_spec,
    GradientTransformation,
    GradientTransformationExtraArgs,
    LeadingClip,
    leading_clip,
    returns_new_updates,
    supports_donated_updates,
    takes_donated_updates,
    takes_extra_args,
    with_inplace,
)
from gradtx.chains.chain import _PARTS
from gradtx.native import observed as native_observed
from gradtx.sharding import dtensor as dtensor_lib
from gradtx.sharding import statistics as stats_lib
from gradtx.sharding.plan import _layout_key
from gradtx.sharding.spec import nearest_paths
from gradtx.state_dims import rank_shares

PyTree = Any
Groups = Union[None, str, int, Sequence[Union[str, tuple[str, str]]], Callable[[str], Optional[str]]]

STATISTICS = ("grad_norm", "prev_update_norm", "prev_param_norm", "prev_update_ratio", "grad_max", "grad_nonfinite")


class ObservedStats(NamedTuple):
    """One group's statistics (0-d tensors): the gradients' of the last step, the updates' and
    params' of the step before.

    ``grad_norm``: L2 norm of the updates entering ``inner`` (the gradients); ``prev_update_norm``:
    of the updates ``inner`` returned at the step *before* (NaN at the first step);
    ``prev_param_norm``: of the params passed to ``update`` at the step before (NaN at the first
    step, and when none were passed); ``prev_update_ratio``: ``prev_update_norm`` over
    ``prev_param_norm`` (the update over the params it was computed for); ``grad_max``: the
    largest ``|g|`` (NaN when a gradient element is NaN); ``grad_nonfinite``: how many gradient
    elements are NaN or infinite (int64).

    The update and param statistics are one step late so that all of a step's statistics, and the
    norm of a leading clip, reduce in the one all-reduce that runs before ``inner`` (see
    :func:`observe`), and the params' sums are read in the passes ``inner`` makes over them.
    """

    grad_norm: Tensor
    prev_update_norm: Tensor
    prev_param_norm: Tensor
    prev_update_ratio: Tensor
    grad_max: Tensor
    grad_nonfinite: Tensor


class ObservedClip(NamedTuple):
    """The first ``clip_by_global_norm`` of ``inner`` at the last step: the norm it saw, the factor it
    scaled by (``min(1, max_norm / (norm + 1e-6))``), and whether that factor was below 1."""

    norm: Tensor
    coefficient: Tensor
    clipped: Tensor


@rank_shares("pending_sq")
class ObserveState(NamedTuple):
    """``inner_state``: ``inner``'s state; ``total``: the statistics of all leaves together;
    ``groups``: group name -> its statistics (every group of every rank, in the same order on every
    rank); ``clip``: the clip's statistics, or ``None`` when ``inner`` has no global-norm clip;
    ``pending_sq``: this rank's share (float64, shape ``(2, 1 + groups)``: rows updates, params;
    columns total, group 0, ...; not yet reduced) of the squared norms of the updates ``inner``
    returned at the last step and of the params it was given, reduced with the next step's
    statistics and reported there as ``prev_update_norm`` and ``prev_param_norm`` (NaN before the
    first step, and at the first step after a state of a sharded run was loaded from a checkpoint:
    see :func:`gradtx.state_dims.rank_shares`)."""

    inner_state: Any
    total: ObservedStats
    groups: dict[str, ObservedStats]
    clip: Optional[ObservedClip]
    pending_sq: Tensor


# --------------------------------------------------------------------------- grouping


def _module_of(path: str) -> str:
    """``"layers.3.attn.weight"`` -> ``"layers.3.attn"`` (a top-level leaf is its own group)."""
    head, _, _ = path.rpartition(".")
    return head or path


def _prefix(depth: int) -> Callable[[str], str]:
    def prefix(path: str) -> str:
        return ".".join(path.split(".")[:depth])

    return prefix


class _Grouping:
    """How leaf paths map to group names: ``assign(paths)`` and the check for unused glob rules."""

    def __init__(self, groups: Groups, owner: str):
        self.owner = owner
        self.rules: Optional[list[tuple[str, re.Pattern, str]]] = None
        self.fn: Optional[Callable[[str], Any]] = None
        if groups is None:
            self.fn = lambda path: None
        elif groups == "module":
            self.fn = _module_of
        elif isinstance(groups, int) and not isinstance(groups, bool):
            if groups < 1:
                raise ValueError(f"{owner}: a depth given as groups must be >= 1, got {groups}")
            self.fn = _prefix(groups)
        elif isinstance(groups, str):
            raise ValueError(f"{owner}: groups={groups!r}: the only string accepted is 'module' (give globs as a list)")
        elif isinstance(groups, (list, tuple)):
            self.rules = []
            for rule in groups:
                if isinstance(rule, str):
                    glob, name = rule, rule
                elif isinstance(rule, tuple) and len(rule) == 2 and all(isinstance(x, str) for x in rule):
                    glob, name = rule
                else:
                    raise TypeError(f"{owner}: a group rule must be a glob or a (glob, group name) pair of strings, got {rule!r}")
                self.rules.append((glob, re.compile(fnmatch.translate(glob)), name))
        elif callable(groups):
            self.fn = groups
        else:
            raise TypeError(
                f"{owner}: groups must be None, 'module', a depth (int), a list of globs or (glob, name) pairs, "
                f"or a callable path -> group name; got {type(groups).__name__}"
            )

    def assign(self, paths: Sequence[str]) -> stats_lib.Assignment:
        named: list[Optional[str]] = []
        matched: set[str] = set()
        try:
            for path in paths:
                if self.rules is not None:
                    name = None
                    for glob, pattern, group in self.rules:
                        if pattern.match(path):
                            name = group
                            matched.add(glob)
                            break
                else:
                    name = self.fn(path)  # type: ignore[misc]
                    if name is not None and not isinstance(name, str):
                        raise TypeError(
                            f"{self.owner}: the groups callable returned {name!r} (a {type(name).__name__}) for leaf "
                            f"{path!r}; it must return a group name (str) or None"
                        )
                named.append(name)
        except Exception as exc:  # noqa: BLE001 - reported on every rank alike
            return [None] * len(paths), matched, exc
        return named, matched, None

    def check_unused(self, matched: set[str], paths: Sequence[str]) -> Optional[Exception]:
        if self.rules is None:
            return None
        unused = [glob for glob, _, _ in self.rules if glob not in matched]
        if not unused:
            return None
        listed = "; ".join(
            f"glob {glob!r} matches no leaf path (the nearest: {', '.join(repr(p) for p in nearest_paths(glob, paths)) or 'none'})"
            for glob in unused
        )
        return ValueError(f"{self.owner}: {listed}")


# --------------------------------------------------------------------------- the clip


def _find_clip(inner: GradientTransformation) -> Optional[tuple[Callable[[Any], Tensor], Callable[[Any, Tensor], Tensor]]]:
    """``(norm_of(inner_state), coefficient(inner_state, norm))`` of ``inner``'s clip: its leading
    clip (see :class:`~gradtx.base.LeadingClip`), else the first ``clip_by_global_norm`` among a
    ``chain``'s members; ``None`` when there is neither."""
    lead = leading_clip(inner)
    if lead is not None:
        return lead.norm_of, lead.coefficient
    for index, part in enumerate(getattr(inner.init, _PARTS, ())):
        clip = leading_clip(part)
        if clip is not None:
            return (lambda state, i=index, c=clip: c.norm_of(state[i])), (lambda state, norm, i=index, c=clip: c.coefficient(state[i], norm))
    return None


def _clip_stats(found: Any, inner_state: Any, dtype: torch.dtype, norm: Optional[Tensor] = None) -> Optional[ObservedClip]:
    if found is None:
        return None
    norm_of, coefficient = found
    if norm is None:
        norm = norm_of(inner_state)
    coef = coefficient(inner_state, norm)
    return ObservedClip(norm.detach().to(dtype), coef.detach().to(dtype), (coef < 1.0).detach())


def _host_clip_stats(found: Any, inner_state: Any, dtype: torch.dtype, norm: Tensor, extremes: _Extremes) -> Optional[ObservedClip]:
    """:func:`_clip_stats` of a leading clip whose float32 coefficient the step's passes took
    (``extremes``): its value as they multiplied by it, made into tensors from host floats, where
    :func:`_clip_stats` computes it again in tensor ops."""
    factor = extremes.host_factor() if norm.dtype == torch.float32 and norm.is_cpu else None
    if found is None or factor is None:
        return _clip_stats(found, inner_state, dtype, norm)
    return ObservedClip(
        torch.scalar_tensor(norm.item(), dtype=dtype), torch.scalar_tensor(factor, dtype=dtype), torch.scalar_tensor(factor < 1.0, dtype=torch.bool)
    )


# --------------------------------------------------------------------------- the transformation


def _param_sq(layout: stats_lib.GroupLayout, counted_params: Optional[list[Any]], device: torch.device, tally: Any = None) -> Tensor:
    """The params' ``[total, per group]`` sums of squares (NaN when no params were given)."""
    if counted_params is None:
        return torch.full((len(layout.names) + 1,), float("nan"), dtype=torch.float64, device=device)
    return stats_lib.squared_sums(layout, counted_params, device, tally)


def _check_gradients(layout: stats_lib.GroupLayout, grads: Sequence[Any]) -> None:
    """A ``TypeError`` naming the first gradient that is a tensor of neither a floating-point nor a
    complex dtype."""
    for path, g in zip(layout.paths, grads):
        if isinstance(g, Tensor) and not (g.dtype.is_floating_point or g.dtype.is_complex):
            raise TypeError(f"leaf {path!r} is a {g.dtype} tensor; observe's gradients must be floating point or complex")


def _on_host(device: torch.device, grads: Sequence[Any], params: Optional[Sequence[Any]]) -> bool:
    """Whether the statistics of these leaves can be finished on the host: eagerly, with every
    tensor on the CPU (reading a value there waits for nothing)."""
    return (
        device.type == "cpu"
        and not torch_internals.functorch_active()
        and all(leaf.is_cpu for leaves in (grads, params or ()) for leaf in leaves if isinstance(leaf, Tensor))
    )


def _apart(params: list[Any], updates: list[Any], state: Any) -> bool:
    """Whether no param shares memory with a donated update (``updates``: the leaves) or a tensor
    of ``state``."""
    written = dtensor_lib.storage_pointers(updates) | dtensor_lib.storage_pointers(tree_lib.leaves(state))
    return not written & dtensor_lib.storage_pointers(params)


class _Extremes:
    """``max |g|`` and the non-finite counts of the gradients, read where a leading clip scales them:
    :meth:`scale` is the clip's :data:`gradtx.base.Scaling`; :meth:`absorbed` takes them from a
    kernel that took the clip's product itself (the Adam step after a clip, in a
    :func:`~gradtx.chain`), a group of leaves at a time; :meth:`of` gives them afterwards."""

    def __init__(self, device: torch.device):
        self.device = device
        # (tensors, their maxima, their counts): tensors from a scaling, host floats from a kernel
        self.parts: list[tuple[list[Tensor], Any, Any]] = []
        self.factors: list[Any] = []  # the clip's coefficient as each part was scaled by it

    def scale(self, tensors: list[Tensor], coefficient: Tensor, inplace: bool) -> list[Tensor]:
        done = native_observed.scale_observed(tensors, coefficient, inplace=inplace)
        if done is None:  # the ATen ops: the extremes first, before any gradient is overwritten
            maxima, counts = stats_lib.extremes_of(list(tensors), self.device)
            scaled = tree_lib.scale_(tensors, coefficient, inplace=inplace)
        else:
            scaled, maxima, counts = done
        self.parts.append((list(tensors), maxima, counts))
        self.factors.append(coefficient)
        return scaled

    __call__ = scale  # the Scaling itself, so a kernel that takes the product finds :meth:`absorbed`

    def absorbed(self, tensors: list[Tensor], maxima: list[float], counts: list[int], factor: float) -> None:
        self.parts.append((list(tensors), maxima, [float(c) for c in counts]))
        self.factors.append(factor)

    def host_factor(self) -> Optional[float]:
        """The one float32 coefficient every part was scaled by, as a host float; ``None`` when the
        parts disagree, or one was scaled by another dtype's."""
        values = set()
        for factor in self.factors:
            if isinstance(factor, Tensor):
                if factor.dtype != torch.float32 or not factor.is_cpu or factor.numel() != 1:
                    return None
                factor = factor.item()
            values.add(factor)
        return values.pop() if len(values) == 1 else None

    def of(self, tensors: list[Tensor]) -> tuple[Tensor, Tensor]:
        """Each tensor's ``max |g|`` and non-finite count, as tensors on the device."""
        parts = [
            tuple(torch.tensor(x, dtype=torch.float64) if isinstance(x, list) else x for x in (maxima, counts))
            for _, maxima, counts in self.parts
        ]
        located = self._located(tensors)
        if located is None:
            maxima, counts = parts[0]
        else:
            maxima = torch.stack([parts[k][0][j].to(torch.float64) for k, j in located])
            counts = torch.stack([parts[k][1][j].to(torch.float64) for k, j in located])
        return maxima.to(self.device), counts.to(device=self.device, dtype=torch.float64)

    def host_of(self, tensors: list[Tensor]) -> tuple[list[float], list[float]]:
        """:meth:`of` as host floats (where a scaling's tensors hold them, they are read: CPU only)."""
        parts = [tuple(x if isinstance(x, list) else x.tolist() for x in (maxima, counts)) for _, maxima, counts in self.parts]
        located = self._located(tensors)
        if located is None:
            return parts[0][0], [float(c) for c in parts[0][1]]
        return [parts[k][0][j] for k, j in located], [float(parts[k][1][j]) for k, j in located]

    def _located(self, tensors: list[Tensor]) -> Optional[list[tuple[int, int]]]:
        """Each tensor's (part, index) in :attr:`parts`; ``None`` when one part holds them all, in order."""
        if len(self.parts) == 1 and len(self.parts[0][0]) == len(tensors) and all(a is b for a, b in zip(tensors, self.parts[0][0])):
            return None
        where = {id(t): (k, j) for k, (seen, _, _) in enumerate(self.parts) for j, t in enumerate(seen)}
        found = [where.get(id(t)) for t in tensors]
        if None in found or sum(len(seen) for seen, _, _ in self.parts) != len(tensors):
            raise RuntimeError("observe: the leading clip scaled other tensors than the gradients observe was given")
        return found  # type: ignore[return-value]


def _stats_of(sums: Tensor, maxima: Tensor, column: int, dtype: torch.dtype) -> ObservedStats:
    grad, update, param = (sums[k, column].sqrt().to(dtype) for k in range(3))
    return ObservedStats(grad, update, param, update / param, maxima[column].to(dtype), sums[3, column].to(torch.int64))


def _all_stats(sums: Tensor, maxima: Tensor, dtype: torch.dtype) -> list[ObservedStats]:
    """:func:`_stats_of` of every column (total, then the groups). Eagerly on the CPU the values are
    read back and finished on the host (:func:`_host_stats`), so each statistic is still a tensor of
    its own, made from its value, instead of six operations per group."""
    if torch.compiler.is_compiling() or sums.device.type != "cpu" or torch_internals.functorch_active():
        return [_stats_of(sums, maxima, column, dtype) for column in range(sums.shape[1])]
    return _host_stats(sums.tolist(), maxima.tolist(), dtype)


def _host_stats(rows: list[list[float]], maxima: list[float], dtype: torch.dtype) -> list[ObservedStats]:
    """:func:`_stats_of` of every column, from host floats: ``rows`` are the float64 sums (gradients'
    squares, the previous updates' squares, the previous params' squares, non-finite counts),
    ``maxima`` the ``max |g|``, one value per column. The same roundings as the tensor ops (a float64
    square root, one rounding to ``dtype``, the ratio divided in ``dtype``), in numpy's vector ops."""
    kind = np.float32 if dtype == torch.float32 else np.float64
    with np.errstate(all="ignore"):  # overflow to inf and 0 / 0 as the tensor ops give them
        roots = np.sqrt(np.array(rows[:3], dtype=np.float64)).astype(kind)
        ratios = roots[1] / roots[2]
        largest = np.array(maxima, dtype=np.float64).astype(kind)
    return [
        ObservedStats(*(torch.scalar_tensor(value, dtype=dtype) for value in values[:5]), torch.scalar_tensor(int(values[5]), dtype=torch.int64))
        for values in zip(*roots.tolist(), ratios.tolist(), largest.tolist(), rows[3])
    ]


def _empty_stats(device: torch.device, dtype: torch.dtype) -> ObservedStats:
    """Statistics before the first step; each a tensor of its own, as a step's are."""

    def zero() -> Tensor:
        return torch.zeros((), dtype=dtype, device=device)

    def nan() -> Tensor:
        return torch.full((), float("nan"), dtype=dtype, device=device)

    return ObservedStats(zero(), nan(), nan(), nan(), zero(), torch.zeros((), dtype=torch.int64, device=device))


def _fusable(lead: Optional[LeadingClip], layout: stats_lib.GroupLayout, spec: Any) -> Optional[str]:
    """How the leading clip's norm can come from the statistics: ``"reduced"`` from their all-reduce
    (something is sharded and the clip lays the gradients out as they do), ``"local"`` from their
    per-leaf norms (nothing is sharded, for the clip either, and its norm is a 2- or inf-norm);
    ``None``: the clip computes its own."""
    if lead is None or lead.spec is not spec:
        return None
    if layout.plan is None:
        return "local" if lead.norm_type in (2.0, math.inf) else None
    return "reduced" if layout.plan.global_group() is not None else None


@takes_spec
def observe(
    inner: GradientTransformation, groups: Groups = None, spec: Optional[sharding.ShardingSpec] = None
) -> GradientTransformation:
    """Runs ``inner`` and records per-group statistics of its gradients, updates and params.

    Args:
      inner: any transformation or chain; its updates are returned as they are (the same tensors).
      groups: how leaves form groups, besides the total of all leaves: ``None`` (the total only);
        ``"module"`` (a leaf's path without its last part: ``"layers.3.attn"``); a depth ``n`` (the
        first ``n`` parts: ``2`` gives ``"layers.3"`` per layer); a list of globs (``fnmatch``,
        ``*`` crosses dots, as :class:`~gradtx.sharding.ShardingSpec`'s rules) or ``(glob, name)``
        pairs, matched in order, each leaf joining the first that matches (a glob that matches no
        leaf, on any rank, is a ``ValueError``); or a callable ``path -> group name or None``.
        Leaves in no group still count in the total.
      spec: how the gradients are sharded (DTensors need none): every statistic is then that of the
        logical tensors, identical on every rank, with one all-reduce per step, a leading clip's
        included when it has the same ``spec``. A leading clip with a spec beside no ``spec`` here
        is a ``ValueError``.

    The state is an :class:`ObserveState`; read it with :func:`observations`. The gradient
    statistics belong to the step that produced the state; ``prev_update_norm``,
    ``prev_param_norm`` and ``prev_update_ratio`` to the step before (NaN after the first step):
    the statistics reduce before ``inner`` runs, in the all-reduce that also gives a leading
    ``clip_by_global_norm`` its norm, and the params' sums of squares are taken in ``inner``'s own
    passes over them, so reading them costs no pass before the step. Leaves whose gradient is
    ``None`` are left out.
    """
    if not isinstance(inner, GradientTransformation):
        raise TypeError(f"observe: inner must be a GradientTransformation, got {type(inner).__name__}")
    if spec is not None and not isinstance(spec, sharding.ShardingSpec):
        raise TypeError(f"observe: spec must be a gradtx.sharding.ShardingSpec or None, got {type(spec).__name__}")
    grouping = _Grouping(groups, "observe")
    inner_update = with_inplace(inner)
    extra = takes_extra_args(inner)
    clip = _find_clip(inner)
    lead = leading_clip(inner)
    if spec is None and lead is not None and lead.spec is not None:
        raise ValueError(
            "observe: its leading clip_by_global_norm has a ShardingSpec and observe has none, so the statistics "
            "would be of this rank's pieces only: pass the same spec to observe (observe(inner, spec=spec))"
        )
    layouts: dict[Any, stats_lib.GroupLayout] = {}

    def layout_of(tree: PyTree, tree_leaves: Optional[list[Any]] = None, structure: Any = None) -> stats_lib.GroupLayout:
        """The groups of ``tree`` (``tree_leaves`` and ``structure``: its flattening, when at hand)."""
        if tree_leaves is None or structure is None:
            tree_leaves, structure = tree_lib.leaves(tree), tree_lib.structure(tree)
        # eagerly through the paths' cache; traced, built anew (Dynamo traces through the cache)
        paths = tree_lib._structure_paths.__wrapped__(structure) if torch.compiler.is_compiling() else tree_lib._structure_paths(structure)
        key = (paths, _layout_key(tree_leaves))
        layout = layouts.get(key)
        if layout is None:
            if torch.compiler.is_compiling():
                raise ValueError(
                    "observe: under torch.compile met a gradient tree no eager call has seen; run the step once "
                    "eagerly before compiling (gradtx.compile_step does this for you)"
                )
            known = layouts.get(paths)  # the same leaves, other None leaves: the same groups
            if known is None:
                layout = layouts[paths] = stats_lib.layout_groups(tree, spec, grouping.assign, grouping.check_unused, what="observe")
            else:
                layout = stats_lib.relayout(known, tree, spec, grouping.assign, grouping.check_unused, what="observe")
            layouts[key] = layout
        return layout

    def init_fn(params: PyTree) -> ObserveState:
        inner_state = inner.init(params)
        layout = layout_of(params)
        tensors = [leaf for leaf in tree_lib.leaves(params) if isinstance(leaf, Tensor)]
        dtype = tree_lib.accumulation_dtype(tree_lib.real_dtypes(params)) if tensors else torch.float32
        device = stats_lib.local_device(tree_lib.leaves(params), layout.plan)
        # tensors of their own, as every step's are: a state whose leaves alias one another would
        # not match the guards of a step compiled for the states steps return (a second compilation)
        clip_stats = None
        if clip is not None:
            clip_stats = ObservedClip(*(torch.zeros((), dtype=kind, device=device) for kind in (dtype, dtype, torch.bool)))
        pending = torch.full((2, len(layout.names) + 1), float("nan"), dtype=torch.float64, device=device)
        groups = {name: _empty_stats(device, dtype) for name in layout.names}
        return ObserveState(inner_state, _empty_stats(device, dtype), groups, clip_stats, pending)

    def update_fn(updates, state, params=None, *, inplace=False, **extra_args):
        # eagerly the updates are flattened once for all that follows; traced, as Dynamo traces best
        grads, structure = tree_lib.flatten(updates) if not torch.compiler.is_compiling() else (tree_lib.leaves(updates), None)
        layout = layout_of(updates, grads, structure)
        device = stats_lib.local_device(grads, layout.plan)
        eager = not torch.compiler.is_compiling()
        # under sharding a rank that fails here still joins the one all-reduce, with an error bit:
        # every rank then raises its error instead of the others waiting for it
        collective = eager and layout.plan is not None and layout.plan.global_group() is not None
        error: Optional[Exception] = None
        counted_params = None
        try:
            _check_gradients(layout, grads)
            if params is not None:
                expected = structure if structure is not None else tree_lib.structure(updates)
                param_leaves = tree_lib.flatten_like(params, expected, updates, what="observe: params", like="updates")
                counted_params = [p if g is not None else None for p, g in zip(param_leaves, grads)]
        except (TypeError, ValueError) as exc:
            if not collective:
                raise
            error = exc
        dtype = torch.float32 if error is not None else tree_lib.accumulation_dtype(tree_lib.real_dtypes(grads))
        forwarded = extra_args if extra else {}
        columns = len(layout.names) + 1
        pending = state.pending_sq
        if pending.shape != (2, columns):  # a new tree structure: no step of its own before
            pending = torch.full((2, columns), float("nan"), dtype=torch.float64, device=device)
        fused = _fusable(lead, layout, spec)
        p = lead.norm_type if fused else 2.0  # type: ignore[union-attr]
        # the params' sums are taken after ``inner`` (from its tally) when nothing it may write holds
        # them, eagerly; else before it. Either way they wait in the state for the next step.
        late = eager and (counted_params is None or not inplace or _apart(counted_params, grads, state.inner_state))
        on_host = late and _on_host(device, grads, counted_params)  # a few dozen leaves' values: host floats, not tensor ops
        param_sq: Optional[Tensor] = None  # the params' sums taken before ``inner``
        stats: Optional[list[ObservedStats]] = None  # finished on the host, with the two below
        if error is None and fused == "local" and p == 2.0 and late and native_observed.usable() is not None:
            # nothing is sharded, so no statistic waits for a collective: all are read in the passes
            # the step makes (the clip's norm, its scaling, the Adam kernel's tally), none of their own
            norms = stats_lib.counted_norms(layout, grads)
            clip_norm = tree_lib.total_norm([g for g in grads if isinstance(g, Tensor)], 2.0, norms=norms)
            extremes = _Extremes(device)
            with native_observed.tallying() as tally:
                run = lead.given(clip_norm, extremes)  # type: ignore[union-attr]
                new_updates, inner_state = run(updates, state.inner_state, params, inplace=inplace, **forwarded)
            if on_host:
                grad_sq, nonfinite, host_maxima = stats_lib.host_gradient_partials(layout, grads, norms, extremes.host_of)
                stats = _host_stats([grad_sq, *pending.tolist(), nonfinite], host_maxima, dtype)
                clip_stats = _host_clip_stats(clip, inner_state, dtype, clip_norm, extremes)
            else:
                partials = stats_lib.gradient_partials(layout, grads, device, norms, extremes.of)
                sums = torch.cat([partials.sq[None], pending.to(device), partials.nonfinite[None]])
                maxima = partials.max
        else:
            try:
                if error is not None:
                    raise error
                partials = stats_lib.gradient_partials(layout, grads, device)
                if not late:
                    param_sq = _param_sq(layout, counted_params, device)
                share = stats_lib.norm_share(layout, grads, p) if fused == "reduced" else None
            except (TypeError, ValueError, RuntimeError) as exc:
                if not collective:
                    raise
                error = exc  # this rank's share is zeros of the shapes every rank sends
                zeros = torch.zeros(columns, dtype=torch.float64, device=device)
                partials = stats_lib.GradientPartials(zeros, zeros, zeros, [], None)
                share = zeros[:1] if fused == "reduced" and p not in (2.0, math.inf) else None
            rows = torch.cat([partials.sq[None], pending.to(device), partials.nonfinite[None]]).reshape(-1)
            buffer = rows if share is None else torch.cat([rows, share.reshape(1)])
            buffer, maxima = stats_lib.reduce_statistics(layout, buffer, partials.max, what="observe", error=error)
            sums = buffer[: rows.numel()].reshape(4, -1)
            clip_norm = None
            if fused == "reduced":
                reduced_share = None if share is None else buffer[rows.numel():]
                clip_norm = stats_lib.global_norm_from(layout, grads, p, sums, maxima, reduced_share)
            elif fused == "local" and partials.maxima is not None:
                # the clip's own number (per-leaf norms stacked as it stacks them), from norms taken once
                norms = partials.norms if p == 2.0 else list(partials.maxima.unbind())
                clip_norm = tree_lib.total_norm([g for g in grads if isinstance(g, Tensor)], p, norms=norms)
            run = inner_update if clip_norm is None else lead.given(clip_norm)  # type: ignore[union-attr]
            with native_observed.tallying() if eager else contextlib.nullcontext() as tally:
                new_updates, inner_state = run(updates, state.inner_state, params, inplace=inplace, **forwarded)
        if stats is None:
            stats = _all_stats(sums, maxima, dtype)
            clip_stats = _clip_stats(clip, inner_state, dtype, clip_norm)
        if on_host:
            param_sq_host = [math.nan] * columns if counted_params is None else stats_lib.host_squared_sums(layout, counted_params, tally)
            update_sq_host = stats_lib.host_squared_sums(layout, tree_lib.leaves(new_updates), tally)
            pending_sq = torch.tensor([update_sq_host, param_sq_host], dtype=torch.float64, device=device)
        else:
            if param_sq is None:
                param_sq = _param_sq(layout, counted_params, device, tally)
            pending_sq = torch.stack([stats_lib.squared_sums(layout, tree_lib.leaves(new_updates), device, tally), param_sq])
        total, *group_stats = stats
        return new_updates, ObserveState(inner_state, total, dict(zip(layout.names, group_stats)), clip_stats, pending_sq)

    runs_inner(update_fn, inner)
    if takes_donated_updates(inner):
        supports_donated_updates(update_fn, returns_new_updates=returns_new_updates(inner))
    kind = GradientTransformationExtraArgs if extra else GradientTransformation
    return kind(init_fn, update_fn)


# --------------------------------------------------------------------------- for loggers


def _find_states(node: Any) -> list[ObserveState]:
    if isinstance(node, ObserveState):
        return [node]
    if isinstance(node, Mapping):
        children = list(node.values())
    elif isinstance(node, (tuple, list)):
        children = list(node)
    else:
        return []
    return [found for child in children for found in _find_states(child)]


def observations(state: Any, *, prefix: str = "") -> dict[str, float]:
    """The statistics an :func:`observe` recorded, anywhere in ``state``, as a flat dict of floats.

    ``state`` is a chain's state, or an optimizer made by :func:`gradtx.wrap` (its ``tx_state`` is
    read), or a wrapper of one that holds it as ``.optimizer`` (Lightning's, accelerate's). Keys:
    ``"grad_norm"``, ``"prev_update_norm"``, ``"prev_param_norm"``, ``"prev_update_ratio"`` (the
    update and param statistics are those of the step before, NaN after the first step),
    ``"grad_max"``, ``"grad_nonfinite"`` for all leaves; the same with ``"/<group>"`` appended per group
    (``"grad_norm/layers.3"``); ``"clip/norm"``, ``"clip/coefficient"``, ``"clip/clipped"`` (1.0 or
    0.0) when the observed transformation has a global-norm clip; each key after ``prefix``. This is
    where the values reach the host: one transfer for all of them. Raises ``KeyError`` when no
    ``observe`` state is found; with several, the first (in flattening order) is read.
    """
    for _ in range(8):  # an optimizer's wrappers (Lightning's, accelerate's) hold it as .optimizer
        inner_optimizer = getattr(state, "optimizer", None)
        if hasattr(state, "tx_state") or not isinstance(inner_optimizer, torch.optim.Optimizer):
            break
        state = inner_optimizer
    if hasattr(state, "tx_state") and not isinstance(state, tuple):
        state = state.tx_state
    found = _find_states(state)
    if not found:
        raise KeyError("observations: no gradtx.observe state found in the given state")
    observed = found[0]
    keys: list[str] = []
    values: list[Tensor] = []
    for suffix, group in [("", observed.total)] + [(f"/{name}", stats) for name, stats in observed.groups.items()]:
        for name, value in zip(STATISTICS, group):
            keys.append(f"{prefix}{name}{suffix}")
            values.append(value)
    if observed.clip is not None:
        for name, value in zip(ObservedClip._fields, observed.clip):
            keys.append(f"{prefix}clip/{name}")
            values.append(value)
    if not values:
        return {}
    device = values[0].device
    numbers = torch.stack([v.detach().to(device=device, dtype=torch.float64) for v in values]).tolist()
    return dict(zip(keys, numbers))
