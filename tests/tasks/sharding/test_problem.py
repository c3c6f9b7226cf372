"""The public API: `hlomap.explore(...)` returns a Plan carrying its estimate and how it was found,
saves the best plan as it runs, survives Ctrl-C, refuses to load against another module or mesh;
reports render."""

from __future__ import annotations

import json

import numpy as np
import pytest

from hlomap.api import explore_detailed, parse_mesh
from hlomap.propagation.conflicts import REPLICATED
from hlomap.report.sharding import format_plan_summary, plot_convergence
from hlomap.tasks.sharding.compare import layer_of
from hlomap.tasks import Task
from hlomap.plan import Plan


def test_parse_mesh() -> None:
    assert parse_mesh(8) == {"model": 8}
    assert parse_mesh("8", Task.ADP) == {"data": 8}
    assert parse_mesh("data=2,model=4", "hybrid") == {"data": 2, "model": 4}
    assert parse_mesh({"x": 4}) == {"x": 4}
    with pytest.raises(ValueError, match="two mesh axes"):
        parse_mesh({"model": 8}, "hybrid")
    with pytest.raises(ValueError, match="NAME=SIZE"):
        parse_mesh("data=two")


@pytest.mark.parametrize("task", [Task.PIPELINE, Task.AUTO])
def test_sharding_explorers_refuse_the_pipeline_tasks(task: Task) -> None:
    # One Task enum names every task; the sharding explorers take only opp, adp and hybrid.
    with pytest.raises(ValueError, match=f"task '{task.value}' is not a sharding task"):
        parse_mesh(8, task)


def test_unknown_task_names_the_tasks() -> None:
    with pytest.raises(ValueError, match="unknown task 'tp'; the tasks are opp, adp, hybrid, pipeline, auto"):
        parse_mesh(8, "tp")


def test_explore_is_callable_as_hlomap_explore(cap_of, graph_of) -> None:
    import hlomap

    plan = hlomap.explore(cap_of("gpt-tiny"), task="opp", mesh={"model": 8}, cluster="A", agent="greedy",
                          budget_seconds=10, seed=0, reward="paper", graph=graph_of("gpt-tiny"))
    assert isinstance(plan, Plan)
    assert plan.search["driver"] == "greedy" and plan.search["reward"] == "paper"
    assert plan.search["task"] == "opp" and plan.search["seed"] == 0
    assert plan.search["evaluations"] > 0 and plan.search["seconds"] >= 0
    assert plan.estimate is not None and plan.estimate["step_seconds"] > 0


def test_plan_saves_as_the_search_runs_and_loads_back(cap_of, graph_of, tmp_path) -> None:
    out = tmp_path / "plan.json"
    seen = []

    def watch(progress) -> None:
        if out.exists():
            seen.append(json.loads(out.read_text())["search"]["score"]["value"])

    ex = explore_detailed(cap_of("t5-tiny"), "opp", 8, "A", "random", None, 0, "paper", budget_evaluations=256,
                          output=out, graph=graph_of("t5-tiny"), on_progress=watch, with_estimate=False)
    assert seen and seen == sorted(seen)  # written while running, improving
    loaded = Plan.load(out, cap=cap_of("t5-tiny"), mesh={"model": 8})
    assert loaded.parameters == ex.plan.parameters and loaded.groups == ex.plan.groups
    assert loaded.search == json.loads(json.dumps(ex.plan.search))


def test_loading_against_another_module_or_mesh_fails_clearly(cap_of, graph_of, tmp_path) -> None:
    out = tmp_path / "plan.json"
    explore_detailed(cap_of("gpt-tiny"), "opp", 8, "A", "exact", None, 0, "paper", output=out,
                     graph=graph_of("gpt-tiny"), with_estimate=False)
    with pytest.raises(ValueError, match="another module.*entry parameters"):
        Plan.load(out, cap=cap_of("bert-tiny"))
    with pytest.raises(ValueError, match="mesh"):
        Plan.load(out, mesh={"data": 2, "model": 4})
    from hlomap.verify.numerics import run_plan

    with pytest.raises(ValueError, match="another module"):
        run_plan(Plan.load(out), cap_of("bert-tiny"))


def test_ctrl_c_keeps_the_best_plan_on_disk(cap_of, graph_of, tmp_path) -> None:
    out = tmp_path / "plan.json"
    calls = []

    def interrupt(progress) -> None:
        calls.append(progress)
        if len(calls) == 2:
            raise KeyboardInterrupt

    ex = explore_detailed(cap_of("t5-tiny"), "opp", 8, "A", "random", 600, 0, "paper", output=out,
                          graph=graph_of("t5-tiny"), on_progress=interrupt, with_estimate=False)
    assert ex.result.interrupted and ex.plan.search["interrupted"]
    assert Plan.load(out).search["interrupted"]
    assert len(calls) == 2  # the search stopped at the interrupt (a structural check, not a wall-time bound)


def test_reports_render(cap_of, graph_of, tmp_path) -> None:
    from rich.console import Console

    ex = explore_detailed(cap_of("gpt-tiny"), "opp", 8, "A", "random", None, 0, "paper", budget_evaluations=64,
                          graph=graph_of("gpt-tiny"))
    console = Console(record=True, width=120)
    console.print(format_plan_summary(ex.plan))
    text = console.export_text()
    assert "layers_0" in text and "attn/query/kernel" in text and "model" in text
    assert "found by random" in text and "estimate on cluster " in text and ": step " in text
    png = tmp_path / "curve.png"
    plot_convergence([ex.result], png, title="gpt-tiny", optimum=12.7)
    assert png.stat().st_size > 1000 and png.read_bytes()[:4] == b"\x89PNG"


def test_layer_of() -> None:
    assert layer_of("params/layers_3/attn/query/kernel") == "layers_3"
    assert layer_of("params/decoder/layers_0/mlp/fc_in/kernel") == "decoder/layers_0"
    assert layer_of("params/block2_conv1/kernel") == "block2_conv1"
    assert layer_of("params/embed/embedding") == "embed"
    assert layer_of("batch/tokens") == "batch"


def test_the_plan_summary_tells_zero_1_from_fsdp_and_shows_the_stored_split(cap_of, graph_of) -> None:
    """A plan whose state sharding lists only optimizer-state leaves reads as ZeRO-1; one that
    lists the parameters too reads as FSDP, and its table shows each parameter's spec as placed
    (split over `data`), by roles when given and by paths otherwise."""
    from rich.console import Console

    from hlomap.plan import Plan, resolve_plan

    cap, graph = cap_of("haiku-mlp"), graph_of("haiku-mlp")
    array, axes, _ = resolve_plan(graph, "dp", {"data": 8})
    base = Plan.from_groups(cap, graph, array, axes)
    roles = {p.path: p.role.value for p in cap.parameters}

    def text(plan: Plan, with_roles: bool) -> str:
        console = Console(record=True, width=140)
        console.print(format_plan_summary(plan, roles=roles if with_roles else None))
        return console.export_text()

    for with_roles in (True, False):
        zero = text(base.with_sharded_state(graph), with_roles)
        fsdp = text(base.with_sharded_state(graph, parameters=True), with_roles)
        assert "(ZeRO-1)" in zero and "FSDP" not in zero
        assert "(FSDP / ZeRO-3)" in fsdp and "ZeRO-1" not in fsdp
        assert "8 of 8 variables sharded" in fsdp and "2 of 8 variables sharded" in zero


def test_axes_of_one_device_split_nothing_in_the_summaries(cap_of, graph_of) -> None:
    """A one-device plan names mesh axes of size 1 (hlomap found {model: 1} on an H200 and said
    "61 of 102 variables sharded"); neither summary counts those as split."""
    from rich.console import Console

    from hlomap.plan import resolve_plan
    from hlomap.report.explain import explain_plan, format_explanation

    cap, graph = cap_of("haiku-mlp"), graph_of("haiku-mlp")
    roles = {p.path: p.role.value for p in cap.parameters}

    def texts(mesh: dict[str, int]) -> tuple[str, str]:
        array, axes, _ = resolve_plan(graph, "megatron", mesh)
        plan = Plan.from_groups(cap, graph, array, axes)
        out = []
        for renderable in (format_plan_summary(plan, roles=roles),
                           format_explanation(explain_plan(plan, cap, graph), plan)):
            console = Console(record=True, width=160)
            console.print(renderable)
            out.append(console.export_text())
        return out[0], out[1]

    summary, explanation = texts({"model": 1})
    assert "0 of 8 variables sharded" in summary and "fully replicated" not in summary  # one device: nothing to split
    assert "0 of 8 variables sharded (" in explanation and "mesh axes of one device" in explanation
    summary, explanation = texts({"model": 8})
    assert "0 of 8" not in summary and "mesh axes of one device" not in explanation
    # a plan that splits nothing over 8 devices (a search may return it) says so
    array, axes, _ = resolve_plan(graph, "megatron", {"model": 8})
    console = Console(record=True, width=200)
    replicated = np.full_like(array, REPLICATED)
    console.print(format_plan_summary(Plan.from_groups(cap, graph, replicated, axes), roles=roles))
    assert "0 of 8 variables sharded: every one of the 8 devices runs the whole step (fully replicated)" in \
        console.export_text()
