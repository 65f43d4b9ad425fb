"""Runs Python scripts as ``python SCRIPT ARGS`` or ``torchrun --standalone --nproc_per_node N
SCRIPT ARGS`` would, each in a process forked from one interpreter that has imported torch, gradtx
and the heavy modules nearly every run imports (``_warm_server.PRELOAD``) and run nothing else: a
run starts in milliseconds instead of paying those imports, seconds on a small machine (four times
for a world of 3 ranks and torchrun's agent).

A forked run is a fresh interpreter in everything a script can see: its own ``__main__``,
``sys.argv``, ``sys.path[0]``, working directory, environment and standard streams; it ends as
any script does (traceback and exit code 1 on an uncaught exception, atexit handlers and
finalizers run). Ranks get the environment torchrun gives its workers; rank 0 hosts the store
(``MASTER_ADDR``/``MASTER_PORT``), and when a rank fails the others are stopped. torchrun itself
is run for real by ``tests/distributed/test_hybrid_parallel_example.py``.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_SERVER = (
    "import sys; sys.path[0] = {tests!r}; import _warm_server; _warm_server.main()"
)
_server: subprocess.Popen | None = None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start() -> subprocess.Popen:
    global _server
    if _server is None or _server.poll() is not None:
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
        command = [sys.executable, "-c", _SERVER.format(tests=str(Path(__file__).resolve().parent))]
        _server = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True)
        atexit.register(_stop, _server)
        _read(_server, time.monotonic() + 120)  # {"ready": pid}
    return _server


def _stop(server: subprocess.Popen) -> None:
    """Ends the server (its stdin closed, it returns) and reaps it, so its time counts as this process's children's."""
    server.stdin.close()
    try:
        server.wait(timeout=30)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()


def _read(server: subprocess.Popen, deadline: float) -> dict | None:
    """The server's next reply, or ``None`` at the deadline."""
    while True:
        ready, _, _ = select.select([server.stdout], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            return None
        line = server.stdout.readline()
        if not line:
            raise RuntimeError(f"the warm interpreter ended (exit code {server.wait()})")
        return json.loads(line)


def torchrun_env(env: dict[str, str], rank: int, nproc: int, port: int) -> dict[str, str]:
    """The environment ``torchrun --standalone --nproc_per_node nproc`` gives rank ``rank``."""
    env = dict(env)
    env.setdefault("OMP_NUM_THREADS", "1")
    for key, value in {
        "RANK": rank, "LOCAL_RANK": rank, "GROUP_RANK": 0, "ROLE_RANK": rank, "ROLE_NAME": "default",
        "WORLD_SIZE": nproc, "LOCAL_WORLD_SIZE": nproc, "GROUP_WORLD_SIZE": 1, "ROLE_WORLD_SIZE": nproc,
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "TORCHELASTIC_RESTART_COUNT": 0,
        "TORCHELASTIC_MAX_RESTARTS": 0, "TORCHELASTIC_RUN_ID": f"warm-{port}", "TORCHELASTIC_USE_AGENT_STORE": "False",
    }.items():
        env[key] = str(value)
    return env


def run(argv: list[str], *, cwd: str | Path, env: dict[str, str], timeout: float, nproc: int = 1) -> subprocess.CompletedProcess:
    """Runs ``python *argv`` (``nproc`` 1) or its torchrun launch on ``nproc`` ranks; returns what
    ``subprocess.run(..., capture_output=True, text=True)`` would (the ranks' outputs in rank
    order) or raises ``subprocess.TimeoutExpired`` with the output so far."""
    server = _start()
    port = _free_port() if nproc > 1 else 0
    with tempfile.TemporaryDirectory(prefix="gradtx_warm_") as folder:
        runs = [
            {
                "argv": [str(a) for a in argv],
                "cwd": str(cwd),
                "env": torchrun_env(env, rank, nproc, port) if nproc > 1 else dict(env),
                "stdout": os.path.join(folder, f"{rank}.out"),
                "stderr": os.path.join(folder, f"{rank}.err"),
            }
            for rank in range(nproc)
        ]
        server.stdin.write(json.dumps({"runs": runs}) + "\n")
        server.stdin.flush()
        deadline = time.monotonic() + timeout
        pids = _read(server, deadline + 30)["pids"]
        done = _read(server, deadline)
        if done is None:
            for pid in pids:
                try:
                    os.killpg(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            _read(server, time.monotonic() + 30)
        stdout = "".join(Path(r["stdout"]).read_text(errors="replace") for r in runs)
        stderr = "".join(Path(r["stderr"]).read_text(errors="replace") for r in runs)
    if done is None:
        raise subprocess.TimeoutExpired(argv, timeout, output=stdout, stderr=stderr)
    codes = done["codes"]
    returncode = codes[0] if nproc == 1 else next((1 for c in codes if c != 0), 0)
    return subprocess.CompletedProcess(argv, returncode, stdout, stderr)
