"""Plan + compile cost per turn over synthetic ledgers of M stored steps (embeddings present).

For each M, one session of M synthetic agent steps is written to a fresh SQLite ledger and enriched
(rule summaries + hashing-embedder keys), its snapshot is loaded once, and then every policy plans and
compiles the next turn ``--repeat`` times at ``--budget`` tokens. Reported: p50 / p95 milliseconds of
plan + compile (the per-turn work a policy adds, query embedding included), and, separately, the time to
load the snapshot from SQLite.

    python benchmarks/plan_compile.py                       # M = 1,000 / 10,000 / 100,000
    python benchmarks/plan_compile.py --sizes 1000 --repeat 50
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import tempfile
import time
from pathlib import Path

from palimpsest.platform import Ledger, Runtime, StepRecord
from palimpsest.platform.compile.budget import Budget

POLICIES = ["full", "window", "rolling_summary", "pace", "ace", "pace_plus"]
TASK = "Fix the KeyError raised by parse_config in settings/loader.py when DATABASE_URL is missing from the env file."
WORDS = ["parse_config", "database_url", "settings/loader.py", "pool_size", "KeyError", "env_file",
         "tests/test_loader.py",
         "load_dotenv", "Config", "os.environ", "validate_url", "retry_count", "logging.getLogger", "schema_v2"]


def synthetic_step(rng: random.Random, t: int) -> StepRecord:
    ident = f"{rng.choice(WORDS)}_{rng.randrange(10_000)}"
    path = f"pkg/mod_{rng.randrange(500)}/file_{rng.randrange(50)}.py"
    cmd = rng.choice([f"grep -n {ident} {path}", f"cat {path}", f"python -m pytest {path} -k {ident}",
                      f"sed -n '{rng.randrange(900)},+20p' {path}"])
    lines = [f"{rng.randrange(1, 999)}: def {ident}(x): return {rng.choice(WORDS)}(x, {rng.randrange(100)})"
             for _ in range(rng.randrange(1, 12))]
    if rng.random() < 0.1:
        lines.append(f"Traceback (most recent call last):\nKeyError: '{ident}'")
    return StepRecord(t=t, kind="bash", action=cmd, thought=f"Look at {ident}.", observation="\n".join(lines),
                      tool=cmd.split()[0])


def build(path: Path, m: int, seed: int = 0, tokenizer: str | None = None) -> tuple[Ledger, Runtime, float]:
    # bulk load; the durability of one append is not what is measured
    led = Ledger(path, tokenizer=tokenizer, synchronous="NORMAL")
    rt = Runtime(led)
    led.create_session("bench", TASK, system="You are a coding agent.")
    rng = random.Random(seed)
    t0 = time.perf_counter()
    for start in range(0, m, 5000):
        led.append_many("bench", [synthetic_step(rng, t) for t in range(start, min(m, start + 5000))])
    rt.enrich("bench", batch=512)
    return led, rt, time.perf_counter() - t0


def measure(rt: Runtime, budget: int, repeat: int) -> dict:
    # One live turn per policy first: rolling_summary stores its fold, as it would after its first
    # fold in production, so the turns measured below are its steady state.
    for name in POLICIES:
        rt.turn("bench", name, Budget(budget), record=False)
    t0 = time.perf_counter()
    snap = rt.snapshot("bench")
    load_s = time.perf_counter() - t0
    out = {"snapshot_load_ms": round(load_s * 1000, 1), "policies": {}}
    for name in POLICIES:
        pol = rt.policy(name)
        rt.compile(snap, pol, Budget(budget))  # warm caches (the ACE elasticizer caches per-step salient sets)
        times, tokens = [], 0
        for _ in range(repeat):
            t1 = time.perf_counter()
            turn = rt.compile(snap, pol, Budget(budget))
            times.append((time.perf_counter() - t1) * 1000)
            tokens = turn.prompt.tokens
        times.sort()
        out["policies"][name] = {"p50_ms": round(statistics.median(times), 2),
                                 "p95_ms": round(times[min(len(times) - 1, int(0.95 * len(times)))], 2),
                                 "tokens": tokens, "visible": int((turn.plan.resolution < 4).sum())}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1000,10000,100000")
    ap.add_argument("--budget", type=int, default=16_000)
    ap.add_argument("--repeat", type=int, default=21)
    ap.add_argument("--json", action="store_true", help="print the results as JSON only")
    ap.add_argument("--tokenizer", default="smollm2",
                    help="smollm2 (the actor's tokenizer and chat template: what is served), approx, or a path")
    args = ap.parse_args()
    if args.tokenizer == "smollm2":
        from palimpsest.models.assets import smollm2_tokenizer_dir

        args.tokenizer = str(smollm2_tokenizer_dir())
    sizes = [int(s) for s in args.sizes.split(",")]
    results = {"machine": f"{platform.machine()}, {platform.python_version()}, {__import__('os').cpu_count()} cpus",
               "budget": args.budget, "repeat": args.repeat, "tokenizer": Path(args.tokenizer).name, "sizes": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for m in sizes:
            led, rt, build_s = build(Path(tmp) / f"m{m}.db", m, tokenizer=args.tokenizer)
            r = measure(rt, args.budget, args.repeat)
            r["build_and_enrich_s"] = round(build_s, 1)
            results["sizes"][m] = r
            led.close()
            if not args.json:
                print(f"M={m:>7,}: built+enriched in {build_s:.1f}s, snapshot load {r['snapshot_load_ms']} ms",
                      flush=True)
    if args.json:
        print(json.dumps(results, indent=2))
        return
    print(f"\nplan + compile per turn, p50 (p95) ms, budget {args.budget}, {args.repeat} turns each; "
          f"{results['machine']}")
    print("| policy | " + " | ".join(f"M = {m:,}" for m in sizes) + " |")
    print("|---|" + "---|" * len(sizes))
    for name in POLICIES:
        cells = [f"{results['sizes'][m]['policies'][name]['p50_ms']} "
                 f"({results['sizes'][m]['policies'][name]['p95_ms']})"
                 for m in sizes]
        print(f"| {name} | " + " | ".join(cells) + " |")
    print("| snapshot load (once per session, not per turn) | "
          + " | ".join(f"{results['sizes'][m]['snapshot_load_ms']}" for m in sizes) + " |")


if __name__ == "__main__":
    main()
