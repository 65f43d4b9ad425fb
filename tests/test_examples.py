"""Every example runs, as written, in its quick mode (``GRADTX_EXAMPLES_QUICK=1``), so none rots.

Each example runs as a user launches it, ``python examples/NAME.py`` or, for the distributed ones,
``torchrun --standalone --nproc_per_node N examples/NAME.py`` (gloo, CPU), in processes forked
from an interpreter that has imported torch, gradtx and a few heavy modules and run nothing
(``_warm``: the ranks get torchrun's environment; torchrun itself runs in
``tests/distributed/test_hybrid_parallel_example.py``).
``hybrid_parallel.py`` (4 processes) is run by ``tests/distributed/test_hybrid_parallel_example.py``;
``reshard_resume.py`` is run with ``python`` and starts its worlds of 4, 2 and 1 ranks itself. A run passes
when it exits with 0 and prints the line that shows it did its job. Examples need the
``examples`` extra (tqdm, scikit-learn); without it they are skipped, saying so.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

import _warm

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
TIMEOUT_S = 180

# name -> list of (processes: 1 for python, n for torchrun --nproc_per_node n, extra arguments,
#                  text the output must contain)
RUNS: dict[str, list[tuple[int, list[str], str]]] = {
    "quickstart.py": [(1, [], "final test accuracy")],
    "colossalai_style.py": [
        (1, ["--clip", "chain"], "grad norm before clipping"),
        (2, [], "parameters identical on all 2 ranks: True"),
    ],
    "fsdp2.py": [(2, [], "FSDP2 + gradtx matches dense training")],
    "muon_fsdp2.py": [(2, [], "Muon under FSDP2 matches the dense twin"), (4, [], "Muon under FSDP2 matches the dense twin")],
    "per_example_dp.py": [(1, [], "with DP-SGD")],
    "maml.py": [(1, [], "meta-loss decreased: True"), (1, ["--inner", "adam"], "meta-loss decreased: True")],
    "lbfgs_logistic.py": [(1, ["--quick"], "torch.optim.LBFGS  iterations to reach target")],
    "reshard_resume.py": [(1, ["--quick"], "every resumed run matches the uninterrupted one")],
    "observe.py": [(1, [], "largest per-group gradient norm at the injected step and layer: True")],
    "low_memory.py": [(1, [], "final held-out loss per variant")],
}
# Examples run with python that start several gloo processes of their own.
SPAWNS_RANKS = {"reshard_resume.py"}
# Examples whose run under torchrun is checked by a test of their own (not repeated here).
RUN_ELSEWHERE = {"hybrid_parallel.py": ROOT / "tests" / "distributed" / "test_hybrid_parallel_example.py"}

CASES = [
    pytest.param(
        name,
        nproc,
        args,
        expected,
        id=f"{name[:-3]}-{'python' if nproc == 1 else f'torchrun{nproc}'}{''.join('-' + a.lstrip('-') for a in args)}",
        marks=[pytest.mark.distributed] if nproc > 1 or name in SPAWNS_RANKS else [],
    )
    for name, runs in RUNS.items()
    for nproc, args, expected in runs
]


def _missing_extras() -> list[str]:
    return [module for module in ("sklearn", "tqdm") if importlib.util.find_spec(module) is None]


def _examples() -> list[Path]:
    """The example scripts (``_name.py`` modules are pieces the examples share, not examples)."""
    return [p for p in sorted(EXAMPLES.glob("*.py")) if not p.name.startswith("_")]


def test_every_example_is_run():
    on_disk = [p.name for p in _examples()]
    unregistered = [name for name in on_disk if name not in RUNS and name not in RUN_ELSEWHERE]
    assert not unregistered, f"examples with no quick run in tests/test_examples.py: {unregistered}"
    for name, test_file in RUN_ELSEWHERE.items():
        if (EXAMPLES / name).exists():
            assert test_file.exists() and name in test_file.read_text(), f"examples/{name}: {test_file} does not run it"


def test_every_example_is_in_the_readme_table():
    readme = (ROOT / "README.md").read_text()
    missing = [p.name for p in _examples() if f"](./examples/{p.name})" not in readme]
    assert not missing, f"examples missing from README.md's examples table: {missing}"


@pytest.mark.parametrize("name, nproc, args, expected", CASES)
def test_example_runs(name: str, nproc: int, args: list[str], expected: str):
    if not (EXAMPLES / name).exists():
        pytest.skip(f"examples/{name} is not in this checkout")
    missing = _missing_extras()
    if missing:
        pytest.skip(f"the examples need the 'examples' extra (pip install -e \".[examples]\"); missing: {missing}")
    env = dict(os.environ, GRADTX_EXAMPLES_QUICK="1", PYTHONUNBUFFERED="1")
    env.setdefault("OMP_NUM_THREADS", "1")
    result = _warm.run([EXAMPLES / name, *args], cwd=ROOT, env=env, timeout=TIMEOUT_S, nproc=nproc)
    output = result.stdout + result.stderr
    assert "terminate called" not in output, (
        f"examples/{name} {' '.join(args)}: a rank aborted at exit (a process group destroyed while an object "
        f"using it was alive?):\n{output[-4000:]}"
    )
    assert result.returncode == 0, f"examples/{name} {' '.join(args)} exited with {result.returncode}:\n{output[-4000:]}"
    assert expected in output, f"examples/{name} {' '.join(args)} did not print {expected!r}:\n{output[-4000:]}"

