"""The rules users pick instead of Palimpsest, as policies: observation masking (arXiv 2508.21433) and Anthropic's
``clear_tool_uses_20250919``. A masked step keeps its action verbatim and its place; its result is one line naming
the step, which glimpse shows whole; the budget, the audit and call/result pairs hold as for every policy."""

from __future__ import annotations

import numpy as np
import pytest

from palimpsest.platform import Resolution, StepRecord
from palimpsest.platform.compile.budget import Budget
from palimpsest.platform.prompt import toolcalls
from palimpsest.platform.prompt.render import INPUT_MASKED, RESULT_MASKED, authority_block, masked_note
from tests.helpers import STEPS, per_turn, step

M = 4


def _masked(plan) -> np.ndarray:
    """The plan's mask as compiled (the compiler leaves None where nothing is masked)."""
    return np.zeros(len(plan), dtype=np.int8) if plan.masked is None else plan.masked


def _shown(turn, i: int) -> tuple[bool, bool]:
    """(action shown verbatim, observation shown) of step i in a compiled turn."""
    s = turn.snapshot.steps[i]
    return s.action in turn.prompt.text, authority_block(s.observation or "", s.authority) in turn.prompt.text


def test_observation_masking_keeps_every_action_and_the_last_m_observations(runtime, session):
    turn = runtime.turn(session, per_turn("observation_masking", m=M), Budget(100_000))
    n = turn.snapshot.t
    for i, s in enumerate(turn.snapshot.steps):
        action, observation = _shown(turn, i)
        assert action, f"step {i}'s action is not shown verbatim"
        assert observation == (i >= n - M), f"step {i}: observation shown {observation}, m={M}"
        assert (masked_note(s.id) in turn.prompt.text) == (i < n - M)
    assert (turn.plan.resolution == Resolution.FULL).all()
    assert _masked(turn.plan).tolist() == [RESULT_MASKED] * (n - M) + [0] * M


def test_a_masked_observation_keeps_its_role_and_place_and_glimpse_brings_it_back(runtime, session):
    turn = runtime.turn(session, per_turn("observation_masking", m=M), Budget(100_000))
    msgs = turn.prompt.messages
    assert [m["role"] for m in msgs[2:]] == ["assistant", "tool"] * len(STEPS)
    first = turn.snapshot.steps[0]
    assert msgs[2]["content"] == first.action and msgs[3]["content"] == masked_note(first.id)
    assert STEPS[0][1] in runtime.glimpse(session, first.id)
    audit = runtime.ledger.audit(session)[-1]
    assert audit["prompt_hash"] == turn.prompt.prompt_hash
    assert audit["plan"][0]["reason"].startswith(f"older than the last {M} steps: observation masked")
    assert audit["plan"][-1]["reason"] == f"within the last {M} steps: observation shown"


def test_the_users_own_words_are_never_masked(runtime, ledger):
    from palimpsest.platform import Authority

    ledger.create_session("u", "Book a flight.")
    runtime.append("u", StepRecord(t=0, kind="message", action="Which day?", observation="Tuesday the 4th, please.",
                                   authority=Authority.USER))
    for t in range(1, 8):
        runtime.append("u", step(t, f"search_flights day={t}", f"flight HAT{t}00 at 0{t}:00"))
    turn = runtime.turn("u", per_turn("observation_masking", m=2), Budget(100_000), record=False)
    assert "Tuesday the 4th, please." in turn.prompt.text and "flight HAT100" not in turn.prompt.text


def test_observation_masking_stays_within_the_budget_and_degrades_the_oldest_first(runtime, session):
    roomy = runtime.turn(session, per_turn("observation_masking", m=M), Budget(100_000), record=False).prompt.tokens
    tight = runtime.turn(session, per_turn("observation_masking", m=M), Budget(roomy - 30, 16), record=False)
    assert tight.prompt.tokens + 16 <= roomy - 30
    degraded = [d.t for d in tight.plan.degradations]
    assert degraded and min(degraded) == 0 and max(degraded) < len(STEPS) - M


def _clear(**fields) -> dict:
    return per_turn("clear_tool_uses", **fields)


def _input_tokens(runtime, session) -> int:
    """The input a client would send: the whole history, nothing cleared (``full`` with room for all of it)."""
    return runtime.turn(session, per_turn("full"), Budget(1_000_000), record=False).prompt.tokens


def test_clear_tool_uses_clears_nothing_until_the_input_passes_the_trigger(runtime, session):
    size = _input_tokens(runtime, session)
    at = runtime.turn(session, _clear(trigger=size), Budget(100_000), record=False)
    assert not _masked(at.plan).any() and at.prompt.tokens == size  # exactly at the trigger: not past it
    past = runtime.turn(session, _clear(trigger=size - 1), Budget(100_000), record=False)
    assert _masked(past.plan).any() and past.prompt.tokens < size
    assert past.plan.info["clear_tool_uses"]["input"] == size  # counted on the compiled prompt's ids


def test_clear_tool_uses_keeps_the_last_keep_tool_uses_and_clears_the_rest(runtime, session):
    turn = runtime.turn(session, _clear(trigger=100, keep=3), Budget(100_000), record=False)
    n = turn.snapshot.t
    for i in range(n):
        action, observation = _shown(turn, i)
        assert action and observation == (i >= n - 3), f"step {i}: observation shown {observation}"
    assert turn.plan.info["clear_tool_uses"]["cleared"] == n - 3


def test_clear_tool_uses_never_touches_an_excluded_tool(runtime, session):
    turn = runtime.turn(session, _clear(trigger=100, keep=1, exclude_tools=["cat"]), Budget(100_000), record=False)
    for i, s in enumerate(turn.snapshot.steps):
        if s.tool == "cat":
            assert _shown(turn, i) == (True, True) and _masked(turn.plan)[i] == 0, f"excluded step {i} was cleared"
    assert any(_masked(turn.plan))


def test_clear_tool_inputs_clears_the_calls_too_and_clear_at_least_gates_the_edit(runtime, session):
    turn = runtime.turn(session, _clear(trigger=100, keep=2, clear_tool_inputs=True), Budget(100_000), record=False)
    n = turn.snapshot.t
    assert _masked(turn.plan).tolist() == [INPUT_MASKED] * (n - 2) + [0, 0]
    assert STEPS[0][0] not in turn.prompt.text and STEPS[-1][0] in turn.prompt.text
    only = runtime.turn(session, _clear(trigger=100, keep=2, clear_tool_inputs=["ls"]), Budget(100_000), record=False)
    assert _masked(only.plan)[0] == INPUT_MASKED and set(_masked(only.plan)[1:n - 2].tolist()) == {RESULT_MASKED}
    size = _input_tokens(runtime, session)
    cleared = runtime.turn(session, _clear(trigger=100, keep=2), Budget(100_000), record=False).prompt.tokens
    freed = size - cleared
    enough = runtime.turn(session, _clear(trigger=100, keep=2, clear_at_least=freed - 5), Budget(100_000), record=False)
    assert _masked(enough.plan).any()
    gated = runtime.turn(session, _clear(trigger=100, keep=2, clear_at_least=freed + 5), Budget(100_000), record=False)
    assert not _masked(gated.plan).any() and gated.prompt.tokens == size


def test_a_trigger_in_tool_uses_counts_the_calls(runtime, session):
    at = runtime.turn(session, _clear(trigger=len(STEPS), trigger_type="tool_uses"), Budget(100_000), record=False)
    past = runtime.turn(session, _clear(trigger=len(STEPS) - 1, trigger_type="tool_uses"), Budget(100_000),
                        record=False)
    assert not _masked(at.plan).any() and _masked(past.plan).any()


# -- tool-calling steps: a call and its answers are never split --------------------------------------------


def _call_step(t: int, calls: list[tuple[str, str, str]]) -> StepRecord:
    """A structured step: (name, arguments, result) per call, each answered by its own tool message."""
    wire = [{"id": f"call_{t}_{k}", "name": name, "arguments": args} for k, (name, args, _) in enumerate(calls)]
    results = [toolcalls.Result("tool", res, f"call_{t}_{k}", name) for k, (name, _, res) in enumerate(calls)]
    return StepRecord(t=t, kind="tool_call", action=toolcalls.action_text("", wire), tool=calls[0][0],
                      observation="\n".join(r.content for r in results), calls=toolcalls.encode(wire, results))


def _tool_session(runtime, sid: str = "tools", n: int = 24) -> str:
    runtime.ledger.create_session(sid, "Fix the failing import in pkg/loader.py")
    for t in range(n):
        calls = [("read_file", f'{{"path": "pkg/mod_{t}.py"}}', f"def handler_{t}(env):\n" + f"    return {t}\n" * 30)]
        if t % 3 == 0:
            calls.append(("grep", f'{{"pattern": "key_{t}"}}', f"pkg/mod_{t}.py:3: key_{t} = 1"))
        runtime.append(sid, _call_step(t, calls))
    return sid


def _assert_calls_answered(messages) -> None:
    """Every assistant message with tool calls is followed by exactly one answer per call, in order, and every
    answer follows its call."""
    pending: list[str] = []
    for m in messages:
        if m.get("tool_call_id") is not None:
            assert pending and m["tool_call_id"] == pending.pop(0), "an answer without its call"
            continue
        assert not pending, "a call's answers were split from it"
        if m["role"] == "assistant" and m.get("tool_calls"):
            pending = [c["id"] for c in m["tool_calls"]]
    assert not pending


@pytest.mark.parametrize("cfg", [per_turn("observation_masking", m=3), _clear(trigger=500, keep=3),
                                 _clear(trigger=500, keep=3, clear_tool_inputs=True),
                                 {"type": "observation_masking", "m": 3}, {"type": "clear_tool_uses", "trigger": 500}])
def test_masked_tool_calls_keep_their_answers_and_the_budget_holds(runtime, cfg):
    sid = _tool_session(runtime)
    for budget in (1200, 2500, 100_000):
        turn = runtime.turn(sid, cfg, Budget(budget, 32))
        assert turn.prompt.tokens + 32 <= budget
        _assert_calls_answered(turn.prompt.messages)
    roomy = runtime.turn(sid, {**cfg, "compaction": {"mode": "per_turn"}}, Budget(100_000), record=False)
    masked = [i for i, v in enumerate(_masked(roomy.plan).tolist()) if v]
    assert masked, "the rule should mask something in this session"
    answers = [m for m in roomy.prompt.messages if m.get("tool_call_id")]
    first = roomy.snapshot.steps[masked[0]]
    assert [m["content"] for m in answers if m["tool_call_id"].startswith(f"call_{first.t}_")] == \
        [masked_note(first.id)] * len(toolcalls.decode(first).results)
    cleared_inputs = _masked(roomy.plan)[masked[0]] == INPUT_MASKED
    call = next(m for m in roomy.prompt.messages if m.get("tool_calls") and
                m["tool_calls"][0]["id"].startswith(f"call_{first.t}_"))
    assert (call["tool_calls"][0]["function"]["arguments"] == "") == bool(cleared_inputs)


def test_a_keep_protected_structured_step_is_kept_whole(runtime):
    """keep counts calls, and a step's calls are cleared together: with keep 3, the latest steps t = 20 and 19 (one
    call each) and t = 18 (two calls, one of them among the last three) are kept whole; t = 17 is cleared."""
    sid = _tool_session(runtime, n=21)
    turn = runtime.turn(sid, _clear(trigger=500, keep=3), Budget(100_000), record=False)
    assert _masked(turn.plan)[-3:].tolist() == [0, 0, 0] and _masked(turn.plan)[-4] == RESULT_MASKED
    text = turn.prompt.text
    assert "key_18 = 1" in text and "def handler_18" in text and "def handler_17" not in text
    two = runtime.turn(sid, _clear(trigger=500, keep=2), Budget(100_000), record=False)
    assert _masked(two.plan)[-2:].tolist() == [0, 0] and _masked(two.plan)[-3] == RESULT_MASKED
