"""Suite-wide pytest hooks."""

from __future__ import annotations

import gc
import os

# quantize_state compiles its code book loops for leaves of 2**16 values and more, tens of seconds
# on a first step; the suite runs them eagerly (the same numbers), and
# tests/test_quantization_streaming.py compiles them once
os.environ.setdefault("GRADTX_QUANTIZE_COMPILE", "0")


def pytest_collection_finish(session) -> None:
    """Moves what collection imported (torch, gradtx, hypothesis and every test module) out of the
    garbage collector's sight: each full collection would walk those objects again, thousands of
    times over the suite (about 15% of the CPU time of the small tests). Nothing collection made
    is garbage: it stays alive for the whole session anyway."""
    gc.collect()
    gc.freeze()
