"""The demo's own pieces that need no models: its arms (the demo's, or the positive control's), the breakdown of
where the models' time went, and the progress lines."""

from pathlib import Path

from rich.console import Console

from palimpsest.demo import CONTROL_ARMS, DEMO_SERVE, Progress, busy_markdown, demo_config, show_markdown
from palimpsest.platform.compile.budget import Budget

ROOT = Path(__file__).resolve().parents[1]


def test_the_demo_serves_pace_and_judges_a_dark_candidate_on_every_turn_and_the_control_a_weak_arm():
    from palimpsest.demo import candidate_arm

    cfg = demo_config(ROOT / DEMO_SERVE, control=False, full=False)
    assert [a.name for a in cfg.arms] == ["pace"] and cfg.summarizer.mode == "rule"
    assert cfg.ab.shadow_rate == 1.0 and cfg.ab.shadow_queue >= 100  # every turn scored, none skipped for load
    assert cfg.ab.candidate_rate == 1.0 and cfg.ab.gate_min_pairs <= 8  # the gate reads every pair of the run
    memory, window = candidate_arm(True), candidate_arm(False)  # the registered memory, or window when it does not fit
    assert (memory.name, memory.memory, memory.candidate_of, memory.stage) == ("pace+memory", True, "pace", "dark")
    assert (window.name, window.memory, window.candidate_of) == ("window", False, "pace")
    control = demo_config(ROOT / DEMO_SERVE, control=True, full=False)
    assert [a.name for a in control.arms] == [a["name"] for a in CONTROL_ARMS] == [
        "last2", "pace", "pace-per-turn", "pace-aa"]
    last2 = control.arm("last2").policy_config()
    assert last2.type == "window" and last2.k == 2 and last2.compaction.mode == "per_turn"
    # the default configuration users run (compaction epochs) beside the seeds' per-turn planning, and the A/A
    # arm: the very configuration of `pace`
    assert control.arm("pace").policy_config().compaction.mode == "epochs"
    assert control.arm("pace-per-turn").policy_config().compaction.mode == "per_turn"
    assert control.arm("pace-aa").policy_config() == control.arm("pace").policy_config()
    assert demo_config(ROOT / DEMO_SERVE, control=False, full=True).summarizer.mode == "llm"


def test_the_breakdown_names_every_load_with_its_tokens_and_seconds():
    busy = {"actor": {"turn": {"requests": 3, "prompt_tokens": 6000, "cached_tokens": 2048, "completion_tokens": 72,
                               "prefill_s": 30.5, "decode_s": 9.25},
                      "summary": {"requests": 40, "prompt_tokens": 12000, "cached_tokens": 0, "completion_tokens": 1900,
                                  "prefill_s": 80.0, "decode_s": 120.0}},
            "memory": {"memory": {"calls": 2, "seconds": 20.0, "tokens": 4096},
                       "shadow": {"calls": 3, "seconds": 45.0, "tokens": 9000}}}
    md = busy_markdown(busy, {"serve (stage)": 100.0})
    assert "| actor: turn | 3 | 6,000 (2,048) | 72 | 30.5 | 9.2 |" in md
    assert "| actor: summary | 40 | 12,000 (0) | 1,900 | 80.0 | 120.0 |" in md
    assert "| shadow scoring (HF forwards) | 3 | 9,000 | - | 45.0 | - |" in md
    assert "| memory encoding | 2 | 4,096 |" in md and "| serve (stage) | 100 |" in md


def test_progress_lines_carry_the_stage_and_an_eta():
    out = Console(record=True, width=200)
    p = Progress(out, stages=2)
    p.stage("traffic: 3 trajectories")
    p.step(0, 4, "sessions")
    p.step(2, 4, "sessions")
    p.stage("report")
    text = out.export_text()
    assert "1/2. traffic" in text and "[1/2] 0/4 sessions" in text and "ETA ?" in text
    import re

    assert re.search(r"\[1/2\] 2/4 sessions; \d+ s elapsed, ETA \d+ s", text), text
    assert set(p.seconds) == {"traffic"}


def test_a_control_run_may_widen_the_budget_and_the_reference_window_together():
    import pytest

    from palimpsest.platform.types import PalimpsestError

    cfg = demo_config(ROOT / DEMO_SERVE, control=True, full=False, budget=4096, window=8192)
    assert (cfg.budget, cfg.actor.max_model_len) == (4096, 8192)
    with pytest.raises(PalimpsestError, match="exceeds the actor's window"):
        demo_config(ROOT / DEMO_SERVE, control=True, full=False, budget=9000, window=8192)


def test_a_report_in_a_log_keeps_every_table_line_whole():
    """Output not on a terminal (a CI log, `| tee`): the markdown is printed as its own text, never wrapped at 80
    columns; on a terminal it is rendered."""
    import io

    row = ("| vs `full`: fidelity KL, non-identical turns (session mean, 95% CI; lower is closer) | "
           "0.1019 [0.0559, 0.1702] | 0.1387 |")
    buf = io.StringIO()
    show_markdown(Console(file=buf, width=80), "| metric | a | b |\n|---|---|---|\n" + row + "\n")
    assert row in buf.getvalue().splitlines()
    term = io.StringIO()
    show_markdown(Console(file=term, width=80, force_terminal=True), "| metric | a | b |\n|---|---|---|\n" + row + "\n")
    assert row not in term.getvalue()  # rendered as a table


def test_the_demo_report_opens_with_the_share_of_turns_that_served_their_reference():
    from palimpsest.demo import identical_note

    def arm(scored, identical):
        return {"fidelity": {"scored": scored, "identical": identical}}

    note = identical_note({"arms": {"pace": arm(1, 2), "window": arm(0, 3)}})
    assert note.startswith("**5 of 6 scored turns served their reference itself** (`pace` 2 of 3, `window` 3 of 3)")
    assert identical_note({"arms": {"pace": arm(0, 0)}}).startswith("No turn was scored")


MEMORY = {"models": {"default": {"enabled": True, "model": "models:/palimpsest-memory/7", "max_slots": 8,
                                 "block_size": 32, "queries": 4,  # and what it reads, as its bundle says:
                                 "read": {"max_history_tokens": 1024, "max_field_chars": 400}}}}


def _candidate_run(tmp_path, diffs):
    """A demo run's ledger: `pace` served one turn per trajectory, and its dark memory candidate judged on it,
    worse by ``diffs[i]`` KL on trajectory i."""
    from palimpsest.demo import candidate_arm
    from palimpsest.experiments.gate import subject_of
    from palimpsest.platform import Ledger
    from tests.helpers import TASK

    cfg = demo_config(ROOT / DEMO_SERVE, control=False, full=False)
    cfg = cfg.model_copy(update={"arms": [*cfg.arms, candidate_arm(True)]})
    ledger = Ledger(str(tmp_path / "demo.db"))
    subject = subject_of(cfg.arm("pace+memory").policy_config().config_hash(), MEMORY["models"]["default"]["model"])
    for i, d in enumerate(diffs):
        sid = f"demo/tr{i}@pace"
        ledger.create_session(sid, TASK)
        ledger.record_shadow_pair(sid, 4, "pace", "pace+memory", subject, "scored", reference="full",
                                  control_kl=0.1, control_top1=0.9, candidate_kl=0.1 + d, candidate_top1=0.8,
                                  control_tokens=2000, candidate_tokens=2008, tokens=16)
    return cfg, ledger


def test_the_demo_report_leads_with_the_gates_decision_and_its_evidence(tmp_path):
    """The demo reads the gate once more on every pair of the run, with the function the replicas call: a memory
    candidate worse on each of 8 sessions is withdrawn (appended to the ledger), and the report opens with that
    decision, n, and each e-value beside the level it must reach; the pairs follow. At 7 sessions the same data
    cannot decide (no e-value can reach 40 there), and the report says so."""
    from palimpsest.demo import decide_candidates
    from palimpsest.experiments.gate import decisions_markdown, pairs_markdown, status

    info = {"memory": MEMORY, "prompt_embeds": True}
    worse = [0.3 + 0.01 * i for i in range(8)]
    cfg, ledger = _candidate_run(tmp_path / "a", worse)
    judged, results = decide_candidates(ledger, cfg, info, track=False)
    (r,) = results
    assert (r["candidate"], r["decision"], r["stage"], r["sessions"]) == ("pace+memory", "withdraw", "withdrawn", 8)
    assert r["recorded"] is not None and [d["stage"] for d in ledger.rollouts()] == ["withdrawn"]
    md = decisions_markdown(results, status(ledger))
    assert md.startswith("**Decisions**")
    first = md.splitlines()[2]
    assert first.startswith("- `pace+memory` (candidate of `pace`") and "**withdraw** -> withdrawn" in first
    assert f"worse {r['quality']['worse']['e_value']:.3g} (withdraws at 40)" in first and "n = 8 sessions" in first
    assert "| pace+memory | 8 (0) | 8 | +0.3350 | +8.0 | 0.008 |" in pairs_markdown(ledger, judged)
    cfg, ledger = _candidate_run(tmp_path / "b", worse[:7])
    _, (held,) = decide_candidates(ledger, cfg, info, track=False)
    assert held["decision"] == "hold" and held["recorded"] is None and ledger.rollouts() == []
    line = decisions_markdown([held], status(ledger)).splitlines()[2]
    assert "**hold**, stays dark" in line and "the most any e-value can reach at this n: 30.3" in line


def test_the_demos_aa_control_compares_the_served_prompts_by_hash(tmp_path):
    """Two A/A arms that served prompts of one size but different content: the A/A fails on the prompts' hashes
    (read from the run's audit), whatever the sizes say."""
    from palimpsest.demo import control_report
    from palimpsest.platform import Ledger, Runtime
    from tests.helpers import TASK, step

    rt = Runtime(Ledger(str(tmp_path / "control.db")))
    served, shadows = [], []
    noise = [0.02, -0.03, 0.01, -0.01, 0.03, -0.02, 0.015, -0.025]
    for i, d in enumerate(noise):
        for arm, kl in (("pace", 0.5), ("pace-aa", 0.5 + d)):
            sid = f"run/tr{i}@{arm}"
            rt.ledger.create_session(sid, TASK)
            for t in range(3):  # the A/A arm's last observation differs by one digit on trajectory 3
                rt.append(sid, step(t, f"ls dir_{t}",
                                    f"file_{t}.py" + ("9" if (i, arm, t) == (3, "pace-aa", 2) else "8")))
            turn = rt.turn(sid, "pace", Budget(2000))
            served.append({"arm": arm, "session_id": sid, "t": turn.t, "tokens_context": 1000, "tokens_prompt": 1000})
            shadows.append({"session_id": sid, "t": turn.t, "arm": arm, "status": "scored", "reason": "",
                            "reference": "full", "kl": kl, "top1": 0.5, "tokens": 4})
    _, _, verdicts, md = control_report(rt.ledger, served, [], shadows, [])
    assert verdicts["aa_prompts"] == {"pairs": 8, "differ": 1, "by_size": 0}
    assert verdicts["aa_status"] == "failed" and "A/A: FAILED" in md
