import numpy as np
import pytest

from palimpsest.platform import ConfigError, Resolution
from palimpsest.platform.compile.budget import Budget
from palimpsest.platform.policies import PacePlusConfig, parse_policy_config
from palimpsest.platform.policies.pace_plus import allocate


def test_allocate_maximises_value_within_capacity():
    costs = np.array([[10, 50, 100, 400], [10, 50, 100, 400], [10, 50, 100, 400]], dtype=float)
    values = np.array([5.0, 1.0, 0.1])[:, None] * np.array([0.02, 0.6, 0.95, 1.0])[None, :]
    choice = allocate(costs, values, capacity=30 + 90 + 40)
    assert choice.tolist() == [2, 1, 0]  # the most relevant gets detailed, the next brief
    assert float(costs[np.arange(3), choice].sum()) <= 160
    assert allocate(costs, values, capacity=10_000).tolist() == [3, 3, 3]
    assert allocate(costs, values, capacity=0).tolist() == [0, 0, 0]


def test_allocate_skips_missing_options_and_takes_free_upgrades():
    costs = np.array([[10, np.nan, np.nan, 40], [10, 5, 20, 30]], dtype=float)
    values = np.array([[0.1, 0.6, 0.9, 1.0], [0.1, 0.6, 0.9, 1.0]])
    choice = allocate(costs, values, capacity=20)
    assert choice[0] == 0 and choice[1] >= 1  # row 1's brief costs less than its placeholder


def test_pace_plus_keeps_the_relevant_step_rich_and_the_context_small(runtime, session):
    snap = runtime.snapshot(session)
    plan = runtime.policy("pace_plus").plan(snap, 100_000)
    res = [Resolution(int(r)) for r in plan.resolution]
    assert res[1] is Resolution.FULL and res[-1] is Resolution.FULL
    assert plan.score[1] == plan.score[:10].max()
    tight = runtime.compile(snap, runtime.policy("pace_plus"), Budget(1200))
    res = [Resolution(int(r)) for r in tight.plan.resolution]
    assert tight.prompt.tokens <= 1200 and res[1] <= Resolution.DETAILED
    assert res[1] <= min(res[0], res[2])  # never poorer than the images or the weather


def test_pace_plus_spends_at_most_its_fill_share_before_the_compiler(runtime, session):
    snap = runtime.snapshot(session)
    budget = 1500
    turn = runtime.compile(snap, runtime.policy(PacePlusConfig(fill=0.5)), Budget(budget))
    assert turn.prompt.tokens <= 0.5 * budget + 40  # placeholders are the floor, never more than a line each
    assert not turn.plan.degradations


def test_pace_plus_config_is_validated():
    with pytest.raises(ConfigError, match="coverage must rise strictly"):
        parse_policy_config({"type": "pace_plus", "coverage": [0.5, 0.4, 0.9, 1.0]})
    with pytest.raises(ConfigError, match="fill"):
        parse_policy_config({"type": "pace_plus", "fill": 0})
