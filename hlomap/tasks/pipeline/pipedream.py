"""PipeDream's profiled layer graphs (msr-fiddle/pipedream profiler output) as pipeline input.

File format, one record per line:
    node<ID> -- <description> -- forward_compute_time=<ms>, backward_compute_time=<ms>,
        activation_size=<bytes or [b1; b2; ...]>, parameter_size=<bytes>
    <TAB>node<A> -- node<B>          (edge: A's output feeds B)
Times are milliseconds per minibatch (profiled on a V100); sizes are bytes (fp32: 4 bytes per
element; vgg16's first conv 3->64 3x3 has (27 * 64 + 64) * 4 = 7168 bytes). A layer with several
outputs (LSTMs) lists each output's bytes in brackets; they are summed.

Conversion to a `LayerDag` (`to_dag`) and its straight `PipelineProfile` (`to_profile`),
following PipeDream's optimizer where it makes a choice:
- Source nodes named `Input...` are dropped (PipeDream zeroes them and removes them: the input is
  read where it is needed, so it costs neither compute nor a cut). Sink nodes named
  `__getitem__...` are dropped too (unused tuple outputs; PipeDream removes them).
- Nodes are ordered topologically by Kahn's algorithm, taking the ready node with the smallest
  numeric id first (the profiler numbers nodes in execution order), so chains keep their order:
  the straight order.
- The bytes crossing the cut after position p are the activation sizes of the distinct nodes at
  positions <= p that feed some node after p. Each tensor is counted once however many
  consumers it has beyond the cut, because it is sent once (PipeDream's antichain
  `output_activation_size` also sums nodes, not edges); counting per edge would charge ResNet
  skip connections twice.
- A node's stash (memory per in-flight minibatch) and its output are its activation size; its
  compute is forward + backward time.
The straight profile is what the linear DP, the DQN and the inference network cut. On graphs with
branches PipeDream's optimizer also cuts between positions of that order (at antichains);
`downsets.solve_downsets` on `to_dag`'s graph searches those cuts too. On chains (vgg16, alexnet)
the two coincide.

`pipedream_cluster` is the network PipeDream's optimizer assumes for such a profile: one GPU per
worker, every pair of workers joined by the same link, memory never the limit.
"""

from __future__ import annotations

import heapq
import math
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hlomap.cost.cluster import Cluster, uniform
from hlomap.cost.pipeline.links import with_device_memory
from hlomap.cost.pipeline.profile import PipelineProfile
from hlomap.tasks.pipeline.downsets import LayerDag

__all__ = [
    "LayerGraph",
    "LayerNode",
    "PipeDreamParseError",
    "load_pipedream",
    "load_pipedream_dag",
    "parse_graph",
    "pipedream_cluster",
    "to_dag",
    "to_profile",
]

_NODE = re.compile(
    r"^(?P<id>node\d+) -- (?P<desc>.*) -- "
    r"forward_compute_time=(?P<fwd>[^,]+), backward_compute_time=(?P<bwd>[^,]+), "
    r"activation_size=(?P<act>\[[^\]]*\]|[^,]+), parameter_size=(?P<param>\S+)$"
)
_EDGE = re.compile(r"^\t(?P<src>node\d+) -- (?P<dst>node\d+)$")


class PipeDreamParseError(ValueError):
    """Malformed PipeDream graph; the message starts with file:line."""


@dataclass(frozen=True)
class LayerNode:
    """One profiled layer. Times in seconds, sizes in bytes; `line` is its 1-based line."""

    node_id: str
    description: str
    forward_time: float
    backward_time: float
    activation_bytes: float
    parameter_bytes: float
    line: int

    @property
    def number(self) -> int:
        return int(self.node_id[4:])


@dataclass(frozen=True)
class LayerGraph:
    """A profiled DAG: nodes by id (file order) and edges (src, dst) in file order."""

    nodes: dict[str, LayerNode]
    edges: tuple[tuple[str, str], ...]
    source: str


def _number(text: str, *, what: str, where: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise PipeDreamParseError(f"{where}: {what} {text!r} is not a number") from None
    if not (np.isfinite(value) and value >= 0):
        raise PipeDreamParseError(f"{where}: {what} {text!r} must be finite and >= 0")
    return value


def _activation(text: str, where: str) -> float:
    if text.startswith("["):
        parts = [p.strip() for p in text[1:-1].split(";") if p.strip()]
        if not parts:
            raise PipeDreamParseError(f"{where}: activation_size {text!r} lists no sizes")
        return sum(_number(p, what="activation_size entry", where=where) for p in parts)
    return _number(text, what="activation_size", where=where)


def parse_graph(text: str, source: str = "<string>") -> LayerGraph:
    """Parse a PipeDream graph file's text; errors name `source:line`."""
    nodes: dict[str, LayerNode] = {}
    edges: list[tuple[str, str, int]] = []
    for number, raw in enumerate(text.splitlines(), start=1):
        where = f"{source}:{number}"
        line = raw.rstrip("\r\n")
        if not line.strip():
            continue
        edge = _EDGE.match(line)
        if edge:
            edges.append((edge["src"], edge["dst"], number))
            continue
        node = _NODE.match(line)
        if node is None:
            raise PipeDreamParseError(
                f"{where}: expected 'nodeN -- desc -- forward_compute_time=..., "
                f"backward_compute_time=..., activation_size=..., parameter_size=...' or "
                f"'<TAB>nodeA -- nodeB', got {line[:120]!r}"
            )
        node_id = node["id"]
        if node_id in nodes:
            raise PipeDreamParseError(
                f"{where}: node {node_id} already defined at {source}:{nodes[node_id].line}"
            )
        nodes[node_id] = LayerNode(
            node_id=node_id,
            description=node["desc"],
            forward_time=_number(node["fwd"], what="forward_compute_time", where=where) / 1e3,
            backward_time=_number(node["bwd"], what="backward_compute_time", where=where) / 1e3,
            activation_bytes=_activation(node["act"].strip(), where),
            parameter_bytes=_number(node["param"], what="parameter_size", where=where),
            line=number,
        )
    for src, dst, number in edges:
        for end in (src, dst):
            if end not in nodes:
                raise PipeDreamParseError(f"{source}:{number}: edge names unknown node {end}")
        if src == dst:
            raise PipeDreamParseError(f"{source}:{number}: self-loop on {src}")
    if not nodes:
        raise PipeDreamParseError(f"{source}: no nodes")
    unique = tuple(dict.fromkeys((s, d) for s, d, _ in edges))
    return LayerGraph(nodes=nodes, edges=unique, source=source)


def _drop(graph: LayerGraph) -> set[str]:
    """Input sources and `__getitem__` sinks, which PipeDream's optimizer removes."""
    has_in = {d for _, d in graph.edges}
    has_out = {s for s, _ in graph.edges}
    dropped = set()
    for node_id, node in graph.nodes.items():
        if node.description.startswith("Input") and node_id not in has_in:
            dropped.add(node_id)
        elif node.description.startswith("__getitem__") and node_id not in has_out:
            dropped.add(node_id)
    return dropped


def topological_order(graph: LayerGraph, keep: set[str]) -> list[str]:
    """Kahn's algorithm, smallest node number first; raises on a cycle, naming its nodes."""
    successors: dict[str, list[str]] = {n: [] for n in keep}
    indegree = {n: 0 for n in keep}
    for src, dst in graph.edges:
        if src in keep and dst in keep:
            successors[src].append(dst)
            indegree[dst] += 1
    ready = [(graph.nodes[n].number, n) for n in keep if indegree[n] == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        _, node = heapq.heappop(ready)
        order.append(node)
        for nxt in successors[node]:
            indegree[nxt] -= 1
            if indegree[nxt] == 0:
                heapq.heappush(ready, (graph.nodes[nxt].number, nxt))
    if len(order) != len(keep):
        stuck = sorted((n for n in keep if indegree[n] > 0), key=lambda n: graph.nodes[n].number)
        where = ", ".join(f"{n} ({graph.source}:{graph.nodes[n].line})" for n in stuck[:5])
        raise PipeDreamParseError(f"{graph.source}: the graph has a cycle through {where}")
    return order


def to_dag(graph: LayerGraph) -> LayerDag:
    """The layer DAG of a profiled graph (see the module docstring), layers in the straight
    order; `solve_downsets` cuts it at any downset."""
    dropped = _drop(graph)
    keep = set(graph.nodes) - dropped
    if not keep:
        raise PipeDreamParseError(f"{graph.source}: no layers left after dropping inputs")
    order = topological_order(graph, keep)
    position = {node: p for p, node in enumerate(order)}
    consumers: list[list[int]] = [[] for _ in order]
    for src, dst in graph.edges:
        if src in keep and dst in keep:
            consumers[position[src]].append(position[dst])
    nodes = [graph.nodes[node] for node in order]
    activation = np.array([node.activation_bytes for node in nodes])
    return LayerDag(
        names=tuple(f"{node.node_id}:{node.description.split('(')[0]}" for node in nodes),
        forward_time=np.array([node.forward_time for node in nodes]),
        backward_time=np.array([node.backward_time for node in nodes]),
        parameter_bytes=np.array([node.parameter_bytes for node in nodes]),
        stash_bytes=activation,
        output_bytes=activation,
        consumers=tuple(tuple(c) for c in consumers),
        source=graph.source,
    )


def to_profile(graph: LayerGraph) -> PipelineProfile:
    """The straight-pipeline profile of a layer graph (see the module docstring)."""
    return to_dag(graph).straight


def load_pipedream(path: str | Path) -> PipelineProfile:
    """Read a PipeDream graph file into a straight `PipelineProfile`."""
    return to_profile(_read(path))


def load_pipedream_dag(path: str | Path) -> LayerDag:
    """Read a PipeDream graph file into a `LayerDag` (for `downsets.solve_downsets`)."""
    return to_dag(_read(path))


def _read(path: str | Path) -> LayerGraph:
    path = Path(path)
    return parse_graph(path.read_text(), source=str(path))


def pipedream_cluster(workers: int, bandwidth_gbps: float = 10.0) -> Cluster:
    """`workers` V100s (the profiles' GPU), each its own server, all joined by `bandwidth_gbps`
    links without latency, with unlimited memory: the network PipeDream's optimizer prices
    straight pipelines on (one worker per stage, so no two transfers share a NIC)."""
    network = uniform(workers, "V100-16GB", bandwidth_gbps * 1e9 / 8, 0.0,
                      name=f"pipedream-{workers}x{bandwidth_gbps:g}Gbps")
    return with_device_memory(network, math.inf)
