"""Grouping for foreach kernels at a cost independent of Python loops over the leaves: map_groups finds
one group without visiting positions one by one, and apply_updates moves no update that is on its
parameter's device already. Results and grouping are those of the position-by-position path."""

from __future__ import annotations

import torch

import gradtx as gtx
from gradtx import tree as tree_lib
from gradtx.transforms import _foreach as fe


class _CountingList(list):
    """A list that counts indexing by position (``seq[i]``), what a loop over the positions does."""

    def __init__(self, *args):
        super().__init__(*args)
        self.indexed = 0

    def __getitem__(self, index):
        if isinstance(index, int):
            self.indexed += 1
        return super().__getitem__(index)


def _record(calls):
    def fn(a, b, flags):
        calls.append((list(a), list(b), list(flags)))
        return [x + y for x, y in zip(a, b)], [x * 2 for x in a]

    return fn


def test_one_group_runs_once_without_visiting_positions():
    a = _CountingList(torch.full((2,), float(i)) for i in range(50))
    b = _CountingList(torch.ones(2) for _ in range(50))
    flags = _CountingList([True, False] * 25)
    calls = []
    sums, doubled = fe.map_groups(_record(calls), a, b, flags, outputs=2)
    assert len(calls) == 1 and len(calls[0][0]) == 50
    assert a.indexed == b.indexed == flags.indexed == 0
    for i in range(50):
        assert torch.equal(sums[i], torch.full((2,), i + 1.0)) and torch.equal(doubled[i], torch.full((2,), 2.0 * i))


def test_mixed_dtypes_still_group_by_position_in_input_order():
    a = [torch.full((2,), float(i), dtype=torch.float64 if i % 3 == 0 else torch.float32) for i in range(9)]
    b = [torch.ones(2, dtype=torch.bfloat16 if i == 4 else torch.float32) for i in range(9)]
    flags = [bool(i % 2) for i in range(9)]
    calls = []
    sums, doubled = fe.map_groups(_record(calls), a, b, flags, outputs=2)
    # (float64, float32) at 0, 3, 6; (float32, bfloat16) at 4; (float32, float32) elsewhere
    assert sorted(len(call[0]) for call in calls) == [1, 3, 5]
    for call in calls:
        assert len({t.dtype for t in call[0]}) == 1 and len({t.dtype for t in call[1]}) == 1
    for i in range(9):
        assert torch.equal(sums[i], a[i] + b[i]) and torch.equal(doubled[i], a[i] * 2)


def test_a_list_mixing_tensors_and_other_values_is_grouped_by_position():
    a = [torch.zeros(2), torch.zeros(2, dtype=torch.float64), torch.zeros(2)]
    b = [torch.ones(2), None, torch.ones(2, dtype=torch.float64)]
    calls = []

    def fn(x, y):
        calls.append(len(x))
        return ([t.dtype for t in x],)

    (dtypes,) = fe.map_groups(fn, a, b, outputs=1)
    assert sorted(calls) == [1, 1, 1]
    assert dtypes == [torch.float32, torch.float64, torch.float32]


def test_adamw_on_many_leaves_matches_leaf_by_leaf_steps():
    gen = torch.Generator().manual_seed(0)
    params = {f"p{i}": torch.randn(2, generator=gen) for i in range(300)}
    grads = {k: torch.randn(2, generator=gen) for k in params}
    tx = gtx.adamw(1e-2, weight_decay=0.1)
    updates, state = tx.update(grads, tx.init(params), params)
    for key in ("p0", "p151", "p299"):  # the same leaf alone: a group of one
        one = {key: params[key]}
        alone, alone_state = tx.update({key: grads[key]}, tx.init(one), one)
        assert torch.equal(alone[key], updates[key])
        assert torch.equal(alone_state[0].mu[key], state[0].mu[key])
        assert torch.equal(alone_state[0].nu[key], state[0].nu[key])


def test_apply_updates_moves_no_update_already_on_its_device(monkeypatch):
    params = {f"p{i}": torch.zeros(2) for i in range(100)}
    updates = {k: torch.ones(2) for k in params}
    moved = []
    original = torch.Tensor.to

    def counting_to(self, *args, **kwargs):
        moved.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", counting_to)
    new = gtx.apply_updates(params, updates)
    assert not moved
    assert all(torch.equal(new[k], torch.ones(2)) for k in params)


def test_to_devices_moves_each_tensor_to_its_counterparts_device():
    tensors = [torch.zeros(2), torch.ones(3)]
    assert all(a is b for a, b in zip(tree_lib.to_devices(tensors, tensors), tensors))
    like = [torch.empty(2, device="meta"), torch.empty(3)]
    moved = tree_lib.to_devices(tensors, like)
    assert [t.device.type for t in moved] == ["meta", "cpu"]
    assert moved[1] is tensors[1]


def test_division_of_many_small_tensors_makes_no_call_per_tensor(monkeypatch):
    gen = torch.Generator().manual_seed(1)
    params = {f"p{i}": torch.randn(3, generator=gen) for i in range(64)}
    grads = {k: torch.randn(3, generator=gen) for k in params}
    tx = gtx.adam(1e-2)
    state = tx.init(params)
    with monkeypatch.context() as m:
        m.setattr(fe, "SMALL_TENSOR", 0)  # the per-tensor out= division
        expected, _ = tx.update(grads, state, params)
    divisions = []
    original = torch.div

    def counting_div(*args, **kwargs):
        divisions.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(torch, "div", counting_div)
    for inplace in (False, True):
        donated = {k: v.clone() for k, v in grads.items()}
        updates, _ = tx.update(donated, tree_lib.tree_map(torch.clone, state), params, inplace=inplace)
        assert all(torch.equal(updates[k], expected[k]) for k in params)
    assert not divisions
