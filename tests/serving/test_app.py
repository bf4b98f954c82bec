"""End to end over HTTP on 127.0.0.1: the composed Serve app with a tiny vLLM actor and a memory bundle."""

from __future__ import annotations

import base64
import json
import time

import httpx
import pytest
import torch

from palimpsest.platform import Ledger
from palimpsest.serving.http.server import ARM_HEADER
from palimpsest.serving.models.embeds import encode_embeds
from palimpsest.serving.turn.router import Router
from tests.helpers import error_message
from tests.serving.conftest import KEYS, tiny_config

pytestmark = [pytest.mark.slow, pytest.mark.ray, pytest.mark.vllm]

OBS = "def parse_config(env): return env['database_url']\nsettings/loader.py:12: KeyError"


def bearer(tenant: str) -> dict:
    return {"Authorization": f"Bearer {KEYS[tenant]}"}


@pytest.fixture(scope="module")
def shadow_rate() -> float:
    return 1.0  # every turn of this module's app is scored for shadow fidelity


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=120, headers=bearer("alice")) as c:
        yield c


@pytest.fixture(scope="module")
def bob(server):
    with httpx.Client(base_url=server.url, timeout=120, headers=bearer("bob")) as c:
        yield c


def new_session(client, sid, arm=None, steps=0):
    r = client.post("/v1/sessions", json={"session_id": sid, "task": "Fix the failing test in settings",
                                          **({"arm": arm} if arm else {})})
    assert r.status_code == 200, r.text
    created = r.json()
    for t in range(steps):
        r = client.post(f"/v1/sessions/{sid}/steps", json={"kind": "bash",
                                                          "action": f"grep -n parse_config settings/loader.py # {t}",
                                                          "observation": OBS, "tool": "bash"})
        assert r.status_code == 200, r.text
    return created


def test_a_turn_with_soft_memory_goes_through_prompt_embeds(client):
    new_session(client, "mem-1", arm="pace+memory", steps=9)
    new_session(client, "txt-1", arm="pace", steps=9)
    with_memory = client.post("/v1/sessions/mem-1/turn", json={"max_tokens": 4}).json()
    text_only = client.post("/v1/sessions/txt-1/turn", json={"max_tokens": 4}).json()
    assert with_memory["arm"] == "pace+memory" and text_only["arm"] == "pace"
    assert with_memory["tokens"]["soft"] > 0 and text_only["tokens"]["soft"] == 0
    # Same history, same plan: the memory arm's actor input is longer by the soft span (the two sessions'
    # ledger-wide step ids differ in their digits, so the texts differ by a few tokens).
    assert abs(with_memory["tokens"]["prompt"] - with_memory["tokens"]["soft"] - text_only["tokens"]["prompt"]) <= 9
    assert with_memory["latency_ms"]["memory"] > 0
    again = client.post("/v1/sessions/mem-1/turn", json={"max_tokens": 4}).json()
    assert again["tokens"]["soft"] == with_memory["tokens"]["soft"]  # the same boundary: served from the cache
    audit = client.get("/v1/sessions/mem-1/audit").json()["turns"]
    assert [t["t"] for t in audit] == [9, 9]
    # An arm with its own memory model (here the same bundle, loaded under the arm's name).
    new_session(client, "mem-b", arm="memory-b", steps=9)
    own = client.post("/v1/sessions/mem-b/turn", json={"max_tokens": 4}).json()
    assert own["arm"] == "memory-b" and own["tokens"]["soft"] == with_memory["tokens"]["soft"]


def test_sampled_turns_are_scored_for_shadow_fidelity_off_the_turn_path(server, client):
    """Every turn is sampled here (ab.shadow_rate = 1): the lane scores each served prompt against the reference
    after the turn returned, and records it (identical to its reference, or why it was skipped) under the arm
    that served it."""
    new_session(client, "shadow-1", arm="pace", steps=6)
    new_session(client, "shadow-m", arm="pace+memory", steps=6)
    for sid in ("shadow-1", "shadow-m"):
        for _ in range(2):
            assert client.post(f"/v1/sessions/{sid}/turn", json={"max_tokens": 4}).status_code == 200
    state = client.get("/v1/ab/shadow", params={"wait_s": 120}).json()
    assert state["drained"] and state["sampled"] >= 4 and state["scored"] >= 2
    assert state["scored"] + state["identical"] + state["skipped"] == state["sampled"]
    rows = Ledger(server.cfg.ledger).shadows()
    text = [r for r in rows if r["session_id"] == "alice::shadow-1"]
    assert len(text) == 2 and {r["arm"] for r in text} == {"pace"}
    for r in text:  # short histories fit the window: the reference is the whole history
        assert r["status"] in ("scored", "identical") and r["reference"] == "full" and r["tokens"] >= 1
        assert (r["kl"] is None) == (r["status"] == "identical")
        if r["status"] == "scored":
            assert 0 <= r["top1"] <= 1
    # a soft span is never the reference: always scored, and a (random) memory moves the distribution
    memory = [r for r in rows if r["session_id"] == "alice::shadow-m"]
    assert len(memory) == 2 and all(r["status"] == "scored" and r["kl"] > 1e-6 for r in memory), memory
    assert client.get("/readyz").json()["shadow"]["rate"] == 1.0


def test_paired_traffic_runs_every_trajectory_once_per_arm_and_the_report_pairs_them(server, tmp_path):
    from palimpsest.experiments.ab_report import ab_summary, summary_markdown
    from palimpsest.experiments.live import drive
    from tests.pipelines.test_replay import traj

    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(json.dumps(traj(f"tr{i}", n=8)) for i in range(3)) + "\n")
    res = drive(server.url, data, prefix="pair/", every=3, first=3, max_tokens=3, max_turns=1, concurrency=2,
                arms=["pace", "wide"], headers=bearer("alice"))
    assert not res.errors and sorted(res.sessions) == sorted(f"pair/tr{i}@{a}" for i in range(3)
                                                             for a in ("pace", "wide"))
    assert all(arm == sid.rsplit("@", 1)[1] for sid, arm in res.sessions.items())  # the arm named, not hashed
    with httpx.Client(base_url=server.url, timeout=200, headers=bearer("alice")) as c:
        assert c.get("/v1/ab/shadow", params={"wait_s": 180}).json()["drained"]
    led = Ledger(server.cfg.ledger)
    mine = lambda rows: [r for r in rows if r["session_id"].startswith("alice::pair/")]  # noqa: E731
    s = ab_summary(mine(led.served(res.started)), mine(led.outcomes(res.started)), ["pace", "wide"],
                   mine(led.shadows(res.started)))
    paired = s["paired"]["wide"]
    assert paired["outcome"]["n"] == 3 and paired["tokens_context"]["n"] == 3
    f = s["arms"]["wide"]["fidelity"]
    assert f["scored"] + f["identical"] + f["skipped"] == 3 and f["sampled"] == 3
    assert "Paired by trajectory" in summary_markdown(s)


def test_an_arm_serving_a_memory_otherwise_than_it_was_trained_is_warned_about(client, tiny_dir, tiny_memory, tmp_path):
    from palimpsest.platform.policies import parse_policy_config
    from palimpsest.platform.prompt.chat import MEMORY_READ_VERSION
    from palimpsest.serving.serve_config import parse_serve_config
    from palimpsest.serving.turn.replica import memory_warnings

    ready = client.get("/readyz").json()  # the test bundle records no policy config
    assert any("records no policy config" in w for w in ready["warnings"])
    cfg = parse_serve_config(tiny_config(tiny_dir, tiny_memory, tmp_path / "l.db"))
    pace = parse_policy_config("pace").config_hash()
    entry = {"enabled": True, "model": "m", "policy_hash": pace, "trained_budget": 900,
             "memory_read_version": MEMORY_READ_VERSION}
    assert memory_warnings(cfg, {"models": {"default": entry}}) == []  # trained as served: nothing to say
    other = {**entry, "policy_hash": parse_policy_config("ace").config_hash(), "memory_read_version": None,
             "trained_budget": 3072}
    warned = memory_warnings(cfg, {"models": {"default": other}})
    assert any("'pace+memory': its policy config" in w for w in warned)
    # what it reads of a turn is its bundle's, never the serve config's: nothing to reconcile, nothing to warn
    assert not any("memory_tokens" in w or "max_observation_chars" in w for w in warned)
    # what the memory reads changed (platform.prompt.chat.MEMORY_READ_VERSION): a model trained on another read, or
    # before the read was recorded (version 1), is warned about
    assert any(f"trained on version 1 of what the memory reads, served version {MEMORY_READ_VERSION}" in w
               for w in warned)
    assert any("'pace+memory': serves at budget 900, its memory was trained on prompts at 3072" in w for w in warned)


def test_glimpse_returns_the_raw_step_and_is_limited_per_turn(client):
    new_session(client, "gl-1", steps=3)
    other = new_session(client, "gl-2", steps=1)
    ids = [client.post("/v1/sessions/gl-1/steps",
                       json={"action": "cat a.py", "observation": f"line {i}"}).json()["step_id"]
           for i in range(1)]
    r = client.post("/v1/sessions/gl-1/glimpse", json={"step_id": ids[0]})
    assert r.status_code == 200 and "line 0" in r.json()["text"] and "cat a.py" in r.json()["text"]
    for _ in range(2):
        assert client.post("/v1/sessions/gl-1/glimpse", json={"step_id": ids[0]}).status_code == 200
    r = client.post("/v1/sessions/gl-1/glimpse", json={"step_id": ids[0]})
    assert r.status_code == 429 and "limit" in error_message(r)
    # Another session's step is not this session's to read.
    assert other["arm"] in ("pace", "pace+memory")
    r = client.post("/v1/sessions/gl-2/glimpse", json={"step_id": ids[0]})
    assert r.status_code == 404


def test_the_llm_elasticizer_arm_serves_turns(server, client):
    new_session(client, "ace-1", arm="ace-llm", steps=6)
    ledger = Ledger(server.cfg.ledger)
    deadline = time.time() + 120
    while ledger.pending("alice::ace-1", None)[0] and time.time() < deadline:  # abstractions are what ace reads
        time.sleep(0.5)
    r = client.post("/v1/sessions/ace-1/turn", json={"max_tokens": 2})
    assert r.status_code == 200, r.text
    assert r.json()["arm"] == "ace-llm" and r.json()["plan"]["full"] >= 1


def test_session_ids_with_slashes_route(client):
    new_session(client, "group/trajectory-1", steps=2)
    assert client.get("/v1/sessions/group/trajectory-1/audit").json()["session_id"] == "group/trajectory-1"


def test_ab_assignment_is_sticky_by_session_hash(client):
    router = Router(("pace", "pace+memory"), (1.0, 1.0))
    arms = {}
    for i in range(12):
        sid = f"ab-{i}"
        arms[sid] = new_session(client, sid)["arm"]
        assert arms[sid] == router.assign(f"alice::{sid}")  # the hash of the tenant's namespaced session id
    assert set(arms.values()) == {"pace", "pace+memory"}
    for sid, arm in arms.items():  # creating again (or from another replica) keeps the arm
        assert new_session(client, sid)["arm"] == arm
    r = client.post("/v1/sessions", json={"session_id": "ab-header", "task": "x"}, headers={"x-palimpsest-arm": "pace"})
    assert r.json()["arm"] == "pace"
    r = client.post("/v1/sessions/ab-0/outcome", json={"value": 1.0})
    assert r.status_code == 200 and r.json()["arm"] == arms["ab-0"]


def test_an_openai_client_gets_context_management_by_changing_its_base_url(server, client):
    openai = pytest.importorskip("openai")
    oc = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEYS["alice"])
    model = oc.models.list().data[0].id
    history = [{"role": "system", "content": "You are a careful agent."},
               {"role": "user", "content": "Fix the failing test in settings"}]
    for i in range(3):
        reply = oc.chat.completions.create(model=model, messages=history, max_tokens=4, user="oa-1")
        assert reply.choices[0].message.role == "assistant" and isinstance(reply.choices[0].message.content, str)
        history += [{"role": "assistant", "content": f"grep -n parse_config settings/loader.py # {i}"},
                    {"role": "tool", "content": OBS, "tool_call_id": f"c{i}"}]
    turns = client.get("/v1/sessions/oa-1/audit").json()["turns"]
    assert [t["t"] for t in turns] == [0, 1, 2]  # resending the history recorded each step once
    # usage as the OpenAI API reports it, with the prefix cache's share; the epoch prompt only grew, so the
    # actor's own cache held the previous turn's prompt (vLLM's count) and the served record says so too
    assert reply.usage.prompt_tokens_details is not None
    served = [r for r in Ledger(server.cfg.ledger).served() if r["session_id"].endswith("oa-1")]
    assert [r["compaction"] for r in served] == [False] * 3
    # the session's first turn: nothing of it is cached, every id is billed in full
    assert served[0]["prefix_reuse"] == 0.0 and served[0]["expected_cached"] == 0
    assert served[0]["billed"] == served[0]["uncached"] > 0
    assert all(r["prefix_reuse"] > 0.5 and r["uncached"] < r["tokens_context"] for r in served[1:])
    assert served[-1]["tokens_cached"] > 0 and reply.usage.prompt_tokens_details.cached_tokens > 0
    history[3] = {"role": "tool", "content": "something else", "tool_call_id": "c0"}
    with pytest.raises(openai.ConflictError):
        oc.chat.completions.create(model=model, messages=history, max_tokens=4, user="oa-1")
    r = client.post("/v1/chat/completions", json={"messages": history[:2]})
    assert r.status_code == 400 and "session" in error_message(r)


def test_an_append_primes_the_next_turn_on_every_route(server, client):
    """The next turn's query embeddings and the new steps' keys are computed before an append returns, on
    POST /steps and on the chat proxy alike: the turn's plan looks its query up and sends the embedder nothing."""
    ledger = Ledger(server.cfg.ledger)

    def keyed(sid):  # PACE embeds its query only to weigh old steps that have a key
        deadline = time.time() + 120
        while ledger.pending(sid, "hashing-256-512")[1]:
            assert time.time() < deadline, f"the steps of {sid} were not keyed within 120 s"
            time.sleep(0.2)

    def step(i):
        return [{"role": "assistant", "content": f"sed -n {i},40p settings/loader.py"},
                {"role": "tool", "content": f"{OBS} ({i})", "tool_call_id": f"p{i}"}]

    new_session(client, "prime-steps", arm="per-turn", steps=6)
    history = [{"role": "system", "content": "You are a careful agent."},
               {"role": "user", "content": "Fix the failing test in settings"}] + sum((step(i) for i in range(6)), [])
    chat = {"max_tokens": 2, "user": "prime-chat"}
    assert client.post("/v1/chat/completions", json={**chat, "messages": history},
                       headers={ARM_HEADER: "per-turn"}).status_code == 200
    for i in range(6, 9):
        keyed("alice::prime-steps"), keyed("alice::prime-chat")
        r = client.post("/v1/sessions/prime-steps/steps", json={
            "kind": "bash", "action": f"cat settings/loader.py # {i}", "observation": OBS, "tool": "bash"})
        assert r.status_code == 200, r.text
        assert client.post("/v1/sessions/prime-steps/turn", json={"max_tokens": 2}).status_code == 200
        history += step(i)  # the chat proxy appends and plans in one request
        r = client.post("/v1/chat/completions", json={**chat, "messages": history})
        assert r.status_code == 200, r.text
    served = ledger.served()
    for sid in ("alice::prime-steps", "alice::prime-chat"):
        rows = [r for r in served if r["session_id"] == sid and r["t"] >= 7]
        assert len(rows) == 3 and all(r["arm"] == "per-turn" for r in rows)
        assert all(r["embed_lookups"] >= 1 for r in rows), rows  # the plan did ask for its query
        # answered from the cache: no request of its own, and no wait for a priming request still in flight
        assert [(r["embed_requests"], r["embed_joined"]) for r in rows] == [(0, 0)] * 3, (sid, rows)


def test_the_chat_endpoint_records_every_message_and_refuses_what_it_cannot_honour(server, client):
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "Fix the failing test in settings"},
            {"role": "assistant", "content": "Let me look."}, {"role": "assistant", "content": "ls"},
            {"role": "tool", "content": "a.py", "tool_call_id": "c1"}, {"role": "user", "content": "go on"}]
    r = client.post("/v1/chat/completions", json={"messages": msgs, "user": "all-1", "max_tokens": 3,
                                                  "stop": ["\n\n"], "top_p": 0.9, "seed": 1})
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert usage["prompt_tokens"] >= r.json()["palimpsest"]["tokens"]["context"] and "context_tokens_saved" in usage
    tools = [{"type": "function", "function": {"name": "run_shell", "parameters": {"type": "object"}}}]
    r = client.post("/v1/chat/completions", json={"messages": msgs, "user": "tools-1", "max_tokens": 2,
                                                  "tools": tools, "tool_choice": "auto"})
    assert r.status_code == 200, r.text
    assert "run_shell" in Ledger(server.cfg.ledger).session("alice::tools-1").tools  # recorded with the session
    other = [{"type": "function", "function": {"name": "other"}}]
    r = client.post("/v1/chat/completions", json={"messages": msgs, "user": "tools-1", "tools": other})
    assert r.status_code == 409 and "tools" in error_message(r)
    audit = client.get("/v1/sessions/all-1/audit").json()["turns"]
    assert audit[-1]["t"] == 2  # two steps recorded: "Let me look." (no result), "ls" with "a.py" and "go on"
    steps = client.get("/v1/sessions/all-1/steps").json()
    assert steps["total"] == 2 and steps["next"] is None
    assert [(x["action"], x["observation"], x["authority"]) for x in steps["steps"]] == [
        ("Let me look.", None, "model"), ("ls", "a.py\ngo on", "tool")]
    page = client.get("/v1/sessions/all-1/steps", params={"start": 1, "limit": 1}).json()
    assert [x["t"] for x in page["steps"]] == [1] and len(page["steps"][0]["sha256"]) == 64
    bad = [({"response_format": {"type": "json_object"}}, "response_format"), ({"n": 2}, "n"),
           ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
           ({"tool_choice": "required"}, "tool_choice"), ({"foo": 1}, "foo"),
           ({"messages": msgs[:1] + [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            "messages[1].content[0]"),
           ({"messages": msgs + [{"role": "assistant", "content": "The fix is"}]}, "messages[6]: a trailing assistant"),
           ({"messages": msgs[:2] + [{"role": "assistant", "content": None, "function_call": {
               "name": "ls", "arguments": "{}"}}, {"role": "function", "name": "ls", "content": "a.py"}]},
            "messages[2].function_call")]
    for patch, field in bad:
        r = client.post("/v1/chat/completions", json={"messages": msgs, "user": "all-2", **patch})
        assert r.status_code in (400, 422) and field in error_message(r), (patch, r.text)
    assert client.get("/v1/sessions/all-2/steps").status_code == 404  # refused before anything was recorded
    served = client.get("/v1/models").json()["data"][0]["id"]
    r = client.post("/v1/chat/completions", json={"messages": msgs, "user": "all-3", "model": "gpt-4o"})
    assert r.status_code == 404 and repr(served) in error_message(r) and "'gpt-4o'" in error_message(r)
    r = client.post("/v1/chat/completions", json={"messages": msgs, "user": "all-3", "model": served, "max_tokens": 2})
    assert r.status_code == 200, r.text


TOOLS = [{"type": "function", "function": {
    "name": "run_shell", "description": "Run a shell command", "strict": True,
    "parameters": {"type": "object", "properties": {}, "additionalProperties": False}}}]


def tool_history() -> list[dict]:
    """A history with tools: an assistant tool call, its result, then two assistant messages in a row."""
    return [{"role": "system", "content": "You are a careful agent."},
            {"role": "user", "content": "Fix the failing test in settings"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_a", "type": "function", "function": {"name": "run_shell", "arguments": "{}"}},
                {"id": "call_b", "type": "function", "function": {"name": "run_shell", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "call_a", "content": OBS},
            {"role": "tool", "tool_call_id": "call_b", "content": "2 passed"},
            {"role": "assistant", "content": "The loader reads database_url."},
            {"role": "assistant", "content": "I will patch it."},
            {"role": "user", "content": "go on"}]


def test_the_openai_client_gets_tool_calls_and_streams_and_every_message_is_recorded(server, client):
    openai = pytest.importorskip("openai")
    oc = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEYS["alice"], default_headers={ARM_HEADER: "wide"})
    model = oc.models.list().data[0].id
    forced = {"type": "function", "function": {"name": "run_shell"}}
    # Sampled, with room: the constrained JSON admits whitespace, and a random actor decoding greedily pads it
    # until max_tokens (a trained model closes it at once).
    reply = oc.chat.completions.create(model=model, messages=tool_history(), tools=TOOLS, tool_choice=forced,
                                       max_tokens=400, seed=7, user="tc-1")
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    call = choice.message.tool_calls[0]
    assert call.function.name == "run_shell" and isinstance(json.loads(call.function.arguments), dict) and call.id
    # the round trip: the call and its result go back, and the agent's next request records them
    history = tool_history() + [choice.message.model_dump(exclude_none=True),
                                {"role": "tool", "tool_call_id": call.id, "content": "ok"}]
    chunks = list(oc.chat.completions.create(model=model, messages=history, tools=TOOLS, max_tokens=5, user="tc-1",
                                             stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes and finishes[-1] in ("stop", "length", "tool_calls")
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens >= 1
    steps = client.get("/v1/sessions/tc-1/steps").json()["steps"]
    by_t = {s["t"]: s for s in steps}
    first = by_t[0]
    assert [c["id"] for c in first["tool_calls"]] == ["call_a", "call_b"] and first["authority"] == "tool"
    assert [(r["tool_call_id"], r["content"]) for r in first["results"]] == [("call_a", OBS), ("call_b", "2 passed")]
    assert by_t[1]["action"] == "The loader reads database_url." and by_t[1]["observation"] is None
    assert by_t[2]["action"] == "I will patch it." and by_t[2]["observation"] == "go on"
    last = by_t[3]
    assert last["tool_calls"][0]["id"] == call.id and last["tool_call_id"] == call.id
    assert last["results"][0]["content"] == "ok" and last["authority"] == "tool"
    audit = client.get("/v1/sessions/tc-1/audit").json()["turns"]
    assert len(audit) == 2  # the streamed turn is audited as a non-streamed one


def test_a_langchain_agent_drives_its_own_tool_loop_through_the_proxy(server, client):
    """LangChain's ChatOpenAI with bound tools, pointed at the proxy: every step recorded in order, each tool
    result paired with its call, and every turn's compiled context within its budget."""
    lc = pytest.importorskip("langchain_openai")
    from langchain_core.messages import HumanMessage, SystemMessage, ToolMessage

    model = client.get("/v1/models").json()["data"][0]["id"]  # an unknown model name is a 404
    llm = lc.ChatOpenAI(base_url=f"{server.url}/v1", api_key=KEYS["alice"], model=model, max_tokens=400, seed=7,
                        default_headers={ARM_HEADER: "wide", "x-palimpsest-session": "lc-1"}, max_retries=0)
    agent = llm.bind_tools(TOOLS, tool_choice="run_shell")
    messages = [SystemMessage("You are a careful agent."), HumanMessage("Fix the failing test in settings")]
    calls = []
    for k in range(3):
        ai = agent.invoke(messages)
        assert ai.tool_calls and ai.tool_calls[0]["name"] == "run_shell", ai
        messages.append(ai)
        for call in ai.tool_calls:
            calls.append(call["id"])
            messages.append(ToolMessage(f"output {k}", tool_call_id=call["id"]))
    agent.invoke(messages)  # the last results are recorded with this request
    steps = client.get("/v1/sessions/lc-1/steps").json()["steps"]
    assert [s["t"] for s in steps] == list(range(len(steps))) and len(steps) == 3
    assert [c["id"] for s in steps for c in s["tool_calls"]] == calls
    for k, s in enumerate(steps):
        assert [r["tool_call_id"] for r in s["results"]] == [c["id"] for c in s["tool_calls"]]
        assert [r["content"] for r in s["results"]] == [f"output {k}"] * len(s["tool_calls"])
    turns = client.get("/v1/sessions/lc-1/audit").json()["turns"]
    assert len(turns) == 4 and all(t["tokens"] + t["reserve"] <= t["budget"] for t in turns), turns


def test_an_openai_agents_sdk_agent_runs_its_tool_loop_through_the_proxy(server, client):
    """The OpenAI Agents SDK (chat-completions model) with a function tool: its first turn must call the tool
    (the SDK then resets tool_choice to auto); every step is recorded with its call and result paired."""
    pytest.importorskip("agents")
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )
    from agents.exceptions import MaxTurnsExceeded
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    outputs = []

    @function_tool
    def run_shell() -> str:
        """Run the test suite and return its output."""
        outputs.append(f"output {len(outputs)}")
        return outputs[-1]

    oc = AsyncOpenAI(base_url=f"{server.url}/v1", api_key=KEYS["alice"], max_retries=0,
                     default_headers={ARM_HEADER: "wide", "x-palimpsest-session": "ag-1"})
    agent = Agent(name="fixer", instructions="You are a careful agent.", tools=[run_shell],
                  model=OpenAIChatCompletionsModel(model=client.get("/v1/models").json()["data"][0]["id"],
                                                   openai_client=oc),
                  model_settings=ModelSettings(tool_choice="required", max_tokens=400, temperature=1.0))
    try:
        Runner.run_sync(agent, "Fix the failing test in settings", max_turns=3)
    except MaxTurnsExceeded:
        pass  # a random tiny actor may keep calling the tool; the protocol is what is under test
    assert outputs, ("the agent never called its tool", client.get("/v1/sessions/ag-1/steps").text[:2000],
                     client.get("/v1/sessions/ag-1/audit").text[:1000])
    steps = client.get("/v1/sessions/ag-1/steps").json()["steps"]
    assert [s["t"] for s in steps] == list(range(len(steps))) and steps
    first = steps[0]
    assert first["tool_calls"][0]["function"]["name"] == "run_shell" and first["authority"] == "tool"
    assert [r["tool_call_id"] for r in first["results"]] == [c["id"] for c in first["tool_calls"]]
    assert first["results"][0]["content"] == "output 0"
    turns = client.get("/v1/sessions/ag-1/audit").json()["turns"]
    assert len(turns) >= 2 and all(t["tokens"] + t["reserve"] <= t["budget"] for t in turns)


def test_a_stream_is_server_sent_events_ending_in_done(server, client):
    body = {"messages": tool_history()[:2], "user": "sse-1", "max_tokens": 4, "stream": True}
    with client.stream("POST", "/v1/chat/completions", json=body, headers={ARM_HEADER: "wide"}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    turns = client.get("/v1/sessions/sse-1/audit").json()["turns"]
    assert len(turns) == 1 and text is not None


def test_tool_messages_that_answer_no_call_of_their_action_are_refused_by_field(client):
    bad = tool_history()
    bad[4] = {"role": "tool", "tool_call_id": "call_zzz", "content": "?"}
    r = client.post("/v1/chat/completions", json={"messages": bad, "user": "tc-2", "tools": TOOLS})
    assert r.status_code == 400 and "messages[4].tool_call_id" in error_message(r)
    many = tool_history()
    many[2]["tool_calls"] = [{"id": f"c{k}", "type": "function", "function": {"name": "run_shell", "arguments": "{}"}}
                             for k in range(10_000)]
    r = client.post("/v1/chat/completions", json={"messages": many, "user": "tc-3", "tools": TOOLS})
    assert r.status_code in (413, 422) and "tool_calls" in error_message(r)
    odd = tool_history()
    odd[2]["tool_calls"][0]["function"]["arguments"] = "not json {"
    r = client.post("/v1/chat/completions", json={"messages": odd, "user": "tc-4", "tools": TOOLS, "max_tokens": 2},
                    headers={ARM_HEADER: "wide"})
    assert r.status_code == 200, r.text  # recorded as the agent sent it: arguments are the agent's text
    step = client.get("/v1/sessions/tc-4/steps").json()["steps"][0]
    assert step["tool_calls"][0]["function"]["arguments"] == "not json {"


def test_greedy_output_from_the_actors_own_embeddings_equals_output_from_ids(client, tiny_dir):
    from transformers import AutoTokenizer

    from palimpsest.models.actor import FrozenActor

    tok = AutoTokenizer.from_pretrained(tiny_dir)
    actor = FrozenActor.from_pretrained(tiny_dir)
    prompt = "grep -n parse_config settings/loader.py"
    ids = tok.encode(prompt, add_special_tokens=False)
    by_ids = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 8}).json()
    embeds = actor.embed(torch.tensor(ids)).detach()
    by_embeds = client.post("/v1/completions", json={"prompt_embeds": encode_embeds(embeds), "max_tokens": 8}).json()
    assert by_ids["usage"]["prompt_tokens"] == by_embeds["usage"]["prompt_tokens"] == len(ids)
    assert by_embeds["choices"][0]["token_ids"] == by_ids["choices"][0]["token_ids"]


def test_bad_input_is_a_4xx_and_loses_nothing(client):
    new_session(client, "bad-1", steps=2)
    big = "x" * 20_001
    cases = [
        client.post("/v1/sessions", content=b"{not json", headers={"content-type": "application/json"}),
        client.post("/v1/sessions/nope/steps", json={"action": "ls"}),
        client.post("/v1/sessions/nope/turn", json={}),
        client.post("/v1/sessions/bad-1/steps", json={"action": "ls", "observation": big}),
        client.post("/v1/sessions/bad-1/steps", json={"t": 0, "action": "rewritten"}),
        client.post("/v1/sessions/bad-1/steps", json={"action": "ls", "authority": "root"}),
        client.post("/v1/sessions/bad-1/turn", json={"budget": 5}),
        client.post("/v1/completions", json={"prompt_embeds": encode_embeds(torch.randn(4, 7))}),
        client.post("/v1/completions", json={"prompt_embeds": encode_embeds(torch.ones(4, 128, dtype=torch.int32))}),
        client.post("/v1/completions", json={"prompt_embeds": encode_embeds(torch.full((4, 128), float("nan")))}),
        client.post("/v1/completions", json={"prompt_embeds": encode_embeds(torch.randn(2, 4, 128))}),
        client.post("/v1/completions", json={"prompt_embeds": base64.b64encode(b"junk").decode()}),
        client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "stream": True,
                                                  "user": "s", "tool_choice": "required"}),
    ]
    codes = [r.status_code for r in cases]
    assert codes == [422, 404, 404, 413, 409, 422, 422, 400, 400, 400, 400, 400, 422], [r.text for r in cases]
    assert all(error_message(r) for r in cases)
    assert client.get("/healthz").json() == {"status": "ok"}
    assert new_session(client, "bad-1")["steps"] == 2  # nothing stored was lost or added


def test_enrichment_runs_in_the_background(server, client):
    new_session(client, "enrich-1", steps=5)
    ledger = Ledger(server.cfg.ledger)
    deadline = time.time() + 120
    while time.time() < deadline:
        no_summary, no_key = ledger.pending("alice::enrich-1", "hashing-256-512")
        if not no_summary and not no_key:
            break
        time.sleep(0.5)
    assert (no_summary, no_key) == ([], [])


def test_metrics_and_openapi(client):
    new_session(client, "met-1", arm="pace", steps=2)
    client.post("/v1/sessions/met-1/turn", json={"max_tokens": 2})
    text = client.get("/metrics").text
    assert 'palimpsest_turns_total{arm="pace"}' in text and "palimpsest_turn_latency_ms_bucket" in text
    paths = client.get("/openapi.json").json()["paths"]
    for p in ("/v1/sessions", "/v1/sessions/{session_id}/turn", "/v1/sessions/{session_id}/glimpse",
              "/v1/sessions/{session_id}/audit",
              "/v1/chat/completions", "/v1/models", "/healthz", "/readyz", "/metrics"):
        assert p in paths


def test_tenants_are_isolated_and_keys_are_required(client, bob, server):
    new_session(client, "shared-name", steps=2)
    step_id = client.post("/v1/sessions/shared-name/steps",
                          json={"action": "cat secret.txt", "observation": "alice's secret"}).json()["step_id"]
    # Bob cannot see, extend, turn, audit or glimpse Alice's session, even knowing its id and a step id.
    assert bob.post("/v1/sessions/shared-name/steps", json={"action": "ls"}).status_code == 404
    assert bob.post("/v1/sessions/shared-name/turn", json={}).status_code == 404
    assert bob.get("/v1/sessions/shared-name/audit").status_code == 404
    assert bob.get("/v1/sessions/shared-name/steps").status_code == 404
    assert bob.post("/v1/sessions/shared-name/glimpse", json={"step_id": step_id}).status_code == 404
    # The same name is a different session for Bob, and Alice's step ids are not his to read through it.
    assert bob.post("/v1/sessions", json={"session_id": "shared-name", "task": "bob's task"}).json()["steps"] == 0
    r = bob.post("/v1/sessions/shared-name/glimpse", json={"step_id": step_id})
    assert r.status_code == 404 and "secret" not in r.text
    # No key, a wrong key: 401; raw prompt embeds only for tenants allowed to send them.
    assert httpx.post(f"{server.url}/v1/sessions", json={"task": "x"}).status_code == 401
    assert httpx.post(f"{server.url}/v1/sessions", json={"task": "x"},
                      headers={"Authorization": "Bearer nope"}).status_code == 401
    r = bob.post("/v1/completions", json={"prompt_embeds": encode_embeds(torch.randn(3, 128))})
    assert r.status_code == 403 and "prompt_embeds" in error_message(r)
    assert client.post("/v1/completions", json={"prompt_embeds": encode_embeds(torch.randn(3, 128)),
                                                "max_tokens": 2}).status_code == 200


def test_every_route_keeps_tenants_apart(client, bob, server):
    """The chat proxy (plain and streamed), the steps list, the shadow counts and the models' time, route by
    route: another tenant's request naming the same session records into its own, and nothing of Alice's
    (a session, a step, a shadow record) is visible to Bob. (The Messages endpoint: the Anthropic test.)"""
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "Fix the failing test in settings"},
            {"role": "assistant", "content": "cat secret.txt"},
            {"role": "tool", "content": "alice's chat secret", "tool_call_id": "c1"}]
    assert client.post("/v1/chat/completions",
                       json={"messages": msgs, "user": "iso-chat", "max_tokens": 2}).status_code == 200
    before = client.get("/v1/sessions/iso-chat/steps").json()
    assert before["total"] == 1 and "alice's chat secret" in json.dumps(before)
    assert bob.get("/v1/sessions/iso-chat/steps").status_code == 404
    assert bob.get("/v1/sessions/iso-chat/audit").status_code == 404
    bobs = [msgs[0], msgs[1], {"role": "assistant", "content": "ls"}, {"role": "tool", "content": "b.txt",
                                                                        "tool_call_id": "c1"}]
    for stream in (False, True):  # the same session name, in Bob's own namespace: no 409 against Alice's history
        r = bob.post("/v1/chat/completions", json={"messages": bobs, "user": "iso-chat", "max_tokens": 2,
                                                   "stream": stream})
        assert r.status_code == 200 and "alice" not in r.text, r.text
    mine = bob.get("/v1/sessions/iso-chat/steps").json()
    assert mine["total"] == 1 and "secret" not in json.dumps(mine)
    assert client.get("/v1/sessions/iso-chat/steps").json() == before  # Alice's session is untouched
    # the replica-wide figures need a key and name no session
    for path in ("/v1/ab/shadow", "/v1/busy", "/v1/models"):
        assert httpx.get(f"{server.url}{path}").status_code == 401, path
        r = bob.get(path)
        assert r.status_code == 200 and "iso-chat" not in r.text and "alice" not in r.text, path
    # shadow records and served turns are the ledger's, kept under the tenant's internal session id
    ledger = Ledger(server.cfg.ledger)
    assert {r["session_id"] for r in ledger.served() if r["session_id"].endswith("::iso-chat")} == {
        "alice::iso-chat", "bob::iso-chat"}


CLAUDE_TOOLS = [{"name": "run_shell", "description": "Run a shell command",
                 "input_schema": {"type": "object", "properties": {}}}]


def test_the_anthropic_client_runs_a_tool_loop_streams_and_counts_and_every_block_is_recorded(server, client, bob):
    anthropic = pytest.importorskip("anthropic")
    ac = anthropic.Anthropic(base_url=server.url, api_key=KEYS["alice"], max_retries=0,
                             default_headers={ARM_HEADER: "wide"})
    model = client.get("/v1/models").json()["data"][0]["id"]
    system = [{"type": "text", "text": "You are a careful agent.", "cache_control": {"type": "ephemeral"}}]
    messages = [{"role": "user", "content": "Fix the failing test in settings"}]
    calls = []
    for k in range(2):  # the tool loop: each call goes back with its result, and the next request records both
        reply = ac.messages.create(model=model, max_tokens=400, system=system, messages=messages, tools=CLAUDE_TOOLS,
                                   tool_choice={"type": "tool", "name": "run_shell"}, metadata={"user_id": "cc-1"})
        assert reply.stop_reason == "tool_use" and reply.usage.input_tokens > 0, reply
        use = next(b for b in reply.content if b.type == "tool_use")
        assert use.name == "run_shell" and isinstance(use.input, dict) and use.id
        calls.append(use.id)
        messages += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in reply.content]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                   "content": [{"type": "text", "text": f"output {k}"}]}]}]
    events = []
    # a constructed case: the tool is forced, so the streamed reply must end in exactly one call, `tool_use`
    with ac.messages.stream(model=model, max_tokens=400, system=system, messages=messages, tools=CLAUDE_TOOLS,
                            tool_choice={"type": "tool", "name": "run_shell"}, metadata={"user_id": "cc-1"}) as stream:
        for ev in stream:
            events.append(ev.type)
        final = stream.get_final_message()
    assert events[0] == "message_start" and events[-1] == "message_stop" and "message_delta" in events
    assert final.stop_reason == "tool_use" and final.usage.output_tokens >= 1
    assert [b.name for b in final.content if b.type == "tool_use"] == ["run_shell"]
    counted = ac.messages.count_tokens(model=model, system=system, messages=messages, tools=CLAUDE_TOOLS)
    bare = ac.messages.count_tokens(model=model, system=system, messages=messages)
    assert counted.input_tokens > bare.input_tokens > 0  # the tool declarations count
    steps = client.get("/v1/sessions/cc-1/steps").json()["steps"]
    assert [s["tool_calls"][0]["id"] for s in steps] == calls  # one step per call, each answered by its result
    assert [(r["tool_call_id"], r["content"]) for s in steps for r in s["results"]] == [
        (calls[0], "output 0"), (calls[1], "output 1")]
    audit = client.get("/v1/sessions/cc-1/audit").json()["turns"]
    assert len(audit) == 3  # two turns and the streamed one, audited alike
    # nothing the text actor cannot read is dropped: each is a 400 naming its field
    bad = [({"messages": [{"role": "user", "content": [{"type": "image", "source": {
        "type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]}, "messages[0].content[0]"),
           ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
           ({"top_k": 5}, "top_k"), ({"container": "x"}, "container"),
           ({"messages": messages[:1] + [{"role": "assistant", "content": [
               {"type": "thinking", "thinking": "hmm", "signature": "s"}]}]}, "messages[1].content[0]")]
    for patch, field in bad:
        r = client.post("/v1/messages", json={"model": model, "max_tokens": 4, "messages": messages[:1],
                                              "metadata": {"user_id": "cc-bad"}, **patch})
        assert r.status_code == 400 and field in error_message(r), (patch, r.text)
    r = client.post("/v1/messages", json={"model": "claude-sonnet-4-5", "max_tokens": 4, "messages": messages[:1]})
    assert r.status_code == 404 and model in error_message(r)
    # what Claude Code sends with every request is read, and recorded with the turn
    r = client.post("/v1/messages", json={
        "model": model, "max_tokens": 2, "messages": messages[:1], "metadata": {"user_id": "cc-fields"},
        "thinking": {"type": "adaptive"}, "output_config": {"effort": "high"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]}})
    assert r.status_code == 200, r.text
    row = [x for x in Ledger(server.cfg.ledger).served() if x["session_id"] == "alice::cc-fields"][-1]
    assert json.loads(row["requested_thinking"]) == {"type": "adaptive"}
    assert json.loads(row["requested_output_config"]) == {"effort": "high"}
    assert "clear_thinking_20251015" in row["requested_context_management"]
    assert client.get("/v1/sessions/cc-bad/steps").status_code == 404  # refused before anything was recorded
    # another tenant naming the same session sees none of it, and records into its own
    assert bob.get("/v1/sessions/cc-1/steps").status_code == 404
    r = bob.post("/v1/messages", json={"model": model, "max_tokens": 2, "messages": messages[:1],
                                       "metadata": {"user_id": "cc-1"}})
    assert r.status_code == 200, r.text
    assert bob.get("/v1/sessions/cc-1/steps").json()["total"] == 0
    assert len(client.get("/v1/sessions/cc-1/audit").json()["turns"]) == 3


def test_a_served_boundary_with_a_relevance_predictor_scores_old_steps_as_its_head_does(server, client, tiny_relevance):
    """The arm's policy names a relevance bundle: the served boundary's audited scores of the old steps are the
    head's probabilities over the features of the ledger's own snapshot, and the pace arm (the cosine) scores the
    same history otherwise."""
    import numpy as np

    from palimpsest.models.relevance_head import read_head
    from palimpsest.platform import Runtime
    from palimpsest.platform.policies.base import query_text, relative_softmax
    from palimpsest.platform.policies.relevance import features

    ledger = Ledger(server.cfg.ledger)
    audits = {}
    for arm in ("learned-relevance", "pace"):
        sid = f"relevance-{arm}"
        client.post("/v1/sessions", json={"session_id": sid, "task": "Fix the failing test in settings", "arm": arm})
        for t in range(10):  # distinct files, some named again later
            name = f"src/mod_{t % 6}/file_{t}.py"
            r = client.post(f"/v1/sessions/{sid}/steps", json={
                "kind": "bash", "action": f"cat {name}", "tool": "bash",
                "observation": f"{name}:1: def f_{t}(): return load('cfg_{t % 3}')\n" + "word " * (10 + 7 * t)})
            assert r.status_code == 200, r.text
        deadline = time.time() + 120
        while ledger.pending(f"alice::{sid}", "hashing-256-512") != ([], []) and time.time() < deadline:
            time.sleep(0.5)
        assert ledger.pending(f"alice::{sid}", "hashing-256-512") == ([], [])
        r = client.post(f"/v1/sessions/{sid}/turn", json={"max_tokens": 2})
        assert r.status_code == 200 and r.json()["arm"] == arm, r.text
        audits[arm] = ledger.audit(f"alice::{sid}")[-1]

    served = audits["learned-relevance"]
    assert served["relevance"] == str(tiny_relevance) and audits["pace"]["relevance"] == "cosine"
    rt = Runtime(ledger)  # the hashing embedder, as served
    snap = rt.snapshot("alice::relevance-learned-relevance", at=served["plan"][-1]["t"] + 1)
    old = np.flatnonzero(snap.has_key[: snap.t - 2])
    assert old.size == 8
    text = query_text(snap, 2, "recent_first")
    head = read_head(tiny_relevance)
    expected = relative_softmax(head.probability(head.read(features(snap, old, rt.embedder.embed([text])[0], text))),
                                0.3)
    scores = np.array([p["score"] for p in served["plan"]])
    np.testing.assert_allclose(scores[old], expected, rtol=1e-5, atol=1e-7)
    cosine = np.array([p["score"] for p in audits["pace"]["plan"]])
    assert not np.allclose(cosine[old], expected, rtol=1e-3)
