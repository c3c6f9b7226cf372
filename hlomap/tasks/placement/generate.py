"""Generated placement problems: the benchmark's topologies x sizes x workloads, and random ones
to train the placement policy on.

Topology families (cluster topology strings, `cost.cluster.parse_topology`): 3-D and 2-D torus,
2-D and 3-D mesh, hierarchical servers of 8 GPUs, Parmesan's random-block islands, random uniform
distances, and one uniform switch (every placement equal: a control).

Workloads, both from a dense transformer of `hidden` width and `layers` layers at `seq` tokens
per sample and `microbatch` samples per data-parallel replica, 2-byte values, trained with Adam:
- spmd: a data x model mesh (Megatron tensor parallelism on `model`, at most 8 wide): 4
  all-reduces of the [b, s, h] activations per layer and step along `model`, one gradient
  all-reduce of the replica's parameter shard along `data`; compute 6 x parameters x tokens
  split over the mesh, on the cluster's device at the roofline efficiency.
- pipeline: S stages of `layers / S` layers, each replicated r ways (data parallel inside the
  stage), M = 2 S microbatches: per stage its forward and backward compute, its parameter bytes
  (all-reduced once per batch), and the [b, s, h] activation crossing each cut.
- joint: the pipeline's stages, each a data x model mesh (Megatron tensor parallelism on
  `model`, at most 4 wide, inside the stage): per microbatch 4 all-reduces of the [b, s, h]
  activations per layer along `model`, the stage's gradient all-reduce along `data` once per
  batch, and each data replica's activations crossing each cut.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from dataclasses import dataclass

import numpy as np

from hlomap.cost.cluster import Cluster, load_cluster
from hlomap.cost.collectives import Collective
from hlomap.cost.devices import DeviceSpec
from hlomap.cost.estimate import CommunicationTerm
from hlomap.cost.pipeline.profile import PipelineProfile
from hlomap.cost.pipeline.stages import Schedule
from hlomap.tasks.placement.problem import (JointLayout, Layout, MeshLayout, MeshStage, PlacementProblem,
                                            StageLayout, StageTerm)

__all__ = ["BENCHMARK_SIZES", "BenchmarkWorkload", "ModelSize", "TopologyFamily", "benchmark_problem", "joint_layout",
           "model_for", "pipeline_layout", "random_problem", "scrambled", "spmd_layout", "tensor_parallel_layout", "topology"]

BENCHMARK_SIZES = (8, 16, 64, 128, 512)
#: Values are 2 bytes (bf16 activations and gradients).
VALUE_BYTES = 2


class TopologyFamily(str, enum.Enum):
    TORUS = "torus"        # 3-D torus
    TORUS_2D = "torus2d"
    MESH = "mesh"          # 2-D mesh
    MESH_3D = "mesh3d"
    HIER = "hier"          # servers of 8 GPUs (NVLink inside, 25 GbE between)
    RANDOM = "random"      # random-block islands
    UNIFORM_RANDOM = "uniform-random"
    UNIFORM = "uniform"    # one switch: every placement is equal

    def __str__(self) -> str:
        return self.value


class BenchmarkWorkload(str, enum.Enum):
    SPMD = "spmd"
    PIPELINE = "pipeline"
    JOINT = "joint"

    def __str__(self) -> str:
        return self.value


def _factor(n: int, parts: int) -> tuple[int, ...]:
    """n (a power of two) as `parts` near-equal powers of two, largest last."""
    exponent = int(round(math.log2(n)))
    if 2 ** exponent != n:
        raise ValueError(f"benchmark sizes are powers of two, got {n}")
    base, extra = divmod(exponent, parts)
    return tuple(2 ** (base + (1 if i >= parts - extra else 0)) for i in range(parts))


def topology(family: TopologyFamily | str, n: int, seed: int = 0) -> str:
    """The topology string of `family` at `n` devices."""
    family = TopologyFamily(family)
    if family is TopologyFamily.TORUS:
        return "torus:" + "x".join(map(str, _factor(n, 3)))
    if family is TopologyFamily.TORUS_2D:
        return "torus:" + "x".join(map(str, _factor(n, 2)))
    if family is TopologyFamily.MESH:
        return "mesh:" + "x".join(map(str, _factor(n, 2)))
    if family is TopologyFamily.MESH_3D:
        return "mesh:" + "x".join(map(str, _factor(n, 3)))
    if family is TopologyFamily.HIER:
        per = min(8, n)
        return f"hier:{n // per}x{per}"
    if family is TopologyFamily.RANDOM:
        return f"random:{n}:{seed}"
    if family is TopologyFamily.UNIFORM_RANDOM:
        return f"uniform:{n}:{seed}"
    return f"uniform:{n}"


@dataclass(frozen=True)
class ModelSize:
    hidden: int
    layers: int
    seq: int = 2048
    microbatch: int = 8

    @property
    def parameters(self) -> float:
        return 12.0 * self.layers * self.hidden ** 2

    @property
    def activation_bytes(self) -> float:
        """One [b, s, h] activation of a microbatch."""
        return float(self.microbatch * self.seq * self.hidden * VALUE_BYTES)


def model_for(n: int) -> ModelSize:
    """A model whose size grows with the cluster (1.2B parameters at 8-16 devices, 6.4B at 64-128,
    39B at 512)."""
    if n <= 16:
        return ModelSize(hidden=2048, layers=24)
    if n <= 128:
        return ModelSize(hidden=4096, layers=32)
    return ModelSize(hidden=8192, layers=48)


def _flops_per_second(device: DeviceSpec) -> float:
    return device.flops_for("bf16") * device.efficiency


def spmd_layout(cluster: Cluster, n: int, model: ModelSize, model_axis: int | None = None) -> MeshLayout:
    """The spmd workload on n devices (module docstring)."""
    tp = model_axis or min(8, max(2, n // 2))
    dp = n // tp
    if dp * tp != n:
        raise ValueError(f"model axis {tp} does not divide {n} devices")
    terms = (
        CommunicationTerm(Collective.ALL_REDUCE, ("model",), model.activation_bytes, 4 * model.layers),
        CommunicationTerm(Collective.ALL_REDUCE, ("data",), model.parameters / tp * VALUE_BYTES, 1),
    )
    tokens = model.microbatch * model.seq * dp
    compute = 6 * model.parameters * tokens / n / _flops_per_second(cluster.devices[0])
    return MeshLayout((("data", dp), ("model", tp)), terms, compute)


def pipeline_layout(cluster: Cluster, n: int, model: ModelSize, stages: int | None = None) -> StageLayout:
    """The pipeline workload on n devices (module docstring)."""
    s = stages or _stage_count(n)
    r = n // s
    if r * s != n or model.layers % s:
        raise ValueError(f"{s} stages do not split {n} devices and {model.layers} layers evenly")
    per_stage = model.parameters / s
    forward = 2 * per_stage * model.microbatch * model.seq / _flops_per_second(cluster.devices[0])
    profile = PipelineProfile(
        names=tuple(f"stage{i}" for i in range(s)),
        forward_time=np.full(s, forward),
        backward_time=np.full(s, 2 * forward),
        activation_bytes=np.full(s - 1, model.activation_bytes),
        parameter_bytes=np.full(s, per_stage * VALUE_BYTES),
        source=f"transformer h={model.hidden} L={model.layers}",
    )
    return StageLayout(profile, (r,) * s, 2 * s, Schedule.ONE_F_ONE_B)


def _stage_count(n: int) -> int:
    return max(2, min(16, int(2 ** round(math.log2(n) / 2))))


def joint_layout(cluster: Cluster, n: int, model: ModelSize, stages: int | None = None) -> JointLayout:
    """The joint workload on n devices (module docstring)."""
    s = stages or _stage_count(n)
    group = n // s
    if group * s != n or model.layers % s:
        raise ValueError(f"{s} stages do not split {n} devices and {model.layers} layers evenly")
    tp = min(4, group)
    dp = group // tp
    m = 2 * s
    per_stage = model.parameters / s
    compute = 6 * per_stage * model.microbatch * model.seq / tp / _flops_per_second(cluster.devices[0])
    terms = (StageTerm(Collective.ALL_REDUCE, ("model",), model.activation_bytes, 4.0 * model.layers / s, 1.0, 1.0),
             StageTerm(Collective.ALL_REDUCE, ("data",), per_stage / tp * VALUE_BYTES, 1.0, 1.0 / m, 1.0 / m))
    return JointLayout(tuple(MeshStage((("data", dp), ("model", tp)), compute, terms,
                                       model.activation_bytes * dp if k + 1 < s else 0.0) for k in range(s)),
                       m, Schedule.ONE_F_ONE_B)


def tensor_parallel_layout(n: int, group: int = 8, nbytes: float = 1e8, count: int = 1) -> MeshLayout:
    """n / group tensor-parallel groups of `group` devices, all all-reducing `nbytes` at once
    (`count` times a step) and nothing else: the workload where a placement's only job is to
    keep every group on links no other group crosses (issue 23's torus:8x8 example)."""
    if n % group:
        raise ValueError(f"groups of {group} do not split {n} devices")
    return MeshLayout((("data", n // group), ("model", group)),
                      (CommunicationTerm(Collective.ALL_REDUCE, ("model",), float(nbytes), float(count)),))


def scrambled(cluster: Cluster, seed: int = 0) -> Cluster:
    """`cluster` with its device ids a random permutation of its physical devices, as a scheduler
    may hand them out: device k of the result is device `order[k]` of `cluster` (tables,
    servers, coordinates and, on a grid, the node each id sits on all follow). Named
    `NAME~SEED`."""
    order = np.random.default_rng([seed, 0x5C4A]).permutation(cluster.n_devices)
    network = cluster.network
    if network is not None:
        nodes = network.node_of_device.copy()
        nodes[: cluster.n_devices] = nodes[order]  # nodes past the devices (a slice of a torus) stay
        network = type(network)(dataclasses.replace(network.grid, device_nodes=tuple(nodes.tolist())))
    coords = None if cluster.coords is None else tuple(cluster.coords[i] for i in order)
    return Cluster(f"{cluster.name}~{seed}", tuple(cluster.devices[i] for i in order),
                   tuple(cluster.node_of[i] for i in order), cluster.bandwidth[np.ix_(order, order)],
                   cluster.latency[np.ix_(order, order)], cluster.nics_per_node, cluster.measured, network, coords)


def benchmark_problem(family: TopologyFamily | str, n: int, workload: BenchmarkWorkload | str,
                      seed: int = 0) -> PlacementProblem:
    """One row of the benchmark: `workload` on `family` at n devices."""
    name = topology(family, n, seed)
    cluster = load_cluster(name)
    model = model_for(n)
    kind = BenchmarkWorkload(workload)
    layout: Layout = (spmd_layout(cluster, n, model) if kind is BenchmarkWorkload.SPMD else
                      joint_layout(cluster, n, model) if kind is BenchmarkWorkload.JOINT else
                      pipeline_layout(cluster, n, model))
    return PlacementProblem(cluster, layout, name=f"{BenchmarkWorkload(workload).value} on {name}")


#: Families the policy is trained on (the uniform switch teaches nothing).
TRAINING_FAMILIES = (TopologyFamily.TORUS, TopologyFamily.TORUS_2D, TopologyFamily.MESH, TopologyFamily.HIER,
                     TopologyFamily.RANDOM, TopologyFamily.UNIFORM_RANDOM)


def random_problem(rng: np.random.Generator, sizes: tuple[int, ...] = (8, 16, 32, 64)) -> PlacementProblem:
    """A random training problem: family, size, workload, mesh or stage shape and the message
    sizes are drawn, so that latency-bound and bandwidth-bound terms both occur."""
    family = TRAINING_FAMILIES[int(rng.integers(len(TRAINING_FAMILIES)))]
    n = int(rng.choice(sizes))
    cluster = load_cluster(topology(family, n, int(rng.integers(1 << 20))))
    hidden = int(rng.choice([512, 1024, 2048, 4096]))
    model = ModelSize(hidden=hidden, layers=16, seq=int(rng.choice([256, 1024, 2048])),
                      microbatch=int(rng.choice([1, 4, 8])))
    if rng.random() < 0.5:
        tp = int(rng.choice([t for t in (2, 4, 8) if t < n]))
        layout: MeshLayout | StageLayout = spmd_layout(cluster, n, model, model_axis=tp)
        kind = BenchmarkWorkload.SPMD
    else:
        stages = int(rng.choice([s for s in (2, 4, 8, 16) if s <= n]))
        layout = pipeline_layout(cluster, n, model, stages=stages)
        kind = BenchmarkWorkload.PIPELINE
    return PlacementProblem(cluster, layout, name=f"{kind.value} on {cluster.name}")
