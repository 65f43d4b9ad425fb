"""Every ```python block of README.md and docs/*.md runs as written, so the docs cannot rot.

A page's blocks run in order, in one namespace, as one script a reader would paste together, in a
fresh interpreter on CPU (forked from one that has imported torch, gradtx and a few heavy modules
and run nothing: ``_warm``). A block fenced ```` ```python no-run ```` is shown only (another
library's code, CUDA, a mesh larger than a CPU test machine). A page whose code needs several
ranks says ``# torchrun N`` in a comment of one of its blocks; it then runs on N ranks as
``torchrun --standalone --nproc_per_node N`` starts them (gloo). A failure names the page, the
block (its index and line in the page) and shows the script's output.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest

import _warm

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TIMEOUT_S = 120
FENCE = re.compile(r"^```(\S*)[ \t]*(.*)$")
TORCHRUN = re.compile(r"#\s*torchrun\s+(\d+)\b")


class Block(NamedTuple):
    index: int  # 1-based, counting the page's ```python blocks, shown ones included
    line: int  # 1-based line of the opening fence
    source: str
    runs: bool


def python_blocks(text: str) -> list[Block]:
    """The page's fenced ```python blocks, in order; ``runs`` is False for ```python no-run."""
    blocks: list[Block] = []
    lines = text.splitlines()
    number = 0
    while number < len(lines):
        match = FENCE.match(lines[number])
        if match is None:
            number += 1
            continue
        language, info = match.groups()
        start = number
        number += 1
        body = []
        while number < len(lines) and not lines[number].startswith("```"):
            body.append(lines[number])
            number += 1
        number += 1  # the closing fence
        if language == "python":
            if info not in ("", "no-run"):
                raise ValueError(f"line {start + 1}: unknown fence ```python {info} (use ```python or ```python no-run)")
            blocks.append(Block(len(blocks) + 1, start + 1, "\n".join(body) + "\n", info != "no-run"))
    return blocks


def world_size(blocks: list[Block]) -> int:
    """The ``# torchrun N`` a runnable block asks for, or 1."""
    sizes = {int(m.group(1)) for b in blocks if b.runs for m in TORCHRUN.finditer(b.source)}
    if len(sizes) > 1:
        raise ValueError(f"blocks ask for different world sizes: {sorted(sizes)}")
    return sizes.pop() if sizes else 1


def page_script(page: str, blocks: list[Block]) -> str:
    """One script running the blocks in order in one namespace; each compiled under a name that
    says which block it is, so a traceback points at the page, the block and its line."""
    parts = [
        "import sys",
        "namespace = {'__name__': '__main__'}",
        "def run(name, source):",
        "    print(f'--- {name}', file=sys.stderr, flush=True)",
        "    exec(compile(source, name, 'exec'), namespace)",
    ]
    for block in blocks:
        if block.runs:
            parts.append(f"run({f'{page} block {block.index} (line {block.line})'!r}, {block.source!r})")
    return "\n".join(parts) + "\n"


def _failing_block(output: str) -> str:
    """The block named in the first traceback (under torchrun, the first failing rank's), else the last started."""
    in_traceback = re.search(r'File "(.+ block \d+ \(line \d+\))", line (\d+)', output)
    if in_traceback:
        return f"{in_traceback.group(1)}, line {in_traceback.group(2)} of the block"
    started = re.findall(r"^--- (.+ block \d+ \(line \d+\))$", output, flags=re.M)
    return started[-1] if started else "before the first block"


def _excerpt(output: str, limit: int = 4000) -> str:
    """The output from its first traceback on (a rank's, before torchrun's own), else its end."""
    start = output.find("Traceback (most recent call last)")
    if start >= 0:
        start = output.rfind("\n", 0, start) + 1
        return output[start:start + limit]
    return output[-limit:]


def _pages() -> list:
    return [pytest.param(page, id=str(page.relative_to(ROOT))) for page in PAGES if page.exists()]


def run_page(name: str, text: str, workdir: Path) -> str | None:
    """Runs a page's blocks as one script in ``workdir``; returns why it failed, or ``None``."""
    blocks = python_blocks(text)
    nproc = world_size(blocks)
    script = workdir / (Path(name).stem + ".py")
    script.write_text(page_script(name, blocks))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    try:
        done = _warm.run([str(script)], cwd=workdir, env=env, timeout=TIMEOUT_S, nproc=nproc)
    except subprocess.TimeoutExpired as error:
        output = "".join(s.decode() if isinstance(s, bytes) else s for s in (error.stdout or "", error.stderr or ""))
        return f"{name}: ran past {TIMEOUT_S} s in {_failing_block(output)}:\n{_excerpt(output)}"
    if done.returncode != 0:
        launcher = f", torchrun --nproc_per_node {nproc}" if nproc > 1 else ""
        return f"{name}: {_failing_block(done.stderr)} failed (exit code {done.returncode}{launcher}):\n{_excerpt(done.stderr)}"
    output = done.stdout + done.stderr
    if "Traceback" in output:
        return f"{name}: a traceback was printed although it exited with 0:\n{_excerpt(output)}"
    return None


@pytest.mark.parametrize("page", _pages())
def test_page_runs(page: Path, tmp_path: Path):
    name = str(page.relative_to(ROOT))
    text = page.read_text()
    if not any(block.runs for block in python_blocks(text)):
        pytest.skip(f"{name} has no runnable ```python block")
    failure = run_page(name, text, tmp_path)
    if failure:
        pytest.fail(failure, pytrace=False)


def test_a_failure_names_the_page_and_block(tmp_path: Path):
    page = "\n".join(["# A page", "```python", "x = 0", "```", "", "```python", "y = 1", "print(1 / x)", "```", ""])
    failure = run_page("docs/page.md", page, tmp_path)
    assert failure is not None
    assert "docs/page.md block 2 (line 6), line 2 of the block failed (exit code 1)" in failure, failure
    assert "ZeroDivisionError" in failure, failure
    assert run_page("docs/page.md", page.replace("x = 0", "x = 1"), tmp_path) is None


def test_block_extraction():
    """The parser: fences, no-run, other languages, torchrun sizes."""
    text = "\n".join([
        "text", "```python", "a = 1", "```", "```bash", "echo no", "```",
        "```python no-run", "import nothing_here", "```", "```python", "# torchrun 4", "b = a + 1", "```",
    ])
    blocks = python_blocks(text)
    assert [(b.index, b.line, b.runs) for b in blocks] == [(1, 2, True), (2, 8, False), (3, 11, True)]
    assert blocks[2].source == "# torchrun 4\nb = a + 1\n"
    assert world_size(blocks) == 4 and world_size(blocks[:1]) == 1
    namespace: dict = {}
    exec(page_script("page.md", blocks), namespace)
    assert namespace["namespace"]["b"] == 2
    with pytest.raises(ValueError, match="unknown fence"):
        python_blocks("```python run\nx = 1\n```\n")


if __name__ == "__main__":
    # python tests/test_docs.py docs/sharding.md > sharding.py: a page's script, to run or debug by hand.
    target = ROOT / sys.argv[1]
    sys.stdout.write(page_script(str(target.relative_to(ROOT)), python_blocks(target.read_text())))
