import pytest

from palimpsest.platform import GlimpseLimitError, UnknownStepError
from palimpsest.platform.compile.budget import Budget
from tests.helpers import TASK, per_turn, step


def test_glimpse_returns_the_raw_step(runtime, session, ledger):
    st = ledger.step_at(session, 1)
    text = runtime.glimpse(session, f"#{st.id}")
    assert "def parse_config(env):" in text and "cat settings/loader.py" in text


def test_at_most_three_glimpses_per_turn_then_a_new_turn_resets(runtime, session, ledger):
    ids = [ledger.step_at(session, t).id for t in range(4)]
    for sid in ids[:3]:
        runtime.glimpse(session, sid)
    with pytest.raises(GlimpseLimitError, match="3 per turn"):
        runtime.glimpse(session, ids[3])
    runtime.append(session, step(12, "ls", "x"))
    assert runtime.glimpse(session, ids[3])


def test_glimpse_of_unknown_or_foreign_step_is_a_clear_error(runtime, session, ledger):
    ledger.create_session("other", TASK)
    foreign = runtime.append("other", step(0, "cat secret.txt", "the other tenant's secret"))
    with pytest.raises(UnknownStepError, match=f"no step #{foreign.id} in session 's1'"):
        runtime.glimpse(session, foreign.id)
    with pytest.raises(UnknownStepError, match="no step #999999"):
        runtime.glimpse(session, 999_999)
    with pytest.raises(UnknownStepError, match="invalid step id"):
        runtime.glimpse(session, "; DROP TABLE steps")


def test_every_turn_is_audited_with_plan_hash_and_config(runtime, session, ledger):
    turn = runtime.turn(session, "pace", Budget(800))
    (row,) = ledger.audit(session)
    assert row["policy"] == "pace" and row["config_hash"] == turn.plan.config_hash
    assert row["prompt_hash"] == turn.prompt.prompt_hash and row["tokens"] == turn.prompt.tokens
    assert len(row["plan"]) == 12 and {"t", "step_id", "resolution", "reason", "score"} <= set(row["plan"][0])
    assert [p["resolution"] for p in row["plan"]] == [e.resolution.label for e in turn.plan.entries()]
    assert len(row["degradations"]) == len(turn.plan.degradations)


def test_enrichment_is_idempotent_and_turns_never_wait_for_it(runtime, session, ledger):
    assert runtime.enrich(session).summaries == 0
    runtime.append(session, step(12, "cat settings/loader.py", "parse_config database_url"), enrich=False)
    turn = runtime.turn(session, "pace", Budget(100_000))  # the new step has no key or summary yet
    assert turn.t == 13 and turn.plan.resolution[-1] == 0
    assert runtime.enrich(session).summaries == 1 and runtime.enrich(session).keys == 0


def test_a_turn_without_keys_is_planned_on_the_fallback_and_fits(runtime, session):
    """The embedder down: the turn plans as if no key existed yet (PACE's fallback) and stays in budget."""
    with_keys = runtime.turn(session, per_turn("pace"), Budget(2_000), record=False)
    without = runtime.turn(session, per_turn("pace"), Budget(2_000), record=False, keys=False)
    assert without.prompt.tokens <= 2_000
    reasons = {e.reason for e in without.plan.entries()}
    assert not any(r.startswith("w~") for r in reasons)  # nothing was scored by relevance
    assert any(r.startswith("w~") for r in {e.reason for e in with_keys.plan.entries()})
    assert without.plan.entries()[-1].resolution.label == "full"
