"""The HTTP ingress (FastAPI inside a Serve deployment): the routes, and nothing else.

Every route but the health checks and the metrics takes one dependency, :func:`caller`: the replica is composed
(``serving/turn/replica.py``: ledger, runtime, arms, the served turn, enrichment, shadow lane, tenants) and the
caller's key names its tenant. The route hands both to the module of its protocol: Palimpsest's own sessions
(``sessions.py``), OpenAI's chat and completions (``openai_proxy.py``) and Responses (``responses_proxy.py``),
Anthropic's Messages (``anthropic_proxy.py``). The shapes every route shares (the app, errors per protocol, the
body limit, tenants, streaming) are ``server.py``'s. A turn: the session's arm (the router) -> the served turn
(``turn.py:TurnService``) -> its wire format. Appends return once the step is durable; summaries and key
embeddings are written in the background (``enrichment.py``) and a turn never waits for them.
"""

from __future__ import annotations

import asyncio
import types
from dataclasses import dataclass

from fastapi import Depends, FastAPI, Query, Request
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
from palimpsest.serving.http.server import HTTPProblem, Tenant, app
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


@dataclass(frozen=True)
class Caller:
    """Who calls and who answers: the composed replica and the caller's tenant (``Replica.tenant``: 401 without a
    valid key when tenants are configured). Every route but the health checks and the metrics takes one."""

    replica: Replica
    tenant: Tenant


async def caller(request: Request) -> Caller:
    """The routes' one dependency: the replica is composed (503 until it is) and the caller's key names its
    tenant, before the handler runs and before the body model is validated (a body that is not JSON, or too
    large, is refused first)."""
    ingress = serve.get_replica_context().servable_object  # this replica's Ingress (as Serve's own routes find it)
    replica = await ingress._ready()
    return Caller(replica, replica.tenant(request))


CALLER = Depends(caller)


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
    async def create_session(self, body: SessionIn, request: Request, c: Caller = CALLER) -> SessionOut:
        return await sessions.create(c.replica, c.tenant, body, request)

    @app.post("/v1/sessions/{session_id:path}/steps", response_model=StepOut,
              summary="Append a step (durable on return)")
    async def append_step(self, session_id: str, body: StepIn, c: Caller = CALLER) -> StepOut:
        return await sessions.append(c.replica, c.tenant, session_id, body)

    @app.post("/v1/sessions/{session_id:path}/turn", response_model=TurnOut,
              summary="Compile the context and generate the next action")
    async def turn(self, session_id: str, body: TurnIn | None = None, c: Caller = CALLER) -> TurnOut:
        return await sessions.turn(c.replica, c.tenant, session_id, body)

    @app.post("/v1/sessions/{session_id:path}/glimpse", response_model=GlimpseOut,
              summary="The full text of a step (counts against the turn's limit)")
    async def glimpse(self, session_id: str, body: GlimpseIn, c: Caller = CALLER) -> GlimpseOut:
        return await sessions.glimpse(c.replica, c.tenant, session_id, body)

    @app.get("/v1/sessions/{session_id:path}/steps", summary="The recorded steps of a session, paged")
    async def list_steps(self, session_id: str, start: int = Query(0, ge=0, le=2**53),
                         limit: int = Query(100, ge=1, le=1000), c: Caller = CALLER) -> dict:
        return await sessions.steps(c.replica, c.tenant, session_id, start, limit)

    @app.get("/v1/sessions/{session_id:path}/audit", summary="Every audited turn of a session")
    async def audit(self, session_id: str, plans: bool = False, c: Caller = CALLER) -> dict:
        return await sessions.audit(c.replica, c.tenant, session_id, plans)

    @app.post("/v1/sessions/{session_id:path}/outcome", summary="Post the session's outcome (A/B feedback)")
    async def outcome(self, session_id: str, body: OutcomeIn, c: Caller = CALLER) -> dict:
        return await sessions.outcome(c.replica, c.tenant, session_id, body)

    # -- OpenAI-compatible (openai_proxy.py) ---------------------------------------------------------

    @app.get("/v1/models", summary="The served actor (OpenAI's list; Anthropic's to a client that sends "
                                   "anthropic-version)")
    async def models(self, request: Request, c: Caller = CALLER) -> dict:
        if "anthropic-version" in request.headers:
            return anthropic_proxy.models(c.replica)
        return openai_proxy.models(c.replica)

    @app.post("/v1/chat/completions",
              summary="OpenAI-compatible chat: the history is recorded and the context compiled")
    async def chat_completions(self, body: ChatIn, request: Request, c: Caller = CALLER):
        return await openai_proxy.chat_completions(c.replica, c.tenant, body, request)

    @app.post("/v1/completions", summary="Raw completion from a prompt or from prompt_embeds (base64 of torch.save)")
    async def completions(self, body: CompletionIn, c: Caller = CALLER) -> dict:
        return await openai_proxy.completions(c.replica, c.tenant, body)

    @app.post("/v1/responses", summary="OpenAI Responses API (Codex CLI, client.responses): the conversation is "
                                       "recorded and the context compiled; stored responses resolve "
                                       "previous_response_id")
    async def responses(self, request: Request, c: Caller = CALLER):
        return await responses_proxy.responses(c.replica, c.tenant, request)

    # -- Anthropic Messages (anthropic_proxy.py) -----------------------------------------------------

    @app.post("/v1/messages", summary="Anthropic Messages API: the history is recorded and the context compiled")
    async def messages(self, request: Request, c: Caller = CALLER):
        return await anthropic_proxy.messages(c.replica, c.tenant, request)

    @app.post("/v1/messages/count_tokens", summary="Anthropic count_tokens: the whole history as a served turn "
                                                    "renders it, uncompressed, tools and Palimpsest's prefix included "
                                                    "(nothing is recorded)")
    async def count_tokens(self, request: Request, c: Caller = CALLER) -> dict:
        return await anthropic_proxy.count_tokens(c.replica, c.tenant, request)

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
    async def shadow_state(self, wait_s: float = Query(0.0, ge=0.0, le=3600.0), c: Caller = CALLER) -> dict:
        """With ``wait_s``, first wait (at most that long) until the queued samples are scored or skipped. The
        replica's counts over every tenant, with no session named; a valid key is required, as on every route
        that is not a health check."""
        shadow = c.replica.shadow
        drained = await shadow.drained(wait_s) if wait_s else shadow.queue.qsize() == 0
        return {**shadow.state(), "drained": drained}

    @app.get("/v1/busy", summary="Where the models' time went: the actor by kind of generation (turn, summary, "
                                 "elasticizer), the memory encoder's encoding and shadow scoring")
    async def busy(self, c: Caller = CALLER) -> dict:
        """Request-seconds and tokens per kind since the replicas started (``ActorEngine.busy``,
        ``MemoryEncoder.stats``): the demo's breakdown of the actor's time reads it."""
        actor, memory = await asyncio.gather(c.replica.actor.busy.remote(), c.replica.memory.stats.remote())
        return {"actor": actor, "memory": memory}

    @app.get("/metrics", summary="Prometheus metrics", response_class=PlainTextResponse)
    async def prometheus(self):
        return PlainTextResponse(self.replica.metrics.render(), media_type="text/plain; version=0.0.4")
