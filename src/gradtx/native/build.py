"""Compiles gradtx's C kernels on first use with the machine's C compiler, and caches the library.

Each ``<name>.c`` beside this module becomes a shared library in the cache folder
(``$GRADTX_CACHE_DIR``, else ``$XDG_CACHE_HOME/gradtx``, else ``~/.cache/gradtx``), named by a hash
of its source and the headers beside it, the compiler, the flags and this CPU's instruction sets (``-march=native``: a cache
shared by machines of other CPUs never hands them code they cannot run), so a changed source or
compiler builds anew and processes
that build at once never see each other's half-written file. ``GRADTX_NATIVE=0`` turns the kernels
off. Where no compiler works, :func:`load` says why and gradtx keeps to torch's ops (the same numbers).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Optional

HERE = Path(__file__).resolve().parent
# -ffp-contract=off: no multiply-add the source does not write (the numbers must be ATen's);
# -fno-math-errno: sqrtf becomes the vector instruction. No -ffast-math anywhere.
FLAGS = ("-O3", "-march=native", "-mprefer-vector-width=256", "-ffp-contract=off", "-fno-math-errno", "-fPIC", "-shared")
OPENMP = "-fopenmp"

_lock = threading.Lock()
_loaded: dict[str, tuple[Optional[ctypes.CDLL], str]] = {}


def enabled() -> bool:
    """Whether the kernels may be used at all (``GRADTX_NATIVE=0`` says no)."""
    return os.environ.get("GRADTX_NATIVE", "1").strip().lower() not in ("0", "false", "no", "off")


def cache_dir() -> Path:
    if os.environ.get("GRADTX_CACHE_DIR"):
        return Path(os.environ["GRADTX_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "gradtx"


def compiler() -> Optional[str]:
    """The C compiler: ``$CC``, else ``cc``, ``gcc`` or ``clang`` on the path."""
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def load(name: str) -> tuple[Optional[ctypes.CDLL], str]:
    """The library built from ``<name>.c`` and ``""``, or ``None`` and the reason it is not there."""
    with _lock:
        if name not in _loaded:
            _loaded[name] = _build_and_load(name)
        return _loaded[name]


def _build_and_load(name: str) -> tuple[Optional[ctypes.CDLL], str]:
    if not enabled():
        return None, "GRADTX_NATIVE=0"
    if sys.platform == "win32":
        return None, "not built on Windows"
    cc = compiler()
    if cc is None:
        return None, "no C compiler ($CC, cc, gcc or clang) on the path"
    source = (HERE / f"{name}.c").read_bytes() + b"".join(path.read_bytes() for path in sorted(HERE.glob("*.h")))
    errors = []
    for flags in (FLAGS + (OPENMP,), FLAGS):  # without OpenMP where the compiler has none (one thread)
        parts = [source, cc.encode(), _version(cc), " ".join(flags).encode(), _cpu()]
        key = hashlib.sha256(b"\0".join(parts)).hexdigest()[:20]
        target = cache_dir() / f"{name}-{key}.so"
        if not target.exists():
            error = _compile(cc, HERE / f"{name}.c", flags, target)
            if error:
                errors.append(error)
                continue
        try:
            return ctypes.CDLL(str(target)), ""
        except OSError as exc:
            errors.append(f"{target} does not load: {exc}")
    return None, "; ".join(errors)


@functools.cache
def _cpu() -> bytes:
    """What ``-march=native`` compiles for: the CPU's feature flags (Linux), else its name."""
    try:
        with open("/proc/cpuinfo", "rb") as info:
            for line in info:
                if line.startswith((b"flags", b"Features")):
                    return line
    except OSError:
        pass
    return f"{platform.machine()} {platform.processor()}".encode()


@functools.cache
def _version(cc: str) -> bytes:
    try:
        return subprocess.run([cc, "--version"], capture_output=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return b""


def _compile(cc: str, source: Path, flags: tuple[str, ...], target: Path) -> str:
    """Builds ``target`` (written under a temporary name, then renamed); returns an error or ``""``."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, partial = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
    except OSError as exc:
        return f"cannot write to {target.parent}: {exc}"
    try:
        done = subprocess.run([cc, *flags, str(source), "-o", partial, "-lm"], capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            return f"{os.path.basename(cc)} {' '.join(flags)} failed: {done.stderr.strip()[-400:]}"
        os.replace(partial, target)
        return ""
    except (OSError, subprocess.SubprocessError) as exc:
        return f"{os.path.basename(cc)} did not run: {exc}"
    finally:
        if os.path.exists(partial):
            os.remove(partial)
