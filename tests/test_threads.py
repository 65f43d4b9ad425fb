"""gradtx holds no process-wide mode: a wrapped optimizer stepping in one thread leaves pure
chains running in another thread with exactly their single-threaded results.

The pure chains run over dicts whose key order is not sorted order, the case where a
process-wide switch of optree's dict ordering (insertion order instead of sorted keys) would
flatten the gradients and the state in different orders and swap updates between keys.
"""

from __future__ import annotations

import sys
import threading

import torch
from torch import nn

import gradtx as gtx

ROUNDS = 40


def pure_tx() -> gtx.GradientTransformation:
    # a mask written in a third order: it must still match the gradients key by key
    decay_mask = {"b": False, "m": True, "a": False, "z": True}
    return gtx.chain(gtx.clip_by_global_norm(0.5), gtx.adamw(1e-2, weight_decay=0.1, mask=decay_mask))


def pure_inputs() -> tuple[dict[str, torch.Tensor], list[dict[str, torch.Tensor]]]:
    gen = torch.Generator().manual_seed(0)
    # insertion order z, a, m, b is not sorted order; equal shapes make swapped leaves silent
    params = {k: torch.randn(3, 2, generator=gen) for k in ("z", "a", "m", "b")}
    scales = {"z": 1e3, "a": 1e-3, "m": 1.0, "b": 3e-7}  # the norm's sum depends on the order of the terms
    grads = [{k: torch.randn(3, 2, generator=gen) * s * (i + 1) for k, s in scales.items()} for i in range(4)]
    return params, grads


def run_pure(params, grads_seq) -> list[dict[str, torch.Tensor]]:
    tx = pure_tx()
    state = tx.init(params)
    out = []
    for grads in grads_seq:
        updates, state = tx.update(grads, state, params)
        params = gtx.apply_updates(params, updates)
        out.append(params)
    return out


def run_wrapped(started: threading.Event, stop: threading.Event, errors: list[BaseException]) -> None:
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    opt = gtx.wrap(torch.optim.SGD(model.parameters(), lr=0.1), gtx.clip_by_global_norm(0.1), model=model)
    x = torch.randn(5, 4)
    try:
        while not stop.is_set():
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
            started.set()
    except BaseException as error:  # noqa: BLE001 - reported to the test
        errors.append(error)


def test_wrapped_steps_in_one_thread_leave_pure_chains_in_another_exact():
    params, grads_seq = pure_inputs()
    reference = run_pure(params, grads_seq)
    started, stop, errors = threading.Event(), threading.Event(), []
    worker = threading.Thread(target=run_wrapped, args=(started, stop, errors), daemon=True)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible
    try:
        worker.start()
        assert started.wait(timeout=60), errors  # the first step (and its lazy imports) is done
        for _ in range(ROUNDS):
            result = run_pure(params, grads_seq)
            for got, want in zip(result, reference):
                assert list(got) == list(want)
                for key in want:
                    assert torch.equal(got[key], want[key]), key
    finally:
        sys.setswitchinterval(interval)
        stop.set()
        worker.join(timeout=30)
    assert not errors, errors
