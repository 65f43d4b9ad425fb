"""gradtx.plot: the heatmap draws exactly the logged per-group norms, the clip panel the logged
coefficients, a PNG is written, and without matplotlib the error names the extra to install."""

from __future__ import annotations

import math
import sys

import numpy as np
import pytest
import torch

import gradtx as gtx
from gradtx import plot


def _history(steps=5, clip=True):
    """``observations`` dicts of a few real observed steps, the gradients of layer 1 growing."""
    gen = torch.Generator().manual_seed(0)
    params = {"layers": [{"w": torch.randn(4, 3, generator=gen)} for _ in range(3)], "head": torch.randn(3, generator=gen)}
    inner = gtx.chain(gtx.clip_by_global_norm(2.0), gtx.sgd(0.1)) if clip else gtx.sgd(0.1)
    tx = gtx.observe(inner, groups=2)
    state = tx.init(params)
    history = []
    for step in range(steps):
        grads = gtx.tree.tree_map(lambda p: torch.randn(p.shape, generator=gen), params)
        grads["layers"][1]["w"] = grads["layers"][1]["w"] * 10.0**step
        updates, state = tx.update(grads, state, params)
        params = gtx.apply_updates(params, updates)
        history.append(gtx.observations(state))
    return history


def test_group_norms_are_the_logged_values():
    history = _history()
    names, values = plot.group_norms(history)
    assert names == ["head", "layers.0", "layers.1", "layers.2"]
    assert values.shape == (4, 5)
    for row, name in enumerate(names):
        assert values[row].tolist() == [logged[f"grad_norm/{name}"] for logged in history]
    names, values = plot.group_norms(history, "prev_param_norm")
    assert values[1, 2] == history[2]["prev_param_norm/layers.0"]
    # a step that lacks a group: NaN there
    names, values = plot.group_norms([{"grad_norm/a": 1.0}, {"grad_norm/b": 2.0}])
    assert names == ["a", "b"] and math.isnan(values[0, 1]) and values[1, 1] == 2.0


def test_heatmap_draws_the_logged_values_and_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    history = _history()
    path = tmp_path / "norms.png"
    figure = plot.observed_heatmap(history, path=path, steps=range(10, 15))
    assert path.exists() and path.stat().st_size > 1000
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    heat = figure.axes[0].collections[0]
    names = [t.get_text() for t in figure.axes[0].get_yticklabels()]
    drawn = np.asarray(heat.get_array()).reshape(len(names), len(history))
    for row, name in enumerate(names):
        assert drawn[row].tolist() == [logged[f"grad_norm/{name}"] for logged in history]
    assert heat.norm.__class__.__name__ == "LogNorm"
    coefficient, rate = figure.axes[1].get_lines()
    assert coefficient.get_ydata().tolist() == [logged["clip/coefficient"] for logged in history]
    assert coefficient.get_xdata().tolist() == list(range(10, 15))
    clipped = [logged["clip/clipped"] for logged in history]
    assert rate.get_ydata().tolist() == pytest.approx([sum(clipped[: i + 1]) / (i + 1) for i in range(5)])
    import matplotlib.pyplot as plt

    plt.close(figure)
    figure = plot.observed_heatmap(_history(3, clip=False))  # no clip: the heatmap alone
    assert len(figure.axes) == 2  # the heatmap and its colour bar
    plt.close(figure)


def test_bad_history_is_a_clear_error():
    with pytest.raises(ValueError, match="history is empty"):
        plot.observed_heatmap([])
    with pytest.raises(ValueError, match="no 'grad_norm/<group>' key"):
        plot.observed_heatmap([{"grad_norm": 1.0}])
    with pytest.raises(ValueError, match="2 steps given for 1 entries"):
        plot.observed_heatmap([{"grad_norm/a": 1.0}], steps=[0, 1])


def test_without_matplotlib_the_error_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)
    with pytest.raises(ImportError, match=r"gradtx\[plot\]"):
        plot.observed_heatmap([{"grad_norm/a": 1.0}])
