"""The ``api`` directive: one list of public names becomes a summary table and their reference entries.

With ``:module-doc: gradtx.transforms.clipping``, the module's docstring comes first (the module
that defines the names, whose docstring says what they are for).

Each line of the directive's content is a name in the current module (``.. currentmodule::``):

- ``name``: documented from the code, as a function, a class (with its documented public members)
  or a value (a type alias, whose docstring is the string literal under its assignment);
- ``name -> target``: the same object as ``target`` (a name in the current module, or a dotted
  ``gradtx...`` path), documented there; here an entry says so and links to it.

A name that is another name of an object the current module also exports (``clip`` for
``clip_by_value``) is written ``clip -> clip_by_value``; the build fails on such a name written
alone, so no object is documented twice.
"""

from __future__ import annotations

import importlib
import inspect
import re
import sys
from typing import Any

from docutils import nodes
from docutils.parsers.rst import directives
from docutils.statemachine import StringList
from sphinx.ext.autosummary import Autosummary, extract_summary
from sphinx.pycode import ModuleAnalyzer
from sphinx.util.docstrings import prepare_docstring
from sphinx.util.docutils import SphinxDirective
from sphinx.util.inspect import getdoc
from sphinx.util.nodes import nested_parse_with_titles


def _module_of(directive: SphinxDirective) -> str:
    module = directive.env.ref_context.get("py:module")
    if not module:
        raise directive.error("the api directive needs a '.. currentmodule::' before it")
    return module


def _resolve(path: str) -> Any:
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def _value_doc(obj: Any, name: str) -> list[str]:
    """The docstring under ``name = ...`` in the gradtx module that first binds ``obj`` to ``name``."""
    for modname in sorted(m for m in sys.modules if m == "gradtx" or m.startswith("gradtx.")):
        if getattr(sys.modules[modname], name, None) is not obj:
            continue
        docs = ModuleAnalyzer.for_module(modname).find_attr_docs().get(("", name))
        if docs:
            return list(docs)
    return []


def _kind(obj: Any) -> str:
    if getattr(obj, "__module__", None) == "typing":  # an alias (``Params = Any``), not a class of ours
        return "data"
    if inspect.isclass(obj):
        return "class"
    if inspect.isroutine(obj):
        return "function"
    return "data"


class Api(SphinxDirective):
    has_content = True
    option_spec = {"module-doc": directives.unchanged_required}

    def run(self) -> list[nodes.Node]:
        module = _module_of(self)
        entries: list[tuple[str, str | None]] = []
        for line in self.content:
            if not line.strip():
                continue
            name, _, target = (part.strip() for part in line.partition("->"))
            entries.append((name, target or None))
        lines = []
        if "module-doc" in self.options:  # automodule sets the current module: set it back after
            lines += [f".. automodule:: {self.options['module-doc']}", "   :no-index:", "", f".. currentmodule:: {module}", ""]
        lines += [".. api-summary::", ""]
        lines += [f"   {name}" for name, _ in entries]
        lines.append("")
        for name, target in entries:
            lines += self._entry(module, name, target)
        node = nodes.container(classes=["gradtx-api"])
        nested_parse_with_titles(self.state, StringList(lines, source=self.get_source_info()[0]), node)
        return node.children

    def _entry(self, module: str, name: str, target: str | None) -> list[str]:
        try:
            obj = _resolve(f"{module}.{name}")
        except (ImportError, AttributeError) as error:
            raise self.error(f"{module}.{name} does not exist: {error}") from None
        kind = _kind(obj)
        role = {"class": "class", "function": "func", "data": "data"}[kind]
        if target is not None:
            full = target if target.startswith("gradtx.") else f"{module}.{target}"
            if _resolve(full) is not obj:
                raise self.error(f"{module}.{name} is not the same object as {full}")
            return [f".. py:{kind}:: {name}", "", f"   The same object as :{role}:`{full}`.", ""]
        own = getattr(obj, "__name__", name)
        if kind != "data" and own != name and getattr(sys.modules[module], own, None) is obj:
            raise self.error(f"{module}.{name} is {module}.{own}: write '{name} -> {own}'")
        if kind == "class":
            fields = ",".join(getattr(obj, "_fields", ()))
            options = ["   :members:"] + ([f"   :exclude-members: {fields}"] if fields else [])
            return [f".. autoclass:: {name}", *options, ""]
        if kind == "function":
            return [f".. autofunction:: {name}", ""]
        doc = _value_doc(obj, name)
        if not doc:
            raise self.error(f"{module}.{name} is a value with no docstring under its assignment")
        return [f".. py:data:: {name}", "", *(f"   {line}" for line in doc), ""]


class ApiSummary(Autosummary):
    """``autosummary``'s table of an ``api`` block's names (``:nosignatures:``), each with the first
    sentence of the docstring ``autodoc`` gives that name (``_summary_lines``).

    ``autosummary`` itself loads each object as ``autodoc`` does, formatting every signature again
    for a table that shows none: a tenth of the site's build.
    """

    def get_items(self, names: list[str]) -> list[tuple[str, str | None, str, str]]:
        module = _module_of(self)
        settings = self.state.document.settings
        items: list[tuple[str, str | None, str, str]] = []
        for name in names:
            full = f"{module}.{name}"
            obj = _resolve(full)
            items.append((name, None, extract_summary(self._summary_lines(module, name, obj), settings), full))
        return items

    def _summary_lines(self, module: str, name: str, obj: Any) -> list[str]:
        """The docstring ``autodoc`` documents ``module.name`` with, processed as for its entry.

        A class under another name than its own is documented as a value, without its docstring; a
        value by the docstring under its assignment in ``module``; a first line that is a signature
        (a NamedTuple's generated docstring) is taken as the signature, not as text.
        """
        if inspect.isclass(obj) and obj.__name__ != name:
            return []
        if not (inspect.isclass(obj) or inspect.isroutine(obj)):
            what = "data"
            lines = list(ModuleAnalyzer.for_module(module).find_attr_docs().get(("", name), []))
        else:
            what = "function" if not inspect.isclass(obj) else "exception" if issubclass(obj, BaseException) else "class"
            doc = getdoc(obj)
            lines = prepare_docstring(doc) if doc else []
            if lines and re.fullmatch(rf"{re.escape(obj.__name__)}\(.*\)(\s*->.*)?", lines[0].strip()):
                lines = lines[1:]
        self.env.events.emit("autodoc-process-docstring", what, f"{module}.{name}", obj, {}, lines)
        return lines


def setup(app):
    app.add_directive("api", Api)
    app.add_directive("api-summary", ApiSummary)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
