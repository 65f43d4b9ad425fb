"""``import gradtx`` stays cheap: it must not pull in what costs seconds and a user did not ask for.

Checked by what a fresh interpreter has imported, not by timing it (timings belong in benchmarks).
"""

from __future__ import annotations

import subprocess
import sys

import pytest

HEAVY = ["torch._dynamo"]  # seconds to import; gradtx needs it only when a step is compiled


@pytest.mark.parametrize("module", HEAVY)
def test_import_gradtx_does_not_import(module):
    code = f"import sys, torch; before = {module!r} in sys.modules; import gradtx; print(before, {module!r} in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    before, after = result.stdout.split()
    assert before == "True" or after == "False", f"import gradtx imported {module}"
