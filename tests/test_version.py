"""One version number: pyproject.toml's, gradtx.__version__, and a CHANGELOG.md section for it."""

from __future__ import annotations

import re
from pathlib import Path

import gradtx

ROOT = Path(__file__).resolve().parent.parent


def pyproject_version() -> str:
    match = re.search(r'^version\s*=\s*"([^"]+)"', (ROOT / "pyproject.toml").read_text(), flags=re.M)
    assert match, "pyproject.toml has no version"
    return match.group(1)


def test_package_version_is_pyprojects():
    assert gradtx.__version__ == pyproject_version()


def test_changelog_has_a_section_for_the_version():
    headings = re.findall(r"^## \[([^\]]+)\]", (ROOT / "CHANGELOG.md").read_text(), flags=re.M)
    assert pyproject_version() in headings, f"CHANGELOG.md has sections {headings}, none for {pyproject_version()}"
