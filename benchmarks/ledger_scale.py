"""The ledger's side of the capacity model (docs/scaling.md), on SQLite and PostgreSQL side by side.

For each backend and each M: one session of M synthetic agent steps (the generator of plan_compile.py)
appended in batches, enriched (rule summaries + 256-d hashing keys) and given ``--turns`` audited turns of
PACE. Reported per backend:

- rows and bytes per step (every table, indexes included: the SQLite file, or pg_total_relation_size);
- durable single-step append latency (p50 / p95 ms, one writer, one commit per step);
- appends per second with ``--writers`` processes on their own sessions (one commit per step);
- snapshot load time at M (what a turn reads whole, without the snapshot cache);
- platform time per turn at M (snapshot refresh, plan, compile, audit write) after one new step is appended
  and enriched: the first turn of a fresh runtime (its cache empty: the session read whole) apart from the
  following ``--turns`` turns (p50 / p95, the cache reads only what changed), with the same turns read whole
  beside them, and the cache's bytes per cached step (its own estimate: texts plus columns).

    python benchmarks/ledger_scale.py --postgres postgresql://user@127.0.0.1:5432/db   # both backends
    python benchmarks/ledger_scale.py                                                  # SQLite only
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from plan_compile import TASK, synthetic_step  # noqa: E402

from palimpsest.platform import Ledger, Runtime  # noqa: E402
from palimpsest.platform.compile.budget import Budget

TABLES = ("sessions", "steps", "representations", "abstractions", "keys", "audit", "served", "folds", "glimpses",
          "outcomes", "leases", "meta")


def _pg_schema(base: str) -> tuple[str, str]:
    import psycopg

    name = "bench_" + uuid.uuid4().hex[:8]
    with psycopg.connect(base, autocommit=True) as c:
        c.execute(f"CREATE SCHEMA {name}")
    return f"{base}{'&' if '?' in base else '?'}options=-csearch_path%3D{name}", name


def _drop(base: str, schema: str) -> None:
    import psycopg

    with psycopg.connect(base, autocommit=True) as c:
        c.execute(f"DROP SCHEMA {schema} CASCADE")


def _size(led: Ledger, url: str) -> tuple[dict, int]:
    rows = {t: led._read_one(f"SELECT COUNT(*) FROM {t}")[0] for t in TABLES}
    if led.backend == "sqlite":
        led._read_one("PRAGMA wal_checkpoint(TRUNCATE)")
        return rows, os.path.getsize(url)
    total = sum(led._read_one("SELECT pg_total_relation_size(?)", (t,))[0] for t in TABLES)
    return rows, total


def _writer(url: str, sid: str, n: int, q) -> None:
    import random

    led = Ledger(url, tokenizer="approx")
    led.create_session(sid, TASK)
    rng = random.Random(sid)
    recs = [synthetic_step(rng, t) for t in range(n)]
    t0 = time.perf_counter()
    for r in recs:
        led.append(sid, r)
    q.put(time.perf_counter() - t0)
    led.close()


def concurrent_appends(url: str, writers: int, n: int) -> float:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_writer, args=(url, f"w{writers}-{i}", n, q)) for i in range(writers)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    if any(p.exitcode for p in procs):
        raise RuntimeError("a writer failed (see its traceback above)")
    spans = [q.get(timeout=10) for _ in procs]
    return round(writers * n / max(spans), 1)  # the writers' own time: process start-up excluded


def _pct(xs: list[float]) -> dict:
    xs = sorted(xs)
    return {"p50": round(statistics.median(xs), 2), "p95": round(xs[min(len(xs) - 1, int(0.95 * len(xs)))], 2)}


def turn_cost(led: Ledger, sid: str, m: int, turns: int, rng) -> dict:
    """Platform time per turn with the snapshot cache (first turn apart) and without it, at M steps."""
    cached, whole = Runtime(led), Runtime(led, snapshot_cache_bytes=0)
    budget = 16000
    t = m

    def next_step() -> None:  # the agent's step, appended and enriched before the turn (not timed)
        nonlocal t
        cached.append(sid, synthetic_step(rng, t))
        t += 1

    next_step()
    t0 = time.perf_counter()
    cached.turn(sid, "pace", Budget(budget))
    first_ms = (time.perf_counter() - t0) * 1000
    with_cache, refresh = [], []
    for _ in range(turns):
        next_step()
        t0 = time.perf_counter()
        cached.snapshot(sid)
        refresh.append((time.perf_counter() - t0) * 1000)
        t0 = time.perf_counter()
        cached.turn(sid, "pace", Budget(budget))  # the refresh inside is a hit now: plan + compile + audit
        plan_ms = (time.perf_counter() - t0) * 1000
        with_cache.append(refresh[-1] + plan_ms)
    read_whole = []
    for _ in range(max(3, turns // 5)):
        next_step()
        t0 = time.perf_counter()
        whole.turn(sid, "pace", Budget(budget))
        read_whole.append((time.perf_counter() - t0) * 1000)
    entry_bytes = cached.snapshots.nbytes
    return {"first_turn_ms": round(first_ms, 1), "turn_ms": _pct(with_cache), "refresh_ms": _pct(refresh),
            "turn_ms_read_whole": _pct(read_whole), "cache_bytes_per_step": round(entry_bytes / max(t, 1))}


def one_backend(fresh, sizes: list[int], turns: int, appends: int, writers: int) -> dict:
    """``fresh()`` -> (url of a new empty ledger, cleanup)."""
    import random

    out: dict = {"by_m": {}}
    for m in sizes:
        url, cleanup = fresh()
        led = Ledger(url, tokenizer="approx")
        sid = f"bench-{m}"
        rt = Runtime(led)
        led.create_session(sid, TASK, system="You are a coding agent.")
        rng = random.Random(0)
        t0 = time.perf_counter()
        for start in range(0, m, 2000):
            led.append_many(sid, [synthetic_step(rng, t) for t in range(start, min(m, start + 2000))])
        rt.enrich(sid, batch=512)
        ingest_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        led.snapshot(sid, key_model=rt.embedder.name)
        load_ms = (time.perf_counter() - t0) * 1000
        cost = turn_cost(led, sid, m, turns, rng)
        rows, size = _size(led, url)
        steps = rows["steps"]
        out["by_m"][m] = {
            "ingest_s": round(ingest_s, 1), "snapshot_load_ms": round(load_ms, 1), **cost,
            "rows_per_step": {t: round(rows[t] / steps, 3) for t in ("representations", "abstractions", "keys")},
            "audit_rows_per_turn": 1, "bytes_per_step": round(size / steps), "total_bytes": size}
        led.close()
        cleanup()
    url, cleanup = fresh()
    led = Ledger(url, tokenizer="approx")
    led.create_session("latency", TASK)
    rng = random.Random(1)
    lat = []
    for t in range(appends):
        rec = synthetic_step(rng, t)
        t0 = time.perf_counter()
        led.append("latency", rec)
        lat.append((time.perf_counter() - t0) * 1000)
    lat.sort()
    out["append_ms"] = {"p50": round(statistics.median(lat), 2), "p95": round(lat[int(0.95 * len(lat))], 2)}
    led.close()
    out["appends_per_s"] = {f"{w} writers": concurrent_appends(url, w, appends) for w in (1, writers)}
    cleanup()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[1000, 10000])
    ap.add_argument("--turns", type=int, default=20)
    ap.add_argument("--appends", type=int, default=300, help="steps per writer in the latency and throughput runs")
    ap.add_argument("--writers", type=int, default=4)
    ap.add_argument("--postgres", default=os.environ.get("PALIMPSEST_TEST_POSTGRES"),
                    help="a PostgreSQL server URL (a fresh schema is made and dropped)")
    ap.add_argument("--backends", nargs="+", default=["sqlite", "postgresql"], choices=["sqlite", "postgresql"])
    ap.add_argument("--out", default="benchmarks/results/ledger_scale.json")
    args = ap.parse_args()
    result = {"machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
              "sizes": args.sizes, "turns": args.turns, "backends": {}}
    with tempfile.TemporaryDirectory() as d:
        def sqlite_fresh():
            path = Path(d) / f"{uuid.uuid4().hex[:8]}.db"
            return str(path), lambda: [p.unlink() for p in Path(d).glob(path.name + "*")]

        if "sqlite" in args.backends:
            result["backends"]["sqlite"] = one_backend(sqlite_fresh, args.sizes, args.turns, args.appends,
                                                       args.writers)
    if args.postgres and "postgresql" in args.backends:
        def pg_fresh():
            url, schema = _pg_schema(args.postgres)
            return url, lambda: _drop(args.postgres, schema)

        result["backends"]["postgresql"] = one_backend(pg_fresh, args.sizes, args.turns, args.appends, args.writers)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
