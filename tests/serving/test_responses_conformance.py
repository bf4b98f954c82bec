"""The Responses API as its clients read it: the live app driven with raw HTTP, raw server-sent events and the
``openai`` client's ``responses.create`` (streamed and not, with tools and a ``function_call_output`` history),
``previous_response_id`` resolved from the ledger, the window on ``/v1/models``, and errors in OpenAI's shape
(an unknown route included). One app for the module."""

from __future__ import annotations

import json

import httpx
import pytest

from palimpsest.platform import Ledger
from palimpsest.serving.http.server import ARM_HEADER
from tests.helpers import error_message
from tests.serving.conftest import KEYS

pytestmark = [pytest.mark.slow, pytest.mark.ray, pytest.mark.vllm]

TOOLS = [{"type": "function", "name": "run_shell", "description": "Run a shell command",
          "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}}}]


CAROL = "carol-secret-key"  # a tenant whose sessions are pinned: compaction off, its own budget


@pytest.fixture(scope="module")
def serve_overrides() -> dict:
    import hashlib

    from tests.serving.conftest import tiny_config

    tenants = tiny_config("x", "x", "x")["auth"]["tenants"]
    carol = {"key_sha256": hashlib.sha256(CAROL.encode()).hexdigest(), "compaction": "off", "budget": 1500}
    return {"auth": {"tenants": {**tenants, "carol": carol}}}


@pytest.fixture(scope="module")
def client(server):
    headers = {"Authorization": f"Bearer {KEYS['alice']}", ARM_HEADER: "wide"}
    with httpx.Client(base_url=server.url, timeout=120, headers=headers) as c:
        yield c


@pytest.fixture(scope="module")
def oc(server):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEYS["alice"], max_retries=0,
                         default_headers={ARM_HEADER: "wide"})


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.get("/v1/models").json()["data"][0]["id"]


def events(text: str) -> list[tuple[str, dict]]:
    out = []
    for frame in text.split("\n\n"):
        if not frame.strip() or frame.startswith(":"):
            continue
        lines = dict(line.split(": ", 1) for line in frame.split("\n"))
        data = json.loads(lines["data"])
        assert data["type"] == lines["event"], frame
        out.append((lines["event"], data))
    return out


def served(server, session: str) -> list[dict]:
    return [r for r in Ledger(server.cfg.ledger).served() if r["session_id"] == f"alice::{session}"]


def test_a_response_object_as_the_openai_types_read_it(server, client, model):
    from openai.types.responses import Response

    r = client.post("/v1/responses", json={"model": model, "input": "Fix the failing test", "user": "resp-1",
                                           "max_output_tokens": 6, "temperature": 0.0, "metadata": {"k": "v"},
                                           "reasoning": {"effort": "low"}})
    assert r.status_code == 200, r.text
    body = r.json()
    resp = Response.model_validate(body)
    assert resp.status in ("completed", "incomplete") and resp.object == "response"
    assert resp.usage.input_tokens > 0 and resp.usage.input_tokens_details.cached_tokens >= 0
    assert resp.usage.total_tokens == resp.usage.input_tokens + resp.usage.output_tokens
    if resp.status == "incomplete":
        assert resp.incomplete_details.reason == "max_output_tokens"
    assert body["palimpsest"]["session_id"] == "resp-1" and resp.metadata == {"k": "v"}
    (row,) = served(server, "resp-1")
    assert row["tokens_prompt_total"] == resp.usage.input_tokens  # usage is the turn's own count
    assert json.loads(row["requested_metadata"]) == {"k": "v"}
    assert json.loads(row["requested_reasoning"]) == {"effort": "low"}


def test_the_stream_is_the_documented_event_sequence(server, client, model):
    r = client.post("/v1/responses", json={"model": model, "input": "Say hi", "user": "resp-2", "stream": True,
                                           "max_output_tokens": 6, "temperature": 0.0})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"), r.text
    evs = events(r.text)
    names = [n for n, _ in evs]
    assert [d["sequence_number"] for _, d in evs] == list(range(len(evs)))
    assert names[:2] == ["response.created", "response.in_progress"]
    assert names[-1] in ("response.completed", "response.incomplete")
    final = evs[-1][1]["response"]
    text = "".join(d["delta"] for n, d in evs if n == "response.output_text.delta")
    if text:
        assert names[2:4] == ["response.output_item.added", "response.content_part.added"]
        assert names[-4:-1] == ["response.output_text.done", "response.content_part.done",
                                "response.output_item.done"]
        assert evs[-2][1]["item"]["content"][0]["text"] == text == final["output"][0]["content"][0]["text"]
        assert evs[2][1]["item"]["id"] == final["output"][0]["id"]
    else:  # no text: nothing was opened, and the response holds no message
        assert names[2:-1] == [] and final["output"] == []
    assert final["usage"]["input_tokens"] > 0 and final["id"] == evs[0][1]["response"]["id"]


def test_the_openai_client_with_tools_and_a_function_call_output_history(server, client, oc, model):
    history = [{"role": "user", "content": "Fix the failing test"},
               {"type": "function_call", "call_id": "call_1", "name": "run_shell", "arguments": "{\"cmd\": \"ls\"}"},
               {"type": "function_call_output", "call_id": "call_1", "output": "a.py b.py"}]
    resp = oc.responses.create(model=model, input=history, tools=TOOLS, user="resp-3", max_output_tokens=6,
                               temperature=0.0)
    assert resp.status in ("completed", "incomplete") and resp.usage.input_tokens > 0
    (step,) = client.get("/v1/sessions/resp-3/steps").json()["steps"]
    assert [c["id"] for c in step["tool_calls"]] == ["call_1"]
    assert [(x["tool_call_id"], x["content"]) for x in step["results"]] == [("call_1", "a.py b.py")]
    # a forced call comes back as a function_call item. vLLM's constraint fixes the call's form and name and leaves
    # the arguments free, where this random actor may write a value that never ends: then the forced call is cut
    # by max_output_tokens and stays text (the writer's function-call events: test_responses_protocol)
    forced = oc.responses.create(model=model, input="Fix the failing test in settings", tools=TOOLS, user="resp-4",
                                 max_output_tokens=400, temperature=0.0,
                                 tool_choice={"type": "function", "name": "run_shell"})
    calls = [o for o in forced.output if o.type == "function_call"]
    if calls:
        assert [c.name for c in calls] == ["run_shell"] and calls[0].call_id
    else:
        assert forced.status == "incomplete" and forced.output_text.startswith('<tool_call>{"name": "run_shell"')
    streamed = list(oc.responses.create(model=model, input="Fix the failing test in settings", tools=TOOLS,
                                        user="resp-5", max_output_tokens=400, temperature=0.0, stream=True,
                                        tool_choice={"type": "function", "name": "run_shell"}))
    kinds, final = [e.type for e in streamed], streamed[-1].response
    assert kinds[0] == "response.created" and kinds[-1] in ("response.completed", "response.incomplete")
    assert [o.name for o in final.output if o.type == "function_call"] == [c.name for c in calls]
    assert ("response.function_call_arguments.done" in kinds) == bool(calls)


def test_previous_response_id_resolves_the_conversation_from_the_ledger(server, client, oc, model):
    first = oc.responses.create(model=model, input="Fix the failing test", user="resp-6", max_output_tokens=4,
                                temperature=0.0)
    second = oc.responses.create(model=model, input="And now the docs", previous_response_id=first.id,
                                 max_output_tokens=4, temperature=0.0)
    assert second.previous_response_id == first.id
    steps = client.get("/v1/sessions/resp-6/steps").json()["steps"]  # the same session, one step more
    assert len(steps) == 1 and steps[0]["observation"] == "And now the docs"
    assert steps[0]["action"] == (first.output_text or "")
    third = oc.responses.create(model=model, input="Then commit", previous_response_id=second.id,
                                max_output_tokens=4, temperature=0.0)
    assert len(client.get("/v1/sessions/resp-6/steps").json()["steps"]) == 2 and third.status
    # not stored: nothing to resolve later
    unstored = client.post("/v1/responses", json={"model": model, "input": "x", "user": "resp-7", "store": False,
                                                  "max_output_tokens": 2})
    r = client.post("/v1/responses", json={"model": model, "input": "y", "max_output_tokens": 2,
                                           "previous_response_id": unstored.json()["id"]})
    assert r.status_code == 400 and error_message(r).startswith("previous_response_id")
    assert r.json()["error"]["param"] == "previous_response_id"
    # another tenant cannot continue alice's conversation
    bob = client.post("/v1/responses", headers={"Authorization": f"Bearer {KEYS['bob']}"},
                      json={"model": model, "input": "y", "previous_response_id": first.id, "max_output_tokens": 2})
    assert bob.status_code == 400, bob.text


def test_errors_in_openais_shape_and_unknown_routes(server, client, model):
    r = client.post("/v1/responses", json={"model": model, "input": "x", "frequency_penalty": 1})
    assert r.status_code == 400 and error_message(r).startswith("frequency_penalty")
    assert r.json()["error"]["param"] == "frequency_penalty"
    r = client.post("/v1/responses", json={"model": "other", "input": "x"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = client.post("/v1/responses", json={"model": model, "input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": "data:,"}]}]})
    assert r.status_code == 400 and error_message(r).startswith("input[0].content[0]")
    r = client.get("/v1/nope")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found", r.text
    r = client.post("/v1/nope", headers={"anthropic-version": "2023-06-01"}, json={})
    assert r.status_code == 404 and r.json()["type"] == "error" and r.json()["error"]["type"] == "not_found_error"


def test_models_report_the_window(server, client, model):
    cfg = server.cfg
    (m,) = client.get("/v1/models").json()["data"]
    assert m["max_model_len"] == cfg.actor.max_model_len
    window = m["palimpsest"]
    arm = max(cfg.arms, key=lambda a: a.weight)
    assert window["budget"] == (arm.budget or cfg.budget) and window["arm"] == arm.name
    assert window["compaction"]["high_tokens"] == int(arm.policy_config().compaction.high * window["budget"])
    assert window["compaction"]["low_tokens"] < window["compaction"]["high_tokens"]
    (a,) = client.get("/v1/models", headers={"anthropic-version": "2023-06-01"}).json()["data"]
    assert a["max_input_tokens"] == cfg.actor.max_model_len - cfg.actor.max_tokens
    assert a["max_tokens"] == cfg.actor.max_tokens


def test_a_clear_tool_uses_edit_is_honoured_by_the_compaction_and_reported(server, client, model):
    """A Messages request with ``clear_tool_uses_20250919``: the compiled prompt (the audited plan) keeps the
    excluded tool's step in full while the budget degrades the others, and the response says what was cleared."""
    tools = [{"name": "run_shell", "input_schema": {"type": "object"}},
             {"name": "read_file", "input_schema": {"type": "object"}}]
    messages = [{"role": "user", "content": "Fix the failing test"}]
    for k in range(6):
        name = "read_file" if k == 1 else "run_shell"
        messages += [{"role": "assistant", "content": [{"type": "tool_use", "id": f"t{k}", "name": name,
                                                        "input": {"arg": f"step {k}"}}]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"t{k}",
                                                   "content": f"output {k} " + "x" * 200}]}]
    edit = {"type": "clear_tool_uses_20250919", "trigger": {"type": "input_tokens", "value": 1200},
            "keep": {"type": "tool_uses", "value": 2}, "exclude_tools": ["read_file"], "clear_tool_inputs": True}
    control = client.post("/v1/messages", headers={"anthropic-version": "2023-06-01"},
                          json={"model": model, "max_tokens": 4, "temperature": 0.0, "tools": tools,
                                "messages": messages, "metadata": {"user_id": "edit-0"}})
    assert control.status_code == 200 and "context_management" not in control.json()
    plain = [p["resolution"] for p in client.get("/v1/sessions/edit-0/audit", params={"plans": True}).json()[
        "turns"][-1]["plan"]]
    assert plain[1] != "full", plain  # without the edit the budget degrades the read_file step
    r = client.post("/v1/messages", headers={"anthropic-version": "2023-06-01"},
                    json={"model": model, "max_tokens": 4, "temperature": 0.0, "tools": tools, "messages": messages,
                          "metadata": {"user_id": "edit-1"}, "context_management": {"edits": [edit]}})
    # a clear_tool_uses edit without clear_tool_inputs (false: inputs kept verbatim) is refused by name
    r0 = client.post("/v1/messages", headers={"anthropic-version": "2023-06-01"},
                     json={"model": model, "max_tokens": 4, "tools": tools, "messages": messages,
                           "metadata": {"user_id": "edit-3"}, "context_management": {"edits": [
                               {k: v for k, v in edit.items() if k != "clear_tool_inputs"}]}})
    assert r0.status_code == 400 and error_message(r0).startswith("context_management.edits[0].clear_tool_inputs")
    assert r.status_code == 200, r.text
    (applied,) = r.json()["context_management"]["applied_edits"]
    assert applied["type"] == "clear_tool_uses_20250919" and applied["cleared_tool_uses"] >= 1
    assert applied["cleared_input_tokens"] > 0
    plan = client.get("/v1/sessions/edit-1/audit", params={"plans": True}).json()["turns"][-1]["plan"]
    levels = [p["resolution"] for p in plan]
    assert levels[1] == "full" and levels[-2:] == ["full"] * 2  # the excluded tool's step, the 2 kept uses
    assert sum(level != "full" for level in levels) == applied["cleared_tool_uses"]  # one call per step here
    row = served(server, "edit-1")[-1]
    assert json.loads(row["requested_context_management"])["edits"][0]["type"] == "clear_tool_uses_20250919"
    # asked for literally (the header), the edit is the clear_tool_uses policy: inputs kept, results cleared
    # (short results: the whole history fits the budget, so only the rule clears anything)
    short = [m if m["role"] == "assistant" or isinstance(m["content"], str) else
             {"role": "user", "content": [{**m["content"][0], "content": m["content"][0]["content"][:12]}]}
             for m in messages]
    lit = client.post("/v1/messages", headers={"anthropic-version": "2023-06-01",
                                               "x-palimpsest-context-edits": "literal"},
                      json={"model": model, "max_tokens": 4, "temperature": 0.0, "tools": tools, "messages": short,
                            "metadata": {"user_id": "edit-4"}, "context_management": {"edits": [
                                {"type": "clear_tool_uses_20250919", "trigger": {"type": "input_tokens", "value": 100},
                                 "keep": {"type": "tool_uses", "value": 2}, "exclude_tools": ["read_file"]}]}})
    assert lit.status_code == 200, lit.text
    (turn,) = client.get("/v1/sessions/edit-4/audit", params={"plans": True}).json()["turns"]
    assert turn["policy"] == "clear_tool_uses" and all(p["resolution"] == "full" for p in turn["plan"])
    (done,) = lit.json()["context_management"]["applied_edits"]
    assert done["cleared_tool_uses"] == 3  # 6 uses: the read_file one excluded, the latest 2 kept
    # an edit the gateway cannot honour is refused by name, and nothing is recorded
    r = client.post("/v1/messages", headers={"anthropic-version": "2023-06-01"},
                    json={"model": model, "max_tokens": 4, "messages": messages[:1], "metadata": {"user_id": "edit-2"},
                          "context_management": {"edits": [{"type": "compact_20260112"}]}})
    assert r.status_code == 400 and error_message(r).startswith("context_management.edits[0]")
    assert client.get("/v1/sessions/edit-2/steps").status_code == 404


def test_a_tenants_pin_serves_its_sessions_and_is_recorded_per_turn(server, client, model):
    from palimpsest.platform.policies import parse_policy_config
    from palimpsest.serving.http.tenancy import OFF

    r = client.post("/v1/responses", headers={"Authorization": f"Bearer {CAROL}"},
                    json={"model": model, "input": "Fix the failing test", "user": "pin-1", "max_output_tokens": 2})
    assert r.status_code == 200, r.text
    (row,) = [x for x in Ledger(server.cfg.ledger).served() if x["session_id"] == "carol::pin-1"]
    assert row["policy_hash"] == parse_policy_config(OFF).config_hash() and row["budget"] == 1500
    assert json.loads(row["tenant_pin"]) == {"tenant": "carol", "budget": 1500, "compaction": "off",
                                             "policy": parse_policy_config(OFF).config_hash()}
    (turn,) = Ledger(server.cfg.ledger).audit("carol::pin-1")
    assert turn["policy"] == "full"
    # alice's sessions keep their arm's policy
    assert client.post("/v1/responses", json={"model": model, "input": "Fix the failing test", "user": "pin-2",
                                              "max_output_tokens": 2}).status_code == 200
    alice = served(server, "pin-2")[0]
    assert "tenant_pin" not in alice and alice["policy_hash"] != row["policy_hash"]


def test_a_responses_compaction_threshold_sets_the_turns_boundary(server, client, model):
    history = [{"role": "user", "content": "Fix the failing test"}]
    for k in range(5):
        history += [{"type": "function_call", "call_id": f"c{k}", "name": "run_shell", "arguments": "{}"},
                    {"type": "function_call_output", "call_id": f"c{k}", "output": f"out {k} " + "y" * 300}]
    r = client.post("/v1/responses", json={"model": model, "input": history, "tools": TOOLS, "user": "cmp-1",
                                           "max_output_tokens": 2, "temperature": 0.0,
                                           "context_management": [{"type": "compaction", "compact_threshold": 1500}]})
    assert r.status_code == 200, r.text
    applied = r.json()["palimpsest"]["context_management"]
    assert applied["type"] == "compaction" and applied["high_tokens"] == 1500  # the boundary falls at the threshold
    assert applied["applied"]  # the session's first turn is a boundary
    plan = client.get("/v1/sessions/cmp-1/audit", params={"plans": True}).json()["turns"][-1]["plan"]
    assert sum(p["resolution"] != "full" for p in plan) == applied["cleared_tool_uses"] >= 1
    assert r.json()["usage"]["input_tokens"] <= 1500  # the compiled prompt stayed under the trigger
    row = served(server, "cmp-1")[-1]
    assert row["policy_hash"] != server.cfg.arm("wide").policy_config().config_hash()  # its own epoch chain
