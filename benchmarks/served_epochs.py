"""vLLM's own prefix-cache hit rate on the composed app: pace in compaction epochs beside pace planned per turn.

    .venv/bin/python benchmarks/served_epochs.py [--turns 55] [--budget 4096] [--memory] [--out FILE]

One long session per arm (the dev trajectories one after another, each opening with its task as a user
message, as `replay --concat` builds it), driven over HTTP as an agent does: append a step, ask a turn, in
step with the other arm, against one composed app (SmolLM2-135M on vLLM with prefix caching, MiniLM keys,
rule summaries so that the turns alone use the actor). The hit rate is vLLM's: the cached tokens it reports
per request (`num_cached_tokens`) over the prompt tokens, summed over each arm's turns, beside the prefix
reuse the ingress predicts from the ids (`platform/compile/epochs.py:turn_cost`) and the compactions per 100 turns.
The budget is sized for CPU prefill on 2 cores.

``--memory``: both arms inject the soft memory (the registered memory model; the demo's is trained first when
none is). The whole prompt then goes to vLLM as input embeddings, and its prefix cache hashes an embeds block
by its bytes: the hit rate shows whether the soft span, computed once per boundary and placed after the
compacted history, leaves the prefix cacheable (results: ``served_epochs_memory_BUDGET.json``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
POLICIES = {"pace": {"type": "pace"}, "pace-per-turn": {"type": "pace", "compaction": {"mode": "per_turn"}}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=ROOT.parent / "shared" / "data" / "trajectories" / "dev.jsonl")
    ap.add_argument("--turns", type=int, default=55, help="turns per arm")
    ap.add_argument("--budget", type=int, default=4096)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--port", type=int, default=8127)
    ap.add_argument("--work", type=Path, default=ROOT / ".palimpsest" / "bench-epochs")
    ap.add_argument("--memory", action="store_true", help="both arms with soft memory (prompt embeds)")
    ap.add_argument("--out", type=Path, default=None, help="default: benchmarks/results/served_epochs_BUDGET.json")
    args = ap.parse_args()
    kind = "memory_" if args.memory else ""
    args.out = args.out or ROOT / "benchmarks" / "results" / f"served_epochs_{kind}{args.budget}.json"
    arms = {f"{name.replace('pace', 'pace+memory')}" if args.memory else name: pol for name, pol in POLICIES.items()}
    if not args.data.is_file():
        sys.exit(f"no trajectories at {args.data}; pass --data FILE")
    from palimpsest.pipelines.replay_sessions import _concat_records
    from palimpsest.pipelines.trajectories import read_trajectories
    from palimpsest.platform import Ledger
    from palimpsest.serving.local import LocalServer

    records, _ = _concat_records(read_trajectories(args.data).trajectories)
    args.work.mkdir(parents=True, exist_ok=True)
    ledger = args.work / f"served-{time.strftime('%Y%m%d-%H%M%S')}.db"
    cfg = {"ledger": str(ledger), "embedder": "minilm", "budget": args.budget,
           "actor": {"model": "smollm2", "max_tokens": args.max_tokens},
           "summarizer": {"mode": "rule"},
           "arms": [{"name": name, "policy": pol, "weight": 1.0, "memory": args.memory} for name, pol in arms.items()]}
    if args.memory:
        from rich.console import Console

        from palimpsest.demo import DEMO_TRAIN, ensure_memory

        ref = ensure_memory(Console(stderr=True), DEMO_TRAIN, args.data)
        if ref is None:
            sys.exit("no memory model is registered and none could be trained")
        # what the memory reads, as the demo memory was trained (configs/serve/demo.yaml)
        cfg["memory"] = {"model": ref}  # it reads what its bundle says
    t0 = time.perf_counter()
    with LocalServer(cfg, port=args.port) as srv, httpx.Client(base_url=srv.url, timeout=1800) as client:
        ready_s = time.perf_counter() - t0
        sids = {arm: f"epochs-{arm}" for arm in arms}
        for arm, sid in sids.items():
            client.post("/v1/sessions", json={"session_id": sid, "arm": arm, "task": "Work through the tasks that "
                                              "arrive as user messages, one after another."}).raise_for_status()
        turns = {arm: 0 for arm in arms}
        for rec in records:
            for arm, sid in sids.items():
                client.post(f"/v1/sessions/{sid}/steps", json={
                    "kind": rec.kind, "thought": rec.thought, "action": rec.action, "observation": rec.observation,
                    "authority": rec.authority.value, "tool": rec.tool}).raise_for_status()
            if rec.t < 2:
                continue
            for arm, sid in sids.items():
                r = client.post(f"/v1/sessions/{sid}/turn", json={"max_tokens": args.max_tokens})
                r.raise_for_status()
                turns[arm] += 1
            print(f"turn {min(turns.values())}/{args.turns} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr,
                  flush=True)
            if min(turns.values()) >= args.turns:
                break
        metrics = client.get("/metrics").text
    served = [r for r in Ledger(ledger).served() if not r.get("error")]
    out = {"budget": args.budget, "max_tokens": args.max_tokens, "memory": cfg.get("memory"),
           "ready_s": round(ready_s, 1), "wall_s": round(time.perf_counter() - t0, 1), "arms": {}}
    for arm in arms:
        rows = [r for r in served if r["arm"] == arm]
        prompt = sum(r["tokens_prompt"] for r in rows)
        cached = sum(r["tokens_cached"] for r in rows)
        reuse = [r["prefix_reuse"] for r in rows if "prefix_reuse" in r]
        out["arms"][arm] = {
            "turns": len(rows), "vllm_hit_rate": round(cached / prompt, 4) if prompt else None,
            "vllm_cached_per_turn": round(cached / len(rows), 1), "prompt_per_turn": round(prompt / len(rows), 1),
            "uncached_per_turn": round((prompt - cached) / len(rows), 1),
            "predicted_prefix_reuse": round(statistics.mean(reuse), 4) if reuse else None,
            "compactions_per_100": round(100 * sum(bool(r.get("rebuilt")) for r in rows) / len(rows), 1),
            "soft_per_turn": round(statistics.mean(r.get("tokens_soft", 0) for r in rows), 1),
            "memory_cached_share": round(statistics.mean(bool(r.get("memory_cached")) for r in rows), 4),
            "actor_ms_p50": round(statistics.median(r["actor_ms"] for r in rows), 1),
            "total_ms_p50": round(statistics.median(r["total_ms"] for r in rows), 1)}
    out["metrics_cached_lines"] = [x for x in metrics.splitlines() if x.startswith("palimpsest_prefix_cached_tokens")]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
