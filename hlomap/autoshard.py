"""`@hlomap.auto_shard`: explore a plan for a train step at its first call, keep it on disk, run it.

    @hlomap.auto_shard(mesh={"data": 2, "model": 4}, cluster="A", task="hybrid", budget_seconds=60)
    def train_step(params, opt_state, batch): ...

    params, opt_state = train_step.place(params, opt_state)
    params, opt_state, loss = train_step(params, opt_state, batch)   # capture, look up / explore, compile
    train_step.plan, train_step.explain()

The first call captures the step abstractly (shapes only, no weights copied), looks the plan up in
the cache, explores it when missing (`hlomap.api.explore`, the CLI's front) and runs it with
`hlomap.run.parallelize`. Later calls with the same argument shapes and dtypes reuse the compiled
step; a new shape or dtype captures again, as `jax.jit` retraces.

The cache is a folder of plan files (`Plan` JSON, usable as `plan=PATH` and by `hlomap run`), one
per key: the HLO fingerprint of the captured step, the mesh, the cluster the search priced, the
task, the hlomap version and how many candidates were measured. Writes are atomic; an entry that
cannot be read is explored again with a warning. The cache folder is created and probed when the
decorator is applied: a `cache_dir` the user named that cannot be written is an error naming it
(the user asked for it); an unwritable default folder only warns and runs without a cache, and so
does a write that fails later (the plan in hand is still good).

The cluster the search prices: the first N devices of `cluster`, N the devices the mesh spans.
The default, "local", is the devices the step runs on, measured on first use and cached
(`hlomap.run.local`); a preset, a JSON file or a Cluster plans for other hardware. A step on
8 devices of preset "A" (two servers of 8 V100s) is priced on its first server; a cluster with
fewer than N devices is an error.

Measured selection: when the plan runs where it was planned (the priced cluster's devices are the
kind JAX shows, `hlomap.run.measure.runs_where_planned`), the first call times the search's best `measure` candidates
(default 3) on the present devices from copies of its arguments and runs the measured fastest;
`timings.measure` is its cost. `measure=0` turns it off.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import hashlib
import json
import logging
import math
import os
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

from hlomap.tasks import Task
# Plans are cached where the `local` cluster is (unless `cache_dir` says otherwise):
# $HLOMAP_CACHE_DIR, default ~/.cache/hlomap.
from hlomap.run.local import CACHE_ENV, default_cache_dir, folder_problem
from hlomap.run.runner import positional_arguments
from hlomap.run.spmd import ReturnedState

log = logging.getLogger(__name__)

__all__ = ["AutoShardConfig", "AutoShardedStep", "CacheKey", "Origin", "Task", "Timings", "auto_shard",
           "cache_dir_problem", "cache_key", "cache_path", "default_cache_dir", "load_cached", "measured_count",
           "save_cached", "usable_cache_dir"]

#: The two state arguments (params, opt_state) that `place` lays out and the step donates.
STATE_ARGS = 2
#: Candidate plans timed after a search when the plan runs where it was planned (`auto_shard`).
DEFAULT_MEASURE = 3


class Origin(enum.Enum):
    """Where a step's plan came from."""

    EXPLORED = "explored"
    CACHE = "cache"
    FILE = "file"


@dataclass(frozen=True)
class AutoShardConfig:
    """The decorator's arguments, checked (see `auto_shard`)."""

    mesh: int | tuple[tuple[str, int], ...] | None
    cluster: Any
    task: Task
    agent: str | None  # None: the task's default
    budget_seconds: float | None
    seed: int
    cache_dir: Path | None
    plan_path: Path | None
    progress: bool | None
    options: tuple[tuple[str, Any], ...] = ()
    measure: Any = None  # hlomap.run.measure.MeasureSettings; None: do not measure


@dataclass(frozen=True)
class CacheKey:
    """What a cached plan is valid for (module docstring)."""

    fingerprint: str  # sha256 of the captured HLO text
    mesh: tuple[tuple[str, int], ...]
    cluster: str  # name and content hash of the priced cluster
    task: str
    version: str  # hlomap's
    #: Candidates timed to choose the plan (0: the search's pick, unmeasured). Measured selection
    #: may choose another plan, so it is part of the key; 0 leaves the digest of older entries.
    measure: int = 0

    def digest(self) -> str:
        parts: list[Any] = [self.fingerprint, [list(a) for a in self.mesh], self.cluster, self.task, self.version]
        if self.measure:
            parts.append(["measure", self.measure])
        return hashlib.sha256(json.dumps(parts).encode()).hexdigest()


@dataclass(frozen=True)
class Timings:
    """Seconds spent by the first call for one argument signature (the bench reads them)."""

    capture: float
    lookup: float  # reading the cache, or the plan file
    explore: float  # 0 on a cache hit; the search alone when measured
    first_call: float = 0.0  # compile and run the first step
    measure: float = 0.0  # compile and time the candidate plans (0 when not measured)
    cluster: float = 0.0  # resolve the priced cluster: `local` is measured on its first use (tens of seconds)


@dataclass(frozen=True)
class _Entry:
    """A captured signature: its capture, plan, runnable step and how the plan was found."""

    cap: Any
    plan: Any
    step: Any  # hlomap.run.runner.ParallelStep
    origin: Origin
    path: Path | None
    timings: Timings
    key: CacheKey | None = field(default=None)


# ---------------------------------------------------------------------------------------------
# The cache: small pure functions
# ---------------------------------------------------------------------------------------------


def cluster_tag(cluster: Any) -> str:
    """`NAME:HASH` of a Cluster's JSON: a cluster file edited in place is another key."""
    digest = hashlib.sha256(json.dumps(cluster.to_json(), sort_keys=True).encode()).hexdigest()
    return f"{cluster.name}:{digest[:16]}"


def cache_key(fingerprint: str, mesh: Mapping[str, int], cluster: Any, task: Task | str, measure: int = 0) -> CacheKey:
    import hlomap

    return CacheKey(fingerprint, tuple((str(k), int(v)) for k, v in mesh.items()), cluster_tag(cluster),
                    Task(task).value, hlomap.__version__, measure)


def cache_path(cache_dir: Path, key: CacheKey) -> Path:
    """`<cache_dir>/<task>-<fingerprint[:12]>-<key digest[:16]>.plan.json`: readable at a glance,
    unique by the whole key."""
    return Path(cache_dir) / f"{key.task}-{key.fingerprint[:12]}-{key.digest()[:16]}.plan.json"


def load_cached(path: Path, cap: Any) -> Any:
    """The plan cached at `path`, or None when there is none; an entry that cannot be read or was
    made for another module is reported with a warning (and explored again by the caller)."""
    from hlomap.plan import Plan

    if not path.is_file():
        return None
    try:
        return Plan.load(path, cap=cap)
    except (OSError, ValueError) as err:  # JSON errors are ValueErrors
        warnings.warn(f"hlomap.auto_shard: ignoring the corrupt cache entry {path} ({err}); exploring again",
                      RuntimeWarning, stacklevel=3)
        return None


def cache_dir_problem(directory: Path) -> str | None:
    """Why plans cannot be cached in `directory` (created if missing), or None when they can."""
    return folder_problem(directory)


def usable_cache_dir(cache_dir: str | os.PathLike[str] | None, cache: bool) -> Path | None:
    """The cache folder the decorator uses (module docstring): None without a cache; raises
    ValueError for a `cache_dir` given that cannot be written; warns and returns None for an
    unwritable default."""
    if not cache:
        return None
    directory = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    problem = cache_dir_problem(directory)
    if problem is None:
        return directory
    if cache_dir is not None:
        raise ValueError(f"auto_shard: cache_dir={str(cache_dir)!r}: cannot write plans in {directory} ({problem}); "
                         "pass a writable folder, or cache=False")
    warnings.warn(f"hlomap.auto_shard: cannot write plans in the default cache folder {directory} ({problem}); "
                  f"running without a plan cache (set ${CACHE_ENV} or cache_dir= to a writable folder)",
                  RuntimeWarning, stacklevel=4)
    return None


def save_cached(path: Path, plan: Any) -> None:
    """Save atomically (`Plan.save`): a reader never sees half a plan, even across processes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    plan.save(path)


# ---------------------------------------------------------------------------------------------
# Meshes and clusters
# ---------------------------------------------------------------------------------------------


def mesh_devices(mesh: int | Mapping[str, int]) -> int:
    return int(mesh) if isinstance(mesh, int) else math.prod(dict(mesh).values())


def resolve_mesh(mesh: int | tuple[tuple[str, int], ...] | None, task: Task, available: int) -> dict[str, int]:
    """The mesh the search gets: None -> every local device; an int or mapping checked against
    the devices JAX sees. For the tasks that plan their own meshes, `{"devices": N}`."""
    from hlomap.api import parse_mesh

    given: int | dict[str, int] = available if mesh is None else (mesh if isinstance(mesh, int) else dict(mesh))
    need = mesh_devices(given)
    if need > available:
        raise ValueError(f"auto_shard: mesh={given!r} needs {need} devices, but JAX sees {available} "
                         f"({available} x {_platform()}); pass a smaller mesh or mesh=None for all of them")
    if task.plans_its_mesh:
        return {"devices": need}
    try:
        return parse_mesh(given, task.value)
    except ValueError as err:
        raise ValueError(f"auto_shard: mesh={given!r}: {err}") from None


def priced_cluster(cluster: Any, devices: int) -> Any:
    """The first `devices` devices of `cluster` (module docstring)."""
    from hlomap.api import load_cluster
    from hlomap.cost.cluster import ClusterSpecError, first_devices

    try:
        loaded = load_cluster(cluster)
    except ClusterSpecError as err:
        raise ValueError(f"auto_shard: cluster={cluster!r}: {err}") from None
    if devices > loaded.n_devices:
        raise ValueError(f"auto_shard: cluster={cluster!r}: cluster {loaded.name!r} has {loaded.n_devices} devices, "
                         f"the mesh {devices}; pass mesh= for at most {loaded.n_devices}, or a cluster of {devices}")
    return first_devices(loaded, devices)


def measured_count(settings: Any, cluster: Any) -> int:
    """How many candidates auto_shard times for a plan priced on `cluster`: the setting's count
    when the plan runs where it was planned (`runs_where_planned`), else 0."""
    if settings is None or not settings.enabled:
        return 0
    import jax

    from hlomap.run.measure import runs_where_planned

    device = jax.devices()[0]
    return settings.count if runs_where_planned([d.name for d in cluster.devices], device.device_kind,
                                                device.platform) else 0


def _platform() -> str:
    import jax

    return jax.devices()[0].platform


# ---------------------------------------------------------------------------------------------
# Argument signatures (what makes the step capture again)
# ---------------------------------------------------------------------------------------------

def signature(args: Sequence[Any]) -> tuple[Any, ...]:
    """Tree structure, shapes and dtypes of each argument: `jax.jit`'s retrace condition. Every
    plan's step returns the user's pytrees, so the state it hands back has the signature it got."""
    import jax

    out = []
    for arg in args:
        leaves, treedef = jax.tree_util.tree_flatten(arg)
        out.append((treedef, tuple((getattr(x, "shape", ()), getattr(x, "dtype", type(x))) for x in leaves)))
    return tuple(out)


def abstract_args(args: Sequence[Any]) -> tuple[Any, ...]:
    """Shapes and dtypes only: capturing copies no weights."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    return tuple(jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x)), tuple(args)))


# ---------------------------------------------------------------------------------------------
# The decorated step
# ---------------------------------------------------------------------------------------------


class AutoShardedStep:
    """A train step that explores (or looks up) its plan at its first call (module docstring).

    `plan`, `cap`, `origin`, `plan_file`, `timings`: of the signature last called. `step`: the
    `hlomap.parallelize` step running it. `__wrapped__`: the undecorated function.
    """

    def __init__(self, step: Callable[..., Any], config: AutoShardConfig):
        functools.update_wrapper(self, step)
        self.config = config
        self._entries: dict[tuple[Any, ...], _Entry] = {}
        self._current: _Entry | None = None
        self._file_step: Any = None  # plan=PATH, built before the first call so that place() can lay out
        self._returned = ReturnedState()  # the state's signature, when it is what the last call returned
        self._keeps_state: dict[tuple[Any, ...], bool] = {}  # signature -> its step returns the state alike

    # -- what the last call ran ---------------------------------------------------------------------
    def _last(self) -> _Entry:
        if self._current is None:
            raise RuntimeError(f"{self.__name__}: no plan yet; call the step once (its first call explores)")
        return self._current

    @property
    def plan(self) -> Any:
        return self._last().plan

    @property
    def cap(self) -> Any:
        return self._last().cap

    @property
    def step(self) -> Any:
        return self._last().step

    @property
    def origin(self) -> Origin:
        return self._last().origin

    @property
    def plan_file(self) -> Path | None:
        """The cache entry (or plan=PATH) the plan was read from or saved to."""
        return self._last().path

    @property
    def timings(self) -> Timings:
        return self._last().timings

    def explain(self, *, console: Any = None) -> Any:
        """Print the plan as a table per variable (its spec and why: its linkage group, what else
        the group links, why a dim stays whole) and return the rows."""
        from hlomap.report.explain import print_explanation

        entry = self._last()
        return print_explanation(entry.plan, entry.cap, origin=entry.origin.value, path=entry.path,
                                 console=console)

    # -- state ----------------------------------------------------------------------------------------
    def place(self, params: Any, opt_state: Any) -> tuple[Any, Any]:
        """The state where the plan wants it. Before the first call there is no plan yet (it
        depends on the batch's shapes), so the state is returned as given and laid out by the
        first call; with `plan=PATH` it is laid out now."""
        if self._current is not None:
            return self._current.step.place(params, opt_state)
        if self.config.plan_path is not None:
            return self._plan_file_step().place(params, opt_state)
        return params, opt_state

    def gather(self, params: Any, opt_state: Any) -> tuple[Any, Any]:
        """The user's pytrees of params and opt_state, as numpy arrays on the host."""
        return self._last().step.gather(params, opt_state)

    # -- the call -------------------------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs:
            args = positional_arguments(self.__wrapped__, args, kwargs)
        known = self._returned.lookup(args)  # (signature, entry, program) of the call that returned this state
        if known is not None:
            rest = signature(args[STATE_ARGS:])
            if known[0][STATE_ARGS:] == rest and known[1] is self._current:  # a train loop's next step
                out = known[2](*args)
                self._returned.remember(out, known)
                return out
            sig = known[0][:STATE_ARGS] + rest
        else:
            sig = signature(args)
        entry = self._entries.get(sig)
        if entry is None:
            out = self._first_call(args, sig)
            entry = self._current
            self._keeps_state[sig] = signature(out[:STATE_ARGS]) == sig[:STATE_ARGS] if isinstance(out, tuple) else False
        else:
            if entry is not self._current:  # back to an earlier signature: the state follows its plan
                args = self._relocate(args, entry)
                self._current = entry
            out = entry.step(*args)
        if self._keeps_state[sig]:  # the state handed back has the signature it got: not flattened again
            self._returned.remember(out, (sig, entry, entry.step.direct() or entry.step))
        else:
            self._returned.forget()
        return out

    def _first_call(self, args: tuple[Any, ...], sig: tuple[Any, ...]) -> Any:
        entry = self._build(args)
        args = self._relocate(args, entry)
        start = time.perf_counter()
        out = entry.step(*args)
        _block(out)
        entry = dataclasses.replace(entry, timings=dataclasses.replace(entry.timings,
                                                                       first_call=time.perf_counter() - start))
        self._entries[sig] = entry
        self._current = entry
        return out

    def _relocate(self, args: tuple[Any, ...], entry: _Entry) -> tuple[Any, ...]:
        """Lay the state out for `entry`'s plan: the user's pytrees, whichever plan's step returned
        them (every plan's step takes and returns them)."""
        if len(args) < STATE_ARGS:
            return args
        params, opt_state = entry.step.place(args[0], args[1])
        return (params, opt_state, *args[STATE_ARGS:])

    # -- capture, look up, explore --------------------------------------------------------------------
    def _plan_file_step(self) -> Any:
        from hlomap.run import parallelize

        if self._file_step is None:
            self._file_step = parallelize(self.__wrapped__, _read_plan_file(self.config.plan_path))
        return self._file_step

    def _build(self, args: tuple[Any, ...]) -> _Entry:
        from hlomap.hlo.capture import capture
        from hlomap.run import parallelize

        start = time.perf_counter()
        abstract = abstract_args(args)
        cap = capture(self.__wrapped__, *abstract)
        captured = time.perf_counter()
        if self.config.plan_path is not None:
            plan = self._plan_file_step().plan
            try:
                plan.check_compatible(cap, where=f"plan={str(self.config.plan_path)!r}")
            except ValueError as err:
                raise ValueError(f"auto_shard: {err}") from None
            # One signature only: another shape is another module, which check_compatible refuses.
            return _Entry(cap, plan, self._plan_file_step(), Origin.FILE, self.config.plan_path,
                          Timings(captured - start, time.perf_counter() - captured, 0.0))
        import jax

        mesh = resolve_mesh(self.config.mesh, self.config.task, jax.local_device_count())
        resolving = time.perf_counter()
        cluster = priced_cluster(self.config.cluster, mesh_devices(mesh))
        resolved = time.perf_counter() - resolving
        measure = measured_count(self.config.measure, cluster)
        key = cache_key(cap.text_sha256, mesh, cluster, self.config.task, measure)
        path = cache_path(self.config.cache_dir, key) if self.config.cache_dir is not None else None
        plan = load_cached(path, cap) if path is not None else None
        looked_up = time.perf_counter()
        origin = Origin.CACHE
        explored = looked_up
        measuring = 0.0
        if plan is None:
            origin = Origin.EXPLORED
            plan = self._explore(cap, mesh, cluster, args if measure else None, measure)
            # The measuring's own wall time (its clock's), out of the exploration's.
            measuring = plan.measured.seconds if plan.measured is not None else 0.0
            if path is not None:
                try:
                    save_cached(path, plan)
                except OSError as err:  # the plan in hand still runs: only the cache misses it
                    warnings.warn(f"hlomap.auto_shard: could not cache the plan in {path} ({err}); running it "
                                  "uncached", RuntimeWarning, stacklevel=4)
                    path = None
            explored = time.perf_counter()
        log.info("auto_shard %s: %s plan (%s) %s", self.__name__, self.config.task.value,
                 ", ".join(f"{k}={v}" for k, v in mesh.items()),
                 f"read from {path}" if origin is Origin.CACHE else
                 f"explored in {explored - looked_up:.1f} s" + (f", saved to {path}" if path else ""))
        step = parallelize(_runnable(self.__wrapped__, plan, cap), plan, example_args=_pipeline_args(plan, abstract))
        return _Entry(cap, plan, step, origin, path,
                      Timings(captured - start, looked_up - captured - resolved,
                              max(0.0, explored - looked_up - measuring), measure=measuring, cluster=resolved), key)

    def _explore(self, cap: Any, mesh: dict[str, int], cluster: Any, args: tuple[Any, ...] | None,
                 measure: int) -> Any:
        """Search the plan; with `measure` > 0, time that many candidates on the present devices
        from copies of the call's own arguments (`args`: the user's arrays are not donated)."""
        from hlomap.api import explore

        config = self.config
        # the auto task's joint planner is exact (a DP over stage plans): it takes no agent
        how = "exact" if config.task is Task.AUTO else config.agent or "dqn"
        log.info("auto_shard %s: no cached plan; exploring %s on %s (%s, budget %s s)", self.__name__,
                 config.task.value, cluster.name, how, config.budget_seconds)
        options = dict(config.options)
        with _progress(config.progress, f"auto_shard / {config.task.value}") as on_progress:
            if on_progress is not None:
                options["on_progress"] = on_progress
            if measure:
                options["measure"] = dataclasses.replace(config.measure, count=measure)
                options["runnable"] = (self.__wrapped__, args)
            if not config.task.plans_its_mesh:  # the pipeline and joint tasks take the cluster's devices
                options["mesh"] = mesh
            if config.task is not Task.AUTO:  # the joint planner is exact: no agent, no budget
                options.update(agent=config.agent, budget_seconds=config.budget_seconds)
            return explore(cap, task=config.task.value, cluster=cluster, seed=config.seed, **options)


def _runnable(step: Callable[..., Any], plan: Any, cap: Any) -> Callable[..., Any]:
    """What `parallelize` runs: for an SPMD plan the captured program (its jit replays the
    capture's jaxpr instead of tracing the model again: about 0.3 s instead of 2 s for gpt-small);
    a pipeline plan cuts the user's own step, whose loss and gradient it must find."""
    return cap.program() if plan.pipeline is None and cap.jaxpr is not None else step


def _pipeline_args(plan: Any, abstract: tuple[Any, ...]) -> tuple[Any, ...] | None:
    """A pipeline plan is cut now, from the shapes (so `place` lays the state out per stage)."""
    return abstract if plan.pipeline is not None else None


def _block(out: Any) -> None:
    import jax

    jax.block_until_ready(jax.tree.leaves(out))


def _read_plan_file(path: Path) -> Any:
    from hlomap.plan import Plan

    if not path.is_file():
        raise ValueError(f"auto_shard: plan={str(path)!r}: no such file" + (" (a directory)" if path.is_dir() else ""))
    try:
        return Plan.load(path)
    except ValueError as err:  # malformed JSON or plan; the message names the file
        raise ValueError(f"auto_shard: plan={str(path)!r}: {err}") from None


@contextlib.contextmanager
def _progress(enabled: bool | None, description: str) -> Iterator[Callable[[Any], None] | None]:
    """The search's progress bar on a terminal (report/progress.py), nothing elsewhere."""
    from hlomap.report.progress import progress_bar

    with progress_bar(sys.stderr.isatty() if enabled is None else enabled, description=description) as update:
        yield update


# ---------------------------------------------------------------------------------------------
# The decorator
# ---------------------------------------------------------------------------------------------


def auto_shard(fn: Callable[..., Any] | None = None, *, mesh: int | Mapping[str, int] | str | None = None,
               cluster: Any = "local", task: Task | str = Task.AUTO, agent: str | None = None,
               budget_seconds: float | None = 60.0, seed: int = 0,
               cache_dir: str | os.PathLike[str] | None = None, cache: bool = True,
               plan: str | os.PathLike[str] | None = None, progress: bool | None = None,
               measure: int | Any = DEFAULT_MEASURE, measure_rounds: int = 10,
               measure_budget_seconds: float | None = 60.0, **options: Any) -> Any:
    """Explore a plan for a train step `fn(params, opt_state, batch, ...) -> (params, opt_state,
    ...)` at its first call, cache it on disk and run it (module docstring). Use as
    `@auto_shard(...)` or `auto_shard(fn, ...)`.

    mesh: 8, {"data": 2, "model": 4}, "data=2,model=4", or None for every local device; for
      task "auto" and "pipeline" only the number of devices counts (the planner picks the meshes).
    cluster: what the search prices: "local" (default: the devices JAX sees, measured once and
      cached; `hlomap.run.local`), a preset ("A", "B", "C"), a topology string ("hier:2x4", ...),
      a cluster JSON file or a Cluster;
      its first N devices for a mesh of N devices.
    task: "opp", "adp", "hybrid", "pipeline" or "auto" (`hlomap.api.explore`).
    agent, budget_seconds, seed, **options: passed to `hlomap.api.explore` (agent and
      budget_seconds: the searches of opp, adp, hybrid and pipeline; the auto task's joint planner
      is exact and refuses them).
    cache_dir: the plan cache (default $HLOMAP_CACHE_DIR or ~/.cache/hlomap); cache=False: none.
      Created and probed now: a folder given that cannot be written raises ValueError naming it;
      an unwritable default warns and runs without a cache.
    plan: a plan file to run instead of searching (checked against the captured step).
    progress: a progress bar during the search; None: when stderr is a terminal.
    measure: after a search, compile and time this many candidate plans on the present devices
      and run the measured fastest (`hlomap.explore`'s measure=K; its cost is `timings.measure`),
      when the plan runs where it was planned: the priced cluster's devices are the kind JAX
      shows (a cluster calibrated here, as `cluster="local"` is; not a preset of V100s priced from a
      CPU). 0 turns it off; a `hlomap.run.measure.MeasureSettings` sets everything.
    measure_rounds, measure_budget_seconds: interleaved timing rounds at most, and the seconds of
      timing after which the rounds stop.
    """
    config = make_config(mesh=mesh, cluster=cluster, task=task, agent=agent, budget_seconds=budget_seconds, seed=seed,
                         cache_dir=cache_dir, cache=cache, plan=plan, progress=progress, options=options,
                         measure=measure, measure_rounds=measure_rounds,
                         measure_budget_seconds=measure_budget_seconds)

    def decorate(step: Callable[..., Any]) -> AutoShardedStep:
        if not callable(step):
            raise TypeError(f"auto_shard decorates a train step function, not {step!r}")
        return AutoShardedStep(step, config)

    return decorate if fn is None else decorate(fn)


def make_config(*, mesh: int | Mapping[str, int] | str | None, cluster: Any, task: Task | str, agent: str | None,
                budget_seconds: float | None, seed: int, cache_dir: str | os.PathLike[str] | None, cache: bool,
                plan: str | os.PathLike[str] | None, progress: bool | None,
                options: Mapping[str, Any], measure: int | Any = 0, measure_rounds: int = 10,
                measure_budget_seconds: float | None = 60.0) -> AutoShardConfig:
    """Check the decorator's arguments when it is applied, not at the first call."""
    from hlomap.api import InputError, measure_settings
    from hlomap.plan import parse_mesh_text

    try:
        task = Task(getattr(task, "value", task))
    except ValueError:
        raise ValueError(f"auto_shard: task={task!r}; one of {', '.join(t.value for t in Task)}") from None
    for name, value, given in (("agent", agent, agent is not None), ("budget_seconds", budget_seconds,
                                                                       budget_seconds != 60.0)):
        if task is Task.AUTO and given:
            raise ValueError(f"auto_shard: {name}={value!r}: the auto task (the default) plans with an exact joint "
                             "planner, which takes no agent and no budget; give task= a search task to use it")
    if isinstance(mesh, str):
        try:
            mesh = parse_mesh_text(mesh)
        except ValueError as err:
            raise ValueError(f"auto_shard: mesh={mesh!r}: {err}") from None
    if isinstance(mesh, bool) or not (mesh is None or isinstance(mesh, (int, Mapping))):
        raise ValueError(f"auto_shard: mesh={mesh!r}; give a device count, a mapping such as "
                         "{'data': 2, 'model': 4}, or None for every local device")
    if mesh is not None and mesh_devices(mesh) < 1:
        raise ValueError(f"auto_shard: mesh={mesh!r} has no devices")
    frozen_mesh = mesh if mesh is None or isinstance(mesh, int) else tuple((str(k), int(v)) for k, v in mesh.items())
    plan_path = None if plan is None else Path(plan).expanduser()
    if plan_path is not None and not plan_path.is_file():
        raise ValueError(f"auto_shard: plan={str(plan)!r}: no such file")
    try:
        settings = measure_settings(measure, measure_rounds, measure_budget_seconds)
    except InputError as err:
        raise ValueError(f"auto_shard: {err}") from None
    directory = usable_cache_dir(cache_dir, cache)
    return AutoShardConfig(frozen_mesh, cluster, task, agent, budget_seconds, seed, directory, plan_path, progress,
                           tuple(sorted(options.items())), settings)
