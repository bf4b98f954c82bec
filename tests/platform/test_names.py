"""A summarised step names, within its caps, the identifiers a later action may reuse (platform/prompt/names.py)."""

import numpy as np

from palimpsest.platform import Resolution
from palimpsest.platform.compile.budget import Budget
from palimpsest.platform.compile.compiler import compile_plan
from palimpsest.platform.policies.base import Reasons, new_plan
from palimpsest.platform.prompt.abstraction import BRIEF_NAMES
from palimpsest.platform.prompt.names import RECUR_WINDOW, name_order, summary_body
from tests.helpers import step

# A listing whose frequent names fill a brief's cap; `needle_loader_v2` is named once, and step 1 goes back to it.
CROWD = [f"crowd_name_{k}" for k in range(16)]
LISTING = "\n".join(" ".join(CROWD) for _ in range(20)) + "\nneedle_loader_v2 = load(KeyError)\n"


def _session(runtime, later=("grep -n needle_loader_v2 src/", "2: needle_loader_v2 = load(KeyError)")):
    runtime.ledger.create_session("n1", "Fix the loader: crowd_name_3 fails.", system="You are a careful agent.")
    runtime.append("n1", step(0, "ls -R src/", LISTING))
    runtime.append("n1", step(1, *later))
    for t in range(2, 6):
        runtime.append("n1", step(t, f"echo unrelated {t}", f"nothing here {t}"))
    return runtime.snapshot("n1")


def _step0_text(runtime, snap, level=Resolution.BRIEF) -> str:
    """The text the prompt shows for step 0, planned at ``level`` (every other step full)."""
    m = snap.t
    res = np.full(m, Resolution.FULL, dtype=np.int8)
    res[0] = level
    reasons = Reasons()
    plan = new_plan("test", "test", snap, res, np.arange(m, dtype=np.float64), np.full(m, reasons("test")), reasons)
    prompt = compile_plan(snap, plan, Budget(100_000), runtime.ledger.tokenizer)
    (seg,) = [s for s in prompt.segments if s.kind == "step" and s.t == 0]
    assert seg.resolution is level
    return seg.text


def test_a_brief_of_a_step_keeps_an_identifier_a_later_step_reuses(runtime):
    snap = _session(runtime)
    assert "needle_loader_v2" not in snap.body(0, Resolution.BRIEF)  # the writer's own brief: the most frequent
    for level in (Resolution.BRIEF, Resolution.DETAILED):
        text = _step0_text(runtime, snap, level)
        assert "needle_loader_v2" in text, level
    # within the brief's cap
    brief = summary_body(snap, 0, Resolution.BRIEF)
    names = brief.split('source="tool">')[1].split("</untrusted>")[0].split(", ")
    assert names[0] == "needle_loader_v2" and len(names) <= BRIEF_NAMES + 1


def test_what_the_step_introduced_goes_before_what_the_task_or_its_action_named(runtime):
    snap = _session(runtime, later=("echo next", "nothing"))
    order = name_order(snap, 0, snap.abstraction(0))
    # crowd_name_3 is the task's: every other crowd name (as frequent) goes first
    assert order.index("crowd_name_3") > max(order.index(c) for c in CROWD if c != "crowd_name_3")


def test_a_summary_names_the_same_at_every_turn_once_its_window_exists(runtime):
    """The text of a summarised step reads steps up to RECUR_WINDOW after it: a later turn, whatever its steps
    name, renders it byte for byte (a boundary's kept region stays in the prefix cache)."""
    snap = _session(runtime)
    at = snap.upto(1 + RECUR_WINDOW)
    for t in range(6, 10):  # later steps go back to other names of step 0
        runtime.append("n1", step(t, f"grep {CROWD[t]} src/", f"{CROWD[t]} found"))
    later = runtime.snapshot("n1")
    for level in (Resolution.BRIEF, Resolution.DETAILED):
        assert summary_body(at, 0, level) == summary_body(later, 0, level)
