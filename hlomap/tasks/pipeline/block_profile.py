"""A pipeline plan's profile in blocks, and its JSON form in a plan's pipeline section.

Merging a profile's layers (`merge_layers`) keeps every cost of any plan whose cuts fall between
the merged groups (sums per stage, the bytes crossing each kept cut). A plan therefore carries its
profile merged into at most `MAX_BLOCKS` blocks whose boundaries include the plan's cuts: enough to
re-price the plan on other devices or another cluster without its source (`hlomap place`), and to
move whole blocks between neighbouring stages or cut the blocks afresh when resources change
(`hlomap replan`). The other block boundaries split the remaining compute evenly. Per microbatch,
like every `PipelineProfile`.

JSON (`pipeline.block_profile`): {"names": [str], "forward_seconds": [float],
"backward_seconds": [float], "parameter_bytes": [float], "stash_bytes": [float] | null,
"activation_bytes": [float] (one per boundary between blocks), "stage_bounds": [int],
"update_seconds_per_byte": float, "forward_fixed_seconds": [float], "backward_fixed_seconds": [float],
"forward_syncs": [float], "backward_syncs": [float], "forward_sync_bytes": [float],
"backward_sync_bytes": [float], "gradient_buffers": [float], "replica_transposes": [float]} where stage s of
the plan is blocks [stage_bounds[s], stage_bounds[s + 1]); the fields from "update_seconds_per_byte" on are
optional (plans written before them read as 0: no update priced, every second split over replicas, no
all-reduces inside the passes, no per-buffer cost of the gradient all-reduce, no transposes after it).
"""

from __future__ import annotations

from typing import Any, Mapping, NamedTuple

import numpy as np

from hlomap.cost.pipeline.profile import SYNC_FIELDS, PipelineProfile, merge_layers, sync_fields
from hlomap.cost.pipeline.stages import PipelinePlan

__all__ = ["MAX_BLOCKS", "PlanProfile", "ProfileError", "plan_profile"]

#: Most blocks a plan's profile is merged into.
MAX_BLOCKS = 64


class ProfileError(ValueError):
    """A saved block profile that is malformed (the message names the field)."""


class PlanProfile(NamedTuple):
    """A profile in blocks and the plan's stages as block bounds [0, b_1, ..., B]."""

    blocks: PipelineProfile
    stage_bounds: tuple[int, ...]

    def stage_profile(self) -> PipelineProfile:
        """One layer per stage."""
        return merge_layers(self.blocks, [b - 1 for b in self.stage_bounds[1:-1]])

    def to_json(self) -> dict[str, Any]:
        p = self.blocks
        return {
            "names": list(p.names),
            "forward_seconds": p.forward_time.tolist(),
            "backward_seconds": p.backward_time.tolist(),
            "parameter_bytes": p.parameter_bytes.tolist(),
            "stash_bytes": None if p.stash_bytes is None else p.stash_bytes.tolist(),
            "activation_bytes": p.activation_bytes.tolist(),
            "stage_bounds": list(self.stage_bounds),
            "update_seconds_per_byte": p.update_seconds_per_byte,
            "forward_fixed_seconds": p.forward_fixed.tolist(),  # type: ignore[union-attr]
            "backward_fixed_seconds": p.backward_fixed.tolist(),  # type: ignore[union-attr]
            **{name: values.tolist() for name, values in sync_fields(p).items()},
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any], *, where: str = "block_profile") -> PlanProfile:
        """Inverse of `to_json`; errors name `where` and the field."""
        if not isinstance(data, Mapping):
            raise ProfileError(f"{where}: expected an object, got {type(data).__name__}")
        fields = ("names", "forward_seconds", "backward_seconds", "parameter_bytes", "activation_bytes",
                  "stage_bounds")
        missing = [f for f in fields if f not in data]
        if missing:
            raise ProfileError(f"{where}: missing field(s) {missing}")

        def vector(key: str) -> np.ndarray:
            value = data[key]
            if not isinstance(value, list) or not all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                                      for v in value):
                raise ProfileError(f"{where}: field {key!r}: expected a list of numbers")
            return np.asarray(value, dtype=np.float64)

        stash = data.get("stash_bytes")
        update = data.get("update_seconds_per_byte", 0.0)  # plans written before it priced no update
        if isinstance(update, bool) or not isinstance(update, (int, float)):
            raise ProfileError(f"{where}: field 'update_seconds_per_byte': expected a number, got {update!r}")
        try:
            blocks = PipelineProfile(
                names=tuple(str(n) for n in data["names"]), forward_time=vector("forward_seconds"),
                backward_time=vector("backward_seconds"), activation_bytes=vector("activation_bytes"),
                parameter_bytes=vector("parameter_bytes"), stash_bytes=None if stash is None else vector("stash_bytes"),
                source=where, update_seconds_per_byte=float(update),
                forward_fixed=vector("forward_fixed_seconds") if "forward_fixed_seconds" in data else None,
                backward_fixed=vector("backward_fixed_seconds") if "backward_fixed_seconds" in data else None,
                # plans written before the in-pass all-reduces were priced have none
                **{name: vector(name) if name in data else None for name in SYNC_FIELDS})
        except ValueError as err:
            raise ProfileError(f"{where}: {err}") from None
        bounds = data["stage_bounds"]
        if (not isinstance(bounds, list) or len(bounds) < 2 or bounds[0] != 0 or bounds[-1] != blocks.n_layers
                or any(not isinstance(b, int) or b >= c for b, c in zip(bounds[:-1], bounds[1:]))):
            raise ProfileError(f"{where}: field 'stage_bounds': expected increasing block indices from 0 to "
                               f"{blocks.n_layers}, got {bounds!r}")
        return cls(blocks, tuple(bounds))


def plan_profile(profile: PipelineProfile, plan: PipelinePlan, max_blocks: int = MAX_BLOCKS) -> PlanProfile:
    """`profile` merged into at most `max_blocks` blocks (more only if the plan has more stages),
    cut at the plan's cuts and where the cumulative compute crosses even shares of the total."""
    cuts = set(plan.cuts)
    if profile.n_layers <= max_blocks:
        kept = list(range(profile.n_pivots))
    else:
        cumulative = np.cumsum(profile.compute_time)[:-1]  # compute up to and including each pivot's layer
        targets = float(cumulative[-1] + profile.compute_time[-1]) * np.arange(1, max_blocks) / max_blocks
        even = sorted(set(np.searchsorted(cumulative, targets).clip(0, profile.n_pivots - 1).tolist()) - cuts)
        room = max(max_blocks - 1 - len(cuts), 0)
        if len(even) > room:
            even = [even[i] for i in np.linspace(0, len(even) - 1, room).round().astype(int)] if room else []
        kept = sorted(cuts | set(even))
    blocks = merge_layers(profile, kept)
    index = {pivot: i for i, pivot in enumerate(kept)}
    bounds = (0, *(index[c] + 1 for c in plan.cuts), blocks.n_layers)
    return PlanProfile(blocks, bounds)
