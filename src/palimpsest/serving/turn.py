"""The served turn: compile -> [soft memory] -> actor -> glimpse loop, as one function over small handles.

The ingress owns HTTP, tenants and recording; this module owns what the actor receives on a turn. The
prompt is the platform's (``palimpsest.platform.chat``): its ids plus the reply's ``max_tokens`` plus the
soft positions are at most the budget, and a glimpse answered inside the turn is cut to what is left, so
the bound holds on every generation of the turn.
"""

from __future__ import annotations

import asyncio
import re
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable, Protocol

from palimpsest.platform.budget import Budget
from palimpsest.platform.chat import glimpse_call, memory_read, with_glimpse
from palimpsest.platform.embedding import EmbedderUnavailable
from palimpsest.platform.runtime import Runtime
from palimpsest.platform.types import CompiledTurn, GlimpseLimitError, UnknownStepError


class Generate(Protocol):
    """The actor: one generation from context ids, an optional soft span, and bridge ids."""

    def __call__(self, request: dict, memory: Any = None) -> Awaitable[dict]: ...


class WaitClock(Protocol):
    """The embedder's clock of time spent waiting (its own thread-local figure)."""

    def reset_wait(self) -> None: ...

    @property
    def waited_ms(self) -> float: ...


@dataclass(frozen=True)
class TurnRequest:
    session_id: str
    policy: Any
    budget: Budget  # total, the reply's max_tokens, the soft positions reserved when the arm has memory
    temperature: float | None = None
    seed: int | None = None
    sampling: dict = field(default_factory=dict)  # further sampling fields passed to the actor as they are
    tools: list[dict] | None = None  # the session's declared function tools, for the actor's tool parser
    tool_choice: Any = None  # auto, none, required or a named function
    parallel_tool_calls: bool | None = None


@dataclass
class TurnResult:
    compiled: CompiledTurn
    text: str  # the reply as generated
    finish_reason: str | None
    glimpses: list[int]
    prompt_tokens: int  # the ids of the last generation (soft positions included)
    prompt_tokens_total: int  # summed over every generation of the turn
    completion_tokens: int  # summed over every generation of the turn
    generations: int
    soft_tokens: int
    cached_tokens: int
    latency: dict[str, float]
    fallback: str | None
    out: dict
    content: str | None = None  # the reply without tool-call markup
    cached_tokens_total: int = 0  # the actor's prefix-cache hits, summed over every generation of the turn
    tool_calls: list[dict] = field(default_factory=list)  # OpenAI wire shape, each with an id


async def compile_turn(rt: Runtime, req: TurnRequest, clock: WaitClock | None) -> tuple[CompiledTurn, float, str | None]:
    """Plan and compile in a worker thread (policies may block on the embedder); when the embedder is down
    the turn is planned as if no step had a key yet. Returns (turn, ms waited for the embedder, fallback)."""
    def plan(keys: bool):
        if clock is not None:
            clock.reset_wait()
        ct = rt.turn(req.session_id, req.policy, req.budget, None, True, keys)
        return ct, (clock.waited_ms if clock is not None else 0.0)

    try:
        ct, waited = await asyncio.to_thread(plan, True)
        return ct, waited, None
    except EmbedderUnavailable:
        ct, waited = await asyncio.to_thread(plan, False)
        return ct, waited, "embedder"


def turn_memory(rt: Runtime, ct: CompiledTurn, memory_cfg) -> tuple[list[int], list[int]] | None:
    """What the memory network reads on a served turn (``memory_cfg``: the serve config's ``memory``): the
    steps the compiled prompt left out and the context before its soft slot, or None when it left none out.
    The REMORY data builder makes the same call (``platform.chat.memory_read``) on the same compiled turn."""
    return memory_read(rt.ledger.tokenizer, ct, memory_cfg.max_field_chars, memory_cfg.max_history_tokens)


_GLIMPSE_PREFIX = re.compile(r"^\s*#?\d{0,18}\s*(\)\s*)?$")


def could_be_glimpse(text: str) -> bool:
    """Whether a reply that begins with ``text`` may still turn out to be a glimpse call."""
    s = text.lstrip()
    if len(s) <= len("glimpse("):
        return "glimpse(".startswith(s)
    return s.startswith("glimpse(") and bool(_GLIMPSE_PREFIX.match(s[len("glimpse("):]))


class _Gate:
    """What a streamed generation may show the client: nothing while the reply may still be a glimpse call
    (answered inside the turn, never shown), everything once it cannot be."""

    def __init__(self, emit: Callable[[str], Awaitable[None]], may_glimpse: bool):
        self.emit, self.open, self.held, self.text = emit, not may_glimpse, [], ""

    async def feed(self, delta: str, content: str | None) -> None:
        self.text += delta
        if not self.open and not could_be_glimpse(self.text):
            await self.release()
        if content:
            if self.open:
                await self.emit(content)
            else:
                self.held.append(content)

    async def release(self) -> None:
        self.open = True
        for c in self.held:
            await self.emit(c)
        self.held = []


async def _streamed(events: AsyncIterator[dict], gate: _Gate) -> dict:
    async for ev in events:
        if ev.get("done"):
            return ev
        await gate.feed(ev["delta"], ev.get("content"))
    raise RuntimeError("the actor's stream ended without a result")


async def run_turn(rt: Runtime, req: TurnRequest, generate: Generate, glimpse_limit: int,
                   memory_for: Callable[[CompiledTurn], Awaitable[Any]] | None = None,
                   clock: WaitClock | None = None,
                   stream: Callable[[dict, Any], AsyncIterator[dict]] | None = None,
                   emit: Callable[[str], Awaitable[None]] | None = None) -> TurnResult:
    """One served turn. With ``stream`` and ``emit``, the final answer's content is handed to ``emit`` as
    it is generated (a glimpse round inside the turn never is); the result is the same either way."""
    t_start = time.perf_counter()
    ct, embed_ms, fallback = await compile_turn(rt, req, clock)
    plan_ms = (time.perf_counter() - t_start) * 1000
    memory = await memory_for(ct) if (memory_for is not None and req.budget.soft) else None
    request: dict[str, Any] = {**req.sampling, "max_tokens": req.budget.reply, "temperature": req.temperature,
                               "seed": req.seed}
    if req.tools:
        request.update(tools=req.tools, tool_choice=req.tool_choice, parallel_tool_calls=req.parallel_tool_calls)
    room = req.budget.prompt
    messages = list(ct.prompt.messages)
    context, bridge = list(ct.prompt.context_ids), list(ct.prompt.bridge_ids)
    glimpsed: list[int] = []
    actor_ms, completion, generations, prompt_total, cached_total = 0.0, 0, 0, 0, 0
    tok = rt.ledger.tokenizer
    gate = None
    while True:
        if stream is not None and emit is not None:
            gate = _Gate(emit, may_glimpse=len(glimpsed) < glimpse_limit)
            out = await _streamed(stream({**request, "context": context, "bridge": bridge, "messages": messages},
                                         memory), gate)
        else:
            out = await generate({**request, "context": context, "bridge": bridge, "messages": messages}, memory)
        generations += 1
        actor_ms += out["actor_ms"]
        completion += int(out.get("completion_tokens", len(out["token_ids"])))
        prompt_total += out["prompt_tokens"]
        cached_total += int(out.get("cached_tokens") or 0)
        step_id = glimpse_call(out["text"])
        if step_id is None or len(glimpsed) >= glimpse_limit:
            break
        try:
            text = await asyncio.to_thread(rt.glimpse, req.session_id, step_id)
        except (UnknownStepError, GlimpseLimitError) as e:
            text = f"(unavailable: {e})"
        grown = await asyncio.to_thread(with_glimpse, tok, messages, step_id, text, room, ct.prompt.soft_at)
        if grown is None:  # not even a notice fits what the budget leaves: the reply stands as it is
            break
        messages, ids = grown
        context, bridge = list(ids.context), list(ids.bridge)
        glimpsed.append(step_id)
    if gate is not None and not gate.open:  # the reply stands (a glimpse call past the limit, or no room)
        await gate.release()
    total_ms = (time.perf_counter() - t_start) * 1000
    return TurnResult(
        compiled=ct, text=out["text"], finish_reason=out.get("finish_reason"), glimpses=glimpsed,
        prompt_tokens=out["prompt_tokens"], prompt_tokens_total=prompt_total, completion_tokens=completion,
        generations=generations,
        soft_tokens=out["soft_tokens"], cached_tokens=out["cached_tokens"], cached_tokens_total=cached_total,
        latency={"plan": plan_ms, "embed": embed_ms, "memory": float(out.get("memory_ms", 0.0)), "actor": actor_ms,
                 "total": total_ms},
        fallback=fallback, out=out, content=out.get("content", out["text"]), tool_calls=list(out.get("tool_calls") or []))
