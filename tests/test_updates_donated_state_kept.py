"""``inplace="updates"`` donates the updates and not the state: whatever the transformation,
the state it is given is never written, and the new state shares no memory with it.

A chain passes ``"updates"`` to every member after one that made new updates on a pure step (a
clip, a scale), so a member that wrote its state there would change the caller's state on a
pure step: its step count advanced, its moments overwritten. Checked over the catalogue of
optimizers that take donated updates and over the wrappers that pass the mode on (``quantize_state`` at 8 and 4 bits and in
bfloat16, ``masked``, ``apply_if_finite``, ``inject_hyperparams``), at each of three steps.
"""

from __future__ import annotations

import copy

import pytest
import torch

import gradtx as gtx
from gradtx import base
from gradtx import tree as tree_lib
from test_differentiable import CASES, PARAMS, _extra_args

WRAPPED = {
    "quantize_state(adamw, 8)": lambda: gtx.quantize_state(gtx.adamw(0.05, weight_decay=0.1), 8, min_size=1),
    "quantize_state(adamw, 4)": lambda: gtx.quantize_state(gtx.adamw(0.05, weight_decay=0.1), 4, min_size=1),
    "quantize_state(lion, 8)": lambda: gtx.quantize_state(gtx.lion(0.01), 8, min_size=1),
    "quantize_state(sgd, bfloat16)": lambda: gtx.quantize_state(gtx.sgd(0.1, momentum=0.9), torch.bfloat16, min_size=1),
    "masked(adamw)": lambda: gtx.masked(gtx.adamw(0.05), {"w": True, "b": False}),
    "apply_if_finite(adamw)": lambda: gtx.apply_if_finite(gtx.adamw(0.05), 3),
    "inject_hyperparams(adamw)": lambda: gtx.inject_hyperparams(gtx.adamw)(learning_rate=0.05, weight_decay=0.1),
    "chain(scale, amsgrad)": lambda: gtx.chain(gtx.scale(1.0), gtx.amsgrad(0.05)),
}
ALL = {**CASES, **WRAPPED}
# the others take no donated updates: a chain passes them a bool
DONATING = sorted(name for name, make in ALL.items() if base.takes_donated_updates(make()))


def _tensors(tree) -> list[torch.Tensor]:
    return [x for x in tree_lib.leaves(tree) if isinstance(x, torch.Tensor)]


@pytest.mark.parametrize("name", DONATING)
def test_a_step_given_updates_alone_leaves_the_state_alone(name):
    tx = ALL[name]()
    gen = torch.Generator().manual_seed(0)
    if isinstance(tx, gtx.GradientTransformationExtraArgs):  # the least-squares problem its value_fn solves
        params = {k: v.clone() for k, v in PARAMS.items()}
    else:
        params = {"w": torch.randn(6, 70, generator=gen), "b": torch.randn(70, generator=gen)}
    state = tx.init(params)
    for step in range(3):
        batch = (4,) if name == "dpsgd" else ()  # per-example gradients
        grads = {k: torch.randn(batch + p.shape, generator=gen, dtype=p.dtype) for k, p in params.items()}
        kept = copy.deepcopy(state)
        given = _tensors(state)
        updates, new_state = tx.update(grads, state, params, inplace="updates", **_extra_args(tx, params, grads))
        for before, after in zip(_tensors(kept), given):
            assert before.dtype == after.dtype and torch.equal(before, after) or (before.isnan() == after.isnan()).all(), (step, name)
        shared = {t.untyped_storage().data_ptr() for t in given if t.numel()}
        assert not {t.untyped_storage().data_ptr() for t in _tensors(new_state) if t.numel()} & shared, (step, name)
        params, state = gtx.apply_updates(params, updates), new_state
