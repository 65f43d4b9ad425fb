"""Keeps every test of this folder on one pytest-xdist worker (``--dist loadgroup``): the worlds of
``_world.py`` are spawned once per process and serve all cases, so a second worker would spawn them
all again, and two workers running worlds of 4 and 8 ranks at once would oversubscribe the cores.

pytest-xdist (3.8) groups a test by the ``@group`` suffix it writes into the test's ``_nodeid``;
pytest 9.2 keeps node ids elsewhere, so there the suffix is lost and the group silently splits over
the workers (every world then runs once per worker). The test extra pins ``pytest<9.2``, and the
check below fails such a test instead of letting the run double its work."""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
GROUP = "distributed"


def _ours(item: pytest.Item) -> bool:
    return HERE in Path(str(item.path)).resolve().parents


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook, which reads the mark
def pytest_collection_modifyitems(config, items):
    for item in items:
        if _ours(item):
            item.add_marker(pytest.mark.xdist_group(GROUP))


def pytest_runtest_setup(item):
    """Fails a distributed test that pytest-xdist's ``--dist loadgroup`` did not group, before it
    starts a world: silently, every world would run once per worker."""
    if getattr(item.config.option, "loadgroup", False) and not item.nodeid.endswith(f"@{GROUP}"):
        pytest.fail(
            f"pytest-xdist's --dist loadgroup did not group this test on one worker: this pytest "
            f"({pytest.__version__}) and this pytest-xdist do not work together (pytest 9.2 and "
            "pytest-xdist 3.8 do not). Install the test extra (it pins pytest<9.2) or run with -n 0.",
            pytrace=False,
        )
