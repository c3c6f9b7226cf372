"""The joint planner's exact outer level against enumeration, its inner level against the cost
model's own estimate, and the expert grid inside its space."""

from __future__ import annotations

import dataclasses

import math

import numpy as np
import pytest

from hlomap.cost.cluster import hierarchical, mesh_topology
from hlomap.cost.pipeline.stages import Schedule
from hlomap.plan import Recompute
from hlomap.tasks.joint.costs import JointModel, PlanKind, StageOption, stage_options
from hlomap.tasks.joint.grid import expert_grid
from hlomap.tasks.joint.plans import JointPlan, JointStage, evaluate
from hlomap.tasks.joint.solve import JointSpace, aligned, aligned_starts, microbatch_choices, solve
from tests.tasks.oracle import joint_brute_force, joint_plans


@pytest.fixture(scope="module")
def gpt_tiny(cap_of):
    return cap_of("gpt-tiny")


def _model(cap, cluster, layers: int = 5) -> JointModel:
    """gpt-tiny cut into `layers` layers at evenly spaced chain positions."""
    probe = JointModel.build(cap, cluster, ())
    n = probe.attribution.length
    pivots = tuple(round(k * n / layers) - 1 for k in range(1, layers))
    return JointModel.build(cap, cluster, pivots, graph=probe.graph)


CLUSTERS = {
    "2 servers x 4": lambda: hierarchical(2, 4, "V100-16GB"),
    "torus 2x2": lambda: mesh_topology((2, 2), "V100-16GB", 25e9, 1e-6, torus=True),
}


@pytest.mark.parametrize("cluster", sorted(CLUSTERS))
@pytest.mark.parametrize("schedule", [Schedule.ONE_F_ONE_B, Schedule.GPIPE])
def test_the_dp_finds_the_enumerated_optimum(gpt_tiny, cluster, schedule) -> None:
    model = _model(gpt_tiny, CLUSTERS[cluster](), layers=4)
    space = JointSpace(stage_options(model.cluster), (1, 2, 4), schedule)
    plan, cost = solve(model, space)
    best_plan, best = joint_brute_force(model, space)
    assert cost.latency == pytest.approx(best.latency, rel=1e-9)
    assert evaluate(model, plan).latency == pytest.approx(cost.latency, rel=1e-12)
    assert sum(stage.option.devices for stage in plan.stages) <= model.cluster.n_devices


@pytest.mark.parametrize("which", ["optimum", "worst", "out of the space"])
def test_an_incumbent_bounds_the_dp_without_changing_the_optimum(gpt_tiny, which) -> None:
    """A plan found by other means bounds every microbatch count's DP from the start (stages and
    cuts no faster plan can hold are left out); the optimum is the enumerated one whether the
    incumbent is that optimum, the slowest plan that fits, or a plan the space does not hold."""
    model = _model(gpt_tiny, CLUSTERS["2 servers x 4"](), layers=4)
    space = JointSpace(stage_options(model.cluster), (1, 2, 4))
    best_plan, best = joint_brute_force(model, space)
    if which == "optimum":
        incumbent = best_plan
    elif which == "worst":
        fitting = [(evaluate(model, p).latency, p) for p in joint_plans(model, space) if evaluate(model, p).fits]
        incumbent = max(fitting, key=lambda pair: pair[0])[1]
    else:
        incumbent = JointPlan((JointStage.of(0, model.n_layers, 0, StageOption(8, 8, 1)),), 3)  # M = 3 is not offered
    plan, cost = solve(model, space, incumbent)
    assert cost.latency == pytest.approx(best.latency, rel=1e-9)
    assert evaluate(model, plan).latency == pytest.approx(cost.latency, rel=1e-12)


def test_a_computation_every_layer_calls_is_charged_to_each_layer() -> None:
    """The zoo GPT's `jnp.where` lowers to one computation that every block calls; its work goes
    to each caller's layer (it all went to the first block, which made a first stage of GPT-145B
    7x slower than the others), so identical blocks cost alike."""
    import dataclasses

    from hlomap import zoo
    from hlomap.hlo.capture import capture
    from hlomap.tasks.joint.costs import block_ends

    tiny = zoo.get("gpt-tiny")
    four = dataclasses.replace(tiny, config=dataclasses.replace(tiny.config, num_layers=4))
    cap = capture(four.train_step(), *four.abstract_args())
    probe = JointModel.build(cap, CLUSTERS["2 servers x 4"](), ())
    ends = block_ends(probe)
    assert len(ends) == 4
    model = JointModel.build(cap, probe.cluster, ends[:-1], graph=probe.graph)  # layer k ends with block k
    called = [i for i in model_instructions(model) if i.instance > 0 and "where" in i.computation]
    assert called, "the step no longer calls a nested computation"
    charged = [p for p in (model.position_of(i) for i in called) if p is not None and p >= 0]
    layers = {int(np.searchsorted(model.boundaries, p, side="right")) - 1 for p in charged}
    assert layers == {0, 1, 2, 3}  # one call per block, each charged to its own block's layer
    compute = np.diff(model.arrays(StageOption(1, 1, 1)).compute)
    assert compute[1] == pytest.approx(compute[2], rel=1e-6)  # blocks 1 and 2: nothing else in them


def model_instructions(model: JointModel):  # type: ignore[no-untyped-def]
    from hlomap.cost.estimate import step_work
    from hlomap.cost.sharding import ShardedGraph

    option = StageOption(1, 1, 1)
    plan, axes = model.plan_for(option)
    sg = ShardedGraph.build(model.graph, plan, axes)
    return step_work(sg, model.cluster, model._mapping(option)).instructions


def test_memory_limits_are_honoured(gpt_tiny) -> None:
    """Devices too small for the unconstrained optimum: the DP finds the best plan that fits,
    the one enumeration finds."""
    from hlomap.cost.devices import DeviceSpec

    roomy = _model(gpt_tiny, hierarchical(2, 4, "V100-16GB"), layers=4)
    space = JointSpace(stage_options(roomy.cluster), (1, 2))
    free_plan, free = solve(roomy, space)
    leanest = min(max(evaluate(roomy, plan).stage_memory) for plan in joint_plans(roomy, space))
    assert leanest < max(free.stage_memory)
    capacity = int((leanest + max(free.stage_memory)) / 2)
    small = DeviceSpec("small", {"f32": 1e13}, 9e11, capacity)
    model = _model(gpt_tiny, hierarchical(2, 4, small), layers=4)
    plan, cost = solve(model, space)
    assert cost.fits and max(cost.stage_memory) <= capacity and plan != free_plan
    assert cost.latency >= free.latency
    assert joint_brute_force(model, space)[1].latency == pytest.approx(cost.latency, rel=1e-9)


def test_a_stage_costs_what_the_cost_model_says_for_the_whole_step(gpt_tiny) -> None:
    """One stage over all layers with M = 1 is the whole step on the group: its compute is the
    cost model's compute of the step minus the optimizer update it amortizes."""
    from hlomap.api import estimate

    cluster = hierarchical(1, 8, "V100-16GB")
    model = _model(gpt_tiny, cluster)
    option = StageOption(8, 2, 4)
    arrays = model.arrays(option)
    est = estimate(gpt_tiny, "dp+megatron", mesh={"data": 2, "model": 4}, cluster=cluster, graph=model.graph)
    priced = arrays.compute[-1] + arrays.update[-1]
    attributed = sum(i.seconds for i in est.instructions)
    assert priced == pytest.approx(attributed, rel=0.05)  # the rest: phase-less ops (constants)
    partial = sum(c.total_seconds for c in est.collectives if c.reason.value != "gradient sync")
    assert arrays.alpha[-1] + arrays.beta[-1] == pytest.approx(partial, rel=1e-9)
    one = JointPlan((JointStage.of(0, model.n_layers, 0, option),), 1)
    assert math.isfinite(evaluate(model, one).latency)


def test_the_expert_grid_lies_inside_the_joint_space(gpt_tiny) -> None:
    from hlomap.tasks.joint.explore import joint_model

    cluster = hierarchical(2, 4, "V100-16GB")
    model = joint_model(gpt_tiny, cluster, max_pivots=6)
    grid = [g for g in expert_grid(model) if g.cost is not None]
    assert {g.label for g in grid} >= {"pp=1 tp=4 dp=2", "pp=2 tp=4 dp=1", "pp=2 tp=2 dp=2"}
    plan, cost = solve(model, JointSpace(stage_options(cluster), microbatch_choices(model.batch)))
    assert cost.latency <= min(g.cost.latency for g in grid) * (1 + 1e-12)


def test_the_grid_with_the_state_split_is_a_point_per_configuration_with_data_replicas(gpt_tiny) -> None:
    """`split_state=(False, True)` adds each configuration with data replicas once more with its
    optimizer state split (what `explore_joint` bounds the DP with); the plain points are the
    same as without."""
    from hlomap.tasks.joint.explore import joint_model

    cluster = hierarchical(2, 4, "V100-16GB")
    model = joint_model(gpt_tiny, cluster, max_pivots=6)
    plain = expert_grid(model)
    both = expert_grid(model, split_state=(False, True))
    assert [(g.label, g.cost) for g in both if not g.split_state] == [(g.label, g.cost) for g in plain]
    split = [g for g in both if g.split_state]
    assert split and all(g.dp > 1 for g in split)
    splittable = {(g.pp, g.tp, g.dp) for g in plain if g.dp > 1 and g.note != "no uniform split of the blocks"}
    assert {(g.pp, g.tp, g.dp) for g in split} == splittable
    assert all(stage.split_state for g in split if g.plan is not None for stage in g.plan.stages)


def test_stage_options_keep_tensor_parallelism_inside_a_server() -> None:
    options = stage_options(hierarchical(2, 8, "V100-16GB"))
    assert StageOption(16, 2, 8) in options and StageOption(8, 1, 8) in options
    assert all(o.model <= 8 and o.data * o.model == o.devices for o in options)
    assert {o.devices for o in options} == {1, 2, 4, 8, 16}
    assert all(o.kind is PlanKind.EXPERT for o in options)


@pytest.mark.parametrize("servers, per_server, layers, episodes", [
    (2, 4, 4, 600), pytest.param(2, 4, 6, 600, marks=pytest.mark.slow),
    # one server of 8: the exact plan is 5 stages deep and off the best-looking path at 3 steps
    # (uniform exploration without fine-tuning ended 20.6% above it)
    pytest.param(1, 8, 6, 800, marks=pytest.mark.slow)])
def test_the_dqn_over_the_outer_level_finds_the_exact_optimum(gpt_tiny, servers, per_server, layers,
                                                              episodes) -> None:
    """Small enough to enumerate: the DQN driver on the joint task reaches the DP's plan."""
    from hlomap.search.budget import Budget
    from hlomap.search.dqn import dqn_search
    from hlomap.tasks.joint.task import JointSearchTask

    model = _model(gpt_tiny, hierarchical(servers, per_server, "V100-16GB"), layers=layers)
    space = JointSpace(stage_options(model.cluster), (1, 2, 4))
    _, exact = solve(model, space)
    if servers == 2:  # the brute force enumerates every plan: affordable on the smaller spaces
        assert joint_brute_force(model, space)[1].latency == pytest.approx(exact.latency, rel=1e-9)
    found = dqn_search(JointSearchTask(model, space), Budget(episodes=episodes, seconds=None), seed=0)
    assert found.score.step_time == pytest.approx(exact.latency, rel=1e-9)
    assert evaluate(model, found.plan).latency == pytest.approx(exact.latency, rel=1e-9)


def test_joint_plans_are_priced_by_the_one_pipeline_formula(gpt_tiny, monkeypatch) -> None:
    """The joint task's cost combines its stage and transfer times with the pipeline task's
    closed form (`cost.pipeline.costs.pipeline_latency`, through `stage_time_latency`, which
    placement's joint layouts share), not a copy of it."""
    import hlomap.cost.pipeline.costs as plans
    from hlomap.cost.pipeline.costs import pipeline_latency

    model = _model(gpt_tiny, CLUSTERS["2 servers x 4"](), layers=4)
    plan, cost = solve(model, JointSpace(stage_options(model.cluster), (2,), Schedule.ONE_F_ONE_B))
    assert (cost.latency, cost.bottleneck) == pipeline_latency(cost.stage_seconds, cost.transfer_seconds, 2)
    seen = []
    monkeypatch.setattr(plans, "pipeline_latency", lambda t, u, m: seen.append((tuple(t), tuple(u), m)) or (1.0, 0.5))
    again = evaluate(model, plan)
    assert (again.latency, again.bottleneck) == (1.0, 0.5)
    assert seen == [(cost.stage_seconds, cost.transfer_seconds, plan.microbatches)]


@pytest.mark.parametrize("data, tp", [(8, 1), (2, 4)])
@pytest.mark.parametrize("split", [False, True])
def test_a_one_stage_plan_costs_the_spmd_estimate_on_a_measured_cluster(gpt_tiny, data: int, tp: int,
                                                                        split: bool) -> None:
    """On a calibrated cluster (8 CPU devices, measured collectives, dispatch, kernel launches and
    the combined all-reduce's per-buffer cost), a one-stage one-microbatch joint plan is the SPMD
    plan on the same mesh: the joint model prices it as the SPMD estimate does, so `task="auto"`
    and the sharding tasks compare like with like; so with the optimizer state split over `data`
    (`Plan.with_sharded_state`)."""
    from hlomap.api import estimate, with_sharded_state
    from hlomap.cost.cluster import load_cluster
    from tests.local_cluster import LOCAL_CLUSTER_FILE

    cluster = load_cluster(str(LOCAL_CLUSTER_FILE))
    assert cluster.measured is not None and cluster.measured.combined_operand_seconds > 0
    model = _model(gpt_tiny, cluster)
    option = StageOption(8, data, tp, split_state=split)
    one = JointPlan((JointStage.of(0, model.n_layers, 0, option),), 1)
    mesh = {"data": data, "model": tp} if tp > 1 else {"data": data}
    plan = "dp+megatron" if tp > 1 else "dp"
    if split:
        plan = with_sharded_state(gpt_tiny, plan, mesh=mesh, graph=model.graph)
    est = estimate(gpt_tiny, plan, mesh=None if split else mesh, cluster=cluster, graph=model.graph)
    assert evaluate(model, one).latency == pytest.approx(est.step_seconds, rel=0.01)


def test_a_measured_cluster_prices_the_executors_gradient_all_reduce_in_every_microbatch(gpt_tiny) -> None:
    """hlomap's executors all-reduce a stage's gradients in each microbatch's backward: on a
    measured cluster a stage of 2 data replicas pays the whole all-reduce per microbatch (M times
    per step); a datasheet cluster, an ideal executor syncing once per step, pays it once."""
    from hlomap.cost.cluster import load_cluster
    from hlomap.cost.pipeline.costs import syncs_each_microbatch
    from hlomap.tasks.joint.plans import stage_seconds
    from tests.local_cluster import LOCAL_CLUSTER_FILE

    measured = load_cluster(str(LOCAL_CLUSTER_FILE))
    assert syncs_each_microbatch(measured) and not syncs_each_microbatch(hierarchical(1, 8, "V100-16GB"))
    model = _model(gpt_tiny, measured)
    a = model.arrays(StageOption(2, 2, 1))
    i, j, m = 0, 2, 4
    sync = float(a.sync_alpha + a.sync_beta * (a.grads[j] - a.grads[i])
                 + a.sync_per_buffer * max(a.buffers[j] - a.buffers[i] - 1, 0))
    assert sync > 0
    once = float(stage_seconds(a, i, j, m))
    every = float(stage_seconds(a, i, j, m, sync_each_microbatch=True))
    assert every - once == pytest.approx(sync * (1 - 1 / m), rel=1e-9)
    assert float(stage_seconds(a, i, j, 1, sync_each_microbatch=True)) == pytest.approx(float(stage_seconds(a, i, j, 1)))
    # evaluate and the DP price a plan the same way: a two-stage plan's stage times carry it
    option = StageOption(4, 2, 2)
    plan = JointPlan((JointStage.of(0, 2, 0, option), JointStage.of(2, model.n_layers, 4, option)), m)
    b = model.arrays(option)
    assert evaluate(model, plan).stage_seconds[0] == pytest.approx(
        float(stage_seconds(b, 0, 2, m, sync_each_microbatch=True)))


def _recomputed_oracle(model: JointModel, keep, i: int, j: int, held: int, selective: bool) -> float:
    """Activation bytes (per step) a recomputing stage of layers [i, j) holds at its peak, by a
    loop over its checkpoint groups: the lesser of checkpointing it whole and group by group."""
    groups = model.checkpoint_groups
    stash, saved = np.diff(keep.stash), np.diff(keep.saved) if selective else np.zeros(model.n_layers)
    rest = np.maximum(stash - saved, 0.0) if selective else stash
    runs, first = [], i
    for k in range(i + 1, j + 1):
        if k == j or groups[k] != groups[k - 1]:
            runs.append((first, k))
            first = k
    kept_matmuls = float(saved[i:j].sum())
    whole = held * (keep.inputs[i] + kept_matmuls) + (max(float(stash[i:j].sum()) - kept_matmuls, 0.0)
                                                      if selective else float(stash[i:j].sum()))
    grouped = held * (sum(keep.inputs[a] for a, _ in runs) + kept_matmuls) + max(float(rest[a:b].sum())
                                                                                for a, b in runs)
    return min(whole, grouped)


def test_checkpoint_groups_are_the_transformer_blocks(gpt_tiny) -> None:
    """A recomputing stage checkpoints the joint layers of one transformer block together (the
    stretch before the first block joins it; the one after the last is its own group)."""
    from hlomap.tasks.joint.explore import joint_model

    model = joint_model(gpt_tiny, hierarchical(2, 4, "V100-16GB"))
    groups, names = model.checkpoint_groups, model.layer_names
    assert list(groups) == sorted(groups) and len(set(groups.tolist())) == 3
    for name, group in zip(names, groups):  # a layer's name is its last instruction's scope
        expected = 0 if name.startswith(("before", "layers_0")) else 1 if name.startswith("layers_1") else 2
        assert group == expected, (name, group)
    first_of_1 = names.index("layers_1")
    assert model.checkpoint_starts(0, model.n_layers) == (first_of_1, int(np.argmax(groups == 2)))
    assert model.checkpoint_starts(first_of_1, first_of_1 + 2) == ()


def test_a_recomputing_stage_pays_one_more_forward_and_keeps_only_its_groups_inputs(gpt_tiny) -> None:
    """`Recompute.FULL` priced: the stage's forward compute once more per step; per microbatch in
    flight its input (checkpointed whole) or each checkpoint group's input (group by group)
    instead of its stash, plus what one microbatch's recomputation holds (the stage's stash, or
    one group's), whichever is less, against a loop over the groups; both cases occur."""
    from hlomap.tasks.joint.explore import joint_model
    from hlomap.tasks.joint.plans import checkpoints_groups, stage_memory, stage_seconds

    model = joint_model(gpt_tiny, hierarchical(2, 4, "V100-16GB"))
    keep = model.arrays(StageOption(2, 2, 1))
    again = model.arrays(StageOption(2, 2, 1, recompute=Recompute.FULL))
    m, n = 4, model.n_layers
    forward = keep.forward[n] - keep.forward[1]
    assert forward > 0
    assert stage_seconds(again, 1, n, m) == pytest.approx(stage_seconds(keep, 1, n, m) + forward / m, rel=1e-12)
    assert keep.inputs[1] == keep.crossing[0] > 0 and keep.inputs[0] == 0.0
    chosen = set()
    for i, j in [(0, n), (1, n), (0, 19), (3, n - 3), (5, 6), (14, 24)]:
        params = 4.0 * (keep.params[j] - keep.params[i])
        for held in (1, 3, 8):
            assert stage_memory(keep, i, j, held, m) == pytest.approx(
                params + held * (keep.stash[j] - keep.stash[i]) / m, rel=1e-12)
            oracle = _recomputed_oracle(model, keep, i, j, held, selective=False)
            assert stage_memory(again, i, j, held, m) == pytest.approx(params + oracle / m, rel=1e-12)
            chosen.add(checkpoints_groups(again, i, j, held))
    assert chosen == {True, False}
    assert stage_memory(again, 0, n, 8, m) < stage_memory(keep, 0, n, 8, m)


def test_a_selectively_recomputing_stage_redoes_all_but_its_matmuls_and_keeps_their_outputs(gpt_tiny) -> None:
    """`Recompute.SELECTIVE` priced (JAX's `dots_saveable`): the forward's non-matmul compute once
    more per step, and per microbatch in flight its input (or its groups' inputs) and its
    forward's matmul outputs, plus the rest of one microbatch's stash (or one group's) while it
    recomputes. Its time sits between keeping everything and full recomputation; the saved
    bytes are those of the forward's dots on the stage's layers."""
    from hlomap.tasks.joint.plans import stage_memory, stage_seconds

    model = _model(gpt_tiny, hierarchical(2, 4, "V100-16GB"), layers=5)
    keep = model.arrays(StageOption(2, 2, 1))
    full = model.arrays(StageOption(2, 2, 1, recompute=Recompute.FULL))
    selective = model.arrays(StageOption(2, 2, 1, recompute=Recompute.SELECTIVE))
    i, j, m, held = 1, 4, 4, 3
    redo, forward = selective.redo[j] - selective.redo[i], keep.forward[j] - keep.forward[i]
    assert 0 < redo < forward
    assert stage_seconds(selective, i, j, m) == pytest.approx(stage_seconds(keep, i, j, m) + redo / m, rel=1e-12)
    saved = selective.saved[j] - selective.saved[i]
    params = 4.0 * (keep.params[j] - keep.params[i])
    for a, b, h in [(i, j, held), (0, 5, 1), (0, 5, 8), (2, 3, 2)]:
        oracle = _recomputed_oracle(model, keep, a, b, h, selective=True)
        assert stage_memory(selective, a, b, h, m) == pytest.approx(
            4.0 * (keep.params[b] - keep.params[a]) + oracle / m, rel=1e-12)
    assert stage_memory(selective, i, j, held, m) <= params + (held * (keep.inputs[i] + saved) + max(
        keep.stash[j] - keep.stash[i] - saved, 0.0)) / m * (1 + 1e-12)
    times = [float(stage_seconds(a, i, j, m)) for a in (keep, selective, full)]
    assert times[0] < times[1] < times[2]
    assert stage_memory(full, i, j, held, m) < stage_memory(selective, i, j, held, m)
    # the saved bytes: every forward dot of layers [i, j), at its size on one device (data = 2
    # splits each along the batch)
    entry = {inst.name: inst for inst in gpt_tiny.module.entry.instructions}
    bounds = model.boundaries
    dots = [name for name, p in model.attribution.anchor.items() if entry[name].opcode == "dot"
            and name in model.attribution.forward and bounds[i] <= p < bounds[j]]
    assert dots and saved == pytest.approx(sum(entry[d].shape.byte_size for d in dots) / 2, rel=1e-9)


def test_the_dp_recomputes_exactly_when_memory_requires_it(gpt_tiny) -> None:
    """Devices too small for any plan that keeps its activations: with recomputing options the DP
    finds the plan enumeration finds (over every option, none pruned), and it recomputes; on
    roomy devices `problem_for` drops every recomputing option (each is dominated by its twin)
    and the plan is the one found without them."""
    from hlomap.cost.devices import DeviceSpec
    from hlomap.tasks.joint.solve import problem_for
    from hlomap.tasks.pipeline.solution import NoFeasiblePlan

    roomy = _model(gpt_tiny, hierarchical(2, 4, "V100-16GB"), layers=4)
    keeping = JointSpace(stage_options(roomy.cluster), (2, 4))
    both = JointSpace(stage_options(roomy.cluster, recompute=tuple(Recompute)), (2, 4))
    assert len(both.options) == 3 * len(keeping.options)
    assert len(problem_for(roomy, both, 4).options) == len(problem_for(roomy, keeping, 4).options)
    assert solve(roomy, both)[1].latency == pytest.approx(solve(roomy, keeping)[1].latency, rel=1e-12)

    def leanest(space: JointSpace) -> float:
        return min(max(evaluate(roomy, plan).stage_memory) for plan in joint_plans(roomy, space))

    keep_least, recompute_least = leanest(keeping), leanest(both)
    assert recompute_least < keep_least
    capacity = int((keep_least + recompute_least) / 2)
    small = DeviceSpec("small", {"f32": 1e13}, 9e11, capacity)
    model = _model(gpt_tiny, hierarchical(2, 4, small), layers=4)
    with pytest.raises(NoFeasiblePlan):
        solve(model, JointSpace(stage_options(model.cluster), (2, 4)))
    space = JointSpace(stage_options(model.cluster, recompute=tuple(Recompute)), (2, 4))
    plan, cost = solve(model, space)
    assert cost.fits and any(stage.recompute is not Recompute.NONE for stage in plan.stages)
    assert joint_brute_force(model, space)[1].latency == pytest.approx(cost.latency, rel=1e-9)


def test_a_stage_s_cut_transfers_priced_at_once_equal_the_collective_permute_model() -> None:
    """The planner's tables price every cut of a stage in one call (`transfer_seconds_of`): each
    equals the collective-permute of the replicas' shards that `transfer_seconds` describes."""
    import numpy as np

    from hlomap.cost.collectives import collective_permute_time
    from hlomap.tasks.joint.costs import transfer_seconds_of

    cluster = hierarchical(4, 8, "A100-80GB", nics_per_node=2)
    nbytes = np.asarray([0.0, 1.0, 4096.0, 3e6, 7.5e8])
    for option, first, receiver in ((StageOption(8, 4, 2), 0, 8), (StageOption(16, 16, 1), 8, 24),
                                    (StageOption(2, 2, 1), 6, 8), (StageOption(4, 1, 4), 4, 8)):
        shards = max(1, min(option.data, cluster.n_devices - receiver))
        pairs = [(first + c * option.model, receiver + c) for c in range(shards)]
        expected = [collective_permute_time(cluster, pairs, b / shards) if b > 0 else 0.0 for b in nbytes]
        assert transfer_seconds_of(cluster, option, first, receiver, nbytes) == pytest.approx(expected, rel=1e-12)


def test_memoized_collective_prices_equal_a_fresh_cluster_s() -> None:
    """`collective_time` memoizes its analysis of a group list per cluster: asked again with other
    byte counts, kinds and group lists it prices what an unmemoized cluster does."""
    from hlomap.cost.collectives import Collective, collective_time

    def build():
        return hierarchical(4, 4, "A100-80GB", nics_per_node=1)

    warm = build()
    asks = [(kind, groups, nbytes) for kind in (Collective.ALL_REDUCE, Collective.ALL_GATHER, Collective.ALL_TO_ALL)
            for groups in ([[0, 4, 8, 12], [1, 5, 9, 13]], [[0, 1, 2, 3]], [[0, 1, 4, 5], [8, 9, 12, 13]])
            for nbytes in (0.0, 1e3, 2.5e7)]
    for kind, groups, nbytes in asks * 2:
        assert collective_time(kind, warm, groups, nbytes) == collective_time(kind, build(), groups, nbytes)
    assert len(warm.collective_memo) == 9


def test_a_gpt_s_stash_splits_over_data_replicas(gpt_tiny) -> None:
    """#26: the zoo GPT's `jnp.where` (causal mask) lowers to a nested call that also returns the
    broadcast fill value its derivative reads, a [batch, heads, seq, seq] constant the data plan
    leaves replicated. XLA rebuilds it (it inlines the call), so it is not an activation kept
    for the backward pass (`chain.kept_bytes`): under data=8 every value the stage keeps that
    has the batch dim is an eighth of it on a device, and the stash of data=8 is an eighth of
    data=1's but for what has no batch dim (weights the backward reads again)."""
    from hlomap.cost.pipeline.chain import kept_bytes
    from hlomap.cost.sharding import ShardedGraph
    from hlomap.propagation.graph import constant_derived

    entry = gpt_tiny.module.entry
    free = constant_derived(gpt_tiny.module)
    masked = [i for i in entry.instructions
              if i.opcode == "get-tuple-element" and "where" in i.name and all(free[i.name]) and i.shape.rank == 4]
    assert masked, "the causal mask's constant element of the nested where-call"
    kept = kept_bytes(gpt_tiny)
    assert all(kept[i.name] == 0.0 for i in masked)
    model = _model(gpt_tiny, hierarchical(1, 8, "V100-16GB"))
    plan, axes = model.plan_for(StageOption(8, 8, 1))
    sg = ShardedGraph.build(model.graph, plan, axes)
    by_name = {i.name: i for i in entry.instructions}
    batched = [name for name in model.attribution.stashed
               if kept[name] > 0 and by_name[name].shape.rank and by_name[name].shape.dims[0] == model.batch]
    assert batched
    for name in batched:
        first = model.graph.node_tensors[model.graph.node_of(entry.name, name)][0]
        assert sg.tensor_degree[first] == 8, name
    one, eight = model.arrays(StageOption(1, 1, 1)), model.arrays(StageOption(8, 8, 1))
    unbatched = sum(kept[n] for n in model.attribution.stashed if n not in batched)
    assert eight.stash[-1] == pytest.approx(unbatched + (one.stash[-1] - unbatched) / 8, rel=1e-9)


def test_a_split_state_stage_pays_an_all_gather_and_keeps_its_moments_at_one_over_data(gpt_tiny) -> None:
    """`StageOption.split_state` priced: Adam's moments at 1 / data (4 x params -> (2 + 2 / data) x
    params), 1 / data of the update, and once per step the all-gather of the stage's updated
    parameters over its data groups."""
    from hlomap.cost.collectives import Collective, collective_time
    from hlomap.cost.mapping import axis_devices
    from hlomap.tasks.joint.plans import stage_memory, stage_seconds

    model = _model(gpt_tiny, hierarchical(2, 4, "V100-16GB"), layers=5)
    whole = model.arrays(StageOption(4, 4, 1))
    split = model.arrays(StageOption(4, 4, 1, split_state=True))
    i, j, m, held = 1, 4, 4, 2
    params = whole.params[j] - whole.params[i]
    assert params > 0
    groups = axis_devices(model.cluster, {"data": 4, "model": 1}, order=("data", "model")).groups("data")
    gather = collective_time(Collective.ALL_GATHER, model.cluster, groups, float(params))
    update = whole.update[j] - whole.update[i]
    assert update > 0
    assert float(stage_seconds(split, i, j, m)) == pytest.approx(
        float(stage_seconds(whole, i, j, m)) + (gather - update * 3 / 4) / m, rel=1e-9)
    assert float(stage_memory(split, i, j, held, m)) == pytest.approx(
        float(stage_memory(whole, i, j, held, m)) - 2.0 * params * 3 / 4, rel=1e-12)
    offered = stage_options(model.cluster, split_state=(False, True))
    assert any(o.split_state for o in offered)
    assert not any(o.split_state and o.data == 1 for o in offered)  # no data replicas, nothing to split over


def test_a_stage_with_split_parameters_gathers_each_microbatch_and_keeps_a_data_th_of_its_state(gpt_tiny) -> None:
    """`StageOption.shard_parameters` (FSDP) priced: weights, gradients and moments at 1 / data plus
    one gathered copy of the weights (4 x params -> (4 / data + 1) x params), 1 / data of the
    update, and every microbatch two all-gathers of the weights (forward, backward) and a
    reduce-scatter of the gradients over the data groups instead of the all-reduce."""
    from hlomap.cost.collectives import Collective, collective_time
    from hlomap.cost.mapping import axis_devices
    from hlomap.tasks.joint.plans import stage_memory, stage_seconds

    model = _model(gpt_tiny, hierarchical(2, 4, "V100-16GB"), layers=5)
    whole = model.arrays(StageOption(4, 4, 1))
    fsdp = model.arrays(StageOption(4, 4, 1, split_state=True, shard_parameters=True))
    i, j, m, held = 1, 4, 4, 2
    params, grads = whole.params[j] - whole.params[i], whole.grads[j] - whole.grads[i]
    assert params > 0 and grads > 0
    groups = axis_devices(model.cluster, {"data": 4, "model": 1}, order=("data", "model")).groups("data")
    gather = collective_time(Collective.ALL_GATHER, model.cluster, groups, float(params))
    scatter = collective_time(Collective.REDUCE_SCATTER, model.cluster, groups, float(grads))
    reduce = collective_time(Collective.ALL_REDUCE, model.cluster, groups, float(grads))
    own = (whole.compute[j] - whole.compute[i]) + (whole.beta[j] - whole.beta[i])
    update = whole.update[j] - whole.update[i]
    assert float(stage_seconds(whole, i, j, m)) == pytest.approx((own + update + reduce) / m
                                                                 + whole.alpha[j] - whole.alpha[i], rel=1e-9)
    assert float(stage_seconds(fsdp, i, j, m)) == pytest.approx((own + update / 4) / m + 2 * gather + scatter
                                                                + whole.alpha[j] - whole.alpha[i], rel=1e-9)
    assert float(stage_memory(fsdp, i, j, held, m)) == pytest.approx(
        float(stage_memory(whole, i, j, held, m)) - 4.0 * params + (4.0 / 4 + 1.0) * params, rel=1e-12)
    offered = stage_options(model.cluster, split_state=(False, True), shard_parameters=(False, True))
    assert any(o.shard_parameters for o in offered)
    assert all(o.split_state and o.data > 1 for o in offered if o.shard_parameters)
    with pytest.raises(ValueError, match="need split_state"):
        StageOption(4, 4, 1, shard_parameters=True)


def test_a_stage_with_split_gradients_reduce_scatters_each_microbatch_and_keeps_its_weights_whole(gpt_tiny) -> None:
    """`StageOption.shard_gradients` (ZeRO-2) priced: the weights whole, gradients and moments at
    1 / data (4 x params -> (1 + 3 / data) x params), 1 / data of the update and ZeRO-1's all-gather
    of the updated parameters once per step, and every microbatch a reduce-scatter of the
    gradients over the data groups instead of the all-reduce. Offered wherever split parameters
    are; it never goes with them."""
    from hlomap.cost.collectives import Collective, collective_time
    from hlomap.cost.mapping import axis_devices
    from hlomap.tasks.joint.plans import stage_memory, stage_seconds

    model = _model(gpt_tiny, hierarchical(2, 4, "V100-16GB"), layers=5)
    whole = model.arrays(StageOption(4, 4, 1))
    zero2 = model.arrays(StageOption(4, 4, 1, split_state=True, shard_gradients=True))
    i, j, m, held = 1, 4, 4, 2
    params, grads = whole.params[j] - whole.params[i], whole.grads[j] - whole.grads[i]
    groups = axis_devices(model.cluster, {"data": 4, "model": 1}, order=("data", "model")).groups("data")
    gather = collective_time(Collective.ALL_GATHER, model.cluster, groups, float(params))
    scatter = collective_time(Collective.REDUCE_SCATTER, model.cluster, groups, float(grads))
    own = (whole.compute[j] - whole.compute[i]) + (whole.beta[j] - whole.beta[i])
    update = whole.update[j] - whole.update[i]
    assert float(stage_seconds(zero2, i, j, m)) == pytest.approx((own + update / 4 + gather) / m + scatter
                                                                 + whole.alpha[j] - whole.alpha[i], rel=1e-9)
    assert float(stage_memory(zero2, i, j, held, m)) == pytest.approx(
        float(stage_memory(whole, i, j, held, m)) - 4.0 * params + (1.0 + 3.0 / 4) * params, rel=1e-12)
    offered = stage_options(model.cluster, split_state=(False, True), shard_parameters=(False, True))
    zero2_offered = {dataclasses.replace(o, shard_gradients=False, shard_parameters=True) for o in offered
                     if o.shard_gradients}
    assert zero2_offered == {o for o in offered if o.shard_parameters}
    assert not any(o.shard_gradients for o in stage_options(model.cluster, split_state=(False, True)))
    with pytest.raises(ValueError, match="need split_state"):
        StageOption(4, 4, 1, shard_gradients=True)
    with pytest.raises(ValueError, match="splits the gradients already"):
        StageOption(4, 4, 1, split_state=True, shard_parameters=True, shard_gradients=True)


def test_the_dp_splits_the_parameters_where_only_that_fits_and_finds_the_enumerated_optimum(cap_of) -> None:  # type: ignore[no-untyped-def]
    """haiku-mlp (its parameters outweigh its activations) in data-parallel stages only (model = 1),
    on devices with 90% of the memory the leanest plan with the optimizer state split needs: only
    stages whose gradients are split too fit (ZeRO-2, or FSDP, which the model prices at the same
    memory with more collectives), the DP takes them, and its optimum (exact pruning included) is
    the enumerated one; without ZeRO-2 among the options it takes FSDP."""
    import dataclasses

    from hlomap.cost.devices import device_preset
    from hlomap.tasks.pipeline.solution import NoFeasiblePlan

    mlp = cap_of("haiku-mlp")
    cluster = hierarchical(2, 4, "V100-16GB")
    model = _model(mlp, cluster, layers=4)
    zero1 = JointSpace(stage_options(cluster, max_model=1, split_state=(False, True)), (2, 4))
    least = min(max(evaluate(model, plan).stage_memory) for plan in joint_plans(model, zero1))
    device = dataclasses.replace(device_preset("V100-16GB"), memory_bytes=least * 0.9)
    model = _model(mlp, hierarchical(2, 4, device), layers=4)
    with pytest.raises(NoFeasiblePlan):
        solve(model, JointSpace(stage_options(model.cluster, max_model=1, split_state=(False, True)), (2, 4)))
    space = JointSpace(stage_options(model.cluster, max_model=1, split_state=(False, True),
                                     shard_parameters=(False, True)), (2, 4))
    plan, cost = solve(model, space)
    assert cost.fits and any(stage.shard_gradients for stage in plan.stages)
    assert not any(stage.shard_parameters for stage in plan.stages)
    assert cost.latency == pytest.approx(joint_brute_force(model, space)[1].latency, rel=1e-9)
    fsdp_only = JointSpace(tuple(o for o in space.options if not o.shard_gradients), (2, 4))
    plan, fsdp_cost = solve(model, fsdp_only)
    assert fsdp_cost.fits and any(stage.shard_parameters for stage in plan.stages)
    assert fsdp_cost.latency >= cost.latency
    assert fsdp_cost.latency == pytest.approx(joint_brute_force(model, fsdp_only)[1].latency, rel=1e-9)


@pytest.mark.parametrize("capacity", [pytest.param(None, marks=pytest.mark.slow), 0.85])
def test_the_dp_with_split_state_finds_the_enumerated_optimum(gpt_tiny, capacity) -> None:
    """With split-state (and recomputing) options the DP, its exact pruning included, finds what
    enumeration over every option finds: on roomy devices and on devices with 85% of the memory
    the leanest whole-state plan needs."""
    import dataclasses

    from hlomap.cost.devices import device_preset

    cluster = hierarchical(2, 4, "V100-16GB")
    model = _model(gpt_tiny, cluster, layers=4)
    if capacity is not None:
        whole = JointSpace(stage_options(cluster), (2, 4))
        least = min(max(evaluate(model, plan).stage_memory) for plan in joint_plans(model, whole))
        device = dataclasses.replace(device_preset("V100-16GB"), memory_bytes=least * capacity)
        model = _model(gpt_tiny, hierarchical(2, 4, device), layers=4)
    space = JointSpace(stage_options(model.cluster, recompute=tuple(Recompute), split_state=(False, True)), (2, 4))
    plan, cost = solve(model, space)
    best_plan, best = joint_brute_force(model, space)
    assert cost.latency == pytest.approx(best.latency, rel=1e-9)
    if capacity is not None:
        assert any(stage.split_state or stage.recompute is not Recompute.NONE for stage in plan.stages)


def test_dominated_options_are_dropped_and_the_optimum_kept(gpt_tiny) -> None:
    """Two plan kinds that run the same plan (no searched plan given: SEARCHED falls back to the
    expert one) price alike: `without_dominated` keeps the first of each pair, and the DP's
    optimum over the pruned options is the enumerated one over all of them."""
    from hlomap.tasks.joint.solve import problem_for, without_dominated

    model = _model(gpt_tiny, hierarchical(2, 4, "V100-16GB"), layers=4)
    space = JointSpace(stage_options(model.cluster, kinds=(PlanKind.EXPERT, PlanKind.SEARCHED)), (2, 4))
    problem = problem_for(model, space, 4)
    pruned, tables = without_dominated(problem, problem.tables())
    assert len(pruned.options) == len(problem.options) // 2
    assert all(o.kind is PlanKind.EXPERT for o in pruned.options) and len(tables.stage) == len(pruned.options)
    plan, cost = solve(model, space)
    assert cost.latency == pytest.approx(joint_brute_force(model, space)[1].latency, rel=1e-9)


@pytest.mark.parametrize("per_node", [1, 4, 6, 8])
def test_aligned_starts_are_the_devices_aligned_groups_start_on(per_node) -> None:
    for devices in (8, 24, 48):
        for size in range(1, devices + 1):
            expected = [d for d in range(devices - size + 1) if aligned(per_node, d, size)]
            assert list(aligned_starts(per_node, devices, size)) == expected, (per_node, devices, size)


def test_cuts_between_groups_a_server_apart_are_priced_once_and_alike() -> None:
    """On servers alike (`Cluster.shift_period`) a cut's terms are kept once per offset in a
    server; the price is the one from the pairs' own links, wherever the groups are."""
    from hlomap.cost.collectives import collective_permute_terms
    from hlomap.tasks.joint.costs import transfer_seconds

    cluster = hierarchical(6, 8, "A100-80GB", inter_bw=25e9, nics_per_node=2)
    cache: dict = {}
    for option in (StageOption(8, 8, 1), StageOption(16, 4, 4), StageOption(4, 2, 2), StageOption(2, 1, 2)):
        for first in range(0, 48 - 2 * option.devices + 1, option.devices):
            receiver = first + option.devices
            shards = min(option.data, 48 - receiver)
            pairs = [(first + c * option.model, receiver + c) for c in range(shards)]
            expected = max(t.alpha + t.beta * 1e6 / shards for t in collective_permute_terms(cluster, pairs))
            assert transfer_seconds(cluster, option, first, receiver, 1e6, cache) == pytest.approx(expected, rel=1e-12)
    kept = [key for key in cache if key[0] == "permute terms"]
    assert kept and all(key[3] < 8 for key in kept)


@pytest.mark.parametrize("recompute", list(Recompute))
def test_the_most_microbatches_held_is_the_memory_check_summed(gpt_tiny, recompute) -> None:
    """`HeldMemory.most_held` (a line through the fewest and most held, then steps of one) is
    the last count at which `fit` (the table over every count) still fits, on capacities from
    roomy to none and on capacities exactly at some stage's need (where rounding decides)."""
    from hlomap.tasks.joint.solve import HeldMemory

    model = _model(gpt_tiny, CLUSTERS["2 servers x 4"](), layers=5)
    arrays = model.arrays(StageOption(4, 2, 2, recompute=recompute))
    held = (1, 2, 2, 3, 5, 8, 8, 8)
    memory = HeldMemory(arrays, held, 8)
    full = float(memory[8][np.isfinite(memory[8])].max())
    # a stage's own need holding 2, 5 or 8 microbatches: it fits there exactly
    edges = [float(np.sort(values)[len(values) * k // 4])
             for values in (memory[h][np.isfinite(memory[h])] for h in (2, 5, 8)) for k in (1, 2, 3)]
    for capacity in (0.0, full / 7, full / 3, full / 2, full, 2 * full, *edges):
        fits = memory.fit(held, capacity)
        assert np.array_equal(memory.most_held(held, capacity), fits.sum(axis=0) - 1)


def test_the_dp_on_servers_of_unequal_memory_finds_the_enumerated_optimum(gpt_tiny) -> None:
    """Groups of one option on servers of different memory share a stage table but check memory
    apart (`table_groups`: one group per capacity); the DP finds what enumeration finds, with the
    second server's devices too small for any plan on them alone (0.9 of the leanest plan's)."""
    import dataclasses

    from hlomap.cost.devices import device_preset
    from hlomap.tasks.joint.solve import _JointOptions, problem_for

    cluster = hierarchical(2, 4, "V100-16GB")
    space = JointSpace(stage_options(cluster), (2, 4))
    model = _model(gpt_tiny, cluster, layers=4)
    least = min(max(evaluate(model, plan).stage_memory) for plan in joint_plans(model, space))
    big, small = (dataclasses.replace(device_preset("V100-16GB"), memory_bytes=least * f) for f in (4.0, 0.9))
    mixed = dataclasses.replace(cluster, devices=(big,) * 4 + (small,) * 4)
    model = _model(gpt_tiny, mixed, layers=4)
    problem = problem_for(model, space, 4)
    options = _JointOptions(problem, problem.tables())
    one = options.sizes.index(1)
    assert [(key, members) for key, members in options.table_groups(one, range(8))] == [
        ((one, small.memory_bytes), [4, 5, 6, 7]), ((one, big.memory_bytes), [0, 1, 2, 3])]
    plan, cost = solve(model, space)
    _, best = joint_brute_force(model, space)
    assert cost.fits and cost.latency == pytest.approx(best.latency, rel=1e-9)


def test_the_planner_splits_parameters_only_when_no_plan_fits_without(cap_of, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """`explore_joint`'s default (`shard_parameters=None`, auto): haiku-mlp in data-parallel stages
    only on devices of 3.2 MiB, where no plan fits unless some stage splits its gradients (ZeRO-2)
    or parameters (FSDP): auto finds the plan that forcing those options in finds, and on roomy
    devices it returns the plan searched without them."""
    import dataclasses
    import functools

    import hlomap.tasks.joint.explore as explore_module
    from hlomap.cost.devices import device_preset
    from hlomap.tasks.pipeline.solution import NoFeasiblePlan

    monkeypatch.setattr(explore_module, "stage_options", functools.partial(stage_options, max_model=1))
    mlp = cap_of("haiku-mlp")
    tight = hierarchical(2, 4, dataclasses.replace(device_preset("V100-16GB"), memory_bytes=int(3.2 * 2**20)))
    with pytest.raises(NoFeasiblePlan):
        explore_module.explore_joint(mlp, tight, shard_parameters=False, with_grid=False)
    forced = explore_module.explore_joint(mlp, tight, shard_parameters=True, with_grid=False)
    auto = explore_module.explore_joint(mlp, tight, with_grid=False)
    assert auto.cost.fits and any(stage.shard_parameters or stage.shard_gradients for stage in auto.plan.stages)
    assert auto.cost.latency == pytest.approx(forced.cost.latency, rel=1e-12)
    roomy = hierarchical(2, 4, "V100-16GB")
    plain = explore_module.explore_joint(mlp, roomy, with_grid=False)
    assert not any(stage.shard_parameters or stage.shard_gradients for stage in plain.plan.stages)
    assert plain.cost.latency == pytest.approx(
        explore_module.explore_joint(mlp, roomy, shard_parameters=False, with_grid=False).cost.latency, rel=1e-12)


def test_ties_go_to_fewer_microbatches() -> None:
    """One stage on one device costs the same L for every microbatch count on a datasheet cluster
    (one microbatch's time times M); the executor's dispatches, which such a cluster does not
    price, make more microbatches slower in fact. haiku-mlp got 32 microbatches; now one, which
    is an ordinary SPMD plan."""
    from hlomap import api

    for cluster in ("uniform:1", "hier:1x1"):
        plan = api.explore("zoo:haiku-mlp", task="auto", cluster=cluster)
        assert plan.pipeline is None and all(size == 1 for _, size in plan.mesh)


def test_the_grid_keeps_to_the_stages_the_search_may_use(gpt_tiny) -> None:
    """`--stages 2` caps the joint search at 2 stages; the grid it is compared with too."""
    from hlomap.tasks.joint.explore import joint_model

    model = joint_model(gpt_tiny, hierarchical(2, 4, "V100-16GB"), max_pivots=6)
    everything = expert_grid(model)
    capped = expert_grid(model, max_stages=2)
    assert max(g.pp for g in everything) > 2 and max(g.pp for g in capped) == 2
    assert [(g.label, g.cost) for g in capped] == [(g.label, g.cost) for g in everything if g.pp <= 2]
