"""Runs every benchmark in ``benchmarks/``; with ``--write``, writes ``results.md`` (tables) and ``results.png`` (a plot).

Each ``benchmarks/*.py`` (but ``common.py`` and this file) runs as a subprocess from the repository
root, as its docstring says to run it; under ``--quick`` with the script's own ``--quick`` where it has
one, else ``--rounds 5`` (and ``--small``). The lines ``common.report`` prints (candidate, median, ratio) become
the tables; ``scaling.py`` also leaves its medians as JSON, which become the plot of step time
against model size.

A script whose module-level imports are not installed in the interpreter that would run it
(``optax_agreement.py`` needs JAX and optax) is skipped, and the run says which modules it lacks.
optax, JAX and torchopt are not dependencies of gradtx; the benchmarks that compare with them
(``scaling.py``, ``external.py``) skip what does not import. To include them, point
``--external-python`` (or ``GRADTX_BENCH_PYTHON``) at an interpreter that has them installed
next to torch, optree and numpy; gradtx itself is taken from this checkout's ``src/``. The plot
needs matplotlib (the ``bench`` extra); without it only ``results.md`` is written.

Run:  python benchmarks/run_all.py [--quick] [--write] [--external-python PATH]
"""

from __future__ import annotations

import argparse
import ast
import datetime
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

BENCH_DIR = Path(__file__).resolve().parent
ROOT = BENCH_DIR.parent
NOT_BENCHMARKS = {"common.py", "run_all.py", "__init__.py"}
REPORT_LINE = re.compile(r"^\s+(?P<name>.+?)\s+median\s+(?P<ms>[\d.]+) ms\s+ratio vs (?P<base>.+): (?P<ratio>[\d.]+)\s*$")
TIMEOUT_S = 1800
QUICK_ROUNDS = 5  # enough for a median on a noisy machine, still a few minutes in all
MAX_PRINTED_LINES = 80


@dataclass
class Table:
    title: str
    baseline: str
    rows: list[tuple[str, float, float]] = field(default_factory=list)  # (candidate, median ms, ratio)


@dataclass
class Outcome:
    script: str
    command: list[str]
    seconds: float
    returncode: int
    output: str
    tables: list[Table]


def benchmark_scripts() -> list[Path]:
    return sorted(p for p in BENCH_DIR.glob("*.py") if p.name not in NOT_BENCHMARKS and not p.name.startswith("_"))


def wants_external(source: str) -> bool:
    return "import optax" in source or "import torchopt" in source


def required_modules(source: str) -> list[str]:
    """The top-level packages a script imports at module level (it cannot start without them):
    neither the standard library nor this repository's own modules (gradtx, benchmarks, common)."""
    local = {"gradtx", "benchmarks", *(p.stem for p in BENCH_DIR.glob("*.py"))}
    names: list[str] = []
    for node in ast.parse(source).body:
        if isinstance(node, ast.Import):
            found = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found = [node.module]
        else:
            continue
        for name in found:
            top = name.split(".")[0]
            if top not in sys.stdlib_module_names and top != "__future__" and top not in local and top not in names:
                names.append(top)
    return names


def missing_modules(modules: Sequence[str], python: str) -> list[str]:
    """Those of ``modules`` that ``python`` cannot import (found without importing them)."""
    if not modules:
        return []
    if python == sys.executable:
        return [m for m in modules if importlib.util.find_spec(m) is None]
    probe = "import importlib.util, sys; print(' '.join(m for m in sys.argv[1:] if importlib.util.find_spec(m) is None))"
    result = subprocess.run([python, "-c", probe, *modules], capture_output=True, text=True, timeout=60)
    if result.returncode != 0:
        return list(modules)
    return result.stdout.split()


def skip_reason(
    script: Path, python: str, missing: Optional[Callable[[Sequence[str], str], list[str]]] = None
) -> Optional[str]:
    """Why ``script`` cannot run under ``python`` (the modules it lacks), or ``None`` when it can."""
    lacking = (missing or missing_modules)(required_modules(script.read_text()), python)
    if not lacking:
        return None
    hint = "" if python != sys.executable else "; pass --external-python PATH for an interpreter that has them"
    return f"needs {', '.join(lacking)}, not installed for {python}{hint}"


def command_for(script: Path, *, quick: bool, python: str, json_path: Path) -> list[str]:
    """The script's command line: only the flags it declares (read from its source)."""
    source = script.read_text()
    args = [python, str(script.relative_to(ROOT))]
    if quick:
        if '"--quick"' in source:  # the script's own quick mode chooses its rounds
            args.append("--quick")
        elif '"--rounds"' in source:
            args += ["--rounds", str(QUICK_ROUNDS)]
        if '"--small"' in source:
            args.append("--small")
    if '"--json"' in source:
        args += ["--json", str(json_path)]
    return args


def parse_tables(output: str) -> list[Table]:
    """The ``common.report`` blocks of ``output``: a title line, then one line per candidate."""
    tables: list[Table] = []
    previous = ""
    for line in output.splitlines():
        match = REPORT_LINE.match(line)
        if match:
            current = tables[-1] if tables else None
            if (
                current is None
                or current.title != previous
                or current.baseline != match["base"]
                or any(row[0] == match["name"] for row in current.rows)  # a second report, same title
            ):
                tables.append(Table(previous, match["base"]))
            tables[-1].rows.append((match["name"], float(match["ms"]), float(match["ratio"])))
        elif line.strip():
            previous = line.strip()
    return tables


def run(script: Path, *, quick: bool, python: str, json_path: Path) -> Outcome:
    command = command_for(script, quick=quick, python=python, json_path=json_path)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT), str(BENCH_DIR), env.get("PYTHONPATH", "")])
    print(f"$ {' '.join(command)}", flush=True)
    start = time.perf_counter()
    try:
        result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
        returncode, output = result.returncode, result.stdout + result.stderr
    except subprocess.TimeoutExpired as error:
        returncode, output = -1, f"timed out after {TIMEOUT_S} s\n{error.stdout or ''}"
    seconds = time.perf_counter() - start
    print(output.rstrip() + f"\n[{script.name}: exit {returncode}, {seconds:.0f} s]\n", flush=True)
    return Outcome(script.name, command, seconds, returncode, output, parse_tables(output))


def machine_line(scaling: dict | None) -> str:
    if scaling is not None:
        m = scaling["machine"]
        others = ", ".join(f"{name} {m[name]}" for name in ("jax", "optax", "torchopt") if name in m)
        return (f"{m['cpu']}, {m['cores']} CPU cores ({m['threads']} torch threads), no GPU; torch {m['torch']}, "
                f"Python {m['python']}" + (f"; {others}" if others else ""))
    import platform

    import torch

    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPU cores, no GPU; torch {torch.__version__}"


def write_markdown(
    path: Path, outcomes: list[Outcome], scaling: dict | None, *, quick: bool, skipped: Sequence[tuple[str, str]] = ()
) -> None:
    today = datetime.date.today().isoformat()
    lines = [
        "# Benchmark results",
        "",
        f"Measured {today} on {machine_line(scaling)}, with `python benchmarks/run_all.py{' --quick' if quick else ''}`. "
        "Times are medians of interleaved rounds (`benchmarks/common.py`); ratios are medians of per-round ratios "
        "against each table's baseline (lower is faster). The machine is small and shared, so read the ratios, "
        "not the milliseconds, and expect noise of 10-20%.",
        "",
    ]
    if scaling is not None:
        results = scaling["results"]
        names = list(results[0]["median_ms"]) if results else []
        for r in results[1:]:
            names += [n for n in r["median_ms"] if n not in names]
        lines += [
            "## Step time against model size",
            "",
            "One optimizer step on a GPT-style gradient tree: clip by global norm 1.0, AdamW, apply "
            f"(`benchmarks/scaling.py`: {scaling.get('method', str(scaling['rounds']) + ' rounds')}). "
            f"Milliseconds (ratio to `{scaling['baseline']}`).",
            "",
            "| candidate | " + " | ".join(f"{r['size']} ({r['n_params'] / 1e6:.1f}M)" for r in results) + " |",
            "| --- | " + " | ".join("---:" for _ in results) + " |",
        ]
        for name in names:
            cells = []
            for r in results:
                ms = r["median_ms"].get(name)
                cells.append("n/a" if ms is None else f"{ms:.1f} ({r['ratio'][name]:.2f}x)")
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        lines += ["", "![step time against model size](results.png)", ""]
    for outcome in outcomes:
        if outcome.script == "scaling.py":
            continue
        lines += [f"## `{outcome.script}`", "", f"`{' '.join(Path(c).name if i == 0 else c for i, c in enumerate(outcome.command))}`"
                  f" ({outcome.seconds:.0f} s)", ""]
        if outcome.returncode != 0:
            lines += [f"Failed (exit {outcome.returncode}); last lines:", "", "```", *outcome.output.strip().splitlines()[-8:], "```", ""]
        for table in outcome.tables:
            lines += [f"**{table.title}**", "", f"| candidate | median ms | ratio vs {table.baseline} |", "| --- | ---: | ---: |"]
            lines += [f"| {name} | {ms:.2f} | {ratio:.3f} |" for name, ms, ratio in table.rows]
            lines.append("")
        if outcome.returncode == 0 and not outcome.tables:  # not a timing: show what it printed
            printed = outcome.output.strip().splitlines()
            shown = printed[:MAX_PRINTED_LINES] + ([f"... ({len(printed) - MAX_PRINTED_LINES} more lines)"] if len(printed) > MAX_PRINTED_LINES else [])
            lines += ["```", *shown, "```", ""]
    for name, reason in skipped:
        lines += [f"## `{name}`", "", f"Skipped: {reason}.", ""]
    path.write_text("\n".join(lines).rstrip() + "\n")


def plot_skip_reason() -> Optional[str]:
    """Why the plot cannot be drawn (matplotlib missing), or ``None``."""
    if importlib.util.find_spec("matplotlib") is None:
        return 'matplotlib is not installed (pip install -e ".[bench]")'
    return None


def write_plot(path: Path, scaling: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = scaling["results"]
    sizes = [r["n_params"] / 1e6 for r in results]
    names: list[str] = []
    for r in results:
        names += [n for n in r["median_ms"] if n not in names]
    fig, ax = plt.subplots(figsize=(8, 5), dpi=110)
    for name in names:
        points = [(s, r["median_ms"][name]) for s, r in zip(sizes, results) if name in r["median_ms"]]
        style = "-" if name.startswith("gradtx") else "--"
        ax.plot([p[0] for p in points], [p[1] for p in points], style, marker="o", label=name)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("parameters (millions)")
    ax.set_ylabel("step time (ms, median)")
    subtitle = textwrap.fill(machine_line(scaling), width=100)
    ax.set_title(f"clip by global norm + AdamW + apply, one step\n{subtitle}", fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Runs the benchmarks; returns the exit status (1 when a benchmark that ran failed)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds and smaller trees (a few minutes)")
    parser.add_argument("--write", action="store_true",
                        help="write results.md and results.png (into --out); without it nothing is written")
    parser.add_argument("--external-python", default=os.environ.get("GRADTX_BENCH_PYTHON"),
                        help="an interpreter with optax/jax/torchopt, for the benchmarks that compare with them")
    parser.add_argument("--only", nargs="*", default=None, help="run only these scripts (e.g. scaling.py wrap.py)")
    parser.add_argument("--out", default=str(BENCH_DIR), help="where --write puts results.md and results.png")
    args = parser.parse_args(argv)

    out = Path(args.out)
    outcomes = []
    skipped: list[tuple[str, str]] = []
    scaling = None
    with tempfile.TemporaryDirectory() as tmp:
        for script in benchmark_scripts():
            if args.only and script.name not in args.only:
                continue
            python = sys.executable
            if args.external_python and wants_external(script.read_text()):
                python = args.external_python
            reason = skip_reason(script, python)
            if reason is not None:
                print(f"skipped {script.name}: {reason}\n", flush=True)
                skipped.append((script.name, reason))
                continue
            json_path = Path(tmp) / f"{script.stem}.json"
            outcome = run(script, quick=args.quick, python=python, json_path=json_path)
            outcomes.append(outcome)
            if script.name == "scaling.py" and json_path.exists():
                scaling = json.loads(json_path.read_text())
    if args.write:
        write_markdown(out / "results.md", outcomes, scaling, quick=args.quick, skipped=skipped)
        print(f"wrote {out / 'results.md'}")
        no_plot = plot_skip_reason()
        if scaling is not None and no_plot is None:
            write_plot(out / "results.png", scaling)
            print(f"wrote {out / 'results.png'}")
        elif scaling is not None:
            print(f"no plot: {no_plot}")
    else:
        print("results not written (pass --write to update results.md and results.png)")
    for name, reason in skipped:
        print(f"skipped {name}: {reason}")
    failed = [o.script for o in outcomes if o.returncode != 0]
    if failed:
        print(f"failed: {failed}")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
