"""The Messages API on the wire, against the embedded default (BENCHMARKS.md, "The Messages API as its clients
read it"): the app `palimpsest serve` runs with no config (SmolLM2-135M with the Hermes tool template and
parser, MiniLM, pace), driven over HTTP on 127.0.0.1 with raw requests, raw server-sent events and the official
``anthropic`` client. Each documented item is exercised and what came back is recorded whole:

- errors by status, in Anthropic's shape (400, 404 model and route, 413, a rewritten history);
- ``stop_reason: stop_sequence`` with the matched string, whole and streamed;
- the event order of a streamed tool call, ``message_start``'s usage against what the actor was sent, pings;
- several ``tool_result`` blocks in one message (a list of blocks, ``is_error``), ``tool_choice`` any / none /
  tool, a system prompt of several blocks as the ledger records it, ``count_tokens``;
- what would have been dropped, refused by name.

    .venv/bin/python benchmarks/messages_wire.py [--ping-s 0.25] [--out benchmarks/results/messages_wire.json]

The only overrides of the default: the ledger's path, and the ping interval (the default's 10 s is longer than
any prefill of this machine's short prompts; ``--ping-s 10`` keeps it).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
TOOLS = [{"name": "bash", "description": "Run a shell command in the repository.",
          "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}},
         {"name": "read_file", "description": "Read a file.",
          "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}]
TASK = "List the files of the repository, then read the README."


def events(text: str) -> list[tuple[str, dict]]:
    out = []
    for frame in text.split("\n\n"):
        if frame.strip():
            fields = dict(line.split(": ", 1) for line in frame.split("\n"))
            out.append((fields["event"], json.loads(fields["data"])))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ping-s", type=float, default=0.25)
    ap.add_argument("--port", type=int, default=8475)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "messages_wire.json"))
    args = ap.parse_args()
    import anthropic

    from palimpsest.platform import Ledger
    from palimpsest.serving.local import LocalServer

    ledger = ROOT / ".palimpsest" / f"messages-wire-{int(time.time())}.db"
    cfg = {"ledger": str(ledger), "turns": {"stream_ping_s": args.ping_s}}
    out: dict = {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, no GPU",
                 "config": cfg}
    with LocalServer(cfg, port=args.port) as srv:
        http = httpx.Client(base_url=srv.url, timeout=600)
        model = http.get("/v1/models").json()["data"][0]["id"]
        client = anthropic.Anthropic(base_url=srv.url, api_key="unused", max_retries=0)

        def post(body: dict, path: str = "/v1/messages", **kw) -> httpx.Response:
            return http.post(path, json=body, **kw)

        def base(user: str, **extra) -> dict:
            return {"model": model, "max_tokens": 16, "temperature": 0.0, "metadata": {"user_id": user},
                    "messages": [{"role": "user", "content": TASK}], **extra}

        # -- errors, each in Anthropic's shape
        errors = {"400 no messages": post({**base("e-1"), "messages": []}),
                  "404 a model not served": post(base("e-1") | {"model": "claude-sonnet-4-5"}),
                  "404 an unknown route": post({}, "/v1/messages/batches"),
                  "413 a body over limits.max_request_bytes": http.post(
                      "/v1/messages", content=b" " * (8 * 1024 * 1024 + 1),
                      headers={"content-type": "application/json"})}
        history = [{"role": "user", "content": TASK}, {"role": "assistant", "content": "ls"},
                   {"role": "user", "content": "README.md setup.py"}]
        post({**base("e-2"), "messages": history})
        errors["400 a rewritten history"] = post({**base("e-2"), "messages": [history[0], {
            "role": "assistant", "content": "rm -rf /"}, history[2]]})
        out["errors"] = {k: {"status": r.status_code, "body": r.json()} for k, r in errors.items()}

        # -- stop sequences
        free = post({**base("s-0"), "max_tokens": 32}).json()
        text = "".join(b.get("text", "") for b in free["content"])
        stop = next((c for c in text[1:] if c.isalnum()), text[1:3])
        whole = post({**base("s-1"), "max_tokens": 32, "stop_sequences": [stop]}).json()
        streamed = events(post({**base("s-2"), "max_tokens": 32, "stop_sequences": [stop], "stream": True}).text)
        out["stop_sequence"] = {"free_text": text, "stop": stop,
                                "free": {k: free[k] for k in ("stop_reason", "stop_sequence")},
                                "whole": {k: whole[k] for k in ("stop_reason", "stop_sequence", "content")},
                                "streamed_delta": next(d for e, d in streamed if e == "message_delta")["delta"]}

        # -- a streamed, forced tool call, read as raw server-sent events
        r = post({**base("sse-1"), "max_tokens": 128, "tools": TOOLS, "tool_choice": {"type": "tool", "name": "bash"},
                  "stream": True})
        evs = events(r.text)
        row = [x for x in Ledger(str(ledger)).served() if x["session_id"] == "sse-1"][-1]
        start = evs[0][1]["message"]["usage"]
        out["stream"] = {"content_type": r.headers["content-type"], "events": [e for e, _ in evs],
                         "message_start_usage": start, "served_tokens_prompt": row["tokens_prompt"],
                         "message_delta": next(d for e, d in evs if e == "message_delta"),
                         "tool_use": [d for e, d in evs if e == "content_block_start"],
                         "input_json": "".join(d["delta"].get("partial_json", "") for e, d in evs
                                               if e == "content_block_delta")}

        # -- tool results, tool_choice, system blocks, count_tokens, through the client
        results = [{"role": "user", "content": TASK},
                   {"role": "assistant", "content": [
                       {"type": "tool_use", "id": "toolu_a", "name": "bash", "input": {"command": "ls"}},
                       {"type": "tool_use", "id": "toolu_b", "name": "read_file", "input": {"path": "README"}}]},
                   {"role": "user", "content": [
                       {"type": "tool_result", "tool_use_id": "toolu_a",
                        "content": [{"type": "text", "text": "README.md"}, {"type": "text", "text": "setup.py"}]},
                       {"type": "tool_result", "tool_use_id": "toolu_b", "content": "no such file: README",
                        "is_error": True}]}]
        system = [{"type": "text", "text": "You are a careful agent."}, {"type": "text", "text": "Be brief."}]
        sampling = {"extra_body": {"temperature": 0.0}}
        reply = client.messages.create(model=model, max_tokens=16, system=system, messages=results, tools=TOOLS,
                                       metadata={"user_id": "c-1"}, **sampling)
        led = Ledger(str(ledger))
        (step,) = led.steps("c-1", 0, 10)
        out["client"] = {
            "several_results": {"stop_reason": reply.stop_reason, "recorded_calls": step.calls,
                                "recorded_observation": step.observation},
            "system_recorded": led.session("c-1").system}
        choices = {}
        for name, choice in (("tool", {"type": "tool", "name": "bash"}), ("any", {"type": "any"}),
                             ("none", {"type": "none"})):
            m = client.messages.create(model=model, max_tokens=128, messages=[{"role": "user", "content": TASK}],
                                       tools=TOOLS, tool_choice=choice, metadata={"user_id": f"tc-{name}"}, **sampling)
            choices[name] = {"stop_reason": m.stop_reason, "content": [b.model_dump() for b in m.content]}
        out["client"]["tool_choice"] = choices
        counted = post({"model": model, "messages": results, "tools": TOOLS, "system": system},
                       "/v1/messages/count_tokens").json()
        sdk = client.messages.count_tokens(model=model, messages=results, tools=TOOLS, system=system)
        served = [x for x in led.served() if x["session_id"] == "c-1"][-1]
        out["count_tokens"] = {"raw": counted, "client_input_tokens": sdk.input_tokens,
                               "served_turn_tokens_prompt": served["tokens_prompt"]}

        # -- refused by name
        bad = {"metadata.team": {"metadata": {"user_id": "d-1", "team": "x"}},
               "tool_choice without tools": {"tool_choice": {"type": "auto"}},
               "an empty text block": {"messages": [{"role": "user", "content": [{"type": "text", "text": ""}]}]}}
        out["refused"] = {k: (lambda r: {"status": r.status_code, "body": r.json()})(post({**base("d-1"), **v}))
                          for k, v in bad.items()}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2, default=str))
    json.dump(out, sys.stdout, indent=2, default=str)
    print()


if __name__ == "__main__":
    main()
