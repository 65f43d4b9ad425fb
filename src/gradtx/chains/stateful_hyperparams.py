"""``inject_stateful_hyperparams``: optax's deprecated name for :func:`inject_hyperparams`."""

from __future__ import annotations

import warnings
from typing import Callable, Iterable, Optional, Union

import torch

from gradtx.base import GradientTransformation
from gradtx.chains.hyperparams import InjectHyperparamsState, inject_hyperparams

InjectStatefulHyperparamsState = InjectHyperparamsState
"""The state :func:`inject_stateful_hyperparams` returns: that of :func:`inject_hyperparams`.

optax's class has one more field, ``hyperparams_states``, for schedules that keep state of their
own; gradtx's ``inject_hyperparams`` evaluates (stateless) schedules at ``count``, so its state has
``count``, ``hyperparams`` and ``inner_state`` only, the fields ported code reads.
"""


def inject_stateful_hyperparams(
    inner_factory: Callable[..., GradientTransformation],
    static_args: Union[str, Iterable[str]] = (),
    hyperparam_dtype: Optional[torch.dtype] = None,
) -> Callable[..., GradientTransformation]:
    """:func:`inject_hyperparams`, with the ``DeprecationWarning`` optax gives for this name."""
    warnings.warn(
        "inject_stateful_hyperparams is deprecated, use inject_hyperparams instead", DeprecationWarning, stacklevel=2
    )
    return inject_hyperparams(inner_factory, static_args, hyperparam_dtype)
