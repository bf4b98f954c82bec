"""The HTTP shapes shared by every route: the FastAPI app, errors in the shape of each route's protocol
(``errors.py``), the body-size limit, the replica header, tenants (API keys -> disjoint session namespaces), and
the one driver of streamed turns."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException

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
from palimpsest.serving.http import errors
from palimpsest.serving.http.errors import HistoryConflict
from palimpsest.serving.models.embeds import EmbedsError
from palimpsest.serving.models.remote import UpstreamError, UpstreamUnavailable


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


class HTTPProblem(Exception):
    def __init__(self, status: int, message: str):
        self.status, self.message = status, message


_STATUS = ((UpstreamUnavailable, 503), (UpstreamError, 502), (LedgerUnavailableError, 503), (UnknownSessionError, 404),
           (UnknownStepError, 404), (GlimpseLimitError, 429), (HistoryConflict, 409), (EmbedsError, 400),
           (BudgetError, 422), (ConfigError, 422), (LedgerError, 409), (PalimpsestError, 400))


def error_response(request: Request | None, status: int, message: str) -> JSONResponse:
    """An error in the shape of the protocol the route speaks (``serving/http/errors.py``), with ``Retry-After`` on
    a 503 (the operation did not commit: a retry is safe)."""
    path = request.url.path if request is not None else ""
    root = request.scope.get("root_path", "") if request is not None else ""
    if root and path.startswith(root):  # Serve keeps a route prefix in the path (serve.route_prefix)
        path = path[len(root):]
    anthropic_client = request is not None and "anthropic-version" in request.headers
    status, body = errors.body(errors.protocol_of(path, anthropic_client), status, message)
    return JSONResponse(body, status_code=status, headers={"Retry-After": "5"} if status in (503, 529) else None)


@app.exception_handler(HTTPProblem)
async def _problem(request: Request, e: HTTPProblem):
    return error_response(request, e.status, e.message)


@app.exception_handler(PalimpsestError)
async def _palimpsest_error(request: Request, e: PalimpsestError):
    return error_response(request, next(code for cls, code in _STATUS if isinstance(e, cls)), str(e))


@app.exception_handler(StarletteHTTPException)
async def _http_exception(request: Request, e: StarletteHTTPException):
    """Starlette's own (an unknown route is a 404, a wrong method a 405), in the protocol's shape."""
    response = error_response(request, e.status_code, str(e.detail))
    for k, v in (e.headers or {}).items():
        response.headers[k] = v
    return response


@app.exception_handler(Exception)
async def _unexpected(request: Request, e: Exception):
    """What is neither the caller's nor an upstream's: logged whole, answered as the protocol's server error."""
    code = status_of(e)
    if code == 500:
        logging.getLogger("palimpsest.ingress").error("request failed", exc_info=e)
    return error_response(request, code, f"{type(e).__name__}: {e}" if code == 500 else str(e))


def status_of(e: BaseException) -> int:
    """The HTTP status of an error raised while serving (500 for what is not the caller's or an upstream's)."""
    if isinstance(e, HTTPProblem):
        return e.status
    if isinstance(e, PalimpsestError):
        return next(code for cls, code in _STATUS if isinstance(e, cls))
    return 503 if _retriable_error(e) else 500


@app.exception_handler(RecursionError)
async def _too_deep(request: Request, e: RecursionError):
    return error_response(request, 400, "the JSON body is nested too deeply")


#: Limits the middleware applies, set by the replica when it starts (``configure``). A module global, not
#: ``app.state``: ``serve.ingress`` serves a pickled copy of ``app``, whose state the replica never sees.
LIMITS: dict[str, int | None] = {"max_request_bytes": None}


def configure(max_request_bytes: int) -> None:
    LIMITS["max_request_bytes"] = max_request_bytes


class _BodyLimit:
    """The limit on bodies sent without a ``Content-Length`` (chunked): the bytes are counted as the route reads
    them, and past the limit the read fails as a 413 in the route's protocol shape (nothing is recorded: the
    body is read before anything is)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        limit = LIMITS.get("max_request_bytes")
        if scope["type"] != "http" or limit is None:
            return await self.app(scope, receive, send)
        seen = 0

        async def counted():
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b"")) if message["type"] == "http.request" else 0
            if seen > limit:  # Starlette's own: FastAPI passes it through a body it is parsing
                raise StarletteHTTPException(413, f"the body has more than {limit} bytes; at most {limit} are "
                                                  "accepted")
            return message

        await self.app(scope, counted, send)


app.add_middleware(_BodyLimit)


@app.middleware("http")
async def _body_limit(request: Request, call_next):
    """Refuse bodies over the configured size before reading them (413), and undecodable ones (400)."""
    limit = LIMITS.get("max_request_bytes")
    length = request.headers.get("content-length")
    if limit is not None and length is not None:
        if not length.isdigit():
            return error_response(request, 400, "invalid Content-Length")
        if int(length) > limit:
            return error_response(request, 413, f"the body has {length} bytes; at most {limit} are accepted")
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
async def _invalid(request: Request, e: RequestValidationError):
    msgs = []
    for err in e.errors()[:5]:
        loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
        msgs.append(f"{loc or 'body'}: {err.get('msg')}")
    return error_response(request, 422, "; ".join(msgs))


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




def unsent(content: str | None, sent: str) -> str:
    """The part of a reply's final ``content`` a stream has not sent (its text so far being ``sent``)."""
    if not content or content == sent:
        return ""
    return content[len(sent):] if content.startswith(sent) else ("" if sent else content)


async def stream_turn(run, writer, on_gone=None, ping_s: float | None = None):
    """The body of a streamed turn as server-sent events: ``writer`` (an OpenAI ``ChunkWriter`` or an Anthropic
    ``MessagesEvents``, ``ResponsesEvents``) renders the opening, what the turn tells once it is compiled
    (``started``: its size), each text delta ``run(emit, started)`` hands over while the turn generates, the
    closing events of the finished turn, or an error as an event (the 200 status line is already sent), and the
    ending. Every ``ping_s`` seconds without an event (a long prefill), the writer's keep-alive. A client that
    goes away cancels the turn (and its generation); ``on_gone`` is told."""
    queue: asyncio.Queue = asyncio.Queue()

    async def put(items: list[str]) -> None:
        for item in items:
            await queue.put(item)

    async def emit(text: str) -> None:
        await put(writer.text(text))

    async def started(info: dict) -> None:
        await put(writer.started(info))

    async def drive() -> None:
        try:
            turn = await run(emit, started)
            await put(writer.closing(turn))
        except Exception as e:
            code = status_of(e)
            if code >= 500 and code != 503:
                logging.getLogger("palimpsest.ingress").exception("streamed turn failed")
            message = e.message if isinstance(e, HTTPProblem) else (str(e) if code < 500 or code == 503 else
                                                                    f"{type(e).__name__}: {e}")
            await put(writer.error(code, message))
        finally:
            await queue.put(None)

    task = asyncio.ensure_future(drive())
    try:
        for item in writer.opening():
            yield item
        while True:
            try:
                item = await (asyncio.wait_for(queue.get(), ping_s) if ping_s else queue.get())
            except asyncio.TimeoutError:
                if not queue.empty():  # an event arrived as the wait ended: it goes first (the opening before a ping)
                    continue
                for ping in writer.ping():
                    yield ping
                continue
            if item is None:
                break
            yield item
        for item in writer.ending():
            yield item
    finally:
        if not task.done():  # the client went away: stop generating
            task.cancel()
            if on_gone is not None:
                on_gone()
