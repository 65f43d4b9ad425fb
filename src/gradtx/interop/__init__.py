"""Bridges to torch: a chain around any torch optimizer (``wrap`` / ``ChainedOptimizer``), and any
torch optimizer as a transformation (``from_torch``, with torch's own kernels where they exist)."""

from gradtx.interop.from_torch import FromTorchState, from_torch
from gradtx.interop.wrap import ChainedOptimizer, wrap

__all__ = ["ChainedOptimizer", "FromTorchState", "from_torch", "wrap"]
