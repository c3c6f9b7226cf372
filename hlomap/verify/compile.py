"""Compile a step under a plan with XLA: the one place verify/ builds shardings (its meshes come
from `verify.mesh`, as the runner's do).

Every oracle in verify/ starts here. `compile_plan` lowers `jax.jit(step)` with the plan's
`in_shardings` on a mesh of the host's devices and compiles it; what differs between the oracles
is only how much is pinned:

- collectives, FLOPs and memory (`verify.xla`) compile the step as a training loop runs it:
  outputs pinned to the shardings the plan derives for them (`output_specs`) and the parameters
  and optimizer state donated (`donated_arguments`), so their buffers are reused for the updates;
- propagated shardings and numerics (`verify.shardings`, `verify.numerics`) pin the inputs only:
  XLA's own propagation chooses the outputs (that choice is what the sharding oracle checks), and
  nothing is donated, so the executable can run again on the same placed arguments.

Arguments are always kept (`keep_unused=True`), as in `hlo.capture`, so the compiled module's
entry parameter i is the plan's parameter i. With `dump_dir`, XLA also writes the module at each
shardy pass; `before_spmd-partitioning` holds the shardings its propagation chose.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any, Callable, NamedTuple, Sequence

from hlomap.hlo.capture import Capture, Role
from hlomap.verify.mesh import plan_mesh

if TYPE_CHECKING:
    from jax.sharding import Mesh, PartitionSpec

    from hlomap.plan import Plan
    from hlomap.propagation.graph import FactorGraph

log = logging.getLogger(__name__)

__all__ = ["CompiledPlan", "compile_plan", "donated_arguments", "output_specs"]

#: XLA dumps the module before and after every pass whose name matches; shardy's passes include
#: the one before SPMD partitioning, whose `sharding=` attributes are propagation's result.
SHARDY_DUMP_PASSES = "shardy-xla"


def output_specs(graph: FactorGraph, plan: Plan) -> list[PartitionSpec]:
    """A PartitionSpec per output leaf of the step, from the plan's groups of the entry root's
    leaves: the new parameters and optimizer state come back sharded as they went in."""
    from jax.sharding import PartitionSpec

    from hlomap.propagation.conflicts import MeshAxes

    axes = MeshAxes.from_mesh(plan.mesh_shape, extra=[g.axes for g in plan.groups])
    array = plan.group_array(graph, axes)
    parameters = sorted(plan.parameters, key=lambda p: p.index)
    split = plan.state_sharding.dim_of if plan.state_sharding is not None else {}
    specs = []
    for k, t in enumerate(graph.output_tensors):
        entries: list[Any] = []
        for d in graph.tensor_dims(t):
            o = int(array[graph.group_of_dim[d]])
            entries.append(None if o < 0 else (axes.options[o][0] if len(axes.options[o]) == 1 else axes.options[o]))
        # a state leaf split over the data axes (ZeRO-1) comes back split as it went in: the step
        # returns the new state first, leaf k being argument leaf k
        if k in split and k < len(parameters) and len(entries) == len(parameters[k].shape):
            placed = list(plan.leaf_spec(parameters[k]))
            entries = placed + [None] * (len(entries) - len(placed))
        while entries and entries[-1] is None:
            entries.pop()
        specs.append(PartitionSpec(*entries))
    return specs


def donated_arguments(cap: Capture) -> tuple[int, ...]:
    """Argument positions a training loop donates: those holding trainable parameters or
    optimizer state (their updated values are outputs of the same shapes)."""
    if cap.in_tree is None or cap.args is None:
        return ()
    import jax

    donate = []
    offset = 0
    for i, arg in enumerate(cap.args):
        n = len(jax.tree_util.tree_leaves(arg))
        roles = {p.role for p in cap.parameters[offset: offset + n]}
        if roles & {Role.TRAINABLE, Role.OPTIMIZER_STATE}:
            donate.append(i)
        offset += n
    return tuple(donate)


class CompiledPlan(NamedTuple):
    """A step compiled under a plan, with the mesh and input shardings it was compiled for."""

    compiled: Any  # jax.stages.Compiled: callable on arguments placed with `in_shardings`
    mesh: Mesh
    in_shardings: Any  # NamedSharding pytree shaped like the arguments

    def place(self, args: Sequence[Any]) -> tuple[Any, ...]:
        """`args` on the devices, sharded as the executable expects them."""
        import jax

        return jax.device_put(tuple(args), self.in_shardings)


def compile_plan(step: Callable[..., Any], args: Sequence[Any], plan: Plan, *, mesh: Mesh | None = None,
                 outputs: Sequence[PartitionSpec] | None = None, donate: Sequence[int] = (),
                 dump_dir: str | None = None) -> CompiledPlan:
    """`jax.jit(step, in_shardings=plan, out_shardings=outputs, donate_argnums=donate)` lowered
    for `args` (arrays or ShapeDtypeStructs) and compiled.

    `mesh`: a jax Mesh whose axes match the plan's; default the plan's own on its device order
    (`verify.mesh.plan_mesh`). `outputs`: one PartitionSpec per output leaf (see `output_specs`);
    None leaves them to XLA's propagation.
    `dump_dir`: also dump the modules of XLA's shardy passes there (see the module docstring).
    The element types are the arguments': call inside `jax.enable_x64(True)` for float64 ones.
    """
    import jax
    from jax.sharding import NamedSharding

    mesh = mesh if mesh is not None else plan_mesh(plan)
    in_shardings = plan.shardings(mesh, like=tuple(args))
    pinned: dict[str, Any] = {}  # out_shardings only when given: jit's default is "XLA chooses"
    if outputs is not None:
        leaves, treedef = jax.tree_util.tree_flatten(jax.eval_shape(step, *args))
        if len(outputs) != len(leaves):
            raise ValueError(f"the step has {len(leaves)} outputs but {len(outputs)} output specs were given "
                             f"(the module's root leaves)")
        pinned["out_shardings"] = jax.tree_util.tree_unflatten(treedef, [NamedSharding(mesh, s) for s in outputs])
    options = None
    if dump_dir is not None:
        os.makedirs(dump_dir, exist_ok=True)
        options = {"xla_dump_to": dump_dir, "xla_dump_hlo_pass_re": SHARDY_DUMP_PASSES}
    jitted = jax.jit(step, in_shardings=in_shardings, donate_argnums=tuple(donate), keep_unused=True, **pinned)
    compiled = jitted.lower(*args).compile(compiler_options=options)
    return CompiledPlan(compiled, mesh, in_shardings)
