"""``gtx.lion``: one transformation standing for ``chain(scale_by_lion, add_decayed_weights,
scale_by_learning_rate)``, with its C kernel (gradtx/native/lion.c).

Checked: its updates and state equal that chain's bit for bit, with the kernel and with the ATen
ops, for random trees, ``b1``/``b2`` on both sides of each interpolation's branch, learning rates
and weight decays as numbers, 0-d tensors or schedules, masks, momentum dtypes and each donation
mode, with the same state structure (``tests/test_clip_handoff.py``: a clip before it); the kernel
is not used where it could change a number; its check refuses a kernel whose numbers differ.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import gradtx as gtx
from gradtx.native import build, checks
from gradtx.native import lion as native_lion
from native_helpers import KERNEL_REFUSALS, NEEDS_KERNELS, donated_run, probe_values, refused_gradients, same_results

pytestmark = NEEDS_KERNELS

_SIZES = st.sampled_from([(), (0,), (1,), (7,), (3, 5, 11), (70_001,)])


def _value(kind: str, number: float):
    if kind == "schedule":
        return lambda count: number / (1.0 + count)
    if kind == "tensor":
        return torch.tensor(number, dtype=torch.float64)
    return number


def _reference(lr, b1, b2, mu_dtype, wd, mask):
    """The chain ``lion`` stands for, nested as ``lion``'s state is."""
    return gtx.chain(gtx.scale_by_lion(b1, b2, mu_dtype), gtx.add_decayed_weights(wd, mask), gtx.scale_by_learning_rate(lr))


def _calls() -> int:
    return native_lion.usable().calls


@settings(max_examples=30, deadline=None)
@given(
    sizes=st.lists(_SIZES, min_size=1, max_size=3),
    betas=st.sampled_from([(0.9, 0.99), (0.3, 0.2), (0.6, 0.7), (0.0, 0.0)]),
    lr=st.sampled_from(["number", "tensor", "schedule"]),
    wd=st.sampled_from(["number", "zero", "tensor", "schedule"]),
    masked=st.booleans(),
    mu_dtype=st.sampled_from([None, torch.bfloat16]),
    inplace=st.sampled_from([False, True, "updates"]),
    aten=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_lion_equals_the_chain_it_stands_for_bit_for_bit(sizes, betas, lr, wd, masked, mu_dtype, inplace, aten, seed):
    params = {f"p{i}": probe_values(s, seed + i) for i, s in enumerate(sizes)}
    grads = [{k: probe_values(p.shape, seed + 100 * t + i) for i, (k, p) in enumerate(params.items())} for t in range(3)]
    if betas[1] == 0.0:  # the momentum's weight 1: torch's lerp signs a -0.0 by position, give it none
        grads = [{k: torch.where(g == 0, torch.zeros_like(g), g) for k, g in step.items()} for step in grads]
    b1, b2 = betas
    learning_rate = _value(lr, 0.037)
    weight_decay = 0.0 if wd == "zero" else _value(wd, 0.1)
    mask = {k: i % 2 == 0 for i, k in enumerate(params)} if masked else None
    with checks.aten_only():
        want = donated_run(_reference(learning_rate, b1, b2, mu_dtype, weight_decay, mask), params, grads, inplace)
    calls = _calls()
    with checks.aten_only() if aten else checks.checking(native_lion.usable()):
        got = donated_run(gtx.lion(learning_rate, b1, b2, mu_dtype, weight_decay, mask), params, grads, inplace)
    assert (_calls() > calls) == (not aten and mu_dtype is None)  # bf16 momenta: the ATen ops
    same_results(want, got)


@pytest.mark.parametrize("case", [*KERNEL_REFUSALS, "a param that is its gradient", "bf16 momentum"])
def test_the_kernel_is_not_used_where_it_could_change_a_number(case):
    g = probe_values((8, 8), 8)
    params = {"w": probe_values((8, 8), 9)}
    grads = refused_gradients(case, g) if case in KERNEL_REFUSALS else {"w": g}
    tx = gtx.lion(1e-3, weight_decay=0.1)
    inplace = False
    if case == "bfloat16 leaves":
        params = {"w": params["w"].bfloat16()}
    elif case == "one gradient twice":
        params, inplace = {"w": params["w"], "x": params["w"].clone()}, True
    elif case == "a param that is its gradient":  # donated: the update written over the param it decays
        grads, params, inplace = {"w": g}, {"w": g}, True
    elif case == "bf16 momentum":
        tx = gtx.lion(1e-3, mu_dtype=torch.bfloat16)
    before = _calls()
    tx.update(grads, tx.init(params), params, inplace=inplace)
    assert _calls() == before


def test_the_check_refuses_a_kernel_whose_numbers_differ():
    lib, _ = build.load("lion")

    class OffByOne(native_lion._Kernel):  # b2 one float32 step off
        def __call__(self, g, m, p, mo, uo, w1, w2, *args):
            super().__call__(g, m, p, mo, uo, w1, float(torch.nextafter(torch.tensor(w2), torch.tensor(0.0))), *args)

    class Undecayed(native_lion._Kernel):  # the decay term left out
        def __call__(self, g, m, p, mo, uo, w1, w2, decay, *args):
            super().__call__(g, m, p, mo, uo, w1, w2, native_lion.DECAY_NONE, *args)

    assert "values of" in native_lion._mismatch(OffByOne(lib))
    assert "values of" in native_lion._mismatch(Undecayed(lib))
    assert native_lion._mismatch(native_lion._Kernel(lib)) == ""
    assert native_lion.status() == "in use"
