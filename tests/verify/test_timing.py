"""Interleaved timing: the loop's bookkeeping under a fake clock (nothing asserts on wall time)."""

from __future__ import annotations

import itertools

import pytest

from hlomap.verify.timing import TimedRun, pooled, rotated, stateful_step, time_interleaved


class FakeClock:
    """A clock that each runnable advances by its own fixed cost."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def runnable(self, seconds: float, calls: list[str], name: str):
        def run() -> str:
            self.now += seconds
            calls.append(name)
            return name
        return run


def test_medians_are_each_runnables_own_cost_and_rounds_rotate():
    clock, calls = FakeClock(), []
    runs = {"a": clock.runnable(0.010, calls, "a"), "b": clock.runnable(0.030, calls, "b")}
    timed = time_interleaved(runs, rounds=4, repeats=2, warmup=1, clock=clock, wait=lambda x: x)
    assert timed["a"].median == pytest.approx(0.010)
    assert timed["b"].median == pytest.approx(0.030)
    assert len(timed["a"].rounds) == 4
    timed_calls = calls[2:]  # after one warm-up call each
    firsts = [timed_calls[i * 4] for i in range(4)]
    assert firsts == ["a", "b", "a", "b"]


def test_budget_stops_after_min_rounds():
    clock, calls = FakeClock(), []
    runs = {"slow": clock.runnable(1.0, calls, "slow")}
    timed = time_interleaved(runs, rounds=50, repeats=1, warmup=0, budget_seconds=2.5, min_rounds=2, clock=clock,
                             wait=lambda x: x)
    assert len(timed["slow"].rounds) == 3  # the round crossing 2.5 s is the last
    timed = time_interleaved(runs, rounds=50, repeats=1, warmup=0, budget_seconds=0.1, min_rounds=4, clock=clock,
                             wait=lambda x: x)
    assert len(timed["slow"].rounds) == 4


def test_iqr_and_spread():
    run = TimedRun("x", (1.0, 2.0, 3.0, 4.0, 5.0))
    assert run.median == 3.0
    assert run.iqr == pytest.approx(2.0)
    assert run.relative_spread == pytest.approx(2.0 / 3.0)
    assert TimedRun("y", (1.0,)).iqr == 0.0


def test_rotated_and_bad_arguments():
    assert rotated(["a", "b", "c"], 4) == ["b", "c", "a"]
    assert rotated([], 3) == []
    with pytest.raises(ValueError, match="rounds"):
        time_interleaved({}, rounds=0)


def test_stateful_step_feeds_outputs_back():
    counter = itertools.count()

    def step(params, opt_state, batch):
        return params + batch, opt_state + 1, next(counter)

    run = stateful_step(step, 0, 0, 5)
    run()
    out = run()
    assert out[:2] == (10, 2)


def test_rows_of_one_plan_pool_their_rounds():
    """A pick timed in its own row and its twin are one plan: both get the pooled figure; other
    runs keep theirs, and a twin of a twin joins the first run of its plan."""
    runs = {"one device": TimedRun("one device", (15.0, 15.1, 15.2)),
            "auto pick": TimedRun("auto pick", (16.7, 16.8, 16.9)),
            "measured pick": TimedRun("measured pick", (15.5,)),
            "data=8": TimedRun("data=8", (30.0, 31.0))}
    out = pooled(runs, {"auto pick": "one device", "measured pick": "auto pick"})
    assert out["one device"].rounds == out["auto pick"].rounds == out["measured pick"].rounds \
        == (15.0, 15.1, 15.2, 16.7, 16.8, 16.9, 15.5)
    assert out["auto pick"].name == "auto pick" and out["auto pick"].median == 15.5
    assert out["data=8"] == runs["data=8"]
    assert pooled(runs, {}) == runs
