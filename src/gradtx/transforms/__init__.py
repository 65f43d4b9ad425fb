"""Gradient transformations, one module per family."""

from gradtx.transforms.clipping import (
    ClipByGlobalNormState,
    adaptive_grad_clip,
    clip,
    clip_by_block_rms,
    clip_by_global_norm,
    clip_by_value,
    global_norm,
    unitwise_norm,
)

__all__ = [
    "ClipByGlobalNormState",
    "adaptive_grad_clip",
    "clip",
    "clip_by_block_rms",
    "clip_by_global_norm",
    "clip_by_value",
    "global_norm",
    "unitwise_norm",
]
