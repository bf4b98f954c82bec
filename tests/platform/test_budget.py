"""The budget is one value, validated where it enters; every bound reads its fields."""

import numpy as np
import pytest

from palimpsest.platform import Budget, BudgetError


def test_the_reserve_is_the_reply_and_the_soft_positions():
    b = Budget(4096, 128, 64)
    assert (b.reserve, b.prompt) == (192, 3904)
    assert b.of_total(2048) == Budget(2048, 128, 64)
    assert Budget.of(np.int64(1000), 10) == Budget(1000, 10)
    assert Budget.of(b) is b


@pytest.mark.parametrize("args, field", [((0,), "positive integer"), ((1.5,), "positive integer"),
                                         (("100",), "positive integer"), ((True,), "positive integer"),
                                         ((100, -1), "max_tokens"), ((100, 10, -1), "soft positions"),
                                         ((100, 100), "leaves no room"), ((100, 60, 40), r"\+ 40 soft positions")])
def test_a_budget_that_cannot_hold_a_prompt_names_its_field(args, field):
    with pytest.raises(BudgetError, match=field):
        Budget(*args)


def test_a_reserve_beside_a_budget_value_is_refused():
    with pytest.raises(BudgetError, match="inside the Budget"):
        Budget.of(Budget(100, 10), 5)


def test_the_runtime_takes_a_budget_value_or_a_total_with_its_reserve_alike(runtime, session):
    a = runtime.turn(session, "pace", Budget(900, 100), record=False)
    b = runtime.turn(session, "pace", 900, record=False, reserve=100)
    assert a.prompt.ids == b.prompt.ids and a.prompt.tokens + 100 <= 900
