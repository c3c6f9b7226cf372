import re

import numpy as np
import pytest

from hlomap.cost.pipeline.costs import CommModel, CostOptions
from hlomap.tasks.pipeline.dp import solve, solve_states
from hlomap.tasks.pipeline.downsets import downset_family, downset_states, solve_downsets
from hlomap.tasks.pipeline.pipedream import (
    PipeDreamParseError,
    load_pipedream,
    load_pipedream_dag,
    parse_graph,
    pipedream_cluster,
    to_profile,
)
from hlomap.tasks.pipeline.space import PipelineObjective, PipelineSpace

STRAIGHT_PIPEDREAM = PipelineSpace(
    objective=PipelineObjective.BOTTLENECK,
    cost=CostOptions(comm=CommModel.IGNORED),
    check_memory=False,
)


def _node(i, desc="Conv2d(1, 1)", fwd=1.0, bwd=2.0, act="100.0", param=0.0):
    return (
        f"node{i} -- {desc} -- forward_compute_time={fwd:.3f}, backward_compute_time={bwd:.3f}, "
        f"activation_size={act}, parameter_size={param:.3f}"
    )


@pytest.mark.parametrize(
    "n_stages,published", [(2, 0.370931), (4, 0.21645), (8, 0.159531)]
)
def test_dp_reproduces_pipedreams_optimizer_on_vgg16(corpus_dir, n_stages, published):
    """PipeDream's optimizer, --straight_pipeline, no activation_compression_ratio: each stage
    one worker, stage time = sum of (forward + backward ms) / 1000 of its layers, communication
    ignored, Input nodes zeroed; it prints the slowest stage's time."""
    profile = load_pipedream(corpus_dir / "pipedream" / "vgg16.txt")
    solution = solve(profile, pipedream_cluster(n_stages, 10.0), STRAIGHT_PIPEDREAM)
    assert solution.plan.n_stages == n_stages
    assert solution.value == pytest.approx(published, rel=5e-7)


@pytest.mark.parametrize(
    "n_stages,published", [(2, 0.370931), (4, 0.21645), (8, 0.159531)]
)
def test_downset_dp_reproduces_pipedreams_optimizer_on_vgg16(corpus_dir, n_stages, published):
    """vgg16 is a chain: its downsets are the straight order's prefixes, and the downset DP, by
    its linear fast path or over the downset tables, gives PipeDream's numbers."""
    dag = load_pipedream_dag(corpus_dir / "pipedream" / "vgg16.txt")
    cluster = pipedream_cluster(n_stages, 10.0)
    found = solve_downsets(dag, cluster, STRAIGHT_PIPEDREAM)
    assert found.complete and found.value == pytest.approx(published, rel=5e-7)
    family = downset_family(dag)
    assert len(family.members) == dag.n_layers + 1
    general = solve_states(downset_states(dag, family), lambda chain: (dag.straight, chain),
                           cluster, STRAIGHT_PIPEDREAM)
    assert general.solution.value == found.value


def test_every_corpus_graph_becomes_a_profile(corpus_dir):
    for path in sorted((corpus_dir / "pipedream").glob("*.txt")):
        text = path.read_text()
        profile = load_pipedream(path)
        # Independent count: node lines minus Input sources and unused __getitem__ sinks.
        node_lines = [line for line in text.splitlines() if line.startswith("node")]
        descriptions = {line.split(" -- ")[0]: line.split(" -- ")[1] for line in node_lines}
        sources = {m.group(1) for m in re.finditer(r"^\tnode\d+ -- (node\d+)$", text, re.M)}
        sinks = {m.group(1) for m in re.finditer(r"^\t(node\d+) -- node\d+$", text, re.M)}
        dropped = [
            n for n, d in descriptions.items()
            if (d.startswith("Input") and n not in sources)
            or (d.startswith("__getitem__") and n not in sinks)
        ]
        assert profile.n_layers == len(node_lines) - len(dropped), path.name
        assert (profile.activation_bytes >= 0).all()
        total_ms = sum(
            float(v) for line in node_lines
            if line.split(" -- ")[0] not in dropped
            for v in re.findall(r"(?:forward|backward)_compute_time=([\d.]+)", line)
        )
        assert profile.compute_time.sum() == pytest.approx(total_ms / 1e3, rel=1e-9), path.name


def test_cut_bytes_count_each_crossing_tensor_once():
    """Diamond a -> {b, c} -> d plus a skip a -> d: order a, b, c, d.

    cut after a: a's output (once, although three consumers lie beyond)      = 1
    cut after b: a (still needed by c and d) + b                              = 1 + 2
    cut after c: a (needed by d) + b + c                                      = 1 + 2 + 4
    """
    text = "\n".join([
        _node(1, act="1.0"), _node(2, act="2.0"), _node(3, act="4.0"), _node(4, act="8.0"),
        "\tnode1 -- node2", "\tnode1 -- node3", "\tnode2 -- node4", "\tnode3 -- node4",
        "\tnode1 -- node4",
    ])
    profile = to_profile(parse_graph(text, "diamond.txt"))
    assert profile.names[0].startswith("node1")
    assert list(profile.activation_bytes) == [1.0, 3.0, 7.0]


def test_inputs_and_unused_getitem_are_dropped_and_lists_are_summed():
    text = "\n".join([
        _node(1, desc="Input0", fwd=17.0, act="500.0"),
        _node(2, desc="LSTM(2, 2)", act="[10.0; 20.0; 30.0]", param=64.0),
        _node(3, desc="__getitem__(0)", fwd=0.0, bwd=0.0, act="10.0"),
        _node(4, desc="__getitem__(1)", fwd=0.0, bwd=0.0, act="20.0"),
        _node(5, desc="Linear(2, 2)"),
        "\tnode1 -- node2", "\tnode2 -- node3", "\tnode2 -- node4", "\tnode3 -- node5",
    ])
    profile = to_profile(parse_graph(text, "lstm.txt"))
    # node4 is an unused output (a sink): dropped; node3 feeds node5: kept.
    assert [name.split(":")[0] for name in profile.names] == ["node2", "node3", "node5"]
    assert list(profile.stash_bytes) == [60.0, 10.0, 100.0]
    assert profile.forward_time[0] == pytest.approx(1e-3)  # ms -> s
    assert list(profile.parameter_bytes) == [64.0, 0.0, 0.0]


@pytest.mark.parametrize(
    "lines,message",
    [
        ([_node(1), "node2 -- Conv -- forward_compute_time=x"], r"g.txt:2: expected 'nodeN"),
        ([_node(1), _node(1)], r"g.txt:2: node node1 already defined at g.txt:1"),
        ([_node(1), "\tnode1 -- node7"], r"g.txt:2: edge names unknown node node7"),
        ([_node(1, act="[]")], r"g.txt:1: activation_size '\[\]' lists no sizes"),
        ([_node(1, act="1e999")], r"g.txt:1: activation_size '1e999' must be finite"),
        (
            [_node(1), _node(2), _node(3), "\tnode1 -- node2", "\tnode2 -- node3",
             "\tnode3 -- node2"],
            r"cycle through node2 \(g.txt:2\), node3 \(g.txt:3\)",
        ),
    ],
)
def test_bad_input_names_file_and_line(lines, message):
    with pytest.raises(PipeDreamParseError, match=message):
        to_profile(parse_graph("\n".join(lines), "g.txt"))


def test_straight_order_on_a_chain_keeps_file_independent_order():
    """Node lines in shuffled order (as in the corpus files) still give the chain order."""
    lines = [_node(i, fwd=float(i)) for i in (3, 1, 4, 2)]
    edges = ["\tnode1 -- node2", "\tnode2 -- node3", "\tnode3 -- node4"]
    profile = to_profile(parse_graph("\n".join(lines + edges), "chain.txt"))
    assert np.allclose(profile.forward_time, [1e-3, 2e-3, 3e-3, 4e-3])
