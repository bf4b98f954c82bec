"""The HTTP ingress (FastAPI inside a Serve deployment): the routes, and nothing else.

Each route checks that the replica is composed (``replica.py``: ledger, runtime, arms, the served turn,
enrichment, shadow lane, tenants) and hands the request to the module of its protocol: Palimpsest's own
sessions (``sessions.py``), OpenAI's chat and completions (``openai_proxy.py``) and Responses
(``responses_proxy.py``), Anthropic's Messages
(``anthropic_proxy.py``). The shapes every route shares (the app, errors per protocol, the body limit,
tenants, streaming) are ``http.py``'s. A turn: the session's arm (the router) -> the served turn
(``turn.py:TurnService``) -> its wire format. Appends return once the step is durable; summaries and key
embeddings are written in the background (``enrichment.py``) and a turn never waits for them.
"""

from __future__ import annotations

import asyncio
import types

from fastapi import FastAPI, Query, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from ray import serve

from palimpsest.serving.http import (
    anthropic_protocol,
    anthropic_proxy,
    openai_proxy,
    responses_proxy,
    sessions,
)
from palimpsest.serving.http.schemas import (
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
from palimpsest.serving.http.server import HTTPProblem, app
from palimpsest.serving.turn.replica import Replica


def _openapi(self: FastAPI) -> dict:
    """The served document (``/openapi.json``), with the request bodies the Messages and Responses routes read
    raw: vLLM's protocol models (imported by the replica before it is ready) and the served model names (known
    once it is). Asked for before the replica is ready, the document comes without those two bodies and is not
    kept: the event loop never waits for that import."""
    if self.openapi_schema is None:
        doc = FastAPI.openapi(self)
        models = anthropic_protocol.served_models()  # known once the replica has asked the actor
        if not (anthropic_protocol.loaded() and models):
            self.openapi_schema = None  # FastAPI.openapi keeps what it built: this one must not be kept
            return doc
        try:
            self.openapi_schema = responses_proxy.documented(anthropic_proxy.documented(doc, models), models)
        except Exception:
            self.openapi_schema = None  # never keep the document without the two bodies
            raise
    return self.openapi_schema


# Bound to the app before Serve freezes it (``serve.ingress`` pickles the app as it is at decoration).
app.openapi = types.MethodType(_openapi, app)


@serve.deployment(name="Ingress", max_ongoing_requests=64, health_check_period_s=10)
@serve.ingress(app)
class Ingress:
    def __init__(self, config: dict, actor, embedder, summarizer, memory):
        self.replica = Replica(config, actor, embedder, summarizer, memory)

    def reconfigure(self, user_config: dict) -> None:
        """`serve deploy` with new arm weights shifts traffic live (existing sessions keep their arm)."""
        self.replica.reconfigure(user_config)

    async def _ready(self) -> Replica:
        await self.replica.ready()
        return self.replica

    # -- sessions and steps (sessions.py) -----------------------------------------------------------

    @app.post("/v1/sessions", response_model=SessionOut, summary="Create a session (idempotent)")
    async def create_session(self, body: SessionIn, request: Request) -> SessionOut:
        return await sessions.create(await self._ready(), body, request)

    @app.post("/v1/sessions/{session_id:path}/steps", response_model=StepOut,
              summary="Append a step (durable on return)")
    async def append_step(self, session_id: str, body: StepIn, request: Request) -> StepOut:
        return await sessions.append(await self._ready(), session_id, body, request)

    @app.post("/v1/sessions/{session_id:path}/turn", response_model=TurnOut,
              summary="Compile the context and generate the next action")
    async def turn(self, session_id: str, request: Request, body: TurnIn | None = None) -> TurnOut:
        return await sessions.turn(await self._ready(), session_id, body, request)

    @app.post("/v1/sessions/{session_id:path}/glimpse", response_model=GlimpseOut,
              summary="The full text of a step (counts against the turn's limit)")
    async def glimpse(self, session_id: str, body: GlimpseIn, request: Request) -> GlimpseOut:
        return await sessions.glimpse(await self._ready(), session_id, body, request)

    @app.get("/v1/sessions/{session_id:path}/steps", summary="The recorded steps of a session, paged")
    async def list_steps(self, session_id: str, request: Request, start: int = Query(0, ge=0, le=2**53),
                         limit: int = Query(100, ge=1, le=1000)) -> dict:
        return await sessions.steps(await self._ready(), session_id, start, limit, request)

    @app.get("/v1/sessions/{session_id:path}/audit", summary="Every audited turn of a session")
    async def audit(self, session_id: str, request: Request, plans: bool = False) -> dict:
        return await sessions.audit(await self._ready(), session_id, plans, request)

    @app.post("/v1/sessions/{session_id:path}/outcome", summary="Post the session's outcome (A/B feedback)")
    async def outcome(self, session_id: str, body: OutcomeIn, request: Request) -> dict:
        return await sessions.outcome(await self._ready(), session_id, body, request)

    # -- OpenAI-compatible (openai_proxy.py) ---------------------------------------------------------

    @app.get("/v1/models", summary="The served actor (OpenAI's list; Anthropic's to a client that sends "
                                   "anthropic-version)")
    async def models(self, request: Request) -> dict:
        replica = await self._ready()
        replica.tenant(request)
        if "anthropic-version" in request.headers:
            return anthropic_proxy.models(replica)
        return openai_proxy.models(replica)

    @app.post("/v1/chat/completions",
              summary="OpenAI-compatible chat: the history is recorded and the context compiled")
    async def chat_completions(self, body: ChatIn, request: Request):
        return await openai_proxy.chat_completions(await self._ready(), body, request)

    @app.post("/v1/completions", summary="Raw completion from a prompt or from prompt_embeds (base64 of torch.save)")
    async def completions(self, body: CompletionIn, request: Request) -> dict:
        return await openai_proxy.completions(await self._ready(), body, request)

    @app.post("/v1/responses", summary="OpenAI Responses API (Codex CLI, client.responses): the conversation is "
                                       "recorded and the context compiled; stored responses resolve "
                                       "previous_response_id")
    async def responses(self, request: Request):
        return await responses_proxy.responses(await self._ready(), request)

    # -- Anthropic Messages (anthropic_proxy.py) -----------------------------------------------------

    @app.post("/v1/messages", summary="Anthropic Messages API: the history is recorded and the context compiled")
    async def messages(self, request: Request):
        return await anthropic_proxy.messages(await self._ready(), request)

    @app.post("/v1/messages/count_tokens", summary="Anthropic count_tokens: the whole history as a served turn "
                                                    "renders it, uncompressed, tools and Palimpsest's prefix included "
                                                    "(nothing is recorded)")
    async def count_tokens(self, request: Request) -> dict:
        return await anthropic_proxy.count_tokens(await self._ready(), request)

    # -- operations ---------------------------------------------------------------------------------

    @app.get("/healthz", summary="Liveness")
    async def healthz(self) -> dict:
        return {"status": "ok"}

    @app.get("/readyz", summary="Readiness: every deployment answered and the ledger is open")
    async def readyz(self):
        try:
            return (await self._ready()).readiness()
        except HTTPProblem as e:
            return JSONResponse({"ready": False, "error": e.message}, status_code=503)

    @app.get("/v1/ab/shadow", summary="Shadow fidelity: samples queued, scored and skipped on this replica")
    async def shadow_state(self, request: Request, wait_s: float = Query(0.0, ge=0.0, le=3600.0)) -> dict:
        """With ``wait_s``, first wait (at most that long) until the queued samples are scored or skipped. The
        replica's counts over every tenant, with no session named; a valid key is required, as on every route
        that is not a health check."""
        replica = await self._ready()
        replica.tenant(request)
        shadow = replica.shadow
        drained = await shadow.drained(wait_s) if wait_s else shadow.queue.qsize() == 0
        return {**shadow.state(), "drained": drained}

    @app.get("/v1/busy", summary="Where the models' time went: the actor by kind of generation (turn, summary, "
                                 "elasticizer), the memory encoder's encoding and shadow scoring")
    async def busy(self, request: Request) -> dict:
        """Request-seconds and tokens per kind since the replicas started (``ActorEngine.busy``,
        ``MemoryEncoder.stats``): the demo's breakdown of the actor's time reads it."""
        replica = await self._ready()
        replica.tenant(request)
        actor, memory = await asyncio.gather(replica.actor.busy.remote(), replica.memory.stats.remote())
        return {"actor": actor, "memory": memory}

    @app.get("/metrics", summary="Prometheus metrics", response_class=PlainTextResponse)
    async def prometheus(self):
        return PlainTextResponse(self.replica.metrics.render(), media_type="text/plain; version=0.0.4")
