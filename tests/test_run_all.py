"""benchmarks/run_all.py's selection: what it skips and why, its exit status, and that it writes
results only with ``--write``. No benchmark runs: ``run`` and the module probe are replaced."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCH_DIR = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.fixture()
def run_all(monkeypatch):
    if not (BENCH_DIR / "run_all.py").exists():
        pytest.skip("benchmarks/run_all.py is not in this checkout")
    spec = importlib.util.spec_from_file_location("gradtx_bench_run_all", BENCH_DIR / "run_all.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_required_modules_are_the_module_level_third_party_imports(run_all):
    source = "\n".join([
        "from __future__ import annotations", "import os, json", "import numpy as np", "import jax.numpy as jnp",
        "from optax import chain", "import torch", "import gradtx as gtx", "from common import report",
        "try:", "    import torchopt", "except ImportError:", "    torchopt = None",
        "def f():", "    import matplotlib",
    ])
    assert run_all.required_modules(source) == ["numpy", "jax", "optax", "torch"]
    assert {"jax", "optax"} <= set(run_all.required_modules((BENCH_DIR / "optax_agreement.py").read_text()))


def test_missing_modules_probes_without_importing(run_all):
    assert run_all.missing_modules(["os", "no_such_module_here"], sys.executable) == ["no_such_module_here"]


def _outcome(name: str, returncode: int):
    from types import SimpleNamespace

    return SimpleNamespace(script=name, command=["python", name], seconds=0.0, returncode=returncode, output="", tables=[])


def test_quick_skips_what_cannot_import_and_writes_nothing(run_all, monkeypatch, tmp_path, capsys):
    calls: list[str] = []
    monkeypatch.setattr(run_all, "run", lambda script, **kw: calls.append(script.name) or _outcome(script.name, 0))
    monkeypatch.setattr(run_all, "missing_modules", lambda modules, python: [m for m in modules if m in ("jax", "optax")])
    status = run_all.main(["--quick", "--out", str(tmp_path)])
    output = capsys.readouterr().out
    assert status == 0
    assert "optax_agreement.py" not in calls and "adamw.py" in calls
    assert "skipped optax_agreement.py: needs jax, optax" in output
    assert "results not written" in output
    assert list(tmp_path.iterdir()) == []


def test_write_records_skips_and_a_failure_exits_1(run_all, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(run_all, "run", lambda script, **kw: _outcome(script.name, 1 if script.name == "wrap.py" else 0))
    monkeypatch.setattr(run_all, "missing_modules", lambda modules, python: ["jax"] if "jax" in modules else [])
    status = run_all.main(["--quick", "--write", "--out", str(tmp_path), "--only", "optax_agreement.py", "wrap.py"])
    output = capsys.readouterr().out
    assert status == 1 and "failed: ['wrap.py']" in output
    results = (tmp_path / "results.md").read_text()
    assert "## `optax_agreement.py`" in results and "Skipped: needs jax" in results
    assert "## `wrap.py`" in results and "Failed (exit 1)" in results
