"""microbatch: a function over microbatches of its batch, outputs combined as optax.microbatching does."""

from __future__ import annotations

import pytest
import torch

import gradtx as gtx
from gradtx.microbatching import AccumulationType, Accumulator, microbatch, reshape_batch_axis

F64 = torch.float64
SUM, MEAN, RUNNING_MEAN, CONCAT = AccumulationType.SUM, AccumulationType.MEAN, AccumulationType.RUNNING_MEAN, AccumulationType.CONCAT


def data(*shape, seed=0):
    return torch.randn(*shape, dtype=F64, generator=torch.Generator().manual_seed(seed))


def test_exports():
    assert gtx.microbatch is microbatch and gtx.microbatching.AccumulationType is AccumulationType


def test_reshape_batch_axis_is_column_major():
    x = torch.arange(8)
    assert reshape_batch_axis(x, 2).tolist() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    y = torch.arange(12).reshape(2, 6)  # batch on axis 1: 3 microbatches of 2
    out = reshape_batch_axis({"y": y}, 2, axis=1)["y"]
    assert out.shape == (2, 3, 2)
    assert out[0, 1].tolist() == [1, 4] and out[1, 2].tolist() == [8, 11]
    with pytest.raises(ValueError, match="batch size 8 .* not divisible by microbatch_size=3"):
        reshape_batch_axis(x, 3)


def test_each_microbatch_gets_optax_rows():
    seen = []
    record = lambda x: seen.append(x.tolist()) or x.sum()  # noqa: E731
    microbatch(record, 0, 2)(torch.arange(6))
    assert seen == [[0, 3], [1, 4], [2, 5]]  # microbatch i holds rows i, i + n, ...


def test_sum_mean_running_mean_concat_equal_the_full_batch():
    w = data(3, seed=1)
    x = data(12, 3, seed=2)

    def fun(w, x):
        preds = x @ w
        return {"preds": preds, "total": preds.square().sum(), "avg": preds.mean()}

    full = fun(w, x)
    out = microbatch(fun, 1, 4, {"preds": CONCAT, "total": SUM, "avg": MEAN})(w, x)
    torch.testing.assert_close(out["preds"], full["preds"], rtol=1e-15, atol=0)
    torch.testing.assert_close(out["total"], full["total"], rtol=1e-14, atol=0)
    torch.testing.assert_close(out["avg"], full["avg"], rtol=1e-14, atol=1e-15)
    running = microbatch(lambda x: x.mean(0), 0, 3, RUNNING_MEAN)(x)
    torch.testing.assert_close(running, x.mean(0), rtol=1e-14, atol=1e-15)


def test_a_single_accumulation_type_applies_to_every_leaf_and_gradients_flow():
    w = data(3, seed=3).requires_grad_()
    x, y = data(8, 3, seed=4), data(8, seed=5)
    loss = lambda w, x, y: ((x @ w - y) ** 2).sum()  # noqa: E731
    total = microbatch(loss, (1, 2), 2)(w, x, y)
    (grad,) = torch.autograd.grad(total, w)
    (reference,) = torch.autograd.grad(loss(w, x, y), w)
    torch.testing.assert_close(grad, reference, rtol=1e-13, atol=1e-13)
    pair = microbatch(lambda x: (x.sum(), x.abs().sum()), 0, 4, SUM)(x)
    torch.testing.assert_close(pair[0], x.sum())
    torch.testing.assert_close(pair[1], x.abs().sum())


def test_keyword_batch_arguments_and_in_axes():
    x = data(3, 10, seed=6)  # batch on axis 1
    y = data(10, seed=7)
    fun = lambda x, *, y: (x * y).sum(0)  # noqa: E731  -> one value per example
    out = microbatch(fun, 0, 5, CONCAT, argnames="y", in_axes=(1, 0))(x, y=y)
    torch.testing.assert_close(out, fun(x, y=y), rtol=1e-15, atol=0)


def test_custom_accumulator_and_prefix_trees():
    x = data(9, seed=8)
    maximum = Accumulator(
        init=lambda v: torch.full_like(v, -float("inf")),
        update=lambda carry, value, index: torch.maximum(carry, value),
        finalize=lambda carry: carry,
        aggregate=lambda values: values.amax(0),
    )
    out = microbatch(lambda x: (x.max(), (x.sum(), x)), 0, 3, (maximum, SUM))(x)
    assert float(out[0]) == float(x.max())
    torch.testing.assert_close(out[1][0], x.sum(), rtol=1e-14, atol=1e-15)
    # a SUM over a subtree sums the per-microbatch rows: row k of the result is the sum over rows
    # k, k + 3, k + 6 of the columns each microbatch saw
    torch.testing.assert_close(out[1][1], reshape_batch_axis(x, 3).sum(0))


def test_num_real_microbatches():
    x = torch.arange(8, dtype=F64)
    assert float(microbatch(lambda x: x.sum(), 0, 2, SUM, num_real_microbatches=2)(x)) == float(0 + 4 + 1 + 5)
    assert float(microbatch(lambda x: x.sum(), 0, 2, MEAN, num_real_microbatches=2)(x)) == float(10 / 4)
    assert float(microbatch(lambda x: x.sum(), 0, 2, RUNNING_MEAN, num_real_microbatches=2)(x)) == 5.0
    concat = microbatch(lambda x: x, 0, 2, CONCAT, num_real_microbatches=1)(x)
    assert concat.tolist() == [0, 0, 0, 0, 4, 0, 0, 0]  # rows of microbatches not run stay zero
    assert float(microbatch(lambda x: x.sum(), 0, 2, SUM, num_real_microbatches=0)(x)) == 0.0


def test_none_microbatch_size_returns_the_function():
    fun = lambda x: x  # noqa: E731
    assert microbatch(fun, 0, None) is fun


def test_errors_say_what_is_wrong():
    x, y = torch.ones(6), torch.ones(4)
    with pytest.raises(ValueError, match="equal batch sizes, found argument 0: 6, argument 1: 4"):
        microbatch(lambda x, y: x.sum(), (0, 1), 2)(x, y)
    with pytest.raises(ValueError, match="batch size 6 is not divisible by microbatch_size=4"):
        microbatch(lambda x: x.sum(), 0, 4)(x)
    with pytest.raises(ValueError, match="MEAN accumulation requires floating-point outputs, got torch.int64"):
        microbatch(lambda x: x.sum(), 0, 2, MEAN)(torch.arange(6))
    with pytest.raises(ValueError, match="unknown accumulator 'sum'"):
        microbatch(lambda x: x.sum(), 0, 2, "sum")(x)
    with pytest.raises(ValueError, match="in_axes has 1 entries for 2 batch arguments"):
        microbatch(lambda x, y: x, (0, 1), 2, in_axes=(0,))
    with pytest.raises(ValueError, match="microbatch_size must be a positive integer"):
        microbatch(lambda x: x, 0, 0)
    with pytest.raises(ValueError, match="keyword argument 'y', which was not given"):
        microbatch(lambda x, y=None: x.sum(), 0, 2, argnames="y")(x)
    with pytest.raises(ValueError, match=r"num_real_microbatches=5 is outside \[0, 3\]"):
        microbatch(lambda x: x.sum(), 0, 2, num_real_microbatches=5)(x)
    with pytest.raises(ValueError, match="prefix of fun's output"):
        microbatch(lambda x: x.sum(), 0, 2, (SUM, SUM))(x)
    with pytest.raises(ValueError, match="CONCAT accumulation requires outputs with a leading"):
        microbatch(lambda x: x.sum(), 0, 2, CONCAT)(x)


# --------------------------------------------------------------------------- micro_vmap


def test_micro_vmap_equals_vmap_and_reduces():
    from gradtx.microbatching import micro_vmap

    w, x, s = data(3, seed=9), data(12, 3, seed=10), data(12, seed=11)
    fun = lambda w, x, *, s: (x @ w) * s  # noqa: E731  -> one value per example
    expected = (x @ w) * s
    for size in (None, 1, 3, 12):
        out = micro_vmap(fun, in_axes=(None, 0), microbatch_size=size)(w, x, s=s)
        torch.testing.assert_close(out, expected, rtol=1e-15, atol=0)
    total = micro_vmap(fun, in_axes=(None, 0), microbatch_size=4, accumulator=SUM)(w, x, s=s)
    torch.testing.assert_close(total, expected.sum(), rtol=1e-14, atol=1e-15)
    mean = micro_vmap(fun, in_axes=(None, 0), microbatch_size=4, accumulator=MEAN)(w, x, s=s)
    torch.testing.assert_close(mean, expected.mean(), rtol=1e-14, atol=1e-15)
    squares = micro_vmap(lambda v: v.square(), microbatch_size=4)(torch.arange(8.0))
    assert squares.tolist() == [float(i * i) for i in range(8)]


def test_micro_vmap_errors():
    from gradtx.microbatching import micro_vmap

    with pytest.raises(NotImplementedError, match="out_axes"):
        micro_vmap(lambda x: x, out_axes=1)
    with pytest.raises(ValueError, match="in_axes has 1 entries for 2 positional arguments"):
        micro_vmap(lambda x, y: x, in_axes=(0,))(torch.ones(2), torch.ones(2))
    with pytest.raises(ValueError, match="no argument is batched"):
        micro_vmap(lambda x: x, in_axes=None)(torch.ones(2))
    with pytest.raises(ValueError, match="batch size 6 is not divisible by microbatch_size=4"):
        micro_vmap(lambda x: x, microbatch_size=4)(torch.ones(6))


# --------------------------------------------------------------------------- micro_grad


def test_micro_grad_per_example_gradients_as_optax_documents():
    from gradtx.microbatching import micro_grad

    def mean_squared_loss(params, features, targets):
        return 0.5 * ((features @ params - targets) ** 2).mean()

    # per-example gradients at params 0 are -targets: [0, -2, -4, -6]
    (grads, squared), aux = micro_grad(
        mean_squared_loss, argnums=0, batch_argnums=(1, 2), accumulator=MEAN,
        transform_fn=lambda g: (g, g**2), metrics_fn=torch.linalg.norm,
    )(torch.zeros(1, dtype=F64), torch.ones(4, 1, dtype=F64), torch.tensor([0.0, 2.0, 4.0, 6.0], dtype=F64))
    assert grads.tolist() == [-3.0] and squared.tolist() == [14.0]
    assert aux.values.tolist() == [0.0, 2.0, 8.0, 18.0] and aux.metrics.tolist() == [0.0, 2.0, 4.0, 6.0]
    assert aux.aux is None


def test_micro_grad_clipped_sum_against_a_loop_over_examples():
    from gradtx.microbatching import micro_grad

    params = {"w": data(3, 2, seed=12), "b": data(2, seed=13)}
    x, y = data(6, 3, seed=14), data(6, 2, seed=15)

    def loss(params, x, y):
        out = x @ params["w"] + params["b"]
        return ((out - y) ** 2).sum(), out.detach()

    def clip(grads, bound=1.0):
        norm = torch.sqrt(sum(g.square().sum() for g in grads.values()))
        return {k: g * torch.clamp(bound / norm, max=1.0) for k, g in grads.items()}

    expected = {"w": torch.zeros(3, 2, dtype=F64), "b": torch.zeros(2, dtype=F64)}
    values = []
    for i in range(6):
        leaves = {k: v.clone().requires_grad_() for k, v in params.items()}
        value, _ = loss(leaves, x[i : i + 1], y[i : i + 1])
        grads = dict(zip(leaves, torch.autograd.grad(value, list(leaves.values()))))
        for k, g in clip(grads).items():
            expected[k] += g
        values.append(value.detach())
    for size in (None, 2, 3):
        got, aux = micro_grad(loss, has_aux=True, batch_argnums=(1, 2), microbatch_size=size, transform_fn=clip)(params, x, y)
        torch.testing.assert_close(got["w"], expected["w"], rtol=1e-13, atol=1e-14)
        torch.testing.assert_close(got["b"], expected["b"], rtol=1e-13, atol=1e-14)
        torch.testing.assert_close(aux.values, torch.stack(values), rtol=1e-14, atol=0)
        torch.testing.assert_close(aux.aux, (x @ params["w"] + params["b"]).unsqueeze(1), rtol=1e-14, atol=0)
        assert aux.metrics is None


def test_micro_grad_without_the_batch_dim_and_errors():
    from gradtx.microbatching import micro_grad

    shapes = []
    fun = lambda w, x: shapes.append(tuple(x.shape)) or (w * x).sum()  # noqa: E731
    x = data(4, 3, seed=16)
    grads, _ = micro_grad(fun, batch_argnums=1, keep_batch_dim=False)(torch.ones(3, dtype=F64), x)
    torch.testing.assert_close(grads, x.sum(0), rtol=1e-15, atol=0)
    assert shapes == [(3,)]  # traced once under vmap, on one example without its batch axis
    with pytest.raises(ValueError, match="batch_argnums must name at least one argument"):
        micro_grad(fun, batch_argnums=())
    with pytest.raises(ValueError, match="batch_argnums names argument 2, but 2 positional arguments were given"):
        micro_grad(fun, batch_argnums=2)(torch.ones(3), torch.ones(4, 3))
