"""Sphinx configuration of gradtx's site: the guides (MyST markdown) and the API reference (autodoc).

Build: ``python -m sphinx -W --keep-going -b html docs docs/_build/html`` (``pip install -e ".[docs]"``).
No extension here reaches the network: there is no intersphinx, and math is rendered as text.
"""

from __future__ import annotations

import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
sys.path[:0] = [str(DOCS.parent / "src"), str(DOCS / "_ext")]  # this checkout's gradtx, then the local extension

import gradtx  # noqa: E402

project = "gradtx"
author = "gradtx contributors"
copyright = "gradtx contributors"
release = version = gradtx.__version__

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "myst_parser",
    "gradtx_api",
    "gradtx_site",
]

source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "_ext"]
templates_path: list[str] = []

# The docstrings are Google style (Args / Returns / References / Example).
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False

autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_preserve_defaults = True
autodoc_inherit_docstrings = False  # members show gradtx's own docs, not torch.optim.Optimizer's
# Signatures name these aliases rather than spelling out the unions they stand for.
autodoc_type_aliases = {
    name: f"gradtx.{name}" for name in ("ScalarOrSchedule", "MaskOrFn", "Params", "Updates", "OptState", "Schedule")
}
autosummary_generate = False  # the api directive documents every entry on its own page
python_maximum_signature_line_length = 88  # one parameter a line beyond this
add_module_names = True

myst_heading_anchors = 3  # README.md and the guides link to each other's sections by slug

html_theme = "furo"
html_title = f"gradtx {release}"
html_static_path: list[str] = []
html_show_sourcelink = False

# Pages outside docs/ that the guides link to, and the document of the site that includes each.
site_pages = {"benchmarks/results.md": "benchmarks"}
# Where a bare name in a markdown page's code span is looked up, in order, to link it to its entry.
site_name_modules = (
    "gradtx",
    "gradtx.contrib",
    "gradtx.sharding",
    "gradtx.checkpoint",
    "gradtx.schedules",
    "gradtx.tree_utils",
    "gradtx.projections",
    "gradtx.microbatching",
)
