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
from gradtx.contrib.complex import split_real_and_imaginary, SplitRealAndImaginaryState
from gradtx.contrib.galore import galore, GaLoreDimensionNumbers, GaLoreState, scale_by_galore
from gradtx.contrib.learning_rate_free import (
    cocob,
    COCOBState,
    dadapt_adamw,
    DAdaptAdamWState,
    dog,
    DoGState,
    dowg,
    DoWGState,
    MechanicState,
    mechanize,
    prodigy,
    ProdigyState,
    scale_by_cocob,
    scale_by_dog,
    scale_by_dowg,
)
from gradtx.contrib.madgrad import madgrad, MadgradState, scale_by_madgrad
from gradtx.contrib.momo import momo, momo_adam, MomoAdamState, MomoState
from gradtx.contrib.muon import muon, MuonDimensionNumbers, MuonState, scale_by_muon
from gradtx.contrib.plateau import reduce_on_plateau, ReduceLROnPlateauState
from gradtx.contrib.sam import normalize, NormalizeState, sam, SAMState
from gradtx.contrib.schedule_free import (
    schedule_free,
    schedule_free_adamw,
    schedule_free_eval_params,
    schedule_free_sgd,
    ScheduleFreeState,
)
from gradtx.contrib.second_order import (
    hutchinson_estimator_diag_hessian,
    HutchinsonState,
    sophia,
    SophiaState,
)
from gradtx.optimizers.sgd_like import dpsgd
from gradtx.transforms.noise import differentially_private_aggregate, DifferentiallyPrivateAggregateState

__all__ = [
    "acprop",
    "ademamix",
    "adopt",
    "cocob",
    "COCOBState",
    "dadapt_adamw",
    "DAdaptAdamWState",
    "differentially_private_aggregate",
    "DifferentiallyPrivateAggregateState",
    "dog",
    "DoGState",
    "dowg",
    "DoWGState",
    "dpsgd",
    "galore",
    "GaLoreDimensionNumbers",
    "GaLoreState",
    "hutchinson_estimator_diag_hessian",
    "HutchinsonState",
    "madgrad",
    "MadgradState",
    "MechanicState",
    "mechanize",
    "momo",
    "momo_adam",
    "MomoAdamState",
    "MomoState",
    "muon",
    "MuonDimensionNumbers",
    "MuonState",
    "normalize",
    "NormalizeState",
    "prodigy",
    "ProdigyState",
    "reduce_on_plateau",
    "ReduceLROnPlateauState",
    "sam",
    "SAMState",
    "scale_by_acprop",
    "scale_by_ademamix",
    "scale_by_adopt",
    "scale_by_cocob",
    "scale_by_dog",
    "scale_by_dowg",
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
    "sophia",
    "SophiaState",
    "split_real_and_imaginary",
    "SplitRealAndImaginaryState",
]
