"""Numerics: does a step under a plan compute what the unsharded step computes?

`run_plan` (behind `hlomap run PLAN.json --source zoo:NAME`) runs the step plain (one device,
`jax.jit(step)`) and compiled under the plan (`verify.compile.compile_plan`) on the same real
arguments, and compares every output leaf with `compare_outputs`. The sharding oracle
(`verify.shardings.check_plan_shardings`) compares its compiled step's outputs with the same
function.

The comparison is `assert_allclose`'s rule `|got - want| <= atol + rtol * |want|` per element, with
one NaN rule: NaN where both sides are NaN is equal, a NaN or infinity on one side only is a
mismatch. The tolerance may differ per leaf (a callable of the leaf's path and reference values),
so that a leaf can be judged relative to its own scale: partitioning reorders floating-point sums,
whose rounding is relative to the magnitude of the summands, not of the result.

Float32 rounding can be amplified past any fixed tolerance by an ill-conditioned step (Adam's
first update lr * g / (|g| + eps) at gradients near eps; batch-norm statistics). Two ways this is
told apart from a partitioning error, which spoils whole blocks of a tensor and stays wrong in
float64: the elements outside tolerance are isolated (`OutputComparison.isolated_only`), and the
same comparison in float64 passes (`run_plan(float64=True)`, `reference_outputs(float64=True)`).
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import TYPE_CHECKING, Any, Callable, NamedTuple, Protocol, Sequence, Union

import numpy as np

from hlomap.verify.compile import compile_plan
from hlomap.verify.mesh import plan_mesh

if TYPE_CHECKING:
    from hlomap.hlo.capture import Capture
    from hlomap.plan import Plan

log = logging.getLogger(__name__)

__all__ = ["ATOL", "RTOL", "LeafMismatch", "OutputComparison", "RunReport", "Tolerance", "compare_outputs",
           "random_args", "reference_outputs", "run_plan", "to_float64", "unsharded_outputs"]

RTOL = 1e-4
ATOL = 1e-5

#: At most this fraction of a leaf's elements outside tolerance, each off by less than
#: `ISOLATED_ERROR`, reads as amplified rounding rather than a partitioning error.
ISOLATED_FRACTION = 1e-4
ISOLATED_ERROR = 1e-4


# ---------------------------------------------------------------------------------------------
# Comparing outputs
# ---------------------------------------------------------------------------------------------


class Tolerance(NamedTuple):
    """`|got - want| <= atol + rtol * |want|`, elementwise."""

    rtol: float = RTOL
    atol: float = ATOL


#: One tolerance for every leaf, or one per leaf from its keystr path and reference values.
ToleranceRule = Union[Tolerance, Callable[[str, np.ndarray], Tolerance]]


class LeafMismatch(NamedTuple):
    """An output leaf with elements outside its tolerance."""

    index: int  # position among the output leaves
    path: str  # jax.tree_util.keystr of the leaf
    mismatched: int  # elements outside tolerance
    size: int
    max_abs_error: float

    def __str__(self) -> str:
        return (f"leaf {self.index} {self.path}: {self.mismatched} of {self.size} elements, "
                f"max abs error {self.max_abs_error:.3g}")


class OutputComparison(NamedTuple):
    """Every output leaf of one step compared with a reference's."""

    leaves: int
    max_abs_error: float  # over every element of every leaf (inf: a NaN or inf on one side only)
    max_rel_error: float  # |got - want| / |want|, over elements off by more than their leaf's atol
    worst_leaf: str  # path of the leaf with the largest abs error ("" when everything is equal)
    failing: tuple[LeafMismatch, ...]  # leaves beyond their tolerance, in leaf order

    @property
    def ok(self) -> bool:
        return not self.failing

    @property
    def failing_leaves(self) -> tuple[str, ...]:
        return tuple(m.path for m in self.failing)

    @property
    def mismatched_elements(self) -> int:
        return sum(m.mismatched for m in self.failing)

    @property
    def worst_fraction(self) -> float:
        """The largest fraction of one leaf's elements outside tolerance."""
        return max((m.mismatched / m.size for m in self.failing), default=0.0)

    @property
    def isolated_only(self) -> bool:
        """Every element outside tolerance is isolated (a single element of its leaf, or at most
        `ISOLATED_FRACTION` of it) and off by less than `ISOLATED_ERROR`: the signature of Adam's
        first step dividing an eps-sized gradient by its own magnitude, which turns rounding into
        O(lr) differences in single elements. A partitioning error spoils whole blocks of a tensor
        instead."""
        isolated = all(m.mismatched <= max(1.0, ISOLATED_FRACTION * m.size) for m in self.failing)
        return isolated and self.max_abs_error < ISOLATED_ERROR


def compare_outputs(got: Any, want: Any, tolerance: ToleranceRule = Tolerance()) -> OutputComparison:
    """Compare pytree `got` with the reference pytree `want`, leaf by leaf in float64.

    `tolerance`: a `Tolerance` for every leaf, or a callable `(path, want_leaf) -> Tolerance`.
    Raises ValueError when the two trees have different numbers of leaves or a leaf's shapes
    differ (that is not a numerical difference but a different program)."""
    import jax

    got_leaves = jax.tree_util.tree_leaves_with_path(got)
    want_leaves = jax.tree_util.tree_leaves(want)
    if len(got_leaves) != len(want_leaves):
        raise ValueError(f"the step returned {len(got_leaves)} output leaves, the reference {len(want_leaves)}")
    worst_abs, worst_rel, worst_leaf, failing = 0.0, 0.0, "", []
    for i, ((key, a), b) in enumerate(zip(got_leaves, want_leaves)):
        path = jax.tree_util.keystr(key)
        a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
        if a.shape != b.shape:
            raise ValueError(f"output leaf {i} {path} has shape {a.shape}, the reference's {b.shape}")
        if not a.size:
            continue
        tol = tolerance if isinstance(tolerance, Tolerance) else tolerance(path, b)
        err = _elementwise_error(a, b)
        outside = err > tol.atol + tol.rtol * np.abs(np.where(np.isfinite(b), b, 0.0))
        leaf_abs = float(err.max())
        if leaf_abs > worst_abs:
            worst_abs, worst_leaf = leaf_abs, path
        beyond_atol = err > tol.atol
        if beyond_atol.any():
            with np.errstate(invalid="ignore"):  # inf / inf where the reference is infinite
                rel = err[beyond_atol] / np.maximum(np.abs(b[beyond_atol]), np.finfo(np.float32).tiny)
            worst_rel = max(worst_rel, float(np.nan_to_num(rel, nan=np.inf).max()))
        if outside.any():
            failing.append(LeafMismatch(i, path, int(outside.sum()), int(a.size), leaf_abs))
    return OutputComparison(len(got_leaves), worst_abs, worst_rel, worst_leaf, tuple(failing))


def _elementwise_error(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """|a - b|, 0 where the elements are equal or both NaN (equal infinities included), inf where
    only one side is NaN."""
    with np.errstate(invalid="ignore", over="ignore"):
        same = (a == b) | (np.isnan(a) & np.isnan(b))
        err = np.where(same, 0.0, np.abs(a - b))
    return np.nan_to_num(err, nan=np.inf, posinf=np.inf)


# ---------------------------------------------------------------------------------------------
# Reference runs
# ---------------------------------------------------------------------------------------------


def to_float64(tree: Any) -> Any:
    """Floating-point leaves of `tree` as float64 numpy arrays (others unchanged)."""
    import jax

    def cast(leaf: Any) -> Any:
        arr = np.asarray(leaf)
        return arr.astype(np.float64) if np.issubdtype(arr.dtype, np.floating) else arr

    return jax.tree_util.tree_map(cast, tree)


def unsharded_outputs(step: Callable[..., Any], args: Sequence[Any]) -> Any:
    """`jax.jit(step)(*args)` on one device, as host numpy arrays."""
    import jax

    return jax.tree.map(np.asarray, jax.jit(step)(*args))


def reference_outputs(step: Callable[..., Any], example_args: Sequence[Any], *,
                      float64: bool = False) -> tuple[tuple[Any, ...], Any]:
    """(arguments, outputs) of the unsharded step; with `float64`, the arguments widened by
    `to_float64` and the step run under `jax.enable_x64`, whose rounding lies far below the
    tolerance, so that a remaining mismatch means a partitioning error."""
    import jax

    args = to_float64(tuple(example_args)) if float64 else tuple(example_args)
    with jax.enable_x64(True) if float64 else contextlib.nullcontext():
        return args, unsharded_outputs(step, args)


def random_args(abstract: Any, seed: int, nonnegative: Any = None) -> Any:
    """Real arrays shaped like `abstract` (ShapeDtypeStructs): small normal floats, integers in
    [0, 2) (valid indices for any table), zeros for everything else. Leaves where the pytree
    `nonnegative` (same structure, bools) is True get absolute values (optimizer second moments
    must not be negative)."""
    import jax
    import jax.numpy as jnp

    rng = np.random.default_rng(seed)

    def make(leaf: Any, positive: bool) -> Any:
        dtype = np.dtype(leaf.dtype)
        if np.issubdtype(dtype, np.floating):
            x = 0.02 * rng.standard_normal(leaf.shape)
            return jnp.asarray((np.abs(x) if positive else x).astype(dtype))
        if np.issubdtype(dtype, np.integer):
            return jnp.asarray(rng.integers(0, 2, size=leaf.shape).astype(dtype))
        return jnp.zeros(leaf.shape, dtype)

    if nonnegative is None:
        nonnegative = jax.tree.map(lambda _: False, abstract)
    return jax.tree.map(make, abstract, nonnegative)


# ---------------------------------------------------------------------------------------------
# Running a plan
# ---------------------------------------------------------------------------------------------


class RunnableModel(Protocol):
    """A benchmark step with real example arguments (as `hlomap.zoo.ZooModel`)."""

    def train_step(self) -> Callable[..., Any]: ...

    def example_args(self, seed: int = 0) -> Any: ...


class RunReport(NamedTuple):
    """Largest differences between the sharded and the unsharded step's outputs.

    The `float64_*` fields are filled by `run_plan(..., float64=True)`: the same comparison with
    both steps run in float64, and how far the unsharded float32 step itself is from its float64
    run. When the float32 comparison fails but the float64 one passes and the unsharded float32
    step is itself about as far from float64, the difference is float32 rounding amplified by an
    ill-conditioned step (see the module docstring), not a wrong partitioning: a wrong one stays
    wrong in float64.
    """

    max_abs_err: float
    max_rel_err: float
    ok: bool
    seconds: float  # wall time of one sharded step (after compilation)
    worst_leaf: str = ""
    failing_leaves: tuple[str, ...] = ()  # output leaves beyond the tolerance (keystr paths)
    float64_ok: bool | None = None  # sharded vs unsharded, both in float64, same rtol / atol
    float64_max_abs_err: float | None = None
    reference_float32_err: float | None = None  # max |unsharded float32 - unsharded float64|


def _resolve(target: Capture | RunnableModel, seed: int) -> tuple[Callable[..., Any], tuple[Any, ...], Capture | None]:
    """(step, real args, capture if given) from a Capture or a model with example arguments."""
    from hlomap.hlo.capture import Capture, Role

    if isinstance(target, Capture):
        import jax

        if target.step is None or target.args is None:
            raise ValueError(f"capture {target.source!r} is a bare HLO module; running a plan needs the JAX step")
        flags = [p.role is Role.OPTIMIZER_STATE for p in target.parameters]
        treedef = jax.tree_util.tree_structure(target.args)
        positive = jax.tree_util.tree_unflatten(treedef, flags)
        return target.step, tuple(random_args(target.args, seed, positive)), target
    if hasattr(target, "train_step") and hasattr(target, "example_args"):
        return target.train_step(), tuple(target.example_args(seed)), None
    raise TypeError(f"run_plan needs a Capture or a model with train_step() and example_args(seed) "
                    f"(a zoo.ZooModel), not {type(target).__name__}")


def run_plan(plan: Plan, target: Capture | RunnableModel, seed: int = 0, *, rtol: float = RTOL,
             atol: float = ATOL, float64: bool = False) -> RunReport:
    """Run the step of `target` under `plan` and compare with the unsharded step.

    `target`: a Capture with its JAX step (arguments are seeded random arrays) or a model such as
    `zoo.get(name)` (arguments are its `example_args(seed)`). Raises ValueError when the plan was
    made for another module (a Capture's sha256 differs) or its mesh needs more devices than JAX
    sees. `float64=True` also runs both steps in float64 (see `RunReport`).
    """
    import jax

    step, args, cap = _resolve(target, seed)
    if cap is not None:
        check = getattr(plan, "check_compatible", None)
        if check is not None:
            check(cap)
    tolerance = Tolerance(rtol, atol)
    mesh = plan_mesh(plan)
    plain = unsharded_outputs(step, args)
    out, seconds = _run_sharded(step, args, plan, mesh)
    diff = compare_outputs(out, plain, tolerance)
    report = RunReport(diff.max_abs_error, diff.max_rel_error, diff.ok, seconds, diff.worst_leaf,
                       diff.failing_leaves)
    if not float64:
        return report
    wide, plain64 = reference_outputs(step, args, float64=True)
    with jax.enable_x64(True):  # scoped: the process's default dtypes are left alone
        out64, _ = _run_sharded(step, wide, plan, mesh)
    diff64 = compare_outputs(out64, plain64, tolerance)
    reference = compare_outputs(plain, plain64, tolerance)
    return report._replace(float64_ok=diff64.ok, float64_max_abs_err=diff64.max_abs_error,
                           reference_float32_err=reference.max_abs_error)


def _run_sharded(step: Callable[..., Any], args: tuple[Any, ...], plan: Plan, mesh: Any) -> tuple[Any, float]:
    """(outputs as host arrays, seconds of one step after compiling) of the step under `plan`."""
    import jax

    compiled = compile_plan(step, args, plan, mesh=mesh)
    placed = compiled.place(args)
    jax.block_until_ready(compiled.compiled(*placed))  # first run: allocations, thread pools
    start = time.perf_counter()
    out = compiled.compiled(*placed)
    jax.block_until_ready(out)
    seconds = time.perf_counter() - start
    return jax.tree.map(np.asarray, out), seconds
