"""Pipeline plans as runnable steps: the step cut into stage programs and two executors.

- `prepare`: trace the step, map the plan's HLO cuts to loss equations (`cuts`), split the loss
  into stage programs (`loss_split`) and the rest of the step into per-stage updates
  (`stage_update`); `section` reads the plan's pipeline section for them.
- `spmd_executor`: GPipe (plain or circular) as one SPMD program over a `stage` mesh axis, with
  every stage's state packed into rows (`layout`); runs across processes.
- `mpmd_executor`: one program per stage driven by a Python scheduler in the order the pipeline
  simulator predicts (`dispatch`); any schedule, one controller.
- `stage_state`: the per-stage state (`Staged`) both executors hold inside a step.
- `shared_compile`: one compiled executable for the stages whose programs are identical.
"""
