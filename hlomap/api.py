"""The one public front that the CLI, the decorator and users call: every verb of the `hlomap`
command, on plain user-facing arguments (names, paths, mesh strings), returning data and printing
nothing.

    cap = load_source("zoo:gpt-small")          # or an HLO text file, or FILE.py:FUNCTION
    plan = explore(cap, task="opp", mesh={"model": 8}, cluster="A", agent="dqn", budget_seconds=60)
    est = estimate(cap, plan, cluster="A")       # or "dp" | "megatron" | "dp+megatron"
    sim = simulate_plan(cap, plan, cluster="A")     # any plan kind: SPMD, built-in, pipeline, joint
    checked = check_run(plan, "zoo:gpt-small")   # run on the local devices, compare with unsharded
    cluster, measured = calibrate(devices=8)     # measure the present devices; save_calibration(...)

Everything here resolves user-facing names (presets, files, built-in plans, mesh strings) into the
plain data the layers below take, and nothing below imports it. Which estimator prices a plan is
decided once, by `plan_category`.
"""

from __future__ import annotations

import enum
import logging
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

from hlomap.hlo.capture import Capture, Role, capture, from_module
from hlomap.plan import parse_mesh_text
from hlomap.tasks.pipeline.step_dag import EXPLORER_MAX_STATES

log = logging.getLogger(__name__)

#: The pipeline explorer's default bound on the exact agent's downset DP (`--downset-states`): 0,
#: off. On the zoo's captured steps the chain's segments already hold the useful cuts (resnet50
#: and t5-small at 8 stages: the same optimum), the DP takes 2-5x the linear one's time, and where
#: it wins on tiny models it is by a near-empty first stage; `EXPLORER_MAX_STATES` is the bound to ask for.
DOWNSET_STATES = 0
#: A bound that searches enough downsets for the zoo's steps in seconds.
SUGGESTED_DOWNSET_STATES = EXPLORER_MAX_STATES

__all__ = [
    "CalibrationProfileError",
    "ClusterChoice",
    "DumpedModule",
    "InputError",
    "JointExploration",
    "JointSimulation",
    "OneDeviceFaster",
    "PipelineExploration",
    "PipelineSimulation",
    "PlacementJob",
    "PlacementOutcome",
    "PlanCategory",
    "ReplanJob",
    "RunCheck",
    "RunPhase",
    "Simulation",
    "SourceError",
    "SpmdSimulation",
    "ZooEntry",
    "check_plan_for",
    "check_plan_specs",
    "check_run",
    "calibrate",
    "check_calibration",
    "check_replaceable_cluster_file",
    "check_writable",
    "dump_zoo",
    "zoo_hlo",
    "ensure_host_devices",
    "estimate",
    "explore",
    "explore_auto",
    "explore_auto_detailed",
    "explore_detailed",
    "explore_candidates",
    "explore_pipeline_detailed",
    "inspect_capture",
    "is_pipedream_graph",
    "is_step_file",
    "load_pipeline_source",
    "load_plan_file",
    "load_source",
    "measure_found",
    "measure_runnable",
    "measure_settings",
    "needs_module",
    "one_device_faster",
    "other_cluster_warning",
    "parse_mesh",
    "parse_mesh_text",
    "place",
    "plan_devices",
    "plan_fits",
    "plan_category",
    "plan_or_built_in",
    "prepare_placement",
    "prepare_replan",
    "read_calibration",
    "replan",
    "replan_policies",
    "replan_run",
    "require_roles",
    "resolve_cluster",
    "save_calibration",
    "simulate_plan",
    "user_errors",
    "zoo_entries",
]

ZOO_PREFIX = "zoo:"
PIPEDREAM_PREFIX = "pipedream:"


class SourceError(ValueError):
    """A SOURCE that names nothing hlomap can read."""


# ---------------------------------------------------------------------------------------------
# Sources
# ---------------------------------------------------------------------------------------------


def load_source(spec: str, *, trainable: Iterable[int | str] | None = None, trainable_prefix: Iterable[str] = (),
                module_index: int = 0) -> Capture:
    """`zoo:NAME` lowers a zoo train step abstractly; `FILE.py:FUNCTION` lowers a user's step
    (the function returns `(train_step, example_args)`, as `hlomap run --source` takes it);
    anything else is read as HLO text.

    For an HLO file holding several modules (split by `// -----`), `module_index` picks one.
    `trainable` (indices or HLO names) and `trainable_prefix` (starts of paths or names) name
    the trainable entry parameters of a bare dump; without them, a dump of a JAX step takes its
    roles from its parameters' names (`hlomap.hlo.capture.from_module`, `infer_roles`).
    """
    import dataclasses

    trainable_prefix = tuple(trainable_prefix)
    if spec.startswith(ZOO_PREFIX) or is_step_file(spec):
        for option, value, flag in (("trainable", trainable, "--trainable"),
                                    ("trainable_prefix", trainable_prefix, "--trainable-prefix"),
                                    ("module_index", module_index, "--module")):
            if value:
                raise OptionError(option, value, f"{spec} is lowered from JAX, which knows its parameters' roles and "
                                                 "has one module: the option reads HLO files", cli_flag=flag)
    if trainable and trainable_prefix:
        raise OptionError("trainable_prefix", list(trainable_prefix), "name the trainable parameters one way: by "
                          "index or name, or by path prefix, not both", cli_flag="--trainable-prefix")
    # a step lowered from JAX is named after the SOURCE that names it (`zoo:gpt-tiny`, not the
    # function's `jax:train_step`): reports, plan files and mismatch errors then say which step
    if spec.startswith(ZOO_PREFIX):
        return dataclasses.replace(_load_zoo(spec[len(ZOO_PREFIX):]), source=spec)
    if is_step_file(spec):
        return dataclasses.replace(_load_step_capture(spec), source=spec)
    return _load_file(Path(spec), trainable=trainable, trainable_prefix=trainable_prefix,
                      module_index=module_index)


def _load_zoo(name: str) -> Capture:
    from hlomap import zoo

    try:
        model = zoo.get(name)
    except KeyError as err:
        raise SourceError(str(err.args[0]) if err.args else f"unknown zoo model {name!r}") from None
    # Carried non-trained state inside params (batch-norm running statistics) is OTHER, not
    # trainable: the optimizer never updates it.
    params_arg = model.arg_names[0]
    roles = {f"{params_arg}/{path}": Role.OTHER for path in model.other_paths()}
    return capture(model.train_step(), *model.abstract_args(), arg_names=model.arg_names, roles=roles or None)


def is_step_file(spec: str) -> bool:
    """Whether SOURCE names a user's step, `FILE.py:FUNCTION`, rather than an HLO file."""
    path_text, sep, name = spec.rpartition(":")
    return bool(sep) and path_text.endswith(".py") and name.isidentifier()


def _load_step_capture(spec: str) -> Capture:
    """The Capture of a user's `FILE.py:FUNCTION` step, lowered from its example arguments."""
    from hlomap.run.errors import RunError
    from hlomap.run.source import load_step_file

    try:
        step, example = load_step_file(spec)
    except RunError as err:
        raise SourceError(str(err).removeprefix("--source ")) from None
    return capture(step, *example)


def _load_file(path: Path, *, trainable: Iterable[int | str] | None, trainable_prefix: tuple[str, ...],
               module_index: int) -> Capture:
    from hlomap.hlo.parser import parse_all

    if not path.exists():
        raise SourceError(f"{path}: no such file (SOURCE is an HLO text file, zoo:NAME or FILE.py:FUNCTION)")
    if path.is_dir():
        raise SourceError(f"{path}: is a directory, expected an HLO text file")
    if path.suffix == ".py":
        raise SourceError(f"{path}: a Python file, not HLO text; name the function that returns (train_step, "
                          f"example_args): {path}:FUNCTION")
    try:
        text = path.read_text()
    except UnicodeDecodeError as err:
        raise SourceError(f"{path}: not a text file ({err.reason} at byte {err.start})") from None
    if text.lstrip().startswith("{"):  # HLO text starts with `HloModule`; JSON is a plan or a cluster
        raise SourceError(f"{path}: a JSON file, not HLO text (SOURCE is an HLO text file, zoo:NAME or "
                          "FILE.py:FUNCTION; a plan file is what hlomap simulate --plan and hlomap run take)")
    modules = parse_all(text, filename=str(path))
    if not 0 <= module_index < len(modules):
        raise SourceError(f"{path}: holds {len(modules)} module(s); --module {module_index} is out of range")
    # The source hash identifies the module a plan was made for; hash the module's own text
    # when the file holds several.
    own_text = text if len(modules) == 1 else None
    try:
        return from_module(modules[module_index], trainable=trainable, trainable_prefix=trainable_prefix,
                           source=str(path), text=own_text, infer_roles=True)
    except ValueError as err:  # an index out of range, an unknown name, a prefix matching nothing
        raise SourceError(f"{path}: {err}") from None


def is_pipedream_graph(path: str | Path) -> bool:
    """True when `path` is a PipeDream profiled layer graph (its first line is a `nodeN -- `
    record), not HLO text."""
    path = Path(path)
    if not path.is_file():
        return False
    with path.open(errors="replace") as handle:
        for line in handle:
            if line.strip():
                return re.match(r"^node\d+ -- ", line) is not None
    return False


def load_pipeline_source(spec: str | Path, *, trainable: Sequence[int | str] | None = None,
                         trainable_prefix: Iterable[str] = ()) -> Any:
    """What the pipeline explorer takes, from a SOURCE: a PipeDream graph (`pipedream:PATH`, or
    a file recognised by its content) becomes a per-minibatch `PipelineProfile`; `zoo:NAME` or
    an HLO text file becomes a `Capture` (`trainable` naming the weights of a bare dump)."""
    text = str(spec)
    if text.startswith(PIPEDREAM_PREFIX):
        path = Path(text[len(PIPEDREAM_PREFIX):])
        if not path.is_file():
            raise SourceError(f"{path}: no such PipeDream profile (pipedream:PATH names a PipeDream graph file)")
        spec = path
    if text.startswith(PIPEDREAM_PREFIX) or is_pipedream_graph(spec):
        from hlomap.tasks.pipeline.pipedream import load_pipedream

        return load_pipedream(spec)
    return load_source(text, trainable=trainable, trainable_prefix=trainable_prefix)


# ---------------------------------------------------------------------------------------------
# Meshes
# ---------------------------------------------------------------------------------------------


def parse_mesh(mesh: Mapping[str, int] | int | str, task: Any = "opp") -> dict[str, int]:
    """`{"model": 8}`, `8` or `"8"` (one axis, named `model`, or `data` for ADP) or
    `"data=2,model=4"`; the hybrid task needs two axes. `simulate` and `explore` read --mesh
    through this one function, so they accept and reject the same strings."""
    from hlomap.tasks.sharding.space import mesh_shape  # not .problem: parsing a mesh needs no search

    try:
        return mesh_shape(mesh, task)
    except OptionError:
        raise
    except ValueError as err:  # a PlanError from the text's parser, or the shape's own check
        raise OptionError("mesh", mesh, str(err).removeprefix(f"mesh {mesh!r}: ")) from None


# ---------------------------------------------------------------------------------------------
# Explore and estimate
# ---------------------------------------------------------------------------------------------


#: The searches of the sharding tasks (opp, adp, hybrid) and of the pipeline task.
SHARDING_AGENTS = ("dqn", "random", "greedy", "exact")
PIPELINE_AGENTS = ("dqn", "dqn-infer", "dp")

def check_agent(task: str, agent: Any) -> None:
    """OptionError unless `agent` is a search `task` runs (`SHARDING_AGENTS`, `PIPELINE_AGENTS`;
    the auto task takes none; None: the task's default): checked before anything is loaded."""
    if agent is None:
        return
    name = str(getattr(agent, "value", agent))
    agents = SHARDING_AGENTS if task in ("opp", "adp", "hybrid") else PIPELINE_AGENTS if task == "pipeline" else None
    if agents is not None and name not in agents:
        raise OptionError("agent", name, f"the {task} task takes {', '.join(agents)}")


#: The sharding tasks' mesh and reward, and the searches' agent and budget, where `explore` is
#: given none (the auto task's joint planner is exact: it takes no agent and no budget).
DEFAULT_EXPLORE_MESH = 8
DEFAULT_REWARD = "paper"
DEFAULT_AGENT = "dqn"
DEFAULT_BUDGET_SECONDS = 60.0
#: explore's tasks, and the keywords of the searches each hands its options to: what it reads.
EXPLORE_TASKS = ("opp", "adp", "hybrid", "pipeline", "auto")
#: Keywords `explore` takes itself (positional there), not options of a task's search.
_EXPLORE_OWN = frozenset({"cap", "source", "task", "mesh", "cluster", "agent", "budget_seconds", "seed", "reward"})


def task_options(task: str) -> frozenset[str]:
    """The keyword options `explore(..., task=task, **options)` reads: its search's keywords."""
    import inspect

    from hlomap.tasks.joint.explore import explore_joint
    from hlomap.tasks.pipeline.explore import explore_pipeline, explore_pipeline_plan
    from hlomap.tasks.sharding.problem import explore_sharding

    searches = {"auto": (explore_auto_detailed, explore_joint),
                "pipeline": (explore_pipeline_plan, explore_pipeline)}.get(task, (explore_sharding,))
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return frozenset(p.name for search in searches for p in inspect.signature(search).parameters.values()
                     if p.kind in named) - _EXPLORE_OWN


def check_explore_arguments(task: str, mesh: Any, budget_seconds: Any, seed: Any, reward: Any,
                            options: Mapping[str, Any], agent: Any = None) -> None:
    """OptionError for an argument of `explore` of the wrong type or value, named as given, before
    anything is loaded (each reached Python's own TypeError or an enum's ValueError deep inside)."""
    from hlomap.cost.pipeline.stages import Schedule
    from hlomap.tasks.pipeline.schedules import AUTO_SCHEDULE
    from hlomap.tasks.sharding.objective import RewardMode

    for given, value in (("mesh", mesh), ("reward", reward)):
        if value is not None and task in ("pipeline", "auto"):  # they choose their stages' meshes
            raise OptionError(given, value, f"task {task!r} does not read it (an option of opp, adp, hybrid); "
                                            f"the {task} task chooses its stages' devices itself")
    for given, value, unset in (("agent", agent, agent is None),
                                ("budget_seconds", budget_seconds, budget_seconds == DEFAULT_BUDGET_SECONDS)):
        if task == "auto" and not unset:
            raise OptionError(given, value, "task 'auto' does not read it (an option of opp, adp, hybrid, pipeline): "
                                            "its joint planner is exact, a search with no agent and no budget")
    if not (mesh is None or isinstance(mesh, (Mapping, str)) or _whole(mesh)):
        raise OptionError("mesh", mesh, "expected a mapping such as {'data': 2, 'model': 4}, a device count such as "
                                        "8, or text such as 'data=2,model=4'")
    if budget_seconds is not None and not (isinstance(budget_seconds, (int, float)) and not isinstance(
            budget_seconds, bool) and budget_seconds > 0):
        raise OptionError("budget_seconds", budget_seconds, "expected a number of seconds > 0, or None for no limit")
    if not _whole(seed):
        raise OptionError("seed", seed, "expected a whole number")
    rewards = [mode.value for mode in RewardMode]
    if reward is not None and str(getattr(reward, "value", reward)) not in rewards:
        raise OptionError("reward", reward, f"expected one of {', '.join(rewards)}")
    schedule = options.get("schedule")
    schedules = [s.value for s in Schedule] + [AUTO_SCHEDULE]
    if task == "pipeline" and schedule is not None and str(getattr(schedule, "value", schedule)) not in schedules:
        raise OptionError("schedule", schedule, f"expected one of {', '.join(schedules)}")


def _whole(value: Any) -> bool:
    """Whether `value` is a whole number (an int, not a bool)."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_task_options(task: str, options: Mapping[str, Any]) -> None:
    """OptionError for an option `task` does not read, naming the tasks that do (the CLI refuses
    its flags the same way: `hlomap.cli.explore.TASK_OPTIONS`)."""
    if task not in EXPLORE_TASKS:
        return
    unread = sorted(set(options) - task_options(task))
    if unread:
        readers = [t for t in EXPLORE_TASKS if unread[0] in task_options(t)]
        where = f"an option of {', '.join(readers)}" if readers else "no task reads it"
        own = _TASK_SPELLINGS.get((unread[0], task))
        where += f"; the {task} task's is {own}" if own else ""
        raise OptionError(unread[0], options[unread[0]], f"task {task!r} does not read it ({where})")


#: An option one task spells otherwise: (option, task) -> that task's keyword.
_TASK_SPELLINGS = {("stages", "auto"): "max_stages", ("max_stages", "pipeline"): "stages",
                   ("shard_optimizer_state", "auto"): "split_state"}


#: Measured selection's bounds unless told: interleaved rounds at most, and seconds of timing.
MEASURE_ROUNDS = 10
MEASURE_BUDGET_SECONDS = 60.0


def explore_detailed(cap: Capture, task: Any = "opp", mesh: Mapping[str, int] | int | str = 8, cluster: Any = "A",
                     agent: Any = "dqn", budget_seconds: float | None = 60.0, seed: int = 0, reward: Any = "paper",
                     **options: Any) -> Any:
    """`explore` for the sharding tasks, returning the whole `Exploration` (plan, search result,
    space, graph) that reports and benchmarks need."""
    from hlomap.tasks.sharding.problem import explore_sharding

    return explore_sharding(cap, task, parse_mesh(mesh, task), _cluster_arg(cluster), agent, budget_seconds, seed, reward,
                            **options)


def explore(cap: Capture | str, task: Any = "opp", mesh: Mapping[str, int] | int | str | None = None, cluster: Any = "A",
            agent: Any = None, budget_seconds: float | None = DEFAULT_BUDGET_SECONDS, seed: int = 0, reward: Any = None,
            *, measure: int | Any = 0, measure_rounds: int = MEASURE_ROUNDS,
            measure_budget_seconds: float | None = MEASURE_BUDGET_SECONDS,
            runnable: tuple[Callable[..., Any], Sequence[Any]] | None = None,
            on_measure_round: Callable[[int, int], None] | None = None, **options: Any) -> Any:
    """Search a plan for `cap` and return it as a `hlomap.plan.Plan`.

    task: "opp" (tensor parallelism of the trainable variables), "adp" (data inputs), "hybrid"
    (both, on a data x model mesh). mesh: `{"model": 8}`, `8` or `"data=2,model=8"` (default 8). cluster: a
    preset name ("A", "B", "C"), a topology string ("hier:2x4", "torus:4x4", ...), "local" (the
    devices JAX sees, calibrated on first use), a JSON path or a Cluster (used by the cost reward
    and for the plan's estimate; it must have the mesh's devices). agent: "dqn" (default), "random",
    "greedy" or "exact". reward: "paper" (default) or "cost". Options: budget_evaluations, output (path
    saved as the search runs), graph, replicate_residual, dqn_config, with_estimate, on_progress.

    task "auto" plans the whole cluster at once (pipeline stages with data and tensor
    parallelism inside each, Alpa-style two-level search): options schedule, microbatches,
    max_stages, output; see `explore_auto`.

    task "pipeline" decides stage cuts instead: agent "dqn", "dqn-infer" or "dp"; mesh and
    reward do not apply. Options: stages (the most it cuts; default: one per server of the cluster),
    microbatches, schedule, episodes, finetune_episodes, compare_dp, output, on_progress. The
    plan's parameters stay replicated and its `pipeline` section holds the cuts, stage devices
    and replication.

    measure=K (default 0: off): after the search, compile and time the best K distinct
    candidates on the present devices (the pick and the best of each family the task weighed
    always, so K may be raised; `measure_found`) in up to `measure_rounds` interleaved rounds,
    `measure_budget_seconds` of timing at most, and return the measured fastest, its `measured`
    section recording every candidate. It needs a runnable step: `cap` given as `zoo:NAME` or
    `FILE.py:FUNCTION`, or `runnable=(train_step, example_args)`. `measure` may also be a
    `hlomap.run.measure.MeasureSettings` (tests inject a clock and runnables through it).
    `on_measure_round(done, rounds)` hears each timed round.

    `cap` may also be a SOURCE string (`load_source`: zoo:NAME, FILE.py:FUNCTION, an HLO file).
    """
    if not isinstance(cap, (Capture, str)):
        raise InputError(f"explore: expected a Capture (hlomap.capture) or a SOURCE string such as 'zoo:gpt-tiny', "
                         f"got {type(cap).__name__}")
    name = str(getattr(task, "value", task))
    check_agent(name, agent)
    check_task_options(name, options)
    check_explore_arguments(name, mesh, budget_seconds, seed, reward, options, agent)
    agent = DEFAULT_AGENT if agent is None else agent
    mesh = DEFAULT_EXPLORE_MESH if mesh is None else mesh
    if name in ("opp", "adp", "hybrid"):
        mesh = parse_mesh(mesh, name)  # a mesh it cannot use, named before anything is loaded
    reward = DEFAULT_REWARD if reward is None else reward
    settings = measure_settings(measure, measure_rounds, measure_budget_seconds)
    for given, value, default in (("measure_rounds", measure_rounds, MEASURE_ROUNDS),
                                  ("measure_budget_seconds", measure_budget_seconds, MEASURE_BUDGET_SECONDS),
                                  ("runnable", runnable, None)):
        if not settings.enabled and value != default:  # as the CLI refuses --measure-rounds without --measure
            raise OptionError(given, value, "it serves measure=K, which is off (0)")
    step_and_args = measure_runnable(cap, runnable, seed) if settings.enabled else None
    cap = _capture_of(cap)
    if step_and_args is not None and runnable is not None:
        check_runnable_matches(cap, step_and_args[1])
    cluster = _cluster_arg(cluster)
    if name == "auto":
        if not settings.enabled:
            return explore_auto(cap, cluster=cluster, **options)
        found: Any = explore_auto_detailed(cap, cluster=cluster, **options)
    elif name == "pipeline":
        from hlomap.tasks.pipeline.explore import explore_pipeline_plan

        found = explore_pipeline_plan(cap, cluster=cluster, agent=str(getattr(agent, "value", agent)),
                                      budget_seconds=budget_seconds, seed=seed, **options)
        if not settings.enabled:
            return found
    else:
        found = explore_detailed(cap, task, mesh, cluster, agent, budget_seconds, seed, reward, **options)
        if not settings.enabled:
            return found.plan
    assert step_and_args is not None
    elsewhere = measuring_elsewhere(cluster)
    if elsewhere is not None:
        warnings.warn(elsewhere, stacklevel=2)
    chosen = measure_found(found, cap, cluster, settings, step_and_args, on_round=on_measure_round).plan
    if options.get("output") is not None:
        chosen.save(options["output"])
    return chosen


# ---------------------------------------------------------------------------------------------
# Measured selection: time the best candidates of a search on the present devices
# ---------------------------------------------------------------------------------------------

MEASURE_NEEDS_STEP = ("measuring needs a runnable step: name the SOURCE as zoo:NAME or FILE.py:FUNCTION (a function "
                      "returning (train_step, example_args)), or in Python pass runnable=(train_step, example_args)")


def measure_settings(measure: int | Any = 0, rounds: int = MEASURE_ROUNDS,
                     budget_seconds: float | None = MEASURE_BUDGET_SECONDS) -> Any:
    """`MeasureSettings` from `explore`'s measure arguments (a settings object passes as it is);
    InputError naming the argument for a bad value."""
    from hlomap.run.measure import MeasureSettings

    if isinstance(measure, MeasureSettings):
        return measure
    try:
        return MeasureSettings(count=measure, rounds=rounds, budget_seconds=budget_seconds)
    except (TypeError, ValueError) as err:
        raise InputError(str(err)) from None


def measure_runnable(source: Capture | str | None, runnable: tuple[Callable[..., Any], Sequence[Any]] | None = None,
                     seed: int = 0) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """(train step, real example arguments) that measuring runs: `runnable` when given, else
    those of a `zoo:NAME` or `FILE.py:FUNCTION` SOURCE; InputError for anything else (an HLO
    file, a Capture alone), checked before any search."""
    if runnable is not None:
        if not (isinstance(runnable, tuple) and len(runnable) == 2 and callable(runnable[0])):
            raise InputError(f"runnable={runnable!r}: expected (train_step, example_args)")
        return runnable[0], tuple(runnable[1])
    if isinstance(source, str) and (source.startswith(ZOO_PREFIX) or is_step_file(source)):
        step, example, _ = _run_source(source, seed)
        return step, tuple(example)
    what = source if isinstance(source, str) else "a Capture"
    raise InputError(f"{what}: {MEASURE_NEEDS_STEP}")


def measuring_elsewhere(cluster: Any) -> str | None:
    """Why timing the candidates of a plan priced on `cluster` on the devices JAX sees would not
    say which is fastest where it was planned (`hlomap.run.measure.measures_elsewhere`: a preset of
    V100s measured on CPUs), or None."""
    import jax

    from hlomap.cost.cluster import Cluster
    from hlomap.run.measure import measures_elsewhere

    cluster = cluster if isinstance(cluster, Cluster) else load_cluster(cluster)
    device = jax.devices()[0]
    return measures_elsewhere(cluster, device.device_kind, device.platform, jax.device_count())


def check_runnable_matches(cap: Capture, args: Sequence[Any]) -> None:
    """InputError naming the first argument leaf of `runnable`'s example whose shape or dtype is
    not the captured step's (or how their pytrees differ): measuring times the candidates on
    these arguments, and a step of other shapes would time another program than the one planned.
    Nothing is checked against a bare HLO dump, whose arguments hlomap does not know as a pytree."""
    import jax
    import numpy as np

    if cap.args is None:
        return
    expected, expected_tree = jax.tree_util.tree_flatten_with_path(tuple(cap.args))
    given, given_tree = jax.tree_util.tree_flatten_with_path(tuple(args))
    if given_tree != expected_tree:
        raise InputError(f"runnable: its example arguments are not shaped like the step's captured ones "
                         f"({len(given)} array leaves against {len(expected)}; pytree {given_tree} against "
                         f"{expected_tree})")
    for (path, want), (_, have) in zip(expected, given):
        # as JAX will see it: without x64, a float64 NumPy array runs as float32, the same program
        shape = tuple(np.shape(have))
        dtype = np.dtype(jax.dtypes.canonicalize_dtype(getattr(have, "dtype", np.asarray(have).dtype)))
        if shape != tuple(want.shape) or dtype != np.dtype(want.dtype):
            name = jax.tree_util.keystr(path)
            raise InputError(f"runnable: example argument {name} is {dtype.name}{list(shape)}, but the step was "
                             f"captured with {np.dtype(want.dtype).name}{list(want.shape)}: measuring would time "
                             "another program than the one planned")


def explore_candidates(found: Any, cap: Capture, cluster: Any) -> list[Any]:
    """Every distinct candidate plan of a finished search (`hlomap.tasks.candidates`): `found`
    is a sharding `Exploration`, a pipeline Plan or `PipelineExploration`, or a
    `JointExploration`."""
    from hlomap.cost.cluster import Cluster
    from hlomap.tasks import candidates

    cluster = cluster if isinstance(cluster, Cluster) else load_cluster(cluster)
    if isinstance(found, JointExploration):
        import dataclasses

        from hlomap.tasks.joint.explore import explore_joint, joint_plan

        result = found.result
        model = result.model

        def fewer_stages(stages: int) -> Any:
            try:
                return explore_joint(cap, model.cluster, schedule=result.plan.schedule, max_stages=stages,
                                     with_grid=False, model=model, **found.bounds)
            except ValueError:  # NoFeasiblePlan: no plan of so few stages fits
                return None

        listed = candidates.candidates_for_joint(result, to_plan=joint_plan, resolve=fewer_stages)
        if found.joint is None:
            return listed
        # the refined plan is the pick; the joint planner's own plan stays among the candidates
        refined = candidates.Candidate(candidates.PICK, candidates.Family.SPMD, found.plan,
                                       float(found.plan.search["refined"]["step_seconds"]))
        renamed = [dataclasses.replace(c, name="joint pick") if c.name == candidates.PICK else c for c in listed]
        return candidates.distinct_candidates([refined, *renamed])
    if isinstance(found, PipelineExploration):
        from hlomap.tasks.pipeline.explore import pipeline_plan

        found = pipeline_plan(cap, found.result)
    if hasattr(found, "problem"):
        return candidates.candidates_for_sharding(found, cluster)
    return candidates.candidates_for_pipeline(cap, found, cluster)


def measure_found(found: Any, cap: Capture, cluster: Any, settings: Any,
                  runnable: tuple[Callable[..., Any], Sequence[Any]],
                  on_round: Callable[[int, int], None] | None = None,
                  on_candidates: Callable[[Sequence[Any]], None] | None = None) -> Any:
    """Time the best `settings.count` candidates of a finished search (`explore_candidates`,
    `select_candidates`) on the present devices and return the `MeasuredSelection`: the
    measured fastest plan, its `measured` section listing every timed candidate. A chosen plan
    other than the search's pick keeps the pick's search record. `on_candidates` hears the
    selected candidates before compiling (a progress bar's length)."""
    import dataclasses

    import jax

    from hlomap.run.measure import MeasuredSelection, MeasureError, measure_candidates, step_preparer
    from hlomap.tasks.candidates import PICK, select_candidates

    listed = explore_candidates(found, cap, cluster)
    selected = select_candidates(listed, settings.count)
    if len(selected) == 1:  # one program to run whatever is chosen (one device's plans are all one)
        log.info("measure: one distinct candidate plan, %s: nothing to choose, not timed", selected[0].name)
        return MeasuredSelection(selected[0].plan, selected[0], None)
    if on_candidates is not None:
        on_candidates(selected)
    prepare = settings.prepare or step_preparer(runnable[0], runnable[1])
    present, platform = jax.device_count(), jax.devices()[0].platform

    def prepare_here(plan: Any) -> Callable[[], Any]:
        needed = plan_devices(plan)
        if needed > present:
            raise InputError(f"needs {needed} devices; JAX sees {present} ({platform})")
        return prepare(plan)

    try:
        selection = measure_candidates(selected, prepare_here, settings, devices=present, platform=platform,
                                       on_round=on_round)
    except MeasureError as err:
        raise InputError(str(err)) from None
    pick = next((c for c in listed if c.name == PICK), None)
    if selection.chosen.name != PICK and pick is not None and pick.plan.search is not None:
        plan = dataclasses.replace(selection.plan, search=pick.plan.search)
        selection = dataclasses.replace(selection, plan=plan)
    return selection


def explore_auto(cap: Capture, *, cluster: Any = "A", schedule: str = "1f1b", microbatches: Sequence[int] | None = None,
                 max_stages: int | None = None, output: str | Path | None = None, **options: Any) -> Any:
    """The joint plan (`hlomap.tasks.joint`): stage cuts, each stage's device group, mesh shape
    and sharding, microbatches and schedule, by the exact two-level search, with Megatron-LM's
    expert grid priced beside it (in the plan's `search` record)."""
    return explore_auto_detailed(cap, cluster=cluster, schedule=schedule, microbatches=microbatches,
                                 max_stages=max_stages, output=output, **options).plan


def _warn_spec_disagreements(plan: Any, graph: Any, axes: Any, where: str) -> None:
    """Warn where a parameter's spec differs from its linkage group's sharding (`Plan.spec_disagreements`,
    a spec edited by hand on one leaf): the estimate prices the group as one, the runner places
    that leaf as its own spec says."""
    found = plan.spec_disagreements(graph, axes)
    if found:
        more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
        warnings.warn(f"{where}: {found[0]}{more}: the estimate prices linked dims alike, as the rest of the group is "
                      "sharded, while `hlomap run` places each parameter as its own spec says (resharding it in "
                      "the step); edit every parameter of the group alike, or build the plan with "
                      "hlomap.Plan.from_specs(..., strict=True)", stacklevel=3)


def check_estimate_arguments(plan: Any, mesh: Any) -> None:
    """InputError for a `plan` that is none of the kinds `estimate` prices, and OptionError for a
    `mesh` that is no mesh (each reached a deep error, or a numpy warning first)."""
    from hlomap.plan import Plan

    if plan is None or isinstance(plan, (bool, int, float, Mapping)):
        raise InputError(f"plan: expected a Plan, a plan file's path, a built-in plan name ({', '.join(BUILT_IN_PLANS)}) "
                         f"or a plan array, got {type(plan).__name__}")
    if mesh is None or isinstance(plan, Plan):
        return
    sizes = [mesh] if _whole(mesh) else list(mesh.values()) if isinstance(mesh, Mapping) else None
    if sizes is not None and not all(_whole(size) and size >= 1 for size in sizes):
        raise OptionError("mesh", mesh, "every axis needs a whole number of devices >= 1")


def estimate(cap: Capture, plan: Any, *, mesh: Mapping[str, int] | Any | int | None = None, cluster: Any = "A",
             axis_devices: Any = None, axis_order: Sequence[str] | None = None, graph: Any = None,
             overlap: Any = None, fusion: Any = None, executor: str | None = None, plan_name: str | None = None) -> Any:
    """Estimate one training step of `cap` under `plan` on `cluster` -> `StepEstimate`.

    `plan`: a `hlomap.plan.Plan` (its own mesh), a built-in plan name ("dp", "megatron",
    "dp+megatron"; `mesh` says the axes: {"data": 2, "model": 4}, or a device count), or a plan
    array over the factor graph's groups with `mesh` naming its axes. `cluster`: a preset name
    ("A", "B", "C"), a topology string, a JSON path or a Cluster. A placed Plan is priced on its
    placement's device order unless `axis_devices` or `axis_order` say otherwise. Raises
    PlanConflict for a plan with conflicts.

    A pipeline or joint plan is priced by its stages instead (`simulate_plan`), and its
    `PipelineSimulation` or `JointSimulation` is returned, priced on `executor` ("spmd" or
    "mpmd"; default the runner's choice); every kind answers `step_seconds` and `fits`.
    `plan_name` names the plan in the estimate (default: the built-in name, or "plan").

    `cap` may also be a SOURCE string (`load_source`) and `plan` a plan file's path. A Plan made
    for another step is refused (InputError saying what differs), not priced.
    """
    if executor is not None and executor not in ("spmd", "mpmd"):
        raise OptionError("executor", executor, "expected spmd or mpmd")
    check_estimate_arguments(plan, mesh)
    if isinstance(plan, Path) or (isinstance(plan, str) and plan.endswith(".json")):
        plan = load_plan_file(plan)
    if plan_category(plan) in (PlanCategory.PIPELINE, PlanCategory.JOINT):
        return simulate_plan(cap, plan, cluster=cluster, mesh=mesh, axis_order=axis_order, executor=executor)
    if executor is not None:
        raise OptionError("executor", executor, "the plan has no pipeline section (executors run pipelines)")
    cap = _capture_of(cap)
    if not isinstance(cap, Capture):
        raise InputError(f"cap: expected a Capture (hlomap.capture) or a SOURCE string, got {type(cap).__name__}")
    from hlomap.plan import Plan

    if isinstance(plan, Plan):
        check_plan_for(plan, cap, plan_name or "plan")
    from hlomap.cost import estimate as cost_estimate
    from hlomap.plan import resolve_plan
    from hlomap.propagation.graph import FactorGraph

    graph = graph if graph is not None else FactorGraph.from_capture(cap)
    array, axes, name = resolve_plan(graph, plan, mesh)
    if isinstance(plan, Plan):
        _warn_spec_disagreements(plan, graph, axes, plan_name or "the plan")
    name = plan_name or name
    if axis_devices is None and axis_order is None and getattr(plan, "placement", None) is not None:
        import numpy as np

        from hlomap.cost.mapping import AxisMapping

        # A placed plan runs its mesh on the placement's device order.
        axis_devices = AxisMapping(tuple(plan.mesh), np.asarray(plan.device_order()).reshape(
            [size for _, size in plan.mesh]))
    extra: dict[str, Any] = {}
    if overlap is not None:
        extra["overlap"] = overlap
    if fusion is not None:
        extra["fusion"] = fusion
    if getattr(plan, "state_sharding", None) is not None:
        extra["sharded_state"] = plan.sharded_state()
        over = ",".join(plan.state_sharding.axes)
        trainable = {p.index for p in cap.parameters if p.role is Role.TRAINABLE}
        name = (f"{name}, parameters and optimizer state split over {over} (FSDP)"
                if plan.state_sharding.splits_any(trainable) else
                f"{name}, optimizer state split over {over} (ZeRO-1)")
    return cost_estimate.estimate(cap, array, axes, cluster=_cluster_arg(cluster), axis_devices=axis_devices,
                                  axis_order=axis_order, graph=graph, plan_name=name, **extra)



def with_sharded_state(cap: Capture, plan: Any, *, mesh: Mapping[str, int] | Any | int | None = None,
                       graph: Any = None, where: str = "plan", parameters: bool = False) -> Any:
    """`plan` (a `Plan` or a built-in plan name with its `mesh`) with its optimizer state split
    over its data axes (ZeRO-1, `Plan.with_sharded_state`), with `parameters` its trainable
    parameters stored split there too (FSDP / ZeRO-3); InputError when it has no data axis."""
    from hlomap.plan import Plan, PlanError, resolve_plan
    from hlomap.propagation.graph import FactorGraph

    graph = graph if graph is not None else FactorGraph.from_capture(cap)
    if not isinstance(plan, Plan):
        array, axes, _ = resolve_plan(graph, plan, mesh)
        plan = Plan.from_groups(cap, graph, array, axes)
    try:
        return plan.with_sharded_state(graph, parameters=parameters)
    except PlanError as err:
        raise InputError(f"{where}: {err}") from None


# ---------------------------------------------------------------------------------------------
# Errors a user can cause
# ---------------------------------------------------------------------------------------------


class InputError(ValueError):
    """An argument hlomap cannot use (a plan file, a profile, an option's value): the message
    names the value and where it came from."""


class OptionError(InputError):
    """An option's value hlomap cannot use, named as its caller spelled it: `stages=9: ...` from
    Python, `--stages 9: ...` on the command line (`cli_text`)."""

    def __init__(self, option: str, value: Any, message: str, *, cli_flag: str | None = None):
        super().__init__(f"{option}={value!r}: {message}")
        self.option, self.value, self.message = option, value, message
        self.cli_flag = cli_flag or "--" + option.replace("_", "-")  # where the CLI's flag is spelt otherwise

    def cli_text(self) -> str:
        value = ",".join(map(str, self.value)) if isinstance(self.value, (tuple, list)) else self.value
        return f"{self.cli_flag} {value}: {self.message}"


class CalibrationProfileError(InputError):
    """A calibration profile that cannot be read (`profile` None) or applied (`profile` its path)."""

    def __init__(self, message: str, profile: str | None = None):
        super().__init__(message)
        self.profile = profile


def user_errors() -> tuple[type[BaseException], ...]:
    """Every exception that reports a user's mistake (bad file, bad HLO, unknown name, a plan
    that does not fit its module...): a front shows its message, never a traceback."""
    from hlomap.cost.cluster import ClusterSpecError
    from hlomap.cost.estimate import EstimateError
    from hlomap.cost.mapping import MappingError
    from hlomap.hlo.capture import StepTraceError
    from hlomap.hlo.parser import HloParseError
    from hlomap.plan import PlanError
    from hlomap.propagation.conflicts import PlanConflict
    from hlomap.tasks.pipeline.pipedream import PipeDreamParseError
    from hlomap.tasks.pipeline.solution import NoFeasiblePlan
    from hlomap.tasks.placement.problem import PlacementError
    from hlomap.tasks.replan.trace import TraceError
    from hlomap.tasks.sharding.exact import ExactTooLarge

    return (InputError, SourceError, HloParseError, ClusterSpecError, EstimateError, PlanError, MappingError,
            PlanConflict, ExactTooLarge, PipeDreamParseError, NoFeasiblePlan, PlacementError, TraceError,
            StepTraceError, FileNotFoundError, IsADirectoryError, PermissionError)


# ---------------------------------------------------------------------------------------------
# Outputs
# ---------------------------------------------------------------------------------------------


def check_writable(path: str | Path, example: str = "plan.json") -> None:
    """Raise InputError unless `path` can be written: checked before any work, so a long search
    never ends unable to save. The directory is probed by creating (and removing) a file in it,
    because permission bits do not tell: root passes every `access` check, yet cannot create a
    file in /sys or /proc (`plan.write_problem`). `example`: a file name to suggest inside a
    directory given for the file."""
    from hlomap.plan import write_problem

    if str(path) == "-":  # the shell's "standard output": hlomap writes files (and plots beside them)
        raise InputError(f"-: hlomap writes this to a file, not to standard output; name the file, e.g. {example}")
    path = Path(path)
    if path.is_dir():
        raise InputError(f"{path}: is a directory; name the file to write, e.g. {path / example}")
    if not path.parent.exists():
        raise InputError(f"{path.parent}: directory does not exist (for {path.name})")
    if not path.parent.is_dir():
        raise InputError(f"{path.parent}: not a directory (for {path.name})")
    problem = write_problem(path.parent)
    if problem is not None:
        raise InputError(f"{path}: not writable ({problem})")
    if path.exists() and not _opens_for_append(path):
        raise InputError(f"{path}: not writable")


def check_replaceable_cluster_file(path: str | Path) -> None:
    """InputError when `path` holds something other than a cluster file: `hlomap calibrate -o`
    replaces a cluster file it wrote before, never a plan (or any other file) a slip of the name
    would overwrite with a minute's measurement."""
    import json

    path = Path(path)
    if not path.is_file():
        return
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        data = None
    if isinstance(data, Mapping) and "devices" in data and ("calibration" in data or "bandwidth" in data):
        return
    what = "a plan" if isinstance(data, Mapping) and "mesh" in data and "parameters" in data else "not a cluster file"
    raise InputError(f"{path}: exists and is {what}; calibrate writes cluster files: name another file (or remove it)")


def _opens_for_append(path: Path) -> bool:
    try:
        with path.open("a"):
            return True
    except OSError:
        return False


# ---------------------------------------------------------------------------------------------
# Roles, inspection and the zoo
# ---------------------------------------------------------------------------------------------

ROLE_HELP = ("name the trainable entry parameters with --trainable 0-11,15 (indices, ranges or HLO names) or "
             "--trainable-prefix params (the start of their path or name); `hlomap inspect FILE` lists them")


def require_roles(cap: Capture, what: str, *, trainable: bool = True) -> None:
    """Refuse a search that would be nonsense without roles (ADP on a role-less dump would
    split the weights as if they were data)."""
    if not cap.has_roles:
        raise InputError(f"{cap.source} has no roles (a bare HLO dump whose parameters carry no names hlomap "
                         f"knows): {what} needs to know which parameters are weights; " + ROLE_HELP)
    if trainable and not cap.with_role(Role.TRAINABLE):
        raise InputError(f"{cap.source} names no trainable parameter: {what} splits weights; " + ROLE_HELP)


def inspect_capture(cap: Capture) -> dict[str, Any]:
    """What `hlomap inspect` reports, as JSON-ready data: opcode counts, computations, entry
    parameters with roles and bytes, and the FLOPs of one run as the cost model counts them
    (XLA's conventions, while loops times their trip counts; `simulate` reports the same)."""
    from hlomap.cost.compute import flops_by_opcode, module_flops
    from hlomap.hlo.stats import summarize

    summary = summarize(cap.module)
    flops = flops_by_opcode(cap.module)
    bytes_by_role: dict[str, int] = {}
    for p in cap.parameters:
        bytes_by_role[p.role.value] = bytes_by_role.get(p.role.value, 0) + p.byte_size
    return {
        "source": cap.source,
        "module": summary.name,
        "instructions": summary.instruction_count,
        "opcodes": dict(summary.opcode_counts),
        "computations": [{"name": c.name, "instructions": c.instruction_count, "entry": c.is_entry}
                         for c in summary.computations],
        "parameters": [{"index": p.index, "name": p.name, "path": p.path, "shape": list(p.shape.dims),
                        "dtype": p.dtype, "role": p.role.value, "bytes": p.byte_size} for p in cap.parameters],
        "parameter_bytes": sum(p.byte_size for p in cap.parameters),
        "parameter_bytes_by_role": bytes_by_role,
        "trainable_parameter_count": sum(p.shape.num_elements for p in cap.parameters if p.role is Role.TRAINABLE),
        "has_roles": cap.has_roles,
        "flops": module_flops(cap.module),
        "dot_flops": flops.get("dot", 0.0),
        "convolution_flops": flops.get("convolution", 0.0),
    }


@dataclass(frozen=True)
class ZooEntry:
    """One model of the zoo, as `hlomap zoo list` shows it."""

    name: str
    family: str
    parameters: int
    description: str
    #: dtype of its activations and dots (`zoo:NAME:DTYPE` picks another)
    compute_dtype: str = "float32"


def zoo_entries() -> list[ZooEntry]:
    from hlomap import zoo

    return [ZooEntry(name, model.family, model.parameters, model.description, model.compute_dtype)
            for name, model in ((name, zoo.get(name)) for name in zoo.names())]


@dataclass(frozen=True)
class DumpedModule:
    """An HLO text file written from a zoo step."""

    path: Path
    instructions: int
    characters: int


def zoo_hlo(name: str) -> str:
    """The HLO text of the zoo step `name` (or `zoo:name`), lowered abstractly."""
    return str(load_source(f"{ZOO_PREFIX}{name.removeprefix(ZOO_PREFIX)}").module)


def dump_zoo(name: str, output: str | Path) -> DumpedModule:
    """Lower the zoo step `name` (or `zoo:name`) abstractly and write its HLO text to `output`."""
    output = Path(output)
    name = name.removeprefix(ZOO_PREFIX)
    check_writable(output, f"{name}.hlo")
    cap = load_source(f"{ZOO_PREFIX}{name}")
    text = str(cap.module)
    output.write_text(text)
    return DumpedModule(output, cap.module.instruction_count, len(text))


# ---------------------------------------------------------------------------------------------
# Plans and clusters
# ---------------------------------------------------------------------------------------------

BUILT_IN_PLANS = ("dp", "megatron", "dp+megatron")


class PlanCategory(enum.Enum):
    """Which estimator prices a plan: the one place that reads a plan's pipeline section's kind."""

    BUILT_IN = "built-in"  # a reference plan by name ("dp", "megatron", "dp+megatron")
    SPMD = "spmd"  # one mesh, specs per parameter: `estimate`
    PIPELINE = "pipeline"  # stage cuts over device groups: priced from the stage profile it carries
    JOINT = "joint"  # stages each with its own data x model mesh: priced again from the module


def plan_category(plan: Any) -> PlanCategory:
    if isinstance(plan, str):
        return PlanCategory.BUILT_IN
    pipeline = getattr(plan, "pipeline", None)
    if pipeline is None:
        return PlanCategory.SPMD
    from hlomap.plan import PipelineKind

    return PlanCategory.JOINT if pipeline.kind is PipelineKind.JOINT else PlanCategory.PIPELINE


def load_plan_file(path: str | Path) -> Any:
    """A saved plan, or InputError saying what is wrong with the file (missing, a folder, not
    text, not JSON, not a plan, another version)."""
    from hlomap.plan import Plan, PlanError
    from hlomap.plan.model import read_plan_json

    path = Path(path)
    if not path.exists():
        raise InputError(f"{path}: No such file (a plan saved by hlomap explore or Plan.save)")
    if path.is_dir():
        raise InputError(f"{path}: is a directory, not a plan file")
    try:
        data = read_plan_json(path)
    except PlanError as err:
        raise InputError(str(err)) from None
    if not isinstance(data, dict):
        raise InputError(f"{path}: not a plan JSON file (the top level is a {type(data).__name__}, not an object)")
    try:
        return Plan.from_json(data, where=str(path))
    except ValueError as err:
        raise InputError(str(err)) from None


def plan_or_built_in(text: str) -> Any:
    """`dp`, `megatron`, `dp+megatron` name built-in reference plans; anything else is a file."""
    if text in BUILT_IN_PLANS:
        return text
    if not Path(text).exists():
        raise InputError(f"{text}: not dp, megatron, dp+megatron, nor an existing plan file")
    return load_plan_file(text)


def _plan_of(plan: Any) -> Any:
    """A verb's `plan` argument: a Plan as it is, a path read as a plan file."""
    return load_plan_file(plan) if isinstance(plan, (str, Path)) else plan


def _capture_of(source: Capture | str | None) -> Capture | None:
    """A verb's `source` argument: a Capture as it is, a SOURCE string loaded."""
    return load_source(source) if isinstance(source, str) else source


def check_plan_for(plan: Any, cap: Capture, where: str) -> None:
    """A saved plan must have been made for this module, and its specs must fit the shapes and
    mesh it names: checked before anything is compiled or estimated."""
    try:
        plan.check_compatible(cap, where=str(where))
        plan.check_specs(where=str(where))
    except ValueError as err:
        raise InputError(str(err)) from None


def batch_split_problems(plan: Any, cap: Capture) -> list[str]:
    """Why `hlomap run` would refuse to split `cap`'s batch as the pipeline or joint `plan` says
    (`hlomap.cost.pipeline.stages.splits_batch`): into its microbatches, and each microbatch over
    the data-parallel devices of every stage (a stage's `data` axis, or all its devices where the
    stage names no mesh). Empty when it splits, for other plans, and when the step's batch is not
    known. `simulate` still prices such a plan (a what-if) but says so."""
    from hlomap.cost.pipeline.stages import splits_batch

    section = getattr(plan, "pipeline", None)
    batch = cap.batch_size
    if section is None or batch is None:
        return []
    m = section.microbatches
    if not splits_batch(batch, m, 1):
        return [f"the batch of {batch} examples does not split into {m} equal microbatches"]
    problems = []
    for s, stage in enumerate(section.stages):
        ways = dict(stage.mesh).get("data", 1) if stage.mesh else len(stage.devices)
        if not splits_batch(batch, m, ways):
            problems.append(f"stage {s} splits each microbatch of {batch // m} examples over {ways} data-parallel "
                            "devices, which does not divide it")
    return problems


def check_plan_specs(plan: Any, where: str) -> None:
    """The plan's specs fit the shapes and mesh it names (no module needed)."""
    try:
        plan.check_specs(where=str(where))
    except ValueError as err:
        raise InputError(str(err)) from None


@dataclass(frozen=True)
class ClusterChoice:
    """The cluster a front names, and what the user should hear about it."""

    cluster: Any
    warnings: tuple[str, ...] = ()


def resolve_cluster(cluster: Any, profile: str | None = None) -> ClusterChoice:
    """The Cluster `cluster` names (a preset, a topology string, a JSON path or a Cluster),
    with a calibration `profile`'s efficiencies applied to the devices it was measured on."""
    from hlomap.cost.calibration import CalibrationError, apply_calibration, load_calibration

    loaded = load_cluster(cluster)
    if profile is None:
        return ClusterChoice(loaded)
    try:
        calibration = load_calibration(profile)
    except CalibrationError as err:  # names the file and the field already
        raise CalibrationProfileError(str(err)) from None
    try:
        calibrated = apply_calibration(loaded, calibration)
    except CalibrationError as err:
        raise CalibrationProfileError(str(err), profile) from None
    warnings: tuple[str, ...] = ()
    if calibration.backend and calibration.backend not in ("gpu", "cuda", "rocm"):
        warnings = (f"--profile {profile} was measured on the {calibration.backend} backend, not a GPU: its factors "
                    f"do not describe the {calibration.device}",)
    return ClusterChoice(calibrated, warnings)


def other_cluster_warning(plan: Any, cluster: Any) -> str | None:
    """A warning when `plan` was placed on another cluster than the one it is priced on."""
    placement = getattr(plan, "placement", None)
    name = getattr(cluster, "name", str(cluster))
    if placement is not None and placement.cluster and placement.cluster != name:
        return (f"the plan was placed on cluster {placement.cluster}, not {name}: its device order may not suit "
                f"this cluster (place it again with hlomap place --cluster {name})")
    return None


def other_cluster_note(plan: Any, cluster: Any) -> str | None:
    """A note when `plan` (a file) was explored and priced on another cluster than `cluster`:
    pricing it elsewhere is what simulate is for, but a default --cluster may not be what the
    user meant. None for a built-in plan or the same cluster, and for a placed plan: the cluster
    it was placed on is the one that counts (`other_cluster_warning`)."""
    if getattr(plan, "placement", None) is not None:
        return None
    estimate = getattr(plan, "estimate", None) or {}
    explored_on = estimate.get("cluster")
    name = getattr(cluster, "name", str(cluster))
    if not explored_on or explored_on == name:
        return None
    return f"pricing on cluster {name}; the plan was explored on {explored_on} ({_how_to_name(explored_on)})"


def _how_to_name(cluster_name: str) -> str:
    """How --cluster names the cluster called `cluster_name`: a preset, topology or `local` by that
    name; another calibrated cluster (whose name no --cluster spelling takes) by its file."""
    if _cluster_spelling(cluster_name) is None:
        return "--cluster prices it there given the cluster file it was explored on, or local if it was this machine"
    return f"--cluster {cluster_name} prices it there"


def _cluster_spelling(cluster_name: str) -> str | None:
    """`cluster_name` when --cluster takes it as it is (a preset, a topology string, `local`), else None."""
    from hlomap.cost.cluster import ClusterSpecError
    from hlomap.cost.cluster import load_cluster as load

    if is_local(cluster_name):
        return cluster_name
    try:
        load(cluster_name)
    except (ClusterSpecError, ValueError, OSError):
        return None
    return cluster_name


def _made_for(estimate: Any, placement: Any) -> str | None:
    """The cluster name a plan was made for: the one its placement chose devices on, else the one
    its estimate priced it on (from their JSON)."""
    for section in (placement, estimate):
        cluster = section.get("cluster") if isinstance(section, Mapping) else None
        if isinstance(cluster, str) and cluster:
            return cluster
    return None


def saved_plan_cluster(path: str | Path) -> str | None:
    """The cluster name a plan file was made for (`_made_for`), read from its JSON alone (nothing
    started: a plan explored on `local` needs the host devices set up before JAX starts); None
    when the file is not a plan JSON or records none."""
    from hlomap.plan import PlanError
    from hlomap.plan.model import read_plan_json

    try:
        data = read_plan_json(path)
    except (PlanError, OSError):
        return None
    return _made_for(data.get("estimate"), data.get("placement")) if isinstance(data, dict) else None


def explored_cluster(plan: Any) -> str | None:
    """The cluster a saved plan was made for (placed on, else explored on), spelt as --cluster
    takes it (a preset, a topology string, `local`); None for a built-in plan or a cluster only
    its file names."""
    placement = getattr(plan, "placement", None)
    made_for = _made_for(getattr(plan, "estimate", None), placement.to_json() if placement is not None else None)
    return _cluster_spelling(made_for) if made_for else None


# ---------------------------------------------------------------------------------------------
# Simulate: every plan kind
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SpmdSimulation:
    """An SPMD or built-in plan's estimate; a placed plan's also on the identity device order."""

    estimate: Any
    identity: Any = None
    placement: Any = None

    @property
    def fits(self) -> bool:
        return bool(self.estimate.fits)

    @property
    def step_seconds(self) -> float:
        return float(self.estimate.step_seconds)


@dataclass(frozen=True)
class PipelineSimulation:
    """A pipeline plan priced from the stage profile it carries, on its placement; plus the cost
    of the executor that runs it (`executor`), as a measured cluster knows it."""

    estimate: Any
    cluster_name: str
    placement: Any = None
    executor: str = ""
    executor_seconds: float = 0.0
    lockstep_seconds: float | None = None  # the batch as the spmd executor's lockstep ticks run it

    @property
    def fits(self) -> bool:
        return bool(self.estimate.placed.feasible)

    @property
    def step_seconds(self) -> float:
        """The batch time on the plan's placement as its executor runs it (the mpmd executor: the
        event simulator's schedule; the spmd one: lockstep ticks, `costs.lockstep_latency`), plus
        the executor's own cost."""
        length = self.estimate.placed.length if self.lockstep_seconds is None else self.lockstep_seconds
        return float(length) + self.executor_seconds


@dataclass(frozen=True)
class JointSimulation:
    """A joint plan priced again by the cost model: per stage layers, devices, mesh, time per
    microbatch and memory, then the step time and the transfers; the executor's cost is that of
    `executor`."""

    result: Any
    executor: str = ""
    executor_seconds: float = 0.0
    placement: Any = None  # the plan's placement section, when it has one (`result` is priced on it)
    identity_seconds: float | None = None  # a placed plan's L on its own device ids

    @property
    def fits(self) -> bool:
        return bool(self.result.cost.fits)

    @property
    def step_seconds(self) -> float:
        """The closed form's step time L over the stages priced again, plus the executor's cost."""
        cost = self.result.cost
        return float(cost.latency - cost.executor_seconds) + self.executor_seconds


def plan_executor(plan: Any, requested: str | None = None, where: str = "plan") -> str:
    """The executor a pipeline or joint plan runs on: `requested` when the plan allows it, else
    the runner's default for its schedule and stages (`hlomap.run.runner.choose_executor`)."""
    from hlomap.run.errors import RunError
    from hlomap.run.pipeline.section import pipeline_section
    from hlomap.run.runner import choose_executor

    try:
        section = pipeline_section(plan, where)
        return choose_executor(section.schedule, section.uniform, requested, section.repeats,
                               section.splits_state, bool(section.recompute), section.layered_recompute).value
    except RunError as err:
        raise InputError(_naming(where, err)) from None


Simulation = SpmdSimulation | PipelineSimulation | JointSimulation


def needs_module(plan: Any) -> bool:
    """Whether simulating `plan` reads the step's module (a pipeline plan carries its profile)."""
    return plan_category(plan) is not PlanCategory.PIPELINE


def reads_source(plan: Any, source: str | None) -> bool:
    """Whether a command given `plan` and the SOURCE `source` beside it captures the source: to
    price the plan (`needs_module`), or to check that the plan was made for it where pricing does
    not need it (a pipeline plan made for a module, beside a SOURCE that is one, not a PipeDream
    profile, which a pipeline plan may also come from)."""
    if not source:
        return False
    if needs_module(plan):
        return True
    return bool(plan.source.sha256) and not is_pipedream_graph(str(source))


def check_simulation_options(plan: Any, *, mesh: Any = None, axis_order: Sequence[str] | None = None,
                             where: str = "plan") -> None:
    """Refuse a mesh or axis order the plan fixes itself (a pipeline plan's stages, a placed
    plan's device order): checked before any module is read."""
    category = plan_category(plan)
    if category in (PlanCategory.PIPELINE, PlanCategory.JOINT) and (mesh is not None or axis_order):
        option, value = ("mesh", mesh) if mesh is not None else ("axis_order", axis_order)
        raise OptionError(option, value, f"a {category.value} plan's stages fix its devices and meshes: no mesh or "
                                         "axis order applies")
    if category is PlanCategory.SPMD and plan.placement is not None and axis_order:
        raise InputError(f"{where} is placed: its placement fixes the device order, so --axis-order does not apply")


def simulate_plan(cap: Capture | str | None, plan: Any, *, cluster: Any = "A", mesh: Mapping[str, int] | int | None = None,
                  axis_order: Sequence[str] | None = None, where: str = "plan", executor: str | None = None,
                  shard_optimizer_state: bool = False, shard_parameters: bool = False) -> Simulation:
    """Price one step of `plan` on `cluster`, whatever its kind (`plan_category`): an SPMD plan or
    a built-in one by `estimate` (a placed plan also on the identity order, for comparison), a
    pipeline plan from its stage profile, a joint plan again from `cap`'s module. `cap` may be
    None for a pipeline plan (`needs_module`). `cap` and `plan` may also be given as a SOURCE
    string and a built-in plan name or plan file. `executor` ("spmd" or "mpmd", default the
    runner's choice) prices a pipeline or joint plan on that executor. `shard_optimizer_state`
    prices an SPMD or built-in plan with its optimizer state split over its data axes (ZeRO-1,
    `Plan.with_sharded_state`), `shard_parameters` with its trainable parameters stored split
    there too (FSDP / ZeRO-3; implies `shard_optimizer_state`)."""
    import dataclasses

    from hlomap.cost.cluster import Cluster
    from hlomap.cost.estimate import pass_buffers, state_leaves
    from hlomap.cost.pipeline.costs import executor_overhead, mean_stage_devices

    plan = plan_or_built_in(plan) if isinstance(plan, (str, Path)) else plan
    cap = _capture_of(cap)
    cluster = cluster if isinstance(cluster, Cluster) else load_cluster(cluster)  # this module's: `local` too
    check_simulation_options(plan, mesh=mesh, axis_order=axis_order, where=where)
    category = plan_category(plan)
    if category not in (PlanCategory.PIPELINE, PlanCategory.JOINT) and executor is not None:
        raise InputError(f"executor {executor!r}: {where} has no pipeline section (executors run pipelines)")
    if category in (PlanCategory.PIPELINE, PlanCategory.JOINT) and (shard_optimizer_state or shard_parameters):
        raise InputError(f"{where}: sharding the optimizer state or the parameters over data replicas applies to "
                         f"SPMD plans, not to a {category.value} plan")
    if category in (PlanCategory.PIPELINE, PlanCategory.JOINT):
        chosen = plan_executor(plan, executor, where)
        section = plan.pipeline
        overhead = executor_overhead(cluster, chosen, section.n_stages * section.repeats, section.microbatches,
                                     section.schedule, pass_buffers(cap) if cap is not None else 0.0,
                                     mean_stage_devices(section.stages), state_leaves(cap) if cap is not None else 0.0)
    if category is PlanCategory.PIPELINE:
        from hlomap.tasks.placement.place import estimate_pipeline_plan, lockstep_pipeline_seconds

        if cap is not None:  # priced from its own stage profile, but made for one step: not another's
            check_plan_for(plan, cap, where)

        lockstep = lockstep_pipeline_seconds(plan, cluster, where=where) if chosen == "spmd" else None
        return PipelineSimulation(estimate_pipeline_plan(plan, cluster, where=where), cluster.name, plan.placement,
                                  chosen, overhead, lockstep)
    if cap is None:
        raise InputError(f"{where}: a {category.value} plan is priced from the step's module: name its SOURCE")
    if category is PlanCategory.JOINT:
        from hlomap.tasks.joint.explore import reprice_joint_plan
        from hlomap.tasks.joint.layout import priced_on

        check_plan_for(plan, cap, where)
        try:
            result = reprice_joint_plan(cap, cluster, plan.pipeline)
        except ValueError as err:
            raise InputError(f"--plan {where}: {err}") from None
        order = plan.device_order()
        if max(order) >= cluster.n_devices:
            raise InputError(f"--plan {where}: its placement uses device {max(order)} but cluster {cluster.name!r} "
                             f"has {cluster.n_devices} devices")
        # each stage's collectives and cuts on the devices it runs on (its placement's, if any)
        placed = dataclasses.replace(result, cost=priced_on(result.model, result.plan, order))
        identity = (priced_on(result.model, result.plan, plan.logical_devices()).latency
                    if plan.placement is not None else None)
        return JointSimulation(placed, chosen, overhead, plan.placement, identity)
    placed = category is PlanCategory.SPMD and plan.placement is not None
    if category is PlanCategory.SPMD:
        check_plan_for(plan, cap, where)
    else:
        require_roles(cap, f"the built-in plan {plan!r}")
    name = plan if isinstance(plan, str) else None
    if shard_optimizer_state or shard_parameters:
        plan = with_sharded_state(cap, plan, mesh=mesh, where=where, parameters=shard_parameters)
        mesh = None
    est = estimate(cap, plan, mesh=mesh, cluster=cluster, axis_order=axis_order, plan_name=name)
    identity = estimate(cap, dataclasses.replace(plan, placement=None), mesh=mesh, cluster=cluster) if placed else None
    return SpmdSimulation(est, identity, plan.placement if placed else None)


# ---------------------------------------------------------------------------------------------
# Explore: the pipeline and joint tasks in detail
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PipelineExploration:
    """What the pipeline task found: its result, the Capture it was made for (None for a
    PipeDream profile) and notes on stages the runner cannot split."""

    result: Any
    cap: Capture | None
    notes: tuple[str, ...] = ()

    @property
    def fits(self) -> bool:
        return not self.result.simulation.violations


def explore_pipeline_detailed(source: Any, *, stages: int, microbatches: int, schedule: str, cluster: Any,
                              agent: str, seed: int = 0, budget_seconds: float | None = None, episodes: int = 2000,
                              finetune_episodes: int = 0, compare_dp: bool = False, name: str = "",
                              output: str | Path | None = None,
                              on_progress: Callable[[Any], None] | None = None,
                              downset_states: int = DOWNSET_STATES) -> PipelineExploration:
    """The pipeline task on `source` (a Capture, or a PipeDream profile from
    `load_pipeline_source`); the best plan so far is saved to `output` as the search improves
    it, so an interrupted search keeps it. `downset_states`: the exact agent's bound on the
    downset DP (0, the default: the chain's order only; `SUGGESTED_DOWNSET_STATES` searches the zoo's steps in seconds)."""
    import json

    from hlomap.plan import write_atomic
    from hlomap.tasks.pipeline.explore import explore_pipeline, pipeline_plan, unsplittable_stages

    cap = source if isinstance(source, Capture) else None
    cluster = load_cluster(cluster)
    if stages > cluster.n_devices:
        raise OptionError("stages", stages, f"cluster {cluster.name} has {cluster.n_devices} devices, so at most "
                                            f"{cluster.n_devices} stages")

    def save(result: Any) -> None:
        if output is None:
            return
        if cap is not None:
            pipeline_plan(cap, result, seed=seed).save(output)
        else:  # a PipeDream profile has no HLO module to tie a Plan to: save the result itself
            write_atomic(Path(output), json.dumps(result.to_json(), indent=1) + "\n")

    result = explore_pipeline(source, stages=stages, microbatches=microbatches, schedule=schedule, cluster=cluster,
                              agent=agent, seed=seed, budget_seconds=budget_seconds, episodes=episodes,
                              finetune_episodes=finetune_episodes, compare_dp=compare_dp, name=name, on_best=save,
                              on_progress=on_progress,
                              downset_states=downset_states)
    save(result)
    notes = tuple(unsplittable_stages(cap, result)) if cap is not None else ()
    found_stages = result.plan.n_stages
    if found_stages < stages and not result.interrupted:  # stages is the most it cuts, not a count it must
        notes += (f"{found_stages} stage{'s' if found_stages != 1 else ''} of the {stages} allowed: fewer stages "
                  f"priced faster on {cluster.name} (stages is the most the search cuts)",)
    return PipelineExploration(result, cap, notes)


@dataclass(frozen=True)
class JointExploration:
    """The joint (auto) task's result and the plan it returns; `joint` is the plan made from the
    result when a sharding search on its mesh replaced it (`refined_sharding`), else None."""

    result: Any
    plan: Any
    joint: Any = None
    #: what bounded the search (microbatches, recompute, split_state, shard_parameters, kinds): a
    #: candidate of fewer stages is searched within the same bounds
    bounds: Mapping[str, Any] = field(default_factory=dict)

    @property
    def fits(self) -> bool:
        return bool(self.result.cost.fits)


#: The schedules the joint planner takes: its DP plans under the closed form of 1F1B or GPipe;
#: "auto" then prices the plan under 1F1B, ZB-H1 and GPipe by the event timeline and keeps the
#: fastest that fits (interleaving is the pipeline task's only).
JOINT_SCHEDULES = ("1f1b", "gpipe", "auto")


def explore_auto_detailed(cap: Capture, *, cluster: Any = "A", schedule: str = "1f1b",
                          microbatches: int | Sequence[int] | None = None, max_stages: int | None = None,
                          output: str | Path | None = None, **options: Any) -> JointExploration:
    """`explore_auto`, returning the search's result beside the plan."""
    from hlomap.tasks.joint.costs import step_batch
    from hlomap.tasks.joint.explore import explore_joint, joint_plan

    if str(getattr(schedule, "value", schedule)) not in JOINT_SCHEDULES:
        raise InputError(f"schedule {getattr(schedule, 'value', schedule)!r}: the auto task plans under "
                         f"{', '.join(JOINT_SCHEDULES)} (auto chooses among 1f1b, zb-h1 and gpipe)")

    if microbatches is not None:
        microbatches = _microbatch_counts(microbatches)
        batch = step_batch(cap)
        bad = [m for m in microbatches if m < 1 or batch % m]
        if bad:
            raise InputError(f"microbatches {bad}: the step's batch of {batch} does not split into "
                             f"{' or '.join(str(m) for m in bad)} equal microbatches")
    result = explore_joint(cap, load_cluster(cluster), schedule=schedule, microbatches=microbatches,
                           max_stages=max_stages, **options)
    plan = joint_plan(result)
    refined = refined_sharding(cap, plan, result.model.cluster)
    refined = one_device_instead(cap, refined or plan, plan, result.model) or refined
    if output is not None:
        (refined or plan).save(output)
    bounds = {"microbatches": microbatches, **{k: v for k, v in options.items() if k in _JOINT_BOUNDS}}
    return JointExploration(result, refined or plan, plan if refined is not None else None, bounds)


#: The joint planner's keywords that bound its space (not how it reports or stops).
_JOINT_BOUNDS = frozenset({"recompute", "split_state", "shard_parameters", "kinds"})


def _microbatch_counts(microbatches: Any) -> tuple[int, ...]:
    """The auto task's microbatch counts to consider: one count or several (the pipeline task
    takes one; the same keyword takes either here)."""
    counts = (microbatches,) if _whole(microbatches) else microbatches
    try:
        counts = tuple(counts)
    except TypeError:
        raise OptionError("microbatches", microbatches, "expected a whole number or a list of them") from None
    if not counts or not all(_whole(m) for m in counts):
        raise OptionError("microbatches", microbatches, "expected a whole number or a list of them")
    return counts


#: Seconds the auto task's greedy sharding search may take on the mesh of a one-stage pick.
REFINE_SECONDS = 20.0


def refined_sharding(cap: Capture, plan: Any, cluster: Any) -> Any | None:
    """A one-stage joint pick runs Megatron's sharding on its mesh (the joint planner's stage
    options); the sharding task's greedy search (cost reward) on the same mesh often finds a
    better one (haiku-mlp on 8 CPU devices: 3.7 ms against 4.9 ms priced). That plan, with the
    pick's optimizer-state split when it has one, if the cost model prices it faster and it fits;
    else None. Its search record names the joint pick's price."""
    import dataclasses

    if plan.pipeline is not None or not plan.mesh:
        return None
    mesh = {axis: size for axis, size in plan.mesh if size > 1}
    if not mesh or not set(mesh) <= {"data", "model"}:
        return None
    task = "hybrid" if len(mesh) == 2 else ("adp" if "data" in mesh else "opp")
    try:
        found = explore_detailed(cap, task, mesh, cluster, "greedy", REFINE_SECONDS, 0, "cost")
    except ValueError as err:  # a step the sharding task cannot search (InputError among them): keep the pick
        log.info("auto: no sharding search on the pick's mesh %s (%s)", mesh, err)
        return None
    options = [found.plan]
    if plan.state_sharding is not None:
        trainable = {p.index for p in cap.parameters if p.role is Role.TRAINABLE}
        parameters = plan.state_sharding.splits_any(trainable)
        try:
            options.append(with_sharded_state(cap, found.plan, parameters=parameters))
        except InputError:
            pass
    pick = simulate_plan(cap, plan, cluster=cluster)
    priced = [(simulate_plan(cap, option, cluster=cluster), option) for option in options]
    fitting = [(sim.step_seconds, option) for sim, option in priced if sim.fits]
    if not fitting:
        return None
    seconds, best = min(fitting, key=lambda item: item[0])
    if seconds >= pick.step_seconds:
        return None
    search = {**(best.search or {}), "refined": {"joint_pick_step_seconds": float(pick.step_seconds),
                                                 "step_seconds": float(seconds), "task": task}}
    return dataclasses.replace(best, search=search)


def one_device_instead(cap: Capture, best: Any, pick: Any, model: Any) -> Any | None:
    """The whole step on one device when the cost model prices it faster than `best` (the auto
    task's plan so far; `pick` the joint planner's) and it fits; else None. Only where devices
    share hardware (`hlomap.cost.cluster.busy_speedup`): the joint planner prices every stage
    with all of the cluster's devices busy, but one device of 8 host CPU devices on 2 cores runs
    up to 4x faster than each of 8 busy ones and pays no collective (gpt-tiny: 8.9 ms against
    14.7 ms for the best 8-device plan). Its search record is `refined` with task "one device"."""
    import dataclasses

    cluster = model.cluster
    one = fitting_one_device(cap, model.graph, cluster)
    if one is None:
        return None
    refined = (best.search or {}).get("refined")
    best_seconds = float(refined["step_seconds"]) if refined else float(simulate_plan(cap, pick, cluster=cluster).step_seconds)
    if one.predicted_seconds >= best_seconds:
        return None
    pick_seconds = float(refined["joint_pick_step_seconds"]) if refined else best_seconds
    search = {**(pick.search or {}), "refined": {"joint_pick_step_seconds": pick_seconds,
                                                 "step_seconds": float(one.predicted_seconds), "task": "one device"}}
    return dataclasses.replace(one.plan, search=search)


@dataclass(frozen=True)
class OneDeviceFaster:
    """The whole step on one device priced faster than a plan on several of a cluster whose
    devices share hardware (`one_device_faster`)."""

    one_device_seconds: float
    plan_seconds: float
    plan_devices: int
    cores: int  # the host's cores the devices share (0 where the cluster does not record them)

    @property
    def speedup(self) -> float:
        return self.plan_seconds / self.one_device_seconds


def fitting_one_device(cap: Capture, graph: Any, cluster: Any) -> Any | None:
    """The whole step on one device as a priced candidate (`one_device_candidate`) where the
    cluster's devices share hardware (`hlomap.cost.cluster.busy_speedup`: only there can one
    device outrun several) and it fits; else None. `graph`: the step's factor graph."""
    from hlomap.cost.cluster import busy_speedup
    from hlomap.tasks.candidates import one_device_candidate

    if cluster.n_devices < 2 or busy_speedup(cluster, 1) <= 1.0:
        return None
    one = one_device_candidate(cap, graph, cluster)
    if one.predicted_seconds is None or not plan_fits(one.plan):
        return None
    return one


def one_device_faster(cap: Capture, plan: Any, cluster: Any, graph: Any = None) -> OneDeviceFaster | None:
    """Whether the whole step on one device is priced faster than `plan`, an SPMD plan on several
    of `cluster`'s devices, and fits: only where the devices share hardware
    (`hlomap.cost.cluster.busy_speedup`; 8 host CPU devices on 2 cores, where the opp, adp and
    hybrid picks of the zoo's tiny models on 8 devices measured 1.9-9.4x slower than one device).
    The sharding tasks search the mesh they are given, so they cannot return it; the auto task
    does (`one_device_instead`). None otherwise. `graph`: the step's factor graph when the caller
    has it (an exploration's), else built here."""
    from hlomap.propagation.graph import FactorGraph

    cluster = load_cluster(cluster)
    devices = plan_devices(plan)
    if plan.pipeline is not None or devices < 2:
        return None
    one = fitting_one_device(cap, graph if graph is not None else FactorGraph.from_capture(cap), cluster)
    if one is None:
        return None
    seconds = float(simulate_plan(cap, plan, cluster=cluster).step_seconds)
    if one.predicted_seconds >= seconds:
        return None
    cores = cluster.measured.cores if cluster.measured is not None else 0
    return OneDeviceFaster(float(one.predicted_seconds), seconds, devices, cores)


def plan_fits(plan: Any) -> bool:
    """Whether a searched SPMD plan's saved estimate says it fits device memory (True when the
    plan carries no estimate: nothing says it does not)."""
    saved = getattr(plan, "estimate", None) or {}
    return bool((saved.get("memory") or {}).get("fits", True))


# ---------------------------------------------------------------------------------------------
# Place
# ---------------------------------------------------------------------------------------------

PLACEMENT_AGENTS = ("greedy", "ppo", "exact", "random", "identity")


@dataclass(frozen=True)
class PlacementJob:
    """A plan's placement problem on a cluster, ready to solve: checked and priced, the policy
    file read."""

    plan: Any
    cluster: Any
    problem: Any
    agent: str
    options: Mapping[str, Any]
    notes: tuple[str, ...] = ()

    @property
    def positions(self) -> int:
        return int(self.problem.n_positions)


@dataclass(frozen=True)
class PlacementOutcome:
    """The placed plan and the search that chose its device order."""

    plan: Any
    problem: Any
    result: Any


def prepare_placement(plan: Any, cluster: Any, *, agent: str = "greedy", cap: Capture | str | None = None,
                      policy: str | Path | None = None, finetune_seconds: float = 0.0,
                      where: str = "plan") -> PlacementJob:
    """Check `agent`, price the plan's positions on `cluster` (an SPMD plan with `cap` is
    estimated again on it, otherwise its saved estimate is used) and read ppo's policy file.
    `plan` may be a plan file's path, `cap` a SOURCE string."""
    import dataclasses

    from hlomap.cost.cluster import Cluster
    from hlomap.tasks.placement.place import problem_from_plan

    if agent not in PLACEMENT_AGENTS:
        raise OptionError("agent", agent, f"choose one of {', '.join(PLACEMENT_AGENTS)}")
    for name, value, given in (("policy", policy, policy is not None),
                               ("finetune_seconds", finetune_seconds, finetune_seconds != 0.0)):
        if given and agent != "ppo":
            raise OptionError(name, value, f"only the ppo agent reads it (agent is {agent!r})")
    plan, cap = _plan_of(plan), _capture_of(cap)
    cluster = cluster if isinstance(cluster, Cluster) else load_cluster(cluster)
    step_estimate = None
    if cap is not None:
        check_plan_for(plan, cap, where)
    if cap is not None and plan.pipeline is None:
        step_estimate = estimate(cap, dataclasses.replace(plan, placement=None), cluster=cluster)
    if plan_category(plan) is PlanCategory.JOINT and cap is None:
        raise InputError(f"{where}: a joint plan is priced from its step's module: name its SOURCE (--source)")
    problem = problem_from_plan(plan, cluster, estimate=step_estimate, cap=cap, where=where)
    notes: tuple[str, ...] = ()
    estimated_on = (plan.estimate or {}).get("cluster")
    if plan.pipeline is None and step_estimate is None and estimated_on not in (None, cluster.name):
        notes = (f"compute time from the plan's estimate on cluster {estimated_on}; --source re-estimates the step "
                 f"on {cluster.name}",)
    options: dict[str, Any] = {}
    if agent == "ppo":
        from hlomap.tasks.placement.ppo import load_placement_policy

        try:
            loaded = load_placement_policy(policy)
        except ValueError as err:  # not a policy file, or one of another version (FileNotFoundError: a user error)
            raise InputError(f"--policy {err}" if policy else str(err)) from None
        options = {"policy": loaded, "finetune_seconds": finetune_seconds}
    return PlacementJob(plan, cluster, problem, agent, options, notes)


def place(job: PlacementJob, *, budget_seconds: float = 60.0, budget_evaluations: int | None = None,
          seed: int = 0, output: str | Path | None = None) -> PlacementOutcome:
    """Choose which device takes each logical position of the job's plan; saves the placed plan
    to `output` when given."""
    from hlomap.search.tracker import Budget
    from hlomap.tasks.placement.place import search_placement, with_placement

    result = search_placement(job.problem, job.agent, Budget(budget_seconds, budget_evaluations), seed, **job.options)
    placed = with_placement(job.plan, job.problem, result)
    if output is not None:
        placed.save(output)
    return PlacementOutcome(placed, job.problem, result)


# ---------------------------------------------------------------------------------------------
# Replan
# ---------------------------------------------------------------------------------------------


def replan_policies() -> tuple[str, ...]:
    """The re-planning policies by name, in the order they are played."""
    from hlomap.tasks.replan.policies import ReplanPolicy

    return tuple(p.value for p in ReplanPolicy)


@dataclass(frozen=True)
class ReplanJob:
    """A pipeline or joint plan, a resource trace, the meta policy's network (None: left out) and,
    for a joint plan, its step."""

    plan: Any
    trace: Any
    network: Any
    where: str
    notes: tuple[str, ...] = ()
    cap: Capture | None = None

    @property
    def policies(self) -> int:
        return len(replan_policies()) - (self.network is None)


def prepare_replan(plan: Any, trace: str | Path, *, network: str | Path | None = None, use_meta: bool = True,
                   where: str = "plan", source: Capture | str | None = None) -> ReplanJob:
    """Check that `plan` can be re-planned before the trace is read; read the trace and the
    meta policy's gain network (the shipped one when `network` is None; when that is missing the
    meta policy is left out, with a note). `plan` may be a plan file's path. A joint plan
    (`--task auto` with stages) is re-planned in the joint planner's space and needs `source`,
    its step (a Capture or what `load_source` reads); the plan is checked against it."""
    from hlomap.tasks.replan.replay_plan import is_joint, workload_of
    from hlomap.tasks.replan.trace import load_trace

    plan = _plan_of(plan)
    cap = None
    if is_joint(plan):  # a plan that cannot be re-planned fails before the trace is read
        if source is None:
            raise InputError(f"{where}: a joint plan is re-planned from its step's module: give its step as source= "
                             "(a Capture or a SOURCE string)")
    else:
        workload_of(plan, where)
    if source is not None:  # a pipeline's step gives its batch: a re-solve offers only stages a microbatch splits over
        cap = _capture_of(source)
        assert cap is not None
        check_plan_for(plan, cap, where)
    loaded_trace = load_trace(trace)
    loaded_network, notes = None, ()
    if cap is None and not is_joint(plan):
        notes = ("without --source (the plan's step) the batch is unknown, so a re-solve may replicate a stage "
                 "over more devices than a microbatch splits over, which hlomap run would refuse: give --source to "
                 "keep to plans that run",)
    if use_meta:
        from hlomap.tasks.replan.meta import load_network

        try:
            loaded_network = load_network(network)
        except FileNotFoundError as err:
            if network:
                raise InputError(str(err)) from None
            notes = (*notes, f"{err}; the meta policy is left out")
        except ValueError as err:
            raise InputError(str(err)) from None
    return ReplanJob(plan, loaded_trace, loaded_network, where, notes, cap)


def replans_from_module(plan: Any) -> bool:
    """Whether re-planning `plan` needs its step's module (a joint plan of `--task auto`)."""
    from hlomap.tasks.replan.replay_plan import is_joint

    return is_joint(_plan_of(plan))


def replan(job: ReplanJob) -> Any:
    """Play every re-planning policy over the job's trace -> `ReplanReport`."""
    from hlomap.tasks.replan.replay_plan import replan_plan

    return replan_plan(job.plan, job.trace, network=job.network, where=job.where, cap=job.cap)


def replan_run(report: Any, policy: str) -> Any:
    """The run of `policy` (by name) in `report`, or InputError when it did not run."""
    from hlomap.tasks.replan.policies import ReplanPolicy

    shown = report.runs.get(ReplanPolicy(policy))
    if shown is None:
        raise InputError(f"--show {policy}: that policy did not run (no gain network)")
    return shown


# ---------------------------------------------------------------------------------------------
# Run and check
# ---------------------------------------------------------------------------------------------



class RunPhase(enum.Enum):
    """The phases of `check_run` before the check itself (whose phases `run.compare.check_step`
    names), reported as each starts: a big step takes minutes in each."""

    LOADING = "loading the step and its example arguments"
    CAPTURING = "building the unsharded step"
    PREPARING = "preparing the plan's step (shardings; a pipeline's cuts and stages)"
    OUTPUTS = "compiling and running the plan's step and the unsharded one, comparing their outputs"


@dataclass(frozen=True)
class RunCheck:
    """A plan run on the local devices and compared with the unsharded step: `check` (loss and
    gradients before the optimizer, a `StepCheck`) for a step that marks its loss, else
    `outputs` (a `RunReport` of its outputs), with `note` saying why; for a step whose dots run
    in half precision, `note` says its check used the mixed-precision tolerances."""

    plan_where: str
    source: str
    devices: int
    platform: str
    description: Any = None
    check: Any = None
    outputs: Any = None
    note: str | None = None

    @property
    def ok(self) -> bool:
        return bool(self.check.ok if self.check is not None else self.outputs.ok)


def plan_devices(plan: Any) -> int:
    """Devices a plan needs: up to the highest device id it runs on (`Plan.device_order`: its
    placement's, else its pipeline stages' devices, else its mesh's positions)."""
    return max(plan.device_order(), default=0) + 1


def ensure_host_devices(count: int) -> None:
    """Let the CPU backend show `count` devices (`hlomap.verify.mesh.ensure_host_devices`)."""
    from hlomap.verify.mesh import ensure_host_devices as ensure

    ensure(count)


def too_few_devices_hint(needed: int) -> str:
    """What to do when JAX shows fewer than `needed` devices: on a CPU, which shows one device
    unless told otherwise before JAX starts, the flag that asks for more; elsewhere nothing."""
    import jax

    if jax.default_backend() != "cpu":
        return ""
    return (f" (a CPU shows one device unless XLA_FLAGS=--xla_force_host_platform_device_count={needed} is set "
            "before JAX starts)")


def _run_source(spec: str, seed: int) -> tuple[Callable[..., Any], tuple[Any, ...], Any]:
    """(train step, real example arguments, zoo model or None) of a run's SOURCE."""
    from hlomap.run.errors import RunError
    from hlomap.run.source import load_step_file

    if spec.startswith(ZOO_PREFIX):
        from hlomap import zoo

        try:
            model = zoo.get(spec.removeprefix(ZOO_PREFIX))
        except KeyError as err:
            raise InputError(f"--source {spec}: {err}") from None
        return model.train_step(), tuple(model.example_args(seed)), model
    try:
        step, example = load_step_file(spec)
    except RunError as err:
        raise InputError(str(err)) from None
    return step, example, None


def _compare_outputs(step: Callable[..., Any], example: tuple[Any, ...], plan: Any, *, rtol: float,
                     atol: float) -> Any:
    """A step that marks no loss: its outputs (updated state included) under `parallelize`
    against the unsharded step's, each run on fresh copies of the example (the step donates)."""
    import time

    import jax
    import numpy as np

    from hlomap.run import parallelize
    from hlomap.verify.numerics import RunReport, Tolerance, compare_outputs, unsharded_outputs

    host = tuple(jax.tree.map(np.asarray, example))
    plain = unsharded_outputs(step, host)
    parallel = parallelize(step, plan)

    def once() -> tuple[Any, float]:
        placed = parallel.place(host[0], host[1])
        start = time.perf_counter()
        out = jax.block_until_ready(parallel(*placed, *host[2:]))
        return out, time.perf_counter() - start

    out, _ = once()  # compiles
    _, seconds = once()
    diff = compare_outputs(jax.tree.map(np.asarray, out), plain, Tolerance(rtol, atol))
    return RunReport(diff.max_abs_error, diff.max_rel_error, diff.ok, seconds, diff.worst_leaf, diff.failing_leaves)


def _dot_operand_dtypes(module: Any) -> set[str]:
    """HLO element types of every operand of the module's dots and convolutions."""
    from hlomap.cost.compute import MATRIX_OPCODES

    return {getattr(computation[operand].shape, "dtype", "")
            for computation, instruction in module.instructions() if instruction.opcode in MATRIX_OPCODES
            for operand in instruction.operands}


def _naming(where: Any, err: BaseException) -> str:
    """`err`'s message led by the plan it is about (`where`: its file), once."""
    text = str(err)
    return text if text.startswith(str(where)) else f"{where}: {text}"


def check_run(plan: Any, source: str, *, executor: str | None = None, seed: int = 0, rtol: float = 1e-4,
              atol: float = 1e-5, where: str = "plan",
              on_phase: Callable[[str], None] | None = None) -> RunCheck:
    """Run the step `source` names (`zoo:NAME` or `FILE.py:FUNCTION`) under `plan` on this
    machine's devices with `hlomap.parallelize`, and compare it with the unsharded step: its
    loss and gradients before the optimizer when it marks its loss with
    `hlomap.value_and_grad` (within `run.compare.HALF_PRECISION`'s tolerances when its dots take
    bfloat16 or float16 operands), else its outputs (`rtol`, `atol`). On a CPU-only machine the CPU
    backend is given as many devices as the plan needs (before JAX starts). `on_phase` hears
    each phase as it starts, in words (`RunPhase`, then `check_step`'s). `plan` may be a plan
    file's path."""
    report = on_phase or (lambda phase: None)
    plan = _plan_of(plan)
    check_plan_specs(plan, where)
    if plan.pipeline is None and executor is not None:
        raise OptionError("executor", executor, f"{where} has no pipeline section (executors run pipelines)")
    devices = plan_devices(plan)
    ensure_host_devices(max(devices, 1))

    import dataclasses

    import jax

    from hlomap.run import parallelize
    from hlomap.run.compare import HALF_PRECISION, check_step, tolerances_for
    from hlomap.run.errors import RunError, SplitError

    if jax.device_count() < devices:
        raise InputError(f"{where} needs {devices} devices; JAX sees {jax.device_count()} "
                         f"({jax.devices()[0].platform}){too_few_devices_hint(devices)}")
    report(RunPhase.LOADING.value)
    step, example, model = _run_source(source, seed)
    report(RunPhase.CAPTURING.value)
    cap = dataclasses.replace(capture(step, *example, arg_names=model.arg_names if model is not None else None),
                              source=source)  # named as `load_source` names it
    check_plan_for(plan, cap, where)
    platform = jax.devices()[0].platform
    tolerances = tolerances_for(_dot_operand_dtypes(cap.module))
    precision_note = ("the step's dots run in half precision: compared within mixed-precision tolerances"
                      if tolerances is HALF_PRECISION else None)
    try:
        report(RunPhase.PREPARING.value)
        parallel = parallelize(step, plan, executor=executor, example_args=example if plan.pipeline else None)
        description = parallel.describe(example) if plan.pipeline is not None else None
        checked = check_step(parallel, example, report, tolerances)
        return RunCheck(str(where), source, devices, platform, description=description, check=checked,
                        note=precision_note)
    except SplitError as err:
        if plan.pipeline is not None:
            raise InputError(_naming(where, err)) from None
        note = f"{err}; comparing the step's outputs instead of its gradients"
    except RunError as err:
        raise InputError(_naming(where, err)) from None
    report(RunPhase.OUTPUTS.value)
    outputs = _compare_outputs(step, example, plan, rtol=rtol, atol=atol)
    return RunCheck(str(where), source, devices, platform, outputs=outputs, note=note)


# ---------------------------------------------------------------------------------------------
# calibrate: measure the present devices
# ---------------------------------------------------------------------------------------------


def calibrate(devices: int | None = None, quick: bool = False,
              on_progress: Callable[[Any], None] | None = None) -> tuple[Any, Any]:
    """Measure the first `devices` of the present devices (all when None) and return
    (Cluster, ClusterCalibration): the cluster the fits describe, and every sample and fit behind
    it (`hlomap.cost.calibration`). `quick` takes about 15 s instead of 40-55 on 8 CPU devices, for
    rough figures (fewer and smaller samples, timed once); `on_progress`
    receives a `verify.devices.BenchProgress` after every sample. A CPU-only machine shows
    `devices` host devices when JAX has not started yet (`ensure_host_devices`)."""
    if devices is not None and not _whole(devices):
        raise InputError(f"devices={devices!r}: expected a whole number of devices, or None for all of them")
    if devices is not None and devices < 1:
        raise OptionError("devices", devices, "must be at least 1")
    if devices is not None:
        ensure_host_devices(devices)
    import jax

    from hlomap.cost.calibration import CalibrationError, calibrated_cluster
    from hlomap.run.calibrate import measure_present_devices

    seen = jax.device_count()
    if devices is not None and devices > seen:
        raise OptionError("devices", devices, f"JAX sees only {seen} {jax.default_backend()} device(s)"
                                              f"{too_few_devices_hint(devices)}")
    try:
        measured = measure_present_devices(devices, quick=quick, on_progress=on_progress)
        return calibrated_cluster(measured), measured
    except CalibrationError as err:
        raise InputError(f"calibration failed: {err}") from None


def save_calibration(calibration: Any, path: str | Path, *, name: str | None = None) -> Path:
    """Write the calibrated cluster file (an ordinary cluster JSON with the fits and samples under
    its "calibration" key) that `--cluster FILE` and `load_cluster` read; `name` is the cluster's
    (default `calibrated-BACKEND-N`)."""
    import json

    from hlomap.cost.calibration import calibrated_cluster_json
    from hlomap.plan import write_atomic

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps(calibrated_cluster_json(calibration, name=name), indent=1) + "\n")
    return path


def read_calibration(cluster: str | Path = "local") -> tuple[Path, Any]:
    """(path, `ClusterCalibration`) of a calibrated cluster: "local" (the cached calibration of
    the devices JAX sees) or the path of a file `hlomap calibrate` wrote. A CPU-only machine that
    has not started JAX yet then shows as many host devices as the calibration measured.
    InputError when the file is missing, unreadable or holds no calibration."""
    import json

    from hlomap.cost.calibration import CLUSTER_CALIBRATION_KEY, CalibrationError, ClusterCalibration
    from hlomap.cost.cluster import AUTOMAP_SERVERS

    if not isinstance(cluster, (str, Path)):
        raise InputError(f"cluster={cluster!r}: expected 'local' or the path of a cluster file hlomap calibrate "
                         f"wrote, not a {type(cluster).__name__}")
    local = str(cluster) == "local"
    path = local_cluster_path() if local else Path(cluster)
    if path.is_dir():
        raise InputError(f"{path}: a folder, not a cluster file")
    if not path.is_file():
        if not local and (str(cluster).upper() in AUTOMAP_SERVERS or ":" in str(cluster)):
            raise InputError(f"{cluster}: a datasheet model (a preset or a topology string), which holds no "
                             "calibration to time again: give 'local' or a file hlomap calibrate wrote")
        raise InputError(f"{path}: no such file" + (
            " (the devices JAX sees were never calibrated: run hlomap calibrate --local)" if local else ""))
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise InputError(f"{path}: cannot read a cluster file ({err})") from None
    if not isinstance(data, dict) or CLUSTER_CALIBRATION_KEY not in data:
        raise InputError(f"{path}: no {CLUSTER_CALIBRATION_KEY!r} object, so nothing measured to time again: only "
                         "the cluster files hlomap calibrate writes hold one (not a preset, a cluster written by "
                         "hand or a plan)")
    try:
        calibration = ClusterCalibration.from_json(data[CLUSTER_CALIBRATION_KEY], source=str(path))
    except CalibrationError as err:
        raise InputError(str(err)) from None
    devices = data.get("devices")
    if isinstance(devices, list) and len(devices) != calibration.n_devices:
        raise InputError(f"{path}: its cluster has {len(devices)} devices but its calibration measured "
                         f"{calibration.n_devices}: the file was edited; calibrate again")
    ensure_host_devices(calibration.n_devices)  # before anything starts JAX
    return path, calibration


def check_calibration(cluster: str | Path = "local", *,
                      on_progress: Callable[[Any], None] | None = None) -> Any:
    """Time the compute samples of a calibrated cluster (`read_calibration`) again on the present
    devices and say how far they moved (`hlomap.verify.recheck`): a `CalibrationCheck` whose
    `speed_ratio` is now / then (above 1: the devices run slower than the cluster prices them) and
    `stale` past `STALE_RATIO`. InputError when it cannot be timed again here (another backend,
    fewer devices)."""
    path, calibration = read_calibration(cluster)
    import jax

    from hlomap.cost.calibration import CalibrationError
    from hlomap.verify.recheck import recheck

    seen = jax.device_count()
    if seen < calibration.n_devices:
        raise InputError(f"{path}: calibrated {calibration.n_devices} {calibration.backend} device(s); JAX sees "
                         f"only {seen} {jax.default_backend()} device(s){too_few_devices_hint(calibration.n_devices)}")
    try:
        return recheck(calibration, on_progress=on_progress)
    except CalibrationError as err:
        raise InputError(f"{path}: {err}") from None


def local_cluster(refresh: bool = False) -> Any:
    """The `local` cluster (`cluster="local"`): the devices JAX sees, calibrated on first use and
    cached on disk (`hlomap.run.local`); `refresh` measures them again. A CPU-only machine that
    has not started JAX yet shows LOCAL_CPU_DEVICES host devices."""
    ensure_host_devices(LOCAL_CPU_DEVICES)  # before hlomap.run imports JAX
    from hlomap.run.local import local_cluster as cached_local_cluster

    return cached_local_cluster(refresh=refresh)


def check_cache_folder(folder: Path) -> None:
    """Create hlomap's cache `folder` if missing (`hlomap.run.local.folder_problem`, the one check
    of it); one that cannot be made or written raises InputError naming it."""
    from hlomap.run.local import folder_problem

    problem = folder_problem(folder)
    if problem is not None:
        raise InputError(f"{folder}: cannot create the cache folder or write in it ({problem}); "
                         "set $HLOMAP_CACHE_DIR to a writable folder")


def local_cluster_path() -> Path:
    """Where the `local` cluster of the devices JAX sees is cached (it may not exist yet)."""
    ensure_host_devices(LOCAL_CPU_DEVICES)  # before hlomap.run imports JAX
    from hlomap.run.local import cached_path, present_key

    return cached_path(present_key())


#: Host devices a CPU-only machine shows for `local` and `hlomap calibrate` (`hlomap.run.local`).
from hlomap.cost.cluster import LOCAL_CPU_DEVICES  # noqa: E402,F401 - re-exported for the CLI


def is_local(cluster: Any) -> bool:
    """Whether `cluster` names the `local` cluster (the devices JAX sees)."""
    from hlomap.cost.cluster import LOCAL

    return isinstance(cluster, str) and cluster.strip().lower() == LOCAL


def load_cluster(spec: Any) -> Any:
    """`hlomap.cost.cluster.load_cluster` (a preset, a topology string, a JSON path or a
    Cluster), and `local`: the devices JAX sees, measured on first use and cached
    (`local_cluster`). Every verb of this module resolves its `cluster` through here."""
    from hlomap.cost.cluster import load_cluster as load

    return local_cluster() if is_local(spec) else load(spec)


def _cluster_arg(cluster: Any) -> Any:
    """`cluster` for the layers below: `local` measured (they cannot run the devices), any
    other spelling passed on as given (they load it, with their own errors)."""
    return local_cluster() if is_local(cluster) else cluster
