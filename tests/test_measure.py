"""Measured selection (`hlomap.explore(..., measure=K)`, `--measure K`, auto_shard's measure=):
the candidates of a search, the choice of the measured fastest with an injected clock and
runnables (nothing here reads wall time), failures recorded, the plan's `measured` section and
its JSON, and one real compile-and-time of a tiny model through auto_shard."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any, Callable

import pytest

from hlomap import api
from hlomap.cli import run
from hlomap.plan import MeasuredCandidate, Measurement, Plan, PlanError
from hlomap.run.measure import MeasureError, MeasureSettings, measure_candidates
from hlomap.tasks.candidates import PICK, Candidate, Family, select_candidates

ROOT = Path(__file__).resolve().parents[1]
TINY = "zoo:haiku-mlp"


class FakeClock:
    """A clock that moves only when a fake runnable says its step took so long."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def runnable(self, seconds: float) -> Callable[[], None]:
        def run() -> None:
            self.now += seconds

        return run


def fake_settings(count: int, cost: Callable[[Plan], float], *, fail: Callable[[Plan], bool] = lambda plan: False,
                  rounds: int = 4) -> tuple[MeasureSettings, FakeClock]:
    """Settings whose runnables cost `cost(plan)` fake seconds a step (raising for `fail`)."""
    clock = FakeClock()

    def prepare(plan: Plan) -> Callable[[], None]:
        if fail(plan):
            raise RuntimeError("XLA could not compile this plan\nsecond line")
        return clock.runnable(cost(plan))

    return MeasureSettings(count=count, rounds=rounds, repeats=1, budget_seconds=None, clock=clock,
                           wait=lambda out: out, prepare=prepare), clock


def is_dp(plan: Plan) -> bool:
    return plan.mesh_shape == {"data": 8}


# ---------------------------------------------------------------------------------------------
# Selecting and timing candidates: pure
# ---------------------------------------------------------------------------------------------


def _candidate(name: str, family: Family, seconds: float | None, axis: str = "data", size: int = 8) -> Candidate:
    return Candidate(name, family, Plan(mesh=((axis, size),), parameters=()), seconds)


def test_select_keeps_the_pick_and_each_familys_best_then_the_fastest_predicted() -> None:
    found = [
        _candidate(PICK, Family.PIPELINE, 3.0, "stage"),
        _candidate("dp", Family.SPMD, 1.0, "data"),
        _candidate("megatron", Family.SPMD, 2.0, "model"),
        _candidate("joint 1 stage", Family.JOINT, 5.0, "joint"),
        _candidate("copy of dp", Family.SPMD, 0.5, "data"),  # the same structure as dp: not distinct
    ]
    assert [c.name for c in select_candidates(found, 1)] == ["dp", PICK, "joint 1 stage"]  # K raised to 3
    assert [c.name for c in select_candidates(found, 4)] == ["dp", "megatron", PICK, "joint 1 stage"]
    with pytest.raises(ValueError, match="at least 1"):
        select_candidates(found, 0)


def test_plans_over_axes_of_one_device_are_one_candidate() -> None:
    """On one device dp (data=1), megatron (model=1) and a search's plan on {model: 1} run one
    program: they are timed once (each was compiled and timed on a lent H200)."""
    from hlomap.propagation.graph import FactorGraph
    from hlomap.tasks.candidates import distinct_candidates, spmd_reference_candidates, structure_key

    cap = api.load_source(TINY)
    graph = FactorGraph.from_capture(cap)
    one = spmd_reference_candidates(cap, graph, 1, api.load_cluster("uniform:1"))
    assert [c.name for c in one] == ["dp", "megatron"] and len({c.plan.mesh for c in one}) == 2
    assert [c.name for c in distinct_candidates(one)] == ["dp"]
    eight = spmd_reference_candidates(cap, graph, 8, api.load_cluster("uniform:8"))
    assert len({structure_key(c.plan) for c in eight}) == 2  # axes of 8 devices still differ


def test_one_distinct_candidate_is_not_timed() -> None:
    """On one device the auto task's pick, dp and megatron are one program: nothing is compiled
    or timed (on an H200 timing gpt-small's one candidate cost 14 s of its first call) and the
    plan has no measured section."""
    prepared: list[Plan] = []
    settings, _ = fake_settings(3, lambda plan: 1.0)
    settings = dataclasses.replace(settings, prepare=lambda plan: prepared.append(plan) or (lambda: None))
    plan = api.explore(TINY, task="auto", cluster="uniform:1", measure=settings)
    assert prepared == [] and plan.measured is None and plan.pipeline is None


def test_measure_candidates_chooses_the_measured_fastest_and_records_a_failure() -> None:
    found = [_candidate(PICK, Family.SPMD, 1.0, "model"), _candidate("dp", Family.SPMD, 2.0, "data"),
             _candidate("megatron", Family.SPMD, 3.0, "other")]
    settings, _ = fake_settings(3, lambda plan: 0.25 if is_dp(plan) else 1.0,
                                fail=lambda plan: plan.mesh_shape == {"other": 8})
    chosen = measure_candidates(found, settings.prepare, settings, devices=8, platform="cpu")
    assert chosen.chosen.name == "dp" and chosen.plan.measured == chosen.measurement
    records = {c.name: c for c in chosen.measurement.candidates}
    assert records["dp"].median_seconds == pytest.approx(0.25) and records["dp"].rounds == 4
    assert records[PICK].median_seconds == pytest.approx(1.0) and records[PICK].predicted_seconds == 1.0
    assert records["megatron"].failed and records["megatron"].median_seconds is None
    assert records["megatron"].error == "RuntimeError: XLA could not compile this plan"
    # the fake clock ran 4 rounds of 1.25 s plus the untimed warm-up call of each
    assert chosen.measurement.seconds == pytest.approx(4 * 1.25 + 1.25)


def test_measure_candidates_fails_only_when_every_candidate_fails() -> None:
    settings, _ = fake_settings(1, lambda plan: 1.0, fail=lambda plan: True)
    with pytest.raises(MeasureError, match="no candidate plan compiled.*searched: RuntimeError"):
        measure_candidates([_candidate(PICK, Family.SPMD, 1.0)], settings.prepare, settings, devices=8, platform="cpu")


# ---------------------------------------------------------------------------------------------
# hlomap.explore(measure=K)
# ---------------------------------------------------------------------------------------------


def test_explore_measure_returns_the_measured_best_not_the_predicted_best() -> None:
    settings, _ = fake_settings(2, lambda plan: 0.5 if is_dp(plan) else 2.0)
    # planned for cluster A's V100s and timed on CPUs: it measures as asked, and says what that means
    with pytest.warns(UserWarning, match=r"on this machine's 8 cpu device\(s\), but they were planned for cluster "
                                         r"'A' \(V100-16GB\): the plan chosen will be the fastest here"):
        plan = api.explore(TINY, task="opp", mesh=8, agent="greedy", budget_seconds=5, measure=settings)
    measured = plan.measured
    assert measured is not None and measured.chosen == "dp" and is_dp(plan)
    assert measured.devices == 8 and measured.platform == "cpu"
    records = {c.name: c for c in measured.candidates}
    assert set(records) == {PICK, "dp"}
    # the cost model prefers the searched plan; the (fake) measurement prefers dp
    assert records[PICK].predicted_seconds < records["dp"].predicted_seconds
    assert records["dp"].median_seconds == pytest.approx(0.5) and records[PICK].median_seconds == pytest.approx(2.0)
    assert plan.search is not None and plan.search["driver"] == "greedy"  # the search that found the pick
    assert Plan.from_json(json.loads(json.dumps(plan.to_json()))).measured == measured


def test_the_joint_candidates_keep_the_bounds_the_search_was_given() -> None:
    """A joint candidate of fewer stages is searched within the auto task's bounds (its
    microbatches, no split state where told): measured selection never returns a plan the user
    ruled out."""
    cap = api.load_source("zoo:gpt-tiny")
    found = api.explore_auto_detailed(cap, cluster="hier:2x4", split_state=False, microbatches=[4])
    joint = [c for c in api.explore_candidates(found, cap, "hier:2x4") if c.family is Family.JOINT]
    assert any(c.name == "joint 1 stage" for c in joint)
    for c in joint:
        assert c.plan.state_sharding is None, c.name
        assert c.plan.pipeline is not None and c.plan.pipeline.microbatches == 4, c.name


def test_explore_without_measure_is_unchanged() -> None:
    plain = api.explore(TINY, task="opp", mesh=8, agent="greedy", budget_seconds=5)
    zero = api.explore(TINY, task="opp", mesh=8, agent="greedy", budget_seconds=5, measure=0)
    assert plain.measured is None and "measured" not in plain.to_json()
    assert zero.to_json()["parameters"] == plain.to_json()["parameters"]


def test_explore_measure_of_a_pipeline_times_the_pick_and_the_best_spmd_plan() -> None:
    settings, _ = fake_settings(1, lambda plan: 0.5 if plan.pipeline is not None else 2.0)
    plan = api.explore(TINY, task="pipeline", cluster="hier:2x4", agent="dp", stages=2, measure=settings)
    families = {c.family for c in plan.measured.candidates}
    assert families == {"pipeline", "spmd"} and plan.measured.chosen == PICK and plan.pipeline is not None


def test_measure_settings_name_the_one_bound_that_is_wrong() -> None:
    with pytest.raises(ValueError, match=r"^measure_rounds = 0: must be >= 1$"):
        MeasureSettings(count=2, rounds=0)
    with pytest.raises(ValueError, match=r"^measure_repeats = 0: must be >= 1$"):
        MeasureSettings(count=2, repeats=0)


def test_explore_measure_needs_a_runnable_step(tmp_path: Path) -> None:
    cap = api.load_source(TINY)
    with pytest.raises(api.InputError, match="measuring needs a runnable step"):
        api.explore(cap, task="opp", agent="greedy", measure=2)
    with pytest.raises(api.InputError, match="measure = -1"):
        api.explore(TINY, task="opp", agent="greedy", measure=-1)


def test_explore_measure_refuses_a_runnable_shaped_unlike_the_captured_step() -> None:
    """Measuring times the candidates on `runnable`'s arguments: arguments of other shapes (or
    another pytree) would time another program than the one planned, so they are refused, naming
    the leaf, before any search."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import hlomap

    def step(params: dict[str, Any], x: Any) -> Any:
        grads = jax.grad(lambda p: jnp.sum((x @ p["w"]) ** 2))(params)
        return {"w": params["w"] - 0.1 * grads["w"]}

    cap = hlomap.capture(step, {"w": jax.ShapeDtypeStruct((16, 8), jnp.float32)},
                         jax.ShapeDtypeStruct((32, 16), jnp.float32))
    wider = ({"w": np.zeros((16, 32), np.float32)}, np.zeros((32, 16), np.float32))
    with pytest.raises(api.InputError, match=r"example argument \[0\]\['w'\] is float32\[16, 32\], but the step "
                                             r"was captured with float32\[16, 8\]"):
        api.explore(cap, task="opp", agent="greedy", measure=2, runnable=(step, wider))
    halved = ({"w": np.zeros((16, 8), np.float32)}, np.zeros((16, 16), np.float32))
    with pytest.raises(api.InputError, match=r"example argument \[1\] is float32\[16, 16\]"):
        api.explore(cap, task="opp", agent="greedy", measure=2, runnable=(step, halved))
    with pytest.raises(api.InputError, match="not shaped like the step's captured ones"):
        api.explore(cap, task="opp", agent="greedy", measure=2, runnable=(step, (np.zeros((16, 8), np.float32),)))
    integers = ({"w": np.zeros((16, 8), np.int32)}, np.zeros((32, 16), np.float32))
    with pytest.raises(api.InputError, match=r"\[0\]\['w'\] is int32\[16, 8\]"):
        api.explore(cap, task="opp", agent="greedy", measure=2, runnable=(step, integers))


# ---------------------------------------------------------------------------------------------
# The plan's measured section
# ---------------------------------------------------------------------------------------------

MEASUREMENT = Measurement((MeasuredCandidate("searched", "spmd", 1e-3, 2e-3, 1e-4, 5),
                           MeasuredCandidate("dp", "spmd", 2e-3, error="RuntimeError: boom")),
                          "searched", 8, "cpu", (1.0, 0.5, 0.25), 12.5)


def test_the_measured_section_round_trips_and_old_plans_load_without_it() -> None:
    old = json.loads((ROOT / "tests" / "data" / "plans" / "spmd_v1.json").read_text())
    plan = Plan.from_json(old)
    assert plan.measured is None and "measured" not in plan.to_json()
    with_record = dataclasses.replace(plan, measured=MEASUREMENT)
    again = Plan.from_json(json.loads(json.dumps(with_record.to_json())))
    assert again.measured == MEASUREMENT and again.measured.candidate("dp").failed


@pytest.mark.parametrize("change, needle", [
    ({"chosen": "nobody"}, "chooses 'nobody'"),
    ({"candidates": []}, "non-empty 'candidates'"),
    ({"load_average": [1]}, "load_average"),
    ({"candidates": [{"name": "searched", "median_seconds": "fast"}]}, "candidate 0: median_seconds"),
])
def test_a_malformed_measured_section_is_named(change: dict[str, Any], needle: str) -> None:
    data = dataclasses.replace(Plan.from_json(json.loads((ROOT / "tests/data/plans/spmd_v1.json").read_text())),
                               measured=MEASUREMENT).to_json()
    data["measured"] |= change
    with pytest.raises(PlanError, match="measured") as err:
        Plan.from_json(data, where="p.json")
    assert needle in str(err.value) and str(err.value).startswith("p.json")


# ---------------------------------------------------------------------------------------------
# The command line
# ---------------------------------------------------------------------------------------------


def test_cli_measure_on_an_hlo_file_says_it_needs_a_runnable_step(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    dump = tmp_path / "mlp.hlo"
    assert run(["zoo", "dump", "haiku-mlp", "-o", str(dump)]) == 0
    capsys.readouterr()
    out = tmp_path / "plan.json"
    assert run(["explore", str(dump), "--measure", "2", "-q", "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert "--measure 2" in err and "measuring needs a runnable step" in err and "Traceback" not in err
    assert not out.exists()


def test_cli_measure_names_what_it_times_and_warns_off_the_devices_planned_for(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--measure 1 on a datasheet cluster of V100s: the CPUs here are not its devices (one warning
    line, no source line), and the count raised to the pick and each family's best (a pipeline
    and an SPMD plan) is said, with their names."""
    out = tmp_path / "plan.json"
    assert run(["explore", TINY, "--task", "pipeline", "--agent", "dp", "--stages", "2", "--microbatches", "4",
                "--cluster", "hier:1x8", "--measure", "1", "--measure-rounds", "1", "--measure-budget-seconds", "0.1",
                "-o", str(out)]) == 0
    err = capsys.readouterr().err
    assert "warning: measuring times the candidates on this machine's 8 cpu device(s), but they were planned for " \
           "cluster 'hier:1x8' (V100-16GB)" in err and "UserWarning" not in err
    announced = re.search(r"measuring (\d+) candidate plans \(--measure 1, raised: the pick and the best of each "
                          r"family are always timed\) on this machine's devices, compiling first: (.*)", err)
    assert announced is not None and PICK in announced.group(2)
    assert int(announced.group(1)) == len(Plan.load(out).measured.candidates) >= 2
    assert run(["explore", TINY, "--agent", "greedy", "--measure-rounds", "3", "-o", str(out)]) == 2
    assert "--measure-rounds: it bounds the timing of --measure K, which is off" in capsys.readouterr().err


def test_cli_help_lists_the_measure_options(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        run(["explore", "--help"])
    text = capsys.readouterr().out
    assert "--measure K" in text and "--measure-rounds R" in text and "--measure-budget-seconds S" in text


# ---------------------------------------------------------------------------------------------
# auto_shard
# ---------------------------------------------------------------------------------------------


def test_auto_shard_measures_only_where_the_plan_was_planned() -> None:
    from hlomap.run.measure import runs_where_planned

    assert runs_where_planned(["cpu"] * 8, "cpu", "cpu")
    assert runs_where_planned(["NVIDIA H100 80GB HBM3"], "NVIDIA H100 80GB HBM3", "gpu")
    assert not runs_where_planned(["V100-16GB"] * 8, "cpu", "cpu")
    assert not runs_where_planned([], "cpu", "cpu")


def test_the_cache_key_changes_with_measuring_and_keeps_unmeasured_digests() -> None:
    from hlomap.autoshard import CacheKey

    plain = CacheKey("f", (("data", 8),), "A:x", "opp", "1")
    assert dataclasses.replace(plain, measure=0).digest() == plain.digest()
    assert dataclasses.replace(plain, measure=3).digest() != plain.digest()


def cpu_cluster() -> Any:
    from hlomap.cost.cluster import hierarchical
    from hlomap.cost.devices import DeviceSpec

    return hierarchical(1, 8, device=DeviceSpec(name="cpu", peak_flops={"f32": 1e11}, hbm_bandwidth=1e10,
                                                memory_bytes=1e10))


def test_auto_shard_times_candidates_on_a_cluster_of_the_present_devices(tmp_path: Path) -> None:
    """The one real compile and run: two candidates of a tiny model, two short rounds."""
    import jax
    import numpy as np

    import hlomap
    from hlomap import zoo

    model = zoo.get("haiku-mlp")
    step = hlomap.auto_shard(model.train_step(), mesh=8, cluster=cpu_cluster(), task="opp", agent="greedy",
                             budget_seconds=5, cache_dir=tmp_path, progress=False,
                             measure=MeasureSettings(count=2, rounds=2, repeats=1, budget_seconds=30))
    params, opt_state, *rest = model.example_args(0)
    before = jax.tree.map(np.array, params)
    out = step(params, opt_state, *rest)
    assert len(out) >= 2
    measured = step.plan.measured
    assert measured is not None and len(measured.candidates) >= 2 and measured.platform == "cpu"
    assert all(c.median_seconds is not None and c.rounds >= 1 for c in measured.candidates if not c.failed)
    assert step.timings.measure > 0 and step.timings.measure == measured.seconds
    assert step.plan_file is not None and Plan.load(step.plan_file).measured == measured
    # the user's arguments were copied for the candidates, not donated
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), b), params, before)


def test_explore_measure_of_auto_lists_joint_plans_of_fewer_stages_and_the_spmd_plans() -> None:
    settings, _ = fake_settings(8, lambda plan: 1.0 if plan.pipeline is not None else 3.0)
    plan = api.explore(TINY, task="auto", cluster="hier:1x8", measure=settings)
    names = {c.name: c.family for c in plan.measured.candidates}
    assert names[PICK] == "joint" and "joint 1 stage" in names
    assert {"joint", "spmd"} <= set(names.values())
    assert plan.pipeline is not None and plan.search is not None and plan.search["task"] == "auto"


CPU8 = ROOT / "tests" / "data" / "clusters" / "cpu8.cluster.json"


def test_a_one_stage_auto_pick_takes_the_sharding_search_on_its_mesh_when_that_prices_faster() -> None:
    """On the CI machine's calibration the joint planner puts haiku-mlp on one stage of data 2 x
    model 4 with Megatron's sharding; the sharding task's greedy search on that mesh finds a plan
    the cost model prices faster (recording the joint pick's price). There the whole step on one
    device prices faster still, which auto returns (the next test); a measured selection still
    times the joint pick beside it."""
    cap = api.load_source(TINY)
    found = api.explore_auto_detailed(cap, cluster=str(CPU8))
    joint = found.joint
    assert joint is not None and joint.pipeline is None and found.plan.pipeline is None
    sharded = api.refined_sharding(cap, joint, str(CPU8))
    assert sharded is not None and dict(sharded.mesh) == dict(joint.mesh)
    refined = sharded.search["refined"]
    assert refined["task"] == "hybrid" and refined["step_seconds"] < refined["joint_pick_step_seconds"]
    assert api.simulate_plan(cap, sharded, cluster=str(CPU8)).step_seconds == pytest.approx(refined["step_seconds"])
    assert api.simulate_plan(cap, joint, cluster=str(CPU8)).step_seconds == pytest.approx(
        refined["joint_pick_step_seconds"])
    listed = {c.name: c for c in api.explore_candidates(found, cap, str(CPU8))}
    assert listed[PICK].plan is found.plan and listed[PICK].family is Family.SPMD
    assert "joint pick" in listed and listed["joint pick"].family is Family.JOINT
    # where the joint pick is a pipeline nothing is refined
    assert api.refined_sharding(cap, api.explore(cap, task="auto", cluster="hier:1x8"), "hier:1x8") is None


@pytest.mark.parametrize("name", ["zoo:gpt-tiny", TINY])
def test_auto_runs_the_step_on_one_device_where_devices_share_hardware_and_that_prices_faster(name: str) -> None:
    """8 host CPU devices share 2 cores: one device alone computes up to 4x faster than each of 8
    busy ones and pays no collective, so on their calibration the step on one device prices
    faster than every 8-device plan (gpt-tiny measured: 8.9 ms against 14.7 ms), and auto
    returns it. On devices of their own it never does."""
    cap = api.load_source(name)
    found = api.explore_auto_detailed(cap, cluster=str(CPU8))
    refined = found.plan.search["refined"]
    assert refined["task"] == "one device" and refined["step_seconds"] < refined["joint_pick_step_seconds"]
    assert found.plan.pipeline is None and api.plan_devices(found.plan) == 1
    assert api.estimate(cap, found.plan, cluster=str(CPU8)).step_seconds == pytest.approx(refined["step_seconds"])
    listed = api.explore_candidates(found, cap, str(CPU8))
    assert next(c for c in listed if c.name == PICK).plan is found.plan
    # every one-stage candidate on fewer devices than the cluster is priced with only those busy
    for candidate in listed:
        if candidate.plan.pipeline is None and api.plan_devices(candidate.plan) < 8:
            assert candidate.predicted_seconds == pytest.approx(
                api.estimate(cap, candidate.plan, cluster=str(CPU8)).step_seconds)
    datasheet = api.explore_auto_detailed(cap, cluster="hier:1x8")
    assert ((datasheet.plan.search or {}).get("refined") or {}).get("task") != "one device"
    on_their_own = api.explore_candidates(datasheet, cap, "hier:1x8")
    pick = next(c for c in on_their_own if c.name == PICK)
    # "one device", or a one-stage joint candidate of the same structure listed before it
    one = next(c for c in on_their_own if c.plan.pipeline is None and api.plan_devices(c.plan) == 1)
    assert one.predicted_seconds > pick.predicted_seconds


def test_auto_lists_the_best_megatron_grid_meshes_so_measuring_can_find_a_runner_up_mesh() -> None:
    """The auto task's candidates hold each of the `GRID_CANDIDATES` best points of the joint
    planner's Megatron grid: its one-stage points are data x model meshes the cost model ranks
    just behind the pick's, which a measured selection then times too."""
    from hlomap.tasks.candidates import GRID_CANDIDATES, best_grid_points

    cap = api.load_source("zoo:bert-tiny")
    found = api.explore_auto_detailed(cap, cluster=str(CPU8))
    listed = api.explore_candidates(found, cap, str(CPU8))
    meshes = {frozenset((a, n) for a, n in c.plan.mesh_shape.items() if n > 1) for c in listed
              if c.plan.pipeline is None}
    points = best_grid_points(found.result.grid, GRID_CANDIDATES)
    assert len(points) == GRID_CANDIDATES
    assert [float(p.cost.latency) for p in points] == sorted(float(p.cost.latency) for p in points)
    one_stage = [p for p in points if p.pp == 1]
    assert one_stage  # bert-tiny's best grid points include single-stage meshes
    for point in one_stage:
        assert frozenset((a, n) for a, n in (("data", point.dp), ("model", point.tp)) if n > 1) in meshes


def test_one_device_faster_is_the_one_device_estimate_against_the_plans() -> None:
    """`one_device_faster` prices the step on one device as the auto task's candidate does and the
    plan as `simulate_plan` does; only where devices share hardware, only for plans on several."""
    cap = api.load_source(TINY)
    plan = api.explore(cap, task="opp", mesh={"model": 8}, cluster=str(CPU8), agent="greedy", reward="cost")
    faster = api.one_device_faster(cap, plan, str(CPU8))
    assert faster is not None and faster.plan_devices == 8
    assert faster.cores == api.load_cluster(str(CPU8)).measured.cores  # 0: this file predates the figure
    assert faster.one_device_seconds == pytest.approx(
        api.estimate(cap, "dp", mesh={"data": 1}, cluster=str(CPU8)).step_seconds)
    assert faster.plan_seconds == pytest.approx(api.simulate_plan(cap, plan, cluster=str(CPU8)).step_seconds)
    assert faster.speedup == pytest.approx(faster.plan_seconds / faster.one_device_seconds) and faster.speedup > 1
    assert api.one_device_faster(cap, plan, "hier:1x8") is None  # devices of their own
    one = api.explore(cap, task="opp", mesh={"model": 1}, cluster=str(CPU8), agent="greedy", reward="cost")
    assert api.one_device_faster(cap, one, str(CPU8)) is None  # already on one device
