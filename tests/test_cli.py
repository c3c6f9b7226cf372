"""The `hlomap` command: reports, JSON, and clear errors without tracebacks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hlomap.cli import run

SMALL_HLO = """HloModule small, entry_computation_layout={(f32[8,16]{1,0}, f32[16,4]{1,0})->f32[8,4]{1,0}}

ENTRY main {
  x = f32[8,16]{1,0} parameter(0)
  w = f32[16,4]{1,0} parameter(1)
  ROOT d = f32[8,4]{1,0} dot(x, w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}
"""


def test_inspect_json_on_a_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "small.hlo"
    path.write_text(SMALL_HLO)
    assert run(["inspect", str(path), "--json", "--trainable", "1"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["opcodes"] == {"parameter": 2, "dot": 1}
    assert report["dot_flops"] == 2 * 8 * 4 * 16
    assert report["parameter_bytes"] == (8 * 16 + 16 * 4) * 4
    assert [p["role"] for p in report["parameters"]] == ["data", "trainable"]


def test_inspect_says_when_a_dump_has_no_roles(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "small.hlo"
    path.write_text(SMALL_HLO)
    assert run(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "no roles" in out and "dot" in out


def test_bad_hlo_reports_file_line_and_column(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "bad.hlo"
    path.write_text(SMALL_HLO.replace("parameter(1)", "parameter(1"))
    assert run(["inspect", str(path)]) == 2
    err = capsys.readouterr().err
    # the missing ')' closes line 5; the parser notices at the end of line 5 or on line 6
    assert f"{path}:5:" in err or f"{path}:6:" in err
    assert "expected ')'" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("argv, message", [
    (["inspect", "/nonexistent/file.hlo"], "no such file"),
    (["inspect", "zoo:no-such-model"], "no-such-model"),
])
def test_user_errors_are_one_line(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert run(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_console_script_help_and_exit_code() -> None:
    done = subprocess.run([sys.executable, "-m", "hlomap.cli", "inspect", "--help"], capture_output=True, text=True)
    assert done.returncode == 0 and "SOURCE" in done.stdout
    done = subprocess.run([sys.executable, "-m", "hlomap.cli", "inspect", "/nonexistent.hlo"],
                          capture_output=True, text=True)
    assert done.returncode == 2 and "Traceback" not in done.stderr
