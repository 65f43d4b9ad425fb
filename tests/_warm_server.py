"""The server side of ``_warm``: imports torch, gradtx and ``PRELOAD`` once, then forks one process
per run requested on stdin, each becoming ``python SCRIPT ARGS`` for the rest of its life.

Started as ``python -c "import _warm_server; _warm_server.main()"``, so that the interpreter's
``__main__`` module is free for the script: a forked child clears it, executes the script in it
and lets the interpreter end as after any script (an uncaught exception prints its traceback and
exits with 1, ``sys.exit`` exits with its code, atexit handlers and finalizers run).

Protocol, one JSON line each way: a request ``{"runs": [{"argv", "cwd", "env", "stdout",
"stderr"}, ...]}`` is answered by ``{"pids": [...]}`` once every run is started, then by
``{"codes": [...]}`` (each as ``subprocess`` reports it: negative for a signal) once all have
ended. When a run of several ends with a non-zero code, the others are stopped, as torchrun does.
"""

from __future__ import annotations

import builtins
import gc
import importlib
import json
import os
import pkgutil
import signal
import sys
import time

GRACE_S = 5.0  # after a rank failed, how long the others get to end on SIGTERM before SIGKILL


def _reply(message: dict) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def _become(run: dict) -> None:
    """In the forked child: lays out the process as ``python argv...`` would, then runs the script
    in ``__main__``. Never returns: the script's end (or error) ends the interpreter."""
    os.setpgid(0, 0)  # a group of its own: a timeout kills whatever the script started too
    for fd, path, flags in (
        (0, os.devnull, os.O_RDONLY),
        (1, run["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
        (2, run["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
    ):
        opened = os.open(path, flags, 0o644)
        os.dup2(opened, fd)
        os.close(opened)
    os.chdir(run["cwd"])
    os.environ.clear()
    os.environ.update(run["env"])
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    script = os.path.abspath(run["argv"][0])
    sys.argv = list(run["argv"])
    sys.path[0] = os.path.dirname(script)
    main = sys.modules["__main__"]
    main.__dict__.clear()
    main.__dict__.update(__name__="__main__", __file__=script, __builtins__=builtins, __doc__=None,
                         __package__=None, __spec__=None, __loader__=None, __cached__=None)
    with open(script, "rb") as source:
        code = compile(source.read(), script, "exec")
    exec(code, main.__dict__)
    raise SystemExit(0)


def _wait(pids: list[int]) -> list[int]:
    codes: dict[int, int] = {}
    stop_at = None
    while len(codes) < len(pids):
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            if stop_at is not None and time.monotonic() > stop_at:
                _signal_all([p for p in pids if p not in codes], signal.SIGKILL)
                stop_at = None
            time.sleep(0.02)
            continue
        if pid not in pids:
            continue
        codes[pid] = os.waitstatus_to_exitcode(status)
        if codes[pid] != 0 and stop_at is None and len(codes) < len(pids):
            _signal_all([p for p in pids if p not in codes], signal.SIGTERM)
            stop_at = time.monotonic() + GRACE_S
    return [codes[p] for p in pids]


def _signal_all(pids: list[int], signum: int) -> None:
    for pid in pids:
        try:
            os.killpg(pid, signum)
        except (ProcessLookupError, PermissionError):
            pass


# Imported once here besides torch and gradtx: what nearly every run imports and takes seconds to.
# torch.func's transforms import torch._dynamo on their first call (2.5 s of CPU; it brings
# torch.distributed.tensor and torch.distributed.fsdp), and the examples load their data with
# scikit-learn (1.7 s). gradtx's own submodules, which it imports on a name's first use, are
# imported too (each run would compile them again where no bytecode is cached). A run still
# executes its own import statements; they find these loaded.
PRELOAD = ("torch._dynamo", "sklearn.datasets", "sklearn.model_selection")


def _preload() -> None:
    import torch  # noqa: F401 - what every run would import first, imported once here

    import gradtx

    for module in PRELOAD:
        try:
            importlib.import_module(module)
        except ImportError:  # an optional extra that is not installed: the runs that need it are skipped
            pass
    for module in pkgutil.walk_packages(gradtx.__path__, "gradtx."):
        importlib.import_module(module.name)


def main() -> None:
    _preload()

    # What the imports made lives as long as any run: moved out of the collector's reach, a run's
    # collections (and the interpreter's at exit) skip it instead of traversing it, each touching,
    # and so copying, every page of the parent's heap (0.6 s of CPU a run, more than most pages take).
    gc.freeze()
    _reply({"ready": os.getpid()})
    for line in sys.stdin:
        runs = json.loads(line)["runs"]
        pids = []
        for run in runs:
            pid = os.fork()
            if pid == 0:
                _become(run)
            pids.append(pid)
        _reply({"pids": pids})
        _reply({"codes": _wait(pids)})
