"""``inject_hyperparams``: hyperparameters that live in the state, scheduled or set by hand.

``inject_hyperparams(adamw)(learning_rate=warmup_cosine_decay_schedule(...), weight_decay=0.1)``
builds a transformation whose state holds every numeric hyperparameter as a 0-d tensor in
``state.hyperparams``. Schedules are evaluated at the state's step count on every update; other
numbers are read from the state, so ``state.hyperparams["learning_rate"] = 1e-4`` (or an in-place
``fill_``) changes the next step, and logging reads the value actually used. The factory is called
with the current values at every update, as in optax.
"""

from __future__ import annotations

import functools
import inspect
import typing
from typing import Any, Callable, Iterable, NamedTuple, Optional, Union

import torch
from torch import Tensor

from gradtx import tree as tree_lib
from gradtx.base import (
    runs_inner,
    GradientTransformation,
    GradientTransformationExtraArgs,
    LeadingClip,
    leading_clip,
    set_leading_clip,
    takes_extra_args,
    with_inplace,
)
from gradtx.chains._select import counter, safe_increment
from gradtx.state_check import named
from gradtx.transforms import _foreach as fe

PyTree = Any


class InjectHyperparamsState(NamedTuple):
    """As ``optax.InjectHyperparamsState``.

    Attributes:
      count: updates done so far (0-d int32): the step schedules are evaluated at.
      hyperparams: name -> 0-d tensor, the values used by the last update (the initial ones after
        ``init``). Values not scheduled may be overwritten to change the next step.
      inner_state: the inner transformation's state.
    """

    count: Tensor
    hyperparams: dict[str, Tensor]
    inner_state: Any


def _integer_params(signature: inspect.Signature) -> set[str]:
    """Parameters declared ``int``/``bool`` (by annotation or an int default): kept static, as optax."""
    names = set()
    for name, param in signature.parameters.items():
        annotation = param.annotation
        candidates = typing.get_args(annotation) or (annotation,)
        declared = any(c in (int, bool, "int", "bool") for c in candidates)
        if declared or (param.default is not param.empty and isinstance(param.default, int)):
            names.add(name)
    return names


def _hyperparam_dtype(params: PyTree, override: Optional[torch.dtype]) -> torch.dtype:
    if override is not None:
        return override
    return tree_lib.accumulation_dtype(tree_lib.real_dtypes(params))


def _as_hyperparam(value: Any, dtype: torch.dtype, device: torch.device, *, keep_dtype: bool = True) -> Tensor:
    """A number as a 0-d tensor of ``dtype`` on ``device``; a given tensor keeps its dtype if ``keep_dtype``."""
    if isinstance(value, Tensor):
        if keep_dtype or not value.is_floating_point():
            return value.to(device)
        return value.to(device=device, dtype=dtype)
    return torch.tensor(value, dtype=dtype, device=device)


def inject_hyperparams(
    inner_factory: Callable[..., GradientTransformation],
    static_args: Union[str, Iterable[str]] = (),
    hyperparam_dtype: Optional[torch.dtype] = None,
) -> Callable[..., GradientTransformation]:
    """Wraps ``inner_factory`` so its numeric arguments may be schedules and live in the state.

    Args:
      inner_factory: a function returning a ``GradientTransformation`` (``adamw``, ``scale``, ...).
      static_args: names of arguments passed through as they are (callables that are not
        schedules, say). Bools, and ints given for parameters declared ``int``/``bool``, are
        always static.
      hyperparam_dtype: the dtype of injected numbers. By default float32, or float64 when some
        parameter is float64 (optax uses the params' highest dtype, which would round a bfloat16
        model's learning rate to bfloat16; this does not).

    Returns:
      A function with ``inner_factory``'s arguments, where any numeric one may be a schedule
      ``count -> value``. Schedules get the 0-d int32 tensor count, so they must accept tensors
      (every schedule in :mod:`gradtx.schedules` does). The factory is also called once when the
      transformation is built, with the initial values, to learn whether its ``update`` takes
      ``inplace`` (which is then passed through) and extra arguments (a
      ``GradientTransformationExtraArgs``: then so is the result, and it forwards them).
    """
    static_args = {static_args} if isinstance(static_args, str) else set(static_args)
    signature = inspect.signature(inner_factory)
    kinds = {name: param.kind for name, param in signature.parameters.items()}
    takes_keywords = inspect.Parameter.VAR_KEYWORD in kinds.values()  # any name may be an argument
    unknown = static_args - set(signature.parameters)
    if unknown and not takes_keywords:
        raise ValueError(
            f"inject_hyperparams: static_args {sorted(unknown)} are not parameters of "
            f"{getattr(inner_factory, '__name__', inner_factory)!r} ({list(signature.parameters)})"
        )
    integer_params = _integer_params(signature)

    positional_only = [name for name, kind in kinds.items() if kind == inspect.Parameter.POSITIONAL_ONLY]

    @functools.wraps(inner_factory)
    def wrapped(*args: Any, **kwargs: Any) -> GradientTransformation:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        arguments: dict[str, Any] = {}  # by name: the arguments ``**kwargs`` takes each on its own
        variadic: tuple = ()  # what ``*args`` takes, passed on as it is
        for name, value in bound.arguments.items():
            if kinds[name] == inspect.Parameter.VAR_KEYWORD:
                arguments.update(value)
            elif kinds[name] == inspect.Parameter.VAR_POSITIONAL:
                variadic = tuple(value)
            else:
                arguments[name] = value
        schedules: dict[str, Callable] = {}
        numeric: dict[str, Any] = {}
        other: dict[str, Any] = {}
        for name, value in arguments.items():
            if name in static_args or isinstance(value, bool):
                other[name] = value
            elif name in integer_params and isinstance(value, int):
                other[name] = value
            elif callable(value) and not isinstance(value, (Tensor, type)):  # a class is no schedule
                schedules[name] = value
            elif isinstance(value, (int, float, Tensor)):
                numeric[name] = value
            else:
                other[name] = value

        def inner_factory_of(values: dict[str, Any]) -> GradientTransformation:
            """``inner_factory`` called with ``values`` by name, positional-only ones by position."""
            leading = [values.pop(name) for name in positional_only]
            return inner_factory(*leading, *variadic, **values)

        # whether the inner update takes ``inplace``, decided once on a probe built with the first values
        probe = inner_factory_of({**other, **numeric, **{name: fn(0) for name, fn in schedules.items()}})
        takes_inplace = with_inplace(probe) is probe.update
        extra = takes_extra_args(probe)

        def current(hyperparams: dict[str, Any], count: Tensor, dtype: torch.dtype) -> dict[str, Tensor]:
            values = {name: _as_hyperparam(hyperparams[name], dtype, count.device) for name in numeric}
            values.update(
                {name: _as_hyperparam(fn(count), dtype, count.device, keep_dtype=False) for name, fn in schedules.items()}
            )
            return values

        def init_fn(params: PyTree) -> InjectHyperparamsState:
            count = counter(params)
            hyperparams = current(numeric, count, _hyperparam_dtype(params, hyperparam_dtype))
            inner = inner_factory_of({**other, **hyperparams})
            return InjectHyperparamsState(count=count, hyperparams=hyperparams, inner_state=inner.init(params))

        def step(updates, state, params, inplace, extra_args, norm=None, scale=None):
            missing = set(numeric) - set(state.hyperparams)
            if missing:
                raise ValueError(f"inject_hyperparams: state.hyperparams lacks {sorted(missing)}")
            if params is not None or hyperparam_dtype is not None:
                dtype = _hyperparam_dtype(params, hyperparam_dtype)
            else:
                floats = [v.dtype for v in state.hyperparams.values() if isinstance(v, Tensor) and v.is_floating_point()]
                dtype = tree_lib.accumulation_dtype(floats)
            hyperparams = current(state.hyperparams, state.count, dtype)
            if not inplace:  # values read from the state are copied: the new state shares no storage with the old
                hyperparams.update({name: hyperparams[name].clone() for name in numeric})
            symbolic = torch.compiler.is_compiling()
            if symbolic:  # the inner transformation's numbers are Dynamo's scalars: none is tested
                fe._SYMBOLIC_HYPERPARAMS[0] = True
            try:
                return run_inner(updates, state, params, inplace, extra_args, norm, scale, hyperparams)
            finally:
                if symbolic:
                    fe._SYMBOLIC_HYPERPARAMS[0] = False

        def run_inner(updates, state, params, inplace, extra_args, norm, scale, hyperparams):
            inner = inner_factory_of({**other, **hyperparams})
            if not extra:
                extra_args = {}
            if norm is not None:  # the inner's leading clip takes a norm reduced by the caller
                new_updates, inner_state = leading_clip(inner).given(norm, scale)(updates, state.inner_state, params, inplace=inplace, **extra_args)
            elif takes_inplace:
                new_updates, inner_state = inner.update(updates, state.inner_state, params, inplace=inplace, **extra_args)
            else:
                new_updates, inner_state = inner.update(updates, state.inner_state, params, **extra_args)
            return new_updates, InjectHyperparamsState(safe_increment(state.count), hyperparams, inner_state)

        def update_fn(updates, state, params=None, *, inplace=False, **extra_args):
            return step(updates, state, params, inplace, extra_args)

        probe_clip = leading_clip(probe)
        clip = None
        if probe_clip is not None:

            def given(norm, scale=None):
                def update_given(updates, state, params=None, *, inplace=False, **extra_args):
                    return step(updates, state, params, inplace, extra_args, norm, scale)

                return update_given

            def coefficient(state, norm):  # the clip built from the values the last update used
                return leading_clip(inner_factory_of({**other, **state.hyperparams})).coefficient(state.inner_state, norm)

            clip = LeadingClip(probe_clip.spec, probe_clip.norm_type, lambda state: probe_clip.norm_of(state.inner_state), coefficient, given)
        set_leading_clip(update_fn, clip)
        runs_inner(update_fn, probe)

        name = f"inject_hyperparams({getattr(inner_factory, '__name__', 'factory')})"
        return (GradientTransformationExtraArgs if extra else GradientTransformation)(init_fn, named(update_fn, name))

    return wrapped
