"""Gradient transformations, one module per family."""

from gradtx.transforms.adadelta import ScaleByAdaDeltaState, scale_by_adadelta, scale_by_yogi
from gradtx.transforms.adam import (
    ScaleByAdamState,
    ScaleByAmsgradState,
    ScaleByBeliefState,
    fused_adam,
    scale_by_adam,
    scale_by_adamax,
    scale_by_amsgrad,
    scale_by_belief,
    scale_by_radam,
)
from gradtx.transforms.adan import ScaleByAdanState, scale_by_adan
from gradtx.transforms.block_norm import (
    NonNegativeParamsState,
    ScaleByDistanceOverGradientsState,
    keep_params_nonnegative,
    normalize_by_update_norm,
    scale_by_distance_over_gradients,
    scale_by_param_block_norm,
    scale_by_param_block_rms,
)
from gradtx.transforms.clipping import (
    ClipByGlobalNormState,
    adaptive_grad_clip,
    clip,
    clip_by_block_rms,
    clip_by_global_norm,
    clip_by_value,
    global_norm,
    unitwise_norm,
)
from gradtx.transforms.elementwise import ZeroNansState, centralize, set_to_zero, zero_nans
from gradtx.transforms.factored import FactoredState, scale_by_factored_rms
from gradtx.transforms.lbfgs import ScaleByLBFGSState, scale_by_lbfgs
from gradtx.transforms.linesearch import (
    BacktrackingLinesearchInfo,
    ScaleByBacktrackingLinesearchState,
    ScaleByZoomLinesearchState,
    ZoomLinesearchInfo,
    scale_by_backtracking_linesearch,
    scale_by_zoom_linesearch,
    value_and_grad_from_state,
)
from gradtx.transforms.lion import ScaleByLionState, scale_by_lion
from gradtx.transforms.momentum import EmaState, TraceState, ema, trace
from gradtx.transforms.noise import (
    AddNoiseState,
    DifferentiallyPrivateAggregateState,
    add_noise,
    differentially_private_aggregate,
)
from gradtx.transforms.novograd import ScaleByNovogradState, scale_by_novograd
from gradtx.transforms.optimistic import ScaleByOptimisticGradientState, scale_by_optimistic_gradient
from gradtx.transforms.per_example import per_example_global_norm_clip, per_example_layer_norm_clip
from gradtx.transforms.polyak import scale_by_polyak
from gradtx.transforms.rms import (
    ScaleByRStdDevState,
    ScaleByRStdDevWithCountState,
    ScaleByRmsState,
    ScaleByRmsWithCountState,
    ScaleByRssState,
    scale_by_rms,
    scale_by_rss,
    scale_by_stddev,
)
from gradtx.transforms.scaling import (
    ScaleByScheduleState,
    scale,
    scale_by_learning_rate,
    scale_by_schedule,
    scale_by_trust_ratio,
)
from gradtx.transforms.sign import ScaleByRpropState, scale_by_rprop, scale_by_sign
from gradtx.transforms.sm3 import ScaleBySM3State, scale_by_sm3
from gradtx.transforms.weight_decay import WeightDecaySchedule, add_decayed_weights

__all__ = [
    "AddNoiseState",
    "BacktrackingLinesearchInfo",
    "ClipByGlobalNormState",
    "DifferentiallyPrivateAggregateState",
    "EmaState",
    "FactoredState",
    "NonNegativeParamsState",
    "ScaleByAdaDeltaState",
    "ScaleByAdamState",
    "ScaleByAdanState",
    "ScaleByAmsgradState",
    "ScaleByBacktrackingLinesearchState",
    "ScaleByBeliefState",
    "ScaleByDistanceOverGradientsState",
    "ScaleByLBFGSState",
    "ScaleByLionState",
    "ScaleByNovogradState",
    "ScaleByOptimisticGradientState",
    "ScaleByRStdDevState",
    "ScaleByRStdDevWithCountState",
    "ScaleByRmsState",
    "ScaleByRmsWithCountState",
    "ScaleByRpropState",
    "ScaleByRssState",
    "ScaleBySM3State",
    "ScaleByScheduleState",
    "ScaleByZoomLinesearchState",
    "TraceState",
    "WeightDecaySchedule",
    "ZeroNansState",
    "ZoomLinesearchInfo",
    "adaptive_grad_clip",
    "add_decayed_weights",
    "add_noise",
    "centralize",
    "clip",
    "clip_by_block_rms",
    "clip_by_global_norm",
    "clip_by_value",
    "differentially_private_aggregate",
    "ema",
    "fused_adam",
    "global_norm",
    "keep_params_nonnegative",
    "normalize_by_update_norm",
    "per_example_global_norm_clip",
    "per_example_layer_norm_clip",
    "scale",
    "scale_by_adadelta",
    "scale_by_adam",
    "scale_by_adamax",
    "scale_by_adan",
    "scale_by_amsgrad",
    "scale_by_backtracking_linesearch",
    "scale_by_belief",
    "scale_by_distance_over_gradients",
    "scale_by_factored_rms",
    "scale_by_lbfgs",
    "scale_by_learning_rate",
    "scale_by_lion",
    "scale_by_novograd",
    "scale_by_optimistic_gradient",
    "scale_by_param_block_norm",
    "scale_by_param_block_rms",
    "scale_by_polyak",
    "scale_by_radam",
    "scale_by_rms",
    "scale_by_rprop",
    "scale_by_rss",
    "scale_by_schedule",
    "scale_by_sign",
    "scale_by_sm3",
    "scale_by_stddev",
    "scale_by_trust_ratio",
    "scale_by_yogi",
    "scale_by_zoom_linesearch",
    "set_to_zero",
    "trace",
    "unitwise_norm",
    "value_and_grad_from_state",
    "zero_nans",
]
