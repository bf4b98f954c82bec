"""The Anthropic Messages API on the chat proxy's path: Claude Code, the Claude Agent SDK and the ``anthropic``
clients get the same session model, ledger, policies, memory, tenants and audit as OpenAI clients.

A request is checked here field by field, then read by vLLM's own Anthropic protocol models and converted
to a chat-completions message list by vLLM's conversion (``vllm.entrypoints.anthropic``), which the chat
proxy records (``openai_proxy.parse_messages``): there is no second parser. vLLM's models ignore what they
do not know, and its conversion skips thinking blocks, so what the text actor cannot read (images,
documents, thinking, server tools, an unknown field) is refused first with a 400 naming it. The turn goes
back as Anthropic's ``message`` (text and ``tool_use`` blocks, ``stop_reason``, ``usage`` with the prefix
cache's ``cache_read_input_tokens``), or as its server-sent events when streamed.

vLLM is imported on the first request (this module is loaded by the ingress, which otherwise needs none).
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
import uuid
from dataclasses import dataclass
from typing import Any, Callable

from palimpsest.platform.types import PalimpsestError

#: The request fields read (what the Messages API defines and the text actor can honour)
FIELDS = {"model", "messages", "max_tokens", "metadata", "stop_sequences", "stream", "system", "temperature",
          "tool_choice", "tools", "top_p", "thinking", "output_config", "context_management"}
#: Context edits that have nothing to act on here (the actor writes no thinking blocks); any other edit is
#: refused: this gateway's own policy decides what of the history the actor sees
NOOP_EDITS = {"clear_thinking_20251015"}
#: Block fields per type; ``cache_control`` is Anthropic's cache hint (this server's cache is the compaction epoch)
BLOCK_FIELDS = {"text": {"type", "text", "cache_control", "citations"},
                "tool_use": {"type", "id", "name", "input", "cache_control"},
                "tool_result": {"type", "tool_use_id", "content", "is_error", "cache_control"}}
TOOL_FIELDS = {"name", "description", "input_schema", "cache_control", "type"}


#: A ``metadata.user_id`` that names a session as it is; any other is hashed into one (``user-<sha256>``)
_NAME = re.compile(r"^[\w.:/@+-]{1,200}$")


class AnthropicInputError(PalimpsestError):
    """A Messages request this endpoint refuses; the message names the field."""


def _check_blocks(blocks: Any, where: str, allowed: set[str]) -> None:
    if isinstance(blocks, str):
        return
    if not isinstance(blocks, list):
        raise AnthropicInputError(f"{where}: a string or a list of content blocks is needed")
    for j, b in enumerate(blocks):
        at = f"{where}[{j}]"
        kind = b.get("type") if isinstance(b, dict) else None
        if not isinstance(kind, str) or kind not in allowed:
            raise AnthropicInputError(f"{at}: a {kind!r} block cannot be read or produced by the text actor "
                                      f"(served: {', '.join(sorted(allowed))})")
        # what a client echoes back empty, or a tool call the model made itself, is nothing to record
        extra = {k for k in set(b) - BLOCK_FIELDS[kind] if b[k] not in (None, "", [], {})
                 and not (k == "caller" and b[k] == {"type": "direct"})}
        if extra:
            raise AnthropicInputError(f"{at}.{sorted(extra)[0]}: not read by this endpoint (nothing is ignored "
                                      "silently; remove the field)")
        if kind == "text" and b.get("citations"):
            raise AnthropicInputError(f"{at}.citations: citations are not served")
        if kind == "tool_result" and isinstance(b.get("content"), list):
            for k, part in enumerate(b["content"]):
                if not (isinstance(part, dict) and part.get("type") == "text" and set(part) <= BLOCK_FIELDS["text"]):
                    ptype = part.get("type") if isinstance(part, dict) else type(part).__name__
                    raise AnthropicInputError(f"{at}.content[{k}]: a {ptype!r} part of a tool result cannot be read "
                                              "by the text actor (send text)")


def check_request(raw: Any) -> None:
    """Refuse, naming the field, what vLLM's models would accept and then lose."""
    if not isinstance(raw, dict):
        raise AnthropicInputError("the body must be a JSON object")
    extra = set(raw) - FIELDS
    if extra:
        raise AnthropicInputError(f"{sorted(extra)[0]}: not served by this endpoint (nothing is ignored silently; "
                                  "remove the field)")
    thinking = raw.get("thinking")
    # "adaptive" leaves thinking to the model, and this one never thinks: what it asks for is what happens
    if thinking is not None and not (isinstance(thinking, dict) and thinking.get("type") in ("disabled", "adaptive")):
        raise AnthropicInputError("thinking: the actor produces no thinking blocks (send {\"type\": \"disabled\"} "
                                  "or {\"type\": \"adaptive\"}, or leave it out)")
    output = raw.get("output_config")
    if output is not None and not (isinstance(output, dict) and set(output) <= {"effort"}):
        raise AnthropicInputError("output_config: only effort is read (recorded with the turn; the actor has no "
                                  "reasoning effort to set); structured output formats are not served")
    edits = raw.get("context_management")
    if edits is not None:
        if not (isinstance(edits, dict) and set(edits) <= {"edits"} and isinstance(edits.get("edits", []), list)):
            raise AnthropicInputError("context_management: {\"edits\": [...]} is read")
        for k, e in enumerate(edits.get("edits", [])):
            if not (isinstance(e, dict) and e.get("type") in NOOP_EDITS):
                kind = e.get("type") if isinstance(e, dict) else None
                raise AnthropicInputError(f"context_management.edits[{k}]: a {kind!r} edit is not served (this gateway "
                                          "compiles the context itself; clearing thinking blocks, which the actor "
                                          "never writes, is accepted)")
    if raw.get("system") is not None:
        _check_blocks(raw["system"], "system", {"text"})
    messages = raw.get("messages")
    if not isinstance(messages, list) or not messages:
        raise AnthropicInputError("messages: a non-empty list is needed")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise AnthropicInputError(f"messages[{i}].role: user or assistant")
        if set(m) - {"role", "content"}:
            raise AnthropicInputError(f"messages[{i}].{sorted(set(m) - {'role', 'content'})[0]}: not read by this "
                                      "endpoint")
        allowed = {"text", "tool_use"} if m["role"] == "assistant" else {"text", "tool_result"}
        _check_blocks(m.get("content"), f"messages[{i}].content", allowed)
    tools = raw.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise AnthropicInputError("tools: a list of client tools is needed")
    for k, t in enumerate(tools or []):
        if not isinstance(t, dict) or set(t) - TOOL_FIELDS or t.get("type") not in (None, "custom"):
            raise AnthropicInputError(f"tools[{k}]: a client tool {{name, description, input_schema}} is served "
                                      "(server tools such as web search are not)")


@dataclass(frozen=True)
class MessagesRequest:
    """A checked Messages request and the chat-completions form the proxy records."""

    model: str
    stream: bool
    max_tokens: int
    user_id: str | None
    chat: dict  # the fields of a ChatIn: messages, tools, tool_choice, parallel_tool_calls, sampling
    noted: dict  # fields read that change nothing for this actor, recorded whole with the served turn (JSON)


def load() -> None:
    """Import vLLM's Anthropic protocol and conversion: ~8 s on 2 CPU cores, paid once per replica. The ingress
    starts it in a thread when it starts, so that the first Messages request does not wait for it (an import
    in progress is waited for by the import lock, never run twice)."""
    global _load_error
    try:
        import vllm.entrypoints.anthropic.protocol  # noqa: F401
        import vllm.entrypoints.anthropic.serving  # noqa: F401
    except BaseException as e:  # kept for the ingress to raise when it starts (a thread's error is otherwise lost)
        _load_error = e
        raise
    _loaded.set()


_load_error: BaseException | None = None


def load_error() -> BaseException | None:
    """What :func:`load` failed with in this process, if it did."""
    return _load_error


_loaded = threading.Event()
_served: list[str] = []


def loaded() -> bool:
    """Whether :func:`load` has finished in this process (importing here then costs nothing)."""
    return _loaded.is_set()


def serve_models(models: list[str]) -> None:
    """The model names this process serves (the ingress sets them once it knows the actor): the document's."""
    _served[:] = sorted(set(models))


def served_models() -> list[str]:
    return list(_served)


def read_request(raw: Any) -> MessagesRequest:
    """Check ``raw``, read it with vLLM's protocol model and convert it with vLLM's conversion."""
    check_request(raw)
    from pydantic import ValidationError
    from vllm.entrypoints.anthropic.protocol import AnthropicMessagesRequest
    from vllm.entrypoints.anthropic.serving import AnthropicServingMessages

    try:
        req = AnthropicMessagesRequest.model_validate(raw)
    except ValidationError as e:
        err = e.errors()[0]
        raise AnthropicInputError(f"{'.'.join(str(x) for x in err['loc'])}: {err['msg']}") from None
    chat = AnthropicServingMessages.to_chat_completion_request(req)
    tools = [t.model_dump(exclude_none=True) for t in (chat.tools or [])] or None
    choice = chat.tool_choice
    if choice is not None and not isinstance(choice, str):
        choice = choice.model_dump(exclude_none=True)
    # vLLM's conversion drops a tool result's is_error: it is written into the result's text instead
    failed = {b.tool_use_id for m in req.messages if not isinstance(m.content, str) for b in m.content
              if b.type == "tool_result" and b.is_error}
    messages = [dict(m) for m in chat.messages]
    for m in messages:
        if m.get("role") == "tool" and m.get("tool_call_id") in failed and isinstance(m.get("content"), str):
            m["content"] = "(the tool reported an error)\n" + m["content"]
    body: dict[str, Any] = {"messages": messages, "max_tokens": req.max_tokens,
                            "temperature": req.temperature, "top_p": req.top_p,
                            "stop": list(req.stop_sequences) if req.stop_sequences else None}
    if tools:
        body.update(tools=tools, tool_choice=choice if choice is not None else "auto")
        if req.tool_choice is not None and req.tool_choice.disable_parallel_tool_use is not None:
            body["parallel_tool_calls"] = not req.tool_choice.disable_parallel_tool_use
    user = (req.metadata or {}).get("user_id")
    user = user if isinstance(user, str) and user else None
    noted: dict[str, str] = {}
    if user is not None and not _NAME.match(user):  # e.g. Claude Code's, a JSON object with its session id
        user, noted["user_id"] = f"user-{hashlib.sha256(user.encode()).hexdigest()[:24]}", user
    # read, and changing nothing for this actor: recorded whole with the turn
    for field in ("thinking", "output_config", "context_management"):
        if raw.get(field) is not None:
            noted[field] = json.dumps(raw[field], sort_keys=True, ensure_ascii=False)
    return MessagesRequest(model=req.model, stream=bool(req.stream), max_tokens=req.max_tokens,
                           user_id=user, chat=body, noted=noted)


def history_session(messages: list[dict]) -> str:
    """A session named by the history itself (no ``metadata.user_id``): the system prompt and the task, hashed.
    Every resend of one conversation names the same session; the resend validation refuses a rewrite."""
    head = [m for m in messages if m.get("role") == "system"] + [m for m in messages if m.get("role") == "user"][:1]
    digest = hashlib.sha256(json.dumps(head, sort_keys=True, ensure_ascii=False).encode()).hexdigest()
    return f"anthropic-{digest[:24]}"


def stop_reason(turn) -> str:
    """Anthropic's stop reason of a turn: a tool call, the token cap, a stop sequence, or the end of the turn."""
    if turn.tool_calls:
        return "tool_use"
    return {"length": "max_tokens"}.get(turn.finish_reason or "stop", "end_turn")


def content_blocks(turn) -> list[dict]:
    """The reply as Anthropic content blocks: its text, then one ``tool_use`` per call (input as JSON; arguments
    that are not a JSON object are kept whole under ``_raw``, never dropped)."""
    out: list[dict] = []
    if turn.content:
        out.append({"type": "text", "text": turn.content})
    for c in turn.tool_calls:
        try:
            args = json.loads(c["function"]["arguments"] or "{}")
        except json.JSONDecodeError:
            args = None
        out.append({"type": "tool_use", "id": c["id"], "name": c["function"]["name"],
                    "input": args if isinstance(args, dict) else {"_raw": c["function"]["arguments"]}})
    return out


def usage(turn) -> dict:
    """Anthropic's usage: input tokens are what the prefix cache did not hold, ``cache_read_input_tokens`` what it
    did (summed over the turn's generations), as the Messages API splits them."""
    prompt = int(turn.tokens["prompt_total"])
    cached = int(turn.tokens.get("cached_total", turn.tokens["cached"]))
    return {"input_tokens": prompt - cached, "output_tokens": int(turn.tokens["completion"]),
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


def message(turn, model: str, extension: dict) -> dict:
    return {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant", "model": model,
            "content": content_blocks(turn), "stop_reason": stop_reason(turn), "stop_sequence": None,
            "usage": usage(turn), "palimpsest": extension}


def event(name: str, data: dict) -> str:
    """One server-sent event in Anthropic's framing."""
    return f"event: {name}\ndata: {json.dumps({'type': name, **data}, ensure_ascii=False)}\n\n"


def message_start(model: str, msg_id: str) -> str:
    return event("message_start", {"message": {
        "id": msg_id, "type": "message", "role": "assistant", "model": model, "content": [], "stop_reason": None,
        "stop_sequence": None, "usage": {"input_tokens": 0, "output_tokens": 0}}})


def closing_events(turn, text_open: bool, index: int, extension: dict) -> list[str]:
    """After the streamed text: its block's stop, one block per tool call (its input as one JSON delta), the
    stop reason with the usage, and ``message_stop``."""
    out = []
    if text_open:
        out.append(event("content_block_stop", {"index": index}))
        index += 1
    for block in content_blocks(turn):
        if block["type"] != "tool_use":
            continue
        out.append(event("content_block_start", {"index": index, "content_block": {**block, "input": {}}}))
        out.append(event("content_block_delta", {"index": index, "delta": {
            "type": "input_json_delta", "partial_json": json.dumps(block["input"], ensure_ascii=False)}}))
        out.append(event("content_block_stop", {"index": index}))
        index += 1
    out.append(event("message_delta", {"delta": {"stop_reason": stop_reason(turn), "stop_sequence": None},
                                       "usage": usage(turn), "palimpsest": extension}))
    out.append(event("message_stop", {}))
    return out


class EventWriter:
    """Anthropic's server-sent events for one streamed turn: ``message_start``, the answer's text as
    ``content_block_delta`` events (its block opened on the first text), each tool call as a ``tool_use`` block,
    the ``message_delta`` with the stop reason and usage, ``message_stop`` (``serving.http.stream_turn`` drives it)."""

    def __init__(self, model: str, extension: Callable[[Any], dict]):
        self.model, self.extension, self.opened = model, extension, False

    def opening(self) -> list[str]:
        return [message_start(self.model, f"msg_{uuid.uuid4().hex}")]

    def text(self, text: str) -> list[str]:
        out = []
        if not self.opened:
            self.opened = True
            out.append(event("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}}))
        out.append(event("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": text}}))
        return out

    def closing(self, turn) -> list[str]:
        return closing_events(turn, self.opened, 0, self.extension(turn))

    def error(self, code: int, message: str) -> list[str]:
        return [event("error", {"error": {"type": "invalid_request_error" if code < 500 else "api_error",
                                          "message": message}})]

    def ending(self) -> list[str]:
        return []


def documented(doc: dict, models: list[str] | None = None) -> dict:
    """The served OpenAPI document with the request bodies of ``/v1/messages`` and ``/v1/messages/count_tokens``:
    vLLM's protocol models (the routes read the raw body, so that every field is checked before vLLM's models,
    which ignore unknown fields, see it), narrowed to what this endpoint reads (``FIELDS``, ``BLOCK_FIELDS``,
    ``TOOL_FIELDS``; any other field is a 400) and, once the app knows them, to the ``models`` it serves (any
    other is a 404). Values inside those fields are not narrowed: the endpoint still refuses some that the
    schema allows (``thinking`` enabled, an ``output_config`` format, a non-positive ``max_tokens``). Clients
    and the fuzzer read the bodies from here."""
    from vllm.entrypoints.anthropic.protocol import AnthropicCountTokensRequest, AnthropicMessagesRequest

    ref = "#/components/schemas/{model}"
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    for path, model in (("/v1/messages", AnthropicMessagesRequest),
                        ("/v1/messages/count_tokens", AnthropicCountTokensRequest)):
        schema = model.model_json_schema(ref_template=ref)
        defs = schema.pop("$defs", {})
        _narrow(schema, FIELDS)
        if models:
            schema["properties"]["model"] = {"type": "string", "enum": list(models), "title": "Model"}
        _narrow(defs["AnthropicContentBlock"], set().union(*BLOCK_FIELDS.values()))
        defs["AnthropicContentBlock"]["properties"]["type"]["enum"] = sorted(BLOCK_FIELDS)
        _narrow(defs["AnthropicTool"], TOOL_FIELDS)
        _narrow(defs["AnthropicMessage"], {"role", "content"})
        schemas.update(defs)
        schemas[model.__name__] = schema
        doc["paths"][path]["post"]["requestBody"] = {
            "required": True, "content": {"application/json": {"schema": {"$ref": ref.format(model=model.__name__)}}}}
    return doc


def _narrow(schema: dict, fields: set[str]) -> None:
    schema["properties"] = {k: v for k, v in schema.get("properties", {}).items() if k in fields}
    schema["required"] = [k for k in schema.get("required", []) if k in fields]
    schema["additionalProperties"] = False
