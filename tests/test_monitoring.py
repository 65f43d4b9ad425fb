"""snapshot, monitor, measure_with_ema, get_measurement."""

import pytest
import torch
from combinator_helpers import clone, make_tree, run_both_paths, running_sum, scale_by

import gradtx as gtx


def _grads(step: int) -> dict:
    return make_tree(seed=step)


def test_snapshot_records_the_norm_at_its_place_in_the_chain():
    params = make_tree()
    tx = gtx.chain(
        scale_by(3.0),
        gtx.snapshot("norm_before_clip", gtx.global_norm),
        gtx.clip_by_global_norm(0.5),
        gtx.snapshot("norm_after_clip", gtx.global_norm),
    )
    state = tx.init(params)
    assert isinstance(state[1], gtx.SnapshotState)
    grads = _grads(0)
    updates, state = tx.update(grads, state, params)
    torch.testing.assert_close(gtx.get_measurement(state, "norm_before_clip"), 3.0 * gtx.global_norm(grads))
    torch.testing.assert_close(gtx.get_measurement(state, "norm_after_clip"), gtx.global_norm(updates))
    torch.testing.assert_close(gtx.get_measurement(state, "norm_after_clip"), torch.tensor(0.5), rtol=1e-5, atol=1e-6)
    with pytest.raises(KeyError, match="missing"):
        gtx.get_measurement(state, "missing")


def test_monitor_with_plain_and_ema_measures():
    params = {"w": torch.zeros(2)}
    decay = 0.9
    tx = gtx.chain(
        gtx.monitor(
            {
                "norm": gtx.global_norm,
                "big_ema": gtx.measure_with_ema(lambda u: gtx.global_norm(u) > 2.0, decay=decay),
                "norm_ema_raw": gtx.measure_with_ema(gtx.global_norm, decay=decay, debias=False),
            }
        ),
        gtx.clip_by_global_norm(1.0),
    )
    state = tx.init(params)
    assert set(state[0].measurements) == {"norm", "big_ema", "norm_ema_raw"}  # final structure from init
    norms = [1.0, 5.0, 3.0, 0.5]
    ema, raw = 0.0, 0.0
    for step, norm in enumerate(norms, start=1):
        _, state = tx.update({"w": torch.tensor([norm, 0.0])}, state, params)
        ema = decay * ema + (1 - decay) * float(norm > 2.0)
        raw = decay * raw + (1 - decay) * norm
        torch.testing.assert_close(gtx.get_measurement(state, "norm"), torch.tensor(norm))
        torch.testing.assert_close(gtx.get_measurement(state, "big_ema"), torch.tensor(ema / (1 - decay**step)))
        torch.testing.assert_close(gtx.get_measurement(state, "norm_ema_raw"), torch.tensor(raw))


def test_measurements_survive_later_in_place_transforms():
    params = make_tree()
    tx = gtx.chain(
        gtx.snapshot("raw", lambda u: u["head"]),  # the update tensor itself
        gtx.monitor({"view": lambda u: u["layer"]["w"][0]}),  # a view of one
        gtx.clip_by_value(0.01),  # overwrites the donated updates in place
    )
    grads = _grads(0)
    expected_head, expected_row = grads["head"].clone(), grads["layer"]["w"][0].clone()
    _, state = tx.update(clone(grads), tx.init(params), params, inplace=True)
    torch.testing.assert_close(gtx.get_measurement(state, "raw"), expected_head)
    torch.testing.assert_close(gtx.get_measurement(state, "view"), expected_row)


def test_pure_and_donated_paths_agree():
    params = make_tree()
    tx = gtx.chain(
        running_sum(),
        gtx.monitor({"n": gtx.global_norm, "ema": gtx.measure_with_ema(gtx.global_norm, 0.5)}),
        gtx.snapshot("head", lambda u: u["head"]),
        scale_by(-0.1),
    )
    run_both_paths(tx, params, [_grads(i) for i in range(3)])
