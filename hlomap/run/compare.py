"""Is a parallelized step the unsharded step? Loss and gradients compared before the optimizer.

Why before: Adam's first update is `lr * g / (|g| + eps)`, so a gradient that is zero up to
float32 rounding (the gradient of a key bias under softmax, say) becomes +-lr in either run
with a random sign; comparing updated parameters would fail on noise and pass on gradients
that are wrong by a constant factor (Adam divides it out). So:

- the loss: relative tolerance;
- each gradient leaf against a tolerance relative to that leaf's scale (its largest magnitude,
  floored at a small fraction of the largest gradient so leaves that are zero in exact
  arithmetic are held to the rounding of the others);
- the optimizer's output (updated parameters) only where the gradient is well above rounding
  noise, relative to the size of the update.

A step whose dots run in bfloat16 or float16 (mixed precision) is held to its own, wider
`Tolerances` (`HALF_PRECISION`): its sums are rounded to 8 (or 11) bits wherever a device or a
microbatch ends one, so the sharded step differs from the unsharded one by a few percent.

Each leaf goes through `hlomap.verify.numerics.compare_outputs` (the project's comparison) with
an absolute tolerance made from that leaf's scale; this module only decides the tolerances.

The unsharded reference (`reference_gradients`) is the marked function's loss and gradient on
one device: the mean over M equal microbatches of the loss and gradient of each (for a loss
that averages over examples, the loss and gradient of the whole batch), aux outputs averaged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from hlomap.verify.numerics import Tolerance, compare_outputs

__all__ = ["FLOAT32", "HALF_PRECISION", "GradientResult", "LeafDiff", "LeafGroupCheck", "StepCheck", "Tolerances",
           "check_pipeline", "check_spmd", "check_step", "compare_loss", "compare_scaled", "compare_updates",
           "reference_gradients", "tolerances_for"]

#: Allowed difference of a gradient leaf, as a fraction of its scale (float32 sums reordered over
#: microbatches and devices differ by a few ulps of the largest terms).
GRADIENT_TOLERANCE = 1e-4
#: Gradients below this fraction of the step's largest gradient are at the level of float32
#: rounding noise (a gradient that is zero in exact arithmetic comes out about this small): a
#: leaf's scale is at least this fraction of the largest, and the update check skips them.
SCALE_FLOOR = 1e-4
#: Relative tolerance of the loss.
LOSS_TOLERANCE = 1e-5
#: Gradients below this fraction of their leaf's scale are rounding noise for the update check.
NOISE = 1e-3
#: Allowed difference of an updated parameter, as a fraction of the leaf's largest update.
UPDATE_TOLERANCE = 1e-3


@dataclass(frozen=True)
class Tolerances:
    """How near the unsharded step's a parallel step's results must come: the loss (relative),
    each gradient leaf (a fraction of its scale, floored at `floor` of the largest gradient),
    and the updated parameters where the gradient is above `noise` of its leaf's scale."""

    loss: float = LOSS_TOLERANCE
    gradient: float = GRADIENT_TOLERANCE
    floor: float = SCALE_FLOOR
    noise: float = NOISE
    update: float = UPDATE_TOLERANCE


#: A step that computes in float32 (or wider).
FLOAT32 = Tolerances()
#: A step whose dots take bfloat16 or float16 operands. A gradient leaf that is a sum over the
#: batch (a bias) reduces its terms in bfloat16: the sharded and unsharded sums differ by up to a
#: few percent of the leaf's scale (4.2% measured on gpt-tiny in bfloat16 over 8 devices). Adam's
#: first update is about +-lr for every gradient, so the update check keeps to gradients above
#: `noise` of their leaf's scale, which no difference within `gradient` can flip the sign of.
HALF_PRECISION = Tolerances(loss=1e-2, gradient=1e-1, floor=1e-2, noise=0.3, update=UPDATE_TOLERANCE)

#: HLO element types of half precision.
HALF_DTYPES = frozenset({"bf16", "f16"})


def tolerances_for(dot_operand_dtypes: Iterable[str]) -> Tolerances:
    """`HALF_PRECISION` when any dot of the step takes a half-precision operand, else `FLOAT32`."""
    return HALF_PRECISION if HALF_DTYPES.intersection(dot_operand_dtypes) else FLOAT32


@dataclass(frozen=True)
class GradientResult:
    """The marked call's results: loss, aux leaves, gradient leaves (host arrays)."""

    loss: Any
    aux: list[Any]
    grads: list[Any]


@dataclass(frozen=True)
class LeafDiff:
    path: str
    max_error: float  # largest |actual - expected|
    scale: float  # what the tolerance is relative to
    ok: bool

    @property
    def relative(self) -> float:
        return self.max_error / self.scale if self.scale > 0 else (0.0 if self.max_error == 0 else float("inf"))


@dataclass(frozen=True)
class LeafGroupCheck:
    """One group of leaves (the loss, the gradients, the updated parameters) of a parallelized step
    checked against the unsharded step's: ok when every leaf is within its tolerance."""

    what: str
    tolerance: float
    leaves: tuple[LeafDiff, ...]

    @property
    def ok(self) -> bool:
        return all(d.ok for d in self.leaves)

    @property
    def worst(self) -> LeafDiff | None:
        return max(self.leaves, key=lambda d: d.relative, default=None)

    @property
    def failing(self) -> tuple[str, ...]:
        return tuple(d.path for d in self.leaves if not d.ok)

    def words(self) -> str:
        worst = self.worst
        if worst is None:
            return f"{self.what}: nothing to compare"
        verdict = "equal" if self.ok else "DIFFERENT"
        scale = "of each leaf's scale" if len(self.leaves) > 1 else "of its scale"
        text = (f"{self.what} {verdict} to the unsharded step's within {self.tolerance:g} {scale} "
                f"(worst {worst.path}: {worst.relative:.2g} of its scale {worst.scale:.3g})")
        if not self.ok:
            text += f"; {len(self.failing)} of {len(self.leaves)} leaves differ: {', '.join(self.failing[:3])}"
            text += " ..." if len(self.failing) > 3 else ""
        return text

    def to_json(self) -> dict[str, Any]:
        worst = self.worst
        return {"what": self.what, "ok": self.ok, "tolerance": self.tolerance, "leaves": len(self.leaves),
                "failing": list(self.failing), "worst_leaf": worst.path if worst else None,
                "worst_relative_error": worst.relative if worst else None}


def _leaf(path: str, actual: Any, expected: Any, scale: float, tolerance: float, mask: Any = None) -> LeafDiff:
    a = np.asarray(actual, dtype=np.float64)
    b = np.asarray(expected, dtype=np.float64)
    if a.shape != b.shape:
        raise AssertionError(f"{path}: shape {a.shape} against {b.shape}")
    if mask is not None:
        a, b = a[mask], b[mask]
    diff = compare_outputs([a], [b], Tolerance(rtol=0.0, atol=tolerance * scale))
    return LeafDiff(path, diff.max_abs_error, scale, diff.ok)


def compare_scaled(what: str, actual: Sequence[Any], expected: Sequence[Any], paths: Sequence[str], *,
                   tolerance: float = GRADIENT_TOLERANCE, floor: float = SCALE_FLOOR) -> LeafGroupCheck:
    """Each leaf within `tolerance` of its scale: max |expected leaf|, floored at `floor` times
    the largest scale."""
    scales = [float(np.max(np.abs(np.asarray(e, dtype=np.float64)))) if np.size(e) else 0.0 for e in expected]
    top = max(scales, default=0.0)
    return LeafGroupCheck(what, tolerance, tuple(
        _leaf(p, a, e, max(s, floor * top), tolerance) for p, a, e, s in zip(paths, actual, expected, scales)))


def compare_loss(actual: Any, expected: Any, *, tolerance: float = LOSS_TOLERANCE) -> LeafGroupCheck:
    scale = abs(float(np.asarray(expected)))
    return LeafGroupCheck("loss", tolerance, (_leaf("loss", actual, expected, max(scale, 1e-30), tolerance),))


def compare_updates(what: str, actual: Sequence[Any], expected: Sequence[Any], before: Sequence[Any],
                    grads: Sequence[Any], paths: Sequence[str], *, noise: float = NOISE,
                    floor: float = SCALE_FLOOR, tolerance: float = UPDATE_TOLERANCE) -> LeafGroupCheck:
    """Updated leaves, only where the reference gradient is above `noise` of its leaf's scale
    (floored at `floor` of the largest gradient), within `tolerance` of the leaf's largest
    update there."""
    magnitudes = [np.abs(np.asarray(g, dtype=np.float64)) for g in grads]
    top = max((float(g.max()) for g in magnitudes if g.size), default=0.0)
    leaves = []
    for path, a, e, old, g in zip(paths, actual, expected, before, magnitudes):
        mask = g > noise * max(float(g.max()) if g.size else 0.0, floor * top)
        step = np.abs(np.asarray(e, dtype=np.float64) - np.asarray(old, dtype=np.float64))
        scale = float(step[mask].max()) if mask.any() else 0.0
        leaves.append(_leaf(path, a, e, max(scale, 1e-30), tolerance, mask))
    return LeafGroupCheck(what, tolerance, tuple(leaves))


def _marked_gradients(step: Callable[..., Any], args: Sequence[Any], microbatches: int = 1,
                      shardings: Sequence[Any] | None = None) -> GradientResult:
    """Loss, aux and gradients of the marked call of `step(*args)`, averaged over `microbatches`
    equal microbatches. `shardings`: one per flat argument (the plan's NamedShardings), so that
    XLA partitions the gradient computation from the plan's arguments; None: one device."""
    import jax
    import jax.numpy as jnp
    from jax.extend import core as jcore

    from hlomap.run.errors import RunError
    from hlomap.run.trace import InputKind, microbatch_args, trace_step

    args = tuple(args)
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), args)
    whole = trace_step(step, abstract)
    if whole.batch_size % microbatches:
        raise RunError(f"the batch of {whole.batch_size} examples cannot be split into {microbatches} equal "
                       "microbatches")
    mb = whole.batch_size // microbatches
    traced = whole
    if microbatches > 1:  # traced again at the microbatch's shapes
        traced = trace_step(step, microbatch_args(abstract, mb, whole.batch_size))
    flat = jax.tree_util.tree_leaves(args)
    positions = [p for p in traced.grads]
    run = jcore.jaxpr_as_fun(traced.loss)

    def loss_of(grad_values: Sequence[Any], values: Sequence[Any]) -> Any:
        values = list(values)
        for p, v in zip(positions, grad_values):
            values[p] = v
        out = run(*values)
        return out[0], out[1:]

    def placed(value: Any, leaf: int) -> Any:
        return jnp.asarray(value) if shardings is None else jax.device_put(value, shardings[leaf])

    value_and_grad = jax.jit(jax.value_and_grad(loss_of, has_aux=True))
    losses, auxes, grads = [], [], []
    for i in range(microbatches):
        values = []
        for item in traced.loss_inputs:
            if item.kind is InputKind.CONST:
                values.append(item.value)
            elif item.kind is InputKind.DATA:
                values.append(placed(np.asarray(flat[item.leaf])[i * mb:(i + 1) * mb], item.leaf))
            else:
                values.append(placed(flat[item.leaf], item.leaf))
        (loss, aux), g = value_and_grad([values[p] for p in positions], values)
        losses.append(np.asarray(loss))
        auxes.append([np.asarray(a) for a in aux])
        grads.append([np.asarray(x) for x in g])
    dtype = losses[0].dtype

    def mean(values: list[Any]) -> Any:
        first = np.asarray(values[0])
        if not np.issubdtype(first.dtype, np.floating):
            return first if len(values) == 1 else np.asarray(values[-1])
        return (np.sum(np.asarray(values, dtype=np.float64), axis=0) / len(values)).astype(first.dtype)

    return GradientResult(mean(losses).astype(dtype), [mean([a[j] for a in auxes]) for j in range(len(auxes[0]))],
                          [mean([g[k] for g in grads]) for k in range(len(grads[0]))])


def reference_gradients(step: Callable[..., Any], args: Sequence[Any], microbatches: int = 1) -> GradientResult:
    """The marked call of `step(*args)` without a pipeline (module docstring): jit on one device."""
    return _marked_gradients(step, args, microbatches)


@dataclass(frozen=True)
class StepCheck:
    """A parallelized step against the unsharded one (`check_pipeline`, `check_spmd`).

    comparisons: loss, gradients, aux against the reference with the same microbatches (SPMD
    plans: also the updated parameters where the gradient is above rounding noise).
    microbatching: the same reference against the whole batch in one piece, for information: it
    differs when the loss is not a mean over examples or uses batch statistics (batch norm),
    which microbatching changes by design.
    float64: when the float32 comparison fails, the same comparison with both run in float64,
    and `reference_float32`: how far the unsharded float32 gradients are from float64. When the
    pipeline agrees in float64 and the unsharded float32 step is itself outside the tolerance,
    the float32 difference is rounding amplified by an ill-conditioned step (batch-norm
    statistics), not a wrong pipeline: a wrong cut or schedule stays wrong in float64.
    """

    comparisons: tuple[LeafGroupCheck, ...]
    microbatching: tuple[LeafGroupCheck, ...]
    seconds: float  # one pipelined step after compiling
    float64: tuple[LeafGroupCheck, ...] = ()
    reference_float32: LeafGroupCheck | None = None

    @property
    def exact(self) -> bool:
        return all(c.ok for c in self.comparisons)

    @property
    def rounding(self) -> bool:
        """The float32 difference is explained by float32 rounding (see the class docstring)."""
        return (not self.exact and bool(self.float64) and all(c.ok for c in self.float64)
                and self.reference_float32 is not None and not self.reference_float32.ok)

    @property
    def ok(self) -> bool:
        return self.exact or self.rounding

    def to_json(self) -> dict[str, Any]:
        return {"ok": self.ok, "float32_equal": self.exact, "float32_rounding": self.rounding,
                "comparisons": [c.to_json() for c in self.comparisons],
                "microbatching": [c.to_json() for c in self.microbatching],
                "float64": [c.to_json() for c in self.float64],
                "reference_float32": self.reference_float32.to_json() if self.reference_float32 else None,
                "step_seconds": self.seconds}


def _marked_comparisons(got: GradientResult, ref: GradientResult, paths: Sequence[str],
                        label: str, tolerances: Tolerances) -> tuple[LeafGroupCheck, ...]:
    """The loss, each gradient leaf and each aux output of the marked call against the reference."""
    scaled = {"tolerance": tolerances.gradient, "floor": tolerances.floor}
    out = [compare_loss(got.loss, ref.loss, tolerance=tolerances.loss),
           compare_scaled(f"gradients{label}", got.grads, ref.grads, paths, **scaled)]
    if ref.aux:
        out.append(compare_scaled(f"aux outputs{label}", got.aux, ref.aux, [f"aux {j}" for j in range(len(ref.aux))],
                                  **scaled))
    return tuple(out)


def _timed_step(step: Any, args: Sequence[Any]) -> float:
    """Seconds of one step of `step` (a `hlomap.parallelize` step) after two others: the first
    compiles, and where a step returns its state laid out otherwise than `place` put it (a joint
    plan's split optimizer state on the mpmd executor) the second compiles again."""
    import time

    import jax

    out = step.place(args[0], args[1])
    for _ in range(2):
        out = step(out[0], out[1], *args[2:])
        jax.block_until_ready(out)
    start = time.perf_counter()
    jax.block_until_ready(step(out[0], out[1], *args[2:]))
    return time.perf_counter() - start


def check_pipeline(step: Any, args: Sequence[Any], on_phase: Callable[[str], None] | None = None,
                   tolerances: Tolerances = FLOAT32) -> StepCheck:
    """Loss, gradients and aux of `step` (a pipelined `hlomap.parallelize` step) against the
    unsharded reference with the plan's microbatches, in float64 too when float32 differs;
    then one timed step. `on_phase` hears each phase as it starts."""
    import jax

    phase = on_phase or _silent

    step.describe(args)  # cuts the step now if its first call has not
    microbatches = step.program.microbatches
    traced = step.program.traced
    paths = [traced.loss_inputs[p].path for p in traced.grads]

    def against(result: tuple[Any, list[Any], list[Any]], ref: GradientResult, label: str) -> tuple[LeafGroupCheck, ...]:
        return _marked_comparisons(GradientResult(*result), ref, paths, label, tolerances)

    phase("compiling and running the plan's step")
    result = step.value_and_grad(*args)
    phase("running the unsharded step")
    reference = reference_gradients(step.step, args, microbatches)
    decisive = against(result, reference, "")
    informative: tuple[LeafGroupCheck, ...] = ()
    if microbatches > 1:
        informative = against(result, reference_gradients(step.step, args, 1), " (whole batch)")
    wide_checks: tuple[LeafGroupCheck, ...] = ()
    reference_error = None
    if not all(c.ok for c in decisive):
        from hlomap.run.runner import ParallelStep
        from hlomap.verify.numerics import to_float64

        phase(FLOAT64_PHASE)
        with jax.enable_x64(True):
            wide = tuple(to_float64(tuple(args)))
            wide_step = ParallelStep(step.step, step.plan, executor=step.executor, devices=step.order,
                                     example_args=wide, compiler_options=step.compiler_options, check_source=False)
            wide_reference = reference_gradients(step.step, wide, microbatches)
            wide_checks = against(wide_step.value_and_grad(*wide), wide_reference, " in float64")
            reference_error = compare_scaled("unsharded float32 gradients against float64", reference.grads,
                                             wide_reference.grads, paths)
    phase(TIMING_PHASE)
    return StepCheck(decisive, informative, _timed_step(step, args), wide_checks, reference_error)


def check_spmd(step: Any, args: Sequence[Any], on_phase: Callable[[str], None] | None = None,
               tolerances: Tolerances = FLOAT32) -> StepCheck:
    """An SPMD plan (`hlomap.parallelize` of a plan without pipeline) against the unsharded step:
    the marked loss and gradients computed from arguments placed with the plan's shardings (XLA
    partitions the computation from them), and the optimizer's output of the whole sharded step
    where the gradient is above rounding noise (`compare_updates`); in float64 too when float32
    differs; then one timed step. `on_phase` hears each phase as it starts."""
    import jax

    from hlomap.run.trace import InputKind, trace_step

    phase = on_phase or _silent
    from hlomap.verify.numerics import to_float64

    args = tuple(args)
    flat_shardings = jax.tree_util.tree_leaves(step.arg_shardings(args))
    traced = trace_step(step.step, jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), args))
    paths = [traced.loss_inputs[p].path for p in traced.grads]
    n_params = len(jax.tree_util.tree_leaves(args[0]))
    # gradient k -> flat parameter leaf, for the gradients of parameters (the update check)
    leaf_of = {k: traced.loss_inputs[p].leaf for k, p in enumerate(traced.grads)
               if traced.loss_inputs[p].kind is InputKind.PARAM and traced.loss_inputs[p].leaf < n_params}

    def against(sharded: GradientResult, ref: GradientResult, label: str) -> list[LeafGroupCheck]:
        return list(_marked_comparisons(sharded, ref, paths, label, tolerances))

    def updated(values: Sequence[Any]) -> list[Any]:
        """The state leaves after one step, sharded and unsharded (copies: the step donates)."""
        placed = step.place(values[0], values[1])
        out = step(*placed, *values[2:])
        reference = jax.jit(step.step)(*values)
        # host copies: the device buffers (the whole state, twice) are freed before the next phase
        return [[np.asarray(x) for x in jax.tree_util.tree_leaves(o[0])] for o in (out, reference)]

    phase("running the unsharded step")
    reference = reference_gradients(step.step, args)
    phase("compiling and running the plan's step")
    decisive = against(_marked_gradients(step.step, args, 1, flat_shardings), reference, "")
    phase("running the whole step sharded and unsharded (the optimizer's update)")
    (after, after_reference), before = updated(args), jax.tree_util.tree_leaves(args[0])
    decisive.append(compare_updates("updated parameters", [after[leaf] for leaf in leaf_of.values()],
                                    [after_reference[leaf] for leaf in leaf_of.values()],
                                    [before[leaf] for leaf in leaf_of.values()],
                                    [reference.grads[k] for k in leaf_of], [paths[k] for k in leaf_of],
                                    noise=tolerances.noise, floor=tolerances.floor, tolerance=tolerances.update))
    wide_checks: tuple[LeafGroupCheck, ...] = ()
    reference_error = None
    if not all(c.ok for c in decisive):
        phase(FLOAT64_PHASE)
        with jax.enable_x64(True):
            wide = tuple(to_float64(args))
            wide_reference = reference_gradients(step.step, wide)
            wide_checks = tuple(against(_marked_gradients(step.step, wide, 1, flat_shardings), wide_reference,
                                        " in float64"))
            reference_error = compare_scaled("unsharded float32 gradients against float64", reference.grads,
                                             wide_reference.grads, paths)
    phase(TIMING_PHASE)
    return StepCheck(tuple(decisive), (), _timed_step(step, args), wide_checks, reference_error)


def check_step(step: Any, args: Sequence[Any], on_phase: Callable[[str], None] | None = None,
               tolerances: Tolerances = FLOAT32) -> StepCheck:
    """`check_pipeline` or `check_spmd`, by the plan `step` runs."""
    check = check_pipeline if step.plan.pipeline is not None else check_spmd
    return check(step, args, on_phase, tolerances)


FLOAT64_PHASE = "running both steps again in float64 (float32 differs)"
TIMING_PHASE = "timing one step"


def _silent(phase: str) -> None:
    """The phase callback of a check nobody watches."""
