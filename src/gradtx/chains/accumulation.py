"""Gradient accumulation: ``MultiSteps`` runs the inner optimizer once every k mini-steps.

As ``optax.MultiSteps``: each call adds its gradients to an accumulator (a running mean by
default) and returns zero updates, except on every k-th call, which passes the accumulated
gradients to the inner transformation and returns its updates. ``k`` may follow a schedule of the
gradient step, which lets the effective batch size grow during training.

Two ways to decide, with identical results:

- eagerly, the counters live on the CPU, so the step is chosen by a Python branch with no device
  synchronisation and the inner transformation runs on emitting steps only;
- under ``torch.compile``, with a ``should_skip_update_fn`` (whose verdict is a device tensor), or
  when the state was moved off the CPU, the decision stays on the device: the inner transformation
  runs at every mini-step and ``torch.where`` keeps its result only on the step that emits, so
  nothing is read back to the host and one graph serves every step.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, NamedTuple, Optional, Protocol, Union

import torch
from torch import Tensor

from gradtx import sharding, state_check
from gradtx import tree as tree_lib
from gradtx.base import GradientTransformation, GradientTransformationExtraArgs, takes_extra_args, with_inplace, runs_inner
from gradtx.chains import step_gates
from gradtx.chains._select import safe_increment, where_or_zero, where_tree, zeros_like_tree
from gradtx.transforms import _foreach as fe

PyTree = Any
ShouldSkipUpdateFn = Callable[[PyTree, Tensor, Optional[PyTree]], tuple[Tensor, PyTree]]


class ShouldSkipUpdateFunction(Protocol):
    """The type of ``MultiSteps``'s ``should_skip_update_fn`` (as optax's): a verdict and what to log.

    Called with the mini-step's ``updates``, the ``gradient_step`` (0-d int32) and the ``params``;
    returns a 0-d bool tensor (true: drop this mini-step's gradients) and a pytree kept in
    ``MultiStepsState.skip_state``. :func:`skip_not_finite` and :func:`skip_large_updates` are two.
    """

    def __call__(self, updates: PyTree, gradient_step: Tensor, params: Optional[PyTree]) -> tuple[Tensor, PyTree]: ...


class MultiStepsState(NamedTuple):
    """As ``optax.MultiStepsState``.

    Attributes:
      mini_step: calls since the last emitted update (0-d int32; back to 0 when one is emitted).
      gradient_step: updates emitted so far (0-d int32).
      inner_opt_state: the inner transformation's state, changed only by emitting steps.
      acc_grads: the accumulated gradients (``accumulator_dtype``).
      skip_state: what ``should_skip_update_fn`` returned for logging (``()`` without one).
    """

    mini_step: Tensor
    gradient_step: Tensor
    inner_opt_state: Any
    acc_grads: Any
    skip_state: Any = ()


def _copy(tree: PyTree) -> PyTree:
    """``tree`` with every tensor leaf cloned (other leaves kept)."""
    return tree_lib.tree_map(lambda x: x.clone() if isinstance(x, Tensor) else x, tree)


def skip_not_finite(
    updates: PyTree, gradient_step: Tensor, params: Optional[PyTree], *, spec: Optional[sharding.ShardingSpec] = None
) -> tuple[Tensor, dict]:
    """A ``should_skip_update_fn``: skip mini-steps whose gradients hold a NaN or an infinity.

    Under sharding (``spec``, passed by ``MultiSteps(..., spec=)``, or DTensor gradients) the verdict
    and the count are those of the logical gradient, the same on every rank (one all-reduce).
    """
    del gradient_step, params
    finite, num_not_finite = sharding.count_not_finite(updates, spec)
    should_skip = ~finite
    return should_skip, {"should_skip": should_skip, "num_not_finite": num_not_finite}


def skip_large_updates(
    updates: PyTree,
    gradient_step: Tensor,
    params: Optional[PyTree],
    max_squared_norm: float,
    *,
    spec: Optional[sharding.ShardingSpec] = None,
) -> tuple[Tensor, dict]:
    """A ``should_skip_update_fn`` (bind ``max_squared_norm`` with ``functools.partial``): skip
    mini-steps whose squared global norm is not below ``max_squared_norm`` (NaN norms included).

    Under sharding the norm is that of the logical gradient (one all-reduce), so every rank agrees.
    """
    del gradient_step, params
    tensors = [leaf for leaf in tree_lib.leaves(updates) if isinstance(leaf, Tensor)]
    if sharding.is_sharded(tensors, spec):
        norm_sq = sharding.global_norm(updates, spec).square()
    else:
        norm_sq = tree_lib.total_norm(tensors, 2.0).square()
    should_skip = ~(norm_sq < max_squared_norm)
    return should_skip, {"should_skip": should_skip, "norm_squared": norm_sq}


def _unwrapped(fn: Callable[..., Any]) -> Callable[..., Any]:
    while isinstance(fn, functools.partial):
        fn = fn.func
    return fn


def _takes_spec(fn: Callable[..., Any]) -> bool:
    """Whether a skip function takes ``spec=`` (and so decides on the logical gradient itself)."""
    try:
        parameter = inspect.signature(fn).parameters.get("spec")
    except (TypeError, ValueError):
        return False
    return parameter is not None and parameter.kind in (parameter.KEYWORD_ONLY, parameter.POSITIONAL_OR_KEYWORD)


def _no_skip(updates: PyTree, gradient_step: Tensor, params: Optional[PyTree]) -> tuple[Tensor, tuple]:
    del updates, params
    return torch.zeros((), dtype=torch.bool, device=gradient_step.device), ()


class MultiSteps:
    """Accumulates gradients over ``every_k_schedule`` mini-steps, then applies ``opt`` once.

    Args:
      opt: the inner transformation.
      every_k_schedule: an int, or a schedule ``gradient_step -> k`` (int or 0-d tensor).
      use_grad_mean: average the accumulated gradients (Welford's running mean, as optax) rather
        than sum them.
      should_skip_update_fn: ``(updates, gradient_step, params) -> (skip, skip_state)`` with
        ``skip`` a 0-d bool tensor; a skipped mini-step changes nothing but ``skip_state`` (see
        :func:`skip_not_finite`, :func:`skip_large_updates`).
      accumulator_dtype: the accumulator's dtype (float32, as optax), or ``None`` for each
        parameter's own.
      spec: how the gradients are sharded (a :class:`gradtx.sharding.ShardingSpec`; DTensor
        gradients need none). Skip decisions are then the same on every rank: ``skip_not_finite``
        and ``skip_large_updates`` receive it and decide on the logical gradient; any other skip
        function (given ``spec=`` too if it takes it) decides per rank, and every rank skips when
        any rank says so (one all-reduce of a 0/1 flag over the mesh).

    Mini-steps return zeros. Where optax multiplies by 0/1 flags, this selects with ``torch.where``,
    so a NaN in a discarded inner update neither leaks into a mini-step's zeros nor sticks in the
    accumulator after it is emitted. Without ``should_skip_update_fn`` the counters are CPU
    tensors, so eager updates decide on the
    host without a device sync and run the inner transformation on emitting steps only (given
    ``inplace`` then); under ``torch.compile`` or with ``should_skip_update_fn`` the decision stays
    on the device and the inner transformation runs on its pure path at every mini-step, its
    result discarded on mini-steps. With ``inplace=True`` the accumulator is updated in place.

    Extra arguments given to ``update`` reach ``opt`` when it takes them (on the steps it runs).
    """

    def __init__(
        self,
        opt: GradientTransformation,
        every_k_schedule: Union[int, Callable[[Tensor], Union[int, Tensor]]],
        use_grad_mean: bool = True,
        should_skip_update_fn: Optional[ShouldSkipUpdateFn] = None,
        accumulator_dtype: Optional[torch.dtype] = torch.float32,
        spec: Optional[sharding.ShardingSpec] = None,
    ):
        if not isinstance(opt, GradientTransformation):
            raise TypeError(f"MultiSteps: opt must be a GradientTransformation, got {type(opt).__name__}")
        if isinstance(every_k_schedule, int):
            if every_k_schedule < 1:
                raise ValueError(f"MultiSteps: every_k_schedule must be >= 1, got {every_k_schedule}")
            constant_k = every_k_schedule
            every_k_schedule = lambda step: constant_k  # noqa: E731
        elif not callable(every_k_schedule):
            raise TypeError("MultiSteps: every_k_schedule must be an int or a callable")
        self._opt = opt
        self._opt_update = with_inplace(opt)
        self._opt_takes_extra_args = takes_extra_args(opt)
        self._every_k_schedule = every_k_schedule
        self._use_grad_mean = use_grad_mean
        self._should_skip = should_skip_update_fn
        self._skip_takes_spec = should_skip_update_fn is not None and _takes_spec(should_skip_update_fn)
        # only gradtx's own skip functions are known to decide on the logical gradient
        self._skip_is_global = should_skip_update_fn is not None and _unwrapped(should_skip_update_fn) in (
            skip_not_finite,
            skip_large_updates,
        )
        self._accumulator_dtype = accumulator_dtype
        self._spec = spec
        # the state checks of every GradientTransformation, for calls on this object too
        self.init, self.update = state_check.checked(self.init, self.update)  # type: ignore[method-assign]

    @property
    def inner_opt(self) -> GradientTransformation:
        return self._opt

    def init(self, params: PyTree) -> MultiStepsState:
        dtype = self._accumulator_dtype
        acc_grads = fe.zeros_like_tree(params, dtype)  # a real dtype is a precision for complex leaves
        # on the CPU when the host may decide (see the module docstring); with a skip function the
        # verdict is a device tensor, so the counters live beside it and nothing syncs
        device = torch.device("cpu") if self._should_skip is None else tree_lib.first_device(params)
        gradient_step = torch.zeros((), dtype=torch.int32, device=device)
        skip_state: Any = ()
        if self._should_skip is not None:
            # the skip state's structure, from this rank's pieces alone: building a state issues no
            # collective (a spec is not passed, and DTensors are seen as their local shards)
            zeros = tree_lib.tree_map(lambda p: torch.zeros_like(sharding.dtensor.local(p)), params)
            _, skip_state = self._should_skip(zeros, gradient_step, params)
        return MultiStepsState(
            mini_step=torch.zeros_like(gradient_step),
            gradient_step=gradient_step,
            inner_opt_state=self._opt.init(params),
            acc_grads=acc_grads,
            skip_state=skip_state,
        )

    def _skip_fn(self) -> ShouldSkipUpdateFn:
        if self._skip_takes_spec and self._spec is not None:
            return functools.partial(self._should_skip, spec=self._spec)  # type: ignore[arg-type]
        return self._should_skip  # type: ignore[return-value]

    def _k_steps(self, gradient_step: Tensor) -> Tensor:
        k = self._every_k_schedule(gradient_step)
        if isinstance(k, Tensor):
            return k.to(device=gradient_step.device, dtype=gradient_step.dtype)
        return torch.full((), int(k), dtype=gradient_step.dtype, device=gradient_step.device)

    def update(self, updates, state: MultiStepsState, params=None, *, inplace: bool = False, **extra_args):
        """Accumulates ``updates``; returns the inner updates every k-th call and zeros otherwise."""
        if not self._opt_takes_extra_args:
            extra_args = {}
        on_host = (
            self._should_skip is None
            and state.mini_step.device.type == "cpu"
            and state.gradient_step.device.type == "cpu"
            and not torch.compiler.is_compiling()
            and not tree_lib.uses_functorch([state.mini_step, state.gradient_step])  # batched by vmap
        )
        if on_host:
            return self._update_on_host(updates, state, params, inplace=inplace, extra_args=extra_args)
        return self._update_on_device(updates, state, params, inplace=inplace, extra_args=extra_args)

    def _update_on_host(self, updates, state: MultiStepsState, params, *, inplace: bool, extra_args: dict):
        """Branches in Python on the CPU counters: the inner transformation runs on emitting steps only."""
        k_steps = int(self._k_steps(state.gradient_step))
        mini_step = int(state.mini_step)
        acc_grads = self._accumulate(updates, state.acc_grads, state.mini_step, inplace=inplace)
        if mini_step < k_steps - 1:
            zeros = zeros_like_tree(updates, inplace=inplace)
            new_state = state._replace(mini_step=safe_increment(state.mini_step), acc_grads=acc_grads)
            if not inplace:  # what a mini-step keeps is copied: the new state shares no storage with the old
                new_state = new_state._replace(
                    gradient_step=state.gradient_step.clone(),
                    inner_opt_state=_copy(state.inner_opt_state),
                    skip_state=_copy(state.skip_state),
                )
            return zeros, new_state
        # the accumulator is handed to the inner transformation (donated when ``inplace``: its
        # updates may be written into it), so the next one starts from fresh zeros
        inner_grads = self._inner_grads(updates, acc_grads)
        final_updates, inner_state = self._opt_update(
            inner_grads, state.inner_opt_state, params, inplace=inplace, **extra_args
        )
        new_state = MultiStepsState(
            mini_step=torch.zeros_like(state.mini_step),
            gradient_step=safe_increment(state.gradient_step),
            inner_opt_state=inner_state,
            acc_grads=tree_lib.tree_map(torch.zeros_like, state.acc_grads),
            skip_state=state.skip_state if inplace else _copy(state.skip_state),
        )
        return final_updates, new_state

    @staticmethod
    def _inner_grads(updates: PyTree, acc_grads: PyTree) -> PyTree:
        """The accumulated gradients in the updates' dtypes."""
        return tree_lib.tree_map(
            lambda u, a: u if a is None else (a if a.dtype == u.dtype else a.to(u.dtype)), updates, acc_grads
        )

    def _update_on_device(self, updates, state: MultiStepsState, params, *, inplace: bool, extra_args: dict):
        """Selects with ``torch.where``: the inner transformation runs every mini-step, nothing syncs."""
        k_steps = self._k_steps(state.gradient_step)
        if self._should_skip is None:
            skip, skip_state = _no_skip(updates, state.gradient_step, params)
        else:
            skip, skip_state = self._skip_fn()(updates, state.gradient_step, params)
            if not isinstance(skip, Tensor) or skip.dtype != torch.bool or skip.ndim != 0:
                raise ValueError(
                    "MultiSteps: should_skip_update_fn must return a 0-d bool tensor, got "
                    f"{type(skip).__name__} {getattr(skip, 'dtype', '')} {tuple(getattr(skip, 'shape', ()))}"
                )
            if not self._skip_is_global:  # a per-rank verdict: any rank's skip is everyone's
                skip = sharding.any_rank(skip, updates, self._spec)
            skip = skip.to(state.gradient_step.device)
        # the old accumulator must survive a skipped mini-step, so it is only reused when none can be
        acc_grads = self._accumulate(updates, state.acc_grads, state.mini_step, inplace=inplace and self._should_skip is None)
        inner_grads = self._inner_grads(updates, acc_grads)
        final_updates, new_inner_state = self._opt_update(
            inner_grads, state.inner_opt_state, params, inplace=False, **extra_args
        )

        emit = state.mini_step == k_steps - 1
        apply = emit & ~skip
        # select everything that may alias the accumulator before it is reset in place
        out_updates = where_or_zero(apply, final_updates)
        inner_state = where_tree(apply, new_inner_state, state.inner_opt_state, what="MultiSteps")
        if self._should_skip is None:
            new_acc = self._reset(acc_grads, emit, inplace=inplace)
        else:
            new_acc = where_tree(skip, state.acc_grads, self._reset(acc_grads, emit, inplace=False), what="MultiSteps")
        new_state = MultiStepsState(
            mini_step=torch.where(skip, state.mini_step, safe_increment(state.mini_step) % k_steps),
            gradient_step=torch.where(apply, safe_increment(state.gradient_step), state.gradient_step),
            inner_opt_state=inner_state,
            acc_grads=new_acc,
            skip_state=skip_state,
        )
        return out_updates, new_state

    def _accumulate(self, updates: PyTree, acc_grads: PyTree, mini_step: Tensor, *, inplace: bool) -> PyTree:
        """``acc + (g - acc) / (n + 1)`` (mean, as one ``lerp``) or ``acc + g`` (sum), per (device, dtype) group."""
        acc_leaves, treedef = tree_lib.flatten(acc_grads)
        grad_leaves = tree_lib.flatten_like(
            updates, treedef, acc_grads, what="MultiSteps: updates", like="state.acc_grads"
        )
        present = [i for i, (a, g) in enumerate(zip(acc_leaves, grad_leaves)) if a is not None and g is not None]
        accs = [acc_leaves[i] for i in present]
        grads = [grad_leaves[i].to(acc_leaves[i].dtype) for i in present]
        out = list(acc_leaves)
        for indices, (group_accs, group_grads) in tree_lib.grouped(accs, grads):
            if self._use_grad_mean:
                weight = 1.0 / (mini_step.to(group_accs[0].device) + 1).to(group_accs[0].dtype)
                if not inplace and torch.compiler.is_compiling():
                    # the out-of-place foreach lerp reads a tensor weight on the host (a graph break);
                    # the in-place one on fresh copies gives the same numbers in the graph
                    group_accs, inplace_here = [a.clone() for a in group_accs], True
                else:
                    inplace_here = inplace
                new = tree_lib.foreach("lerp", group_accs, group_grads, weight, inplace=inplace_here)
            else:
                new = tree_lib.foreach_add(group_accs, group_grads, inplace=inplace)
            for i, value in zip(indices, new):
                out[present[i]] = value
        return tree_lib.unflatten(treedef, out)

    @staticmethod
    def _reset(acc_grads: PyTree, emit: Tensor, *, inplace: bool) -> PyTree:
        """Zeros after an emitting step, the accumulator otherwise."""
        if inplace and not tree_lib.needs_graph(tree_lib.leaves(acc_grads), emit):
            return tree_lib.tree_map(lambda a: a.masked_fill_(emit.to(a.device), 0), acc_grads)
        return tree_lib.tree_map(lambda a: torch.where(emit.to(a.device), 0, a), acc_grads)

    def has_updated(self, state: MultiStepsState) -> Tensor:
        """Whether the last call emitted an update (a 0-d bool tensor)."""
        return (state.mini_step == 0) & (state.gradient_step > 0)

    def gradient_transformation(self) -> GradientTransformation:
        """This accumulator as a ``GradientTransformation`` (to put it in a chain).

        A ``GradientTransformationExtraArgs`` when the inner transformation takes extra arguments.
        """
        kind = GradientTransformationExtraArgs if self._opt_takes_extra_args else GradientTransformation

        def update(updates, state: MultiStepsState, params=None, *, inplace: bool = False, **extra_args):
            return self.update(updates, state, params, inplace=inplace, **extra_args)

        update.__qualname__ = update.__name__ = "MultiSteps"
        update.__doc__ = self.update.__doc__
        return kind(self.init, step_gates.set_gate(runs_inner(update, self._opt), self.step_gate()))

    def step_gate(self) -> step_gates.StepGate:
        """Whether a call applied the inner transformation: its ``gradient_step`` advanced (and, when
        the inner transformation skips steps itself, it applied that one too)."""
        return step_gates.wrapping(
            lambda state: step_gates.copied(state.gradient_step),
            lambda before, new: new.gradient_step != before.to(new.gradient_step.device),
            step_gates.gate_of(self._opt),
            lambda state: state.inner_opt_state,
        )

