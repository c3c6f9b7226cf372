"""The names DESIGN.md promises at the top level of `hlomap`, importable without JAX until used."""

from __future__ import annotations

import subprocess
import sys

import hlomap


def test_public_names_resolve() -> None:
    for name in hlomap.__all__:
        assert getattr(hlomap, name) is not None, name
    assert callable(hlomap.explore) and callable(hlomap.capture) and callable(hlomap.estimate)
    assert hlomap.Plan.load is not None


def test_import_does_not_load_jax() -> None:
    code = "import sys, hlomap; print('jax' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"
