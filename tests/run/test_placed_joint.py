"""A joint plan placed on other devices than its own ids runs there, with the unsharded step's
numerics."""

from __future__ import annotations

import pytest

import hlomap
from hlomap.run.compare import check_pipeline
from tests.run.helpers import FAST_COMPILE
from tests.tasks.placement.helpers import placed_joint_plan


@pytest.mark.slow  # 29 s; the fast run keeps the mapping of a pipeline's ids to placed devices (tests/test_plan_placement.py)
def test_a_placed_joint_plan_runs_with_the_unsharded_numerics(zoo_case) -> None:  # type: ignore[no-untyped-def]
    """The placed plan's stages run on the devices its placement names (the runner's stage meshes),
    and the loss and gradients equal the unsharded step's."""
    case = zoo_case("gpt-tiny")
    _, placed, _ = placed_joint_plan(case.cap)
    assert placed.device_order() != placed.logical_devices()
    step = hlomap.parallelize(case.model.train_step(), placed, example_args=case.args, compiler_options=FAST_COMPILE)
    described = step.describe()
    assert [tuple(s.devices) for s in described.stages] == [tuple(g) for g in placed.stage_devices()]
    check = check_pipeline(step, case.args)
    assert check.exact, "\n".join(c.words() for c in check.comparisons)
