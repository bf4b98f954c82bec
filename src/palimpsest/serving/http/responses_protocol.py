"""The OpenAI Responses API, its requests: what a ``POST /v1/responses`` body may hold (as Codex CLI and the
``openai`` package's ``client.responses`` send it), read field by field and item by item, and converted to the
chat-completions message list the chat proxy records (``openai_protocol.parse_messages``): one session model,
one ledger, one turn for chat, Messages and Responses alike.

What is read, and how:

- ``instructions`` is a system message ahead of the input; it does not carry over to a later response that
  names this one in ``previous_response_id`` (the API's rule).
- ``input`` items: ``message`` (roles user, system, developer, assistant; ``input_text`` / ``output_text``
  parts), ``function_call`` (consecutive calls join one assistant message), ``function_call_output``,
  ``custom_tool_call`` / ``custom_tool_call_output`` (a freeform tool's text, carried as one string argument
  ``input``) and a ``reasoning`` item with no content (what a client echoes back; this actor writes none).
  Any other item or part (images, files, computer or shell calls, reasoning content) is refused naming it.
- ``tools``: ``function`` tools are declared to the actor; a ``namespace``'s function tools are declared as
  ``<namespace>__<name>`` (vLLM's flat name) and their calls go back with ``namespace`` and ``name`` apart;
  ``custom`` tools as a function of one string; hosted tools (``web_search``, ``file_search``, ...) that the
  gateway has nothing to run are recorded with the turn (``requested_hosted_tools``) and not declared, so the
  actor never calls what nothing would execute.
- ``include``, ``reasoning``, ``text.verbosity``, ``truncation``, ``service_tier``, ``metadata``,
  ``client_metadata``, ``prompt_cache_key``, ``store`` change nothing this actor does: each is recorded with the
  served turn (``requested_<name>``). ``text.format`` other than text, ``logprobs`` and ``background`` are refused.

The replies and the route's logic are ``responses_proxy``'s.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Any

from palimpsest.platform.compile.context_edits import MAX_TOKENS, ContextEdits
from palimpsest.platform.types import PalimpsestError
from palimpsest.serving.http.errors import unread_field

#: The request fields read (every other is a 400 naming it)
FIELDS = {"model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls", "max_output_tokens",
          "temperature", "top_p", "store", "previous_response_id", "prompt_cache_key", "user", "include",
          "reasoning", "text", "stream", "stream_options", "metadata", "client_metadata", "service_tier",
          "truncation", "context_management", "max_tool_calls", "background", "top_logprobs", "safety_identifier"}
#: Read, changing nothing for this actor: recorded whole with the served turn
NOTED = ("include", "reasoning", "text", "truncation", "service_tier", "metadata", "client_metadata",
         "prompt_cache_key", "store", "safety_identifier", "max_tool_calls")
#: ``include`` values honoured: the actor writes no reasoning, so there is no encrypted reasoning to include
INCLUDE = {"reasoning.encrypted_content"}
#: Hosted tool types: executed by a provider's servers, nothing here runs them
HOSTED_TOOLS = {"web_search", "web_search_preview", "file_search", "code_interpreter", "image_generation",
                "computer_use_preview", "mcp", "local_shell", "shell", "apply_patch", "tool_search"}
NAMESPACE_SEP = "__"  # vLLM's flat name of a namespaced tool

ITEM_FIELDS = {
    "message": {"type", "id", "role", "content", "status"},
    "function_call": {"type", "id", "call_id", "name", "arguments", "status", "namespace"},
    "function_call_output": {"type", "id", "call_id", "output", "status"},
    "custom_tool_call": {"type", "id", "call_id", "name", "input", "status"},
    "custom_tool_call_output": {"type", "id", "call_id", "output", "status"},
    "reasoning": {"type", "id", "summary", "content", "encrypted_content", "status"},
}
TEXT_PARTS = {"input_text", "output_text"}
_NAME = re.compile(r"^[\w.:/@+-]{1,200}$")


class ResponsesInputError(PalimpsestError):
    """A Responses request this endpoint refuses; the message names the field."""


@dataclass
class ResponsesRequest:
    """A checked Responses request: the chat form the proxy records, and what goes back in the reply."""
    model: str | None
    stream: bool
    chat: dict  # the fields of a ChatIn: messages, tools, tool_choice, sampling
    input_messages: list[dict]  # this request's own messages in chat form (instructions excluded): stored
    instructions: str | None
    previous_response_id: str | None
    store: bool
    session: str | None  # user, else prompt_cache_key
    noted: dict = field(default_factory=dict)
    echo: dict = field(default_factory=dict)  # request fields a response object repeats
    namespaces: dict = field(default_factory=dict)  # flat tool name -> (namespace, name)
    custom_tools: set = field(default_factory=set)  # names of freeform tools
    edits: ContextEdits | None = None  # a compaction entry, honoured by the turn's compaction


def _text_of(content: Any, where: str, parts: set[str]) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ResponsesInputError(f"{where}: a string or a list of content parts is needed")
    out = []
    for j, p in enumerate(content):
        kind = p.get("type") if isinstance(p, dict) else type(p).__name__
        kind = kind if isinstance(kind, str) else type(kind).__name__
        if kind == "refusal" and kind in parts and isinstance(p.get("refusal"), str) and set(p) <= {"type", "refusal"}:
            out.append(p["refusal"])  # the model's refusal, echoed back: its text
            continue
        if kind not in parts or not isinstance(p.get("text"), str):
            raise ResponsesInputError(f"{where}[{j}]: a {kind!r} part cannot be read by the text actor (served: "
                                      f"{', '.join(sorted(parts))})")
        extra = {k for k in set(p) - {"type", "text", "annotations", "logprobs"} if p[k] not in (None, [], {}, "")}
        if extra or p.get("annotations") or p.get("logprobs"):
            name = sorted(extra)[0] if extra else ("annotations" if p.get("annotations") else "logprobs")
            raise ResponsesInputError(f"{where}[{j}].{name}: not read by this endpoint (nothing is ignored "
                                      "silently; remove the field)")
        out.append(p["text"])
    return "\n".join(out)


def _check_fields(item: dict, kind: str, where: str) -> None:
    extra = {k for k in set(item) - ITEM_FIELDS[kind] if item[k] not in (None, "", [], {})}
    if extra:
        raise ResponsesInputError(f"{where}.{sorted(extra)[0]}: not read by this endpoint (nothing is ignored "
                                  "silently; remove the field)")


def _call_name(item: dict, where: str) -> str:
    name = item.get("name")
    if not isinstance(name, str) or not name:
        raise ResponsesInputError(f"{where}.name: a non-empty string is needed")
    ns = item.get("namespace")
    if ns:
        if not isinstance(ns, str):
            raise ResponsesInputError(f"{where}.namespace: a string is needed")
        return f"{ns}{NAMESPACE_SEP}{name}"
    return name


def _call_id(item: dict, where: str) -> str:
    cid = item.get("call_id")
    if not isinstance(cid, str) or not cid:
        raise ResponsesInputError(f"{where}.call_id: a non-empty string is needed")
    return cid


def input_messages(items: Any) -> list[dict]:
    """``input`` (a string, or a list of items) as chat-completions messages; what cannot be read is refused."""
    if isinstance(items, str):
        if not items.strip():
            raise ResponsesInputError("input: the input is empty")
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise ResponsesInputError("input: a string or a non-empty list of items is needed")
    out: list[dict] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise ResponsesInputError(f"{where}: an object is needed")
        kind = item.get("type", "message" if "role" in item else None)
        if not isinstance(kind, str) or kind not in ITEM_FIELDS:
            raise ResponsesInputError(f"{where}.type: a {kind!r} item is not served (served: "
                                      f"{', '.join(sorted(ITEM_FIELDS))}; compaction items name a boundary)")
        _check_fields(item, kind, where)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise ResponsesInputError(f"{where}.role: user, system, developer or assistant")
            text = _text_of(item.get("content"), f"{where}.content",
                            {"output_text", "refusal"} if role == "assistant" else TEXT_PARTS)
            if role == "assistant" and out and out[-1]["role"] == "assistant" and not out[-1].get("content"):
                out[-1]["content"] = text  # text after the same turn's calls: one assistant message
                continue
            out.append({"role": role, "content": text})
        elif kind in ("function_call", "custom_tool_call"):
            if kind == "function_call":
                args = item.get("arguments", "")
                if not isinstance(args, str):
                    raise ResponsesInputError(f"{where}.arguments: JSON text is needed")
            else:
                if not isinstance(item.get("input", ""), str):
                    raise ResponsesInputError(f"{where}.input: a string is needed")
                args = json.dumps({"input": item.get("input", "")}, ensure_ascii=False)
            call = {"id": _call_id(item, where), "type": "function",
                    "function": {"name": _call_name(item, where), "arguments": args}}
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind in ("function_call_output", "custom_tool_call_output"):
            output = item.get("output")
            text = _text_of(output, f"{where}.output", TEXT_PARTS) if not isinstance(output, str) else output
            out.append({"role": "tool", "content": text, "tool_call_id": _call_id(item, where)})
        else:  # reasoning: the actor writes none; an echo with no content is nothing to record
            if item.get("content") or item.get("encrypted_content") or item.get("summary"):
                raise ResponsesInputError(f"{where}: a reasoning item with content cannot be read by this actor "
                                          "(it writes no reasoning; leave the item out)")
    return out


def _check_tool(t: dict, where: str) -> None:
    """The types of a function or custom tool's fields (the actor's template reads them as these)."""
    for key, kind, what in (("description", str, "a string"), ("parameters", dict, "a JSON schema object"),
                            ("strict", bool, "a boolean"), ("defer_loading", bool, "a boolean"),
                            ("format", dict, "an object")):
        if t.get(key) is not None and not isinstance(t[key], kind):
            raise ResponsesInputError(f"{where}.{key}: {what} is needed")


def chat_tools(tools: Any) -> tuple[list[dict], dict, set, list[dict]]:
    """(function tools in chat form, flat name -> (namespace, name), freeform tool names, hosted tools)."""
    if tools is None:
        return [], {}, set(), []
    if not isinstance(tools, list):
        raise ResponsesInputError("tools: a list is needed")
    out, namespaces, custom, hosted, deferred, names = [], {}, set(), [], [], set()

    def function(t: dict, where: str, ns: str | None = None) -> None:
        extra = set(t) - {"type", "name", "description", "parameters", "strict", "defer_loading"}
        if extra:
            raise ResponsesInputError(f"{where}.{sorted(extra)[0]}: not read by this endpoint")
        if not isinstance(t.get("name"), str) or not t["name"]:
            raise ResponsesInputError(f"{where}.name: a non-empty string is needed")
        _check_tool(t, where)
        name = f"{ns}{NAMESPACE_SEP}{t['name']}" if ns else t["name"]
        if name in names:
            raise ResponsesInputError(f"{where}.name: {name!r} is declared twice (a namespace's tools are declared "
                                      f"as <namespace>{NAMESPACE_SEP}<name>)")
        names.add(name)
        if t.get("defer_loading"):  # not in the model's context until a tool search loads it, as Messages reads it
            deferred.append(name)
            return
        if ns:
            namespaces[name] = (ns, t["name"])
        fn = {"name": name, **{k: t[k] for k in ("description", "parameters", "strict") if t.get(k) is not None}}
        out.append({"type": "function", "function": fn})

    for k, t in enumerate(tools):
        where = f"tools[{k}]"
        kind = t.get("type") if isinstance(t, dict) else None
        kind = kind if isinstance(kind, str) else None
        if kind == "function":
            function(t, where)
        elif kind == "namespace":
            if not isinstance(t.get("name"), str) or not isinstance(t.get("tools"), list):
                raise ResponsesInputError(f"{where}: a namespace has a name and a list of tools")
            for j, inner in enumerate(t["tools"]):
                if not isinstance(inner, dict) or inner.get("type") != "function":
                    raise ResponsesInputError(f"{where}.tools[{j}]: only function tools are served in a namespace")
                function(inner, f"{where}.tools[{j}]", t["name"])
        elif kind == "custom":
            if not isinstance(t.get("name"), str) or not t["name"]:
                raise ResponsesInputError(f"{where}.name: a non-empty string is needed")
            extra = set(t) - {"type", "name", "description", "format", "defer_loading"}
            if extra:
                raise ResponsesInputError(f"{where}.{sorted(extra)[0]}: not read by this endpoint")
            _check_tool(t, where)
            if t.get("defer_loading"):  # as a deferred function tool: recorded, not declared
                deferred.append(t["name"])
                continue
            custom.add(t["name"])
            fmt = t.get("format")
            desc = (t.get("description") or "") + (f"\n(input format: {json.dumps(fmt, sort_keys=True)})"
                                                   if fmt else "")
            out.append({"type": "function", "function": {
                "name": t["name"], "description": desc.strip(),
                "parameters": {"type": "object", "properties": {"input": {"type": "string"}}, "required": ["input"]}}})
        elif kind in HOSTED_TOOLS:
            hosted.append(t)
        else:
            raise ResponsesInputError(f"{where}.type: a {kind!r} tool is not served (function, namespace, custom, "
                                      f"or a hosted tool: {', '.join(sorted(HOSTED_TOOLS))})")
    return out, namespaces, custom, hosted + [{"type": "function", "name": n, "defer_loading": True}
                                              for n in deferred]


def chat_tool_choice(choice: Any, names: set[str]) -> Any:
    """The Responses ``tool_choice`` in chat form (``{"type": "function", "name"}`` -> the chat shape)."""
    if choice is None or isinstance(choice, str):
        if choice not in (None, "auto", "none", "required"):
            raise ResponsesInputError("tool_choice: auto, none, required, or {\"type\": \"function\", \"name\"}")
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        if choice["name"] not in names:
            raise ResponsesInputError(f"tool_choice: names {choice['name']!r}, which tools do not declare")
        return {"type": "function", "function": {"name": choice["name"]}}
    raise ResponsesInputError("tool_choice: auto, none, required, or {\"type\": \"function\", \"name\"} (hosted and "
                              "allowed-tools choices are not served)")


def read_request(raw: Any) -> ResponsesRequest:
    """Check ``raw`` and convert it; a field that would be lost is refused by name."""
    problem = unread_field(raw, FIELDS)
    if problem:
        raise ResponsesInputError(problem)
    if raw.get("background"):
        raise ResponsesInputError("background: background responses are not served (send the request and wait)")
    if raw.get("top_logprobs"):
        raise ResponsesInputError("top_logprobs: log probabilities are not served")
    include = raw.get("include") or []
    bad = [v for v in include if not isinstance(v, str) or v not in INCLUDE] if isinstance(include, list) else [include]
    if bad:
        raise ResponsesInputError(f"include: {bad[0]!r} is not served (served: {', '.join(sorted(INCLUDE))})")
    text = raw.get("text")
    if text is not None:
        fmt = text.get("format") if isinstance(text, dict) else None
        if not isinstance(text, dict) or set(text) - {"format", "verbosity"} or (
                fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text")):
            raise ResponsesInputError("text.format: only {\"type\": \"text\"} is served (structured outputs are not "
                                      "enabled on this actor); text.verbosity is recorded")
    reasoning = raw.get("reasoning")
    if reasoning is not None and (not isinstance(reasoning, dict) or
                                  set(reasoning) - {"effort", "summary", "generate_summary"}):
        raise ResponsesInputError("reasoning: {effort, summary} is read (recorded; the actor writes no reasoning)")
    stream_options = raw.get("stream_options")
    if stream_options is not None and (not isinstance(stream_options, dict) or
                                       set(stream_options) - {"include_obfuscation"}):
        raise ResponsesInputError("stream_options: only include_obfuscation is read (the stream carries no "
                                  "obfuscation padding)")
    for name in ("metadata", "client_metadata"):
        if raw.get(name) is not None and not isinstance(raw[name], dict):
            raise ResponsesInputError(f"{name}: an object is needed")
    for name in ("stream", "store", "parallel_tool_calls", "background"):
        if raw.get(name) is not None and not isinstance(raw[name], bool):
            raise ResponsesInputError(f"{name}: true or false is needed")
    for name in ("user", "prompt_cache_key", "previous_response_id", "instructions", "model", "safety_identifier"):
        if raw.get(name) is not None and not isinstance(raw[name], str):
            raise ResponsesInputError(f"{name}: a string is needed")
    if "input" not in raw:
        raise ResponsesInputError("input: required")
    tools, namespaces, custom, hosted = chat_tools(raw.get("tools"))
    names = {t["function"]["name"] for t in tools}
    choice = chat_tool_choice(raw.get("tool_choice"), names)
    if choice not in (None, "auto", "none") and not tools:
        raise ResponsesInputError("tool_choice: forcing a tool call needs function tools")
    edits = _compaction(raw.get("context_management"))
    messages = input_messages(raw["input"])
    instructions = raw.get("instructions")
    chat: dict[str, Any] = {"max_tokens": raw.get("max_output_tokens"), "temperature": raw.get("temperature"),
                            "top_p": raw.get("top_p")}
    if tools:
        chat.update(tools=tools, tool_choice=choice or "auto")
        if raw.get("parallel_tool_calls") is not None:
            chat["parallel_tool_calls"] = raw["parallel_tool_calls"]
    noted = {k: json.dumps(raw[k], sort_keys=True, ensure_ascii=False) for k in NOTED if raw.get(k) is not None}
    for k in ("stream_options",) + (("tool_choice",) if not tools and raw.get("tool_choice") is not None else ()):
        if raw.get(k) is not None:  # read, and changing nothing here: recorded
            noted[k] = json.dumps(raw[k], sort_keys=True, ensure_ascii=False)
    if hosted:  # hosted tools (nothing here runs them) and deferred ones: recorded, not declared
        noted["hosted_tools"] = json.dumps(hosted, sort_keys=True, ensure_ascii=False)
    if raw.get("parallel_tool_calls") is not None and not tools:
        noted["parallel_tool_calls"] = json.dumps(raw["parallel_tool_calls"])
    session = raw.get("user") or raw.get("prompt_cache_key")
    if session is not None and not _NAME.match(session):
        session = f"user-{hashlib.sha256(session.encode()).hexdigest()[:24]}"
    echo = {k: raw.get(k) for k in ("instructions", "tools", "tool_choice", "parallel_tool_calls", "temperature",
                                    "top_p", "max_output_tokens", "previous_response_id", "metadata", "reasoning",
                                    "text", "truncation", "user", "prompt_cache_key", "service_tier")}
    return ResponsesRequest(model=raw.get("model"), stream=bool(raw.get("stream")), chat=chat,
                            input_messages=messages, instructions=instructions,
                            previous_response_id=raw.get("previous_response_id"),
                            store=raw.get("store", True) is not False, session=session, noted=noted, echo=echo,
                            namespaces=namespaces, custom_tools=custom,
                            edits=edits)


def _compaction(entries: Any) -> ContextEdits | None:
    """``context_management: [{"type": "compaction", "compact_threshold": N}]`` as the gateway's compaction
    honours it: the epoch boundary falls at N tokens (``platform.compile.context_edits``)."""
    if entries is None:
        return None
    if not isinstance(entries, list) or len(entries) > 1:
        raise ResponsesInputError("context_management: a list of one {\"type\": \"compaction\", "
                                  "\"compact_threshold\": N} is served")
    out = None
    for k, e in enumerate(entries):
        if not isinstance(e, dict) or e.get("type") != "compaction" or set(e) - {"type", "compact_threshold"}:
            raise ResponsesInputError(f"context_management[{k}]: only {{\"type\": \"compaction\", "
                                      "\"compact_threshold\": N} is served")
        n = e.get("compact_threshold")
        if n is not None and (not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_TOKENS):
            raise ResponsesInputError(f"context_management[{k}].compact_threshold: an integer from 1 to "
                                      f"{MAX_TOKENS} is needed")
        out = ContextEdits(kind="compaction", trigger_tokens=n)
    return out


def history_session(messages: list[dict]) -> str:
    """A session named by the history itself (no ``user``, ``prompt_cache_key`` or previous response): the
    system messages and the first user message, hashed."""
    head = [m for m in messages if m.get("role") in ("system", "developer")] + \
        [m for m in messages if m.get("role") == "user"][:1]
    digest = hashlib.sha256(json.dumps(head, sort_keys=True, ensure_ascii=False).encode()).hexdigest()
    return f"responses-{digest[:24]}"
