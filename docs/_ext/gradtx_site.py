"""Three adaptations of the sources for the site.

- A docstring may show its example as a fenced block (three backticks and ``python``), as the
  guides do, so that ``help()`` reads like the guides and the tests can run it; the reference
  renders the block as a ``code-block``.
- The guides link to pages outside ``docs/`` (``../benchmarks/results.md``) that the site includes
  under a name of its own: ``site_pages`` in ``conf.py`` maps each such path (relative to the
  repository root) to the document that includes it.
- In the markdown pages (the README and the guides), a code span that is exactly a documented
  name (``adamw``, ``gtx.chain``, ``gradtx.sharding.ShardingSpec``) links to its reference entry;
  a bare name is looked up in ``site_name_modules`` in order (``gradtx``, then the modules used
  through themselves), so ``leaf_norms`` finds ``gradtx.sharding.leaf_norms``.
"""

from __future__ import annotations

import os
from pathlib import Path

import re

from docutils import nodes
from sphinx import addnodes
from sphinx.transforms.post_transforms import SphinxPostTransform


def fenced_to_code_block(lines: list[str]) -> list[str]:
    """``lines`` with every fenced block rewritten as an indented ``.. code-block::``."""
    out: list[str] = []
    fence: str | None = None  # the indentation of the open fence
    for line in lines:
        stripped = line.lstrip()
        indent = line[: len(line) - len(stripped)]
        if fence is None and stripped.startswith("```"):
            fence = indent
            out += [f"{indent}.. code-block:: {stripped[3:].strip() or 'text'}", ""]
        elif fence is not None and stripped.startswith("```"):
            fence = None
            out.append("")
        elif fence is not None:
            out.append(f"{fence}   {line[len(fence):]}" if line.strip() else "")
        else:
            out.append(line)
    if fence is not None:
        raise ValueError("a fenced block in a docstring is not closed")
    return out


def _process_docstring(app, what, name, obj, options, lines: list[str]) -> None:
    lines[:] = fenced_to_code_block(lines)


class SitePages(SphinxPostTransform):
    """Points a guide's link to a page outside ``docs/`` at the document that includes it."""

    default_priority = 5  # before myst's resolver (9), which would report the path as unknown

    def run(self, **kwargs) -> None:
        srcdir = Path(self.env.srcdir)
        pages = {str(srcdir.parent / path.rsplit(".", 1)[0]): docname for path, docname in self.config.site_pages.items()}
        for node in self.document.findall(addnodes.pending_xref):
            if node.get("reftype") != "myst" or node.get("refdomain") != "doc":
                continue
            # The target is absolute (recent MyST) or relative to the linking document (older ones).
            referrer = srcdir / Path(node.get("refdoc", self.env.docname)).parent
            target = os.path.normpath(referrer / node["reftarget"])
            if target in pages:
                node["reftarget"] = pages[target]


_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")


class LinkNames(SphinxPostTransform):
    """Turns a markdown page's code span naming a documented object into a link to its entry."""

    default_priority = 5  # before the references are resolved (10)

    def run(self, **kwargs) -> None:
        if not str(self.env.doc2path(self.env.docname)).endswith(".md"):
            return
        objects = self.env.get_domain("py").objects
        modules = self.config.site_name_modules
        for literal in list(self.document.findall(nodes.literal)):
            text = literal.astext()
            if not _NAME.fullmatch(text) or _inside(literal, (nodes.reference, addnodes.pending_xref, nodes.title)):
                continue
            if text.startswith("gtx."):
                text = "gradtx." + text[4:]
            candidates = [text] if text.startswith("gradtx.") else [f"{module}.{text}" for module in modules]
            target = next((name for name in candidates if name in objects), None)
            if target is None:
                continue
            xref = addnodes.pending_xref(
                "", refdomain="py", reftype="obj", reftarget=target, refexplicit=True, refdoc=self.env.docname
            )
            literal.replace_self(xref)
            xref += literal


def _inside(node: nodes.Node, kinds: tuple) -> bool:
    parent = node.parent
    while parent is not None:
        if isinstance(parent, kinds):
            return True
        parent = parent.parent
    return False


def setup(app):
    app.add_config_value("site_pages", {}, "env", dict)
    app.add_config_value("site_name_modules", ("gradtx",), "env", tuple)
    app.connect("autodoc-process-docstring", _process_docstring, priority=400)  # before napoleon's sections
    app.add_post_transform(SitePages)
    app.add_post_transform(LinkNames)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
