"""Requests as the current coding agents send them, read without a server: the Responses API body of Codex CLI
0.171 and the Messages body of Claude Code 2.1.332 (both recorded from the CLIs, texts shortened), each field
carried into the turn or recorded, and what would be lost refused by name. Also the error shape of unknown
routes, and the chat fields that used to be dropped silently."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from palimpsest.serving.http import errors, responses_protocol, responses_proxy
from palimpsest.serving.http.openai_protocol import parse_messages
from palimpsest.serving.http.responses_protocol import ResponsesInputError, input_messages, read_request
from palimpsest.serving.http.schemas import ChatIn

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


def recorded(name: str) -> dict:
    return json.loads((FIXTURES / name).read_text())


# -- the Responses API -----------------------------------------------------------------------------------


def test_the_documented_body_is_what_the_reader_reads_and_the_recorded_request_fits_it():
    """``/openapi.json`` declares the body of ``POST /v1/responses`` (clients and the fuzzer generate from it): the
    fields and item kinds it names are the ones ``read_request`` reads, and Codex's recorded request is valid."""
    import jsonschema

    doc = responses_proxy.documented({"paths": {"/v1/responses": {"post": {}}}}, ["m"])
    body = doc["paths"]["/v1/responses"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    schema = {**doc["components"]["schemas"]["ResponsesRequest"], "components": doc["components"]}
    assert body == {"$ref": "#/components/schemas/ResponsesRequest"}
    assert set(schema["properties"]) == responses_protocol.FIELDS
    items = schema["properties"]["input"]["anyOf"][1]["items"]["anyOf"]
    assert {i["properties"]["type"]["enum"][0]: set(i["properties"]) for i in items} == \
        responses_protocol.ITEM_FIELDS
    assert schema["properties"]["model"]["enum"] == ["m"]
    sent = {**recorded("codex_0.171.0_responses.json")["body"], "model": "m"}
    jsonschema.validate(sent, schema)
    with pytest.raises(jsonschema.ValidationError, match="unread"):
        jsonschema.validate({**sent, "unread": 1}, schema)


def test_codex_request_is_read_whole_into_the_chat_form_the_recorder_takes():
    rec = recorded("codex_0.171.0_responses.json")
    req = read_request(rec["body"])
    assert req.stream and not req.store and req.session == rec["body"]["prompt_cache_key"]
    roles = [m["role"] for m in req.input_messages]
    assert roles == [m["role"] for m in rec["body"]["input"]]  # developer, developer, user, user
    names = [t["function"]["name"] for t in req.chat["tools"]]
    assert names[:2] == ["exec_command", "view_image"]
    assert names[2:] == ["multi_agent_v1__close_agent", "multi_agent_v1__resume_agent"]  # a namespace, flattened
    assert req.namespaces["multi_agent_v1__close_agent"] == ("multi_agent_v1", "close_agent")
    # the hosted web_search tool is recorded, not declared: nothing here would run it
    assert json.loads(req.noted["hosted_tools"]) == [{"type": "web_search", "external_web_access": False}]
    for name in ("include", "reasoning", "client_metadata", "prompt_cache_key", "store"):
        assert json.loads(req.noted[name]) == rec["body"][name], name
    chat = ChatIn.model_validate({"messages": req.input_messages, **{k: v for k, v in req.chat.items()
                                                                    if v is not None}})
    parsed = parse_messages(chat.messages)
    assert parsed.system.startswith("You are a coding agent") and "<skills_instructions>" in parsed.system
    assert parsed.task.startswith("<environment_context>")
    assert [s.observation for s in parsed.steps] == ["Say hello"]  # the user's words, a step of their own


def test_function_calls_and_their_outputs_become_one_assistant_message_and_tool_messages():
    items = [{"role": "user", "content": "fix it"},
             {"type": "function_call", "call_id": "c1", "name": "exec_command", "arguments": "{\"cmd\": \"ls\"}"},
             {"type": "function_call", "call_id": "c2", "name": "close_agent", "namespace": "multi_agent_v1",
              "arguments": "{}"},
             {"type": "function_call_output", "call_id": "c1", "output": "a.py"},
             {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "ok"}]},
             {"type": "reasoning", "id": "rs_1", "summary": []},  # an empty echo: nothing to record
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "done"}]},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "thanks"}]}]
    out = input_messages(items)
    assert [m["role"] for m in out] == ["user", "assistant", "tool", "tool", "assistant", "user"]
    assert [c["function"]["name"] for c in out[1]["tool_calls"]] == ["exec_command", "multi_agent_v1__close_agent"]
    assert out[2] == {"role": "tool", "content": "a.py", "tool_call_id": "c1"}
    assert out[3]["content"] == "ok" and out[4]["content"] == "done"
    parsed = parse_messages(ChatIn.model_validate({"messages": out}).messages)
    assert parsed.steps[0].action and "a.py" in parsed.steps[0].observation and "ok" in parsed.steps[0].observation


def test_a_custom_tool_is_declared_as_one_string_and_its_call_read_back():
    body = {"model": "m", "input": [
        {"role": "user", "content": "patch"},
        {"type": "custom_tool_call", "call_id": "c9", "name": "apply_patch", "input": "*** Begin Patch"},
        {"type": "custom_tool_call_output", "call_id": "c9", "output": "applied"}],
        "tools": [{"type": "custom", "name": "apply_patch", "description": "Edit files",
                   "format": {"type": "grammar", "syntax": "lark", "definition": "start: x"}}]}
    req = read_request(body)
    fn = req.chat["tools"][0]["function"]
    assert fn["name"] == "apply_patch" and fn["parameters"]["required"] == ["input"] and "lark" in fn["description"]
    assert json.loads(req.input_messages[1]["tool_calls"][0]["function"]["arguments"]) == {"input": "*** Begin Patch"}
    assert req.custom_tools == {"apply_patch"}


@pytest.mark.parametrize("patch, field", [
    ({"frequency_penalty": 0.5}, "frequency_penalty"),
    ({"background": True}, "background"),
    ({"include": ["message.output_text.logprobs"]}, "include"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {}}}}, "text.format"),
    ({"tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"tools": [{"type": "computer_use", "display_width": 1}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "name": "f", "extra": 1}]}, "tools[0].extra"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0]"),
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": "x", "note": "y"}]}]},
     "input[0].content[0].note"),
    ({"input": [{"type": "local_shell_call", "call_id": "c"}]}, "input[0].type"),
    ({"input": [{"type": "reasoning", "summary": [{"type": "summary_text", "text": "t"}]}]}, "input[0]"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": "x", "extra": 1}]}, "input[0].extra"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
    ({"input": ""}, "input"),
    ({"metadata": "x"}, "metadata"),
])
def test_what_would_be_lost_is_refused_by_name(patch, field):
    body = {"model": "m", "input": "hello", "tools": [{"type": "function", "name": "f"}], **patch}
    with pytest.raises(ResponsesInputError) as e:
        read_request(body)
    assert str(e.value).startswith(field), str(e.value)


def test_session_names_that_are_not_ids_are_hashed_and_the_text_format_text_is_accepted():
    req = read_request({"input": "hi", "user": "a user with spaces", "text": {"format": {"type": "text"},
                                                                              "verbosity": "low"}})
    assert req.session.startswith("user-") and json.loads(req.noted["text"])["verbosity"] == "low"
    assert read_request({"input": "hi", "prompt_cache_key": "thread-1"}).session == "thread-1"
    assert read_request({"input": "hi", "user": "u1", "prompt_cache_key": "thread-1"}).session == "u1"


# -- Claude Code's Messages body -------------------------------------------------------------------------


def test_claude_code_request_with_a_system_message_inside_messages_is_read_at_its_position():
    pytest.importorskip("vllm")
    from palimpsest.serving.http import anthropic_protocol

    rec = recorded("claude_code_2.1.332_messages.json")
    req = anthropic_protocol.read_request(rec["body"])
    roles = [m["role"] for m in req.chat["messages"]]
    assert roles == ["system", "user", "system"]  # the top-level system, the user, the system message after it
    assert req.chat["messages"][2]["content"].startswith("# Environment")
    # the deferred tool is not declared to the actor until a search loads it; its name is recorded
    assert [t["function"]["name"] for t in req.chat["tools"]] == ["Bash", "Read"]
    assert json.loads(req.noted["deferred_tools"]) == ["DeferredToolPlaceholder"]
    assert json.loads(req.noted["thinking"]) == rec["body"]["thinking"]  # adaptive, display omitted
    assert json.loads(req.noted["output_config"]) == {"effort": "high"}
    assert "messages[1].content[0]" in json.loads(req.noted["cache_control"])
    assert req.user_id.startswith("user-") and req.noted["user_id"] == rec["body"]["metadata"]["user_id"]
    assert req.max_tokens == 32000  # the CLI's default cap, refused by the turn unless the budget holds it
    parsed = parse_messages(ChatIn.model_validate({**req.chat, "max_tokens": 64}).messages)
    assert parsed.task.endswith("Say hello")
    assert parsed.steps[-1].authority.value == "system" and parsed.steps[-1].observation.startswith("# Environment")


def test_a_system_message_between_turns_keeps_its_place_among_tool_results():
    pytest.importorskip("vllm")
    from palimpsest.serving.http import anthropic_protocol

    body = {"model": "m", "max_tokens": 8, "messages": [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "Bash", "input": {"c": 1}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "out",
                                      "is_error": True}]},
        {"role": "system", "content": "Be brief from here on."},
        {"role": "user", "content": "next"}],
        "tools": [{"name": "Bash", "input_schema": {"type": "object"}}]}
    chat = anthropic_protocol.read_request(body).chat["messages"]
    assert [m["role"] for m in chat] == ["user", "assistant", "tool", "system", "user"]
    assert chat[2]["content"].startswith(
        "(the tool reported an error)") and chat[3]["content"] == "Be brief from here on."


@pytest.mark.parametrize("patch, field", [
    ({"metadata": {"user_id": 42}}, "metadata.user_id"),
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
    ({"thinking": {"type": "adaptive", "shape": 1}}, "thinking.shape"),
    ({"metadata": {"user_id": ""}}, "metadata.user_id"),
    ({"tools": [{"name": "T", "input_schema": {"type": "object"}, "defer_loading": True}],
      "tool_choice": {"type": "any"}}, "tool_choice"),
    ({"context_management": {"edits": [{"type": "clear_tool_uses_20250919", "clear_tool_inputs": True},
                                       {"type": "clear_tool_uses_20250919", "clear_tool_inputs": True}]}},
     "context_management.edits[1]"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [
        {"type": "text", "text": "x", "citations": [{"type": "char_location"}]}]}]}]},
     "messages[0].content[0].content[0].citations"),
])
def test_claude_code_fields_that_would_be_lost_are_refused_by_name(patch, field):
    pytest.importorskip("vllm")
    from palimpsest.serving.http import anthropic_protocol

    body = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "x"}], **patch}
    with pytest.raises(anthropic_protocol.AnthropicInputError) as e:
        anthropic_protocol.read_request(body)
    assert str(e.value).startswith(field), str(e.value)


# -- errors and the chat fields once dropped ---------------------------------------------------------------


def test_unknown_v1_routes_answer_in_the_clients_protocol():
    assert errors.protocol_of("/v1/nope") == errors.OPENAI
    assert errors.protocol_of("/v1/nope", anthropic_client=True) == errors.ANTHROPIC
    assert errors.protocol_of("/v1/responses") == errors.OPENAI
    assert errors.protocol_of("/v1/responses", anthropic_client=True) == errors.OPENAI  # a known OpenAI route
    assert errors.protocol_of("/v1/sessions/s/turn") == errors.PALIMPSEST
    assert errors.protocol_of("/v1/ab/shadow") == errors.PALIMPSEST
    assert errors.protocol_of("/nope") == errors.PALIMPSEST
    status, body = errors.body(errors.protocol_of("/v1/nope"), 404, "Not Found")
    assert status == 404 and body["error"]["type"] == "invalid_request_error" and body["error"]["code"] == "not_found"


def test_chat_refuses_two_different_reply_caps_and_unread_keys_of_text_parts():
    base = {"messages": [{"role": "user", "content": "x"}]}
    with pytest.raises(ValidationError, match="max_tokens: differs"):
        ChatIn.model_validate({**base, "max_tokens": 5, "max_completion_tokens": 6})
    assert ChatIn.model_validate({**base, "max_tokens": 5, "max_completion_tokens": 5}).max_tokens == 5
    chat = ChatIn.model_validate({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "x", "cache_control": {"type": "ephemeral"}}]}]})
    with pytest.raises(Exception, match=r"messages\[0\]\.content\[0\]\.cache_control"):
        parse_messages(copy.deepcopy(chat.messages))


# -- context-management requests ---------------------------------------------------------------------------


def test_clear_tool_uses_maps_onto_the_compaction_and_what_cannot_be_honoured_is_refused():
    pytest.importorskip("vllm")
    from palimpsest.serving.http import anthropic_protocol

    base = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "x"}]}
    edit = {"type": "clear_tool_uses_20250919", "trigger": {"type": "input_tokens", "value": 3000},
            "keep": {"type": "tool_uses", "value": 2}, "clear_at_least": {"type": "input_tokens", "value": 500},
            "exclude_tools": ["Read"], "clear_tool_inputs": True}
    req = anthropic_protocol.read_request({**base, "context_management": {"edits": [edit]}})
    assert (req.edits.trigger_tokens, req.edits.keep_tool_uses, req.edits.clear_at_least_tokens,
            req.edits.exclude_tools) == (3000, 2, 500, ("Read",))
    defaults = anthropic_protocol.read_request({**base, "context_management": {"edits": [
        {"type": "clear_tool_uses_20250919", "clear_tool_inputs": True}]}}).edits
    assert (defaults.trigger_tokens, defaults.keep_tool_uses) == (100_000, 3)  # Anthropic's published defaults
    # absent, clear_tool_inputs is false (inputs kept verbatim), which the gateway's compaction does not do
    absent = {k: v for k, v in edit.items() if k != "clear_tool_inputs"}
    for bad, field in ((absent, "context_management.edits[0].clear_tool_inputs"),
                       ({**edit, "clear_tool_inputs": False}, "context_management.edits[0].clear_tool_inputs"),
                       ({**edit, "trigger": {"type": "tool_uses", "value": 3}}, "context_management.edits[0].trigger"),
                       ({"type": "compact_20260112"}, "context_management.edits[0]"),
                       ({**edit, "trigger": {"type": "input_tokens", "value": 0}},
                        "context_management.edits[0].trigger"),
                       ({**edit, "keep": {"type": "tool_uses", "value": 10**17}}, "context_management.edits[0].keep"),
                       ({**edit, "trigger": {}}, "context_management.edits[0].trigger"),
                       ({"type": []}, "context_management.edits[0]"), ({"type": {}}, "context_management.edits[0]")):
        with pytest.raises(anthropic_protocol.AnthropicInputError) as e:
            anthropic_protocol.read_request({**base, "context_management": {"edits": [bad]}})
        assert str(e.value).startswith(field), str(e.value)


def test_the_responses_compaction_entry_sets_the_boundary():
    req = read_request({"input": "x", "context_management": [{"type": "compaction", "compact_threshold": 2000}]})
    assert req.edits.kind == "compaction" and req.edits.trigger_tokens == 2000
    for flag in ("stream", "store"):
        with pytest.raises(ResponsesInputError, match=flag):
            read_request({"input": "x", flag: "false"})
    for bad in ([{"type": "compaction", "compact_threshold": 0}],
                [{"type": "compaction", "compact_threshold": 1 << 41}],
                [{"type": "other"}], {"type": "compaction"}):
        with pytest.raises(ResponsesInputError, match="context_management"):
            read_request({"input": "x", "context_management": bad})


def test_the_event_writer_streams_a_function_call_as_its_items_and_argument_events():
    from types import SimpleNamespace

    from palimpsest.serving.http.responses_proxy import Ids, ResponsesEvents

    req = read_request({"input": "x", "tools": [{"type": "namespace", "name": "ns", "tools": [
        {"type": "function", "name": "go"}]}]})
    turn = SimpleNamespace(content="ok", tool_calls=[{"id": "c1", "type": "function", "function": {
        "name": "ns__go", "arguments": "{\"a\": 1}"}}], finish_reason="tool_calls", stop_sequence=None, arm="pace",
        t=0, plan={}, latency_ms={}, glimpses=[], context_edit=None,
        tokens={"prompt_total": 10, "completion": 3, "cached": 4, "cached_total": 4})
    w = ResponsesEvents(req, Ids(), "m", "s")
    frames = w.opening() + w.text("o") + w.closing(turn)
    evs = [json.loads(f.split("data: ", 1)[1]) for f in frames]
    assert [e["type"] for e in evs] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.output_item.added",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed"]
    assert [e["sequence_number"] for e in evs] == list(range(len(evs)))
    call = evs[-2]["item"]
    assert (call["namespace"], call["name"], call["call_id"], call["arguments"]) == ("ns", "go", "c1", "{\"a\": 1}")
    final = evs[-1]["response"]
    assert final["usage"]["input_tokens_details"] == {"cached_tokens": 4, "cache_write_tokens": 6}
    from openai.types.responses import Response

    assert Response.model_validate({**final, "tools": []}).output[1].type == "function_call"


def test_a_request_that_names_no_temperature_is_sampled_at_the_actors_default():
    from palimpsest.serving.serve_config import parse_serve_config

    smol = parse_serve_config({}).actor  # the default SmolLM2 actor rambles at 1.0 (benchmarks/codex_cli.py)
    assert smol.sampling_temperature(None) == 0.0 and smol.sampling_temperature(0.9) == 0.9
    assert parse_serve_config({"actor": {"temperature": 0.7}}).actor.sampling_temperature(None) == 0.7
    assert parse_serve_config({"actor": {"model": "/models/x"}}).actor.sampling_temperature(None) == 1.0


def test_leading_system_messages_extend_the_system_prompt_and_tool_result_cache_hints_are_recorded():
    pytest.importorskip("vllm")
    from palimpsest.serving.http import anthropic_protocol

    req = anthropic_protocol.read_request({"model": "m", "max_tokens": 8, "system": "Top.", "messages": [
        {"role": "system", "content": "Then this."},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [
            {"type": "text", "text": "x", "cache_control": {"type": "ephemeral"}}]}, {"type": "text", "text": "go"}]}]})
    assert req.chat["messages"][0] == {"role": "system", "content": "Top.\n\nThen this."}
    assert json.loads(req.noted["cache_control"]) == ["messages[1].content[0].content[0]"]  # as the client sent it


def test_responses_inputs_once_lost_are_recorded_or_refused():
    req = read_request({"input": [{"role": "assistant", "content": [{"type": "refusal", "refusal": "no"}]},
                                  {"role": "user", "content": "x"}],
                        "tools": [{"type": "function", "name": "f"},
                                  {"type": "function", "name": "g", "defer_loading": True}],
                        "stream_options": {"include_obfuscation": False}})
    assert req.input_messages[0] == {"role": "assistant", "content": "no"}
    assert [t["function"]["name"] for t in req.chat["tools"]] == ["f"]  # deferred: recorded, not declared
    assert json.loads(req.noted["hosted_tools"]) == [{"type": "function", "name": "g", "defer_loading": True}]
    assert json.loads(req.noted["stream_options"]) == {"include_obfuscation": False}
    assert json.loads(read_request({"input": "x", "tool_choice": "none"}).noted["tool_choice"]) == "none"
    with pytest.raises(ResponsesInputError, match=r"tools\[1\]\.tools\[0\]\.name: 'ns__go' is declared twice"):
        read_request({"input": "x", "tools": [{"type": "function", "name": "ns__go"}, {
            "type": "namespace", "name": "ns", "tools": [{"type": "function", "name": "go"}]}]})
    with pytest.raises(ResponsesInputError, match=r"input\[0\]\.phase"):
        read_request({"input": [{"role": "user", "content": "x", "phase": "final_answer"}]})


def test_a_failed_stream_and_its_events_are_the_openai_types():
    from openai.types.responses import ResponseErrorEvent, ResponseFailedEvent

    from palimpsest.serving.http.responses_proxy import Ids, ResponsesEvents

    for status in (400, 404, 409, 413, 422, 429, 500, 503):
        w = ResponsesEvents(read_request({"input": "x"}), Ids(), "m", "s")
        err, failed = [json.loads(f.split("data: ", 1)[1]) for f in w.error(status, "messages: bad")]
        ResponseErrorEvent.model_validate(err)
        assert ResponseFailedEvent.model_validate(failed).response.status == "failed", status


def test_a_literal_clear_tool_uses_edit_is_the_policy_with_its_parameters():
    pytest.importorskip("vllm")
    from palimpsest.platform.compile.context_edits import edited_config
    from palimpsest.serving.http import anthropic_protocol

    base = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "x"}]}
    edit = {"type": "clear_tool_uses_20250919", "trigger": {"type": "tool_uses", "value": 4},
            "keep": {"type": "tool_uses", "value": 1}, "exclude_tools": ["Read"]}  # clear_tool_inputs absent: false
    with pytest.raises(anthropic_protocol.AnthropicInputError, match="x-palimpsest-context-edits: literal"):
        anthropic_protocol.read_request({**base, "context_management": {"edits": [edit]}})
    edits = anthropic_protocol.read_request({**base, "context_management": {"edits": [edit]}}, literal=True).edits
    assert edits.literal and edits.trigger_tool_uses == 4 and edits.clear_tool_inputs is False
    cfg = edited_config(None, edits, 6000)
    assert (cfg.name, cfg.trigger, cfg.trigger_type, cfg.keep, cfg.exclude_tools, cfg.clear_tool_inputs) == (
        "clear_tool_uses", 4, "tool_uses", 1, ("Read",), False)


_JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
                     lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner,
                                                                                  max_size=3), max_leaves=8)


def _paths(value, at=()):
    yield at
    children = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for k, v in children:
        yield from _paths(v, (*at, k))


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_a_mutated_codex_request_is_read_or_refused_by_name_never_an_error(data):
    """Any value anywhere in Codex's recorded body: read into a valid chat request, or refused with the reader's
    own error; nothing else raises (a server error is a bug)."""
    body = copy.deepcopy(recorded("codex_0.171.0_responses.json")["body"])
    for _ in range(data.draw(st.integers(1, 3))):
        path = data.draw(st.sampled_from([p for p in _paths(body) if p]))
        parent = body
        for k in path[:-1]:
            parent = parent[k]
        parent[path[-1]] = data.draw(_JSON)
    try:
        req = read_request(body)
    except ResponsesInputError:
        return
    try:
        ChatIn.model_validate({"messages": req.input_messages, **{k: v for k, v in req.chat.items() if v is not None}})
    except ValidationError:
        pass  # the route answers 400 naming the field
