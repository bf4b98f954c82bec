"""The Anthropic Messages API on the chat proxy's path: Claude Code, the Claude Agent SDK and the ``anthropic``
clients get the same session model, ledger, policies, memory, tenants and audit as OpenAI clients.

The routes' logic (``messages``, ``count_tokens``; ``ingress.py`` holds the routes) and the replies: a request
is read by ``anthropic_protocol`` and recorded by the chat proxy's recorder (``sessions.record_chat``); the turn
goes back as Anthropic's ``message`` (text and ``tool_use`` blocks, ``stop_reason`` with the matched
``stop_sequence``, ``usage`` with the prefix cache's ``cache_read_input_tokens``), or as its server-sent events
when streamed: ``message_start`` once the prompt is compiled (its usage: the prompt's size, split by what the
session's previous turn leaves in the prefix cache), ``ping`` every ``turns.stream_ping_s`` while nothing else
is sent (a CPU prefill can take tens of seconds), the content blocks, ``message_delta`` (the usage measured,
summed over the turn's generations) and ``message_stop``. Errors are Anthropic's (``serving/http/errors.py``).
"""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any, Callable

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import ValidationError

from palimpsest.platform.prompt.chat import chat_ids, raw_history_messages
from palimpsest.platform.types import Session, UnknownSessionError
from palimpsest.serving.http import anthropic_protocol, openai_proxy, sessions
from palimpsest.serving.http.errors import anthropic_error
from palimpsest.serving.http.openai_protocol import parse_messages, plain
from palimpsest.serving.http.schemas import ChatIn, valid_text
from palimpsest.serving.http.server import ARM_HEADER, SESSION_HEADER, HTTPProblem, Tenant, stream_turn, unsent
from palimpsest.serving.turn.request import TurnRequest


def stop_reason(turn) -> str:
    """Anthropic's stop reason of a turn: a tool call, the token cap, a stop sequence, or the end of the turn."""
    if turn.tool_calls:
        return "tool_use"
    if turn.finish_reason == "length":
        return "max_tokens"
    return "stop_sequence" if turn.stop_sequence is not None else "end_turn"


def stop_sequence(turn) -> str | None:
    """The stop sequence that ended the reply (``stop_reason: stop_sequence``), else None."""
    return None if turn.tool_calls or turn.finish_reason == "length" else turn.stop_sequence


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


def applied(turn) -> dict:
    """``context_management`` as the Messages API reports it: the edit, where the turn was the compaction boundary
    it applied at, with the tool uses it left out of full view and the input tokens that saved; an empty list
    on a turn that only extended the prompt; nothing where no edit was asked for."""
    e = getattr(turn, "context_edit", None)
    if not e:
        return {}
    return {"context_management": {"applied_edits": [
        {"type": e["type"], "cleared_tool_uses": e["cleared_tool_uses"],
         "cleared_input_tokens": e["cleared_input_tokens"]}] if e["applied"] else []}}


def message(turn, model: str, extension: dict) -> dict:
    return {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant", "model": model,
            "content": content_blocks(turn), "stop_reason": stop_reason(turn), "stop_sequence": stop_sequence(turn),
            "usage": usage(turn), **applied(turn), "palimpsest": extension}


def event(name: str, data: dict) -> str:
    """One server-sent event in Anthropic's framing."""
    return f"event: {name}\ndata: {json.dumps({'type': name, **data}, ensure_ascii=False)}\n\n"


def message_start(model: str, msg_id: str, info: dict | None) -> str:
    """``info``: the compiled prompt's size (``prompt``, soft positions included) and the part the epoch expects
    the prefix cache to hold (``expected_cached``); None when the turn failed before it was compiled."""
    prompt, cached = (int(info["prompt"]), int(info["expected_cached"])) if info else (0, 0)
    cached = min(cached, prompt)
    return event("message_start", {"message": {
        "id": msg_id, "type": "message", "role": "assistant", "model": model, "content": [], "stop_reason": None,
        "stop_sequence": None, "usage": {"input_tokens": prompt - cached, "output_tokens": 0,
                                         "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}}})


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
    out.append(event("message_delta", {"delta": {"stop_reason": stop_reason(turn),
                                                 "stop_sequence": stop_sequence(turn)},
                                       "usage": usage(turn), **applied(turn), "palimpsest": extension}))
    out.append(event("message_stop", {}))
    return out


class MessagesEvents:
    """Anthropic's server-sent events for one streamed turn: ``message_start``, the answer's text as
    ``content_block_delta`` events (its block opened on the first text), each tool call as a ``tool_use`` block,
    the ``message_delta`` with the stop reason and usage, ``message_stop`` (``server.stream_turn`` drives it)."""

    def __init__(self, model: str, extension: Callable[[Any], dict]):
        self.model, self.extension, self.opened, self.begun = model, extension, False, False
        self.sent = ""  # the answer's text streamed so far

    def opening(self) -> list[str]:  # message_start waits for the compiled prompt's size (started)
        return []

    def started(self, info: dict | None) -> list[str]:
        if self.begun:
            return []
        self.begun = True
        return [message_start(self.model, f"msg_{uuid.uuid4().hex}", info)]

    def ping(self) -> list[str]:
        """Keep-alive: a ``ping`` event once the message has started; before (the prompt still compiling: an
        ``ace`` LLM elasticizer, an embedder wait), an SSE comment, which every event-stream reader skips."""
        return [event("ping", {})] if self.begun else [": keep-alive\n\n"]

    def text(self, text: str) -> list[str]:
        out = self.started(None)
        self.sent += text
        if not self.opened:
            self.opened = True
            out.append(event("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}}))
        out.append(event("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": text}}))
        return out

    def closing(self, turn) -> list[str]:
        # text the tool parser held back as possible call markup and then gave back as content (a call that
        # never closed) is sent now: the streamed message holds what the whole one would
        rest = unsent(turn.content, self.sent)
        out = self.started(None) + (self.text(rest) if rest else [])
        return out + closing_events(turn, self.opened, 0, self.extension(turn))

    def error(self, code: int, message: str) -> list[str]:
        return [event("error", {"error": anthropic_error(code, message)[1]})]

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
    from vllm.entrypoints.anthropic.protocol import (  # vLLM: loaded by anthropic_protocol.load before this
        AnthropicCountTokensRequest,
        AnthropicMessagesRequest,
    )

    ref = "#/components/schemas/{model}"
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    for path, model in (("/v1/messages", AnthropicMessagesRequest),
                        ("/v1/messages/count_tokens", AnthropicCountTokensRequest)):
        schema = model.model_json_schema(ref_template=ref)
        defs = schema.pop("$defs", {})
        _narrow(schema, anthropic_protocol.FIELDS)
        if models:
            schema["properties"]["model"] = {"type": "string", "enum": list(models), "title": "Model"}
        _narrow(defs["AnthropicContentBlock"], set().union(*anthropic_protocol.BLOCK_FIELDS.values()))
        defs["AnthropicContentBlock"]["properties"]["type"]["enum"] = sorted(anthropic_protocol.BLOCK_FIELDS)
        _narrow(defs["AnthropicTool"], anthropic_protocol.TOOL_FIELDS)
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


# -- the routes' logic ------------------------------------------------------------------------------------


def models(replica) -> dict:
    """``GET /v1/models`` as the Models API answers an Anthropic client: the served actor, one page, with the
    window (``max_input_tokens``: the actor's window less the reply's default cap; ``max_tokens``: that cap) and
    Palimpsest's budget and compaction watermarks beside it (``openai_proxy.window``)."""
    model, info = replica.actor_info["model"], openai_proxy.window(replica)
    return {"data": [{"type": "model", "id": model, "display_name": model, "created_at": "1970-01-01T00:00:00Z",
                      "max_input_tokens": info["max_model_len"] - info["max_output_tokens"],
                      "max_tokens": info["max_output_tokens"], "palimpsest": info}],
            "has_more": False, "first_id": model, "last_id": model}


async def read(replica, request: Request, counting: bool = False) -> tuple[Any, ChatIn]:
    """The request checked and converted (``anthropic_protocol.read_request``), its model served, and its
    chat-completions form validated as the chat proxy's."""
    try:
        raw = await request.json()
        valid_text(raw)  # a lone surrogate reaches no tokenizer and no database
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise HTTPProblem(400, "the body is not JSON") from None
    except RecursionError:
        raise HTTPProblem(400, "the body is nested too deeply") from None
    except ValueError as e:
        raise HTTPProblem(400, str(e)) from None
    if counting and isinstance(raw, dict):
        raw = {**raw, "max_tokens": raw.get("max_tokens", 1)}  # count_tokens takes no max_tokens
    mode = request.headers.get(anthropic_protocol.LITERAL_HEADER, "compaction")
    if mode not in ("compaction", "literal"):
        raise HTTPProblem(400, f"{anthropic_protocol.LITERAL_HEADER}: compaction (the gateway's own, the default) or "
                               "literal (the edit's own rule)")
    try:
        req = await asyncio.to_thread(anthropic_protocol.read_request, raw, mode == "literal")
    except anthropic_protocol.AnthropicInputError as e:
        raise HTTPProblem(400, str(e)) from None
    replica.check_model(req.model)
    for name, value in request.query_params.items():  # Claude Code sends ?beta=true: recorded with the turn
        if name != "beta":
            raise HTTPProblem(400, f"{name}: the query parameter is not read by this endpoint (only beta is)")
        req.noted["beta"] = value
    try:
        chat = ChatIn.model_validate(req.chat)
    except ValidationError as e:
        err = e.errors()[0]
        raise HTTPProblem(400, f"{'.'.join(str(x) for x in err['loc'])}: {err['msg']}") from None
    return req, chat


async def messages(replica, tenant: Tenant, request: Request):
    """``POST /v1/messages``: the history recorded in its session, the turn served, the reply as a message or
    as server-sent events."""
    req, chat = await read(replica, request)
    ext = request.headers.get(SESSION_HEADER) or req.user_id or anthropic_protocol.history_session(req.chat["messages"])
    sid = await sessions.record_chat(replica, chat, tenant, ext, request)
    turn_req = TurnRequest(sid, max_tokens=req.max_tokens, top_p=chat.top_p, stop=chat.stop, edits=req.edits,
                           temperature=replica.cfg.actor.sampling_temperature(chat.temperature),
                           tool_choice=chat.tool_choice if chat.tools else None,
                           parallel_tool_calls=chat.parallel_tool_calls, noted=req.noted)
    model = replica.actor_info["model"]
    if req.stream:  # what can be refused is refused before the 200 status line is sent
        await replica.check_turn(turn_req)
        writer = MessagesEvents(model, lambda turn: openai_proxy.extension(ext, turn))

        def run(emit, started):
            return replica.turn(turn_req, emit=emit, started=started)

        return StreamingResponse(stream_turn(run, writer, replica.gone, replica.cfg.turns.stream_ping_s),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    turn = await replica.turn(turn_req)
    return message(turn, model, openai_proxy.extension(ext, turn))


async def count_tokens(replica, tenant: Tenant, request: Request) -> dict:
    """``POST /v1/messages/count_tokens``, recording nothing. ``input_tokens``: the whole history as a served
    turn renders it for the actor, uncompressed (the session's prefix with Palimpsest's memory-tool text, the
    tool declarations, every step at full resolution): what a turn costs before the policy compacts it, and
    the most it can send. Beside it (``palimpsest``): the client's messages alone through the actor's
    template, and the budget a served turn of the session's arm is held to."""
    req, chat = await read(replica, request, counting=True)
    parsed = parse_messages(chat.messages, replica.cfg.proxy.user_messages_after_actions)
    tools = json.dumps(chat.tools, sort_keys=True, ensure_ascii=False) if chat.tools else None
    session = Session(id="count_tokens", task=parsed.task, system=parsed.system, tools=tools)
    msgs = [{"role": m.role, "content": plain(m.content),
             **({"tool_calls": [c.model_dump() for c in m.tool_calls]} if m.tool_calls else {}),
             **({"tool_call_id": m.tool_call_id} if m.tool_call_id else {})} for m in chat.messages]
    if chat.tools:
        if msgs[0]["role"] != "system":
            msgs.insert(0, {"role": "system", "content": ""})
        msgs[0]["tools"] = chat.tools
    tok = replica.runtime.ledger.tokenizer
    served = await asyncio.to_thread(chat_ids, tok, raw_history_messages(session, parsed.steps))
    bare = await asyncio.to_thread(chat_ids, tok, msgs)
    ext = request.headers.get(SESSION_HEADER) or req.user_id or anthropic_protocol.history_session(req.chat["messages"])
    sid = tenant.internal(ext)
    try:  # the session's own arm when it exists, else the one its first request would be given
        arm = replica.arm_of(await asyncio.to_thread(replica.runtime.ledger.session, sid))
    except UnknownSessionError:
        arm = replica.router.choose(sid, request.headers.get(ARM_HEADER))
    arm = replica.cfg.arm(arm)
    return {"input_tokens": len(served.all),
            "palimpsest": {"messages_tokens": len(bare.all),
                           "budget": arm.budget or replica.cfg.budget}}
