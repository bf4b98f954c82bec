"""The OpenAI proxy as an agent sees it (BENCHMARKS.md, "OpenAI proxy"): the served app with SmolLM2 on vLLM
and all-MiniLM-L6-v2, driven by the official ``openai`` client over HTTP on 127.0.0.1.

For each dev trajectory, the growing message list (assistant action, tool result) is resent every turn, as
an agent framework does, alternately with ``stream=False`` and ``stream=True`` (the same turns, one run):

- time to first token of a streamed turn (request sent -> first content delta), against the whole turn;
- proxy overhead per turn: the client's wall time minus the actor's generation time as the server reports
  it (recording the history, compiling the context, waiting for the query embedding, HTTP and Serve hops).

    .venv/bin/python benchmarks/proxy_stream.py [--data FILE] [--turns 40] [--out benchmarks/results/proxy_stream.json]
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
        msgs.append({"role": "assistant", "content": ((rec.thought + "\n") if rec.thought else "") + rec.action[:limit]})
        msgs.append({"role": "tool", "content": (rec.observation or "")[:limit]})
    return msgs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default=str(ROOT.parent / "shared" / "data" / "trajectories" / "dev.jsonl"))
    ap.add_argument("--turns", type=int, default=40)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--port", type=int, default=8471)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "proxy_stream.json"))
    args = ap.parse_args()

    from openai import OpenAI

    from palimpsest.pipelines.trajectories import read_trajectories
    from palimpsest.serving.local import LocalServer

    trajs = read_trajectories(args.data).trajectories
    ledger = ROOT / ".palimpsest" / f"proxy-bench-{int(time.time())}.db"
    cfg = {"ledger": str(ledger), "embedder": "minilm", "budget": 6000,
           "actor": {"model": "smollm2", "max_model_len": 8192, "max_tokens": args.max_tokens},  # tools by default
           "summarizer": {"mode": "rule"}, "memory": {"model": None},
           "arms": [{"name": "pace", "policy": {"type": "pace"}}]}
    rows = []
    with LocalServer(cfg, port=args.port) as srv:
        oc = OpenAI(base_url=f"{srv.url}/v1", api_key="unused", timeout=600)
        turn = 0
        for traj in trajs:
            for upto in range(2, len(traj.steps)):
                if turn >= args.turns:
                    break
                msgs = history(traj, upto, 4000)
                sid = f"bench-{traj.id}"
                stream = turn % 2 == 1
                t0 = time.perf_counter()
                if stream:
                    first, tail = None, None
                    for chunk in oc.chat.completions.create(model="smollm2", messages=msgs, user=sid, stream=True,
                                                            max_tokens=args.max_tokens, temperature=0):
                        if first is None and chunk.choices and chunk.choices[0].delta.content:
                            first = time.perf_counter()
                        if getattr(chunk, "palimpsest", None) or (chunk.model_extra or {}).get("palimpsest"):
                            tail = (chunk.model_extra or {}).get("palimpsest")
                    wall = time.perf_counter() - t0
                    ext = tail
                    ttft = ((first or time.perf_counter()) - t0) * 1000
                else:
                    r = oc.chat.completions.create(model="smollm2", messages=msgs, user=sid, max_tokens=args.max_tokens,
                                                   temperature=0)
                    wall = time.perf_counter() - t0
                    ext = (r.model_extra or {}).get("palimpsest")
                    ttft = None
                lat = ext["latency_ms"]
                rows.append({"stream": stream, "wall_ms": wall * 1000, "ttft_ms": ttft, "actor_ms": lat["actor"],
                             "overhead_ms": wall * 1000 - lat["actor"], "plan_ms": lat["plan"], "embed_ms": lat["embed"],
                             "context_tokens": ext["tokens"]["context"], "messages": len(msgs)})
                turn += 1
    out = {"machine": f"{platform.processor() or platform.machine()}, {__import__('os').cpu_count()} cores, no GPU",
           "turns": len(rows), "max_tokens": args.max_tokens}
    for name, sel in (("non_streamed", [r for r in rows if not r["stream"]]), ("streamed", [r for r in rows if r["stream"]])):
        out[name] = {k: {"p50": pct([r[k] for r in sel], 50), "p95": pct([r[k] for r in sel], 95)}
                     for k in ("wall_ms", "actor_ms", "overhead_ms", "plan_ms", "embed_ms", "context_tokens")}
        out[name]["turns"] = len(sel)
    streamed = [r for r in rows if r["stream"]]
    out["streamed"]["ttft_ms"] = {"p50": pct([r["ttft_ms"] for r in streamed], 50),
                                  "p95": pct([r["ttft_ms"] for r in streamed], 95)}
    out["streamed"]["ttft_share_of_turn_p50"] = statistics.median(r["ttft_ms"] / r["wall_ms"] for r in streamed)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    json.dump(out, sys.stdout, indent=2)
    print()


if __name__ == "__main__":
    main()
