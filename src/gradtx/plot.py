"""Pictures of what :func:`gradtx.observe` recorded: per-group gradient norms over steps, and the clip.

Reads a list of :func:`gradtx.observations` dicts (one per step, as a training loop collects them)
and draws them with matplotlib, an optional dependency (``pip install gradtx[plot]``), imported
only when a picture is asked for.
"""

from __future__ import annotations

import math
import os
import sys
from typing import Any, Mapping, Optional, Sequence, Union

import numpy as np


def _pyplot() -> Any:
    try:
        import matplotlib

        if "matplotlib.pyplot" not in sys.modules:
            matplotlib.use("Agg")  # no display needed; a backend already chosen is left alone
        import matplotlib.pyplot as plt
    except ImportError as error:
        raise ImportError(
            "gradtx.plot draws with matplotlib, which is not installed: pip install 'gradtx[plot]' (or matplotlib)"
        ) from error
    return plt


def group_norms(history: Sequence[Mapping[str, float]], statistic: str = "grad_norm") -> tuple[list[str], np.ndarray]:
    """``(groups, values)``: the groups that ``history`` (a list of :func:`gradtx.observations`
    dicts, one per step) reports ``statistic`` for (``"grad_norm/<group>"`` keys), in the order of
    first appearance, and a ``groups x steps`` array of their values (NaN where a step lacks one).
    This is the heatmap's data."""
    prefix = statistic + "/"
    groups: dict[str, None] = {}
    for logged in history:
        for key in logged:
            if key.startswith(prefix):
                groups.setdefault(key[len(prefix):], None)
    names = list(groups)
    values = np.full((len(names), len(history)), math.nan)
    for step, logged in enumerate(history):
        for row, name in enumerate(names):
            values[row, step] = logged.get(prefix + name, math.nan)
    return names, values


def observed_heatmap(
    history: Sequence[Mapping[str, float]],
    *,
    statistic: str = "grad_norm",
    steps: Optional[Sequence[int]] = None,
    path: Union[None, str, "os.PathLike[str]"] = None,
    title: Optional[str] = None,
) -> Any:
    """A heatmap of each group's ``statistic`` over steps (log colour scale), above the clip's
    coefficient and running clip rate over the same steps; returns the matplotlib ``Figure``.

    Args:
      history: one :func:`gradtx.observations` dict per step (keys without a ``prefix``).
      statistic: which per-group statistic to draw (``"grad_norm"``, ``"prev_param_norm"``, ...).
      steps: the step numbers of ``history``'s entries (default ``0, 1, ...``).
      path: where to save the picture as a PNG, if given.
      title: the figure's title.

    The lower panel is drawn when the steps carry ``clip/coefficient`` (an observed
    ``clip_by_global_norm``); the clip rate is the fraction of steps so far that clipped.
    Raises ``ValueError`` when ``history`` is empty or reports no group.
    """
    if not history:
        raise ValueError("observed_heatmap: history is empty (give one gradtx.observations dict per step)")
    names, values = group_norms(history, statistic)
    if not names:
        raise ValueError(f"observed_heatmap: no '{statistic}/<group>' key in history; observe with groups=... to have groups")
    steps = list(range(len(history))) if steps is None else list(steps)
    if len(steps) != len(history):
        raise ValueError(f"observed_heatmap: {len(steps)} steps given for {len(history)} entries of history")
    plt = _pyplot()
    from matplotlib.colors import LogNorm

    has_clip = all("clip/coefficient" in logged for logged in history)
    heights = [max(2.0, 0.3 * len(names)), 1.5] if has_clip else [max(2.0, 0.3 * len(names))]
    figure, axes = plt.subplots(
        len(heights), 1, figsize=(8, 1.2 + sum(heights)), sharex=True, squeeze=False, layout="constrained",
        gridspec_kw={"height_ratios": heights},
    )
    x = np.asarray(steps, dtype=float)
    middles = (x[1:] + x[:-1]) / 2 if len(x) > 1 else np.empty(0)
    first, last = (x[0] - (middles[0] - x[0]), x[-1] + (x[-1] - middles[-1])) if len(x) > 1 else (x[0] - 0.5, x[0] + 0.5)
    edges = np.concatenate([[first], middles, [last]])
    ax = axes[0, 0]
    positive = values[np.isfinite(values) & (values > 0)]
    norm = LogNorm(vmin=positive.min(), vmax=positive.max()) if positive.size else None
    masked = np.ma.masked_where(~np.isfinite(values) | (values <= 0), values)
    image = ax.pcolormesh(edges, np.arange(len(names) + 1) - 0.5, masked, norm=norm, cmap="viridis", shading="flat")
    ax.set_yticks(range(len(names)), names)
    ax.set_ylim(len(names) - 0.5, -0.5)  # the first group on top
    ax.set_ylabel("group")
    ax.set_title(title or f"{statistic} per group")
    figure.colorbar(image, ax=list(axes[:, 0]), label=f"{statistic} (log scale)")
    if has_clip:
        clip_ax = axes[1, 0]
        coefficient = np.array([logged["clip/coefficient"] for logged in history])
        clipped = np.array([logged.get("clip/clipped", float(c < 1.0)) for logged, c in zip(history, coefficient)])
        rate = np.cumsum(clipped) / np.arange(1, len(clipped) + 1)
        clip_ax.plot(x, coefficient, label="clip coefficient", marker=".")
        clip_ax.plot(x, rate, label="clip rate so far", linestyle="--")
        clip_ax.set_ylim(0.0, 1.05)
        clip_ax.set_ylabel("clip")
        clip_ax.legend(loc="lower left", fontsize="small")
    bottom = axes[-1, 0]
    bottom.xaxis.get_major_locator().set_params(integer=True)
    bottom.set_xlim(edges[0], edges[-1])
    bottom.set_xlabel("step")
    if path is not None:
        figure.savefig(os.fspath(path), format="png", dpi=100)
    return figure
