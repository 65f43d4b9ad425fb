"""Per-example clipping: published formulas (Abadi et al. 2016; McMahan et al. 2017) as references."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.func import grad, vmap

import gradtx as gtx


def _reference_global(grads: dict, clip: float):
    """Loop over examples: factor_b = min(1, C / ||g_b||) (1 when the norm is 0), summed."""
    batch = next(iter(v for v in grads.values() if v is not None)).shape[0]
    summed = {k: None if v is None else torch.zeros(v.shape[1:], dtype=torch.float64) for k, v in grads.items()}
    clipped = 0
    for b in range(batch):
        norm = math.sqrt(sum(float(v[b].double().square().sum()) for v in grads.values() if v is not None))
        factor = 1.0 if norm == 0.0 else min(1.0, clip / norm)
        clipped += factor < 1.0
        for k, v in grads.items():
            if v is not None:
                summed[k] += factor * v[b].double()
    return summed, clipped


def _mlp_per_example_grads(batch: int = 6, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    params = {
        "w1": torch.randn(5, 4, generator=gen),
        "b1": torch.randn(5, generator=gen),
        "w2": torch.randn(1, 5, generator=gen),
    }
    x = torch.randn(batch, 4, generator=gen) * 3
    y = torch.randn(batch, 1, generator=gen)

    def loss(p, xb, yb):
        h = torch.tanh(p["w1"] @ xb + p["b1"])
        return ((p["w2"] @ h - yb) ** 2).sum()

    return params, x, y, loss


def test_optax_documented_examples():
    grads = [torch.tensor([[0, 0, 0], [0, 3, 4], [4, 0, 3], [3, 4, 0]], dtype=torch.float32)]
    for clip, expected, count in [(math.inf, 7.0, 0), (0.0, 0.0, 3), (1.25, 1.75, 3)]:
        summed, num = gtx.per_example_global_norm_clip(grads, clip)
        torch.testing.assert_close(summed[0], torch.full((3,), expected))
        assert num.item() == count and num.ndim == 0
        summed, nums = gtx.per_example_layer_norm_clip(grads, clip)
        torch.testing.assert_close(summed[0], torch.full((3,), expected))
        assert nums[0].item() == count


def test_global_clip_of_vmapped_grads_matches_loop_reference():
    params, x, y, loss = _mlp_per_example_grads()
    per_example = vmap(grad(loss), in_dims=(None, 0, 0))(params, x, y)
    # the vmapped grads are the same as one grad call per example
    for b in range(x.shape[0]):
        single = grad(loss)(params, x[b], y[b])
        for k in params:
            torch.testing.assert_close(per_example[k][b], single[k])
    norms = torch.stack(
        [torch.linalg.vector_norm(torch.cat([per_example[k][b].flatten() for k in params])) for b in range(x.shape[0])]
    )
    clip = float(norms.median())
    summed, num = gtx.per_example_global_norm_clip(per_example, clip)
    expected, expected_num = _reference_global(per_example, clip)
    assert int(num) == expected_num == int((norms > clip).sum())
    for k in params:
        torch.testing.assert_close(summed[k], expected[k].float(), rtol=1e-5, atol=1e-6)


def test_runs_inside_vmap_over_microbatches():
    params, x, y, loss = _mlp_per_example_grads(batch=8, seed=1)
    per_example = vmap(grad(loss), in_dims=(None, 0, 0))(params, x, y)
    micro = {k: v.reshape(2, 4, *v.shape[1:]) for k, v in per_example.items()}
    summed, num = vmap(gtx.per_example_global_norm_clip, in_dims=(0, None))(micro, 0.5)
    layer_summed, layer_num = vmap(gtx.per_example_layer_norm_clip, in_dims=(0, None))(micro, 0.5)
    for m in range(2):
        one = {k: v[m] for k, v in micro.items()}
        ref_summed, ref_num = gtx.per_example_global_norm_clip(one, 0.5)
        ref_layer, ref_layer_num = gtx.per_example_layer_norm_clip(one, 0.5)
        assert num[m] == ref_num
        for k in params:
            torch.testing.assert_close(summed[k][m], ref_summed[k])
            torch.testing.assert_close(layer_summed[k][m], ref_layer[k])
            assert layer_num[k][m] == ref_layer_num[k]


def test_composes_with_vmap_of_a_clipped_grad():
    """The whole DP step ``vmap(grad)`` then clip can itself be mapped over a group dimension."""
    params, x, y, loss = _mlp_per_example_grads(batch=6, seed=2)

    def dp_sum(xs, ys):
        g = vmap(grad(loss), in_dims=(None, 0, 0))(params, xs, ys)
        return gtx.per_example_global_norm_clip(g, 1.0)[0]

    grouped = vmap(dp_sum)(x.reshape(2, 3, 4), y.reshape(2, 3, 1))
    for m in range(2):
        ref = dp_sum(x[3 * m : 3 * m + 3], y[3 * m : 3 * m + 3])
        for k in params:
            torch.testing.assert_close(grouped[k][m], ref[k])


@pytest.mark.parametrize("uniform", [True, False])
def test_layer_clip_matches_formula(uniform):
    gen = torch.Generator().manual_seed(3)
    grads = {"a": torch.randn(5, 3, 2, generator=gen), "b": torch.randn(5, 10, generator=gen) * 4, "c": None}
    clip = 2.0
    summed, nums = gtx.per_example_layer_norm_clip(grads, clip, uniform=uniform)
    sizes = {"a": 6, "b": 10}
    assert summed["c"] is None and nums["c"] is None
    for k in ("a", "b"):
        leaf_clip = clip / math.sqrt(2) if uniform else clip * math.sqrt(sizes[k] / 16)
        ref, ref_num = _reference_global({k: grads[k]}, leaf_clip)
        torch.testing.assert_close(summed[k], ref[k].float(), rtol=1e-5, atol=1e-6)
        assert int(nums[k]) == ref_num and nums[k].dtype == torch.int64


def test_layer_clip_keeps_each_example_within_global_clip():
    gen = torch.Generator().manual_seed(4)
    grads = {"a": torch.randn(1, 7, generator=gen) * 10, "b": torch.randn(1, 3, generator=gen) * 10}
    for uniform in (True, False):
        summed, _ = gtx.per_example_layer_norm_clip(grads, 1.5, uniform=uniform)
        assert float(gtx.global_norm(summed)) <= 1.5 * (1 + 1e-6)


def test_none_leaves_and_low_precision():
    gen = torch.Generator().manual_seed(5)
    grads = {"w": (torch.randn(4, 3, generator=gen) * 300).to(torch.bfloat16), "skip": None}
    summed, num = gtx.per_example_global_norm_clip(grads, 1.0)
    assert summed["skip"] is None and summed["w"].dtype == torch.bfloat16
    ref, ref_num = _reference_global({"w": grads["w"].double()}, 1.0)
    torch.testing.assert_close(summed["w"].double(), ref["w"], rtol=1e-2, atol=1e-2)
    assert int(num) == ref_num == 4


def test_zero_clip_and_infinite_clip():
    grads = {"w": torch.tensor([[0.0, 0.0], [3.0, 4.0]])}
    summed, num = gtx.per_example_global_norm_clip(grads, 0.0)
    torch.testing.assert_close(summed["w"], torch.zeros(2))
    assert int(num) == 1  # the all-zero example is not counted as clipped
    summed, num = gtx.per_example_global_norm_clip(grads, torch.tensor(math.inf))
    torch.testing.assert_close(summed["w"], torch.tensor([3.0, 4.0]))
    assert int(num) == 0


def test_batch_dimension_errors_name_the_leaf():
    with pytest.raises(ValueError, match="'layer.b'"):
        gtx.per_example_global_norm_clip({"layer": {"a": torch.ones(3, 2), "b": torch.ones(4, 2)}}, 1.0)
    with pytest.raises(ValueError, match="'s'"):
        gtx.per_example_layer_norm_clip({"s": torch.tensor(1.0)}, 1.0)
    with pytest.raises(TypeError, match="'x'"):
        gtx.per_example_global_norm_clip({"x": 3.0}, 1.0)


@settings(max_examples=25, deadline=None)
@given(
    batch=st.integers(1, 6),
    scale=st.floats(0.01, 100.0),
    clip=st.floats(0.01, 10.0),
    seed=st.integers(0, 2**16),
)
def test_property_sum_of_clipped_examples(batch, scale, clip, seed):
    gen = torch.Generator().manual_seed(seed)
    grads = {"a": torch.randn(batch, 3, generator=gen, dtype=torch.float64) * scale, "b": torch.randn(batch, generator=gen, dtype=torch.float64)}
    summed, num = gtx.per_example_global_norm_clip(grads, clip)
    ref, ref_num = _reference_global(grads, clip)
    assert int(num) == ref_num
    for k in grads:
        torch.testing.assert_close(summed[k], ref[k])
    # a clip at least every example's norm is the plain sum
    big = float(max(gtx.global_norm({k: v[b] for k, v in grads.items()}) for b in range(batch))) * 1.01
    summed, num = gtx.per_example_global_norm_clip(grads, big)
    assert int(num) == 0
    for k in grads:
        torch.testing.assert_close(summed[k], grads[k].sum(0))
