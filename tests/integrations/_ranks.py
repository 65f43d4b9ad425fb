"""Starts one process per rank for the integration tests, with a deadline instead of a possible hang."""

from __future__ import annotations

import gc
import importlib
import socket
import time
from typing import Any, Callable

import torch.multiprocessing as mp

FORK = "fork" if "fork" in mp.get_all_start_methods() else "spawn"


def free_port() -> int:
    """A TCP port on the loopback that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(
    fn: Callable[..., None],
    args: tuple[Any, ...],
    *,
    nprocs: int = 2,
    start_method: str = FORK,
    timeout_s: float = 150.0,
    preload: tuple[str, ...] = (),
) -> None:
    """Runs ``fn(rank, *args)`` on ``nprocs`` processes; raises a rank's error, or ``TimeoutError``.

    ``fork`` starts the ranks with the parent's imports (a fresh interpreter costs seconds on a
    small machine); ``spawn`` for libraries whose process-wide state must not be inherited.
    ``preload``: modules the ranks would import on first use (dynamo, which DDP and DTensor import,
    DCP, a framework), imported here once before the fork instead of on every rank.
    """
    for module in preload:
        importlib.import_module(module)
    gc.collect()
    gc.freeze()  # the ranks' garbage collections skip every object that exists now
    try:
        context = mp.start_processes(fn, args=args, nprocs=nprocs, join=False, start_method=start_method)
    finally:
        gc.unfreeze()
    deadline = time.monotonic() + timeout_s
    while not context.join(timeout=1.0):
        if time.monotonic() > deadline:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
            raise TimeoutError(f"{fn.__name__}: ranks still running after {timeout_s:.0f} s")
