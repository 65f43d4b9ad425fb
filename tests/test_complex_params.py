"""Complex parameters, where the catalogue sweep (test_complex_catalogue.py) does not reach: L-BFGS
and line searches against the real-equivalent problem, torch.optim's own conventions, per-example
clipping, unit-wise norms with optax's ``axis``, the state dtypes kept for complex params, and the
tree helpers that order complex numbers."""

from __future__ import annotations

import pytest
import torch

import gradtx as gtx
import gradtx.contrib

C128 = torch.complex128


def _complex_tree(seed: int, dtype=C128) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(3, 2, generator=gen, dtype=dtype), "b": torch.randn(2, generator=gen, dtype=dtype)}


# --------------------------------------------------------------------------- extra arguments and single tensors


@pytest.mark.parametrize("name", ["adam", "adamw", "nadam", "nadamw"])
def test_adam_aliases_take_and_ignore_extra_args(name):
    tx = getattr(gtx, name)(0.1)
    params, grads = _complex_tree(0), _complex_tree(1)
    plain, _ = tx.update(grads, tx.init(params), params)
    value = torch.tensor(1.5, dtype=torch.float64)
    extra, _ = tx.update(grads, tx.init(params), params, value=value, grad=grads, value_fn=lambda p: value)
    for k in plain:
        assert torch.equal(plain[k], extra[k])
    # so they sit where any optimizer may: after a line search's arguments in a chain that forwards them
    chained = gtx.chain(tx, gtx.scale_by_polyak(max_learning_rate=0.5))
    chained.update(grads, chained.init(params), params, value=value)


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_muon_takes_a_single_tensor(weight_decay):
    matrix, vector = torch.randn(4, 3, dtype=torch.float64), torch.randn(3, dtype=torch.float64)
    for param in (matrix, vector, matrix.to(C128)):
        grad = torch.randn_like(param)
        tx = gtx.contrib.muon(0.1, weight_decay=weight_decay, adam_weight_decay=weight_decay)
        alone, _ = tx.update(grad.clone(), tx.init(param), param)
        in_tree, _ = tx.update({"p": grad.clone()}, tx.init({"p": param}), {"p": param})
        torch.testing.assert_close(alone, in_tree["p"], rtol=0, atol=0)


def test_a_branch_that_selects_nothing_needs_no_params():
    param = torch.randn(3)
    for branch in (gtx.adamw(0.1, weight_decay=0.1), gtx.add_decayed_weights(0.1), gtx.adaptive_grad_clip(0.1), gtx.lars(0.1)):
        tx = gtx.partition({"used": gtx.sgd(0.1), "unused": branch}, "used")
        updates, _ = tx.update(param.clone(), tx.init(param), param)
        torch.testing.assert_close(updates, -0.1 * param)
    with pytest.raises(ValueError, match="adamw: params are required for weight decay"):
        gtx.adamw(0.1).update(param, gtx.adamw(0.1).init(param))
