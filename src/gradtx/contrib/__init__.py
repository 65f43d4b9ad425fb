"""optax.contrib's names: optimizers and transformations from recent papers, with optax's
names, arguments, defaults and states. Each is also importable from ``gradtx`` itself."""

from gradtx.contrib.adam_variants import (
    acprop,
    ademamix,
    adopt,
    scale_by_acprop,
    scale_by_ademamix,
    scale_by_adopt,
    scale_by_simplified_ademamix,
    ScaleByAdemamixState,
    ScaleBySimplifiedAdEMAMixState,
    simplified_ademamix,
)
from gradtx.contrib.galore import galore, GaLoreDimensionNumbers, GaLoreState, scale_by_galore
from gradtx.contrib.madgrad import madgrad, MadgradState, scale_by_madgrad
from gradtx.contrib.muon import muon, MuonDimensionNumbers, MuonState, scale_by_muon
from gradtx.contrib.schedule_free import (
    schedule_free,
    schedule_free_adamw,
    schedule_free_eval_params,
    schedule_free_sgd,
    ScheduleFreeState,
)

__all__ = [
    "acprop",
    "ademamix",
    "adopt",
    "galore",
    "GaLoreDimensionNumbers",
    "GaLoreState",
    "madgrad",
    "MadgradState",
    "muon",
    "MuonDimensionNumbers",
    "MuonState",
    "scale_by_acprop",
    "scale_by_ademamix",
    "scale_by_adopt",
    "scale_by_galore",
    "scale_by_madgrad",
    "scale_by_muon",
    "scale_by_simplified_ademamix",
    "ScaleByAdemamixState",
    "ScaleBySimplifiedAdEMAMixState",
    "schedule_free",
    "schedule_free_adamw",
    "schedule_free_eval_params",
    "schedule_free_sgd",
    "ScheduleFreeState",
    "simplified_ademamix",
]
