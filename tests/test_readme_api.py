"""README.md's API tables agree with the package.

Every row of the tables under ``## API`` (one per module, under ``###`` headings) is checked on its
own (one test per row, named after the row's first entry). In the first cell, each backticked
``name`` must exist (in ``gradtx``, or in the module a dotted name such as
``gradtx.sharding.ShardingSpec`` starts the row with), and a ``name(arguments)``, where a row shows
one, must show the object's whole signature: the same parameters, in the same order, of the same
kinds (``*``, ``*args``, ``**kwargs``), with equal defaults. A last test checks that every public
name of ``gradtx`` appears in the tables; tests/test_site.py checks that the API reference
documents each of them.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import math
import re
import types
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch

import gradtx
from test_import import names_declared_for_type_checkers

README = Path(__file__).resolve().parent.parent / "README.md"
_MISSING = object()


class Row(NamedTuple):
    line: int  # 1-based line number in README.md
    cell: str  # the first cell, as written


class Entry(NamedTuple):
    name: str  # as written: "clip", "gradtx.sharding.ShardingSpec"
    arguments: str | None  # the text between the first pair of parentheses, or None when not shown


def api_rows(text: str) -> list[Row]:
    """The rows of the ``| name | what it does |`` tables under ``## API`` and its ``###`` sections
    (until the next ``##`` heading), headers and rules excluded; other tables there (the
    differences from optax and torch, the timings) are not lists of names."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.strip() == "## API"), None)
    if start is None:
        raise AssertionError("README.md has no '## API' section")
    rows = []
    in_names_table = False
    for number in range(start + 1, len(lines)):
        line = lines[number]
        if line.startswith("## ") or line.startswith("# "):
            break
        if not line.startswith("|"):
            in_names_table = False
            continue
        cell = line.split(" | ")[0].lstrip("| ").strip()
        if cell == "name":
            in_names_table = True
        elif in_names_table and cell != "---":
            rows.append(Row(number + 1, cell))
    return rows


def _entries(cell: str) -> list[Entry]:
    """The backticked entries of a cell: ``name`` or ``name(arguments)...``."""
    entries = []
    for span in re.findall(r"`([^`]+)`", cell):
        match = re.match(r"[A-Za-z_][\w.]*", span)
        if match is None:
            raise AssertionError(f"cannot read the entry `{span}`")
        name, rest = match.group(), span[match.end():]
        if not rest.startswith("("):
            entries.append(Entry(name, None))
            continue
        depth = 0
        for index, char in enumerate(rest):
            depth += {"(": 1, ")": -1}.get(char, 0)
            if depth == 0:
                break
        entries.append(Entry(name, rest[1:index]))
    return entries


def _resolve(name: str, module: types.ModuleType) -> tuple[Any, types.ModuleType]:
    """The object ``name`` names, and the module later bare names of the same row resolve in."""
    if name.startswith("gradtx."):
        owner, _, attribute = name.rpartition(".")
        try:
            module = importlib.import_module(owner)
        except ImportError:
            return _MISSING, module
        return getattr(module, attribute, _MISSING), module
    return getattr(module, name, _MISSING), module


def _shown(arguments: str) -> list[tuple[str, str, Any]]:
    """``(name, kind, default)`` of each parameter in the README's argument list."""
    try:
        function = ast.parse(f"def shown({arguments}): pass").body[0]
    except SyntaxError as error:
        raise AssertionError(f"not a Python parameter list: ({arguments}): {error.msg}") from None
    namespace = {"torch": torch, "inf": math.inf, "math": math}

    def default(node: ast.expr | None) -> Any:
        if node is None:
            return inspect.Parameter.empty
        return eval(compile(ast.Expression(node), "README.md", "eval"), namespace)  # noqa: S307 - our own README

    args = function.args
    positional = args.posonlyargs + args.args
    defaults = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)
    params = [(a.arg, "POSITIONAL_ONLY", default(d)) for a, d in zip(args.posonlyargs, defaults)]
    params += [(a.arg, "POSITIONAL_OR_KEYWORD", default(d)) for a, d in zip(args.args, defaults[len(args.posonlyargs):])]
    if args.vararg:
        params.append((args.vararg.arg, "VAR_POSITIONAL", inspect.Parameter.empty))
    params += [(a.arg, "KEYWORD_ONLY", default(d)) for a, d in zip(args.kwonlyargs, args.kw_defaults)]
    if args.kwarg:
        params.append((args.kwarg.arg, "VAR_KEYWORD", inspect.Parameter.empty))
    return params


def _actual(obj: Any) -> list[tuple[str, str, Any]]:
    signature = inspect.signature(obj)
    return [(p.name, p.kind.name, p.default) for p in signature.parameters.values()]


def _same(shown: list[tuple[str, str, Any]], actual: list[tuple[str, str, Any]]) -> bool:
    if [(n, k) for n, k, _ in shown] != [(n, k) for n, k, _ in actual]:
        return False
    for (_, _, a), (_, _, b) in zip(shown, actual):
        if a is inspect.Parameter.empty or b is inspect.Parameter.empty:
            if a is not b:
                return False
        elif type(a) is not type(b) and not (isinstance(a, (int, float)) and isinstance(b, (int, float))):
            return False
        elif a != b:
            return False
    return True


def _render(obj: Any) -> str:
    """The code's signature in the README's style: no annotations, defaults as repr."""
    parts = []
    star = False
    for p in inspect.signature(obj).parameters.values():
        if p.kind is p.KEYWORD_ONLY and not star:
            parts.append("*")
        star = star or p.kind in (p.KEYWORD_ONLY, p.VAR_POSITIONAL)
        prefix = {p.VAR_POSITIONAL: "*", p.VAR_KEYWORD: "**"}.get(p.kind, "")
        parts.append(prefix + p.name + ("" if p.default is p.empty else f"={p.default!r}"))
    return "(" + ", ".join(parts) + ")"


def row_problems(cell: str) -> list[str]:
    """What in one first cell disagrees with the package (empty when the row is right)."""
    problems = []
    module: types.ModuleType = gradtx
    for entry in _entries(cell):
        obj, module = _resolve(entry.name, module)
        if obj is _MISSING:
            problems.append(f"`{entry.name}` does not exist in {module.__name__}")
            continue
        if entry.arguments is None:
            continue
        shown = f"{entry.name}({entry.arguments})"
        try:
            matches = _same(_shown(entry.arguments), _actual(obj))
        except AssertionError as error:
            problems.append(f"`{shown}`: {error}")
            continue
        if not matches:
            problems.append(f"`{shown}` but the code has {entry.name}{_render(obj)}")
    return problems


ROWS = api_rows(README.read_text())


def test_the_tables_have_rows():
    assert len(ROWS) > 20, f"README.md's API tables have only {len(ROWS)} rows"


@pytest.mark.parametrize("row", ROWS, ids=[_entries(r.cell)[0].name if _entries(r.cell) else str(r.line) for r in ROWS])
def test_api_row_matches_the_code(row: Row):
    problems = row_problems(row.cell)
    assert not problems, f"README.md line {row.line}, API row {row.cell[:60]!r}:\n  " + "\n  ".join(problems)


def test_every_public_name_is_in_the_table():
    listed = {entry.name.rpartition(".")[2] for row in ROWS for entry in _entries(row.cell)}
    public = {name for name in gradtx.__all__ if not isinstance(getattr(gradtx, name), types.ModuleType)}
    missing = sorted(public - listed)
    assert not missing, f"public names of gradtx missing from README.md's API tables: {missing}"


MODULE_SCOPED = ("gradtx.sharding", "gradtx.checkpoint", "gradtx.microbatching")  # helpers the README says are used through their module


def test_every_name_in_the_table_is_importable_from_gradtx():
    """The README's promise: every public name is importable from ``gradtx`` itself (the leaf specs
    the table shows as ``gradtx.sharding.ShardingSpec`` included), except the helpers of the modules
    it names as used through themselves."""
    missing = []
    for row in ROWS:
        module: types.ModuleType = gradtx
        for entry in _entries(row.cell):
            obj, module = _resolve(entry.name, module)
            name = entry.name.rpartition(".")[2]
            if obj is _MISSING or isinstance(obj, types.ModuleType) or getattr(gradtx, name, _MISSING) is obj:
                continue
            if module.__name__ not in MODULE_SCOPED or name in ("ShardingSpec", "Shard", "Replicate", "LeafSpec"):
                missing.append(f"{entry.name} (README.md line {row.line})")
    assert not missing, f"not importable from gradtx as the same object: {missing}"
    for name in ("ShardingSpec", "Shard", "Replicate", "LeafSpec"):
        assert getattr(gradtx, name) is getattr(gradtx.sharding, name)


def test_all_lists_every_public_name():
    """``gradtx.__all__`` is what the table is checked against: it must name everything exported,
    the names bound in the module and those it imports on first use (the names its
    ``if TYPE_CHECKING:`` block declares), and each of them must resolve."""
    for name in gradtx.__all__:
        getattr(gradtx, name)  # binds the names imported on first use
    bound = {
        name
        for name, value in vars(gradtx).items()
        if not name.startswith("_") and name not in ("annotations", "importlib", "TYPE_CHECKING")
        and not (isinstance(value, types.ModuleType) and name not in gradtx.__all__)
    }
    exported = bound | set(names_declared_for_type_checkers())
    assert exported == set(gradtx.__all__), sorted(exported ^ set(gradtx.__all__))


def test_the_check_catches_drift():
    """The checker itself: a wrong default, a missing parameter, an unknown name are reported."""
    assert row_problems("`clip_by_value(max_delta)` (alias `clip`)") == []
    assert row_problems("`trace(decay, nesterov=True, accumulator_dtype=None)`")
    assert row_problems("`trace(decay, nesterov=False)`")
    assert row_problems("`scale_by_adam(b1=0.9, b2=0.999, eps=1e-8, eps_root=0.0, mu_dtype=None, nesterov=False)`")
    assert row_problems("`no_such_transformation()`")
    assert row_problems("`gradtx.sharding.Shard(*axes, duplicate=False, dim=None)`, `NoSuchSpec`")
