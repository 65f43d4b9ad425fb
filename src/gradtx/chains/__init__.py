"""Combinators: transformations built out of transformations."""

from gradtx.chains.accumulation import (
    MultiSteps,
    MultiStepsState,
    ShouldSkipUpdateFunction,
    skip_large_updates,
    skip_not_finite,
)
from gradtx.chains.cadence import (
    ApplyEvery,
    ConditionallyMaskState,
    ConditionallyTransformState,
    apply_every,
    conditionally_mask,
    conditionally_transform,
)
from gradtx.chains.chain import chain, named_chain
from gradtx.chains.conditionals import ApplyIfFiniteState, apply_if_finite
from gradtx.chains.hyperparams import InjectHyperparamsState, inject_hyperparams
from gradtx.chains.layouts import flatten
from gradtx.chains.lookahead import LookaheadParams, LookaheadState, lookahead
from gradtx.chains.master_weights import MasterWeightsState, master_weights
from gradtx.chains.masking import MaskedNode, MaskedState, freeze, masked
from gradtx.chains.monitoring import (
    EmaMeasureState,
    MonitorState,
    SnapshotState,
    get_measurement,
    measure_with_ema,
    monitor,
    snapshot,
)
from gradtx.chains.observing import ObservedClip, ObservedStats, ObserveState, observations, observe
from gradtx.chains.partition import (
    MultiTransformState,
    PartitionState,
    multi_transform,
    partition,
    selective_transform,
)
from gradtx.chains.stateful_hyperparams import InjectStatefulHyperparamsState, inject_stateful_hyperparams

__all__ = [
    "ApplyEvery",
    "ApplyIfFiniteState",
    "ConditionallyMaskState",
    "ConditionallyTransformState",
    "EmaMeasureState",
    "InjectHyperparamsState",
    "InjectStatefulHyperparamsState",
    "LookaheadParams",
    "LookaheadState",
    "MaskedNode",
    "MaskedState",
    "MasterWeightsState",
    "MonitorState",
    "MultiSteps",
    "MultiStepsState",
    "MultiTransformState",
    "ObserveState",
    "ObservedClip",
    "ObservedStats",
    "PartitionState",
    "ShouldSkipUpdateFunction",
    "SnapshotState",
    "apply_every",
    "apply_if_finite",
    "chain",
    "conditionally_mask",
    "conditionally_transform",
    "flatten",
    "freeze",
    "get_measurement",
    "inject_hyperparams",
    "inject_stateful_hyperparams",
    "lookahead",
    "masked",
    "master_weights",
    "measure_with_ema",
    "monitor",
    "multi_transform",
    "named_chain",
    "observations",
    "observe",
    "partition",
    "selective_transform",
    "skip_large_updates",
    "skip_not_finite",
    "snapshot",
]
