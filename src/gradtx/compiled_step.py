"""A whole pure step, ``update`` then ``apply_updates``, as one ``torch.compile`` graph whose large
outputs are written into buffers recycled from the caller's earlier outputs.

What ``jax.jit`` with donated buffers gives an optax user, without donating anything: Inductor
writes the new params and state straight into buffers from a :class:`~gradtx.buffer_pool.BufferPool`
(its graph takes them as inputs and stores into them in the same loop that computes the values),
so a step allocates nothing large and page-faults nothing once it has run twice. The inputs are
never written, and no output shares memory with anything the caller still holds.

With ``donate=True`` the caller gives the step its params and state, as ``jax.jit``'s
``donate_argnums`` does: the graph stores the new values into their very buffers, in the loop that
reads the old ones, so a step moves as little memory as torch's in-place optimizers do.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import sys
import types
import warnings
from typing import Any, Callable, Optional

import torch
from torch import Tensor

from gradtx import compiled_fusion
from gradtx import tree as tree_lib
from gradtx.base import GradientTransformation, apply_updates, paired_leaves, untraceable_members
from gradtx.buffer_pool import BufferPool, recyclable
from gradtx.sharding.compiling import Preflight


def _write_outputs(leaves: list[Any], outs: list[Optional[Tensor]], inputs: list[Any]) -> list[Any]:
    """``leaves`` with each one that fits its buffer in ``outs`` copied there (inside the graph, so
    Inductor stores it there directly). A leaf fits when it has the buffer's shape, dtype, device
    and strides: the result then has the layout the eager step gives it. A leaf that is one of the
    inputs, passed through unchanged, keeps its identity (no copy)."""
    result = list(leaves)
    for index, (value, out) in enumerate(zip(leaves, outs)):
        if out is None or not isinstance(value, Tensor) or value.requires_grad or any(value is x for x in inputs):
            continue  # nothing to write into, a graph to keep, or an input passed through
        if value.shape == out.shape and value.dtype == out.dtype and value.device == out.device and value.stride() == out.stride():
            out.copy_(value)
            result[index] = out
    return result


def _storage_key(leaf: Tensor) -> tuple[torch.device, int]:
    return leaf.device, leaf.untyped_storage().data_ptr()


def donatable(templates: list[Any], others: list[Any]) -> list[bool]:
    """Which of ``templates`` (the params' and state's leaves) a donated step may overwrite: plain
    tensors (not subclasses such as DTensor) with elements, whose memory no other leaf of the
    step's inputs (the other templates, and ``others``: the updates' and extra arguments' leaves)
    shares (a tied weight held twice, a state leaf that is a param, a view of a gradient), so that
    writing one leaf's new value changes nothing else the step reads or returns. Decided by
    storage, so two views of one buffer are never donated even where they do not overlap."""
    keys = [_storage_key(leaf) if isinstance(leaf, Tensor) and leaf.numel() else None for leaf in templates]
    uses = collections.Counter(key for key in keys if key is not None)
    uses.update(_storage_key(leaf) for leaf in others if isinstance(leaf, Tensor) and leaf.numel())
    return [key is not None and type(leaf) in (Tensor, torch.nn.Parameter) and uses[key] == 1 for leaf, key in zip(templates, keys)]


def _refusal(leaf: Any) -> str:
    return f"a {type(leaf).__name__}, not a plain tensor" if type(leaf) not in (Tensor, torch.nn.Parameter) else "shares memory with another leaf of the inputs"


def _is_recompile_limit_hit(error: BaseException) -> bool:
    """Whether ``error`` is Dynamo's "recompile limit hit" (looked up when one is raised: importing
    ``torch._dynamo`` costs seconds, which ``import gradtx`` must not pay)."""
    exc = sys.modules.get("torch._dynamo.exc")
    kinds = tuple(getattr(exc, name) for name in ("FailOnRecompileLimitHit", "FailOnCacheLimitHit") if hasattr(exc, name))
    return bool(kinds) and isinstance(error, kinds)


def _is_traced_failure(error: BaseException) -> bool:
    """Whether ``error`` is one of Dynamo's (raised while it traced or ran a graph); ``False``
    where this torch has no such base class."""
    kind = getattr(sys.modules.get("torch._dynamo.exc"), "TorchDynamoException", None)
    return kind is not None and isinstance(error, kind)


_instances = itertools.count()


def _own_copy(function: Callable[..., Any]) -> Callable[..., Any]:
    """``function`` with a code object of its own. Dynamo keeps compiled variants, and counts them
    against ``recompile_limit``, per code object: steps sharing one would share one limit."""
    code = function.__code__.replace(co_name=f"{function.__name__}_{next(_instances)}")
    return types.FunctionType(code, function.__globals__, code.co_name, function.__defaults__, function.__closure__)


def _variants(code: types.CodeType) -> Optional[int]:
    """How many compiled variants Dynamo keeps for ``code`` (``None`` where it cannot tell)."""
    try:
        return len(torch._dynamo.eval_frame._debug_get_cache_entry_list(code))
    except (AttributeError, TypeError, RuntimeError):
        return None


def _dynamo_setting(name: str, older_name: str) -> tuple[str, Optional[int]]:
    """``torch._dynamo.config``'s ``name`` (``older_name`` before torch 2.7): its full name and value,
    the value ``None`` where this torch has neither."""
    config = torch._dynamo.config
    for found in (name, older_name):
        if hasattr(config, found):
            return f"torch._dynamo.config.{found}", getattr(config, found)
    return f"torch._dynamo.config.{name}", None


class CompiledStep:
    """The callable :func:`compile_step` returns; ``pool`` holds its recycled output buffers."""

    def __init__(
        self, tx: GradientTransformation, recycle: bool, donate: bool, compile_options: dict[str, Any], inductor: bool
    ) -> None:
        untraced = untraceable_members(tx)
        if untraced:
            name, why = untraced[0]
            raise ValueError(f"compile_step: {name} {why}; run this step eagerly (tx.update, then apply_updates)")
        self.tx, self.recycle, self.donate, self.pool = tx, recycle, donate, BufferPool()
        self._compile_options = compile_options
        # Inductor's graphs compile with compiled_fusion's choices; other backends have no such hook
        self._choices = compiled_fusion.fusing_reductions if inductor else contextlib.nullcontext
        self._body_function = _own_copy(CompiledStep._body)
        self._compiled = torch.compile(types.MethodType(self._body_function, self), **compile_options)
        self._preflight = Preflight()  # sharded steps: the cross-rank checks run eagerly, before tracing
        self._refused: set[frozenset[int]] = set()  # sets of leaves not donated, already warned of

    def _body(self, updates: Any, state: Any, params: Any, outs: list[Optional[Tensor]], extra_args: dict) -> tuple[Any, Any]:
        new_updates, new_state = self.tx.update(updates, state, params, **extra_args)
        new_params = apply_updates(params, new_updates)
        param_leaves, param_def = tree_lib.flatten_to_rebuild(new_params)
        state_leaves, state_def = tree_lib.flatten_to_rebuild(new_state)
        inputs = tree_lib.leaves(params) + tree_lib.leaves(state) + tree_lib.leaves(updates)
        leaves = _write_outputs(param_leaves + state_leaves, outs, inputs)
        n = len(param_leaves)
        return tree_lib.unflatten(param_def, leaves[:n]), tree_lib.unflatten(state_def, leaves[n:])

    def __call__(self, updates: Any, state: Any, params: Any, **extra_args: Any) -> tuple[Any, Any]:
        # Checked here, where a mismatch is a plain error naming the leaf; inside the graph the
        # tracer would report it as an unsupported exception.
        paired_leaves(params, updates, owner="compile_step")
        if self._preflight.due(updates):
            self._preflight.run(updates, lambda: self.tx.update(updates, state, params, **extra_args))
        templates = tree_lib.leaves(params) + tree_lib.leaves(state)
        others = tree_lib.leaves(updates) + tree_lib.leaves(extra_args)
        inputs = templates + others
        outs: list[Optional[Tensor]] = [None] * len(templates)
        if (self.recycle or self.donate) and not tree_lib.needs_graph(inputs):
            donated = donatable(templates, others) if self.donate else [False] * len(templates)
            if self.donate:
                self._warn_once_of_refusals(params, state, templates, donated)
            if self.recycle:
                outs = self.pool.take([t if recyclable(t) and not d else None for t, d in zip(templates, donated)])
            outs = [t if d else out for t, d, out in zip(templates, donated, outs)]
        try:
            with self._choices():
                return self._compiled(updates, state, params, outs, extra_args)
        except Exception as error:
            if _is_recompile_limit_hit(error):
                raise RuntimeError(self._limit_message()) from error
            self._explain_eagerly(error, updates, state, params, extra_args)
            raise

    def _explain_eagerly(self, error: Exception, updates: Any, state: Any, params: Any, extra_args: dict) -> None:
        """A step that failed while Dynamo traced it runs once eagerly, where gradtx's checks name what
        is wrong (a state built for params of other shapes, a leaf of another dtype): that error is
        raised in place of the tracer's (a fake tensor's broadcast error, say). Not across ranks,
        where an eager step's collectives could wait for ranks whose step traced."""
        if not _is_traced_failure(error):
            return
        if torch.distributed.is_available() and torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            return
        try:
            self.tx.update(updates, state, params, **extra_args)  # pure: nothing of the caller's is written
        except Exception as eager_error:  # noqa: BLE001 - the eager step's own error is the one to show
            raise eager_error from error

    def _warn_once_of_refusals(self, params: Any, state: Any, templates: list[Any], donated: list[bool]) -> None:
        """Warns, once per set of leaves, of the tensors with elements that ``donate=True`` could not
        overwrite, naming them and why (as ``jax.jit`` warns of donated buffers it cannot use)."""
        refused = frozenset(i for i, (t, d) in enumerate(zip(templates, donated)) if not d and isinstance(t, Tensor) and t.numel())
        if not refused or refused in self._refused:
            return
        self._refused.add(refused)
        names = [f"params.{p}" for p in tree_lib.paths(params)] + [f"state.{p}" for p in tree_lib.paths(state)]
        listed = [f"{names[i] if i < len(names) else f'leaf {i}'} ({_refusal(templates[i])})" for i in sorted(refused)]
        more = f" and {len(listed) - 5} more" if len(listed) > 5 else ""
        warnings.warn(
            f"compile_step(donate=True): {len(listed)} leaves are not donated and get new tensors: "
            f"{', '.join(listed[:5])}{more}. Continue from the returned trees.",
            stacklevel=3,
        )

    def _limit_message(self) -> str:
        name, limit = _dynamo_setting("recompile_limit", "cache_size_limit")
        if self._compile_options.get("recompile_limit"):
            name, limit = "recompile_limit", self._compile_options["recompile_limit"]
        variants = _variants(self._body_function.__code__)
        accumulated_name, accumulated = _dynamo_setting("accumulated_recompile_limit", "accumulated_cache_size_limit")
        if variants is not None and accumulated is not None and variants >= accumulated:
            name, limit = accumulated_name, accumulated
        compiled = f"it has compiled {variants} variants of its graph" if variants is not None else "its variants are compiled"
        return (
            f"compile_step: this step hit its recompile limit: {compiled} ({name} = {limit}) and these "
            "inputs need another (a new tree structure, or new shapes, dtypes, strides or devices). Each "
            f"compile_step has a limit of its own: use one compile_step per tree structure, or raise {name}."
        )

    def clear(self) -> None:
        """Lets go of the recycled buffers kept between steps (see :meth:`BufferPool.clear`)."""
        self.pool.clear()


def compile_step(
    tx: GradientTransformation, *, recycle: bool = True, donate: bool = False, **compile_options: Any
) -> CompiledStep:
    """``step(updates, state, params, **extra_args) -> (new_params, new_state)``: ``tx.update``
    followed by :func:`~gradtx.apply_updates`, compiled as one graph.

    Pure: ``updates``, ``state`` and ``params`` are left as they are, and the results share no
    memory with anything the caller still references. The results are the plain step's, laid out as
    it lays them out, whatever the params' layouts: a permuted param keeps its layout, and a sliced,
    ``expand``-ed or otherwise self-overlapping one gets a new dense tensor, as ``apply_updates``
    gives it. With ``recycle=True`` (the default), the large CPU outputs are written into buffers
    the step handed out two calls before and the caller has dropped since (``params, state =
    step(grads, state, params)`` drops them): after two steps a step allocates nothing large, which
    on a CPU saves it page-faulting its new trees in every time. Only dense layouts are written into
    recycled buffers; a param with another layout is from its second step on, its new value being
    dense. A weak reference to an output's storage (a ``weakref`` to the storage object, a
    ``torch.multiprocessing.reductions.StorageWeakRef``) keeps the storage from being recycled: it
    sees the output's values for as long as the pool keeps the storage (two steps), then dies, never
    seeing a later step's. Between steps the process then keeps the buffers of the step before (what
    a pure step holds at its peak anyway); ``step.clear()`` lets them go. Where a graph is recorded
    (an input requires grad, or a ``torch.func`` transform is active) the outputs are new tensors,
    as autograd needs.

    ``donate=True`` hands the step ``params`` and ``state``, as ``jax.jit(..., donate_argnums=...)``
    does: their leaves are overwritten with the new values, stored by the same loop that reads the
    old ones, and the returned trees hold those very tensors. That saves memory (no second copy of
    params and state, no pool) and time (a new value is written where it was read, so no cache line
    is fetched only to be overwritten: the step moves as little memory as torch's in-place
    optimizers). Under ``torch.no_grad()`` a model's own parameters can be donated, which updates the
    model in place. A leaf is overwritten only where that changes nothing else the step reads: a
    plain tensor (not a DTensor) whose memory no other leaf of the inputs shares (tied weights held
    twice, a state leaf that is a param, a view of another buffer), with the layout its new value
    takes, and no graph being recorded. Any other leaf gets a new tensor (from the pool with
    ``recycle=True``), so always continue from the returned trees. ``updates`` are never written.

    Each step compiles variants of its own (one per tree structure, and per shapes, dtypes and
    layouts) and counts them against ``torch._dynamo.config.recompile_limit`` on its own, however
    many other steps the process has; past its limit, a call is a ``RuntimeError`` that says so.

    ``compile_options`` go to ``torch.compile`` (``fullgraph=True`` unless given). Example::

        >>> import torch, gradtx as gtx
        >>> step = gtx.compile_step(gtx.chain(gtx.clip_by_global_norm(1.0), gtx.adamw(1e-3)))
        >>> params = {"w": torch.ones(3)}
        >>> state = gtx.chain(gtx.clip_by_global_norm(1.0), gtx.adamw(1e-3)).init(params)
        >>> params, state = step({"w": torch.full((3,), 0.5)}, state, params)
        >>> params["w"]
        tensor([0.9990, 0.9990, 0.9990])
    """
    compile_options.setdefault("fullgraph", True)
    inductor = compile_options.get("backend", "inductor") == "inductor"
    if inductor:
        # A new moment is read twice, by the update and by the store into its buffer; left
        # unrealized, Inductor recomputes it in a loop of its own (two more passes over memory).
        # Statistics and norms that read what the update reads share its loop (see compiled_fusion).
        compile_options["options"] = {
            "realize_reads_threshold": 1, **compiled_fusion.cache_options(), **compile_options.get("options", {})
        }
    return CompiledStep(tx, recycle, donate, compile_options, inductor)
