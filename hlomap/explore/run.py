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

__all__ = ["RTOL", "ATOL", "RunReport", "random_args", "run_plan"]

RTOL = 1e-4
ATOL = 1e-5


class RunReport(NamedTuple):
    """Largest differences between the sharded and the unsharded step's outputs."""

    max_abs_err: float
    max_rel_err: float
    ok: bool
    seconds: float  # wall time of one sharded step (after compilation)
    worst_leaf: str = ""


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
             atol: float = ATOL) -> RunReport:
    """Run the step of `target` under `plan` and compare with the unsharded step.

    `target`: a Capture with its JAX step (arguments are seeded random arrays), a ZooModel or a
    zoo name (arguments are its `example_args(seed)`). Raises ValueError when the plan was made
    for another module (a Capture's sha256 differs) or its mesh needs more devices than JAX sees.
    """
    import jax

    from hlomap.cost.reference import jax_mesh

    step, args, cap = _resolve(target, seed)
    if cap is not None:
        check = getattr(plan, "check_compatible", None)
        if check is not None:
            check(cap)
    mesh = jax_mesh(plan.mesh)
    shardings = plan.shardings(mesh, like=args)
    plain = jax.jit(step)(*args)
    plain = jax.tree.map(np.asarray, plain)
    sharded_fn = jax.jit(step, in_shardings=shardings)
    placed = jax.device_put(args, shardings)
    out = sharded_fn(*placed)
    jax.block_until_ready(out)
    start = time.perf_counter()
    out = sharded_fn(*placed)
    jax.block_until_ready(out)
    seconds = time.perf_counter() - start
    worst_abs, worst_rel, worst_leaf, ok = 0.0, 0.0, "", True
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(out), jax.tree_util.tree_leaves(plain)):
        a = np.asarray(a, dtype=np.float64)
        b = np.asarray(b, dtype=np.float64)
        if a.shape != b.shape:
            raise AssertionError(f"output {jax.tree_util.keystr(path)} has shape {a.shape} sharded, {b.shape} plain")
        both_nan = np.isnan(a) & np.isnan(b)
        diff = np.where(both_nan, 0.0, np.abs(a - b))  # NaN where both are NaN counts as equal
        if not diff.size:
            continue
        rel = diff / np.maximum(np.abs(b), np.finfo(np.float32).tiny)
        leaf_ok = bool(np.all(diff <= atol + rtol * np.abs(np.nan_to_num(b))))
        if not leaf_ok and not np.isfinite(diff).all():
            worst_abs, worst_leaf = float("inf"), jax.tree_util.keystr(path)
        elif float(diff.max()) > worst_abs:
            worst_abs, worst_leaf = float(diff.max()), jax.tree_util.keystr(path)
        worst_rel = max(worst_rel, float(np.where(diff > atol, rel, 0.0).max()))
        ok &= leaf_ok
    return RunReport(worst_abs, worst_rel, ok, seconds, worst_leaf)
