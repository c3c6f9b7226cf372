"""The `hlomap` command: reports, JSON, and clear errors without tracebacks."""

from __future__ import annotations

import copy
import argparse
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

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
    assert report["dot_flops"] == report["flops"] == 2 * 8 * 4 * 16
    assert report["convolution_flops"] == 0
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


def _json_of(argv: list[str], capsys: pytest.CaptureFixture[str]) -> dict:
    run(argv)
    return json.loads(capsys.readouterr().out)


def _inspect_and_simulate_flops(model: str, capsys: pytest.CaptureFixture[str],
                                monkeypatch: pytest.MonkeyPatch) -> tuple[dict, dict]:
    """`inspect --json` and `simulate --plan dp --mesh 1 --json` of one zoo step, captured once
    for both commands (they pass different, equivalent keyword arguments)."""
    import inspect

    import hlomap.api

    load, captured = hlomap.api.load_source, {}
    signature = inspect.signature(load)

    def load_once(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        key = repr(sorted(bound.arguments.items()))
        if key not in captured:
            captured[key] = load(*args, **kwargs)
        return captured[key]

    monkeypatch.setattr(hlomap.api, "load_source", load_once)
    inspected = _json_of(["inspect", f"zoo:{model}", "--json"], capsys)
    simulated = _json_of(["simulate", f"zoo:{model}", "--plan", "dp", "--mesh", "1", "--json"], capsys)
    return inspected, simulated


def _check_one_flop_count(inspected: dict, simulated: dict) -> None:
    # One FLOP count (hlomap.cost.compute): a one-device data-parallel step does the module's work.
    assert inspected["flops"] == simulated["flops"] > 0
    assert 0 < inspected["dot_flops"] + inspected["convolution_flops"] <= inspected["flops"]
    by_kind = {row["kind"]: row["flops"] for row in simulated["by_kind"]}
    assert inspected["dot_flops"] == by_kind.get("dot", 0.0)
    assert inspected["convolution_flops"] == by_kind.get("convolution", 0.0)


@pytest.mark.parametrize("model", ["gpt-tiny", "vgg19-tiny"])
def test_inspect_and_simulate_report_the_same_flops(model: str, capsys: pytest.CaptureFixture[str],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    _check_one_flop_count(*_inspect_and_simulate_flops(model, capsys, monkeypatch))


@pytest.mark.slow
@pytest.mark.parametrize("model", ["vgg19", "resnet50", "gpt-small"])
def test_inspect_and_simulate_report_the_same_flops_on_full_models(
        model: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    _check_one_flop_count(*_inspect_and_simulate_flops(model, capsys, monkeypatch))


# ---------------------------------------------------------------------------------------------
# explore and run
# ---------------------------------------------------------------------------------------------

PIPEDREAM_VGG16 = Path(__file__).resolve().parents[2] / "shared" / "corpus" / "pipedream" / "vgg16.txt"


def test_explore_saves_a_plan_that_runs_with_unsharded_numerics(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    plan_path = tmp_path / "plan.json"
    assert run(["explore", "zoo:gpt-tiny", "--agent", "exact", "--budget-seconds", "60", "-q",
                "-o", str(plan_path)]) == 0
    captured = capsys.readouterr()
    assert "variables sharded" in captured.out and "mlp" in captured.out
    saved = json.loads(plan_path.read_text())
    assert saved["mesh"] == {"axes": {"model": 8}}
    assert saved["search"]["driver"] == "exact" and saved["search"]["reward"] == "paper"
    assert any(any(s is not None for s in p["spec"]) for p in saved["parameters"])
    assert (tmp_path / "plan.convergence.png").stat().st_size > 0

    assert run(["run", str(plan_path), "--source", "zoo:gpt-tiny", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    # equal in float32 at the CLI's own tolerances (loss 1e-5 relative, each gradient leaf 1e-4
    # of its scale, updates 1e-3 of the leaf's update): no float64 rescue needed
    assert report["ok"] is True and report["float32_equal"] is True and not report["float64"]
    whats = {c["what"]: c for c in report["comparisons"]}
    assert {"loss", "gradients", "updated parameters"} <= set(whats)
    assert all(c["ok"] for c in whats.values())
    params = sum(p["path"].startswith("params") for p in saved["parameters"])
    assert whats["gradients"]["leaves"] == params > 0  # one gradient per trainable leaf
    assert whats["gradients"]["worst_relative_error"] < 1e-4


CPU8 = Path(__file__).resolve().parent / "data" / "clusters" / "cpu8.cluster.json"


@pytest.mark.parametrize("cluster, says", [(str(CPU8), True), ("hier:1x8", False)])
def test_explore_says_when_one_device_is_priced_faster(cluster: str, says: bool, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """8 host CPU devices share 2 cores: on their calibration the opp task's plan on {model: 8}
    is priced slower than the step on one device, which it cannot return; explore says so. On
    devices of their own it never does."""
    assert run(["explore", "zoo:haiku-mlp", "--agent", "greedy", "--cluster", cluster, "-q",
                "-o", str(tmp_path / "plan.json")]) == 0
    err = capsys.readouterr().err
    found = re.search(r"note: the whole step on one device is priced at ([\d.]+) ms per step, ([\d.]+)x faster "
                      r"than this plan on 8 devices \(([\d.]+) ms\): they share (?:the host's \d+ cores|their hardware)",
                      err)
    assert (found is not None) == says, err
    if says:
        one, ratio, plan = (float(g) for g in found.groups())
        assert one < plan and ratio == pytest.approx(plan / one, abs=0.06)


@pytest.mark.slow
def test_the_readme_flow_on_gpt_small_says_equal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """README's Quickstart command then its suggested `hlomap run plan.json --source zoo:gpt-small`:
    a correct plan whose key-bias gradients are zero up to rounding (Adam makes them +-lr) is
    reported equal, with every gradient leaf within its scale's tolerance."""
    monkeypatch.chdir(tmp_path)
    assert run(["explore", "zoo:gpt-small", "--budget-seconds", "30", "-q"]) == 0
    capsys.readouterr()
    assert run(["run", "plan.json", "--source", "zoo:gpt-small"]) == 0
    out = capsys.readouterr().out
    assert "gradients equal" in out and "updated parameters equal" in out
    assert ": equal to the unsharded step" in " ".join(out.split())


def test_run_refuses_a_plan_made_for_another_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plan_path = tmp_path / "plan.json"
    assert run(["explore", "zoo:gpt-tiny", "--agent", "greedy", "-q", "-o", str(plan_path)]) == 0
    capsys.readouterr()
    assert run(["run", str(plan_path), "--source", "zoo:bert-tiny"]) == 2
    err = capsys.readouterr().err
    assert "another module" in err and "Traceback" not in err


@pytest.mark.parametrize("argv, message", [
    (["explore", "zoo:gpt-tiny", "--agent", "dp"], "--agent dp"),
    (["explore", "zoo:gpt-tiny", "--task", "pipeline", "--agent", "greedy"], "--agent greedy"),
    (["explore", "zoo:gpt-tiny", "--mesh", "model=x"], "--mesh"),
    (["explore", "zoo:gpt-tiny", "--task", "hybrid", "--mesh", "8"], "data x model"),
    (["explore", "zoo:gpt-tiny", "-o", "/nonexistent/dir/plan.json"], "does not exist"),
    (["explore", "pipedream:/nonexistent.txt", "--task", "pipeline"], "no such PipeDream profile"),
    (["run", "/nonexistent/plan.json", "--source", "zoo:gpt-tiny"], "No such file"),
])
def test_explore_and_run_user_errors(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert run(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_explore_pipeline_on_a_zoo_step(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plan_path = tmp_path / "pp.json"
    assert run(["explore", "zoo:gpt-tiny", "--task", "pipeline", "--stages", "2", "--agent", "dp", "-q",
                "--microbatches", "1", "-o", str(plan_path)]) == 0  # a batch of 8 splits over stages of 8
    out = capsys.readouterr().out
    assert "Cuts" in out and "device cuts: [8]" in out and "on server boundaries" in out
    saved = json.loads(plan_path.read_text())
    stages = saved["pipeline"]["stages"]
    assert len(stages) == 2 and [s["devices"][0] for s in stages] == [0, 8]
    assert saved["search"]["driver"] == "dp" and saved["estimate"]["step_seconds"] > 0
    assert (tmp_path / "pp.timeline.png").stat().st_size > 0
    assert run(["run", str(plan_path), "--source", "zoo:gpt-tiny"]) == 2  # cluster A's 16 GPUs, 8 CPU devices here
    assert "needs 16 devices" in capsys.readouterr().err


def test_explore_pipeline_at_downsets_records_the_runs_before_each_cut(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """--agent dp cuts gpt-tiny at downsets on hier:2x4 (cheaper than the chain's order there); the
    plan's cut lists its runs and the search section both optima; --downset-states 0 turns it off."""
    plan_path = tmp_path / "ds.json"
    argv = ["explore", "zoo:gpt-tiny", "--task", "pipeline", "--stages", "2", "--agent", "dp", "--microbatches", "2",
            "--cluster", "hier:2x4", "-q", "--downset-states", "128", "-o", str(plan_path)]
    assert run(argv) == 0
    assert "cut at downsets of the layer DAG" in capsys.readouterr().out
    saved = json.loads(plan_path.read_text())
    assert saved["pipeline"]["cuts"][0]["downset"] and saved["search"]["downset_states"] > 0
    assert saved["search"]["straight_optimum"] > saved["estimate"]["model_step_seconds"]
    assert run([*argv[:-4], "--downset-states", "0", "-o", str(plan_path)]) == 0
    assert "downset" not in json.loads(plan_path.read_text())["pipeline"]["cuts"][0]


USER_STEP = Path(__file__).resolve().parent / "run" / "user_step.py"


def _user_pipeline_plan(tmp_path: Path, microbatches: int = 4, schedule: str = "gpipe") -> Path:
    """A 2-stage plan (4 devices per stage) for tests/run/user_step.py, saved to a file."""
    import hlomap
    from tests.run.helpers import boundary_pivots, chain_of, pipeline_plan
    from tests.run.user_step import make

    step, args = make()
    cap = hlomap.capture(step, *args)
    chain = chain_of(cap)
    plan = pipeline_plan(cap, chain, boundary_pivots(chain, 1), microbatches=microbatches, schedule=schedule,
                         devices_per_stage=4)
    path = tmp_path / "pipeline.json"
    plan.save(path)
    return path


def test_run_a_pipeline_plan_of_a_user_step(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plan_path = _user_pipeline_plan(tmp_path)
    assert run(["run", str(plan_path), "--source", f"{USER_STEP}:make", "--rtol", "0.5"]) == 0
    out, err = capsys.readouterr()
    assert "note: --rtol did not apply: the step marks its loss" in err  # the outputs' tolerance, not read
    assert "Cuts" in out and "layer1/" in out and "exact" in out  # the explorer's layer names, mapped
    assert "gradients equal" in out and "loss equal" in out
    assert run(["run", str(plan_path), "--source", f"{USER_STEP}:make", "--executor", "mpmd", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is True and report["description"]["executor"] == "mpmd"
    assert {c["what"] for c in report["comparisons"]} == {"loss", "gradients"}


def test_explore_takes_the_same_file_py_function_source_as_run(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """`hlomap explore mymodel.py:make`: a user's step explored, then run from the same source;
    on a terminal the run says which phase it is in (a big step sits minutes in each)."""
    plan_path = tmp_path / "plan.json"
    assert run(["explore", f"{USER_STEP}:make", "--agent", "greedy", "--budget-evaluations", "10", "-q",
                "-o", str(plan_path)]) == 0
    assert json.loads(plan_path.read_text())["parameters"]
    capsys.readouterr()
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    assert run(["run", str(plan_path), "--source", f"{USER_STEP}:make"]) == 0
    captured = capsys.readouterr()
    assert "equal" in captured.out
    phases = [line.split("] ", 1)[1] for line in captured.err.splitlines() if line.startswith("[")]
    assert phases == ["loading the step and its example arguments ...", "building the unsharded step ...",
                      "preparing the plan's step (shardings; a pipeline's cuts and stages) ...",
                      "running the unsharded step ...", "compiling and running the plan's step ...",
                      "running the whole step sharded and unsharded (the optimizer's update) ...",
                      "timing one step ..."]


def test_run_compares_the_outputs_of_a_step_without_a_marked_loss(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """Through `hlomap.parallelize` like every other plan: the SPMD step's outputs against the
    unsharded step's."""
    plan_path = tmp_path / "plan.json"
    source = f"{USER_STEP}:make_unmarked"
    assert run(["explore", source, "--agent", "greedy", "--budget-evaluations", "10", "-q", "-o", str(plan_path)]) == 0
    capsys.readouterr()
    assert run(["run", str(plan_path), "--source", source]) == 0
    out = capsys.readouterr().out
    assert "comparing the step's outputs" in out and "outputs equal to the unsharded step" in out
    assert run(["run", str(plan_path), "--source", source, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ok"] is True


def test_run_exits_3_when_the_pipeline_differs(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    from hlomap.run import compare

    original = compare.reference_gradients

    def off_by_a_little(*args, **kwargs):
        reference = original(*args, **kwargs)
        return compare.GradientResult(reference.loss, reference.aux, [g * 1.01 for g in reference.grads])

    monkeypatch.setattr(compare, "reference_gradients", off_by_a_little)
    assert run(["run", str(_user_pipeline_plan(tmp_path)), "--source", f"{USER_STEP}:make"]) == 3
    assert "gradients DIFFERENT" in capsys.readouterr().out


@pytest.mark.parametrize("source, microbatches, message", [
    (f"{USER_STEP}:nowhere", 4, "has no function 'nowhere'"),
    (f"{USER_STEP}:make_unmarked", 4, "hlomap.value_and_grad"),
    (f"{USER_STEP}:make", 3, "{plan}: the batch of 16 examples cannot be split into 3 equal microbatches"),
    ("not-a-source", 4, "expected zoo:NAME or FILE.py:FUNCTION"),
    (f"{USER_STEP}:make_raising", 4, f"tracing train_step failed at {USER_STEP}:"),
])
def test_run_pipeline_user_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str], source: str,
                                  microbatches: int, message: str) -> None:
    """Each in one line; what the plan asks and the step cannot do names the plan file."""
    plan_path = _user_pipeline_plan(tmp_path, microbatches=microbatches)
    assert run(["run", str(plan_path), "--source", source]) == 2
    err = capsys.readouterr().err
    assert message.format(plan=plan_path) in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


@pytest.mark.skipif(not PIPEDREAM_VGG16.exists(), reason="needs ../shared/corpus/pipedream")
def test_explore_pipeline_on_a_pipedream_profile(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out_path = tmp_path / "vgg.json"
    assert run(["explore", f"pipedream:{PIPEDREAM_VGG16}", "--task", "pipeline", "--stages", "2", "--agent", "dp",
                "--json", "-q", "-o", str(out_path)]) == 0
    result = json.loads(capsys.readouterr().out)
    assert len(result["stages"]) == 2 and result["latency_seconds"] > 0
    assert json.loads(out_path.read_text())["cuts"] == result["cuts"]


@pytest.mark.skipif(not PIPEDREAM_VGG16.exists(), reason="needs ../shared/corpus/pipedream")
def test_a_pipedream_graph_is_recognised_without_its_prefix(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["explore", "--task", "pipeline", "--stages", "2", "--agent", "dp", "--json", "-q"]
    assert run([*argv[:1], f"pipedream:{PIPEDREAM_VGG16}", *argv[1:], "-o", str(tmp_path / "a.json")]) == 0
    prefixed = json.loads(capsys.readouterr().out)
    assert run([*argv[:1], str(PIPEDREAM_VGG16), *argv[1:], "-o", str(tmp_path / "b.json")]) == 0
    assert json.loads(capsys.readouterr().out)["cuts"] == prefixed["cuts"]
    assert run(["explore", str(PIPEDREAM_VGG16), "--task", "opp", "-o", str(tmp_path / "c.json")]) == 2
    err = capsys.readouterr().err
    assert "PipeDream profile" in err and "--task pipeline" in err and "Traceback" not in err


# ---------------------------------------------------------------------------------------------
# place
# ---------------------------------------------------------------------------------------------


def test_place_a_pipeline_plan_on_a_torus_and_simulate_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plan_path, placed_path = tmp_path / "pp.json", tmp_path / "placed.json"
    assert run(["explore", "zoo:gpt-tiny", "--task", "pipeline", "--stages", "2", "--agent", "dp", "-q",
                "--microbatches", "1", "-o", str(plan_path)]) == 0  # a batch of 8 splits over stages of 8
    capsys.readouterr()
    assert run(["place", str(plan_path), "--cluster", "torus:4x4", "--budget-evaluations", "3000", "-q",
                "-o", str(placed_path)]) == 0
    out = capsys.readouterr().out
    assert "placed by greedy: step " in out and " by the closed form (identity order " in out and "stage" in out
    placement = json.loads(placed_path.read_text())["placement"]
    assert placement["cluster"] == "torus:4x4" and sorted(placement["devices"]) == list(range(16))
    assert placement["step_seconds"] < placement["identity_step_seconds"]
    assert run(["simulate", "zoo:gpt-tiny", "--plan", str(placed_path), "--cluster", "torus:4x4", "--json"]) == 0
    simulated = json.loads(capsys.readouterr().out)
    assert simulated["step_seconds"] < simulated["identity_order_step_seconds"]
    assert simulated["model_step_seconds"] == pytest.approx(placement["step_seconds"], rel=1e-9)
    assert run(["simulate", "zoo:gpt-tiny", "--plan", str(placed_path), "--cluster", "torus:4x4"]) == 0
    assert "identity order" in capsys.readouterr().out
    # without --cluster a placed plan is priced where it was placed, not where it was explored
    assert run(["simulate", "zoo:gpt-tiny", "--plan", str(placed_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == simulated
    assert run(["simulate", "zoo:gpt-tiny", "--plan", str(placed_path)]) == 0
    err = capsys.readouterr().err
    assert "note: pricing on torus:4x4, the cluster the plan was placed on" in err and "explored on" not in err


@pytest.mark.slow  # 20 s; a placed SPMD plan's run: tests/run/test_executors.py
def test_place_an_spmd_plan_then_simulate_and_run_it_on_its_placement(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plan_path, placed_path = tmp_path / "hybrid.json", tmp_path / "placed.json"
    assert run(["explore", "zoo:gpt-tiny", "--task", "hybrid", "--mesh", "data=2,model=4", "--agent", "greedy", "-q",
                "-o", str(plan_path)]) == 0
    capsys.readouterr()
    assert run(["place", str(plan_path), "--cluster", "torus:2x2x2", "--source", "zoo:gpt-tiny",
                "--budget-evaluations", "2000", "--json", "-q", "-o", str(placed_path)]) == 0
    placement = json.loads(capsys.readouterr().out)
    assert sorted(placement["devices"]) == list(range(8))
    assert placement["step_seconds"] < placement["identity_step_seconds"]  # rings of one hop, not two
    assert run(["simulate", "zoo:gpt-tiny", "--plan", str(placed_path), "--cluster", "torus:2x2x2", "--json"]) == 0
    simulated = json.loads(capsys.readouterr().out)
    assert simulated["step_seconds"] == pytest.approx(placement["step_seconds"], rel=1e-9)
    assert simulated["identity_order_step_seconds"] == pytest.approx(placement["identity_step_seconds"], rel=1e-9)
    assert run(["run", str(placed_path), "--source", "zoo:gpt-tiny", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ok"]


@pytest.mark.parametrize("argv, message", [
    (["place", "PLAN", "--cluster", "torus:4xx4"], "shape '4xx4'"),
    (["place", "PLAN", "--cluster", "mesh:2x2"], "16 logical positions but cluster 'mesh:2x2' has only 4"),
    (["place", "PLAN", "--cluster", "torus:4x4", "--agent", "dqn"], "--agent dqn"),
    (["place", "PLAN", "--cluster", "torus:4x4", "--agent", "exact"], "16! = "),
    (["place", "/nonexistent/plan.json", "--cluster", "torus:4x4"], "No such file"),
    (["simulate", "zoo:gpt-tiny", "--plan", "PLAN", "--axis-order", "data"],
     "--axis-order data: a pipeline plan's stages fix its devices"),
])
def test_place_user_errors(argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from hlomap.plan import Plan, PlanSource

    plan = Plan(mesh=(), parameters=(), source=PlanSource("test", ""), pipeline={
        "stages": [{"devices": list(range(8))}, {"devices": list(range(8, 16))}], "microbatches": 2,
        "schedule": "1f1b", "block_profile": {"names": ["a", "b"], "forward_seconds": [1e-3, 1e-3],
                                              "backward_seconds": [2e-3, 2e-3], "parameter_bytes": [1e6, 1e6],
                                              "stash_bytes": None, "activation_bytes": [1e5], "stage_bounds": [0, 1, 2]}})
    plan.save(tmp_path / "plan.json")
    argv = [str(tmp_path / "plan.json") if a == "PLAN" else a for a in argv]
    assert run(argv) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1 and message in errors[0] and "Traceback" not in err


# ---------------------------------------------------------------------------------------------
# replan
# ---------------------------------------------------------------------------------------------


def test_replan_prints_decisions_and_totals_and_draws_the_plot(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    from hlomap.plan import Plan, PlanSource
    from hlomap.tasks.pipeline.block_profile import PlanProfile
    from hlomap.tasks.replan.trace import Event, Trace
    from hlomap.cost.cluster import load_cluster
    from tests.tasks.replan.helpers import small_workload

    workload = small_workload()
    stages = [[0, 1], [2, 3], [4, 5], [6, 7]]
    plan = Plan(mesh=(), parameters=(), source=PlanSource("test", ""), pipeline={
        "stages": [{"devices": s} for s in stages], "microbatches": workload.microbatches, "schedule": "1f1b",
        "block_profile": PlanProfile(workload.profile, (0, 2, 4, 6, 8)).to_json()})
    plan.save(tmp_path / "plan.json")
    cluster = load_cluster("hier:4x2")
    Trace("demo", cluster, 10_000.0, (Event(1000.0, ((0, 1, 1e8), (1, 2, 1e8))), Event(4000.0, gpus=(2, 0, 2, 2)),
                                      Event(7000.0, gpus=(2, 2, 2, 2)))).save(tmp_path / "trace.json")
    assert run(["replan", str(tmp_path / "plan.json"), "--trace", str(tmp_path / "trace.json"), "--no-meta",
                "-q"]) == 0
    out = capsys.readouterr().out
    assert "arbiter on trace demo" in out and "total training time" in out and "oracle" in out
    assert run(["replan", str(tmp_path / "plan.json"), "--trace", str(tmp_path / "trace.json"), "--no-meta",
                "-q", "--show", "static", "--plot", str(tmp_path / "static.png")]) == 0
    assert "cannot run" in capsys.readouterr().out  # server 1 left under the static plan
    assert (tmp_path / "plan.replan.png").stat().st_size > 0
    assert run(["replan", str(tmp_path / "plan.json"), "--trace", str(tmp_path / "trace.json"), "--no-meta",
                "--json", "-q", "--show", "static"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert set(data["policies"]) == {"static", "re-solve", "arbiter", "oracle"}
    assert data["policies"]["static"]["decisions"][2]["option"] == "re-solve"  # forced: its devices left


def test_replan_takes_a_joint_plan_with_its_source(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A joint plan (hlomap explore --task auto with stages) is re-planned in the joint planner's
    space; without its SOURCE it is one line and exit 2."""
    from hlomap.tasks.replan.trace import Event, Trace
    from hlomap.cost.cluster import load_cluster

    assert run(["explore", "zoo:gpt-tiny", "--task", "auto", "--cluster", "hier:2x4", "-o",
                str(tmp_path / "auto.json")]) == 0
    assert json.loads((tmp_path / "auto.json").read_text())["pipeline"]["kind"] == "joint"
    Trace("demo", load_cluster("hier:2x4"), 10_000.0, (Event(4000.0, gpus=(1, 0)), Event(7000.0, gpus=(4, 4)))).save(
        tmp_path / "trace.json")
    capsys.readouterr()
    argv = ["replan", str(tmp_path / "auto.json"), "--trace", str(tmp_path / "trace.json"), "--no-meta", "-q"]
    assert run(argv) == 2
    err = capsys.readouterr().err
    assert "give its SOURCE with --source" in err and "Traceback" not in err
    assert run([*argv, "--source", "zoo:gpt-tiny", "--show", "static", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    static = data["policies"]["static"]["decisions"]
    assert static[1]["option"] == "re-solve" and static[1]["plan"].startswith("[0,")  # one device left: forced
    assert "M=" in static[1]["plan"]


@pytest.mark.parametrize("trace_text, message", [
    ('{"version": 1, "cluster": "hier:4x2", "horizon_seconds": 10, "events": [{"time": 1, "gpus": [2, 2]}]}',
     "gpus lists 2 servers"),
    ('{"version": 1, "cluster": "hier:1x4", "horizon_seconds": 10, "events": []}', "has a cluster of 4 devices"),
    ("{not json", "invalid JSON"),
])
def test_replan_user_errors(trace_text: str, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from hlomap.plan import Plan, PlanSource
    from hlomap.tasks.pipeline.block_profile import PlanProfile
    from tests.tasks.replan.helpers import small_workload

    workload = small_workload()
    Plan(mesh=(), parameters=(), source=PlanSource("test", ""), pipeline={
        "stages": [{"devices": [0, 1, 2, 3]}, {"devices": [4, 5, 6, 7]}], "microbatches": 8, "schedule": "1f1b",
        "block_profile": PlanProfile(workload.profile, (0, 4, 8)).to_json()}).save(tmp_path / "plan.json")
    (tmp_path / "trace.json").write_text(trace_text)
    assert run(["replan", str(tmp_path / "plan.json"), "--trace", str(tmp_path / "trace.json"), "--no-meta"]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_run_exits_3_when_an_spmd_plans_gradients_differ(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The SPMD comparison can fail: against a reference whose gradients are 1% off, Megatron's
    plan of gpt-tiny is reported DIFFERENT (exit 3), in float64 too."""
    from hlomap.api import load_source
    from hlomap.plan import Plan, reference_plan
    from hlomap.propagation.graph import FactorGraph
    from hlomap.run import compare

    cap = load_source("zoo:gpt-tiny")
    graph = FactorGraph.from_capture(cap)
    array, axes = reference_plan(graph, "megatron", {"model": 8})
    plan_path = tmp_path / "megatron.json"
    Plan.from_groups(cap, graph, array, axes).save(plan_path)
    original = compare.reference_gradients

    def off_by_a_little(*args, **kwargs):
        reference = original(*args, **kwargs)
        return compare.GradientResult(reference.loss, reference.aux, [g * 1.01 for g in reference.grads])

    monkeypatch.setattr(compare, "reference_gradients", off_by_a_little)
    assert run(["run", str(plan_path), "--source", "zoo:gpt-tiny"]) == 3
    out = " ".join(capsys.readouterr().out.split())
    assert "gradients DIFFERENT" in out and "gradients in float64 DIFFERENT" in out and "DIFFERENT to the unsharded" in out


def test_calibrate_quick_writes_a_cluster_that_load_cluster_reads(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    from hlomap.cost.cluster import load_cluster

    out = tmp_path / "x.json"
    assert run(["calibrate", "--quick", "--devices", "2", "-o", str(out), "--quiet"]) == 0
    captured = capsys.readouterr()
    assert "collective-permute" in captured.out and "matmul dtype" in captured.out
    assert f"wrote {out}" in captured.err
    cluster = load_cluster(out)
    assert cluster.n_devices == 2 and cluster.bandwidth[0, 1] > 0
    kept = json.loads(out.read_text())["calibration"]
    assert kept["n_devices"] == 2 and kept["backend"] == "cpu" and kept["jax_version"]
    kinds = {s["kind"] for s in kept["samples"]["comm"]}
    assert kinds == {"all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute", "transfer",
                     "dispatch", "launch", "combined-all-reduce"}
    assert {k["dtype"] for k in kept["samples"]["kernels"] if k["kind"] == "dot"} == {"f32", "bf16"}
    # both pipeline executors timed on 2 devices (2 stages), and the costs the model uses kept
    assert {s["executor"] for s in kept["samples"]["executors"]} == {"spmd", "mpmd"}
    measured = json.loads(out.read_text())["measured"]
    assert set(measured["executors"]) == {"spmd", "mpmd"} and measured["kernel_seconds"] >= 0
    assert "pipeline executor" in captured.out
    # the narrow products (--quick: one dot, two convolutions, one convolution over images its
    # window reaches past), and the curves shown where fitted
    widths = sorted((k["kind"], k["width"]) for k in kept["samples"]["kernels"] if "width" in k)
    assert widths == [("convolution", 4), ("convolution", 32), ("dot", 8), ("oversized-convolution", 32)]
    device = json.loads(out.read_text())["devices"][0]
    assert ("narrow product" in captured.out) == bool(device.get("narrow"))
    # each matmul and memory-bound op size timed alone too: the curves one-device plans are priced on
    assert [size for size, _ in measured["alone_dot"]] == [2.0 * 64**3, 2.0 * 256**3]
    assert [size for size, _ in measured["alone_memory"]] == [8.0 * 2**12, 8.0 * 2**20]
    assert "one device alone, matmuls" in captured.out and "one device alone, memory-bound ops" in captured.out


def test_calibrate_check_times_a_calibration_again_and_says_how_far_it_moved(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`--check FILE` times the file's compute samples again on its devices (the quick plan that made
    it) and shows, per kind of sample, now over then; it writes nothing. The verdict holds to the
    figures it printed, and the options of a new calibration are refused beside it."""
    from hlomap.verify.recheck import STALE_RATIO

    out = tmp_path / "x.json"
    assert run(["calibrate", "--quick", "--devices", "2", "-o", str(out), "--quiet"]) == 0
    before = out.read_text()
    capsys.readouterr()
    assert run(["calibrate", "--check", str(out), "--quiet"]) == 0
    captured = capsys.readouterr()
    text = " ".join(captured.out.split())
    for group in ("matmul", "matmul alone", "narrow product", "memory-bound op", "kernel-launch step", "dispatch"):
        assert f" {group} │" in text
    ratio = float(re.search(r"all │ \d+ │ ([\d.]+)x", text).group(1))
    assert ratio > 0 and f"{kept_time(out)}" in text
    # the verdict's figure is the same ratio (both printed to 2 decimals: 1 / 0.90 may read 1.11 or 1.12)
    said = re.search(r"the devices run ([\d.]+)x (slower|faster) than calibrated", text)
    assert said is not None and said.group(2) == ("slower" if ratio >= 1 else "faster")
    assert float(said.group(1)) == pytest.approx(ratio if ratio >= 1 else 1 / ratio, abs=0.01 / min(ratio, 1) ** 2)
    assert ("the calibration holds" in text) == (1 / STALE_RATIO <= ratio <= STALE_RATIO)
    assert out.read_text() == before  # nothing new is written
    assert run(["calibrate", "--check", str(out), "--local"]) == 2
    assert "--check times an existing calibration again and writes nothing; --local does not apply" in \
        capsys.readouterr().err
    assert run(["calibrate", "--check", str(out), "-o", str(tmp_path / "y.json")]) == 2
    assert "writes nothing; -o does not apply" in capsys.readouterr().err
    assert run(["calibrate", "--check", str(tmp_path / "nope.json")]) == 2
    assert "nope.json: no such file" in capsys.readouterr().err


def kept_time(path: Path) -> str:
    """When the calibration in a cluster file was made."""
    return json.loads(path.read_text())["calibration"]["measured_at"]


@pytest.mark.slow  # 24 s in a new process; `calibrate --quick` is checked in the fast set
def test_calibrate_on_a_cpu_only_machine_measures_eight_simulated_devices_by_default(tmp_path: Path) -> None:
    """A CPU backend shows one device unless XLA_FLAGS asks for more: without --devices,
    `hlomap calibrate` simulates the 8 host devices the examples and `hlomap run` plan for."""
    import os

    from hlomap.cost.cluster import load_cluster

    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1])
    done = subprocess.run([sys.executable, "-m", "hlomap.cli", "calibrate", "--quick", "-o", "local.json"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "8 simulated host devices" in done.stderr
    assert load_cluster(tmp_path / "local.json").n_devices == 8


def test_calibrate_refuses_a_device_count_it_cannot_measure(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "x.json"
    with pytest.raises(SystemExit) as exited:
        run(["calibrate", "--quick", "--devices", "0", "-o", str(out), "--quiet"])
    assert exited.value.code == 2
    assert "--devices: 0 must be positive" in capsys.readouterr().err
    assert run(["calibrate", "--quick", "--devices", "64", "-o", str(out), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "--devices 64: JAX sees only 8 cpu device(s)" in err and "Traceback" not in err
    assert not out.exists()


def test_calibrate_refuses_options_that_contradict_local(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """--local writes the cached `local` cluster: a file of -o would be ignored, and a --quick
    calibration is too rough to plan on there. Both are refused before anything is measured."""
    monkeypatch.setenv("HLOMAP_CACHE_DIR", str(tmp_path / "cache"))
    out = tmp_path / "x.json"
    assert run(["calibrate", "--local", "-o", str(out)]) == 2
    assert "--local measures every device JAX sees and keeps the result where --cluster local reads it; -o does " \
           "not apply" in capsys.readouterr().err
    assert run(["calibrate", "--local", "--quick"]) == 2
    err = capsys.readouterr().err
    assert "too rough for the `local` cluster" in err and "-o FILE.json" in err and "calibrate ━" not in err
    assert not out.exists() and not (tmp_path / "cache").exists()


def test_calibrate_checks_the_output_before_measuring(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "missing" / "x.json"
    assert run(["calibrate", "--quick", "--devices", "2", "-o", str(out)]) == 2
    captured = capsys.readouterr()
    assert "directory does not exist" in captured.err
    assert "calibrate ━" not in captured.err and "matmul dtype" not in captured.out  # nothing was measured


def test_simulate_prices_a_pipeline_on_the_executor_asked_for(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """`--executor`: the spmd executor's lockstep ticks or the mpmd executor's simulated schedule,
    each plus its own cost on the cluster (none on a datasheet cluster); an SPMD plan has none."""
    plan_path = tmp_path / "gpipe.json"
    assert run(["explore", "zoo:haiku-mlp", "--task", "pipeline", "--stages", "2", "--agent", "dp", "-q",
                "--microbatches", "4", "--schedule", "gpipe", "--cluster", "hier:1x8", "-o", str(plan_path)]) == 0
    capsys.readouterr()
    priced = {}
    for executor in ("spmd", "mpmd"):
        assert run(["simulate", "zoo:haiku-mlp", "--plan", str(plan_path), "--cluster", "hier:1x8", "--json",
                    "--executor", executor]) == 0
        priced[executor] = json.loads(capsys.readouterr().out)
    spmd, mpmd = priced["spmd"], priced["mpmd"]
    assert spmd["executor"] == "spmd" and mpmd["executor"] == "mpmd"
    assert mpmd["lockstep_seconds"] is None
    assert mpmd["executor_step_seconds"] == pytest.approx(mpmd["step_seconds"] + mpmd["executor_seconds"])
    assert spmd["executor_step_seconds"] == pytest.approx(spmd["lockstep_seconds"] + spmd["executor_seconds"])
    assert spmd["lockstep_seconds"] >= spmd["step_seconds"]  # lockstep never beats the overlapped schedule here
    assert run(["simulate", "zoo:haiku-mlp", "--plan", str(plan_path), "--cluster", "hier:1x8",
                "--executor", "mpmd"]) == 0
    assert "on the mpmd executor: step" in capsys.readouterr().out
    assert run(["simulate", "zoo:haiku-mlp", "--plan", "dp", "--executor", "spmd"]) == 2
    assert "executor 'spmd'" in capsys.readouterr().err


def test_explore_says_when_the_exact_search_ran_out_of_budget(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """With the cost reward the exact driver enumerates t5-tiny's 3244 conflict-free opp plans;
    an evaluation budget stops it first, and the summary says the plan is not proven optimal."""
    plan_path = tmp_path / "plan.json"
    assert run(["explore", "zoo:t5-tiny", "--agent", "exact", "--reward", "cost", "--budget-evaluations", "90",
                "-o", str(plan_path)]) == 0
    out = capsys.readouterr().out
    assert "not proven optimal: the budget ran out (climbed first" in out
    assert "of 3244 conflict-free plans" in out
    assert json.loads(plan_path.read_text())["search"]["optimal"] is False


def test_the_cli_shows_hlomaps_warnings_as_one_line_and_hands_on_the_others(
        capsys: pytest.CaptureFixture[str]) -> None:
    """A warning raised inside the package (an unreadable local cluster, a corrupt cache entry)
    reads as the CLI's own `warning: ...` line, without Python's file, line and source line; a
    warning from elsewhere goes where it went before (Python's display, or a test runner's record)."""
    import hlomap.cli as cli
    import hlomap.run.local as ours

    handed_on: list[tuple[object, ...]] = []
    show = cli.one_line_warnings(lambda *args: handed_on.append(args))
    show(RuntimeWarning("hlomap: ignoring the unreadable local cluster x.json"), RuntimeWarning, ours.__file__, 91)
    assert capsys.readouterr().err == "warning: hlomap: ignoring the unreadable local cluster x.json\n"
    assert not handed_on
    old = DeprecationWarning("old")
    show(old, DeprecationWarning, "/elsewhere/lib.py", 7, None, "call()")
    assert handed_on == [(old, DeprecationWarning, "/elsewhere/lib.py", 7, None, "call()")]
    assert capsys.readouterr().err == ""


@pytest.fixture(scope="module")
def gpt_tiny_pipeline_plan(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """gpt-tiny (a batch of 8) cut in 2 stages of 4 devices, 2 microbatches, on hier:1x8."""
    path = tmp_path_factory.mktemp("pipeline") / "pp.json"
    assert run(["explore", "zoo:gpt-tiny", "--task", "pipeline", "--stages", "2", "--agent", "dp", "-q",
                "--microbatches", "2", "--cluster", "hier:1x8", "-o", str(path)]) == 0
    return json.loads(path.read_text())


@pytest.mark.parametrize("microbatches, problem", [
    (3, "the batch of 8 examples does not split into 3 equal microbatches"),
    (4, "stage 0 splits each microbatch of 2 examples over 4 data-parallel devices, which does not divide it"),
    (2, None),
])
def test_simulate_warns_of_a_pipeline_plan_run_would_refuse(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                            gpt_tiny_pipeline_plan: dict[str, Any],
                                                            microbatches: int, problem: str | None) -> None:
    """A hand-edited microbatch count is still priced (a what-if), but a warning says run refuses it."""
    assert [len(stage["devices"]) for stage in gpt_tiny_pipeline_plan["pipeline"]["stages"]] == [4, 4]
    edited = copy.deepcopy(gpt_tiny_pipeline_plan)
    edited["pipeline"]["microbatches"] = microbatches
    plan_path = tmp_path / "edited.json"
    plan_path.write_text(json.dumps(edited))
    capsys.readouterr()
    assert run(["simulate", "zoo:gpt-tiny", "--plan", str(plan_path), "--cluster", "hier:1x8"]) == 0
    captured = capsys.readouterr()
    assert "pipeline plan on cluster" in captured.out
    if problem is None:
        assert "would refuse" not in captured.err
    else:
        assert f"warning: {problem}: `hlomap run` would refuse this plan for zoo:gpt-tiny" in captured.err


def test_inspect_reports_a_step_that_raises_as_the_step_s_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert run(["inspect", f"{USER_STEP}:make_raising"]) == 2
    err = capsys.readouterr().err
    assert re.search(r"tracing train_step failed at .*user_step\.py:\d+: RuntimeError: the step's own bug", err)
    assert "internal error" not in err and len(err.strip().splitlines()) == 1


JOINT_PLAN = Path(__file__).resolve().parent / "data" / "plans" / "joint_v1.json"  # gpt-tiny on hier:2x4


def test_simulate_a_joint_plan_reports_its_executor_and_refuses_what_it_would_ignore(
        capsys: pytest.CaptureFixture[str]) -> None:
    base = ["simulate", "zoo:gpt-tiny", "--plan", str(JOINT_PLAN), "--cluster", "hier:2x4"]
    assert run([*base, "--executor", "mpmd"]) == 0
    assert "on the mpmd executor: step " in capsys.readouterr().out
    assert run([*base, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["executor"] == "mpmd" and report["executor_step_seconds"] > 0
    for extra, message in ((["--mesh", "4"], "--mesh 4: a joint plan's stages fix its devices and meshes"),
                           (["--axis-order", "model,data"], "--axis-order model,data: a joint plan's stages fix"),
                           (["--top", "3"], "--top 3: a joint plan is priced by its stages")):
        assert run([*base, *extra]) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("schedule, method", [("zb-h1", "by the search's event timeline"),
                                              ("1f1b", "by the search's closed form")])
def test_a_pipeline_s_model_l_is_labelled_by_how_it_was_priced(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                               schedule: str, method: str) -> None:
    """ZB-H1 has no closed form: its model L is the event timeline's, and says so."""
    assert run(["explore", "zoo:gpt-tiny", "--task", "pipeline", "--stages", "2", "--microbatches", "4", "--agent",
                "dp", "--schedule", schedule, "--cluster", "hier:2x4", "-q", "-o", str(tmp_path / "p.json")]) == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("L = "))
    assert method in line


def test_simulate_says_a_one_axis_built_in_plan_uses_both_axes(capsys: pytest.CaptureFixture[str]) -> None:
    assert run(["simulate", "zoo:gpt-tiny", "--plan", "megatron", "--mesh", "data=2,model=4"]) == 0
    assert "note: megatron splits over every axis of data=2,model=4 together (the weights 8 ways)" in \
        capsys.readouterr().err
    assert run(["simulate", "zoo:gpt-tiny", "--plan", "dp+megatron", "--mesh", "data=2,model=4"]) == 0
    assert "splits over every axis" not in capsys.readouterr().err


def test_simulate_prices_a_saved_plan_on_the_cluster_it_was_explored_on_unless_told(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Without --cluster, a plan explored on a cluster --cluster can name is priced there (it was
    priced on A, with a note); a built-in plan on A, as before."""
    from hlomap import api
    from hlomap.cli.simulate import prices_on_local

    plan = tmp_path / "h.json"
    assert run(["explore", "zoo:gpt-tiny", "--task", "adp", "--mesh", "4", "--cluster", "hier:1x4", "--agent",
                "greedy", "--budget-evaluations", "3", "-q", "-o", str(plan)]) == 0
    capsys.readouterr()
    assert run(["simulate", "zoo:gpt-tiny", "--plan", str(plan), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["cluster"] == "hier:1x4"
    assert run(["simulate", "zoo:gpt-tiny", "--plan", str(plan)]) == 0
    assert "note: pricing on hier:1x4, the cluster the plan was explored on" in capsys.readouterr().err
    # given another step, the plan is refused, with no note about a price it never made
    assert run(["simulate", "zoo:haiku-mlp", "--plan", str(plan)]) == 2
    err = capsys.readouterr().err
    assert "made for another module than zoo:haiku-mlp" in err and "note:" not in err
    assert run(["simulate", "zoo:gpt-tiny", "--plan", str(plan), "--cluster", "A", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["cluster"] == "A"
    assert run(["simulate", "zoo:gpt-tiny", "--plan", "dp", "--mesh", "8", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["cluster"] == "A"
    # a plan explored on `local` asks for the host devices before anything starts JAX
    local = json.loads(plan.read_text())
    local["estimate"]["cluster"] = "local"
    (tmp_path / "l.json").write_text(json.dumps(local))
    parsed = argparse.Namespace(cluster=None, plan=str(tmp_path / "l.json"))
    assert prices_on_local(parsed) and not prices_on_local(argparse.Namespace(cluster=None, plan=str(plan)))
    assert api.explored_cluster(api.load_plan_file(tmp_path / "l.json")) == "local"
