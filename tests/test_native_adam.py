"""The C kernel of the eager Adam step (gradtx/native): the ATen ops' numbers, bit for bit.

Checked: for random trees, hyperparameters (both branches of ``lerp``, each kind of weight decay,
schedules), extreme values and each donation mode, the kernel's updates and moments equal the
ATen ops' bit for bit, where the kernel is really used; at 1 and 2 threads; where it must not be
used (recorded graphs, other dtypes, strided leaves, shared memory, tensor ``b1``) it is not;
its own check fails on a kernel whose numbers differ; without a compiler, or with
``GRADTX_NATIVE=0``, gradtx says why and keeps to the ATen ops; the library is built once per cache.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys

import numpy
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import gradtx as gtx
from gradtx.native import adam as native_adam
from gradtx.native import build, checks
from gradtx.transforms.adam import fused_adam
from native_helpers import NEEDS_KERNELS, applied, donated_run, equal_bits, in_threads, lerp_at_one_safe

pytestmark = NEEDS_KERNELS


def _kernel_calls() -> int:
    return native_adam.usable().calls


def _values(n: int, seed: int) -> torch.Tensor:
    return checks.probe(n, seed) if n else torch.empty(0)


def _run(tx, params, grads_per_step, inplace):
    out, state = donated_run(tx, params, grads_per_step, inplace)
    return out, state[0].mu, state[0].nu


_SIZES = st.sampled_from([(), (0,), (1,), (7,), (2047,), (2049,), (3, 5, 11), (70_001,)])


@settings(max_examples=25, deadline=None)
@given(
    sizes=st.lists(_SIZES, min_size=1, max_size=3),
    b1=st.sampled_from([0.0, 0.1, 0.5, 0.9, 0.99]),
    b2=st.sampled_from([0.0, 0.5, 0.95, 0.999]),
    eps=st.sampled_from([1e-8, 1e-3]),
    lr=st.sampled_from([1e-3, 0.3, "schedule"]),
    wd=st.sampled_from([None, 0.0, 0.1, "schedule"]),
    masked=st.booleans(),
    inplace=st.sampled_from([False, True, "updates"]),
    seed=st.integers(0, 2**16),
)
def test_the_kernels_steps_equal_the_aten_ops_bit_for_bit(sizes, b1, b2, eps, lr, wd, masked, inplace, seed):
    params = {f"p{i}": _values(int(torch.Size(s).numel()), seed + i).reshape(s) for i, s in enumerate(sizes)}
    grads = [{k: _values(p.numel(), seed + 100 * t + i).reshape(p.shape) for i, (k, p) in enumerate(params.items())} for t in range(3)]
    if b1 == 0.0:
        grads = [lerp_at_one_safe(g) for g in grads]
    learning_rate = (lambda count: 0.1 / (1.0 + count)) if lr == "schedule" else lr
    weight_decay = (lambda count: 0.01 * count) if wd == "schedule" else wd
    mask = {k: i % 2 == 0 for i, k in enumerate(params)} if masked and wd is not None else None
    make = lambda: fused_adam(learning_rate, b1, b2, eps, weight_decay=weight_decay, mask=mask)  # noqa: E731
    with checks.aten_only():
        want = _run(make(), params, grads, inplace)
    before = _kernel_calls()
    got = _run(make(), params, grads, inplace)
    assert _kernel_calls() > before or not any(p.numel() for p in params.values())
    for want_tree, got_tree in zip(want, got):
        for key in want_tree:
            assert equal_bits(want_tree[key], got_tree[key]), key


def test_the_adamw_alias_chained_with_a_clip_and_applied_takes_the_kernel():
    params = {"w": _values(50_000, 1).reshape(100, 500), "b": _values(500, 2)}
    grads = {"w": _values(50_000, 3).reshape(100, 500), "b": _values(500, 4)}
    tx = gtx.chain(gtx.clip_by_global_norm(1.0), gtx.adamw(1e-3, weight_decay=0.1))

    with checks.aten_only():
        want = applied(tx, params, grads)
    before = _kernel_calls()
    got = applied(tx, params, grads)
    assert _kernel_calls() == before + 6  # a call per leaf and step
    assert all(equal_bits(want[k], got[k]) for k in want)


def test_the_same_numbers_at_one_and_two_threads():
    params = {"w": _values(300_000, 5)}
    grads = {"w": _values(300_000, 6)}
    tx = gtx.adamw(1e-3, weight_decay=0.1)
    results = []
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            results.append(_run(tx, params, [grads, grads], False))
    finally:
        torch.set_num_threads(threads)
    for one, two in zip(*results):
        assert equal_bits(one["w"], two["w"])


@pytest.mark.parametrize(
    "case",
    [
        "a recorded graph", "bfloat16 leaves", "a transposed leaf", "a size-1 dimension's own stride",
        "a gradient that is the param",
        "one gradient twice", "tensor b1", "nesterov",
    ],
)
def test_the_kernel_is_not_used_where_it_could_change_a_number(case):
    w = _values(64, 7).reshape(8, 8)
    g = _values(64, 8).reshape(8, 8)
    tx = gtx.adamw(1e-3, weight_decay=0.1)
    if case == "a recorded graph":
        w = w.requires_grad_()
    elif case == "bfloat16 leaves":
        w, g = w.bfloat16(), g.bfloat16()
    elif case == "a transposed leaf":
        w, g = w.t(), g.t()
    elif case == "a size-1 dimension's own stride":  # contiguous, but new tensors get other strides
        w, g = w[:, :1], g[:, :1]
    elif case == "a gradient that is the param":
        g = w
    elif case == "tensor b1":
        tx = gtx.adamw(1e-3, b1=torch.tensor(0.9), weight_decay=0.1)
    elif case == "nesterov":
        tx = gtx.adamw(1e-3, weight_decay=0.1, nesterov=True)
    params, grads = {"w": w}, {"w": g}
    if case == "one gradient twice":  # updates donated: the first position's would be the second's gradient
        params, grads = {"w": w, "x": w.clone()}, {"w": g, "x": g}
    before = _kernel_calls()
    tx.update(grads, tx.init(params), params, inplace="updates")
    assert _kernel_calls() == before


def test_the_kernels_checks_see_a_zeros_sign_and_take_nan_for_nan():
    """``==`` takes -0.0 for +0.0; a kernel whose zero has the other sign differs in a bit."""
    assert checks.first_difference([{"x": torch.tensor([0.0, 1.0])}], [{"x": torch.tensor([-0.0, 1.0])}]) == "1 of 2 values of 'x'"
    assert checks.first_difference([{"x": torch.tensor([-0.0, float("nan")])}], [{"x": torch.tensor([-0.0, float("nan")])}]) == ""


def test_the_check_refuses_a_kernel_whose_numbers_differ():
    lib, _ = build.load("adam")

    class OffByOne(native_adam._Kernel):  # b2 one float32 step off
        def __call__(self, *args):
            args = list(args)
            args[8] = float(torch.nextafter(torch.tensor(args[8]), torch.tensor(0.0)))
            super().__call__(*args)

    assert "values of" in native_adam._mismatch(OffByOne(lib, native_adam.usable().vector_sqrt))
    values = checks.probe(100_000, 0).abs()
    if not torch.equal(torch.sqrt(values), torch.from_numpy(numpy.sqrt(values.numpy()))):
        # torch's sqrt is not the correctly rounded one (MKL's here): the kernel with sqrtf is refused
        assert "values of" in native_adam._mismatch(native_adam._Kernel(lib, None))


def test_torch_exports_the_vector_sqrt_its_sqrt_kernel_calls():
    """A private symbol of torch's CPU library (MKL's): where it is gone, the kernel falls back to
    sqrtf, and its check keeps it only if torch's sqrt is that."""
    if not torch.backends.mkl.is_available():
        pytest.skip("torch without MKL")
    assert native_adam._torch_vector_sqrt() is not None


def test_without_a_compiler_gradtx_says_why_and_keeps_to_the_aten_ops(monkeypatch, tmp_path):
    monkeypatch.setenv("GRADTX_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(build, "compiler", lambda: None)
    lib, why = build._build_and_load("adam")
    assert lib is None and "no C compiler" in why
    monkeypatch.setattr(build, "load", lambda name: (None, why))
    kernel, reason = native_adam._build_and_check()
    assert kernel is None and "no C compiler" in reason


def test_a_failing_compiler_is_reported():
    script = (
        "import os; os.environ['CC'] = '/bin/false'; os.environ['PATH'] = '/nonexistent';"
        "from gradtx.native import build; print(build._build_and_load('adam')[1])"
    )
    env = dict(os.environ, GRADTX_CACHE_DIR="/nonexistent-dir-of-gradtx/cache")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, check=True).stdout
    assert "cannot write" in out or "failed" in out


def test_a_first_step_under_vmap_takes_the_aten_ops_and_checks_the_kernels_later():
    """In a fresh process (no kernel checked yet), each optimizer's first step under ``vmap``: the
    check is not run there (its random probes would fail under ``vmap``), and runs at the next use."""
    script = """
import torch, gradtx as gtx
from gradtx.native import adam, amsgrad, lion, momentum
for tx in (gtx.adamw(1e-2), gtx.amsgrad(1e-2), gtx.lion(1e-3), gtx.sgd(0.1, momentum=0.9)):
    batched = {"w": torch.randn(4, 3, 5)}
    states = torch.func.vmap(tx.init)(batched)
    torch.func.vmap(lambda u, s, p: tx.update(u, s, p))(batched, states, batched)
print([kernel.status() for kernel in (adam, amsgrad, lion, momentum)])
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    assert out.strip() == str(["in use"] * 4)


def test_gradtx_native_0_turns_the_kernels_off(monkeypatch):
    monkeypatch.setenv("GRADTX_NATIVE", "0")
    assert build._build_and_load("adam") == (None, "GRADTX_NATIVE=0")


def test_the_library_is_built_once_per_cache_folder(monkeypatch, tmp_path):
    monkeypatch.setenv("GRADTX_CACHE_DIR", str(tmp_path))
    lib, why = build._build_and_load("adam")
    assert lib is not None, why
    built = sorted(tmp_path.iterdir())
    assert len(built) == 1 and built[0].suffix == ".so"
    monkeypatch.setattr(build, "_compile", lambda *args: pytest.fail("compiled again"))
    again, _ = build._build_and_load("adam")
    assert isinstance(again, ctypes.CDLL) and sorted(tmp_path.iterdir()) == built


def test_threads_stepping_at_once_get_the_numbers_of_steps_one_after_another():
    """The kernel keeps nothing between calls (its scratch is on the stack): several Python threads
    may step at once, as the eager ATen ops may."""
    trees = [({"w": _values(100_000, 20 + i)}, {"w": _values(100_000, 40 + i)}) for i in range(4)]
    tx = gtx.adamw(1e-3, weight_decay=0.1)
    alone = [_run(tx, params, [grads, grads], False) for params, grads in trees]
    before = _kernel_calls()
    together = in_threads(lambda i: _run(tx, trees[i][0], [trees[i][1], trees[i][1]], False), len(trees))
    assert _kernel_calls() >= before + 2 * len(trees)
    for one, other in zip(alone, together):
        for want, got in zip(one, other):
            assert equal_bits(want["w"], got["w"])


def test_another_cpu_gets_a_library_of_its_own(monkeypatch, tmp_path):
    """``-march=native`` code may not run on another CPU: a cache shared with one builds anew."""
    monkeypatch.setenv("GRADTX_CACHE_DIR", str(tmp_path))
    assert build._build_and_load("adam")[0] is not None
    monkeypatch.setattr(build, "_cpu", lambda: b"flags : another cpu")
    assert build._build_and_load("adam")[0] is not None
    assert len(list(tmp_path.glob("adam-*.so"))) == 2


def test_torchs_lerp_at_weight_one_signs_a_zero_by_position():
    # why the bitwise tests give b1 = 0 no -0.0 gradient: ATen's vectorized lerp is
    # fma(w - 1, end - start, end), +0.0 here, and its scalar tail end - (end - start) * (1 - w),
    # -0.0; the kernel is the vectorized one everywhere. When torch agrees with itself, this fails
    # and the exclusion (native_helpers.lerp_at_one_safe) can go.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = torch.lerp(torch.full((37,), -1.0), torch.full((37,), -0.0), 1.0)
    finally:
        torch.set_num_threads(threads)
    signs = torch.signbit(out)
    assert not bool(signs[0]) and bool(signs[-1])
