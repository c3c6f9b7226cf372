"""A pipeline plan's profile at stage granularity, and its JSON form in a plan's pipeline section.

Merging a profile's layers at a plan's cuts (`merge_layers`) keeps every cost of that plan (sums
per stage, the bytes crossing each kept cut), so a saved plan that carries the merged profile can
be re-priced on another cluster or another device placement without its source: what
`hlomap place` and `hlomap replan` do. Per microbatch, like every `PipelineProfile`.

JSON (`pipeline.stage_profile`): {"names": [str], "forward_seconds": [float],
"backward_seconds": [float], "parameter_bytes": [float], "stash_bytes": [float] | null,
"activation_bytes": [float]} with one entry per stage (one fewer activation entry: per cut).
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from hlomap.cost.pipeline.profile import PipelineProfile, merge_layers
from hlomap.cost.pipeline.stages import PipelinePlan

__all__ = ["StageProfileError", "profile_from_json", "profile_to_json", "stage_profile"]


class StageProfileError(ValueError):
    """A saved stage profile that is malformed (the message names the field)."""


def stage_profile(profile: PipelineProfile, plan: PipelinePlan) -> PipelineProfile:
    """`profile` with the layers of each stage of `plan` merged into one."""
    return merge_layers(profile, plan.cuts)


def profile_to_json(profile: PipelineProfile) -> dict[str, Any]:
    return {
        "names": list(profile.names),
        "forward_seconds": profile.forward_time.tolist(),
        "backward_seconds": profile.backward_time.tolist(),
        "parameter_bytes": profile.parameter_bytes.tolist(),
        "stash_bytes": None if profile.stash_bytes is None else profile.stash_bytes.tolist(),
        "activation_bytes": profile.activation_bytes.tolist(),
    }


def profile_from_json(data: Mapping[str, Any], *, where: str = "stage_profile") -> PipelineProfile:
    """Inverse of `profile_to_json`; errors name `where` and the field."""
    if not isinstance(data, Mapping):
        raise StageProfileError(f"{where}: expected an object, got {type(data).__name__}")
    fields = ("names", "forward_seconds", "backward_seconds", "parameter_bytes", "activation_bytes")
    missing = [f for f in fields if f not in data]
    if missing:
        raise StageProfileError(f"{where}: missing field(s) {missing}")

    def vector(key: str) -> np.ndarray:
        value = data[key]
        if not isinstance(value, list) or not all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                                  for v in value):
            raise StageProfileError(f"{where}: field {key!r}: expected a list of numbers")
        return np.asarray(value, dtype=np.float64)

    stash = data.get("stash_bytes")
    try:
        return PipelineProfile(
            names=tuple(str(n) for n in data["names"]),
            forward_time=vector("forward_seconds"),
            backward_time=vector("backward_seconds"),
            activation_bytes=vector("activation_bytes"),
            parameter_bytes=vector("parameter_bytes"),
            stash_bytes=None if stash is None else vector("stash_bytes"),
            source=where,
        )
    except ValueError as err:
        raise StageProfileError(f"{where}: {err}") from None
