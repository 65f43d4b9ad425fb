"""Keeps every test of this folder on one pytest-xdist worker (``--dist loadgroup``): the worlds of
``_world.py`` are spawned once per process and serve all cases, so a second worker would spawn them
all again, and two workers running worlds of 4 and 8 ranks at once would oversubscribe the cores."""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items):
    for item in items:
        if HERE in Path(str(item.path)).resolve().parents:
            item.add_marker(pytest.mark.xdist_group("distributed"))
