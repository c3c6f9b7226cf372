"""The joint planner: pipeline stages with data and tensor parallelism inside each stage, for
the whole cluster at once (`hlomap.explore(cap, task="auto")`).

  costs   the inner level: a stage's cost for a layer range and an option (device group, mesh
          shape, sharding plan), memoized as prefix sums of the sharded step's prices
  plans   joint plans and their closed-form cost (L, memory per device)
  solve   the exact outer level: DP over cuts, device groups, options and microbatches
  grid    the expert baseline: every Megatron-LM (pp, tp, dp) configuration
  task    the outer level as a search task for the DQN driver
  explore from a captured step to a `Plan`
"""
