"""Summaries written by the actor model, with the deterministic writer as the floor.

The actor is asked for a one-sentence summary, the outcome and the critical facts of a step, with
instructions to keep ids, paths, numbers and failure reasons. Whatever it writes is merged into the
rule writer's structured abstraction: the model's summary and facts replace the rule ones, and every
identifier, path, URL, number, error line and failure reason the rule extractor found is kept even if the
model dropped it (a small model paraphrases ids away). If the model is slow, down, or writes nothing
usable, the rule writer's summaries are used as they are. Either way the authority label survives.
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import replace
from typing import Awaitable, Callable

from palimpsest.platform.prompt.abstraction import (
    Abstraction,
    RuleSummarizer,
    Summaries,
    abstract_step,
    render_brief,
    render_detailed,
)
from palimpsest.platform.prompt.chat import chat_ids
from palimpsest.platform.types import StepRecord

LLM_VERSION = "v1"
INSTRUCTION = (
    "Summarise this step of an agent's work for its own later reference. Keep every id, file path, URL, "
    "number and error message exactly as written, and say why a failed action failed.\n"
    "Answer in exactly this form:\nSUMMARY: <one sentence>\nOUTCOME: ok|error|empty\nFACTS:\n- <fact>\n- <fact>"
)
_OUTCOMES = ("ok", "error", "empty", "unknown")

Generate = Callable[[list[dict]], Awaitable[str]]


def summary_messages(step: StepRecord, max_chars: int) -> list[dict]:
    obs = step.observation or ""
    if len(obs) > max_chars:
        obs = obs[: max_chars // 2] + "\n[...]\n" + obs[-max_chars // 2:]
    body = (f"ACTION ({step.kind}{', ' + step.tool if step.tool else ''}):\n{step.action[:max_chars]}\n\n"
            f"OUTPUT:\n{obs or '(none)'}")
    return [{"role": "system", "content": INSTRUCTION}, {"role": "user", "content": body}]


def sent_ids(tokenizer, messages: list[dict], window: int, max_tokens: int) -> int:
    """The ids a helper call of ``messages`` sends the actor (``Actor.chat``: the chat template's ids, the last
    ``window - max_tokens - 1`` of them): what a call that never answered is counted with."""
    return min(len(chat_ids(tokenizer, messages).all), max(int(window) - int(max_tokens) - 1, 0))


def parse_reply(text: str) -> tuple[str, str | None, list[str]] | None:
    """(summary, outcome or None, facts) from the model's reply; None when it has no usable summary."""
    m = re.search(r"SUMMARY:\s*(.+)", text or "")
    summary = (m.group(1) if m else (text or "").strip().split("\n", 1)[0]).strip()
    if not summary or len(summary) > 400 or not re.search(r"[A-Za-z]{3}", summary):
        return None
    o = re.search(r"OUTCOME:\s*(\w+)", text)
    outcome = o.group(1).lower() if o and o.group(1).lower() in _OUTCOMES else None
    facts_block = text.split("FACTS:", 1)[1] if "FACTS:" in text else ""
    facts = [ln.strip()[2:].strip() for ln in facts_block.splitlines() if ln.strip().startswith("- ")]
    return summary, outcome, [f for f in facts if 0 < len(f) <= 300][:12]


def merge(rule: Abstraction, reply: tuple[str, str | None, list[str]]) -> Abstraction:
    """The model's words added to the rule writer's structure; nothing the rule extractor found is lost.

    The model read the observation, so what it wrote carries the observation's authority: its summary and
    facts go into ``critical_facts``, which are rendered inside the step's authority block (delimited and
    untrusted for tool output), never into the action line that stands outside it."""
    summary, outcome, facts = reply
    kept = list(dict.fromkeys([f"summary: {summary}"] + facts + rule.critical_facts))
    # The rule outcome wins when it saw an error: a model must not talk a failure into a success.
    final_outcome = rule.outcome if rule.outcome == "error" or outcome is None else outcome
    return replace(rule, outcome=final_outcome, critical_facts=kept[:16])


class LLMSummarizer:
    """``summarize(step)`` through the actor, bounded by ``timeout_s``; the rule writer otherwise."""

    version = LLM_VERSION

    def __init__(self, generate: Generate, model_name: str, timeout_s: float = 20.0, max_input_chars: int = 4000):
        self.generate = generate
        self.name = f"llm:{model_name}"
        self.timeout_s = timeout_s
        self.max_input_chars = max_input_chars
        self.rule = RuleSummarizer()

    async def summarize(self, step: StepRecord) -> tuple[Summaries, str, str]:
        """(summaries, producer, version): the producer says which writer it came from."""
        return (await self.summarize_counted(step))[:3]

    async def summarize_counted(self, step: StepRecord) -> tuple[Summaries, str, str, dict]:
        """``summarize`` and what its call cost: ``{"calls", "input", "cached", "generated"}`` ids, as the actor
        reported them (a ``generate`` that returns its usage beside the text); a call that timed out or failed
        is ``unanswered``: its ids are not known here (0), and the ingress counts what it sent (``sent_ids``)."""
        rule = abstract_step(step)
        usage = {"calls": 1, "input": 0, "cached": 0, "generated": 0, "unanswered": 0}
        try:
            out = await asyncio.wait_for(self.generate(summary_messages(step, self.max_input_chars)), self.timeout_s)
        except Exception:  # timeout, actor down, bad reply: the floor
            out, usage["unanswered"] = None, 1
        if isinstance(out, dict):
            usage.update(input=int(out.get("prompt_tokens") or 0), cached=int(out.get("cached_tokens") or 0),
                         generated=int(out.get("completion_tokens") or 0))
            out = out.get("text")
        reply = parse_reply(out) if out else None
        if reply is None:
            return Summaries(rule, render_detailed(rule), render_brief(rule)), self.rule.name, self.rule.version, usage
        a = merge(rule, reply)
        return Summaries(a, render_detailed(a), render_brief(a)), self.name, self.version, usage
