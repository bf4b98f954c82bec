"""The rollout gate on live traffic (BENCHMARKS.md, "The rollout gate on live traffic"): dev trajectories replayed
through the HTTP endpoint, served by `pace`, with two dark candidates judged on the same turns:

- `window-k1`: `window` with k = 1 (the latest step only), worse by construction: the gate must withdraw it;
- `pace-aa`: `pace` itself under another name (an A/A): the gate must neither withdraw it nor promote it as better.

The app is `configs/serve/demo.yaml` (SmolLM2, MiniLM, every turn scored against the full-history reference up to
its 4,096 window) at budget 3,584, with those arms and no memory. Each trajectory is one session with one turn
(`--first`); the gate reads one difference per session, at `ab.gate_alpha` over the two candidates gated at once.
The script waits until every sampled turn is scored and the gate has read every pair, then records the stages,
every decision with its evidence and the pairs.

    .venv/bin/python benchmarks/rollout_live.py [--limit 40] [--first 16] [--out benchmarks/results/rollout_live.json]
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
# dev_extra: 92 trajectories (dev has 10); nothing is fitted here, the gate only reads the pairs
DATA = ROOT.parent / "shared" / "data" / "trajectories" / "dev_extra.jsonl"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default=str(DATA))
    ap.add_argument("--limit", type=int, default=40, help="trajectories (sessions)")
    ap.add_argument("--first", type=int, default=16, help="the history length at the session's one turn")
    ap.add_argument("--budget", type=int, default=3584, help="the turn's budget (the reference window is 4,096)")
    ap.add_argument("--port", type=int, default=8476)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "rollout_live.json"))
    args = ap.parse_args()

    from palimpsest.experiments.gate import status
    from palimpsest.experiments.live import drive
    from palimpsest.platform import Ledger
    from palimpsest.platform.config_files import read_yaml
    from palimpsest.serving.local import LocalServer

    cfg = read_yaml(ROOT / "configs" / "serve" / "demo.yaml", "serve config")
    ledger = ROOT / ".palimpsest" / f"rollout-live-{int(time.time())}.db"
    cfg.update(ledger=str(ledger), budget=args.budget, memory={**cfg.get("memory", {}), "model": None},
               arms=[{"name": "pace", "policy": {"type": "pace"}, "weight": 1.0},
                     {"name": "window-k1", "policy": {"type": "window", "k": 1}, "candidate_of": "pace"},
                     {"name": "pace-aa", "policy": {"type": "pace"}, "candidate_of": "pace"}])
    out: dict = {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, no GPU",
                 "data": args.data, "limit": args.limit, "first": args.first, "config": cfg}
    t0 = time.perf_counter()
    with LocalServer(cfg, port=args.port) as srv:
        res = drive(srv.url, Path(args.data), prefix="live-", every=10_000, first=args.first, max_turns=1,
                    limit=args.limit, concurrency=2, tail=False, max_tokens=cfg["actor"]["max_tokens"])
        out["traffic"] = {"sessions": len(res.sessions), "turns": res.turns, "errors": res.errors[:10],
                          "wall_s": round(res.wall_s, 1)}
        with httpx.Client(base_url=srv.url, timeout=3700) as c:
            out["shadow"] = c.get("/v1/ab/shadow", params={"wait_s": 3600}).json()
            time.sleep(3 * cfg["ab"]["refresh_s"])  # the gate reads the last pairs at its next refresh
            out["readyz"] = c.get("/readyz").json().get("rollouts")
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    with Ledger(str(ledger)) as led:
        out["status"] = status(led)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2, default=float))
    json.dump({k: out[k] for k in ("traffic", "wall_s", "status")}, sys.stdout, indent=2, default=float)
    print()


if __name__ == "__main__":
    main()
