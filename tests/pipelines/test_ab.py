"""The per-arm A/B comparison: means with intervals, differences from the control arm, per-session outcomes."""

import math

import pytest

from palimpsest.pipelines.ab import ab_summary, diff_ci, mean_ci, summary_markdown
from palimpsest.platform import Ledger
from palimpsest.platform.types import LedgerError


def served(arm, sid, tokens, ms):
    return {"arm": arm, "session_id": sid, "t": 1, "tokens_context": tokens, "tokens_prompt": tokens + 10,
            "tokens_soft": 0, "plan_ms": 2.0, "memory_ms": 0.0, "actor_ms": ms, "total_ms": ms + 5, "glimpses": 0}


def test_mean_ci_and_welch_difference():
    a = mean_ci([1.0, 2.0, 3.0, 4.0])
    assert a["mean"] == 2.5 and a["lo"] < 2.5 < a["hi"]
    assert math.isclose(a["hi"] - a["mean"], 3.182 * a["sd"] / 2)  # Student's t, 3 degrees of freedom
    d = diff_ci(a, mean_ci([11.0, 12.0, 13.0, 14.0]))
    assert d["diff"] == 10.0 and d["lo"] > 0  # clearly different
    assert math.isnan(mean_ci([])["mean"])


def test_paired_trajectories_detect_a_difference_the_unpaired_comparison_cannot():
    """Ten trajectories, each run once per arm (sessions ID@ARM). Trajectories differ a lot from each other and
    arm b is better by a small constant on every one: only the paired comparison can tell, and the report says so
    with the smallest difference each comparison could detect at 80% power."""
    import random

    rng = random.Random(0)
    level = {f"traj{i}": rng.uniform(0.0, 2.0) for i in range(10)}
    rows, shadows, outcomes = [], [], []
    for traj, base in level.items():
        for arm, shift in (("a", 0.0), ("b", -0.05)):
            sid = f"demo/{traj}@{arm}"
            for t in (4, 12):
                rows.append(served(arm, sid, 1000, 100.0))
                shadows.append({"session_id": sid, "t": t, "arm": arm, "status": "scored", "reason": "",
                                "reference": "full", "kl": base + shift + rng.gauss(0, 0.005), "top1": 0.5, "tokens": 4})
            shadows.append({"session_id": sid, "t": 20, "arm": arm, "status": "skipped", "reason": "load: queue full",
                            "reference": "", "kl": None, "top1": None, "tokens": 4})
            outcomes.append({"arm": arm, "session_id": sid, "value": base / 2})
    s = ab_summary(rows, outcomes, ["a", "b"], shadows)
    b = s["arms"]["b"]
    assert b["fidelity"]["scored"] == 20 and b["fidelity"]["skipped"] == 10
    assert b["fidelity"]["skip_reasons"] == {"load: queue full": 10} and b["fidelity"]["references"] == {"full": 20}
    unpaired = b["vs_control"]["fidelity_kl"]
    assert unpaired["lo"] < 0 < unpaired["hi"]  # lost in the between-trajectory spread
    assert b["power"]["fidelity_kl_mde"] > 0.3
    paired = s["paired"]["b"]["kl"]
    assert paired["n"] == 10 and paired["significant"] and paired["hi"] < 0
    assert paired["mde"] < 0.05 < b["power"]["fidelity_kl_mde"]
    assert not s["paired"]["b"]["outcome"]["significant"]  # identical outcomes: no difference
    md = summary_markdown(s)
    assert "Paired by trajectory" in md and "| shadow fidelity KL | 10 |" in md and "80% power" in md


def test_summary_separates_arms_and_counts_outcomes_per_session():
    rows = [served("a", f"s{i}", 1000 + i, 100.0) for i in range(10)] + \
           [served("b", f"t{i}", 500 + i, 120.0) for i in range(10)] + [{"arm": "b", "session_id": "t0", "t": 2, "error": "RuntimeError"}]
    outcomes = [{"arm": "a", "session_id": "s0", "value": 0.0}, {"arm": "a", "session_id": "s0", "value": 1.0},
                {"arm": "a", "session_id": "s1", "value": 0.0}, {"arm": "b", "session_id": "t1", "value": 1.0}]
    s = ab_summary(rows, outcomes, ["a", "b"])
    a, b = s["arms"]["a"], s["arms"]["b"]
    assert (a["turns"], a["errors"], b["turns"], b["errors"]) == (10, 0, 10, 1)
    assert a["outcome"]["n"] == 2 and a["outcome"]["mean"] == 0.5  # the last outcome of a session counts
    assert b["vs_control"]["tokens_context"]["diff"] == pytest.approx(-500.0)
    assert b["vs_control"]["tokens_context"]["hi"] < 0
    md = summary_markdown(s)
    assert "| context tokens" in md and "control arm `a`" in md


def test_outcomes_are_recorded_append_only(ledger_url):
    led = Ledger(ledger_url)
    led.create_session("s", "task")
    led.record_outcome("s", "a", 1.0, "solved")
    led.record_served("s", 0, "a", {"tokens_context": 10})
    assert led.outcomes()[0]["value"] == 1.0 and led.served()[0]["tokens_context"] == 10
    with pytest.raises(LedgerError):
        led.record_outcome("s", "a", float("nan"))
    with pytest.raises(Exception, match="append-only"), led.transaction() as db:
        db.execute("DELETE FROM outcomes")
