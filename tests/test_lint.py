"""The repository passes ruff with the rules in pyproject.toml ([tool.ruff]); CI runs this test."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _ruff() -> list[str]:
    """ruff as installed by the test extras: its console script, else the module."""
    found = shutil.which("ruff")
    if found:
        return [found]
    try:
        import ruff  # noqa: F401
    except ImportError:
        pytest.fail("ruff is not installed: `python -m pip install -e '.[test]'` brings it")
    return [sys.executable, "-m", "ruff"]


def test_ruff_finds_nothing() -> None:
    done = subprocess.run([*_ruff(), "check", "--no-cache", "--output-format", "concise", "."], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
