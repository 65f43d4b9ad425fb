"""The core types and apply_updates: purity, dtype handling, None leaves, errors naming paths."""

from __future__ import annotations

import io
import re

import pytest
import torch

import gradtx as gtx
from gradtx import tree as tree_lib


def clone_tree(tree):
    return tree_lib.tree_map(torch.clone, tree)


def assert_trees_equal(a, b):
    assert tree_lib.structure(a) == tree_lib.structure(b)
    for x, y in zip(tree_lib.leaves(a), tree_lib.leaves(b)):
        assert (x is None and y is None) or (x.dtype == y.dtype and torch.equal(x, y))


# --------------------------------------------------------------------------- building blocks


def test_gradient_transformation_is_a_named_pair():
    tx = gtx.identity()
    assert isinstance(tx, tuple) and tx._fields == ("init", "update")
    init, update = tx
    assert init is tx.init and update is tx.update


def test_empty_state_has_no_leaves_and_saves():
    state = gtx.EmptyState()
    assert tree_lib.leaves(state) == []
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    assert torch.load(buffer, weights_only=False) == state


def test_identity_returns_its_inputs():
    grads = {"w": torch.ones(2), "b": None}
    tx = gtx.identity()
    state = tx.init(grads)
    updates, new_state = tx.update(grads, state, grads, inplace=True)
    assert updates is grads and new_state is state


def test_stateless_passes_params_and_keeps_state_empty():
    seen = []

    def weight_decay(updates, params):
        seen.append(params)
        return tree_lib.tree_map(lambda u, p: u + 0.1 * p, updates, params)

    tx = gtx.stateless(weight_decay)
    params = {"w": torch.full((2,), 10.0)}
    updates, state = tx.update({"w": torch.ones(2)}, tx.init(params), params)
    assert seen == [params] and state == gtx.EmptyState()
    torch.testing.assert_close(updates["w"], torch.full((2,), 2.0))


def test_stateless_with_tree_map_skips_none():
    tx = gtx.stateless_with_tree_map(lambda g: -g)
    updates, _ = tx.update({"w": torch.ones(2), "frozen": None}, gtx.EmptyState())
    assert updates["frozen"] is None and torch.equal(updates["w"], -torch.ones(2))


def test_stateless_with_tree_map_passes_params_to_two_argument_functions():
    # optax's convention: fn(update, param), param None when update gets no params
    params = {"w": torch.tensor([1.0, -2.0], dtype=torch.float64), "b": torch.tensor(3.0, dtype=torch.float64)}
    grads = {"w": torch.tensor([0.5, 0.25], dtype=torch.float64), "b": torch.tensor(-1.0, dtype=torch.float64)}
    tx = gtx.stateless_with_tree_map(lambda g, p: g + 0.1 * p)
    updates, state = tx.update(grads, tx.init(params), params)
    assert state == gtx.EmptyState()
    torch.testing.assert_close(updates["w"], torch.tensor([0.6, 0.05], dtype=torch.float64), rtol=0, atol=1e-15)
    torch.testing.assert_close(updates["b"], torch.tensor(-0.7, dtype=torch.float64), rtol=0, atol=1e-15)

    seen = []
    tx = gtx.stateless_with_tree_map(lambda g, p: seen.append(p) or 2 * g)
    updates, _ = tx.update(grads, gtx.EmptyState())
    assert seen == [None, None] and torch.equal(updates["w"], 2 * grads["w"])

    tx = gtx.stateless_with_tree_map(lambda g, p=None: g if p is None else g * p)  # a default still gets the param
    updates, _ = tx.update(grads, gtx.EmptyState(), params)
    torch.testing.assert_close(updates["w"], torch.tensor([0.5, -0.5], dtype=torch.float64))


def test_stateless_with_tree_map_one_argument_and_builtin_functions():
    grads = {"w": torch.tensor([1.0, -2.0]), "b": torch.tensor(-3.0)}
    params = {"w": torch.zeros(2), "b": torch.zeros(())}
    for fn in (lambda g: g.abs(), torch.abs):
        updates, _ = gtx.stateless_with_tree_map(fn).update(grads, gtx.EmptyState(), params)
        assert torch.equal(updates["w"], torch.tensor([1.0, 2.0])) and torch.equal(updates["b"], torch.tensor(3.0))


# --------------------------------------------------------------------------- apply_updates


def test_apply_updates_adds_and_is_pure():
    params = {"w": torch.randn(3, 2), "b": torch.randn(2)}
    updates = {"w": torch.randn(3, 2), "b": torch.randn(2)}
    before_p, before_u = clone_tree(params), clone_tree(updates)
    new = gtx.apply_updates(params, updates)
    assert_trees_equal(params, before_p)
    assert_trees_equal(updates, before_u)
    for k in params:
        assert new[k] is not params[k]
        assert torch.equal(new[k], params[k] + updates[k])


def test_apply_updates_none_update_keeps_the_parameter():
    params = {"w": torch.ones(2), "frozen": torch.ones(3)}
    new = gtx.apply_updates(params, {"w": torch.ones(2), "frozen": None})
    assert new["frozen"] is params["frozen"]
    assert torch.equal(new["w"], torch.full((2,), 2.0))


def test_apply_updates_none_parameter_with_none_update_is_fine():
    new = gtx.apply_updates({"w": torch.ones(1), "gone": None}, {"w": torch.ones(1), "gone": None})
    assert new["gone"] is None


@pytest.mark.parametrize("param_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("update_dtype", [torch.float32, torch.float64])
def test_apply_updates_casts_back_like_torch_add_(param_dtype, update_dtype):
    """The sum is rounded once into the parameter's dtype: ``p.add_(u)``, optax's ``(p + u).astype``."""
    gen = torch.Generator().manual_seed(0)
    param = torch.randn(4096, generator=gen).to(param_dtype)
    update = (torch.randn(4096, generator=gen, dtype=torch.float64) * 1e-2).to(update_dtype)
    expected = param.clone().add_(update)
    assert torch.equal(expected, (param.to(torch.float64) + update.to(torch.float64)).to(param_dtype))
    pure = gtx.apply_updates({"p": param}, {"p": update})["p"]
    assert pure.dtype == param_dtype and torch.equal(pure, expected)
    donated = {"p": param.clone()}
    inplace = gtx.apply_updates(donated, {"p": update}, inplace=True)
    assert inplace is donated and torch.equal(donated["p"], expected)


def test_apply_updates_inplace_mutates_params_in_place():
    model = torch.nn.Linear(3, 2)
    params = {k: v.detach() for k, v in model.named_parameters()}
    pointers = {k: v.data_ptr() for k, v in params.items()}
    expected = {k: v + 1.0 for k, v in params.items()}
    out = gtx.apply_updates(params, {k: torch.ones_like(v) for k, v in params.items()}, inplace=True)
    assert out is params
    for k, v in params.items():
        assert v.data_ptr() == pointers[k] and torch.equal(v, expected[k])
    torch.testing.assert_close(model.weight.detach(), expected["weight"])  # the module sees the step


def test_apply_updates_nested_mixed_dtypes():
    params = {"a": [torch.ones(2, dtype=torch.bfloat16), torch.ones(1, dtype=torch.float64)], "b": torch.ones(())}
    updates = {"a": [torch.full((2,), 0.5), torch.full((1,), 0.25, dtype=torch.float64)], "b": torch.tensor(2.0)}
    new = gtx.apply_updates(params, updates)
    assert [t.dtype for t in tree_lib.leaves(new)] == [t.dtype for t in tree_lib.leaves(params)]
    assert new["a"][0].tolist() == [1.5, 1.5] and new["a"][1].item() == 1.25 and new["b"].item() == 3.0


def test_apply_updates_mismatched_trees_name_the_path():
    params = {"enc": {"weight": torch.ones(2), "bias": torch.ones(1)}}
    with pytest.raises(ValueError, match=r"apply_updates: updates do not match params: params has leaf 'enc\.bias' that updates lacks"):
        gtx.apply_updates(params, {"enc": {"weight": torch.ones(2)}})
    with pytest.raises(ValueError, match=r"apply_updates: updates do not match params: updates has leaf 'enc\.scale' that params lacks"):
        gtx.apply_updates(params, {"enc": {"weight": torch.ones(2), "bias": torch.ones(1), "scale": torch.ones(1)}})
    with pytest.raises(ValueError, match=r"'enc\.weight' has update shape \(3,\) but parameter shape \(2,\)"):
        gtx.apply_updates(params, {"enc": {"weight": torch.ones(3), "bias": torch.ones(1)}})
    with pytest.raises(ValueError, match=r"'gone' has an update but no parameter"):
        gtx.apply_updates({"gone": None}, {"gone": torch.ones(1)})


@pytest.mark.parametrize(
    ("grads", "message"),
    [
        ({"w": torch.ones(2), "b": torch.ones(1)},
         "params has leaf 'W' that updates lacks; updates has leaf 'w' that params lacks (updates is a dict, params is a dict)"),
        ({"W": torch.ones(2)}, "params has leaf 'b' that updates lacks (updates is a dict, params is a dict)"),
        ([torch.ones(2), torch.ones(1)], "updates is a list of 2 where params is a dict"),
    ],
    ids=["wrong key", "missing leaf", "list for dict"],
)
def test_mismatched_gradients_say_which_side_lacks_which_leaf(grads, message):
    params = {"W": torch.ones(2), "b": torch.ones(1)}
    with pytest.raises(ValueError, match=re.escape(f"apply_updates: updates do not match params: {message}")):
        gtx.apply_updates(params, grads)
    tx = gtx.adamw(0.1)
    state = tx.init(params)
    with pytest.raises(ValueError, match=r"^adamw: (params do not match updates|updates do not match params): "):
        tx.update(grads, state, params)


def test_stateless_with_tree_map_names_params_that_do_not_match():
    tx = gtx.stateless_with_tree_map(lambda g, p: g * p)
    with pytest.raises(ValueError, match=re.escape(
        "stateless_with_tree_map: params do not match updates: updates has leaf 'w' that params lacks; "
        "params has leaf 'W' that updates lacks (params is a dict, updates is a dict)"
    )):
        tx.update({"w": torch.ones(1)}, tx.init(None), {"W": torch.ones(1)})


def test_apply_updates_non_tensor_leaf_names_the_path():
    with pytest.raises(TypeError, match=r"updates: leaf 'w' is a float"):
        gtx.apply_updates({"w": torch.ones(1)}, {"w": 0.5})
    with pytest.raises(TypeError, match=r"params: leaf 'layers\.1' is a str"):
        gtx.apply_updates({"layers": [torch.ones(1), "w"]}, {"layers": [torch.ones(1), torch.ones(1)]})


def test_init_empty_state_is_the_init_of_stateless_transforms():
    params = {"w": torch.ones(3)}
    assert gtx.init_empty_state(params) == gtx.EmptyState()
    for tx in (gtx.identity(), gtx.stateless(lambda u, p: u), gtx.clip_by_value(1.0), gtx.scale(2.0)):
        assert tx.init(params) == gtx.EmptyState()
