"""`hlomap.auto_shard`: the README example runs and equals the undecorated step; the plan cache
(hit without search, the key, corrupt entries, atomic writes); new shapes capture again;
plan=PATH; mesh=None; errors that name the value."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import hlomap
from hlomap import autoshard
from hlomap.autoshard import Origin, cache_key, cache_path, load_cached, save_cached
from hlomap.tasks import Task
from tests.local_cluster import seed_local_cluster

ROOT = Path(__file__).resolve().parents[1]
#: The example between these markers in README.md.
EXAMPLE = re.compile(r"<!-- auto_shard example: start -->\s*```python\n(.*?)```\s*<!-- auto_shard example: end -->",
                     re.S)


def readme_example() -> str:
    match = EXAMPLE.search((ROOT / "README.md").read_text())
    if match:
        return match.group(1)
    raise AssertionError("no auto_shard example between its markers in README.md")


@pytest.fixture(scope="module")
def example(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The README example, run as written (its cache in a temporary folder)."""
    cache = tmp_path_factory.mktemp("cache")
    seed_local_cluster(cache)  # the example prices on "local", kept in the same cache folder
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(autoshard.CACHE_ENV, str(cache))
        namespace: dict[str, Any] = {"__name__": "readme_example"}
        exec(compile(readme_example(), "README.md:auto_shard example", "exec"), namespace)
    namespace["cache"] = cache
    return namespace


def test_the_readme_example_runs_and_equals_the_undecorated_step(example: dict[str, Any]) -> None:
    """Loss and updated weights of one decorated step against `jax.jit` of the undecorated one,
    updates compared where the gradient is above rounding noise (`hlomap.run.compare`)."""
    import jax

    from hlomap.run.compare import compare_loss, compare_updates

    step = example["train_step"]
    # Which candidate runs is the measured fastest on this machine's timing (dp on data=8 or the
    # search's pick on the 2x4 mesh): what does not depend on timing is asserted.
    assert step.origin is Origin.EXPLORED and math.prod(step.plan.mesh_shape.values()) == 8
    measured = step.plan.measured
    assert measured is not None and "searched" in {c.name for c in measured.candidates}
    timed = [c for c in measured.candidates if c.median_seconds is not None]
    assert measured.chosen == min(timed, key=lambda c: c.median_seconds).name
    assert any(p.partition_spec() != jax.sharding.PartitionSpec() for p in step.plan.parameters)
    params0, opt0 = example["init"](jax.random.key(0))
    batch = example["batch"]
    expected = jax.jit(step.__wrapped__)(params0, opt0, batch)
    grads = jax.grad(example["loss_fn"])(params0, batch)
    out = step(*step.place(params0, opt0), batch)
    params, _ = step.gather(out[0], out[1])
    names = sorted(params0)
    assert compare_loss(np.asarray(out[2]), np.asarray(expected[2])).ok
    updates = compare_updates("updated parameters", [params[k] for k in names], [expected[0][k] for k in names],
                              [params0[k] for k in names], [grads[k] for k in names], names)
    assert updates.ok, updates.words()
    rows = step.explain()
    assert {r.path for r in rows} >= {"params/w1", "batch/x"}
    assert any(d.axes and "group" in d.why for r in rows for d in r.dims)


def test_a_new_process_reads_the_plan_from_the_cache(example: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """Same step, same key, a fresh decorator (as a new process has): no search."""
    import jax

    def no_search(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("explored although the plan is cached")

    monkeypatch.setattr("hlomap.api.explore", no_search)
    again = hlomap.auto_shard(mesh={"data": 2, "model": 4}, task="hybrid", agent="greedy",
                              cache_dir=example["cache"])(example["train_step"].__wrapped__)
    params, opt_state = again.place(*example["init"](jax.random.key(0)))
    again(params, opt_state, example["batch"])
    assert again.origin is Origin.CACHE and again.timings.explore == 0.0
    assert again.plan == example["train_step"].plan


def test_a_corrupt_entry_warns_and_is_explored_again(example: dict[str, Any], tmp_path: Path) -> None:
    import jax

    step = example["train_step"]
    corrupt = tmp_path / step.plan_file.name
    corrupt.write_text('{"version": 1, "mesh": ')
    fresh = hlomap.auto_shard(mesh={"data": 2, "model": 4}, task="hybrid", agent="greedy", budget_seconds=5,
                              cache_dir=tmp_path)(step.__wrapped__)
    with pytest.warns(RuntimeWarning, match="corrupt cache entry"):
        fresh(*example["init"](jax.random.key(0)), example["batch"])
    assert fresh.origin is Origin.EXPLORED and fresh.plan_file == corrupt
    assert hlomap.Plan.load(corrupt) == fresh.plan  # replaced by the new plan


def test_the_key_changes_with_mesh_task_cluster_and_fingerprint() -> None:
    from hlomap.cost.cluster import cluster_preset, first_devices

    a8 = first_devices(cluster_preset("A"), 8)
    base = cache_key("f" * 64, {"data": 2, "model": 4}, a8, "hybrid")
    others = [cache_key("e" * 64, {"data": 2, "model": 4}, a8, "hybrid"),
              cache_key("f" * 64, {"data": 4, "model": 2}, a8, "hybrid"),
              cache_key("f" * 64, {"data": 2, "model": 4}, a8, "opp"),
              cache_key("f" * 64, {"data": 2, "model": 4}, first_devices(cluster_preset("B"), 8), "hybrid")]
    paths = {cache_path(Path("c"), k) for k in [base, *others]}
    assert len(paths) == 5
    assert cache_path(Path("c"), base) == cache_path(Path("c"), cache_key("f" * 64, {"data": 2, "model": 4}, a8,
                                                                          Task.HYBRID))
    assert base.version == hlomap.__version__


def test_a_new_shape_captures_again(example: dict[str, Any]) -> None:
    import jax
    import jax.numpy as jnp

    step = example["train_step"]
    before = step.cap.text_sha256
    params, opt_state = step.place(*example["init"](jax.random.key(0)))
    wider = {k: jnp.concatenate([v, v]) for k, v in example["batch"].items()}  # 64 examples
    params, opt_state, loss = step(params, opt_state, wider)
    assert step.cap.text_sha256 != before and step.cap.parameters[-1].shape.dims[0] == 64
    assert len(list(example["cache"].glob("*.plan.json"))) == 2
    step(params, opt_state, example["batch"])  # back to the first signature: no new capture
    assert step.cap.text_sha256 == before


def test_the_state_the_last_call_returned_is_not_flattened_again(example: dict[str, Any],
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A train loop hands each step's state to the next: the decorated step then reads the
    signature of the batch alone (flattening gpt-small's state twice per call cost 7% of its
    H200 step) and calls the jitted program straight, not through the runner's layers. State it
    did not return, even with the same leaves, is read again; the steps' losses equal plain
    `jax.jit`'s."""
    import jax

    from hlomap.run.spmd import SpmdStep

    step, batch = example["train_step"], example["batch"]
    read: list[int] = []
    real = autoshard.signature
    monkeypatch.setattr(autoshard, "signature", lambda args: read.append(len(args)) or real(args))
    layered: list[int] = []
    through = SpmdStep.__call__
    monkeypatch.setattr(SpmdStep, "__call__", lambda self, *args: layered.append(1) or through(self, *args))
    params, opt_state = step.place(*example["init"](jax.random.key(0)))
    plain = jax.jit(step.__wrapped__)
    host = jax.tree.map(np.asarray, step.gather(params, opt_state))
    losses, expected = [], []
    for _ in range(3):
        params, opt_state, loss = step(params, opt_state, batch)
        host = plain(*host, batch)
        losses.append(float(loss))
        expected.append(float(host[2]))
        host = host[:2]
    assert read == [3, 1, 1]  # placed state is new to it; then each call's returned state comes back
    assert len(layered) == 1  # the first call through the SPMD step, the next two to its program
    np.testing.assert_allclose(losses, expected, rtol=1e-5)
    read.clear()
    step(dict(params), opt_state, batch)  # a new container of the same leaves
    assert read == [3] and len(layered) == 2


def test_plan_path_skips_the_search(example: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    import jax

    monkeypatch.setattr("hlomap.api.explore", lambda *a, **k: pytest.fail("searched despite plan="))
    path = example["train_step"].plan_file
    fixed = hlomap.auto_shard(plan=path)(example["train_step"].__wrapped__)
    params, opt_state = fixed.place(*example["init"](jax.random.key(0)))
    assert params["w1"].sharding.spec == example["train_step"].plan.parameters[1].partition_spec()
    fixed(params, opt_state, example["batch"])
    assert fixed.origin is Origin.FILE and fixed.plan == hlomap.Plan.load(path)


def test_a_plan_for_another_step_is_refused_by_name(example: dict[str, Any]) -> None:
    import jax
    import jax.numpy as jnp

    fixed = hlomap.auto_shard(plan=example["train_step"].plan_file)(example["train_step"].__wrapped__)
    wider = {k: jnp.concatenate([v, v]) for k, v in example["batch"].items()}
    with pytest.raises(ValueError, match=r"plan=.*was made for another module"):
        fixed(*example["init"](jax.random.key(0)), wider)


def test_mesh_none_uses_every_local_device(example: dict[str, Any], tmp_path: Path) -> None:
    import jax

    # measure=0: the search's own plan (measured selection could pick a built-in data=8 plan)
    step = hlomap.auto_shard(mesh=None, task="opp", agent="greedy", budget_seconds=5, measure=0,
                             cache_dir=tmp_path)(example["train_step"].__wrapped__)
    step(*example["init"](jax.random.key(0)), example["batch"])
    assert step.plan.mesh_shape == {"model": jax.local_device_count()} == {"model": 8}
    assert json.loads(step.plan_file.read_text())["mesh"]["axes"] == {"model": 8}


def test_cache_writes_are_atomic(example: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A write that fails half-way leaves the old entry whole and no temporary file behind."""
    plan = example["train_step"].plan
    path = tmp_path / "deeper" / "entry.plan.json"
    save_cached(path, plan)
    before = path.read_text()

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise OSError("disk full")

    monkeypatch.setattr("os.replace", broken)
    with pytest.raises(OSError, match="disk full"):
        save_cached(path, plan)
    assert path.read_text() == before and [p.name for p in path.parent.iterdir()] == ["entry.plan.json"]
    assert load_cached(path, None) == plan


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"mesh": 16, "task": "opp"}, r"mesh=16 needs 16 devices, but JAX sees 8"),
    ({"mesh": {"data": 4, "model": 4}, "task": "hybrid"}, r"mesh=\{'data': 4, 'model': 4\} needs 16 devices"),
    ({"mesh": 8, "task": "hybrid"}, r"mesh=8: the hybrid task needs a data x model mesh"),
    ({"mesh": 8, "task": "opp", "cluster": "nope"}, r"cluster='nope'"),
    ({"mesh": 8, "task": "opp", "cluster": "hier:1x4"}, r"cluster='hier:1x4': cluster 'hier:1x4' has 4 devices, the "
                                                       r"mesh 8; pass mesh= for at most 4, or a cluster of 8"),
])
def test_errors_name_the_value(example: dict[str, Any], kwargs: dict[str, Any], message: str, tmp_path: Path) -> None:
    import jax

    step = hlomap.auto_shard(cache_dir=tmp_path, **kwargs)(example["train_step"].__wrapped__)
    with pytest.raises(ValueError, match=message):
        step(*example["init"](jax.random.key(0)), example["batch"])


def test_bad_arguments_fail_when_decorating(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"plan='.*missing.json': no such file"):
        hlomap.auto_shard(plan=tmp_path / "missing.json")
    with pytest.raises(ValueError, match=r"task='fast'"):
        hlomap.auto_shard(task="fast")
    with pytest.raises(ValueError, match=r"mesh=\[8\]"):
        hlomap.auto_shard(mesh=[8])
    # the default task's joint planner is exact: a search's agent or budget would be ignored
    with pytest.raises(ValueError, match=r"budget_seconds=10: the auto task \(the default\) plans with an exact"):
        hlomap.auto_shard(budget_seconds=10)
    with pytest.raises(ValueError, match=r"agent='greedy': the auto task"):
        hlomap.auto_shard(agent="greedy")
    hlomap.auto_shard(task="opp", agent="greedy", budget_seconds=10, cache=False)  # a search task reads them


@pytest.mark.slow
def test_task_auto_runs_the_joint_plan_with_the_unsharded_numerics(tmp_path: Path) -> None:
    """The decorator's default task on gpt-tiny and a 2-server x 4-device cluster: a pipeline
    plan (stages with their own meshes) whose loss and gradients before the optimizer equal the
    undecorated step's (`check_pipeline` on the step the decorator built)."""
    from hlomap import zoo
    from hlomap.cost.cluster import hierarchical
    from hlomap.run.compare import check_pipeline

    model = zoo.get("gpt-tiny")
    args = tuple(model.example_args(0))
    step = hlomap.auto_shard(mesh=8, cluster=hierarchical(2, 4), cache_dir=tmp_path)(model.train_step())
    params, opt_state = step.place(args[0], args[1])
    step(params, opt_state, *args[2:])
    assert step.origin is Origin.EXPLORED and step.plan.pipeline is not None
    assert step.plan.pipeline["kind"] == "joint" and len(step.plan.pipeline["stages"]) >= 2
    check = check_pipeline(step.step, args)
    assert check.exact, [c.words() for c in check.comparisons]


def test_an_unwritable_cache_dir_is_named_when_decorating(tmp_path: Path) -> None:
    """A folder that cannot be created (a file stands in its path) fails at once with its name,
    not with a PermissionError traceback after the search."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(ValueError, match=r"cache_dir='.*a-file/plans': cannot write plans in .*a-file/plans"):
        hlomap.auto_shard(cache_dir=blocker / "plans")


def test_an_unwritable_default_cache_warns_and_runs_without_one(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv(autoshard.CACHE_ENV, str(blocker / "plans"))
    with pytest.warns(RuntimeWarning, match=r"default cache folder .*a-file/plans.*without a plan cache"):
        step = hlomap.auto_shard(mesh=8, task="opp")(lambda params, opt_state, batch: (params, opt_state))
    assert step.config.cache_dir is None


def test_a_cache_write_that_fails_warns_and_keeps_the_plan(example: dict[str, Any], tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    import jax

    def broken(path: Path, plan: Any) -> None:
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(autoshard, "save_cached", broken)
    step = hlomap.auto_shard(cache_dir=tmp_path, mesh=8, task="opp", agent="greedy", budget_seconds=5)(
        example["train_step"].__wrapped__)
    with pytest.warns(RuntimeWarning, match="could not cache the plan"):
        step(*example["init"](jax.random.key(0)), example["batch"])
    assert step.plan is not None and step.plan_file is None


def test_the_decorated_step_takes_the_train_step_s_keywords(example: dict[str, Any]) -> None:
    """It has the train step's signature: keywords bind as the undecorated step binds them."""
    import jax

    step, batch = example["train_step"], example["batch"]
    by_position = step(*step.place(*example["init"](jax.random.key(0))), batch)[2]
    params, opt_state = step.place(*example["init"](jax.random.key(0)))
    by_keyword = step(params, opt_state=opt_state, batch=batch)[2]
    assert float(by_keyword) == float(by_position)
    with pytest.raises(TypeError, match=r"^train_step\(\): .*'bogus'"):
        step(params, opt_state, batch, bogus=1)
