"""``gtx.amsgrad``: one transformation standing for ``chain(scale_by_amsgrad, scale_by_learning_rate)``,
with its C kernel (``gradtx_amsgrad_f32`` in gradtx/native/adam.c).

Checked: its updates and state, and ``scale_by_amsgrad``'s, equal the ATen ops' bit for bit, with
the kernel and without, for random trees, ``b1`` on both sides of ``lerp``'s branch, bias
corrections on and off, learning rates as numbers, 0-d tensors or schedules, ``mu`` dtypes and each
donation mode (``tests/test_clip_handoff.py``: a clip before it); the kernel is not used where it
could change a number; its check refuses a kernel whose numbers differ.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import gradtx as gtx
from gradtx.native import amsgrad as native_amsgrad
from gradtx.native import build, checks
from native_helpers import KERNEL_REFUSALS, NEEDS_KERNELS, donated_run, probe_values, refused_gradients, same_results

pytestmark = NEEDS_KERNELS

_SIZES = st.sampled_from([(), (0,), (1,), (7,), (3, 5, 11), (70_001,)])


def _calls() -> int:
    return native_amsgrad.usable().calls


@settings(max_examples=30, deadline=None)
@given(
    sizes=st.lists(_SIZES, min_size=1, max_size=3),
    b1=st.sampled_from([0.9, 0.3]),
    corrections=st.sampled_from([(True, True), (False, True), (True, False)]),
    lr=st.sampled_from(["number", "tensor", "schedule", "none"]),
    mu_dtype=st.sampled_from([None, torch.bfloat16]),
    inplace=st.sampled_from([False, True, "updates"]),
    aten=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_amsgrad_equals_the_chain_it_stands_for_bit_for_bit(sizes, b1, corrections, lr, mu_dtype, inplace, aten, seed):
    params = {f"p{i}": probe_values(s, seed + i) for i, s in enumerate(sizes)}
    grads = [{k: probe_values(p.shape, seed + 100 * t + i) for i, (k, p) in enumerate(params.items())} for t in range(3)]
    hyper = dict(b1=b1, b2=0.99, eps=1e-6, mu_dtype=mu_dtype, bias_correction_mu=corrections[0], bias_correction_nu=corrections[1])
    if lr == "none":  # scale_by_amsgrad on its own (it takes no donated updates: updates are donated with the state)
        inplace = bool(inplace)
        reference = tested = lambda: gtx.scale_by_amsgrad(**hyper)  # noqa: E731
    else:
        learning_rate = {"number": 0.037, "tensor": torch.tensor(0.037, dtype=torch.float64), "schedule": lambda c: 0.1 / (1.0 + c)}[lr]
        reference = lambda: gtx.chain(gtx.scale_by_amsgrad(**hyper), gtx.scale_by_learning_rate(learning_rate))  # noqa: E731
        tested = lambda: gtx.amsgrad(learning_rate, **hyper)  # noqa: E731
    with checks.aten_only():
        want = donated_run(reference(), params, grads, inplace)
    calls = _calls()
    with checks.aten_only() if aten else checks.checking(native_amsgrad.usable()):
        got = donated_run(tested(), params, grads, inplace)
    assert (_calls() > calls) == (not aten and mu_dtype is None)  # bf16 moments: the ATen ops
    same_results(want, got)


@pytest.mark.parametrize("case", [*KERNEL_REFUSALS, "eps_root"])
def test_the_kernel_is_not_used_where_it_could_change_a_number(case):
    g = probe_values((8, 8), 8)
    grads = refused_gradients(case, g) if case in KERNEL_REFUSALS else {"w": g}
    tx = gtx.amsgrad(1e-3, eps_root=1e-8) if case == "eps_root" else gtx.amsgrad(1e-3)
    before = _calls()
    tx.update(grads, tx.init(grads), inplace=case == "one gradient twice")
    assert _calls() == before


def test_the_check_refuses_a_kernel_whose_numbers_differ():
    lib, _ = build.load("adam")
    vector_sqrt = native_amsgrad.usable().vector_sqrt

    class OffByOne(native_amsgrad._Kernel):  # b2 one float32 step off
        def __call__(self, *args):
            args = list(args)
            args[9] = float(torch.nextafter(torch.tensor(args[9]), torch.tensor(0.0)))
            super().__call__(*args)

    class Unstepped(native_amsgrad._Kernel):  # the learning rate left out
        def __call__(self, *args):
            super().__call__(*args[:14], None, *args[15:])

    assert "values of" in native_amsgrad._mismatch(OffByOne(lib, vector_sqrt))
    assert "values of" in native_amsgrad._mismatch(Unstepped(lib, vector_sqrt))
    assert native_amsgrad._mismatch(native_amsgrad._Kernel(lib, vector_sqrt)) == ""
    assert native_amsgrad.status() == "in use"
