"""optax.contrib's optimizers and wrappers, with optax's names, arguments and states."""

from gradtx.contrib.adam_variants import (
    ScaleByAdemamixState,
    ScaleBySimplifiedAdEMAMixState,
    acprop,
    ademamix,
    adopt,
    scale_by_acprop,
    scale_by_ademamix,
    scale_by_adopt,
    scale_by_simplified_ademamix,
    simplified_ademamix,
)
from gradtx.contrib.madgrad import MadgradState, madgrad, scale_by_madgrad
from gradtx.contrib.schedule_free import (
    ScheduleFreeState,
    schedule_free,
    schedule_free_adamw,
    schedule_free_eval_params,
    schedule_free_sgd,
)

__all__ = [
    "MadgradState",
    "ScaleByAdemamixState",
    "ScaleBySimplifiedAdEMAMixState",
    "ScheduleFreeState",
    "acprop",
    "ademamix",
    "adopt",
    "madgrad",
    "scale_by_acprop",
    "scale_by_ademamix",
    "scale_by_adopt",
    "scale_by_madgrad",
    "scale_by_simplified_ademamix",
    "schedule_free",
    "schedule_free_adamw",
    "schedule_free_eval_params",
    "schedule_free_sgd",
    "simplified_ademamix",
]
