"""Fixed-size pipeline problems for the inference network (Auto-MAP section 3.5).

- `coarsen(profile, slots)`: any model to at most `slots` (128) pivots, keeping in each bin of
  equal compute the pivot with the fewest crossing bytes (the same thinning as candidate pivots),
  so that a plan on the coarse profile is a plan on the original with the same cost. The
  `CutEnv` observation then carries the section 3.5 arrays: prefix sums of C and W and the
  crossing bytes A, each scaled to [0, 1], and the topology matrix between stage groups.
- `random_task(rng)`: a random pipeline problem of 128 pivots for training: per-layer compute,
  parameters, stash and crossing bytes drawn from uniform, normal or binomial distributions,
  optionally with a repeating block pattern (transformer layers) and a heavy first or last layer
  (embeddings, an LM head); 2 to 8 stages on as many servers of 1 to 8 devices with random
  bandwidths (one NIC per server); random microbatches, schedule, objective and memory.
  Communication is scaled so that transfer and all-reduce times, priced like every pipeline's
  (`hlomap.cost.pipeline.links`), range from negligible to dominant against compute.
- `RandomCutEnv`: an environment whose every episode is a fresh random task (drawn from the
  reset seed), so one training run sees hundreds of thousands of environments.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from hlomap.agents.environment import TimeStep
from hlomap.cost.pipeline.costs import CostOptions
from hlomap.cost.cluster import Cluster
from hlomap.cost.devices import device_preset
from hlomap.cost.pipeline.links import AffineMax, allreduce_cost, transfer_cost, with_device_memory
from hlomap.cost.topology import block_tables
from hlomap.tasks.pipeline.cutenv import MAX_STAGES, CutEnv, CutTask
from hlomap.cost.pipeline.chain import thin_pivots
from hlomap.cost.pipeline.profile import PipelineProfile, merge_layers
from hlomap.tasks.pipeline.space import PipelineObjective, PipelineSpace
from hlomap.cost.pipeline.stages import Schedule

__all__ = [
    "CANDIDATES",
    "SLOTS",
    "GeneratorSpec",
    "RandomCutEnv",
    "coarsen",
    "random_cluster",
    "random_profile",
    "random_task",
]

#: Pivot slots of the inference network: every model is normalized to this many points.
SLOTS = 128
#: The inference network chooses among this many legal pivots, those with the best estimates
#: (`CutEnv(ranked=...)`): its outputs then mean the same thing for every model.
CANDIDATES = 8


def coarsen(
    profile: PipelineProfile, slots: int = SLOTS
) -> tuple[PipelineProfile, tuple[int, ...]]:
    """At most `slots` pivots of `profile` (module docstring): the merged profile and, for each of
    its pivots, the pivot index in `profile`."""
    if profile.n_pivots <= slots:
        return profile, tuple(range(profile.n_pivots))
    kept = thin_pivots(profile, range(profile.n_pivots), slots)
    return merge_layers(profile, kept), tuple(kept)


@dataclass(frozen=True)
class GeneratorSpec:
    """Ranges of the random problems (see the module docstring)."""

    slots: int = SLOTS
    min_stages: int = 2
    max_stages: int = MAX_STAGES
    devices_per_node: tuple[int, ...] = (1, 2, 4, 8)
    microbatches: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    #: log10 range of (transfer or all-reduce time) / (balanced stage time)
    comm_ratio: tuple[float, float] = (-3.0, 0.5)
    few_pivots: float = 0.15  # chance of a problem with fewer pivots than slots
    bottleneck: float = 0.2  # chance of PipeDream's objective
    memory_limit: float = 0.3  # chance of a finite device memory
    require_trainable: float = 0.5

    def __post_init__(self) -> None:
        if not 2 <= self.min_stages <= self.max_stages <= MAX_STAGES:
            raise ValueError(f"GeneratorSpec stages [{self.min_stages}, {self.max_stages}] must "
                             f"lie in [2, {MAX_STAGES}]")


def _draw(rng: np.random.Generator, n: int) -> np.ndarray:
    """n non-negative values from a uniform, normal or binomial distribution (mean about 1)."""
    kind = rng.integers(3)
    if kind == 0:
        low = rng.uniform(0.0, 0.9)
        return rng.uniform(low, 1.0, n) / ((1.0 + low) / 2)
    if kind == 1:
        return np.abs(rng.normal(1.0, rng.uniform(0.05, 1.0), n))
    trials = int(rng.integers(1, 20))
    p = rng.uniform(0.1, 0.9)
    return (rng.binomial(trials, p, n) + 0.1) / (trials * p + 0.1)


def _pattern(rng: np.random.Generator, n: int, values: np.ndarray) -> np.ndarray:
    """Half of the time, repeat a random block of values (layers of a transformer or a CNN)."""
    if rng.random() < 0.5:
        period = int(rng.integers(2, 33))
        block = values[:period].copy()
        return np.resize(block, n) * rng.uniform(0.9, 1.1, n)
    return values


def random_profile(rng: np.random.Generator, n_layers: int) -> PipelineProfile:
    """A random chain of `n_layers` layers; compute sums to 1 second, the other arrays have
    arbitrary scales (`random_task` scales them against the cluster)."""
    compute = _pattern(rng, n_layers, _draw(rng, n_layers))
    if rng.random() < 0.3:  # a heavy head or tail: an LM head, an embedding, a classifier
        heavy = rng.uniform(0.05, 0.5) * compute.sum() / (1 - 0.5)
        compute[-1 if rng.random() < 0.7 else 0] += heavy
    compute = np.maximum(compute, 0.0) + 1e-6
    compute /= compute.sum()
    backward_share = rng.uniform(0.5, 0.75, n_layers)
    params = _pattern(rng, n_layers, _draw(rng, n_layers))
    params[rng.random(n_layers) < rng.uniform(0.0, 0.5)] = 0.0
    if rng.random() < 0.3:
        params[0] += rng.uniform(0.1, 1.0) * max(params.sum(), 1.0)
    if params.sum() <= 0:
        params[rng.integers(n_layers)] = 1.0
    crossing = _pattern(rng, n_layers - 1, _draw(rng, n_layers - 1) + 0.05)
    stash = _pattern(rng, n_layers, _draw(rng, n_layers))
    return PipelineProfile(
        names=tuple(f"layer{i}" for i in range(n_layers)),
        forward_time=compute * (1 - backward_share),
        backward_time=compute * backward_share,
        activation_bytes=crossing,
        parameter_bytes=params,
        stash_bytes=stash,
        source="random",
    )


def random_cluster(rng: np.random.Generator, nodes: int, per_node: int) -> Cluster:
    """`nodes` servers of `per_node` devices, one NIC each: fast links inside a server, slower
    and uneven ones between servers (bytes/s), small latencies, unlimited memory."""
    node_of = np.repeat(np.arange(nodes), per_node)
    inside = 10 ** rng.uniform(10.5, 11.5)
    outside = 10 ** rng.uniform(8.5, 10.5)
    pair = np.triu(rng.uniform(0.3, 1.0, (nodes, nodes)), 1)
    pair = pair + pair.T + np.eye(nodes)
    tables = block_tables(node_of, inside, outside * pair, 5e-6, rng.uniform(5e-6, 5e-5))
    # The device only lends its memory, made unlimited; profiles give the compute times.
    cluster = Cluster(f"random-{nodes}x{per_node}", (device_preset("V100-16GB"),) * len(node_of),
                      tuple(tables.node_of.tolist()), tables.bandwidth, tables.latency)
    return with_device_memory(cluster, math.inf)


def _bytes_for(cost: AffineMax, target: float) -> float:
    """Bytes that take `target` seconds under `cost` (its smallest such x; 0 when even an empty
    message takes longer, the latency)."""
    if cost.alpha.size == 0:
        return 0.0
    return max(float(np.min((target - cost.alpha) / cost.beta)), 0.0)


def random_task(rng: np.random.Generator, spec: GeneratorSpec = GeneratorSpec()) -> CutTask:
    """A random `CutTask` (module docstring)."""
    stages = int(rng.integers(spec.min_stages, spec.max_stages + 1))
    pivots = spec.slots
    if rng.random() < spec.few_pivots:
        pivots = int(rng.integers(max(stages, 8), spec.slots + 1))
    per_node = int(rng.choice(spec.devices_per_node))
    cluster = random_cluster(rng, stages, per_node)
    profile = random_profile(rng, pivots + 1)
    m = int(rng.choice(spec.microbatches))
    d = cluster.n_devices
    unit = 1.0 / d  # balanced stage time: compute sums to 1
    group0, group1 = range(0, per_node), range(per_node, 2 * per_node)
    # Transfers: the median crossing tensor between two servers takes ratio * unit.
    ratio = 10 ** rng.uniform(*spec.comm_ratio)
    median = float(np.median(profile.activation_bytes))
    a_scale = _bytes_for(transfer_cost(cluster, group0, group1), ratio * unit) / median
    # All-reduce: an even share of W over one server, amortized per microbatch.
    ratio = 10 ** rng.uniform(*spec.comm_ratio)
    share = float(profile.parameter_bytes.sum()) / stages
    if per_node > 1:
        w_scale = _bytes_for(allreduce_cost(cluster, group0), ratio * unit * m) / share
    else:
        w_scale = 1e9 / share  # no all-reduce on one device: W only weighs on memory
    profile = replace(
        profile,
        activation_bytes=profile.activation_bytes * a_scale,
        parameter_bytes=profile.parameter_bytes * w_scale,
    )
    schedule = Schedule.GPIPE if rng.random() < 0.5 else Schedule.ONE_F_ONE_B
    # A memory limit needs something to weigh: no limit when the parameters vanished (their
    # all-reduce was scaled below the latency).
    check_memory = rng.random() < spec.memory_limit and profile.parameter_bytes.sum() > 0
    if check_memory:
        stash = profile.stash_bytes if profile.stash_bytes is not None else np.zeros(1)
        stash = stash * 10 ** rng.uniform(-1, 1) * profile.parameter_bytes.sum() / max(
            float(stash.sum()) * m, 1e-30)
        profile = replace(profile, stash_bytes=stash)
        balanced = (4.0 * float(profile.parameter_bytes.sum()) / stages
                    + m * float(stash.sum()) / stages / per_node)
        memory = balanced * rng.uniform(1.0, 3.0)
        cluster = with_device_memory(cluster, memory)
    space = PipelineSpace(
        microbatches=m,
        schedule=schedule,
        objective=PipelineObjective.BOTTLENECK if rng.random() < spec.bottleneck else PipelineObjective.LATENCY,
        replication=(per_node,),
        cut_on_node_boundary=True,
        require_trainable=bool(rng.random() < spec.require_trainable),
        check_memory=check_memory,
        cost=CostOptions(),
    )
    return CutTask(profile=profile, cluster=cluster, space=space, n_stages=stages)


class RandomCutEnv:
    """Every episode a new `random_task`, drawn from the reset seed (deterministic per seed)."""

    def __init__(self, spec: GeneratorSpec = GeneratorSpec()) -> None:
        self.spec = spec
        probe = CutEnv(random_task(np.random.default_rng(0), spec), slots=spec.slots,
                       ranked=CANDIDATES)
        self.observation_size = probe.observation_size
        self.num_actions = probe.num_actions
        self.env = probe

    def reset(self, seed: int) -> TimeStep:
        rng = np.random.default_rng(seed)
        while True:
            task = random_task(rng, self.spec)
            self.env = CutEnv(task, slots=self.spec.slots, ranked=CANDIDATES)
            try:
                return self.env.reset(seed)
            except ValueError:  # NoFeasiblePlan: rules left no first cut; draw again
                continue

    def step(self, action: int) -> TimeStep:
        return self.env.step(action)
