"""The budget is one value, validated where it enters; every bound reads its fields."""

import numpy as np
import pytest

from palimpsest.platform import Budget, BudgetError


def test_the_reserve_is_the_reply_and_the_soft_positions():
    b = Budget(4096, 128, 64)
    assert (b.reserve, b.prompt) == (192, 3904)
    assert b.of_total(2048) == Budget(2048, 128, 64)
    assert Budget(np.int64(1000), 10) == Budget(1000, 10)


@pytest.mark.parametrize("args, field", [((0,), "positive integer"), ((1.5,), "positive integer"),
                                         (("100",), "positive integer"), ((True,), "positive integer"),
                                         ((100, -1), "max_tokens"), ((100, 10, -1), "soft positions"),
                                         ((100, 100), "leaves no room"), ((100, 60, 40), r"\+ 40 soft positions")])
def test_a_budget_that_cannot_hold_a_prompt_names_its_field(args, field):
    with pytest.raises(BudgetError, match=field):
        Budget(*args)


def test_the_runtime_takes_a_budget_value_only(runtime, session):
    """One shape of the budget from the route to the compiler: a plain total (with or without a reserve beside
    it) is refused by name, at the turn and at the compile alike."""
    turn = runtime.turn(session, "pace", Budget(900, 100), record=False)
    assert turn.prompt.tokens + 100 <= 900
    for total in (900, np.int64(900)):
        with pytest.raises(BudgetError, match="Runtime.turn takes a Budget"):
            runtime.turn(session, "pace", total, record=False)
        with pytest.raises(BudgetError, match="Runtime.compile takes a Budget"):
            runtime.compile(turn.snapshot, runtime.policy("pace"), total)
    with pytest.raises(TypeError, match="reserve"):
        runtime.turn(session, "pace", Budget(900), reserve=100, record=False)
