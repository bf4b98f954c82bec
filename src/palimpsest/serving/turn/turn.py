"""The served turn, one owner: size -> compile -> memory -> generate -> record -> offer to the shadow lane.

:class:`TurnService` is what every route that serves a turn calls (``POST .../turn``, the OpenAI chat proxy, the
Messages endpoint); the routes keep HTTP and tenants, each protocol its wire format. :func:`run_turn` is the generation
loop inside it (compile, soft memory, the actor, glimpses answered within the turn), over small handles so that tests
and the REMORY data builder run it without Serve. The prompt is the platform's (``platform.prompt.chat``): its ids
plus the reply's ``max_tokens`` plus the soft positions are at most the budget, and a glimpse answered inside the turn
is cut to what is left, so the bound holds on every generation of the turn.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable, Protocol

from palimpsest.models.memory import MemoryConfig, MemoryRead
from palimpsest.platform.compile.budget import Budget
from palimpsest.platform.compile.context_edits import applied
from palimpsest.platform.compile.epochs import with_soft
from palimpsest.platform.embedding import EmbedderUnavailable
from palimpsest.platform.prompt.chat import declared_tools, glimpse_call, memory_read, with_glimpse
from palimpsest.platform.runtime import Runtime
from palimpsest.platform.types import (
    BudgetError,
    CompiledTurn,
    GlimpseLimitError,
    LedgerUnavailableError,
    UnknownSessionError,
    UnknownStepError,
)
from palimpsest.serving.http.schemas import TurnOut
from palimpsest.serving.http.tenancy import TurnPolicies
from palimpsest.serving.turn.request import TurnRequest
from palimpsest.serving.turn.stream import StreamGate, streamed


class Generate(Protocol):
    """The actor: one generation from context ids, an optional soft span, and bridge ids."""

    def __call__(self, request: dict, memory: Any = None) -> Awaitable[dict]: ...


class WaitClock(Protocol):
    """The embedder's clock of time spent waiting and of the requests sent (its own thread-local figures)."""

    def reset_wait(self) -> None: ...

    @property
    def waited_ms(self) -> float: ...

    @property
    def requests(self) -> int: ...

    @property
    def lookups(self) -> int: ...

    @property
    def joined(self) -> int: ...


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
    # the plan's embeddings: texts looked up, lookups that waited for a priming request in flight, requests the
    # plan sent itself (with priming on append the last two are 0)
    embed: dict[str, int] = field(default_factory=dict)
    stop_sequence: str | None = None  # the stop string that ended the reply, as the actor matched it
    sized: Sized | None = None  # what the turn was compiled at (a memory that sent nothing: no soft positions)


@dataclass(frozen=True)
class Sized:
    """What the server decided of a turn (``TurnService.size``): the arm's policy, the budget (total, the reply,
    the soft positions reserved when the arm has memory), the declared tools when the actor parses tool calls, and
    how long a planning turn waits for missing step keys (``turns.keys_wait_s``)."""
    policy: Any
    budget: Budget
    tools: list[dict] | None = None
    keys_wait_s: float = 0.0
    # the policy at another budget (a request's context edit puts the budget in its watermarks): where a memory
    # sends nothing, the turn is its policy's at the budget without the soft positions
    policy_at: Callable[[Budget], Any] | None = None

    def without_soft(self) -> "Sized":
        budget = self.budget.without_soft()
        policy = self.policy_at(budget) if self.policy_at is not None else self.policy
        return dataclasses.replace(self, budget=budget, policy=policy)


async def compile_turn(rt: Runtime, req: TurnRequest, sized: Sized, clock: WaitClock | None,
                       record: bool = True, keys: bool = True) -> tuple[CompiledTurn, dict[str, float], str | None]:
    """Plan and compile in a worker thread (policies may block on the embedder); when the embedder is down
    the turn is planned as if no step had a key yet. Returns (turn, the embedder's part: ms waited, texts
    looked up, lookups that joined a priming request in flight, requests the plan sent itself; fallback).

    A turn that plans (a compaction boundary, or a policy that plans every turn) while some step has no key
    yet first waits, up to ``sized.keys_wait_s``, for the enrichment to write them (``Runtime.await_keys``): the
    plan is then the one every replica makes, not one of whichever keys existed at that moment. ``keys_ms``
    and ``keys_missing`` say what it waited for. ``record=False``: a preview, audited and stored nowhere;
    ``keys=False``: planned as if no key existed at once (the embedder already failed this turn)."""
    spent: dict[str, float] = {"ms": 0.0, "lookups": 0, "joined": 0, "requests": 0, "keys_ms": 0.0, "keys_missing": 0}

    def plan(keys: bool):
        if clock is not None:
            clock.reset_wait()
        try:
            if keys and sized.keys_wait_s > 0:
                missing = rt.missing_keys(req.session_id)
                if missing:
                    preview = rt.turn(req.session_id, sized.policy, sized.budget, None, False, keys)
                    if preview.compacted or preview.boundary is None:  # this turn plans: its keys matter
                        t0 = time.perf_counter()
                        rt.await_keys(req.session_id, sized.keys_wait_s)
                        spent["keys_ms"] += (time.perf_counter() - t0) * 1000
                        spent["keys_missing"] = missing
            return rt.turn(req.session_id, sized.policy, sized.budget, None, record, keys)
        finally:  # a failed attempt's wait and requests count too (read in the thread that made them)
            if clock is not None:
                for k, v in (("ms", clock.waited_ms), ("lookups", clock.lookups), ("joined", clock.joined),
                             ("requests", clock.requests)):
                    spent[k] += v

    if not keys:
        return await asyncio.to_thread(plan, False), spent, "embedder"
    try:
        return await asyncio.to_thread(plan, True), spent, None
    except EmbedderUnavailable:
        return await asyncio.to_thread(plan, False), spent, "embedder"


def turn_memory(rt: Runtime, ct: CompiledTurn, spec: MemoryRead) -> tuple[list[int], list[int]] | None:
    """What the memory reads of a served turn, as its bundle says (``spec``), or None where nothing was left out;
    the REMORY data builder makes the same call (``platform.prompt.chat.memory_read``) on the same compiled turn."""
    return memory_read(rt.ledger.tokenizer, ct, spec.max_field_chars, spec.max_history_tokens)


def _slots(memory: Any) -> int:
    """Soft positions of a span the memory sends (its ``soft``: S rows), 0 without one."""
    return 0 if memory is None else len(memory["soft"])


async def _with_memory(rt: Runtime, req: TurnRequest, sized: Sized, clock: WaitClock | None,
                       memory_for: Callable[[CompiledTurn], Awaitable[Any]]):
    """A memory arm's turn. It is previewed with room for the soft span, and the span is read from what that
    prompt left out. Where the memory sends nothing (the prompt left nothing out, or its span gate is shut) the
    room goes back to the text: the turn is compiled, and recorded, as its policy alone serves it
    (``Budget.without_soft``), so a memory that sends nothing costs the actor nothing. Where it sends a span the
    turn is recorded at the preview's budget; if that prompt differs from the preview (another replica stored a
    boundary between the two), the span is read again from it. The preview waits for no missing key (the recorded
    turn does, once), and an embedder that failed the preview is not asked again. Returns (turn, span or None, the
    sizes it was compiled at, the embedder's part, fallback, ms spent on the memory)."""
    preview, embed, fallback = await compile_turn(rt, req, dataclasses.replace(sized, keys_wait_s=0.0), clock,
                                                  record=False)
    t0 = time.perf_counter()
    memory = await memory_for(preview)
    memory_ms = (time.perf_counter() - t0) * 1000
    if memory is None:
        sized = sized.without_soft()
    ct, spent, fallback = await compile_turn(rt, req, sized, clock, keys=fallback is None)
    embed = {k: embed[k] + spent[k] for k in embed}
    if memory is not None and list(ct.prompt.ids) != list(preview.prompt.ids):
        t0 = time.perf_counter()
        memory = await memory_for(ct)  # None here serves the recorded prompt with its room unused: a rare race
        memory_ms += (time.perf_counter() - t0) * 1000
    return ct, memory, sized, embed, fallback, memory_ms


async def run_turn(rt: Runtime, req: TurnRequest, sized: Sized, generate: Generate, glimpse_limit: int,
                   memory_for: Callable[[CompiledTurn], Awaitable[Any]] | None = None, clock: WaitClock | None = None,
                   stream: Callable[[dict, Any], AsyncIterator[dict]] | None = None,
                   emit: Callable[[str], Awaitable[None]] | None = None,
                   started: Callable[[CompiledTurn, int], Awaitable[None]] | None = None) -> TurnResult:
    """One served turn. With ``stream`` and ``emit``, the final answer's content is handed to ``emit`` as
    it is generated (a glimpse round inside the turn never is); the result is the same either way.
    ``started`` is told the compiled turn and its soft positions before the actor is first called (a stream's
    opening names its size). ``memory_for(ct)``: the soft span the memory sends for a compiled turn, or None."""
    t_start = time.perf_counter()
    memory, memory_ms = None, 0.0
    if memory_for is not None and sized.budget.soft:
        ct, memory, sized, embed, fallback, memory_ms = await _with_memory(rt, req, sized, clock, memory_for)
    else:
        ct, embed, fallback = await compile_turn(rt, req, sized, clock)
    plan_ms = (time.perf_counter() - t_start) * 1000 - memory_ms
    if started is not None:
        await started(ct, _slots(memory))
    request = req.actor_fields(sized.budget.reply, sized.tools)
    room = sized.budget.prompt
    messages = list(ct.prompt.messages)
    context, bridge = list(ct.prompt.context_ids), list(ct.prompt.bridge_ids)
    glimpsed: list[int] = []
    actor_ms, completion, generations, prompt_total, cached_total = 0.0, 0, 0, 0, 0
    tok = rt.ledger.tokenizer
    gate = None
    while True:
        if stream is not None and emit is not None:
            gate = StreamGate(emit, may_glimpse=len(glimpsed) < glimpse_limit)
            out = await streamed(stream({**request, "context": context, "bridge": bridge, "messages": messages},
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
        latency={"plan": plan_ms, "embed": embed["ms"], "memory": memory_ms or float(out.get("memory_ms", 0.0)),
                 "actor": actor_ms, "total": total_ms},
        fallback=fallback, out=out, content=out.get("content", out["text"]),
        tool_calls=list(out.get("tool_calls") or []),
        embed={k: embed[k] for k in ("lookups", "joined", "requests", "keys_missing", "keys_ms")},
        stop_sequence=out.get("stop_sequence"), sized=sized)


class TurnService:
    """Every served turn of an ingress replica: its size (budget, reply, soft positions, 422 past the actor's
    window), the compiled prompt and the memory's soft span, the actor, the record under its arm, and the offer
    to the shadow lane. Built once the replica's dependencies answered (``Replica._start``)."""

    def __init__(self, runtime: Runtime, cfg, policies: dict, actor, memory, actor_info: dict, memory_info: dict,
                 metrics, shadow=None, enqueue: Callable[[str], None] | None = None):
        self.runtime, self.cfg, self.policies = runtime, cfg, policies
        self.actor, self.memory, self.actor_info, self.memory_info = actor, memory, actor_info, memory_info
        self.metrics, self.shadow, self.enqueue = metrics, shadow, enqueue
        self.inflight = 0  # turns being served on this replica (the shadow lane waits for none)
        self.resolve = TurnPolicies(cfg, runtime, policies)  # the arm's, a tenant's pin, a request's edit

    def memory_of(self, armcfg) -> str | None:
        """The memory encoder's key for this arm (its own model, else the default), or None: no soft memory."""
        if not armcfg.memory:
            return None
        models = self.memory_info["models"]
        key = armcfg.name if armcfg.name in models else "default"
        return key if models[key]["enabled"] else None

    def read_spec(self, mem: str) -> MemoryRead:  # what memory model ``mem`` reads of a turn: its bundle's spec
        return MemoryRead(**self.memory_info["models"][mem]["read"])

    def soft_positions(self, mem: str, history: int) -> int:
        """Soft positions model ``mem`` yields for a read of ``history`` ids (MemoryConfig.slots_for, <= the room)."""
        m = self.memory_info["models"][mem]
        return MemoryConfig(**{k: m[k] for k in ("block_size", "queries", "max_slots")}).slots_for(history)

    def size(self, armcfg, budget: int | None, max_tokens: int | None) -> tuple[Budget, str | None]:
        """(budget, memory key) of a turn on this arm; a BudgetError (422) when the budget exceeds the actor's
        window or leaves no room for the reply and the soft span."""
        total = budget or armcfg.budget or self.cfg.budget
        window = self.actor_info["max_model_len"]
        if total > window:
            raise BudgetError(f"budget: {total} tokens exceeds the actor's window of {window}")
        mem = self.memory_of(armcfg)
        soft = self.memory_info["models"][mem]["max_slots"] if mem is not None else 0
        return Budget(total, max_tokens or self.cfg.actor.max_tokens, soft), mem

    async def serve(self, session, arm: str, req: TurnRequest, emit: Callable[[str], Awaitable[None]] | None = None,
                    started: Callable[[dict], Awaitable[None]] | None = None):
        """One turn of ``session`` (the ledger's ``req.session_id``) on ``arm`` (the router's choice). A failure
        that is not the caller's is counted and recorded under the arm, then raised. ``req.noted``: request fields
        read that change nothing for this actor, recorded with the turn (``requested_<name>``)."""
        ledger, sid = self.runtime.ledger, session.id
        self.inflight += 1
        try:
            return await self._serve(session, arm, req, emit, started)
        except Exception as e:
            self.metrics.errors.labels(arm=arm, kind=type(e).__name__).inc()
            if (isinstance(e, (UnknownSessionError, BudgetError, LedgerUnavailableError))
                    or getattr(e, "status", 500) < 500):
                raise  # the caller's mistakes are not the arm's, and nothing can be recorded without the ledger
            await asyncio.to_thread(ledger.record_served, sid, ledger.count(sid), arm, {"error": type(e).__name__})
            raise
        finally:
            self.inflight -= 1

    async def _serve(self, session, arm: str, req: TurnRequest, emit, started=None):
        sid = session.id
        pin = self.resolve.pin(sid)  # the tenant's pinned policy, budget and compaction mode, if any
        budget, mem = self.size(self.cfg.arm(arm), self.resolve.budget(pin, req.budget), req.max_tokens)
        policy = self.resolve.policy(arm, pin, req.edits, budget)
        sized = Sized(policy, budget, declared_tools(session.tools) if self.actor_info.get("tool_parser") else None,
                      self.cfg.turns.keys_wait_s, lambda at: self.resolve.policy(arm, pin, req.edits, at))

        async def memory_for(ct):
            """The span memory ``mem`` sends for ``ct``, awaited (whether it sends one decides the prompt), or None:
            the prompt left nothing out, or the span gate is shut (an empty span)."""
            read = await asyncio.to_thread(turn_memory, self.runtime, ct, self.read_spec(mem))
            if read is None:
                return None
            span = await self.memory.encode.remote(mem, sid, *read)
            return span if len(span["soft"]) else None

        async def opened(ct, soft: int):
            """The size of the turn's first generation, before the actor is called (a stream's opening usage):
            its ids, the soft positions of the span sent, and what the epoch expects the cache to hold."""
            ids = len(ct.prompt.context_ids) + len(ct.prompt.bridge_ids)
            await started({"prompt": ids + soft, "expected_cached": int((ct.cost or {}).get("cached", 0))})

        stream = (lambda r, m: self.actor.options(stream=True).generate_stream.remote(r, m)) if emit else None
        res = await run_turn(self.runtime, req, sized, self.actor.generate.remote, self.cfg.limits.glimpses_per_turn,
                             memory_for if mem is not None else None, clock=self.runtime.embedder,
                             stream=stream, emit=emit, started=opened if started is not None else None)
        if res.fallback:
            self.metrics.fallbacks.labels(arm=arm, kind=res.fallback).inc()
            if self.enqueue is not None:
                self.enqueue(sid)
        ct, sent = res.compiled, res.sized or sized  # sent: without the soft positions where the memory sent nothing
        tokens = {"context": ct.prompt.tokens, "prefix": ct.prompt.prefix_tokens, "soft": res.soft_tokens,
                  "prompt": res.prompt_tokens, "completion": res.completion_tokens, "cached": res.cached_tokens,
                  "reserve": ct.prompt.reserve, "generations": res.generations, "prompt_total": res.prompt_tokens_total,
                  "full_history_estimate": ct.plan.info.get("full_tokens_estimate", ct.prompt.tokens),
                  "cached_total": res.cached_tokens_total}
        await asyncio.to_thread(self._record, sid, arm, ct, res, tokens, emit is not None, dict(req.noted),
                                req.tool_choice, TurnPolicies.recorded(pin, sent.policy))
        self.metrics.observe_turn(arm, tokens, res.latency, len(res.glimpses))
        if self.shadow is not None:
            self._offer(sid, arm, mem, ct, res, sent.budget)
        edit = None if req.edits is None else applied(req.edits, ct.plan, ct.snapshot, sent.policy.cfg,
                                                       sent.budget.total, bool(ct.compacted),
                                                       sent.budget.total - sent.budget.prompt)
        return TurnOut(session_id=sid, t=ct.t, arm=arm, action=res.text, finish_reason=res.finish_reason,
                       stop_sequence=res.stop_sequence, context_edit=edit,
                       plan=ct.plan.counts(), tokens=tokens, latency_ms=res.latency, glimpses=res.glimpses,
                       prompt_hash=ct.prompt.prompt_hash, content=res.content, tool_calls=res.tool_calls)

    def _record(self, sid: str, arm: str, ct: CompiledTurn, res: TurnResult, tokens: dict, streamed: bool,
                noted: dict, tool_choice: Any = None, policy: dict | None = None) -> None:
        """The turn under its arm: tokens, latency by stage, and what its ids should cost against the session's
        previous turn (``compile.epochs.turn_cost``) beside what the actor's cache really held (tokens_cached)."""
        cost = with_soft(ct.cost, len(ct.prompt.ids), res.soft_tokens) if ct.cost else {}
        self.runtime.ledger.record_served(sid, ct.t, arm, {
            **{f"tokens_{k}": v for k, v in tokens.items()}, **{f"{k}_ms": v for k, v in res.latency.items()},
            "glimpses": len(res.glimpses), "budget": ct.budget,
            "memory_cached": bool(res.out.get("memory_cached", False)),
            "elided": len(ct.plan.info.get("elided", [])), "tool_calls": len(res.tool_calls), "streamed": streamed,
            **({"tool_choice": json.dumps(tool_choice, sort_keys=True)} if tool_choice is not None else {}),
            **{f"embed_{k}": v for k, v in res.embed.items()},
            "compaction": bool(ct.compacted), "rebuilt": bool(ct.compacted) or ct.boundary is None,
            **({"expected_cached": cost["cached"], "uncached": cost["uncached"], "billed": cost["billed"],
                "prefix_reuse": cost["prefix_reuse"]} if cost else {}),
            **({"fallback": res.fallback} if res.fallback else {}),
            **{f"elasticizer_{k}": v for k, v in ct.plan.info.get("model_calls", {}).items()},  # ace's LLM calls
            **(policy or {}), **{f"requested_{k}": v for k, v in noted.items()}})

    def _offer(self, sid: str, arm: str, mem: str | None, ct: CompiledTurn, res: TurnResult, budget=None) -> None:
        async def score(reference: list[int], reply: list[int], threads: int | None = None) -> tuple[float, float]:
            """Both prompts of the turn scored by the memory encoder's actor (a memory arm's span is cached)."""
            # the span only where the turn sent one (a memory that sent nothing was served its policy's prompt)
            sent = mem and res.soft_tokens
            read = await asyncio.to_thread(turn_memory, self.runtime, ct, self.read_spec(mem)) if sent else None
            p = ct.prompt
            return await self.memory.score.remote(mem if read else None, sid, *(read or ([], [])),
                                                  list(p.context_ids), list(p.bridge_ids), reply, reference, threads)

        self.shadow.offer(sid, arm, ct, res.out.get("token_ids") or [], res.generations, res.soft_tokens,
                          self.policies[arm], score, budget)
