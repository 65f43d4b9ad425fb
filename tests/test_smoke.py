"""The package imports and the quickstart chain runs: a first line of defence."""

import torch

import gradtx as gtx


def test_chain_clips_and_logs_norm():
    grads = {"w": torch.full((4,), 3.0), "b": None}
    tx = gtx.chain(gtx.clip_by_global_norm(1.0))
    updates, state = tx.update(grads, tx.init(grads))
    torch.testing.assert_close(state[0].norm, torch.tensor(6.0))
    torch.testing.assert_close(gtx.global_norm(updates), torch.tensor(1.0), rtol=1e-6, atol=1e-6)
    assert updates["b"] is None
