"""The OpenAI Responses API on the chat proxy's path (``POST /v1/responses``): Codex CLI and the ``openai``
package's ``client.responses`` get the same session model, ledger, policies, memory, arms and audit as chat and
Messages clients.

A request is read by ``responses_protocol`` (``previous_response_id`` resolved from the ledger's stored
responses), recorded by the chat proxy's recorder (``sessions.record_chat``) and served by the replica's turn;
the reply goes back as a ``response`` object (a ``message`` item with ``output_text``, one ``function_call`` per
tool call, ``usage`` with ``input_tokens_details.cached_tokens``), or as the documented event sequence when
streamed (``response.created``, ``response.in_progress``, ``response.output_item.added``,
``response.content_part.added``, ``response.output_text.delta`` / ``.done``, ``response.content_part.done``,
``response.function_call_arguments.delta`` / ``.done``, ``response.output_item.done``, ``response.completed`` or
``response.incomplete``; a failure after the 200 is an ``error`` event and ``response.failed``). Every event
carries its ``sequence_number``. Errors are OpenAI's (``serving/http/errors.py``).

The session is named by the ``x-palimpsest-session`` header, else the previous response's, else ``user``,
else ``prompt_cache_key`` (Codex sends its thread id there), else by the history itself.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import ValidationError

from palimpsest.platform.types import UnknownSessionError
from palimpsest.serving.http import responses_protocol, sessions
from palimpsest.serving.http.errors import openai_error
from palimpsest.serving.http.openai_proxy import extension
from palimpsest.serving.http.responses_protocol import ResponsesRequest
from palimpsest.serving.http.schemas import ChatIn, valid_text
from palimpsest.serving.http.server import SESSION_HEADER, HTTPProblem, Tenant, stream_turn, unsent
from palimpsest.serving.turn.request import TurnRequest


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def usage(turn) -> dict:
    """The Responses API's usage: every generation of the turn; ``cached_tokens`` what the prefix cache held."""
    prompt, completion = int(turn.tokens["prompt_total"]), int(turn.tokens["completion"])
    cached = int(turn.tokens.get("cached_total", turn.tokens["cached"]))
    # the ids the cache did not hold are computed anew and written to it (vLLM's prefix cache keeps them)
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached,
                                                             "cache_write_tokens": max(prompt - cached, 0)},
            "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + completion}


def message_item(item_id: str, text: str, status: str = "completed") -> dict:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}] if status == "completed" else []}


def call_item(req: ResponsesRequest, call: dict, item_id: str, status: str = "completed") -> dict:
    """One tool call of the reply as its Responses item: a ``function_call`` (with ``namespace`` for a
    namespaced tool) or a ``custom_tool_call`` (a freeform tool's text)."""
    flat, args = call["function"]["name"], call["function"]["arguments"] or ""
    if flat in req.custom_tools:
        try:
            text = json.loads(args).get("input", "")
        except (json.JSONDecodeError, AttributeError):
            text = args
        return {"type": "custom_tool_call", "id": item_id, "call_id": call["id"], "name": flat,
                "input": text if isinstance(text, str) else json.dumps(text), "status": status}
    item = {"type": "function_call", "id": item_id, "call_id": call["id"], "name": flat,
            "arguments": args if status == "completed" else "", "status": status}
    if flat in req.namespaces:
        item["namespace"], item["name"] = req.namespaces[flat]
    return item


def status_of(turn) -> tuple[str, dict | None]:
    if turn.finish_reason == "length" and not turn.tool_calls:
        return "incomplete", {"reason": "max_output_tokens"}
    return "completed", None


class Ids:
    """The ids of one response and its output items, the same in a stream's events and its final object."""

    def __init__(self):
        self.response, self.message = _id("resp"), _id("msg")
        self.calls: dict[int, str] = {}

    def call(self, k: int) -> str:
        return self.calls.setdefault(k, _id("fc"))


def output(turn, req: ResponsesRequest, ids: Ids) -> list[dict]:
    items = [message_item(ids.message, turn.content)] if turn.content else []
    return items + [call_item(req, c, ids.call(k)) for k, c in enumerate(turn.tool_calls)]


def response_object(req: ResponsesRequest, ids: Ids, model: str, created: int, status: str = "in_progress",
                    turn=None, ext: str | None = None, error: dict | None = None) -> dict:
    """A ``response`` object: in progress (a stream's opening), finished from ``turn``, or failed."""
    echo = req.echo
    body = {"id": ids.response, "object": "response", "created_at": created, "status": status, "model": model,
            "output": [], "usage": None, "error": error, "incomplete_details": None,
            "instructions": echo.get("instructions"), "tools": echo.get("tools") or [],
            "tool_choice": echo.get("tool_choice") or "auto",
            "parallel_tool_calls": echo.get("parallel_tool_calls") is not False,
            "temperature": echo.get("temperature"), "top_p": echo.get("top_p"),
            "max_output_tokens": echo.get("max_output_tokens"), "previous_response_id": req.previous_response_id,
            "store": req.store, "metadata": echo.get("metadata") or {}, "reasoning": echo.get("reasoning"),
            "text": echo.get("text") or {"format": {"type": "text"}},
            "truncation": echo.get("truncation") or "disabled",
            "user": echo.get("user"), "prompt_cache_key": echo.get("prompt_cache_key")}
    if turn is not None:
        body["status"], body["incomplete_details"] = status_of(turn)
        body.update(output=output(turn, req, ids), usage=usage(turn), completed_at=int(time.time()))
        body["palimpsest"] = extension(ext, turn)
        if turn.context_edit:  # what the request's compaction entry did (the API has no field for it)
            body["palimpsest"]["context_management"] = turn.context_edit
    return body


class ResponsesEvents:
    """The Responses API's server-sent events for one streamed turn (``serving.http.server.stream_turn`` drives it)."""

    def __init__(self, req: ResponsesRequest, ids: Ids, model: str, ext: str):
        self.req, self.ids, self.model, self.ext = req, ids, model, ext
        self.created, self.seq, self.sent, self.opened = int(time.time()), 0, "", False

    def event(self, name: str, data: dict) -> str:
        body = {"type": name, "sequence_number": self.seq, **data}
        self.seq += 1
        return f"event: {name}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"

    def _response(self, **kw) -> dict:
        return response_object(self.req, self.ids, self.model, self.created, **kw)

    def opening(self) -> list[str]:
        return [self.event("response.created", {"response": self._response()}),
                self.event("response.in_progress", {"response": self._response()})]

    def started(self, info: dict) -> list[str]:  # the Responses stream carries no usage until it completes
        return []

    def ping(self) -> list[str]:  # no keep-alive event in this API: an SSE comment, which every reader skips
        return [": keep-alive\n\n"]

    def text(self, text: str) -> list[str]:
        out = []
        where = {"item_id": self.ids.message, "output_index": 0, "content_index": 0}
        if not self.opened:
            self.opened = True
            out += [self.event("response.output_item.added",
                               {"output_index": 0, "item": message_item(self.ids.message, "", "in_progress")}),
                    self.event("response.content_part.added",
                               {**where, "part": {"type": "output_text", "text": "", "annotations": []}})]
        self.sent += text
        return out + [self.event("response.output_text.delta", {**where, "delta": text, "logprobs": []})]

    def closing(self, turn) -> list[str]:
        rest = unsent(turn.content, self.sent)
        out = self.text(rest) if rest else []
        index = 0
        if self.opened:
            where = {"item_id": self.ids.message, "output_index": 0, "content_index": 0}
            part = {"type": "output_text", "text": self.sent, "annotations": []}
            out += [self.event("response.output_text.done", {**where, "text": self.sent, "logprobs": []}),
                    self.event("response.content_part.done", {**where, "part": part}),
                    self.event("response.output_item.done", {"output_index": 0,
                                                             "item": message_item(self.ids.message, self.sent)})]
            index = 1
        for k, call in enumerate(turn.tool_calls):
            done = call_item(self.req, call, self.ids.call(k))
            at = {"item_id": done["id"], "output_index": index}
            out.append(self.event("response.output_item.added", {
                "output_index": index, "item": call_item(self.req, call, self.ids.call(k), "in_progress")}))
            if done["type"] == "function_call":
                out += [self.event("response.function_call_arguments.delta", {**at, "delta": done["arguments"]}),
                        self.event("response.function_call_arguments.done", {**at, "arguments": done["arguments"],
                                                                              "name": done["name"]})]
            else:
                out += [self.event("response.custom_tool_call_input.delta", {**at, "delta": done["input"]}),
                        self.event("response.custom_tool_call_input.done", {**at, "input": done["input"]})]
            out.append(self.event("response.output_item.done", {"output_index": index, "item": done}))
            index += 1
        final = self._response(turn=turn, ext=self.ext)
        name = "response.completed" if final["status"] == "completed" else "response.incomplete"
        return out + [self.event(name, {"response": final})]

    def error(self, code: int, message: str) -> list[str]:
        err = openai_error(code, message)
        # a response's error code is one of the API's own (ResponseError.code): the caller's, a rate, or ours
        kind = "server_error" if code >= 500 else "rate_limit_exceeded" if code == 429 else "invalid_prompt"
        failed = self._response(status="failed", error={"code": kind, "message": message})
        return [self.event("error", {"code": err["code"] or err["type"], "message": message, "param": err["param"]}),
                self.event("response.failed", {"response": failed})]

    def ending(self) -> list[str]:
        return []


def _assistant(turn) -> dict:
    """The reply in chat form, as a later request's history holds it."""
    msg: dict[str, Any] = {"role": "assistant", "content": turn.content or None}
    if turn.tool_calls:
        msg["tool_calls"] = [{"id": c["id"], "type": "function", "function": dict(c["function"])}
                             for c in turn.tool_calls]
    return msg


async def _history(replica, tenant, previous: str) -> tuple[list[dict], str]:
    """The conversation a ``previous_response_id`` names (its messages and outputs, oldest first, without any
    response's instructions) and its session's external name; another tenant's response is not found."""
    try:
        chain = await asyncio.to_thread(replica.runtime.ledger.response_chain, previous)
    except UnknownSessionError:
        chain = []
    if not chain or (tenant.name is not None and not chain[-1]["session_id"].startswith(f"{tenant.name}::")):
        raise HTTPProblem(400, f"previous_response_id: no stored response {previous!r} (a response sent with "
                               "store: false is not kept)")
    # the conversation's first instructions are the session's system prompt (its stable prefix)
    first = [{"role": "system", "content": chain[0]["instructions"]}] if chain[0].get("instructions") else []
    return first + [m for r in chain for m in r["messages"] + r["output"]], tenant.external(chain[-1]["session_id"])


def documented(doc: dict, models: list[str] | None = None) -> dict:
    """The served OpenAPI document with the body of ``POST /v1/responses``, which the route reads raw (every field
    is checked by ``responses_protocol.read_request``): the request fields read (``FIELDS``), the input items
    (``ITEM_FIELDS``) and tool types served, and once the app knows them the ``models`` it serves. Values are not
    narrowed further: the endpoint still refuses some the schema allows (``background`` true, a ``text.format``
    other than text). Clients and the fuzzer read the body from here."""
    string, integer, boolean = ({"type": t} for t in ("string", "integer", "boolean"))
    obj = {"type": "object"}
    protocol = responses_protocol
    empty = {"type": "array", "maxItems": 0}  # as the replies carry them: nothing to read
    part = {"type": "object", "required": ["type", "text"], "additionalProperties": False,
            "properties": {"type": {"type": "string", "enum": sorted(protocol.TEXT_PARTS)}, "text": string,
                           "annotations": empty, "logprobs": empty}}
    refusal = {"type": "object", "required": ["type", "refusal"], "additionalProperties": False,
               "properties": {"type": {"type": "string", "enum": ["refusal"]}, "refusal": string}}
    content = {"anyOf": [string, {"type": "array", "items": {"anyOf": [part, refusal]}}]}
    fields = {"type": string, "id": string, "role": {"type": "string", "enum": ["user", "system", "developer",
                                                                                "assistant"]},
              "content": content, "status": string, "call_id": string, "name": string, "arguments": string,
              "namespace": string, "output": content, "input": string, "summary": {"type": "array", "items": obj},
              "encrypted_content": string}
    items = []
    for kind, names in sorted(protocol.ITEM_FIELDS.items()):
        props = {k: fields[k] for k in sorted(names)}
        props["type"] = {"type": "string", "enum": [kind]}
        # a message may leave its type out ({"role", "content"}, as the SDKs write it)
        required = ["role", "content"] if kind == "message" else ["type"]
        items.append({"type": "object", "required": required, "additionalProperties": False, "properties": props})
    tool_kinds = ["function", "namespace", "custom", *sorted(protocol.HOSTED_TOOLS)]
    tool = {"type": "object", "required": ["type"],
            "properties": {"type": {"type": "string", "enum": tool_kinds}, "name": string, "description": string,
                           "parameters": obj, "strict": boolean, "defer_loading": boolean,
                           "tools": {"type": "array", "items": obj}, "format": obj}}
    props = {
        "model": {"type": "string", "enum": list(models)} if models else string,
        "input": {"anyOf": [string, {"type": "array", "minItems": 1, "items": {"anyOf": items}}]},
        "instructions": string, "tools": {"type": "array", "items": tool},
        "tool_choice": {"anyOf": [{"type": "string", "enum": ["auto", "none", "required"]},
                                  {"type": "object", "required": ["type", "name"],
                                   "properties": {"type": {"type": "string", "enum": ["function"]}, "name": string}}]},
        "parallel_tool_calls": boolean, "max_output_tokens": {"type": "integer", "minimum": 1},
        "temperature": {"type": "number", "minimum": 0, "maximum": 2}, "top_p": {"type": "number", "minimum": 0,
                                                                                 "maximum": 1},
        "store": boolean, "previous_response_id": string, "prompt_cache_key": string, "user": string,
        "safety_identifier": string,
        "include": {"type": "array", "items": {"type": "string", "enum": sorted(protocol.INCLUDE)}},
        "reasoning": {"type": "object", "properties": {"effort": string, "summary": string}},
        "text": {"type": "object", "properties": {"format": obj, "verbosity": string}},
        "stream": boolean, "stream_options": {"type": "object", "properties": {"include_obfuscation": boolean}},
        "metadata": obj, "client_metadata": obj, "service_tier": string, "truncation": string,
        "context_management": {"type": "array", "maxItems": 1, "items": {
            "type": "object", "required": ["type"], "additionalProperties": False,
            "properties": {"type": {"type": "string", "enum": ["compaction"]},
                           "compact_threshold": {"type": "integer", "minimum": 1}}}},
        "max_tool_calls": integer, "background": boolean, "top_logprobs": {"type": "integer", "minimum": 0},
    }
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    schemas["ResponsesRequest"] = {"type": "object", "required": ["input"], "additionalProperties": False,
                                   "properties": props, "title": "ResponsesRequest"}
    doc["paths"]["/v1/responses"]["post"]["requestBody"] = {
        "required": True,
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ResponsesRequest"}}}}
    return doc


async def responses(replica, tenant: Tenant, request: Request):
    """``POST /v1/responses``: the conversation recorded in its session, the turn served, the reply as a
    ``response`` object or as its events; stored (``store``, the default) for a later ``previous_response_id``."""
    try:
        raw = await request.json()
        valid_text(raw)  # a lone surrogate reaches no tokenizer and no database
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise HTTPProblem(400, "the body is not JSON") from None
    except RecursionError:
        raise HTTPProblem(400, "the body is nested too deeply") from None
    except ValueError as e:
        raise HTTPProblem(400, str(e)) from None
    try:
        req = responses_protocol.read_request(raw)
    except responses_protocol.ResponsesInputError as e:
        raise HTTPProblem(400, str(e)) from None
    replica.check_model(req.model)
    history, ext = ([], None)
    instructions = [{"role": "system", "content": req.instructions}] if req.instructions else []
    if req.previous_response_id:
        history, ext = await _history(replica, tenant, req.previous_response_id)
        # instructions do not carry over: this request's own, where they differ from the conversation's first,
        # are a system message at this point of it (the ledger cannot take back what was shown before)
        first = history[0]["content"] if history and history[0]["role"] == "system" else None
        instructions = [] if req.instructions in (None, first) else instructions
    header = request.headers.get(SESSION_HEADER)
    messages = (history + instructions if history else instructions) + req.input_messages
    ext = header or ext or req.session or responses_protocol.history_session(messages)
    if req.session and req.session != ext:  # the session is the header's or the previous response's: kept
        req.noted["user_named"] = req.session
    try:
        chat = ChatIn.model_validate({"messages": messages, **{k: v for k, v in req.chat.items() if v is not None}})
    except ValidationError as e:
        err = e.errors()[0]
        raise HTTPProblem(400, f"{'.'.join(str(x) for x in err['loc'])}: {err['msg']}") from None
    sid = await sessions.record_chat(replica, chat, tenant, ext, request)
    turn_req = TurnRequest(sid, max_tokens=chat.max_tokens, top_p=chat.top_p, edits=req.edits,
                           temperature=replica.cfg.actor.sampling_temperature(chat.temperature),
                           tool_choice=chat.tool_choice if chat.tools else None,
                           parallel_tool_calls=chat.parallel_tool_calls, noted=req.noted)
    model, ids = replica.actor_info["model"], Ids()

    async def served(emit=None, started=None):
        turn = await replica.turn(turn_req, emit=emit, started=started)
        if req.store:
            body = {"messages": req.input_messages, "output": [_assistant(turn)], "instructions": req.instructions}
            await asyncio.to_thread(replica.runtime.ledger.record_response, ids.response, sid,
                                    req.previous_response_id, body)
        return turn

    if req.stream:  # what can be refused is refused before the 200 status line is sent
        await replica.check_turn(turn_req)
        writer = ResponsesEvents(req, ids, model, ext)
        return StreamingResponse(stream_turn(lambda emit, started: served(emit, started), writer, replica.gone,
                                             replica.cfg.turns.stream_ping_s),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    turn = await served()
    return response_object(req, ids, model, int(time.time()), turn=turn, ext=ext)
