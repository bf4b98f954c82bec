"""A client's context-management request, honoured by the gateway's own compaction for that request.

Clients now ask the server to manage context: Anthropic's ``clear_tool_uses_20250919`` edit (``trigger``,
``keep``, ``clear_at_least``, ``exclude_tools``) and the Responses API's ``compaction`` entry
(``compact_threshold``). The gateway does not apply a second, fixed rule on top of its own: it maps each
request onto the policy's compaction epochs (``platform.compile.epochs``) for that turn:

- the trigger sets where an epoch boundary falls (the high watermark, ``trigger / budget``, at most 1: the
  budget stays a hard bound);
- ``clear_at_least`` says how far a boundary compacts (the low watermark: ``(trigger - clear_at_least) / budget``);
- ``keep`` says how many of the latest tool uses stay raw, and ``exclude_tools`` which tools' steps are never
  degraded: both are :class:`Retain`, which pins those steps at full resolution in every plan.

The policy config that results has its own hash, so its boundaries form their own epoch chain: a client that
sends the same edit every turn (as clients do) keeps one chain, and a turn that sends none is the arm's own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field

from palimpsest.platform.compile.retain import Retain, tool_names
from palimpsest.platform.policies import parse_policy_config
from palimpsest.platform.prompt import toolcalls
from palimpsest.platform.types import Resolution

if TYPE_CHECKING:
    from palimpsest.platform.ledger.snapshot import SessionSnapshot
    from palimpsest.platform.types import RenderPlan

MAX_TOKENS = 1 << 40  # an amount of input tokens an edit may name
MAX_TOOL_USES = 1_000_000  # as the retain section and the clear_tool_uses policy bound theirs


class ContextEdits(BaseModel):
    """One request's context-management edit, read from its protocol (``kind``: the edit's own name). ``literal``:
    the client asked for the edit's own rule (the ``clear_tool_uses`` policy with its parameters) instead of the
    gateway's compaction."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    kind: str
    trigger_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS)
    trigger_tool_uses: int | None = Field(None, ge=1, le=MAX_TOOL_USES)
    clear_at_least_tokens: int | None = Field(None, ge=0, le=MAX_TOKENS)
    keep_tool_uses: int | None = Field(None, ge=0, le=MAX_TOOL_USES)
    exclude_tools: tuple[str, ...] = ()
    clear_tool_inputs: bool | tuple[str, ...] = True
    literal: bool = False

    def literal_policy(self) -> dict:
        """The ``clear_tool_uses`` policy config that applies this edit as the API defines it."""
        trigger = {"trigger": self.trigger_tool_uses, "trigger_type": "tool_uses"} if self.trigger_tool_uses else \
            {"trigger": self.trigger_tokens or 100_000}
        # planned every turn, as the API applies the edit to each request: the compiler degrades beyond the rule only
        # past the budget, which stays a hard bound (in epochs a boundary would compact to the low watermark too)
        return {"type": "clear_tool_uses", "compaction": {"mode": "per_turn"}, **trigger,
                "keep": 3 if self.keep_tool_uses is None else self.keep_tool_uses,
                "clear_at_least": self.clear_at_least_tokens or 0, "exclude_tools": list(self.exclude_tools),
                "clear_tool_inputs": self.clear_tool_inputs if isinstance(self.clear_tool_inputs, bool)
                else list(self.clear_tool_inputs)}


def edited_config(cfg: Any, edits: ContextEdits, budget: int, reserve: int = 0) -> Any:
    """The policy config ``cfg`` with ``edits`` applied at ``budget`` (a new config, its own hash). The trigger and
    ``clear_at_least`` count input tokens, the watermarks the prompt plus the turn's ``reserve`` (the reply's cap
    and the soft positions): a boundary falls when the input would pass the trigger, and compacts the input to
    the trigger less ``clear_at_least``, or, without it, keeps the arm's ratio of low to high watermark."""
    if edits.literal:  # the edit's own rule, as a policy (platform/policies/clear_tool_uses.py)
        return parse_policy_config(edits.literal_policy())
    comp = cfg.compaction
    high = min(1.0, (edits.trigger_tokens + reserve) / budget) if edits.trigger_tokens else comp.high
    if edits.clear_at_least_tokens is not None:
        low = (edits.trigger_tokens or comp.high * budget - reserve) - edits.clear_at_least_tokens + reserve
        low = max(1e-3, min(high, low / budget))
    else:
        low = min(high, max(1e-3, high * comp.low / comp.high))
    compaction = comp.model_copy(update={"mode": "epochs", "high": high, "low": low})
    retain = Retain(tools=tuple(sorted(set(edits.exclude_tools))), tool_uses=edits.keep_tool_uses or 0)
    return cfg.model_copy(update={"compaction": compaction, "retain": retain})


def cleared(plan: "RenderPlan", snap: "SessionSnapshot") -> dict:
    """What a turn's plan left out of the tool uses, as the clients' fields report it: the tool calls (one step
    may hold several) whose step is not shown in full (``cleared_tool_uses``), and the ids that saved
    (``cleared_input_tokens``)."""
    n, saved = 0, 0
    for i, s in enumerate(snap.steps[: len(plan.resolution)]):
        if not (tool_names(s) or s.kind == "tool_call"):
            continue
        level = int(plan.resolution[i])
        masked = plan.masked is not None and bool(plan.masked[i])  # shown at full with its result cleared
        if level != Resolution.FULL or masked:
            sc = toolcalls.decode(s)
            n += max(len(sc.tool_calls), 1) if sc else 1
            full = int(snap.tokens[i, Resolution.FULL])
            shown = int(snap.tokens[i, level]) if level < snap.tokens.shape[1] else 0  # DROP: nothing shown
            saved += max(full - max(shown, 0), 0) if not masked else max(full - int(snap.tokens[i, -1]), 0)
    return {"cleared_tool_uses": n, "cleared_input_tokens": saved}


def applied(edits: ContextEdits, plan: "RenderPlan", snap: "SessionSnapshot", cfg: Any, total: int,
            compacted: bool, reserve: int = 0) -> dict:
    """What ``edits`` did to a turn (the edited policy's ``cfg`` at budget ``total``): whether the turn was a
    compaction boundary (the edit applies there; between boundaries the prompt is only extended), what the
    boundary cleared (zero on other turns), and the watermarks it ran under, in input tokens (the turn's
    ``reserve`` left out)."""
    counts = cleared(plan, snap) if compacted or edits.literal else {"cleared_tool_uses": 0, "cleared_input_tokens": 0}
    compacted = compacted or (edits.literal and counts["cleared_tool_uses"] > 0)
    return {"type": edits.kind, "applied": bool(compacted), **counts,
            "high_tokens": round(cfg.compaction.high * total) - reserve,
            "low_tokens": round(cfg.compaction.low * total) - reserve}
