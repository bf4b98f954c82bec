"""The A/B machinery's positive control: can the live report see a difference that is known to be there?

    .venv/bin/python benchmarks/ab_control.py [--demo] [--limit N] [--max-turns 2] [--first 4] [--budget B]
        [--window W] [--out FILE]

Runs `palimpsest demo --control`: the dev trajectories through the composed app on two arms, `pace` and the
deliberately weak `last2` (only the two previous steps), each trajectory once per arm, every turn scored for
shadow fidelity (the exact KL against the full-history reference). `last2` throws away nearly the whole
history, so its fidelity must come out significantly worse than pace's in the paired comparison; the report
says after how many trajectories (in the order driven) the difference first came out significant.

``--demo`` then runs the demo's own arms (`pace`, `window`, and `pace+memory` when the registered memory was
trained at the demo budget) in the same process, and prints the smallest difference of their paired fidelity
that the same number of sessions could detect at 80% power, beside the control's observed difference.
Results: ``benchmarks/results/ab_control.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def paired_rows(summary: dict) -> list[dict]:
    rows = []
    for arm, per in summary["paired"].items():
        for metric in ("kl:full", "top1:full", "kl:policy@window"):
            v = per[metric]
            rows.append({"arm": arm, "control": summary["control"], "metric": metric, "trajectories": v["n"],
                         "pairs": v["pairs"], "difference": v["mean"], "lo": v["lo"], "hi": v["hi"],
                         "significant": v["significant"], "sessions_needed": v["sessions_needed"], "mde": v["mde"],
                         "both_identical": v.get("both_identical")})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=ROOT.parent / "shared" / "data" / "trajectories" / "dev.jsonl")
    ap.add_argument("--demo", action="store_true", help="also run the demo's own arms and print their power")
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--max-turns", type=int, default=2, help="turns per session (at steps 4, 12, ...)")
    ap.add_argument("--first", type=int, default=4, help="the first turn comes after this many steps")
    ap.add_argument("--budget", type=int, default=None, help="the arms' budget (default: the demo's, 2,560)")
    ap.add_argument("--window", type=int, default=None, help="the actor's window, the reach of the `full` reference "
                                                             "(default: the demo's, 4,096)")
    ap.add_argument("--port", type=int, default=8131)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "ab_control.json")
    args = ap.parse_args()
    from rich.console import Console

    from palimpsest.demo import run_main_demo

    out = Console()
    result: dict = {"runs": {}}
    modes = [("control", True)] + ([("demo", False)] if args.demo else [])
    for name, control in modes:
        r = run_main_demo(out, args.data, port=args.port, max_turns=args.max_turns, limit=args.limit, control=control,
                          first=args.first, budget=args.budget, window=args.window)
        result["runs"][name] = {"paired": paired_rows(r["summary"]), "timings": r["timings"], "errors": len(r["errors"]),
                                "report": r["markdown"], "breakdown": r["breakdown"]}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2, default=str))  # each run as soon as it is done
    print("\n| run | arm − control | metric | trajectories (pairs) | difference [95% CI] | significant | "
          "significant after | detectable at 80% power |")
    print("|---|---|---|---|---|---|---|---|")
    for name, run in result["runs"].items():
        for row in run["paired"]:
            if not row["trajectories"]:
                continue
            after = f"{row['sessions_needed']} trajectories" if row["sessions_needed"] else "-"
            print(f"| {name} | `{row['arm']}` − `{row['control']}` | {row['metric']} | {row['trajectories']} "
                  f"({row['pairs']}) | {row['difference']:.4f} [{row['lo']:.4f}, {row['hi']:.4f}] | "
                  f"{'yes' if row['significant'] else 'no'} | {after} | {row['mde']:.4f} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2, default=str))
    print(f"\nresults: {args.out}")
    control = next((r for r in result["runs"]["control"]["paired"] if r["metric"] == "kl:full"), None)
    if control is None or not control["significant"]:
        print("the positive control was NOT significant: the A/B report cannot see last2 against pace", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
