"""A found sharding plan against Megatron's on the same graph, and the per-variable view of a
plan (Auto-MAP's Table 5 counts, which variables are split on which dims)."""

from __future__ import annotations

import re
from typing import NamedTuple

import numpy as np

from hlomap.tasks.sharding.space import ShardingSpace

__all__ = [
    "MegatronComparison",
    "VariableDiff",
    "compare_with_megatron",
    "is_layer_norm",
    "layer_of",
    "partitioned_dims",
    "variable_specs",
]

_LAYER_NORM = re.compile(r"(^|/)(ln[^/]*|[^/]*norm[^/]*)/")
_NUMBERED = re.compile(r"\d")


def is_layer_norm(path: str) -> bool:
    """A normalization's parameter by its path (`layers_0/ln_1/scale`, `.../layer_norm/bias`)."""
    return bool(_LAYER_NORM.search(path))


def layer_of(path: str) -> str:
    """The layer a variable belongs to, for grouping: the path up to its first numbered component
    (`decoder/layers_3`, `block2_conv1`), else its first component (`embed`), without the
    argument name (`params/`)."""
    parts = path.split("/")
    if len(parts) > 1 and parts[0] in ("params", "parameters", "weights", "variables", "model", "batch"):
        head, parts = parts[0], parts[1:]
    else:
        head = ""
    for i, part in enumerate(parts[:-1]):
        if _NUMBERED.search(part):
            return "/".join(parts[: i + 1])
    if head == "batch":
        return "batch"
    return parts[0] if len(parts) > 1 else "(top level)"


def partitioned_dims(space: ShardingSpace, choices: np.ndarray) -> tuple[int, int]:
    """(candidate dims partitioned, candidate dims in all): the paper's Table 5 figures."""
    choices = np.asarray(choices)
    return int(space.weights[choices >= 0].sum()), int(space.weights.sum())


class VariableDiff(NamedTuple):
    """A variable the explored plan shards differently from Megatron."""

    path: str
    shape: tuple[int, ...]
    found: tuple[str | None, ...]
    megatron: tuple[str | None, ...]


class MegatronComparison(NamedTuple):
    """The found plan against `hlomap.propagation.plans.megatron_plan` on the same graph."""

    found_partitioned: int
    megatron_partitioned: int
    total: int
    identical: bool  # same choice at every position
    same_variables: bool  # the same variables are partitioned (perhaps on other dims)
    layer_norms_replicated: bool
    differences: tuple[VariableDiff, ...]
    contains_megatron: bool = False  # every group Megatron splits is split the same way

    @property
    def equivalent(self) -> bool:
        """Megatron-equivalent: Megatron's partitioning of every variable it splits, layer norms
        replicated; other groups may be split too (the paper reward splits whatever it can)."""
        return self.contains_megatron and self.layer_norms_replicated


def variable_specs(space: ShardingSpace, choices: np.ndarray) -> dict[str, tuple[tuple[int, ...], tuple[str | None, ...]]]:
    """path -> (shape, per-dim axis names or None) for every candidate variable."""
    plan = space.plan_of(choices)
    out: dict[str, tuple[tuple[int, ...], tuple[str | None, ...]]] = {}
    for p in space.graph.parameters:
        if not any(c.parameter == p.index for c in space.candidates):
            continue
        groups = space.graph.parameter_groups(p.index)
        spec = tuple(None if plan[g] < 0 else "x".join(space.axes.options[int(plan[g])]) for g in groups)
        out[p.path] = (tuple(p.shape.dims), spec)
    return out


def compare_with_megatron(space: ShardingSpace, choices: np.ndarray, megatron: np.ndarray) -> MegatronComparison:
    """Compare a found choice vector with Megatron's plan array (`megatron_plan(graph, axis, axes)`)."""
    mega_choices = space.choices_of(megatron)
    ours = variable_specs(space, choices)
    theirs = variable_specs(space, mega_choices)
    diffs = tuple(VariableDiff(path, shape, spec, theirs[path][1])
                  for path, (shape, spec) in ours.items() if spec != theirs[path][1])
    same_vars = all(any(s is not None for s in spec) == any(s is not None for s in theirs[path][1])
                    for path, (_, spec) in ours.items())
    ln_ok = all(all(s is None for s in spec) for path, (_, spec) in ours.items() if is_layer_norm(path))
    found, total = partitioned_dims(space, choices)
    mega, _ = partitioned_dims(space, mega_choices)
    split = mega_choices >= 0
    contains = bool(np.array_equal(np.asarray(choices)[split], mega_choices[split]))
    return MegatronComparison(found, mega, total, bool(np.array_equal(np.asarray(choices), mega_choices)),
                              same_vars, ln_ok, diffs, contains)
