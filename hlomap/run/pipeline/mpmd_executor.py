"""The mpmd executor: a pipeline as one program per stage, driven by a Python scheduler (GPipe, 1F1B,
interleaved 1F1B or ZB-H1).

Each stage is its own `jax.jit` on its own mesh (the plan's tensor or data parallelism inside the
stage applies there), compiled once: its forward returns its outputs and the residuals of its
backward (`jax.fwd_and_bwd`), its backward maps the residuals and the output cotangents to
parameter and input cotangents. Activations and cotangents move between stages with
`jax.device_put` to the receiving stage's `NamedSharding`. The scheduler dispatches the passes
in the order the pipeline simulator predicts (`dispatch.dispatch_order`): under 1F1B (PipeDream-
Flush, Narayanan et al., SC'21, section 2.2) stage s holds at most S - s microbatches' residuals,
under GPipe all M. Under interleaved 1F1B (`repeats` V) the model is cut into S V logical stages,
each its own programs on the mesh of device stage k mod S, dispatched in Megatron's interleaved
order. Under ZB-H1 a stage's backward is two programs over the same residuals, the input
gradient (B, which the previous stage waits for) and the weight gradient (W, run when the
schedule says; the residuals and the output cotangents live until then). Gradients accumulate per
stage; a leaf several stages hold (a tied embedding, or a leaf two chunks read) gets the sum of
their gradients; then each stage runs its own update program.

Where the last stage's schedule runs a microbatch's backward right after its forward (every
microbatch under 1F1B; under GPipe only with one microbatch), the two run as one program
(`forward_backward`): the last stage's backward needs nothing from another stage, and its
residuals then never leave the program. The last of them also runs the stage's update when no other stage reads its
parameters (`forward_backward_update`: the gradients never leave the program). A step that
records its events (`record=True`) runs the passes apart, to time each. Each stage's update (the fused one too)
donates the state it replaces.

Dispatch is asynchronous, so stages on different devices overlap; one Python process drives them
all (single controller), which is why this executor does not run across processes.
"""

from __future__ import annotations

import functools
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from hlomap.cost.pipeline.stages import Pass
from hlomap.run.pipeline.dispatch import Event, RecordedEvent, dispatch_order, fusable_passes
from hlomap.run.pipeline.prepare import CHECKPOINT_POLICIES, PipelineProgram, batch_axes, leaf_specs
from hlomap.run.pipeline.shared_compile import ExecutableCache, SharedProgram
from hlomap.run.pipeline.stage_state import Staged, state_leaves
from hlomap.run.pipeline.stage_update import Source
from hlomap.run.trace import InputKind
from hlomap.run.transfer import put, to_host
from hlomap.verify.mesh import devices_at, mesh_of

__all__ = ["MpmdPipeline", "StageLeaves", "StepStats"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, eq=False)
class StageLeaves:
    """Which state leaves (flat argument indices) each stage holds, for one state argument.

    A leaf several stages read (a tied embedding, Adam's step count) is held by each of them; its
    home, the first of them, holds the copy the user's pytree gets back."""

    per_stage: tuple[tuple[int, ...], ...]
    leaves: tuple[int, ...]
    treedef: Any

    def home(self, leaf: int) -> int:
        return self.holders(leaf)[0]

    def holders(self, leaf: int) -> tuple[int, ...]:
        return self._index[leaf][0]

    def position(self, s: int, leaf: int) -> int:
        """Where stage s keeps the leaf in its tuple of held leaves."""
        return self._index[leaf][1][s]

    @functools.cached_property
    def _index(self) -> dict[int, tuple[tuple[int, ...], dict[int, int]]]:
        where: dict[int, dict[int, int]] = {leaf: {} for leaf in self.leaves}
        for s, held in enumerate(self.per_stage):
            for k, leaf in enumerate(held):
                where[leaf][s] = k
        return {leaf: (tuple(sorted(at)), at) for leaf, at in where.items()}


@dataclass
class StepStats:
    """What the last step held and did, per stage (from the scheduler's own bookkeeping)."""

    peak_in_flight: list[int] = field(default_factory=list)  # microbatches with residuals alive
    peak_residual_bytes: list[int] = field(default_factory=list)
    events: list[RecordedEvent] = field(default_factory=list)  # when recording


def _float0_like(aval: Any) -> Any:
    return np.zeros(aval.shape, dtype=jax.dtypes.float0)


def _is_float(dtype: Any) -> bool:
    return bool(jnp.issubdtype(dtype, jnp.floating))


def _nbytes(tree: Any) -> int:
    return int(sum(getattr(x, "nbytes", 0) for x in jax.tree_util.tree_leaves(tree)))


class MpmdPipeline:
    """The mpmd executor for one traced step and pipeline plan (module docstring)."""

    def __init__(self, program: PipelineProgram, order: Sequence[Any],
                 compiler_options: Mapping[str, Any] | None = None):
        self.options = dict(compiler_options or {}) or None
        section = program.section
        self.program = program
        traced = program.traced
        # stage s below is a logical stage (a chunk under interleaved 1F1B): it runs on device stage s mod S
        self.n_groups = section.n_stages
        self.n_stages = section.logical_stages
        self.microbatches = section.microbatches
        group_meshes = [mesh_of(devices_at(order, ids, f"stage {g}"), inner)
                        for g, (ids, inner) in enumerate(zip(section.devices, section.inner))]
        self.meshes = [group_meshes[s % self.n_groups] for s in range(self.n_stages)]
        self.batch_axes = [batch_axes(section.parameters[s % self.n_groups], traced, dict(section.inner[s % self.n_groups]),
                                      program.microbatch) for s in range(self.n_stages)]
        self.leaf_sharding = [
            {leaf: NamedSharding(mesh, spec if _fits(spec, mesh) else P())
             for leaf, spec in leaf_specs(section.parameters[s % self.n_groups], traced.state_leaves).items()}
            for s, mesh in enumerate(self.meshes)]
        # ZeRO-2 stages: each parameter gradient constrained to its split spec as the backward
        # returns it, so XLA reduce-scatters it and the accumulated gradients stay split
        self.gradient_sharding = [
            {} if not section.gradients or section.gradients[s % self.n_groups] is None else
            {leaf: NamedSharding(mesh, spec) for leaf, spec in
             leaf_specs(section.gradients[s % self.n_groups], traced.state_leaves).items() if _fits(spec, mesh)}
            for s, mesh in enumerate(self.meshes)]
        n0, n1 = traced.arg_sizes[0], traced.arg_sizes[1]
        trees = traced.arg_tree.children()
        residence = program.update.residence
        self.params = StageLeaves(tuple(tuple(leaf for leaf in range(n0) if s in residence[leaf]) for s in range(self.n_stages)),
                                  tuple(range(n0)), trees[0])
        self.opt = StageLeaves(tuple(tuple(leaf for leaf in range(n0, n0 + n1) if s in residence[leaf])
                                     for s in range(self.n_stages)), tuple(range(n0, n0 + n1)), trees[1])
        self.order = dispatch_order(section.schedule, self.n_groups, self.microbatches, section.repeats)
        self.trace_counts: dict[tuple[str, int], int] = {}
        self.executables = ExecutableCache()  # stages with identical programs share one executable
        self._forward = [self._make_forward(s) for s in range(self.n_stages)]
        # ZB-H1: the backward as two passes, the input gradient (B) and the weight gradient (W)
        self.split_backward = any(e.kind is Pass.WEIGHT for e in self.order)
        self._backward = [self._make_backward(s, None if not self.split_backward else 1) for s in range(self.n_stages)]
        self._weight = [self._make_backward(s, 0) for s in range(self.n_stages)] if self.split_backward else []
        self.fused = fusable_passes(self.order, self.n_stages, self.n_groups)
        self._forward_backward = self._make_forward_backward(self.n_stages - 1)
        self.final_update = self._can_fuse_update()
        self._reused = self._final_reused(self.n_stages - 1)
        self._final_donated = self._final_donation(self.n_stages - 1)
        self._final = self._make_final(self.n_stages - 1) if self.final_update else None
        loss_dtype = traced.loss.jaxpr.outvars[0].aval.dtype
        # d(mean loss)/d(a microbatch's loss), on the stage that computes the loss: put there once,
        # not built and transferred on every step
        self._loss_ct = (put(np.asarray(1.0 / self.microbatches, loss_dtype), NamedSharding(self.meshes[-1], P())),)
        self._residual_bytes: int | None = None  # of the last stage's forward, for the fused passes' bookkeeping
        # stage -> (its forward's lowerings when counted, the bytes its residuals hold per microbatch)
        self._residual_bytes_of: dict[int, tuple[int, int]] = {}
        self._accumulate = [self._shared(s, jax.jit(_accumulate, donate_argnums=0, compiler_options=self.options))
                            for s in range(self.n_stages)]
        self._update = [self._make_update(s) for s in range(self.n_stages)]
        self.stats = StepStats()
        self._recording: dict[tuple[int, Pass], Any] = {}
        self._stamps: list[tuple[int, str, int, int, float]] = []
        # leaf -> (the array the last step returned for it, its copies on the other stages that read it)
        self._returned: dict[int, tuple[Any, dict[int, Any]]] = {}

    # -- shardings --------------------------------------------------------------------------------
    def _sharding(self, s: int, leaf: int) -> NamedSharding:
        return self.leaf_sharding[s].get(leaf) or NamedSharding(self.meshes[s], P())

    def _value_sharding(self, s: int, aval: Any) -> NamedSharding:
        """Activations and microbatch leaves: split on the stage's batch axes when batched."""
        axes = self.batch_axes[s]
        if axes and aval.shape and aval.shape[0] == self.program.microbatch:
            return NamedSharding(self.meshes[s], P(axes))
        return NamedSharding(self.meshes[s], P())

    def _counted(self, kind: str, s: int, fn: Callable[..., Any]) -> Callable[..., Any]:
        def traced(*args: Any) -> Any:
            self.trace_counts[(kind, s)] = self.trace_counts.get((kind, s), 0) + 1
            return fn(*args)

        return traced

    # -- per-stage programs -----------------------------------------------------------------------
    def _stage_function(self, s: int) -> Callable[..., Any]:
        """Stage s as a function of (params, received, state, data); a stage the plan marks to
        recompute is checkpointed: with nothing saved (`Recompute.FULL`), its backward keeps only
        the stage's inputs and runs its forward again; with its matmuls' outputs saved
        (`Recompute.SELECTIVE`, `dots_saveable`), it runs the rest of the forward again. A stage
        whose program checkpoints its layers one by one (`StageProgram.checkpointed`, the plan's
        recompute cuts) is not checkpointed again as a whole."""
        stage = self.program.split.stages[s]

        def f(params: Any, received: Any, state: Any, data: Any) -> Any:
            sent, aux, loss = stage.run(params, state, data, received)
            return (tuple(sent) + ((loss,) if stage.computes_loss else ())), tuple(aux)

        policy = None if stage.checkpointed else CHECKPOINT_POLICIES.get(self.program.section.recomputes(s))
        return f if policy is None else jax.checkpoint(f, policy=policy)

    def _make_forward(self, s: int) -> Any:
        fwd, _ = jax.fwd_and_bwd(self._stage_function(s), argnums=(0, 1), has_aux=True, jitted=False)
        return self._shared(s, jax.jit(self._counted("forward", s, fwd), compiler_options=self.options))

    def _backward_function(self, s: int, part: int | None) -> Callable[..., Any]:
        """(residuals, output cotangents) -> (parameter cotangents, input cotangents) of stage s;
        with `part` 0 only the parameter cotangents (ZB-H1's W pass), 1 only the input
        cotangents (its B pass): one backward, of which the compiler drops what the part does
        not return, so each part computes what the whole backward would."""
        _, whole = jax.fwd_and_bwd(self._stage_function(s), argnums=(0, 1), has_aux=True, jitted=False)

        def bwd(residuals: Any, cotangents: Any) -> Any:
            g_params, g_received = whole(residuals, cotangents)
            return self._split_gradients(s, g_params), g_received

        if part is None:
            return bwd
        return lambda residuals, cotangents: bwd(residuals, cotangents)[part]

    def _split_gradients(self, s: int, g_params: Sequence[Any]) -> tuple[Any, ...]:
        """Stage s's parameter gradients, each constrained to its split spec where the stage
        splits its gradients (ZeRO-2); unchanged elsewhere."""
        shardings = self.gradient_sharding[s]
        if not shardings:
            return tuple(g_params)
        traced = self.program.micro
        leaves = [traced.loss_inputs[p].leaf for p in self.program.split.stages[s].params]
        return tuple(jax.lax.with_sharding_constraint(g, shardings[leaf])
                     if leaf in shardings and g.dtype != jax.dtypes.float0 else g
                     for g, leaf in zip(g_params, leaves))

    def _make_backward(self, s: int, part: int | None = None) -> Any:
        kind = {None: "backward", 1: "input_gradient", 0: "weight_gradient"}[part]
        return self._shared(s, jax.jit(self._counted(kind, s, self._backward_function(s, part)),
                                       compiler_options=self.options))

    def _shared(self, s: int, jitted: Any) -> SharedProgram:
        """Stage s's program, compiled once for all stages whose programs are identical."""
        return SharedProgram(jitted, self.meshes[s], self.executables)

    def _forward_backward_function(self, s: int) -> Callable[..., Any]:
        """(params, received, state, data, output cotangents) -> (outputs, aux, parameter and
        input cotangents) of stage s."""
        f = self._stage_function(s)

        def forward_backward(params: Any, received: Any, state: Any, data: Any, cotangents: Any) -> Any:
            out, vjp, aux = jax.vjp(lambda p, r: f(p, r, state, data), params, received, has_aux=True)
            g_params, g_received = vjp(cotangents)
            return out, aux, self._split_gradients(s, g_params), g_received

        return forward_backward

    def _make_forward_backward(self, s: int) -> Any:
        return jax.jit(self._counted("forward_backward", s, self._forward_backward_function(s)),
                       compiler_options=self.options)

    def _can_fuse_update(self) -> bool:
        """Whether the last stage's final fused pass can run its update too: its last microbatch's
        passes fuse, it computes the loss, and no other stage reads its parameters (a shared
        leaf's gradient sums every stage's before any update)."""
        last = self.program.split.stages[-1]
        residence = self.program.update.residence
        shared = any(len(residence[self.program.micro.loss_inputs[p].leaf]) > 1 for p in last.params)
        return last.computes_loss and self.microbatches - 1 in self.fused and not shared

    def _make_final(self, s: int) -> Any:
        """The last stage's last microbatch, forward and backward, then its update (the gradient
        sums, loss and aux means completed inside): one program instead of two, and the gradients
        never leave it."""
        forward_backward = self._forward_backward_function(s)
        program = self.program
        traced = program.micro
        stage = program.split.stages[s]
        update_s = program.update.programs[s]
        m = self.microbatches
        scale = 1.0 / m
        reused = self._reused

        def final(donated: Sequence[Any], params: Any, received: Any, state: Any, data: Any, cotangents: Any,
                  grads_before: Any, loss_before: Any, aux_before: Any, extras: Sequence[Any]) -> Any:
            params, state, extras = self._refill(donated, params, state, extras)
            out, aux, g_params, g_received = forward_backward(params, received, state, data, cotangents)
            extras = [(params, state)[reused[n][0]][reused[n][1]] if n in reused else x for n, x in enumerate(extras)]
            loss_sum = out[-1] if loss_before is None else loss_before + out[-1]
            grads = g_params if grads_before is None else _accumulate(grads_before, g_params)
            aux_sum = aux if aux_before is None else _accumulate(aux_before, aux)
            loss = loss_sum * scale if m > 1 else loss_sum
            aux_mean = {j: (v * scale if _is_float(v.dtype) and m > 1 else v) for j, v in zip(stage.aux, aux_sum)}
            per_leaf = {traced.loss_inputs[p].leaf: g for p, g in zip(stage.params, grads)}
            inputs = []
            for item, given in zip(update_s.inputs, extras):
                if item.source is Source.LOSS:
                    given = loss
                elif item.source is Source.AUX and program.split.aux[item.index].stage is not None:
                    given = aux_mean[item.index]
                elif item.source is Source.GRAD:
                    leaf = traced.loss_inputs[traced.grads[item.index]].leaf
                    aval = program.traced.step.jaxpr.invars[leaf].aval
                    given = per_leaf[leaf] if leaf in per_leaf else jnp.zeros(aval.shape, aval.dtype)
                inputs.append(given)
            return g_received, loss, self._pinned(s, update_s, update_s.run(*inputs))

        return jax.jit(self._counted("forward_backward_update", s, final), donate_argnums=0,
                       compiler_options=self.options)

    def _final_donation(self, s: int) -> tuple[frozenset[int], frozenset[int], frozenset[int]]:
        """Positions of the final pass's parameters, state and update inputs (extras) whose
        buffers it may reuse: state leaves the update replaces, each passed once. Donating them
        is what the plain jitted step does (without it, a one-stage step of gpt-tiny took 10%
        longer on 8 CPU devices)."""
        program = self.program
        traced = program.micro
        stage = program.split.stages[s]
        update_s = program.update.programs[s]
        replaced = {o for o in update_s.outputs if o < traced.state_leaves}
        params = [traced.loss_inputs[p].leaf for p in stage.params]
        state = [traced.loss_inputs[p].leaf for p in stage.state]
        extras: list[int | None] = []
        for n, item in enumerate(update_s.inputs):
            leaf = None
            if n in self._reused:
                leaf = None  # passed as a parameter or state leaf, not again
            elif item.source is Source.STATE:
                leaf = item.index
            elif item.source is Source.AUX and program.split.aux[item.index].stage is None:
                source = program.split.aux[item.index]
                leaf = traced.loss_inputs[source.loss_input].leaf if source.loss_input is not None else None
            extras.append(leaf)
        passed = [leaf for leaf in (*params, *state, *extras) if leaf is not None]
        once = {leaf for leaf in replaced if passed.count(leaf) == 1}
        return (frozenset(k for k, leaf in enumerate(params) if leaf in once),
                frozenset(k for k, leaf in enumerate(state) if leaf in once),
                frozenset(k for k, leaf in enumerate(extras) if leaf in once))

    def _split_donated(self, params: Sequence[Any], state: Sequence[Any],
                       extras: Sequence[Any]) -> tuple[tuple[Any, ...], tuple[Any, ...], tuple[Any, ...], list[Any]]:
        """(donated buffers, then params, state and extras with None where a donated one was)."""
        donated: list[Any] = []
        kept = []
        for group, positions in zip((params, state, extras), self._final_donated):
            donated += [x for k, x in enumerate(group) if k in positions]
            kept.append([None if k in positions else x for k, x in enumerate(group)])
        return tuple(donated), tuple(kept[0]), tuple(kept[1]), kept[2]

    def _refill(self, donated: Sequence[Any], params: Sequence[Any], state: Sequence[Any],
                extras: Sequence[Any]) -> tuple[tuple[Any, ...], tuple[Any, ...], list[Any]]:
        """Inverse of `_split_donated` (inside the final pass)."""
        given = iter(donated)
        groups = [[next(given) if k in positions else x for k, x in enumerate(group)]
                  for group, positions in zip((params, state, extras), self._final_donated)]
        return tuple(groups[0]), tuple(groups[1]), groups[2]

    def _final_reused(self, s: int) -> dict[int, tuple[int, int]]:
        """Update inputs of stage s that the final pass already takes as the forward's parameters
        (0) or state (1): input position -> (which, index). They are passed once (a buffer
        handle per device per argument is what a small step's dispatch costs)."""
        traced = self.program.micro
        stage = self.program.split.stages[s]
        where = {traced.loss_inputs[p].leaf: (0, k) for k, p in enumerate(stage.params)}
        where.update({traced.loss_inputs[p].leaf: (1, k) for k, p in enumerate(stage.state)})
        return {n: where[item.index] for n, item in enumerate(self.program.update.programs[s].inputs)
                if item.source is Source.STATE and item.index in where}

    def _stage_residual_bytes(self, s: int, residuals: Any) -> int:
        """The bytes of stage s's residuals of one microbatch. Their shapes are fixed by the
        forward program, so they are summed once per program lowered rather than per pass: over
        a convolutional network's hundreds of residual leaves the sum took 9 ms of a 50 ms step
        (resnet50-tiny on three 1-device stages, 4 microbatches, on 8 CPU devices)."""
        lowered = self._forward[s].lowerings
        known = self._residual_bytes_of.get(s)
        if known is None or known[0] != lowered:
            known = (lowered, _nbytes(residuals))
            self._residual_bytes_of[s] = known
        return known[1]

    def _last_residual_bytes(self, *args: Any) -> int:
        """What the last stage's forward would keep for its backward (bytes), had it run apart."""
        if self._residual_bytes is None:
            fwd, _ = jax.fwd_and_bwd(self._stage_function(self.n_stages - 1), argnums=(0, 1), has_aux=True,
                                     jitted=False)
            _, res, _ = jax.eval_shape(fwd, *args)
            self._residual_bytes = sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize
                                       for x in jax.tree_util.tree_leaves(res))
        return self._residual_bytes

    def _make_recording(self, s: int, kind: Pass) -> Any:
        """The forward, backward or weight pass of stage s that also tells the host when it
        starts and ends on its devices (`jax.debug.callback`, no blocking: the stages still
        overlap)."""
        fwd, _ = jax.fwd_and_bwd(self._stage_function(s), argnums=(0, 1), has_aux=True, jitted=False)
        if kind is Pass.FORWARD:
            run = fwd
        else:
            run = self._backward_function(s, 0 if kind is Pass.WEIGHT else 1 if self.split_backward else None)

        def recorded(microbatch: Any, *args: Any) -> Any:
            first = jax.tree_util.tree_leaves(args)[0]
            jax.debug.callback(self._stamp, s, kind.value, microbatch, jnp.ravel(first)[0], 0)
            out = run(*args)
            # the first stage's input-gradient pass returns nothing (it has no input): stamp on its input
            last = (jax.tree_util.tree_leaves(out) or [first])[-1]
            jax.debug.callback(self._stamp, s, kind.value, microbatch, jnp.ravel(last)[0], 1)
            return out

        return jax.jit(recorded, compiler_options=self.options)

    def _stamp(self, stage: int, kind: str, microbatch: Any, _: Any, end: int) -> None:
        self._stamps.append((int(stage), kind, int(microbatch), int(end), time.perf_counter()))

    def _pinned(self, s: int, update_s: Any, outputs: Sequence[Any]) -> list[Any]:
        """Stage s's updated state leaves constrained to their shardings on the stage (a leaf
        split more than its parameter, a ZeRO-1 optimizer state, stays split; XLA would be free
        to return it whole otherwise); other outputs as XLA leaves them."""
        n_state = self.program.traced.state_leaves
        return [jax.lax.with_sharding_constraint(value, self._sharding(s, o)) if o < n_state and s in
                self.program.update.residence[o] and o in self.leaf_sharding[s] else value
                for o, value in zip(update_s.outputs, outputs)]

    def _make_update(self, s: int) -> Any:
        update_s = self.program.update.programs[s]
        run = update_s.run

        def update(*inputs: Any) -> Any:
            return self._pinned(s, update_s, run(*inputs))

        return self._shared(s, jax.jit(self._counted("update", s, update), donate_argnums=self._donated(update_s),
                                       compiler_options=self.options))

    def _donated(self, update_s: Any) -> tuple[int, ...]:
        """Update inputs whose buffers the update may reuse: state leaves it replaces, each passed
        once (a leaf also passed as an aux input is the same buffer twice and is kept)."""
        traced = self.program.traced
        n_state = traced.state_leaves
        passed: dict[int, int] = {}
        for item in update_s.inputs:
            leaf = None
            if item.source is Source.STATE:
                leaf = item.index
            elif item.source is Source.AUX and self.program.split.aux[item.index].stage is None:
                source = self.program.split.aux[item.index]
                leaf = traced.loss_inputs[source.loss_input].leaf if source.loss_input is not None else None
            if leaf is not None:
                passed[leaf] = passed.get(leaf, 0) + 1
        replaced = {o for o in update_s.outputs if o < n_state}
        return tuple(position for position, item in enumerate(update_s.inputs)
                     if item.source is Source.STATE and item.index in replaced and passed[item.index] == 1)

    # -- state: the user's pytrees in and out ----------------------------------------------------
    def place(self, params: Any, opt_state: Any) -> tuple[Any, Any]:
        """The user's pytrees, each leaf a copy on its home stage with that stage's sharding (a
        leaf several stages read, also its copies on the others, kept for the next step)."""
        return self._user_trees(*self._stage_state(params, opt_state))

    def gather(self, params: Any, opt_state: Any) -> tuple[Any, Any]:
        """The user's pytrees as numpy arrays on the host."""
        if isinstance(params, Staged):
            params, opt_state = self._user_trees(params, opt_state)
        return jax.tree.map(to_host, params), jax.tree.map(to_host, opt_state)

    def _stage_state(self, params: Any, opt_state: Any) -> tuple[Staged, Staged]:
        """The user's pytrees as the arrays each stage holds. A leaf this executor returned (the
        same object) is taken as it is, and a leaf several stages read takes the copies the step
        that returned it kept: a step fed its own outputs moves nothing. Any other leaf is copied
        onto every stage that reads it (the step donates what it is given)."""
        out = []
        for layout, tree in ((self.params, params), (self.opt, opt_state)):
            if isinstance(tree, Staged):
                out.append(tree)
                continue
            leaves = state_leaves(tree, len(layout.leaves))
            values = dict(zip(layout.leaves, leaves))
            parts = tuple(tuple(self._stage_copy(s, leaf, values[leaf], layout) for leaf in held)
                          for s, held in enumerate(layout.per_stage))
            out.append(Staged(parts, layout))
        return out[0], out[1]

    def _stage_copy(self, s: int, leaf: int, value: Any, layout: StageLeaves) -> Any:
        returned = self._returned.get(leaf)
        if returned is not None and returned[0] is value:
            return value if s == layout.home(leaf) else returned[1][s]
        return put(value, self._sharding(s, leaf))

    def _user_trees(self, params: Staged, opt_state: Staged) -> tuple[Any, Any]:
        """The user's pytrees from the stages' arrays: each leaf its home stage's (`StageLeaves.home`:
        the first stage that reads it); the other stages' copies are kept for the next step."""
        self._returned = {}
        trees = []
        for staged in (params, opt_state):
            layout: StageLeaves = staged.layout
            values = []
            for leaf in layout.leaves:
                copies = {s: staged.parts[s][layout.position(s, leaf)] for s in layout.holders(leaf)}
                value = copies.pop(layout.home(leaf))
                self._returned[leaf] = (value, copies)
                values.append(value)
            trees.append(jax.tree_util.tree_unflatten(layout.treedef, values))
        return trees[0], trees[1]

    def _held(self, params: Staged, opt_state: Staged, s: int) -> dict[int, Any]:
        return {**dict(zip(self.params.per_stage[s], params.parts[s])),
                **dict(zip(self.opt.per_stage[s], opt_state.parts[s]))}

    # -- one step ---------------------------------------------------------------------------------
    def _microbatches(self, rest: Sequence[Any]) -> tuple[list[dict[int, list[Any]]], list[Any]]:
        """Per stage: loss-input position -> value for each microbatch (on the stage's mesh);
        and the flat non-state arguments (host)."""
        program = self.program
        traced = program.micro
        n_state = traced.state_leaves
        args = [np.asarray(x) if not isinstance(x, jax.Array) else x for x in jax.tree_util.tree_leaves(tuple(rest))]
        mb = program.microbatch
        per_stage: list[dict[int, list[Any]]] = []
        for s, stage in enumerate(program.split.stages):
            values: dict[int, list[Any]] = {}
            for p in stage.data:
                item = traced.loss_inputs[p]
                value = args[item.leaf - n_state]
                aval = traced.loss.jaxpr.invars[p].aval
                sharding = self._value_sharding(s, aval)
                if item.kind is InputKind.DATA:
                    program.check_batch_leaf(value)
                    values[p] = [jax.device_put(value[i * mb:(i + 1) * mb], sharding) for i in range(self.microbatches)]
                else:
                    values[p] = [jax.device_put(value, sharding)] * self.microbatches
            per_stage.append(values)
        return per_stage, args

    def _gradients(self, params: Staged, opt_state: Staged, rest: Sequence[Any], record: bool = False,
                   final: dict[str, Any] | None = None) -> tuple[Any, list[dict[int, Any]], list[dict[int, Any]],
                                                                list[Any]]:
        """Run every forward and backward pass in the dispatch order. Returns (loss on the last
        stage, per stage leaf -> summed gradient, per stage aux number -> mean, arguments).
        Given `final` (a step, not a gradient check), the last stage's final pass may run its
        update as well (`final_update`): `final["outputs"]` are then the update's outputs, and
        that stage's gradients and aux are not returned."""
        program = self.program
        traced = program.micro
        split = program.split
        m, n_stages = self.microbatches, self.n_stages
        data, args = self._microbatches(rest)
        held = [self._held(params, opt_state, s) for s in range(n_stages)]
        inputs = []
        for s, stage in enumerate(split.stages):
            leaf = lambda p: traced.loss_inputs[p].leaf  # noqa: E731
            inputs.append((tuple(held[s][leaf(p)] for p in stage.params), tuple(held[s][leaf(p)] for p in stage.state)))
        received: dict[tuple[int, int], tuple[Any, ...]] = {(0, i): () for i in range(m)}
        cotangent: dict[tuple[int, int], tuple[Any, ...]] = {}
        residuals: dict[tuple[int, int], tuple[Any, int]] = {}  # (residuals, their bytes)
        awaiting_weight: dict[tuple[int, int], tuple[Any, int, Any]] = {}  # ZB-H1: (residuals, bytes, cotangents)
        fused_gradients: dict[int, tuple[Any, Any]] = {}  # microbatch -> the last stage's, from its fused pass
        loss_ct = self._loss_ct
        grads: list[Any] = [None] * n_stages
        aux_sum: list[Any] = [None] * n_stages
        loss_sum: Any = None
        scale = 1.0 / m
        in_flight = [0] * n_stages
        peak = [0] * n_stages
        live_bytes = [0] * n_stages
        peak_bytes = [0] * n_stages
        events: list[RecordedEvent] = []
        start = time.perf_counter()
        for event in self.order:
            s, i = event.stage, event.microbatch
            stage = split.stages[s]
            if event.kind is Pass.FORWARD:
                params_s, state_s = inputs[s]
                micro = tuple(data[s][p][i] for p in stage.data)
                inbound = received.pop((s, i))
                updated = False  # the final pass ran this stage's update: nothing of its forward is left to do
                if record:
                    out, res, aux = self._recorder(s, Pass.FORWARD)(np.int32(i), params_s, inbound, state_s, micro)
                    residuals[(s, i)] = (res, _nbytes(res))
                elif final is not None and self.final_update and s == n_stages - 1 and i == m - 1:
                    extras = [None if n in self._reused else x
                              for n, x in enumerate(self._update_inputs(s, held[s], args, None, None, None))]
                    residuals[(s, i)] = (None, self._last_residual_bytes(params_s, inbound, state_s, micro))
                    donated, kept_params, kept_state, extras = self._split_donated(params_s, state_s, extras)
                    g_received, final["loss"], final["outputs"] = self._final(
                        donated, kept_params, inbound, kept_state, micro, loss_ct, grads[s], loss_sum, aux_sum[s],
                        extras)
                    fused_gradients[i] = (None, g_received)
                    updated = True
                elif s == n_stages - 1 and i in self.fused:
                    out, aux, *fused_gradients[i] = self._forward_backward(params_s, inbound, state_s, micro,
                                                                           loss_ct if stage.computes_loss else ())
                    # booked as the separate forward's residuals would be, until the backward's turn
                    residuals[(s, i)] = (None, self._last_residual_bytes(params_s, inbound, state_s, micro))
                else:
                    out, res, aux = self._forward[s](params_s, inbound, state_s, micro)
                    residuals[(s, i)] = (res, self._stage_residual_bytes(s, res))
                in_flight[s] += 1
                live_bytes[s] += residuals[(s, i)][1]
                peak[s], peak_bytes[s] = max(peak[s], in_flight[s]), max(peak_bytes[s], live_bytes[s])
                if updated:
                    continue
                aux_sum[s] = aux if aux_sum[s] is None else self._accumulate[s](aux_sum[s], aux)
                sent = out[:len(stage.sends)]
                if stage.computes_loss:
                    loss_sum = out[-1] if loss_sum is None else loss_sum + out[-1]
                if s + 1 < n_stages:
                    received[(s + 1, i)] = tuple(jax.device_put(v, self._value_sharding(s + 1, var.aval))
                                                 for v, var in zip(sent, split.stages[s + 1].receives))
            elif event.kind is Pass.WEIGHT:  # ZB-H1: the parameter cotangents, from what the B pass kept
                res, nbytes, cts = awaiting_weight.pop((s, i))
                live_bytes[s] -= nbytes
                in_flight[s] -= 1
                g_params = (self._recorder(s, Pass.WEIGHT)(np.int32(i), res, cts) if record
                            else self._weight[s](res, cts))
                del res, cts  # the residuals of microbatch i on stage s are freed here
                grads[s] = g_params if grads[s] is None else self._accumulate[s](grads[s], g_params)
            else:
                res, nbytes = residuals.pop((s, i))
                cts = cotangent.pop((s, i), ()) + (loss_ct if stage.computes_loss else ())  # the last stage: none sent
                g_params = None
                if self.split_backward:  # the input cotangents only; the W pass reads the residuals later
                    g_received = (self._recorder(s, Pass.BACKWARD)(np.int32(i), res, cts) if record
                                  else self._backward[s](res, cts))
                    awaiting_weight[(s, i)] = (res, nbytes, cts)
                else:
                    live_bytes[s] -= nbytes
                    in_flight[s] -= 1
                    if s == n_stages - 1 and i in fused_gradients:
                        g_params, g_received = fused_gradients.pop(i)
                    elif record:
                        g_params, g_received = self._recorder(s, Pass.BACKWARD)(np.int32(i), res, cts)
                    else:
                        g_params, g_received = self._backward[s](res, cts)
                del res  # without a W pass to come, the residuals of microbatch i on stage s are freed here
                if g_params is not None:  # None: the final pass summed and used them, or the W pass will
                    grads[s] = g_params if grads[s] is None else self._accumulate[s](grads[s], g_params)
                if s > 0:
                    previous = split.stages[s - 1]
                    cotangent[(s - 1, i)] = tuple(
                        jax.device_put(g, self._value_sharding(s - 1, var.aval)) if _is_float(var.aval.dtype)
                        else _float0_like(var.aval)
                        for g, var in zip(g_received, previous.sends))
        if record:
            jax.block_until_ready((loss_sum, grads))
            jax.effects_barrier()  # every pass's stamps (asynchronous debug callbacks) have arrived
            events = self._recorded_events(start)
        self.stats = StepStats(peak, peak_bytes, events)
        # an eager multiply is a dispatch of its own (milliseconds on a multi-device mesh): none for
        # M = 1, and one program per stage for all of its aux values (resnet's batch statistics are
        # a hundred leaves: a multiply each took 84 ms of a 165 ms step)
        loss = final["loss"] if final and "loss" in final else loss_sum * scale if m > 1 else loss_sum
        aux_means = []
        for s, stage in enumerate(split.stages):
            sums = tuple(aux_sum[s] or ())
            aux_means.append(dict(zip(stage.aux, _means(sums, m) if m > 1 and sums else sums)))
        per_leaf = self._sum_shared([{traced.loss_inputs[p].leaf: g for p, g in zip(stage.params, grads[s] or ())}
                                     for s, stage in enumerate(split.stages)])
        return loss, per_leaf, aux_means, args

    def _recorder(self, s: int, kind: Pass) -> Any:
        if (s, kind) not in self._recording:
            self._recording[(s, kind)] = self._make_recording(s, kind)
        return self._recording[(s, kind)]

    def _recorded_events(self, start: float) -> list[RecordedEvent]:
        """Each pass from the first device starting it to the last finishing it."""
        spans: dict[tuple[int, str, int], list[float]] = {}
        for stage, kind, microbatch, end, moment in self._stamps:
            span = spans.setdefault((stage, kind, microbatch), [float("inf"), float("-inf")])
            span[end] = min(span[0], moment - start) if end == 0 else max(span[1], moment - start)
        self._stamps = []
        return sorted((RecordedEvent(Event(stage, Pass(kind), microbatch), a, b)
                       for (stage, kind, microbatch), (a, b) in spans.items()), key=lambda e: e.start)

    def _sum_shared(self, per_stage: list[dict[int, Any]]) -> list[dict[int, Any]]:
        """Gradients of a leaf several stages read: the sum of theirs, on each of them."""
        holders: dict[int, list[int]] = {}
        for s, grads in enumerate(per_stage):
            for leaf in grads:
                holders.setdefault(leaf, []).append(s)
        for leaf, stages in holders.items():
            if len(stages) < 2:
                continue
            first = stages[0]
            target = per_stage[first][leaf].sharding
            total = per_stage[first][leaf]
            for s in stages[1:]:
                total = total + jax.device_put(per_stage[s][leaf], target)
            for s in stages:
                per_stage[s][leaf] = jax.device_put(total, per_stage[s][leaf].sharding)
        return per_stage

    def value_and_grad(self, params: Any, opt_state: Any, *rest: Any) -> tuple[Any, list[Any], list[Any]]:
        """(loss, aux leaves, gradient leaves) of the marked call (host arrays)."""
        program = self.program
        traced = program.traced
        program.check_arguments(rest)
        params, opt_state = self._stage_state(params, opt_state)
        loss, grads, aux, _ = self._gradients(params, opt_state, rest)
        aux_out = []
        for j, source in enumerate(program.split.aux):
            if source.stage is not None:
                aux_out.append(to_host(aux[source.stage][j]))
            elif source.loss_input is not None:
                item = traced.loss_inputs[source.loss_input]
                aux_out.append(np.asarray(item.value) if item.kind is InputKind.CONST
                               else to_host(self._held(params, opt_state, self.params.home(item.leaf)
                                                       if item.leaf < traced.arg_sizes[0]
                                                       else self.opt.home(item.leaf))[item.leaf]))
            else:
                aux_out.append(np.asarray(source.constant))
        grad_out = []
        for position in traced.grads:
            leaf = traced.loss_inputs[position].leaf
            found = next((g[leaf] for g in grads if leaf in g), None)
            aval = traced.step.jaxpr.invars[leaf].aval
            grad_out.append(to_host(found) if found is not None else np.zeros(aval.shape, aval.dtype))
        return to_host(loss), aux_out, grad_out

    def __call__(self, params: Any, opt_state: Any, *rest: Any, record: bool = False) -> Any:
        """One step on the user's pytrees (or `Staged` state), returning the user's pytrees."""
        program = self.program
        traced = program.traced
        update = program.update
        n_state = traced.state_leaves
        final: dict[str, Any] = {}
        program.check_arguments(rest)
        params, opt_state = self._stage_state(params, opt_state)
        loss, grads, aux, args = self._gradients(params, opt_state, rest, record=record, final=final)
        new_parts: list[dict[int, Any]] = []
        results: dict[int, Any] = {}
        for s in range(self.n_stages):
            if s == self.n_stages - 1 and "outputs" in final:  # updated in the last stage's final pass
                updated = final["outputs"]
            else:
                inputs = self._update_inputs(s, self._held(params, opt_state, s), args, loss, aux[s], grads[s])
                updated = self._update[s](*inputs)
            outputs = dict(zip(update.programs[s].outputs, updated))
            new_parts.append({o: v for o, v in outputs.items() if o < n_state})
            results.update({o: v for o, v in outputs.items() if o >= n_state and update.owner[o] == s})
        staged = []
        for layout in (self.params, self.opt):
            parts = tuple(tuple(new_parts[s][leaf] for leaf in held) for s, held in enumerate(layout.per_stage))
            staged.append(Staged(parts, layout))
        flat: list[Any] = [None] * len(traced.step.jaxpr.outvars)
        for o, value in results.items():
            flat[o] = value
        out = jax.tree_util.tree_unflatten(traced.out_tree, flat)
        return (*self._user_trees(staged[0], staged[1]), *out[2:])

    def _update_inputs(self, s: int, held: Mapping[int, Any], args: Sequence[Any], loss: Any,
                       aux: Mapping[int, Any] | None, grads: Mapping[int, Any] | None) -> list[Any]:
        """The inputs of stage s's update, in its order. With `aux` and `grads` None (the final
        pass computes them, and the loss), those inputs are None."""
        program = self.program
        traced = program.traced
        mesh_any = NamedSharding(self.meshes[s], P())
        inputs: list[Any] = []
        for item in program.update.programs[s].inputs:
            if item.source is Source.STATE:
                inputs.append(held[item.index])
            elif item.source is Source.ARGUMENT:
                inputs.append(jax.device_put(args[item.index - traced.state_leaves], mesh_any))
            elif item.source is Source.LOSS:
                inputs.append(None if loss is None else jax.device_put(loss, mesh_any))
            elif item.source is Source.AUX:
                source = program.split.aux[item.index]
                if source.stage is not None:
                    inputs.append(None if aux is None else aux[item.index])
                elif source.loss_input is not None and traced.loss_inputs[source.loss_input].leaf is not None:
                    inputs.append(held[traced.loss_inputs[source.loss_input].leaf])
                else:
                    value = source.constant if source.loss_input is None else traced.loss_inputs[source.loss_input].value
                    inputs.append(jnp.asarray(value))
            elif grads is None:
                inputs.append(None)
            else:
                leaf = traced.loss_inputs[traced.grads[item.index]].leaf
                aval = traced.step.jaxpr.invars[leaf].aval
                found = grads.get(leaf)  # a default argument would build the zeros every time
                inputs.append(found if found is not None else jax.device_put(jnp.zeros(aval.shape, aval.dtype), mesh_any))
        return inputs


@functools.partial(jax.jit, static_argnums=1)
def _means(sums: tuple[Any, ...], count: int) -> tuple[Any, ...]:
    """Running sums over `count` microbatches -> their means (float leaves; others as they are),
    in one program."""
    return tuple(x * (1.0 / count) if _is_float(x.dtype) else x for x in sums)


def _accumulate(a: Any, b: Any) -> Any:
    """Running sums of float leaves (gradients, aux); other leaves keep the latest value."""
    return jax.tree.map(lambda x, y: x + y if _is_float(x.dtype) else y, a, b)


def _fits(spec: Any, mesh: Any) -> bool:
    names = set(mesh.axis_names)
    for entry in spec:
        for axis in (entry if isinstance(entry, tuple) else (entry,)):
            if axis is not None and axis not in names:
                return False
    return True
