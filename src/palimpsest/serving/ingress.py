"""The HTTP ingress (FastAPI inside a Serve deployment): the routes, tenants and A/B arms.

A turn: the session's arm (the router) -> the served turn (``serving/turn.py:TurnService``: its size, the
platform's compiled prompt, the soft span of what it left out, the actor, the glimpse loop, the record under
its arm, the offer to the shadow lane) -> its wire format (``openai_proxy.py``, ``anthropic_proxy.py``). Appends
return once the step is durable; summaries and key embeddings are written in the background
(``serving/enrichment.py``) and a turn never waits for them. Every error the caller can fix is a 4xx with a
one-line message (``serving/http.py``); nothing stored is lost and the server stays up.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import threading
import time
import uuid
from typing import Any

from fastapi import Query, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from ray import serve

from palimpsest.platform import Ledger, Runtime
from palimpsest.platform.abstraction import RuleSummarizer
from palimpsest.platform.chat import MEMORY_READ_VERSION
from palimpsest.platform.chat import chat_ids
from palimpsest.platform.tokens import get_tokenizer
from palimpsest.platform.types import (
    ConfigError,
    StepRecord,
)
from palimpsest.serving.ab import Router
from palimpsest.serving.config import parse_serve_config
from palimpsest.serving.embeds import decode_embeds
from palimpsest.serving.enrichment import Enrichment, HandleEmbedder
from palimpsest.serving.http import (
    ARM_HEADER,
    SESSION_HEADER,
    HTTPProblem,
    Tenant,
    _palimpsest_error,  # noqa: F401  (re-exported for tests that call the handler directly)
    _retriable_error,
    app,
    stream_turn,
)
from palimpsest.serving.metrics import Metrics
from palimpsest.serving import anthropic_proxy
from palimpsest.serving import openai_proxy
from palimpsest.serving.openai_proxy import new_steps, parse_messages, step_view
from palimpsest.serving.schemas import (
    ChatIn,
    CompletionIn,
    GlimpseIn,
    GlimpseOut,
    OutcomeIn,
    SessionIn,
    SessionOut,
    StepIn,
    StepOut,
    TurnIn,
    TurnOut,
)
from palimpsest.serving.shadow import ShadowLane
from palimpsest.serving.turn import TurnService

log = logging.getLogger("palimpsest.ingress")


def _plain(content) -> str:
    """A message's content as text (its text parts joined), as the template renders it."""
    if content is None or isinstance(content, str):
        return content or ""
    return "\n".join(p.get("text", "") for p in content if isinstance(p, dict))


# The deployment is serialised when it is declared: what its methods call is defined above it.
def memory_warnings(cfg, memory_info: dict) -> list[str]:
    """Where an arm serves a memory model otherwise than it was trained: another policy config (its hash
    differs from the one recorded with the model's samples), or reading another amount of history."""
    out = []
    models = memory_info.get("models") or {}
    for arm in cfg.arms:
        if not arm.memory:
            continue
        entry = models.get(arm.name if arm.name in models else "default") or {}
        if not entry.get("enabled"):
            continue
        mine = arm.policy_config().config_hash()
        theirs = entry.get("policy_hash")
        if theirs is None:
            out.append(f"arm {arm.name!r}: memory model {entry.get('model')} records no policy config; it may have "
                       "been trained on prompts unlike this arm's")
        elif theirs != mine:
            out.append(f"arm {arm.name!r}: its policy config (hash {mine}) differs from the one memory model "
                       f"{entry.get('model')} was trained with (hash {theirs})")
        reads = entry.get("trained_reads") or {}
        served = {"memory_tokens": cfg.memory.max_history_tokens, "max_observation_chars": cfg.memory.max_field_chars}
        for key, value in served.items():
            if reads.get(key) is not None and reads[key] != value:
                out.append(f"arm {arm.name!r}: the memory reads {key}={value}, trained with {reads[key]} "
                           "(memory.max_history_tokens / memory.max_field_chars)")
        trained_read = reads.get("memory_read") or 1  # none recorded: trained before it was (version 1)
        if trained_read != MEMORY_READ_VERSION:
            out.append(f"arm {arm.name!r}: memory model {entry.get('model')} was trained on version {trained_read} "
                       f"of what the memory reads, served version {MEMORY_READ_VERSION} "
                       "(platform.chat.MEMORY_READ_VERSION: retrain it)")
        budget, trained = arm.budget or cfg.budget, entry.get("trained_budget")
        if trained and trained != budget:  # the prompts leave out other steps than the ones it learned from
            out.append(f"arm {arm.name!r}: serves at budget {budget}, its memory was trained on prompts at {trained}")
    return out


@serve.deployment(name="Ingress", max_ongoing_requests=64, health_check_period_s=10)
@serve.ingress(app)
class Ingress:
    def __init__(self, config: dict, actor, embedder, summarizer, memory):
        self.cfg = parse_serve_config(config)
        self.actor, self.embedder_h, self.summarizer, self.memory = actor, embedder, summarizer, memory
        self.router = Router.of(self.cfg.arms)
        self.metrics = Metrics([a.name for a in self.cfg.arms])
        app.state.max_request_bytes = self.cfg.limits.max_request_bytes
        self.tenants = {t.key_sha256: (name, t.allow_prompt_embeds) for name, t in self.cfg.auth.resolved().items()}
        self._ready: asyncio.Future | None = None
        self.warnings: list[str] = []
        self.enrichment: Enrichment | None = None
        self.runtime: Runtime | None = None
        self.shadow: ShadowLane | None = None
        self.turns: TurnService | None = None
        # vLLM's Anthropic protocol takes ~8 s to import on 2 cores: imported while the other deployments start,
        # and waited for before this replica is ready (the Messages routes and the served document need it)
        self._messages_loaded = threading.Thread(target=anthropic_proxy.load, name="messages-import", daemon=True)
        self._messages_loaded.start()

    # -- start-up ---------------------------------------------------------------------------

    async def _start(self) -> None:
        info = await self.actor.info.remote()
        self.actor_info = info
        anthropic_proxy.serve_models([info["model"], self.cfg.actor.model])  # the served document's names
        if not info.get("prompt_embeds", True) and any(a.memory for a in self.cfg.arms):
            raise ConfigError(f"arms {[a.name for a in self.cfg.arms if a.memory]} need soft memory, and the upstream "
                              f"actor at {info.get('remote')} does not take prompt embeds (vLLM --enable-prompt-embeds)")
        emb = await self.embedder_h.info.remote()
        self.memory_info = await self.memory.info.remote()
        self.warnings = memory_warnings(self.cfg, self.memory_info)
        for w in self.warnings:
            log.warning(w)
        self.summarizer_info = await self.summarizer.info.remote()
        # the actor's own template (or the one its config names): what the budget counts is what it receives
        tokenizer = get_tokenizer(info["tokenizer"], info.get("chat_template"))
        ledger = await asyncio.to_thread(Ledger, self.cfg.ledger, tokenizer, pool_size=self.cfg.ledger_pool_size)
        self.runtime = Runtime(ledger, embedder=HandleEmbedder(self.embedder_h, emb["name"]), summarizer=RuleSummarizer(),
                               glimpse_limit=self.cfg.limits.glimpses_per_turn, chat=self._chat,
                               snapshot_cache_bytes=self.cfg.turns.snapshot_cache_mib << 20)
        self.policies = {a.name: self.runtime.policy(a.policy_config()) for a in self.cfg.arms}
        self.enrichment = Enrichment(self.runtime, self.policies, self.summarizer, self.summarizer_info, self.metrics,
                                     self.cfg)
        self.shadow = ShadowLane(self.runtime, self.cfg.ab, info["max_model_len"],
                                 busy=lambda: self.turns.inflight > 0, metrics=self.metrics)
        self.turns = TurnService(self.runtime, self.cfg, self.policies, self.actor, self.memory, info,
                                 self.memory_info, self.metrics, self.shadow, self._enqueue)
        await asyncio.to_thread(self._messages_loaded.join)
        if anthropic_proxy.load_error() is not None:
            raise anthropic_proxy.load_error()

    async def _ensure(self) -> None:
        if self._ready is None:
            self._ready = asyncio.ensure_future(self._start())
        try:
            await asyncio.shield(self._ready)
        except Exception as e:
            self._ready = None
            raise HTTPProblem(503, f"not ready: {e}") from None

    def _chat(self, prompts: list[list[dict]]) -> list[str | None]:
        """The actor as a policy's language model (the `ace` LLM elasticizer): every prompt is sent at once
        (vLLM batches them), each reply waited for until the summarizer's timeout; failures are None.
        Policies plan in a worker thread, where blocking on handles is allowed."""
        responses = [self.actor.chat.remote(p, 4, "elasticizer") for p in prompts]
        deadline = time.monotonic() + self.cfg.summarizer.timeout_s
        out: list[str | None] = []
        for r in responses:
            try:
                out.append(r.result(timeout_s=max(0.1, deadline - time.monotonic())))
            except Exception:
                out.append(None)
        return out

    def reconfigure(self, user_config: dict) -> None:
        """`serve deploy` with new arm weights shifts traffic live (existing sessions keep their arm)."""
        weights = (user_config or {}).get("weights") or {}
        unknown = set(weights) - set(self.router.names)
        if unknown:
            raise ConfigError(f"weights for unknown arms {sorted(unknown)}")
        self.router = Router(self.router.names, tuple(float(weights.get(n, w)) for n, w in
                                                      zip(self.router.names, self.router.weights)))

    def _tenant(self, request: Request) -> Tenant:
        """The caller's tenant from ``Authorization: Bearer <key>`` (or ``X-API-Key``); 401 without a valid key
        when tenants are configured."""
        if not self.tenants:
            return Tenant(None, self.cfg.limits.allow_prompt_embeds)
        auth = request.headers.get("authorization", "")
        key = auth[7:].strip() if auth.lower().startswith("bearer ") else request.headers.get("x-api-key", "")
        digest = hashlib.sha256(key.encode("utf-8", "surrogateescape")).hexdigest() if key else ""
        for known, (name, embeds) in self.tenants.items():
            if digest and hmac.compare_digest(known, digest):
                return Tenant(name, embeds)
        raise HTTPProblem(401, "a valid API key is required (Authorization: Bearer <key>)")

    # -- sessions and steps -------------------------------------------------------------------

    def _enqueue(self, session_id: str) -> None:
        if self.enrichment is not None:
            self.enrichment.enqueue(session_id)

    def _arm_of(self, session) -> str:
        arm = session.meta.get("arm")
        return arm if arm in self.router.names else self.router.assign(session.id)

    @app.post("/v1/sessions", response_model=SessionOut, summary="Create a session (idempotent)")
    async def create_session(self, body: SessionIn, request: Request) -> SessionOut:
        await self._ensure()
        tenant = self._tenant(request)
        ext = body.session_id or uuid.uuid4().hex
        sid = tenant.internal(ext)
        arm = self.router.choose(sid, body.arm or request.headers.get(ARM_HEADER))
        s = await asyncio.to_thread(self.runtime.ledger.create_session, sid, body.task, body.system, body.tools, {"arm": arm})
        n = await asyncio.to_thread(self.runtime.ledger.count, sid)
        return SessionOut(session_id=ext, arm=self._arm_of(s), steps=n)

    @app.post("/v1/sessions/{session_id:path}/steps", response_model=StepOut, summary="Append a step (durable on return)")
    async def append_step(self, session_id: str, body: StepIn, request: Request) -> StepOut:
        await self._ensure()
        ext, session_id = session_id, self._tenant(request).internal(session_id)
        size = len(body.thought) + len(body.action) + len(body.observation or "")
        if size > self.cfg.limits.max_step_chars:
            raise HTTPProblem(413, f"the step has {size} characters; at most {self.cfg.limits.max_step_chars} are accepted")
        ledger = self.runtime.ledger
        rec = StepRecord(t=body.t or 0, kind=body.kind, thought=body.thought, action=body.action,
                         observation=body.observation, authority=body.authority, tool=body.tool)
        # Without t the step is the next one: t is assigned under the session's lock (concurrent appends each get
        # their own); with t the idempotent and conflict rules apply.
        step = await asyncio.to_thread(ledger.append if body.t is not None else ledger.append_next, session_id, rec)
        if self.cfg.turns.prime_on_append and self.enrichment is not None:
            # the next turn's query and the step's key, before we return
            await self.enrichment.prime_after_append(session_id, [step], self.cfg.turns.prime_timeout_s)
        self._enqueue(session_id)
        return StepOut(session_id=ext, step_id=step.id, t=step.t)

    @app.post("/v1/sessions/{session_id:path}/turn", response_model=TurnOut, summary="Compile the context and generate the next action")
    async def turn(self, session_id: str, request: Request, body: TurnIn | None = None) -> TurnOut:
        await self._ensure()
        out = await self._turn(self._tenant(request).internal(session_id), body or TurnIn())
        return out.model_copy(update={"session_id": session_id})

    @app.post("/v1/sessions/{session_id:path}/glimpse", response_model=GlimpseOut, summary="The full text of a step (counts against the turn's limit)")
    async def glimpse(self, session_id: str, body: GlimpseIn, request: Request) -> GlimpseOut:
        await self._ensure()
        text = await asyncio.to_thread(self.runtime.glimpse, self._tenant(request).internal(session_id), body.step_id)
        return GlimpseOut(session_id=session_id, step_id=body.step_id, text=text)

    @app.get("/v1/sessions/{session_id:path}/steps", summary="The recorded steps of a session, paged")
    async def list_steps(self, session_id: str, request: Request, start: int = Query(0, ge=0, le=2**53),
                         limit: int = Query(100, ge=1, le=1000)) -> dict:
        await self._ensure()
        sid = self._tenant(request).internal(session_id)
        steps = await asyncio.to_thread(self.runtime.ledger.steps, sid, start, limit)
        total = await asyncio.to_thread(self.runtime.ledger.count, sid)
        return {"session_id": session_id, "start": start, "total": total,
                "next": start + len(steps) if start + len(steps) < total else None,
                "steps": [step_view(s) for s in steps]}

    @app.get("/v1/sessions/{session_id:path}/audit", summary="Every audited turn of a session")
    async def audit(self, session_id: str, request: Request, plans: bool = False) -> dict:
        await self._ensure()
        turns = await asyncio.to_thread(self.runtime.ledger.audit, self._tenant(request).internal(session_id))
        if not plans:
            for t in turns:
                t.pop("plan")
        return {"session_id": session_id, "turns": turns}

    @app.post("/v1/sessions/{session_id:path}/outcome", summary="Post the session's outcome (A/B feedback)")
    async def outcome(self, session_id: str, body: OutcomeIn, request: Request) -> dict:
        await self._ensure()
        sid = self._tenant(request).internal(session_id)
        s = await asyncio.to_thread(self.runtime.ledger.session, sid)
        arm = self._arm_of(s)
        await asyncio.to_thread(self.runtime.ledger.record_outcome, sid, arm, body.value, body.note)
        self.metrics.outcomes.labels(arm=arm).observe(body.value)
        return {"session_id": session_id, "arm": arm, "value": body.value}

    # -- the turn -------------------------------------------------------------------------------

    async def _turn(self, sid: str, body: TurnIn, tool_choice: Any = None, parallel_tool_calls: bool | None = None,
                    emit=None, noted: dict | None = None) -> TurnOut:
        """The session's turn on its arm (``TurnService``); a replica that failed is a 503 to retry."""
        session = await asyncio.to_thread(self.runtime.ledger.session, sid)
        try:
            return await self.turns.serve(session, self._arm_of(session), body, tool_choice, parallel_tool_calls, emit,
                                          noted)
        except Exception as e:
            if _retriable_error(e):
                raise HTTPProblem(503, f"a model replica is unavailable ({type(e).__name__}); retry shortly") from None
            raise

    async def _check_turn(self, sid: str, body: TurnIn) -> None:
        """The checks of a turn's size that need no compile (a streamed turn runs them before its 200)."""
        session = await asyncio.to_thread(self.runtime.ledger.session, sid)
        self.turns.size(self.cfg.arm(self._arm_of(session)), body.budget, body.max_tokens)

    def _gone(self) -> None:
        self.metrics.errors.labels(arm="-", kind="ClientDisconnected").inc()

    # -- OpenAI-compatible --------------------------------------------------------------------

    async def _record_chat(self, body: ChatIn, tenant, ext: str, request: Request) -> str:
        """Record a chat request's message list in its session (the chat proxy and the Messages endpoint alike):
        the session is created on first sight, new steps are appended (resent ones must hash the same), and the
        next turn's embeddings are primed. Returns the session's internal id."""
        if len(body.messages) > self.cfg.limits.max_messages:
            raise HTTPProblem(413, f"{len(body.messages)} messages; at most {self.cfg.limits.max_messages} are accepted")
        if body.tools and body.tool_choice != "none" and not self.actor_info.get("tool_parser"):
            raise HTTPProblem(422, "tools: this actor reads no tool calls (configure actor.tool_parser and a "
                                   "tool-capable actor.chat_template), or send tool_choice \"none\"")
        sid = tenant.internal(ext)
        parsed = parse_messages(body.messages, self.cfg.proxy.user_messages_after_actions)
        for s in parsed.steps:
            size = len(s.action) + len(s.observation or "")
            if size > self.cfg.limits.max_step_chars:
                raise HTTPProblem(413, f"step t={s.t} has {size} characters; at most {self.cfg.limits.max_step_chars}")
        ledger = self.runtime.ledger
        arm = self.router.choose(sid, request.headers.get(ARM_HEADER))
        # Tool declarations belong to the session's stable prefix: recorded with it, declared in the system message
        # (a later request declaring other tools for the same session is a 409).
        tools = json.dumps(body.tools, sort_keys=True, ensure_ascii=False) if body.tools else None
        await asyncio.to_thread(ledger.create_session, sid, parsed.task, parsed.system, tools, {"arm": arm})

        def record() -> list:
            fresh = new_steps(ledger.hashes(sid), parsed.steps, parsed.alternates)
            return ledger.append_many(sid, fresh) if fresh else []

        appended = await asyncio.to_thread(record)
        if appended:
            if self.cfg.turns.prime_on_append and self.enrichment is not None:
                # the turn's query embeddings and the new steps' keys, before the turn plans (as POST /steps does)
                await self.enrichment.prime_after_append(sid, appended, self.cfg.turns.prime_timeout_s)
            self._enqueue(sid)
        return sid

    def _check_model(self, model: str | None) -> None:
        """A request naming a model this app does not serve is a 404, as the OpenAI API and vLLM answer it.
        Served: the actor's id (``GET /v1/models``) and its configured name (``actor.model``)."""
        served = {self.actor_info["model"], self.cfg.actor.model}
        if model is not None and model not in served:
            raise HTTPProblem(404, f"model: {model!r} is not served here; the served model is "
                                   f"{self.actor_info['model']!r}")

    @app.get("/v1/models", summary="The served actor (OpenAI-compatible)")
    async def models(self, request: Request) -> dict:
        await self._ensure()
        self._tenant(request)
        return {"object": "list", "data": [{"id": self.actor_info["model"], "object": "model", "created": 0,
                                            "owned_by": "palimpsest"}]}

    @app.post("/v1/chat/completions", summary="OpenAI-compatible chat: the history is recorded and the context compiled")
    async def chat_completions(self, body: ChatIn, request: Request):
        await self._ensure()
        tenant = self._tenant(request)
        self._check_model(body.model)
        ext = request.headers.get(SESSION_HEADER) or body.user
        if not ext:
            raise HTTPProblem(400, f"name the session: the {SESSION_HEADER!r} header or the 'user' field")
        sid = await self._record_chat(body, tenant, ext, request)
        stop = [body.stop] if isinstance(body.stop, str) else body.stop
        turn_in = TurnIn(max_tokens=body.max_completion_tokens or body.max_tokens, seed=body.seed, top_p=body.top_p,
                         stop=stop, temperature=1.0 if body.temperature is None else body.temperature)
        choice = body.tool_choice if body.tools else None
        head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": self.actor_info["model"]}
        if body.stream:  # what can be refused is refused before the 200 status line is sent
            await self._check_turn(sid, turn_in)
            writer = openai_proxy.ChunkWriter(head, ext, bool((body.stream_options or {}).get("include_usage")))
            run = lambda emit: self._turn(sid, turn_in, choice, body.parallel_tool_calls, emit=emit)  # noqa: E731
            return StreamingResponse(stream_turn(run, writer, self._gone), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        turn = await self._turn(sid, turn_in, choice, body.parallel_tool_calls)
        return openai_proxy.completion(turn, head, ext)

    # -- Anthropic Messages (serving/anthropic_proxy.py) ---------------------------------------

    async def _read_messages(self, request: Request, counting: bool = False):
        from pydantic import ValidationError

        try:
            raw = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise HTTPProblem(400, "the body is not JSON") from None
        if counting and isinstance(raw, dict):
            raw = {**raw, "max_tokens": raw.get("max_tokens", 1)}  # count_tokens takes no max_tokens
        try:
            req = await asyncio.to_thread(anthropic_proxy.read_request, raw)
        except anthropic_proxy.AnthropicInputError as e:
            raise HTTPProblem(400, str(e)) from None
        self._check_model(req.model)
        try:
            chat = ChatIn.model_validate(req.chat)
        except ValidationError as e:
            err = e.errors()[0]
            raise HTTPProblem(400, f"{'.'.join(str(x) for x in err['loc'])}: {err['msg']}") from None
        return req, chat

    @app.post("/v1/messages", summary="Anthropic Messages API: the history is recorded and the context compiled")
    async def messages(self, request: Request):
        await self._ensure()
        tenant = self._tenant(request)
        req, chat = await self._read_messages(request)
        ext = request.headers.get(SESSION_HEADER) or req.user_id or anthropic_proxy.history_session(req.chat["messages"])
        sid = await self._record_chat(chat, tenant, ext, request)
        turn_in = TurnIn(max_tokens=req.max_tokens, top_p=chat.top_p, stop=chat.stop,
                         temperature=1.0 if chat.temperature is None else chat.temperature)
        choice = chat.tool_choice if chat.tools else None
        model = self.actor_info["model"]
        if req.stream:  # what can be refused is refused before the 200 status line is sent
            await self._check_turn(sid, turn_in)
            writer = anthropic_proxy.EventWriter(model, lambda turn: openai_proxy.extension(ext, turn))
            run = lambda emit: self._turn(sid, turn_in, choice, chat.parallel_tool_calls, emit=emit,  # noqa: E731
                                          noted=req.noted)
            return StreamingResponse(stream_turn(run, writer, self._gone), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        turn = await self._turn(sid, turn_in, choice, chat.parallel_tool_calls, noted=req.noted)
        return anthropic_proxy.message(turn, model, openai_proxy.extension(ext, turn))

    @app.post("/v1/messages/count_tokens", summary="Anthropic count_tokens: the messages' ids as the actor's template "
                                                    "renders them, tools included (nothing is recorded)")
    async def count_tokens(self, request: Request) -> dict:
        await self._ensure()
        self._tenant(request)
        req, chat = await self._read_messages(request, counting=True)
        msgs = [{"role": m.role, "content": _plain(m.content),
                 **({"tool_calls": [c.model_dump() for c in m.tool_calls]} if m.tool_calls else {}),
                 **({"tool_call_id": m.tool_call_id} if m.tool_call_id else {})} for m in chat.messages]
        if chat.tools:
            if msgs[0]["role"] != "system":
                msgs.insert(0, {"role": "system", "content": ""})
            msgs[0]["tools"] = chat.tools
        ids = await asyncio.to_thread(chat_ids, self.runtime.ledger.tokenizer, msgs)
        return {"input_tokens": len(ids.all)}

    @app.post("/v1/completions", summary="Raw completion from a prompt or from prompt_embeds (base64 of torch.save)")
    async def completions(self, body: CompletionIn, request: Request) -> dict:
        await self._ensure()
        tenant = self._tenant(request)
        self._check_model(body.model)
        if (body.prompt is None) == (body.prompt_embeds is None):
            raise HTTPProblem(400, "give exactly one of prompt or prompt_embeds")
        if body.prompt_embeds is not None and not tenant.allow_prompt_embeds:
            raise HTTPProblem(403, "client-supplied prompt_embeds are not enabled for this caller "
                                   "(auth.tenants.<name>.allow_prompt_embeds, or limits.allow_prompt_embeds without tenants)")
        req: dict[str, Any] = {"max_tokens": body.max_tokens or self.cfg.actor.max_tokens,
                               "temperature": body.temperature, "seed": body.seed}
        if body.prompt_embeds is not None:
            req["embeds"] = decode_embeds(body.prompt_embeds, self.actor_info["hidden_size"],
                                          min(self.actor_info["max_embeds_len"],
                                              self.actor_info["max_model_len"] - req["max_tokens"]),
                                          self.cfg.limits.max_request_bytes)
        else:
            ids = self.runtime.ledger.tokenizer.encode(body.prompt)
            if not ids:
                raise HTTPProblem(400, "the prompt is empty")
            if len(ids) + req["max_tokens"] > self.actor_info["max_model_len"]:
                raise HTTPProblem(422, f"the prompt has {len(ids)} tokens; with max_tokens={req['max_tokens']} it "
                                       f"exceeds the actor's window of {self.actor_info['max_model_len']}")
            req["ids"] = ids
        try:
            out = await self.actor.generate.remote(req)
        except Exception as e:
            if _retriable_error(e):
                raise HTTPProblem(503, f"the actor is unavailable ({type(e).__name__}); retry shortly") from None
            raise
        return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": self.actor_info["model"],
                "choices": [{"index": 0, "text": out["text"], "token_ids": out["token_ids"],
                             "finish_reason": out["finish_reason"] or "stop"}],
                "usage": {"prompt_tokens": out["prompt_tokens"], "completion_tokens": len(out["token_ids"]),
                          "total_tokens": out["prompt_tokens"] + len(out["token_ids"])}}

    # -- operations ---------------------------------------------------------------------------

    @app.get("/healthz", summary="Liveness")
    async def healthz(self) -> dict:
        return {"status": "ok"}

    @app.get("/readyz", summary="Readiness: every deployment answered and the ledger is open")
    async def readyz(self):
        try:
            await self._ensure()
        except HTTPProblem as e:
            return JSONResponse({"ready": False, "error": e.message}, status_code=503)
        return {"ready": True, "arms": dict(zip(self.router.names, self.router.weights)),
                "actor": self.actor_info["model"], "remote": self.actor_info.get("remote"),
                "prompt_embeds": self.actor_info.get("prompt_embeds", True), "memory": self.memory_info, "summarizer": self.summarizer_info,
                "embedder": self.runtime.embedder.name, "warnings": self.warnings,
                "shadow": self.shadow.state() if self.shadow is not None else None}

    @app.get("/v1/ab/shadow", summary="Shadow fidelity: samples queued, scored and skipped on this replica")
    async def shadow_state(self, request: Request, wait_s: float = Query(0.0, ge=0.0, le=3600.0)) -> dict:
        """With ``wait_s``, first wait (at most that long) until the queued samples are scored or skipped. The
        replica's counts over every tenant, with no session named; a valid key is required, as on every route
        that is not a health check."""
        await self._ensure()
        self._tenant(request)
        drained = await self.shadow.drained(wait_s) if wait_s else self.shadow.queue.qsize() == 0
        return {**self.shadow.state(), "drained": drained}

    @app.get("/v1/busy", summary="Where the models' time went: the actor by kind of generation (turn, summary, "
                                 "elasticizer), the memory encoder's encoding and shadow scoring")
    async def busy(self, request: Request) -> dict:
        """Request-seconds and tokens per kind since the replicas started (``ActorEngine.busy``,
        ``MemoryEncoder.stats``): the demo's breakdown of the actor's time reads it."""
        await self._ensure()
        self._tenant(request)
        actor, memory = await asyncio.gather(self.actor.busy.remote(), self.memory.stats.remote())
        return {"actor": actor, "memory": memory}

    @app.get("/metrics", summary="Prometheus metrics", response_class=PlainTextResponse)
    async def prometheus(self):
        return PlainTextResponse(self.metrics.render(), media_type="text/plain; version=0.0.4")
