"""Serving figures of BENCHMARKS.md, in one run on this machine:

1. per-turn latency broken down (plan+compile, memory encode, actor) at p50 / p95 over >= 200 turns of the
   composed app over HTTP (SmolLM2-135M on vLLM, all-MiniLM-L6-v2, the registered memory model), and the
   ingress overhead (turn time minus actor and memory time);
2. throughput and p95 with 8 concurrent sessions;
3. vLLM prefix-cache hit rate when the compiled context keeps its stable prefix first, against a layout
   that reorders the prefix every turn (the same turns, the same engine, the cache reset in between).

    .venv/bin/python benchmarks/serve_latency.py [--data FILE] [--turns 200] [--out benchmarks/results/serve.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from palimpsest.experiments.stats import percentile as pct
from palimpsest.platform.compile.budget import Budget

ROOT = Path(__file__).resolve().parents[1]


skipped: list[str] = []


def session_traffic(client, traj, sid, n_turns, max_tokens, first=4):
    """Append steps as an agent would and ask a turn after each, from step ``first`` on; returns turn replies."""
    from palimpsest.pipelines.trajectories import to_record

    client.post("/v1/sessions", json={"session_id": sid, "task": traj.task, "system": traj.system,
                                      "tools": traj.tools}).raise_for_status()
    replies = []
    for s in traj.steps:
        if s.t >= first and len(replies) < n_turns:
            r = client.post(f"/v1/sessions/{sid}/turn", json={"max_tokens": max_tokens})
            if r.status_code == 422 and "cannot hold" in r.text:
                skipped.append(sid)  # the prefix and this step alone exceed the budget: not a servable turn
            else:
                r.raise_for_status()
                replies.append(r.json())
        rec = to_record(s)
        client.post(f"/v1/sessions/{sid}/steps", json={
            "t": rec.t, "kind": rec.kind, "thought": rec.thought, "action": rec.action, "observation": rec.observation,
            "authority": rec.authority.value, "tool": rec.tool}).raise_for_status()
        if len(replies) >= n_turns:
            break
    return replies


def breakdown(replies):
    lat = {k: [r["latency_ms"][k] for r in replies] for k in ("plan", "embed", "memory", "actor", "total")}
    overhead = [r["latency_ms"]["total"] - r["latency_ms"]["actor"] - r["latency_ms"]["memory"] for r in replies]
    # What the ingress itself costs once the embedder's model time (a separate deployment) is set aside.
    own = [o - r["latency_ms"]["embed"] for o, r in zip(overhead, replies)]
    out = {k: {"p50": pct(v, 0.5), "p95": pct(v, 0.95)} for k, v in lat.items()}
    out["ingress_overhead"] = {"p50": pct(overhead, 0.5), "p95": pct(overhead, 0.95)}
    out["ingress_overhead_without_embed_wait"] = {"p50": pct(own, 0.5), "p95": pct(own, 0.95)}
    out["turns"] = len(replies)
    out["context_tokens_mean"] = statistics.mean(r["tokens"]["context"] for r in replies)
    out["soft_tokens_mean"] = statistics.mean(r["tokens"]["soft"] for r in replies)
    return out


def from_ledger(path: Path) -> dict:
    """The serve figures from the served-turn records (the ingress records each turn's latency breakdown)."""
    from palimpsest.platform import Ledger

    rows = [r for r in Ledger(path).served() if not r.get("error")]
    def as_reply(r):
        return {"latency_ms": {k: r.get(f"{k}_ms", 0.0) for k in ("plan", "embed", "memory", "actor", "total")},
                "tokens": {"context": r["tokens_context"], "soft": r["tokens_soft"]}}

    seq = {arm: [as_reply(r) for r in rows if "-conc-" not in r["session_id"] and r["arm"] == arm]
           for arm in ("pace", "pace+memory")}
    conc_rows = [r for r in rows if "-conc-" in r["session_id"]]
    conc = [as_reply(r) for r in conc_rows]
    # Wall time of the concurrent phase: from the first turn's start to the last turn's end.
    start = min(r["created"] - r["total_ms"] / 1000 for r in conc_rows)
    wall = max(r["created"] for r in conc_rows) - start
    return {"sequential": {arm: breakdown(v) for arm, v in seq.items()},
            "concurrent": {"sessions": len({r["session_id"] for r in conc_rows}), "turns": len(conc), "wall_s": wall,
                           "turns_per_s": len(conc) / wall, **breakdown(conc)},
            "sequential_turns_per_s": 1000.0 / statistics.mean(r["latency_ms"]["total"] for r in seq["pace"]),
            "source": f"served-turn records of {path.name}"}


def serve_phase(args, trajs):
    from palimpsest.serving.local import LocalServer

    cfg = {"ledger": str(args.work / "bench-serve.db"), "embedder": "minilm", "budget": args.budget,
           "actor": {"model": "smollm2", "max_tokens": args.max_tokens},
           "summarizer": {"mode": "rule"},  # LLM summaries would share the 2 cores with the turns being timed
           "memory": {"model": "auto"},
           "arms": [{"name": "pace", "policy": {"type": "pace"}},
                    {"name": "pace+memory", "policy": {"type": "pace"}, "memory": True}]}
    results = {}
    with LocalServer(cfg, port=args.port) as srv, httpx.Client(base_url=srv.url, timeout=600) as client:
        results["memory_model"] = srv.info["memory"]["models"]["default"]["model"]
        stamp = time.strftime("%H%M%S")
        # 1. sequential turns, both arms (arm fixed per session by header-free sticky hash: we pick explicitly)
        replies = {"pace": [], "pace+memory": []}
        per_arm = args.turns // 2
        i = 0
        while min(len(v) for v in replies.values()) < per_arm:
            traj = trajs[i % len(trajs)]
            for arm in replies:
                if len(replies[arm]) >= per_arm:
                    continue
                sid = f"bench-{stamp}-{arm}-{i}"
                client.post("/v1/sessions", json={"session_id": sid, "task": traj.task, "system": traj.system,
                                                  "tools": traj.tools, "arm": arm}).raise_for_status()
                replies[arm] += session_traffic(client, traj, sid, per_arm - len(replies[arm]), args.max_tokens)
            i += 1
        results["sequential"] = {arm: breakdown(r) for arm, r in replies.items()}
        # 2. eight concurrent sessions (pace arm), the same number of turns each
        n_conc, per = args.concurrency, args.concurrent_turns

        def one(k):
            traj = trajs[k % len(trajs)]
            sid = f"bench-{stamp}-conc-{k}"
            client.post("/v1/sessions", json={"session_id": sid, "task": traj.task, "system": traj.system,
                                              "tools": traj.tools, "arm": "pace"}).raise_for_status()
            return session_traffic(client, traj, sid, per, args.max_tokens)

        t0 = time.perf_counter()
        with ThreadPoolExecutor(n_conc) as pool:
            conc = [r for rs in pool.map(one, range(n_conc)) for r in rs]
        wall = time.perf_counter() - t0
        seq = results["sequential"]["pace"]
        results["concurrent"] = {"sessions": n_conc, "turns": len(conc), "wall_s": wall,
                                 "turns_per_s": len(conc) / wall, **breakdown(conc)}
        results["sequential_turns_per_s"] = 1000.0 / statistics.mean(r["latency_ms"]["total"] for r in replies["pace"])
        del seq
    return results


async def prefix_cache_phase(args, trajs):
    """The same compiled turns sent to one engine twice: stable layout, then with the prefix moved each turn."""
    from palimpsest.pipelines.environment import open_runtime
    from palimpsest.pipelines.trajectories import import_trajectory
    from palimpsest.platform.prompt.chat import chat_ids
    from palimpsest.platform.types import BudgetError
    from palimpsest.serving.models.engine import ActorEngine
    from palimpsest.serving.serve_config import ActorConfig

    engine = ActorEngine(ActorConfig(model="smollm2", max_tokens=1))
    rt = open_runtime(args.work / "bench-prefix.db", "minilm", "smollm2")
    prompts = []
    for traj in trajs[: args.prefix_sessions]:
        import_trajectory(rt.ledger, traj)
        rt.enrich(traj.id)
        for t in range(4, min(len(traj.steps), 4 + args.prefix_turns)):
            try:
                ct = rt.turn(traj.id, "pace", Budget(args.budget), at=t, record=False)
            except BudgetError:  # the prefix and this step alone exceed the budget: not a servable turn
                continue
            prompts.append((traj.id, ct.prompt))
    rng = random.Random(0)
    out = {}
    for layout in ("stable", "reordered"):
        await engine.reset_prefix_cache()
        prompt_tokens = cached = 0
        for _, prompt in prompts:
            ids = prompt.ids
            if layout == "reordered":  # the same messages, the prefix moved behind the history every turn
                msgs = list(prompt.messages)
                head, rest = msgs[:2], msgs[2:]
                rng.shuffle(head)
                ids = chat_ids(rt.ledger.tokenizer, rest + head).all
            r = await engine.generate(ids=ids, max_tokens=1)
            prompt_tokens += r["prompt_tokens"]
            cached += r["cached_tokens"]
        out[layout] = {"turns": len(prompts), "prompt_tokens": prompt_tokens, "cached_tokens": cached,
                       "hit_rate": cached / max(prompt_tokens, 1)}
    engine.shutdown()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=ROOT.parent / "shared" / "data" / "trajectories" / "dev.jsonl")
    ap.add_argument("--turns", type=int, default=200, help="sequential turns (half per arm)")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--concurrent-turns", type=int, default=6, help="turns per concurrent session")
    ap.add_argument("--budget", type=int, default=3000)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--prefix-sessions", type=int, default=4)
    ap.add_argument("--prefix-turns", type=int, default=12)
    ap.add_argument("--port", type=int, default=8123)
    ap.add_argument("--work", type=Path, default=ROOT / ".palimpsest" / "bench")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "serve.json")
    ap.add_argument("--phases", default="serve,prefix", help="serve (latency, concurrency), prefix (cache hit rate)")
    ap.add_argument("--from-ledger", type=Path, default=None,
                    help="recompute the serve figures from the served-turn records of an earlier run's ledger")
    args = ap.parse_args()
    from palimpsest.pipelines.trajectories import read_trajectories

    if not args.data.is_file():
        sys.exit(f"no trajectories at {args.data}; pass --data FILE")
    args.work.mkdir(parents=True, exist_ok=True)
    phases = set(args.phases.split(","))
    if args.from_ledger is None:
        for f in args.work.glob("bench-*.db*"):
            f.unlink()
    trajs = sorted(read_trajectories(args.data).trajectories, key=lambda t: -len(t.steps))
    t0 = time.perf_counter()
    results = json.loads(args.out.read_text()) if args.out.is_file() else {}
    results.update({"machine": f"{os.cpu_count()} CPU cores, no GPU", "budget": args.budget,
                    "max_tokens": args.max_tokens})

    def save():
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2))

    if args.from_ledger is not None:
        results.update(from_ledger(args.from_ledger))
        save()
    elif "serve" in phases:
        results.update(serve_phase(args, trajs))
        results["skipped_turns"] = len(skipped)
        save()
    if "prefix" in phases:
        results["prefix_cache"] = asyncio.run(prefix_cache_phase(args, trajs))
        save()
    results["wall_s"] = time.perf_counter() - t0
    save()
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
