"""The demo's own pieces that need no models: its arms (the demo's, or the positive control's), the breakdown of
where the models' time went, and the progress lines."""

from pathlib import Path

from rich.console import Console

from palimpsest.demo import CONTROL_ARMS, DEMO_SERVE, Progress, busy_markdown, demo_config, show_markdown

ROOT = Path(__file__).resolve().parents[1]


def test_the_demo_compares_two_policies_that_differ_and_the_control_a_weak_arm():
    cfg = demo_config(ROOT / DEMO_SERVE, control=False, full=False)
    assert [a.name for a in cfg.arms] == ["pace", "window"] and cfg.summarizer.mode == "rule"
    assert cfg.ab.shadow_rate == 1.0 and cfg.ab.shadow_queue >= 100  # every turn scored, none skipped for load
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

    row = "| vs `full`: fidelity KL, non-identical turns (session mean, 95% CI; lower is closer) | 0.1019 [0.0559, 0.1702] | 0.1387 |"
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
