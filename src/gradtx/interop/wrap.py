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
since a transformation must see unscaled gradients. Under ``torch.compile`` the chain's state is
written in place, so it survives compilation. Opacus's ``DPOptimizer`` rebuilds ``.grad`` in its
own step: wrap the optimizer it wraps instead (``DPOptimizer(gradtx.wrap(opt, tx), ...)``), so the
transformation sees the privatized gradient.
"""

from __future__ import annotations

import itertools
import warnings
from collections import OrderedDict
from typing import Any, Callable, Optional

import torch
from torch import Tensor
from torch.optim import optimizer as torch_optimizer

from gradtx import sharding
from gradtx import tree as tree_lib
from gradtx.base import GradientTransformation, takes_extra_args, with_inplace
from gradtx.chains.accumulation import MultiSteps
from gradtx.chains.chain import _PARTS
from gradtx.interop.checkpoint import STATE_KEY, called_by_checkpoint, from_plain, in_checkpoint_init_step, split_chain_state, to_plain
from gradtx.transforms.clipping import clip_by_global_norm, clip_by_value


_HOOK_DICTS = (
    "_optimizer_step_pre_hooks",
    "_optimizer_step_post_hooks",
    "_optimizer_state_dict_pre_hooks",
    "_optimizer_state_dict_post_hooks",
    "_optimizer_load_state_dict_pre_hooks",
    "_optimizer_load_state_dict_post_hooks",
)


_AMP_ATTRS = ("grad_scale", "found_inf")
"""What ``GradScaler`` sets on an optimizer with ``_step_supports_amp_scaling`` before its step."""


def _check_members_take_spec(tx: GradientTransformation) -> None:
    """``wrap(..., spec=)`` serves ``clip_grad_by_norm`` only: a sharding-aware member of the chain
    given no spec of its own would work on this rank's pieces alone, a silently wrong number."""
    for part in getattr(tx.init, _PARTS, (tx,)):
        if getattr(part.update, "sharding_spec", ...) is None:
            name = getattr(part.update, "__qualname__", "a member").split(".<locals>")[0]
            raise ValueError(
                f"wrap: spec= was given, but the chain's {name} has no spec, so it would work on this rank's "
                f"pieces only; pass the spec to it as well (e.g. gtx.{name}(..., spec)). wrap's spec= is "
                "used by clip_grad_by_norm and clip_grad_by_value; members of the chain take their own"
            )


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
    group under ``STATE_KEY``, as a dict of tensors (and plain numbers) keyed by state path.
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
        with torch.no_grad():
            self._tx_state = None if tx is None else tx.init(self._param_tree())
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
    def tx_state(self) -> Any:
        """The transformation's current state (e.g. ``tx_state[0].norm``: the last pre-clip norm)."""
        return self._tx_state

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
        return OrderedDict((name, param.grad) for name, param in zip(self._names, self._params))

    def _sync_params(self) -> None:
        """Re-derives names (and re-initialises new state) if the param groups were changed."""
        current = [p for group in self.param_groups for p in group["params"]]
        if len(current) == len(self._params) and all(a is b for a, b in zip(current, self._params)):
            return
        self._names, self._params = self._name_params()
        if self.tx is not None:
            with torch.no_grad():
                self._tx_state = _carry_over(self._tx_state, self.tx.init(self._param_tree()))

    def _write_back(self, updates: dict[str, Optional[Tensor]]) -> None:
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
        return tuple(with_inplace(p) for p in head), factor_fn, parts is not None

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
        params = self._param_tree()
        present = [g for g in grads.values() if g is not None]
        if allow_fold and not extra_args and self._can_fold(present):
            head, factor_fn, is_chain = self._fold_plan
            states = list(self._tx_state) if is_chain else [self._tx_state]
            updates = grads
            for i, update in enumerate(head):
                updates, states[i] = update(updates, states[i], params, inplace=True)
            factor, states[-1] = factor_fn(updates, states[-1], params)
            self._store_state(tuple(states) if is_chain else states[0])
            self._write_back(updates)
            if factor.dtype == torch.float32:
                return torch.reciprocal(factor)
            # The fused kernels take a float32 scale; apply a wider one as a separate pass instead.
            self._scale_grads(factor)
            return None
        updates, new_state = self._tx_update(grads, self._tx_state, params, inplace=True, **extra_args)
        self._store_state(new_state)
        self._write_back(updates)
        return None

    def _store_state(self, new_state: Any) -> None:
        """Makes ``new_state`` the transformation's state.

        ``torch.compile`` does not keep attribute writes on an optimizer made inside a compiled
        function (the new state would be silently dropped), but it does keep in-place writes to
        tensors. So under compilation, when the structure is unchanged, every new tensor is copied
        into the tensor it replaces (nothing to do for those updated in place already) and the
        attribute keeps its objects: keep ``tx_state`` tensors across compiled steps with ``.clone()``.
        Eager steps replace the state (a logged ``tx_state.norm`` stays that step's).
        """
        if not torch.compiler.is_compiling():
            self._tx_state = new_state
            return
        old_leaves, old_def = tree_lib.flatten(self._tx_state)
        new_leaves, new_def = tree_lib.flatten(new_state)
        if old_def != new_def or not all(_fits(old, new) for old, new in zip(old_leaves, new_leaves)):
            self._tx_state = new_state
            return
        old_ids = {id(t) for t in old_leaves if isinstance(t, Tensor)}
        pending = []
        for old, new in zip(old_leaves, new_leaves):
            if isinstance(new, Tensor) and new is not old:
                # a new leaf that is another old leaf (states swapping buffers) is read before it is overwritten
                pending.append((old, new.clone() if id(new) in old_ids else new))
        for old, new in pending:
            old.copy_(new)

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
        if not getattr(step, "hooked", False) or "step" in inner.__dict__:
            return None
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

    def _prepare_step(
        self, closure: Optional[Callable[[], Any]] = None, **extra_args: Any
    ) -> Optional[tuple[tuple[Any, ...], dict[str, Tensor]]]:
        """Runs the transformation (or wraps ``closure`` to run it).

        ``extra_args`` go to the transformation's update; with a ``closure`` and a transformation that
        takes extra arguments, the loss the closure returns is also passed as ``value=`` (unless given).

        Returns the inner step's arguments and the amp attributes to set on it, or None when
        ``found_inf`` says to skip the step (with a transformation: see :meth:`step`).
        """
        amp = self._amp_attrs()
        if amp and self.tx is not None:
            if "found_inf" in amp and bool(amp["found_inf"]):
                return None
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

            return (transformed_closure,), amp
        grad_scale = self._transform(allow_fold=not amp, extra_args=extra_args)
        return (), ({"grad_scale": grad_scale} if grad_scale is not None else amp)

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
        with torch.autograd.profiler.record_function(f"Optimizer.step#{type(self).__name__}.step"):
            for pre_hook in itertools.chain(
                torch_optimizer._global_optimizer_pre_hooks.values(), self._optimizer_step_pre_hooks.values()
            ):
                result = pre_hook(self, args, kwargs)
                if result is not None:
                    if not (isinstance(result, tuple) and len(result) == 2):
                        raise RuntimeError(f"a step pre-hook must return None or (new_args, new_kwargs), got {result}")
                    args, kwargs = result
            prepared = self._prepare_step(*args[1:], **kwargs)
            inner = self.optimizer
            raw = self._raw_inner_step()
            if prepared is None:
                out = None  # what a fused kernel does with found_inf: nothing at all
            elif raw is None:
                inner_args, amp = prepared
                out = self._call_with_amp(inner, inner.step, inner_args, {}, amp) if amp else inner.step(*inner_args)
            else:
                # the inner optimizer's own hooks, called as torch's wrapper calls them (inner first in args)
                inner_args, amp = (inner, *prepared[0]), prepared[1]
                inner_kwargs: dict[str, Any] = {}
                for hook in inner._optimizer_step_pre_hooks.values():
                    result = hook(inner, inner_args, inner_kwargs)
                    if result is not None:
                        inner_args, inner_kwargs = result
                # called in this frame, not in a helper: see _patch_step_function
                if amp:
                    out = self._call_with_amp(inner, raw, inner_args, inner_kwargs, amp)
                else:
                    out = raw(*inner_args, **inner_kwargs)
                for hook in inner._optimizer_step_post_hooks.values():
                    hook(inner, inner_args, inner_kwargs)
            self._optimizer_step_code()
            for post_hook in itertools.chain(
                self._optimizer_step_post_hooks.values(), torch_optimizer._global_optimizer_post_hooks.values()
            ):
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
        self._sync_params()

    def state_dict(self) -> dict[str, Any]:
        for hook in self._optimizer_state_dict_pre_hooks.values():
            hook(self)
        state_dict = self.optimizer.state_dict()
        if self.tx is not None:
            plain = to_plain(self._tx_state)
            groups = list(state_dict["param_groups"])
            if groups:
                groups[0] = {**groups[0], STATE_KEY: plain}
                state_dict = {**state_dict, "param_groups": groups}
            else:
                state_dict = {**state_dict, STATE_KEY: {"tx_state": plain}}
        for hook in self._optimizer_state_dict_post_hooks.values():
            result = hook(self, state_dict)
            if result is not None:
                state_dict = result
        return state_dict

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads the inner optimizer's state and the transformation's, all or nothing.

        The transformation's part is checked against the current state (paths, shapes, dtypes)
        and copied before the inner optimizer is touched, and it replaces the current state only
        once the inner optimizer has loaded: a state dict that does not fit leaves this optimizer
        as it was. A state dict without the transformation's entry (saved from the bare inner
        optimizer) leaves the transformation's state as it is.
        """
        state_dict = dict(state_dict)
        for hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = hook(self, state_dict)
            if result is not None:
                state_dict = result
        saved, state_dict = split_chain_state(state_dict)
        self._sync_params()
        new_tx_state = None
        if saved is not None and self.tx is not None:
            new_tx_state = from_plain(saved, self._tx_state)
        elif self.tx is not None and called_by_checkpoint("_load_optim_state_dict"):
            warnings.warn(
                "wrap: the state dict set_state_dict passed has no transformation state, so the chain keeps "
                "its current state; set_state_dict(..., StateDictOptions(flatten_optimizer_state_dict=True)) "
                "drops it (load without flattening), as does a checkpoint saved from the bare inner optimizer",
                stacklevel=2,
            )
        self.optimizer.load_state_dict(state_dict)
        if new_tx_state is not None:
            self._tx_state = new_tx_state
        for hook in self._optimizer_load_state_dict_post_hooks.values():
            hook(self)

    def __repr__(self) -> str:
        inner = repr(self.optimizer).replace("\n", "\n  ")
        return f"{type(self).__name__} (\n  tx: {_describe(self.tx)}\n  optimizer: {inner}\n)"

    def __getstate__(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def __setstate__(self, state: dict[str, Any]) -> None:
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
      spec: how the gradients are sharded across ranks, for ``clip_grad_by_norm``.
      fold: let a final scalar scale of ``tx`` ride in a fused kernel's ``grad_scale`` (module docs).
    """
    return ChainedOptimizer(optimizer, tx, model=model, spec=spec, fold=fold)


def _fits(old: Any, new: Any) -> bool:
    """Whether state leaf ``new`` can be written into ``old``: same tensor layout, or equal non-tensors."""
    if isinstance(old, Tensor) and isinstance(new, Tensor):
        return (
            old.shape == new.shape
            and old.dtype == new.dtype
            and old.device == new.device
            and type(old) is type(new)
            and not old.requires_grad
        )
    if isinstance(old, Tensor) or isinstance(new, Tensor):
        return False
    return old is new or (type(old) is type(new) and old == new)


def _carry_over(old: Any, new: Any) -> Any:
    """``new`` with the leaves of ``old`` kept wherever a path and shape are unchanged."""
    old_by_path = dict(zip(tree_lib.paths(old), tree_lib.leaves(old)))
    new_leaves, treedef = tree_lib.flatten(new)
    kept = []
    for path, leaf in zip(tree_lib.paths(new), new_leaves):
        previous = old_by_path.get(path)
        same = isinstance(leaf, Tensor) and isinstance(previous, Tensor) and previous.shape == leaf.shape
        kept.append(previous if same else leaf)
    return tree_lib.unflatten(treedef, kept)
