"""A bounded load test of the composed app on 127.0.0.1: N concurrent sessions for T seconds.

Each session loops append-a-step / ask-a-turn (the agent loop) until the time is up. Reported: requests,
error rate by status, turn latency p50 / p95, throughput, and steps stored in the ledger against steps
acknowledged to clients (they must be equal: an acknowledged append is durable; nothing else is stored).

    .venv/bin/python benchmarks/load_test.py --sessions 8 --seconds 120 [--config configs/serve/local.yaml]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import httpx

from palimpsest.experiments.stats import percentile as pct

ROOT = Path(__file__).resolve().parents[1]


def worker(url, sid, traj, deadline, max_tokens, stats, lock):
    from palimpsest.pipelines.trajectories import to_record

    with httpx.Client(base_url=url, timeout=600) as c:
        r = c.post("/v1/sessions", json={"session_id": sid, "task": traj.task, "system": traj.system,
                                         "tools": traj.tools})
        with lock:
            stats["status"][r.status_code] += 1
        if r.status_code != 200:
            return
        acked = 0
        for s in traj.steps:
            if time.time() >= deadline:
                break
            rec = to_record(s)
            r = c.post(f"/v1/sessions/{sid}/steps", json={
                "t": rec.t, "kind": rec.kind, "thought": rec.thought, "action": rec.action,
                "observation": rec.observation, "authority": rec.authority.value, "tool": rec.tool})
            with lock:
                stats["status"][r.status_code] += 1
            if r.status_code != 200:
                break
            acked += 1
            if s.t < 2:
                continue
            t0 = time.perf_counter()
            r = c.post(f"/v1/sessions/{sid}/turn", json={"max_tokens": max_tokens})
            ms = (time.perf_counter() - t0) * 1000
            with lock:
                stats["status"][r.status_code] += 1
                if r.status_code == 200:
                    stats["turn_ms"].append(ms)
        with lock:
            stats["acked"][sid] = acked


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=120.0)
    ap.add_argument("--config", type=Path, default=None, help="serve config (default: embedded, rule summaries)")
    ap.add_argument("--data", type=Path, default=ROOT.parent / "shared" / "data" / "trajectories" / "dev.jsonl")
    ap.add_argument("--budget", type=int, default=3000)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--port", type=int, default=8124)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "load.json")
    args = ap.parse_args()
    from palimpsest.pipelines.trajectories import read_trajectories
    from palimpsest.platform import Ledger
    from palimpsest.serving.local import LocalServer
    from palimpsest.serving.serve_config import load_serve_config

    if not args.data.is_file():
        sys.exit(f"no trajectories at {args.data}; pass --data FILE")
    trajs = read_trajectories(args.data).trajectories
    work = ROOT / ".palimpsest" / "bench"
    work.mkdir(parents=True, exist_ok=True)
    ledger_path = work / "load.db"
    for f in work.glob("load.db*"):
        f.unlink()
    cfg = load_serve_config(args.config).model_copy(update={"ledger": str(ledger_path), "budget": args.budget})
    if args.config is None:
        cfg = cfg.model_copy(update={"summarizer": cfg.summarizer.model_copy(update={"mode": "rule"})})
    stats = {"status": Counter(), "turn_ms": [], "acked": {}}
    lock = threading.Lock()
    with LocalServer(cfg, port=args.port) as srv:
        stamp = time.strftime("%H%M%S")
        deadline = time.time() + args.seconds
        t0 = time.perf_counter()
        threads = [threading.Thread(target=worker, args=(srv.url, f"load-{stamp}-{k}", trajs[k % len(trajs)], deadline,
                                                         args.max_tokens, stats, lock)) for k in range(args.sessions)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        wall = time.perf_counter() - t0
    led = Ledger(ledger_path)
    stored = {sid: led.count(sid) for sid in stats["acked"]}
    verified = sum(led.verify(sid) for sid in stats["acked"])
    total = sum(stats["status"].values())
    errors = sum(n for code, n in stats["status"].items() if code >= 400)
    result = {
        "machine": f"{os.cpu_count()} CPU cores, no GPU", "sessions": args.sessions, "seconds": args.seconds,
        "wall_s": wall, "requests": total, "status": {str(k): v for k, v in sorted(stats["status"].items())},
        "error_rate": errors / max(total, 1), "turns": len(stats["turn_ms"]),
        "turns_per_s": len(stats["turn_ms"]) / wall,
        "turn_ms": {"p50": pct(stats["turn_ms"], 0.5), "p95": pct(stats["turn_ms"], 0.95)},
        "steps_acknowledged": sum(stats["acked"].values()), "steps_stored": sum(stored.values()),
        "steps_verified": verified,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    if result["steps_stored"] != result["steps_acknowledged"]:
        sys.exit("steps stored differ from steps acknowledged")


if __name__ == "__main__":
    main()
