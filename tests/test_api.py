"""`hlomap.api`, the one front: which estimator prices each plan kind (decided in one place),
the output check, and the sources explore and run share."""

from __future__ import annotations

import json

import re
from pathlib import Path
from typing import Any

import pytest

from hlomap import api

USER_STEP = Path(__file__).resolve().parent / "run" / "user_step.py"


PLANS = Path(__file__).resolve().parent / "data" / "plans"


@pytest.mark.parametrize("plan, category", [
    ("dp", api.PlanCategory.BUILT_IN),
    ("spmd_v1.json", api.PlanCategory.SPMD),
    ("pipeline_v1.json", api.PlanCategory.PIPELINE),
    ("joint_v1.json", api.PlanCategory.JOINT),
])
def test_plan_category_picks_the_estimator(plan: str, category: api.PlanCategory) -> None:
    if plan.endswith(".json"):
        plan = api.load_plan_file(PLANS / plan)
    assert api.plan_category(plan) is category
    assert api.needs_module(plan) is (category is not api.PlanCategory.PIPELINE)


def test_a_pipeline_plan_refuses_a_mesh_before_anything_is_read() -> None:
    plan = api.load_plan_file(PLANS / "pipeline_v1.json")
    with pytest.raises(api.InputError, match="^mesh='8': a pipeline plan's stages fix its devices"):
        api.check_simulation_options(plan, mesh="8")


def test_an_option_error_names_the_option_as_its_caller_spelled_it() -> None:
    """`devices=0` from Python, `--devices 0` on the command line: one error, two spellings."""
    with pytest.raises(api.OptionError, match=r"^devices=0: must be at least 1$") as caught:
        api.calibrate(devices=0)
    assert caught.value.cli_text() == "--devices 0: must be at least 1"
    assert api.OptionError("axis_order", ("data", "model"), "no").cli_text() == "--axis-order data,model: no"


def test_check_writable_names_what_is_wrong(tmp_path: Path) -> None:
    api.check_writable(tmp_path / "plan.json")  # a writable folder: no error, and no file left
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(api.InputError, match="is a directory"):
        api.check_writable(tmp_path)
    with pytest.raises(api.InputError, match="directory does not exist"):
        api.check_writable(tmp_path / "missing" / "plan.json")
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(api.InputError, match="not a directory"):
        api.check_writable(blocker / "plan.json")


def test_load_source_reads_a_users_step_file() -> None:
    cap = api.load_source(f"{USER_STEP}:make")
    assert cap.parameters and cap.has_roles
    with pytest.raises(api.SourceError, match="has no function 'nowhere'"):
        api.load_source(f"{USER_STEP}:nowhere")


def test_a_step_file_imports_the_modules_beside_it_wherever_it_is_run(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """As `python FILE.py` would: the file's folder is on the path while it imports; and a function
    returning its pair the wrong way round says what it returned."""
    from hlomap.run.errors import RunError
    from hlomap.run.source import load_step_file

    models = tmp_path / "models"
    models.mkdir()
    (models / "shared_layers_28.py").write_text("def double(x):\n    return 2 * x\n")
    (models / "main_28.py").write_text(
        "import numpy as np\nfrom shared_layers_28 import double\n\n"
        "def make():\n    return (lambda p, x: double(p) * x), (np.ones(2), np.ones(2))\n\n"
        "def swapped():\n    step, args = make()\n    return args, step\n")
    monkeypatch.chdir(tmp_path)  # not the file's folder
    monkeypatch.setattr("sys.path", list(__import__("sys").path))  # the folder added is undone after the test
    step, args = load_step_file(f"{models / 'main_28.py'}:make")
    assert float(step(*args)[0]) == 2.0
    with pytest.raises(RunError, match=r"must return \(train_step, example_args\).*it returned a tuple of "
                                           r"tuple, function"):
        load_step_file(f"{models / 'main_28.py'}:swapped")


def test_a_pipeline_of_fewer_stages_than_allowed_says_so() -> None:
    """`stages` is the most the pipeline search cuts: a tiny step on two servers of four is
    fastest in one stage, and the exploration says why it has fewer stages than asked."""
    import jax.numpy as jnp
    import optax

    import hlomap

    optimizer = optax.sgd(0.05, momentum=0.9)

    def loss_fn(params: Any, x: Any, y: Any) -> Any:
        h = jnp.tanh(jnp.tanh(x @ params["w0"]) @ params["w1"])
        return jnp.mean((h @ params["w2"] - y) ** 2)

    def train_step(params: Any, opt_state: Any, x: Any, y: Any) -> Any:
        loss, grads = hlomap.value_and_grad(loss_fn)(params, x, y)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    params = {"w0": jnp.ones((20, 48)), "w1": jnp.ones((48, 48)), "w2": jnp.ones((48, 4))}
    cap = hlomap.capture(train_step, params, optimizer.init(params), jnp.ones((24, 20)), jnp.ones((24, 4)))
    found = api.explore_pipeline_detailed(cap, stages=2, microbatches=4, schedule="gpipe", cluster="hier:2x4",
                                          agent="dp")
    assert found.result.plan.n_stages == 1
    assert found.notes == ("1 stage of the 2 allowed: fewer stages priced faster on hier:2x4 (stages is the most "
                           "the search cuts)",)


def test_a_spec_edited_on_one_leaf_of_a_linkage_group_is_priced_with_a_warning(tmp_path: Path) -> None:
    """The runner places each leaf as its spec says; the estimate prices a linkage group as one.
    A spec edited by hand on some leaves of a group (plan-format.md's example) is therefore priced
    as the rest of the group says, and the estimate warns instead of passing it silently."""
    import warnings

    from hlomap.plan import Plan, reference_plan
    from hlomap.propagation.graph import FactorGraph

    cap = api.load_source("zoo:gpt-tiny")
    graph = FactorGraph.from_capture(cap)
    plan = Plan.from_groups(cap, graph, *reference_plan(graph, "megatron", {"model": 8}))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the plan as explored: no warning
        api.estimate("zoo:gpt-tiny", plan)
    data = plan.to_json()
    edited = [p for p in data["parameters"] if p["path"].endswith("mlp/fc_in/kernel") and any(p["spec"])]
    assert edited, "Megatron splits the first MLP matrix"
    for p in edited:
        p["spec"] = [None] * len(p["spec"])
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(data))
    with pytest.warns(UserWarning, match=r"dim \d is replicated, but dims linked to it are split on model .*"
                                         r"`hlomap run` places each parameter as its own spec says"):
        api.estimate("zoo:gpt-tiny", str(path))


def test_a_joint_plan_leaving_devices_idle_is_priced_alike_by_explore_its_file_and_simulate() -> None:
    """On a measured cluster of devices sharing cores, a joint plan on 6 of 8 devices computes at
    their pace: the search's result, the plan's estimate and `simulate` give one figure (explore
    reported the all-busy price, simulate the paced one)."""
    from hlomap.tasks.joint.plans import evaluate

    cpu8 = str(Path(__file__).parent / "data" / "clusters" / "cpu8.cluster.json")
    cap = api.load_source("zoo:gpt-tiny")
    found = api.explore_auto_detailed(cap, cluster=cpu8, microbatches=[4])
    result = found.result
    assert len({d for stage in result.plan.stages for d in stage.devices}) < 8  # some idle
    assert evaluate(result.model, result.plan).latency > result.cost.latency  # the all-busy price is higher
    plan = found.joint or found.plan
    simulated = api.simulate_plan(cap, plan, cluster=cpu8)
    assert simulated.result.cost.latency == pytest.approx(result.cost.latency, rel=1e-9)
    assert plan.estimate["step_seconds"] == pytest.approx(simulated.step_seconds, rel=1e-9)


def test_simulate_plan_takes_names_and_prices_a_built_in_plan() -> None:
    simulation = api.simulate_plan("zoo:gpt-tiny", "dp", cluster="A", mesh={"data": 8})
    assert isinstance(simulation, api.SpmdSimulation) and simulation.identity is None
    assert simulation.estimate.step_seconds > 0 and simulation.fits


def test_estimate_prices_a_pipeline_plan_by_its_stages(tmp_path: Path) -> None:
    """Not as an SPMD plan whose parameters happen to be replicated: by the stage profile it carries."""
    cap = api.load_source("zoo:gpt-tiny")
    plan = api.explore(cap, task="pipeline", cluster="A", agent="dp", output=tmp_path / "pipe.json")
    priced = api.estimate(cap, plan, cluster="A")
    assert isinstance(priced, api.PipelineSimulation)
    assert priced.estimate.placed.length == pytest.approx(plan.estimate["step_seconds"])


def test_explore_takes_a_source_string() -> None:
    plan = api.explore("zoo:gpt-tiny", task="opp", mesh=8, agent="greedy", budget_evaluations=5)
    assert plan.parameters and dict(plan.mesh) == {"model": 8}


@pytest.mark.parametrize("name, cluster", [("spmd_v1.json", "A"), ("pipeline_v1.json", "hier:2x2"),
                                           ("joint_v1.json", "hier:2x4")])
def test_every_plan_kind_is_estimated_with_a_step_time(name: str, cluster: str) -> None:
    """`hlomap.estimate` prices an SPMD plan, a pipeline plan and a joint plan (each in its own
    way) and each answer says the step time and whether it fits."""
    from hlomap import zoo

    model = zoo.get("gpt-tiny")
    cap = api.capture(model.train_step(), *model.abstract_args())
    result = api.estimate(cap, api.load_plan_file(PLANS / name), cluster=cluster)
    assert 0 < result.step_seconds < 10 and isinstance(result.fits, bool)


@pytest.mark.parametrize("cluster, error, message", [
    ("Z", "ClusterSpecError", "cluster 'Z' is neither a preset"),
    ("hier:1x4", "MappingError", "mesh {'data': 8} needs 8 devices; cluster 'hier:1x4' has 4"),
])
def test_explore_refuses_a_cluster_it_cannot_price_whatever_the_reward(cluster: str, error: str, message: str) -> None:
    """The paper reward never prices a step: a misspelt or too small cluster used to come back as
    a plan without an estimate and a log line."""
    with pytest.raises(ValueError, match=re.escape(message)) as caught:
        api.explore("zoo:gpt-tiny", task="adp", mesh=8, cluster=cluster, agent="greedy", budget_evaluations=5)
    assert type(caught.value).__name__ == error and isinstance(caught.value, api.user_errors())


def test_estimate_takes_sources_and_plan_files_and_refuses_another_step_s_plan(tmp_path: Path) -> None:
    plan = api.explore("zoo:gpt-tiny", task="opp", mesh=8, agent="greedy", budget_evaluations=5)
    path = tmp_path / "plan.json"
    plan.save(path)
    assert api.estimate("zoo:gpt-tiny", str(path)).step_seconds == api.estimate("zoo:gpt-tiny", plan).step_seconds > 0
    with pytest.raises(api.InputError, match="made for another module than zoo:bert-tiny"):
        api.estimate("zoo:bert-tiny", plan)
    with pytest.raises(api.OptionError, match="^executor='bogus': expected spmd or mpmd$"):
        api.estimate("zoo:gpt-tiny", plan, executor="bogus")


@pytest.mark.parametrize("arguments, error, message", [
    (dict(agent="nope"), api.OptionError, "agent='nope': the opp task takes dqn, random, greedy, exact"),
    (dict(task="pipeline", agent="nope"), api.OptionError, "agent='nope': the pipeline task takes dqn, dqn-infer, dp"),
    (dict(cap=42), api.InputError, "explore: expected a Capture (hlomap.capture) or a SOURCE string"),
    (dict(stages=2), api.OptionError, "stages=2: task 'opp' does not read it (an option of pipeline)"),
    (dict(task="hybrid", foo=1), api.OptionError, "foo=1: task 'hybrid' does not read it (no task reads it)"),
    (dict(task="auto", stages=2), api.OptionError, "stages=2: task 'auto' does not read it (an option of pipeline; "
                                                   "the auto task's is max_stages)"),
    (dict(mesh=[8]), api.OptionError, "mesh=[8]: expected a mapping such as {'data': 2, 'model': 4}, a device count"),
    (dict(budget_seconds="10"), api.OptionError, "budget_seconds='10': expected a number of seconds > 0, or None"),
    (dict(seed="a"), api.OptionError, "seed='a': expected a whole number"),
    (dict(reward="x"), api.OptionError, "reward='x': expected one of paper, cost"),
    (dict(task="pipeline", agent="dp", reward="cost"), api.OptionError,
     "reward='cost': task 'pipeline' does not read it (an option of opp, adp, hybrid); the pipeline task chooses"),
    (dict(task="auto", mesh=4), api.OptionError, "mesh=4: task 'auto' does not read it (an option of opp, adp, hybrid)"),
    (dict(task="auto", agent="banana"), api.OptionError, "agent='banana': task 'auto' does not read it (an option of "
                                                        "opp, adp, hybrid, pipeline): its joint planner is exact"),
    (dict(task="auto", budget_seconds=0.001), api.OptionError, "budget_seconds=0.001: task 'auto' does not read it"),
    (dict(measure_rounds=3), api.OptionError, "measure_rounds=3: it serves measure=K, which is off (0)"),
    (dict(mesh=-2), api.OptionError, "mesh=-2: every mesh axis needs a size >= 1, got {'model': -2}"),
    (dict(mesh="data=2,model=x"), api.OptionError, "mesh='data=2,model=x': expected N or NAME=SIZE[,NAME=SIZE...], "
                                                   "got 'model=x'"),
    (dict(task="hybrid", mesh=8), api.OptionError, "mesh=8: the hybrid task needs a data x model mesh"),
])
def test_explore_names_a_wrong_argument_before_any_work(arguments: dict[str, Any], error: type, message: str) -> None:
    cap = arguments.pop("cap", "zoo:gpt-tiny")
    # a search budget the sharding tasks read, so that a wrong argument is what stops them
    budget = {} if arguments.get("task") in ("pipeline", "auto") else {"budget_evaluations": 3}
    with pytest.raises(error, match=re.escape(message)):
        api.explore(cap, **budget, **arguments)


def test_explore_s_options_are_those_its_task_reads() -> None:
    """Python's explore refuses an option its task does not read, as the CLI refuses its flag;
    the auto task takes one microbatch count as the pipeline task does, or a list of them."""
    with pytest.raises(api.OptionError, match=re.escape("budget_evaluations=3: task 'pipeline' does not read it (an "
                                                        "option of opp, adp, hybrid)")):
        api.explore("zoo:gpt-tiny", task="pipeline", agent="dp", budget_evaluations=3)
    with pytest.raises(api.OptionError, match=re.escape("schedule='x': expected one of gpipe, 1f1b, interleaved-1f1b")):
        api.explore("zoo:gpt-tiny", task="pipeline", agent="dp", schedule="x")
    with pytest.raises(api.OptionError, match=re.escape("microbatches='x': expected a whole number or a list")):
        api.explore("zoo:gpt-tiny", task="auto", microbatches="x")
    assert {"stages", "microbatches", "schedule", "downset_states"} <= api.task_options("pipeline")
    assert {"max_stages", "microbatches", "split_state"} <= api.task_options("auto")
    assert "stages" not in api.task_options("auto") and "budget_evaluations" in api.task_options("adp")
    one, listed = (api.explore("zoo:gpt-tiny", task="auto", microbatches=m, max_stages=2).to_json() for m in (4, [4]))
    assert {k: v for k, v in one.items() if k != "search"} == {k: v for k, v in listed.items() if k != "search"}


@pytest.mark.parametrize("plan, mesh, error, message", [
    (None, None, api.InputError, "plan: expected a Plan, a plan file's path, a built-in plan name (dp, megatron, "
                                 "dp+megatron) or a plan array, got NoneType"),
    ("dp", 0, api.OptionError, "mesh=0: every axis needs a whole number of devices >= 1"),
    ("dp", {"data": 0}, api.OptionError, "mesh={'data': 0}: every axis needs a whole number of devices >= 1"),
    ("dp", {"data": 2.5}, api.OptionError, "mesh={'data': 2.5}: every axis"),
    ("dp+megatron", None, ValueError, "plan 'dp+megatron' needs its mesh: two named axes, e.g. data=2,model=4"),
    ("dp+megatron", 8, ValueError, "plan 'dp+megatron' needs two named mesh axes, e.g. data=2,model=4; got 8"),
])
def test_estimate_names_a_plan_or_mesh_it_cannot_price(plan: Any, mesh: Any, error: type, message: str) -> None:
    with pytest.raises(error, match=re.escape(message)):
        api.estimate("zoo:gpt-tiny", plan, mesh=mesh)


def test_prepare_placement_refuses_the_ppo_agent_s_options_for_another_agent() -> None:
    plan = _two_stage_plan()
    with pytest.raises(api.OptionError, match=re.escape("policy='p.npz': only the ppo agent reads it (agent is "
                                                        "'greedy')")):
        api.prepare_placement(plan, "torus:2x2", policy="p.npz")
    with pytest.raises(api.OptionError, match=re.escape("finetune_seconds=5: only the ppo agent reads it")):
        api.prepare_placement(plan, "torus:2x2", agent="exact", finetune_seconds=5)


def _two_stage_plan() -> Any:
    from hlomap.plan import Plan, PlanSource

    return Plan(mesh=(), parameters=(), source=PlanSource("test", ""), pipeline={
        "stages": [{"devices": [0, 1]}, {"devices": [2, 3]}], "microbatches": 2, "schedule": "1f1b"})


def test_the_cli_refuses_a_flag_for_the_tasks_whose_python_search_does_not_read_it() -> None:
    """`hlomap explore` keeps its own table of which task reads each flag (`TASK_OPTIONS`); Python's
    explore reads the searches' signatures. The two must agree, or a flag is refused where the
    option works (or passed where it is ignored)."""
    from hlomap.cli.explore import TASK_OPTIONS

    renamed = {("stages", "auto"): "max_stages", ("shard_optimizer_state", "auto"): "split_state"}
    cli_only = {"curve", "timeline"}  # the plots the command draws
    explore_own = {"mesh", "reward", "agent", "budget_seconds"}  # explore's own arguments, checked above
    for dest, tasks in TASK_OPTIONS.items():
        if dest in cli_only | explore_own:
            continue
        for task in api.EXPLORE_TASKS:
            reads = renamed.get((dest, task), dest) in api.task_options(task)
            assert reads == (task in tasks), (dest, task)


def test_parallelize_takes_a_plan_file_and_refuses_what_is_not_a_plan(tmp_path: Path) -> None:
    import hlomap
    from tests.run.user_step import make

    step, args = make()
    plan = api.explore(hlomap.capture(step, *args), task="adp", mesh=8, agent="greedy", budget_evaluations=3)
    plan.save(tmp_path / "plan.json")
    assert hlomap.parallelize(step, str(tmp_path / "plan.json")).plan == plan
    with pytest.raises(TypeError, match="parallelize: plan must be a hlomap.Plan or a plan file's path, got dict"):
        hlomap.parallelize(step, {"mesh": {}})
    with pytest.raises(TypeError, match="parallelize: train_step must be the step function, got NoneType"):
        hlomap.parallelize(None, plan)
    with pytest.raises(FileNotFoundError, match="parallelize: no plan file 'dp' \\(give a path saved by hlomap"):
        hlomap.parallelize(step, "dp")


def test_the_other_cluster_note_names_a_spelling_that_works() -> None:
    """A calibrated cluster's name is no --cluster spelling: the note says how to name it."""
    from types import SimpleNamespace

    topology = SimpleNamespace(estimate={"cluster": "hier:2x4"})
    assert api.other_cluster_note(topology, "A").endswith("(--cluster hier:2x4 prices it there)")
    calibrated = SimpleNamespace(estimate={"cluster": "calibrated-cpu-8"})
    note = api.other_cluster_note(calibrated, "A")
    assert "--cluster calibrated-cpu-8" not in note and "the cluster file it was explored on, or local" in note
    assert api.other_cluster_note(topology, "hier:2x4") is None


def test_a_joint_plan_on_devices_the_cluster_lacks_names_the_device(tmp_path: Path) -> None:
    import json

    data = json.loads((PLANS / "joint_v1.json").read_text())
    data["pipeline"]["stages"][-1]["devices"] = [96, 97, 98, 99]
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(data))
    with pytest.raises(api.InputError, match=re.escape("the plan's stages use device 99, but hier:2x4 has 8 devices "
                                                       "(0-7)")):
        api.simulate_plan("zoo:gpt-tiny", api.load_plan_file(path), cluster="hier:2x4")
