"""Pipeline plans for the runner's tests, made from a zoo step's HLO chain."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from hlomap.plan import ParameterSpec, Plan, PlanSource
from hlomap.cost.pipeline.chain import StepChain, step_chain


def chain_of(cap: Any) -> StepChain:
    return step_chain(cap)


def pivots_at(chain: StepChain, fractions: Sequence[float]) -> list[int]:
    """Pivot indices at these fractions of the forward chain (cuts anywhere, inside layers too)."""
    n = len(chain.pivots)
    return [min(int(f * n), n - 1) for f in fractions]


def boundary_pivots(chain: StepChain, count: int) -> list[int]:
    """`count` pivots where one tensor crosses and the layer scope changes right after (between
    layers), spread over the middle of the chain (not before the first layer's weights)."""
    pivots = chain.pivots
    n = len(pivots)
    middle = range(n // 10, n - n // 10)
    candidates = [k for k in middle
                  if pivots[k].live_tensors <= 1 and pivots[k].scope.split("/")[0] != pivots[k + 1].scope.split("/")[0]]
    if len(candidates) < count:
        candidates = [k for k in middle if pivots[k].live_tensors <= 1]
    step = len(candidates) / (count + 1)
    return [candidates[int(step * (i + 1))] for i in range(count)]


def pipeline_plan(cap: Any, chain: StepChain, pivots: Sequence[int], *, microbatches: int,
                  schedule: str = "gpipe", devices_per_stage: int = 1, mesh: Mapping[str, int] | None = None,
                  specs: Mapping[int, Sequence[Any]] | None = None, repeats: int = 1) -> Plan:
    """A plan with stages cut after chain pivots `pivots`; `mesh` the mesh inside each stage (the
    plan's top-level mesh) and `specs` per flat parameter index, else replicated stages (a `data`
    axis over each stage's devices). With `repeats` V, a circular plan: the len(pivots) + 1
    logical stages run V rounds over (len(pivots) + 1) / V device stages."""
    n_stages = (len(pivots) + 1) // repeats
    specs = specs or {}
    parameters = tuple(ParameterSpec(p.index, p.path, tuple(p.shape.dims),
                                     tuple(specs.get(p.index, (None,) * len(p.shape.dims))))
                       for p in cap.parameters)
    stages, start = [], 0
    bounds = [*pivots, len(chain.pivots)]
    for s in range(n_stages):
        stage: dict[str, Any] = {"devices": list(range(s * devices_per_stage, (s + 1) * devices_per_stage))}
        if repeats == 1:
            stage["layers"] = [start, bounds[s] + 1]
            start = bounds[s] + 1
        stages.append(stage)
    cuts = [{"pivot": k, "instruction": chain.pivots[k].instruction, "layer": chain.pivots[k].layer,
             "scope": chain.pivots[k].scope, "source": chain.pivots[k].source,
             "crossing_bytes": chain.pivots[k].crossing_bytes} for k in pivots]
    return Plan(mesh=tuple((mesh or {}).items()), parameters=parameters,
                source=PlanSource(cap.source, cap.text_sha256),
                pipeline={"stages": stages, "microbatches": microbatches, "schedule": schedule, "cuts": cuts,
                          **({"repeats": repeats} if repeats > 1 else {})})


# ---------------------------------------------------------------------------------------------
# Running a plan and checking it against the unsharded step
# ---------------------------------------------------------------------------------------------

#: Tests compile many small programs once: XLA's fastest pipeline.
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def gradient_paths(step: Any) -> list[str]:
    """Paths of the marked call's gradient leaves (what `value_and_grad` returns)."""
    traced = step.program.traced
    return [traced.loss_inputs[p].path for p in traced.grads]


def check_gradients(step: Any, args: Sequence[Any], reference_microbatches: int = 1) -> list[Any]:
    """Loss, aux and gradients of the pipelined step against `reference_gradients`; returns the
    comparisons (each has .ok and .words())."""
    from hlomap.run.compare import compare_loss, compare_scaled, reference_gradients

    loss, aux, grads = step.value_and_grad(*args)
    reference = reference_gradients(step.step, args, reference_microbatches)
    paths = gradient_paths(step)
    out = [compare_loss(loss, reference.loss), compare_scaled("gradients", grads, reference.grads, paths)]
    if reference.aux:
        out.append(compare_scaled("aux outputs", aux, reference.aux, [f"aux {j}" for j in range(len(aux))]))
    return out


def check_update(step: Any, args: Sequence[Any], reference_microbatches: int = 1) -> list[Any]:
    """One step of the pipeline against the unsharded step (jit on one device): updated
    parameters where the gradient is above noise, the optimizer state, the returned loss."""
    import jax
    import numpy as np

    from hlomap.run.compare import compare_loss, compare_scaled, compare_updates, reference_gradients

    params, opt_state, batch = args[0], args[1], args[2]
    host_before = jax.tree.map(np.asarray, params)
    plain = jax.tree.map(np.asarray, jax.jit(step.step)(*args))
    placed = step.place(params, opt_state)
    out = step(*placed, batch, *args[3:])
    new_params, new_opt = step.gather(out[0], out[1])
    reference = reference_gradients(step.step, args, reference_microbatches)
    traced = step.program.traced
    grads = {traced.loss_inputs[p].leaf: g for p, g in zip(traced.grads, reference.grads)}
    leaves_new = jax.tree.leaves(new_params)
    leaves_plain = jax.tree.leaves(plain[0])
    leaves_before = jax.tree.leaves(host_before)
    trained = sorted(grads)
    paths = [traced.paths[leaf] for leaf in trained]
    result = [compare_updates("updated parameters", [leaves_new[i] for i in trained],
                              [leaves_plain[i] for i in trained], [leaves_before[i] for i in trained],
                              [grads[i] for i in trained], paths),
              compare_loss(np.asarray(out[2]), plain[2])]
    opt_new, opt_plain = jax.tree.leaves(new_opt), jax.tree.leaves(plain[1])
    floats = [i for i, x in enumerate(opt_plain) if np.issubdtype(np.asarray(x).dtype, np.floating)]
    result.append(compare_scaled("optimizer state", [opt_new[i] for i in floats], [opt_plain[i] for i in floats],
                                 [f"opt_state leaf {i}" for i in floats], tolerance=1e-3))
    ints = [i for i, x in enumerate(opt_plain) if not np.issubdtype(np.asarray(x).dtype, np.floating)]
    assert all(np.array_equal(opt_new[i], opt_plain[i]) for i in ints), "integer optimizer state differs"
    return result


def assert_ok(comparisons: Sequence[Any]) -> None:
    bad = [c.words() for c in comparisons if not c.ok]
    assert not bad, "\n".join(bad)
