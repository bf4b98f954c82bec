"""The controls' analysis on a recorded run (`palimpsest demo --control`, 2026-12-04, before the planning turn
waited for missing keys): which arm plans how, the direction of each verdict, and the A/A control that came
out wrong (two arms of one configuration served different prompts on 5 of 10 trajectories)."""

import json
from pathlib import Path

from palimpsest.experiments.ab_report import ab_summary
from palimpsest.experiments.controls import (
    AA,
    CONTROL_ARMS,
    POSITIVE,
    audit_rows,
    control_verdicts,
    differing_prompts,
    verdicts_markdown,
)
from palimpsest.platform.compile.budget import Budget
from palimpsest.platform.policies import parse_policy_config

RUN = json.loads((Path(__file__).parents[1] / "fixtures" / "control_run_20261204.json").read_text())


def _summaries():
    served, shadows, outcomes = RUN["served"], RUN["shadows"], RUN["outcomes"]
    return ab_summary(served, outcomes, list(POSITIVE), shadows), ab_summary(served, outcomes, list(AA), shadows)


def test_the_control_arms_plan_as_their_names_say():
    modes = {a["name"]: parse_policy_config(a["policy"]).compaction.mode for a in CONTROL_ARMS}
    assert modes == {"last2": "per_turn", "pace": "epochs", "pace-per-turn": "per_turn", "pace-aa": "epochs"}
    positive, _ = _summaries()
    kinds = {arm: per["turn_kinds"]["full"] for arm, per in positive["paired"].items()}
    # as recorded: the epochs arm's scored turns are boundaries (and one append), the per-turn arm's all plan
    assert kinds == {"pace": {"boundary": 5, "append": 1}, "pace-per-turn": {"per turn": 6}}


def test_each_verdict_states_its_direction_as_the_run_recorded_it():
    positive, aa = _summaries()
    v = control_verdicts(positive, aa, RUN["served"])
    by = {r["arm"]: r for r in v["positive"]}
    # arm − last2 in KL to the full history: negative means closer to the full-history actor
    assert by["pace"]["n"] == 6 and round(by["pace"]["difference"], 4) == -0.0088
    assert by["pace"]["direction"] == "`pace` is closer to the full-history actor than `last2`"
    assert not by["pace"]["significant"] and round(by["pace"]["p"], 3) == 0.812
    assert round(by["pace-per-turn"]["difference"], 4) == -0.0067 and not by["pace-per-turn"]["significant"]
    # the A/A control: the test cannot reject at 5 trajectories (2/2^5 = 0.0625), but 5 of 10 pairs of one
    # configuration served different prompts: failed, whatever p says
    a = v["aa"]
    assert a["n"] == 5 and round(a["difference"], 4) == 0.9176 and a["p"] == 0.0625  # the floor: 2/2^5
    assert a["direction"] == "`pace-aa` is further from the full-history actor than `pace`"
    # the recorded run has no prompt hashes on its served rows: compared by size, and said so
    assert v["aa_prompts"] == {"pairs": 10, "differ": 5, "by_size": 10} and v["aa_status"] == "failed"
    md = verdicts_markdown(v)
    assert "`pace` − `last2`: -0.0088" in md and "A/A: FAILED" in md
    assert "served prompts that differ: 5 of 10 pairs (10 compared by size only: no prompt hash)" in md
    # the same records with the prompts in agreement: inconclusive at 5 trajectories, never "ok"
    same = [{**r, "tokens_context": 1000} for r in RUN["served"]]
    assert control_verdicts(positive, aa, same)["aa_status"] == "inconclusive"


def _aa_run(diffs, hashes):
    """An A/A run of len(diffs) trajectories, one scored turn each: `pace-aa`'s KL minus `pace`'s is diffs[i],
    both arms' prompts of one size, with the audit's prompt hashes ``hashes[i]`` = (pace's, pace-aa's)."""
    served, shadows, audit = [], [], []
    for i, (d, hs) in enumerate(zip(diffs, hashes)):
        for arm, kl, h in (("pace", 0.5, hs[0]), ("pace-aa", 0.5 + d, hs[1])):
            sid = f"run/tr{i}@{arm}"
            served.append({"arm": arm, "session_id": sid, "t": 8, "tokens_context": 1000, "tokens_prompt": 1000})
            shadows.append({"session_id": sid, "t": 8, "arm": arm, "status": "scored", "reason": "",
                            "reference": "full", "kl": kl, "top1": 0.5, "tokens": 4})
            audit.append({"session_id": sid, "t": 8, "prompt_hash": h})
    summary = ab_summary(served, [], list(AA), shadows)
    return summary, served, audit


def test_the_aa_verdict_follows_the_test_and_the_prompts_hashes():
    """Eight A/A trajectories (the test can reject from 6): noise is ``ok``; every difference of one sign is
    significant and ``failed``; prompts of equal size but different content (hash) are ``failed`` whatever
    the test says, and without hashes the pair is compared by size and counted as such."""
    noise = [0.02, -0.03, 0.01, -0.01, 0.03, -0.02, 0.015, -0.025]
    same = [("h%d" % i, "h%d" % i) for i in range(8)]
    summary, served, audit = _aa_run(noise, same)
    ok = control_verdicts(summary, summary, served, audit)
    assert ok["aa"]["n"] == 8 and not ok["aa"]["significant"] and ok["aa_status"] == "ok"
    assert ok["aa_prompts"] == {"pairs": 8, "differ": 0, "by_size": 0}
    shifted, served_s, audit_s = _aa_run([abs(x) + 0.01 for x in noise], same)
    bad = control_verdicts(shifted, shifted, served_s, audit_s)
    assert bad["aa"]["significant"] and bad["aa"]["p"] == 2 / 2 ** 8 and bad["aa_status"] == "failed"
    one_differs = [*same[:3], ("h3", "other"), *same[4:]]
    summary, served, audit = _aa_run(noise, one_differs)
    v = control_verdicts(summary, summary, served, audit)
    assert v["aa_prompts"] == {"pairs": 8, "differ": 1, "by_size": 0} and v["aa_status"] == "failed"
    assert "served prompts that differ: 1 of 8 pairs" in verdicts_markdown(v)
    assert differing_prompts([{**r, "prompt_hash": a["prompt_hash"]} for r, a in zip(served, audit)]) == \
        v["aa_prompts"]  # a hash on the served row itself counts as well
    assert differing_prompts(served) == {"pairs": 8, "differ": 0, "by_size": 8}  # sizes agree: not a proof


def test_audit_rows_read_each_sessions_prompt_hashes_from_the_ledger(runtime, session, ledger):
    """What a run joins onto its served turns: each audited turn's prompt hash, per session."""
    turn = runtime.turn(session, "pace", Budget(800))
    assert audit_rows(ledger, [session]) == [{"session_id": session, "t": turn.t,
                                               "prompt_hash": turn.prompt.prompt_hash}]
    other = runtime.turn(session, "pace", Budget(400))
    rows = audit_rows(ledger, {session})
    assert [r["prompt_hash"] for r in rows] == [turn.prompt.prompt_hash, other.prompt.prompt_hash]
