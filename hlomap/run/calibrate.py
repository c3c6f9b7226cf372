"""The pipeline executors' own costs, measured: what `hlomap calibrate` adds to the microbenchmarks.

A pipeline step costs more than its stages' compute and transfers: the mpmd executor dispatches a
forward and a backward program per stage and microbatch and moves every activation with a
`jax.device_put`; the spmd executor runs one program whose loop takes a tick per microbatch and
stage, each with a `ppermute` over the stage axis. On 8 CPU devices that is about a millisecond per
stage and microbatch, more than a tiny model's whole step. These costs are timed here on a model
with next to no compute (a chain of `TINY_LAYERS` 8x8 matmuls), over a few stage and microbatch
counts, and fitted as `fixed + per_unit x units` per executor (`executor_units`): the term
`hlomap.cost.pipeline.costs.executor_overhead` adds to a pipeline's price. The mpmd executor is
timed again on the same model with `MANY_BUFFER_LEAVES` more parameters per layer, so that its fit
also separates what each buffer its passes move costs (`hlomap.cost.estimate.pass_buffers`). The
spmd executor keeps the state packed in rows and slices every leaf out again after each step (the
user's pytrees it returns); that hand-back is timed on its own on both models
(`HandBackSample`), because the many-leaf model's step also runs a kernel per leaf in every tick.

It lives in `run` because it runs the executors; `hlomap.api.calibrate` calls it beside the
device microbenchmarks of `hlomap.verify.devices`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from hlomap.cost.calibration import ExecutorSample, HandBackSample
from hlomap.run.errors import RunError

log = logging.getLogger(__name__)

#: Layers of the near-empty model: enough to cut into the largest stage count measured.
TINY_LAYERS = 8
TINY_WIDTH = 8
TINY_BATCH = 64


#: Parameters each layer of the many-buffer variant multiplies its output by: each adds a
#: parameter and its residuals to every pass (`hlomap.cost.estimate.pass_buffers`), so the mpmd
#: executor's cost per buffer moved separates from its cost per pass (a convolutional network's
#: passes move hundreds of buffers, the plain tiny model's a few dozen).
MANY_BUFFER_LEAVES = 16


@dataclass(frozen=True)
class ExecutorBench:
    """Which (stages, microbatches) to time, how many timed calls each sample is the median of,
    the shapes the mpmd executor is timed at again on the many-buffer variant, and the stages the
    spmd executor's hand-back is timed on (both variants; none: not timed)."""

    shapes: tuple[tuple[int, int], ...]
    repeats: int
    many_buffer_shapes: tuple[tuple[int, int], ...] = ()
    hand_back_stages: int = 0
    # each sample is timed in this many interleaved passes and keeps the median of them
    # (`hlomap.verify.devices.interleaved_passes`): two calibrations back to back fitted the spmd
    # executor's cost per tick at 0.50 and 0.90 ms from one pass each
    passes: int = 3


DEFAULT_EXECUTOR_BENCH = ExecutorBench(shapes=((2, 1), (2, 4), (4, 4)), repeats=10,
                                       many_buffer_shapes=((2, 1), (2, 4)), hand_back_stages=2)
QUICK_EXECUTOR_BENCH = ExecutorBench(shapes=((2, 1), (2, 2)), repeats=3, many_buffer_shapes=((2, 2),), passes=1,
                                     hand_back_stages=2)
#: One device runs pipelines too (a joint plan of one stage and several microbatches): the
#: executor's cost per microbatch is what keeps such a plan from looking free (on an H200 a
#: one-stage plan of 256 microbatches, priced without it at 0.24 ms, ran in 141 ms).
ONE_DEVICE_EXECUTOR_BENCH = ExecutorBench(shapes=((1, 2), (1, 8)), repeats=10, many_buffer_shapes=((1, 4),),
                                          hand_back_stages=1)
QUICK_ONE_DEVICE_EXECUTOR_BENCH = ExecutorBench(shapes=((1, 2), (1, 4)), repeats=3, many_buffer_shapes=((1, 2),),
                                                 passes=1, hand_back_stages=1)


def _tiny_step(extra_leaves: int = 0) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """A train step of TINY_LAYERS small tanh layers (SGD): all overhead, no work. With
    `extra_leaves`, each layer's output is also multiplied by that many parameter vectors."""
    import jax.numpy as jnp
    import optax

    from hlomap.run.grad import value_and_grad

    optimizer = optax.sgd(0.1)

    def loss_fn(params: Any, batch: Any) -> Any:
        h = batch
        for i in range(TINY_LAYERS):
            h = jnp.tanh(h @ params[f"w{i}"])
            for k in range(extra_leaves):
                h = h * params[f"s{i}_{k}"]
        return jnp.mean(h**2)

    def step(params: Any, opt_state: Any, batch: Any) -> Any:
        loss, grads = value_and_grad(loss_fn)(params, batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    params = {f"w{i}": jnp.eye(TINY_WIDTH) for i in range(TINY_LAYERS)}
    params |= {f"s{i}_{k}": jnp.ones(TINY_WIDTH) for i in range(TINY_LAYERS) for k in range(extra_leaves)}
    return step, (params, optimizer.init(params), jnp.ones((TINY_BATCH, TINY_WIDTH)))


ExecutorTask = tuple[str, Callable[[], ExecutorSample | HandBackSample | None]]


def executor_tasks(devices: Sequence[Any], *, quick: bool = False, bench: ExecutorBench | None = None,
                   median_seconds: Callable[[Callable[[], Any], int], float]) -> list[ExecutorTask]:
    """(label, measure) of each executor sample on `devices` (module docstring), for
    `hlomap.verify.devices.measure_devices` to run after its own, in `bench.passes` interleaved
    passes; a measure returns None in the passes before the last, and for a shape the executor
    refuses to run here (logged). Shapes needing more stages than devices are left out.
    `median_seconds(call, repeats)` is the device microbenchmarks' timer."""
    from hlomap.verify.devices import Probe, interleaved_passes

    count = len(devices)
    if bench is None:
        bench = ((QUICK_ONE_DEVICE_EXECUTOR_BENCH if quick else ONE_DEVICE_EXECUTOR_BENCH) if count == 1 else
                 (QUICK_EXECUTOR_BENCH if quick else DEFAULT_EXECUTOR_BENCH))
    if count < 1:
        return []
    prepared: dict[int, dict[str, Any]] = {}

    def probe(executor: str, schedule: str, stages: int, microbatches: int, label: str,
              extra_leaves: int = 0, hand_back: bool = False) -> Probe[Any] | None:
        import jax

        from hlomap.cost.pipeline.costs import mean_stage_devices
        from hlomap.run.runner import parallelize
        from hlomap.tasks.pipeline.explore import explore_pipeline_plan
        from hlomap.verify.timing import stateful_step

        if extra_leaves not in prepared:
            prepared[extra_leaves] = _prepared_tiny_step(extra_leaves)
        step, cap, host, buffers, leaves = (prepared[extra_leaves][k]
                                            for k in ("step", "cap", "host", "buffers", "leaves"))
        try:
            plan = explore_pipeline_plan(cap, cluster=f"uniform:{count}", agent="dp", stages=stages,
                                         microbatches=microbatches, schedule=schedule)
            parallel = parallelize(step, plan, executor=executor, devices=devices, example_args=host)
            run = stateful_step(parallel, *parallel.place(host[0], host[1]), host[2])
            jax.block_until_ready(run())  # compiles it; a shape that cannot run fails here
        except (RunError, ValueError) as err:
            log.info("calibrate: %s left out (%s)", label, err)
            return None
        stage_devices = mean_stage_devices(plan.pipeline.stages)
        if hand_back:
            # `place` on the state the last call returned: the rows it came from, sliced out again
            state = list(run()[:2])

            def hand_back_once() -> Any:
                state[:] = parallel.place(*state)
                return jax.block_until_ready(state)

            return Probe(hand_back_once, lambda seconds: HandBackSample(float(leaves), stage_devices, seconds))
        return Probe(lambda: jax.block_until_ready(run()), lambda seconds: ExecutorSample(
            executor, stages, microbatches, seconds, float(buffers), stage_devices))

    probes: list[tuple[str, Callable[[], Probe[ExecutorSample] | None]]] = []
    for stages, microbatches in bench.shapes:
        if stages > count:
            continue
        for executor, schedule in (("spmd", "gpipe"), ("mpmd", "1f1b")):
            label = f"{executor} executor {stages}x{microbatches}"
            probes.append((label, lambda e=executor, s=schedule, n=stages, m=microbatches, lb=label: probe(e, s, n, m, lb)))
    for stages, microbatches in bench.many_buffer_shapes:
        if stages > count:
            continue
        label = f"mpmd executor {stages}x{microbatches}, {MANY_BUFFER_LEAVES} more parameters per layer"
        probes.append((label, lambda n=stages, m=microbatches, lb=label: probe("mpmd", "1f1b", n, m, lb,
                                                                               MANY_BUFFER_LEAVES)))
    if 1 <= bench.hand_back_stages <= count:
        for extra in (0, MANY_BUFFER_LEAVES):
            stages_label = "1 stage" if bench.hand_back_stages == 1 else f"{bench.hand_back_stages} stages"
            label = f"spmd executor's hand-back of the state over {stages_label}" + (
                f", {extra} more parameters per layer" if extra else "")
            probes.append((label, lambda x=extra, lb=label: probe("spmd", "gpipe", bench.hand_back_stages, 1, lb, x,
                                                                 hand_back=True)))
    return interleaved_passes(probes, bench.passes, bench.repeats, median_seconds)


def _prepared_tiny_step(extra_leaves: int = 0) -> dict[str, Any]:
    import jax
    import numpy as np

    from hlomap.cost.estimate import pass_buffers, state_leaves
    from hlomap.hlo.capture import capture

    step, example = _tiny_step(extra_leaves)
    cap = capture(step, *example)
    return {"step": step, "cap": cap, "host": jax.tree.map(np.asarray, example), "buffers": pass_buffers(cap),
            "leaves": state_leaves(cap)}


def measure_present_devices(devices: int | None = None, *, quick: bool = False,
                            on_progress: Callable[[Any], None] | None = None) -> Any:
    """`hlomap.verify.devices.measure_devices` on the first `devices` devices, with both
    executors' samples after the microbenchmarks: everything `hlomap calibrate` measures."""
    from hlomap.verify.devices import measure_devices

    def extra(chosen: Sequence[Any], fast: bool, timer: Callable[[Callable[[], Any], int], float]) -> list[ExecutorTask]:
        return executor_tasks(chosen, quick=fast, median_seconds=timer)

    return measure_devices(devices, quick=quick, on_progress=on_progress, extra_tasks=extra)
