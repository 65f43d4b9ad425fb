"""Torch's own optimizer contract, with a stateful chain behind ``wrap``.

Every optimizer torch tests (``torch.testing._internal.common_optimizers.optim_db``, with torch's
own hyperparameter sets) is wrapped with a chain whose state changes the numbers, and put through
the protocols of torch's ``test/test_optim.py``: ``test_state_dict_deterministic`` (state dicts of
equal runs are equal, also with a param group listed twice, and a loaded one resumes exactly) and
the sparse-gradient runs (``SparseAdam``, sparse ``SGD`` / ``Adagrad``) behind a clip.
"""

from __future__ import annotations

import copy
import functools
import warnings

import pytest
import torch
from torch.nn import Parameter

import gradtx as gtx

pytestmark = pytest.mark.filterwarnings("ignore:Sparse invariant checks are implicitly disabled:UserWarning")

common_optimizers = pytest.importorskip("torch.testing._internal.common_optimizers")
OPTIM_DB = {info.optim_cls.__name__: info for info in common_optimizers.optim_db}


def chain() -> gtx.GradientTransformation:
    """A clip and a scheduled scale: both keep state, and the scale's count changes every step's numbers."""
    return gtx.chain(gtx.clip_by_global_norm(1.0), gtx.scale_by_schedule(gtx.linear_schedule(1.0, 0.5, 30)))


def inputs_of(info) -> list:
    return common_optimizers._get_optim_inputs_including_global_cliquey_kwargs(
        "cpu", torch.float32, info, skip=("differentiable",)
    )


def assert_nested_equal(a, b, where: str = "state_dict") -> None:
    assert type(a) is type(b), f"{where}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, dict):
        assert a.keys() == b.keys(), f"{where}: keys {sorted(map(str, a))} != {sorted(map(str, b))}"
        for key in a:
            assert_nested_equal(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_nested_equal(x, y, f"{where}[{i}]")
    elif isinstance(a, torch.Tensor):
        torch.testing.assert_close(a, b, msg=where)
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def run_steps(info, optimizer, closure, n: int) -> None:
    for _ in range(n):
        if info.step_requires_closure:
            optimizer.step(closure)
        else:
            closure()
            optimizer.step()


@pytest.mark.parametrize("name", sorted(OPTIM_DB))
def test_state_dict_deterministic(name):
    """torch's test_state_dict_deterministic, every optimizer and input set, wrapped with a stateful chain."""
    info = OPTIM_DB[name]
    torch.manual_seed(0)
    weight = Parameter(torch.randn(2, 3))
    bias = Parameter(torch.randn(2))
    x = torch.randn(3)

    def fwd_bwd(optimizer, w, b):
        optimizer.zero_grad()
        loss = (w.mv(x) + b).pow(2).sum()
        loss.backward()
        if info.only_supports_sparse_grads:
            w.grad, b.grad = w.grad.to_sparse(), b.grad.to_sparse()
        return loss

    for optim_input in inputs_of(info):
        if name == "Muon":  # torch's Muon takes 2-D params only: the weight alone
            make = lambda w, b: gtx.wrap(info.optim_cls([w], **optim_input.kwargs), chain())  # noqa: E731
        else:
            make = lambda w, b: gtx.wrap(info.optim_cls([w, b], **optim_input.kwargs), chain())  # noqa: E731
        optimizer = make(weight, bias)
        closure = functools.partial(fwd_bwd, optimizer, weight, bias)
        run_steps(info, optimizer, closure, 10)
        with torch.no_grad():
            weight_c, bias_c = Parameter(weight.clone()), Parameter(bias.clone())
        optimizer_c = make(weight_c, bias_c)
        closure_c = functools.partial(fwd_bwd, optimizer_c, weight_c, bias_c)
        optimizer_c.load_state_dict(copy.deepcopy(optimizer.state_dict()))
        for _ in range(10):
            run_steps(info, optimizer, closure, 1)
            run_steps(info, optimizer_c, closure_c, 1)
            torch.testing.assert_close(weight, weight_c)
            torch.testing.assert_close(bias, bias_c)
        assert_nested_equal(optimizer.state_dict(), optimizer_c.state_dict())
        # a param group listed twice has the same representation as the group itself
        optimizer_c.param_groups.extend(optimizer_c.param_groups)
        assert_nested_equal(optimizer.state_dict()["param_groups"][-1], optimizer_c.state_dict()["param_groups"][-1])


def sparse_embedding_run(make_optimizer, *, wrapped: bool, steps: int = 5) -> torch.Tensor:
    torch.manual_seed(0)
    embedding = torch.nn.Embedding(12, 4, sparse=True)
    inner = make_optimizer(embedding.parameters())
    opt = gtx.wrap(inner, gtx.clip_by_global_norm(0.5)) if wrapped else inner
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        opt.zero_grad()
        ids = torch.randint(0, 12, (6,), generator=gen)  # repeated ids: an uncoalesced gradient
        embedding(ids).pow(2).sum().backward()
        if not wrapped:  # clip_grad_norm_ has no sparse kernel: clip the coalesced gradient by hand
            grad = embedding.weight.grad.coalesce()
            norm = grad.values().norm()
            embedding.weight.grad = grad * torch.clamp(0.5 / (norm + 1e-6), max=1.0)
        opt.step()
    return embedding.weight.detach()


@pytest.mark.parametrize(
    "make",
    [
        lambda ps: torch.optim.SparseAdam(ps, lr=0.1),
        lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
        lambda ps: torch.optim.Adagrad(ps, lr=0.1),
    ],
    ids=["SparseAdam", "SGD", "Adagrad"],
)
def test_sparse_gradients_behind_a_clip_match_torch(make):
    torch.testing.assert_close(sparse_embedding_run(make, wrapped=True), sparse_embedding_run(make, wrapped=False))


def test_a_chain_that_cannot_take_sparse_gradients_says_which_params_have_them():
    torch.manual_seed(0)
    embedding = torch.nn.Embedding(12, 4, sparse=True)
    opt = gtx.wrap(torch.optim.SGD(embedding.parameters(), lr=0.1), gtx.chain(gtx.clip_by_global_norm(1.0), gtx.trace(0.9)), model=embedding)
    embedding(torch.tensor([1, 2, 2])).sum().backward()
    with pytest.raises(TypeError, match=r"could not take the sparse gradients of \['weight'\] \(RuntimeError: .*keeps per-element state"):
        opt.step()


def test_selecting_sparse_updates_warns_of_nothing():
    """apply_if_finite around a clip of sparse gradients: the selection rebuilds a sparse tensor
    from coalesced indices, with no warning about invariant checks every step."""
    torch.manual_seed(0)
    embedding = torch.nn.Embedding(12, 4, sparse=True)
    opt = gtx.wrap(torch.optim.SGD(embedding.parameters(), lr=0.1), gtx.apply_if_finite(gtx.clip_by_global_norm(1.0), 3))
    embedding(torch.tensor([1, 2, 2])).sum().backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.step()


def test_sparse_gradient_norms_are_those_of_the_dense_gradient():
    torch.manual_seed(0)
    dense = torch.zeros(6, 3)
    dense[[1, 4]] = torch.randn(2, 3)
    indices = torch.tensor([[1, 4, 1]])
    values = torch.stack([dense[1] / 2, dense[4], dense[1] / 2])  # row 1 stored twice, halves of it
    sparse = torch.sparse_coo_tensor(indices, values, (6, 3))
    for norm_type in (1.0, 2.0, 3.0, float("inf")):
        torch.testing.assert_close(
            gtx.global_norm({"s": sparse, "d": dense}, norm_type=norm_type),
            torch.linalg.vector_norm(torch.cat([dense.flatten(), dense.flatten()]), norm_type),
        )
    clipped, _ = gtx.clip_by_value(0.3).update({"s": sparse}, gtx.EmptyState())
    torch.testing.assert_close(clipped["s"].to_dense(), dense.clamp(-0.3, 0.3))
    finite = gtx.apply_if_finite(gtx.identity(), 1)
    poisoned = torch.sparse_coo_tensor(torch.tensor([[2]]), torch.tensor([[float("nan")] * 3]), (6, 3))
    out, state = finite.update({"s": poisoned}, finite.init({"s": dense}))
    assert not bool(state.last_finite) and torch.equal(out["s"].to_dense(), torch.zeros(6, 3))
