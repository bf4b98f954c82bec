"""The Anthropic Messages API, its requests: what a ``/v1/messages`` or ``count_tokens`` body may hold, read
field by field, then by vLLM's own Anthropic protocol models and converted to a chat-completions message list
by vLLM's conversion (``vllm.entrypoints.anthropic``), which the chat proxy records
(``openai_protocol.parse_messages``): there is no second parser. vLLM's models ignore what they do not know, and
its conversion skips thinking blocks, so what the text actor cannot read (images, documents, thinking, server
tools, an unknown field) is refused first with a 400 naming it, as is what would otherwise be dropped: a
``metadata`` key other than ``user_id``, ``tool_choice`` without ``tools``, an empty text block or message.
A system prompt of several blocks is joined with a blank line between blocks
(``SYSTEM_JOIN``). The replies are ``anthropic_proxy``'s.

vLLM's protocol is imported by :func:`load`, which a replica starts in a thread when it starts (``replica.py``).
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from dataclasses import dataclass
from typing import Any

from palimpsest.platform.compile.context_edits import MAX_TOKENS, MAX_TOOL_USES, ContextEdits
from palimpsest.platform.types import PalimpsestError
from palimpsest.serving.http.errors import unread_field

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
TOOL_FIELDS = {"name", "description", "input_schema", "cache_control", "type", "defer_loading"}
#: ``thinking`` keys read (``display`` says how thinking would be shown; the actor writes none)
THINKING_FIELDS = {"type", "budget_tokens", "display"}


#: What separates the blocks of a system prompt given as a list (each block is a paragraph of its own; vLLM's
#: conversion glues them with nothing: "You are A." + "Be brief." -> "You are A.Be brief.")
SYSTEM_JOIN = "\n\n"
#: The ``metadata`` keys read (``user_id`` names the session)
METADATA_FIELDS = {"user_id"}

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
        if kind == "text" and not (isinstance(b.get("text"), str) and b["text"].strip()):
            raise AnthropicInputError(f"{at}.text: text content blocks must contain non-whitespace text")
        if kind == "text" and b.get("citations"):
            raise AnthropicInputError(f"{at}.citations: citations are not served")
        if kind == "tool_result" and isinstance(b.get("content"), list):
            for k, part in enumerate(b["content"]):
                if isinstance(part, dict) and part.get("citations"):
                    raise AnthropicInputError(f"{at}.content[{k}].citations: citations are not served")
                if not (isinstance(part, dict) and part.get("type") == "text" and set(part) <= BLOCK_FIELDS["text"]):
                    ptype = part.get("type") if isinstance(part, dict) else type(part).__name__
                    raise AnthropicInputError(f"{at}.content[{k}]: a {ptype!r} part of a tool result cannot be read "
                                              "by the text actor (send text)")


def check_request(raw: Any, literal: bool = False) -> None:
    """Refuse, naming the field, what vLLM's models would accept and then lose."""
    problem = unread_field(raw, FIELDS)
    if problem:
        raise AnthropicInputError(problem)
    thinking = raw.get("thinking")
    # "adaptive" leaves thinking to the model, and this one never thinks: what it asks for is what happens
    if isinstance(thinking, dict) and set(thinking) - THINKING_FIELDS:
        raise AnthropicInputError(f"thinking.{sorted(set(thinking) - THINKING_FIELDS)[0]}: not read by this endpoint")
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
        seen = 0
        for k, e in enumerate(edits.get("edits", [])):
            kind = e.get("type") if isinstance(e, dict) else None
            kind = kind if isinstance(kind, str) else None
            if kind == CLEAR_TOOL_USES:
                seen += 1
                if seen > 1:
                    raise AnthropicInputError(f"context_management.edits[{k}]: one {CLEAR_TOOL_USES} edit per "
                                              "request is served")
                context_edit(e, f"context_management.edits[{k}]", literal)
            elif kind not in NOOP_EDITS:
                raise AnthropicInputError(f"context_management.edits[{k}]: a {kind!r} edit is not served (served: "
                                          f"{CLEAR_TOOL_USES}, mapped onto the gateway's compaction, and clearing "
                                          "thinking blocks, which the actor never writes; compact_20260112's "
                                          "compaction blocks are not)")
    temperature = raw.get("temperature")
    if isinstance(temperature, (int, float)) and not isinstance(temperature, bool) and not 0 <= temperature <= 1:
        raise AnthropicInputError("temperature: between 0 and 1 (the Messages API's range)")
    metadata = raw.get("metadata")
    if metadata is not None:
        if not isinstance(metadata, dict):
            raise AnthropicInputError("metadata: an object is needed")
        if metadata.get("user_id") is not None and not (isinstance(metadata["user_id"], str) and metadata["user_id"]):
            raise AnthropicInputError("metadata.user_id: a non-empty string is needed (it names the session)")
        extra = set(metadata) - METADATA_FIELDS
        if extra:
            raise AnthropicInputError(f"metadata.{sorted(extra)[0]}: not read by this endpoint (metadata.user_id "
                                      "names the session; nothing is ignored silently)")
    if raw.get("tool_choice") is not None and not raw.get("tools"):
        raise AnthropicInputError("tool_choice: given without tools (declare the tools it chooses among, or "
                                  "leave it out)")
    if raw.get("system") is not None:
        _check_blocks(raw["system"], "system", {"text"})
    messages = raw.get("messages")
    if not isinstance(messages, list) or not messages:
        raise AnthropicInputError("messages: a non-empty list is needed")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant", "system"):
            raise AnthropicInputError(f"messages[{i}].role: user, assistant or system")
        if set(m) - {"role", "content"}:
            raise AnthropicInputError(f"messages[{i}].{sorted(set(m) - {'role', 'content'})[0]}: not read by this "
                                      "endpoint")
        allowed = {"assistant": {"text", "tool_use"}, "user": {"text", "tool_result"}, "system": {"text"}}[m["role"]]
        if m.get("content") in ("", []) or (isinstance(m.get("content"), str) and not m["content"].strip()):
            raise AnthropicInputError(f"messages[{i}].content: a message must have non-empty content")
        _check_blocks(m.get("content"), f"messages[{i}].content", allowed)
    tools = raw.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise AnthropicInputError("tools: a list of client tools is needed")
    for k, t in enumerate(tools or []):
        if not isinstance(t, dict) or set(t) - TOOL_FIELDS or t.get("type") not in (None, "custom"):
            raise AnthropicInputError(f"tools[{k}]: a client tool {{name, description, input_schema}} is served "
                                      "(server tools such as web search are not)")


CLEAR_TOOL_USES = "clear_tool_uses_20250919"
#: The request header that asks for an edit's own rule (``literal``) instead of the gateway's compaction
LITERAL_HEADER = "x-palimpsest-context-edits"


def _amount(value: Any, where: str, unit: str, minimum: int = 0, maximum: int = MAX_TOKENS) -> int:
    if not (isinstance(value, dict) and value.get("type") == unit and set(value) <= {"type", "value"}
            and isinstance(value.get("value"), int) and not isinstance(value["value"], bool)
            and minimum <= value["value"] <= maximum):
        raise AnthropicInputError(f"{where}: {{\"type\": \"{unit}\", \"value\": N}} is served, "
                                  f"{minimum} <= N <= {maximum}")
    return value["value"]


def context_edit(edit: dict, where: str, literal: bool = False) -> ContextEdits:
    """A ``clear_tool_uses_20250919`` edit as the gateway's compaction honours it (``platform.compile.context_edits``):
    ``trigger`` (input tokens) sets the epoch boundary, ``clear_at_least`` how far it compacts, ``keep`` the
    latest tool uses kept raw, ``exclude_tools`` tools never degraded. ``clear_tool_inputs: true`` is what the
    gateway does (a degraded step's call is abstracted with its result, its identifiers kept); keeping inputs
    verbatim while clearing results (``false``, the API's default when absent, or a list) is not served, and
    is refused."""
    extra = set(edit) - {"type", "trigger", "keep", "clear_at_least", "exclude_tools", "clear_tool_inputs"}
    if extra:
        raise AnthropicInputError(f"{where}.{sorted(extra)[0]}: not read by this endpoint")
    inputs = edit.get("clear_tool_inputs", False)
    if not (isinstance(inputs, bool) or (isinstance(inputs, list) and all(isinstance(t, str) for t in inputs))):
        raise AnthropicInputError(f"{where}.clear_tool_inputs: true, false or a list of tool names")
    if inputs is not True and not literal:  # absent means false: results cleared, inputs kept verbatim
        raise AnthropicInputError(f"{where}.clear_tool_inputs: send true (the gateway's compaction abstracts a "
                                  "degraded step's call with its result; keeping inputs verbatim, the default, is "
                                  f"the edit's own rule: send the header {LITERAL_HEADER}: literal)")
    tools = [] if edit.get("exclude_tools") is None else edit["exclude_tools"]
    if not (isinstance(tools, list) and all(isinstance(t, str) and t for t in tools)):
        raise AnthropicInputError(f"{where}.exclude_tools: a list of tool names is needed")
    trigger = {"type": "input_tokens", "value": 100_000} if edit.get("trigger") is None else edit["trigger"]
    by_uses = literal and isinstance(trigger, dict) and trigger.get("type") == "tool_uses"
    unit = "tool_uses" if by_uses else "input_tokens"
    value = _amount(trigger, f"{where}.trigger", unit, minimum=1, maximum=MAX_TOOL_USES if by_uses else MAX_TOKENS)
    return ContextEdits(
        kind=CLEAR_TOOL_USES, literal=literal, clear_tool_inputs=inputs if isinstance(inputs, bool) else tuple(inputs),
        trigger_tokens=None if by_uses else value, trigger_tool_uses=value if by_uses else None,
        keep_tool_uses=_amount(edit["keep"], f"{where}.keep", "tool_uses", maximum=MAX_TOOL_USES) if "keep" in edit
        else 3,
        clear_at_least_tokens=_amount(edit["clear_at_least"], f"{where}.clear_at_least", "input_tokens",
                                      maximum=MAX_TOKENS)
        if "clear_at_least" in edit else None,
        exclude_tools=tuple(tools))


@dataclass(frozen=True)
class MessagesRequest:
    """A checked Messages request and the chat-completions form the proxy records."""
    model: str
    stream: bool
    max_tokens: int
    user_id: str | None
    chat: dict  # the fields of a ChatIn: messages, tools, tool_choice, parallel_tool_calls, sampling
    noted: dict  # fields read that change nothing for this actor, recorded whole with the served turn (JSON)
    edits: ContextEdits | None = None  # a clear_tool_uses edit, honoured by the turn's compaction


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


def _cache_hints(raw: dict) -> list[str]:
    """Where the request carries ``cache_control`` (Anthropic's cache hints; this server's cache is the compaction
    epoch, so they change nothing): recorded with the turn."""
    out = [f"system[{j}]" for j, b in enumerate(raw["system"]) if isinstance(b, dict) and b.get("cache_control")] \
        if isinstance(raw.get("system"), list) else []
    for i, m in enumerate(raw["messages"]):
        if isinstance(m.get("content"), list):
            for j, b in enumerate(m["content"]):
                out += [f"messages[{i}].content[{j}]"] if b.get("cache_control") else []
                if b.get("type") == "tool_result" and isinstance(b.get("content"), list):
                    out += [f"messages[{i}].content[{j}].content[{k}]" for k, part in enumerate(b["content"])
                            if part.get("cache_control")]
    return out + [f"tools[{k}]" for k, t in enumerate(raw.get("tools") or []) if t.get("cache_control")]


def _converted(raw: dict, messages: list[dict]):
    """vLLM's model of a request whose messages are ``messages``, and its chat-completions conversion."""
    from pydantic import ValidationError
    from vllm.entrypoints.anthropic.protocol import AnthropicMessagesRequest
    from vllm.entrypoints.anthropic.serving import AnthropicServingMessages

    try:
        req = AnthropicMessagesRequest.model_validate({**raw, "messages": messages})
    except ValidationError as e:
        err = e.errors()[0]
        raise AnthropicInputError(f"{'.'.join(str(x) for x in err['loc'])}: {err['msg']}") from None
    return req, AnthropicServingMessages.to_chat_completion_request(req)


def _with_system_messages(raw: dict, first: list[dict]) -> list[dict]:
    """The chat messages of a request whose ``messages`` hold ``system`` messages: each run of user and
    assistant messages is converted by vLLM's conversion, and each system message stays a system message at its
    position (Anthropic applies it from there on; the recorder keeps it as a step of its own authority)."""
    out = first
    segment: list[dict] = []
    bare = {k: v for k, v in raw.items() if k not in ("system", "tools", "tool_choice")}
    for m in raw["messages"][len(_leading(raw["messages"])):] + [None]:
        if m is not None and m["role"] != "system":
            segment.append(m)
            continue
        if segment:
            out += [dict(x) for x in _converted(bare, segment)[1].messages]
            segment = []
        if m is not None:
            content = m["content"]
            out.append({"role": "system", "content": content if isinstance(content, str) else
                        SYSTEM_JOIN.join(b["text"] for b in content)})
    return out


def _leading(messages: list[dict]) -> list[dict]:
    """The messages before the first system message inside ``messages``."""
    k = next((i for i, m in enumerate(messages) if m["role"] == "system"), len(messages))
    return messages[:k]


def read_request(raw: Any, literal: bool = False) -> MessagesRequest:
    """Check ``raw``, read it with vLLM's protocol model and convert it with vLLM's conversion. ``literal``: the
    client asked for a context edit's own rule (``LITERAL_HEADER``), not the gateway's compaction."""
    check_request(raw, literal)
    hints = _cache_hints(raw)
    if isinstance(raw.get("system"), list):  # one paragraph per block (SYSTEM_JOIN), as a string for vLLM
        raw = {**raw, "system": SYSTEM_JOIN.join(b["text"] for b in raw["system"])}
    # a deferred tool (tool search) is not in the model's context until a search loads it: not declared
    deferred = [t["name"] for t in raw.get("tools") or [] if t.get("defer_loading")]
    if deferred:
        raw = {**raw, "tools": [t for t in raw["tools"] if not t.get("defer_loading")] or None}
        if not raw["tools"] and raw.get("tool_choice") is not None:
            raise AnthropicInputError("tool_choice: every tool is deferred (defer_loading), so none is declared to "
                                      "choose among")
    first = next((i for i, m in enumerate(raw["messages"]) if m["role"] != "system"), None)
    if first is None:
        raise AnthropicInputError("messages: a user message is needed")
    if first:  # system messages ahead of the conversation extend the system prompt, in order
        head = [m["content"] if isinstance(m["content"], str) else SYSTEM_JOIN.join(b["text"] for b in m["content"])
                for m in raw["messages"][:first]]
        raw = {**raw, "system": SYSTEM_JOIN.join(([raw["system"]] if raw.get("system") else []) + head),
               "messages": raw["messages"][first:]}
    leading = _leading(raw["messages"])
    req, chat = _converted(raw, leading)
    tools = [t.model_dump(exclude_none=True) for t in (chat.tools or [])] or None
    choice = chat.tool_choice
    if choice is not None and not isinstance(choice, str):
        choice = choice.model_dump(exclude_none=True)
    # vLLM's conversion drops a tool result's is_error: it is written into the result's text instead
    failed = {b.get("tool_use_id") for m in raw["messages"] if isinstance(m["content"], list) for b in m["content"]
              if b.get("type") == "tool_result" and b.get("is_error")}
    messages = [dict(m) for m in chat.messages]
    if len(leading) < len(raw["messages"]):
        messages = _with_system_messages(raw, messages)
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
    if deferred:
        noted["deferred_tools"] = json.dumps(deferred, ensure_ascii=False)
    if hints:
        noted["cache_control"] = json.dumps(hints)
    edit = next((e for e in (raw.get("context_management") or {}).get("edits", []) if e["type"] == CLEAR_TOOL_USES),
                None)
    return MessagesRequest(model=req.model, stream=bool(req.stream), max_tokens=req.max_tokens,
                           user_id=user, chat=body, noted=noted,
                           edits=context_edit(edit, "context_management", literal) if edit else None)


def history_session(messages: list[dict]) -> str:
    """A session named by the history itself (no ``metadata.user_id``): the system prompt and the task, hashed.
    Every resend of one conversation names the same session; the resend validation refuses a rewrite."""
    head = [m for m in messages if m.get("role") == "system"] + [m for m in messages if m.get("role") == "user"][:1]
    digest = hashlib.sha256(json.dumps(head, sort_keys=True, ensure_ascii=False).encode()).hexdigest()
    return f"anthropic-{digest[:24]}"


