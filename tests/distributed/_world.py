"""Runs many test cases in one real gloo world per world size: processes are started once, every
case runs on every rank in turn, and each rank reports its failures back to pytest.

A case is a function ``case(world)`` registered with ``@case(sizes...)``; it runs on all ranks at
once and may use any collective. Collectives time out (``COLLECTIVE_TIMEOUT_S``) instead of
hanging, the parent kills a world that outlives ``WORLD_TIMEOUT_S``, and a failure on any rank
surfaces as that rank's traceback in the matching pytest test.
"""

from __future__ import annotations

import datetime
import functools
import gc
import multiprocessing
import os
import queue as queue_lib
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

COLLECTIVE_TIMEOUT_S = 30
WORLD_TIMEOUT_S = 240  # the compile cases trace for ~15 s each on a loaded 2-core machine
# Every module defining cases: each world imports them all, so one spawn per size runs every case.
CASE_MODULES = (
    "test_sharding_layouts",
    "test_sharding_dtensor",
    "test_sharding_validation",
    "test_sharding_properties",
    "test_sharding_collectives",
    "test_sharding_decisions",
    "test_sharding_disagreement",
    "test_contrib_sharded",
    "test_contrib_dtensor",
    "test_sharding_factored",
    "test_sharding_muon",
    "test_sharding_galore",
    "test_contrib_sharding",
    "test_sharding_agreement",
    "test_sharding_compile",
    "test_state_errors_sharded",
    "test_checkpoint_reshard",
    "test_private_apis_dtensor",
    "test_observe_sharded",
    "test_sharding_low_precision",
    "test_sharding_quantization",
    "test_sharding_elements",
    "test_sharding_stages",
    "test_dtensor_gaps",
)

# What the cases import on first use, imported once in the parent before the fork instead of on
# every rank: dynamo (DTensor.from_local and torch.compile), torch.compile's compiler stack (also
# what torch.profiler imports), DCP. Seconds of CPU per rank on a small machine.
PRELOAD = ("torch._dynamo", "functorch.compile", "torch._inductor.compile_fx", "torch.distributed.checkpoint")

_CASES: dict[int, dict[str, Callable[["World"], None]]] = {}


def case(*sizes: int):
    """Registers ``fn`` to run in the worlds of the given sizes."""

    def register(fn):
        for size in sizes:
            _CASES.setdefault(size, {})[fn.__name__] = fn
        return fn

    return register


def cases_for(size: int) -> list[str]:
    return sorted(_CASES.get(size, {}))


def params_for(module: str) -> list[tuple[int, str]]:
    """The ``(size, case)`` pairs defined in ``module``, for ``pytest.mark.parametrize``."""
    return [(size, name) for size in sorted(_CASES) for name in cases_for(size) if _CASES[size][name].__module__ == module]


def check(size: int, name: str) -> None:
    """Fails the calling pytest test with every rank's report if case ``name`` failed anywhere."""
    import pytest

    reports = run_world(size)
    if reports.get(name):
        pytest.fail(f"case {name!r} in a world of {size}:\n" + "\n".join(reports[name]), pytrace=False)


@dataclass
class World:
    rank: int
    size: int
    _meshes: dict[Any, Any] = field(default_factory=dict)

    def mesh(self, shape: tuple[int, ...], names: tuple[str, ...] | None):
        """A ``DeviceMesh`` over all ranks, created once per (shape, names) and reused by later cases."""
        from torch.distributed.device_mesh import init_device_mesh

        key = (tuple(shape), names)
        if key not in self._meshes:
            self._meshes[key] = init_device_mesh("cpu", tuple(shape), mesh_dim_names=names)
        return self._meshes[key]


def _child(rank: int, size: int, store_path: str, modules: list[str], results: Any) -> None:
    import importlib

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    # Every group (the mesh's, gradtx's) times out instead of hanging when a rank has failed.
    dist.distributed_c10d.default_pg_timeout = datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    for module in modules:
        importlib.import_module(module)
    dist.init_process_group(
        "gloo",
        store=dist.FileStore(store_path, size),
        rank=rank,
        world_size=size,
        timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S),
    )
    control = dist.new_group(list(range(size)))  # only for "did anyone fail?" between cases
    world = World(rank, size)
    failed_case = None
    try:
        for name in cases_for(size):
            if failed_case is not None:
                results.put((rank, name, f"not run: the world stopped after case {failed_case!r} failed", 0.0))
                continue
            start = time.perf_counter()
            try:
                _CASES[size][name](world)
                error = None
            except BaseException:  # noqa: BLE001 - reported to the parent, which fails the test
                error = traceback.format_exc()
            results.put((rank, name, error, time.perf_counter() - start))
            # A case that failed on some ranks only may have left others blocked in its
            # collectives: they time out, then all agree to stop, so one failure never cascades
            # into timeouts in every later case. A case that failed on every rank left the world
            # in step, and the later cases still run.
            failures = torch.tensor([0 if error is None else 1])
            try:
                dist.all_reduce(failures, group=control)
            except RuntimeError:
                failures.fill_(1)
            if 0 < failures.item() < size:
                failed_case = name
    finally:
        results.put((rank, None, None, 0.0))
        # Leave together and with nothing holding gloo work: wait for every rank (unless the world
        # broke), drop the cases' meshes and collect reference cycles, then destroy the groups.
        # Destroying a group a live object still uses can abort the process at exit.
        if failed_case is None:
            try:
                dist.barrier(group=control)
            except RuntimeError:
                pass
        del world
        gc.collect()
        dist.destroy_process_group()


def _collect_hypothesis_constants() -> None:
    """Hypothesis, on a process's first draw, collects the constants of every local module (a walk
    over all of sys.modules, a second or more with torch imported) to draw from. Done here once,
    the ranks inherit the collection instead of each redoing it, and all draw from the same pool.
    A private function of hypothesis: without it, each rank collects its own, as before."""
    if "hypothesis" not in sys.modules:
        return
    try:
        from hypothesis.internal.conjecture.providers import _get_local_constants
    except ImportError:
        return
    _get_local_constants()


@functools.cache
def run_world(size: int, modules: tuple[str, ...] = CASE_MODULES) -> dict[str, list[str]]:
    """Runs every case registered for ``size`` in one spawned world; returns case -> error reports."""
    import importlib

    for module in modules:
        importlib.import_module(module)
    for module in PRELOAD:
        importlib.import_module(module)
    _collect_hypothesis_constants()
    # fork: the children start with torch and the cases already imported (spawning 8 fresh
    # interpreters costs ~15 s on two cores). The parent never touches torch.distributed.
    context = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn")
    results = context.Queue()
    store_path = tempfile.mktemp(prefix=f"gradtx_world{size}_")
    processes = [
        context.Process(target=_child, args=(rank, size, store_path, list(modules), results), daemon=True)
        for rank in range(size)
    ]
    # The children's garbage collections skip every object that exists now (torch, dynamo, sympy,
    # ...): a full collection otherwise walks them all on every rank.
    gc.collect()
    gc.freeze()
    try:
        for process in processes:
            process.start()
    finally:
        gc.unfreeze()
    reports: dict[str, list[str]] = {name: [] for name in cases_for(size)}
    seen: dict[str, set[int]] = {name: set() for name in cases_for(size)}
    finished: set[int] = set()
    deadline = time.monotonic() + WORLD_TIMEOUT_S
    while len(finished) < size and time.monotonic() < deadline:
        try:
            rank, name, error, seconds = results.get(timeout=1.0)
        except queue_lib.Empty:
            if all(not p.is_alive() for p in processes):
                break
            continue
        if name is None:
            finished.add(rank)
            continue
        seen[name].add(rank)
        if rank == 0 and os.environ.get("GRADTX_CASE_TIMES"):
            print(f"[world {size}] {name}: {seconds:.2f}s", flush=True)
        if error is not None:
            reports[name].append(f"rank {rank}:\n{error}")
    for process in processes:
        process.join(timeout=5)
        if process.is_alive():
            process.kill()
            process.join(timeout=5)
    try:
        os.remove(store_path)
    except OSError:
        pass
    for name in reports:
        missing = sorted(set(range(size)) - seen[name])
        if missing:
            reports[name].append(
                f"ranks {missing} never reported (crashed, or the world of {size} ran past {WORLD_TIMEOUT_S}s; "
                f"exit codes {[p.exitcode for p in processes]})"
            )
    return reports
