"""Every example runs, as written, in its quick mode (``GRADTX_EXAMPLES_QUICK=1``), so none rots.

Each example is launched as a user would: ``python examples/NAME.py`` or, for the distributed
ones, ``torchrun --standalone --nproc_per_node 2 examples/NAME.py`` (gloo, CPU). A run passes
when it exits with 0 and prints the line that shows it did its job. Examples need the
``examples`` extra (tqdm, scikit-learn); without it they are skipped, saying so.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
TIMEOUT_S = 180

# name -> list of (launcher, extra arguments, text the output must contain)
RUNS: dict[str, list[tuple[str, list[str], str]]] = {
    "quickstart.py": [("python", [], "final test accuracy")],
    "colossalai_style.py": [
        ("python", ["--clip", "chain"], "grad norm before clipping"),
        ("torchrun", [], "parameters identical on all 2 ranks: True"),
    ],
    "fsdp2.py": [("torchrun", [], "FSDP2 + gradtx matches dense training")],
    "per_example_dp.py": [("python", [], "with DP-SGD")],
    "hybrid_parallel.py": [("torchrun", [], "")],
}

CASES = [
    pytest.param(
        name,
        launcher,
        args,
        expected,
        id=f"{name[:-3]}-{launcher}{'-' + '-'.join(a.lstrip('-') for a in args) if args else ''}",
        marks=[pytest.mark.distributed] if launcher == "torchrun" else [],
    )
    for name, runs in RUNS.items()
    for launcher, args, expected in runs
]


def _missing_extras() -> list[str]:
    return [module for module in ("sklearn", "tqdm") if importlib.util.find_spec(module) is None]


def _command(name: str, launcher: str, args: list[str]) -> list[str]:
    script = str(EXAMPLES / name)
    if launcher == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", script, *args]
    return [sys.executable, script, *args]


def test_every_example_is_run_here():
    on_disk = sorted(p.name for p in EXAMPLES.glob("*.py"))
    unregistered = [name for name in on_disk if name not in RUNS]
    assert not unregistered, f"examples with no quick run in tests/test_examples.py: {unregistered}"


@pytest.mark.parametrize("name, launcher, args, expected", CASES)
def test_example_runs(name: str, launcher: str, args: list[str], expected: str):
    if not (EXAMPLES / name).exists():
        pytest.skip(f"examples/{name} is not in this checkout")
    missing = _missing_extras()
    if missing:
        pytest.skip(f"the examples need the 'examples' extra (pip install -e \".[examples]\"); missing: {missing}")
    env = dict(os.environ, GRADTX_EXAMPLES_QUICK="1", PYTHONUNBUFFERED="1")
    env.setdefault("OMP_NUM_THREADS", "1")
    result = subprocess.run(
        _command(name, launcher, args),
        cwd=ROOT,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"examples/{name} {' '.join(args)} exited with {result.returncode}:\n{output[-4000:]}"
    assert expected in output, f"examples/{name} {' '.join(args)} did not print {expected!r}:\n{output[-4000:]}"


DOCS = ROOT / "docs"
RUNNABLE_BLOCK = "```python run\n"


@pytest.mark.parametrize("page", ["concepts.md", "migration.md"])
def test_doc_snippets_run(page: str, capsys):
    """The guides' ```python run blocks execute in order, in one namespace, as a reader would paste them."""
    text = (DOCS / page).read_text()
    blocks = [chunk.split("```", 1)[0] for chunk in text.split(RUNNABLE_BLOCK)[1:]]
    assert blocks, f"docs/{page} has no runnable blocks"
    namespace: dict = {"__name__": f"docs.{page}"}
    for index, block in enumerate(blocks):
        exec(compile(block, f"docs/{page} block {index + 1}", "exec"), namespace)
