"""The one public front that the CLI, the decorator and users call: read a SOURCE, parse a mesh,
explore a plan, estimate a plan.

    cap = load_source("zoo:gpt-small")                      # or an HLO text file
    plan = explore(cap, task="opp", mesh={"model": 8}, cluster="A", agent="dqn", budget_seconds=60)
    est = estimate(cap, plan, cluster="A")                   # or "dp" | "megatron" | "dp+megatron"

Everything here resolves user-facing names (presets, files, built-in plans, mesh strings) into the
plain data the layers below take, and nothing below imports it.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from hlomap.hlo.capture import Capture, Role, capture, from_module
from hlomap.plan import parse_mesh_text

log = logging.getLogger(__name__)

__all__ = [
    "SourceError",
    "estimate",
    "explore",
    "explore_auto",
    "explore_detailed",
    "is_pipedream_graph",
    "load_pipeline_source",
    "load_source",
    "parse_mesh",
    "parse_mesh_text",
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
    """`zoo:NAME` lowers a zoo train step abstractly; anything else is read as HLO text.

    For an HLO file holding several modules (split by `// -----`), `module_index` picks one.
    `trainable` (indices or HLO names) and `trainable_prefix` (starts of paths or names) name
    the trainable entry parameters of a bare dump; without them, a dump of a JAX step takes its
    roles from its parameters' names (`hlomap.hlo.capture.from_module`, `infer_roles`).
    """
    if spec.startswith(ZOO_PREFIX):
        return _load_zoo(spec[len(ZOO_PREFIX):])
    return _load_file(Path(spec), trainable=trainable, trainable_prefix=tuple(trainable_prefix),
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


def _load_file(path: Path, *, trainable: Iterable[int | str] | None, trainable_prefix: tuple[str, ...],
               module_index: int) -> Capture:
    from hlomap.hlo.parser import parse_all

    if not path.exists():
        raise SourceError(f"{path}: no such file (SOURCE is an HLO text file or zoo:NAME)")
    if path.is_dir():
        raise SourceError(f"{path}: is a directory, expected an HLO text file")
    try:
        text = path.read_text()
    except UnicodeDecodeError as err:
        raise SourceError(f"{path}: not a text file ({err.reason} at byte {err.start})") from None
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

    return mesh_shape(mesh, task)


# ---------------------------------------------------------------------------------------------
# Explore and estimate
# ---------------------------------------------------------------------------------------------


def explore_detailed(cap: Capture, task: Any = "opp", mesh: Mapping[str, int] | int | str = 8, cluster: Any = "A",
                     agent: Any = "dqn", budget_seconds: float | None = 60.0, seed: int = 0, reward: Any = "paper",
                     **options: Any) -> Any:
    """`explore` for the sharding tasks, returning the whole `Exploration` (plan, search result,
    space, graph) that reports and benchmarks need."""
    from hlomap.tasks.sharding.problem import explore_sharding

    return explore_sharding(cap, task, parse_mesh(mesh, task), cluster, agent, budget_seconds, seed, reward,
                            **options)


def explore(cap: Capture, task: Any = "opp", mesh: Mapping[str, int] | int | str = 8, cluster: Any = "A",
            agent: Any = "dqn", budget_seconds: float | None = 60.0, seed: int = 0, reward: Any = "paper",
            **options: Any) -> Any:
    """Search a plan for `cap` and return it as a `hlomap.plan.Plan`.

    task: "opp" (tensor parallelism of the trainable variables), "adp" (data inputs), "hybrid"
    (both, on a data x model mesh). mesh: `{"model": 8}`, `8` or `"data=2,model=8"`. cluster: a
    preset name ("A", "B", "C"), a JSON path or a Cluster (used by the cost reward and for the
    plan's estimate). agent: "dqn", "random", "greedy" or "exact". reward: "paper" or "cost".
    Options: budget_evaluations, output (path saved as the search runs), graph,
    replicate_residual, dqn_config, with_estimate, on_progress.

    task "auto" plans the whole cluster at once (pipeline stages with data and tensor
    parallelism inside each, Alpa-style two-level search): options schedule, microbatches,
    max_stages, output; see `explore_auto`.

    task "pipeline" decides stage cuts instead: agent "dqn", "dqn-infer" or "dp"; mesh and
    reward do not apply. Options: stages (default: one stage per server of the cluster),
    microbatches, schedule, episodes, finetune_episodes, compare_dp, output, on_progress. The
    plan's parameters stay replicated and its `pipeline` section holds the cuts, stage devices
    and replication.
    """
    if str(getattr(task, "value", task)) == "auto":
        return explore_auto(cap, cluster=cluster, **options)
    if str(getattr(task, "value", task)) == "pipeline":
        from hlomap.tasks.pipeline.explore import explore_pipeline_plan

        return explore_pipeline_plan(cap, cluster=cluster, agent=str(getattr(agent, "value", agent)),
                                     budget_seconds=budget_seconds, seed=seed, **options)
    return explore_detailed(cap, task, mesh, cluster, agent, budget_seconds, seed, reward, **options).plan


def explore_auto(cap: Capture, *, cluster: Any = "A", schedule: str = "1f1b", microbatches: Sequence[int] | None = None,
                 max_stages: int | None = None, output: str | Path | None = None, **options: Any) -> Any:
    """The joint plan (`hlomap.tasks.joint`): stage cuts, each stage's device group, mesh shape
    and sharding, microbatches and schedule, by the exact two-level search, with Megatron-LM's
    expert grid priced beside it (in the plan's `search` record)."""
    from hlomap.cost.cluster import load_cluster
    from hlomap.tasks.joint.explore import explore_joint, joint_plan

    result = explore_joint(cap, load_cluster(cluster), schedule=schedule, microbatches=microbatches,
                           max_stages=max_stages, **options)
    plan = joint_plan(result)
    if output is not None:
        plan.save(output)
    return plan


def estimate(cap: Capture, plan: Any, *, mesh: Mapping[str, int] | Any | int | None = None, cluster: Any = "A",
             axis_devices: Any = None, axis_order: Sequence[str] | None = None, graph: Any = None,
             overlap: Any = None, fusion: Any = None) -> Any:
    """Estimate one training step of `cap` under `plan` on `cluster` -> `StepEstimate`.

    `plan`: a `hlomap.plan.Plan` (its own mesh), a built-in plan name ("dp", "megatron",
    "dp+megatron"; `mesh` says the axes: {"data": 2, "model": 4}, or a device count), or a plan
    array over the factor graph's groups with `mesh` naming its axes. `cluster`: a preset name
    ("A", "B", "C"), a topology string, a JSON path or a Cluster. A placed Plan is priced on its
    placement's device order unless `axis_devices` or `axis_order` say otherwise. Raises
    PlanConflict for a plan with conflicts.
    """
    from hlomap.cost import estimate as cost_estimate
    from hlomap.plan import resolve_plan
    from hlomap.propagation.graph import FactorGraph

    graph = graph if graph is not None else FactorGraph.from_capture(cap)
    array, axes, name = resolve_plan(graph, plan, mesh)
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
    return cost_estimate.estimate(cap, array, axes, cluster=cluster, axis_devices=axis_devices,
                                  axis_order=axis_order, graph=graph, plan_name=name, **extra)

