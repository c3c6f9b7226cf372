"""The joint planner's `schedule="auto"`: its plan priced under 1F1B, ZB-H1 and GPipe by the event
timeline, the fastest that fits kept; a ZB-H1 joint plan (stages with their own meshes, the
backward split into input- and weight-gradient programs) runs with the unsharded step's loss."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from hlomap.cost.cluster import hierarchical
from hlomap.cost.pipeline.stages import Schedule
from hlomap.tasks.joint.plans import choose_schedule, evaluate


@pytest.fixture(scope="module")
def gpt_tiny():  # type: ignore[no-untyped-def]
    import hlomap
    from hlomap import zoo

    model = zoo.get("gpt-tiny")
    step, args = model.train_step(), model.example_args(0)
    return step, args, hlomap.capture(step, *args, arg_names=model.arg_names)


def test_auto_keeps_the_fastest_schedule_that_fits(gpt_tiny) -> None:  # type: ignore[no-untyped-def]
    from hlomap.tasks.joint.explore import explore_joint

    cap = gpt_tiny[2]
    cluster = hierarchical(2, 4, "V100-16GB")
    found = explore_joint(cap, cluster, schedule="auto", microbatches=[4], with_grid=False)
    model, plan = found.model, found.plan
    timed = {s: evaluate(model, dataclasses.replace(plan, schedule=s), timeline=True)
             for s in (Schedule.ONE_F_ONE_B, Schedule.ZERO_BUBBLE, Schedule.GPIPE)}
    best = min((c.latency for c in timed.values() if c.fits))
    assert timed[plan.schedule].latency == pytest.approx(best)
    if plan.n_stages > 1:  # the weight passes fill the drain: never slower than 1F1B
        assert timed[Schedule.ZERO_BUBBLE].latency <= timed[Schedule.ONE_F_ONE_B].latency * (1 + 1e-9)


def test_a_zero_bubble_joint_plan_runs_with_the_unsharded_loss(gpt_tiny) -> None:  # type: ignore[no-untyped-def]
    import jax

    import hlomap
    from hlomap.tasks.joint.explore import explore_joint, joint_plan

    step, args, cap = gpt_tiny
    found = explore_joint(cap, hierarchical(2, 4, "V100-16GB"), microbatches=[4], max_stages=2, with_grid=False)
    assert found.plan.n_stages == 2
    zero_bubble = choose_schedule(found.model, found.plan, schedules=(Schedule.ZERO_BUBBLE,))
    plan = joint_plan(dataclasses.replace(found, plan=zero_bubble, cost=evaluate(found.model, zero_bubble)))
    assert plan.pipeline.schedule is Schedule.ZERO_BUBBLE
    parallel = hlomap.parallelize(step, plan)
    params, opt_state = parallel.place(args[0], args[1])
    _, _, loss = parallel(params, opt_state, *args[2:])
    _, _, want = jax.jit(step)(*args)
    np.testing.assert_allclose(float(loss), float(want), rtol=1e-5)
