"""The replay comparison of BENCHMARKS.md: every policy side by side, in one run, on one data file.

    python benchmarks/replay_dev.py                                   # ../shared dev split, 8K and 16K
    python benchmarks/replay_dev.py --data FILE --budgets 16000 --out benchmarks/results/x

For each budget: full (unbudgeted reference), window, rolling_summary, pace, ace, pace_plus at their
default configs; then the fair fight: window's K and rolling_summary's threshold are searched so
that each spends about the same mean tokens as pace_plus. Finally the longevity run: the whole file
as one concatenated session (--concat). Writes summary JSON per run under --out and prints the tables.
Uses the real embedder (all-MiniLM-L6-v2) and the actor's tokenizer (SmolLM2), as `palimpsest replay`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from palimpsest.evaluation.replay import run_replay, summary_markdown, write_outputs
from palimpsest.pipelines.replay_sessions import TimedEmbedder
from palimpsest.platform import Ledger, Runtime
from palimpsest.platform.policies import parse_policy_config

POLICIES = ["full", "last2", "window", "rolling_summary", "pace", "pace_task_first", "ace", "pace_plus"]
# The floor and the paper's query order, beside the defaults (configs/replay/reference.yaml).
VARIANTS = {"last2": {"type": "window", "k": 2, "compaction": {"mode": "per_turn"}},
            "pace_task_first": {"type": "pace", "query": "task_first"}}


# Every prompt keeps room for the reply, as serving does (the serve config's default actor.max_tokens).
RESERVE = 128


def configs() -> dict:
    return {p: parse_policy_config(VARIANTS.get(p, p)) for p in POLICIES}


def default_data() -> Path:
    root = os.environ.get("PALIMPSEST_SHARED") or Path(__file__).resolve().parents[2] / "shared"
    return Path(root) / "data" / "trajectories" / "dev.jsonl"


def runtime(ledger: Path) -> tuple[Runtime, TimedEmbedder]:
    from palimpsest.models.assets import smollm2_tokenizer_dir
    from palimpsest.models.embedder import MiniLMEmbedder

    timer = TimedEmbedder(MiniLMEmbedder())
    return Runtime(Ledger(ledger, tokenizer=str(smollm2_tokenizer_dir())), embedder=timer), timer


def match_tokens(rt, timer, data, budget, make, values, target) -> tuple[object, dict]:
    """The config (from ``make(v)`` over ``values``) whose mean tokens are closest to ``target``."""
    best = None
    for v in values:
        cfg = make(v)
        m = run_replay(rt, data, {"x": cfg}, budget, timer=timer, reserve=RESERVE).summary["policies"]["x"]
        gap = abs(m["mean_tokens"] - target)
        if best is None or gap < best[0]:
            best = (gap, cfg, m)
    return best[1], best[2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=default_data())
    ap.add_argument("--budgets", default="8000,16000")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/dev"))
    ap.add_argument("--ledger", type=Path, default=Path(".palimpsest/replay-smollm2.db"))
    ap.add_argument("--no-concat", action="store_true")
    ap.add_argument("--no-fair", action="store_true", help="skip the token-matched window / rolling_summary search")
    args = ap.parse_args()
    if not args.data.is_file():
        sys.exit(f"no trajectories at {args.data}; pass --data FILE")
    rt, timer = runtime(args.ledger)
    budgets = [int(b) for b in args.budgets.split(",")]
    report: dict = {"data": str(args.data), "budgets": {}}
    for budget in budgets:
        t0 = time.perf_counter()
        res = run_replay(rt, args.data, configs(), budget, timer=timer, reserve=RESERVE)
        write_outputs(res, args.out / f"b{budget}")
        pols = res.summary["policies"]
        target = pols["pace_plus"]["mean_tokens"]
        report["budgets"][budget] = {"summary": res.summary, "seconds": round(time.perf_counter() - t0, 1)}
        print(summary_markdown(res.summary), flush=True)
        if args.no_fair:
            continue
        win_cfg, win = match_tokens(rt, timer, args.data, budget,
                                    lambda k: parse_policy_config({"type": "window", "k": k}),
                                    [1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32], target)
        rs_cfg, rs = match_tokens(
            rt, timer, args.data, budget,
            lambda f: parse_policy_config({"type": "rolling_summary", "trigger_fraction": f, "keep_last": 2}),
            [0.1, 0.15, 0.2, 0.25, 0.3, 0.35, 0.4, 0.5, 0.6, 0.7, 0.8], target)
        report["budgets"][budget] = {
            "summary": res.summary,
            "fair": {"window": {"config": win_cfg.model_dump(mode="json"), "metrics": win},
                     "rolling_summary": {"config": rs_cfg.model_dump(mode="json"), "metrics": rs}},
            "seconds": round(time.perf_counter() - t0, 1),
        }
        print(f"fair fight at ~{target:.0f} mean tokens: window k={win_cfg.k} -> {win['mean_tokens']} tokens, "
              f"recall {win['need_recall_strong']} (20+: {win['recall_by_distance']['20+']}); rolling_summary "
              f"trigger {rs_cfg.trigger_fraction} -> {rs['mean_tokens']} tokens, recall {rs['need_recall_strong']} "
              f"(20+: {rs['recall_by_distance']['20+']})\n", flush=True)
    if not args.no_concat:
        for budget in budgets:
            res = run_replay(rt, args.data, configs(), budget, concat=True, timer=timer, reserve=RESERVE)
            write_outputs(res, args.out / f"concat-b{budget}")
            report["budgets"][budget]["concat"] = res.summary
            print(summary_markdown(res.summary))
            for name, m in res.summary["policies"].items():
                print(f"  {name}: recall by window of 250 steps "
                      f"{[w['need_recall_strong'] for w in m['recall_by_window']]}")
            print(flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "comparison.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
