"""Frameworks imported when a test first uses them, not when pytest collects the file: transformers
and lightning take seconds to import, and every pytest-xdist worker collects every file."""

from __future__ import annotations

import importlib.util
from types import ModuleType

import pytest


class LazyModule:
    """Stands for module ``name``: the first attribute read imports it (skipping the test if that fails)."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._module: ModuleType | None = None

    def __getattr__(self, attr: str):
        if attr.startswith("_"):  # pytest's probes while collecting (__test__, fixture markers)
            raise AttributeError(attr)
        if self._module is None:
            self._module = pytest.importorskip(self._name)
        return getattr(self._module, attr)


def lazy_or_skip(name: str) -> LazyModule:
    """``name``, imported at its first use; skips the calling test file now if its package is not installed."""
    if importlib.util.find_spec(name.partition(".")[0]) is None:
        pytest.skip(f"{name} is not installed", allow_module_level=True)
    return LazyModule(name)
