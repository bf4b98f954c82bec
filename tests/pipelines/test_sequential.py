"""The rollout gate's sequential test: anytime-valid under continuous monitoring, with power, margins, and the
gate's promote / withdraw / hold (``experiments.stats.sequential_test``, ``gate_decision``)."""

import math

import numpy as np
import pytest

from palimpsest.experiments.stats import gate_decision, sequential_test


def test_the_false_positive_rate_stays_at_alpha_when_read_after_every_difference():
    """No real difference, normal and heavy-tailed (Student's t, 2 df) per-session differences, read after every
    one of 150: rejected at ANY n on at most alpha of the runs, up to simulation noise. A rejection at any n so
    far is what ``reject`` reports (the prefix test below checks that it is what a reader after every
    difference sees). The fixed-n sign-flip test read the same way fires on ~35% (BENCHMARKS.md)."""
    rng = np.random.default_rng(11)
    reps = 300
    for name, draw in (("normal", rng.standard_normal), ("t2", lambda n: rng.standard_t(2, n))):
        fired = sum(sequential_test(list(draw(150)), alpha=0.05)["reject"] for _ in range(reps))
        assert fired / reps <= 0.05 + 3 * math.sqrt(0.05 * 0.95 / reps), (name, fired)


def test_reading_after_every_difference_sees_what_the_whole_sequence_reports():
    """The e-values of a prefix do not change when more differences arrive (the bets use the past only), so a
    rejection stands, its direction never changes, and the first n at which a reader after every difference
    sees ``reject`` is the ``at`` of the whole sequence."""
    rng = np.random.default_rng(3)
    for shift in (-0.6, 0.0, 0.6, 1.2):
        d = list(rng.standard_normal(70) + shift)
        whole = sequential_test(d)
        seen, first = 0, None
        for k in range(1, len(d) + 1):
            r = sequential_test(d[:k])
            if seen:
                assert r["reject"] and r["direction"] == seen, (shift, k)
            elif r["reject"]:
                seen, first = r["direction"], k
            prefix = sequential_test(d[: k + 1])  # the e-values up to k are those of the longer sequence's
            assert r["e_max_worse"] <= prefix["e_max_worse"] and r["e_max_better"] <= prefix["e_max_better"]
        assert whole["direction"] == seen and (whole["at_better"] if seen == -1 else whole["at_worse"]) == first
        if seen:
            assert whole["reject"] and first is not None


def test_a_clear_shift_is_found_in_its_direction():
    """1.5 sd over 60 sessions: the candidate lower (better, direction -1) or higher (worse, +1) is rejected on
    the right side in nearly every run, and never on the wrong one."""
    rng = np.random.default_rng(5)
    for shift, want in ((-1.5, -1), (1.5, +1)):
        out = [sequential_test(list(rng.standard_normal(60) + shift)) for _ in range(50)]
        assert sum(r["direction"] == want for r in out) >= 48, shift
        assert not any(r["direction"] == -want for r in out)
        assert all(r["n"] == 60 and r["threshold"] == 40.0 and r["alpha"] == 0.05 for r in out)


def test_heavy_tails_and_one_wild_value_do_not_decide():
    """A Cauchy null's runs and a run with one enormous difference: the bets are bounded, so no single value
    moves the wealth by more than a factor of two."""
    d = [0.1, -0.2, 0.05, -0.1, 0.15, 1e12, -0.05, 0.1, -0.15, 0.02]
    r = sequential_test(d)
    assert not r["reject"] and r["e_max_worse"] < 40.0
    small = sequential_test([1e12])
    assert small["e_value_worse"] <= 2.0 and small["e_value_better"] <= 1.0


def test_the_margin_shifts_only_the_non_inferiority_side():
    """margin m: the ``better`` side tests centre >= m (candidate worse by m or more) against below m; the
    ``worse`` side still tests centre <= 0. The differences near 0: shown not worse by 0.3 (non-inferior), not
    shown better at margin 0; centred at 0.5: shown worse, never non-inferior at 0.3."""
    rng = np.random.default_rng(9)
    near = list(0.1 * rng.standard_normal(60))
    ni, plain = sequential_test(near, margin=0.3), sequential_test(near)
    assert ni["direction"] == -1 and ni["at_better"] is not None and ni["at_worse"] is None
    assert not plain["reject"]
    assert ni["e_value_worse"] == plain["e_value_worse"]  # the worse side does not move with the margin
    shifted = sequential_test([x - 0.3 for x in near])
    assert ni["e_value_better"] == pytest.approx(shifted["e_value_better"])
    worse = sequential_test([0.5 + x for x in near], margin=0.3)
    assert worse["direction"] == +1 and worse["at_better"] is None
    for bad in (-0.1, float("nan")):
        with pytest.raises(ValueError):
            sequential_test(near, margin=bad)


def test_non_finite_differences_are_counted_and_positions_kept():
    d = [-2.0, float("nan"), -1.5, -2.5, float("inf"), -1.8, -2.2, -1.9, -2.1, -2.4, -1.7, -2.0, -2.3]
    r = sequential_test(d)
    assert r["dropped_nan"] == 2 and r["n"] == 11
    clean = sequential_test([x for x in d if math.isfinite(x)])
    assert r["e_value_better"] == clean["e_value_better"]
    assert r["at_better"] is not None and math.isfinite(d[r["at_better"] - 1])  # a position in the input
    assert r["at_better"] == clean["at_better"] + sum(not math.isfinite(x) for x in d[: r["at_better"]])
    empty = sequential_test([float("nan")])
    assert empty["n"] == 0 and empty["dropped_nan"] == 1 and not empty["reject"]


def test_the_gate_promotes_withdraws_or_holds():
    rng = np.random.default_rng(21)
    noise = lambda n: rng.standard_normal(n)  # noqa: E731
    n = 80
    better = gate_decision(list(noise(n) - 1.5), list(noise(n) + 2.0))
    assert better["decision"] == "promote" and better["primary"] == "kl" and "better" in better["reason"]
    assert better["cost"]["at"] is None  # more expensive, and still promoted: shown better on quality
    worse = gate_decision(list(noise(n) + 1.5), list(noise(n) - 2.0))
    assert worse["decision"] == "withdraw" and worse["at"] == worse["quality"]["worse"]["at"]
    q = list(0.1 * noise(n))  # quality unchanged
    cheap = gate_decision(q, list(noise(n) - 2.0), margin=0.3)
    assert cheap["decision"] == "promote" and "billed ids shown lower" in cheap["reason"]
    assert cheap["at"] == max(cheap["quality"]["non_inferior"]["at"], cheap["cost"]["at"])
    dear = gate_decision(q, list(noise(n) + 2.0), margin=0.3)
    assert dear["decision"] == "hold" and dear["quality"]["non_inferior"]["at"] is not None
    assert gate_decision(q, list(noise(n) - 2.0))["decision"] == "hold"  # margin 0: not worse is not shown
    few = gate_decision([-3.0, -2.5, -3.2, -2.8], [-5.0] * 4)
    assert few["decision"] == "hold" and few["at"] is None
    with pytest.raises(ValueError):
        gate_decision([0.1, 0.2], [1.0])


def test_the_gate_splits_alpha_over_candidates_and_decisions():
    g = gate_decision([0.0] * 5, [0.0] * 5, alpha=0.05, candidates=4)
    assert g["alpha_withdraw"] == pytest.approx(0.05 / 8) and g["alpha_promote_each"] == pytest.approx(0.05 / 16)
    assert g["quality"]["worse"]["threshold"] == pytest.approx(160.0)
    assert g["quality"]["better"]["threshold"] == pytest.approx(320.0) == g["cost"]["threshold"]
    # the same evidence that promotes one candidate can hold among forty
    d = list(np.random.default_rng(2).standard_normal(14) - 1.5)
    one, many = gate_decision(d, [0.0] * 14), gate_decision(d, [0.0] * 14, candidates=40)
    assert one["decision"] == "promote" and many["decision"] == "hold"


def test_the_gate_on_aa_noise_rarely_decides():
    """Quality and cost both unchanged: promote or withdraw at any of 100 sessions on at most alpha of runs."""
    rng = np.random.default_rng(17)
    reps = 150
    decided = sum(gate_decision(list(rng.standard_t(3, 100)), list(rng.standard_normal(100)))["decision"] != "hold"
                  for _ in range(reps))
    assert decided / reps <= 0.05 + 3 * math.sqrt(0.05 * 0.95 / reps)
