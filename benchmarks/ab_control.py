"""The A/B machinery's controls: can the live report see a difference that is known to be there, and does it
stay quiet where there is none?

    .venv/bin/python benchmarks/ab_control.py [--demo] [--limit N] [--max-turns 1] [--first 8] [--budget B]
        [--window W] [--out FILE]

Runs `palimpsest demo --control` (experiments/controls.py): the dev trajectories through the composed app,
each once per arm: the weak `last2` (only the two previous steps, per turn), `pace` as users run it
(compaction epochs), `pace-per-turn`, and `pace-aa` (`pace` again), every turn scored for shadow fidelity
(the exact KL against the full-history reference). The positive controls are `pace` − `last2` and
`pace-per-turn` − `last2`; the A/A control is `pace-aa` − `pace`. Defaults: budget 4,096, an 8K reference
window, one turn per session at step 8 (``CONTROL_SHAPE``).

``--demo`` then runs the demo's own arms in the same process and prints the smallest difference of their
paired fidelity that the same test could detect at 80% power. Results: ``benchmarks/results/ab_controls.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def paired_rows(summary: dict | None) -> list[dict]:
    rows = []
    for arm, per in (summary or {}).get("paired", {}).items():
        for metric in ("kl:full", "top1:full", "kl:policy@window"):
            v = per[metric]
            rows.append({"arm": arm, "control": summary["control"], "metric": metric, "trajectories": v["n"],
                         "pairs": v["pairs"], "difference": v["mean"], "lo": v["lo"], "hi": v["hi"], "p": v["p"],
                         "significant": v["significant"], "mde": v["mde"], "both_identical": v.get("both_identical"),
                         "turn_kinds": per.get("turn_kinds"), "unpaired": per.get("unpaired")})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=ROOT.parent / "shared" / "data" / "trajectories" / "dev.jsonl")
    ap.add_argument("--demo", action="store_true", help="also run the demo's own arms and print their power")
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--max-turns", type=int, default=None, help="turns per session (default: the controls' 1)")
    ap.add_argument("--first", type=int, default=None, help="the first turn comes after this many steps (default 8)")
    ap.add_argument("--budget", type=int, default=None, help="the arms' budget (default: the controls' 4,096)")
    ap.add_argument("--window", type=int, default=None, help="the actor's window, the reach of the `full` reference "
                                                             "(default: the controls' 8,192)")
    ap.add_argument("--port", type=int, default=8131)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "ab_controls.json")
    args = ap.parse_args()
    from rich.console import Console

    from palimpsest.demo import run_main_demo

    out = Console(soft_wrap=True)
    result: dict = {"runs": {}}
    modes = [("control", True)] + ([("demo", False)] if args.demo else [])
    for name, control in modes:
        r = run_main_demo(out, args.data, port=args.port, max_turns=args.max_turns, limit=args.limit, control=control,
                          first=args.first, budget=args.budget, window=args.window)
        result["runs"][name] = {"paired": paired_rows(r["summary"]) + paired_rows(r.get("aa")),
                                "verdicts": r.get("verdicts"), "timings": r["timings"], "errors": len(r["errors"]),
                                "report": r["markdown"], "breakdown": r["breakdown"],
                                "summary": r["summary"], "aa": r.get("aa")}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2, default=str))  # each run as soon as it is done
    print("\n| run | arm − control | metric | trajectories (pairs) | difference [95% interval] | p | significant | "
          "detectable at 80% power |")
    print("|---|---|---|---|---|---|---|---|")
    for name, run in result["runs"].items():
        for row in run["paired"]:
            if not row["trajectories"]:
                continue
            print(f"| {name} | `{row['arm']}` − `{row['control']}` | {row['metric']} | {row['trajectories']} "
                  f"({row['pairs']}) | {row['difference']:.4f} [{row['lo']:.4f}, {row['hi']:.4f}] | {row['p']:.3f} | "
                  f"{'yes' if row['significant'] else 'no'} | {row['mde']:.4f} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2, default=str))
    print(f"\nresults: {args.out}")
    verdicts = result["runs"]["control"]["verdicts"] or {}
    per_turn = next((r for r in verdicts.get("positive", []) if r["arm"] == "pace-per-turn"), {})
    failed = []
    if not per_turn.get("significant") or per_turn.get("difference", 0) >= 0:
        failed.append("the positive control (pace-per-turn closer than last2) was not significant")
    if verdicts.get("aa_status") == "failed":
        failed.append("the A/A control failed: two arms of one configuration differ")
    for why in failed:
        print(why, file=sys.stderr)
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
