"""Topology-aware device placement (Parmesan's device mapping; DRL-PP's PPO placement agent) as a
search task of `hlomap.search`.

    problem = problem_from_plan(plan, load_cluster("torus:8x8x8"))
    result = search_placement(problem, "greedy", Budget(seconds=60))
    placed = with_placement(plan, problem, result)     # the plan with its placement section

See `problem` (what is placed and priced), `objective` (incremental pricing), `construct`
(structured and constructed starting placements), `curves` (row-major, snake and Hilbert walks
over topology coordinates), `bisection` (recursive bisection of positions against devices),
`task` (the search task: scores, swap moves, exact enumeration), `ppo` (the learned policy's
environment and training), `generate` (benchmark and training problems, scrambled clusters),
`place` (plans in and out), `pipeline_costs` (the one door to the pipeline cost model and DP).
"""
