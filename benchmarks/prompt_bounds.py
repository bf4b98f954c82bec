"""What the actor receives stays within the budget, on every step of every trajectory of a file.

    python benchmarks/prompt_bounds.py [--data FILE] [--budget 8192] [--max-tokens 256]

For every step t of every trajectory and every budgeted policy, the turn is compiled exactly as
`palimpsest render --json` and serving compile it (the runtime, the compiler, ``platform/prompt/chat.py``, SmolLM2's
tokenizer and chat template, MiniLM keys) with ``max_tokens`` reserved, and checked:

- the prompt ids plus ``max_tokens`` are at most the budget;
- the ids decode to the prompt text, and that text re-tokenizes to the same number of ids;
- no turn fails: an oversized latest step is shown head and tail (counted as ``elided``).

Prints one row per policy and writes benchmarks/results/prompt_bounds.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from palimpsest.pipelines.trajectories import import_trajectory, read_trajectories
from palimpsest.platform.policies import parse_policy_config
from palimpsest.platform.types import BudgetError

sys.path.insert(0, str(Path(__file__).resolve().parent))
from replay_dev import default_data, runtime  # noqa: E402

from palimpsest.platform.compile.budget import Budget

POLICIES = ("window", "rolling_summary", "pace", "ace", "pace_plus")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=default_data())
    ap.add_argument("--budget", type=int, default=8192)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--ledger", type=Path, default=Path(".palimpsest/replay-smollm2.db"))
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/prompt_bounds.json"))
    args = ap.parse_args()
    if not args.data.is_file():
        sys.exit(f"no trajectories at {args.data}; pass --data FILE")
    rt, _ = runtime(args.ledger)
    tok = rt.ledger.tokenizer
    trajs = read_trajectories(args.data).trajectories
    for tr in trajs:
        import_trajectory(rt.ledger, tr)
        rt.enrich(tr.id)
    out = {"data": str(args.data), "budget": args.budget, "max_tokens": args.max_tokens,
           "tokenizer": tok.name, "policies": {}}
    print("| policy | turns | max ids + max_tokens | over budget | re-tokenized count differs | failed | elided | "
          "ms/turn p50 |\n|---|---|---|---|---|---|---|---|")
    for name in POLICIES:
        policy = rt.policy(parse_policy_config(name))
        turns = over = differ = failed = elided = 0
        most = 0
        ms = []
        for tr in trajs:
            full = rt.snapshot(tr.id)
            for t in range(len(tr.steps)):
                snap = full.upto(t)
                t0 = time.perf_counter()
                try:
                    ct = rt.compile(snap, policy, Budget(args.budget, args.max_tokens))
                except BudgetError:
                    failed += 1
                    continue
                ms.append((time.perf_counter() - t0) * 1000)
                p = ct.prompt
                turns += 1
                most = max(most, p.tokens + args.max_tokens)
                over += p.tokens + args.max_tokens > args.budget
                differ += tok.decode(p.ids) != p.text or len(tok.encode(p.text)) != p.tokens
                elided += bool(ct.plan.info.get("elided"))
        row = {"turns": turns, "max_total": most, "over_budget": over, "retokenized_differs": differ,
               "failed": failed, "elided": elided, "ms_p50": round(float(np.median(ms)), 1) if ms else None}
        out["policies"][name] = row
        print(f"| {name} | {turns} | {most} | {over} | {differ} | {failed} | {elided} | {row['ms_p50']} |", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
