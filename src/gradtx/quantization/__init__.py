"""Quantized optimizer state: block-wise 8-bit and 4-bit moments (and bfloat16 / float8 storage).

:func:`quantize_state` wraps any transformation; :mod:`~gradtx.quantization.maps` builds the code
books, :mod:`~gradtx.quantization.blocks` the block geometry, scales and codes on the logical tensor.
"""

from gradtx.quantization.state import QuantizedState, quantize_state

__all__ = ["QuantizedState", "quantize_state"]
