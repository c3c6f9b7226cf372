"""Training loop: determinism, checkpoint/resume bit-identity, Ctrl-C, progress bar."""

from __future__ import annotations

import dataclasses
import os
import signal
from pathlib import Path

import jax
import numpy as np
import pytest

from hlomap.agents import checkpoint
from hlomap.agents.dqn import DqnAgent, DqnConfig, DqnFunctions, make_dqn
from hlomap.agents.loop import EpisodeRecord, LoopConfig, LoopProgress, LoopResult, run_loop
from hlomap.agents.ppo import PpoAgent, PpoConfig, PpoFunctions, make_ppo
from hlomap.report.progress import training_bar
from tests.agents.toy_envs import ContextualBandit, MaskedMDP, PlacementMDP

# Small enough to be quick, with updates every step, n-step pending across the cut, and a
# target update inside the resumed part.
DQN = DqnConfig(hidden=(16,), learning_rate=1e-3, min_replay_size=32, target_update_period=20,
                n_step=3, discount=1.0, epsilon_decay_steps=200, replay_capacity=150)
PPO = PpoConfig(hidden=(16,), rollout_length=24, num_minibatches=4, learning_rate=1e-3)


@pytest.fixture(scope="module")
def dqn_fns() -> DqnFunctions:
    env = MaskedMDP()
    return make_dqn(DQN, env.observation_size, env.num_actions)


@pytest.fixture(scope="module")
def ppo_fns() -> PpoFunctions:
    env = PlacementMDP()
    return make_ppo(PPO, env.observation_size, env.num_actions)


def _leaves(tree: object) -> list[np.ndarray]:
    return [np.asarray(jax.random.key_data(x) if jax.dtypes.issubdtype(
        x.dtype, jax.dtypes.prng_key) else x) for x in jax.tree.leaves(tree)]


def assert_same_run(a: tuple[object, LoopResult], b: tuple[object, LoopResult]) -> None:
    (agent_a, res_a), (agent_b, res_b) = a, b
    np.testing.assert_array_equal(res_a.episode_returns, res_b.episode_returns)
    np.testing.assert_array_equal(res_a.episode_lengths, res_b.episode_lengths)
    assert (res_a.num_steps, res_a.best_return, res_a.best_episode, res_a.last_loss) == (
        res_b.num_steps, res_b.best_return, res_b.best_episode, res_b.last_loss)
    for x, y in zip(_leaves(agent_a.state), _leaves(agent_b.state)):  # type: ignore[attr-defined]
        np.testing.assert_array_equal(x, y)


def _dqn(fns: DqnFunctions, seed: int = 0) -> DqnAgent:
    env = MaskedMDP()
    return DqnAgent(DQN, env.observation_size, env.num_actions, seed=seed, functions=fns)


def _ppo(fns: PpoFunctions, seed: int = 0) -> PpoAgent:
    env = PlacementMDP()
    return PpoAgent(PPO, env.observation_size, env.num_actions, seed=seed, functions=fns)


def test_same_seed_same_run_other_seed_other_run(dqn_fns: DqnFunctions) -> None:
    runs = []
    for seed in (0, 0, 1):
        agent = _dqn(dqn_fns, seed)
        runs.append((agent, run_loop(MaskedMDP(), agent,
                                     LoopConfig(num_steps=150, seed=seed))))
    assert_same_run(runs[0], runs[1])
    assert not np.array_equal(_leaves(runs[0][0].state)[0], _leaves(runs[2][0].state)[0])


@pytest.mark.parametrize("cut", [37, 101])  # mid-episode (37 = 9 * 4 + 1) and later
def test_dqn_resume_mid_episode_is_bit_identical(dqn_fns: DqnFunctions, tmp_path: Path,
                                                 cut: int) -> None:
    total = 160
    whole = _dqn(dqn_fns)
    expected = (whole, run_loop(MaskedMDP(), whole,
                                LoopConfig(num_steps=total, seed=3)))
    path = str(tmp_path / "ckpt.npz")
    first = _dqn(dqn_fns)
    run_loop(MaskedMDP(), first, LoopConfig(num_steps=cut, seed=3, checkpoint_path=path))
    # A fresh process would build a fresh agent; the checkpoint carries everything else.
    resumed, extra = DqnAgent.from_checkpoint(path, functions=dqn_fns)
    assert extra is not None and extra["loop"]["step"] == cut
    assert extra["loop"]["in_episode"] == (cut % 4 != 0)
    again = _dqn(dqn_fns, seed=99)  # the seed is overwritten by the checkpoint's state
    result = run_loop(MaskedMDP(), again, LoopConfig(num_steps=total, seed=3, checkpoint_path=path))
    assert_same_run(expected, (again, result))
    assert resumed.num_steps == cut


def test_ppo_resume_mid_rollout_is_bit_identical(ppo_fns: PpoFunctions, tmp_path: Path) -> None:
    total, cut = 24 * 4, 24 + 13
    whole = _ppo(ppo_fns)
    expected = (whole, run_loop(PlacementMDP(), whole,
                                LoopConfig(num_steps=total, seed=5)))
    path = str(tmp_path / "ppo.npz")
    run_loop(PlacementMDP(), _ppo(ppo_fns),
             LoopConfig(num_steps=cut, seed=5, checkpoint_path=path))
    resumed = _ppo(ppo_fns, seed=7)
    result = run_loop(PlacementMDP(), resumed, LoopConfig(num_steps=total, seed=5, checkpoint_path=path))
    assert_same_run(expected, (resumed, result))


def test_ctrl_c_checkpoints_at_a_step_boundary_and_resumes(dqn_fns: DqnFunctions,
                                                           tmp_path: Path) -> None:
    total = 120
    whole = _dqn(dqn_fns)
    expected = (whole, run_loop(MaskedMDP(), whole,
                                LoopConfig(num_steps=total, seed=1)))
    path = str(tmp_path / "int.npz")

    def interrupt(record: EpisodeRecord) -> None:
        if record.index == 10:
            os.kill(os.getpid(), signal.SIGINT)

    # As in an interactive shell, whatever SIGINT disposition this test process inherited (a
    # background job ignores it).
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            run_loop(MaskedMDP(), _dqn(dqn_fns), LoopConfig(num_steps=total, seed=1, checkpoint_path=path),
                     on_episode=interrupt)
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # handler restored
    finally:
        signal.signal(signal.SIGINT, inherited)
    _, meta = checkpoint.load(path)
    assert meta["extra"]["loop"]["episode"] == 11 and meta["num_steps"] == 44
    resumed = _dqn(dqn_fns)
    result = run_loop(MaskedMDP(), resumed, LoopConfig(num_steps=total, seed=1, checkpoint_path=path))
    assert_same_run(expected, (resumed, result))


def test_periodic_checkpoints_early_stop_and_progress_bar(
        dqn_fns: DqnFunctions, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "p.npz"
    seen: list[EpisodeRecord] = []

    def stop_after_five(record: EpisodeRecord) -> bool:
        seen.append(record)
        return record.index == 4

    reports: list[LoopProgress] = []

    def keep(progress: LoopProgress) -> None:
        reports.append(progress)
        draw(progress)

    with training_bar() as draw:
        result = run_loop(MaskedMDP(), _dqn(dqn_fns),
                          LoopConfig(num_steps=1000, checkpoint_path=str(path), checkpoint_every_steps=7,
                                     progress_seconds=0.0),
                          on_episode=stop_after_five, on_progress=keep)
    assert result.stopped_early and result.num_episodes == 5 and result.num_steps == 20
    assert [r.end_step for r in seen] == [4, 8, 12, 16, 20]
    assert result.best_return == max(r.episode_return for r in seen)
    assert sorted(os.listdir(tmp_path)) == ["p.npz"]  # no temporary files left behind
    assert checkpoint.load(path)[1]["num_steps"] == 20
    out = capsys.readouterr()
    assert "train" in out.out + out.err and "epsilon" in out.out + out.err
    # every step reported (no interval), then once more at the end
    assert [p.step for p in reports] == list(range(1, 21)) + [20]
    assert reports[-1].total == 1000 and reports[-1].episodes == 5
    assert reports[-1].best_return == result.best_return and reports[-1].loss == result.last_loss
    assert reports[-1].mean_return == pytest.approx(result.mean_return())
    assert reports[-1].epsilon is not None and 0.0 < reports[-1].epsilon < 1.0
    # The bar only reports: the same run without it is the same run.
    quiet = run_loop(MaskedMDP(), _dqn(dqn_fns), LoopConfig(num_steps=1000),
                     on_episode=lambda r: r.index == 4)
    np.testing.assert_array_equal(quiet.episode_returns, result.episode_returns)


def test_failed_write_keeps_previous_checkpoint(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "c.npz"
    checkpoint.save(path, {"x": np.arange(3)}, {"n": 1})

    def broken(*args: object, **kwargs: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(np, "savez", broken)
    with pytest.raises(OSError, match="disk full"):
        checkpoint.save(path, {"x": np.arange(4)}, {"n": 2})
    arrays, meta = checkpoint.load(path)
    assert meta["n"] == 1 and arrays["x"].tolist() == [0, 1, 2]
    assert sorted(os.listdir(tmp_path)) == ["c.npz"]


def test_restore_refuses_another_config(dqn_fns: DqnFunctions, tmp_path: Path) -> None:
    path = tmp_path / "a.npz"
    _dqn(dqn_fns).save(path)
    env = MaskedMDP()
    other = DqnAgent(dataclasses.replace(DQN, n_step=2), env.observation_size, env.num_actions)
    with pytest.raises(ValueError, match="checkpoint is for"):
        other.restore(path)
    with pytest.raises(ValueError, match="no training-loop state"):
        run_loop(env, _dqn(dqn_fns), LoopConfig(num_steps=5, checkpoint_path=str(path)))


def test_config_json_round_trip() -> None:
    for config in (DQN, DqnConfig(huber_delta=None), PPO, PpoConfig()):
        data = checkpoint.config_to_json(config)
        assert checkpoint.config_from_json(type(config), data) == config


def test_params_snapshot_survives_updates(tmp_path: Path) -> None:
    env = ContextualBandit()
    config = dataclasses.replace(DQN, n_step=1, min_replay_size=8)
    agent = DqnAgent(config, env.observation_size, env.num_actions)
    run_loop(env, agent, LoopConfig(num_steps=20))
    snapshot = agent.get_params()
    copy = jax.tree.map(np.copy, snapshot)
    run_loop(env, agent, LoopConfig(num_steps=40))  # donating updates
    for x, y in zip(jax.tree.leaves(snapshot), jax.tree.leaves(copy)):
        np.testing.assert_array_equal(x, y)
    agent.set_params(snapshot)
    for x, y in zip(jax.tree.leaves(agent.get_params()), jax.tree.leaves(copy)):
        np.testing.assert_array_equal(x, y)


def test_unflatten_names_the_mismatched_array() -> None:
    template = {"layer": {"kernel": np.zeros((2, 3), np.float32)}, "key": jax.random.key(0)}
    arrays = checkpoint.flatten("p", template)
    assert set(arrays) == {"p['layer']['kernel']", "p['key']"}
    restored = checkpoint.unflatten("p", template, arrays)
    assert jax.random.key_impl(restored["key"]) == jax.random.key_impl(template["key"])
    np.testing.assert_array_equal(jax.random.key_data(restored["key"]),
                                  jax.random.key_data(template["key"]))
    arrays["p['layer']['kernel']"] = np.zeros((3, 3), np.float32)
    with pytest.raises(ValueError, match=r"p\['layer'\]\['kernel'\].*float32\[3, 3\].*\[2, 3\]"):
        checkpoint.unflatten("p", template, arrays)
    del arrays["p['key']"]
    with pytest.raises(KeyError, match="no array"):
        checkpoint.unflatten("p", template, arrays)


def test_an_ignored_sigint_stays_ignored(dqn_fns: DqnFunctions) -> None:
    """A loop started as a background job (SIGINT ignored) must not make itself interruptible."""
    inherited = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        result = run_loop(MaskedMDP(), _dqn(dqn_fns), LoopConfig(num_steps=8, seed=1),
                          on_episode=lambda record: os.kill(os.getpid(), signal.SIGINT))
        assert result.num_steps == 8 and signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, inherited)
