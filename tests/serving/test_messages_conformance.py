"""The Messages API as its clients read it: the live app driven with raw HTTP (and raw server-sent events) and
with the ``anthropic`` client, against Anthropic's documented shapes: errors by status, ``stop_sequence``, the
event order with usage in ``message_start`` and ``ping``, tool results (several in one message, as lists of
blocks, ``is_error``), ``tool_choice`` any / none / tool, a system given as blocks, and what would be dropped
refused by name. One app for the module (a ping every 10 ms, a 64 KiB body limit)."""

from __future__ import annotations

import json

import httpx
import pytest

from palimpsest.platform import Ledger
from palimpsest.platform.prompt.chat import prefix_messages
from palimpsest.serving.http import anthropic_proxy, errors
from palimpsest.serving.http.server import ARM_HEADER
from tests.helpers import error_message
from tests.serving.conftest import KEYS

pytestmark = [pytest.mark.slow, pytest.mark.ray, pytest.mark.vllm]

LIMIT = 64 * 1024
TOOLS = [{"name": "run_shell", "description": "Run a shell command",
          "input_schema": {"type": "object", "properties": {"cmd": {"type": "string"}}}},
         {"name": "read_file", "description": "Read a file", "input_schema": {"type": "object", "properties": {}}}]
TASK = "Fix the failing test in settings"


@pytest.fixture(scope="module")
def serve_overrides() -> dict:
    return {"turns": {"stream_ping_s": 0.01}, "limits": {"max_request_bytes": LIMIT}}


def bearer(name: str) -> dict:
    return {"Authorization": f"Bearer {KEYS[name]}", ARM_HEADER: "wide"}


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=120, headers=bearer("alice")) as c:
        yield c


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.get("/v1/models").json()["data"][0]["id"]


@pytest.fixture(scope="module")
def ac(server):
    anthropic = pytest.importorskip("anthropic")
    return anthropic.Anthropic(base_url=server.url, api_key=KEYS["alice"], max_retries=0,
                               default_headers={ARM_HEADER: "wide"})


def body(model: str, user: str, **extra) -> dict:
    return {"model": model, "max_tokens": 8, "temperature": 0.0, "metadata": {"user_id": user},
            "messages": [{"role": "user", "content": TASK}], **extra}


def sse(text: str) -> list[tuple[str, dict]]:
    """Server-sent events as (event, data), read as a raw consumer reads them."""
    out = []
    for frame in text.split("\n\n"):
        if not frame.strip() or frame.startswith(":"):  # an SSE comment (a keep-alive before message_start)
            continue
        lines = dict(line.split(": ", 1) for line in frame.split("\n"))
        data = json.loads(lines["data"])
        assert data["type"] == lines["event"], frame  # Anthropic's framing: the data names its event
        out.append((lines["event"], data))
    return out


# -- errors ----------------------------------------------------------------------------------------------


def test_each_status_has_anthropics_error_type_in_the_body_and_in_the_stream():
    """The table of the Messages API's error types, as this server writes them in a body and as an ``error``
    event of a stream (whose 200 is already sent): a 404 or 429 is not an ``invalid_request_error``, nor a 503
    an ``api_error``."""
    documented = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                  404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
                  503: "overloaded_error", 529: "overloaded_error"}
    writer = anthropic_proxy.MessagesEvents("m", lambda turn: {})
    for status, kind in documented.items():
        sent, body_ = errors.body(errors.ANTHROPIC, status, "why")
        assert (sent, body_) == (status, {"type": "error", "error": {"type": kind, "message": "why"}})
        ((event, data),) = sse("".join(writer.error(status, "why")))
        assert event == "error" and data["error"] == {"type": kind, "message": "why"}
    # the API sends neither 409 nor 422: a rewritten history or an unservable size is its 400
    assert errors.body(errors.ANTHROPIC, 409, "x")[0] == errors.body(errors.ANTHROPIC, 422, "x")[0] == 400


def test_the_live_errors_of_the_messages_routes_are_anthropics(server, client, model):
    cases = {
        400: client.post("/v1/messages", json={**body(model, "err-1"), "messages": []}),
        401: httpx.post(f"{server.url}/v1/messages", json=body(model, "err-1")),
        404: client.post("/v1/messages", json=body("claude-sonnet-4-5", "err-1")),
        # this app's limit (64 KiB, the default is 8 MiB) reaches the replica that serves: ``serve.ingress`` serves
        # a pickled copy of the app, and a limit kept on the module's ``app.state`` never did
        413: client.post("/v1/messages", content=b" " * (LIMIT + 1), headers={"content-type": "application/json"}),
    }
    for status, r in cases.items():
        assert r.status_code == status, (status, r.text)
        assert error_message(r)  # Anthropic's shape, its type the documented one for the status
        assert r.json()["error"]["type"] == errors.ANTHROPIC_TYPES[status]
    r = client.post("/v1/messages/nope", json={})  # an unknown route of the Messages API: its 404
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"

    def chunks():  # no Content-Length: the limit counts the bytes as the route reads them
        for _ in range(LIMIT // 4096 + 2):
            yield b" " * 4096

    r = client.post("/v1/messages", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large", r.text
    # a rewritten history is the API's 400, not a 409
    first = {**body(model, "err-2"), "messages": [{"role": "user", "content": TASK},
                                                   {"role": "assistant", "content": "ls"},
                                                   {"role": "user", "content": "a.py"}]}
    assert client.post("/v1/messages", json=first).status_code == 200
    first["messages"][1]["content"] = "rm -rf /"
    r = client.post("/v1/messages", json=first)
    assert r.status_code == 400 and "rewrites recorded step" in error_message(r)


def test_the_anthropic_client_reads_each_error_as_its_own_class(server, ac, model):
    anthropic = pytest.importorskip("anthropic")
    with pytest.raises(anthropic.NotFoundError) as e:
        ac.messages.create(model="claude-sonnet-4-5", max_tokens=4, messages=[{"role": "user", "content": TASK}])
    assert e.value.body["error"]["type"] == "not_found_error" and model in e.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as e:
        ac.messages.create(model=model, max_tokens=4, messages=[{"role": "user", "content": "  "}])
    assert e.value.body["error"]["message"].startswith("messages[0].content")
    stranger = anthropic.Anthropic(base_url=server.url, api_key="not-a-key", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as e:
        stranger.messages.create(model=model, max_tokens=4, messages=[{"role": "user", "content": TASK}])
    assert e.value.body["error"]["type"] == "authentication_error"


def test_models_answers_each_client_in_its_own_api(server, client, ac, model):
    """``GET /v1/models`` is both APIs' route: an Anthropic client (``anthropic-version``) reads Anthropic's page,
    an OpenAI client OpenAI's list, and an error there comes in the asking client's shape."""
    page = ac.models.list()
    assert [m.id for m in page.data] == [model] and page.data[0].type == "model"
    assert client.get("/v1/models").json()["object"] == "list"
    r = httpx.get(f"{server.url}/v1/models", headers={"anthropic-version": "2023-06-01"})  # no key
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"


def test_the_openai_routes_answer_in_openais_error_shape(server, client, model):
    msgs = [{"role": "user", "content": TASK}]
    cases = [client.post("/v1/chat/completions", json={"messages": msgs}),  # no session named
             client.post("/v1/chat/completions", json={"messages": msgs, "user": "oe-1", "model": "gpt-4o"}),
             client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": TASK, "name": "bo"}],
                                                       "user": "oe-1"}),
             httpx.get(f"{server.url}/v1/models"),
             client.post("/v1/completions", json={"prompt": ""})]
    assert [r.status_code for r in cases] == [400, 404, 400, 401, 400], [r.text for r in cases]
    messages = [error_message(r) for r in cases]  # each OpenAI's {message, type, param, code}
    assert cases[1].json()["error"]["code"] == "model_not_found"
    assert cases[2].json()["error"]["param"] == "messages[0].name" and "name" in messages[2]
    assert cases[3].json()["error"]["code"] == "invalid_api_key"
    r = client.post("/v1/sessions/nobody/turn", json={})  # Palimpsest's own routes keep their one-line body
    assert r.status_code == 404 and isinstance(r.json()["error"], str)


# -- stop sequences, usage, the event order ----------------------------------------------------------------


def test_a_stop_sequence_is_reported_with_the_string_it_matched(client, ac, model):
    """Greedy replies are the same for the same prompt: the first reply's text names a character the second,
    given it as a stop sequence, must stop at."""
    task = {"role": "user", "content": TASK}
    free = client.post("/v1/messages", json={**body(model, "stop-0"), "max_tokens": 24})
    assert free.status_code == 200, free.text
    text = "".join(b["text"] for b in free.json()["content"] if b["type"] == "text")
    assert len(text) >= 3, text
    stop = text[1:3]  # where vLLM first matches it, the reply ends (it may be at the very start)
    cut = text[:text.index(stop)]
    r = client.post("/v1/messages", json={**body(model, "stop-1"), "messages": [task], "max_tokens": 24,
                                          "stop_sequences": [stop]})
    reply = r.json()
    assert (reply["stop_reason"], reply["stop_sequence"]) == ("stop_sequence", stop), reply
    assert "".join(b["text"] for b in reply["content"] if b["type"] == "text") == cut
    # streamed: the message_delta carries it
    r = client.post("/v1/messages", json={**body(model, "stop-2"), "messages": [task], "max_tokens": 24,
                                          "stop_sequences": [stop], "stream": True})
    delta = next(d for e, d in sse(r.text) if e == "message_delta")
    assert delta["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": stop}
    # and through the client
    msg = ac.messages.create(model=model, max_tokens=24, messages=[task], metadata={"user_id": "stop-3"},
                             stop_sequences=[stop], extra_body={"temperature": 0.0})
    assert (msg.stop_reason, msg.stop_sequence) == ("stop_sequence", stop)
    # no stop sequence matched: end_turn or max_tokens, and stop_sequence null
    assert free.json()["stop_reason"] in ("end_turn", "max_tokens") and free.json()["stop_sequence"] is None


def test_a_stream_is_in_the_documented_order_with_real_usage_at_its_start_and_pings(server, client, model):
    r = client.post("/v1/messages", json={**body(model, "order-1"), "max_tokens": 400, "tools": TOOLS,
                                          "tool_choice": {"type": "tool", "name": "run_shell"}, "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"), r.text
    events = sse(r.text)
    names = [e for e, _ in events]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"], names
    assert "ping" in names, names  # 10 ms between events is far less than a prefill here
    blocks = [e for e in names if e != "ping"][1:-2]
    # every content block: start, deltas, stop, the indexes counting up from 0
    k, index = 0, 0
    while k < len(blocks):
        assert blocks[k] == "content_block_start", blocks
        k += 1
        while blocks[k] == "content_block_delta":
            k += 1
        assert blocks[k] == "content_block_stop", blocks
        k += 1
        index += 1
    starts = [d for e, d in events if e == "content_block_start"]
    assert [d["index"] for d in starts] == list(range(index))
    use = next(d for d in starts if d["content_block"]["type"] == "tool_use")
    partial = "".join(d["delta"]["partial_json"] for e, d in events if e == "content_block_delta"
                      and d["index"] == use["index"])
    assert use["content_block"]["name"] == "run_shell" and isinstance(json.loads(partial), dict)
    # message_start's usage is the compiled prompt's size: what the turn's generation was sent
    usage = events[0][1]["message"]["usage"]
    row = [x for x in Ledger(server.cfg.ledger).served() if x["session_id"] == "alice::order-1"][-1]
    assert usage["input_tokens"] > 0 and usage["output_tokens"] == 0
    assert usage["input_tokens"] + usage["cache_read_input_tokens"] == row["tokens_prompt"]
    final = next(d for e, d in events if e == "message_delta")
    assert final["delta"]["stop_reason"] == "tool_use" and final["usage"]["output_tokens"] >= 1


# -- tools ---------------------------------------------------------------------------------------------------


def test_several_tool_results_in_one_message_as_blocks_and_with_is_error_are_each_recorded(client, model):
    messages = [
        {"role": "user", "content": TASK},
        {"role": "assistant", "content": [
            {"type": "text", "text": "Two looks."},
            {"type": "tool_use", "id": "toolu_a", "name": "run_shell", "input": {"cmd": "ls"}},
            {"type": "tool_use", "id": "toolu_b", "name": "read_file", "input": {}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_a",
             "content": [{"type": "text", "text": "a.py"}, {"type": "text", "text": "b.py"}]},
            {"type": "tool_result", "tool_use_id": "toolu_b", "content": "no such file", "is_error": True}]}]
    r = client.post("/v1/messages", json={**body(model, "tr-1"), "messages": messages, "tools": TOOLS})
    assert r.status_code == 200, r.text
    (step,) = client.get("/v1/sessions/tr-1/steps").json()["steps"]
    assert [c["id"] for c in step["tool_calls"]] == ["toolu_a", "toolu_b"]
    assert [(x["tool_call_id"], x["content"]) for x in step["results"]] == [
        ("toolu_a", "a.py\nb.py"), ("toolu_b", "(the tool reported an error)\nno such file")]


def test_tool_choice_any_none_and_a_named_tool(server, ac, model):
    base = {"model": model, "max_tokens": 8, "messages": [{"role": "user", "content": TASK}],
            "extra_body": {"temperature": 0.0}}
    named = ac.messages.create(**{**base, "max_tokens": 400}, tools=TOOLS, metadata={"user_id": "tc-tool"},
                               tool_choice={"type": "tool", "name": "run_shell"})
    assert named.stop_reason == "tool_use", named.content
    assert [b.name for b in named.content if b.type == "tool_use"] == ["run_shell"], named.content
    # any: a tool must be called. vLLM's constraint for it fixes the call's form and name and leaves the arguments
    # free, where this random actor writes a number that never ends: the call is forced, and cut by max_tokens
    anyone = ac.messages.create(**{**base, "max_tokens": 64}, tools=TOOLS[:1], metadata={"user_id": "tc-any"},
                                tool_choice={"type": "any"})
    uses = [b.name for b in anyone.content if b.type == "tool_use"]
    forced = anyone.content and anyone.content[0].type == "text" and anyone.content[0].text.startswith(
        '<tool_call>{"name": "run_shell"')
    assert (anyone.stop_reason, uses) == ("tool_use", ["run_shell"]) or (anyone.stop_reason == "max_tokens"
                                                                          and forced), anyone.content
    none = ac.messages.create(**base, tools=TOOLS, metadata={"user_id": "tc-none"}, tool_choice={"type": "none"})
    assert none.stop_reason != "tool_use" and all(b.type == "text" for b in none.content)
    # each choice reached the turn as vLLM's conversion gives it, and is recorded with it
    chosen = {r["session_id"]: r.get("tool_choice") for r in Ledger(server.cfg.ledger).served()}
    assert json.loads(chosen["alice::tc-none"]) == "none" and json.loads(chosen["alice::tc-any"]) == "required"
    assert json.loads(chosen["alice::tc-tool"]) == {"type": "function", "function": {"name": "run_shell"}}


# -- what the prompt holds, and what is refused ------------------------------------------------------------


def test_a_system_of_several_blocks_reaches_the_prompt_as_paragraphs(server, client, model):
    system = [{"type": "text", "text": "You are A."}, {"type": "text", "text": "Be brief.",
                                                       "cache_control": {"type": "ephemeral"}}]
    r = client.post("/v1/messages", json={**body(model, "sys-1"), "system": system})
    assert r.status_code == 200, r.text
    session = Ledger(server.cfg.ledger).session("alice::sys-1")
    assert session.system == "You are A.\n\nBe brief."
    assert prefix_messages(session)[0]["content"].startswith("You are A.\n\nBe brief.\n\n")  # what the actor reads


def test_what_would_be_dropped_silently_is_refused_by_name_and_nothing_is_recorded(client, model):
    bad = [({"metadata": {"user_id": "drop-1", "team": "x"}}, "metadata.team"),
           ({"tool_choice": {"type": "auto"}}, "tool_choice"),
           ({"messages": [{"role": "user", "content": [{"type": "text", "text": ""}]}]}, "messages[0].content[0].text"),
           ({"messages": [{"role": "user", "content": ""}]}, "messages[0].content"),
           ({"messages": [{"role": "user", "content": [{"type": "text", "text": " \n"}]}]},
            "messages[0].content[0].text"),
           ({"temperature": 1.5}, "temperature"),
           ({"messages": [{"role": "user", "content": TASK}, {"role": "assistant", "content": []},
                          {"role": "user", "content": "go"}]}, "messages[1].content")]
    for patch, field in bad:
        r = client.post("/v1/messages", json={**body(model, "drop-1"), **patch})
        assert r.status_code == 400 and error_message(r).startswith(field), (patch, r.text)
    assert client.get("/v1/sessions/drop-1/steps").status_code == 404


def test_count_tokens_counts_what_a_turn_sends_for_the_whole_history(server, client, model):
    """``input_tokens`` is the whole history as a served turn renders it (Palimpsest's prefix, the tools, every
    step): a turn at a budget that holds it all sends exactly that many ids."""
    messages = [{"role": "user", "content": TASK},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "run_shell",
                                                   "input": {"cmd": "ls"}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "a.py"}]}]
    req = {"model": model, "messages": messages, "tools": TOOLS, "metadata": {"user_id": "count-1"}}
    counted = client.post("/v1/messages/count_tokens", json=req).json()
    assert counted["input_tokens"] > counted["palimpsest"]["messages_tokens"] > 0  # the prefix costs ids
    assert client.get("/v1/sessions/count-1/steps").status_code == 404  # nothing recorded
    r = client.post("/v1/messages", json={**req, "max_tokens": 2, "temperature": 0.0})
    assert r.status_code == 200, r.text
    row = [x for x in Ledger(server.cfg.ledger).served() if x["session_id"] == "alice::count-1"][-1]
    assert row["tokens_prompt"] == counted["input_tokens"] <= counted["palimpsest"]["budget"]
