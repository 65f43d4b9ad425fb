"""``wrap``: any torch optimizer, with a gradient transformation run before its step.

``opt = gradtx.wrap(torch.optim.AdamW(model.parameters()), gradtx.clip_by_global_norm(1.0), model=model)``
is a drop-in ``torch.optim.Optimizer``: it shares the inner optimizer's ``param_groups``, ``state``
and ``defaults`` (so learning-rate schedulers, ``GradScaler`` and checkpoints keep working), and its
``step`` hands the gradients to the transformation as a dict keyed by parameter name, on the donated
(in-place) path, writes the results back to ``.grad`` and then runs the inner step.

Parameter names come from ``model.named_parameters()`` when ``model`` is given (every parameter of
the optimizer must be one of the model's; model parameters the optimizer does not hold are frozen
and ignored), else from the names the optimizer was built with (``optimizer(model.named_parameters())``),
else they are positional: ``"group0.param3"``.

``clip_grad_by_norm`` / ``clip_grad_by_value`` clip ``.grad`` at once, between ``backward`` and
``step``, as Colossal-AI's boosted optimizers and ``torch.nn.utils.clip_grad_norm_`` do; with a
``spec`` the norm is that of the logical gradient across ranks.

Folding. When the transformation ends in a scale by one scalar (``clip_by_global_norm`` does) and
the inner optimizer runs a fused kernel that can divide the gradients by a scalar itself
(``fused=True`` Adam, AdamW, SGD, Adagrad: any optimizer with ``_step_supports_amp_scaling``, the
contract ``GradScaler`` uses), the scale is not applied in a separate pass over the gradients: its
reciprocal goes to the kernel as ``grad_scale``. The kernel then sees ``g / (1 / c)`` instead of
``g * c``: the same when the clip does not engage (``c == 1``), and within one rounding of the
gradient otherwise. ``wrap(..., fold=False)`` keeps the separate pass, which matches
``clip_grad_norm_`` followed by ``step`` bit for bit.

Drop-in details. Attributes the wrapper does not define are read from the inner optimizer
(``consolidate_state_dict``, schedule-free ``train`` / ``eval``, ...). Step hooks, torch's
process-wide ones included, fire once per step with the wrapper. ``GradScaler``'s fused contract
(``grad_scale`` / ``found_inf`` set on the optimizer) is offered only without a transformation,
since a transformation must see unscaled gradients. The chain's state survives ``torch.compile``,
and a state read through ``tx_state`` is never changed by later steps, eager or compiled. Opacus's
``DPOptimizer`` rebuilds ``.grad`` in its own step: wrap the optimizer it wraps instead
(``DPOptimizer(gradtx.wrap(opt, tx), ...)``), so the transformation sees the privatized gradient.

Skipped steps. A step the transformation skips (a ``MultiSteps`` mini-step, a non-finite step under
``apply_if_finite``) does not step the inner optimizer at all: its ``step`` is not called, so its
parameters, state, step counts and own hooks stay exactly as they were, as in the pure path
(:attr:`ChainedOptimizer.last_step_skipped` tells; see :mod:`gradtx.chains.step_gates`). The decision
is read on the host once per step (as ``GradScaler`` reads ``found_inf``); on the CPU counters of
``MultiSteps`` that costs no device synchronisation.

State follows the parameters. When the optimizer's parameters change after ``wrap`` (accelerate's
FSDP2 preparation swaps them for DTensor shards; ``model.double()`` or ``model.to(device)`` change
their dtype or device), the chain's state is built anew by ``tx.init`` for the new parameters, and
every old state leaf whose path and logical shape are unchanged keeps its values, converted to the
dtype, device and layout ``tx.init`` gives it (a DTensor keeps this rank's slice).
"""

from __future__ import annotations

import copy
import functools
import itertools
import operator
import warnings
from collections import OrderedDict
from typing import Any, Callable, NamedTuple, Optional, Union

import torch
from torch import Tensor
from torch.optim import optimizer as torch_optimizer

from gradtx import sharding
from gradtx import tree as tree_lib
from gradtx.base import (
    DONATE_UPDATES,
    GradientTransformation,
    members_unsharded_only,
    members_without_spec,
    takes_donated_updates,
    takes_extra_args,
    with_inplace,
)
from gradtx.chains import step_gates
from gradtx.chains.accumulation import MultiSteps
from gradtx.chains.chain import _PARTS
from gradtx.interop.checkpoint import STATE_KEY, called_by_checkpoint, check_inner_fits, from_plain, in_checkpoint_init_step, split_chain_state, to_plain
from gradtx.sharding import dtensor as dtensor_lib
from gradtx.state_dims import without_rank_shares
from gradtx.transforms.clipping import clip_by_global_norm, clip_by_value


_HOOK_DICTS = (
    "_optimizer_step_pre_hooks",
    "_optimizer_step_post_hooks",
    "_optimizer_state_dict_pre_hooks",
    "_optimizer_state_dict_post_hooks",
    "_optimizer_load_state_dict_pre_hooks",
    "_optimizer_load_state_dict_post_hooks",
)


_MISSING = object()

_INNER_STEP_HOOKS = ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks")
"""Where an optimizer keeps its own step hooks, pre and post (``register_step_pre_hook``)."""

_UNKNOWN_HOOKS: dict[Any, Any] = {}  # where torch keeps its process-wide step hooks is unknown


def _global_step_hooks() -> tuple[dict[Any, Any], dict[Any, Any]]:
    """Torch's process-wide step hooks (``register_optimizer_step_pre_hook`` / ``_post_hook``),
    pre and post, or :data:`_UNKNOWN_HOOKS` twice where this torch keeps them elsewhere."""
    pre = getattr(torch_optimizer, "_global_optimizer_pre_hooks", None)
    post = getattr(torch_optimizer, "_global_optimizer_post_hooks", None)
    if not (isinstance(pre, dict) and isinstance(post, dict)):
        return _UNKNOWN_HOOKS, _UNKNOWN_HOOKS
    return pre, post


_AMP_ATTRS = ("grad_scale", "found_inf")
"""What ``GradScaler`` sets on an optimizer with ``_step_supports_amp_scaling`` before its step."""


def _check_members_take_spec(tx: GradientTransformation) -> None:
    """``wrap(..., spec=)`` serves ``clip_grad_by_norm`` only: a sharding-aware member of the chain
    (at any depth: inside ``masked``, ``partition``, ``MultiSteps``, ...) given no spec of its own
    would work on this rank's pieces alone, a silently wrong number."""
    unsharded = members_unsharded_only(tx)
    if unsharded:
        owner, what = unsharded[0]
        raise ValueError(
            f"wrap: spec= was given, but the chain's {owner} computes {what} over the whole tree and takes no spec, "
            "so on sharded params it would use this rank's pieces only; it runs on unsharded (or DTensor-free, "
            "whole) params alone"
        )
    missing = members_without_spec(tx)
    if missing:
        name = missing[0]
        more = f" (and {', '.join(missing[1:])})" if len(missing) > 1 else ""
        raise ValueError(
            f"wrap: spec= was given, but the chain's {name}{more} has no spec, so it would work on this rank's "
            f"pieces only; pass the spec to it as well (e.g. gtx.{name}(..., spec=spec)). wrap's spec= is "
            "used by clip_grad_by_norm and clip_grad_by_value; members of the chain take their own"
        )


def _check_gates(state: Any, gate: Optional[step_gates.StepGate]) -> None:
    """A ``MultiSteps`` or ``apply_if_finite`` that only some leaves go through (inside ``partition``,
    ``masked``, ...) would skip part of a step; the inner optimizer can only skip whole steps."""
    if step_gates.ungated_skippers(state, gate):
        raise ValueError(
            "wrap: the transformation holds a MultiSteps or apply_if_finite inside a combinator other than chain "
            "(partition, masked, inject_hyperparams, ...), so it would skip the step for some parameters only, "
            "while the inner optimizer would still step all of them. Put MultiSteps / apply_if_finite at the top "
            "of the chain (they may wrap anything), so a skipped step skips the inner optimizer's step"
        )


def _attribute(objects: list, name: str) -> list:
    """``[getattr(o, name) for o in objects]`` in one native map (with many small params a Python
    step each costs more than the kernels), in a form Dynamo traces."""
    return list(map(getattr, objects, [name] * len(objects)))


def _same_objects(a: list, b: list) -> bool:
    """Whether ``a[i] is b[i]`` at every position (in a native map eagerly)."""
    if torch.compiler.is_compiling():
        return all(x is y for x, y in zip(a, b))
    return all(map(operator.is_, a, b))


class _Prepared(NamedTuple):
    """What :meth:`ChainedOptimizer.step` does after the transformation ran."""

    args: tuple[Any, ...]
    amp: dict[str, Tensor]
    run_inner: bool = True
    result: Any = None


def _replaying(loss: Any, closure: Callable[[], Any]) -> Callable[[], Any]:
    """A closure returning ``loss`` on its first call (already evaluated) and calling ``closure`` after."""
    pending = [loss]

    def replay() -> Any:
        if pending:
            return pending.pop()
        return closure()

    return replay


def _scheduler_tracked_step(raw_step: Callable[..., Any], inner: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
    """``raw_step(inner, ...)``, first marking the call as a learning-rate scheduler's step patch does."""
    inner._opt_called = True  # type: ignore[attr-defined]
    return raw_step(inner, *args, **kwargs)


def _is_dp_optimizer(optimizer: torch.optim.Optimizer) -> bool:
    """Opacus's ``DPOptimizer`` family: ``step`` rebuilds ``.grad`` from per-sample gradients."""
    return hasattr(optimizer, "original_optimizer") and callable(getattr(optimizer, "pre_step", None))


def _describe(tx: Optional[GradientTransformation]) -> str:
    if tx is None:
        return "none"

    def name(part: GradientTransformation) -> str:
        qualname = getattr(part.update, "__qualname__", type(part.update).__name__)
        return qualname.split(".<locals>")[0]

    parts = getattr(tx.init, _PARTS, None)
    return name(tx) if parts is None else "chain(" + ", ".join(name(p) for p in parts) + ")"


def _group_tensors(params: Any) -> list[Any]:
    """The tensors of a param group's ``params`` entry (tensors, or ``(name, tensor)`` pairs)."""
    if isinstance(params, Tensor):
        return [params]
    return [p[1] if isinstance(p, tuple) else p for p in params]


class ChainedOptimizer(torch.optim.Optimizer):
    """A torch optimizer whose gradients pass through a :class:`GradientTransformation` first.

    Built by :func:`wrap`. ``param_groups``, ``state`` and ``defaults`` are the inner optimizer's.
    The transformation's state is :attr:`tx_state`; ``state_dict()`` carries it in its first param
    group under ``STATE_KEY``, as a dict of tensors (and plain numbers) keyed by state path. With a
    ``spec``, that dict is :func:`gradtx.checkpoint.state_dict`'s: ``torch.distributed.checkpoint``
    saves each plain piece as a piece of its logical tensor and loads it into any other layout (the
    inner optimizer's own state stays as the inner optimizer keeps it).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        tx: Optional[GradientTransformation] = None,
        *,
        model: Optional[torch.nn.Module] = None,
        spec: Optional[sharding.ShardingSpec] = None,
        fold: bool = True,
    ):
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"wrap: expected a torch.optim.Optimizer instance, got {type(optimizer).__name__}"
                + (" (a class: build the optimizer first, or use gradtx.from_torch)" if isinstance(optimizer, type) else "")
            )
        if isinstance(tx, MultiSteps):
            tx = tx.gradient_transformation()
        if tx is not None and not isinstance(tx, GradientTransformation):
            raise TypeError(
                f"wrap: tx must be a GradientTransformation, a MultiSteps or None, got {type(tx).__name__}"
            )
        if tx is not None and _is_dp_optimizer(optimizer):
            raise TypeError(
                f"wrap: {type(optimizer).__name__} recomputes .grad from the per-sample gradients in its step, "
                "so a transformation run before it would be silently ignored, and one run on the per-sample "
                "gradients would change the privacy guarantee. Wrap the optimizer Opacus wraps instead, so the "
                "transformation sees the privatized gradient: DPOptimizer(gradtx.wrap(torch.optim.SGD(...), tx), "
                "noise_multiplier=..., max_grad_norm=..., expected_batch_size=...) or "
                "PrivacyEngine().make_private(module=..., optimizer=gradtx.wrap(torch.optim.SGD(...), tx), ...)"
            )
        if model is not None and not isinstance(model, torch.nn.Module):
            raise TypeError(f"wrap: model must be a torch.nn.Module, got {type(model).__name__}")
        if spec is not None and tx is not None:
            _check_members_take_spec(tx)
        # Deliberately no Optimizer.__init__: param_groups, state and defaults are the inner ones.
        self.optimizer = optimizer
        self.tx = tx
        self.spec = spec
        self.model = model
        self.fold = bool(fold)
        for hooks in _HOOK_DICTS:
            setattr(self, hooks, OrderedDict())
        self._patch_step_function()
        self._names, self._params = self._name_params()
        self._remember_layouts()
        # The state lives in a list, not in an attribute: under torch.compile an attribute written on an
        # optimizer is dropped, a list entry written is kept. The second entry says whether the state
        # was handed out (``tx_state``): it is then never written in place again.
        self._state_box: list[Any] = [None, False]
        with torch.no_grad():
            self._tx_state = None if tx is None else tx.init(self._param_tree())
        self._gate = None if tx is None else step_gates.gate_of(tx)
        if tx is not None:
            _check_gates(self._tx_state, self._gate)
        self._skipped_box: list[Union[None, bool, Tensor]] = [None]  # in a list for the reason _state_box is
        self._keep_state_slot()
        self._tx_update = None if tx is None else with_inplace(tx)
        self._fold_plan = self._plan_fold(tx)

    # ------------------------------------------------------------------ shared with the inner optimizer

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property
    def state(self):
        return self.optimizer.state

    @state.setter
    def state(self, value) -> None:
        self.optimizer.state = value

    @property
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.optimizer.defaults = value

    @property
    def _step_supports_amp_scaling(self) -> bool:
        """Whether ``GradScaler`` may hand ``grad_scale`` / ``found_inf`` to :meth:`step` (its fused contract).

        Only without a transformation, and when the inner optimizer supports it: they are then passed
        on to the inner step. A transformation must see unscaled gradients, so with one ``GradScaler``
        unscales them (and skips non-finite steps) before :meth:`step`, as for a plain optimizer.
        """
        return self.tx is None and bool(getattr(self.optimizer, "_step_supports_amp_scaling", False))

    def __getattr__(self, name: str) -> Any:
        """Forwards what the wrapper does not define to the inner optimizer.

        (``consolidate_state_dict`` of ``ZeroRedundancyOptimizer``, ``train`` / ``eval`` of
        schedule-free optimizers, ...). Only called when ordinary lookup fails; dunder names and a
        wrapper without its inner optimizer yet (during unpickling) raise ``AttributeError``.
        """
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        try:
            inner = self.__dict__["optimizer"]
        except KeyError:
            raise AttributeError(name) from None
        try:
            return getattr(inner, name)
        except AttributeError:
            raise AttributeError(
                f"'{type(self).__name__}' object has no attribute {name!r} (nor has the {type(inner).__name__} it wraps)"
            ) from None

    @property
    def last_step_skipped(self) -> Optional[bool]:
        """Whether the last :meth:`step` skipped the inner optimizer's step (None before the first).

        A step is skipped when the transformation skipped it (a ``MultiSteps`` mini-step, a
        non-finite step under ``apply_if_finite``) or when ``found_inf`` was set. The inner
        optimizer then learns nothing of it: its ``step`` is not called, so its parameters, state,
        step counts and own hooks stay as they were, exactly as the pure path leaves them. Without
        a transformation, ``found_inf`` goes to the inner (fused) step, which skips itself; it is
        read here, on the host, only when this is asked.

        ``GradScaler`` with a transformation unscales the gradients itself and, when they are not
        finite, does not call :meth:`step` at all: the wrapper does not see that step, and this
        keeps the value of the step before (read ``scaler.get_scale()``, which drops on such a step).
        """
        skipped = self._skipped_box[0]
        return bool(skipped) if isinstance(skipped, Tensor) else skipped

    @property
    def _last_step_skipped(self) -> Optional[bool]:
        return self._skipped_box[0]

    @_last_step_skipped.setter
    def _last_step_skipped(self, skipped: Union[bool, Tensor]) -> None:
        self._skipped_box[0] = skipped

    @property
    def tx_state(self) -> Any:
        """The transformation's current state (``tx_state[0].norm`` is the last pre-clip norm, say).

        What this returns is never changed afterwards, by eager or compiled steps alike: a step
        after it was read computes a new state instead of updating this one in place (so keep it
        for logging at no cost; a step that follows no read reuses the state's buffers).
        """
        self._state_box[1] = True
        return self._state_box[0]

    @property
    def _tx_state(self) -> Any:
        return self._state_box[0]

    @_tx_state.setter
    def _tx_state(self, state: Any) -> None:
        self._state_box[0] = state
        self._state_box[1] = False

    def _donation(self, tx: GradientTransformation) -> Any:
        """How ``tx`` may be called on the state: donated, unless it was handed out (then updates only).

        Compiled steps never donate the state: whether it was handed out would be one more guard,
        and reading it every step would compile the step twice.
        """
        if not torch.compiler.is_compiling() and not self._state_box[1]:
            return True
        return DONATE_UPDATES if takes_donated_updates(tx) else False

    # ------------------------------------------------------------------ names

    def _model_names(self) -> dict[int, str]:
        names: dict[int, str] = {}
        for name, param in self.model.named_parameters():
            names.setdefault(id(param), name)
        return names

    def _name_params(self) -> tuple[list[str], list[Tensor]]:
        model_names = self._model_names() if self.model is not None else None
        names: list[str] = []
        params: list[Tensor] = []
        for g, group in enumerate(self.param_groups):
            group_names = group.get("param_names")
            for i, param in enumerate(group["params"]):
                if model_names is not None:
                    if id(param) not in model_names:
                        raise ValueError(
                            f"wrap: parameter {i} of param group {g} (shape {tuple(param.shape)}) is not a "
                            "parameter of the model given as model=; pass the model the optimizer was built from"
                        )
                    name = model_names[id(param)]
                elif group_names is not None:
                    name = str(group_names[i])
                else:
                    name = f"group{g}.param{i}"
                names.append(name)
                params.append(param)
        if len(set(names)) != len(names):
            seen: set[str] = set()
            duplicate = next(n for n in names if n in seen or seen.add(n))
            raise ValueError(f"wrap: two optimized parameters share the name {duplicate!r}")
        return names, params

    # The chain sees OrderedDicts: they flatten in parameter order (a plain dict flattens sorted by
    # key), so reductions over them (the global norm) add the per-parameter terms in the order
    # ``clip_grad_norm_`` does and match torch's numbers bit for bit, with no process-wide mode.
    # Masks, labels and spec prefixes written as plain dicts still match them key by key.

    def _param_tree(self) -> OrderedDict[str, Tensor]:
        return OrderedDict(zip(self._names, self._params))

    def _grad_tree(self) -> OrderedDict[str, Optional[Tensor]]:
        return OrderedDict(zip(self._names, _attribute(self._params, "grad")))

    def _sync_params(self) -> None:
        """Follows the parameters: re-derives names, and the state, when they changed since the last call.

        A change is another set of parameter objects (``add_param_group``, accelerate's FSDP2
        preparation swapping them for DTensor shards) or a parameter whose dtype or device changed
        in place (``model.double()``, ``model.to(device)``). The state is then built anew by
        ``tx.init`` for the current parameters, and every old leaf whose path and logical shape are
        unchanged keeps its value, converted to the dtype, device and layout ``tx.init`` gave that
        leaf (see :func:`_carry_over`).
        """
        current = [p for group in self.param_groups for p in group["params"]]
        if (
            len(current) == len(self._params)
            and _same_objects(current, self._params)
            and _attribute(current, "dtype") == self._dtypes
            and _attribute(current, "device") == self._devices
        ):
            return
        self._names, self._params = self._name_params()
        self._remember_layouts()
        self._keep_state_slot()
        if self.tx is not None:
            with torch.no_grad():
                self._tx_state = _carry_over(self._tx_state, self.tx.init(self._param_tree()))

    def _keep_state_slot(self) -> None:
        """Makes sure the first param group has the key the chain's state travels under (see :meth:`state_dict`).

        The live group holds ``None`` there (no reference to the state); :meth:`state_dict` fills in
        the state. The key must be in the live group because torch's checkpoint code rebuilds a
        flattened optimizer state dict from the keys the live param groups have.
        """
        if self.tx is not None and self.param_groups:
            self.param_groups[0][STATE_KEY] = None

    def _remember_layouts(self) -> None:
        self._dtypes = _attribute(self._params, "dtype")
        self._devices = _attribute(self._params, "device")

    def _write_back(self, updates: dict[str, Optional[Tensor]]) -> None:
        if isinstance(updates, dict) and len(updates) == len(self._names) and not torch.compiler.is_compiling():
            try:  # every gradient transformed in place (donated): nothing to write, checked in native maps
                if _same_objects(list(map(updates.__getitem__, self._names)), _attribute(self._params, "grad")):
                    return
            except KeyError:
                pass  # named below
        for name, param in zip(self._names, self._params):
            try:
                new = updates[name]
            except (KeyError, TypeError):
                raise ValueError(f"wrap: the transformation's output has no entry {name!r}") from None
            if new is param.grad:
                continue
            if new is not None and (new.shape != param.shape or new.dtype != param.dtype or new.device != param.device):
                raise ValueError(
                    f"wrap: the transformation turned the gradient of {name!r} into {tuple(new.shape)} {new.dtype} "
                    f"on {new.device}, but the parameter is {tuple(param.shape)} {param.dtype} on {param.device}"
                )
            param.grad = new

    # ------------------------------------------------------------------ the step

    @staticmethod
    def _plan_fold(tx: Optional[GradientTransformation]):
        """``(head parts, last part, its scalar_factor)`` when ``tx`` ends in a scalar scale, else None."""
        if tx is None:
            return None
        parts = getattr(tx.init, _PARTS, None)
        head, last = ((), tx) if parts is None else (parts[:-1], parts[-1])
        factor_fn = getattr(last.update, "scalar_factor", None)
        if factor_fn is None:
            return None
        return tuple((with_inplace(p), p) for p in head), factor_fn, parts is not None

    def _can_fold(self, grads: list[Tensor]) -> bool:
        inner = self.optimizer
        return (
            self.fold
            and self._fold_plan is not None
            and getattr(inner, "_step_supports_amp_scaling", False)
            and all(group.get("fused") for group in self.param_groups)
            and not hasattr(inner, "grad_scale")
            and not hasattr(inner, "found_inf")
            and not sharding.has_dtensor(grads)
        )

    @torch.no_grad()
    def _transform(self, *, allow_fold: bool, extra_args: dict[str, Any]) -> Optional[Tensor]:
        """Runs the transformation on the gradients; returns a ``grad_scale`` for the kernel if folded."""
        self._sync_params()
        if self.tx is None:
            return None
        return self._run_tx(allow_fold, extra_args)

    def _run_tx(self, allow_fold: bool, extra_args: dict[str, Any]) -> Optional[Tensor]:
        grads = self._grad_tree()
        try:
            return self._run_tx_on(grads, allow_fold, extra_args)
        except (RuntimeError, NotImplementedError, TypeError) as exc:
            sparse = [name for name, g in grads.items() if isinstance(g, Tensor) and g.layout != torch.strided]
            if not sparse or torch.compiler.is_compiling():
                raise
            raise TypeError(
                f"wrap: the transformation could not take the sparse gradients of {sparse} ({type(exc).__name__}: {exc}). "
                "Sparse gradients pass through stateless transformations (clip_by_global_norm, clip_by_value, scale, "
                "apply_if_finite around them); one that keeps per-element state or adds a dense term (trace, MultiSteps, "
                "add_noise, an optimizer) needs dense ones: Embedding(sparse=False)"
            ) from exc

    def _run_tx_on(self, grads: dict[str, Any], allow_fold: bool, extra_args: dict[str, Any]) -> Optional[Tensor]:
        params = self._param_tree()
        present = [g for g in grads.values() if g is not None]
        if allow_fold and not extra_args and self._can_fold(present):
            head, factor_fn, is_chain = self._fold_plan
            kept = self._gate.before(self._tx_state) if self._gate is not None else None
            states = list(self._tx_state) if is_chain else [self._tx_state]
            updates = grads
            for i, (update, part) in enumerate(head):
                updates, states[i] = update(updates, states[i], params, inplace=self._donation(part))
            factor, states[-1] = factor_fn(updates, states[-1], params)
            new_state = tuple(states) if is_chain else states[0]
            self._store_state(new_state)
            self._write_back(updates)
            if self._gate is not None and not bool(self._gate.applied(kept, new_state)):
                self._last_step_skipped = True
                return None
            if factor.dtype == torch.float32:
                return torch.reciprocal(factor)
            # The fused kernels take a float32 scale; apply a wider one as a separate pass instead.
            self._scale_grads(factor)
            return None
        kept = self._gate.before(self._tx_state) if self._gate is not None else None
        updates, new_state = self._tx_update(grads, self._tx_state, params, inplace=self._donation(self.tx), **extra_args)
        self._store_state(new_state)
        self._write_back(updates)
        if self._gate is not None:
            self._last_step_skipped = not bool(self._gate.applied(kept, new_state))
        return None

    def _store_state(self, new_state: Any) -> None:
        """Makes ``new_state`` the transformation's state (kept under ``torch.compile`` too: see ``_state_box``)."""
        self._tx_state = new_state

    def _scale_grads(self, factor: Tensor) -> None:
        grads = [p.grad for p in self._params if p.grad is not None]
        local, _ = sharding.locals_of(grads)
        tree_lib.scale_(local, factor, inplace=True)

    def _raw_inner_step(self) -> Optional[Callable[..., Any]]:
        """The inner optimizer's step function without torch's hook wrapper, or None to call ``step`` as is.

        The process-wide step hooks (``register_optimizer_step_pre_hook``) run for the wrapper, as for
        any optimizer, so the inner step runs without them: they fire once per step, with the wrapper.
        The inner optimizer's own hooks are run around it by :meth:`step`. A step that is not torch's
        hooked one, or one patched on the instance (a scheduler's counter), is called as it is.
        """
        inner = self.optimizer
        step = getattr(type(inner), "step", None)
        if not getattr(step, "hooked", False) or not all(isinstance(getattr(inner, name, None), dict) for name in _INNER_STEP_HOOKS):
            return None  # (where torch keeps an optimizer's step hooks elsewhere, its hooked step runs them)
        patched = inner.__dict__.get("step")
        if patched is not None:
            if not getattr(patched, "_wrapped_by_lr_sched", False):
                return None
            # A learning-rate scheduler built on the inner optimizer before wrapping replaced its step
            # by one that records the call and then runs torch's hooked step: record it here, and run
            # the step without torch's hooks, which fire for the wrapper.
            return functools.partial(_scheduler_tracked_step, getattr(step, "__wrapped__", None))
        return getattr(step, "__wrapped__", None)

    @staticmethod
    def _call_with_amp(inner: torch.optim.Optimizer, call: Callable[..., Any], args, kwargs, amp: dict[str, Tensor]) -> Any:
        """``call(*args, **kwargs)`` with ``amp`` (``grad_scale`` / ``found_inf``) set on ``inner`` meanwhile."""
        for name, value in amp.items():
            setattr(inner, name, value)
        try:
            return call(*args, **kwargs)
        finally:
            for name in amp:
                delattr(inner, name)

    def _amp_attrs(self) -> dict[str, Tensor]:
        """What ``GradScaler`` (or a caller following its fused contract) set on the wrapper for this step."""
        return {name: self.__dict__[name] for name in _AMP_ATTRS if self.__dict__.get(name) is not None}

    def _patch_step_function(self) -> None:
        """Torch wraps every optimizer class's ``step`` in a function running the step hooks; not this one.

        :meth:`step` runs the same hooks (process-wide and per instance, with torch's semantics)
        itself: under ``torch.compile`` each Python frame between the compiled function and the inner
        step's own graph break costs one more break, and this keeps the count torch's.
        """
        self._zero_grad_profile_name = f"Optimizer.zero_grad#{type(self).__name__}.zero_grad"

    def _check_extra_args(self, extra_args: dict[str, Any]) -> None:
        """Extra keyword arguments of ``step`` go to the transformation, which must take them."""
        if extra_args and (self.tx is None or not takes_extra_args(self.tx)):
            raise TypeError(
                f"wrap: step() got {sorted(extra_args)}, but the transformation ({_describe(self.tx)}) takes no "
                "extra arguments; only a GradientTransformationExtraArgs (a line search, lbfgs, polyak_sgd, or a "
                "chain holding one) receives value=, grad=, value_fn=, ..."
            )

    def _prepare_step(self, closure: Optional[Callable[[], Any]] = None, **extra_args: Any) -> _Prepared:
        """Runs the transformation (or wraps ``closure`` to run it); says whether the inner step runs.

        ``extra_args`` go to the transformation's update; with a ``closure`` and a transformation that
        takes extra arguments, the loss the closure returns is also passed as ``value=`` (unless given).

        The inner step is skipped when ``found_inf`` says so (with a transformation: see :meth:`step`)
        or when the transformation skipped the step (its gate, see :mod:`gradtx.chains.step_gates`).
        """
        self._last_step_skipped = False
        amp = self._amp_attrs()
        if amp and self.tx is not None:
            if "found_inf" in amp and bool(amp["found_inf"]):
                self._last_step_skipped = True
                return _Prepared((), {}, run_inner=False)
            if "grad_scale" in amp:
                self._sync_params()
                self._scale_grads(torch.reciprocal(amp["grad_scale"].double()).float())
            amp = {}
        if closure is not None:
            forward_value = self.tx is not None and takes_extra_args(self.tx) and "value" not in extra_args

            def transformed_closure():
                with torch.enable_grad():
                    loss = closure()
                value = {"value": loss.detach() if isinstance(loss, Tensor) else loss} if forward_value else {}
                self._transform(allow_fold=False, extra_args={**extra_args, **value})
                return loss

            if self._gate is None:
                self._note_found_inf(amp)
                return _Prepared((transformed_closure,), amp)
            # A gated chain decides before the inner step whether there is one: the first evaluation
            # runs here, and the inner step's first call of the closure gets its loss.
            loss = transformed_closure()
            if self._last_step_skipped:
                return _Prepared((), {}, run_inner=False, result=loss)
            return _Prepared((_replaying(loss, transformed_closure),), amp)
        grad_scale = self._transform(allow_fold=not amp, extra_args=extra_args)
        if self._last_step_skipped:
            return _Prepared((), {}, run_inner=False)
        self._note_found_inf(amp)
        return _Prepared((), {"grad_scale": grad_scale} if grad_scale is not None else amp)

    def _note_found_inf(self, amp: dict[str, Tensor]) -> None:
        """Without a transformation ``found_inf`` goes to the inner step, which skips itself where it
        is set: :attr:`last_step_skipped` reads it when asked (no host sync in the step)."""
        if "found_inf" in amp:
            self._last_step_skipped = amp["found_inf"].detach().clone()

    def step(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        """``step(closure=None, **extra_args)``: transforms the gradients, writes them back to ``.grad``,
        runs the inner step.

        With a ``closure`` the transformation runs after each evaluation the inner optimizer makes.
        Keyword arguments other than ``closure`` (``value=``, ``value_fn=``, ...) go to a transformation
        that takes extra arguments (a ``TypeError`` otherwise, before anything runs); with a closure,
        such a transformation also gets the closure's loss as ``value=``. The inner step sees neither.
        ``grad_scale`` / ``found_inf`` set on the wrapper (``GradScaler``'s fused contract) go to the
        inner step; with a transformation, the wrapper first unscales the gradients by
        ``grad_scale`` and skips the whole step (transformation included) when ``found_inf`` is set.
        Step hooks, torch's process-wide ones included, run once, with the wrapper, as for any optimizer.
        """
        self._check_extra_args({k: v for k, v in kwargs.items() if k != "closure"})
        if (args[0] if args else kwargs.get("closure")) is None and in_checkpoint_init_step():
            # torch.distributed.checkpoint steps an optimizer with no state once, with zero gradients
            # and a zero learning rate, so that the inner optimizer's state exists; the chain's state
            # already does, and this step is not a training step: the chain must not advance.
            return self.optimizer.step()
        # as torch's hook wrapper passes them: the optimizer first, then step's arguments as given
        args = (self, *args)
        global_pre, global_post = _global_step_hooks()
        with torch.autograd.profiler.record_function(f"Optimizer.step#{type(self).__name__}.step"):
            for pre_hook in itertools.chain(global_pre.values(), self._optimizer_step_pre_hooks.values()):
                result = pre_hook(self, args, kwargs)
                if result is not None:
                    if not (isinstance(result, tuple) and len(result) == 2):
                        raise RuntimeError(f"a step pre-hook must return None or (new_args, new_kwargs), got {result}")
                    args, kwargs = result
            prepared = self._prepare_step(*args[1:], **kwargs)
            inner = self.optimizer
            # where torch keeps its process-wide hooks elsewhere, its own step wrapper runs them (around
            # the inner step)
            raw = self._raw_inner_step() if global_pre is not _UNKNOWN_HOOKS else None
            if not prepared.run_inner:
                # a skipped step (found_inf, or the chain skipped it): the inner optimizer does not step
                out = prepared.result
            elif raw is None:
                inner_args, amp = prepared.args, prepared.amp
                out = self._call_with_amp(inner, inner.step, inner_args, {}, amp) if amp else inner.step(*inner_args)
            else:
                # the inner optimizer's own hooks, called as torch's wrapper calls them (inner first in args)
                inner_args, amp = (inner, *prepared.args), prepared.amp
                inner_kwargs: dict[str, Any] = {}
                for hook in getattr(inner, _INNER_STEP_HOOKS[0]).values():
                    result = hook(inner, inner_args, inner_kwargs)
                    if result is not None:
                        inner_args, inner_kwargs = result
                # called in this frame, not in a helper: see _patch_step_function
                if amp:
                    out = self._call_with_amp(inner, raw, inner_args, inner_kwargs, amp)
                else:
                    out = raw(*inner_args, **inner_kwargs)
                for hook in getattr(inner, _INNER_STEP_HOOKS[1]).values():
                    hook(inner, inner_args, inner_kwargs)
            step_code = getattr(self, "_optimizer_step_code", None)  # a no-op that profilers find
            if step_code is not None:
                step_code()
            for post_hook in itertools.chain(self._optimizer_step_post_hooks.values(), global_post.values()):
                post_hook(self, args, kwargs)
            return out

    # ------------------------------------------------------------------ clipping between backward and step

    @torch.no_grad()
    def clip_grad_by_norm(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False) -> Tensor:
        """Clips ``.grad`` in place to global norm ``max_norm``; returns the norm before clipping.

        The numbers of ``torch.nn.utils.clip_grad_norm_`` (with ``spec``: of the logical gradient).
        """
        self._sync_params()
        clip = clip_by_global_norm(max_norm, self.spec, norm_type=norm_type, error_if_nonfinite=error_if_nonfinite)
        grads = self._grad_tree()
        updates, state = clip.update(grads, clip.init(grads), self._param_tree(), inplace=True)
        self._write_back(updates)
        return state.norm

    @torch.no_grad()
    def clip_grad_by_value(self, clip_value: float) -> None:
        """Clamps every gradient element into ``[-clip_value, clip_value]`` in place (``clip_grad_value_``)."""
        self._sync_params()
        clip = clip_by_value(clip_value)
        grads = self._grad_tree()
        updates, _ = clip.update(grads, clip.init(grads), self._param_tree(), inplace=True)
        self._write_back(updates)

    # ------------------------------------------------------------------ the rest of the Optimizer API

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if self.model is not None and isinstance(param_group, dict) and "params" in param_group:
            params = param_group["params"]
            params = [params] if isinstance(params, Tensor) else list(params)
            param_group["params"] = params
            model_names = self._model_names()
            for i, param in enumerate(_group_tensors(params)):
                if isinstance(param, Tensor) and id(param) not in model_names:
                    raise ValueError(
                        f"wrap: parameter {i} of the new param group (shape {tuple(param.shape)}) is not a "
                        "parameter of the model given as model="
                    )
        self.optimizer.add_param_group(param_group)
        self._keep_state_slot()
        self._sync_params()

    def state_dict(self) -> dict[str, Any]:
        for hook in self._optimizer_state_dict_pre_hooks.values():
            hook(self)
        self._keep_state_slot()
        state_dict = self.optimizer.state_dict()
        if self.tx is not None:
            plain = self._chain_state_dict()
            live = self.param_groups
            groups = list(state_dict["param_groups"])
            if groups:
                # every entry of the first group carries it: the group may be listed more than once
                for i, group in enumerate(live[: len(groups)]):
                    if group is live[0]:
                        groups[i] = {**groups[i], STATE_KEY: plain}
                state_dict = {**state_dict, "param_groups": groups}
            else:
                state_dict = {**state_dict, STATE_KEY: {"tx_state": plain}}
        for hook in self._optimizer_state_dict_post_hooks.values():
            result = hook(self, state_dict)
            if result is not None:
                state_dict = result
        return state_dict

    def _chain_state_dict(self) -> dict[str, Any]:
        """The transformation's state as ``state_dict()`` carries it, keyed by state path.

        With ``spec``, or DTensor params and a ``quantize_state`` in the chain: as
        :func:`gradtx.checkpoint.state_dict` lays it out, each plain piece a piece of its logical
        tensor, so ``torch.distributed.checkpoint`` reshards it to any other layout (every rank must
        call ``state_dict()`` then: it makes one ``all_gather_object``). Otherwise: the leaves as
        they are (DTensor leaves reshard by themselves).
        """
        if self.spec is None and not self._pieces_in_state():
            if dtensor_lib.has_dtensor(tree_lib.leaves(self._param_tree())):
                return to_plain(without_rank_shares(self._tx_state))  # one rank's shares would go for all
            return to_plain(self._tx_state)
        from gradtx import checkpoint as checkpoint_lib

        return checkpoint_lib.state_dict(self._tx_state, self._param_tree(), self.spec)

    def _pieces_in_state(self) -> bool:
        """Whether plain tensors of the state are this rank's pieces of a DTensor param's state
        (``quantize_state``'s codes and scales): ``torch.distributed.checkpoint`` would take them
        for copies of one tensor and keep one rank's, so they go as :mod:`gradtx.checkpoint` lays
        them out, each a piece of its logical tensor."""
        from gradtx.tree_utils import tree_get_all_with_path

        return dtensor_lib.has_dtensor(tree_lib.leaves(self._param_tree())) and bool(
            tree_get_all_with_path(self._tx_state, "QuantizedState")
        )

    def _chain_state_from(self, saved: Any) -> Any:
        """A new transformation state from the saved entry: a :mod:`gradtx.checkpoint` dict (it
        has the manifest) is laid out anew for this rank; a dict of leaves as they are must fit
        the current state as it is. Every leaf is a copy, so the saved dict stays the caller's."""
        from gradtx import checkpoint as checkpoint_lib

        if not (isinstance(saved, dict) and checkpoint_lib.MANIFEST in saved):
            return from_plain(saved, self._tx_state)
        loaded = checkpoint_lib.load_state_dict(self._tx_state, saved, self._param_tree(), self.spec)
        return tree_lib.tree_map(lambda x: x.clone() if isinstance(x, Tensor) else x, loaded)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads the inner optimizer's state and the transformation's, all or nothing.

        The transformation's part is checked against the current state (paths, shapes, dtypes)
        and copied before the inner optimizer is touched, and the inner part is checked against
        what the inner optimizer keeps (param groups, hyperparameters, state shapes: see
        :func:`~gradtx.interop.checkpoint.check_inner_fits`); the transformation's state is replaced
        only once the inner optimizer has loaded: a state dict that does not fit leaves this
        optimizer as it was. A state dict without the transformation's entry (saved from the bare inner
        optimizer) leaves the transformation's state as it is.
        """
        state_dict = dict(state_dict)
        for hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = hook(self, state_dict)
            if result is not None:
                state_dict = result
        saved, state_dict = split_chain_state(state_dict)
        self._sync_params()
        check_inner_fits(self.optimizer, state_dict)
        new_tx_state = None
        if saved is not None and self.tx is not None:
            new_tx_state = self._chain_state_from(saved)
        elif self.tx is not None and called_by_checkpoint("_load_optim_state_dict"):
            warnings.warn(
                "wrap: the state dict set_state_dict passed has no transformation state (a checkpoint saved "
                "from the bare inner optimizer?), so the chain keeps its current state",
                stacklevel=2,
            )
        self.optimizer.load_state_dict(state_dict)
        self._keep_state_slot()
        if new_tx_state is not None:
            self._tx_state = new_tx_state
        for hook in self._optimizer_load_state_dict_post_hooks.values():
            hook(self)

    def __repr__(self) -> str:
        first = self.param_groups[0] if self.param_groups else {}
        slot = first.pop(STATE_KEY, _MISSING)  # the state's slot is no hyperparameter: not shown
        try:
            inner = repr(self.optimizer).replace("\n", "\n  ")
        finally:
            if slot is not _MISSING:
                first[STATE_KEY] = slot
        return f"{type(self).__name__} (\n  tx: {_describe(self.tx)}\n  optimizer: {inner}\n)"

    def __getstate__(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def __reduce_ex__(self, protocol: Any) -> Any:
        """Pickles only without a transformation: a transformation is a pair of closures (as optax's
        are), which pickle cannot take; say so, instead of naming a closure deep inside it."""
        if self.tx is not None:
            raise TypeError(
                f"a gradtx.wrap optimizer with a transformation ({_describe(self.tx)}) cannot be pickled: transformations "
                "are closures. Save opt.state_dict() (the transformation's state included; torch.load(..., "
                "weights_only=True) reads it) and load it into an optimizer built again; copy.deepcopy works"
            )
        return super().__reduce_ex__(protocol)

    def __deepcopy__(self, memo: dict[int, Any]) -> ChainedOptimizer:
        """What ``copy.deepcopy`` does for any object (a new instance, then the state deep-copied),
        which shares the transformation's functions, as it shares any function."""
        copied = type(self).__new__(type(self))
        memo[id(self)] = copied
        copied.__setstate__(copy.deepcopy(self.__getstate__(), memo))
        return copied

    def __copy__(self) -> ChainedOptimizer:
        copied = type(self).__new__(type(self))
        copied.__setstate__(self.__getstate__())
        return copied

    def __setstate__(self, state: dict[str, Any]) -> None:
        state = dict(state)
        if "_tx_state" in state:  # pickled before the state moved into ``_state_box``
            state["_state_box"] = [state.pop("_tx_state"), False]
        state.setdefault("_skipped_box", [None])
        state.setdefault("_gate", None)
        self.__dict__.update(state)
        for hooks in _HOOK_DICTS:
            if hooks not in self.__dict__:
                setattr(self, hooks, OrderedDict())
        self._patch_step_function()


def wrap(
    optimizer: torch.optim.Optimizer,
    tx: Optional[GradientTransformation] = None,
    *,
    model: Optional[torch.nn.Module] = None,
    spec: Optional[sharding.ShardingSpec] = None,
    fold: bool = True,
) -> ChainedOptimizer:
    """A drop-in ``torch.optim.Optimizer`` that runs ``tx`` on the gradients before ``optimizer.step``.

    Args:
      optimizer: any torch optimizer (built-in or third-party) holding the parameters.
      tx: a gradient-to-gradient transformation (clipping, noise, masking, ...); ``None`` for none.
      model: names the gradients (``model.named_parameters()``), so path rules and masks work.
      spec: how the parameters are sharded across ranks: the norm of ``clip_grad_by_norm`` is the
        logical gradient's, and ``state_dict()`` saves the transformation's state as pieces of logical
        tensors, which ``torch.distributed.checkpoint`` loads into any other layout (see :mod:`gradtx.checkpoint`).
      fold: let a final scalar scale of ``tx`` ride in a fused kernel's ``grad_scale`` (module docs).
    """
    return ChainedOptimizer(optimizer, tx, model=model, spec=spec, fold=fold)


def _carry_over(old: Any, new: Any) -> Any:
    """``new`` (a fresh state) with the values of ``old`` kept wherever a leaf's path and logical shape
    are unchanged, each in the dtype, device and layout of ``new``'s leaf at that path."""
    old_by_path = dict(zip(tree_lib.paths(old), tree_lib.leaves(old)))
    new_leaves, treedef = tree_lib.flatten(new)
    kept = []
    for path, leaf in zip(tree_lib.paths(new), new_leaves):
        previous = old_by_path.get(path)
        if not (isinstance(leaf, Tensor) and isinstance(previous, Tensor) and previous.shape == leaf.shape):
            kept.append(leaf)
            continue
        try:
            kept.append(sharding.dtensor.relayout(previous, leaf))
        except ValueError as error:
            raise ValueError(
                f"wrap: the parameters changed layout, and the transformation's state {path!r} cannot follow: {error}"
            ) from None
    return tree_lib.unflatten(treedef, kept)

