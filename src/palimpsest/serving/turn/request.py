"""A turn as asked: one type from the route to the actor.

Each route reads its own wire format (the native ``POST .../turn`` body, OpenAI chat, Anthropic Messages,
Responses) into one :class:`TurnRequest`; the replica and the turn service carry it unchanged; the turn service adds
only what the server decides (the arm's policy and the :class:`~palimpsest.platform.compile.budget.Budget`); the
actor is sent :meth:`TurnRequest.actor_fields` beside the compiled ids.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from palimpsest.platform.compile.context_edits import ContextEdits


@dataclass(frozen=True)
class TurnRequest:
    session_id: str  # the ledger's id (a tenant's sessions are namespaced before this point)
    budget: int | None = None  # the caller's context budget; None: a tenant's pin, the arm's, the server's
    max_tokens: int | None = None  # the reply's; None: the actor's default
    temperature: float = 0.0
    seed: int | None = None
    top_p: float | None = None
    stop: tuple[str, ...] | None = None
    edits: ContextEdits | None = None  # a context-management edit honoured by this turn's compaction
    tool_choice: Any = None  # auto, none, required or a named function (only where the session declares tools)
    parallel_tool_calls: bool | None = None
    noted: Mapping[str, str] = field(default_factory=dict)  # fields read that change nothing, recorded with the turn

    def __post_init__(self) -> None:  # the request's own copies: a caller's later change to its values is not seen
        if self.stop is not None:
            object.__setattr__(self, "stop", (self.stop,) if isinstance(self.stop, str) else tuple(self.stop))
        object.__setattr__(self, "noted", dict(self.noted))

    def actor_fields(self, reply: int, tools: list[dict] | None) -> dict[str, Any]:
        """What the actor is sent of this request (beside the compiled ids): the reply's size as the budget set
        it, the sampling fields given, and the declared tools with the request's choice when the actor parses
        tool calls."""
        out: dict[str, Any] = {"max_tokens": reply, "temperature": self.temperature, "seed": self.seed,
                               "kind": "turn"}
        out.update({k: v for k, v in (("top_p", self.top_p), ("stop", list(self.stop or ()) or None))
                    if v is not None})
        if tools:
            out.update(tools=tools, tool_choice=self.tool_choice, parallel_tool_calls=self.parallel_tool_calls)
        return out
