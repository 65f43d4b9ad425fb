"""The API reference site: it builds with warnings as errors, and it documents every public name.

The reference pages (``docs/api/*.rst``) list names in ``.. api::`` blocks (``docs/_ext/gradtx_api.py``):
each line ``name`` (documented there from its docstring) or ``name -> target`` (the same object as
``target``, documented there). The static test reads those blocks, so it runs without Sphinx; the
build test runs Sphinx as the README says (``python -m sphinx -W --keep-going -b html docs ...``)
and checks the object inventory of the built site as well.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import os
import re
import sys
import types
import zlib
from pathlib import Path
from typing import Any, Iterable

import pytest

import _warm
import gradtx

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"


def _conf_value(name: str) -> Any:
    """A literal assigned in docs/conf.py, read without running it."""
    for node in ast.parse((DOCS / "conf.py").read_text()).body:
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == [name]:
            return ast.literal_eval(node.value)
    raise KeyError(f"docs/conf.py assigns no {name}")


# The modules whose public names the site documents (gradtx, and those used through themselves):
# the modules the site looks bare names up in.
MODULES = _conf_value("site_name_modules")


def api_entries(text: str) -> list[tuple[str, str | None]]:
    """``(full name, full target or None)`` for every line of every ``.. api::`` block of a page."""
    entries: list[tuple[str, str | None]] = []
    module: str | None = None
    in_block = False
    for line in text.splitlines():
        current = re.match(r"\.\. currentmodule:: (\S+)", line)
        if current:
            module, in_block = current.group(1), False
            continue
        if line.startswith(".. api::"):
            if module is None:
                raise ValueError("an api block before any '.. currentmodule::'")
            in_block = True
            continue
        if in_block and line and not line[0].isspace():
            in_block = False
        if not in_block or not line.strip() or line.strip().startswith(":"):
            continue
        name, _, target = (part.strip() for part in line.partition("->"))
        full_target = None if not target else target if target.startswith("gradtx.") else f"{module}.{target}"
        entries.append((f"{module}.{name}", full_target))
    return entries


def _resolve(path: str) -> Any:
    owner, _, name = path.rpartition(".")
    return getattr(importlib.import_module(owner), name)


def _has_own_docs(obj: Any) -> bool:
    """Whether ``obj`` is a function or class of ours, rather than a value such as ``typing.Any``."""
    return (inspect.isclass(obj) or inspect.isroutine(obj)) and getattr(obj, "__module__", None) != "typing"


def public_names() -> list[str]:
    names = []
    for module_name in MODULES:
        module = importlib.import_module(module_name)
        for name in module.__all__:
            if not isinstance(getattr(module, name), types.ModuleType):
                names.append(f"{module_name}.{name}")
    return names


def undocumented(documented: Iterable[str]) -> list[str]:
    """The public names the site does not document. A function or class counts as documented
    under any of its names (``gradtx.muon`` is documented as ``gradtx.contrib.muon``); a value (a
    type alias such as ``gradtx.Params``, which is ``typing.Any`` as ``gradtx.Updates`` is) only
    under its own name, in any module that exports it (``gradtx.Schedule``, ``gradtx.schedules.Schedule``)."""
    documented = set(documented)
    objects, values = set(), set()
    for path in documented:
        try:
            obj = _resolve(path)
        except (ImportError, AttributeError):
            continue
        objects.add(id(obj))
        values.add((path.rpartition(".")[2], id(obj)))
    missing = []
    for path in public_names():
        obj = _resolve(path)
        if _has_own_docs(obj):
            if path in documented or id(obj) in objects:
                continue
        elif path in documented or (path.rpartition(".")[2], id(obj)) in values:
            continue
        missing.append(path)
    return missing


def page_entries() -> list[tuple[str, str | None]]:
    return [entry for page in sorted((DOCS / "api").glob("*.rst")) for entry in api_entries(page.read_text())]


def test_every_public_name_has_a_reference_entry():
    entries = page_entries()
    missing = undocumented(name for name, target in entries if target is None)
    assert not missing, f"public names no docs/api/*.rst page documents (add them to an '.. api::' block): {missing}"


def test_every_entry_names_an_existing_object():
    wrong = []
    for name, target in page_entries():
        try:
            obj = _resolve(name)
            if target is not None and _resolve(target) is not obj:
                wrong.append(f"{name} is not {target}")
        except (ImportError, AttributeError):
            wrong.append(f"{name} does not exist")
    assert not wrong, wrong


def test_the_check_catches_a_missing_name():
    """The checker itself: a page without ``adamw`` leaves it undocumented; an alias entry alone
    documents nothing, and a function documented under another module's name counts."""
    page = ".. currentmodule:: gradtx\n\n.. api::\n   :module-doc: gradtx.base\n\n   adam\n   clip -> clip_by_value\n"
    assert api_entries(page) == [("gradtx.adam", None), ("gradtx.clip", "gradtx.clip_by_value")]
    documented = [name for name, target in api_entries(page) if target is None]
    missing = undocumented(documented)
    assert "gradtx.adamw" in missing and "gradtx.adam" not in missing and "gradtx.clip" in missing
    assert "gradtx.muon" not in undocumented(["gradtx.contrib.muon"])
    assert "gradtx.Updates" in undocumented(["gradtx.Params"])  # the same object (Any), another name


def _inventory(path: Path) -> dict[str, str]:
    """``{name: "domain:role"}`` from a Sphinx ``objects.inv`` (four header lines, then zlib)."""
    data = path.read_bytes()
    body = data.split(b"\n", 4)[4]
    inventory = {}
    for line in zlib.decompress(body).decode().splitlines():
        match = re.match(r"(.+?)\s+(\S+:\S+)\s+-?\d+\s", line)
        if match:
            inventory[match.group(1)] = match.group(2)
    return inventory


# What ``python -m sphinx`` runs (sphinx/__main__.py).
SPHINX_MAIN = "import sys\nfrom sphinx.cmd.build import main\n\nraise SystemExit(main(sys.argv[1:]))\n"


def test_the_site_builds_without_warnings(tmp_path: Path):
    pytest.importorskip("sphinx", reason="the docs extra (sphinx, myst-parser, furo) is not installed")
    pytest.importorskip("myst_parser", reason="the docs extra (sphinx, myst-parser, furo) is not installed")
    pytest.importorskip("furo", reason="the docs extra (sphinx, myst-parser, furo) is not installed")
    out = tmp_path / "html"
    # python -m sphinx, in a process forked from the interpreter that runs the docs' code (torch and
    # gradtx imported once, for all of them: _warm).
    script = tmp_path / "sphinx_main.py"
    script.write_text(SPHINX_MAIN)
    args = ["-W", "--keep-going", "-q", "-b", "html", str(DOCS), str(out)]
    done = _warm.run([str(script), *args], cwd=ROOT, env=dict(os.environ), timeout=600)
    assert done.returncode == 0, f"sphinx build failed (exit {done.returncode}):\n{done.stderr[-6000:]}"
    for page in ("index", "concepts", "sharding", "benchmarks", "api/optimizers", "api/sharding"):
        assert (out / f"{page}.html").exists(), page
    inventory = _inventory(out / "objects.inv")
    python_objects = [name for name, role in inventory.items() if role.startswith("py:")]
    missing = undocumented(python_objects)
    assert not missing, f"public names the built site does not document: {missing}"
    for name, target in page_entries():
        assert name in inventory, f"{name} has no entry in the built site"
    assert inventory["gradtx.adamw"] == "py:function" and inventory["gradtx.sharding.ShardingSpec"] == "py:class"
    # The README's tables link each name to its entry (a bare name found in the module that has it).
    index = (out / "index.html").read_text()
    for href in ("api/optimizers.html#gradtx.adamw", "api/sharding.html#gradtx.sharding.leaf_norms"):
        assert f'href="{href}"' in index, href
    # Each api block opens with a table of its names and their summaries, as autosummary makes them:
    # a docstring's first sentence, a value's docstring under its assignment, nothing for a class
    # under another name (ClipState is EmptyState) or a generated NamedTuple docstring (a signature).
    summaries = {
        **_summary_rows(out / "api/optimizers.html"), **_summary_rows(out / "api/interop.html"),
        **_summary_rows(out / "api/transforms.html"),
    }
    assert summaries["adamw"] == "AdamW: Adam with weight decay decoupled from the gradient."
    assert summaries["STATE_KEY"].startswith("The key, in the first param group of a ChainedOptimizer state dict")
    assert summaries["ClipState"] == summaries["ScaleByRmsWithCountState"] == ""


def _summary_rows(page: Path) -> dict[str, str]:
    """``{name: summary}`` from the rows of a built page's summary tables (their text, tags dropped)."""
    rows = re.findall(r'<tr class="row-(?:odd|even)"><td><p>(.*?)</td>\s*<td><p>(.*?)</p></td>', page.read_text(), re.S)
    return {re.sub("<.*?>", "", name).strip(): re.sub("<.*?>", "", summary).strip() for name, summary in rows}


def test_fenced_examples_in_docstrings_become_code_blocks():
    pytest.importorskip("sphinx", reason="the docs extra (sphinx, myst-parser, furo) is not installed")
    sys.path.insert(0, str(DOCS / "_ext"))
    try:
        from gradtx_site import fenced_to_code_block
    finally:
        sys.path.remove(str(DOCS / "_ext"))
    lines = ["Text.", "", "```python", "x = 1", "", "    y = 2", "```", "after"]
    assert fenced_to_code_block(lines) == [
        "Text.", "", ".. code-block:: python", "", "   x = 1", "", "       y = 2", "", "after",
    ]
    with pytest.raises(ValueError, match="not closed"):
        fenced_to_code_block(["```python", "x = 1"])
