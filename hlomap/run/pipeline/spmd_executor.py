"""The spmd executor: a pipeline as one SPMD program (GPipe, plain or circular), on one host or several.

One `jax.jit` around a `jax.shard_map` that is manual over a `stage` mesh axis and automatic
over the plan's axes inside a stage (data, model), so that XLA partitions each stage's work as
an SPMD plan would (GPipe, Huang et al. 2019, section 2; the formulation of MaxText's and
Praxis's pipelines). With a single device stage the same body runs on the whole mesh without
the shard_map (`_over_stages`):

- Each stage's state is flattened into rows; rows are padded to one length and stacked
  `[S, L]`, sharded on `stage` (`layout`). A leaf whose counterpart (same size) is on every
  stage, and a leaf several stages read (a tied embedding), has a buffer of its own, so it is
  read and written whole; the gradient of the latter is summed over `stage`.
- Clock tick t: stage s runs microbatch t - s through its own code, chosen with
  `lax.switch(lax.axis_index('stage'), stage_programs)`, then `lax.ppermute` shifts every
  stage's output (packed into one padded buffer) to the next stage. M + S - 1 ticks.
- The last stage's loss, summed over ticks, is `psum`'d over `stage` and divided by M.
- `jax.value_and_grad` of the whole gives GPipe's backward (the scan runs backwards, ppermute
  transposes to the reverse shift). With several microbatches, each tick's stage call is
  rematerialized (`jax.checkpoint` with nothing saved), so a stage keeps only its input per
  microbatch in flight, not every intermediate activation (with one microbatch there is nothing
  to save memory against, and the recomputation would only cost time).
- Then a second `shard_map` runs each stage's part of the step outside the loss (`stage_update`) on
  its own rows: the optimizer update per stage, in the same program as the pipeline.

Leaves are cut from a row by one `split` per buffer, not a slice per leaf: the gradient of a
slice is a pad of the whole row, and summing one pad per leaf made the backward pass a pass over
the row per leaf (it tripled a one-stage step of gpt-tiny).

Circular schedule (`repeats` V > 1; Praxis's and MaxText's looped pipeline): the model is cut
into S V logical stages and device stage s runs logical stages s, S + s, ..., so each keeps V rows
(`circular_rows`) and the `ppermute` becomes a ring. Device stage s at tick t runs iteration
j = t - s: microbatch j mod M in round j // M, logical stage (j // M) S + s. What leaves the last
device stage comes back to stage 0 for its next round M - S ticks later, so stage 0 keeps one slot
per microbatch (`_circulate`); hence M >= S. M V + S - 1 ticks, each a V-th of a stage's work:
the bubble shrinks V times.

The stage axis can span processes (`jax.distributed`): the program is the same on every host.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from hlomap.cost.pipeline.costs import lockstep_remat
from hlomap.run.errors import RunError
from hlomap.run.pipeline.layout import (BatchedLayout, FlatLayout, buffer_dtype, buffer_lengths, matched_buffers,
                                        sharded_buffer)
from hlomap.run.pipeline.prepare import PipelineProgram, batch_axes, leaf_specs
from hlomap.run.pipeline.section import STAGE_AXIS
from hlomap.run.pipeline.stage_state import Staged, state_leaves
from hlomap.run.pipeline.stage_update import Source
from hlomap.run.trace import InputKind
from hlomap.run.transfer import put, to_host
from hlomap.verify.mesh import devices_at, mesh_of

__all__ = ["RowLayout", "SpmdPipeline"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Placement:
    """How one state leaf is stored in the rows: replicated inside its stage (`dim` None), or
    as its local shards, split on `dim` over `shards` devices of the stage's mesh."""

    buffer: str
    dim: int | None = None
    shards: int = 1


@dataclass(frozen=True, eq=False)
class RowLayout:
    """Where each state leaf sits in the rows `[S, (shards,) L]`: a leaf every stage holds, and
    a stage's leaf matched by one of the same size on every other stage, in a buffer of its own
    (`matched_buffers`); the other leaves of each stage one after another in a row per dtype; a
    leaf split over mesh axes inside the stage lives in a buffer of those axes, one shard per
    slot of the `shards` dim."""

    leaves: tuple[int, ...]  # flat argument indices, in the user's pytree order
    avals: tuple[Any, ...]
    placements: dict[int, Placement]
    stages: tuple[FlatLayout, ...]  # over local shapes
    shared: frozenset[str]  # the buffers of the leaves every stage holds (one each)
    lengths: dict[str, int]
    leads: dict[str, tuple[int, ...]]  # buffer -> (shards,) or ()
    axes: dict[str, tuple[str, ...]]  # buffer -> the mesh axes splitting it
    treedef: Any
    rows: tuple[int, ...]  # logical stage -> its row (`circular_rows`)

    @classmethod
    def of(cls, leaves: Sequence[int], avals: Sequence[Any], residence: Sequence[frozenset[int]], n_stages: int,
           specs: Mapping[int, Any], mesh_axes: Mapping[str, int], treedef: Any,
           rows: Sequence[int] | None = None) -> RowLayout:
        placements, leaf_axes, local = {}, {}, {}
        for leaf, aval in zip(leaves, avals):
            placement, leaf_axes[leaf] = _placement(leaf, aval, specs.get(leaf), mesh_axes)
            placements[leaf] = placement
            shape = list(aval.shape)
            if placement.dim is not None:
                shape[placement.dim] //= placement.shards
            local[leaf] = jax.ShapeDtypeStruct(tuple(shape), aval.dtype)
        buffers = matched_buffers(leaves, {leaf: math.prod(local[leaf].shape) for leaf in leaves},
                                  {leaf: placements[leaf].buffer for leaf in leaves}, residence, n_stages)
        axes_of = {buffers[leaf]: leaf_axes[leaf] for leaf in leaves}
        placements = {leaf: Placement(buffers[leaf], p.dim, p.shards) for leaf, p in placements.items()}
        every = frozenset(range(n_stages))
        # a leaf every stage holds has a buffer of its own (`matched_buffers`), so it sits at the
        # same place in every row and its gradient is the sum of the buffer's rows
        shared = FlatLayout.of([(leaf, local[leaf]) for leaf in leaves if residence[leaf] == every], buffers=buffers)
        stages = []
        for s in range(n_stages):
            own = [(leaf, local[leaf]) for leaf in leaves if residence[leaf] != every and s in residence[leaf]]
            layout = FlatLayout.of(own, buffers=buffers)
            stages.append(FlatLayout(shared.keys + layout.keys, shared.slots + layout.slots))
        lengths = {b: max(n, 1) for b, n in buffer_lengths(stages).items()}
        leads = {p.buffer: ((p.shards,) if p.dim is not None else ()) for p in placements.values()}
        return cls(tuple(leaves), tuple(avals), placements, tuple(stages), frozenset(shared.lengths), lengths, leads,
                   axes_of, treedef, tuple(rows) if rows is not None else tuple(range(n_stages)))

    def home(self, leaf: int) -> int:
        return next(s for s, layout in enumerate(self.stages) if leaf in layout.keys)

    def spec(self, buffer: str) -> Any:
        axes = self.axes.get(buffer, ())
        return P(STAGE_AXIS, axes) if axes else P(STAGE_AXIS)

    def to_global(self, leaf: int, value: Any) -> Any:
        """A leaf from its stored form (`[shards, *local]` when split) to its own shape."""
        placement = self.placements[leaf]
        if placement.dim is None:
            return value
        moved = jnp.moveaxis(value, 0, placement.dim)
        return jnp.reshape(moved, self.avals[self.leaves.index(leaf)].shape)

    def to_stored(self, leaf: int, value: Any) -> Any:
        placement = self.placements[leaf]
        if placement.dim is None:
            return value
        d, n = placement.dim, placement.shards
        shape = value.shape
        split = jnp.reshape(value, shape[:d] + (n, shape[d] // n) + shape[d + 1:])
        return jnp.moveaxis(split, d, 0)

    def host_rows(self, values: Sequence[Any]) -> dict[str, np.ndarray]:
        """buffer -> `[S, (shards,) L]` numpy rows of the leaves `values` (in `leaves` order)."""
        rows = {b: np.zeros((len(self.stages),) + self.leads.get(b, ()) + (n,), dtype=buffer_dtype(b))
                for b, n in self.lengths.items()}
        by_leaf = dict(zip(self.leaves, values))
        for s, layout in enumerate(self.stages):
            for leaf, slot in zip(layout.keys, layout.slots):
                stored = np.asarray(self.to_stored(leaf, np.asarray(by_leaf[leaf])))
                lead = self.leads.get(slot.buffer, ())
                rows[slot.buffer][self.rows[s], ..., slot.offset:slot.offset + slot.size] = stored.reshape(
                    lead + (slot.size,))
        return rows

    def leaf_from_rows(self, rows: Mapping[str, Any], leaf: int, stage: int | None = None, first_row: int = 0) -> Any:
        """A leaf (its own shape) from rows (host or device), read on `stage` (default: its home);
        `rows` may start at row `first_row` (one device stage's rows)."""
        s = self.home(leaf) if stage is None else stage
        slot = self.stages[s].slot(leaf)
        lead = self.leads.get(slot.buffer, ())
        stored = rows[slot.buffer][self.rows[s] - first_row, ..., slot.offset:slot.offset + slot.size].reshape(
            lead + slot.shape)
        return self.to_global(leaf, stored)

    def unpack(self, stage: int, row: Mapping[str, Any]) -> dict[int, Any]:
        """Leaves of `stage` from its local row (inside the program)."""
        stored = self.stages[stage].unpack(row, self.leads)
        return {leaf: self.to_global(leaf, value) for leaf, value in stored.items()}

    def pack(self, stage: int, values: Mapping[int, Any]) -> dict[str, Any]:
        stored = {leaf: self.to_stored(leaf, values[leaf]) for leaf in self.stages[stage].keys}
        return self.stages[stage].pack(stored, self.lengths, self.leads)


def circular_rows(n_stages: int, repeats: int) -> tuple[int, ...]:
    """Logical stage -> row of the `[S V, L]` arrays sharded on `stage`: device stage s holds rows
    s V .. s V + V - 1, the logical stages s, S + s, ..., (V - 1) S + s in round order."""
    return tuple((k % n_stages) * repeats + k // n_stages for k in range(n_stages * repeats))


def _placement(leaf: int, aval: Any, spec: Any, mesh_axes: Mapping[str, int]) -> tuple[Placement, tuple[str, ...]]:
    """Replicated, or split on its one sharded dim (the spmd executor stores local shards)."""
    if spec is None:
        return Placement(sharded_buffer(aval.dtype, ())), ()
    split = [(d, (entry,) if isinstance(entry, str) else tuple(entry)) for d, entry in enumerate(spec)
             if entry is not None]
    if not split:
        return Placement(sharded_buffer(aval.dtype, ())), ()
    if len(split) > 1:
        raise RunError(f"parameter {leaf} (shape {aval.shape}) is split on {len(split)} dims by the plan ({spec}); "
                       "the spmd executor stores a parameter split on one dim, use the mpmd executor")
    d, axes = split[0]
    unknown = [a for a in axes if a not in mesh_axes]
    if unknown:
        raise RunError(f"parameter {leaf} is split over mesh axes {unknown} that the stage mesh {dict(mesh_axes)} lacks")
    shards = math.prod(mesh_axes[a] for a in axes)
    if aval.shape[d] % shards:
        raise RunError(f"parameter {leaf} dim {d} of size {aval.shape[d]} does not split into {shards} shards")
    return Placement(sharded_buffer(aval.dtype, axes), d, shards), axes


def _floating(dtype: str) -> bool:
    return bool(jnp.issubdtype(np.dtype(dtype), jnp.floating))


class SpmdPipeline:
    """The spmd executor for one traced step and pipeline plan (module docstring)."""

    def __init__(self, program: PipelineProgram, order: Sequence[Any],
                 compiler_options: Mapping[str, Any] | None = None, remat: bool | None = None):
        section = program.section
        # rematerializing a stage call saves memory only when several microbatches are in flight
        # on a stage; with one, it would recompute the forward pass for nothing (unless the plan asks)
        self.remat = lockstep_remat(section.microbatches, bool(section.recompute)) if remat is None else remat
        if not section.uniform:
            raise ValueError("the spmd executor needs every stage to have the same mesh and specs; use the mpmd "
                             "executor")
        self.program = program
        traced = program.traced
        self.n_stages = section.n_stages
        self.repeats = section.repeats
        self.logical = section.logical_stages
        self.rows = circular_rows(self.n_stages, self.repeats)
        self.microbatches = section.microbatches
        devices = devices_at(order, [d for ids in section.devices for d in ids], "the pipeline plan")
        inner = section.inner[0]
        self.mesh = mesh_of(devices, ((STAGE_AXIS, self.n_stages),) + inner)
        self.inner_axes = dict(inner)
        self.batch_axes = batch_axes(section.parameters[0], traced, self.inner_axes, program.microbatch)
        self.specs = leaf_specs(section.parameters[0], traced.state_leaves)
        flat_avals = [v.aval for v in traced.step.jaxpr.invars]
        n0, n1 = traced.arg_sizes[0], traced.arg_sizes[1]
        trees = traced.arg_tree.children()
        residence = program.update.residence
        self.params = RowLayout.of(range(n0), flat_avals[:n0], residence, self.logical, self.specs, self.inner_axes,
                                   trees[0], self.rows)
        self.opt = RowLayout.of(range(n0, n0 + n1), flat_avals[n0:n0 + n1], residence, self.logical, self.specs,
                                self.inner_axes, trees[1], self.rows)
        self.cut_layouts = [BatchedLayout.of([v.aval for v in stage.sends], program.microbatch)
                            for stage in program.split.stages[:-1]]
        self.act_lengths = buffer_lengths(self.cut_layouts)
        self.aux_layouts = [FlatLayout.of([(j, program.micro.loss.jaxpr.outvars[1 + j].aval) for j in stage.aux])
                            for stage in program.split.stages]
        self.aux_lengths = {d: max(n, 1) for d, n in buffer_lengths(self.aux_layouts).items()}
        outvars = traced.step.jaxpr.outvars
        self.out_layouts = [FlatLayout.of([(o, outvars[o].aval) for o in sorted(program.update.owner)
                                           if program.update.owner[o] == s]) for s in range(self.logical)]
        self.out_lengths = {d: max(n, 1) for d, n in buffer_lengths(self.out_layouts).items()}
        self.replicated = NamedSharding(self.mesh, P())
        self.batch_leaves = frozenset(item.leaf - traced.state_leaves for item in traced.loss_inputs
                                      if item.kind is InputKind.DATA)
        self.batch_sharding = NamedSharding(self.mesh, P(self.batch_axes or None))
        options = dict(compiler_options or {}) or None
        self._pipeline_jit = _Checked(jax.jit(self._loss_and_grads, compiler_options=options))
        self._step_jit = _Checked(jax.jit(self._step, donate_argnums=(0, 1), compiler_options=options))
        self.stage_meshes = [Mesh(self.mesh.devices[d], self.mesh.axis_names[1:]) for d in range(self.n_stages)]
        self._unpack = tuple([self._make_stage_unpack(layout, d, options) for d in range(self.n_stages)]
                             for layout in (self.params, self.opt))
        self._unpack_whole = (self._make_unpack(self.params, options), self._make_unpack(self.opt, options))
        # per state argument: (the leaves the last step returned, the rows they came from)
        self._returned: list[tuple[tuple[Any, ...], Staged] | None] = [None, None]

    # -- state: the user's pytrees in and out ----------------------------------------------------
    def place(self, params: Any, opt_state: Any) -> tuple[Any, Any]:
        """The user's pytrees as the step returns them (`_user_trees`), laid out in rows for the next step."""
        return self._user_trees(*self._stage_state(params, opt_state))

    def gather(self, params: Any, opt_state: Any) -> tuple[Any, Any]:
        """The user's pytrees as numpy arrays on the host."""
        if not isinstance(params, Staged):
            return jax.tree.map(to_host, params), jax.tree.map(to_host, opt_state)
        out = []
        for staged in (params, opt_state):
            layout: RowLayout = staged.layout
            rows = {b: to_host(r) for b, r in staged.parts.items()}
            values = [np.asarray(layout.leaf_from_rows(rows, leaf)) for leaf in layout.leaves]
            out.append(jax.tree_util.tree_unflatten(layout.treedef, values))
        return out[0], out[1]

    def _stage_state(self, params: Any, opt_state: Any, consume: bool = False) -> tuple[Staged, Staged]:
        """The user's pytrees as rows. The very leaves the last step returned take the rows it kept
        (no copy, no transfer; with `consume`, the step about to donate them forgets them, so the
        leaves, which are copies, can still be given again); any other pytree is packed into rows
        through the host, as `place` always did."""
        out = []
        for k, (layout, tree) in enumerate(((self.params, params), (self.opt, opt_state))):
            if isinstance(tree, Staged):
                out.append(tree)
                continue
            leaves = state_leaves(tree, len(layout.leaves))
            returned = self._returned[k]
            if returned is not None and len(returned[0]) == len(leaves) and all(
                    a is b for a, b in zip(returned[0], leaves)):
                out.append(returned[1])
                if consume:
                    self._returned[k] = None
                continue
            rows = layout.host_rows([to_host(x) for x in leaves])
            out.append(Staged({b: put(r, NamedSharding(self.mesh, layout.spec(b))) for b, r in rows.items()}, layout))
        return out[0], out[1]

    def _user_trees(self, params: Staged, opt_state: Staged) -> tuple[Any, Any]:
        """The user's pytrees from the rows, each leaf a `jax.Array` on its home stage's devices
        (its first logical stage's), split as the plan splits it inside the stage: per device
        stage, the rows' shards on its devices viewed as that stage's own rows (no copy) and one
        program that slices its leaves out of them (a copy of the state on the stage, the
        conversion's cost, docs/python-api.md). Across processes one program over the whole mesh
        slices them instead, each leaf replicated over the stages. The rows are kept for the next step."""
        trees = []
        for k, staged in enumerate((params, opt_state)):
            layout: RowLayout = staged.layout
            values: dict[int, Any] = {}
            if jax.process_count() > 1:
                values.update(zip(layout.leaves, self._unpack_whole[k](staged.parts)))
            else:
                for d, (homes, unpack) in enumerate(self._unpack[k]):
                    if homes:
                        values.update(zip(homes, unpack(self._stage_rows(staged.parts, layout, d))))
            leaves = tuple(values[leaf] for leaf in layout.leaves)
            self._returned[k] = (leaves, staged)
            trees.append(jax.tree_util.tree_unflatten(layout.treedef, list(leaves)))
        return trees[0], trees[1]

    def _stage_rows(self, rows: Mapping[str, Any], layout: RowLayout, d: int) -> dict[str, Any]:
        """Device stage d's `[V, ...]` rows as arrays on its own mesh, made of the shards it holds."""
        mesh = self.stage_meshes[d]
        devices = set(mesh.devices.flat)
        out = {}
        for b, r in rows.items():
            sharding = NamedSharding(mesh, P(None, *tuple(layout.spec(b))[1:]))
            shards = [shard.data for shard in r.addressable_shards if shard.device in devices]
            out[b] = jax.make_array_from_single_device_arrays((self.repeats,) + r.shape[1:], sharding, shards)
        return out

    def _make_stage_unpack(self, layout: RowLayout, d: int, options: Mapping[str, Any] | None) -> tuple[list[int], Any]:
        """(the leaves whose home is on device stage d, the program slicing them out of its rows)."""
        homes = [leaf for leaf in layout.leaves if layout.rows[layout.home(leaf)] // self.repeats == d]
        shardings = [NamedSharding(self.stage_meshes[d], self.specs.get(leaf) or P()) for leaf in homes]
        first_row = d * self.repeats
        return homes, jax.jit(lambda rows: [layout.leaf_from_rows(rows, leaf, first_row=first_row) for leaf in homes],
                              out_shardings=shardings, compiler_options=options)

    def _make_unpack(self, layout: RowLayout, options: Mapping[str, Any] | None) -> Any:
        shardings = [NamedSharding(self.mesh, self.specs.get(leaf) or P()) for leaf in layout.leaves]
        return jax.jit(lambda rows: [layout.leaf_from_rows(rows, leaf) for leaf in layout.leaves],
                       out_shardings=shardings, compiler_options=options)

    def __call__(self, params: Any, opt_state: Any, *rest: Any) -> Any:
        """One step on the user's pytrees (or `Staged` rows), returning the user's pytrees."""
        self.program.check_arguments(rest)
        params, opt_state = self._stage_state(params, opt_state, consume=True)
        rest = self._put_arguments(rest)
        new_params, new_opt_state, *out = self._step_jit(params, opt_state, *rest)
        return (*self._user_trees(new_params, new_opt_state), *out)

    def _put_arguments(self, rest: Sequence[Any]) -> Any:
        """The non-state arguments on the mesh: batch leaves split on the stage's batch axes
        (each device receives its share, not the whole batch; with several microbatches the
        program then moves examples to their microbatch's devices), the rest replicated.
        (Passing the batch already reshaped to `[M, mb, ...]` and split on `mb` made JAX 0.10.2
        fail to lower the stage programs: an operand type mismatch in a nested call of the loss.)"""
        leaves, treedef = jax.tree_util.tree_flatten(tuple(rest))
        placed = []
        for j, value in enumerate(leaves):
            if j in self.batch_leaves:
                self.program.check_batch_leaf(value)
                placed.append(put(value, self.batch_sharding, own=False))
            else:
                placed.append(put(value, self.replicated, own=False))
        return jax.tree_util.tree_unflatten(treedef, placed)

    # -- the program ------------------------------------------------------------------------------
    def _arguments(self, rest: Sequence[Any]) -> list[Any]:
        """Flat non-state arguments (batch, later arguments)."""
        return jax.tree_util.tree_leaves(tuple(rest))

    def _microbatched(self, args: Sequence[Any]) -> tuple[list[Any], list[Any]]:
        """(microbatched [M, mb, ...] batch leaves, whole later-argument leaves) for every loss
        input of those kinds, in `program.data_inputs()` order."""
        program = self.program
        n_state = program.traced.state_leaves
        m, mb = self.microbatches, program.microbatch
        spec = P(None, self.batch_axes or None)
        split, whole = [], []
        for p in program.data_inputs():
            item = program.traced.loss_inputs[p]
            value = args[item.leaf - n_state]
            if item.kind is InputKind.DATA:
                value = jnp.reshape(value, (m, mb) + value.shape[1:])
                split.append(lax.with_sharding_constraint(value, NamedSharding(self.mesh, spec)))
                whole.append(None)
            else:
                split.append(None)
                whole.append(value)
        return split, whole

    def _stage_values(self, stage: int, p_row: Mapping[str, Any], o_row: Mapping[str, Any]) -> dict[int, Any]:
        """State leaves of `stage` from its local rows, with the plan's specs inside the stage."""
        values = {**self.params.unpack(stage, p_row), **self.opt.unpack(stage, o_row)}
        for leaf, spec in self.specs.items():
            if leaf in values:
                values[leaf] = self._constrain(values[leaf], spec)
        return values

    # -- the stage axis ---------------------------------------------------------------------------
    # With one device stage the `stage` axis has size 1 and the shard_map over it would change
    # nothing but the program XLA builds: partitioning a partly manual computation, XLA copied
    # every donated state buffer and gathered the embedding's gradient, +15% on a one-stage step
    # of gpt-tiny. So the same body then runs on the whole mesh directly (stage index 0, the
    # shift a no-op), as a shard_map over a one-device axis would.
    def _over_stages(self, body: Any, in_specs: Any, out_specs: Any) -> Any:
        if self.n_stages == 1:
            return body
        return jax.shard_map(body, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs, axis_names={STAGE_AXIS},
                             check_vma=False)

    def _stage_index(self) -> Any:
        return lax.axis_index(STAGE_AXIS) if self.n_stages > 1 else jnp.zeros((), jnp.int32)

    def _shift(self, x: Any, pairs: Sequence[tuple[int, int]]) -> Any:
        """`ppermute` over `stage`; on one stage, what `ppermute` does there: a ring of one keeps
        the value, no pair leaves zeros."""
        if self.n_stages > 1:
            return lax.ppermute(x, STAGE_AXIS, pairs)
        return x if pairs else jnp.zeros_like(x)

    def _constrain(self, x: Any, spec: Any) -> Any:
        """A sharding constraint inside a stage: a bare spec names the axes of the shard_map's
        mesh; without the shard_map it needs the mesh itself."""
        return lax.with_sharding_constraint(x, spec if self.n_stages > 1 else NamedSharding(self.mesh, spec))

    def _pipeline(self, p_float: Mapping[str, Any], p_other: Mapping[str, Any], o_rows: Mapping[str, Any],
                  split: Sequence[Any], whole: Sequence[Any]) -> tuple[Any, dict[str, Any]]:
        program = self.program
        traced = program.traced
        m, n_stages, repeats, n_logical = self.microbatches, self.n_stages, self.repeats, self.logical
        stages = program.split.stages
        data_positions = program.data_inputs()
        differentiated = {traced.loss_inputs[p].leaf for p in traced.grads}
        loss_dtype = traced.loss.jaxpr.outvars[0].aval.dtype
        batch_spec = P(self.batch_axes or None)

        def branch(k: int) -> Any:
            program_k = stages[k]

            def run(p_row: Any, o_row: Any, buffers: Any, micro: Sequence[Any]) -> Any:
                values = self._stage_values(k, p_row, o_row)
                values = {leaf: (v if leaf in differentiated else lax.stop_gradient(v)) for leaf, v in values.items()}
                by_position = dict(zip(data_positions, micro))
                params = [values[traced.loss_inputs[p].leaf] for p in program_k.params]
                state = [values[traced.loss_inputs[p].leaf] for p in program_k.state]
                data = [by_position[p] for p in program_k.data]
                received = self.cut_layouts[k - 1].unpack(buffers) if k > 0 else []
                sent, aux, loss = program_k.run(params, state, data, received)
                out = (self.cut_layouts[k].pack(sent, self.act_lengths) if k < n_logical - 1
                       else self._empty_activations())
                out = {key: (self._constrain(v, batch_spec) if key[1] and self.batch_axes else v)
                       for key, v in out.items()}
                aux_buf = self.aux_layouts[k].pack(dict(zip(program_k.aux, aux)), self.aux_lengths)
                loss = jnp.zeros((), loss_dtype) if loss is None else loss
                return out, aux_buf, loss

            return run

        branches = [branch(k) for k in range(n_logical)]

        def body(p_float: Any, p_other: Any, o_rows: Any, split: Any, whole: Any) -> Any:
            s = self._stage_index()
            p_rows = {**p_float, **p_other}  # local: this device stage's `repeats` rows
            # a circular pipeline sends the last device stage's output round to the first
            shift = [(j, (j + 1) % n_stages) for j in range(n_stages if repeats > 1 else n_stages - 1)]

            def tick(carry: Any, t: Any) -> Any:
                buffers, storage, loss_sum, aux_acc = carry
                j = t - s  # this device stage's iteration: microbatch j mod M in round j // M
                valid = (j >= 0) & (j < m * repeats)
                index = jnp.clip(j, 0, m * repeats - 1)
                i, v = index % m, index // m
                if repeats > 1:
                    buffers, storage = self._circulate(buffers, storage, s, t, i)
                micro = [lax.dynamic_index_in_dim(x, i, keepdims=False) if x is not None else w
                         for x, w in zip(split, whole)]
                p_row, o_row = _row(p_rows, v, repeats), _row(o_rows, v, repeats)
                logical = v * n_stages + s if repeats > 1 else s

                def call(p_row: Any, o_row: Any, buffers: Any, micro: Any) -> Any:
                    return lax.switch(logical, branches, p_row, o_row, buffers, micro)

                run = jax.checkpoint(call, policy=jax.checkpoint_policies.nothing_saveable) if self.remat else call
                out, aux_buf, loss = run(p_row, o_row, buffers, micro)
                loss_sum = loss_sum + jnp.where(valid, loss, jnp.zeros_like(loss))
                aux_acc = {d: _add_row(a, v, valid, aux_buf[d], _floating(d)) for d, a in aux_acc.items()}
                buffers = {key: self._shift(x, shift) for key, x in out.items()}
                return (buffers, storage, loss_sum, aux_acc), None

            storage = ({key: jnp.zeros((m,) + x.shape, x.dtype) for key, x in self._empty_activations().items()}
                       if repeats > 1 else {})
            init = (self._empty_activations(), storage, jnp.zeros((), loss_dtype),
                    {d: jnp.zeros((repeats, n), d) for d, n in self.aux_lengths.items()})
            (_, _, loss_sum, aux_acc), _ = lax.scan(tick, init, jnp.arange(m * repeats + n_stages - 1))
            loss = (lax.psum(loss_sum, STAGE_AXIS) if n_stages > 1 else loss_sum) / m
            aux = {d: (a / m if _floating(d) else a) for d, a in aux_acc.items()}
            return loss, aux

        row = P(STAGE_AXIS)
        in_specs = (jax.tree.map(lambda _: row, p_float), jax.tree.map(lambda _: row, p_other),
                    jax.tree.map(lambda _: row, o_rows), [P() if x is not None else None for x in split],
                    [P() if w is not None else None for w in whole])
        mapped = self._over_stages(body, in_specs, (P(), {d: row for d in self.aux_lengths}))
        return mapped(p_float, p_other, o_rows, split, whole)

    def _empty_activations(self) -> dict[tuple[str, bool], Any]:
        mb = self.program.microbatch
        return {key: jnp.zeros(_buffer_shape(key, n, mb), key[0]) for key, n in self.act_lengths.items()}

    def _circulate(self, arrived: Mapping[Any, Any], storage: Mapping[Any, Any], s: Any, t: Any,
                   i: Any) -> tuple[dict[Any, Any], dict[Any, Any]]:
        """A circular pipeline's loop back: what reached device stage 0 at tick t left the last
        device stage at iteration t - S (microbatch (t - S) mod M, which comes back for its next
        round M - S ticks later); stage 0 keeps it in `storage` (one slot per microbatch) and,
        from its second round on, reads microbatch i's from there. Other stages take what
        arrived."""
        m, n_stages, repeats = self.microbatches, self.n_stages, self.repeats
        came = t - n_stages
        keep = (s == 0) & (came >= 0) & (came < m * (repeats - 1))  # the last round's output goes no further
        slot = jnp.clip(came, 0, m * repeats - 1) % m
        stored = {}
        for key, x in arrived.items():
            old = lax.dynamic_index_in_dim(storage[key], slot, keepdims=False)
            stored[key] = lax.dynamic_update_index_in_dim(storage[key], jnp.where(keep, x, old), slot, 0)
        inbound = {key: jnp.where(s == 0, lax.dynamic_index_in_dim(stored[key], i, keepdims=False), x)
                   for key, x in arrived.items()}
        return inbound, stored

    def _loss_and_grads(self, params: Staged, opt_state: Staged, *rest: Any) -> tuple[Any, Any, Any]:
        """(loss, aux rows, gradient rows): the pipeline, one program."""
        args = self._arguments(rest)
        split, whole = self._microbatched(args)
        p_float = {b: r for b, r in params.parts.items() if _floating(buffer_dtype(b))}
        p_other = {b: r for b, r in params.parts.items() if not _floating(buffer_dtype(b))}
        (loss, aux_rows), grads = jax.value_and_grad(self._pipeline, has_aux=True)(
            p_float, p_other, opt_state.parts, split, whole)
        shared = self.params.shared

        def sum_shared(b: str, g: Any) -> Any:
            if b not in shared or self.logical == 1:
                return g
            return jnp.broadcast_to(jnp.sum(g, axis=0, keepdims=True), g.shape)

        grads = {b: lax.with_sharding_constraint(sum_shared(b, g), NamedSharding(self.mesh, self.params.spec(b)))
                 for b, g in grads.items()}
        return loss, aux_rows, grads

    def _step(self, params: Staged, opt_state: Staged, *rest: Any) -> Any:
        """The whole step, one program: the pipeline's loss and gradients, then every stage's update."""
        loss, aux_rows, grads = self._loss_and_grads(params, opt_state, *rest)
        return self._update(params, opt_state, grads, aux_rows, loss, *rest)

    def value_and_grad(self, params: Any, opt_state: Any, *rest: Any) -> tuple[Any, list[Any], list[Any]]:
        """(loss, aux leaves, gradient leaves) of the marked call, as the pipeline computes them
        (host arrays)."""
        program = self.program
        traced = program.traced
        program.check_arguments(rest)
        params, opt_state = self._stage_state(params, opt_state)
        rest = self._put_arguments(rest)
        loss, aux_rows, grads = self._pipeline_jit(params, opt_state, *rest)
        aux_rows = {d: to_host(r) for d, r in aux_rows.items()}
        grads = {d: to_host(r) for d, r in grads.items()}
        p_rows = {b: to_host(r) for b, r in params.parts.items()}
        o_rows = {b: to_host(r) for b, r in opt_state.parts.items()}
        aux = [np.asarray(self._aux_value(j, source, aux_rows, p_rows, o_rows))
               for j, source in enumerate(program.split.aux)]
        out_grads = []
        for position in traced.grads:
            leaf = traced.loss_inputs[position].leaf
            out_grads.append(np.asarray(self.params.leaf_from_rows(grads, leaf)))
        return to_host(loss), aux, out_grads

    def _aux_value(self, j: int, source: Any, aux_rows: Mapping[str, Any], p_rows: Mapping[str, Any],
                   o_rows: Mapping[str, Any]) -> Any:
        traced = self.program.traced
        if source.stage is not None:
            return _slice(aux_rows, self.aux_layouts[source.stage], self.rows[source.stage], j)
        if source.loss_input is not None:
            item = traced.loss_inputs[source.loss_input]
            if item.kind is InputKind.CONST:
                return item.value
            layout, rows = (self.params, p_rows) if item.leaf < traced.arg_sizes[0] else (self.opt, o_rows)
            return layout.leaf_from_rows(rows, item.leaf)
        return source.constant

    def _update(self, params: Staged, opt_state: Staged, grads: Any, aux_rows: Any, loss: Any, *rest: Any) -> Any:
        """Every (logical) stage's update on its own rows: a second `shard_map`."""
        program = self.program
        traced = program.traced
        args = self._arguments(rest)
        n_state = traced.state_leaves
        update = program.update
        marker_aux_stage = [source.stage for source in program.split.aux]

        def branch(k: int) -> Any:
            update_k = update.programs[k]

            def run(p_row: Any, o_row: Any, g_row: Any, aux_row: Any, loss: Any, args: Any) -> Any:
                values = self._stage_values(k, p_row, o_row)
                grad_values = self.params.unpack(k, g_row)
                aux_values = self.aux_layouts[k].unpack(aux_row)
                inputs = []
                for item in update_k.inputs:
                    if item.source is Source.STATE:
                        inputs.append(values[item.index])
                    elif item.source is Source.ARGUMENT:
                        inputs.append(args[item.index - n_state])
                    elif item.source is Source.LOSS:
                        inputs.append(loss)
                    elif item.source is Source.AUX:
                        if marker_aux_stage[item.index] is not None:
                            inputs.append(aux_values[item.index])
                        else:
                            inputs.append(self._passthrough(item.index, values))
                    else:
                        leaf = traced.loss_inputs[traced.grads[item.index]].leaf
                        inputs.append(grad_values[leaf] if leaf in grad_values
                                      else jnp.zeros(traced.step.jaxpr.invars[leaf].aval.shape,
                                                     traced.step.jaxpr.invars[leaf].aval.dtype))
                outputs = dict(zip(update_k.outputs, update_k.run(*inputs)))
                new_p = self.params.pack(k, outputs)
                new_o = self.opt.pack(k, outputs)
                out = self.out_layouts[k].pack(outputs, self.out_lengths)
                return new_p, new_o, out

            return run

        branches = [branch(k) for k in range(self.logical)]

        def body(p_rows: Any, o_rows: Any, g_rows: Any, aux_rows: Any, loss: Any, args: Any) -> Any:
            s = self._stage_index()
            rounds = []
            for v in range(self.repeats):  # this device stage's logical stages v S + s, one row each
                at = lambda rows: {d: r[v] for d, r in rows.items()}  # noqa: E731 - local rows
                g_row = {**at(g_rows), **{d: jnp.zeros_like(r[v]) for d, r in p_rows.items() if d not in g_rows}}
                rounds.append(lax.switch(s, branches[v * self.n_stages:(v + 1) * self.n_stages], at(p_rows),
                                         at(o_rows), g_row, at(aux_rows), loss, args))
            return jax.tree.map(lambda *xs: jnp.stack(xs), *rounds)

        row = P(STAGE_AXIS)
        rows_spec = lambda rows: {d: row for d in rows}  # noqa: E731
        mapped = self._over_stages(
            body,
            (rows_spec(params.parts), rows_spec(opt_state.parts), rows_spec(grads), rows_spec(aux_rows), P(),
             [P() for _ in args]),
            (rows_spec(params.parts), rows_spec(opt_state.parts), rows_spec(self.out_lengths)))
        new_p, new_o, out_rows = mapped(params.parts, opt_state.parts, grads, aux_rows, loss, list(args))
        flat: list[Any] = [None] * len(traced.step.jaxpr.outvars)
        for o, s in update.owner.items():
            flat[o] = _slice(out_rows, self.out_layouts[s], self.rows[s], o)
        results = jax.tree_util.tree_unflatten(traced.out_tree, flat)
        return (Staged(new_p, self.params), Staged(new_o, self.opt), *results[2:])

    def _passthrough(self, j: int, values: Mapping[int, Any]) -> Any:
        source = self.program.split.aux[j]
        if source.loss_input is not None:
            item = self.program.traced.loss_inputs[source.loss_input]
            return jnp.asarray(item.value) if item.kind is InputKind.CONST else values[item.leaf]
        return jnp.asarray(source.constant)


class _Checked:
    """A jitted program compiled once per argument layout and checked before it first runs.

    Each stage's code sits in a branch of a conditional that only that stage's devices take.
    XLA partitions a branch as if every device ran it; a collective-permute it puts there (to
    reshard between layouts it cannot convert locally) then waits on the CPU runtime for
    devices that never arrive, and the process hangs until XLA aborts it. Such a program is
    refused with an explanation instead.
    """

    def __init__(self, jitted: Any):
        self.jitted = jitted
        self.compiled: dict[Any, Any] = {}

    def __call__(self, *args: Any) -> Any:
        leaves, treedef = jax.tree_util.tree_flatten(args)
        key = (treedef, tuple((x.shape, x.dtype, getattr(x, "sharding", None)) for x in leaves))
        if key not in self.compiled:
            compiled = self.jitted.lower(*args).compile()
            if jax.devices()[0].platform == "cpu":
                _refuse_branch_permutes(compiled.as_text())
            self.compiled[key] = compiled
        return self.compiled[key](*args)


def _refuse_branch_permutes(text: str) -> None:
    for line in text.splitlines():
        if " collective-permute(" in line and "/cond/branch_" in line and "ppermute" not in line.split("=")[0]:
            where = line.split('op_name="', 1)[-1].split('"', 1)[0]
            raise RunError(f"XLA resharded a value inside a stage's branch with a collective-permute ({where}); on "
                           "the CPU runtime that waits for devices of other stages and hangs. Use the mpmd executor "
                           "for this plan, or parameter specs that split one dim each")


def _row(rows: Mapping[str, Any], v: Any, repeats: int) -> dict[str, Any]:
    """Row v of each local `[V, L]` array (a static index without a circular schedule: its
    gradient is then the row itself, not an update of a zero array)."""
    if repeats == 1:
        return {d: r[0] for d, r in rows.items()}
    return {d: lax.dynamic_index_in_dim(r, v, keepdims=False) for d, r in rows.items()}


def _add_row(acc: Any, row: Any, valid: Any, value: Any, floating: bool) -> Any:
    """Aux accumulators `[V, n]`: a float row sums what valid ticks computed (the mean is taken at
    the end); another dtype keeps the latest valid value."""
    current = lax.dynamic_index_in_dim(acc, row, keepdims=False)
    updated = current + jnp.where(valid, value, 0) if floating else jnp.where(valid, value, current)
    return lax.dynamic_update_index_in_dim(acc, updated, row, 0)


def _slice(rows: Mapping[str, Any], layout: FlatLayout, row: int, key: Any) -> Any:
    """Leaf `key` of row `row` (host or device rows)."""
    slot = layout.slot(key)
    return rows[slot.buffer][row, slot.offset:slot.offset + slot.size].reshape(slot.shape)


def _buffer_shape(key: tuple[str, bool], length: int, microbatch: int) -> tuple[int, ...]:
    return (microbatch, length) if key[1] else (length,)
