"""``ShardingSpec``: a device mesh plus a leaf spec for every gradient leaf.

Leaf specs come from one of three forms, resolved against leaf paths such as
``"layers.0.qkv.weight"``:

- a pytree prefix of the gradients holding a leaf spec at each node (it covers every leaf below);
- a list of ``(glob, leaf spec)`` rules, matched in order (``fnmatch`` syntax, ``*`` crosses dots);
- a callable ``(path, tensor) -> leaf spec`` (or ``None`` for "no rule").

A leaf nothing matches takes ``default``; without one it is a ``ValueError`` naming its path. A
rule that matches no leaf path on any rank (a typo such as ``"*.qvk.*"``) is a ``ValueError``
naming it and the nearest paths, unless ``allow_unused_rules=True``.
Resolution runs once per tree structure (the result is cached), so steady-state steps do no matching.
"""

from __future__ import annotations

import difflib
import fnmatch
import re
from typing import Any, Callable, Literal, Optional, Sequence, Union

from gradtx import tree as tree_lib
from gradtx.sharding.mesh import MeshAxes
from gradtx.sharding.placements import Shard

Rules = Sequence[tuple[str, Shard]]
LeafSpecs = Union[None, Rules, Callable[[str, Any], Optional[Shard]], Any]

DEFAULT_TIMEOUT_S = 600.0  # NCCL's default collective timeout; gloo's default is 30 minutes


def _is_rules(leaves: Any) -> bool:
    """A list of ``(glob, spec)`` pairs (an empty list: no rules, every leaf takes the default)."""
    return (
        isinstance(leaves, (list, tuple))
        and all(
            isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str) and isinstance(item[1], Shard)
            for item in leaves
        )
    )


class ShardingSpec:
    """How each gradient leaf is laid out over a named device mesh, so norms count every element once.

    Args:
      mesh: a ``torch.distributed.device_mesh.DeviceMesh`` with ``mesh_dim_names``. Megatron-LM or
        DeepSpeed users who already own their process groups build it from them::

            from torch.distributed.device_mesh import DeviceMesh
            from megatron.core import parallel_state as ps
            groups = [ps.get_pipeline_model_parallel_group(), ps.get_data_parallel_group(),
                      ps.get_tensor_model_parallel_group()]
            mesh = DeviceMesh.from_group(groups, "cuda", mesh=rank_grid,   # ranks as a (pp, dp, tp) tensor
                                         mesh_dim_names=("pp", "dp", "tp"))

        (a single group needs no ``mesh=``: ``DeviceMesh.from_group(tp_group, "cuda",
        mesh_dim_names=("tp",))``; DeepSpeed exposes its groups in ``deepspeed.utils.groups``).
      leaves: leaf specs (``Shard(...)`` / ``Replicate()``) as a pytree prefix of the gradients, an
        ordered list of ``(glob, spec)`` rules, or a callable ``(path, tensor) -> spec``. ``None``:
        every plain tensor is replicated (DTensors still describe themselves).
      stage_axis: the pipeline axis: ranks along it hold *different* leaves, each counted on its
        own stage.
      default: the spec of a leaf no rule matches (``None``: such a leaf is a ``ValueError``).
      check_consistency: when ranks compare what they are about to reduce, with one small
        ``all_gather`` over the whole mesh: their trees, leaf specs, dtypes, reduction groups and
        the reduction itself (ranks of one pipeline stage must hold the same leaves), and any error
        found while resolving the tree on any rank. Disagreement is the same ``ValueError`` on every
        rank, naming the rank, the leaf and the axis, instead of a hang or a wrong number.
        ``"once"`` (default): the first time each resolved plan meets each reduction (the first
        step, and whenever the tree structure or layout changes), so steady-state steps pay
        nothing; ``True``: at every call; ``False``: never (an error then raises on the ranks that
        find it, and the others wait in their collective until it times out).
      reduce_axes: extra axes the global reduction spans. The reduction group is the stage axis
        plus every axis a leaf is sharded over (those named by rules, the default, and the local
        leaves); give this when pipeline stages shard over different axes (one stage has no
        tensor-parallel leaf at all) and leaves are given by a prefix tree or a callable, so that
        every rank joins the same collective.
      allow_unused_rules: accept rules that match no leaf path on any rank (a generic rule set
        meant for several models). By default such a rule is a ``ValueError`` naming it and the
        nearest leaf paths: a misspelt glob would otherwise hand its leaves to another rule or to
        ``default`` silently. A rule that matches on some pipeline stages only is used (the ranks
        decide together, in the cross-rank check; with ``check_consistency=False`` and a stage
        axis nothing is decided). A path matches even where its gradient is ``None``.
      timeout: how many seconds a rank waits in a reduction of this spec (and in the cross-rank
        check) for the other ranks before raising a ``RuntimeError`` that names its call count
        and the count the others reached: a rank that calls ``update`` more often than the others
        gets a clear error instead of waiting for the process group's own timeout. 600 by default;
        ``None`` waits as long as the process group lets it. It bounds the waits on CPU (gloo)
        buffers, in eager mode; GPU collectives are not waited on by the host.

    Build the spec on every rank of the mesh, in the same order as other process groups, as a
    ``DeviceMesh`` is built: it creates the groups its reductions span over several axes at once
    (on a mesh over every rank, after one ``all_reduce`` by which the ranks agree on torch's count
    of groups made, which groups some ranks made alone can leave unequal).

    DTensor leaves take their layout from their placements (a rule matching one may add
    ``duplicate=True``; if it names other axes than the placements do, that is a ``ValueError``);
    their meshes must be slices of this mesh's ranks (``mesh["dp"]``, flattened dims, ...).
    """

    def __init__(
        self,
        mesh: Any,
        leaves: LeafSpecs = None,
        *,
        stage_axis: Optional[str] = None,
        default: Optional[Shard] = None,
        check_consistency: Union[bool, Literal["once"]] = "once",
        reduce_axes: Sequence[str] = (),
        allow_unused_rules: bool = False,
        timeout: Optional[float] = DEFAULT_TIMEOUT_S,
    ):
        self.axes = MeshAxes(mesh, require_names=True)
        self.mesh = mesh
        self.leaves = leaves
        self.stage_axis = stage_axis
        self.default = default
        if not (isinstance(check_consistency, bool) or check_consistency == "once"):
            raise ValueError(f"ShardingSpec: check_consistency must be True, False or 'once', got {check_consistency!r}")
        self.check_consistency: Union[bool, Literal["once"]] = check_consistency
        if not isinstance(allow_unused_rules, bool):
            raise TypeError(f"ShardingSpec: allow_unused_rules must be a bool, got {allow_unused_rules!r}")
        self.allow_unused_rules = allow_unused_rules
        if timeout is not None and not (isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and timeout > 0):
            raise ValueError(f"ShardingSpec: timeout must be a positive number of seconds or None, got {timeout!r}")
        self.timeout: Optional[float] = None if timeout is None else float(timeout)
        if stage_axis is not None:
            self._check_axis(stage_axis, "stage_axis")
        if isinstance(reduce_axes, str):
            reduce_axes = (reduce_axes,)
        for axis in reduce_axes:
            self._check_axis(axis, "reduce_axes")
        if default is not None and not isinstance(default, Shard):
            raise TypeError(f"ShardingSpec: default must be a Shard or Replicate, got {default!r}")
        self._rules: Optional[list[tuple[str, re.Pattern, Shard]]] = None
        declared: list[str] = list(reduce_axes)
        if _is_rules(leaves):
            self._rules = [(glob, re.compile(fnmatch.translate(glob)), spec) for glob, spec in leaves]
            declared += [axis for _, _, spec in self._rules for axis in spec.axes]
            for glob, _, spec in self._rules:
                self.validate_leaf_spec(spec, f"rule {glob!r}")
        elif isinstance(leaves, (list, tuple)) and leaves and all(isinstance(i, tuple) and len(i) == 2 and isinstance(i[0], str) for i in leaves):
            bad = next(i for i in leaves if not isinstance(i[1], Shard))
            raise TypeError(f"ShardingSpec: rule {bad[0]!r} maps to {bad[1]!r}, expected a Shard or Replicate")
        if default is not None:
            self.validate_leaf_spec(default, "default")
            declared += list(default.axes)
        self.declared_axes: tuple[str, ...] = self.axes.ordered(declared)
        self.plans: dict[Any, Any] = {}
        self.traced_plans: dict[Any, Any] = {}  # the same plans, by leaf paths (see gradtx.sharding.plan)
        self.shared_counts: dict[Any, Any] = {}  # the checks and call counts plans share (see gradtx.sharding.plan)

    @property
    def looks_at_tensors(self) -> bool:
        """Whether leaf specs come from a callable, which may look at each tensor (its shape, say)."""
        return self._rules is None and callable(self.leaves)

    def __repr__(self) -> str:
        return f"ShardingSpec(mesh={self.mesh}, leaves={self.leaves!r}, stage_axis={self.stage_axis!r})"

    # ------------------------------------------------------------------ validation

    def _check_axis(self, axis: str, where: str) -> None:
        if axis not in self.axes.names:
            raise ValueError(f"ShardingSpec: {where} names axis {axis!r}, which the mesh lacks (axes: {self.axes.names})")

    def validate_leaf_spec(self, spec: Any, where: str) -> Shard:
        if not isinstance(spec, Shard):
            raise TypeError(f"ShardingSpec: {where} has spec {spec!r}, expected a Shard or Replicate")
        for axis in spec.axes:
            if axis not in self.axes.names:
                raise ValueError(
                    f"ShardingSpec: {where} is sharded over axis {axis!r}, which the mesh lacks (axes: {self.axes.names})"
                )
            if axis == self.stage_axis:
                raise ValueError(
                    f"ShardingSpec: {where} is sharded over the stage axis {axis!r}; pipeline stages hold "
                    "different leaves, so name the axes that split this leaf instead"
                )
        return spec

    # ------------------------------------------------------------------ resolution

    def resolve(self, tree: Any, tree_leaves: Sequence[Any], paths: Sequence[str]) -> list[Optional[Shard]]:
        """The leaf spec of every leaf (``None`` where none is given and there is no default).

        Specs are validated here, before any collective; a missing one is left to the caller, which
        knows whether the leaf is a DTensor (describing itself) or ``None`` (no gradient).
        """
        leaves = self.leaves
        if leaves is None:
            found: list[Optional[Shard]] = [None] * len(paths)
        elif self._rules is not None:
            found = [self._match(path) for path in paths]
        elif callable(leaves):
            found = [leaves(path, leaf) if leaf is not None else None for path, leaf in zip(paths, tree_leaves)]
        else:
            found = self._broadcast(leaves, tree)
        out: list[Optional[Shard]] = []
        for path, spec in zip(paths, found):
            if spec is None:
                spec = self.default
            out.append(None if spec is None else self.validate_leaf_spec(spec, f"leaf {path!r}"))
        return out

    def _match(self, path: str) -> Optional[Shard]:
        for _, pattern, spec in self._rules:  # type: ignore[union-attr]
            if pattern.match(path):
                return spec
        return None

    def unused_rules(self, paths: Sequence[str]) -> tuple[str, ...]:
        """The globs of the rules that match none of ``paths`` (empty without rules, or with
        ``allow_unused_rules``). A rule an earlier one shadows still matches: it is not reported."""
        if self._rules is None or self.allow_unused_rules:
            return ()
        return tuple(glob for glob, pattern, _ in self._rules if not any(pattern.match(path) for path in paths))

    def _broadcast(self, prefix: Any, tree: Any) -> list[Optional[Shard]]:
        try:
            return tree_lib.broadcast_leaves(prefix, tree)
        except ValueError:
            raise ValueError(
                f"ShardingSpec: the leaf specs do not fit the gradient tree: {tree_lib._uncovered(prefix, tree)}"
            ) from None


def explain_unused(unused: Sequence[str], paths: Sequence[str], *, where: str) -> str:
    """The error for rules that match no leaf path ``where`` (of the tree, on any rank): each one
    named with the leaf paths nearest to its glob."""
    parts = [f"rule {glob!r} matches no leaf path {where} (the nearest: {_listed(nearest_paths(glob, paths))})" for glob in unused]
    return (
        "ShardingSpec: " + "; ".join(parts) + ". The leaves it was meant for fall to another rule or to "
        "default=, so the norm would count them with the wrong layout: fix the glob, or pass "
        "allow_unused_rules=True to the ShardingSpec if the rule set is meant for several models"
    )


def nearest_paths(glob: str, paths: Sequence[str], n: int = 3) -> list[str]:
    """The ``n`` leaf paths most like ``glob`` (its literal parts compared, wildcards left out)."""
    literal = glob.replace("*", "").replace("?", "")
    scored = sorted(set(paths), key=lambda p: (-difflib.SequenceMatcher(None, literal, p).ratio(), p))
    return scored[:n]


def _listed(paths: Sequence[str]) -> str:
    return ", ".join(repr(p) for p in paths) if paths else "the tree has none"
