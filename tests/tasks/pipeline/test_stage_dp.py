"""The stage DP over arbitrary stage options against enumeration: options of different sizes,
groups that may not start everywhere, cut times that depend on the next stage's option, stage
times that depend on the first device, and memory that depends on the stages behind. The
pipeline task (`test_dp.py`) and the joint task (`tests/tasks/joint`) are two such problems."""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

import numpy as np
import pytest

from hlomap.tasks.pipeline import dp
from hlomap.tasks.pipeline.dp import StageChain, least_bottleneck, least_latency


@dataclass(frozen=True)
class _Toy:
    """A `StageOptions` from random tables; `need` is memory per microbatch held."""

    stage: np.ndarray  # [D, O, K, K], inf where b <= a
    cut: np.ndarray  # [D, O, K, O]
    need: np.ndarray  # [O, K, K]
    placeable: np.ndarray  # [D, O] bool
    sizes: tuple[int, ...]
    use_all_devices: bool
    max_stages: int
    capacity: float

    @property
    def n_states(self) -> int:
        return self.stage.shape[2]

    @property
    def n_devices(self) -> int:
        return self.stage.shape[0]

    def stage_seconds(self, device: int, option: int) -> np.ndarray | None:
        return self.stage[device, option] if self.placeable[device, option] else None

    def fits(self, device: int, option: int, behind: np.ndarray) -> np.ndarray:
        return (np.asarray(behind)[:, None, None] + 1) * self.need[option][None] <= self.capacity

    def cut_seconds(self, device: int, option: int) -> np.ndarray | None:
        return None if device % 3 == 2 else self.cut[device, option]  # no cut after such groups


def _toy(seed: int, use_all_devices: bool) -> _Toy:
    rng = np.random.default_rng(seed)
    devices, states, sizes = 4, 5, (1, 2)
    upper = np.triu(np.ones((states, states), dtype=bool), k=1)
    stage = np.where(upper, rng.uniform(0.1, 1.0, (devices, len(sizes), states, states)), np.inf)
    placeable = rng.uniform(size=(devices, len(sizes))) < 0.85
    placeable[0, 0] = True
    return _Toy(stage=stage, cut=rng.uniform(0.0, 0.4, (devices, len(sizes), states, len(sizes))),
                need=rng.uniform(0.0, 1.0, (len(sizes), states, states)), placeable=placeable,
                sizes=sizes, use_all_devices=use_all_devices, max_stages=3, capacity=1.5)


def _times(toy: _Toy, chain: StageChain) -> tuple[list[float], list[float]] | None:
    """The chain's stage and cut times, or None when it is not a plan of the toy problem."""
    stages, cuts, device = [], [], 0
    count = len(chain.options)
    for s, (a, b, k) in enumerate(zip(chain.states, chain.states[1:], chain.options)):
        end = device + toy.sizes[k]
        if end > toy.n_devices or not toy.placeable[device, k]:
            return None
        if not toy.fits(device, k, np.asarray([count - 1 - s]))[0, a, b]:
            return None
        stages.append(float(toy.stage[device, k, a, b]))
        if s < count - 1:
            if toy.cut_seconds(device, k) is None:
                return None
            cuts.append(float(toy.cut[device, k, b, chain.options[s + 1]]))
        device = end
    if toy.use_all_devices and device != toy.n_devices:
        return None
    return stages, cuts


def _plans(toy: _Toy):
    """Every plan of the toy problem with its stage and cut times."""
    last = toy.n_states - 1
    for count in range(1, toy.max_stages + 1):
        for inner in itertools.combinations(range(1, last), count - 1):
            for options in itertools.product(range(len(toy.sizes)), repeat=count):
                chain = StageChain((0, *inner, last), options)
                times = _times(toy, chain)
                if times is not None:
                    yield chain, times


def _latency(times: tuple[list[float], list[float]], microbatches: int) -> float:
    stages, cuts = times
    return sum(stages) + 2 * sum(cuts) + (microbatches - 1) * max(stages + cuts)


def _priced(plans: dict, microbatches: int):  # type: ignore[no-untyped-def]
    """The latency the DP asks for, refusing a chain that is not one of the problem's plans."""
    def latency(chain: StageChain) -> float:
        assert chain in plans, f"the DP returned {chain}, not a plan of the problem"
        return _latency(plans[chain], microbatches)

    return latency


def _enumerated_best(plans: dict, microbatches: int) -> float:
    return min(_latency(times, microbatches) for times in plans.values())


@pytest.mark.parametrize("use_all_devices", [True, False])
@pytest.mark.parametrize("microbatches", [1, 4])
@pytest.mark.parametrize("seed", range(12))
def test_least_latency_is_the_enumerated_optimum(seed, microbatches, use_all_devices) -> None:
    toy = _toy(seed, use_all_devices)
    plans = dict(_plans(toy))
    latency = _priced(plans, microbatches)
    chain = least_latency(toy, microbatches, latency)
    if not plans:
        assert chain is None
        return
    best = _enumerated_best(plans, microbatches)
    assert latency(chain) == pytest.approx(best, rel=1e-12)
    assert least_latency(toy, microbatches, latency, bound=best * (1 - 1e-9)) is None


@pytest.mark.parametrize("seed", range(12))
def test_least_bottleneck_is_the_enumerated_optimum(seed) -> None:
    toy = _toy(seed, use_all_devices=True)
    plans = dict(_plans(toy))
    found = least_bottleneck(toy)
    if not plans:
        assert found is None
        return
    tau = min(max(stages + cuts) for stages, cuts in plans.values())
    assert found is not None
    assert found[0] == pytest.approx(tau, rel=1e-12)
    within = [times for times in plans.values() if max(times[0] + times[1]) <= tau * (1 + 1e-9)]
    assert _latency(plans[found[1]], 1) == pytest.approx(min(_latency(t, 1) for t in within),
                                                         rel=1e-12)


@pytest.mark.parametrize("seed", range(6))
def test_stage_counts_done_a_few_at_a_time_give_the_same_plan(seed, monkeypatch) -> None:
    """With many cut states a pass takes stage counts in chunks; the answer does not change.
    Stage times add up over layers and many microbatches favour short stages, so the optimum
    is as deep as allowed and needs every stage count."""
    toy = _toy(seed, use_all_devices=False)
    work = np.concatenate([[0.0], np.cumsum(np.random.default_rng(seed).uniform(1, 2, toy.n_states - 1))])
    additive = np.where(np.isfinite(toy.stage), work[None, :] - work[:, None], np.inf)
    toy = dataclasses.replace(toy, stage=additive, cut=toy.cut * 0.01, need=toy.need * 0.1)
    plans = dict(_plans(toy))

    def latency(chain: StageChain) -> float:
        return _latency(plans[chain], 64)

    whole = least_latency(toy, 64, latency), least_bottleneck(toy)
    assert whole[0] is not None and len(whole[0].options) == toy.max_stages
    monkeypatch.setattr(dp, "_CHUNK_CELLS", 1)  # one stage count at a time
    assert (least_latency(toy, 64, latency), least_bottleneck(toy)) == whole


@dataclass(frozen=True)
class _SharedToy(_Toy):
    """A toy whose cut is priced from the sending side (`cut_depends_on_next` False, the joint
    task's kind, solved by `dp._run_shared`) and whose stages hold min(q + 1, `held_cap`)
    microbatches with q stages after them, as under 1F1B with `held_cap` microbatches."""

    held_cap: int = 2
    cut_depends_on_next: bool = False
    bounded_stages: bool = False
    monotone_in_stages: bool = True

    @property
    def saturated_stages(self) -> int:
        return self.held_cap - 1

    def fits(self, device: int, option: int, behind: np.ndarray) -> np.ndarray:
        held = np.minimum(np.asarray(behind) + 1, self.held_cap)
        return held[:, None, None] * self.need[option][None] <= self.capacity


def _shared_toy(seed: int, use_all_devices: bool, held_cap: int) -> _SharedToy:
    """Odd seeds: stage times that add up over layers and shrink with the group, so that with
    many microbatches deep pipelines win; even seeds: any times."""
    rng = np.random.default_rng(100 + seed)
    devices, states, sizes = 6, 6, (1, 2, 3)
    upper = np.triu(np.ones((states, states), dtype=bool), k=1)
    times = rng.uniform(0.1, 1.0, (devices, len(sizes), states, states))
    if seed % 2:
        work = np.concatenate([[0.0], np.cumsum(rng.uniform(1, 2, states - 1))])
        times = (work[None, :] - work[:, None])[None, None] / np.asarray(sizes)[None, :, None, None] * times
    stage = np.where(upper, times, np.inf)
    placeable = rng.uniform(size=(devices, len(sizes))) < 0.8
    placeable[0, 0] = True
    sending = rng.uniform(0.0, 0.4, (devices, len(sizes), states, 1))
    return _SharedToy(stage=stage, cut=np.broadcast_to(sending, (devices, len(sizes), states, len(sizes))).copy(),
                      need=rng.uniform(0.0, 0.8, (len(sizes), states, states)), placeable=placeable, sizes=sizes,
                      use_all_devices=use_all_devices, max_stages=min(devices, states - 1), capacity=1.5,
                      held_cap=held_cap)


@pytest.mark.parametrize("held_cap", [1, 2, 6])
@pytest.mark.parametrize("use_all_devices", [True, False])
@pytest.mark.parametrize("seed", range(8))
def test_the_shared_cut_pass_is_the_enumerated_optimum(seed, use_all_devices, held_cap) -> None:
    """The pass for cuts priced from the sending side keeps one value per (q, a, d), merges the
    stage counts that hold alike (held_cap 1 and 2: every count from 1 or 2 on), and computes
    only the cells a plan from device 0 can reach; it finds the enumerated optimum, the same
    latency the general pass (one value per option) finds on the same problem."""
    toy = _shared_toy(seed, use_all_devices, held_cap)
    plans = dict(_plans(toy))
    for microbatches in (1, 3, 16):
        latency = _priced(plans, microbatches)
        chain = least_latency(toy, microbatches, latency)
        general = least_latency(dataclasses.replace(toy, cut_depends_on_next=True), microbatches, latency)
        if not plans:
            assert chain is None and general is None
            continue
        best = _enumerated_best(plans, microbatches)
        assert latency(chain) == pytest.approx(best, rel=1e-12)
        assert latency(general) == pytest.approx(best, rel=1e-12)
        assert least_latency(toy, microbatches, latency, bound=best * (1 - 1e-9)) is None
    found = least_bottleneck(toy)
    if plans:
        tau = min(max(stages + cuts) for stages, cuts in plans.values())
        assert found is not None and found[0] == pytest.approx(tau, rel=1e-12)


@pytest.mark.parametrize("seed", range(6))
def test_thresholds_equal_but_for_rounding_share_a_pass(seed) -> None:
    """Stage times that differ only by rounding (one stage priced in two tables) are one candidate
    threshold: the pass runs at the largest, the branch and bound's lower bound takes the least,
    so the latency found is the enumerated optimum to within that rounding (TIE_RTOL)."""
    toy = _shared_toy(seed, False, 6)
    rng = np.random.default_rng(seed)
    coarse = np.round(toy.stage, 1) + 0.1  # few distinct times, each repeated across tables
    noise = 1.0 + rng.integers(0, 5, coarse.shape) * 1e-13  # then 1e-13 apart, far inside TIE_RTOL
    toy = dataclasses.replace(toy, stage=np.where(np.isfinite(coarse), coarse * noise, np.inf))
    plans = dict(_plans(toy))
    for microbatches in (3, 16):
        latency = _priced(plans, microbatches)
        chain = least_latency(toy, microbatches, latency)
        if not plans:
            assert chain is None
            continue
        best = _enumerated_best(plans, microbatches)
        assert latency(chain) == pytest.approx(best, rel=1e-9)


def test_the_shared_cut_pass_merges_stage_counts() -> None:
    toy = _shared_toy(0, False, held_cap=2)
    assert dp.stage_counts(toy) == (2, True)
    assert dp.stage_counts(dataclasses.replace(toy, bounded_stages=True)) == (toy.max_stages, False)
    assert dp.stage_counts(dataclasses.replace(toy, held_cap=1)) == (2, True)  # the last stage stays apart


@pytest.mark.parametrize("held_cap", [2, 6])
@pytest.mark.parametrize("use_all_devices", [True, False])
@pytest.mark.parametrize("seed", range(10))
def test_the_shared_cut_pass_on_short_stages_is_the_same(seed, use_all_devices, held_cap) -> None:
    """Where no stage of a table takes more than a few layers, the shared pass works on the band
    b - a <= width only, and still finds the enumerated optima."""
    toy = _shared_toy(seed, use_all_devices, held_cap)
    upper = np.triu(np.ones_like(toy.need, dtype=bool), k=1)
    short = np.where(upper & ~np.triu(upper, k=3), 1.0, np.inf)[None]  # stages of one or two layers only
    toy = dataclasses.replace(toy, stage=toy.stage * short)
    plans = {chain: times for chain, times in _plans(toy) if np.isfinite(times[0]).all()}
    for microbatches in (1, 3, 16):
        latency = _priced(plans, microbatches)
        chain = least_latency(toy, microbatches, latency)
        if not plans:
            assert chain is None
            continue
        assert latency(chain) == pytest.approx(_enumerated_best(plans, microbatches), rel=1e-12)


@dataclass(frozen=True)
class _UniformToy(_SharedToy):
    """A shared toy whose groups may start anywhere and cut after every state, with the same
    tables on every device: nothing the device budgets leave out."""

    def cut_seconds(self, device: int, option: int) -> np.ndarray | None:
        return self.cut[device, option]


@pytest.mark.parametrize("capacity", [0.3, 0.8, 1.5])
@pytest.mark.parametrize("use_all_devices", [True, False])
@pytest.mark.parametrize("seed", range(10))
def test_device_budgets_bound_every_plan(seed, use_all_devices, capacity) -> None:
    """The fewest devices of a plan's suffix and prefix, from the tables alone, are at most what
    every enumerated plan's take (so the pass may skip cells beyond them, and no plan exists where
    the suffix from state 0 needs more than the devices); with the same tables on every device
    and every group free to start anywhere, the least of them is the enumerated least."""
    toy = dataclasses.replace(_shared_toy(seed, use_all_devices, held_cap=6), capacity=capacity)
    plans = dict(_plans(toy))
    tables = dp.shared_tables(toy)
    suffix, prefix = dp.device_budgets(tables)
    for chain in plans:
        sizes = [toy.sizes[k] for k in chain.options]
        for s, start in enumerate(chain.states[:-1]):
            after = len(sizes) - 1 - s
            assert suffix[min(after, tables.counts - 1), start] <= sum(sizes[s:])
            assert prefix[start] <= sum(sizes[:s])
    if not np.isfinite(suffix[:, 0]).any():
        assert not plans
    # from the tables alone, every cut free: looser still, never tighter
    loose = dp.device_budgets(dp.shared_tables(toy, groups=False))[0]
    assert np.all(loose <= suffix)
    assert dp.fits_devices(toy, tables) == (suffix[:, 0] <= toy.n_devices).any()
    uniform = _UniformToy(**{f.name: getattr(toy, f.name) for f in dataclasses.fields(toy)})
    uniform = dataclasses.replace(uniform, stage=np.broadcast_to(toy.stage[:1], toy.stage.shape).copy(),
                                  placeable=np.ones_like(toy.placeable), use_all_devices=False)
    least = dp.device_budgets(dp.shared_tables(uniform))[0][:, 0].min()
    enumerated = [sum(uniform.sizes[k] for k in chain.options) for chain in dict(_plans(uniform))]
    if least <= uniform.n_devices:
        assert least == min(enumerated)
    else:
        assert not enumerated
