"""`explore_pipeline` end to end on a zoo step; the reduced acceptance case (gpt-tiny, config A)."""

import json

import pytest
from rich.console import Console

from hlomap.cost.cluster import Cluster, cluster_preset, uniform
from hlomap.cost.pipeline.links import with_device_memory
from hlomap.cost.pipeline.profile import PipelineProfile
from hlomap.cost.pipeline.stages import Schedule
from hlomap.tasks.pipeline.dp import solve
from hlomap.tasks.pipeline.solution import NoFeasiblePlan
from hlomap.cost.pipeline.profile import uniform_profile
from hlomap.api import is_pipedream_graph, load_pipeline_source as read_pipeline_source
from hlomap.report.gantt import draw_gantt
from hlomap.report.pipeline import format_pipeline_result, gantt_title
from hlomap.report.units import human_bytes as format_bytes
from hlomap.tasks.pipeline.explore import PipelineAgent, explore_pipeline, pipeline_task
from hlomap.tasks.pipeline.infer import DEFAULT_POLICY
from hlomap.tasks.pipeline.pipedream import pipedream_cluster
from tests.tasks.pipeline.strategies import uniform_cluster


@pytest.fixture(scope="module")
def gpt_tiny():
    from scripts.pipeline_acceptance import model_profile

    return model_profile("gpt-tiny")


def _text(result) -> str:
    console = Console(record=True, width=160)
    console.print(format_pipeline_result(result))
    return console.export_text()


def test_dp_agent_returns_the_optimum_with_a_report_and_timeline(gpt_tiny, tmp_path):
    result = explore_pipeline(gpt_tiny, stages=3, microbatches=4, cluster="B", agent="dp",
                              schedule="gpipe", name="zoo:gpt-tiny", downset_states=0)  # the chain's order
    png = draw_gantt(result.simulation, tmp_path / "t.png", title=gantt_title(result))
    task = pipeline_task(result.profile, cluster_preset("B"), stages=3, microbatches=4,
                         schedule=Schedule.GPIPE)
    assert result.value == pytest.approx(solve(result.profile, task.cluster, task.space).value)
    assert result.agent is PipelineAgent.DP and result.replication == (8, 8, 8)
    assert result.device_cuts == (8, 16) and result.on_node_boundaries
    assert png.stat().st_size > 1000
    assert len(result.stage_memory) == 3 and result.latency > 0
    text = _text(result)
    for cut in result.cuts:
        assert cut.instruction in text and cut.layer in text and cut.scope in text
        assert cut.instruction == gpt_tiny.pivots[cut.pivot].instruction
        # Every cut names a layer of the model, its own scope or the nearest one before it.
        assert cut.scope.removeprefix("after ").startswith(("layers_", "embed", "ln_f"))
        assert cut.source is not None and "gpt.py:" in cut.source
    assert "on server boundaries" in text and "zoo:gpt-tiny" in text
    assert "memory: every stage fits" in text and result.feasible
    for s, memory in enumerate(result.stage_memory):
        assert format_bytes(memory) in text, s
    data = json.loads(json.dumps(result.to_json()))
    assert data["device_cuts"] == [8, 16] and data["schedule"] == "gpipe"
    assert data["feasible"] and data["memory_violations"] == []
    assert [s["replication"] for s in data["stages"]] == [8, 8, 8]


def test_dqn_matches_the_dp_on_gpt_tiny_config_a(gpt_tiny):
    """The reduced acceptance case: within 1% of the DP, device cuts on server boundaries."""
    result = explore_pipeline(gpt_tiny, stages=2, microbatches=8, cluster="A", agent="dqn",
                              episodes=150, compare_dp=True)
    assert result.gap is not None and 0 <= result.gap <= 0.01 + 1e-12
    assert result.on_node_boundaries and result.device_cuts == (8,)
    assert result.episodes == 150
    assert "gap" in _text(result)


@pytest.mark.skipif(not DEFAULT_POLICY.is_file(), reason="no shipped policy")
def test_inference_agent_plans_without_training(gpt_tiny):
    result = explore_pipeline(gpt_tiny, stages=2, microbatches=8, cluster="A",
                              agent="dqn-infer", compare_dp=True)
    assert result.episodes == 0 and result.gap is not None and result.gap >= -1e-12
    assert result.on_node_boundaries


def test_unknown_sources_and_agents_are_refused(gpt_tiny):
    with pytest.raises(TypeError, match="cannot read a pipeline profile"):
        explore_pipeline(42, stages=2)
    with pytest.raises(ValueError, match="'genetic'"):
        explore_pipeline(gpt_tiny, stages=2, agent="genetic")


def test_one_stage_is_plain_data_parallelism_and_bare_profiles_are_per_microbatch():
    from hlomap.cost.pipeline.profile import uniform_profile

    profile = uniform_profile(6, forward_time=1e-3, backward_time=2e-3, parameter_bytes=1e6)
    cluster = uniform_cluster(4, bandwidth=1e9, devices_per_node=2)
    single = explore_pipeline(profile, stages=1, microbatches=4, cluster=cluster, agent="dqn")
    assert single.plan.n_stages == 1 and single.replication == (4,) and single.episodes == 0
    assert single.profile is profile  # not scaled: already per microbatch
    double = explore_pipeline(profile, stages=2, microbatches=4, cluster=cluster, agent="dp",
                              require_trainable=False)
    assert double.replication == (2, 2) and double.plan.cuts == (2,)
    assert double.cuts[0].instruction == "layer2"


def _tight_memory(profile: PipelineProfile) -> Cluster:
    """Two one-device servers whose memory holds half of the model's parameters: no plan fits."""
    memory = 0.5 * float(profile.parameter_bytes.sum()) * 4
    return with_device_memory(uniform(2, "V100-16GB", 1e9, 0.0), memory)


def test_memory_violations_are_reported_not_accepted():
    profile = uniform_profile(6, forward_time=1e-3, backward_time=2e-3, parameter_bytes=1e8,
                              stash_bytes=1e8)
    cluster = _tight_memory(profile)
    # The DP refuses: no admissible plan.
    with pytest.raises(NoFeasiblePlan, match="no plan of 6 layers"):
        explore_pipeline(profile, stages=2, microbatches=4, cluster=cluster, agent="dp")
    # A learned search still returns its best plan, flagged and reported in red.
    result = explore_pipeline(profile, stages=2, microbatches=4, cluster=cluster, agent="dqn",
                              episodes=5)
    assert not result.feasible and result.simulation.violations
    text = _text(result)
    assert "out of memory: stage" in text and "memory: every stage fits" not in text
    data = result.to_json()
    assert not data["feasible"] and data["memory_violations"]


def test_pipedream_graphs_are_read_as_profiles(corpus_dir, tmp_path):
    path = corpus_dir / "pipedream" / "vgg16.txt"
    assert is_pipedream_graph(path)
    source = read_pipeline_source(str(path))
    assert isinstance(source, PipelineProfile) and source.source == str(path)
    hlo = tmp_path / "m.hlo"
    hlo.write_text("HloModule m\nENTRY e {\n  ROOT p = f32[2] parameter(0)\n}\n")
    assert not is_pipedream_graph(hlo) and not is_pipedream_graph(tmp_path / "missing")
    result = explore_pipeline(source, stages=4, microbatches=4,
                              cluster=pipedream_cluster(4, 10.0), agent="dp",
                              require_trainable=False)
    assert result.cuts[0].instruction.startswith("node")  # PipeDream node ids name the cuts


def test_stages_whose_replicas_cannot_split_a_microbatch_are_named():
    """gpt-tiny's batch of 8 in 4 microbatches of 2 over stages of 8 replicas: the runner would
    refuse the plan. From the captured step the explorer never offers it (its stages replicate
    over at most 2 devices, leaving others idle); a plan found for the bare chain, which knows
    no batch, is named with the M that would do."""
    from hlomap.api import load_source
    from hlomap.cost.pipeline.chain import step_chain
    from hlomap.cost.cluster import load_cluster
    from hlomap.tasks.pipeline.explore import unsplittable_stages

    cap = load_source("zoo:gpt-tiny")
    result = explore_pipeline(cap, stages=3, microbatches=4, cluster="B", agent="dp", schedule="gpipe")
    assert unsplittable_stages(cap, result) == []
    assert max(result.replication) == 2 and sum(result.replication) < load_cluster("B").n_devices
    blind = explore_pipeline(step_chain(cap, load_cluster("B").devices[0]), stages=3, microbatches=4, cluster="B",
                             agent="dp", schedule="gpipe")
    problems = unsplittable_stages(cap, blind)
    assert len(problems) == 3 and "stage 0 replicates over 8 devices" in problems[0]
    assert "such that 8 / M is a multiple of 8" in problems[0]
    single = explore_pipeline(cap, stages=3, microbatches=1, cluster="B", agent="dp", schedule="gpipe")
    assert unsplittable_stages(cap, single) == []


def test_the_space_offers_only_replication_a_microbatch_splits_over():
    """8 examples in 4 microbatches of 2 on 2 servers of 4: even groups of 4 cannot split a
    microbatch, so stages replicate over at most 2 devices on a prefix of the devices (the
    DQN's center groups: 2 + 2); with 1 microbatch of 8 the even groups stay."""
    from hlomap.cost.cluster import hierarchical
    from hlomap.cost.pipeline.stages import splits_batch

    assert splits_batch(8, 4, 2) and not splits_batch(8, 4, 4) and not splits_batch(8, 3, 1)
    profile = uniform_profile(6, forward_time=1e-3, backward_time=2e-3, parameter_bytes=1e6)
    cluster = hierarchical(2, 4)
    narrow = pipeline_task(profile, cluster, stages=2, microbatches=4, batch=8)
    assert narrow.space.replication == (1, 2) and not narrow.space.use_all_devices
    assert narrow.center == (0, 2, 4)
    wide = pipeline_task(profile, cluster, stages=2, microbatches=1, batch=8)
    assert wide.space.replication == (4,) and wide.space.use_all_devices and wide.center == (0, 4, 8)
    with pytest.raises(NoFeasiblePlan, match="does not split into 3 equal microbatches"):
        pipeline_task(profile, cluster, stages=2, microbatches=3, batch=8)


@pytest.mark.parametrize("schedule, executor", [("gpipe", "spmd"), ("1f1b", "mpmd"), ("zb-h1", "mpmd")])
def test_the_plans_step_is_priced_on_the_executor_that_runs_it(schedule, executor):
    """What `hlomap run` measures: GPipe over alike stages runs on the spmd executor, in lockstep
    ticks, 1F1B on the mpmd one, each with its own cost on a measured cluster. The plan file's
    estimate and the report say that step, and `hlomap simulate` prices the saved plan the same;
    the schedule's own L (the overlapping simulator) is kept beside it."""
    from hlomap.api import load_source, simulate_plan
    from hlomap.cost.cluster import load_cluster
    from hlomap.tasks.pipeline.explore import pipeline_plan
    from tests.local_cluster import LOCAL_CLUSTER_FILE

    cap = load_source("zoo:gpt-tiny")
    cluster = load_cluster(str(LOCAL_CLUSTER_FILE))
    result = explore_pipeline(cap, stages=2, microbatches=2, cluster=cluster, agent="dp", schedule=schedule)
    assert result.executor == executor
    plan = pipeline_plan(cap, result)
    priced = simulate_plan(None, plan, cluster=cluster)
    assert priced.executor == executor
    assert plan.estimate["step_seconds"] == pytest.approx(priced.step_seconds, rel=1e-9)
    assert plan.estimate["executor"] == executor
    assert plan.estimate["schedule_step_seconds"] == pytest.approx(result.latency)
    assert result.step_seconds > result.latency  # the executor's own cost at least, lockstep ticks too
    assert f"on the {executor} executor" in _text(result)
