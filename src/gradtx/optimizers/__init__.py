"""The named optimizers (optax's aliases), one module per family.

Each is the chain optax builds, with optax's arguments, defaults and tuple state.
"""

from gradtx.optimizers.adam_like import (
    adabelief,
    adam,
    adamax,
    adamaxw,
    adamw,
    adan,
    amsgrad,
    nadam,
    nadamw,
    novograd,
    optimistic_adam,
    optimistic_adam_v2,
    radam,
    yogi,
)
from gradtx.optimizers.adaptive_lr import adadelta, adafactor, adagrad, rmsprop, sm3
from gradtx.optimizers.layerwise import fromage, lamb, lars
from gradtx.optimizers.second_order import lbfgs, polyak_sgd
from gradtx.optimizers.sgd_like import dpsgd, noisy_sgd, optimistic_gradient_descent, sgd
from gradtx.optimizers.sign import lion, rprop, sign_sgd, signum

__all__ = [
    "adabelief",
    "adadelta",
    "adafactor",
    "adagrad",
    "adam",
    "adamax",
    "adamaxw",
    "adamw",
    "adan",
    "amsgrad",
    "dpsgd",
    "fromage",
    "lamb",
    "lars",
    "lbfgs",
    "lion",
    "nadam",
    "nadamw",
    "noisy_sgd",
    "novograd",
    "optimistic_adam",
    "optimistic_adam_v2",
    "optimistic_gradient_descent",
    "polyak_sgd",
    "radam",
    "rmsprop",
    "rprop",
    "sgd",
    "sign_sgd",
    "signum",
    "sm3",
    "yogi",
]
