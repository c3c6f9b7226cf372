"""Search drivers written once over a small task protocol (`task.SearchTask`): the Rainbow DQN
(`dqn`), random and greedy baselines at equal budget (`random`, `greedy`) and the task's exact
method (`exact`), with one budget, one best-so-far tracker and one result record.

    result = dqn_search(task, Budget(seconds=60), seed=0, on_best=save, on_progress=bar)
"""
