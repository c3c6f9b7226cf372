"""Search drivers written once over a small task protocol (`task.SearchTask`): the Rainbow DQN
(`dqn`), a trained PPO policy polished by local search (`ppo`), random and greedy baselines at
equal budget (`random`, `greedy`; greedy is iterated local search on tasks that price moves
incrementally, `task.LocalSearchTask`), the task's exact method (`exact`) and its trivial plan
(`identity`), with one budget, one best-so-far tracker and one result record.

    result = dqn_search(task, Budget(seconds=60), seed=0, on_best=save, on_progress=bar)
"""
