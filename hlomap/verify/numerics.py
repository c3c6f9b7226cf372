"""Run a step under a plan on the local devices and check it computes what the unsharded step
computes (`hlomap run PLAN.json --source zoo:NAME`).

The step is compiled twice with `jax.jit`: once plain (one device), once with `in_shardings` from
the plan's NamedShardings on a mesh of the first prod(mesh) local devices. Both run on the same
real arguments (a zoo model's `example_args(seed)`, or seeded random arrays shaped like a
capture's abstract arguments) and every output leaf is compared with `assert_allclose`'s rule
`|sharded - plain| <= atol + rtol * |plain|`.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

if TYPE_CHECKING:
    from hlomap.hlo.capture import Capture
    from hlomap.plan import Plan
    from hlomap.zoo.model import ZooModel

log = logging.getLogger(__name__)

__all__ = ["RTOL", "ATOL", "RunReport", "compare_outputs", "random_args", "run_plan"]

RTOL = 1e-4
ATOL = 1e-5


class RunReport(NamedTuple):
    """Largest differences between the sharded and the unsharded step's outputs.

    The `float64_*` fields are filled by `run_plan(..., float64=True)`: the same comparison with
    both steps run in float64, and how far the unsharded float32 step itself is from its float64
    run. When the float32 comparison fails but the float64 one passes and the unsharded float32
    step is itself about as far from float64, the difference is float32 rounding amplified by an
    ill-conditioned step (Adam's first update g / (|g| + eps) at gradients near eps, batch-norm
    statistics), not a wrong partitioning: a wrong one stays wrong in float64.
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


class _Diff(NamedTuple):
    max_abs_err: float
    max_rel_err: float
    ok: bool
    worst_leaf: str
    failing_leaves: tuple[str, ...]


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


def _resolve(target: Any, seed: int) -> tuple[Any, tuple[Any, ...], Capture | None]:
    """(step, real args, capture if given) from a ZooModel, a zoo name or a Capture."""
    from hlomap.hlo.capture import Capture

    if isinstance(target, str):
        from hlomap import zoo

        target = zoo.get(target.removeprefix("zoo:"))
    if isinstance(target, Capture):
        import jax

        from hlomap.hlo.capture import Role

        if target.step is None or target.args is None:
            raise ValueError(f"capture {target.source!r} is a bare HLO module; running a plan needs the JAX step")
        flags = [p.role is Role.OPTIMIZER_STATE for p in target.parameters]
        treedef = jax.tree_util.tree_structure(target.args)
        positive = jax.tree_util.tree_unflatten(treedef, flags)
        return target.step, tuple(random_args(target.args, seed, positive)), target
    if hasattr(target, "train_step") and hasattr(target, "example_args"):
        return target.train_step(), tuple(target.example_args(seed)), None
    raise TypeError(f"run_plan needs a Capture, a ZooModel or a zoo name, not {type(target).__name__}")


def run_plan(plan: Plan, target: Capture | ZooModel | str, seed: int = 0, *, rtol: float = RTOL,
             atol: float = ATOL, float64: bool = False) -> RunReport:
    """Run the step of `target` under `plan` and compare with the unsharded step.

    `target`: a Capture with its JAX step (arguments are seeded random arrays), a ZooModel or a
    zoo name (arguments are its `example_args(seed)`). Raises ValueError when the plan was made
    for another module (a Capture's sha256 differs) or its mesh needs more devices than JAX sees.
    `float64=True` also runs both steps in float64 (see `RunReport`).
    """
    import jax

    from hlomap.verify.xla import jax_mesh

    step, args, cap = _resolve(target, seed)
    if cap is not None:
        check = getattr(plan, "check_compatible", None)
        if check is not None:
            check(cap)
    mesh = jax_mesh(plan.mesh)
    shardings = plan.shardings(mesh, like=args)
    plain, out, seconds = _run_both(step, args, shardings)
    diff = compare_outputs(out, plain, rtol=rtol, atol=atol)
    report = RunReport(diff.max_abs_err, diff.max_rel_err, diff.ok, seconds, diff.worst_leaf, diff.failing_leaves)
    if not float64:
        return report
    from hlomap.verify.shardings import to_float64

    with jax.enable_x64(True):  # scoped: the process's default dtypes are left alone
        wide = to_float64(args)
        plain64, out64, _ = _run_both(step, wide, shardings)
    diff64 = compare_outputs(out64, plain64, rtol=rtol, atol=atol)
    reference = compare_outputs(plain, plain64, rtol=rtol, atol=atol)
    return report._replace(float64_ok=diff64.ok, float64_max_abs_err=diff64.max_abs_err,
                           reference_float32_err=reference.max_abs_err)


def _run_both(step: Any, args: tuple[Any, ...], shardings: Any) -> tuple[Any, Any, float]:
    """(unsharded outputs, sharded outputs, seconds of one sharded step after compiling), as
    host arrays."""
    import jax

    plain = jax.tree.map(np.asarray, jax.jit(step)(*args))
    sharded_fn = jax.jit(step, in_shardings=shardings)
    placed = jax.device_put(args, shardings)
    jax.block_until_ready(sharded_fn(*placed))
    start = time.perf_counter()
    out = sharded_fn(*placed)
    jax.block_until_ready(out)
    seconds = time.perf_counter() - start
    return plain, jax.tree.map(np.asarray, out), seconds


def compare_outputs(out: Any, plain: Any, *, rtol: float = RTOL, atol: float = ATOL) -> _Diff:
    """`assert_allclose`'s rule `|out - plain| <= atol + rtol * |plain|` on every leaf; NaN where
    both are NaN counts as equal."""
    import jax

    worst_abs, worst_rel, worst_leaf, failing = 0.0, 0.0, "", []
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(out), jax.tree_util.tree_leaves(plain)):
        a = np.asarray(a, dtype=np.float64)
        b = np.asarray(b, dtype=np.float64)
        if a.shape != b.shape:
            raise AssertionError(f"output {jax.tree_util.keystr(path)} has shape {a.shape} sharded, {b.shape} plain")
        both_nan = np.isnan(a) & np.isnan(b)
        diff = np.where(both_nan, 0.0, np.abs(a - b))
        if not diff.size:
            continue
        rel = diff / np.maximum(np.abs(b), np.finfo(np.float32).tiny)
        leaf_ok = bool(np.all(diff <= atol + rtol * np.abs(np.nan_to_num(b))))
        if not leaf_ok and not np.isfinite(diff).all():
            worst_abs, worst_leaf = float("inf"), jax.tree_util.keystr(path)
        elif float(diff.max()) > worst_abs:
            worst_abs, worst_leaf = float(diff.max()), jax.tree_util.keystr(path)
        worst_rel = max(worst_rel, float(np.where(diff > atol, rel, 0.0).max()))
        if not leaf_ok:
            failing.append(jax.tree_util.keystr(path))
    return _Diff(worst_abs, worst_rel, not failing, worst_leaf, tuple(failing))
