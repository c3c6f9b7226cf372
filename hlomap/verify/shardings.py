"""XLA as the oracle: compile a step with a plan's in_shardings, read the shardings XLA's own
propagation (shardy) chose, and compare them with the ones the factor graph derives.

    report, numerics = check_plan(cap, plan, mesh, workdir, example_args=args, reference=outputs)
    report.agreement(Category.INTERMEDIATE), report.disagreements, numerics.ok

How the comparison is aligned: XLA's `before_spmd-partitioning` module is the same program after a
few cleanup passes (call inlining, simplification), so instruction names and counts differ from
the captured module. We therefore build a factor graph of XLA's module itself, give it the plan's
entry-parameter specs (parameters keep their numbers), derive every tensor's sharding from the
groups, and compare instruction by instruction with the `sharding=` attributes there. Shardings
are compared semantically: each is reduced to the tile coordinates of every device, per dim.
"""

from __future__ import annotations

import enum
import glob
import logging
import os
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from hlomap.hlo.ir import Module
from hlomap.propagation.conflicts import MeshAxes
from hlomap.propagation.graph import FactorGraph

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------
# HLO sharding text -> per-device tile coordinates
# ---------------------------------------------------------------------------------------------


class ShardingParseError(ValueError):
    pass


def split_tuple_sharding(text: str) -> list[str]:
    """`{{a}, {b}}` -> ["{a}", "{b}"]; a non-tuple sharding -> [text]."""
    text = text.strip()
    if not text.startswith("{{"):
        return [text]
    inner = text[1:-1]
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(inner):
        if ch == "{":
            if depth == 0:
                start = i
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                parts.append(inner[start: i + 1])
    return parts


_DEVICES_RE = re.compile(r"devices=\[([\d,]+)\](?:<=\[([\d,]+)\](?:T\(([\d,]+)\))?|([\d,]+))")
_LAST_DIMS_RE = re.compile(r"last_tile_dims=\{([^}]*)\}")


def tile_coordinates(text: str, rank: int, num_devices: int) -> np.ndarray | None:
    """`[num_devices, rank]` tile index of every device along every dim, for one array sharding.

    Replicated -> all zeros. Returns None for shardings that are not a tiling (maximal, manual).
    """
    text = text.strip()
    if "replicated" in text and "devices=" not in text:
        return np.zeros((num_devices, rank), dtype=np.int64)
    if "maximal" in text or text.strip("{} ") == "manual":
        return None
    m = _DEVICES_RE.search(text)
    if m is None:
        raise ShardingParseError(f"cannot parse sharding {text!r}")
    tile = [int(x) for x in m.group(1).split(",")]
    if m.group(4) is not None:
        ids = np.asarray([int(x) for x in m.group(4).split(",")], dtype=np.int64)
    else:
        reshape = [int(x) for x in m.group(2).split(",")]
        ids = np.arange(int(np.prod(reshape))).reshape(reshape)
        if m.group(3):
            ids = ids.transpose([int(x) for x in m.group(3).split(",")])
        ids = ids.ravel()
    ids = ids.reshape(tile)
    extra = 0
    if "last_tile_dim_replicate" in text:
        extra = 1
    else:
        lm = _LAST_DIMS_RE.search(text)
        if lm:
            extra = len([x for x in lm.group(1).split(",") if x.strip()])
    data_rank = len(tile) - extra
    if data_rank != rank:
        raise ShardingParseError(f"sharding {text!r} tiles {data_rank} dims but the array has rank {rank}")
    coords = np.zeros((num_devices, rank), dtype=np.int64)
    for index in np.ndindex(*tile):
        d = int(ids[index])
        if d < num_devices:
            coords[d] = index[:rank]
    return coords


def spec_coordinates(spec: Sequence[tuple[str, ...] | None], mesh_names: Sequence[str],
                     mesh_devices: np.ndarray) -> np.ndarray:
    """The tile coordinates a PartitionSpec-like spec gives on a mesh (`mesh_devices`: device
    ids laid out in the mesh's shape, as `jax.sharding.Mesh.device_ids`)."""
    num_devices = mesh_devices.size
    coords = np.zeros((num_devices, len(spec)), dtype=np.int64)
    shape = dict(zip(mesh_names, mesh_devices.shape))
    for pos in np.ndindex(*mesh_devices.shape):
        where = dict(zip(mesh_names, pos))
        d = int(mesh_devices[pos])
        for k, axes in enumerate(spec):
            index = 0
            for a in axes or ():
                index = index * shape[a] + where[a]
            coords[d, k] = index
    return coords


# ---------------------------------------------------------------------------------------------
# Comparison
# ---------------------------------------------------------------------------------------------


class Category(enum.Enum):
    PARAMETER = "parameter"
    OUTPUT = "output"
    INTERMEDIATE = "intermediate"
    #: outputs as derived on the *captured* module's graph (not XLA's), against XLA's root
    CAPTURED_OUTPUT = "output (captured module)"


class Verdict(enum.Enum):
    MATCH = "match"
    XLA_SHARDS_MORE = "xla shards a dim we replicate"
    WE_SHARD_MORE = "we shard a dim xla replicates"
    DIFFERENT_AXIS = "both shard, on different axes"
    NOT_TILED = "xla sharding is not a tiling (maximal/manual)"


@dataclass(frozen=True)
class Comparison:
    category: Category
    instruction: str
    computation: str
    leaf: int
    opcode: str
    shape: tuple[int, ...]
    ours: tuple[tuple[str, ...] | None, ...]
    xla: str
    verdict: Verdict
    free: bool  # constant-derived (free to materialize in any sharding)
    op_name: str | None = None


@dataclass
class OracleReport:
    """All per-tensor comparisons of one compiled plan."""

    comparisons: list[Comparison] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def of(self, category: Category, *, include_free: bool = True) -> list[Comparison]:
        return [c for c in self.comparisons if c.category is category and (include_free or not c.free)]

    def agreement(self, category: Category, *, include_free: bool = True) -> float:
        items = self.of(category, include_free=include_free)
        return sum(c.verdict is Verdict.MATCH for c in items) / len(items) if items else 1.0

    @property
    def disagreements(self) -> list[Comparison]:
        return [c for c in self.comparisons if c.verdict is not Verdict.MATCH]

    def kinds(self) -> Counter[tuple[str, str, str]]:
        """Disagreements counted by (category, verdict, opcode)."""
        return Counter((c.category.value, c.verdict.value, c.opcode) for c in self.disagreements)

    def summary(self) -> str:
        parts = []
        for cat in Category:
            items = self.of(cat)
            if items:
                parts.append(f"{cat.value}: {self.agreement(cat):.1%} of {len(items)}")
        strict = self.of(Category.INTERMEDIATE, include_free=False)
        if strict:
            parts.append(f"intermediate (not constant-derived): "
                         f"{self.agreement(Category.INTERMEDIATE, include_free=False):.1%} of {len(strict)}")
        return "; ".join(parts)


def _verdict(ours: np.ndarray, xla: np.ndarray | None) -> Verdict:
    if xla is None:
        return Verdict.NOT_TILED
    if np.array_equal(ours, xla):
        return Verdict.MATCH
    ours_split = ours.max(axis=0) > 0 if len(ours) else np.zeros(0, bool)
    xla_split = xla.max(axis=0) > 0 if len(xla) else np.zeros(0, bool)
    if (xla_split & ~ours_split).any() and not (ours_split & ~xla_split).any():
        return Verdict.XLA_SHARDS_MORE
    if (ours_split & ~xla_split).any() and not (xla_split & ~ours_split).any():
        return Verdict.WE_SHARD_MORE
    return Verdict.DIFFERENT_AXIS


def compare_module(xla_module: Module, parameter_specs: Sequence[Sequence[tuple[str, ...] | None]],
                   mesh_names: Sequence[str], mesh_devices: np.ndarray,
                   graph: FactorGraph | None = None) -> OracleReport:
    """Compare XLA's shardings in `xla_module` (the before_spmd-partitioning module) with the ones
    derived from the factor graph of that module when entry parameter i has
    `parameter_specs[i]` (per dim: None or mesh axes)."""
    graph = graph if graph is not None else FactorGraph.build(xla_module)
    report = OracleReport()
    axes = MeshAxes.from_mesh(dict(zip(mesh_names, mesh_devices.shape)),
                              extra=[s for spec in parameter_specs for s in spec if s is not None and len(s) > 1])
    plan = np.full(graph.num_groups, -1, dtype=np.int64)
    for i, spec in enumerate(parameter_specs):
        if i >= len(graph.entry_parameter_tensors):
            break
        groups = graph.group_of_dim[graph.parameter_dims(i)]
        for g, s in zip(groups, spec):
            if s is None:
                continue
            o = axes.index(s)
            if plan[g] >= 0 and plan[g] != o:
                report.notes.append(f"parameter {i} dim spec {s} disagrees with another parameter in group {g} "
                                    f"of XLA's module; kept {axes.options[plan[g]]}")
                continue
            plan[g] = o
    num_devices = mesh_devices.size
    entry = xla_module.entry_name
    root = xla_module.entry.root.name
    cache: dict[tuple[Any, ...], np.ndarray] = {}
    free = _free_tensors(graph)
    for node_id, node in enumerate(graph.nodes):
        inst = node.instruction
        text = inst.sharding
        if inst.opcode in ("constant",) and text is None:
            continue
        if node.computation != entry and text is None:
            continue  # scalar combiners and the like carry no sharding
        leaf_texts = split_tuple_sharding(text) if text is not None else None
        for k, t in enumerate(graph.result_tensors(node_id)):
            rank = int(graph.tensor_rank[t])
            if rank == 0:
                continue
            dims = graph.tensor_dims(t)
            spec = tuple(None if plan[g] < 0 else axes.options[plan[g]] for g in graph.sharding_group_of_dim[dims])
            key = spec
            ours = cache.get(key)
            if ours is None:
                ours = cache[key] = spec_coordinates(spec, mesh_names, mesh_devices)
            if leaf_texts is None:
                xla_text = "{replicated}"
            elif k < len(leaf_texts):
                xla_text = leaf_texts[k]
            else:
                xla_text = leaf_texts[-1]
            try:
                xla = tile_coordinates(xla_text, rank, num_devices)
            except ShardingParseError as exc:
                report.notes.append(f"{inst.name}: {exc}")
                continue
            if node.computation == entry and inst.opcode == "parameter":
                category = Category.PARAMETER
            elif node.computation == entry and inst.name == root:
                category = Category.OUTPUT
            else:
                category = Category.INTERMEDIATE
            md = inst.metadata
            report.comparisons.append(Comparison(
                category, inst.name, node.computation, k, inst.opcode, tuple(int(x) for x in graph.dim_size[dims]),
                spec, xla_text, _verdict(ours, xla), bool(free[t]), md.op_name if md else None))
    return report


def _free_tensors(graph: FactorGraph) -> np.ndarray:
    return np.asarray(graph.tensor_free, dtype=bool)


# ---------------------------------------------------------------------------------------------
# Compiling with JAX
# ---------------------------------------------------------------------------------------------


def compile_with_dump(step: Any, args: Sequence[Any], in_shardings: Any, workdir: str) -> tuple[Module, Any]:
    """Compile `step` with `in_shardings`; return XLA's module just before SPMD partitioning (with
    the shardings its propagation chose) and the compiled executable (callable on real args)."""
    import jax

    from hlomap.hlo.parser import parse

    os.makedirs(workdir, exist_ok=True)
    jitted = jax.jit(step, in_shardings=in_shardings, keep_unused=True)
    compiled = jitted.lower(*args).compile(
        compiler_options={"xla_dump_to": workdir, "xla_dump_hlo_pass_re": "shardy-xla"})
    found = sorted(glob.glob(os.path.join(workdir, "*before_spmd-partitioning*")))
    if not found:
        raise FileNotFoundError(f"XLA wrote no *before_spmd-partitioning* dump under {workdir}; "
                                f"files: {sorted(os.listdir(workdir))[:10]}")
    with open(found[-1]) as f:
        return parse(f.read(), filename=found[-1]), compiled


@dataclass(frozen=True)
class NumericCheck:
    """Sharded step vs unsharded step on the same real inputs, leaf by leaf, with
    `numpy.allclose(rtol=1e-4, atol=1e-5)` semantics."""

    leaves: int
    mismatched: tuple[str, ...]  # "leaf i (path): n of m elements, max abs error e" per failing leaf
    max_abs_error: float
    worst_fraction: float  # the largest fraction of a leaf's elements outside tolerance

    @property
    def ok(self) -> bool:
        return not self.mismatched

    @property
    def isolated_only(self) -> bool:
        """Every element outside tolerance is isolated (at most 1 in 10,000 of its leaf) and off by
        less than 1e-4: the signature of Adam's first step dividing an eps-sized gradient by its
        own magnitude, which turns rounding into O(lr) differences in single elements. A
        partitioning error spoils whole blocks of a tensor instead."""
        return self.worst_fraction <= 1e-4 and self.max_abs_error < 1e-4


def compare_outputs(sharded: Any, reference: Any, rtol: float = 1e-4, atol: float = 1e-5) -> NumericCheck:
    import jax

    got = jax.tree_util.tree_leaves_with_path(sharded)
    want = jax.tree_util.tree_leaves(reference)
    if len(got) != len(want):
        raise ValueError(f"sharded step returned {len(got)} leaves, the reference {len(want)}")
    bad, worst, fraction = [], 0.0, 0.0
    for i, ((path, a), b) in enumerate(zip(got, want)):
        a, b = np.asarray(a).astype(np.float64), np.asarray(b).astype(np.float64)
        err = np.abs(a - b)
        worst = max(worst, float(err.max())) if a.size else worst
        outside = ~np.isclose(a, b, rtol=rtol, atol=atol)
        if outside.any():
            fraction = max(fraction, float(outside.mean()))
            bad.append(f"leaf {i} {jax.tree_util.keystr(path)}: {int(outside.sum())} of {a.size} elements, "
                       f"max abs error {float(err.max()):.3g}")
    return NumericCheck(len(got), tuple(bad), worst, fraction)


def to_float64(tree: Any) -> Any:
    """Floating-point leaves of `tree` as float64 numpy arrays (others unchanged)."""
    import jax

    def cast(leaf: Any) -> Any:
        arr = np.asarray(leaf)
        return arr.astype(np.float64) if np.issubdtype(arr.dtype, np.floating) else arr

    return jax.tree_util.tree_map(cast, tree)


def compare_captured_outputs(report: OracleReport, xla_module: Module, graph: FactorGraph, plan_array: np.ndarray,
                             axes: MeshAxes, mesh_names: Sequence[str], mesh_devices: np.ndarray) -> None:
    """Add the captured module's derived output shardings, compared with XLA's root sharding."""
    from hlomap.propagation.plans import tensor_options

    root = xla_module.entry.root
    texts = split_tuple_sharding(root.sharding) if root.sharding else None
    options = tensor_options(graph, plan_array)
    for k, t in enumerate(graph.output_tensors):
        rank = int(graph.tensor_rank[t])
        if rank == 0:
            continue
        dims = graph.tensor_dims(t)
        spec = tuple(None if o < 0 else axes.options[int(o)] for o in options[dims])
        text = "{replicated}" if texts is None else texts[min(k, len(texts) - 1)]
        ours = spec_coordinates(spec, mesh_names, mesh_devices)
        xla = tile_coordinates(text, rank, mesh_devices.size)
        report.comparisons.append(Comparison(
            Category.CAPTURED_OUTPUT, graph.tensor_name(t), graph.module.entry_name, k, "output",
            tuple(int(x) for x in graph.dim_size[dims]), spec, text, _verdict(ours, xla), bool(graph.tensor_free[t])))


def check_plan(cap: Any, plan: Any, mesh: Any, workdir: str, *, example_args: Sequence[Any] | None = None,
               reference: Any = None, float64: bool = False,
               graph: FactorGraph | None = None) -> tuple[OracleReport, NumericCheck | None]:
    """Compile the captured step with the plan's shardings on `mesh` once: compare XLA's
    propagated shardings with ours (see the module docstring) and, when `example_args` and the
    unsharded step's outputs (`reference`) are given, run it and compare the results. With the
    captured module's `graph`, its derived output shardings are compared with XLA's too.

    With `float64=True` (and float64 `example_args` / `reference`, see `reference_outputs`) the
    step is compiled and run in double precision: partitioning changes the order of floating
    point sums, and Adam's first step divides a gradient by its own magnitude, which turns the
    rounding of a near-zero gradient in float32 into errors above 1e-5. In float64 that rounding
    is far below the tolerance, so a mismatch means a partitioning error. Shardings do not depend
    on the element type.
    """
    import contextlib

    import jax

    context = jax.enable_x64(True) if float64 else contextlib.nullcontext()
    with context:
        args = example_args if example_args is not None else cap.args
        module, compiled = compile_with_dump(cap.step, args, plan.shardings(mesh), workdir)
        specs = [p.spec for p in sorted(plan.parameters, key=lambda p: p.index)]
        names, devices = tuple(mesh.axis_names), np.asarray(mesh.device_ids)
        report = compare_module(module, specs, names, devices)
        if graph is not None:
            axes = MeshAxes.from_mesh(plan.mesh_shape, extra=[g.axes for g in plan.groups])
            compare_captured_outputs(report, module, graph, plan.group_array(graph, axes), axes, names, devices)
        numerics = None
        if example_args is not None and reference is not None:
            placed = jax.device_put(tuple(example_args), plan.shardings(mesh))
            numerics = compare_outputs(compiled(*placed), reference)
    return report, numerics


def reference_outputs(step: Any, example_args: Sequence[Any], *, float64: bool = False) -> tuple[Any, Any]:
    """(arguments, outputs) of the unsharded step, in float64 when asked (see `check_plan`)."""
    import contextlib

    import jax

    args = to_float64(tuple(example_args)) if float64 else tuple(example_args)
    with jax.enable_x64(True) if float64 else contextlib.nullcontext():
        outputs = jax.device_get(jax.jit(step)(*args))
    return args, outputs


# ---------------------------------------------------------------------------------------------
# The acceptance matrix (issue #3, section 4)
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AcceptanceRow:
    model: str
    mesh: str
    plan: str
    groups_sharded: int
    parameters: float
    outputs: float
    captured_outputs: float
    intermediates: float
    intermediates_count: int
    numerics: NumericCheck | None
    disagreements: tuple[tuple[tuple[str, str, str], int], ...]  # ((category, verdict, opcode), n)
    notes: tuple[str, ...]


MESHES: dict[str, dict[str, int]] = {"1x8": {"model": 8}, "2x4": {"data": 2, "model": 4}}


def acceptance_rows(model: str, workdir: str, *, random_per_mesh: int = 10, seed: int = 0,
                    run_numerics: bool = True, float64: bool = True,
                    meshes: Sequence[str] = ("1x8", "2x4")) -> list[AcceptanceRow]:
    """Every plan of the acceptance matrix for one zoo model: data-parallel and Megatron on each
    mesh, their combination on 2x4, and `random_per_mesh` random conflict-free plans per mesh.
    Numerics run in float64 by default (see `check_plan`)."""
    import jax

    import hlomap
    from hlomap import zoo
    from hlomap.plan import Plan
    from hlomap.propagation.plans import combine, data_parallel_plan, megatron_plan, random_plans

    entry = zoo.get(model)
    step = entry.train_step()
    cap = hlomap.capture(step, *entry.abstract_args())
    graph = FactorGraph.from_capture(cap)
    example, reference = (reference_outputs(step, entry.example_args(seed=seed), float64=float64)
                          if run_numerics else (None, None))
    rng = np.random.default_rng(seed)
    rows = []
    for mesh_name in meshes:
        shape = MESHES[mesh_name]
        axes = MeshAxes.from_mesh(shape)
        names = list(shape)
        # Auto axes: XLA propagates shardings itself, which is what is being checked
        mesh = jax.make_mesh(tuple(shape.values()), tuple(shape),
                             axis_types=(jax.sharding.AxisType.Auto,) * len(shape))
        dp = data_parallel_plan(graph, names[0], axes)
        mg = megatron_plan(graph, names[-1], axes)
        plans = [("data-parallel", dp), ("megatron", mg)]
        if len(names) > 1:
            plans.append(("data-parallel x megatron", combine(dp, mg)))
        plans += [(f"random {i}", p) for i, p in enumerate(random_plans(graph, axes, random_per_mesh, rng))]
        for label, array in plans:
            plan = Plan.from_groups(cap, graph, array, axes)
            where = os.path.join(workdir, f"{model}_{mesh_name}_{label.replace(' ', '_')}")
            report, numerics = check_plan(cap, plan, mesh, where, example_args=example, reference=reference,
                                          float64=float64, graph=graph)
            rows.append(AcceptanceRow(
                model, mesh_name, label, int((array >= 0).sum()),
                report.agreement(Category.PARAMETER), report.agreement(Category.OUTPUT),
                report.agreement(Category.CAPTURED_OUTPUT), report.agreement(Category.INTERMEDIATE), len(report.of(Category.INTERMEDIATE)),
                numerics, tuple(report.kinds().most_common()), tuple(report.notes)))
    return rows


def format_rows(rows: Sequence[AcceptanceRow]) -> str:
    lines = [f"{'model':12} {'mesh':4} {'plan':26} {'groups':>6} {'params':>7} {'outputs':>7} {'out/cap':>7} "
             f"{'interm.':>7} {'of':>5} numerics"]
    for r in rows:
        num = "-" if r.numerics is None else ("ok" if r.numerics.ok else
                                              ("isolated" if r.numerics.isolated_only else "FAIL")
                                              + f" {r.numerics.mismatched[:2]}")
        if r.numerics is not None:
            num += f" (max err {r.numerics.max_abs_error:.1e})"
        lines.append(f"{r.model:12} {r.mesh:4} {r.plan:26} {r.groups_sharded:6d} {r.parameters:7.1%} "
                     f"{r.outputs:7.1%} {r.captured_outputs:7.1%} {r.intermediates:7.1%} {r.intermediates_count:5d} {num}")
        for (cat, verdict, opcode), n in r.disagreements:
            lines.append(f"{'':14}{n} x {cat} {opcode}: {verdict}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m hlomap.verify.shardings [MODEL ...]`: the acceptance table per zoo model."""
    import argparse
    import tempfile

    from hlomap import zoo

    parser = argparse.ArgumentParser(
        prog="python -m hlomap.verify.shardings",
        description="Compare hlomap's propagated shardings with XLA's (shardy) for reference and random "
                    "plans of zoo models, and run each plan against the unsharded step.")
    parser.add_argument("models", nargs="*", default=["gpt-tiny"], metavar="MODEL",
                        help="zoo model names (default gpt-tiny); `hlomap zoo list` shows them")
    args = parser.parse_args(argv)
    known = set(zoo.names())
    unknown = [m for m in args.models if m not in known]
    if unknown:
        parser.error(f"unknown zoo model(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models:
            print(format_rows(acceptance_rows(name, tmp)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
