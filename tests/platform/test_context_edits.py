"""A client's context edit honoured by the gateway's compaction: the trigger and ``clear_at_least`` become the
epoch's watermarks, and the steps ``keep`` and ``exclude_tools`` name are never degraded, in every policy."""

from __future__ import annotations

import pytest

from palimpsest.platform.compile.budget import Budget
from palimpsest.platform.compile.context_edits import ContextEdits, Retain, applied, cleared, edited_config
from palimpsest.platform.policies import parse_policy_config
from palimpsest.platform.types import Resolution
from tests.helpers import per_turn


def _levels(turn) -> dict[str, list[int]]:
    """The resolution of each step, by the tool it ran (the helpers name a step's tool by its command)."""
    out: dict[str, list[int]] = {}
    for s, r in zip(turn.snapshot.steps, turn.plan.resolution.tolist()):
        out.setdefault(s.tool, []).append(r)
    return out


@pytest.mark.parametrize("policy", ["pace", "window", "pace_plus", "ace"])
def test_excluded_tools_and_the_kept_tool_uses_are_never_degraded(runtime, session, policy):
    base = parse_policy_config(per_turn(policy))
    tight = 700  # the session's twelve steps do not fit: most history is degraded
    plain = runtime.turn(session, base, Budget(tight), record=False)
    degraded = {tool for tool, levels in _levels(plain).items() if any(r != Resolution.FULL for r in levels)}
    assert degraded, "the budget must force degradation, or the test shows nothing"
    victim = sorted(degraded)[0]
    cfg = base.model_copy(update={"retain": Retain(tools=(victim,), tool_uses=2)})
    edited = runtime.turn(session, cfg, Budget(tight), record=False)
    assert edited.prompt.tokens <= tight
    assert all(r == Resolution.FULL for r in _levels(edited)[victim]), _levels(edited)
    assert all(r == Resolution.FULL for r in edited.plan.resolution[-2:].tolist())
    assert edited.plan.config_hash != plain.plan.config_hash  # its own epoch chain
    report = cleared(edited.plan, edited.snapshot)  # what the response reports: every step not shown in full
    assert report["cleared_tool_uses"] == sum(r != Resolution.FULL for r in edited.plan.resolution.tolist())
    assert report["cleared_input_tokens"] > 0


def test_trigger_and_clear_at_least_become_the_watermarks():
    cfg = parse_policy_config({"type": "pace"})
    out = edited_config(cfg, ContextEdits(kind="clear_tool_uses_20250919", trigger_tokens=3000,
                                          clear_at_least_tokens=1000, keep_tool_uses=2, exclude_tools=("Read",)),
                        budget=6000)
    assert out.compaction.high == 0.5 and out.compaction.low == pytest.approx(2000 / 6000)
    assert out.retain == Retain(tools=("Read",), tool_uses=2) and out.compaction.mode == "epochs"
    # a trigger past the budget cannot raise it: the budget is a hard bound
    assert edited_config(cfg, ContextEdits(kind="compaction", trigger_tokens=10**6), 6000).compaction.high == 1.0
    # an empty retain keeps every config's hash as it was before retain existed
    assert cfg.config_hash() == parse_policy_config({"type": "pace", "retain": {}}).config_hash()
    assert out.config_hash() != cfg.config_hash()


def test_the_trigger_counts_input_tokens_whatever_the_reply_reserves(runtime, session):
    """The boundary falls when the input would pass the trigger, not the input plus the reply's cap, and it
    compacts below the trigger keeping the arm's ratio of low to high watermark (never low == high)."""
    pace = parse_policy_config({"type": "pace"})
    size = runtime.turn(session, pace, Budget(20_000), record=False).prompt.tokens  # the whole session, uncompacted
    budget = 20_000
    for reserve in (0, 4_000):
        above = edited_config(pace, ContextEdits(kind="compaction", trigger_tokens=size + 10), budget, reserve)
        turn = runtime.turn(session, above, Budget(budget, reserve), record=False)
        assert not any(r != Resolution.FULL for r in turn.plan.resolution.tolist()), reserve  # under the trigger
        below = edited_config(pace, ContextEdits(kind="compaction", trigger_tokens=size - 100), budget, reserve)
        turn = runtime.turn(session, below, Budget(budget, reserve), record=False)
        assert turn.prompt.tokens <= size - 100 and any(r != Resolution.FULL for r in turn.plan.resolution.tolist())
        ratio = below.compaction.low / below.compaction.high
        assert ratio == pytest.approx(pace.compaction.low / pace.compaction.high)
        report = applied(ContextEdits(kind="compaction", trigger_tokens=size - 100), turn.plan, turn.snapshot, below,
                         budget, True, reserve)
        assert report["high_tokens"] == size - 100 and report["applied"]


@pytest.mark.parametrize("field,value", [("keep_tool_uses", 1_000_001), ("trigger_tool_uses", 1_000_001),
                                         ("trigger_tokens", 0), ("trigger_tokens", (1 << 40) + 1),
                                         ("clear_at_least_tokens", -1)])
def test_an_edit_beyond_what_a_policy_holds_is_refused_where_it_is_read(field, value):
    """An edit is checked where a request is read: one the retain section or the clear_tool_uses policy could not
    hold would otherwise fail inside the turn."""
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match=field):
        ContextEdits(kind="clear_tool_uses_20250919", **{field: value})
    edits = ContextEdits(kind="clear_tool_uses_20250919", keep_tool_uses=1_000_000, trigger_tokens=1 << 40)
    assert edited_config(parse_policy_config({"type": "pace"}), edits, 4096).retain.tool_uses == 1_000_000
