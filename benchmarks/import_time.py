"""What ``import gradtx`` adds to ``import torch``: wall clock of fresh interpreters, and -X importtime.

Each round starts one fresh interpreter per candidate, in turn (interleaved, so a slow moment of
this shared machine hits every candidate): ``import torch`` alone, ``import torch, gradtx``, and what
a first use then imports (``gradtx.adamw`` and a chain; ``gradtx.contrib``). Prints the median wall
clock and CPU time of each (CPU time suffers less from other work on the machine), its median ratio
to ``import torch`` and the median of the per-round differences (what gradtx adds). Two settings,
since a checkout run with ``PYTHONDONTWRITEBYTECODE=1`` compiles gradtx's sources at every import,
while an installed package reads cached bytecode:

- ``source``: gradtx compiled at each import (no ``.pyc`` written or read for it);
- ``bytecode``: ``.pyc`` files cached in a temporary ``PYTHONPYCACHEPREFIX`` (warmed first).

Then ``python -X importtime`` (medians over the rounds) names the modules each candidate spends its
time in (a package that gradtx's ``__getattr__`` imports through ``importlib`` is not listed, its
submodules are). A module's "self" time can hold a full garbage collection over torch's objects,
started by whichever import happens to cross the collector's threshold. ``--compare SRC`` adds
``import torch, gradtx`` from another checkout's ``src`` folder (an older commit, say), timed in the
same rounds.

Run from the repository root::

    python benchmarks/import_time.py [--rounds N] [--compare SRC] [--setting source|bytecode]
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [_ROOT]  # runs from a checkout

from benchmarks.common import report  # noqa: E402

SRC = os.path.join(_ROOT, "src")
BASELINE = "import torch"
CANDIDATES = {  # what each fresh interpreter runs after ``import torch``
    BASELINE: "pass",
    "import torch, gradtx": "import gradtx",
    "... then chain(clip, adamw)": "import gradtx as g; g.chain(g.clip_by_global_norm(1.0), g.adamw(1e-3))",
    "import torch, gradtx.contrib": "import gradtx.contrib",
}
PROGRAM = "import time, torch\nstart = time.perf_counter()\n{}\nprint(time.perf_counter() - start)"
IMPORTTIME_LINE = re.compile(r"import time:\s+(\d+) \|\s+(\d+) \|\s*(\S+)")


def environment(setting: str, src: str, pycache: str) -> dict[str, str]:
    """This interpreter's environment with ``src`` first on the path, bytecode as ``setting`` says."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([src, env.get("PYTHONPATH", "")])
    if setting == "source":
        env["PYTHONDONTWRITEBYTECODE"] = "1"  # gradtx's sources have no __pycache__ in a fresh checkout
        env.pop("PYTHONPYCACHEPREFIX", None)
    else:
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        env["PYTHONPYCACHEPREFIX"] = pycache  # every .pyc, torch's too, read from (and written to) here
    return env


def run_once(code: str, env: dict[str, str]) -> tuple[float, float, float]:
    """A fresh interpreter importing torch, then running ``code``: its wall clock, its CPU time (user
    + system, all threads) and the seconds ``code`` took in it."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", PROGRAM.format(code)], env=env, check=True, capture_output=True, text=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), float(done.stdout)


def time_imports(candidates: dict[str, tuple[str, dict[str, str]]], rounds: int) -> list[dict[str, list[float]]]:
    """Interleaved rounds, each candidate once per round in turn (after a warm-up round): per
    candidate, seconds of wall clock, of CPU time, and of the code run after ``import torch``."""
    for code, env in candidates.values():
        run_once(code, env)  # warms the file cache (and writes bytecode in the ``bytecode`` setting)
    measures: list[dict[str, list[float]]] = [{name: [] for name in candidates} for _ in range(3)]
    for _ in range(rounds):
        for name, (code, env) in candidates.items():
            for measure, seconds in zip(measures, run_once(code, env)):
                measure[name].append(seconds)
    return measures


def print_added(times: dict[str, list[float]]) -> None:
    for name, ts in times.items():
        if name != BASELINE:
            added = statistics.median(a - b for a, b in zip(ts, times[BASELINE]))
            print(f"  {name:45s} adds {added * 1e3:7.1f} ms to {BASELINE!r} (median of per-round differences)")


def importtime(code: str, env: dict[str, str], rounds: int) -> dict[str, tuple[float, float]]:
    """Per module imported after torch by ``code``: median (cumulative s, self s) over ``rounds``
    runs of -X importtime."""
    cumulative: dict[str, list[float]] = {}
    own: dict[str, list[float]] = {}
    for _ in range(rounds):
        done = subprocess.run(
            [sys.executable, "-X", "importtime", "-c", f"import torch\n{code}"], env=env, capture_output=True, text=True, check=True
        )
        after_torch = False  # a module's line is printed once it is imported: torch's comes last of its own
        for line in done.stderr.splitlines():
            match = IMPORTTIME_LINE.match(line)
            if match and after_torch:
                name = match[3]
                own.setdefault(name, []).append(int(match[1]) / 1e6)
                cumulative.setdefault(name, []).append(int(match[2]) / 1e6)
            after_torch = after_torch or bool(match and match[3] == "torch")
    return {n: (statistics.median(cumulative[n]), statistics.median(own[n])) for n in cumulative}


def print_importtime(title: str, rows: dict[str, tuple[float, float]], top: int) -> None:
    total = sum(own for _, own in rows.values())
    print(f"\n-X importtime, {title}: {len(rows)} modules after torch's (gradtx's and the dependencies it "
          f"adds), {total * 1e3:.1f} ms in all (medians); the slowest:")
    for name, (cum, own) in sorted(rows.items(), key=lambda item: -item[1][0])[:top]:
        print(f"  {name:45s} cumulative {cum * 1e3:7.1f} ms   self {own * 1e3:7.1f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--setting", choices=["source", "bytecode"], action="append", help="default: both")
    parser.add_argument("--compare", metavar="SRC", help="also time `import torch, gradtx` from this src folder")
    parser.add_argument("--top", type=int, default=12, help="modules listed from -X importtime")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="gradtx-pycache-") as pycache:
        for setting in args.setting or ["source", "bytecode"]:
            env = environment(setting, SRC, pycache)
            candidates = {name: (code, env) for name, code in CANDIDATES.items()}
            if args.compare:
                candidates[f"import torch, gradtx ({args.compare})"] = (
                    "import torch, gradtx", environment(setting, os.path.abspath(args.compare), pycache)
                )
            wall, cpu, after_torch = time_imports(candidates, args.rounds)
            title = f"gradtx {setting} ({args.rounds} interleaved rounds)"
            for what, times in (("Wall clock", wall), ("CPU time", cpu)):
                report(f"{what} of a fresh interpreter, {title}", times, BASELINE)
                print_added(times)
            print(f"\nIn the interpreter, after import torch, {title}")
            for name, times in after_torch.items():
                print(f"  {name:45s} median {statistics.median(times) * 1e3:9.2f} ms")
            for name, code in CANDIDATES.items():
                if name != BASELINE:
                    print_importtime(f"{name} ({setting})", importtime(code, env, args.rounds), args.top)


if __name__ == "__main__":
    main()
