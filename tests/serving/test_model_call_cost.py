"""Cost counts every model call: the actor calls of ACE's LLM elasticizer, per arm, and LLM summary calls,
a call that timed out counted with the ids it sent. No Ray: stand-in handles over a ledger."""

import asyncio
from types import SimpleNamespace

import pytest

from palimpsest.experiments.ab_report import ab_summary, summary_markdown
from palimpsest.platform import Ledger, Runtime
from palimpsest.platform.compile.budget import Budget
from palimpsest.platform.prompt.chat import chat_ids
from palimpsest.serving.models.summarizer import LLMSummarizer, sent_ids, summary_messages
from palimpsest.serving.serve_config import parse_serve_config
from palimpsest.serving.turn.enrichment import Enrichment
from palimpsest.serving.turn.replica import ActorChat
from palimpsest.serving.turn.turn import TurnService
from tests.helpers import STEPS, TASK, step

WINDOW = 8192
ACE = {"type": "ace", "elasticizer": "llm", "llm_window": 4, "compaction": {"mode": "per_turn"}}


class _Reply:
    def __init__(self, value):
        self.value = value

    def result(self, timeout_s=None):
        if isinstance(self.value, Exception):
            raise self.value
        return self.value


class _Actor:
    """``chat.remote(messages, max_tokens, kind, usage)``: every other call never answers (a timeout)."""

    def __init__(self):
        self.sent = []

        def remote(messages, max_tokens=96, kind="summary", usage=False):
            self.sent.append(messages)
            if len(self.sent) % 2 == 0:
                return _Reply(TimeoutError("no reply in time"))
            reply = {"text": "raw", "prompt_tokens": 100 + len(self.sent), "cached_tokens": 20, "completion_tokens": 1}
            return _Reply(reply if usage else reply["text"])

        self.chat = SimpleNamespace(remote=remote)


def _runtime(tmp_path, actor):
    led = Ledger(str(tmp_path / "l.db"))
    chat = ActorChat(actor, 1.0, lambda messages, max_tokens: sent_ids(led.tokenizer, messages, WINDOW, max_tokens))
    rt = Runtime(led, chat=chat)
    rt.ledger.create_session("a@ace-llm", TASK)
    for t in range(8):
        action, obs = STEPS[t % len(STEPS)]
        rt.append("a@ace-llm", step(t, action, obs))
    return rt


def _expected(actor, tok, calls):
    """What ``calls`` calls of the stand-in cost: answered ones as the actor reported them, the others with the
    ids they sent."""
    answered = [i for i in range(calls) if (i + 1) % 2]
    sent = sum(sent_ids(tok, actor.sent[i], WINDOW, 4) for i in range(calls) if i not in answered)
    return {"calls": calls, "unanswered": calls - len(answered),
            "input": sum(101 + i for i in answered) + sent, "cached": 20 * len(answered),
            "generated": len(answered)}


def test_the_elasticizers_actor_calls_are_counted_per_arm_with_what_an_unanswered_call_sent(tmp_path):
    actor = _Actor()
    rt = _runtime(tmp_path, actor)
    tok = rt.ledger.tokenizer
    preview = rt.turn("a@ace-llm", ACE, Budget(4000, 16), record=False)  # a preview plans, and its calls cost too
    assert preview.plan.info["model_calls"]["calls"] == 4
    ct = rt.turn("a@ace-llm", ACE, Budget(4000, 16))
    want = _expected(actor, tok, 8)
    assert want["unanswered"] == 4 and all(sent_ids(tok, p, WINDOW, 4) > 0 for p in actor.sent)
    used = ct.plan.info["model_calls"]
    assert {k: used[k] for k in want} == want
    assert used["billed"] == pytest.approx(want["input"] - want["cached"] + rt.cached_rate * want["cached"])
    res = SimpleNamespace(latency={"total": 1.0}, glimpses=[], out={}, tool_calls=[], embed={}, fallback=None,
                          soft_tokens=0)
    TurnService._record(SimpleNamespace(runtime=rt), "a@ace-llm", "ace-llm", ct, res, {"context": 10}, False, {})
    rt.ledger.create_session("a@pace", TASK)
    rt.ledger.record_served("a@pace", 8, "pace", {"tokens_context": 10, "billed": 50.0})
    (row,) = [r for r in rt.ledger.served() if r["arm"] == "ace-llm"]
    assert row["elasticizer_calls"] == 8 and row["elasticizer_unanswered"] == 4
    s = ab_summary(rt.ledger.served(), [], ["pace", "ace-llm"])
    e = s["arms"]["ace-llm"]["elasticizer_calls"]
    assert (e["calls"], e["input"], e["cached"], e["generated"], e["unanswered"]) == (
        8, want["input"], want["cached"], want["generated"], 4)
    assert s["arms"]["pace"]["elasticizer_calls"]["calls"] == 0
    cost = s["arms"]["ace-llm"]["cost"]
    assert cost["elasticizer"] == pytest.approx(used["billed"]) and cost["total"] == pytest.approx(
        cost["turns"] + cost["summaries"] + cost["elasticizer"])
    md = summary_markdown(s)
    assert f"| 0 / 0 (0) / 0 / 0 | 8 / {want['input']:,} ({want['cached']}) / 4 / 4 |" in md


def test_a_summary_call_that_times_out_is_counted_with_the_ids_it_sent(tmp_path):
    async def slow(messages):
        await asyncio.sleep(5)

    record = step(3, "pytest -x", "FAILED tests/test_loader.py\n1 failed")
    _, _, _, usage = asyncio.run(LLMSummarizer(slow, "m", timeout_s=0.05).summarize_counted(record))
    assert usage == {"calls": 1, "input": 0, "cached": 0, "generated": 0, "unanswered": 1}
    rt = Runtime(Ledger(str(tmp_path / "l.db")))
    rt.ledger.create_session("a@pace", TASK)
    s = rt.append("a@pace", step(0, "pytest -x", "FAILED tests/test_loader.py\n1 failed"))
    cfg = parse_serve_config({})
    lane = SimpleNamespace(runtime=rt, cfg=cfg, arm_of=lambda sid: sid.split("@")[1])
    counted = Enrichment._usage(lane, s, {"usage": usage})
    sent = min(len(chat_ids(rt.ledger.tokenizer, summary_messages(s.record(), cfg.summarizer.max_input_chars)).all),
               cfg.actor.max_model_len - cfg.summarizer.max_tokens - 1)
    assert sent > 0 and counted == {**usage, "input": sent}
    Enrichment._record_calls(lane, "a@pace", [counted, {"calls": 1, "input": 300, "cached": 100, "generated": 40}])
    rt.ledger.record_served("a@pace", 1, "pace", {"tokens_context": 10, "billed": 50.0})
    summary = ab_summary(rt.ledger.served(), [], ["pace"], [], rt.ledger.served(kind="summary"))
    calls = summary["arms"]["pace"]["summary_calls"]
    assert (calls["calls"], calls["input"], calls["unanswered"]) == (2, sent + 300, 1)
    assert calls["billed"] == pytest.approx(sent + 200 + rt.cached_rate * 100)  # what it sent, uncached
