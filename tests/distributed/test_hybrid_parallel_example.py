"""The hybrid-parallel example runs as documented (torchrun, 4 gloo processes) and its sharded
norms equal the unsharded ones, in its quick mode (2 steps, as tests/test_examples.py runs every
other example): the five interpreters' imports are most of its time, not the steps."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest

EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "hybrid_parallel.py"


@pytest.mark.distributed
def test_hybrid_parallel_example_runs_under_torchrun():
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4", str(EXAMPLE)]
    try:
        env = {**__import__("os").environ, "OMP_NUM_THREADS": "1", "GRADTX_EXAMPLES_QUICK": "1"}
        done = subprocess.run(command, capture_output=True, text=True, timeout=150, env=env)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the example ran past 150 s:\n{e.stdout}\n{e.stderr}", pytrace=False)
    assert done.returncode == 0, f"exit code {done.returncode}\n{done.stdout}\n{done.stderr[-4000:]}"
    steps = re.findall(r"sharded norm (\S+)\s+unsharded norm (\S+)", done.stdout)
    assert len(steps) == 2, done.stdout
    for sharded, unsharded in steps:
        assert abs(float(sharded) - float(unsharded)) <= 1e-5 * float(unsharded)
    assert ": equal" in done.stdout
