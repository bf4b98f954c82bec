import numpy as np
import pytest

from palimpsest.platform import ConfigError, Resolution
from palimpsest.platform.compile.budget import Budget
from palimpsest.platform.policies import (
    AceConfig,
    PaceConfig,
    RollingSummaryConfig,
    WindowConfig,
    build_policy,
    parse_policy_config,
    policy_names,
)
from tests.helpers import PER_TURN, per_turn, step

BUDGET = 100_000


def plan_of(runtime, session, cfg, budget=BUDGET, at=None):
    return runtime.policy(cfg).plan(runtime.snapshot(session, at), budget)


def resolutions(plan):
    return [Resolution(int(r)) for r in plan.resolution]


def test_registry_lists_every_policy():
    assert policy_names() == ["full", "window", "rolling_summary", "pace", "ace", "pace_plus", "observation_masking",
                              "clear_tool_uses"]


def test_unknown_policy_type_is_a_clear_error():
    with pytest.raises(ConfigError, match="unknown policy type 'magic'; known: full, window"):
        parse_policy_config({"type": "magic"})


def test_invalid_policy_values_name_the_field():
    with pytest.raises(ConfigError, match="window policy config: k: Input should be greater than or equal to 1"):
        parse_policy_config({"type": "window", "k": 0})
    with pytest.raises(ConfigError, match="unexpected_key"):
        parse_policy_config({"type": "pace", "unexpected_key": 1})
    with pytest.raises(ConfigError, match="alpha < beta < gamma"):
        parse_policy_config({"type": "pace", "alpha": 2.0})


def test_full_shows_every_step(runtime, session):
    plan = plan_of(runtime, session, "full")
    assert set(resolutions(plan)) == {Resolution.FULL} and len(plan) == 12


def test_window_keeps_the_last_k(runtime, session):
    plan = plan_of(runtime, session, WindowConfig(k=3))
    assert resolutions(plan) == [Resolution.DROP] * 9 + [Resolution.FULL] * 3


def test_pace_puts_the_relevant_old_step_at_full_and_unrelated_ones_at_placeholder(runtime, session):
    plan = plan_of(runtime, session, "pace")
    res = resolutions(plan)
    assert res[1] is Resolution.FULL  # the parse_config source the last steps are about
    assert res[0] is Resolution.PLACEHOLDER and res[2] is Resolution.PLACEHOLDER  # images, weather
    assert res[10] is Resolution.FULL and res[11] is Resolution.FULL  # N = 2 recent steps
    old = plan.score[:10]
    assert old.mean() == pytest.approx(1.0)  # relative weights M*w have mean 1
    assert plan.score[1] == old.max()


def test_pace_thresholds_rise_with_t_and_with_context_size(runtime, session):
    pol = runtime.policy("pace")
    early = runtime.snapshot(session, at=4)
    late = runtime.snapshot(session)
    p_early, p_late = pol.pressure(early, 10_000), pol.pressure(late, 10_000)
    assert p_late > p_early
    assert pol.thresholds(p_late)[0] > pol.thresholds(p_early)[0]
    # a large previous context raises the pressure too
    runtime.turn(session, "pace", Budget(400))
    bigger = runtime.snapshot(session)
    assert pol.pressure(bigger, 400) > p_late
    a, b, g = pol.thresholds(pol.pressure(bigger, 400))
    assert (a, b, g) > pol.thresholds(p_late) and a < b < g


def test_pace_rising_pressure_coarsens_the_plan(runtime, session):
    relaxed = build_policy(PaceConfig(t_max=100_000), runtime.deps).plan(runtime.snapshot(session), BUDGET)
    pressed = build_policy(PaceConfig(t_max=1, lam=1.0), runtime.deps).plan(runtime.snapshot(session), BUDGET)
    assert (pressed.resolution >= relaxed.resolution).all() and (pressed.resolution > relaxed.resolution).any()


def test_pace_missing_summary_falls_back_without_waiting(runtime, ledger):
    ledger.create_session("s", "Fix parse_config database_url KeyError")
    for t in range(6):
        runtime.append("s", step(t, f"cat parse_config_{t}.py", "database_url parse_config " * (t + 1)), enrich=False)
    runtime.enrich("s")  # keys and summaries for steps 0..5
    for t in (6, 7, 8):  # appended, not enriched: no key and no summary yet
        runtime.append("s", step(t, f"cat other_{t}.py", "unrelated"), enrich=False)
    snap = runtime.snapshot("s")
    assert not snap.has_key[6:].any()
    plan = runtime.policy("pace").plan(snap, BUDGET)  # planned at once: nothing waits for the enricher
    assert len(plan) == 9
    assert plan.reasons[int(plan.reason_code[6])] == "no key yet: placeholder"
    assert plan.resolution[6] == Resolution.PLACEHOLDER  # not scored: the cheapest line, glimpse-able
    assert plan.resolution[7] == plan.resolution[8] == Resolution.FULL  # the last N=2 are full regardless


def test_pace_summary_not_ready_goes_full_when_it_fits_else_placeholder(runtime, ledger):
    ledger.create_session("s", "Fix parse_config database_url KeyError")
    runtime.append("s", step(0, "cat settings/loader.py", "parse_config database_url " * 20), enrich=False)
    for t in range(1, 12):
        runtime.append("s", step(t, f"echo {t}", "noise"), enrich=False)
    runtime.append("s", step(12, "grep parse_config database_url", "parse_config database_url"), enrich=False)
    runtime.append("s", step(13, "grep parse_config", "database_url"), enrich=False)
    # keys for every step, summaries for none: PACE wants a summary for some steps but may not wait
    no_sum, no_key = ledger.pending("s", runtime.embedder.name)
    ledger.add_keys("s", [s.id for s in no_key], runtime.embedder.name,
                    runtime.embedder.embed([s.action + s.observation for s in no_key]))
    snap = runtime.snapshot("s")
    pol = runtime.policy(PaceConfig(alpha=0.01, beta=0.02, gamma=50.0))  # everything "detailed"
    roomy = pol.plan(snap, BUDGET)
    assert set(resolutions(roomy)[:12]) == {Resolution.FULL}
    assert "summary not ready; full fits" in roomy.reasons[int(roomy.reason_code[0])]
    tight = pol.plan(snap, snap.prefix_tokens + int(snap.tokens[12:, 0].sum()) + 40)
    assert Resolution.PLACEHOLDER in resolutions(tight)[:12]


def test_ace_keeps_the_latest_step_raw_and_drops_unrelated_steps(runtime, session):
    plan = plan_of(runtime, session, "ace")
    res = resolutions(plan)
    assert res[-1] is Resolution.FULL
    assert res[1] is Resolution.FULL  # shares parse_config / database_url / settings/loader.py
    assert res[0] is Resolution.DROP and res[2] is Resolution.DROP
    assert res[10] is Resolution.FULL  # the failure, about the same identifiers
    assert all(plan.reasons[int(c)] for c in plan.reason_code)


def test_ace_can_render_drops_as_placeholders(runtime, session):
    plan = plan_of(runtime, session, AceConfig(drop_as="placeholder"))
    assert Resolution.DROP not in resolutions(plan)


def test_rolling_summary_folds_past_the_threshold_and_extends_later(runtime, session, ledger):
    cfg = RollingSummaryConfig(keep_last=3, trigger_tokens=200, compaction=PER_TURN)
    first = runtime.turn(session, cfg, Budget(BUDGET))
    assert first.plan.new_fold and first.plan.fold.upto == 9
    assert resolutions(first.plan) == [Resolution.DROP] * 9 + [Resolution.FULL] * 3
    assert "t=1 bash: cat settings/loader.py" in first.plan.fold.text
    again = runtime.turn(session, cfg, Budget(BUDGET))  # same snapshot + stored fold: nothing new to fold
    assert not again.plan.new_fold and again.plan.fold == first.plan.fold
    for t in range(12, 16):
        runtime.append(session, step(t, f"echo more {t}", "x" * 300))
    later = runtime.turn(session, cfg, Budget(BUDGET))
    assert later.plan.new_fold and later.plan.fold.upto == 13
    assert later.plan.fold.text.startswith(first.plan.fold.text)  # kept and extended
    assert ledger.step_at(session, 1).observation.startswith("def parse_config")  # the source is untouched


def test_rolling_summary_is_bounded(runtime, session):
    cfg = RollingSummaryConfig(keep_last=1, trigger_tokens=50, max_summary_tokens=40, compaction=PER_TURN)
    fold = runtime.turn(session, cfg, Budget(BUDGET)).plan.fold
    assert fold.text.startswith("(") and "earlier steps omitted" in fold.text


@pytest.mark.parametrize("name", ["full", "window", "rolling_summary", "pace", "ace", "pace_plus",
                                  "observation_masking", "clear_tool_uses"])
def test_plans_are_pure_functions_of_snapshot_budget_and_config(runtime, session, name):
    snap = runtime.snapshot(session)
    a = runtime.policy(name).plan(snap, 3000)
    b = runtime.policy(name).plan(snap, 3000)
    assert np.array_equal(a.resolution, b.resolution) and np.array_equal(a.score, b.score)
    assert (a.masked is None) == (b.masked is None) and (a.masked is None or np.array_equal(a.masked, b.masked))
    assert [e.reason for e in a.entries()] == [e.reason for e in b.entries()]


def test_pace_refuses_keys_of_another_embedder(runtime, session):
    from palimpsest.platform import HashingEmbedder
    from palimpsest.platform.policies import PolicyDeps

    pol = build_policy("pace", PolicyDeps(embedder=HashingEmbedder(dim=64)))
    with pytest.raises(ConfigError, match="needs keys of 'hashing-64-512'"):
        pol.plan(runtime.snapshot(session), BUDGET)


def test_the_llm_elasticizer_refines_recent_decisions_and_keeps_the_rule_floor(runtime, session):
    from palimpsest.platform.policies import build_policy
    from palimpsest.platform.policies.base import PolicyDeps

    asked = []

    def chat(prompts):
        asked.extend(prompts)
        return ["RAW because it matters", None, "maybe?"] + ["drop"] * (len(prompts) - 3)

    deps = PolicyDeps(embedder=runtime.embedder, tokenizer=runtime.ledger.tokenizer, chat=chat)
    snap = runtime.snapshot(session)
    rule_plan = build_policy({"type": "ace"}, deps).plan(snap, 100_000)
    llm_plan = build_policy({"type": "ace", "elasticizer": "llm", "llm_window": 4}, deps).plan(snap, 100_000)
    m = snap.t
    judged = list(range(m - 1 - 4, m - 1))
    assert len(asked) == 4 and "Answer with one word" in asked[0][0]["content"]
    entries = llm_plan.entries()
    assert entries[judged[0]].resolution.label == "full" and entries[judged[0]].reason == "the model judged it raw"
    for j in judged[1:3]:  # no reply / an unusable reply: the rule decision stands
        assert entries[j].resolution == rule_plan.entries()[j].resolution
    assert entries[judged[3]].resolution.label == "drop"
    assert entries[-1].resolution.label == "full"  # the latest step is always raw
    older = range(0, judged[0])
    assert [entries[i].resolution for i in older] == [rule_plan.entries()[i].resolution for i in older]


def test_the_llm_elasticizer_needs_a_served_model():
    from palimpsest.platform import ConfigError
    from palimpsest.platform.policies import build_policy

    with pytest.raises(ConfigError, match="served actor"):
        build_policy({"type": "ace", "elasticizer": "llm"})


def test_pace_caps_the_length_term_of_pressure(runtime, session):
    """Past T_max the length term t/T_max adds at most length_pressure_max; the budget term is not capped."""
    snap = runtime.snapshot(session)  # t steps, no audited turn yet: pressure is the length term alone
    long_ago = snap.t / 4  # a session four times as long as T_max
    capped = build_policy(PaceConfig(t_max=long_ago, length_pressure_max=1.5), runtime.deps)
    unbounded = build_policy(PaceConfig(t_max=long_ago, length_pressure_max=None), runtime.deps)
    assert capped.pressure(snap, BUDGET) == 1.5 and unbounded.pressure(snap, BUDGET) == pytest.approx(4.0)
    last = snap.upto(snap.t, last_context_tokens={capped.name: 3 * BUDGET})
    assert capped.pressure(last, BUDGET) == pytest.approx(3.0)  # |C_{t-1}| / B_max still counts in full


def test_the_epoch_query_covers_the_task_the_latest_steps_and_their_identifiers(runtime, ledger):
    """A boundary's plan serves the turns until the next one: with ``query: epoch`` a step that one of the last
    8 steps is about is relevant, where the default query (the last 2 steps) does not see it; and a step that
    is itself one of the query's texts is not scored against its own text."""
    from palimpsest.platform.policies.base import EPOCH_QUERY_STEPS, query_relevance, query_steps, query_texts

    ledger.create_session("e", "Repair the billing service.", system="s")
    steps = [("cat weather/forecast_today.txt", "sunny with light wind and warm afternoon temperatures"),
             ("cat invoices/ledger_reconcile.py", "def reconcile_ledger(rows): totals = sum_invoices(rows)"),
             ("cat docs/unrelated_notes.md", "meeting notes about the office party and the cake"),
             ("python -m pytest tests/test_reconcile.py", "reconcile_ledger failed: sum_invoices KeyError")]
    filler = ["garden hose", "piano lesson", "bicycle tyre", "kitchen tiles", "violin strings", "marble statue",
              "copper kettle"]
    steps += [(f"echo {w}", f"{w} noted") for w in filler[:3]]
    steps += [("cat weather/forecast_week.txt", "rain later in the week with wind from the north")]  # step 7
    steps += [(f"echo {w}", f"{w} noted") for w in filler[3:]]
    for t, (a, o) in enumerate(steps):
        runtime.append("e", step(t, a, o))
    snap = runtime.snapshot("e")
    window = query_steps(snap, 2, "epoch")
    assert len(window) == EPOCH_QUERY_STEPS and window[0].t == snap.t - EPOCH_QUERY_STEPS  # steps 4..11
    texts = query_texts(snap.session.task, window, "epoch")
    assert texts[0].startswith("Repair the billing service.")
    assert len(texts) == 1 + EPOCH_QUERY_STEPS + 1  # the task, each step, the live identifiers
    assert "weather/forecast_week.txt" in texts[-1]
    old = np.arange(snap.t - 2)
    default = runtime.policy(per_turn("pace")).relative_weights(snap, old)
    epoch = runtime.policy(per_turn("pace", query="epoch")).relative_weights(snap, old)
    # step 0 (the weather, outside the query's steps) is what step 7 was about: the epoch query ranks it higher
    assert epoch[0] / epoch.mean() > default[0] / default.mean()
    # step 7 is a query text: its score is its best cosine over the other texts, not 1 against itself
    cos = query_relevance(snap, 2, "epoch", runtime.embedder)
    assert cos[7] < 0.99
    # one text for the other layouts, as before
    assert query_texts("task", snap.steps[-2:], "recent_first") == [query_texts("task", snap.steps[-2:])[0]]
