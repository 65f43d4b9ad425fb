"""Hand-written training-loop pieces the integration tests compare frameworks against."""

from __future__ import annotations

import torch


def accumulate_then_clip_and_step(
    params: list[torch.Tensor], acc: list[torch.Tensor], index: int, every: int, optimizer: torch.optim.Optimizer, max_norm: float
) -> None:
    """One mini-step of ``MultiSteps(apply_if_finite(clip_by_global_norm(max_norm)), every)`` by hand.

    Adds the parameters' gradients to the running mean ``acc``; on every ``every``-th call, clips the
    mean and steps ``optimizer`` unless it holds a NaN or an infinity (then nothing steps), and
    starts a new mean.
    """
    for a, p in zip(acc, params):
        a.lerp_(p.grad, 1.0 / (index % every + 1))
    if index % every != every - 1:
        return
    if all(bool(a.isfinite().all()) for a in acc):
        for a, p in zip(acc, params):
            p.grad = a.clone()
        torch.nn.utils.clip_grad_norm_(params, max_norm)
        optimizer.step()
    for a in acc:
        a.zero_()
