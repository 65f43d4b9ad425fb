"""optax.contrib's optimizers and transformations, with optax's names, arguments and states."""

from gradtx.contrib.learning_rate_free import (
    COCOBState,
    DAdaptAdamWState,
    DoGState,
    DoWGState,
    MechanicState,
    ProdigyState,
    cocob,
    dadapt_adamw,
    dog,
    dowg,
    mechanize,
    prodigy,
    scale_by_cocob,
    scale_by_dog,
    scale_by_dowg,
)
from gradtx.contrib.momo import MomoAdamState, MomoState, momo, momo_adam

__all__ = [
    "COCOBState",
    "DAdaptAdamWState",
    "DoGState",
    "DoWGState",
    "MechanicState",
    "MomoAdamState",
    "MomoState",
    "ProdigyState",
    "cocob",
    "dadapt_adamw",
    "dog",
    "dowg",
    "mechanize",
    "momo",
    "momo_adam",
    "prodigy",
    "scale_by_cocob",
    "scale_by_dog",
    "scale_by_dowg",
]
