"""`hlomap.elastic`: a train step that keeps training when devices leave and come back.

    step = hlomap.elastic(train_step, cluster="local", task="auto")
    params, opt_state, loss = step(params, opt_state, batch)       # plans for every device, runs
    params, opt_state = step.resize(survivors, params, opt_state)  # re-plans, moves the live state
    params, opt_state, loss = step(params, opt_state, batch)       # runs on the survivors

The loop says which devices it has (`resize`, between steps); the step re-plans for exactly
those devices (`hlomap.explore` on the cluster's entries for them: the planner may leave some of
them idle, or choose a pipeline), builds the new step (`hlomap.parallelize` on those devices) and
moves the live params and optimizer state onto the new plan's layout with `jax.device_put`, array
to array, without a trip through the host. A set of devices seen before reuses its plan and
compiled step, so devices coming back cost only the move. `history` records each change and what
its re-plan and move cost.

What it does not do: recover the contents of a device that failed. The live state is read from
the arrays the loop hands in, so the devices leaving must still be readable when `resize` is
called (a preemption notice, a planned drain). After a crash, restore from a checkpoint of
`gather`'s host pytrees and `resize` to the survivors.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import numpy as np

log = logging.getLogger(__name__)

__all__ = ["ElasticStep", "Resize", "elastic", "surviving_cluster"]

#: Tasks whose plans take a mesh of named axes; the others plan the devices as a whole.
MESH_TASKS = frozenset({"opp", "adp", "hybrid"})


@dataclass(frozen=True)
class Resize:
    """One change of devices: after how many steps, to which devices (positions in
    `jax.devices()`), the plan chosen, whether it was planned now or reused, and the seconds its
    re-plan (search and step build) and its move of the live state took."""

    after_steps: int
    devices: tuple[int, ...]
    plan: str
    replanned: bool
    plan_seconds: float
    reshard_seconds: float

    @property
    def seconds(self) -> float:
        return self.plan_seconds + self.reshard_seconds


@dataclass(frozen=True)
class _Planned:
    """A plan for one set of devices and the step that runs it there."""

    plan: Any
    step: Any  # hlomap.run.runner.ParallelStep


def surviving_cluster(cluster: Any, positions: Sequence[int]) -> Any:
    """The entries of `cluster` for the devices at `positions` (their devices, nodes and links),
    named `NAME[i,j,...]`; the cluster itself for all of its devices in order. A cluster with a
    routed network (tori, meshes) keeps its link tables but not its routes: routes need the
    devices' places in the network, which a subset of device ids does not carry."""
    from hlomap.cost.cluster import Cluster

    picked = np.asarray(positions, dtype=np.int64)
    n = cluster.n_devices
    if picked.size == 0:
        raise ValueError("no devices left to plan for")
    if picked.min() < 0 or picked.max() >= n or len(set(picked.tolist())) != picked.size:
        raise ValueError(f"devices {picked.tolist()}: expected distinct positions among the cluster's {n} devices")
    if picked.size == n and np.array_equal(picked, np.arange(n)):
        return cluster
    sub = np.ix_(picked, picked)
    # the survivors keep their topology coordinates (a grid's come from its network, dropped here)
    return Cluster(f"{cluster.name}[{','.join(str(int(p)) for p in picked)}]",
                   tuple(cluster.devices[int(p)] for p in picked), tuple(int(cluster.node_of[int(p)]) for p in picked),
                   np.asarray(cluster.bandwidth)[sub], np.asarray(cluster.latency)[sub], cluster.nics_per_node,
                   cluster.measured, None, cluster.coordinates[picked])


def _positions(devices: Sequence[Any], present: Sequence[Any]) -> tuple[int, ...]:
    """Positions in `present` (`jax.devices()`) of `devices`, given as jax devices or positions."""
    index = {d: i for i, d in enumerate(present)}
    out: list[int] = []
    for d in devices:
        if isinstance(d, (int, np.integer)) and not isinstance(d, bool):
            if not 0 <= int(d) < len(present):
                raise ValueError(f"device {int(d)}: JAX sees {len(present)} devices (positions 0-{len(present) - 1})")
            out.append(int(d))
        elif d in index:
            out.append(index[d])
        else:
            raise ValueError(f"device {d!r} is not one of the {len(present)} devices JAX sees")
    if not out:
        raise ValueError("resize needs at least one device")
    if len(set(out)) != len(out):
        raise ValueError(f"devices {out}: a device is listed twice")
    return tuple(out)


def _describe(plan: Any) -> str:
    if getattr(plan, "pipeline", None) is not None:
        stages = plan.pipeline.stages
        return f"pipeline of {len(stages)} stage(s) on {sum(len(s.devices) for s in stages)} device(s)"
    return "mesh " + ",".join(f"{k}={v}" for k, v in plan.mesh_shape.items())


class ElasticStep:
    """A train step `fn(params, opt_state, *rest) -> (params, opt_state, ...)` run on a set of
    devices that can change between steps (module docstring)."""

    def __init__(self, train_step: Callable[..., Any], *, devices: Sequence[Any] | None = None, cluster: Any = "local",
                 task: str = "auto", mesh: Callable[[int], Mapping[str, int] | int] | None = None,
                 agent: str | None = None, budget_seconds: float | None = None, seed: int = 0, **options: Any):
        import jax

        from hlomap.api import load_cluster

        self.__wrapped__ = train_step
        self._present = tuple(jax.devices())
        self._devices = _positions(devices, self._present) if devices is not None else tuple(range(len(self._present)))
        self._cluster = load_cluster(cluster)
        if self._cluster.n_devices < len(self._present):
            raise ValueError(f"elastic: cluster {self._cluster.name!r} has {self._cluster.n_devices} devices; JAX sees "
                             f"{len(self._present)}: calibrate the devices at hand (cluster='local')")
        self._task = str(getattr(task, "value", task))
        if self._task == "hybrid" and mesh is None:
            raise ValueError("elastic: task 'hybrid' needs mesh=, a function of the device count returning the mesh "
                             "(e.g. lambda n: {'data': 2, 'model': n // 2})")
        self._mesh = mesh
        searched = {k: v for k, v in (("agent", agent), ("budget_seconds", budget_seconds)) if v is not None}
        if self._task == "auto" and searched:  # the joint planner is exact: it would ignore them
            name = next(iter(searched))
            raise ValueError(f"elastic: {name}={searched[name]!r}: the auto task (the default) plans with an exact "
                             "joint planner, which takes no agent and no budget; give task= a search task to use it")
        self._search = dict(seed=seed, **searched, **options)
        self._cap: Any = None
        self._abstract: tuple[Any, ...] | None = None
        self._planned: dict[tuple[int, ...], _Planned] = {}
        self._steps = 0
        self._history: list[Resize] = []

    # -- what it runs on ------------------------------------------------------------------------------
    @property
    def devices(self) -> tuple[Any, ...]:
        """The jax devices the step runs on now."""
        return tuple(self._present[p] for p in self._devices)

    @property
    def plan(self) -> Any:
        """The plan for the present devices (None before the first call)."""
        found = self._planned.get(self._devices)
        return None if found is None else found.plan

    @property
    def history(self) -> tuple[Resize, ...]:
        return tuple(self._history)

    @property
    def steps(self) -> int:
        return self._steps

    # -- the call and the changes --------------------------------------------------------------------------
    def __call__(self, params: Any, opt_state: Any, *rest: Any) -> Any:
        if self._cap is None:
            params, opt_state = self._first_plan(params, opt_state, rest)
        out = self._planned[self._devices].step(params, opt_state, *rest)
        self._steps += 1
        return out

    def resize(self, devices: Sequence[Any], params: Any, opt_state: Any) -> tuple[Any, Any]:
        """Run on `devices` from now on (jax devices or positions in `jax.devices()`): re-plan for
        them (or reuse their plan), and return params and opt_state moved onto its layout."""
        positions = _positions(devices, self._present)
        if self._cap is None:  # nothing planned yet: the first call plans for these devices
            self._devices = positions
            return params, opt_state
        start = time.perf_counter()
        replanned = positions not in self._planned
        if replanned:
            self._planned[positions] = self._plan_for(positions)
        planned = time.perf_counter()
        self._devices = positions
        params, opt_state = self._move(params, opt_state)
        moved = time.perf_counter()
        event = Resize(self._steps, positions, _describe(self._planned[positions].plan), replanned, planned - start,
                       moved - planned)
        self._history.append(event)
        log.info("elastic: %d device(s) after %d step(s): %s (%s %.2f s, moved the state in %.2f s)", len(positions),
                 self._steps, event.plan, "planned in" if replanned else "reused,", event.plan_seconds,
                 event.reshard_seconds)
        return params, opt_state

    def gather(self, params: Any, opt_state: Any) -> tuple[Any, Any]:
        """The user's pytrees of params and opt_state as numpy arrays on the host (a checkpoint)."""
        found = self._planned.get(self._devices)
        if found is None:
            import jax

            return jax.tree.map(np.asarray, params), jax.tree.map(np.asarray, opt_state)
        return found.step.gather(params, opt_state)

    def step_for(self, devices: Sequence[Any]) -> Any:
        """The `ParallelStep` that runs on `devices` (planned by an earlier call or resize)."""
        return self._planned[_positions(devices, self._present)].step

    # -- planning ------------------------------------------------------------------------------------------
    def _first_plan(self, params: Any, opt_state: Any, rest: tuple[Any, ...]) -> tuple[Any, Any]:
        from hlomap.autoshard import abstract_args
        from hlomap.hlo.capture import capture

        self._abstract = abstract_args((params, opt_state, *rest))
        self._cap = capture(self.__wrapped__, *self._abstract)
        self._planned[self._devices] = self._plan_for(self._devices)
        return self._move(params, opt_state)

    def _plan_for(self, positions: tuple[int, ...]) -> _Planned:
        from hlomap.api import explore
        from hlomap.run import parallelize

        cluster = surviving_cluster(self._cluster, positions)
        n = len(positions)
        if self._task in MESH_TASKS:
            mesh: Any = self._mesh(n) if self._mesh is not None else n
            plan = explore(self._cap, task=self._task, mesh=mesh, cluster=cluster, **self._search)
        else:
            plan = explore(self._cap, task=self._task, cluster=cluster, **self._search)
        devices = [self._present[p] for p in positions]
        pipelined = getattr(plan, "pipeline", None) is not None
        # a pipeline is cut now (from the captured shapes), so that the move lays the state out
        step = parallelize(self.__wrapped__, plan, devices=devices,
                           example_args=self._abstract if pipelined else None)
        return _Planned(plan, step)

    def _move(self, params: Any, opt_state: Any) -> tuple[Any, Any]:
        import jax

        params, opt_state = self._planned[self._devices].step.place(params, opt_state)
        jax.block_until_ready((params, opt_state))
        return params, opt_state


def elastic(train_step: Callable[..., Any] | None = None, *, devices: Sequence[Any] | None = None,
            cluster: Any = "local", task: str = "auto", mesh: Callable[[int], Mapping[str, int] | int] | None = None,
            agent: str | None = None, budget_seconds: float | None = None, seed: int = 0, **options: Any) -> Any:
    """An `ElasticStep` of `train_step(params, opt_state, *rest) -> (params, opt_state, ...)`;
    as a decorator `@hlomap.elastic(...)` too.

    devices: the devices to start on (default every device JAX sees). cluster: what plans are
    priced on, an entry per device JAX sees ("local", the default, calibrates them once); each
    re-plan prices the entries of the devices in use. task: "auto" (default: pipelines and meshes,
    devices may be left idle), "pipeline", or "opp" / "adp" / "hybrid" with `mesh`, a function of
    the device count giving the mesh (default one axis of every device). agent, budget_seconds,
    seed and options go to `hlomap.explore` at every re-plan (agent and budget_seconds: the
    search tasks' own, explore's defaults unless given; the auto task refuses them).
    """
    def wrap(step: Callable[..., Any]) -> ElasticStep:
        if not callable(step):
            raise TypeError(f"elastic wraps a train step function, not {step!r}")
        return ElasticStep(step, devices=devices, cluster=cluster, task=task, mesh=mesh, agent=agent,
                           budget_seconds=budget_seconds, seed=seed, **options)

    return wrap if train_step is None else wrap(train_step)
