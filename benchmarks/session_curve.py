"""One session grown through the HTTP API, and what a turn costs the ingress as it grows (docs/scaling.md).

The composed app on 127.0.0.1 (SmolLM2-135M on vLLM as the actor, one generated token; the hashing embedder;
rule summaries; one `pace` arm) takes one session's steps by ``POST /steps`` (synthetic agent steps, the
generator of plan_compile.py, several clients at once), and at each checkpoint M (default 1,000, 10,000 and
100,000 steps) serves ``--turns`` turns, each after one more append as an agent would. Reported per backend
and checkpoint: ingress overhead per turn (turn wall time at the client − actor time − memory time, p50/p95),
the turn's own `plan` stage (snapshot refresh + plan + compile + audit + the query wait), the append latency
at the client, and the growth rate.

    python benchmarks/session_curve.py                                        # SQLite, 1k / 10k / 100k
    python benchmarks/session_curve.py --backends sqlite postgresql --postgres postgresql://...
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from plan_compile import TASK, synthetic_step  # noqa: E402


def _pct(xs: list[float]) -> dict:
    xs = sorted(xs)
    return {"p50": round(statistics.median(xs), 2), "p95": round(xs[min(len(xs) - 1, int(0.95 * len(xs)))], 2),
            "n": len(xs)}


def _append(client: httpx.Client, sid: str, rec) -> float:
    t0 = time.perf_counter()
    r = client.post(f"/v1/sessions/{sid}/steps", json={"kind": rec.kind, "thought": rec.thought, "action": rec.action,
                                                       "observation": rec.observation, "tool": rec.tool})
    r.raise_for_status()
    return (time.perf_counter() - t0) * 1000


def grow(url: str, sid: str, start: int, stop: int, clients: int, rng: random.Random) -> dict:
    """Append steps start..stop-1 with ``clients`` concurrent clients (t assigned by the server)."""
    recs = [synthetic_step(rng, t) for t in range(start, stop)]
    lat: list[float] = []
    t0 = time.perf_counter()

    def run(chunk):
        with httpx.Client(base_url=url, timeout=120) as c:
            return [_append(c, sid, r) for r in chunk]

    with ThreadPoolExecutor(clients) as pool:
        for part in pool.map(run, [recs[i::clients] for i in range(clients)]):
            lat += part
    wall = time.perf_counter() - t0
    return {"appends": len(recs), "appends_per_s": round(len(recs) / wall, 1), "append_ms": _pct(lat)}


def turns(client: httpx.Client, sid: str, n: int, rng: random.Random, t_next: int) -> dict:
    over, plan, appends = [], [], []
    for k in range(n):
        appends.append(_append(client, sid, synthetic_step(rng, t_next + k)))
        t0 = time.perf_counter()
        r = client.post(f"/v1/sessions/{sid}/turn", json={"max_tokens": 1})
        wall = (time.perf_counter() - t0) * 1000
        r.raise_for_status()
        lat = r.json()["latency_ms"]
        over.append(wall - lat.get("actor", 0.0) - lat.get("memory", 0.0))
        plan.append(lat.get("plan", float("nan")))
    return {"ingress_overhead_ms": _pct(over), "plan_ms": _pct(plan), "append_ms": _pct(appends)}


def one_backend(ledger: str, sizes: list[int], n_turns: int, clients: int, port: int, budget: int) -> dict:
    from palimpsest.serving.local import LocalServer

    cfg = {"ledger": ledger, "embedder": "hashing", "budget": budget,
           "actor": {"model": "smollm2", "max_model_len": 4096, "max_tokens": 1},
           "summarizer": {"mode": "rule"}, "memory": {"model": None},
           "arms": [{"name": "pace", "policy": {"type": "pace"}}]}
    out: dict = {}
    rng = random.Random(0)
    sid = f"curve-{uuid.uuid4().hex[:8]}"
    with LocalServer(cfg, port=port) as srv, httpx.Client(base_url=srv.url, timeout=600) as client:
        client.post("/v1/sessions", json={"session_id": sid, "task": TASK, "system": "You are a coding agent."}
                    ).raise_for_status()
        have = 0
        for m in sizes:
            g = grow(srv.url, sid, have, m, clients, rng)
            have = m
            time.sleep(2.0)  # the enrichment lane catches up (a turn would fall back on what exists otherwise)
            cost = turns(client, sid, n_turns, rng, have)
            have += n_turns
            out[str(m)] = {**cost, "growth": g}
            print(f"  M={m}: overhead p50 {cost['ingress_overhead_ms']['p50']} ms, plan p50 {cost['plan_ms']['p50']} "
                  f"ms, growth {g['appends_per_s']} appends/s", file=sys.stderr)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[1000, 10000, 100000])
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--clients", type=int, default=4, help="concurrent appending clients while growing")
    ap.add_argument("--budget", type=int, default=2000)
    ap.add_argument("--port", type=int, default=8123)
    ap.add_argument("--backends", nargs="+", default=["sqlite"], choices=["sqlite", "postgresql"])
    ap.add_argument("--postgres", default=os.environ.get("PALIMPSEST_TEST_POSTGRES"))
    ap.add_argument("--out", default="benchmarks/results/session_curve.json")
    args = ap.parse_args()
    res = {"machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
           "sizes": args.sizes, "turns": args.turns, "budget": args.budget, "backends": {}}
    for backend in args.backends:
        print(f"{backend}:", file=sys.stderr)
        if backend == "sqlite":
            with tempfile.TemporaryDirectory() as d:
                res["backends"][backend] = one_backend(str(Path(d) / "curve.db"), args.sizes, args.turns,
                                                       args.clients, args.port, args.budget)
        else:
            if not args.postgres:
                raise SystemExit("--postgres URL (or $PALIMPSEST_TEST_POSTGRES) is needed for the postgresql backend")
            import psycopg

            schema = "curve_" + uuid.uuid4().hex[:8]
            with psycopg.connect(args.postgres, autocommit=True) as c:
                c.execute(f"CREATE SCHEMA {schema}")
            url = f"{args.postgres}{'&' if '?' in args.postgres else '?'}options=-csearch_path%3D{schema}"
            try:
                res["backends"][backend] = one_backend(url, args.sizes, args.turns, args.clients, args.port,
                                                       args.budget)
            finally:
                with psycopg.connect(args.postgres, autocommit=True) as c:
                    c.execute(f"DROP SCHEMA {schema} CASCADE")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
