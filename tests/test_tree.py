"""The pytree layer: structure, dotted paths, None leaves, masks, groups and foreach kernels."""

from __future__ import annotations

import collections
import math
import re
from typing import NamedTuple

import numpy as np
import optree
import pytest
import torch

from gradtx import tree as tree_lib


class Moments(NamedTuple):
    mu: object
    nu: object


@optree.dataclasses.dataclass(namespace="gradtx")
class Block:
    weight: object
    bias: object


def nested_tree():
    return {
        "layers": [{"qkv": {"weight": torch.ones(2, 2), "bias": None}}, (torch.ones(1), torch.ones(3))],
        "state": Moments(mu=torch.zeros(2), nu={"a": torch.zeros(1)}),
        "ordered": collections.OrderedDict(z=torch.ones(1), a=torch.ones(1)),
    }


# --------------------------------------------------------------------------- structure and paths


def test_flatten_keeps_none_leaves_and_roundtrips():
    tree = nested_tree()
    leaves, treedef = tree_lib.flatten(tree)
    assert sum(leaf is None for leaf in leaves) == 1
    assert len(leaves) == treedef.num_leaves == 8
    rebuilt = tree_lib.unflatten(treedef, leaves)
    assert tree_lib.structure(rebuilt) == treedef
    assert all(a is b for a, b in zip(tree_lib.leaves(rebuilt), leaves))
    assert isinstance(rebuilt["state"], Moments) and isinstance(rebuilt["ordered"], collections.OrderedDict)


def test_paths_of_dict_list_tuple_namedtuple_ordereddict():
    assert tree_lib.paths(nested_tree()) == [
        "layers.0.qkv.bias",  # dict keys are sorted, as torch's and optree's dict flattening does
        "layers.0.qkv.weight",
        "layers.1.0",  # tuple index
        "layers.1.1",
        "ordered.z",  # OrderedDict keeps insertion order
        "ordered.a",
        "state.mu",  # NamedTuple fields by name
        "state.nu.a",
    ]


def test_paths_of_flat_containers_and_registered_dataclass():
    assert tree_lib.paths({"w": 1, "b": 2}) == ["b", "w"]
    assert tree_lib.paths([1, [2, 3]]) == ["0", "1.0", "1.1"]
    assert tree_lib.paths((Moments(1, 2),)) == ["0.mu", "0.nu"]
    assert tree_lib.paths({"blk": Block(weight=1, bias=None)}) == ["blk.weight", "blk.bias"]
    assert tree_lib.paths(torch.ones(1)) == [""]  # a bare leaf is the root
    assert tree_lib.paths({}) == []


def test_path_matches_named_parameters():
    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Tanh(), torch.nn.Linear(3, 1))
    params = dict(model.named_parameters())
    leaves, _ = tree_lib.flatten(params)
    by_path = dict(zip(tree_lib.paths(params), leaves))
    assert by_path.keys() == params.keys()
    assert all(by_path[name] is p for name, p in params.items())


def test_path_at_and_out_of_range():
    tree = {"b": 1, "a": [2, 3]}
    assert [tree_lib.path_at(tree, i) for i in range(3)] == ["a.0", "a.1", "b"]
    assert tree_lib.path_at(tree, 7) == "<leaf 7>"


def test_join_path():
    assert tree_lib.join_path(("layers", 0, "qkv", "weight")) == "layers.0.qkv.weight"
    assert tree_lib.join_path(()) == ""


def test_tree_map_skips_none_and_maps_parallel_trees():
    calls = []

    def double(x, y):
        calls.append(x)
        return x * 2 + y

    out = tree_lib.tree_map(double, {"a": torch.ones(2), "b": None}, {"a": torch.ones(2), "b": torch.ones(2)})
    assert out["b"] is None and len(calls) == 1
    torch.testing.assert_close(out["a"], torch.full((2,), 3.0))


# --------------------------------------------------------------------------- checks and mismatches


def test_flatten_like_names_missing_and_unexpected_paths():
    params = {"layer": {"weight": torch.ones(1), "bias": torch.ones(1)}}
    _, treedef = tree_lib.flatten(params)
    with pytest.raises(ValueError, match=r"^updates do not match params: params has leaf 'layer\.bias' that updates lacks"):
        tree_lib.flatten_like({"layer": {"weight": torch.ones(1)}}, treedef, params, what="updates", like="params")
    with pytest.raises(ValueError, match=r"updates has leaf 'layer\.extra' that params lacks"):
        tree_lib.flatten_like(
            {"layer": {"weight": 1, "bias": 1, "extra": 1}}, treedef, params, what="updates", like="params"
        )
    with pytest.raises(ValueError, match="updates has an OrderedDict at 'layer' where params has a dict"):
        tree_lib.flatten_like(
            {"layer": collections.OrderedDict(bias=1, weight=1)}, treedef, params, what="updates", like="params"
        )


class _Pair(NamedTuple):
    a: torch.Tensor
    b: torch.Tensor


_T = torch.ones(1)


@pytest.mark.parametrize(
    ("tree", "reference", "message"),
    [
        ({"w": _T, "b": _T}, {"W": _T, "b": _T},
         "params has leaf 'W' that grads lacks; grads has leaf 'w' that params lacks (grads is a dict, params is a dict)"),
        ({"W": _T}, {"W": _T, "b": _T}, "params has leaf 'b' that grads lacks (grads is a dict, params is a dict)"),
        ({"W": _T, "b": _T, "c": _T}, {"W": _T, "b": _T}, "grads has leaf 'c' that params lacks"),
        ([_T, _T], {"W": _T, "b": _T}, "grads is a list of 2 where params is a dict"),
        ({"enc": [_T, _T]}, {"enc": {"w": _T, "b": _T}}, "grads has a list of 2 at 'enc' where params has a dict"),
        ({"enc": {"w": _T}}, {"enc": {"w": _T, "b": _T}},
         "params has leaf 'enc.b' that grads lacks (at 'enc': grads has a dict, params has a dict)"),
        ([_T, _T], [_T, _T, _T], "params has leaf '2' that grads lacks (grads is a list of 2, params is a list of 3)"),
        ({"w": {"x": _T}}, {"w": _T}, "grads has a dict at 'w' where params has a leaf"),
        (collections.OrderedDict(a=_T, b=_T), {"a": _T, "b": _T}, "grads is an OrderedDict where params is a dict"),
        (collections.OrderedDict(b=_T, a=_T), collections.OrderedDict(a=_T, b=_T),
         "grads has the keys in the order ['b', 'a'], params in ['a', 'b']"),
        (_Pair(_T, _T), (_T, _T), "grads is a _Pair where params is a tuple of 2"),
        ({"m": {str(i): _T for i in range(5)}}, {}, "grads has leaves 'm.0', 'm.1', 'm.2' and 2 more that params lacks"),
    ],
    ids=["wrong key", "missing leaf", "extra leaf", "list for dict", "nested list for dict", "nested missing leaf",
         "short list", "subtree for leaf", "OrderedDict for dict", "key order", "NamedTuple for tuple", "many leaves"],
)
def test_describe_mismatch_names_the_side_that_lacks_a_leaf_and_both_containers(tree, reference, message):
    assert message in tree_lib.describe_mismatch(tree, reference, name="grads", like="params")
    _, treedef = tree_lib.flatten(reference)
    with pytest.raises(ValueError, match=r"^adamw: grads do not match params: " + re.escape(message)):
        tree_lib.flatten_like(tree, treedef, reference, what="adamw: grads", like="params")


def test_tree_map_names_the_tree_that_does_not_match():
    with pytest.raises(ValueError, match=r"^params do not match grads: params is a list of 1 where grads is a dict$"):
        tree_lib.tree_map(lambda g, p: g, {"w": _T}, [_T], names=("grads", "params"))
    with pytest.raises(ValueError, match=r"^tree 2 does not match the first tree: the first tree has leaf 'w' that tree 2 lacks"):
        tree_lib.tree_map(lambda a, b, c: a, {"w": _T}, {"w": _T}, {"v": _T})
    # a prefix still maps, and an error of fn itself is left as it is
    assert tree_lib.tree_map(lambda a, b: a + b["x"], {"w": _T}, {"w": {"x": _T}})["w"].item() == 2.0
    with pytest.raises(ZeroDivisionError):
        tree_lib.tree_map(lambda a, b: 1 / 0, {"w": _T}, {"w": _T})


def test_mismatch_error_agrees_the_verb_with_the_name():
    one, two = {"a": _T}, {"b": _T}
    assert str(tree_lib.mismatch_error(one, two, what="adamw: state.mu", like="updates")).startswith(
        "adamw: state.mu does not match updates: "
    )
    assert str(tree_lib.mismatch_error(one, two, what="updates", like="params")).startswith("updates do not match params: ")


def test_check_tensors_names_the_leaf():
    tree = {"enc": [torch.ones(1), 3.0], "dec": None}
    leaves, _ = tree_lib.flatten(tree)
    with pytest.raises(TypeError, match=r"'enc\.1' is a float"):
        tree_lib.check_tensors(tree, leaves, what="grads")
    with pytest.raises(TypeError, match=r"'dec' is a NoneType"):
        tree_lib.check_tensors({"dec": None}, [None], what="grads", allow_none=False)


def test_tensor_leaves_lists_present_indices():
    tree = {"a": torch.ones(1), "b": None, "c": torch.ones(2)}
    leaves, treedef, present = tree_lib.tensor_leaves(tree, what="x")
    assert present == [0, 2] and leaves[1] is None and treedef == tree_lib.structure(tree)
    with pytest.raises(TypeError, match=r"x: leaf 'b' is a str"):
        tree_lib.tensor_leaves({"a": torch.ones(1), "b": "grad"}, what="x")


# --------------------------------------------------------------------------- masks


MASK_TREE = {"enc": {"weight": torch.ones(2), "bias": torch.ones(1)}, "head": [torch.ones(1), None]}
# leaves in order: enc.bias, enc.weight, head.0, head.1


def test_mask_full_tree():
    mask = {"enc": {"weight": True, "bias": False}, "head": [False, True]}
    assert tree_lib.mask_leaves(mask, MASK_TREE) == [False, True, False, True]


def test_mask_prefix_covers_subtrees():
    assert tree_lib.mask_leaves({"enc": True, "head": False}, MASK_TREE) == [True, True, False, False]
    assert tree_lib.mask_leaves(False, MASK_TREE) == [False] * 4


def test_mask_callable_and_tensor_values():
    def no_bias(tree):
        return {"enc": {"weight": True, "bias": False}, "head": True}

    assert tree_lib.mask_leaves(no_bias, MASK_TREE) == [False, True, True, True]
    mask = {"enc": torch.tensor(True), "head": [torch.tensor(False), 1]}
    assert tree_lib.mask_leaves(mask, MASK_TREE) == [True, True, False, True]


def test_mask_mismatch_names_the_path():
    with pytest.raises(ValueError, match=r"'head\.0' is not covered"):
        tree_lib.mask_leaves({"enc": True}, MASK_TREE)
    with pytest.raises(ValueError, match=r"has 'extra', which the tree lacks"):
        tree_lib.mask_leaves({"enc": True, "head": True, "extra": False}, MASK_TREE)
    with pytest.raises(ValueError, match="weight_decay mask does not fit"):
        tree_lib.mask_leaves({"enc": True, "head": [True]}, MASK_TREE, what="weight_decay mask")


def test_a_misfit_after_a_prefix_leaf_is_named_where_it_is():
    """A leaf of the prefix covers a whole subtree: the misfit named is the first container that
    does not fit, not the prefix leaf before it; dicts of other kinds and key orders still fit."""
    tree = {"a": {"x": torch.ones(2)}, "b": [torch.ones(2), torch.ones(2)]}
    for mask in ({"a": True, "b": (True, False)}, {"a": {"x": True}, "b": (True, False)}):
        with pytest.raises(ValueError, match=r"the prefix has a tuple of 2 at 'b' where the tree has a list of 2"):
            tree_lib.mask_leaves(mask, tree)
    ordered = collections.OrderedDict([("b", [torch.ones(1)]), ("a", {"x": torch.ones(1), "y": torch.ones(1)})])
    assert tree_lib.mask_leaves({"a": True, "b": [False]}, ordered) == [False, True, True]
    with pytest.raises(ValueError, match=r"the prefix has a tuple of 1 at 'b' where the tree has a list of 1"):
        tree_lib.mask_leaves({"a": True, "b": (False,)}, ordered)


def test_numpy_bools_are_mask_values():
    assert tree_lib.mask_leaves({"enc": np.True_, "head": np.False_}, MASK_TREE) == [True, True, False, False]


def test_mask_non_bool_value_is_a_type_error():
    with pytest.raises(TypeError, match=r"'enc\.bias' has mask value 'yes'"):
        tree_lib.mask_leaves({"enc": "yes", "head": True}, MASK_TREE)
    with pytest.raises(TypeError, match=r"'head\.0'"):
        tree_lib.mask_leaves({"enc": True, "head": torch.ones(2, dtype=torch.bool)}, MASK_TREE)


# --------------------------------------------------------------------------- groups and kernels


def test_grouped_by_dtype_keeps_indices_and_parallel_lists():
    tensors = [torch.ones(1), torch.ones(1, dtype=torch.float64), torch.ones(2), torch.ones(1, dtype=torch.bfloat16)]
    others = ["a", "b", "c", "d"]
    groups = list(tree_lib.grouped(tensors, others))
    assert [indices for indices, _ in groups] == [[0, 2], [1], [3]]
    for indices, (group, other) in groups:
        assert all(group[k] is tensors[i] and other[k] == others[i] for k, i in enumerate(indices))
        assert len({t.dtype for t in group}) == 1


@pytest.mark.parametrize("ord", [1.0, 2.0, 3.0, math.inf])
def test_total_norm_is_the_norm_of_the_concatenation(ord):
    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randn(s, generator=gen, dtype=torch.float64) for s in [(3, 4), (5,), (), (2, 1, 3)]]
    expected = torch.linalg.vector_norm(torch.cat([t.reshape(-1) for t in tensors]), ord)
    torch.testing.assert_close(tree_lib.total_norm(tensors, ord), expected, rtol=1e-12, atol=0)
    local = tree_lib.local_norms(tensors, ord)
    torch.testing.assert_close(torch.stack(local), torch.stack([torch.linalg.vector_norm(t, ord) for t in tensors]))


def test_norms_accumulate_in_float32_or_wider():
    halves = [torch.full((64,), 300.0, dtype=torch.float16), torch.full((4,), 1.0, dtype=torch.bfloat16)]
    assert [n.dtype for n in tree_lib.local_norms(halves, 2.0)] == [torch.float32, torch.float32]
    assert tree_lib.local_norms(halves + [torch.ones(1, dtype=torch.float64)], 2.0)[0].dtype == torch.float64
    exact = torch.tensor(math.sqrt(300.0**2 * 64 + 4), dtype=torch.float32)
    torch.testing.assert_close(tree_lib.total_norm(halves, 2.0), exact, rtol=2e-7, atol=0)
    empty = tree_lib.total_norm([], 2.0)
    assert empty.shape == () and empty.item() == 0.0


@pytest.mark.parametrize("ord", [0.5, 1.0, 2.0, 3.0, math.inf, 0.0])
def test_norms_of_large_half_tensors_are_exact_to_float32(ord):
    """Large half tensors on CPU are normed in chunks (no whole float32 copy): same numbers."""
    gen = torch.Generator().manual_seed(0)
    exact = torch.randn(3 * 65536 + 17, generator=gen, dtype=torch.float64)
    exact[::7] = 0.0
    tensors = [exact.half(), exact.bfloat16()[: 2 * 65536].view(2, 65536).t()]  # contiguous, and not
    expected = [torch.linalg.vector_norm(t.double(), ord) for t in tensors]
    norms = tree_lib.foreach_norm(tensors[:1], ord, torch.float32) + tree_lib.foreach_norm(tensors[1:], ord, torch.float32)
    for norm, reference in zip(norms, expected):
        assert norm.dtype == torch.float32
        torch.testing.assert_close(norm.double(), reference, rtol=1e-4, atol=0)  # float32 sums of 2e5 terms


def test_foreach_mul_keeps_dtypes_of_zero_dim_tensors():
    """A 0-d half tensor times a float32 0-d factor would promote to float32; results keep their dtype."""
    tensors = [torch.tensor(3.0, dtype=torch.float16), torch.tensor(1.5, dtype=torch.bfloat16), torch.ones(3)]
    factor = torch.tensor(0.3, dtype=torch.float64)
    pure = tree_lib.foreach_mul(tensors, factor, inplace=False)
    assert [t.dtype for t in pure] == [t.dtype for t in tensors]
    donated = [t.clone() for t in tensors]
    inplace = tree_lib.foreach_mul(donated, factor, inplace=True)
    assert all(a is b for a, b in zip(inplace, donated))
    assert all(torch.equal(a, b) for a, b in zip(pure, inplace))
    per_tensor = tree_lib.foreach_mul(tensors, [factor.float()] * 3, inplace=False)
    assert [t.dtype for t in per_tensor] == [t.dtype for t in tensors]


def test_foreach_add_pure_and_inplace():
    first, second = [torch.ones(2), torch.zeros(3)], [torch.full((2,), 2.0), torch.ones(3)]
    pure = tree_lib.foreach_add(first, second)
    assert torch.equal(first[0], torch.ones(2)) and torch.equal(pure[0], torch.full((2,), 3.0))
    inplace = tree_lib.foreach_add(first, second, inplace=True)
    assert inplace[1] is first[1] and torch.equal(first[1], torch.ones(3))


def test_replace_present():
    assert tree_lib.replace_present([None, 1, None, 2], [1, 3], ["a", "b"]) == [None, "a", None, "b"]


@pytest.mark.parametrize(
    "tree",
    [
        collections.OrderedDict([("b", torch.ones(1)), ("a", None), ("c", torch.zeros(2))]),
        collections.OrderedDict([("z", torch.ones(1)), ("y", torch.zeros(2))]),
        collections.OrderedDict(),
        collections.OrderedDict([("b", torch.ones(1)), ("nested", {"x": torch.ones(1)})]),
        collections.OrderedDict([("b", torch.ones(1)), ("empty", ())]),
    ],
    ids=["with None", "leaves", "empty", "nested", "an empty child"],
)
def test_unflatten_of_an_ordered_dict_is_optrees(tree):
    leaves, treedef = tree_lib.flatten(tree)
    new = [object() for _ in leaves]
    got, want = tree_lib.unflatten(treedef, new), optree.tree_unflatten(treedef, new)
    assert type(got) is collections.OrderedDict and list(got) == list(want)
    assert tree_lib.leaves(got) == tree_lib.leaves(want) and tree_lib.structure(got) == treedef
    with pytest.raises(ValueError):
        tree_lib.unflatten(treedef, new + [object()])


def test_unflattening_a_flat_ordered_dict_makes_no_object_per_leaf():
    """optree builds it from a (key, value) tuple per leaf: with 100,000 params (``wrap``'s trees)
    the tuples set off the garbage collector's full passes, each hundreds of milliseconds."""
    import gc

    tree = collections.OrderedDict((f"p{i}", torch.zeros(())) for i in range(20_000))
    leaves, treedef = tree_lib.flatten(tree)
    collections_seen = []
    callback = lambda phase, info: collections_seen.append(info["generation"]) if phase == "start" else None  # noqa: E731
    gc.collect()
    gc.callbacks.append(callback)
    try:
        rebuilt = tree_lib.unflatten(treedef, leaves)
    finally:
        gc.callbacks.remove(callback)
    assert not collections_seen and list(rebuilt) == list(tree)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_an_in_place_product_by_a_number_equals_the_out_of_place_one(dtype):
    """On the CPU, ``torch._foreach_mul_`` rounds a number to bfloat16 / float16 before the product
    (0.1 as 0.10009765625), where ``mul``, ``mul_`` and ``_foreach_mul`` take it as a float32:
    ``tree.foreach("mul", ..., inplace=True)`` gives the out-of-place numbers, bit for bit."""
    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randn(1000, generator=gen).to(dtype), torch.randn(7, 3, generator=gen).to(dtype)]
    want = [t * -0.1 for t in tensors]
    got = tree_lib.foreach("mul", [t.clone() for t in tensors], -0.1, inplace=True)
    assert all(torch.equal(w.view(torch.int16), g.view(torch.int16)) for w, g in zip(want, got))
    raw = [t.clone() for t in tensors]
    torch._foreach_mul_(raw, -0.1)
    assert not all(torch.equal(w, r) for w, r in zip(want, raw)), "torch's in-place product now takes the number as is"
