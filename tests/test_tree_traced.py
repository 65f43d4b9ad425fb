"""While ``torch.compile`` traces, ``tree_map`` and ``flatten_like`` walk plain trees themselves
(``gradtx.tree._plain_columns``) instead of running optree's flatten as Python: the leaves, their
order, the rebuilt containers and the structure check must be optree's exactly, and anything the
walk does not know goes to optree."""

from __future__ import annotations

import collections
import operator
from typing import Any, Callable, NamedTuple

import optree
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import gradtx as gtx
from gradtx import tree as tree_lib


class UserPair(NamedTuple):  # a user's namedtuple: optree decides (it might be registered)
    a: Any
    b: Any


KEYS = st.sampled_from(["a", "b", "c", "w", "bias", "0.weight"])


def _leaf(draw_value: int) -> Any:
    return None if draw_value == 0 else torch.full((draw_value,), float(draw_value))


def plain_trees(max_leaves: int = 12):
    """Nestings of dict, OrderedDict, list, tuple and a gradtx state over tensors and None."""
    leaves = st.integers(0, 3).map(_leaf)

    def extend(children):
        return st.one_of(
            st.dictionaries(KEYS, children, max_size=3),
            st.dictionaries(KEYS, children, max_size=3).map(collections.OrderedDict),
            st.lists(children, max_size=3),
            st.lists(children, max_size=3).map(tuple),
            st.tuples(children).map(lambda c: gtx.ClipByGlobalNormState(*c)),
        )

    return st.recursive(leaves, extend, max_leaves=max_leaves)


def _spec(tree):
    return optree.tree_structure(tree, none_is_leaf=True, namespace="gradtx")


def _pairs(tree, others, *, strict):
    """The walk's columns as one ``(leaf, *matching nodes)`` tuple per leaf."""
    columns = tree_lib._plain_columns(tree, others, strict=strict)
    return None if columns is None else list(zip(*columns))


def _same(a, b, *, leaves: Callable[[Any, Any], bool] = operator.is_) -> bool:
    """Equal trees: the same containers (types and key order), and leaves ``leaves`` calls equal
    (identical by default)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k], leaves=leaves) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y, leaves=leaves) for x, y in zip(a, b))
    return leaves(a, b)


def _same_shape(a, b) -> bool:
    """The same containers (types and key order), whatever the leaves."""
    return _same(a, b, leaves=lambda x, y: True)


@settings(max_examples=60, deadline=None)
@given(plain_trees(), plain_trees())
def test_the_walk_agrees_with_optree_on_structure_and_leaf_order(tree, other):
    pairs = _pairs(tree, [other], strict=True)
    if _spec(tree) == _spec(other):
        assert pairs is not None
        assert [p[0] for p in pairs] == optree.tree_leaves(tree, none_is_leaf=True, namespace="gradtx")
        assert [p[1] for p in pairs] == optree.tree_leaves(other, none_is_leaf=True, namespace="gradtx")
    else:
        assert pairs is None


@settings(max_examples=60, deadline=None)
@given(plain_trees())
def test_the_rebuilt_tree_is_optrees_map(tree):
    pairs = _pairs(tree, [tree], strict=False)
    tags = iter(range(1000))
    ours = tree_lib._plain_rebuild(tree, [None if p[0] is None else next(tags) for p in pairs])
    tags = iter(range(1000))
    theirs = optree.tree_map(lambda x: None if x is None else next(tags), tree, none_is_leaf=True, namespace="gradtx")
    assert ours == theirs and _same_shape(ours, theirs)


def test_a_prefix_tree_maps_whole_subtrees_as_optree_does():
    tree = {"w": torch.ones(2), "b": None}
    rest = {"w": {"deep": 1}, "b": [2, 3]}
    pairs = _pairs(tree, [rest], strict=False)
    assert pairs == [(tree["b"], [2, 3]), (tree["w"], {"deep": 1})]  # sorted keys
    assert _pairs(tree, [rest], strict=True) is None


@pytest.mark.parametrize(
    "tree, other",
    [
        ({1: torch.ones(1), "a": torch.ones(1)}, {1: torch.ones(1), "a": torch.ones(1)}),  # a non-string key
        (UserPair(torch.ones(1), None), UserPair(torch.ones(1), None)),  # a user's namedtuple
        ({"a": 1.0}, {"a": 2.0}),  # a leaf that is not a tensor
        (collections.defaultdict(list, a=torch.ones(1)), collections.defaultdict(list, a=torch.ones(1))),
    ],
    ids=["int key", "user namedtuple", "float leaf", "defaultdict"],
)
def test_what_the_walk_does_not_know_goes_to_optree(tree, other):
    assert _pairs(tree, [other], strict=False) is None


def test_an_ordered_dict_keeps_its_order_and_must_match_it_where_structures_must_be_equal():
    first = collections.OrderedDict(z=torch.ones(1), a=torch.zeros(1))
    swapped = collections.OrderedDict(a=torch.zeros(1), z=torch.ones(1))
    assert [p[0] for p in _pairs(first, [], strict=True)] == [first["z"], first["a"]]
    assert _pairs(first, [swapped], strict=True) is None  # optree: different specs
    assert [p[1] for p in _pairs(first, [swapped], strict=False)] == [swapped["z"], swapped["a"]]


def test_compiled_tree_map_and_flatten_like_give_the_eager_results():
    tree = collections.OrderedDict(
        z={"w": torch.randn(3), "b": None}, a=[torch.randn(2), (torch.randn(1),)], s=gtx.ClipByGlobalNormState(torch.ones(()))
    )
    other = tree_lib.tree_map(lambda x: x * 2, tree)

    def both(tree, other):
        mapped = tree_lib.tree_map(lambda x, y: x + y, tree, other)
        leaves = tree_lib.flatten_like(other, tree_lib.structure(tree), tree, what="other", like="tree")
        return mapped, leaves

    eager = both(tree, other)
    compiled = torch.compile(both, backend="eager", fullgraph=True)(tree, other)
    assert _same_shape(compiled[0], eager[0])
    for x, y in zip(tree_lib.leaves(compiled), tree_lib.leaves(eager)):
        assert (x is None and y is None) or torch.equal(x, y)


@pytest.mark.filterwarnings("ignore:Dynamo detected a call to a `functools.lru_cache`")
def test_a_mismatch_under_compile_is_the_eager_error():
    tree = {"w": torch.ones(2), "b": torch.ones(1)}
    other = {"w": torch.ones(2), "c": torch.ones(1)}

    def check(tree, other):
        return tree_lib.flatten_like(other, tree_lib.structure(tree), tree, what="adam: state.mu", like="updates")

    with pytest.raises(ValueError) as eager:
        check(tree, other)
    torch._dynamo.reset()
    with pytest.raises(Exception) as compiled:
        torch.compile(check, backend="eager")(tree, other)
    assert str(eager.value) in str(compiled.value)


def test_a_compiled_adam_step_takes_the_walk():
    """The trees of an ordinary step are plain: the fast path serves them (else its speed is moot)."""
    params = {"w": torch.randn(4, 3), "b": torch.randn(3)}
    tx = gtx.chain(gtx.clip_by_global_norm(1.0), gtx.adam(1e-2))
    state = tx.init(params)
    grads = tree_lib.tree_map(torch.ones_like, params)
    served = []
    original = tree_lib._plain_columns

    def counting(tree, others, *, strict):
        result = original(tree, others, strict=strict)
        served.append(result is not None)
        return result

    torch._dynamo.reset()
    tree_lib._plain_columns = counting
    try:
        torch.compile(tx.update, backend="eager", fullgraph=True)(grads, state, params)
    finally:
        tree_lib._plain_columns = original
        torch._dynamo.reset()
    assert served and all(served)


def _traced_steps(fn: Callable[..., Any], *args: Any) -> int:
    """How many bytecode instructions Dynamo steps through to compile ``fn(*args)`` as one graph."""
    from torch._dynamo import symbolic_convert

    counted = [0]
    original = symbolic_convert.InstructionTranslatorBase.step

    def step(self):
        counted[0] += 1
        return original(self)

    torch._dynamo.reset()
    symbolic_convert.InstructionTranslatorBase.step = step
    try:
        torch.compile(fn, backend="eager", fullgraph=True)(*args)
    finally:
        symbolic_convert.InstructionTranslatorBase.step = original
        torch._dynamo.reset()
    return counted[0]


def test_lining_up_a_dict_of_tensors_traces_in_as_many_steps_whatever_its_size():
    """What a transformation does with its trees before and after its arithmetic (flatten the
    updates, line up the state and the params, group the tensors, rebuild) takes no traced step per
    leaf: a model's compile time does not grow with its parameter count for it."""
    from gradtx.transforms import _foreach

    def line_up(updates, mu, params):
        leaves = _foreach.leaves_of(updates, what="updates")
        groups = [indices for indices, _ in tree_lib.grouped(leaves.tensors)]
        mus = leaves.aligned(mu, what="state.mu")
        kept = tree_lib.tree_map(lambda p, u: p, params, updates)
        return leaves.rebuild(mus), kept, groups

    def steps(n: int) -> int:
        tree = {f"layers.{i}.weight": torch.ones(2) for i in reversed(range(n))}
        return _traced_steps(line_up, tree, dict(tree), dict(tree))

    small, large = steps(2), steps(40)
    assert large < small + 38 * 4, (small, large)  # (Dynamo traces the map's function once per leaf)


@settings(max_examples=60, deadline=None)
@given(plain_trees(), plain_trees())
def test_a_plain_structure_answers_as_optrees_spec(tree, other):
    spec = _spec(tree)
    leaves = optree.tree_leaves(tree, none_is_leaf=True, namespace="gradtx")
    plain = tree_lib._PlainStructure(tree, len(leaves))
    assert plain.num_leaves == spec.num_leaves and plain.num_nodes == spec.num_nodes  # the latter from optree
    assert plain == spec and not plain != spec
    rebuilt = tree_lib.unflatten(plain, leaves)
    assert _same(rebuilt, optree.tree_unflatten(spec, leaves))
    other_plain = tree_lib._PlainStructure(other, _spec(other).num_leaves)
    assert (plain == other_plain) == (spec == _spec(other)) == (plain == _spec(other))
    try:
        expected = spec.flatten_up_to(other)
    except (ValueError, TypeError):
        with pytest.raises((ValueError, TypeError)):
            plain.flatten_up_to(other)
    else:
        assert plain.flatten_up_to(other) == expected


def test_a_plain_structure_refuses_the_wrong_number_of_leaves():
    plain = tree_lib._PlainStructure({"a": torch.ones(1)}, 1)
    with pytest.raises(ValueError, match="2 leaves for a structure of 1"):
        plain.unflatten([torch.ones(1), torch.ones(1)])


@settings(max_examples=20, deadline=None)
@given(st.one_of(plain_trees(), st.builds(UserPair, plain_trees(4), st.integers(0, 3))))
def test_compiled_leaves_and_flatten_to_rebuild_give_optrees_leaves_and_tree(tree):
    """Under ``torch.compile``, ``leaves`` and ``flatten_to_rebuild`` walk a plain tree themselves;
    a user's namedtuple or a non-tensor leaf goes to optree. Either way: optree's leaves, in its
    order, and :func:`unflatten` rebuilds the tree."""
    want = optree.tree_leaves(tree, none_is_leaf=True, namespace="gradtx")

    def plus_one(x: Any) -> Any:
        return x + 1 if isinstance(x, torch.Tensor) else x

    def both(tree):
        found, structure = tree_lib.flatten_to_rebuild(tree)
        return tree_lib.leaves(tree), found, tree_lib.unflatten(structure, [plus_one(x) for x in found])

    torch._dynamo.reset()
    got_leaves, found, rebuilt = torch.compile(both, backend="eager", fullgraph=True)(tree)
    for got in (got_leaves, found):
        assert len(got) == len(want) and all(_same(x, y, leaves=_equal_leaf) for x, y in zip(got, want))
    expected = optree.tree_map(plus_one, tree, none_is_leaf=True, namespace="gradtx")
    if isinstance(tree, UserPair):  # optree's own path, which Dynamo traces through its polyfill:
        rebuilt, expected = _sorted_dicts(rebuilt), _sorted_dicts(expected)  # dicts come back key-sorted
    assert _same(rebuilt, expected, leaves=_equal_leaf)


def _sorted_dicts(tree: Any) -> Any:
    """``tree`` with every plain dict's keys in sorted order (other containers as they are)."""
    if type(tree) is dict:
        return {k: _sorted_dicts(tree[k]) for k in sorted(tree)}
    if isinstance(tree, UserPair):
        return UserPair(*map(_sorted_dicts, tree))
    if isinstance(tree, collections.OrderedDict):
        return collections.OrderedDict((k, _sorted_dicts(v)) for k, v in tree.items())
    if isinstance(tree, (list, tuple)) and type(tree) in (list, tuple):
        return type(tree)(map(_sorted_dicts, tree))
    if isinstance(tree, tuple):  # gradtx's states
        return type(tree)(*map(_sorted_dicts, tree))
    return tree


def test_dynamos_optree_rebuilds_a_dict_below_a_user_namedtuple_in_sorted_key_order():
    """Known, torch's: traced, optree's flatten and unflatten of such a tree (a user's namedtuple
    and an int leaf send gradtx's traced flatten to optree) give a dict of ``None`` leaves back
    with its keys sorted, where eager optree keeps their order (with tensor leaves the order is
    kept). When a torch release keeps it, this test fails: then compare key order again above."""
    tree = UserPair({"b": None, "a": None}, 0)

    def rebuild(tree):
        found, structure = tree_lib.flatten_to_rebuild(tree)
        return tree_lib.unflatten(structure, found)

    assert list(rebuild(tree).a) == ["b", "a"]
    torch._dynamo.reset()
    assert list(torch.compile(rebuild, backend="eager", fullgraph=True)(tree).a) == ["a", "b"]


def _equal_leaf(x: Any, y: Any) -> bool:
    if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
        return torch.equal(x, y)
    return x == y


def test_a_compiled_steps_own_flattening_traces_in_as_many_steps_whatever_the_trees_size():
    """``compile_step``'s body flattens the new params and state, and lists the inputs' leaves, to
    hand its outputs their buffers; ``map_groups`` checks that its lists form one group. None of it
    takes a traced step per leaf (optree's flatten, run by Dynamo as Python, takes dozens)."""
    from gradtx.transforms import _foreach

    def body(params, state):
        param_leaves, param_def = tree_lib.flatten_to_rebuild(params)
        state_leaves, state_def = tree_lib.flatten_to_rebuild(state)
        inputs = tree_lib.leaves(params) + tree_lib.leaves(state)
        firsts, seconds = _foreach.map_groups(lambda a, b: (a, b), param_leaves, state_leaves[1 : 1 + len(param_leaves)], outputs=2)
        return tree_lib.unflatten(param_def, firsts), tree_lib.unflatten(state_def, state_leaves), len(inputs), seconds

    def steps(n: int) -> int:
        params = {f"layers.{i}.weight": torch.ones(2) for i in reversed(range(n))}
        state = gtx.ScaleByAdamState(torch.zeros((), dtype=torch.int32), dict(params), dict(params))
        return _traced_steps(body, params, state)

    small, large = steps(2), steps(40)
    assert large < small + 38 * 2, (small, large)
