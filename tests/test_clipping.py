"""Clipping against torch's own functions and independent formulas; purity, donation, edge cases."""

from __future__ import annotations

import io
import math
import os

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import gradtx as gtx
from gradtx import tree as tree_lib

# Kineto, the profiler's backend, prints "USDT: ... profiler_start/stop" lines for every trace at its
# default log level. These tests only count events: quiet it (read at the first trace; forked ranks
# inherit it). Kineto ranks USDT above its errors, so this hides those too; a failed trace would
# fail the count anyway.
os.environ.setdefault("KINETO_LOG_LEVEL", "6")

NORM_TYPES = [1.0, 2.0, 3.0, math.inf]
HALF = (torch.float16, torch.bfloat16)


def make_grads(dtypes, *, seed=0, scale=3.0):
    """A nested gradient tree of mixed shapes (a 0-d leaf, a (out, 1) column) with a ``None`` leaf."""
    shapes = {"enc.weight": (8, 4), "enc.bias": (4,), "layers.0": (3, 3, 2), "layers.1": (), "head": (5, 1)}
    gen = torch.Generator().manual_seed(seed)
    values = {
        name: (torch.randn(shape, generator=gen, dtype=torch.float64) * scale).to(dtype)
        for (name, shape), dtype in zip(shapes.items(), dtypes)
    }
    return {
        "enc": {"weight": values["enc.weight"], "bias": values["enc.bias"], "frozen": None},
        "layers": [values["layers.0"], values["layers.1"]],
        "head": values["head"],
    }


DTYPE_MIXES = {
    "fp32": [torch.float32] * 5,
    "fp64": [torch.float64] * 5,
    "fp32+fp64": [torch.float32, torch.float64, torch.float32, torch.float64, torch.float32],
    "fp32+bf16+fp16": [torch.float32, torch.bfloat16, torch.float16, torch.float32, torch.bfloat16],
    "fp64+fp16": [torch.float16, torch.float64, torch.float16, torch.float16, torch.float64],
}


def present(tree):
    return [leaf for leaf in tree_lib.leaves(tree) if leaf is not None]


def clone_tree(tree):
    return tree_lib.tree_map(torch.clone, tree)


def torch_clip(grads, clip_fn, *args, **kwargs):
    """Runs a ``torch.nn.utils`` clip function on real parameters whose ``.grad`` holds ``grads``."""
    params = []
    for grad in present(grads):
        param = torch.nn.Parameter(torch.zeros_like(grad))
        param.grad = grad.clone()
        params.append(param)
    params.append(torch.nn.Parameter(torch.zeros(2)))  # a parameter without a gradient, as None
    result = clip_fn(params, *args, **kwargs)
    return [p.grad for p in params[:-1]], result


def fp64_norm(grads, norm_type):
    return torch.linalg.vector_norm(torch.cat([g.double().reshape(-1) for g in present(grads)]), norm_type)


LEAF_RTOL = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float32: 2e-6, torch.float64: 2e-6}


def assert_leaves_equal(actual, expected, *, exact=True, rtol=0.0):
    """Same dtypes and shapes; bit-equal (NaN equal to NaN), or close within the leaf dtype's
    rounding or ``rtol``, whichever is larger."""
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        assert a.dtype == e.dtype and a.shape == e.shape
        if exact:
            assert torch.equal(a, e) or (a.isnan() == e.isnan()).all() and torch.equal(a.nan_to_num(), e.nan_to_num())
        else:
            tol = max(LEAF_RTOL[a.dtype], rtol)
            torch.testing.assert_close(a, e, rtol=tol, atol=tol * 1e-2, equal_nan=True)


def exactly_clipped(grads, max_norm, norm_type):
    """The clipped leaves computed from the float64 norm, each rounded once into its dtype."""
    coef = torch.clamp(max_norm / (fp64_norm(grads, norm_type) + 1e-6), max=1.0)
    return [(g.double() * coef).to(g.dtype) for g in present(grads)]


# --------------------------------------------------------------------------- clip_by_global_norm vs torch


@pytest.mark.parametrize("norm_type", NORM_TYPES)
@pytest.mark.parametrize("max_norm", [0.5, 1e6])
def test_global_norm_clip_is_bit_exact_with_torch_for_float32(norm_type, max_norm):
    grads = make_grads(DTYPE_MIXES["fp32"])
    expected, torch_norm = torch_clip(grads, torch.nn.utils.clip_grad_norm_, max_norm, norm_type=norm_type)
    tx = gtx.clip_by_global_norm(max_norm, norm_type=norm_type)
    updates, state = tx.update(grads, tx.init(grads))
    assert state.norm.dtype == torch.float32 and torch.equal(state.norm, torch_norm)
    assert_leaves_equal(present(updates), expected)
    assert updates["enc"]["frozen"] is None
    assert torch.equal(gtx.global_norm(grads, norm_type=norm_type), torch.nn.utils.get_total_norm(present(grads), norm_type))


@pytest.mark.parametrize("norm_type", NORM_TYPES)
@pytest.mark.parametrize("mix", ["fp64", "fp32+fp64", "fp32+bf16+fp16", "fp64+fp16"])
def test_global_norm_clip_matches_torch_on_mixed_dtypes(norm_type, mix):
    """torch takes each half leaf's norm in its own dtype and a fp32 leaf's in fp32 before stacking;
    gradtx accumulates in float32, or float64 when any leaf is float64: same numbers up to that rounding,
    and closer to the exact (float64) norm."""
    grads = make_grads(DTYPE_MIXES[mix])
    expected, torch_norm = torch_clip(grads, torch.nn.utils.clip_grad_norm_, 1.0, norm_type=norm_type)
    tx = gtx.clip_by_global_norm(1.0, norm_type=norm_type)
    updates, state = tx.update(grads, tx.init(grads))
    has_fp64 = torch.float64 in DTYPE_MIXES[mix]
    assert state.norm.shape == () and state.norm.dtype == (torch.float64 if has_fp64 else torch.float32)
    # float32 and float64 leaves: the same per-leaf norms as torch, stacked in another order
    half_rtol = 1.6e-2 if any(d in HALF for d in DTYPE_MIXES[mix]) else 1e-13
    torch.testing.assert_close(state.norm.double(), torch_norm.double(), rtol=half_rtol, atol=0)
    exact_rtol = 1e-12 if mix == "fp64" else 1e-6
    torch.testing.assert_close(state.norm.double(), fp64_norm(grads, norm_type), rtol=exact_rtol, atol=0)
    assert_leaves_equal(present(updates), expected, exact=mix == "fp64", rtol=half_rtol)
    assert_leaves_equal(present(updates), exactly_clipped(grads, 1.0, norm_type), exact=False)


def test_torch_and_gradtx_agree_bit_for_bit_on_float64():
    grads = make_grads(DTYPE_MIXES["fp64"], scale=50.0)
    expected, torch_norm = torch_clip(grads, torch.nn.utils.clip_grad_norm_, 2.0)
    updates, state = gtx.clip_by_global_norm(2.0).update(grads, None)
    assert torch.equal(state.norm, torch_norm)
    assert_leaves_equal(present(updates), expected)


# --------------------------------------------------------------------------- half precision


def test_fp16_norm_does_not_overflow_and_outputs_keep_fp16():
    grads = {"w": torch.full((4096,), 300.0, dtype=torch.float16)}
    tx = gtx.clip_by_global_norm(1.0)
    updates, state = tx.update(grads, tx.init(grads))
    assert state.norm.dtype == torch.float32 and state.norm.item() == 19200.0  # 300 * sqrt(4096), exactly
    assert updates["w"].dtype == torch.float16
    expected, _ = torch_clip(grads, torch.nn.utils.clip_grad_norm_, 1.0)
    assert torch.equal(updates["w"], expected[0])


def test_fp16_tree_whose_squares_and_norm_overflow_fp16_gets_the_finite_norm():
    # sum of squares 16 * 16384 * 1000**2, every leaf's norm (128000) and the total (512000) are beyond fp16's 65504
    grads = {f"l{i}": torch.full((16384,), 1000.0, dtype=torch.float16) for i in range(16)}
    grads["bias"] = torch.full((3,), -2.0, dtype=torch.bfloat16)
    tx = gtx.clip_by_global_norm(1.0)
    updates, state = tx.update(grads, tx.init(grads))
    # exactly torch's norm of the same gradients held in float32
    assert torch.equal(state.norm, torch.nn.utils.get_total_norm([g.float() for g in grads.values()]))
    torch.testing.assert_close(state.norm.double(), fp64_norm(grads, 2.0), rtol=1e-4, atol=0)
    assert math.isfinite(state.norm.item()) and state.norm.item() > 65504
    assert all(updates[k].dtype == grads[k].dtype for k in grads)
    coef = 1.0 / (fp64_norm(grads, 2.0) + 1e-6)
    for k in grads:
        torch.testing.assert_close(updates[k].double(), grads[k].double() * coef, rtol=1e-2, atol=0)
    torch.testing.assert_close(gtx.global_norm(updates), torch.tensor(1.0), rtol=1e-2, atol=0)
    # torch takes each fp16 leaf's norm in fp16: 128000 overflows to inf, and then it zeroes everything
    _, torch_norm = torch_clip(grads, torch.nn.utils.clip_grad_norm_, 1.0)
    assert math.isinf(torch_norm.item())


# --------------------------------------------------------------------------- edge cases and validation


@pytest.mark.parametrize("norm_type", NORM_TYPES)
def test_max_norm_zero_gives_zeros_never_nan(norm_type):
    for grads in (make_grads(DTYPE_MIXES["fp32+bf16+fp16"]), tree_lib.tree_map(torch.zeros_like, make_grads(DTYPE_MIXES["fp32"]))):
        updates, state = gtx.clip_by_global_norm(0.0, norm_type=norm_type).update(grads, None)
        for leaf, grad in zip(present(updates), present(grads)):
            assert leaf.dtype == grad.dtype and torch.equal(leaf, torch.zeros_like(grad))
        assert torch.isfinite(state.norm)


def test_all_zero_gradient_stays_finite():
    grads = {"w": torch.zeros(3, 2), "h": torch.zeros(4, dtype=torch.float16)}
    updates, state = gtx.clip_by_global_norm(1.0).update(grads, None)
    assert state.norm.item() == 0.0
    assert all(torch.equal(updates[k], grads[k]) for k in grads)


@pytest.mark.parametrize("bad", [-1.0, -1e-12, float("nan"), -math.inf])
def test_negative_or_nan_thresholds_are_value_errors(bad):
    with pytest.raises(ValueError, match="max_norm must be >= 0"):
        gtx.clip_by_global_norm(bad)
    with pytest.raises(ValueError, match="max_delta must be >= 0"):
        gtx.clip_by_value(bad)
    with pytest.raises(ValueError, match="max_delta must be >= 0"):
        gtx.clip(bad)
    with pytest.raises(ValueError, match="threshold must be > 0"):
        gtx.clip_by_block_rms(bad)
    with pytest.raises(ValueError, match="clipping must be >= 0"):
        gtx.adaptive_grad_clip(bad)
    with pytest.raises(ValueError, match="eps must be >= 0"):
        gtx.adaptive_grad_clip(0.1, eps=bad)


@pytest.mark.parametrize("poison", [float("nan"), math.inf, -math.inf])
def test_error_if_nonfinite_raises_runtime_error(poison):
    grads = make_grads(DTYPE_MIXES["fp32"])
    grads["layers"][0][1, 2, 0] = poison
    tx = gtx.clip_by_global_norm(1.0, error_if_nonfinite=True)
    before = clone_tree(grads)
    with pytest.raises(RuntimeError, match="non-finite"):
        tx.update(grads, tx.init(grads))
    with pytest.raises(RuntimeError, match="non-finite"):
        torch_clip(grads, torch.nn.utils.clip_grad_norm_, 1.0, error_if_nonfinite=True)
    assert_leaves_equal(present(grads), present(before))


@pytest.mark.parametrize("poison", [float("nan"), math.inf])
@pytest.mark.parametrize("norm_type", [2.0, math.inf])
def test_nonfinite_norm_otherwise_behaves_as_torch(poison, norm_type):
    grads = make_grads(DTYPE_MIXES["fp32"])
    grads["enc"]["weight"][3, 1] = poison
    expected, torch_norm = torch_clip(grads, torch.nn.utils.clip_grad_norm_, 1.0, norm_type=norm_type)
    updates, state = gtx.clip_by_global_norm(1.0, norm_type=norm_type).update(grads, None)
    torch.testing.assert_close(state.norm, torch_norm, equal_nan=True, rtol=0, atol=0)
    assert_leaves_equal(present(updates), expected)


def test_non_tensor_leaf_is_a_type_error_naming_its_path():
    grads = {"enc": {"weight": torch.ones(2), "bias": 0.5}}
    params = {"enc": {"weight": torch.ones(2), "bias": torch.ones(1)}}
    for tx in (gtx.clip_by_global_norm(1.0), gtx.clip_by_value(1.0), gtx.clip_by_block_rms(1.0), gtx.adaptive_grad_clip(0.1)):
        with pytest.raises(TypeError, match=r"leaf 'enc\.bias' is a float"):
            tx.update(grads, tx.init(params), params)
    with pytest.raises(TypeError, match=r"global_norm: leaf 'enc\.bias' is a float"):
        gtx.global_norm(grads)


# --------------------------------------------------------------------------- state


def test_state_holds_the_pre_clip_norm_as_a_0d_tensor():
    grads = make_grads(DTYPE_MIXES["fp32+bf16+fp16"])
    tx = gtx.clip_by_global_norm(0.1)
    state = tx.init(grads)
    assert isinstance(state, gtx.ClipByGlobalNormState)
    assert state.norm.shape == () and state.norm.dtype == torch.float32 and state.norm.device.type == "cpu"
    assert state.norm.item() == 0.0
    updates, state = tx.update(grads, state)
    assert state.norm.shape == () and state.norm.dtype == torch.float32
    torch.testing.assert_close(state.norm, gtx.global_norm(grads))
    assert gtx.global_norm(updates).item() <= 0.1 * (1 + 1e-2)
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    assert torch.equal(torch.load(buffer, weights_only=False).norm, state.norm)


def test_state_dtype_follows_the_widest_parameter():
    assert gtx.clip_by_global_norm(1.0).init({"a": torch.ones(1, dtype=torch.float16)}).norm.dtype == torch.float32
    assert gtx.clip_by_global_norm(1.0).init(make_grads(DTYPE_MIXES["fp64+fp16"])).norm.dtype == torch.float64


def test_init_and_update_on_empty_trees():
    tx = gtx.clip_by_global_norm(1.0)
    for empty in ({}, {"frozen": None}, []):
        state = tx.init(empty)
        assert state.norm.shape == () and state.norm.dtype == torch.float32 and state.norm.item() == 0.0
        updates, state = tx.update(empty, state)
        assert updates == empty and state.norm.item() == 0.0
    assert gtx.global_norm({}).item() == 0.0


@pytest.mark.parametrize("norm_type", NORM_TYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.complex64])
def test_an_empty_leaf_adds_nothing_to_any_norm(norm_type, dtype):
    """An empty leaf clips as if it were absent, the inf-norm included (torch's kernels raise there:
    a maximum over nothing has no identity, and 0 is the identity over non-negative values)."""
    gen = torch.Generator().manual_seed(0)
    full = {"w": (3 * torch.randn(4, 3, generator=gen)).to(dtype)}
    with_empty = {**full, "e": torch.ones(0, dtype=dtype), "z": torch.ones(2, 0, dtype=dtype)}
    tx = gtx.clip_by_global_norm(1.0, norm_type=norm_type)
    expected, expected_state = tx.update(full, tx.init(full))
    updates, state = tx.update(with_empty, tx.init(with_empty))

    def same(actual, expected):  # a total over norms that include a 0 may round its last bit apart for p = 3
        if norm_type in (1.0, 2.0, math.inf):
            assert torch.equal(actual, expected)
        else:
            torch.testing.assert_close(actual, expected, rtol=1e-6, atol=0.0)

    same(state.norm, expected_state.norm)
    same(updates["w"], expected["w"])
    assert updates["e"].shape == (0,) and updates["z"].shape == (2, 0)
    same(gtx.global_norm(with_empty, norm_type=norm_type), gtx.global_norm(full, norm_type=norm_type))


# --------------------------------------------------------------------------- clip_by_value


@pytest.mark.parametrize("mix", list(DTYPE_MIXES))
@pytest.mark.parametrize("max_delta", [0.0, 0.5, 100.0])
def test_clip_by_value_is_bit_exact_with_clip_grad_value(mix, max_delta):
    grads = make_grads(DTYPE_MIXES[mix])
    grads["enc"]["weight"][0, 0] = float("nan")
    grads["enc"]["weight"][0, 1] = -math.inf
    expected, _ = torch_clip(grads, torch.nn.utils.clip_grad_value_, max_delta)
    tx = gtx.clip_by_value(max_delta)
    updates, state = tx.update(grads, tx.init(grads))
    assert state == gtx.EmptyState() and updates["enc"]["frozen"] is None
    assert_leaves_equal(present(updates), expected)
    assert gtx.clip is gtx.clip_by_value


# --------------------------------------------------------------------------- clip_by_block_rms


def block_rms_reference(grad, threshold):
    """optax.clip_by_block_rms: ``g / max(1, rms(g) / threshold)``, written with float64 ops."""
    g = grad.double()
    rms = g.pow(2).mean().sqrt() if g.numel() else torch.zeros((), dtype=torch.float64)
    return (g / torch.clamp(rms / threshold, min=1.0)).to(grad.dtype)


@pytest.mark.parametrize("mix", ["fp32", "fp32+fp64", "fp32+bf16+fp16"])
@pytest.mark.parametrize("threshold", [0.1, 1.0, 3.0])
def test_clip_by_block_rms_matches_the_formula(mix, threshold):
    grads = make_grads(DTYPE_MIXES[mix])
    grads["layers"][0] = torch.zeros_like(grads["layers"][0])
    tx = gtx.clip_by_block_rms(threshold)
    updates, _ = tx.update(grads, tx.init(grads))
    assert updates["enc"]["frozen"] is None
    for out, grad in zip(present(updates), present(grads)):
        expected = block_rms_reference(grad, threshold)
        assert out.dtype == grad.dtype
        tol = {torch.float16: 1e-3, torch.bfloat16: 8e-3}.get(grad.dtype, 1e-6)
        torch.testing.assert_close(out, expected, rtol=tol, atol=0)
        rms = out.double().pow(2).mean().sqrt()
        assert rms <= threshold * (1 + tol)
        if grad.double().pow(2).mean().sqrt() <= threshold:
            assert torch.equal(out, grad)  # leaves under the threshold pass through unchanged


def test_clip_by_block_rms_empty_leaf():
    updates, _ = gtx.clip_by_block_rms(1.0).update({"e": torch.zeros(0, 3), "w": torch.full((2,), 4.0)}, None)
    assert updates["e"].shape == (0, 3)
    torch.testing.assert_close(updates["w"], torch.ones(2))


# --------------------------------------------------------------------------- adaptive_grad_clip


def agc_reference(grad, param, clipping, eps):
    """AGC (Brock et al., 2021) per tensor with plain float64 ops, units along dim 0 (torch's layout):
    vectors, scalars and anything that squeezes to a vector are one unit."""
    g, p = grad.double(), param.double()
    if g.squeeze().ndim <= 1:
        g_norm, p_norm = g.pow(2).sum().sqrt(), p.pow(2).sum().sqrt()
    else:
        dims = tuple(range(1, g.ndim))
        g_norm, p_norm = g.pow(2).sum(dims, keepdim=True).sqrt(), p.pow(2).sum(dims, keepdim=True).sqrt()
    max_norm = clipping * torch.clamp(p_norm, min=eps)
    clipped = g * (max_norm / torch.clamp(g_norm, min=1e-6))
    return torch.where(g_norm < max_norm, g, clipped).to(grad.dtype)


def agc_tree(dtype=torch.float32):
    gen = torch.Generator().manual_seed(1)
    linear, conv = torch.nn.Linear(6, 4), torch.nn.Conv2d(3, 5, kernel_size=3)
    params = {
        "linear": {"weight": linear.weight.detach(), "bias": linear.bias.detach()},
        "conv": {"weight": conv.weight.detach(), "bias": conv.bias.detach()},
        "scale": torch.tensor(0.7),
        "zero": torch.zeros(3, 2),  # a zero parameter: the cap is clipping * eps
        "column": torch.randn(4, 1, generator=gen),  # squeezes to a vector: one unit
        "frozen": torch.ones(2),
    }
    grads = tree_lib.tree_map(lambda p: torch.randn(p.shape, generator=gen) * 0.05, params)
    grads["linear"]["weight"][1] *= 400.0  # some units far above their cap, others under it
    grads["conv"]["weight"][2] *= 400.0
    grads["frozen"] = None
    to = lambda t: t.to(dtype)  # noqa: E731
    return tree_lib.tree_map(to, grads), tree_lib.tree_map(to, params)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("clipping", [0.01, 0.1, 10.0])
def test_adaptive_grad_clip_matches_the_formula(dtype, clipping):
    grads, params = agc_tree(dtype)
    tx = gtx.adaptive_grad_clip(clipping, eps=1e-3)
    updates, _ = tx.update(grads, tx.init(params), params)
    assert updates["frozen"] is None
    tol = 8e-3 if dtype == torch.bfloat16 else 1e-6
    clipped_units = 0
    for out, grad, param in zip(present(updates), present(grads), [p for p, g in zip(tree_lib.leaves(params), tree_lib.leaves(grads)) if g is not None]):
        expected = agc_reference(grad, param, clipping, 1e-3)
        assert out.dtype == grad.dtype and out.shape == grad.shape
        torch.testing.assert_close(out, expected, rtol=tol, atol=tol * 1e-3)
        clipped_units += int((expected != grad).any())
    assert clipped_units >= 2 or clipping == 10.0


def test_adaptive_grad_clip_units_are_rows_of_linear_and_output_channels_of_conv():
    grads, params = agc_tree()
    updates, _ = gtx.adaptive_grad_clip(0.01).update(grads, None, params)
    w, g = updates["linear"]["weight"], grads["linear"]["weight"]
    caps = 0.01 * params["linear"]["weight"].norm(dim=1)
    torch.testing.assert_close(w[1].norm(), caps[1], rtol=1e-5, atol=0)  # the big row is capped
    assert torch.all(w.norm(dim=1) <= caps * (1 + 1e-5))
    conv_norms = updates["conv"]["weight"].flatten(1).norm(dim=1)
    assert torch.all(conv_norms <= 0.01 * params["conv"]["weight"].flatten(1).norm(dim=1) * (1 + 1e-5))
    torch.testing.assert_close(updates["zero"].norm(dim=1), torch.full((3,), 0.01 * 1e-3), rtol=1e-5, atol=0)
    assert not torch.equal(w, g)


def test_unitwise_norm_shapes():
    assert gtx.unitwise_norm(torch.ones(3, 4)).shape == (3, 1)
    assert gtx.unitwise_norm(torch.ones(5, 3, 2, 2)).shape == (5, 1, 1, 1)
    assert gtx.unitwise_norm(torch.ones(4)).shape == ()
    assert gtx.unitwise_norm(torch.ones(4, 1)).shape == ()
    assert gtx.unitwise_norm(torch.ones((), dtype=torch.float16)).dtype == torch.float32
    torch.testing.assert_close(gtx.unitwise_norm(torch.full((2, 4), 3.0)), torch.full((2, 1), 6.0))


def test_adaptive_grad_clip_needs_fitting_params():
    grads, params = agc_tree()
    tx = gtx.adaptive_grad_clip(0.1)
    with pytest.raises(ValueError, match="params are required"):
        tx.update(grads, tx.init(params))
    del params["conv"]["bias"]
    with pytest.raises(ValueError, match=r"adaptive_grad_clip: params do not match updates: updates has leaf 'conv\.bias' that params lacks"):
        tx.update(grads, None, params)
    grads, params = agc_tree()
    params["scale"] = torch.ones(2)
    with pytest.raises(ValueError, match=r"'scale' has gradient shape \(\) but parameter shape \(2,\)"):
        tx.update(grads, None, params)
    params["scale"] = None
    with pytest.raises(TypeError, match=r"params leaf 'scale' is not a tensor"):
        tx.update(grads, None, params)


# --------------------------------------------------------------------------- purity and donation


def transforms_under_test():
    return {
        "global_norm": gtx.clip_by_global_norm(0.5),
        "global_norm_inf": gtx.clip_by_global_norm(0.5, norm_type=math.inf),
        "value": gtx.clip_by_value(0.3),
        "block_rms": gtx.clip_by_block_rms(0.2),
        "agc": gtx.adaptive_grad_clip(0.01),
        "chain": gtx.chain(gtx.clip_by_value(2.0), gtx.clip_by_global_norm(1.0), gtx.clip_by_block_rms(0.5)),
    }


@pytest.mark.parametrize("name", list(transforms_under_test()))
@pytest.mark.parametrize("mix", ["fp32", "fp32+fp64", "fp32+bf16+fp16", "fp64+fp16"])
def test_update_mutates_nothing_and_donation_gives_identical_results(name, mix):
    tx = transforms_under_test()[name]
    grads = make_grads(DTYPE_MIXES[mix])
    params = make_grads(DTYPE_MIXES[mix], seed=1, scale=1.0)
    params["enc"]["frozen"] = torch.ones(2)
    state = tx.init(params)
    before = clone_tree((grads, state, params))
    pure, pure_state = tx.update(grads, state, params)
    for x, y in zip(tree_lib.leaves((grads, state, params)), tree_lib.leaves(before)):
        assert (x is None and y is None) or (x.dtype == y.dtype and torch.equal(x, y))

    donated, donated_state = clone_tree(grads), clone_tree(state)
    donated_leaves = present(donated)
    pointers = [t.data_ptr() for t in donated_leaves]
    params_copy = clone_tree(params)
    inplace, inplace_state = tx.update(donated, donated_state, params, inplace=True)
    assert_leaves_equal(present(inplace), present(pure))
    assert_leaves_equal(present(inplace_state), present(pure_state))
    assert all(a is b for a, b in zip(present(inplace), donated_leaves))
    assert [t.data_ptr() for t in present(inplace)] == pointers
    assert_leaves_equal(present(params), present(params_copy))  # params are never donated


def large_self_allocations(fn, threshold):
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return [(e.name, e.self_cpu_memory_usage) for e in prof.events() if e.self_cpu_memory_usage >= threshold]


SMALL_SHAPES = [(64, 64), (4096,), (16, 8, 4, 4)]
# half-precision leaves larger than the chunks a CPU norm upcasts to float32 one at a time
HALF_SHAPES = [(512, 1024), (1 << 18,), (64, 32, 8, 16)]


@pytest.mark.parametrize("name", list(transforms_under_test()))
@pytest.mark.parametrize(
    "dtypes, shapes",
    [
        ([torch.float32] * 3, SMALL_SHAPES),
        ([torch.float32, torch.float64, torch.float32], SMALL_SHAPES),
        ([torch.bfloat16, torch.float16, torch.bfloat16], HALF_SHAPES),
    ],
    ids=["fp32", "fp32+fp64", "bf16+fp16"],
)
def test_donated_update_allocates_no_gradient_sized_tensor(name, dtypes, shapes):
    """Measured with the profiler: no single allocation as large as the smallest gradient leaf."""
    if name == "agc" and dtypes[0] == torch.bfloat16:
        pytest.skip("AGC's unit norms of a half tensor are upcast whole by torch's CPU kernel")
    tx = transforms_under_test()[name]
    gen = torch.Generator().manual_seed(0)
    grads = {f"g{i}": torch.randn(s, generator=gen).to(d) for i, (s, d) in enumerate(zip(shapes, dtypes))}
    grads["none"] = None
    params = {k: (torch.randn(v.shape, generator=gen, dtype=v.dtype) if v is not None else None) for k, v in grads.items()}
    smallest = min(t.numel() * t.element_size() for t in present(grads))
    state = tx.init(params)
    tx.update(clone_tree(grads), clone_tree(state), params, inplace=True)  # warm up lazy initialisation
    donated, donated_state = clone_tree(grads), clone_tree(state)
    assert large_self_allocations(lambda: tx.update(donated, donated_state, params, inplace=True), smallest) == []
    # the measurement does see the pure path's new gradients
    assert large_self_allocations(lambda: tx.update(grads, state, params), smallest)


def test_a_tensor_max_norm_gives_the_numbers_of_the_float():
    # inject_hyperparams passes max_norm as a 0-d tensor each step; kept a tensor, nothing reads it on
    # the host (no graph break under torch.compile), and the numbers are those of the float
    gen = torch.Generator().manual_seed(3)
    grads = {"w": torch.randn(4, 3, generator=gen) * 5, "b": torch.randn(3, generator=gen)}
    want, want_state = gtx.clip_by_global_norm(0.7).update(grads, None)
    for dtype in (torch.float32, torch.float64):
        max_norm = torch.tensor(0.7, dtype=torch.float32).to(dtype)
        got, state = gtx.clip_by_global_norm(max_norm).update(grads, None)
        assert torch.equal(state.norm, want_state.norm)
        assert all(torch.equal(got[k], want[k]) for k in grads), dtype
    with pytest.raises(ValueError, match="max_norm must be >= 0"):
        gtx.clip_by_global_norm(torch.tensor(-1.0))
