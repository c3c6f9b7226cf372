"""The inference network: policy files, lifting coarse plans, fine-tuning, the shipped policy."""

import json
from dataclasses import replace

import numpy as np
import pytest

from hlomap.agents import checkpoint
from hlomap.agents.dqn import DqnAgent
from hlomap.cost.pipeline.costs import evaluate_plan
from hlomap.tasks.pipeline.dp import solve
from hlomap.tasks.pipeline.space import PipelineSpace
from hlomap.tasks.pipeline.cutenv import CutEnv, CutTask
from hlomap.search.budget import Budget
from hlomap.tasks.pipeline.infer import (
    DEFAULT_POLICY,
    TrainingConfig,
    infer_cuts,
    inference_dqn_config,
    load_policy,
    save_policy,
    train_policy,
    validate,
)
from hlomap.tasks.pipeline.normalize import (
    CANDIDATES,
    SLOTS,
    RandomCutEnv,
    random_profile,
    random_task,
)
from tests.tasks.pipeline.strategies import uniform_cluster


@pytest.fixture(scope="module")
def tiny_policy(tmp_path_factory):
    """An untrained network: enough to exercise files and inference, not to be good."""
    env = RandomCutEnv()
    agent = DqnAgent(inference_dqn_config(1000), env.observation_size, env.num_actions, seed=3)
    path = tmp_path_factory.mktemp("policy") / "tiny.npz"
    save_policy(path, agent, extra={"episodes": 0})
    return path, agent


def _task(n_layers: int = 300, stages: int = 3) -> CutTask:
    profile = random_profile(np.random.default_rng(5), n_layers)
    profile = replace(profile, activation_bytes=profile.activation_bytes * 1e6,
                      parameter_bytes=profile.parameter_bytes * 1e6)
    cluster = uniform_cluster(2 * stages, bandwidth=1e10, latency=1e-5, devices_per_node=2)
    space = PipelineSpace(microbatches=8, replication=(2,), cut_on_node_boundary=True)
    return CutTask(profile, cluster, space, stages)


def test_policy_files_round_trip(tiny_policy):
    path, agent = tiny_policy
    policy = load_policy(path)
    assert policy.meta["layout"]["slots"] == SLOTS
    assert policy.meta["layout"]["candidates"] == CANDIDATES
    assert policy.meta["extra"]["episodes"] == 0
    assert path.stat().st_size < 5 * 2**20
    loaded = policy.agent()
    for seed in range(3):
        task = random_task(np.random.default_rng(seed))
        observation = CutEnv(task, slots=SLOTS, ranked=CANDIDATES).reset(0).observation
        assert np.allclose(loaded.q_values(observation[None]), agent.q_values(observation[None]))


def test_policy_files_of_another_layout_or_kind_are_refused(tiny_policy, tmp_path):
    path, _ = tiny_policy
    arrays, meta = checkpoint.load(path)
    checkpoint.save(tmp_path / "old.npz", arrays, {**meta, "layout": {**meta["layout"],
                                                                      "version": 0}})
    with pytest.raises(ValueError, match="layout"):
        load_policy(tmp_path / "old.npz")
    checkpoint.save(tmp_path / "other.npz", arrays, {**meta, "kind": "dqn"})
    with pytest.raises(ValueError, match="not a pipeline cut policy"):
        load_policy(tmp_path / "other.npz")
    with pytest.raises(FileNotFoundError, match="train_pipeline_infer.py"):
        load_policy(tmp_path / "missing.npz")


def test_inferred_cuts_are_plans_of_the_original_profile(tiny_policy):
    path, _ = tiny_policy
    task = _task()
    result = infer_cuts(task, load_policy(path))
    assert len(result.coarse_pivots) == SLOTS < task.profile.n_pivots
    assert set(result.plan.cuts) <= set(result.coarse_pivots)
    cost = evaluate_plan(task.profile, task.cluster, result.plan, task.space.cost)
    assert result.cost == cost and result.value == cost.latency
    assert result.value == pytest.approx(result.inference_value, rel=1e-12)  # no fine-tuning
    assert result.value >= solve(task.profile, task.cluster, task.space).value * (1 - 1e-12)
    assert [s.devices[0] for s in result.plan.stages] == [0, 2, 4]


@pytest.mark.slow
def test_fine_tuning_never_ends_worse_than_inference(tiny_policy):
    path, _ = tiny_policy
    task = _task(stages=2)
    result = infer_cuts(task, load_policy(path), finetune=Budget(episodes=30, seconds=None))
    assert result.finetune_episodes == 30
    assert result.value <= result.inference_value * (1 + 1e-12)


def test_device_radius_is_refused():
    task = replace(_task(), device_radius=1)
    with pytest.raises(ValueError, match="device_radius"):
        infer_cuts(task, policy=object())  # refused before the policy is used


def _random_policy_gap(tasks, seed=0):
    """Mean gap of uniformly random legal choices among the same candidates: chance level."""
    rng = np.random.default_rng(seed)
    gaps = []
    for task, optimum in tasks:
        env = CutEnv(task, slots=SLOTS, ranked=CANDIDATES)
        timestep = env.reset(0)
        while not timestep.last:
            timestep = env.step(int(rng.choice(np.flatnonzero(timestep.legal))))
        if env.outcome is not None and env.outcome.feasible:
            gaps.append(env.outcome.value / optimum - 1)
    return float(np.mean(gaps))


@pytest.mark.skipif(not DEFAULT_POLICY.is_file(), reason="no shipped policy")
def test_the_shipped_policy_beats_chance_on_random_problems():
    """Held-out random problems (not the training or validation seeds): greedy inference alone,
    against the DP optimum and random choices among the same candidates.

    Measured with the shipped policy on these 16 problems: 9 land within 1% (7 exactly on the
    optimum; the nearest outside is at +1.06%, the nearest inside at +0.32%, so the count does
    not move with rounding), 1 runs out of memory, the 15 feasible plans are 3.29% above the
    optimum on average (worst +23%), and random choices are 18.0% above (5.5 times as far). The
    bars below are those figures: the count exactly, the mean gap with 0.2 points of margin,
    the ratio to chance rounded down to 5.
    """
    policy = load_policy()
    json.dumps(policy.meta)  # the header is plain JSON
    rng = np.random.default_rng(20240607)
    tasks = []
    while len(tasks) < 16:
        task = random_task(rng)
        try:
            CutEnv(task, slots=SLOTS, ranked=CANDIDATES).reset(0)
            optimum = solve(task.profile, task.cluster,
                            replace(task.space, max_stages=task.n_stages)).value
        except ValueError:
            continue
        tasks.append((task, optimum))
    score = validate(policy.agent(), tasks)
    assert score.within_1pct >= 9 / 16
    assert score.infeasible <= 1
    assert score.mean_gap <= 0.035
    assert score.mean_gap <= _random_policy_gap(tasks) / 5


@pytest.mark.slow
def test_training_keeps_the_best_validated_network(tmp_path):
    reports = []
    agent, best = train_policy(
        TrainingConfig(episodes=60, validation=3, validate_every=20),
        out=tmp_path / "p.npz", report=lambda episode, score: reports.append((episode, score)))
    assert [episode for episode, _ in reports] == [20, 40, 60, 60]
    assert best in [score for _, score in reports]
    assert all((best.within_1pct, -best.mean_gap) >= (s.within_1pct, -s.mean_gap)
               for _, s in reports)
    policy = load_policy(tmp_path / "p.npz")
    assert policy.meta["extra"]["validation"]["mean_gap"] == best.mean_gap
