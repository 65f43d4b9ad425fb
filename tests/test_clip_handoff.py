"""A global-norm clip in a chain hands its coefficient to the Adam, AMSGrad, momentum or Lion step after it.

``chain(clip_by_global_norm(...), adam/adamw/scale_by_adam/sgd with momentum/amsgrad/lion(...))``, and
``quantize_state(adamw(...), 8)`` after the clip, do not make
a scaled copy of the gradients: the step's kernel takes the product where it reads them. Checked: the updates and
state equal, bit for bit, those of the same chain with the ATen ops and of the chain with a member
in between (so the clip scales on its own), for random trees, clip sizes, hyperparameters,
extreme values and every donation mode; no scaling pass runs; the caller's gradients are left
alone on a pure step; where the hand-off must not happen (a graph to record, tensors that are not
plain, an optimizer that does not take it) the clip scales as before; a kernel that ignores the
coefficient fails its check; ``observe``'s statistics of the gradients come from the same pass.
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import gradtx as gtx
from gradtx import tree as tree_lib
from gradtx.native import adam as native_adam
from gradtx.native import checks
from gradtx.native import amsgrad as native_amsgrad
from gradtx.native import lion as native_lion
from gradtx.native import momentum as native_momentum
from gradtx.native import stored_adam
from native_helpers import NEEDS_KERNELS, donated_run, equal_bits, probe_values

pytestmark = NEEDS_KERNELS

_SIZES = st.sampled_from([(), (0,), (1,), (7,), (2049,), (3, 5, 11), (70_001,)])


def _optimizer(kind: str, lr, wd, mask):
    if kind == "scale_by_adam":
        return gtx.scale_by_adam(b1=0.9, b2=0.99)
    if kind.startswith("sgd"):  # the momentum step with the learning rate folded in takes it
        return gtx.sgd(lr, momentum=0.9, nesterov=kind == "sgd_nesterov")
    if kind == "adam":
        return gtx.adam(lr)
    if kind == "amsgrad":
        return gtx.amsgrad(lr)
    if kind == "lion":
        return gtx.lion(lr, weight_decay=wd, mask=mask)
    if kind == "adamw_8bit":  # every leaf stored, in blocks of 64
        return gtx.quantize_state(gtx.adamw(lr, weight_decay=wd, mask=mask), 8, block_size=64, min_size=1)
    return gtx.adamw(lr, weight_decay=wd, mask=mask)


def _kernel_of(kind: str):
    """The C kernel that takes the clip's product for ``kind``."""
    kernels = {"sgd": native_momentum, "sgd_nesterov": native_momentum, "amsgrad": native_amsgrad, "lion": native_lion,
               "adamw_8bit": stored_adam}
    return kernels.get(kind, native_adam).usable()


def _leaves(result) -> list[torch.Tensor]:
    updates, state = result
    return [x for x in tree_lib.leaves((updates, state)) if isinstance(x, torch.Tensor)]


def _same(want, got) -> None:
    want_leaves, got_leaves = _leaves(want), _leaves(got)
    assert len(want_leaves) == len(got_leaves)
    for a, b in zip(want_leaves, got_leaves):
        assert equal_bits(a, b)


def _unclipped_state(result):
    """``(updates, state)`` of a chain with a member between clip and optimizer, with that
    member's state left out, so it lines up with the two-member chain's."""
    updates, state = result
    return updates, (state[0],) + tuple(state[2:])


@settings(max_examples=30, deadline=None)
@given(
    sizes=st.lists(_SIZES, min_size=1, max_size=3),
    max_norm=st.sampled_from([1e-3, 0.5, 1e6]),
    kind=st.sampled_from(["adamw", "adam", "scale_by_adam", "sgd", "sgd_nesterov", "amsgrad", "lion", "adamw_8bit"]),
    lr=st.sampled_from([1e-3, "schedule"]),
    wd=st.sampled_from([0.0, 0.1, "schedule"]),
    masked=st.booleans(),
    bad=st.sampled_from([None, float("inf"), float("nan")]),
    inplace=st.sampled_from([False, True, "updates"]),
    seed=st.integers(0, 2**16),
)
def test_the_handed_coefficient_gives_the_scaled_steps_numbers(sizes, max_norm, kind, lr, wd, masked, bad, inplace, seed):
    params = {f"p{i}": probe_values(s, seed + i) for i, s in enumerate(sizes)}
    grads = [{k: probe_values(p.shape, seed + 100 * t + i) for i, (k, p) in enumerate(params.items())} for t in range(3)]
    if bad is not None and params["p0"].numel():
        grads[1]["p0"].view(-1)[0] = bad  # the norm, and the coefficient, become non-finite
    learning_rate = (lambda count: 0.1 / (1.0 + count)) if lr == "schedule" else lr
    weight_decay = (lambda count: 0.01 * count) if wd == "schedule" else wd
    mask = {k: i % 2 == 0 for i, k in enumerate(params)} if masked else None

    def make(between: bool):
        middle = [gtx.identity()] if between else []
        return gtx.chain(gtx.clip_by_global_norm(max_norm), *middle, _optimizer(kind, learning_rate, weight_decay, mask))

    with checks.aten_only():
        reference = donated_run(make(True), params, grads, inplace)
        aten_handed = donated_run(make(False), params, grads, inplace)
    clip_scaling = donated_run(make(True), params, grads, inplace)
    kernel = _kernel_of(kind)
    before = kernel.calls
    handed = donated_run(make(False), params, grads, inplace)
    assert kernel.calls > before or not any(p.numel() for p in params.values())
    _same(_unclipped_state(reference), handed)
    _same(_unclipped_state(reference), aten_handed)
    _same(_unclipped_state(clip_scaling), handed)


def _counting_scales(monkeypatch) -> list:
    """The calls to the clip's scaling from here on (the kernel's first-use check, which scales
    too, is run before)."""
    assert native_adam.usable() is not None
    calls: list = []
    original = tree_lib.scale_

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(tree_lib, "scale_", counted)
    return calls


@pytest.mark.parametrize("optimizer", ["adamw", "sgd", "amsgrad", "lion", "adamw_8bit"])
@pytest.mark.parametrize("inplace", [False, True, "updates"])
def test_no_scaling_pass_runs_and_a_pure_step_leaves_the_gradients_alone(monkeypatch, inplace, optimizer):
    params = {"w": probe_values((300, 70), 1), "b": probe_values((70,), 2)}
    grads = {k: torch.randn(p.shape) * 10 for k, p in params.items()}  # a norm far above 1: clipped
    kept = {k: g.clone() for k, g in grads.items()}
    kernel = _kernel_of(optimizer)
    tx = gtx.chain(gtx.clip_by_global_norm(1.0), _optimizer(optimizer, 1e-3, 0.1, None))
    scales = _counting_scales(monkeypatch)
    calls = kernel.calls
    given = {k: g.clone() for k, g in grads.items()} if inplace else grads
    updates, state = tx.update(given, tx.init(params), params, inplace=inplace)
    assert scales == [] and kernel.calls == calls + 2
    assert float(state[0].norm) > 1.0
    if not inplace:
        assert all(torch.equal(grads[k], kept[k]) for k in grads)  # pure: nothing the caller passed is written
    else:
        assert all(updates[k].data_ptr() == given[k].data_ptr() for k in grads)  # donated: the updates in their buffers


def test_the_clip_scales_on_its_own_where_the_coefficient_cannot_be_handed(monkeypatch):
    params = {"w": probe_values((40, 30), 3)}
    grads = {"w": torch.randn(40, 30) * 10}
    scales = _counting_scales(monkeypatch)
    # an optimizer that does not take it: RMSProp
    rmsprop = gtx.chain(gtx.clip_by_global_norm(1.0), gtx.rmsprop(1e-3))
    rmsprop.update(grads, rmsprop.init(params), params)
    assert len(scales) == 1
    # gradients that record a graph: the clip's differentiable product
    adamw = gtx.chain(gtx.clip_by_global_norm(1.0), gtx.adamw(1e-3))
    recorded = {"w": grads["w"].clone().requires_grad_()}
    updates, _ = adamw.update(recorded, adamw.init(params), params)
    assert len(scales) == 2 and updates["w"].requires_grad
    # a bfloat16 gradient: not a kernel's, but still handed, and scaled as the clip scales
    low = {"w": grads["w"].to(torch.bfloat16)}
    low_params = {"w": params["w"].to(torch.bfloat16)}
    got, _ = adamw.update(low, adamw.init(low_params), low_params)
    between = gtx.chain(gtx.clip_by_global_norm(1.0), gtx.identity(), gtx.adamw(1e-3))
    want, _ = between.update(low, between.init(low_params), low_params)
    assert equal_bits(want["w"], got["w"])
    # quantized state: only the 8-bit Adam step on the codes takes it; 4 bits and other steps do not
    assert gtx.base.scaled_update_of(_optimizer("adamw_8bit", 1e-3, 0.1, None).update) is not None
    for other in (gtx.quantize_state(gtx.adamw(1e-3), 4), gtx.quantize_state(gtx.lion(1e-3), 8), gtx.quantize_state(gtx.adamw(1e-3, nesterov=True), 8)):
        clipped = gtx.chain(gtx.clip_by_global_norm(1.0), other)
        before = len(scales)
        clipped.update(grads, clipped.init(params), params)
        assert len(scales) == before + 1, other.update


def test_a_handed_coefficient_the_8bit_step_cannot_take_is_applied_first():
    """Where the 8-bit Adam step on the codes is not taken (a transposed gradient, the kernel off),
    the handed coefficient scales the gradients first: the clip's numbers, and the caller's
    gradients left alone."""
    params = {"w": probe_values((40, 30), 4), "v": probe_values((50,), 5)}
    kernel = _kernel_of("adamw_8bit")
    for grads, route in (({"w": torch.randn(30, 40).t() * 10, "v": torch.randn(50)}, "kernel"),
                         ({"w": torch.randn(40, 30) * 10, "v": torch.randn(50)}, "aten")):
        kept = {k: g.clone() for k, g in grads.items()}
        calls, results = kernel.calls, []
        for between in (True, False):
            middle = [gtx.identity()] if between else []
            tx = gtx.chain(gtx.clip_by_global_norm(1.0), *middle, _optimizer("adamw_8bit", 1e-2, 0.1, None))
            with checks.aten_only() if route == "aten" else contextlib.nullcontext():
                results.append(donated_run(tx, params, [grads, grads], False))
        _same(_unclipped_state(results[0]), results[1])
        assert all(torch.equal(grads[k], kept[k]) for k in grads) and kernel.calls == calls


def test_a_max_norm_that_requires_grad_keeps_its_gradient():
    params = {"w": torch.randn(20, 30)}
    grads = {"w": torch.randn(20, 30) * 10}

    def meta_gradient(between: bool):
        max_norm = torch.tensor(0.5, requires_grad=True)
        middle = [gtx.identity()] if between else []
        tx = gtx.chain(gtx.clip_by_global_norm(max_norm), *middle, gtx.adam(1e-2, eps_root=1e-8))
        updates, _ = tx.update(grads, tx.init(params), params)
        (gradient,) = torch.autograd.grad(updates["w"].square().sum(), max_norm)
        return gradient

    want, got = meta_gradient(True), meta_gradient(False)
    assert float(want) != 0.0 and torch.equal(want, got)


def test_the_check_refuses_a_kernel_that_leaves_the_coefficient_out(monkeypatch):
    kernel = native_adam.usable()

    class Unscaled(type(kernel)):
        def __call__(self, *args):  # (g, m, v, p, mo, vo, uo, 6 floats, decay, sums, grad_scale, extremes)
            return super().__call__(*args[:15], None, *args[16:])

    broken = object.__new__(Unscaled)
    broken.__dict__.update(kernel.__dict__)
    broken.calls = 0
    assert "clip" in native_adam._mismatch(broken)
    assert native_adam._mismatch(kernel) == ""

    momentum = native_momentum.usable()

    class UnscaledTrace(type(momentum)):
        def __call__(self, g, t, to, uo, decay, nesterov, grad_scale=None, update_scale=None):
            return super().__call__(g, t, to, uo, decay, nesterov, None, update_scale)

    broken_trace = object.__new__(UnscaledTrace)
    broken_trace.__dict__.update(momentum.__dict__)
    broken_trace.calls = 0
    assert "clip" in native_momentum._mismatch(broken_trace)
    assert native_momentum._mismatch(momentum) == ""


@pytest.mark.parametrize("inplace", [False, True])
def test_observe_reads_the_gradients_extremes_in_the_same_pass(inplace):
    gen = torch.Generator().manual_seed(5)
    params = {"a": torch.randn(300, 70, generator=gen), "b": torch.randn(70, generator=gen), "c": torch.randn(70_001, generator=gen)}
    params["low"] = torch.randn(64, generator=gen).to(torch.bfloat16)  # a group of its own, scaled by the ATen ops
    for bad in (None, float("inf"), float("nan")):
        grads = {k: (torch.randn(p.shape, generator=gen) * 3).to(p.dtype) for k, p in params.items()}
        if bad is not None:
            grads["c"][17] = bad
        results = []
        for between in (True, False):
            middle = [gtx.identity()] if between else []
            tx = gtx.observe(gtx.chain(gtx.clip_by_global_norm(1.0), *middle, gtx.adamw(1e-3, weight_decay=0.1)), groups=1)
            state = tx.init(params)
            for _ in range(2):
                updates, state = tx.update({k: g.clone() for k, g in grads.items()}, state, params, inplace=inplace)
            results.append((updates, gtx.observations(state)))
        (want_updates, want), (got_updates, got) = results
        assert all(equal_bits(want_updates[k], got_updates[k]) for k in params)
        assert want.keys() == got.keys()
        for key, value in want.items():
            assert value == got[key] or (math.isnan(value) and math.isnan(got[key])), (bad, key)
        assert got["grad_nonfinite"] == (0.0 if bad is None else 1.0)


def test_a_wrong_state_is_named_by_the_clip_that_hands_its_coefficient():
    params = {"w": probe_values((40, 30), 5)}
    grads = {"w": torch.randn(40, 30)}
    tx = gtx.chain(gtx.clip_by_global_norm(1.0), gtx.adamw(1e-3))
    clip_state, adam_state = tx.init(params)
    with pytest.raises(TypeError, match=r"^clip_by_global_norm: state is a tuple of 3, where init makes a ClipByGlobalNormState"):
        tx.update(grads, (adam_state, clip_state), params)
