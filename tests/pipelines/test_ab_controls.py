"""The controls' analysis on a recorded run (`palimpsest demo --control`, 2026-12-04, before the planning turn
waited for missing keys): which arm plans how, the direction of each verdict, and the A/A control that came
out wrong (two arms of one configuration served different prompts on 5 of 10 trajectories)."""

import json
from pathlib import Path

from palimpsest.pipelines.ab import ab_summary
from palimpsest.pipelines.ab_controls import AA, CONTROL_ARMS, POSITIVE, control_verdicts, verdicts_markdown
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
    assert a["n"] == 5 and round(a["difference"], 4) == 0.9176 and a["p"] == 0.0625 and not a["significant"]
    assert a["direction"] == "`pace-aa` is further from the full-history actor than `pace`"
    assert v["aa_prompts"] == {"pairs": 10, "differ": 5} and v["aa_status"] == "failed"
    md = verdicts_markdown(v)
    assert "`pace` − `last2`: -0.0088" in md and "A/A: FAILED" in md and "5 of 10 pairs" in md
    # the same records with the prompts in agreement: inconclusive at 5 trajectories, never "ok"
    same = [{**r, "tokens_context": 1000} for r in RUN["served"]]
    assert control_verdicts(positive, aa, same)["aa_status"] == "inconclusive"


def test_the_recorded_aa_pairs_served_different_prompts_under_one_configuration():
    """The finding behind turns.keys_wait_s: the boundary of a session planned on whichever keys existed."""
    ctx = {}
    for r in RUN["served"]:
        key, arm = r["session_id"].rsplit("@", 1)
        ctx.setdefault(key, {})[arm] = r["tokens_context"]
    differ = [k for k, v in ctx.items() if v["pace"] != v["pace-aa"]]
    assert len(ctx) == 10 and len(differ) == 5
