import json
import re

import pytest

from palimpsest.platform.types import Authority, PalimpsestError
from palimpsest.serving.http import anthropic_protocol
from palimpsest.serving.http.errors import HistoryConflict
from palimpsest.serving.http.openai_protocol import new_steps, parse_messages
from palimpsest.serving.http.schemas import ChatMessage


def msgs(*pairs):
    return [ChatMessage(role=r, content=c) for r, c in pairs]


CHAT = msgs(("system", "be careful"), ("user", "fix the bug"), ("assistant", "ls"), ("user", "a.py b.py"),
            ("assistant", "cat a.py"), ("tool", "def f(): ..."))


def test_system_task_and_steps_from_a_message_list():
    p = parse_messages(CHAT)
    assert (p.system, p.task) == ("be careful", "fix the bug")
    assert [(s.t, s.action, s.observation) for s in p.steps] == [(0, "ls", "a.py b.py"),
                                                                  (1, "cat a.py", "def f(): ...")]
    # command output sent as a user message after an action is the tool's, not the principal's (default)
    assert p.steps[0].authority is Authority.TOOL and p.steps[1].authority is Authority.TOOL


def test_authority_comes_from_the_source_not_the_role():
    as_user = parse_messages(CHAT, user_after_action="user")
    assert as_user.steps[0].authority is Authority.USER and as_user.steps[1].authority is Authority.TOOL
    # a user turn before any action is the principal speaking
    p = parse_messages(msgs(("user", "fix the bug"), ("user", "and the docs"), ("assistant", "ls"), ("user", "a.py")))
    assert p.steps[0].authority is Authority.USER and p.steps[1].authority is Authority.TOOL


def test_a_trailing_assistant_prefill_is_refused_by_position_not_dropped():
    assert len(parse_messages(CHAT).steps) == 2
    with pytest.raises(PalimpsestError, match=rf"messages\[{len(CHAT)}\]: a trailing assistant message"):
        parse_messages(CHAT + msgs(("assistant", "pytest")))


def test_a_legacy_function_call_or_an_unread_field_is_refused_by_name():
    call = ChatMessage(role="assistant", content=None, function_call={"name": "ls", "arguments": "{}"})
    with pytest.raises(PalimpsestError, match=r"messages\[2\].function_call: the legacy"):
        parse_messages(CHAT[:2] + [call] + msgs(("function", "a.py")))
    odd = ChatMessage(role="assistant", content="ls", reasoning_content="I should list the files")
    with pytest.raises(PalimpsestError, match=r"messages\[2\].reasoning_content"):
        parse_messages(CHAT[:2] + [odd] + CHAT[3:])
    # what a client echoes back empty on an assistant message is nothing to record
    echoed = ChatMessage(role="assistant", content="ls", refusal=None, function_call=None, annotations=[])
    assert parse_messages(CHAT[:2] + [echoed] + CHAT[3:]).steps == parse_messages(CHAT).steps


def test_resending_history_is_idempotent_and_rewriting_it_is_a_conflict():
    p = parse_messages(CHAT)
    recorded = [s.sha256() for s in p.steps[:1]]
    assert [s.t for s in new_steps(recorded, p.steps)] == [1]
    assert new_steps([s.sha256() for s in p.steps], p.steps) == []
    changed = parse_messages(CHAT[:3] + msgs(("user", "a.py c.py")) + CHAT[4:])
    with pytest.raises(HistoryConflict, match="t=0"):
        new_steps(recorded, changed.steps)
    with pytest.raises(HistoryConflict, match="cannot be removed"):
        new_steps([s.sha256() for s in p.steps], p.steps[:1])


def test_a_list_without_a_task_is_refused():
    with pytest.raises(PalimpsestError, match="user message"):
        parse_messages(msgs(("system", "x")))


def test_text_content_parts_are_read():
    p = parse_messages([ChatMessage(role="user", content=[{"type": "text", "text": "solve it"}])])
    assert p.task == "solve it"


def test_no_message_is_dropped_whatever_the_sequence_of_roles():
    chat = msgs(("system", "be careful"), ("user", "fix the bug"), ("assistant", "I will look first."),
                ("assistant", "ls"), ("tool", "a.py"), ("tool", "b.py"), ("system", "budget: 3 more steps"),
                ("assistant", "cat a.py"), ("system", "the sandbox restarted"), ("assistant", "cat a.py"),
                ("user", "def f(): ..."), ("user", "also check b.py"), ("assistant", "cat b.py"), ("tool", "x = 1"))
    p = parse_messages(chat)
    got = [(s.action, s.observation, s.authority) for s in p.steps]
    assert got == [("I will look first.", None, Authority.MODEL),
                   ("ls", "a.py\nb.py\nbudget: 3 more steps", Authority.TOOL),
                   ("cat a.py", "the sandbox restarted", Authority.SYSTEM),
                   ("cat a.py", "def f(): ...\nalso check b.py", Authority.TOOL),
                   ("cat b.py", "x = 1", Authority.TOOL)]
    texts = "\n".join(f"{a}\n{o}" for a, o, _ in got)  # every message's text is in a step
    assert all(m.content in texts for m in chat[2:])


def test_content_the_text_actor_cannot_read_is_refused_by_position():
    image = [ChatMessage(role="user", content=[{"type": "text", "text": "what is this?"},
                                               {"type": "image_url", "image_url": {"url": "data:..."}}])]
    with pytest.raises(PalimpsestError, match=r"messages\[1\]\.content\[1\]: a 'image_url' content part"):
        parse_messages(msgs(("system", "s")) + image)


def test_sessions_recorded_under_the_other_reading_of_user_output_stay_valid():
    """A session whose command output (user messages after actions) was recorded as the principal's words
    keeps working after the default reading becomes tool output: resending it is not a conflict."""
    old = parse_messages(CHAT, user_after_action="user")
    new = parse_messages(CHAT)  # default: tool
    assert old.steps[0].sha256() != new.steps[0].sha256()
    assert new_steps([s.sha256() for s in old.steps], new.steps, new.alternates) == []
    with pytest.raises(HistoryConflict):  # a real change is still a conflict
        changed = parse_messages(CHAT[:3] + msgs(("user", "a.py c.py")) + CHAT[4:])
        new_steps([s.sha256() for s in old.steps], changed.steps, changed.alternates)


def test_with_the_user_reading_the_principal_speaking_after_tool_output_is_a_user_step():
    chat = CHAT + msgs(("user", "now also fix b.py"), ("assistant", "cat b.py"), ("tool", "x"),
                       ("system", "2 steps left"), ("user", "hurry"))
    p = parse_messages(chat, user_after_action="user")
    got = [(s.action, s.observation, s.authority) for s in p.steps]
    assert got[1:] == [("cat a.py", "def f(): ...", Authority.TOOL), ("", "now also fix b.py", Authority.USER),
                       ("cat b.py", "x\n2 steps left\nhurry", Authority.TOOL)]


def test_malformed_tool_declarations_are_refused_by_field_not_crashed_on():
    import pydantic

    from palimpsest.serving.http.schemas import ChatIn

    msgs = [{"role": "user", "content": "task"}]
    for tools, choice, field in (([{"type": "function", "function": "f"}], None, "tools[0]"),
                                 ([{"type": "function", "function": {"name": "f", "parameters": "x"}}], None,
                                  "tools[0].function.parameters"),
                                 ([{"type": "function", "function": {"name": "f"}}],
                                  {"type": "function", "function": "f"}, "tool_choice")):
        with pytest.raises(pydantic.ValidationError, match=re.escape(field)):
            ChatIn.model_validate({"messages": msgs, "tools": tools, "tool_choice": choice})


def test_a_tool_message_before_any_action_keeps_its_call_id():
    from palimpsest.platform.prompt import toolcalls
    from palimpsest.serving.http.openai_protocol import parse_messages
    from palimpsest.serving.http.schemas import ChatIn

    body = ChatIn.model_validate({"messages": [
        {"role": "user", "content": "task"},
        {"role": "tool", "tool_call_id": "c7", "name": "run", "content": "out"}]})
    (step,) = parse_messages(body.messages).steps
    assert toolcalls.tool_call_ids(step) == ["c7"] and step.observation == "out"


def test_the_served_document_declares_the_messages_bodies_as_this_endpoint_reads_them():
    """The Messages routes read their body raw; the document gives vLLM's protocol models narrowed to the fields
    read (a field outside it is a 400) and the served model names (any other is a 404): what a client or the
    fuzzer generates from it is what the endpoint accepts."""
    from palimpsest.serving.http import anthropic_proxy

    anthropic_protocol.load()
    doc = anthropic_proxy.documented({"paths": {"/v1/messages": {"post": {}},
                                                "/v1/messages/count_tokens": {"post": {}}}},
                                     ["served-model"])
    schemas = doc["components"]["schemas"]
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        ref = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        body = schemas[ref.rsplit("/", 1)[1]]
        assert set(body["properties"]) <= anthropic_protocol.FIELDS and body["additionalProperties"] is False
        assert {"model", "messages"} <= set(body["required"]) and body["properties"]["model"]["enum"] == [
            "served-model"]
    assert set(schemas["AnthropicContentBlock"]["properties"]["type"]["enum"]) == set(anthropic_protocol.BLOCK_FIELDS)
    assert set(schemas["AnthropicTool"]["properties"]) <= anthropic_protocol.TOOL_FIELDS
    # every field the document offers passes the endpoint's own check
    anthropic_protocol.check_request({k: v for k, v in {
        "model": "served-model", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "stream": True,
        "system": "s", "temperature": 0.5, "top_p": 0.9, "stop_sequences": ["x"], "metadata": {"user_id": "u"},
        "thinking": {"type": "disabled"}, "tools": [{"name": "t", "input_schema": {"type": "object"}}],
        "tool_choice": {"type": "auto"}}.items() if k in schemas["AnthropicMessagesRequest"]["properties"]})


def test_what_claude_code_sends_is_read_and_what_would_change_the_actor_is_refused_by_name():
    """Claude Code's requests carry thinking "adaptive", a context edit that clears thinking blocks and an effort
    level: none asks this actor (which writes no thinking blocks and has no effort setting) to behave otherwise,
    so they are read and recorded with the turn. Anything that would is a 400 naming the field."""
    anthropic_protocol.load()
    base = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "list the files"}]}
    req = anthropic_protocol.read_request({
        **base, "thinking": {"type": "adaptive"}, "output_config": {"effort": "high"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]}})
    assert {k: json.loads(v) for k, v in req.noted.items()} == {  # recorded whole
        "thinking": {"type": "adaptive"}, "output_config": {"effort": "high"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]}}
    assert anthropic_protocol.read_request(base).noted == {}
    # a user_id that is no session name (Claude Code's is a JSON object) names one by its hash, kept with the turn
    cc = '{"device_id":"d1","account_uuid":"","session_id":"2e66"}'
    r1, r2 = (anthropic_protocol.read_request({**base, "metadata": {"user_id": u}}) for u in (cc, cc))
    assert r1.user_id == r2.user_id and r1.user_id.startswith("user-") and r1.noted["user_id"] == cc
    assert anthropic_protocol.read_request({**base, "metadata": {"user_id": "my-session-1"}}).user_id == "my-session-1"
    for patch, field in (({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
                         ({"output_config": {"format": {"type": "json_schema", "schema": {}}}}, "output_config"),
                         ({"context_management": {"edits": [{"type": "compact_20260112"}]}},
                          "context_management.edits[0]"),
                         ({"context_management": []}, "context_management")):
        with pytest.raises(anthropic_protocol.AnthropicInputError, match=re.escape(field)):
            anthropic_protocol.read_request({**base, **patch})


def test_a_messages_field_of_any_wrong_json_type_is_a_400_naming_it_never_a_crash():
    """Every field of a Messages body, given each JSON type it does not take (a number for ``tools``, a string for
    ``messages``...), is refused by name as the caller's error: the checks before vLLM's model read the value
    by its type and must not fail on a value of another one."""
    anthropic_protocol.load()
    base = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    for field in sorted(anthropic_protocol.FIELDS):
        for value in (1133455, -3.5, "x", True, {"a": 1}, [1], [None], [{"type": 7}]):
            try:
                anthropic_protocol.read_request({**base, field: value})
            except anthropic_protocol.AnthropicInputError as e:
                assert field in str(e), (field, value, str(e))


def _turn(content: str, **extra):
    from types import SimpleNamespace

    tokens = {"prompt_total": 10, "cached_total": 0, "cached": 0, "completion": 4, "full_history_estimate": 10,
              "context": 10}
    return SimpleNamespace(content=content, tool_calls=[], finish_reason="length", stop_sequence=None, tokens=tokens,
                           **extra)


def test_a_stream_ends_with_the_text_the_tool_parser_held_back():
    """A reply that opens like a tool call and never closes one is held back while it streams (it may be call
    markup) and comes back whole as content: the stream sends it before it closes, as the whole reply has it."""
    from palimpsest.serving.http.anthropic_proxy import MessagesEvents
    from palimpsest.serving.http.openai_proxy import ChunkWriter

    held = '<tool_call>{"name": "bash", "arguments": {'
    writer = MessagesEvents("m", lambda turn: {})
    frames = writer.started({"prompt": 10, "expected_cached": 0}) + writer.closing(_turn(held))
    deltas = [json.loads(f.split("data: ", 1)[1]) for f in frames if f.startswith("event: content_block_delta")]
    assert [d["delta"]["text"] for d in deltas] == [held]
    # what was streamed already is not sent twice
    writer = MessagesEvents("m", lambda turn: {})
    frames = writer.text("Hello") + writer.closing(_turn("Hello world"))
    texts = [json.loads(f.split("data: ", 1)[1])["delta"]["text"] for f in frames
             if f.startswith("event: content_block_delta")]
    assert texts == ["Hello", " world"]
    chunks = ChunkWriter({"id": "x", "created": 0, "model": "m"}, "s", False)
    frames = chunks.closing(_turn(held, arm="a", t=0, plan={}, latency_ms={}, glimpses=[]))
    sent = [json.loads(f[6:])["choices"][0]["delta"].get("content") for f in frames if f.startswith("data: {")]
    assert held in sent


def test_the_served_document_asked_for_before_the_replica_is_ready_is_not_kept(monkeypatch):
    """/openapi.json asked for before the Messages bodies can be documented (vLLM's protocol not imported, the
    served model not known) comes without them and is not kept: the next request, once they can be, has them."""
    import types

    from fastapi import FastAPI, Request

    from palimpsest.serving.http import anthropic_protocol
    from palimpsest.serving.http.ingress import _openapi

    app = FastAPI()

    @app.post("/v1/messages")
    async def messages(request: Request) -> dict:
        return {}

    @app.post("/v1/messages/count_tokens")
    async def count(request: Request) -> dict:
        return {}

    @app.post("/v1/responses")
    async def responses(request: Request) -> dict:
        return {}

    app.openapi = types.MethodType(_openapi, app)
    monkeypatch.setattr(anthropic_protocol, "_served", [])
    early = app.openapi()
    assert "requestBody" not in early["paths"]["/v1/messages"]["post"]
    anthropic_protocol.load()
    anthropic_protocol.serve_models(["served-model"])
    later = app.openapi()
    assert later["paths"]["/v1/messages"]["post"]["requestBody"]["required"] is True
    assert later["paths"]["/v1/responses"]["post"]["requestBody"]["required"] is True


def test_errors_keep_their_protocols_shape_under_a_route_prefix():
    """Serve keeps a route prefix (``serve.route_prefix``) in the request's path and names it in ``root_path``:
    the protocol is read from the path below the prefix."""
    from starlette.requests import Request

    from palimpsest.serving.http.server import error_response

    def at(path: str, root: str = "") -> dict:
        request = Request({"type": "http", "method": "POST", "path": path, "root_path": root, "headers": [],
                           "query_string": b""})
        return json.loads(error_response(request, 404, "model: 'x' is not served here").body)

    assert at("/p/v1/messages", "/p")["error"]["type"] == "not_found_error"
    assert at("/p/v1/chat/completions", "/p")["error"]["code"] == "model_not_found"
    assert at("/p/v1/sessions/s/turn", "/p") == {"error": "model: 'x' is not served here"}
    assert at("/v1/messages")["type"] == "error"


def test_a_messages_stream_keeps_alive_without_breaking_its_event_order():
    """Before ``message_start`` (the prompt still compiling) the keep-alive is an SSE comment, which every
    event-stream reader skips; after it, Anthropic's ``ping`` event."""
    from palimpsest.serving.http.anthropic_proxy import MessagesEvents

    writer = MessagesEvents("m", lambda turn: {})
    assert writer.ping() == [": keep-alive\n\n"]
    (start,) = writer.started({"prompt": 10, "expected_cached": 4})
    usage = json.loads(start.split("data: ", 1)[1])["message"]["usage"]
    assert (usage["input_tokens"], usage["cache_read_input_tokens"]) == (6, 4)
    assert writer.ping() == ['event: ping\ndata: {"type": "ping"}\n\n']
