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
from gradtx.transforms.per_example import per_example_global_norm_clip, per_example_layer_norm_clip

__all__ = [
    "ClipByGlobalNormState",
    "adaptive_grad_clip",
    "clip",
    "clip_by_block_rms",
    "clip_by_global_norm",
    "clip_by_value",
    "global_norm",
    "per_example_global_norm_clip",
    "per_example_layer_norm_clip",
    "unitwise_norm",
]
