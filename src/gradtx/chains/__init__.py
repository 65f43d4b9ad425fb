"""Combinators that build transformations out of transformations."""

from gradtx.chains.accumulation import MultiSteps, MultiStepsState, skip_large_updates, skip_not_finite
from gradtx.chains.aliases import (
    adabelief,
    adagrad,
    adam,
    adamax,
    adamw,
    amsgrad,
    dpsgd,
    lamb,
    lars,
    lion,
    nadam,
    nadamw,
    noisy_sgd,
    radam,
    rmsprop,
    sgd,
)
from gradtx.chains.chain import chain, named_chain
from gradtx.chains.conditionals import ApplyIfFiniteState, apply_if_finite
from gradtx.chains.from_torch import FromTorchState, from_torch
from gradtx.chains.hyperparams import InjectHyperparamsState, inject_hyperparams
from gradtx.chains.masking import MaskedState, freeze, masked
from gradtx.chains.monitoring import (
    EmaMeasureState,
    MonitorState,
    SnapshotState,
    get_measurement,
    measure_with_ema,
    monitor,
    snapshot,
)
from gradtx.chains.objective_aliases import lbfgs, polyak_sgd
from gradtx.chains.partition import PartitionState, multi_transform, partition, selective_transform
from gradtx.chains.wrap import ChainedOptimizer, wrap

__all__ = [
    "lbfgs",
    "polyak_sgd",
    "ApplyIfFiniteState",
    "ChainedOptimizer",
    "EmaMeasureState",
    "FromTorchState",
    "InjectHyperparamsState",
    "MaskedState",
    "MonitorState",
    "MultiSteps",
    "MultiStepsState",
    "PartitionState",
    "SnapshotState",
    "adabelief",
    "adagrad",
    "adam",
    "adamax",
    "adamw",
    "amsgrad",
    "apply_if_finite",
    "chain",
    "dpsgd",
    "freeze",
    "from_torch",
    "get_measurement",
    "inject_hyperparams",
    "lamb",
    "lars",
    "lion",
    "masked",
    "measure_with_ema",
    "monitor",
    "multi_transform",
    "nadam",
    "nadamw",
    "named_chain",
    "noisy_sgd",
    "partition",
    "radam",
    "rmsprop",
    "selective_transform",
    "sgd",
    "skip_large_updates",
    "skip_not_finite",
    "snapshot",
    "wrap",
]

from gradtx.chains.optimizers import (
    adadelta,
    adafactor,
    adamaxw,
    adan,
    fromage,
    novograd,
    optimistic_adam,
    optimistic_adam_v2,
    optimistic_gradient_descent,
    rprop,
    sign_sgd,
    signum,
    sm3,
    yogi,
)

__all__ += [
    "adadelta",
    "adafactor",
    "adamaxw",
    "adan",
    "fromage",
    "novograd",
    "optimistic_adam",
    "optimistic_adam_v2",
    "optimistic_gradient_descent",
    "rprop",
    "sign_sgd",
    "signum",
    "sm3",
    "yogi",
]

from gradtx.chains.cadence import (
    ApplyEvery,
    ConditionallyMaskState,
    ConditionallyTransformState,
    apply_every,
    conditionally_mask,
    conditionally_transform,
)
from gradtx.chains.layouts import flatten
from gradtx.chains.lookahead import LookaheadParams, LookaheadState, lookahead

__all__ += [
    "ApplyEvery",
    "ConditionallyMaskState",
    "ConditionallyTransformState",
    "LookaheadParams",
    "LookaheadState",
    "apply_every",
    "conditionally_mask",
    "conditionally_transform",
    "flatten",
    "lookahead",
]

from gradtx.chains.stateful_hyperparams import inject_stateful_hyperparams

__all__ += ["inject_stateful_hyperparams"]
