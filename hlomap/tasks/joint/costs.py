"""What one pipeline stage costs when it runs a range of a train step's layers on a device group
with a `data x model` mesh and a sharding plan: the inner level of the joint planner.

The prices are the cost model's (`hlomap.cost.estimate.step_work`: the roofline of every
instruction split by the plan, the collectives the plan implies on the group's devices); this
module only sums them per forward-chain position (`cost.pipeline.chain.attribute`), so that a
stage's cost is a difference of prefix sums. A plan array applies to the whole graph and every
instruction's price depends on its own sharding only, so restricting a plan to a stage is
restricting the sum to the stage's instructions: one estimate per (mesh shape, plan) prices
every stage range at once (Alpa's two-level decomposition, section 5, with the stage-level
memo being these prefix sums).

Per microbatch of a step split into M: compute, bytes of partial-result collectives and
stashed activations scale with 1/M (they are proportional to the batch, as
`cost.pipeline.profile.scale_batch` assumes); a collective's latency is paid once per
microbatch; parameters, their gradient all-reduce over the `data` axis and the optimizer update
are per step (amortized over the M microbatches, as the pipeline closed form does).
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import math
import re
from dataclasses import dataclass, field
from typing import Any, Mapping, NamedTuple, Sequence

import numpy as np

from hlomap.cost.cluster import Cluster
from hlomap.cost.collectives import Collective, collective_permute_terms, collective_time
from hlomap.cost.compute import MATRIX_OPCODES
from hlomap.cost.estimate import (CollectiveEstimate, InstructionArrays, InstructionEstimate, Reason,
                                  pass_buffers, per_buffer_seconds, state_leaves, step_arrays)
from hlomap.cost.mapping import AxisMapping, axis_devices
from hlomap.cost.sharding import GraphFacts, ShardedGraph
from hlomap.cost.zero import state_axes
from hlomap.hlo.capture import Capture, Phase, Role
from hlomap.hlo.source_info import layer_name
from hlomap.plan.sections import Recompute
from hlomap.propagation.conflicts import MeshAxes
from hlomap.propagation.graph import FactorGraph
from hlomap.propagation.plans import combine, data_parallel_plan, empty_plan, megatron_plan
from hlomap.cost.pipeline.chain import ChainAttribution, attribute, crossing_of, kept_bytes
from hlomap.tasks.joint.scaling import (FAMILY_WIDTHS, UPDATE, DataScaling, PositionedCollective,
                                        StageWork, fit_data_scaling, per_position)

log = logging.getLogger(__name__)

#: How a stage option's recomputation reads in its description (`StageOption.__str__`, reports).
RECOMPUTED_WORDS = {Recompute.NONE: "", Recompute.SELECTIVE: ", recomputed except its matmuls",
                    Recompute.FULL: ", recomputed"}

__all__ = ["JointModel", "PlanKind", "StageArrays", "StageOption", "block_ends", "stage_options", "step_batch"]

#: Bytes kept per parameter byte: weights, gradients and Adam's two moments (as the pipeline
#: cost model's `CostOptions.param_memory_factor`).
PARAM_MEMORY_FACTOR = 4.0


class PlanKind(enum.Enum):
    """Which sharding plan a stage runs on its mesh.

    EXPERT: the batch split over `data` and Megatron tensor parallelism over `model` (what a
    user copies from Megatron-LM); SEARCHED: the sharding explorer's best plan for the mesh (cost
    reward), found by the driver the planner was given.
    """

    EXPERT = "expert"
    SEARCHED = "searched"


@dataclass(frozen=True, order=True)
class StageOption:
    """A stage's device group and what runs on it: `devices = data * model` devices, the mesh
    shape, the plan kind, what the stage recomputes of its forward pass in its backward
    (`hlomap.plan.Recompute`: FULL, one more forward per microbatch, its inputs kept instead of
    its activations; SELECTIVE, the forward's work other than its matmuls again, its inputs and
    matmul outputs kept), whether it splits its optimizer state over its `data` replicas
    (`split_state`, ZeRO-1: Adam's moments at 1 / data, each replica updates its slice and the
    updated parameters are all-gathered once per step), whether its gradients are split there
    too (`shard_gradients`, ZeRO-2, which implies `split_state`: each microbatch's gradients are
    reduce-scattered instead of all-reduced, and gradients and moments kept at 1 / data), and
    whether its parameters stay split there too (`shard_parameters`, FSDP / ZeRO-3, which
    implies `split_state` and splits the gradients as well: weights, gradients and moments at 1 /
    data; each pass of each microbatch all-gathers the weights and the backward reduce-scatters
    the gradients instead of all-reducing them)."""

    devices: int
    data: int
    model: int
    kind: PlanKind = PlanKind.EXPERT
    recompute: Recompute = Recompute.NONE
    split_state: bool = False
    shard_parameters: bool = False
    shard_gradients: bool = False

    def __post_init__(self) -> None:
        if (self.shard_parameters or self.shard_gradients) and not self.split_state:
            raise ValueError("a stage whose parameters or gradients are split over its data replicas splits its "
                             "optimizer state too (shard_parameters and shard_gradients need split_state)")
        if self.shard_parameters and self.shard_gradients:
            raise ValueError("shard_parameters splits the gradients already; shard_gradients is the ZeRO-2 option "
                             "that keeps the parameters whole")

    def __str__(self) -> str:
        split = (", parameters and optimizer state split" if self.shard_parameters else
                 ", gradients and optimizer state split" if self.shard_gradients else
                 ", optimizer state split" if self.split_state else "")
        return f"{self.devices} devices, data={self.data} x model={self.model} ({self.kind.value}" \
               f"{RECOMPUTED_WORDS[self.recompute]}{split})"

    @property
    def plain(self) -> StageOption:
        """The same devices, mesh and plan without recomputation or a split state: what the cost
        model prices (`JointModel.arrays` derives the others from its arrays)."""
        return dataclasses.replace(self, recompute=Recompute.NONE, split_state=False, shard_parameters=False,
                                   shard_gradients=False)

    @property
    def mesh(self) -> dict[str, int]:
        return {"data": self.data, "model": self.model}


def step_batch(cap: Capture) -> int:
    """A step's batch: the leading dim of its data inputs (the least, what microbatches split)."""
    return min((p.shape.dims[0] for p in cap.parameters if p.role is Role.DATA and p.shape.rank > 0), default=1)


def group_sizes(cluster: Cluster) -> tuple[int, ...]:
    """Device-group sizes a stage may take: slices of a server (powers of two up to its size)
    and whole servers (multiples of its size), on a cluster with servers of equal size; on one
    device per node (a torus, a mesh), powers of two."""
    per_node = cluster.most_per_node
    sizes = {1 << k for k in range(int(math.log2(cluster.n_devices)) + 1) if (1 << k) <= per_node}
    if per_node > 1:
        sizes |= {per_node * m for m in range(1, cluster.n_devices // per_node + 1)}
    else:
        sizes |= {1 << k for k in range(int(math.log2(cluster.n_devices)) + 1)}
    return tuple(sorted(s for s in sizes if s <= cluster.n_devices))


def stage_options(cluster: Cluster, *, kinds: Sequence[PlanKind] = (PlanKind.EXPERT,),
                  max_model: int | None = None, recompute: Sequence[Recompute] = (Recompute.NONE,),
                  split_state: Sequence[bool] = (False,),
                  shard_parameters: Sequence[bool] = (False,)) -> tuple[StageOption, ...]:
    """Every (group size, data x model, kind, recompute, split state, split parameters): tensor
    parallelism stays inside a server (its all-reduces are on the critical path of every layer)
    unless a node holds one device; the optimizer state and the parameters are split only where
    there are data replicas (data > 1), the parameters only with the optimizer state. Where the
    parameters may be split, the gradients may be split alone too (ZeRO-2)."""
    per_node = cluster.most_per_node
    limit = max_model or (per_node if per_node > 1 else 8)
    out = []
    for n in group_sizes(cluster):
        for model in (m for m in range(1, n + 1) if n % m == 0 and m <= limit and m & (m - 1) == 0):
            for kind in kinds:
                for again in recompute:
                    for split in split_state:
                        if split and n // model == 1:
                            continue
                        for shard in (z for z in shard_parameters if split or not z):
                            out.append(StageOption(n, n // model, model, kind, again, split, shard))
                            if shard:  # the gradients split and the parameters whole: ZeRO-2
                                out.append(StageOption(n, n // model, model, kind, again, split, False, True))
    return tuple(out)


class StageArrays(NamedTuple):
    """Prefix sums (leading 0, one entry per layer boundary) of one option's per-layer costs on
    one device of the stage, for the whole batch, and the option's collective prices.

    compute: forward + backward seconds; alpha: latency of the partial-result collectives,
    paid once per microbatch; beta: their bandwidth seconds for the whole batch; update: the
    optimizer update's seconds; grads: bytes of parameter gradients the `data` axis all-reduces;
    params: parameter bytes on the device; stash: activation bytes kept for the backward pass.
    crossing[k]: bytes of the cut after layer k on one device (k < n_layers - 1).
    sync_alpha/sync_beta: the gradient all-reduce over the option's data groups, affine in bytes;
    buffers: how many gradient buffers it combines, and sync_per_buffer what each after the first
    adds (`hlomap.cost.estimate.per_buffer_seconds`, 0 on a datasheet cluster): the SPMD estimate's
    combined all-reduce, so a one-stage plan costs what the same SPMD plan does.
    inputs[k]: bytes entering layer k on one device (not a prefix sum: what a stage starting at
    layer k keeps per microbatch when it recomputes); recompute: what the option's stages
    recompute (`plans.stage_seconds` and `plans.stage_memory` price it); redo: the forward
    seconds a SELECTIVE stage runs again (all but its matmuls); saved: the bytes it keeps per
    microbatch besides its input (its forward's matmul outputs).
    split_state: the option's stages split their optimizer state over their `data` replicas
    (`StageOption.split_state`); gather_alpha/gather_beta: the combined all-gather of their
    updated parameters over the data groups, affine in the gathered bytes (`params`).
    shard_parameters: the option's parameters stay split over `data` too (FSDP,
    `StageOption.shard_parameters`); shard_gradients: its gradients are split there (ZeRO-2,
    `StageOption.shard_gradients`); scatter_alpha/scatter_beta: the reduce-scatter of their
    gradients over the data groups, affine in the gradient bytes (`grads`).
    """

    compute: np.ndarray
    alpha: np.ndarray
    beta: np.ndarray
    update: np.ndarray
    grads: np.ndarray
    params: np.ndarray
    stash: np.ndarray
    crossing: np.ndarray
    sync_alpha: float
    sync_beta: float
    plan: np.ndarray  # the plan array over the graph's groups
    axes: MeshAxes
    buffers: np.ndarray
    sync_per_buffer: float
    forward: np.ndarray  # the forward pass's part of `compute` (for schedules that split the passes)
    inputs: np.ndarray  # [n_layers + 1]: bytes entering layer k on one device (the cut before it; 0 for the first)
    redo: np.ndarray  # the forward's seconds other than its matmuls'
    saved: np.ndarray  # bytes of the forward's matmul outputs
    recompute: Recompute = Recompute.NONE  # what the option's stages run again in the backward
    split_state: bool = False  # the option's stages split their optimizer state over `data`
    data: int = 1  # the option's data replicas
    gather_alpha: float = 0.0
    gather_beta: float = 0.0
    shard_parameters: bool = False  # the option's parameters stay split over `data` (FSDP)
    scatter_alpha: float = 0.0
    scatter_beta: float = 0.0
    shard_gradients: bool = False  # the option's gradients are split over `data` (ZeRO-2)
    #: With `recompute`, [n_layers + 1, n_layers + 1] tables over stages [i, j) (i < j) checkpointed
    #: group by group (`JointModel.checkpoint_groups`, `recompute_tables`): the bytes of the
    #: groups' inputs, and the most one group keeps while the backward recomputes it (its stash,
    #: selectively all but its matmul outputs)
    group_inputs: np.ndarray | None = None
    group_peak: np.ndarray | None = None


def recompute_tables(a: StageArrays, recompute: Recompute, groups: np.ndarray) -> dict[str, np.ndarray | None]:
    """`StageArrays.group_inputs` and `group_peak` of `a` for a stage recomputing as `recompute`,
    its layers checkpointed in `groups` (a group id per layer, non-decreasing). For stage [i, j)
    the groups are the runs of one id inside the range, the first starting at i."""
    if recompute is Recompute.NONE:
        return {"group_inputs": None, "group_peak": None}
    stash = np.diff(a.stash)
    kept = stash if recompute is Recompute.FULL else np.maximum(stash - np.diff(a.saved), 0.0)
    k = len(kept)
    rows, cols = np.arange(k)[:, None], np.arange(k)[None, :]
    ahead = cols >= rows
    starts = ahead & ((cols == rows) | np.concatenate([[True], groups[1:] != groups[:-1]])[None, :])
    prefix = np.concatenate([[0.0], np.cumsum(kept)])
    through = prefix[None, 1:] - prefix[:k, None]  # [i, c]: layers i..c
    before_group = np.maximum.accumulate(np.where(starts, through - kept[None, :], -np.inf), axis=1)
    running_peak = np.maximum.accumulate(np.where(ahead, through - before_group, -np.inf), axis=1)
    running_inputs = np.cumsum(np.where(starts, a.inputs[None, :k], 0.0), axis=1)
    inputs, peak = np.zeros((k + 1, k + 1)), np.zeros((k + 1, k + 1))
    inputs[:k, 1:] = np.where(ahead, running_inputs, 0.0)  # [i, j] reads column j - 1
    peak[:k, 1:] = np.where(ahead, running_peak, 0.0)
    return {"group_inputs": inputs, "group_peak": peak}


#: A repeated block's scope (`.../layers_k`: a transformer layer, an encoder or decoder layer).
BLOCK_SCOPE = re.compile(r"^(.*?layers_\d+)(/|$)")


def block_ends(model: JointModel) -> tuple[int, ...]:
    """The chain position where each repeated block (`.../layers_k`) ends, in chain order."""
    ends: dict[str, int] = {}
    for p, inst in enumerate(model.attribution.chain):
        match = BLOCK_SCOPE.match(layer_name(inst.metadata))
        if match:
            ends[match.group(1)] = p
    return tuple(sorted(ends.values()))


@dataclass(eq=False)
class JointModel:
    """A captured step on a cluster, cut into layers at `pivots` (chain positions), priced per
    stage option on demand and memoized (the inner level's memo)."""

    cap: Capture
    graph: FactorGraph
    cluster: Cluster
    attribution: ChainAttribution
    pivots: tuple[int, ...]  # chain positions after which a cut may go
    layer_names: tuple[str, ...]
    searched_plans: Mapping[tuple[int, int], np.ndarray] = field(default_factory=dict)
    _arrays: dict[StageOption, StageArrays] = field(default_factory=dict)
    _cache: dict[Any, Any] = field(default_factory=dict)

    @classmethod
    def build(cls, cap: Capture, cluster: Cluster, pivots: Sequence[int], *, graph: FactorGraph | None = None,
              layer_names: Sequence[str] = ()) -> JointModel:
        found = attribute(cap)
        graph = graph if graph is not None else FactorGraph.from_capture(cap)
        names = tuple(layer_names) or tuple(f"layer{k}" for k in range(len(pivots) + 1))
        return cls(cap, graph, cluster, found, tuple(int(p) for p in pivots), names)

    # -- layers ---------------------------------------------------------------------------------
    @property
    def n_layers(self) -> int:
        return len(self.pivots) + 1

    @property
    def pass_buffers(self) -> int:
        """Buffers the mpmd executor's passes move per microbatch (`estimate.pass_buffers`): a
        property of the step, not of its cuts."""
        if "pass buffers" not in self._cache:
            self._cache["pass buffers"] = pass_buffers(self.cap)
        return self._cache["pass buffers"]

    @property
    def state_leaves(self) -> int:
        """Arrays of the step's state the spmd executor hands back after each step
        (`estimate.state_leaves`)."""
        if "state leaves" not in self._cache:
            self._cache["state leaves"] = state_leaves(self.cap)
        return self._cache["state leaves"]

    @property
    def boundaries(self) -> np.ndarray:
        """Chain positions where layer k starts, and the chain's length at the end."""
        return np.asarray([0, *(p + 1 for p in self.pivots), self.attribution.length], dtype=np.int64)

    @property
    def checkpoint_groups(self) -> np.ndarray:
        """A group id per layer: the layers a recomputing stage checkpoints together (Megatron-LM
        recomputes a transformer layer at a time): those starting in one repeated block
        (`block_ends`; the stretch before the first block joins it, the one after the last is a
        group of its own); each layer on its own in a step without repeated blocks."""
        key = ("checkpoint groups", self.pivots)  # `_cache` outlives a `dataclasses.replace` of the pivots
        if key not in self._cache:
            ends = np.asarray(block_ends(self), dtype=np.int64)
            starts = self.boundaries[:-1]
            self._cache[key] = (np.searchsorted(ends, starts, side="left") if len(ends)
                                else np.arange(self.n_layers))
        return self._cache[key]

    def checkpoint_starts(self, start: int, stop: int) -> tuple[int, ...]:
        """The layers in (start, stop) where a group checkpointed on its own begins: the cuts a
        stage of layers [start, stop) that recomputes group by group lists."""
        groups = self.checkpoint_groups
        return tuple(k for k in range(start + 1, stop) if groups[k] != groups[k - 1])

    @property
    def batch(self) -> int:
        """The step's batch: the leading dim of its data inputs (what microbatches split)."""
        key = ("batch",)
        if key not in self._cache:  # asked once per option and microbatch count
            self._cache[key] = step_batch(self.cap)
        return self._cache[key]

    # -- one option's arrays --------------------------------------------------------------------
    def arrays(self, option: StageOption) -> StageArrays:
        if option not in self._arrays:
            if option != option.plain:  # the same work and bytes; `plans` prices what these change
                base = self.arrays(option.plain)
                gather = self._gather_prices(option) if option.split_state else (0.0, 0.0)
                scatter = (self._data_terms(Collective.REDUCE_SCATTER, option)
                           if option.shard_parameters or option.shard_gradients else (0.0, 0.0))
                self._arrays[option] = base._replace(recompute=option.recompute, split_state=option.split_state,
                                                     shard_parameters=option.shard_parameters,
                                                     shard_gradients=option.shard_gradients,
                                                     scatter_alpha=scatter[0], scatter_beta=scatter[1],
                                                     gather_alpha=gather[0], gather_beta=gather[1],
                                                     **recompute_tables(base, option.recompute,
                                                                        self.checkpoint_groups))
            else:
                self._arrays[option] = self._price(option)
        return self._arrays[option]

    def can_split_state(self, option: StageOption) -> bool:
        """The option's plan has data replicas to split the optimizer state over: its `data`
        axis splits the batch and no parameter (`hlomap.cost.zero.state_axes`)."""
        plan, axes = self.plan_for(option)
        key = ("split state", option.model, plan.tobytes())  # data widths with one plan array answer alike
        if key not in self._cache:
            sg = ShardedGraph.build(self.graph, plan, axes)
            self._cache[key] = "data" in state_axes(sg)
        return bool(self._cache[key])

    def _gather_prices(self, option: StageOption) -> tuple[float, float]:
        """(latency, seconds per gathered byte) of an all-gather over the option's data groups."""
        return self._data_terms(Collective.ALL_GATHER, option)

    def _data_terms(self, kind: Collective, option: StageOption) -> tuple[float, float]:
        """(latency, seconds per byte) of collective `kind` over the option's data groups (0, 0
        without data replicas)."""
        if option.data <= 1:
            return 0.0, 0.0
        groups = self._mapping(option).groups("data")
        empty = collective_time(kind, self.cluster, groups, 0.0)
        return empty, (collective_time(kind, self.cluster, groups, 2**30) - empty) / 2**30

    def plan_for(self, option: StageOption) -> tuple[np.ndarray, MeshAxes]:
        """The plan array a stage of this option runs, over the whole graph, and its mesh axes
        (memoized per mesh and plan kind)."""
        key = ("plan", option.data, option.model, option.kind)
        if key not in self._cache:
            self._cache[key] = self._plan_for(option)
        return self._cache[key]

    def _plan_for(self, option: StageOption) -> tuple[np.ndarray, MeshAxes]:
        axes = MeshAxes.from_mesh(option.mesh)
        if option.kind is PlanKind.SEARCHED and (option.data, option.model) in self.searched_plans:
            return self.searched_plans[(option.data, option.model)], axes
        parts = []
        if option.data > 1:
            try:
                parts.append(data_parallel_plan(self.graph, "data", axes))
            except ValueError:  # no data inputs known: nothing to split on `data`
                pass
        if option.model > 1:
            parts.append(self._megatron_part(axes))
        return (combine(*parts) if parts else empty_plan(self.graph)), axes

    def _megatron_part(self, axes: MeshAxes) -> np.ndarray:
        """`megatron_plan` on the model axis of `axes`, memoized per model width: its greedy only
        ever assigns the model option, and whether such a trial is conflict-free depends on that
        option's size (divisibility) and on which options share an axis, not on the data width
        (`ConflictChecker`), so the data widths of one model width share the array."""
        model = axes.mesh_shape["model"]
        key = ("megatron part", model, axes.names, axes.options)
        if key not in self._cache:
            self._cache[key] = megatron_plan(self.graph, "model", axes)
        return self._cache[key]

    def _price(self, option: StageOption) -> StageArrays:
        plan, axes = self.plan_for(option)
        return self._arrays_of(option, plan, axes, self.work(option))

    def work(self, option: StageOption) -> StageWork:
        """The work per chain position of `option`'s plan, its collectives not yet priced on
        devices (not memoized: `arrays` keeps what the planner needs of it; placement asks once
        per stage for the collectives)."""
        plan, axes = self.plan_for(option)
        if option.data > 1:  # one family per tensor-parallel width prices every data width
            family = self._family(option)
            if family is not None and np.array_equal(family.plan, plan):
                return family.at(option.data)
        return self._work(option, plan, axes)

    def _mapping(self, option: StageOption) -> AxisMapping:
        return axis_devices(self.cluster, option.mesh, order=("data", "model"))

    def _work(self, option: StageOption, plan: np.ndarray, axes: MeshAxes) -> StageWork:
        """The option's work per chain position, from the cost model's estimate of the step."""
        sg = ShardedGraph.build(self.graph, plan, axes)
        # every stage computes while the others do: the cluster's devices are all busy
        work = step_arrays(sg, self.cluster, self._mapping(option), cache=self._cache, busy=self.cluster.n_devices)
        return self._gathered_work(work.instructions, work.collectives, sg)

    def _gathered_work(self, instructions: InstructionArrays, collectives: Sequence[CollectiveEstimate],
                       sg: ShardedGraph) -> StageWork:
        """Instructions and collectives summed per chain position (`StageWork`)."""
        n = self.attribution.length
        where = self._where()
        node = instructions.node
        forward_node, matmul_node = self._node_kinds()
        compute, forward, redo, update_total = per_position(instructions.seconds, self.node_positions()[node],
                                                            forward_node[node], matmul_node[node], n)
        grads, buffers = np.zeros(n), np.zeros(n)
        priced = []
        for c in collectives:
            p = where.get((c.computation, c.instruction), -1)
            p = p if p >= 0 else n - 1  # the loss's or the update's collectives: the last stage's
            if c.reason is Reason.GRADIENT_SYNC:
                grads[p] += c.nbytes * c.count
                buffers[p] += 1  # one buffer of the combined all-reduce, as the SPMD estimate counts
                continue
            priced.append(PositionedCollective(p, c.kind, c.axes, c.nbytes, c.count))
        params, stash, values, saved = self._bytes(sg)
        return StageWork(compute, forward, update_total, tuple(priced), grads, buffers, params, stash, values, redo,
                         saved)

    def position_of(self, inst: InstructionEstimate, where: dict[tuple[str, str], int] | None = None) -> int | None:
        """The chain position an instruction's work is charged to (`_positions`); an instruction
        of a called computation goes with its own call site's entry instruction: a computation
        that every layer calls (`jnp.where`'s) is charged to each layer once, not all to the
        first."""
        return self._position(inst.instance, inst.computation, inst.name, self._where() if where is None else where)

    def _position(self, instance: int, computation: str, name: str, where: dict[tuple[str, str], int]) -> int | None:
        if instance > 0:
            site = self._entry_sites().get(instance)
            if site is not None:
                return where.get((self.cap.module.entry.name, site))
        return where.get((computation, name))

    def node_positions(self) -> np.ndarray:
        """`position_of` of every graph node (-1 where nothing is charged; memoized)."""
        key = ("node positions",)
        if key not in self._cache:
            where = self._where()
            found = [self._position(node.instance, node.computation, node.instruction.name, where)
                     for node in self.graph.nodes]
            self._cache[key] = np.asarray([-1 if p is None else p for p in found], dtype=np.int64)
        return self._cache[key]

    def _node_kinds(self) -> tuple[np.ndarray, np.ndarray]:
        """Per graph node: whether it is forward work, and whether it is a matmul
        (`MATRIX_OPCODES`: what selective recomputation keeps, as JAX's `dots_saveable` keeps
        dot_general and conv_general_dilated outputs); memoized."""
        key = ("node kinds",)
        if key not in self._cache:
            phases = GraphFacts.of(self.graph).phases
            self._cache[key] = (np.asarray([p is Phase.FORWARD for p in phases], dtype=bool),
                                np.asarray([node.instruction.opcode in MATRIX_OPCODES for node in self.graph.nodes],
                                           dtype=bool))
        return self._cache[key]

    def _entry_sites(self) -> dict[int, str]:
        """Per instance of a called computation, the entry instruction whose call it runs under."""
        key = ("entry sites",)
        if key not in self._cache:
            instances = self.graph.instances
            sites: dict[int, str] = {}
            for k, instance in enumerate(instances):
                if instance.parent < 0:
                    continue
                parent = instances[instance.parent]
                sites[k] = instance.call_site if parent.parent < 0 else sites.get(instance.parent, "")
            self._cache[key] = sites
        return self._cache[key]

    def transfer_seconds(self, option: StageOption, first_device: int, receiver_first: int, nbytes: float) -> float:
        """`transfer_seconds` on this model's cluster, its terms kept per pair of device groups
        (the expert grid, `plans.evaluate` and the DP's tables price the same groups many times)."""
        return transfer_seconds(self.cluster, option, first_device, receiver_first, nbytes, self._cache)

    def transfer_seconds_of(self, option: StageOption, first_device: int, receiver_first: int,
                            nbytes: np.ndarray) -> np.ndarray:
        """`transfer_seconds_of` on this model's cluster, with the same kept terms."""
        return transfer_seconds_of(self.cluster, option, first_device, receiver_first, nbytes, self._cache)

    def transfer_key(self, option: StageOption, first_device: int, receiver_first: int) -> tuple[int, bytes, bytes]:
        """What a cut's price from these groups depends on (`transfer_terms`): cuts of the same
        key cost the same, which on a cluster of equal servers most groups share."""
        shards, alpha, beta = transfer_terms(self.cluster, option, first_device, receiver_first, self._cache)
        return shards, alpha.tobytes(), beta.tobytes()

    def send_groups(self, option: StageOption, starts: Sequence[int],
                    ) -> tuple[tuple[int, tuple[int, bytes, bytes]], ...]:
        """(first device, `transfer_key`) of each group of `option` from `starts` that a next
        stage follows (the last device's group sends nothing); memoized per mesh and starts:
        every microbatch count's tables ask again."""
        key = ("send groups", option.data, option.model, tuple(starts))
        if key not in self._cache:
            n = self.cluster.n_devices
            self._cache[key] = tuple((d, self.transfer_key(option, d, d + option.devices)) for d in starts
                                     if d + option.devices < n)
        return self._cache[key]

    def group_capacities(self, size: int) -> np.ndarray:
        """[first device]: `group_capacity` of every group of `size` devices that fits the
        cluster (memoized per size)."""
        key = ("capacities", size)
        if key not in self._cache:
            memory = np.asarray([d.memory_bytes for d in self.cluster.devices], dtype=float)
            self._cache[key] = np.lib.stride_tricks.sliding_window_view(memory, size).min(axis=1)
        return self._cache[key]

    def group_capacity(self, first_device: int, size: int) -> float:
        """The least memory of devices [first_device, first_device + size) (memoized: plans
        priced by the thousand ask for the same groups)."""
        key = ("capacity", first_device, size)
        if key not in self._cache:
            self._cache[key] = min(d.memory_bytes for d in self.cluster.devices[first_device:first_device + size])
        return self._cache[key]

    def _where(self) -> dict[tuple[str, str], int]:
        key = ("positions",)
        if key not in self._cache:
            self._cache[key] = _positions(self.cap, self.attribution)
        return self._cache[key]

    def _family(self, option: StageOption) -> DataScaling | None:
        """The data-width family of `option`'s tensor-parallel width and plan kind (None when the
        cluster is too small to fit it: it is fitted at data = 2, 4 and 8)."""
        key = ("family", option.model, option.kind)
        if key not in self._cache:
            fits = self.cluster.n_devices >= FAMILY_WIDTHS[-1] * option.model and len(
                {d.name for d in self.cluster.devices}) == 1
            self._cache[key] = fit_data_scaling(self, option) if fits else None
        return self._cache[key]

    def _arrays_of(self, option: StageOption, plan: np.ndarray, axes: MeshAxes, work: StageWork) -> StageArrays:
        """The option's `StageArrays` from its work per position: its collectives priced on the
        option's device groups (each distinct collective once), the gradient all-reduce's terms,
        and every per-position figure as prefix sums over layers."""
        n = self.attribution.length
        mapping = self._mapping(option)
        alpha, beta = np.zeros(n), np.zeros(n)
        seconds: dict[tuple[Collective, tuple[str, ...], float], tuple[float, float]] = {}
        for c in work.collectives:
            key = (c.kind, c.axes, c.nbytes)
            if key not in seconds:
                groups = mapping.groups(c.axes if len(c.axes) > 1 else c.axes[0])
                empty = collective_time(c.kind, self.cluster, groups, 0.0)
                seconds[key] = (empty, collective_time(c.kind, self.cluster, groups, c.nbytes) - empty)
            empty, rest = seconds[key]
            alpha[c.position] += empty * c.count
            beta[c.position] += rest * c.count
        update = work.params / max(work.params.sum(), 1.0) * work.update_total
        crossing, _ = crossing_of(self.attribution, work.values)
        zero, slope = self._data_terms(Collective.ALL_REDUCE, option)
        bounds = self.boundaries
        layer = lambda values: np.concatenate([[0.0], np.cumsum(np.add.reduceat(values, bounds[:-1]))])  # noqa: E731
        cut = crossing[np.asarray(self.pivots, dtype=np.int64)] if self.pivots else np.zeros(0)
        per_buffer = per_buffer_seconds(self.cluster, option.data) if option.data > 1 else 0.0
        inputs = np.concatenate([[0.0], cut, [0.0]])
        return StageArrays(layer(work.compute), layer(alpha), layer(beta), layer(update), layer(work.grads),
                           layer(work.params), layer(work.stash), cut, zero, slope, plan, axes, layer(work.buffers),
                           per_buffer, layer(work.forward), inputs, layer(work.redo), layer(work.saved),
                           data=option.data)

    def _bytes(self, sg: ShardedGraph) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Per chain position: parameter and stash bytes on one device; every crossing value's
        bytes on one device (in `attribution.spans` order); and the bytes of the forward's matmul
        outputs (`_forward_matmuls`)."""
        n = self.attribution.length
        degree = sg.tensor_degree
        (params, stash, saved), (value_tensor, value_bytes) = self._byte_terms()
        per_position = [np.bincount(position, weights=nbytes / degree[tensor], minlength=n)
                        for tensor, position, nbytes in (params, stash, saved)]
        return per_position[0], per_position[1], value_bytes / degree[value_tensor], per_position[2]

    def _byte_terms(self) -> tuple[tuple[tuple[np.ndarray, np.ndarray, np.ndarray], ...],
                                   tuple[np.ndarray, np.ndarray]]:
        """What `_bytes` divides by each plan's split (memoized, plan-independent): for the
        parameters (their bytes), the stashed values and the forward's matmul outputs (the bytes
        a step keeps of them, `kept_bytes`: constants are rebuilt, not kept), each one's first
        tensor, chain position and bytes; and each crossing value's first tensor and kept bytes
        (`attribution.spans` order)."""
        key = ("byte terms",)
        if key not in self._cache:
            entry = self.cap.module.entry
            kept = kept_bytes(self.cap)
            full = {inst.name: float(inst.shape.byte_size) for inst in entry.instructions}

            def tensor(name: str) -> int:
                return self.graph.node_tensors[self.graph.node_of(entry.name, name)][0]

            def terms(where: Mapping[str, int], nbytes: Mapping[str, float]) -> tuple[np.ndarray, ...]:
                names = list(where)
                return (np.asarray([tensor(x) for x in names], dtype=np.int64),
                        np.asarray([where[x] for x in names], dtype=np.int64),
                        np.asarray([nbytes[x] for x in names], dtype=np.float64))

            found = self.attribution
            names = tuple(name for name, _, _ in found.spans)
            self._cache[key] = (
                (terms(found.parameters, full), terms(found.stashed, kept), terms(self._forward_matmuls(), kept)),
                (np.asarray([tensor(x) for x in names], dtype=np.int64),
                 np.asarray([kept[x] for x in names], dtype=np.float64)))
        return self._cache[key]

    def _forward_matmuls(self) -> dict[str, int]:
        """The forward pass's matmuls (`MATRIX_OPCODES`) -> their chain positions (memoized): the
        values selective recomputation keeps. JAX's `dots_saveable` saves every dot_general and
        convolution output the backward needs, directly or through the elementwise work it redoes
        from them; in a forward chain every matmul's output leads to some stashed value."""
        key = ("forward matmuls",)
        if key not in self._cache:
            found = self.attribution
            self._cache[key] = {inst.name: found.anchor[inst.name] for inst in self.cap.module.entry.instructions
                                if inst.opcode in MATRIX_OPCODES and inst.name in found.forward
                                and found.anchor.get(inst.name, -1) >= 0}
        return self._cache[key]


def _positions(cap: Capture, found: ChainAttribution) -> dict[tuple[str, str], int]:
    """(computation, instruction) -> chain position (UPDATE for the optimizer update, -1 for
    the rest) for every instruction of the entry and of the computations its instructions call
    (at their first call site; `JointModel.position_of` charges each call to its own)."""
    module = cap.module
    entry = module.entry
    out: dict[tuple[str, str], int] = {}
    updates = set(found.update)
    for inst in entry.instructions:
        p = found.anchor.get(inst.name, UPDATE if inst.name in updates else -1)
        out[(entry.name, inst.name)] = p
        stack, seen = list(inst.called_computations), set()
        while stack:
            name = stack.pop()
            if name in seen or name not in module.by_name:
                continue
            seen.add(name)
            for inner in module.computation(name).instructions:
                out.setdefault((name, inner.name), p)
                stack.extend(inner.called_computations)
    return out


def transfer_seconds(cluster: Cluster, option: StageOption, first_device: int, receiver_first: int,
                     nbytes: float, cache: dict[Any, Any] | None = None) -> float:
    """Moving a cut's activations (`nbytes` in all, one shard per data replica) from a stage of
    `option` on devices from `first_device` to the next stage, whose devices start at
    `receiver_first`: replica c's first device sends its shard to the next stage's c-th device,
    all at once (streams leaving a server share its NICs: `collective_permute_time`). The
    receiving stage's layout does not enter, so a planner prices a cut from its sending side."""
    return float(transfer_seconds_of(cluster, option, first_device, receiver_first, np.asarray([nbytes]), cache)[0])


def transfer_terms(cluster: Cluster, option: StageOption, first_device: int, receiver_first: int,
                   cache: dict[Any, Any] | None = None) -> tuple[int, np.ndarray, np.ndarray]:
    """The shards of a cut from a stage of `option` on devices from `first_device` to the next
    stage from `receiver_first`, and the distinct (latency, seconds per byte) terms of their
    sends (`transfer_seconds_of` takes the slowest): they depend on the devices only, so they are
    kept in `cache` when given (the expert grid and the DP price the same groups many times)."""
    shards = max(1, min(option.data, cluster.n_devices - receiver_first))
    period = cluster.shift_period()
    shift = first_device - first_device % period if period else 0  # groups a server apart cost the same
    first_device, receiver_first = first_device - shift, receiver_first - shift
    key = ("permute terms", option.data, option.model, first_device, receiver_first, shards)
    terms = None if cache is None else cache.get(key)
    if terms is None:
        pairs = [(first_device + c * option.model, receiver_first + c) for c in range(shards)]
        found = collective_permute_terms(cluster, pairs)
        distinct = np.unique(np.asarray([(t.alpha, t.beta) for t in found], dtype=float).reshape(-1, 2), axis=0)
        terms = (shards, distinct[:, 0], distinct[:, 1])
        if cache is not None:
            cache[key] = terms
    return terms


def transfer_seconds_of(cluster: Cluster, option: StageOption, first_device: int, receiver_first: int,
                        nbytes: np.ndarray, cache: dict[Any, Any] | None = None) -> np.ndarray:
    """`transfer_seconds` of every entry of `nbytes` at once (`transfer_terms`)."""
    nbytes = np.asarray(nbytes, dtype=float)
    shards, alpha, beta = transfer_terms(cluster, option, first_device, receiver_first, cache)
    if not len(alpha):
        return np.zeros_like(nbytes)
    per_shard = nbytes / shards
    seconds = np.max(alpha[:, None] + beta[:, None] * np.atleast_1d(per_shard)[None, :], axis=0).reshape(nbytes.shape)
    return np.where(nbytes > 0, seconds, 0.0)
