"""What a user's mistakes get from the `hlomap` command: one line on stderr naming the value and
where it came from, exit status 2, and nothing they saved overwritten; and Ctrl-C at any moment
stops the command, keeping the best plan found so far."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from hlomap.cli import run

#: A dump with no names hlomap knows: its parameters have no roles until the user names them.
BARE_HLO = """HloModule small, entry_computation_layout={(f32[8,16]{1,0}, f32[16,4]{1,0})->f32[8,4]{1,0}}

ENTRY main {
  x = f32[8,16]{1,0} parameter(0)
  w = f32[16,4]{1,0} parameter(1)
  ROOT d = f32[8,4]{1,0} dot(x, w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}
"""
SAVED = '{"saved": "by the user"}\n'


@pytest.fixture
def bare(tmp_path: Path) -> Path:
    path = tmp_path / "dump.hlo"
    path.write_text(BARE_HLO)
    return path


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    """A file the user saved where the command would write its plan."""
    path = tmp_path / "plan.json"
    path.write_text(SAVED)
    return path


def _one_line_error(capsys: pytest.CaptureFixture[str], *needles: str) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith("note:")]
    assert len(lines) == 1, err
    assert "Traceback" not in err and "internal error" not in err, err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


@pytest.mark.parametrize("task", ["opp", "adp", "hybrid"])
def test_a_dump_without_roles_is_refused_saying_how_to_name_the_weights(
        bare: Path, saved: Path, task: str, capsys: pytest.CaptureFixture[str]) -> None:
    mesh = "data=2,model=4" if task == "hybrid" else "8"
    assert run(["explore", str(bare), "--task", task, "--mesh", mesh, "-q", "-o", str(saved)]) == 2
    _one_line_error(capsys, "has no roles", "--trainable 0-11", "--trainable-prefix")
    assert saved.read_text() == SAVED


@pytest.mark.parametrize("source, options, message", [
    ("zoo:gpt-tiny", ["--trainable", "0-3"], "--trainable 0,1,2,3: zoo:gpt-tiny is lowered from JAX, which knows"),
    ("zoo:gpt-tiny", ["--module", "3"], "--module 3: zoo:gpt-tiny is lowered from JAX"),
    ("DUMP", ["--trainable", "0-3", "--trainable-prefix", "params"],
     "--trainable-prefix params: name the trainable parameters one way"),
    ("STEP", [], "a Python file, not HLO text; name the function that returns (train_step, example_args)"),
    ("PLAN", [], "a JSON file, not HLO text (SOURCE is an HLO text file, zoo:NAME or FILE.py:FUNCTION; a plan file"),
])
def test_inspect_refuses_role_options_it_would_ignore(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                      source: str, options: list[str], message: str) -> None:
    """A zoo step knows its roles and has one module; --trainable and --trainable-prefix together
    used to let the prefix win without a word; a .py file without :FUNCTION was parsed as HLO."""
    dump = tmp_path / "gpt.hlo"
    if source == "DUMP":
        assert run(["zoo", "dump", "gpt-tiny", "-o", str(dump)]) == 0
        capsys.readouterr()
    if source == "PLAN":  # a plan file given where a SOURCE goes was parsed as HLO
        (tmp_path / "plan.json").write_text('{"version": 1, "mesh": {}}\n')
    source = {"DUMP": str(dump), "STEP": str(Path(__file__).resolve().parent / "run" / "user_step.py"),
              "PLAN": str(tmp_path / "plan.json")}.get(source, source)
    assert run(["inspect", source, *options]) == 2
    _one_line_error(capsys, message)


def test_trainable_takes_ranges_and_prefixes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    dump = tmp_path / "gpt.hlo"
    assert run(["zoo", "dump", "gpt-tiny", "-o", str(dump)]) == 0
    capsys.readouterr()
    assert run(["inspect", str(dump), "--json", "--trainable", "0-2,4"]) == 0
    roles = [p["role"] for p in json.loads(capsys.readouterr().out)["parameters"]]
    assert roles[:5] == ["trainable", "trainable", "trainable", "data", "trainable"]
    assert run(["inspect", str(dump), "--json", "--trainable-prefix", "params/layers_0"]) == 0
    report = json.loads(capsys.readouterr().out)
    trainable = {p["path"] for p in report["parameters"] if p["role"] == "trainable"}
    assert trainable and all(path.startswith("params/layers_0/") for path in trainable)
    # the rest of the optimizer state is optimizer state, not data to split
    assert all(p["role"] == "optimizer_state" for p in report["parameters"]
               if p["path"].startswith("opt_state/0/mu/"))


def test_a_jax_dump_takes_its_roles_from_parameter_names_and_says_so(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    dump = tmp_path / "gpt.hlo"
    assert run(["zoo", "dump", "gpt-tiny", "-o", str(dump)]) == 0
    capsys.readouterr()
    assert run(["inspect", str(dump), "--json"]) == 0
    captured = capsys.readouterr()
    roles = {p["path"].split("/")[0]: p["role"] for p in json.loads(captured.out)["parameters"]
             if len(p["shape"]) > 0}
    assert roles == {"params": "trainable", "opt_state": "optimizer_state", "batch": "data"}
    assert "roles were inferred from its parameters' names" in captured.err


@pytest.mark.parametrize("value, needle", [("99", "index out of range"), ("foo", "unknown entry parameter"),
                                          ("3-1", "runs backwards")])
def test_bad_trainable_values_are_named(bare: Path, saved: Path, value: str, needle: str,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    assert run(["explore", str(bare), "--trainable", value, "-q", "-o", str(saved)]) == 2
    _one_line_error(capsys, needle)
    assert saved.read_text() == SAVED


def test_too_many_stages_says_the_maximum(saved: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run(["explore", "zoo:gpt-tiny", "--task", "pipeline", "--stages", "1000", "-q", "-o", str(saved)]) == 2
    _one_line_error(capsys, "--stages 1000", "at most 16 stages")
    assert saved.read_text() == SAVED


@pytest.mark.parametrize("option, value", [("--budget-seconds", "0"), ("--budget-seconds", "-5"),
                                           ("--budget-evaluations", "0"), ("--budget-evaluations", "-3")])
def test_non_positive_budgets_are_refused_before_anything_is_written(
        saved: Path, option: str, value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        run(["explore", "zoo:gpt-tiny", option, value, "-q", "-o", str(saved)])
    assert exit_info.value.code == 2
    _one_line_error(capsys, option, "must be positive")
    assert saved.read_text() == SAVED


def test_a_bad_cluster_file_fails_before_the_search(saved: Path, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    assert run(["explore", "zoo:gpt-tiny", "--cluster", str(tmp_path / "garbage.json"), "-q",
                "-o", str(saved)]) == 2
    _one_line_error(capsys, "garbage.json", "neither a preset")
    assert saved.read_text() == SAVED


def _never(what: str) -> Any:
    def called(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError(f"{what} ran before the input was checked")

    return called


def test_an_output_that_is_a_directory_fails_at_once(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("hlomap.cli.common.load_capture", _never("the capture"))  # nothing is lowered or searched
    assert run(["explore", "zoo:gpt-tiny", "-o", str(tmp_path), "-q"]) == 2
    _one_line_error(capsys, str(tmp_path), "is a directory")


def test_mesh_zero_says_must_be_positive(capsys: pytest.CaptureFixture[str]) -> None:
    assert run(["explore", "zoo:gpt-tiny", "--mesh", "0", "-q"]) == 2
    _one_line_error(capsys, "--mesh", "must be positive")


def test_json_output_is_valid_json_even_with_the_progress_bar(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "p.json"
    assert run(["explore", "zoo:gpt-tiny", "--agent", "greedy", "--budget-evaluations", "20", "--json",
                "-o", str(out)]) == 0
    assert json.loads(capsys.readouterr().out)["version"] == 1


# -- plan files --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gpt_tiny_plan(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A real plan of gpt-tiny (greedy, a few evaluations), as JSON."""
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    assert run(["explore", "zoo:gpt-tiny", "--agent", "greedy", "--budget-evaluations", "5", "-q",
                "-o", str(path)]) == 0
    return json.loads(path.read_text())


def _write(tmp_path: Path, data: dict | bytes) -> Path:
    path = tmp_path / "given.json"
    if isinstance(data, bytes):
        path.write_bytes(data)
    else:
        path.write_text(json.dumps(data))
    return path


def _tampered(plan: dict, *, mesh: dict | None = None, spec: list | None = None, version: int | None = None) -> dict:
    data = json.loads(json.dumps(plan))
    if mesh is not None:
        data["mesh"]["axes"] = mesh
    if spec is not None:
        embed = next(p for p in data["parameters"] if p["path"] == "params/embed/embedding")
        embed["spec"] = spec
        data["groups"] = []
    if version is not None:
        data["version"] = version
    return data


@pytest.mark.parametrize("command", ["simulate", "run"])
@pytest.mark.parametrize("change, needle", [
    (dict(mesh={"model": 3}, spec=["model", None]), "does not divide"),  # 512 rows over 3
    (dict(mesh={"model": 7}, spec=["model", None]), "does not divide"),
    (dict(spec=[None, "nope"]), "does not have"),
    (dict(spec=["model", "model"]), "twice"),
    (dict(version=99), "version 99"),
])
def test_broken_plans_are_refused_before_compiling(gpt_tiny_plan: dict, tmp_path: Path, command: str,
                                                   change: dict, needle: str, capsys: pytest.CaptureFixture[str],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    path = _write(tmp_path, _tampered(gpt_tiny_plan, **change))
    argv = (["simulate", "zoo:gpt-tiny", "--plan", str(path)] if command == "simulate"
            else ["run", str(path), "--source", "zoo:gpt-tiny"])
    # checked before anything is compiled: neither the runner, the comparison nor the estimate starts
    for target in ("hlomap.run.runner.parallelize", "hlomap.verify.numerics.run_plan", "hlomap.api.estimate"):
        monkeypatch.setattr(target, _never(target))
    assert run(argv) == 2
    _one_line_error(capsys, needle)


@pytest.mark.parametrize("command", ["simulate", "run"])
def test_a_plan_for_another_model_says_so(gpt_tiny_plan: dict, tmp_path: Path, command: str,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path, gpt_tiny_plan)
    argv = (["simulate", "zoo:bert-tiny", "--plan", str(path)] if command == "simulate"
            else ["run", str(path), "--source", "zoo:bert-tiny"])
    assert run(argv) == 2
    _one_line_error(capsys, "made for another module")


@pytest.mark.parametrize("command", ["simulate", "run"])
@pytest.mark.parametrize("content, needle", [(None, "No such file"), (b"\x89PNG\r\n\x1a\n\x00\xff", "binary"),
                                             (b"not json", "not a plan JSON file")])
def test_missing_or_binary_plan_files_are_named(tmp_path: Path, command: str, content: bytes | None, needle: str,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "given.json"
    if content is not None:
        path.write_bytes(content)
    argv = (["simulate", "zoo:gpt-tiny", "--plan", str(path)] if command == "simulate"
            else ["run", str(path), "--source", "zoo:gpt-tiny"])
    assert run(argv) == 2
    if command == "simulate" and content is None:  # --plan also takes dp, megatron, dp+megatron
        needle = "nor an existing plan file"
    line = _one_line_error(capsys, needle)
    assert str(path) in line


# -- place and replan --------------------------------------------------------------------------


def _small_plans(tmp_path: Path) -> dict[str, Path]:
    """Plans each of which `place` or `replan` must refuse in one line."""
    from hlomap.plan import Plan, PlanSource

    plans = {
        "spmd-without-estimate": Plan(mesh=(("model", 4),), parameters=(), source=PlanSource("test", "")),
        "one-device": Plan(mesh=(), parameters=(), source=PlanSource("test", "")),
        "pipeline-without-profile": Plan(mesh=(), parameters=(), source=PlanSource("test", ""), pipeline={
            "stages": [{"devices": [0, 1]}, {"devices": [2, 3]}], "microbatches": 2, "schedule": "1f1b"}),
        "joint": Plan(mesh=(), parameters=(), source=PlanSource("test", ""), pipeline={
            "kind": "joint", "stages": [{"devices": [0, 1], "mesh": {"model": 2}}, {"devices": [2, 3],
                                                                                   "mesh": {"model": 2}}],
            "microbatches": 2, "schedule": "1f1b"}),
    }
    paths = {}
    for name, plan in plans.items():
        paths[name] = tmp_path / f"{name}.json"
        plan.save(paths[name])
    return paths


@pytest.mark.parametrize("argv, needle", [
    (["place", "pipeline-without-profile", "--cluster", "torus:4x0"], "cluster 'torus:4x0'"),
    (["place", "pipeline-without-profile", "--cluster", "random:sixty-four"], "random:N:SEED"),
    (["place", "pipeline-without-profile", "--cluster", "hier:4"], "NODESxGPUS"),
    (["simulate", "zoo:gpt-tiny", "--cluster", "torus:9x"], "cluster 'torus:9x'"),
    (["place", "spmd-without-estimate", "--cluster", "torus:2x2"], "no estimate section"),
    (["place", "one-device", "--cluster", "torus:2x2"], "nothing to place"),
    (["place", "pipeline-without-profile", "--cluster", "torus:2x2"], "no block_profile"),
    (["place", "joint", "--cluster", "torus:2x2"], "joint plan"),
    (["replan", "spmd-without-estimate", "--trace", "TRACE"], "needs a pipeline plan"),
    (["replan", "joint", "--trace", "TRACE"], "joint plan"),
    (["place", "one-device", "--cluster", "torus:2x2", "--policy", "p.npz"], "--policy: only --agent ppo reads it"),
    (["place", "one-device", "--cluster", "torus:2x2", "--agent", "random", "--finetune-seconds", "5"],
     "--finetune-seconds: only --agent ppo reads it (--agent is random)"),
])
def test_place_and_replan_refuse_what_they_cannot_use_in_one_line(
        tmp_path: Path, argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]) -> None:
    plans = _small_plans(tmp_path)
    trace = tmp_path / "trace.json"
    trace.write_text('{"version": 1, "cluster": "hier:2x2", "horizon_seconds": 10, "events": []}')
    argv = [str(plans[a]) if a in plans else str(trace) if a == "TRACE" else a for a in argv]
    assert run(argv) == 2
    _one_line_error(capsys, needle)


@pytest.mark.parametrize("option, value, needle", [("--budget-seconds", "0", "must be positive"),
                                                   ("--budget-evaluations", "-2", "must be positive"),
                                                   ("--finetune-seconds", "-1", "must be 0 or more")])
def test_place_refuses_bad_budgets_before_reading_the_plan(tmp_path: Path, option: str, value: str, needle: str,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    plans = _small_plans(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        run(["place", str(plans["one-device"]), "--cluster", "torus:2x2", option, value])
    assert exit_info.value.code == 2
    _one_line_error(capsys, option, needle)


@pytest.mark.parametrize("command", ["place", "replan"])
def test_a_policy_or_network_file_that_is_not_ours_is_named(tmp_path: Path, command: str,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    from hlomap.plan import Plan, PlanSource
    from hlomap.tasks.pipeline.block_profile import PlanProfile
    from tests.tasks.replan.helpers import small_workload

    Plan(mesh=(), parameters=(), source=PlanSource("test", ""), pipeline={
        "stages": [{"devices": [0, 1, 2, 3]}, {"devices": [4, 5, 6, 7]}], "microbatches": 8, "schedule": "1f1b",
        "block_profile": PlanProfile(small_workload().profile, (0, 4, 8)).to_json()}).save(tmp_path / "plan.json")
    (tmp_path / "trace.json").write_text('{"version": 1, "cluster": "hier:2x4", "horizon_seconds": 10, "events": []}')
    (tmp_path / "notes.npz").write_text("not arrays")
    argv = (["place", str(tmp_path / "plan.json"), "--cluster", "torus:2x2x2", "--agent", "ppo", "--policy"]
            if command == "place" else ["replan", str(tmp_path / "plan.json"), "--trace", str(tmp_path / "trace.json"),
                                        "--network"])
    assert run([*argv, str(tmp_path / "notes.npz"), "-q"]) == 2
    _one_line_error(capsys, "notes.npz", "not a checkpoint written by hlomap")


@pytest.mark.parametrize("trace, needle", [("missing", "no such trace file"), ("folder", "is a directory"),
                                           ("binary", "binary data")])
def test_replan_names_a_trace_it_cannot_read(tmp_path: Path, trace: str, needle: str,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    from hlomap.plan import Plan, PlanSource
    from hlomap.tasks.pipeline.block_profile import PlanProfile
    from tests.tasks.replan.helpers import small_workload

    Plan(mesh=(), parameters=(), source=PlanSource("test", ""), pipeline={
        "stages": [{"devices": [0, 1, 2, 3]}, {"devices": [4, 5, 6, 7]}], "microbatches": 8, "schedule": "1f1b",
        "block_profile": PlanProfile(small_workload().profile, (0, 4, 8)).to_json()}).save(tmp_path / "plan.json")
    path = tmp_path / "trace.json"
    if trace == "folder":
        path.mkdir()
    elif trace == "binary":
        path.write_bytes(b"\x89PNG\r\n\x1a\n\x00\xff")
    assert run(["replan", str(tmp_path / "plan.json"), "--trace", str(path), "--no-meta", "-q"]) == 2
    assert str(path) in _one_line_error(capsys, needle)


# -- Ctrl-C ------------------------------------------------------------------------------------


#: `hlomap` as a user's shell starts it: Ctrl-C (SIGINT) delivered, not ignored as it is for a
#: background job (the tests may run as one).
_AS_IN_A_TERMINAL = ("import signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
                     "from hlomap.cli import main; sys.argv[0] = 'hlomap'; main()")


def _start(argv: list[str], cwd: Path) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", _AS_IN_A_TERMINAL, *argv], cwd=cwd, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})


def test_ctrl_c_while_starting_stops_the_command(tmp_path: Path) -> None:
    proc = _start(["explore", "zoo:gpt-small", "--budget-seconds", "120", "-q", "-o", "plan.json"], tmp_path)
    time.sleep(3.0)  # importing JAX, lowering the step: where Ctrl-C used to be swallowed
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=90)
    assert proc.returncode == 130, err
    assert "interrupted" in err and "Traceback" not in err and "Exception ignored" not in err


def test_ctrl_c_during_a_pipeline_dqn_search_keeps_its_best_plan(tmp_path: Path) -> None:
    proc = _start(["explore", "zoo:gpt-tiny", "--task", "pipeline", "--episodes", "100000", "-q",
                   "-o", "plan.json"], tmp_path)
    plan = tmp_path / "plan.json"
    deadline = time.time() + 120
    while not plan.exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.2)
    assert plan.exists(), "the search saves its best plan as it improves"
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=90)
    assert proc.returncode == 130, err
    saved = json.loads(plan.read_text())
    assert saved["pipeline"]["stages"] and saved["search"]["interrupted"] is True
    assert "best plan found so far is saved" in err


# -- outputs are checked before any work ---------------------------------------------------------


@pytest.mark.skipif(not Path("/sys").is_dir(), reason="needs Linux's /sys, where no one can create a file")
@pytest.mark.parametrize("task", ["opp", "pipeline", "auto"])
def test_an_unwritable_output_fails_before_the_search(task: str, capsys: pytest.CaptureFixture[str],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Root passes every permission check on /sys, yet cannot create a file there: the
    directory is probed by writing, before anything is lowered or searched."""
    monkeypatch.setattr("hlomap.cli.common.load_capture", _never("the capture"))
    monkeypatch.setattr("hlomap.api.load_pipeline_source", _never("the capture"))
    assert run(["explore", "zoo:gpt-tiny", "--task", task, "-q", "-o", "/sys/plan.json"]) == 2
    _one_line_error(capsys, "/sys/plan.json", "not writable")


@pytest.mark.skipif(not Path("/sys").is_dir(), reason="needs Linux's /sys, where no one can create a file")
def test_an_unwritable_side_output_fails_before_the_search(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("hlomap.cli.common.load_capture", _never("the capture"))
    assert run(["explore", "zoo:gpt-tiny", "-q", "-o", str(tmp_path / "plan.json"),
                "--curve", "/sys/curve.png"]) == 2
    _one_line_error(capsys, "/sys/curve.png", "not writable")


@pytest.mark.skipif(not Path("/sys").is_dir(), reason="needs Linux's /sys, where no one can create a file")
def test_zoo_dump_to_an_unwritable_file_fails_before_lowering(capsys: pytest.CaptureFixture[str],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("hlomap.api.load_source", _never("the lowering"))
    assert run(["zoo", "dump", "gpt-tiny", "-o", "/sys/tiny.hlo"]) == 2
    _one_line_error(capsys, "/sys/tiny.hlo", "not writable")


@pytest.mark.parametrize("argv", [["explore", "zoo:gpt-tiny", "-q"], ["calibrate"]])
def test_dash_as_the_output_is_refused_not_written_as_a_file_named_dash(
        argv: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """`-o -` reads as "standard output" in most tools; these commands write a file (and a plot
    beside it), so they say so before any work instead of saving a file named `-`."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("hlomap.cli.common.load_capture", _never("the capture"))
    assert run([*argv, "-o", "-"]) == 2
    _one_line_error(capsys, "-:", "not to standard output")
    assert not (tmp_path / "-").exists()


def test_calibrate_does_not_overwrite_a_plan_or_another_file(
        tmp_path: Path, saved: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """`-o plan.json` by a slip of the name: refused before a minute of measuring, the file kept;
    a cluster file written before is replaced as asked."""
    from hlomap import api

    monkeypatch.setattr("hlomap.api.calibrate", _never("the calibration"))
    plan = tmp_path / "opp.json"
    plan.write_text(json.dumps({"version": 1, "mesh": {"axes": {"model": 8}}, "parameters": [], "source": {}}))
    assert run(["calibrate", "--quick", "-o", str(plan)]) == 2
    _one_line_error(capsys, str(plan), "exists and is a plan; calibrate writes cluster files")
    assert run(["calibrate", "--quick", "-o", str(saved)]) == 2
    _one_line_error(capsys, str(saved), "exists and is not a cluster file")
    assert saved.read_text() == SAVED and json.loads(plan.read_text())["version"] == 1
    cluster = Path(__file__).parent / "data" / "clusters" / "cpu8.cluster.json"
    api.check_replaceable_cluster_file(cluster)  # a cluster file: replaced as asked
    api.check_replaceable_cluster_file(tmp_path / "new.json")  # nothing there yet


def test_zoo_dump_to_dash_prints_the_hlo(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert run(["zoo", "dump", "haiku-mlp", "-o", "-"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("HloModule ") and "ENTRY" in out
    assert not (tmp_path / "-").exists()


# -- --fail-if-oom -----------------------------------------------------------------------------


@pytest.fixture
def tiny_memory_cluster(tmp_path: Path) -> Path:
    """Preset A with devices of 1 MiB: no plan of gpt-tiny fits."""
    from hlomap.cost.cluster import cluster_preset
    from hlomap.cost.devices import device_preset

    data = cluster_preset("A").to_json()
    device = device_preset(data["devices"][0]).to_json() | {"name": "V100-1MiB", "memory_bytes": 2**20}
    data["devices"] = [device] * len(data["devices"])
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize("task, mesh", [("opp", "8"), ("adp", "8"), ("hybrid", "data=2,model=4")])
def test_fail_if_oom_exits_3_for_the_sharding_tasks(task: str, mesh: str, tiny_memory_cluster: Path, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["explore", "zoo:gpt-tiny", "--task", task, "--mesh", mesh, "--agent", "greedy", "--budget-evaluations",
            "10", "--cluster", str(tiny_memory_cluster), "-q", "-o", str(tmp_path / "plan.json")]
    assert run(argv) == 0  # without the option a plan that does not fit is still a plan
    assert "DOES NOT FIT" in capsys.readouterr().out
    assert run([*argv, "--fail-if-oom"]) == 3


def test_the_interrupt_handler_only_sets_a_flag() -> None:
    """Raising from a signal handler throws KeyboardInterrupt wherever the main thread is, inside
    an import or a callback from XLA (where it can abort the process): the handler only sets the
    flag, and the command raises at its next check, in ordinary Python code."""
    from hlomap.cli.interrupts import InterruptWatch

    watch = InterruptWatch()
    seen: list[int] = []
    on_progress = watch.wrap(seen.append)
    on_progress(1)
    watch.handler(signal.SIGINT, None)  # does not raise
    assert watch.interrupted
    with pytest.raises(KeyboardInterrupt):
        on_progress(2)
    with pytest.raises(KeyboardInterrupt):
        watch.check()
    assert seen == [1]


def test_a_second_ctrl_c_stops_at_once() -> None:
    """The first Ctrl-C waits for a safe point; the second exits at once, with status 130."""
    code = ("import os, signal, time; from hlomap.cli.interrupts import InterruptWatch; "
            "signal.signal(signal.SIGINT, signal.SIG_DFL); InterruptWatch().install(); "
            "os.kill(os.getpid(), signal.SIGINT); print('first: flag set', flush=True); "
            "os.kill(os.getpid(), signal.SIGINT); time.sleep(30); print('second: not reached')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    assert done.returncode == 130, done.stderr
    assert done.stdout.splitlines() == ["first: flag set"]
    assert "Traceback" not in done.stderr and "stop at once" in done.stderr


# -- a reader that goes away -------------------------------------------------------------------


def test_a_closed_stdout_ends_the_command_quietly(tmp_path: Path) -> None:
    """`hlomap inspect --json | head -1`: once the reader has gone, hlomap stops as a command
    killed by SIGPIPE would (status 141), with no 'internal error' and no traceback."""
    proc = subprocess.Popen([sys.executable, "-m", "hlomap.cli", "inspect", "zoo:gpt-tiny", "--json"], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # before anything is written: the first write meets a closed pipe
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 141, err
    assert "error" not in err and "Traceback" not in err and "Exception ignored" not in err, err


def test_a_command_run_in_process_gives_the_callers_ctrl_c_back() -> None:
    """`hlomap.cli.run` installs its cooperative SIGINT handler only while the command runs."""
    before = signal.getsignal(signal.SIGINT)
    assert run(["zoo", "list"]) == 0
    assert signal.getsignal(signal.SIGINT) is before


def test_the_auto_task_takes_microbatches_and_stages_and_refuses_a_count_that_cannot_split_the_batch(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`--task auto --microbatches M --stages S` plans with M microbatches and at most S stages
    (they were ignored); an M that does not divide the batch is named before any search."""
    plan = tmp_path / "auto.json"
    assert run(["explore", "zoo:gpt-tiny", "--task", "auto", "--cluster", "hier:2x4", "--microbatches", "2",
                "--stages", "1", "-q", "-o", str(plan)]) == 0
    saved = json.loads(plan.read_text())
    assert saved["pipeline"]["microbatches"] == 2 and len(saved["pipeline"]["stages"]) == 1
    capsys.readouterr()
    assert run(["explore", "zoo:gpt-tiny", "--task", "auto", "--cluster", "hier:2x4", "--microbatches", "3",
                "-q", "-o", str(tmp_path / "bad.json")]) == 2
    _one_line_error(capsys, "microbatches [3]", "batch of 8 does not split into 3")


def test_a_plan_a_cluster_file_and_a_folder_given_for_each_other_are_named(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Files swapped between --cluster and a plan argument, or a folder given for either, say what
    they are rather than which field is missing."""
    from hlomap import api

    plan = tmp_path / "plan.json"
    assert run(["explore", "zoo:haiku-mlp", "--agent", "greedy", "--budget-seconds", "2", "-q", "-o", str(plan)]) == 0
    cluster = tmp_path / "cluster.json"
    cluster.write_text(json.dumps({**api.load_cluster("hier:1x8").to_json(), "calibration": {}}))
    capsys.readouterr()
    assert run(["simulate", "zoo:haiku-mlp", "--plan", "dp", "--cluster", str(plan)]) == 2
    _one_line_error(capsys, f"{plan}: a plan file, not a cluster")
    assert run(["run", str(cluster), "--source", "zoo:haiku-mlp"]) == 2
    _one_line_error(capsys, f"{cluster}: a cluster file, not a plan (give it to --cluster")
    assert run(["simulate", "zoo:haiku-mlp", "--plan", "dp", "--cluster", str(tmp_path)]) == 2
    _one_line_error(capsys, "a folder, not a cluster file")
    assert run(["calibrate", "--quick", "-o", str(tmp_path)]) == 2
    _one_line_error(capsys, f"is a directory; name the file to write, e.g. {tmp_path / 'cluster.json'}")


def test_a_pipeline_plan_priced_beside_another_step_is_refused(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """A pipeline plan carries its stage profile, so pricing it needs no module; but a SOURCE named
    beside it must be the step it was made for (as for every other plan), not priced silently."""
    plan = tmp_path / "pipe.json"
    assert run(["explore", "zoo:haiku-mlp", "--task", "pipeline", "--agent", "dp", "--stages", "2",
                "--cluster", "hier:1x8", "-q", "-o", str(plan)]) == 0
    capsys.readouterr()
    assert run(["simulate", "zoo:haiku-mlp", "--plan", str(plan), "--cluster", "hier:1x8"]) == 0
    capsys.readouterr()
    assert run(["simulate", "zoo:gpt-tiny", "--plan", str(plan), "--cluster", "hier:1x8"]) == 2
    _one_line_error(capsys, f"{plan} was made for another module")
    assert run(["place", str(plan), "--cluster", "torus:2x4", "--source", "zoo:gpt-tiny"]) == 2
    _one_line_error(capsys, f"{plan} was made for another module")


def test_pipeline_options_given_to_a_sharding_task_are_refused(saved: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run(["explore", "zoo:haiku-mlp", "--task", "opp", "--agent", "greedy", "--stages", "4",
                "--microbatches", "2", "-o", str(saved)]) == 2
    _one_line_error(capsys, "--task opp does not read --stages (an option of pipeline, auto); --microbatches (an "
                            "option of pipeline, auto)")
    assert saved.read_text() == SAVED


@pytest.mark.parametrize("task, options, message", [
    ("auto", ["--agent", "bogus"], "--task auto does not read --agent (an option of opp, adp, hybrid, pipeline)"),
    ("auto", ["--reward", "cost", "--episodes", "5"], "--task auto does not read --reward (an option of opp, adp, "
                                                      "hybrid); --episodes (an option of pipeline)"),
    ("opp", ["--schedule", "gpipe"], "--task opp does not read --schedule (an option of pipeline, auto)"),
    ("opp", ["--timeline", "t.png"], "--task opp does not read --timeline (an option of pipeline)"),
    ("pipeline", ["--mesh", "data=2,model=4"], "--task pipeline does not read --mesh (an option of opp, adp, hybrid)"),
    ("pipeline", ["--shard-parameters", "on"], "--task pipeline does not read --shard-parameters"),
    # given at their default values: still given, still not read
    ("auto", ["--mesh", "8"], "--task auto does not read --mesh (an option of opp, adp, hybrid)"),
    ("auto", ["--agent", "dqn", "--budget-seconds", "60"], "--task auto does not read --agent (an option of opp, adp, "
                                                           "hybrid, pipeline); --budget-seconds"),
    ("opp", ["--schedule", "1f1b"], "--task opp does not read --schedule (an option of pipeline, auto)"),
])
def test_an_option_the_task_does_not_read_is_refused(saved: Path, capsys: pytest.CaptureFixture[str], task: str,
                                                      options: list[str], message: str) -> None:
    """Every explore option a task would ignore is refused before any work, the plan file kept."""
    assert run(["explore", "zoo:haiku-mlp", "--task", task, *options, "-o", str(saved)]) == 2
    _one_line_error(capsys, message)
    assert saved.read_text() == SAVED


@pytest.mark.parametrize("argv, option", [
    (["run", "PLAN", "--source", "zoo:gpt-tiny", "--rtol", "-1"], "--rtol"),
    (["run", "PLAN", "--source", "zoo:gpt-tiny", "--atol", "nan"], "--atol"),
    (["simulate", "zoo:gpt-tiny", "--top", "-3"], "--top"),
])
def test_negative_tolerances_and_counts_are_refused(tmp_path: Path, argv: list[str], option: str,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """A negative tolerance made every comparison fail; `--top -3` listed rows anyway."""
    with pytest.raises(SystemExit) as exit_info:
        run([str(tmp_path / "plan.json") if a == "PLAN" else a for a in argv])
    assert exit_info.value.code == 2
    _one_line_error(capsys, option, "must be 0 or more")


def test_run_refuses_a_seed_a_step_file_would_ignore(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    step = Path(__file__).resolve().parent / "run" / "user_step.py"
    assert run(["run", str(tmp_path / "plan.json"), "--source", f"{step}:make", "--seed", "5"]) == 2
    _one_line_error(capsys, f"--seed 5: {step}:make returns its own example arguments")
