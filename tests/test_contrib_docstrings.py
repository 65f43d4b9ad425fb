"""The ``Example::`` block of each docstring of gradtx.contrib's Hutchinson estimator, normalize,
reduce_on_plateau and split_real_and_imaginary runs as written and prints what it says. (The
optimizers' examples are doctests: tests/test_optimizer_docstrings.py runs them.)"""

from __future__ import annotations

import contextlib
import io
import re
import textwrap

import pytest

from gradtx import contrib

NAMES = [
    "hutchinson_estimator_diag_hessian",
    "normalize",
    "reduce_on_plateau",
    "split_real_and_imaginary",
]


def example(doc: str) -> str:
    _, _, rest = doc.partition("Example::\n")
    lines = []
    for line in rest.splitlines():
        if line.strip() and not line.startswith(" " * 8):
            break
        lines.append(line)
    return textwrap.dedent("\n".join(lines))


@pytest.mark.parametrize("name", NAMES)
def test_docstring_example_runs(name):
    code = example(getattr(contrib, name).__doc__)
    assert "import" in code, f"{name} has no example"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, f"<{name} example>", "exec"), {})
    # every '# comment' after a print states the printed value's start
    for line, printed in zip([l for l in code.splitlines() if l.startswith("print(")], out.getvalue().splitlines()):
        claimed = re.search(r"#\s*(.*)", line)
        if claimed:
            shown = claimed.group(1).split(":")[0].split(" (")[0].strip()
            if shown.startswith("about"):
                continue
            assert printed.replace(" ", "").startswith(shown.replace(" ", "")), (line, printed)
