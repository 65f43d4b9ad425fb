"""Fast paths for torch's own optimizers: their functional kernels, called on plain lists.

``from_torch(torch.optim.Adam, ...)`` need not drive an optimizer object at all: torch exposes the
math of its built-in optimizers as functions (``torch.optim.adam.adam``, ``torch.optim.sgd.sgd``,
...) that take lists of parameters, gradients and state tensors and run the single-tensor, foreach
or fused kernel the hyperparameters ask for. A :class:`KernelSpec` says, for one optimizer class,
how to create a parameter's state exactly as the class's lazy initialisation does and how to call
its functional kernel exactly as its ``step`` does, so the numbers are the optimizer's own.

A spec is used only for the exact class (a subclass may override ``step``) and only for
hyperparameters where its state can be created up front; everything else goes through the
general engine in :mod:`gradtx.interop.from_torch`. None of these kernels writes to the gradients
(no ``grad_scale`` is passed), so the pure path need not copy them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import Tensor
from torch.optim.adagrad import adagrad as adagrad_kernel
from torch.optim.adam import adam as adam_kernel
from torch.optim.rmsprop import rmsprop as rmsprop_kernel
from torch.optim.sgd import sgd as sgd_kernel

from gradtx.torch_internals import optimizer_scalar_dtype

Group = dict[str, Any]
Slots = dict[str, Tensor]


@dataclass(frozen=True)
class KernelSpec:
    """How to run one torch optimizer class through its functional kernel.

    ``init(param, group)``: the parameter's state, equal to what the class creates on its first step.
    ``run(params, grads, slots, group)``: one step, updating ``params`` and every slot tensor in place.
    ``applies(group)``: whether this spec reproduces the class for these hyperparameters.
    """

    init: Callable[[Tensor, Group], Slots]
    run: Callable[[list[Tensor], list[Tensor], list[Slots], Group], None]
    applies: Callable[[Group], bool] = lambda group: not group.get("differentiable", False)


def _zeros(param: Tensor) -> Tensor:
    return torch.zeros_like(param, memory_format=torch.preserve_format)


def _has_complex(params: list[Tensor]) -> bool:
    return any(torch.is_complex(p) for p in params)


# --------------------------------------------------------------------------- Adam, AdamW


def _adam_init(param: Tensor, group: Group) -> Slots:
    if group["capturable"] or group["fused"]:
        step = torch.zeros((), dtype=optimizer_scalar_dtype(is_fused=group["fused"]), device=param.device)
    else:
        step = torch.tensor(0.0, dtype=optimizer_scalar_dtype(), device="cpu")
    slots = {"step": step, "exp_avg": _zeros(param), "exp_avg_sq": _zeros(param)}
    if group["amsgrad"]:
        slots["max_exp_avg_sq"] = _zeros(param)
    return slots


def _adam_run(decoupled_default: bool):
    def run(params, grads, slots, group):
        beta1, beta2 = group["betas"]
        adam_kernel(
            params,
            grads,
            [s["exp_avg"] for s in slots],
            [s["exp_avg_sq"] for s in slots],
            [s["max_exp_avg_sq"] for s in slots] if group["amsgrad"] else [],
            [s["step"] for s in slots],
            foreach=group["foreach"],
            capturable=group["capturable"],
            differentiable=group["differentiable"],
            fused=group["fused"],
            has_complex=_has_complex(params),
            decoupled_weight_decay=group.get("decoupled_weight_decay", decoupled_default),
            amsgrad=group["amsgrad"],
            beta1=beta1,
            beta2=beta2,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=group["maximize"],
        )

    return run


# --------------------------------------------------------------------------- SGD


def _sgd_init(param: Tensor, group: Group) -> Slots:
    # Torch creates the momentum buffer as a copy of the first gradient. With dampening 0 a zero
    # buffer gives exactly that (0 * momentum + 1 * grad == grad), so it can exist from the start.
    return {"momentum_buffer": _zeros(param)} if group["momentum"] != 0 else {}


def _sgd_run(params, grads, slots, group):
    sgd_kernel(
        params,
        grads,
        [s["momentum_buffer"] for s in slots] if group["momentum"] != 0 else [],
        has_sparse_grad=False,
        foreach=group["foreach"],
        fused=group["fused"],
        weight_decay=group["weight_decay"],
        momentum=group["momentum"],
        lr=group["lr"],
        dampening=group["dampening"],
        nesterov=group["nesterov"],
        maximize=group["maximize"],
    )


def _sgd_applies(group: Group) -> bool:
    return not group.get("differentiable", False) and (group["momentum"] == 0 or group["dampening"] == 0)


# --------------------------------------------------------------------------- RMSprop


def _rmsprop_init(param: Tensor, group: Group) -> Slots:
    if group["capturable"]:
        step = torch.zeros((), dtype=optimizer_scalar_dtype(), device=param.device)
    else:
        step = torch.zeros((), dtype=optimizer_scalar_dtype())
    slots = {"step": step, "square_avg": _zeros(param)}
    if group["momentum"] > 0:
        slots["momentum_buffer"] = _zeros(param)
    if group["centered"]:
        slots["grad_avg"] = _zeros(param)
    return slots


def _rmsprop_run(params, grads, slots, group):
    rmsprop_kernel(
        params,
        grads,
        [s["square_avg"] for s in slots],
        [s["grad_avg"] for s in slots] if group["centered"] else [],
        [s["momentum_buffer"] for s in slots] if group["momentum"] > 0 else [],
        [s["step"] for s in slots],
        foreach=group["foreach"],
        maximize=group["maximize"],
        differentiable=group["differentiable"],
        capturable=group["capturable"],
        has_complex=_has_complex(params),
        lr=group["lr"],
        alpha=group["alpha"],
        eps=group["eps"],
        weight_decay=group["weight_decay"],
        momentum=group["momentum"],
        centered=group["centered"],
    )


# --------------------------------------------------------------------------- Adagrad


def _adagrad_init(param: Tensor, group: Group) -> Slots:
    fused = bool(group["fused"])
    if fused:
        step = torch.zeros((), dtype=optimizer_scalar_dtype(is_fused=True), device=param.device)
    else:
        step = torch.tensor(0.0, dtype=optimizer_scalar_dtype())
    value = group["initial_accumulator_value"]
    fill = complex(value, value) if torch.is_complex(param) else value
    return {"step": step, "sum": torch.full_like(param, fill, memory_format=torch.preserve_format)}


def _adagrad_run(params, grads, slots, group):
    adagrad_kernel(
        params,
        grads,
        [s["sum"] for s in slots],
        [s["step"] for s in slots],
        fused=group["fused"],
        has_sparse_grad=False,
        foreach=group["foreach"],
        differentiable=group["differentiable"],
        has_complex=_has_complex(params),
        lr=group["lr"],
        weight_decay=group["weight_decay"],
        lr_decay=group["lr_decay"],
        eps=group["eps"],
        maximize=group["maximize"],
    )


KERNELS: dict[type, KernelSpec] = {
    torch.optim.Adam: KernelSpec(_adam_init, _adam_run(decoupled_default=False)),
    torch.optim.AdamW: KernelSpec(_adam_init, _adam_run(decoupled_default=True)),
    torch.optim.SGD: KernelSpec(_sgd_init, _sgd_run, _sgd_applies),
    torch.optim.RMSprop: KernelSpec(_rmsprop_init, _rmsprop_run),
    torch.optim.Adagrad: KernelSpec(_adagrad_init, _adagrad_run),
}


def kernel_for(optimizer_cls: type, group: Group) -> Optional[KernelSpec]:
    """The fast path for exactly ``optimizer_cls`` with these hyperparameters, if there is one."""
    spec = KERNELS.get(optimizer_cls)
    return spec if spec is not None and spec.applies(group) else None
