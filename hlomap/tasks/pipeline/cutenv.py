"""The pipeline-cut environment of Auto-MAP's DQN (arXiv 2007.04069, sections 3.4 and 3.5).

An episode builds one pipeline plan of S stages by choosing its S - 1 cuts left to right:

- Pruning. Device cuts start from a center solution whose cuts sit on network (server)
  boundaries: with S stages on N servers and S <= N, stage s gets the servers nearest to an even
  split; with more stages than servers, the devices are split evenly. A device cut may move up to
  `device_radius` devices from its center (0, the default, fixes every stage's devices, e.g.
  one 8-GPU server per stage, data parallel inside it). Pivots before the previous cut are masked
  (cuts are monotone), and so are pivots that leave too few for the remaining cuts, or (with
  `require_trainable`) leave a stage without trainable parameters.
- Action. The next pivot, combined with the device cut's offset when the radius is > 0:
  action = offset_index * slots + slot.
- State. Features precomputed at every candidate pivot for the stage the action would close:
  its compute, its gradient all-reduce time, the activation transfer at the pivot, the largest
  transfer so far, the min/max compute balance ratio against an even split of what remains, its
  memory against the device's, and the estimate of L if the remaining layers were split evenly;
  plus the normalized prefix sums of C and W and the crossing bytes A (section 3.5), a mask of
  the current cuts, the step, and the topology matrix between the stage device groups. Times are
  divided by T = total compute / devices (a perfectly balanced stage's time), so one network can
  read models of any size. Every all-reduce and transfer time, in the features, the estimates
  and the final value, is the one model of `hlomap.cost.pipeline.links` on the task's cluster
  (`hlomap.cost.collectives`' all-reduce; chunked transfers as collective-permutes whose
  cross-server streams share NICs), as in the DP and the simulator.
- Reward. ref / value at the end of the episode (value: L, or the bottleneck for PipeDream's
  objective; ref: the L or bottleneck of a perfect split without communication, so a reward
  is at most about 1), and -`oom_penalty` for a plan out of memory. With `shaping` the reward is
  potential-shaped (Ng et al. 1999): each step adds phi(next) - phi(state), phi(state) being the
  best ref / estimate among the state's legal actions (0 once the episode ends). An episode's
  return is then its final reward - phi(start), a constant per task, so the optimal policy is
  unchanged (discount 1); and a Q-value is the final reward minus what the estimates promised,
  near 0 for good cuts in every model, so one network need not learn each model's scale.

`slots` fixes the number of pivot actions (128 for the inference network of section 3.5): a
profile with fewer pivots is spread over the slots by repeating pivots (a repeat of the
previous cut is masked).

`ranked = K` prunes further: the actions are the K legal pivots with the best estimates, best
first (one per distinct cut). The observation then holds those K candidates' features in rank
order, the section 3.5 arrays (C and W prefix sums, A) at every slot and the current cuts. An MLP
Q-network's output k then means "the k-th best-looking cut" in every state and every model,
instead of one fixed pivot; that is what lets one network trained on random arrays read any
model, and it speeds up online training too. The last cut's estimate is exact (nothing remains
to split), so there the best candidate is first; earlier cuts rely on the even-split estimate
to put the optimum among the K.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple, Sequence

import numpy as np

from hlomap.agents.environment import TimeStep, restart, termination, transition
from hlomap.search.score import Score
from hlomap.search.task import EpisodeOutcome
from hlomap.cost.pipeline.costs import PlanCost, evaluate_plan, sync_seconds
from hlomap.cost.cluster import Cluster
from hlomap.cost.pipeline.links import AffineMax, GroupPrices, group_memory, is_node_boundary
from hlomap.cost.pipeline.profile import SYNC_FIELDS, PipelineProfile, replicated_seconds
from hlomap.tasks.pipeline.solution import NoFeasiblePlan
from hlomap.tasks.pipeline.space import PipelineObjective, PipelineSpace
from hlomap.cost.pipeline.stages import PipelinePlan, Stage, in_flight

__all__ = [
    "FEATURES",
    "MAX_STAGES",
    "CutEnv",
    "CutTask",
    "CutPlan",
    "center_device_bounds",
]

#: Stage counts the fixed-size observation (step one-hot, topology matrix) is laid out for.
MAX_STAGES = 8
#: Ratios of times to T are clipped here: beyond it a choice is hopeless anyway.
_CLIP = 10.0
#: Per-action features, in observation order.
FEATURES = (
    "compute_prefix",  # C prefix sum at the pivot / total C          (section 3.5 arrays)
    "parameter_prefix",  # W prefix sum at the pivot / total W
    "crossing",  # A at the pivot / the largest A
    "stage_compute",  # the closed stage's compute per device / T
    "stage_allreduce",  # its gradient all-reduce, amortized over the microbatches / T
    "transfer",  # activation transfer at the pivot / T
    "max_transfer",  # the largest transfer of the plan so far / T
    "remaining",  # an even split of the remaining compute, per stage / T
    "balance",  # min / max stage compute, remaining split evenly
    "memory",  # the closed stage's memory / its device memory
    "estimate",  # ref / estimated value if the rest is split evenly
    "relative",  # estimate - the best legal estimate (<= 0 for legal actions)
    "legal",  # 1 for a legal action
)
_F = len(FEATURES)


def center_device_bounds(cluster: Cluster, n_stages: int) -> tuple[int, ...]:
    """Device bounds [0, b_1, ..., D] of the center solution: each cut on the network boundary
    nearest an even split when there are at least as many servers as stages, else even."""
    d = cluster.n_devices
    if not 1 <= n_stages <= d:
        raise NoFeasiblePlan(f"{n_stages} stages do not fit on {d} devices")
    boundaries = [b for b in range(1, d) if is_node_boundary(cluster, b)]
    if len(boundaries) < n_stages - 1:
        boundaries = list(range(1, d))
    bounds = [0]
    for k in range(1, n_stages):
        target = k * d / n_stages
        # Leave room for the cuts still to place.
        room = [b for b in boundaries if b > bounds[-1]]
        room = room[: len(room) - (n_stages - 1 - k)]
        bounds.append(min(room, key=lambda b: (abs(b - target), b)))
    bounds.append(d)
    return tuple(bounds)


@dataclass(frozen=True, eq=False)
class CutTask:
    """One pipeline-cut problem: S stages of `profile` on `cluster`, plans as in `space`.

    The plan uses the devices the center device groups cover: every device of `cluster`, or a
    prefix when the space may leave devices idle;
    `space` supplies the microbatches, schedule, objective, replication factors a stage may have,
    the node-boundary and trainable-layer rules, and whether memory is checked.
    """

    profile: PipelineProfile
    cluster: Cluster
    space: PipelineSpace
    n_stages: int
    device_radius: int = 0
    oom_penalty: float = 1.0

    def __post_init__(self) -> None:
        if self.n_stages < 2:
            raise ValueError(f"{self.profile.source}: a cut search needs at least 2 stages; got {self.n_stages}")
        if self.n_stages > self.profile.n_layers:
            raise NoFeasiblePlan(
                f"{self.profile.source}: {self.n_stages} stages need {self.n_stages - 1} "
                f"cut{'s' if self.n_stages != 2 else ''}, but the step has "
                f"{self.profile.n_pivots} candidate cut points, so at most {self.profile.n_layers} stages"
            )
        if self.n_stages > self.cluster.n_devices:
            raise NoFeasiblePlan(
                f"{self.n_stages} stages do not fit on {self.cluster.n_devices} devices (at most "
                f"{self.cluster.n_devices} stages)"
            )
        if self.device_radius < 0:
            raise ValueError(f"device_radius = {self.device_radius} must be >= 0")

    @property
    def center(self) -> tuple[int, ...]:
        """The center device bounds: the cluster's even groups, or, when the space may leave
        devices idle, equal groups of its widest replication factor that fits on a prefix."""
        if self.space.use_all_devices:
            return center_device_bounds(self.cluster, self.n_stages)
        fitting = [r for r in self.space.replication if r * self.n_stages <= self.cluster.n_devices]
        if not fitting:
            raise NoFeasiblePlan(f"{self.n_stages} stages of replication {self.space.replication} do not fit on "
                                 f"{self.cluster.n_devices} devices")
        r = max(fitting)
        return tuple(range(0, r * self.n_stages + 1, r))


class CutPlan(NamedTuple):
    """The plan an episode built and what it is worth."""

    plan: PipelinePlan
    cost: PlanCost
    value: float  # L or bottleneck, per the task's objective
    feasible: bool


@dataclass
class _Decided:
    """What the cuts chosen so far fix: sums and maxima over the closed stages and cuts."""

    sum_time: float = 0.0
    max_time: float = 0.0
    sum_transfer: float = 0.0
    max_transfer: float = 0.0
    min_compute: float = math.inf
    max_compute: float = 0.0


class CutEnv:
    """The `hlomap.agents.Environment` of one `CutTask` (see the module docstring)."""

    def __init__(
        self,
        task: CutTask,
        *,
        slots: int | None = None,
        max_stages: int = MAX_STAGES,
        shaping: bool = True,
        ranked: int | None = None,
    ) -> None:
        profile, cluster, space = task.profile, task.cluster, task.space
        self.task = task
        self.shaping = shaping
        self.n_pivots = profile.n_pivots
        self.slots = self.n_pivots if slots is None else int(slots)
        if self.slots < self.n_pivots:
            raise ValueError(
                f"{profile.source}: {self.n_pivots} pivots do not fit in {self.slots} slots; "
                "coarsen the profile first (hlomap.tasks.pipeline.normalize.coarsen)"
            )
        if task.n_stages > max_stages:
            raise ValueError(f"{task.n_stages} stages exceed max_stages = {max_stages}")
        self.max_stages = max_stages
        # Slot i acts on pivot slot_pivot[i]; repeats spread few pivots over many slots.
        self.slot_pivot = (np.arange(self.slots) * self.n_pivots) // self.slots
        self.radius = task.device_radius
        self.offsets = np.arange(-self.radius, self.radius + 1)
        self.center = task.center
        self.end = self.center[-1]  # the device after the last stage's
        prefix = profile.prefix()
        self._compute = np.asarray(prefix.compute)
        self._fixed = np.asarray(prefix.fixed)
        self._syncs = {name: np.asarray(getattr(prefix, name)) for name in SYNC_FIELDS}
        self._parameter = np.asarray(prefix.parameter)
        self._stash = np.asarray(prefix.stash)
        self._trainable = np.asarray(prefix.trainable)
        self._crossing = profile.activation_bytes
        d = cluster.n_devices
        self.n_stages = task.n_stages
        self.m = space.microbatches
        total = float(self._compute[-1])
        self.unit = max(total / d, 1e-30)  # T
        s, m = self.n_stages, self.m
        if space.objective is PipelineObjective.LATENCY:
            self.reference = (m + s - 1) * self.unit
        else:
            self.reference = self.unit
        self._prices = GroupPrices(cluster)
        self._static = self._static_features()
        self._globals_fixed = self._fixed_globals()
        self.ranked = ranked
        if ranked is not None and ranked < 1:
            raise ValueError(f"ranked = {ranked} must be >= 1")
        n_globals = len(self._globals(0))
        if ranked is None:
            self.observation_size = len(self.offsets) * self.slots * _F + self.slots + n_globals
            self.num_actions = len(self.offsets) * self.slots
        else:
            self.observation_size = ranked * _F + 4 * self.slots + n_globals
            self.num_actions = ranked
        self._order = np.full(ranked or 0, -1, dtype=np.int64)
        self.outcome: CutPlan | None = None
        #: complete plans this environment has priced (episodes that reached their last cut)
        self.plans_scored = 0
        self._reset_state()

    # ---- communication prices (memoized per device group) -------------------------------------
    def _transfer(self, a: int, b: int, c: int) -> AffineMax:
        """Devices [a, b) to [b, c)."""
        return self._prices.transfer(range(a, b), range(b, c))

    def _allreduce(self, a: int, b: int) -> AffineMax:
        """Over devices [a, b)."""
        return self._prices.allreduce(range(a, b))

    def _sync_seconds(self, a: int, b: int, syncs: dict[str, np.ndarray]) -> np.ndarray | float:
        """What a stage's passes add on its replicas on devices [a, b) (`costs.stage_sync_seconds`:
        their all-reduces, the weight gradients' transposes), per pivot: none on one device."""
        if b - a <= 1:
            return 0.0
        price = self._allreduce(a, b)
        return (sync_seconds(price, syncs["forward_syncs"], syncs["forward_sync_bytes"])
                + sync_seconds(price, syncs["backward_syncs"], syncs["backward_sync_bytes"])
                + syncs["replica_transposes"])

    # ---- fixed parts of the observation -------------------------------------------------------
    def _static_features(self) -> np.ndarray:
        pivots = self.slot_pivot
        total_c = max(float(self._compute[-1]), 1e-30)
        total_w = max(float(self._parameter[-1]), 1e-30)
        largest = max(float(self._crossing.max(initial=0.0)), 1e-30)
        return np.stack([
            self._compute[pivots + 1] / total_c,
            self._parameter[pivots + 1] / total_w,
            self._crossing[pivots] / largest,
        ])

    def _fixed_globals(self) -> np.ndarray:
        """Stage count, microbatches, schedule, objective and the topology matrix: entry (i, j)
        the transfer of the median crossing bytes from group i to group j, and (i, i) the
        all-reduce of an even share of W over group i, both / T."""
        space, s = self.task.space, self.n_stages
        bounds = self.center
        median = float(np.median(self._crossing)) if self._crossing.size else 0.0
        share = float(self._parameter[-1]) / s
        topology = np.zeros((self.max_stages, self.max_stages))
        for i in range(s):
            for j in range(s):
                if i == j:
                    t = float(self._allreduce(bounds[i], bounds[i + 1])(share)) / self.m
                else:
                    src = range(bounds[i], bounds[i + 1])
                    dst = range(bounds[j], bounds[j + 1])
                    t = float(self._prices.transfer(src, dst)(median))
                topology[i, j] = min(t / self.unit, _CLIP)
        return np.concatenate([
            [s / self.max_stages, math.log2(self.m) / 8.0,
             float(space.schedule.value == "gpipe"),
             float(space.objective is PipelineObjective.BOTTLENECK)],
            topology.reshape(-1),
        ])

    def _globals(self, step: int) -> np.ndarray:
        onehot = np.zeros(self.max_stages - 1)
        onehot[min(step, self.max_stages - 2)] = 1.0
        return np.concatenate([onehot, self._globals_fixed])

    # ---- episode state --------------------------------------------------------------------------
    def _reset_state(self) -> None:
        self.step_index = 0
        self.cuts: list[int] = []
        self.bounds: list[int] = [0]
        self.decided = _Decided()
        self.potential = 0.0
        self.actions: list[int] = []
        self.episode_return = 0.0
        self._cache: dict[str, np.ndarray] = {}

    def reset(self, seed: int = 0) -> TimeStep:
        """Starts an episode (the task is fixed, so `seed` changes nothing)."""
        del seed
        self._reset_state()
        self.outcome = None
        observation, legal = self._observe()
        self.potential = float(self._cache["best"])
        if not legal.any():
            raise NoFeasiblePlan(
                f"{self.task.profile.source}: no legal first cut for {self.n_stages} stages "
                f"with device bounds {self.center} and replication {self.task.space.replication}"
            )
        return restart(observation, legal)

    def _device_options(self) -> np.ndarray:
        """[J] the next device bound of each offset, or -1 where that offset is illegal."""
        k, s = self.step_index, self.n_stages
        cluster, space = self.task.cluster, self.task.space
        d = self.end
        previous = self.bounds[-1]
        out = np.full(len(self.offsets), -1, dtype=np.int64)
        for j, offset in enumerate(self.offsets):
            b = self.center[k + 1] + int(offset)
            if not previous < b < d:
                continue
            if b - previous not in space.replication:
                continue
            if space.cut_on_node_boundary and not is_node_boundary(cluster, b):
                continue
            remaining = s - k - 1  # stages after this one
            if remaining == 1 and d - b not in space.replication:
                continue
            if d - b < remaining:
                continue
            out[j] = b
        return out

    def _observe(self) -> tuple[np.ndarray, np.ndarray]:
        """The observation and legal mask of the current state; caches per-action arrays."""
        k, s, m = self.step_index, self.n_stages, self.m
        space, cluster = self.task.space, self.task.cluster
        d = self.end
        n = self.task.profile.n_layers
        start = self.cuts[-1] + 1 if self.cuts else 0
        previous = self.bounds[-1]
        pivots = self.slot_pivot
        options = self._device_options()
        j_count = len(options)
        shape = (j_count, self.slots)
        features = np.zeros((j_count, _F, self.slots))
        legal = np.zeros(shape, dtype=bool)
        estimate = np.zeros(shape)
        tiebreak = np.zeros(shape)  # the other objective's estimate, to order equal estimates
        stage_time = np.zeros(shape)
        transfer = np.zeros(shape)
        compute_only = np.zeros(shape)
        last_pivot = self.n_pivots - 1 - (s - 2 - k)  # leave pivots for the remaining cuts
        pivot_ok = (pivots >= start) & (pivots <= last_pivot)
        if self.cuts:
            pivot_ok &= pivots > self.cuts[-1]
        if space.require_trainable:
            # This stage needs a trainable layer, and so does each stage after it.
            pivot_ok &= self._trainable[pivots + 1] - self._trainable[start] > 0.5
            pivot_ok &= self._trainable[n] - self._trainable[pivots + 1] > s - k - 1.5
        compute = self._compute[pivots + 1] - self._compute[start]
        fixed = self._fixed[pivots + 1] - self._fixed[start]
        syncs = {name: values[pivots + 1] - values[start] for name, values in self._syncs.items()}
        remaining_syncs = {name: values[n] - values[pivots + 1] for name, values in self._syncs.items()}
        params = self._parameter[pivots + 1] - self._parameter[start]
        stash = self._stash[pivots + 1] - self._stash[start]
        remaining_compute = self._compute[n] - self._compute[pivots + 1]
        remaining_fixed = self._fixed[n] - self._fixed[pivots + 1]
        remaining_params = self._parameter[n] - self._parameter[pivots + 1]
        crossing = self._crossing[pivots]
        decided = self.decided
        remaining_stages = s - k - 1
        count = in_flight(space.schedule, k, s, m)
        factor = space.cost.param_memory_factor
        update = self.task.profile.update_seconds_per_byte
        for j, b in enumerate(options):
            if b < 0:
                continue
            r = b - previous
            after = self.center[k + 2] if k + 2 < s else d
            after = max(after, b + 1)
            own = replicated_seconds(compute, fixed, r) + self._sync_seconds(previous, b, syncs)
            allreduce = self._allreduce(previous, b)(params) / m
            time = own + allreduce + params * update / m  # every replica updates the stage's parameters
            move = self._transfer(previous, b, after)(crossing)
            rest = replicated_seconds(remaining_compute, remaining_fixed, d - b) + self._sync_seconds(b, after, remaining_syncs)
            rest_params = remaining_params / remaining_stages
            rest_stage = rest + self._allreduce(b, after)(rest_params) / m + rest_params * update / m
            biggest = np.maximum.reduce([
                np.full(self.slots, max(decided.max_time, decided.max_transfer)),
                time, move, rest_stage,
            ])
            latency = (decided.sum_time + time + remaining_stages * rest_stage
                       + 2 * (decided.sum_transfer + move) + (m - 1) * biggest)
            if space.objective is PipelineObjective.LATENCY:
                value, other = latency, biggest
            else:
                value, other = biggest, latency
            low = np.minimum(np.minimum(decided.min_compute, own), rest)
            high = np.maximum(np.maximum(decided.max_compute, own), rest)
            memory = (factor * params + count * stash / r) / group_memory(cluster, range(previous, b))
            features[j] = np.stack([
                *self._static,
                np.minimum(own / self.unit, _CLIP),
                np.minimum(allreduce / self.unit, _CLIP),
                np.minimum(move / self.unit, _CLIP),
                np.minimum(np.maximum(move, decided.max_transfer) / self.unit, _CLIP),
                np.minimum(rest / self.unit, _CLIP),
                np.where(high > 0, low / np.maximum(high, 1e-300), 1.0),
                np.minimum(memory, 2.0),
                self.score(value),
                np.zeros(self.slots),  # relative: filled in once the best is known
                pivot_ok.astype(np.float64),
            ])
            legal[j] = pivot_ok
            estimate[j] = self.score(value)
            tiebreak[j] = -other
            stage_time[j] = time
            transfer[j] = move
            compute_only[j] = own
        best = float(estimate[legal].max()) if legal.any() else 0.0
        features[:, FEATURES.index("relative")] = np.where(legal, estimate - best, 0.0)
        self._cache = {
            "options": options, "estimate": estimate, "stage_time": stage_time,
            "transfer": transfer, "compute": compute_only, "legal": legal,
            "best": np.array(best),
        }
        cut_mask = np.zeros(self.slots)
        if self.cuts:
            cut_mask[np.isin(pivots, self.cuts)] = 1.0
        if self.ranked is None:
            observation = np.concatenate([
                features.reshape(-1), cut_mask, self._globals(k),
            ]).astype(np.float32)
            return observation, legal.reshape(-1)
        order = self._rank(legal, estimate, tiebreak)
        per_action = np.zeros((self.ranked, _F))
        valid = order >= 0
        flat = features.transpose(0, 2, 1).reshape(-1, _F)
        per_action[valid] = flat[order[valid]]
        observation = np.concatenate([
            per_action.reshape(-1), self._static.reshape(-1), cut_mask, self._globals(k),
        ]).astype(np.float32)
        return observation, valid

    def _rank(self, legal: np.ndarray, estimate: np.ndarray, tiebreak: np.ndarray) -> np.ndarray:
        """The flat actions of the `ranked` legal (device offset, pivot) pairs with the best
        estimates, best first, one slot per pivot; -1 pads. Kept for `step` to map back."""
        flat_legal = legal.reshape(-1)
        pivots = np.tile(self.slot_pivot, len(self.offsets))
        offsets = np.repeat(np.arange(len(self.offsets)), self.slots)
        candidates = np.flatnonzero(flat_legal)
        # One slot per (offset, pivot): repeated slots of a spread profile are the same cut.
        _, first = np.unique(offsets[candidates] * (self.n_pivots + 1) + pivots[candidates],
                             return_index=True)
        candidates = candidates[first]
        # Best estimate first; equal estimates (a bottleneck fixed by one big layer makes many)
        # by the other objective, as the DP breaks bottleneck ties by latency.
        best = candidates[np.lexsort((-tiebreak.reshape(-1)[candidates],
                                      -estimate.reshape(-1)[candidates]))]
        order = np.full(self.ranked or 0, -1, dtype=np.int64)
        order[: min(len(best), len(order))] = best[: len(order)]
        self._order = order
        return order

    def _flat(self, action: int) -> int:
        """The (device offset, slot) index of an action: itself, or its ranked candidate."""
        if self.ranked is None:
            return int(action)
        return int(self._order[action])

    def score(self, value: np.ndarray | float) -> np.ndarray | float:
        """ref / value, the reward of a plan worth `value` (1 for a free plan: nothing to do)."""
        v = np.asarray(value, dtype=np.float64)
        out = np.where(v > 0, self.reference / np.maximum(v, 1e-300), 1.0)
        return float(out) if out.ndim == 0 else out

    def decode(self, action: int) -> tuple[int, int]:
        """(pivot, device offset) of an action in the current state."""
        j, slot = divmod(self._flat(action), self.slots)
        return int(self.slot_pivot[slot]), int(self.offsets[j])

    def step(self, action: int) -> TimeStep:
        if self.outcome is not None or self.step_index >= self.n_stages - 1:
            raise RuntimeError("CutEnv.step after the episode ended; call reset")
        action = int(action)
        if not 0 <= action < self.num_actions:
            raise ValueError(f"action {action} is out of range [0, {self.num_actions})")
        flat = self._flat(action)
        if flat < 0:
            raise ValueError(f"action {action} is illegal: fewer ranked candidates remain "
                             f"at step {self.step_index} after cuts {self.cuts}")
        j, slot = divmod(flat, self.slots)
        cache = self._cache
        bound = int(cache["options"][j])
        pivot = int(self.slot_pivot[slot])
        if bound < 0 or not cache["legal"][j, slot]:
            raise ValueError(
                f"action {action} (pivot {pivot}, device offset {int(self.offsets[j])}) is "
                f"illegal at step {self.step_index} after cuts {self.cuts}"
            )
        decided = self.decided
        time = float(cache["stage_time"][j, slot])
        move = float(cache["transfer"][j, slot])
        own = float(cache["compute"][j, slot])
        decided.sum_time += time
        decided.max_time = max(decided.max_time, time)
        decided.sum_transfer += move
        decided.max_transfer = max(decided.max_transfer, move)
        decided.min_compute = min(decided.min_compute, own)
        decided.max_compute = max(decided.max_compute, own)
        self.cuts.append(pivot)
        self.bounds.append(bound)
        self.actions.append(action)
        self.step_index += 1
        old = self.potential
        if self.step_index == self.n_stages - 1:
            self.bounds.append(self.end)
            outcome = self._finish()
            final = self.score(outcome.value) if outcome.feasible else -self.task.oom_penalty
            self.potential = 0.0
            reward = final - old if self.shaping else final
            self.episode_return += reward
            observation = np.zeros(self.observation_size, np.float32)
            return termination(observation, reward, np.zeros(self.num_actions, dtype=bool))
        observation, legal = self._observe()
        if not legal.any():  # a dead end (only possible with a device radius)
            self.outcome = None
            self.potential = 0.0
            penalty = -self.task.oom_penalty
            self.episode_return += penalty - old if self.shaping else penalty
            return termination(observation, penalty - old if self.shaping else penalty, legal)
        self.potential = float(self._cache["best"])
        shaped = self.potential - old if self.shaping else 0.0
        self.episode_return += shaped
        return transition(observation, shaped, legal)

    def _finish(self) -> CutPlan:
        plan = self.plan(self.cuts, self.bounds)
        task = self.task
        cost = evaluate_plan(task.profile, task.cluster, plan, task.space.cost,
                             prices=self._prices)
        value = cost.latency if task.space.objective is PipelineObjective.LATENCY else cost.bottleneck
        feasible = cost.feasible or not task.space.check_memory
        self.outcome = CutPlan(plan, cost, value, feasible)
        self.plans_scored += 1
        return self.outcome

    # ---- what a search driver needs (`hlomap.search.task.TaskEnv`) -----------------------------
    @property
    def position(self) -> int:
        return self.step_index

    @property
    def last_outcome(self) -> EpisodeOutcome | None:
        """The finished episode as a search driver sees it (None at a dead end)."""
        if self.outcome is None:
            return None
        decisions = decisions_of(self.outcome.plan, self.task.cluster.n_devices)
        return EpisodeOutcome(decisions, len(self.cuts), self.episode_return, self.plan_score(self.outcome))

    def plan_score(self, cut: CutPlan) -> Score:
        """A plan's search score: ref / value (the reward), above every plan out of memory,
        which scores in [-1, -0.5] (less negative the faster it would be); latency breaks
        bottleneck ties, as the DP does."""
        value = float(self.score(cut.value))
        if not cut.feasible:
            value = -1.0 + 0.5 * min(value, 1.0)
        by_bottleneck = self.task.space.objective is PipelineObjective.BOTTLENECK
        tiebreak = float(self.score(cut.cost.latency)) if by_bottleneck else 0.0
        return Score(value, tiebreak, True, cut.feasible, cut.cost.latency, max(cut.cost.stage_memory))

    def replay_action(self, decisions: np.ndarray) -> int:
        """The action placing this step's cut and device bound as `decisions` does (pivots of
        the cuts, then the device bounds, as `decisions_of`); the best-estimated legal action
        when that cut is not among this state's actions."""
        k, cuts = self.step_index, (len(decisions) // 2)
        pivot, bound = int(decisions[k]), int(decisions[cuts + k])
        cache = self._cache
        legal = cache["legal"]
        for j in np.flatnonzero(cache["options"] == bound):
            slots = np.flatnonzero((self.slot_pivot == pivot) & legal[j])
            if slots.size:
                flat = int(j) * self.slots + int(slots[0])
                if self.ranked is None:
                    return flat
                hits = np.flatnonzero(self._order == flat)
                if hits.size:
                    return int(hits[0])
        if self.ranked is not None:
            return 0
        return int(np.flatnonzero(legal.reshape(-1))[0])

    def set_replaying(self, replaying: bool) -> None:
        """Legality does not depend on replaying here: every legal cut keeps the plan valid."""

    def plan(self, cuts: Sequence[int], bounds: Sequence[int]) -> PipelinePlan:
        """The plan of pivots `cuts` (S - 1) and device bounds (S + 1, from 0 to D)."""
        layers = [0, *(c + 1 for c in cuts), self.task.profile.n_layers]
        stages = tuple(
            Stage(layers[s], layers[s + 1], tuple(range(bounds[s], bounds[s + 1])))
            for s in range(len(layers) - 1)
        )
        space = self.task.space
        return PipelinePlan(stages=stages, microbatches=space.microbatches,
                            schedule=space.schedule)


def decisions_of(plan: PipelinePlan, n_devices: int | None = None) -> np.ndarray:
    """A plan as a search's decision vector: the pivots of its S - 1 cuts, then the first
    device of stages 1..S-1, then, for a plan that leaves the last of `n_devices` devices idle,
    the device after its last stage."""
    end = plan.stages[-1].devices[-1] + 1
    idle = [end] if n_devices is not None and end != n_devices else []
    return np.asarray([*plan.cuts, *(stage.devices[0] for stage in plan.stages[1:]), *idle], dtype=np.int64)
