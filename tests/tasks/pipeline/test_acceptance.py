"""Acceptance on zoo steps (slow): the DQN within 1% of the DP on clusters A, B, C.

The default run covers the reduced case (gpt-tiny, config A) in test_explore.py; the full table
is `scripts/reproduce_pipeline.py`.
"""

import pytest

from scripts.pipeline_acceptance import ACCEPTANCE_MODELS, CONFIG_STAGES, model_profile, run_case
from hlomap.search.budget import Budget

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def profiles():
    cache = {}

    def get(model):
        if model not in cache:
            cache[model] = model_profile(model)
        return cache[model]

    return get


@pytest.mark.parametrize("config", sorted(CONFIG_STAGES))
@pytest.mark.parametrize("model", ACCEPTANCE_MODELS)
def test_dqn_lands_within_one_percent_of_the_dp_on_server_boundaries(model, config, profiles):
    case = run_case(model, config, hlo=profiles(model), infer=False,
                    budget=Budget(episodes=2000, seconds=None))
    assert case.gap <= 0.01, f"{model} on {config}: DQN {case.dqn_value} vs DP {case.dp_value}"
    assert case.gap >= -1e-9  # nothing beats the optimum
    assert case.dqn_on_server_boundaries
    assert case.dqn_plan.replication == (8,) * CONFIG_STAGES[config]
