"""optax.contrib's transformations and optimizers, with optax's names, arguments and states."""

from gradtx.contrib.complex import SplitRealAndImaginaryState, split_real_and_imaginary
from gradtx.contrib.plateau import ReduceLROnPlateauState, reduce_on_plateau
from gradtx.contrib.sam import NormalizeState, SAMState, normalize, sam
from gradtx.contrib.second_order import (
    HutchinsonState,
    SophiaState,
    hutchinson_estimator_diag_hessian,
    sophia,
)
from gradtx.transforms.noise import DifferentiallyPrivateAggregateState, differentially_private_aggregate


def __getattr__(name):
    # optax.contrib's dpsgd is gradtx's top-level one (looked up lazily: gradtx imports this package)
    if name == "dpsgd":
        import gradtx

        return gradtx.dpsgd
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "DifferentiallyPrivateAggregateState",
    "HutchinsonState",
    "NormalizeState",
    "ReduceLROnPlateauState",
    "SAMState",
    "SophiaState",
    "SplitRealAndImaginaryState",
    "differentially_private_aggregate",
    "dpsgd",
    "hutchinson_estimator_diag_hessian",
    "normalize",
    "reduce_on_plateau",
    "sam",
    "sophia",
    "split_real_and_imaginary",
]
