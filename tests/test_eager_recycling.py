"""Eager pure steps write their large CPU outputs into the memory of outputs the caller let go of
(``gradtx.buffer_pool.new_like``): the same numbers as freshly allocated outputs, never over
anything the caller still holds, and nothing kept after ``release_buffers`` or with
``GRADTX_RECYCLE=0``."""

from __future__ import annotations

import weakref

import numpy as np
import pytest
import torch

import gradtx as gtx
from gradtx import buffer_pool
from gradtx.buffer_pool import RECYCLE_MIN_BYTES

ROWS = RECYCLE_MIN_BYTES // 4 // 64  # a (ROWS, 128) float32 leaf is twice the smallest pooled buffer


def _params() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(ROWS, 128, generator=generator),
        "e": torch.randn(3 * ROWS, 64, generator=generator),
        "b": torch.randn(17, generator=generator),  # below the pooled size: allocated as before
    }


def _grads(params: dict[str, torch.Tensor], step: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    return {k: torch.randn(v.shape, generator=generator) * 1e-2 for k, v in params.items()}


# each reaches one pooled site: a C kernel's outputs (Adam, momentum, Lion, AMSGrad, the 8-bit
# Adam step, observe's scaling pass) and apply_updates' new params
TRANSFORMS = {
    "adamw": lambda: gtx.chain(gtx.clip_by_global_norm(1.0), gtx.adamw(1e-3, weight_decay=0.1)),
    "sgd": lambda: gtx.sgd(1e-2, momentum=0.9, nesterov=True),
    "lion": lambda: gtx.lion(1e-4, weight_decay=0.1),
    "amsgrad": lambda: gtx.amsgrad(1e-3),
    "adamw_8bit": lambda: gtx.quantize_state(gtx.adamw(1e-3), 8),
    "observed": lambda: gtx.observe(gtx.chain(gtx.clip_by_global_norm(1e-3), gtx.adam(1e-3))),
}


def _run(make, steps: int, keep: bool = False):
    """``steps`` pure steps from the same start; the params and states of every step when ``keep``."""
    tx = make()
    params = _params()
    state = tx.init(params)
    kept = []
    for step in range(steps):
        updates, state = tx.update(_grads(params, step), state, params)
        params = gtx.apply_updates(params, updates)
        del updates
        if keep:
            kept.append((params, state))
    return params, state, kept


def _leaves(tree) -> list[torch.Tensor]:
    return [x for x in torch.utils._pytree.tree_leaves(tree) if isinstance(x, torch.Tensor)]


def _assert_same(a: torch.Tensor, b: torch.Tensor, what: str = "") -> None:
    """Bit for bit (NaN where NaN)."""
    torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True, msg=lambda m: f"{what} {m}")


@pytest.fixture(autouse=True)
def _fresh_pools():
    gtx.release_buffers()
    yield
    gtx.release_buffers()


@pytest.mark.parametrize("name", sorted(TRANSFORMS))
def test_recycled_outputs_give_the_numbers_of_fresh_ones(name, monkeypatch):
    params, state, _ = _run(TRANSFORMS[name], 5)
    assert buffer_pool._eager_pools, "no step output came from a pool"
    monkeypatch.setenv("GRADTX_RECYCLE", "0")
    gtx.release_buffers()
    fresh_params, fresh_state, _ = _run(TRANSFORMS[name], 5)
    assert not buffer_pool._eager_pools
    for a, b in zip(_leaves((params, state)), _leaves((fresh_params, fresh_state))):
        assert a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
        _assert_same(a, b)


@pytest.mark.parametrize("name", sorted(TRANSFORMS))
def test_the_new_params_and_state_reuse_the_memory_of_those_let_go_of(name):
    tx = TRANSFORMS[name]()
    params = _params()
    state = tx.init(params)
    addresses = []
    for step in range(6):
        updates, state = tx.update(_grads(params, step), state, params)
        params = gtx.apply_updates(params, updates)
        del updates
        addresses.append({x.untyped_storage().data_ptr() for x in _leaves((params, state)) if x.nbytes >= RECYCLE_MIN_BYTES})
    # from the third step on, every large output sits where an output of two steps before was
    assert addresses[4] == addresses[2] and addresses[5] == addresses[3]
    assert not addresses[4] & addresses[5]


@pytest.mark.parametrize("name", sorted(TRANSFORMS))
def test_what_the_caller_holds_is_never_written(name):
    """Every step's params and state kept, some only through a view, a NumPy array or a weak
    reference to the storage: none changes afterwards, and no two live outputs share memory."""
    tx = TRANSFORMS[name]()
    params = _params()
    state = tx.init(params)
    held, copies = [], []
    for step in range(6):
        updates, state = tx.update(_grads(params, step), state, params)
        params = gtx.apply_updates(params, updates)
        del updates
        leaves = _leaves((params, state))
        copies.append([x.clone() for x in leaves])
        if step % 3 == 0:
            held.append(leaves)
        elif step % 3 == 1:
            held.append([np.asarray(x) if x.dtype != torch.bfloat16 else x[...] for x in leaves])
        else:  # only a weak reference to each storage: what it still reaches must not change
            held.append([(weakref.ref(x.untyped_storage()), x.dtype, x.shape, x.stride()) for x in leaves])
    for step, (kept, expected) in enumerate(zip(held, copies)):
        for value, copy in zip(kept, expected):
            if isinstance(value, tuple):
                storage, dtype, shape, stride = value
                if storage() is None:
                    continue
                value = torch.empty(0, dtype=dtype).set_(storage(), 0, shape, stride)
            value = torch.as_tensor(value).reshape(copy.shape)
            _assert_same(value, copy, f"step {step}")
    live = [x for x in _leaves((params, state)) if x.nbytes >= RECYCLE_MIN_BYTES]
    pointers = [x.untyped_storage().data_ptr() for x in live]
    assert len(set(pointers)) == len(pointers)


def test_release_buffers_lets_the_kept_memory_go():
    params, state, _ = _run(TRANSFORMS["adamw"], 3)
    assert buffer_pool._eager_pools
    spare = [weakref.ref(s) for pool in buffer_pool._eager_pools.values() for generation in pool._kept for s in generation]
    gtx.release_buffers()
    assert not buffer_pool._eager_pools
    live = {x.untyped_storage().data_ptr() for x in _leaves((params, state))}
    # what survives is what the caller holds
    assert all(ref() is None or ref().data_ptr() in live for ref in spare)


def test_recycling_off_keeps_nothing(monkeypatch):
    monkeypatch.setenv("GRADTX_RECYCLE", "0")
    _run(TRANSFORMS["adamw"], 3)
    assert not buffer_pool._eager_pools


def test_a_graph_recording_step_takes_nothing_from_the_pools():
    params = {k: v.requires_grad_() for k, v in _params().items()}
    tx = gtx.adamw(1e-3)
    state = tx.init(params)
    grads = {k: torch.randn_like(v) for k, v in params.items()}
    updates, state = tx.update(grads, state, params)
    new = gtx.apply_updates(params, updates)
    assert all(x.grad_fn is not None for x in new.values())
    assert "apply_updates" not in buffer_pool._eager_pools
