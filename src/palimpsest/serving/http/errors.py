"""Error bodies in each protocol's own shape: a client of the Messages API reads Anthropic's, a client of the
chat and completion routes reads OpenAI's, and Palimpsest's own routes keep their one-line body.

- Anthropic (``/v1/messages*``): ``{"type": "error", "error": {"type", "message"}}``, the type by status as the
  Messages API documents it (400 ``invalid_request_error``, 401 ``authentication_error``, 403
  ``permission_error``, 404 ``not_found_error``, 413 ``request_too_large``, 429 ``rate_limit_error``, 500
  ``api_error``, 503/529 ``overloaded_error``). The API has no 409 or 422: a history conflict or an
  unservable size is its 400 ``invalid_request_error``. In a stream the same object is the ``error`` event.
- OpenAI (``/v1/chat/completions``, ``/v1/completions``, ``/v1/responses``, ``/v1/models`` and any unknown
  ``/v1`` route): ``{"error": {"message", "type",
  "param", "code"}}`` as the OpenAI API sends it: ``invalid_request_error`` for the caller's mistakes,
  ``server_error`` for ours; ``param`` is the field the message names, ``code`` a short reason or null.
- Palimpsest (sessions, steps, turns, operations): ``{"error": "<message>"}``.
"""

from __future__ import annotations

import re

from palimpsest.platform.types import PalimpsestError

ANTHROPIC, OPENAI, PALIMPSEST = "anthropic", "openai", "palimpsest"


class HistoryConflict(PalimpsestError):
    """A message list rewrites history the ledger already holds (a 409; the Messages API's 400)."""

_OPENAI_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")
#: Palimpsest's own routes under /v1 (sessions, the A/B lane, the models' time)
_PALIMPSEST_PREFIXES = ("/v1/sessions", "/v1/ab/", "/v1/busy")

#: Anthropic's error type per status (the Messages API's "Errors" page)
ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                   404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
                   503: "overloaded_error", 529: "overloaded_error"}
#: Statuses the Messages API never sends, and the one it sends for the same cause
_ANTHROPIC_STATUS = {409: 400, 422: 400}

#: OpenAI's ``code`` per status where the API sends one
_OPENAI_CODES = {401: "invalid_api_key", 403: "permission_denied", 404: "not_found", 409: "conflict",
                 413: "request_too_large", 429: "rate_limit_exceeded"}

#: A message that starts by naming its field: ``messages[2].content: ...``
_FIELD = re.compile(r"^([A-Za-z_][\w.\[\]]*): ")


def protocol_of(path: str, anthropic_client: bool = False) -> str:
    """The protocol a route speaks, by its path. The OpenAI routes (chat, completions, responses) and the
    Messages routes have one each; Palimpsest's own routes (sessions, ``/v1/ab/*``, ``/v1/busy``, health,
    metrics) theirs. Any other path under ``/v1`` (``/v1/models``, which both APIs define, and an unknown
    route) answers an Anthropic client (its requests carry ``anthropic-version``) in Anthropic's shape and
    any other client in OpenAI's."""
    if path == "/v1/messages" or path.startswith("/v1/messages/"):
        return ANTHROPIC
    if path in _OPENAI_PATHS or any(path.startswith(p + "/") for p in _OPENAI_PATHS):
        return OPENAI
    if path.startswith(_PALIMPSEST_PREFIXES) or not path.startswith("/v1/"):
        return PALIMPSEST
    return ANTHROPIC if anthropic_client else OPENAI


def anthropic_error(status: int, message: str) -> tuple[int, dict]:
    """(status, the ``error`` object) as the Messages API sends them."""
    status = _ANTHROPIC_STATUS.get(status, status)
    kind = ANTHROPIC_TYPES.get(status) or ("api_error" if status >= 500 else "invalid_request_error")
    return status, {"type": kind, "message": message}


def openai_error(status: int, message: str) -> dict:
    """The ``error`` object as the OpenAI API sends it."""
    field = _FIELD.match(message)
    code = _OPENAI_CODES.get(status)
    if status == 404 and message.startswith("model:"):
        code = "model_not_found"
    return {"message": message, "type": "server_error" if status >= 500 else "invalid_request_error",
            "param": field.group(1) if field else None, "code": code}


def body(protocol: str, status: int, message: str) -> tuple[int, dict]:
    """(the status to send, the body) of an error on a route of ``protocol``."""
    if protocol == ANTHROPIC:
        status, error = anthropic_error(status, message)
        return status, {"type": "error", "error": error}
    if protocol == OPENAI:
        return status, {"error": openai_error(status, message)}
    return status, {"error": message}


def unread_field(raw, fields: set[str]) -> str | None:
    """Why a request body is refused before it is read (not an object, or a field the endpoint does not read),
    naming the field; None when it may be read."""
    if not isinstance(raw, dict):
        return "the body must be a JSON object"
    extra = set(raw) - fields
    return f"{sorted(extra)[0]}: not served by this endpoint (nothing is ignored silently; remove the field)" \
        if extra else None
