"""The C kernel of the eager momentum step (gradtx/native/momentum.c): the ATen ops' numbers.

Checked: for random trees, decays, Nesterov or not and each donation mode, the kernel's updates
and traces equal the ATen ops' bit for bit where the kernel is really used (``sgd`` with momentum
too, chained with a clip and applied); where it must not be used it is not; its check refuses a
kernel whose numbers differ.
"""

from __future__ import annotations


import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import gradtx as gtx
from gradtx.native import build, checks
from gradtx.native import momentum as native_momentum
from native_helpers import KERNEL_REFUSALS, NEEDS_KERNELS, applied, donated_run, equal_bits, probe_values, refused_gradients

pytestmark = NEEDS_KERNELS


def _calls() -> int:
    return native_momentum.usable().calls


@settings(max_examples=25, deadline=None)
@given(
    shapes=st.lists(st.sampled_from([(), (0,), (1,), (7,), (3, 5, 11), (70_001,)]), min_size=1, max_size=3),
    decay=st.sampled_from([0.0, 0.5, 0.9, 0.99]),
    nesterov=st.booleans(),
    inplace=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_the_kernels_steps_equal_the_aten_ops_bit_for_bit(shapes, decay, nesterov, inplace, seed):
    params = {f"p{i}": probe_values(s, seed + i) for i, s in enumerate(shapes)}
    grads = [{k: probe_values(p.shape, seed + 100 * t + i) for i, (k, p) in enumerate(params.items())} for t in range(3)]
    with checks.aten_only():
        want_out, want_state = donated_run(gtx.trace(decay, nesterov), params, grads, inplace)
    before = _calls()
    got_out, got_state = donated_run(gtx.trace(decay, nesterov), params, grads, inplace)
    assert _calls() > before or not any(p.numel() for p in params.values())
    for key in params:
        assert equal_bits(want_out[key], got_out[key]) and equal_bits(want_state.trace[key], got_state.trace[key]), key


@pytest.mark.parametrize("nesterov", [False, True])
def test_sgd_with_momentum_chained_with_a_clip_and_applied_takes_the_kernel(nesterov):
    params = {"w": probe_values((100, 500), 1), "b": probe_values((500,), 2)}
    grads = {"w": probe_values((100, 500), 3), "b": probe_values((500,), 4)}
    tx = gtx.chain(gtx.clip_by_global_norm(1.0), gtx.sgd(1e-2, momentum=0.9, nesterov=nesterov))

    with checks.aten_only():
        want = applied(tx, params, grads)
    before = _calls()
    got = applied(tx, params, grads)
    assert _calls() == before + 6  # a call per leaf and step
    assert all(equal_bits(want[k], got[k]) for k in want)


@pytest.mark.parametrize("case", [*KERNEL_REFUSALS, "tensor decay", "bf16 trace"])
def test_the_kernel_is_not_used_where_it_could_change_a_number(case):
    g = probe_values((8, 8), 8)
    tx = gtx.trace(0.9)
    grads = refused_gradients(case, g) if case in KERNEL_REFUSALS else {"w": g}
    if case == "tensor decay":
        tx = gtx.trace(torch.tensor(0.9))
    elif case == "bf16 trace":
        tx = gtx.trace(0.9, accumulator_dtype=torch.bfloat16)
    before = _calls()
    tx.update(grads, tx.init(grads), inplace=case == "one gradient twice")
    assert _calls() == before


def test_the_check_refuses_a_kernel_whose_numbers_differ():
    lib, _ = build.load("momentum")

    class OffByOne(native_momentum._Kernel):  # the decay one float32 step off
        def __call__(self, g, t, to, uo, decay, nesterov, grad_scale=None, update_scale=None):
            off = float(torch.nextafter(torch.tensor(decay), torch.tensor(0.0)))
            super().__call__(g, t, to, uo, off, nesterov, grad_scale, update_scale)

    class Unstepped(native_momentum._Kernel):  # sgd's learning rate left out of the update
        def __call__(self, g, t, to, uo, decay, nesterov, grad_scale=None, update_scale=None):
            super().__call__(g, t, to, uo, decay, nesterov, grad_scale)

    assert "values of" in native_momentum._mismatch(OffByOne(lib))
    assert "sgd" in native_momentum._mismatch(Unstepped(lib))
    assert native_momentum._mismatch(native_momentum._Kernel(lib)) == ""
