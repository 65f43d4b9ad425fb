"""``apply_updates``' new params by a C kernel (gradtx/native/add.c), and the pure steps' outputs
stored past the cache (gradtx/native/streams.h).

Checked: the sums are ``torch.add``'s bit for bit (probe values with zeros, infinities, NaNs and
subnormals; sizes around the blocks and vector widths; aligned outputs, which take non-temporal
stores, and unaligned ones, which do not); ``apply_updates`` takes the kernel for large float32 CPU
leaves and gives the ATen path's bits; the check refuses a kernel whose numbers differ; the Adam,
AMSGrad, Lion and momentum kernels give the same bits into new buffers (streamed) as in place (not).
"""

from __future__ import annotations

import pytest
import torch

import gradtx as gtx
from gradtx import buffer_pool
from gradtx.native import add as native_add
from gradtx.native import build
from native_helpers import NEEDS_KERNELS, equal_bits, probe_values

pytestmark = NEEDS_KERNELS


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 2047, 2048, 2049, 4096 + 13, 100_003])
@pytest.mark.parametrize("offset", [0, 1, 3])
def test_the_kernels_sums_are_torch_adds_bits(n, offset):
    p, u = probe_values((n,), 2 * n + 1), probe_values((n,), 2 * n + 2)
    out = torch.empty(n + 8)[offset : offset + n]  # offset 0: 32-byte aligned, streamed
    native_add.usable()(p, u, out)
    assert equal_bits(torch.add(p, u), out)


def test_apply_updates_takes_the_kernel_and_gives_atens_bits(monkeypatch):
    params = {"w": probe_values((300, 170), 1), "b": probe_values((70,), 2), "s": probe_values((), 3)}  # w: pooled (>= 128 KiB)
    updates = {k: probe_values(v.shape, 10 + i) for i, (k, v) in enumerate(params.items())}
    before = native_add.usable().calls
    got = gtx.apply_updates(params, updates)
    assert native_add.usable().calls > before  # at least the large leaf
    monkeypatch.setattr(native_add, "usable", lambda: None)  # the ATen path
    want = gtx.apply_updates(params, updates)
    for k in params:
        assert equal_bits(want[k], got[k]), k


def test_no_kernel_where_a_graph_is_recorded():
    p = torch.randn(300, 70, requires_grad=True)
    u = torch.randn(300, 70)
    before = native_add.usable().calls
    out = gtx.apply_updates({"p": p}, {"p": u})["p"]
    assert native_add.usable().calls == before
    out.sum().backward()
    assert torch.equal(p.grad, torch.ones_like(p))


def test_the_check_refuses_a_kernel_whose_numbers_differ():
    lib, _ = build.load("add")

    class Swapped(native_add._Kernel):  # p - u
        def __call__(self, p, u, out):
            return super().__call__(p, -u, out)

    assert "not torch.add's bits" in native_add._mismatch(Swapped(lib))
    assert native_add._mismatch(native_add._Kernel(lib)) == ""
    assert native_add.status() == "in use"


@pytest.mark.parametrize(
    "make",
    [
        lambda: gtx.adamw(1e-2, weight_decay=0.1),
        lambda: gtx.chain(gtx.clip_by_global_norm(0.5), gtx.adam(1e-2)),
        lambda: gtx.amsgrad(1e-2),
        lambda: gtx.lion(1e-3, weight_decay=0.1),
        lambda: gtx.sgd(1e-2, momentum=0.9, nesterov=True),
    ],
)
def test_steps_into_new_buffers_equal_steps_in_place(make):
    """New buffers (a pure step's outputs) are streamed, the donated step's buffers are not: the
    same bits either way, over steps where the outputs come back from the buffer pools."""
    params = {"w": torch.randn(257, 129), "b": torch.randn(129)}
    grads = [{k: torch.randn_like(v) for k, v in params.items()} for _ in range(3)]
    pure, donated = make(), make()
    pure_state, donated_state = pure.init(params), donated.init(params)
    pure_params, donated_params = dict(params), {k: v.clone() for k, v in params.items()}
    for g in grads:
        updates, pure_state = pure.update({k: v.clone() for k, v in g.items()}, pure_state, pure_params)
        pure_params = gtx.apply_updates(pure_params, updates)
        updates, donated_state = donated.update({k: v.clone() for k, v in g.items()}, donated_state, donated_params, inplace=True)
        donated_params = gtx.apply_updates(donated_params, updates, inplace=True)
    for k in params:
        assert equal_bits(donated_params[k], pure_params[k]), k
    assert buffer_pool.poolable(params["w"])
