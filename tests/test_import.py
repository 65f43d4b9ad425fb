"""``import gradtx`` stays cheap: it must not pull in what costs time and a user did not ask for.

Checked by what a fresh interpreter has imported, not by timing it (timings belong in
``benchmarks/import_time.py``). Each public name is imported on first use (PEP 562); the names type
checkers read (the ``if TYPE_CHECKING:`` imports of ``gradtx/__init__.py``) are the names the
package resolves at run time, to the same objects.
"""

from __future__ import annotations

import ast
import functools
import importlib
import json
import pkgutil
import subprocess
import sys
import types
from pathlib import Path

import pytest

import gradtx

HEAVY = ["torch._dynamo"]  # seconds to import; gradtx needs it only when a step is compiled
# What a bare ``import gradtx`` must leave alone: every feature's modules (contrib alone costs more
# than the rest), and optree, which the transformations need, not the import.
NOT_ON_IMPORT = [
    "gradtx.contrib",
    "gradtx.transforms",
    "gradtx.chains",
    "gradtx.optimizers",
    "gradtx.interop",
    "gradtx.sharding",
    "gradtx.tree",
    "optree",
]


def run_python(code: str) -> str:
    """``code``'s standard output in a fresh interpreter (failing the test if it fails)."""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout


# One fresh interpreter serves every check below (each costs an ``import torch``): it imports
# torch, then gradtx, recording what each step added; then uses two names; then names public names
# every way a user can. The report is what it saw at each step.
FRESH_SESSION = """
import json, sys
report = {}
import torch
report["heavy_before"] = {m: m in sys.modules for m in HEAVY}
before = set(sys.modules)
import gradtx
report["added_by_import"] = sorted(set(sys.modules) - before)
report["heavy_after"] = {m: m in sys.modules for m in HEAVY}
report["dir"] = dir(gradtx)
report["submodules_after_dir"] = [m for m in sys.modules if m.startswith("gradtx.")]
gradtx.adamw(1e-3); gradtx.chain(gradtx.clip_by_global_norm(1.0))
report["after_two_names"] = sorted(m for m in sys.modules if m.startswith("gradtx"))
import gradtx as gtx
from gradtx import adamw, ShardingSpec, contrib
from gradtx.contrib import muon
import gradtx.contrib
import gradtx.sharding
assert gtx.contrib.muon is muon is gtx.muon
assert gtx.adamw is adamw and gtx.ShardingSpec is ShardingSpec is gradtx.sharding.ShardingSpec
assert gtx.contrib is contrib is gradtx.contrib
assert gtx.transforms.scale_by_adam is gtx.scale_by_adam  # a submodule outside __all__, as before
from gradtx import *
assert chain is gtx.chain and muon is gtx.muon
report["every_way_of_naming"] = "ok"
print(json.dumps(report))
"""


@functools.cache
def fresh_session() -> dict:
    return json.loads(run_python(f"HEAVY = {HEAVY!r}\n" + FRESH_SESSION))


def names_declared_for_type_checkers() -> dict[str, str]:
    """Each name the ``if TYPE_CHECKING:`` block of ``gradtx/__init__.py`` imports, with the module
    it names it from (``gradtx.contrib`` for ``from gradtx import contrib``)."""
    module = ast.parse(Path(gradtx.__file__).read_text())
    blocks = [
        node for node in module.body
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"
    ]
    assert len(blocks) == 1, "gradtx/__init__.py has one `if TYPE_CHECKING:` block of imports"
    declared: dict[str, str] = {}
    for node in blocks[0].body:
        assert isinstance(node, ast.ImportFrom) and node.level == 0, ast.dump(node)
        for alias in node.names:
            assert alias.asname is None and alias.name not in declared, alias.name
            declared[alias.name] = f"gradtx.{alias.name}" if node.module == "gradtx" else node.module
    return declared


@pytest.mark.parametrize("module", HEAVY)
def test_import_gradtx_does_not_import(module):
    session = fresh_session()
    assert session["heavy_before"][module] or not session["heavy_after"][module], f"import gradtx imported {module}"


def test_import_gradtx_imports_no_feature():
    imported = fresh_session()["added_by_import"]
    assert imported == ["gradtx"], f"import gradtx imported {imported}"
    assert not set(imported) & set(NOT_ON_IMPORT)


def test_a_name_imports_its_own_feature_only():
    """``gradtx.adamw`` imports the optimizers, not ``gradtx.contrib`` or the torch interop."""
    imported = set(fresh_session()["after_two_names"])
    assert {"gradtx.optimizers", "gradtx.chains"} <= imported
    assert not {"gradtx.contrib", "gradtx.interop", "gradtx.microbatching", "gradtx.projections"} & imported, imported


def test_every_way_of_naming_a_public_name_works_in_a_fresh_interpreter():
    assert fresh_session()["every_way_of_naming"] == "ok"


def test_type_checkers_read_the_names_the_package_resolves():
    declared = names_declared_for_type_checkers()
    assert set(declared) == set(gradtx.__all__), sorted(set(declared) ^ set(gradtx.__all__))
    # the run-time table names the same module as the static import (submodules need no entry)
    table = gradtx._MODULE_OF
    assert table == {name: source for name, source in declared.items() if source != f"gradtx.{name}"}
    for name, source in declared.items():
        value = getattr(gradtx, name)
        expected = importlib.import_module(source)
        if source != f"gradtx.{name}":
            expected = getattr(expected, name)
        assert value is expected, f"gradtx.{name} is {value!r}, the TYPE_CHECKING import says {expected!r}"


def test_no_public_name_is_a_submodule_that_would_replace_it():
    """Importing ``gradtx.x`` binds ``x`` in ``gradtx``: no public name may be another submodule's name."""
    submodules = {info.name for info in pkgutil.iter_modules(gradtx.__path__)}
    clashes = {
        name for name in gradtx.__all__ if name in submodules and not isinstance(getattr(gradtx, name), types.ModuleType)
    }
    assert not clashes


def test_dir_lists_every_public_name_and_submodule_before_their_import():
    session = fresh_session()
    listed, imported = set(session["dir"]), session["submodules_after_dir"]
    submodules = {info.name for info in pkgutil.iter_modules(gradtx.__path__)}
    assert set(gradtx.__all__) | submodules | {"__version__", "__all__"} <= listed
    assert not {name for name in listed if not name.startswith("_")} - set(gradtx.__all__) - submodules
    assert not imported, "dir(gradtx) imported submodules"
    assert set(dir(gradtx)) == listed  # the same once everything is imported


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="module 'gradtx' has no attribute 'no_such_name'"):
        gradtx.no_such_name
    assert not hasattr(gradtx, "__wrapped__")
    with pytest.raises(ImportError, match="no_such_name"):
        exec("from gradtx import no_such_name", {})


def test_a_submodule_that_fails_to_import_says_why(tmp_path, monkeypatch):
    """A dependency missing inside a submodule is that ModuleNotFoundError, not "no attribute"."""
    (tmp_path / "needs_a_missing_dependency.py").write_text("import no_such_dependency_of_gradtx\n")
    monkeypatch.setattr(gradtx, "__path__", [*gradtx.__path__, str(tmp_path)])
    with pytest.raises(ModuleNotFoundError, match="no_such_dependency_of_gradtx"):
        gradtx.needs_a_missing_dependency
    assert "gradtx.needs_a_missing_dependency" not in sys.modules


def test_threads_touching_names_first_at_once_all_get_them():
    """Lazy imports run one at a time: gradtx's subpackages import one another, and two threads
    importing two of them at once would otherwise each wait for the other's module (Python then
    hands one of them a half-built module: an ImportError or a KeyError)."""
    code = """
import threading, gradtx as gtx
names = ["chain", "adamw", "clip_by_global_norm", "wrap", "observe", "lion", "masked", "contrib"]
errors, barrier = [], threading.Barrier(len(names))
def touch(name):
    barrier.wait()
    try:
        getattr(gtx, name)
    except BaseException as exc:
        errors.append(f"{name}: {type(exc).__name__}: {exc}")
threads = [threading.Thread(target=touch, args=(n,)) for n in names]
[t.start() for t in threads]
[t.join() for t in threads]
print(errors)
"""
    for _ in range(3):  # a race: each fresh interpreter is one more chance to lose it
        assert run_python(code).strip().splitlines()[-1] == "[]"
