"""The per-arm A/B comparison: means with intervals, differences from the control arm, per-session outcomes."""

import math

import pytest

from palimpsest.experiments.ab_report import ab_summary, summary_markdown
from palimpsest.experiments.stats import diff_ci, mean_ci, wilson
from palimpsest.platform import Ledger
from palimpsest.platform.types import LedgerError


def served(arm, sid, tokens, ms):
    return {"arm": arm, "session_id": sid, "t": 1, "tokens_context": tokens, "tokens_prompt": tokens + 10,
            "tokens_soft": 0, "plan_ms": 2.0, "memory_ms": 0.0, "actor_ms": ms, "total_ms": ms + 5, "glimpses": 0}


def test_bootstrap_means_and_differences():
    a = mean_ci([1.0, 2.0, 3.0, 4.0])
    assert a["mean"] == 2.5 and 1.0 <= a["lo"] < 2.5 < a["hi"] <= 4.0
    assert mean_ci([1.0, 2.0, 3.0, 4.0]) == a  # seeded: a report is reproducible
    d = diff_ci([1.0, 2.0, 3.0, 4.0], [11.0, 12.0, 13.0, 14.0])
    assert d["diff"] == 10.0 and d["lo"] > 0  # clearly different
    assert math.isnan(mean_ci([])["mean"]) and math.isnan(mean_ci([3.0])["lo"])  # no interval from one value


def test_intervals_stay_within_the_range_of_what_they_bound():
    """Top-1 agreement 0.948 over 2-3 sessions got [0.551, 1.345] from Student's t; a proportion's interval
    must stay in [0, 1] (and a KL's above 0) however few and skewed the values are."""
    for xs in ([1.0, 1.0, 0.844], [1.0, 0.5], [0.0, 0.0, 0.0, 1.0], [0.999, 1.0, 1.0, 1.0, 0.2]):
        ci = mean_ci(xs)
        assert 0.0 <= ci["lo"] <= ci["mean"] <= ci["hi"] <= 1.0, (xs, ci)
    kl = mean_ci([0.001, 0.002, 0.9])
    assert kl["lo"] >= 0.0
    d = diff_ci([1.0, 1.0, 0.9], [0.0, 0.1, 0.05])
    assert -1.0 <= d["lo"] <= d["hi"] <= 1.0
    for k, n in ((0, 3), (3, 3), (1, 2), (0, 1), (40, 41)):
        w = wilson(k, n)
        assert 0.0 <= w["lo"] <= w["p"] <= w["hi"] <= 1.0, (k, n, w)
    assert wilson(0, 3)["hi"] > 0.0 and wilson(3, 3)["lo"] < 1.0  # no degenerate [0, 0] or [1, 1]


def test_identical_turns_are_counted_apart_and_references_are_never_pooled():
    """Arm `b` serves the reference itself on some turns (KL 0 by construction): the arm's fidelity mean is over
    the turns it changed, the identical ones are counted; `full` and `policy@window` references are reported
    apart; in the paired comparison a turn where both arms served the reference is left out (counted) and one
    side's skip leaves the pair unpaired, with the reason."""
    shadows = []

    def rec(arm, traj, t, status, kl=None, top1=None, reference="full", reason=""):
        shadows.append({"session_id": f"d/{traj}@{arm}", "t": t, "arm": arm, "status": status, "reason": reason,
                        "reference": reference, "kl": kl, "top1": top1, "tokens": 4})

    for i in range(6):
        traj = f"tr{i}"
        rec("a", traj, 4, "identical")
        rec("b", traj, 4, "identical")  # both served the reference: difference 0 by construction
        rec("a", traj, 12, "scored", 0.2 + 0.01 * i, 0.5)
        rec("b", traj, 12, "identical")  # b changed nothing here: an exact 0, and not in b's mean
        rec("a", traj, 20, "scored", 0.3, 0.5, reference="pace@8167")
        rec("b", traj, 20, "scored", 0.9, 0.25, reference="pace@8167")
        rec("a", traj, 28, "scored", 0.4, 0.5)
        rec("b", traj, 28, "skipped", reason="load: stale")
    s = ab_summary([served("a", "d/tr0@a", 100, 1.0)], [], ["a", "b"], shadows)
    fa, fb = s["arms"]["a"]["fidelity"], s["arms"]["b"]["fidelity"]
    assert (fb["scored"], fb["identical"], fb["skipped"]) == (6, 12, 6)
    assert fb["identical_share"]["k"] == 12 and fb["identical_share"]["n"] == 18
    full_b, window_b = fb["by_reference"]["full"], fb["by_reference"]["policy@window"]
    assert full_b["scored"] == 0 and full_b["identical"] == 12 and full_b["kl"]["n"] == 0  # no zeros averaged in
    assert window_b["kl"]["mean"] == pytest.approx(0.9) and window_b["references"] == {"pace@8167": 6}
    # a's session means over its scored turns (t=12, t=28); its identical t=4 would pull them to ~0.21
    assert fa["by_reference"]["full"]["kl"]["mean"] == pytest.approx((0.225 + 0.4) / 2)
    paired = s["paired"]["b"]
    assert paired["kl:full"]["both_identical"] == 6 and paired["kl:full"]["pairs"] == 6  # t=12 only
    assert paired["kl:full"]["mean"] == pytest.approx(-(0.2 + 0.025), abs=1e-9)  # b's exact 0 minus a's KL
    assert paired["kl:policy@window"]["pairs"] == 6 and paired["kl:policy@window"]["mean"] == pytest.approx(0.6)
    assert paired["unpaired"] == {"b: load: stale": 6}
    md = summary_markdown(s)
    assert "vs `policy@window`" in md and "6 turn pairs where both arms served the `full` reference" in md


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
                                "reference": "full", "kl": base + shift + rng.gauss(0, 0.005), "top1": 0.5,
                                "tokens": 4})
            shadows.append({"session_id": sid, "t": 20, "arm": arm, "status": "skipped", "reason": "load: queue full",
                            "reference": "", "kl": None, "top1": None, "tokens": 4})
            outcomes.append({"arm": arm, "session_id": sid, "value": base / 2})
    s = ab_summary(rows, outcomes, ["a", "b"], shadows)
    b = s["arms"]["b"]
    assert b["fidelity"]["scored"] == 20 and b["fidelity"]["skipped"] == 10
    assert b["fidelity"]["skip_reasons"] == {"load: queue full": 10}
    assert b["fidelity"]["by_reference"]["full"]["references"] == {"full": 20}
    unpaired = b["vs_control"]["fidelity_kl_full"]
    assert unpaired["lo"] < 0 < unpaired["hi"]  # lost in the between-trajectory spread
    assert b["power"]["fidelity_kl_full_mde"] > 0.3
    paired = s["paired"]["b"]["kl:full"]
    assert paired["n"] == 10 and paired["pairs"] == 20 and paired["significant"] and paired["hi"] < 0
    assert paired["mde"] < 0.05 < b["power"]["fidelity_kl_full_mde"]
    assert paired["p"] == 2 / 2 ** 10  # every trajectory's difference has the same sign: the exact test's floor
    assert not s["paired"]["b"]["outcome"]["significant"]  # identical outcomes: no difference
    md = summary_markdown(s)
    assert "Paired by trajectory" in md and "| fidelity KL vs `full` | 10 (20) |" in md and "80% power" in md


def test_summary_separates_arms_and_counts_outcomes_per_session():
    rows = [served("a", f"s{i}", 1000 + i, 100.0) for i in range(10)] + \
           [served("b", f"t{i}", 500 + i, 120.0) for i in range(10)] + \
           [{"arm": "b", "session_id": "t0", "t": 2, "error": "RuntimeError"}]
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


def test_the_paired_test_keeps_its_level_exactly_at_the_sample_sizes_of_a_rollout():
    """No real difference: given the sizes of the differences (normal or Cauchy), each of the 2^n sign patterns
    is equally likely, so the share of patterns the test calls significant IS its level, computed exactly
    here over all of them: 2 floor(0.05 2^(n-1)) / 2^n, at most 5% (0 at 5 pairs or fewer: 2/2^5 > 0.05). A test
    that is not exact (Student's t, a bootstrap, an interval: 10-25% here) gives another share."""
    import itertools

    import numpy as np

    from palimpsest.experiments.stats import sign_flip_p

    rng = np.random.default_rng(7)
    for n in (3, 4, 5, 6, 8, 10):
        for draw in (rng.standard_normal, rng.standard_cauchy):
            size = np.abs(draw(n))
            level = np.mean([sign_flip_p(list(size * np.array(s))) <= 0.05
                             for s in itertools.product((1.0, -1.0), repeat=n)])
            assert level == 2 * math.floor(0.05 * 2 ** (n - 1)) / 2 ** n <= 0.05, (n, draw.__name__, level)
    # beyond 16 pairs, Monte Carlo: at its level on noise up to simulation error
    rate = np.mean([sign_flip_p(list(rng.standard_t(2, 24)), seed=k) <= 0.05 for k in range(300)])
    assert rate <= 0.05 + 2.5 * (0.05 * 0.95 / 300) ** 0.5


def test_the_paired_test_finds_a_real_difference_and_its_interval_matches_it():
    """The interval is the set of mean shifts the test does not reject: just inside either end the shifted
    differences' p is above 5%, just outside it is at most 5% (a t or bootstrap interval fails this)."""
    from palimpsest.experiments.stats import paired_test, sign_flip_p

    d = [0.9, 1.1, 1.3, 0.7, 1.0, 1.2, 0.8, 1.05]
    shifted = paired_test(d)
    assert shifted["significant"] and shifted["p"] == 2 / 2 ** 8 and 0 < shifted["lo"] < 1 < shifted["hi"]
    for end, out in ((shifted["lo"], -1), (shifted["hi"], +1)):
        eps = 1e-6
        assert sign_flip_p([x - (end - out * eps) for x in d]) > 0.05, end
        assert sign_flip_p([x - (end + out * eps) for x in d]) <= 0.05, end
    # an end is a shift where an assignment's |mean| ties the observed one: the mean of a subset of the pairs
    # (here of three), not the mean +- a t quantile x se (0.838, 1.174)
    assert shifted["lo"] == pytest.approx((0.7 + 1.0 + 0.8) / 3, abs=1e-9)
    assert shifted["hi"] == pytest.approx((1.3 + 1.2 + 1.05) / 3, abs=1e-9)
    assert shifted["mde"] < 1.0  # detectable: it was detected
    few = paired_test([1.0, 1.1, 0.9])
    assert not few["significant"] and few["lo"] == float("-inf") and few["mde"] == float("inf")
    noise = paired_test([0.3, -0.2, 0.1, -0.4, 0.2, -0.1, 0.25, -0.3])
    assert not noise["significant"] and noise["lo"] < 0 < noise["hi"]
    big = paired_test([1.0 + 0.1 * k for k in range(20)])  # beyond 16 pairs: Monte Carlo, seeded
    assert big["significant"] and not big["exact"] and big == paired_test([1.0 + 0.1 * k for k in range(20)])


def test_the_paired_test_counts_the_differences_it_leaves_out():
    """A NaN difference (a trajectory without a score) is left out of the test and counted, never silently."""
    from palimpsest.experiments.stats import paired_test

    d = [0.9, 1.1, 1.3, 0.7, 1.0, 1.2, 0.8, 1.05]
    r = paired_test(d + [float("nan"), float("inf")])
    assert r["dropped_nan"] == 2 and r["n"] == 8 and r["p"] == paired_test(d)["p"]
    assert paired_test(d)["dropped_nan"] == 0 and paired_test([float("nan")])["dropped_nan"] == 1


def test_the_detectable_difference_uses_the_tests_own_assignments_up_to_sixteen_pairs():
    """The mde is the smallest shift the test rejects on 80% of 400 seeded normal samples; up to 16 pairs the
    test enumerates every assignment, and so must the mde: the exact test's rate at the mde is 80% or more,
    and just below it under 80%."""
    import numpy as np

    from palimpsest.experiments.stats import _sign_flips, paired_test

    n, sd = 14, 1.0
    d = list(np.random.default_rng(4).standard_normal(n))
    d = [x * sd / float(np.std(d, ddof=1)) for x in d]  # sample sd exactly 1
    r = paired_test(d)
    assert r["exact"]
    noise = np.random.default_rng(1).standard_normal((400, n)) * sd  # _detectable's draws (seed 0 + 1)
    signs = _sign_flips(n, 0)

    def exact_rate(shift):
        x = noise + shift
        observed = np.abs(x.mean(1))
        hits = (np.abs(x @ signs.T / n) >= observed[:, None] - 1e-12 * np.maximum(1.0, observed)[:, None]).sum(1)
        return float((hits / len(signs) <= 0.05).mean())

    assert exact_rate(r["mde"]) >= 0.8 > exact_rate(r["mde"] * 0.999), r["mde"]


def test_an_arms_billed_cost_counts_its_summary_calls_with_the_split_shown(tmp_path):
    """LLM summary calls are recorded under the session's arm (served rows of kind `summary`, apart from the
    turns) and added to the arm's billed input per turn, split: turns + summaries = total."""
    from types import SimpleNamespace

    from palimpsest.platform import Runtime
    from palimpsest.serving.turn.enrichment import Enrichment
    from tests.helpers import TASK

    rt = Runtime(Ledger(str(tmp_path / "l.db")))
    for sid in ("a@pace", "a@window"):
        rt.ledger.create_session(sid, TASK)
        rt.ledger.record_served(sid, 1, sid.split("@")[1],
                                {**served(sid.split("@")[1], sid, 100, 10.0), "billed": 50.0})
        rt.ledger.record_served(sid, 2, sid.split("@")[1],
                                {**served(sid.split("@")[1], sid, 100, 10.0), "billed": 70.0})
    lane = SimpleNamespace(runtime=rt, arm_of=lambda sid: sid.split("@")[1])
    Enrichment._record_calls(lane, "a@pace", [{"calls": 1, "input": 300, "cached": 100, "generated": 40},
                                              {"calls": 1, "input": 200, "cached": 0, "generated": 30}])
    Enrichment._record_calls(lane, "a@window", [{"calls": 0, "input": 0, "cached": 0, "generated": 0}])  # rule writer
    turns, calls = rt.ledger.served(), rt.ledger.served(kind="summary")
    assert len(turns) == 4 and len(calls) == 1 and len(rt.ledger.served(kind=None)) == 5
    s = ab_summary(turns, [], ["window", "pace"], [], calls)
    p, w = s["arms"]["pace"]["summary_calls"], s["arms"]["window"]["summary_calls"]
    assert s["arms"]["pace"]["turns"] == 2  # summary rows are not turns
    assert (p["calls"], p["input"], p["cached"], p["generated"]) == (2, 500, 100, 70)
    billed = 400 + 0.1 * 100  # uncached + the cached rate x cached
    assert p["billed"] == pytest.approx(billed) and p["billed_per_turn"] == pytest.approx(billed / 2)
    assert s["arms"]["pace"]["cost"]["total"] == pytest.approx(60.0 + billed / 2)
    assert w["calls"] == 0 and s["arms"]["window"]["cost"]["total"] == pytest.approx(60.0)
    md = summary_markdown(s)
    assert ("| LLM summary calls: calls / input ids (cached) / generated ids / timed out (counted with the ids sent) "
            "| 0 / 0 (0) / 0 / 0 | 2 / 500 (100) / 70 / 0 |") in md
    assert f"60.0 + {billed / 2:.1f} + 0.0 = {60 + billed / 2:.1f}" in md
