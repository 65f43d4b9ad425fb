"""``gtx.sgd`` with momentum: one transformation standing for ``chain(trace, scale_by_learning_rate)``.

Checked: its updates and state equal that chain's bit for bit (the kernel's and the ATen ops') for
random trees, learning rates (numbers, 0-d tensors, schedules), Nesterov or not, trace dtypes and
each donation mode, with the same state structure; the learning rate is taken in the kernel's pass
(no scaling of its own); a learning rate that requires grad keeps its gradient.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import gradtx as gtx
from gradtx.native import checks
from gradtx.native import momentum as native_momentum
from gradtx.transforms import _foreach as fe
from native_helpers import NEEDS_KERNELS, donated_run, equal_bits, probe_values, same_results

_SIZES = st.sampled_from([(), (0,), (1,), (7,), (3, 5, 11), (70_001,)])


def _learning_rate(kind: str):
    if kind == "schedule":
        return lambda count: 0.1 / (1.0 + count)
    if kind == "tensor":
        return torch.tensor(0.037, dtype=torch.float64)
    return 0.037


def _reference(lr, momentum, nesterov, accumulator_dtype):
    """The chain ``sgd`` stands for, nested as ``sgd``'s state is."""
    return gtx.chain(gtx.trace(momentum, nesterov, accumulator_dtype), gtx.scale_by_learning_rate(lr))


@NEEDS_KERNELS
@settings(max_examples=30, deadline=None)
@given(
    sizes=st.lists(_SIZES, min_size=1, max_size=3),
    lr=st.sampled_from(["number", "tensor", "schedule"]),
    momentum=st.sampled_from([0.0, 0.5, 0.9]),
    nesterov=st.booleans(),
    accumulator_dtype=st.sampled_from([None, torch.bfloat16]),
    inplace=st.sampled_from([False, True, "updates"]),
    aten=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_sgd_equals_the_chain_it_stands_for_bit_for_bit(sizes, lr, momentum, nesterov, accumulator_dtype, inplace, aten, seed):
    params = {f"p{i}": probe_values(s, seed + i) for i, s in enumerate(sizes)}
    grads = [{k: probe_values(p.shape, seed + 100 * t + i) for i, (k, p) in enumerate(params.items())} for t in range(3)]
    learning_rate = _learning_rate(lr)
    with checks.aten_only():
        want = donated_run(_reference(learning_rate, momentum, nesterov, accumulator_dtype), params, grads, inplace)
    calls = native_momentum.usable().calls
    with checks.aten_only() if aten else checks.checking(native_momentum.usable()):
        got = donated_run(gtx.sgd(learning_rate, momentum, nesterov, accumulator_dtype), params, grads, inplace)
    assert (native_momentum.usable().calls > calls) == (not aten and accumulator_dtype is None)  # bf16 traces: the ATen ops
    same_results(want, got)


@NEEDS_KERNELS
@pytest.mark.parametrize("inplace", [False, True, "updates"])
def test_the_learning_rate_is_taken_in_the_kernels_pass(monkeypatch, inplace):
    params = {"w": probe_values((300, 70), 1), "b": probe_values((70,), 2)}
    grads = {k: probe_values(p.shape, 3) for k, p in params.items()}
    kept = {k: g.clone() for k, g in grads.items()}
    assert native_momentum.usable() is not None  # its first-use check, which multiplies too, runs before
    products: list = []
    original = fe.mul

    def counted(*args, **kwargs):
        products.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(fe, "mul", counted)
    tx = gtx.sgd(0.1, momentum=0.9)
    calls = native_momentum.usable().calls
    given_grads = {k: g.clone() for k, g in grads.items()} if inplace else grads
    updates, _ = tx.update(given_grads, tx.init(params), params, inplace=inplace)
    assert products == [] and native_momentum.usable().calls == calls + 2
    if inplace:  # donated: the updates in the gradients' buffers
        assert all(updates[k].data_ptr() == given_grads[k].data_ptr() for k in grads)
    else:  # pure: nothing the caller passed is written
        assert all(equal_bits(grads[k], kept[k]) for k in grads)


def test_a_learning_rate_that_requires_grad_keeps_its_gradient():
    params = {"w": torch.randn(4, 3), "b": torch.randn(3)}
    grads = {k: torch.randn(p.shape) for k, p in params.items()}
    results = []
    for tx_of in (lambda lr: gtx.sgd(lr, momentum=0.9, nesterov=True), lambda lr: _reference(lr, 0.9, True, None)):
        lr = torch.tensor(0.1, requires_grad=True)
        tx = tx_of(lr)
        state = tx.init(params)
        for _ in range(2):
            updates, state = tx.update(grads, state, params)
        sum(u.sum() for u in updates.values()).backward()
        results.append((updates, lr.grad))
    (want, want_grad), (got, got_grad) = results
    assert got_grad is not None and torch.equal(want_grad, got_grad)
    assert all(torch.equal(want[k], got[k]) for k in want)
