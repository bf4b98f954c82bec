"""The OpenAI proxy and the Anthropic Messages endpoint as agents see them (BENCHMARKS.md, "OpenAI proxy"):
the served app with SmolLM2 on vLLM and all-MiniLM-L6-v2, driven over HTTP on 127.0.0.1 by the official
``openai`` client (``/v1/chat/completions``) and the official ``anthropic`` client (``/v1/messages``).

For each dev trajectory, the growing history (assistant action, tool result) is resent every turn, as an
agent framework does, alternately with and without streaming. Each turn goes to both endpoints, one after
the other, in sessions of their own: the chat proxy as assistant text and ``tool`` messages, Messages as
``tool_use`` / ``tool_result`` blocks of a declared ``bash`` tool (the same turns, one run):

- time to first token of a streamed turn (request sent -> first content delta), against the whole turn;
- proxy overhead per turn: the client's wall time minus the actor's generation time as the server reports
  it (recording the history, compiling the context, waiting for the query embedding, HTTP and Serve hops).

    .venv/bin/python benchmarks/proxy_stream.py [--data FILE] [--turns 40] [--budget 6000]
        [--out benchmarks/results/proxy_stream.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))] if xs else float("nan")


def history(traj, upto: int, limit: int) -> list[dict]:
    from palimpsest.pipelines.trajectories import to_record

    msgs = [{"role": "system", "content": traj.system or "You are a careful agent."},
            {"role": "user", "content": traj.task}]
    for s in traj.steps[:upto]:
        rec = to_record(s)
        msgs.append({"role": "assistant",
                     "content": ((rec.thought + "\n") if rec.thought else "") + rec.action[:limit]})
        msgs.append({"role": "tool", "content": (rec.observation or "")[:limit]})
    return msgs


BASH = {"name": "bash", "description": "Run a shell command in the repository.",
        "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}


def messages_history(traj, upto: int, limit: int) -> tuple[str, list[dict]]:
    """The same turns as :func:`history` in Anthropic's shape: each action a ``tool_use`` of ``bash``, answered by
    its ``tool_result`` in the next user message."""
    from palimpsest.pipelines.trajectories import to_record

    msgs: list[dict] = [{"role": "user", "content": traj.task}]
    for i, s in enumerate(traj.steps[:upto]):
        rec = to_record(s)
        blocks = ([{"type": "text", "text": rec.thought}] if rec.thought else []) + [
            {"type": "tool_use", "id": f"toolu_{i:04d}", "name": "bash", "input": {"command": rec.action[:limit]}}]
        msgs.append({"role": "assistant", "content": blocks})
        msgs.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"toolu_{i:04d}",
                                                  "content": (rec.observation or "")[:limit] or "(no output)"}]})
    return traj.system or "You are a careful agent.", msgs


def chat_turn(oc, msgs, sid, stream: bool, max_tokens: int) -> dict:
    t0 = time.perf_counter()
    if stream:
        first, ext = None, None
        for chunk in oc.chat.completions.create(model="smollm2", messages=msgs, user=sid, stream=True,
                                                max_tokens=max_tokens, temperature=0):
            if first is None and chunk.choices and chunk.choices[0].delta.content:
                first = time.perf_counter()
            ext = (chunk.model_extra or {}).get("palimpsest") or ext
        wall = time.perf_counter() - t0
        return {"wall": wall, "ext": ext, "ttft_ms": ((first or time.perf_counter()) - t0) * 1000}
    r = oc.chat.completions.create(model="smollm2", messages=msgs, user=sid, max_tokens=max_tokens, temperature=0)
    return {"wall": time.perf_counter() - t0, "ext": (r.model_extra or {}).get("palimpsest"), "ttft_ms": None}


def messages_turn(ac, system, msgs, sid, stream: bool, max_tokens: int) -> dict:
    kw = {"model": "smollm2", "system": system, "messages": msgs, "tools": [BASH], "metadata": {"user_id": sid},
          "max_tokens": max_tokens, "extra_body": {"temperature": 0}}  # greedy, as the chat turns
    t0 = time.perf_counter()
    if stream:
        first, ext = None, None
        for ev in ac.messages.create(stream=True, **kw):
            if first is None and ev.type == "content_block_delta" and getattr(ev.delta, "type", "") == "text_delta":
                first = time.perf_counter()
            if ev.type == "message_delta":
                ext = (ev.model_extra or {}).get("palimpsest")
        wall = time.perf_counter() - t0
        return {"wall": wall, "ext": ext, "ttft_ms": ((first or time.perf_counter()) - t0) * 1000}
    r = ac.messages.create(**kw)
    return {"wall": time.perf_counter() - t0, "ext": (r.model_extra or {}).get("palimpsest"), "ttft_ms": None}


def summary(rows: list[dict]) -> dict:
    out: dict = {}
    for name, sel in (("non_streamed", [r for r in rows if not r["stream"]]),
                      ("streamed", [r for r in rows if r["stream"]])):
        out[name] = {k: {"p50": pct([r[k] for r in sel], 50), "p95": pct([r[k] for r in sel], 95)}
                     for k in ("wall_ms", "actor_ms", "overhead_ms", "plan_ms", "embed_ms", "context_tokens")}
        out[name]["turns"] = len(sel)
    streamed = [r for r in rows if r["stream"]]
    if streamed:
        out["streamed"]["ttft_ms"] = {"p50": pct([r["ttft_ms"] for r in streamed], 50),
                                      "p95": pct([r["ttft_ms"] for r in streamed], 95)}
        out["streamed"]["ttft_share_of_turn_p50"] = statistics.median(r["ttft_ms"] / r["wall_ms"] for r in streamed)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default=str(ROOT.parent / "shared" / "data" / "trajectories" / "dev.jsonl"))
    ap.add_argument("--turns", type=int, default=40)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--budget", type=int, default=6000, help="the pace arm's budget (the actor's prefill is most of a "
                    "turn on CPU; the overhead is measured beside it)")
    ap.add_argument("--port", type=int, default=8471)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "proxy_stream.json"))
    args = ap.parse_args()

    from anthropic import Anthropic
    from openai import OpenAI

    from palimpsest.pipelines.trajectories import read_trajectories
    from palimpsest.serving.local import LocalServer

    trajs = read_trajectories(args.data).trajectories
    ledger = ROOT / ".palimpsest" / f"proxy-bench-{int(time.time())}.db"
    cfg = {"ledger": str(ledger), "embedder": "minilm", "budget": args.budget,
           "actor": {"model": "smollm2", "max_model_len": 8192, "max_tokens": args.max_tokens},  # tools by default
           "summarizer": {"mode": "rule"}, "memory": {"model": None},
           "arms": [{"name": "pace", "policy": {"type": "pace"}}]}
    rows: dict[str, list[dict]] = {"chat": [], "messages": []}
    with LocalServer(cfg, port=args.port) as srv:
        oc = OpenAI(base_url=f"{srv.url}/v1", api_key="unused", timeout=600)
        ac = Anthropic(base_url=srv.url, api_key="unused", timeout=600, max_retries=0)
        turn = 0
        for traj in trajs:
            for upto in range(2, len(traj.steps)):
                if turn >= args.turns:
                    break
                stream = turn % 2 == 1
                msgs = history(traj, upto, 4000)
                system, blocks = messages_history(traj, upto, 4000)
                for endpoint, res, n in (
                        ("chat", chat_turn(oc, msgs, f"bench-{traj.id}", stream, args.max_tokens), len(msgs)),
                        ("messages", messages_turn(ac, system, blocks, f"msg-{traj.id}", stream, args.max_tokens),
                         len(blocks))):
                    ext, wall = res["ext"], res["wall"]
                    lat = ext["latency_ms"]
                    rows[endpoint].append({
                        "trajectory": traj.id, "turn": turn, "stream": stream, "wall_ms": wall * 1000,
                        "ttft_ms": res["ttft_ms"], "actor_ms": lat["actor"],
                        "overhead_ms": wall * 1000 - lat["actor"], "plan_ms": lat["plan"], "embed_ms": lat["embed"],
                        "context_tokens": ext["tokens"]["context"], "messages": n})
                turn += 1
    out = {"machine": f"{platform.processor() or platform.machine()}, {__import__('os').cpu_count()} cores, no GPU",
           "turns": turn, "max_tokens": args.max_tokens, "budget": args.budget,
           # the chat proxy's figures stay at the top level (as before); the Messages endpoint's beside them
           **summary(rows["chat"]), "messages": summary(rows["messages"]),
           "overhead_p50_ms": {e: pct([r["overhead_ms"] for r in rows[e]], 50) for e in rows},
           "rows": rows}  # every turn, in the order sent
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    json.dump(out, sys.stdout, indent=2)
    print()


if __name__ == "__main__":
    main()
