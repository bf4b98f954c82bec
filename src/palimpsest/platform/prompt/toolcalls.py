"""The structure of a tool-calling step: the assistant's tool calls and the messages that answered them.

A step stays one assistant action plus its results, so compression never separates a call from its
result. The text fields keep working for everything that reads text (summaries, keys, recall): the
action is the assistant's content followed by one ``name(arguments)`` line per call, and the observation
is the answering messages' texts joined by newlines. ``StepRecord.calls`` adds what text loses, as
canonical JSON::

    {"tool_calls": [{"id": ..., "name": ..., "arguments": ...}],
     "results": [{"role": "tool"|"user"|"system", "tool_call_id": ..., "name": ..., "chars": N}]}

``chars`` cuts the observation back into its messages exactly. Pure module: no I/O.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Sequence

from palimpsest.platform.types import LedgerError, StepRecord


@dataclass(frozen=True)
class Result:
    role: str  # tool, user or system
    content: str
    tool_call_id: str | None = None
    name: str | None = None


@dataclass(frozen=True)
class StepCalls:
    content: str  # the assistant's own words (the action without its call lines)
    tool_calls: tuple[dict, ...]  # {"id", "name", "arguments"}
    results: tuple[Result, ...]


def call_line(call: dict) -> str:
    return f"{call.get('name') or 'tool'}({call.get('arguments') or ''})"


def action_text(content: str, tool_calls: Sequence[dict]) -> str:
    """The action's text: the assistant's content, then one ``name(arguments)`` line per call."""
    return "\n".join(x for x in [content, *(call_line(c) for c in tool_calls)] if x)


def encode(tool_calls: Sequence[dict], results: Sequence[Result]) -> str | None:
    """``StepRecord.calls`` of a step (None when it has neither calls nor answers naming a call)."""
    if not tool_calls and not any(r.tool_call_id for r in results):
        return None
    doc = {"tool_calls": [{"id": c.get("id"), "name": c.get("name"), "arguments": c.get("arguments")}
                          for c in tool_calls],
           "results": [{"role": r.role, "tool_call_id": r.tool_call_id, "name": r.name, "chars": len(r.content)}
                       for r in results]}
    return json.dumps(doc, sort_keys=True, ensure_ascii=False, separators=(",", ":"))


def decode(step: Any) -> StepCalls | None:
    """The structure of ``step`` (a Step or StepRecord), or None for a plain step."""
    if getattr(step, "calls", None) is None:
        return None
    doc = json.loads(step.calls)
    calls = tuple(doc.get("tool_calls") or ())
    lines = "\n".join(call_line(c) for c in calls)
    action = step.action or ""
    content = action
    if lines and action.endswith(lines):
        content = action[: len(action) - len(lines)].rstrip("\n")
    results, pos, obs = [], 0, step.observation or ""
    for r in doc.get("results") or ():
        n = int(r.get("chars") or 0)
        results.append(Result(r.get("role") or "tool", obs[pos: pos + n], r.get("tool_call_id"), r.get("name")))
        pos += n + 1
    return StepCalls(content, calls, tuple(results))


def check_calls(r: StepRecord, where: str) -> None:
    """A step's ``calls`` must be the structure of its own text fields (what :func:`encode` writes)."""
    try:
        doc = json.loads(r.calls)
    except (TypeError, ValueError):
        raise LedgerError(f"{where}: calls is not JSON") from None
    if (not isinstance(doc, dict) or not isinstance(doc.get("tool_calls"), list)
            or not isinstance(doc.get("results"), list)):
        raise LedgerError(f"{where}: calls needs the lists tool_calls and results")
    for c in doc["tool_calls"]:
        if not isinstance(c, dict) or not isinstance(c.get("name"), str):
            raise LedgerError(f"{where}: every tool call needs a name")
    lines = "\n".join(call_line(c) for c in doc["tool_calls"])
    if lines and not r.action.endswith(lines):
        raise LedgerError(f"{where}: the action must end with its tool calls' lines")
    chars = [r_.get("chars") if isinstance(r_, dict) else None for r_ in doc["results"]]
    if any(not isinstance(n, int) or n < 0 for n in chars):
        raise LedgerError(f"{where}: every result needs its length in chars")
    if chars and sum(chars) + len(chars) - 1 != len(r.observation or ""):
        raise LedgerError(f"{where}: the results' lengths do not add up to the observation")


def wire(call: dict) -> dict:
    """One recorded call in OpenAI's wire shape."""
    return {"id": call.get("id"), "type": "function",
            "function": {"name": call.get("name"), "arguments": call.get("arguments") or ""}}


def wire_calls(step: Any) -> list[dict]:
    sc = decode(step)
    return [wire(c) for c in sc.tool_calls] if sc else []


def tool_call_ids(step: Any) -> list[str]:
    sc = decode(step)
    return [r.tool_call_id for r in sc.results if r.tool_call_id] if sc else []


__all__ = ["Result", "StepCalls", "action_text", "call_line", "check_calls", "decode", "encode", "tool_call_ids",
           "wire", "wire_calls"]
