"""The HTTP shapes shared by every route: the FastAPI app, errors as one-line 4xx/5xx bodies, the body-size
limit, the replica header, and tenants (API keys -> disjoint session namespaces)."""

from __future__ import annotations

import types
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from ray import serve

from palimpsest.platform.types import (
    BudgetError,
    ConfigError,
    GlimpseLimitError,
    LedgerError,
    LedgerUnavailableError,
    PalimpsestError,
    UnknownSessionError,
    UnknownStepError,
)
from palimpsest.serving.embeds import EmbedsError
from palimpsest.serving.openai_proxy import HistoryConflict
from palimpsest.serving.remote import UpstreamError, UpstreamUnavailable

def _retriable() -> tuple[type[BaseException], ...]:
    """Failures of a child replica (died, restarting, overloaded): the request may simply be retried."""
    from ray import exceptions as rx
    from ray.serve import exceptions as sx

    names = ("RayActorError", "ActorDiedError", "ActorUnavailableError", "ActorUnschedulableError", "GetTimeoutError")
    out = [getattr(rx, n) for n in names if hasattr(rx, n)]
    out += [getattr(sx, n) for n in ("BackPressureError", "DeploymentUnavailableError", "RequestCancelledError")
            if hasattr(sx, n)]
    return tuple(out)


_RETRIABLE = _retriable()


def _retriable_error(e: BaseException) -> bool:
    """A replica failure (by class, including a dead vLLM engine, which arrives wrapped by Ray)."""
    return isinstance(e, _RETRIABLE) or any(c.__name__ in ("EngineDeadError", "UpstreamUnavailable")
                                            for c in type(e).__mro__)
SESSION_HEADER = "x-palimpsest-session"
ARM_HEADER = "x-palimpsest-arm"

app = FastAPI(title="Palimpsest", version="1.0",
              description="Working memory for long-horizon agents: sessions, steps, compiled turns with soft memory, "
                          "glimpse, audit, A/B arms, and an OpenAI-compatible chat endpoint.")


def _openapi(self: FastAPI) -> dict:
    """The served document (``/openapi.json``), with the request bodies the Messages routes read raw: vLLM's
    protocol models (imported by the ingress before it is ready) and the served model names (known once it is).
    Asked for before the ingress is ready, the document comes without those two bodies and is not kept: the
    event loop never waits for that import."""
    if self.openapi_schema is None:
        from palimpsest.serving import anthropic_proxy

        doc = FastAPI.openapi(self)
        models = anthropic_proxy.served_models()  # known once the ingress has asked the actor
        if not (anthropic_proxy.loaded() and models):
            self.openapi_schema = None
            return doc
        try:
            self.openapi_schema = anthropic_proxy.documented(doc, models)
        except Exception:
            self.openapi_schema = None  # never keep the document without the two bodies
            raise
    return self.openapi_schema


# Bound to this app before Serve freezes it (``serve.ingress`` pickles the app as it is at decoration).
app.openapi = types.MethodType(_openapi, app)


class HTTPProblem(Exception):
    def __init__(self, status: int, message: str):
        self.status, self.message = status, message


_STATUS = ((UpstreamUnavailable, 503), (UpstreamError, 502), (LedgerUnavailableError, 503), (UnknownSessionError, 404), (UnknownStepError, 404), (GlimpseLimitError, 429), (HistoryConflict, 409),
           (EmbedsError, 400), (BudgetError, 422), (ConfigError, 422), (LedgerError, 409), (PalimpsestError, 400))


@app.exception_handler(HTTPProblem)
async def _problem(_: Request, e: HTTPProblem):
    return JSONResponse({"error": e.message}, status_code=e.status,
                        headers={"Retry-After": "5"} if e.status == 503 else None)


@app.exception_handler(PalimpsestError)
async def _palimpsest_error(_: Request, e: PalimpsestError):
    status = next(code for cls, code in _STATUS if isinstance(e, cls))
    # 503: the ledger's database is out of reach; the operation did not commit, so a retry is safe.
    return JSONResponse({"error": str(e)}, status_code=status, headers={"Retry-After": "5"} if status == 503 else None)


def status_of(e: BaseException) -> int:
    """The HTTP status of an error raised while serving (500 for what is not the caller's or an upstream's)."""
    if isinstance(e, HTTPProblem):
        return e.status
    if isinstance(e, PalimpsestError):
        return next(code for cls, code in _STATUS if isinstance(e, cls))
    return 503 if _retriable_error(e) else 500


@app.exception_handler(RecursionError)
async def _too_deep(_: Request, e: RecursionError):
    return JSONResponse({"error": "the JSON body is nested too deeply"}, status_code=400)


@app.middleware("http")
async def _body_limit(request: Request, call_next):
    """Refuse bodies over the configured size before reading them (413), and undecodable ones (400)."""
    limit = getattr(request.app.state, "max_request_bytes", None)
    length = request.headers.get("content-length")
    if limit is not None and length is not None:
        if not length.isdigit():
            return JSONResponse({"error": "invalid Content-Length"}, status_code=400)
        if int(length) > limit:
            return JSONResponse({"error": f"the body has {length} bytes; at most {limit} are accepted"}, status_code=413)
    response = await call_next(request)
    response.headers[REPLICA_HEADER] = _replica_tag()
    return response


REPLICA_HEADER = "X-Palimpsest-Replica"


_REPLICA_TAG: str | None = None


def _replica_tag() -> str:
    """Which ingress replica answered, and on which Ray node: ``<replica>@<node>`` (several replicas on
    several nodes may serve one session). Fixed for the process: looked up once."""
    global _REPLICA_TAG
    if _REPLICA_TAG is None:
        try:
            import ray

            node = ray.get_runtime_context().get_node_id()[:12]
            _REPLICA_TAG = f"{serve.get_replica_context().replica_id.unique_id}@{node}"
        except Exception:
            return "-"
    return _REPLICA_TAG


@app.exception_handler(RequestValidationError)
async def _invalid(_: Request, e: RequestValidationError):
    msgs = []
    for err in e.errors()[:5]:
        loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
        msgs.append(f"{loc or 'body'}: {err.get('msg')}")
    return JSONResponse({"error": "; ".join(msgs)}, status_code=422)


@dataclass(frozen=True)
class Tenant:
    name: str | None  # None: the single-tenant (no keys, loopback) server
    allow_prompt_embeds: bool

    def internal(self, session_id: str) -> str:
        """The ledger's id of a tenant's session: tenants live in disjoint namespaces, so another tenant's
        session (and every step id inside it) is simply not found."""
        if not isinstance(session_id, str) or not session_id:
            raise HTTPProblem(422, "a session id is required")
        return session_id if self.name is None else f"{self.name}::{session_id}"

    def external(self, internal_id: str) -> str:
        return internal_id if self.name is None else internal_id.split("::", 1)[1]




async def stream_turn(run, writer, on_gone=None):
    """The body of a streamed turn as server-sent events: ``writer`` (an OpenAI ``ChunkWriter`` or an Anthropic
    ``EventWriter``) renders the opening, each text delta ``run(emit)`` hands over while the turn generates, the
    closing events of the finished turn, or an error as an event (the 200 status line is already sent), and the
    ending. A client that goes away cancels the turn (and its generation); ``on_gone`` is told."""
    import asyncio
    import logging

    queue: asyncio.Queue = asyncio.Queue()

    async def emit(text: str) -> None:
        for item in writer.text(text):
            await queue.put(item)

    async def drive() -> None:
        try:
            turn = await run(emit)
            for item in writer.closing(turn):
                await queue.put(item)
        except Exception as e:
            code = status_of(e)
            if code >= 500 and code != 503:
                logging.getLogger("palimpsest.ingress").exception("streamed turn failed")
            message = e.message if isinstance(e, HTTPProblem) else (str(e) if code < 500 or code == 503 else
                                                                    f"{type(e).__name__}: {e}")
            for item in writer.error(code, message):
                await queue.put(item)
        finally:
            await queue.put(None)

    task = asyncio.ensure_future(drive())
    try:
        for item in writer.opening():
            yield item
        while (item := await queue.get()) is not None:
            yield item
        for item in writer.ending():
            yield item
    finally:
        if not task.done():  # the client went away: stop generating
            task.cancel()
            if on_gone is not None:
                on_gone()
