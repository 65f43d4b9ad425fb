"""Dense references for sharded tests: one gradient tree built identically on every rank, cut
into each rank's pieces by a declared layout, and checks that gradtx's sharded results equal the
dense computation."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

import gradtx as gtx
from gradtx.sharding import Shard, ShardingSpec

P_VALUES = (1.0, 2.0, math.inf)


@dataclass(frozen=True)
class Piece:
    """What a rank holds of dense leaf ``source``: cut by ``splits`` = ((axes, dim), ...) in order
    (``dim=None``: flattened first, as ZeRO does), on pipeline ``stage`` (``None``: every stage)."""

    source: str
    splits: tuple[tuple[tuple[str, ...], Optional[int]], ...] = ()
    stage: Optional[int] = None
    duplicate: bool = False

    def spec(self) -> Shard:
        axes = tuple(a for axes, _ in self.splits for a in axes)
        dims = tuple(d for axes, d in self.splits for _ in axes)
        return Shard(*axes, duplicate=self.duplicate, dim=dims if axes else None)


def dense_tree(shapes: dict[str, tuple[int, ...]], seed: int = 0, dtype=torch.float32) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=gen).to(dtype) for name, shape in shapes.items()}


def coordinates(mesh) -> dict[str, int]:
    return dict(zip(mesh.mesh_dim_names, mesh.get_coordinate()))


def cut(x: torch.Tensor, piece: Piece, mesh) -> torch.Tensor:
    """This rank's part of dense tensor ``x`` under ``piece``."""
    coord = coordinates(mesh)
    sizes = dict(zip(mesh.mesh_dim_names, mesh.shape))
    for axes, dim in piece.splits:
        ordered = [a for a in mesh.mesh_dim_names if a in axes]
        index, count = 0, 1
        for axis in ordered:
            index = index * sizes[axis] + coord[axis]
            count *= sizes[axis]
        if dim is None:
            x, dim = x.reshape(-1), 0
        x = torch.tensor_split(x, count, dim)[index]
    return x.clone()


def on_my_stage(piece: Piece, mesh, stage_axis: Optional[str]) -> bool:
    return stage_axis is None or piece.stage is None or coordinates(mesh)[stage_axis] == piece.stage


def local_tree(dense: dict[str, torch.Tensor], pieces: dict[str, Piece], mesh, stage_axis=None) -> dict[str, torch.Tensor]:
    return {name: cut(dense[p.source], p, mesh) for name, p in pieces.items() if on_my_stage(p, mesh, stage_axis)}


def rules(pieces: dict[str, Piece]) -> list[tuple[str, Shard]]:
    return [(name, piece.spec()) for name, piece in pieces.items()]


def close(actual: torch.Tensor, expected: torch.Tensor, what: str, rtol: float = 2e-5, atol: float = 1e-6) -> None:
    torch.testing.assert_close(
        actual.to(torch.float64), expected.to(torch.float64), rtol=rtol, atol=atol, equal_nan=True, msg=lambda m: f"{what}: {m}"
    )


def check_layout(
    dense: dict[str, torch.Tensor],
    pieces: dict[str, Piece],
    mesh,
    spec: ShardingSpec,
    *,
    stage_axis: Optional[str] = None,
    params: Optional[dict[str, torch.Tensor]] = None,
    p_values: Sequence[float] = P_VALUES,
) -> None:
    """gradtx's sharded norms and clips of the local pieces equal the dense computation, cut alike."""
    local = local_tree(dense, pieces, mesh, stage_axis)
    for p in p_values:
        expected = gtx.global_norm(dense, norm_type=p)
        close(gtx.global_norm(local, spec, norm_type=p), expected, f"global norm p={p}")
        norms = gtx.sharding.leaf_norms(local, spec, norm_type=p)
        for name, value in norms.items():
            close(value, torch.linalg.vector_norm(dense[pieces[name].source], p), f"leaf norm {name!r} p={p}")

        max_norm = 0.5 * float(expected)
        tx = gtx.clip_by_global_norm(max_norm, spec, norm_type=p)
        clipped, state = tx.update(local, tx.init(local))
        dense_clipped, _ = gtx.clip_by_global_norm(max_norm, norm_type=p).update(dense, None)
        close(state.norm, expected, f"clip state norm p={p}")
        for name, value in clipped.items():
            close(value, cut(dense_clipped[pieces[name].source], pieces[name], mesh), f"clipped {name!r} p={p}")
        donated = {k: v.clone() for k, v in local.items()}
        clipped_inplace, _ = tx.update(donated, tx.init(local), inplace=True)
        for name, value in clipped_inplace.items():
            assert torch.equal(value, clipped[name]), f"in-place clip differs for {name!r}"

    rms = gtx.sharding.leaf_rms(local, spec)
    for name, value in rms.items():
        x = dense[pieces[name].source]
        close(value, torch.linalg.vector_norm(x) / math.sqrt(x.numel()), f"rms {name!r}")
    threshold = 0.5
    blocked, _ = gtx.clip_by_block_rms(threshold, spec).update(local, None)
    dense_blocked, _ = gtx.clip_by_block_rms(threshold).update(dense, None)
    for name, value in blocked.items():
        close(value, cut(dense_blocked[pieces[name].source], pieces[name], mesh), f"block rms {name!r}")

    if params is not None:
        local_params = local_tree(params, pieces, mesh, stage_axis)
        # torch's units (rows), optax's axis=0 (columns of a matrix) and the last dim: a sharded dim
        # the norm keeps needs no communication, a reduced one is summed over its axes
        axes = (None, 0, -1) if all(x.ndim >= 1 for x in dense.values()) else (None,)
        for axis in axes:
            agc = gtx.adaptive_grad_clip(0.05, spec=spec, axis=axis)
            clipped, _ = agc.update(local, None, local_params)
            dense_agc, _ = gtx.adaptive_grad_clip(0.05, axis=axis).update(dense, None, params)
            for name, value in clipped.items():
                close(value, cut(dense_agc[pieces[name].source], pieces[name], mesh), f"agc {name!r} axis={axis}")
