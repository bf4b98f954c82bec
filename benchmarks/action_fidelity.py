"""Action fidelity of every policy (and a memory) at two budgets, in one run: `palimpsest eval-actions`.

    .venv/bin/python benchmarks/action_fidelity.py [--data FILE] [--memory models:/palimpsest-memory/N]
        [--budgets 2560,3072] [--window 8192] [--max-boundaries 20] [--policy-config FILE] [--half report]

Writes benchmarks/results/dev/eval_actions_<budget>.json (the command's --json output) and prints one
markdown table per budget: KL to the whole-history actor with its 95% interval, NLL, top-1, positions
and gap closed against `pace`. With a memory in the list, only trajectories the memory did not train on
are scored (for every row, so the rows compare on the same boundaries); the teacher cache is shared by
both budgets.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from palimpsest.pipelines.trajectories import hash_halves

ROOT = Path(__file__).resolve().parents[1]
DEV = ROOT.parent / "shared" / "data" / "trajectories" / "dev.jsonl"
POLICIES = "last2,window,rolling_summary,pace,ace,pace_plus,pace+empty,pace+memory"
REFERENCE = ROOT / "configs" / "replay" / "reference.yaml"


def run(data: Path, budget: int, window: int, policies: str, memory: str | None, max_boundaries: int,
        out: Path, policy_config: Path = REFERENCE) -> dict:
    cmd = [sys.executable, "-m", "palimpsest.cli", "eval-actions", "--data", str(data), "--policy", policies,
           "--policy-config", str(policy_config), "--budget", str(budget),
           "--window", str(window), "--max-boundaries", str(max_boundaries), "--reference", "pace", "--json"]
    if memory:
        cmd += ["--memory", memory]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if r.returncode != 0:
        raise SystemExit(f"eval-actions failed at budget {budget}:\n{r.stderr[-3000:]}")
    doc = json.loads(r.stdout)
    out.write_text(json.dumps(doc, indent=2) + "\n")
    return doc


def table(doc: dict) -> str:
    rows = ["| policy | KL (95% CI) | NLL | top-1 | positions | boundaries | gap closed vs pace |",
            "|---|---|---|---|---|---|---|"]
    for label, p in doc["policies"].items():
        g = doc["gap_closed"].get(label)
        lo, hi = p["kl_ci"]
        rows.append(f"| {label} | {p['kl']:.3f} ({lo:.3f}–{hi:.3f}) | {p['nll']:.3f} | {p['top1']:.3f} | "
                    f"{p['positions']:.0f} | {p['boundaries']} | {'-' if g is None else f'{g:+.3f}'} |")
    return "\n".join(rows)


def turn_table(doc: dict) -> str:
    """An epoch policy's two kinds of served turn apart: the boundary (the epoch's compaction) and the append
    turns after it (the chain as served); a per-turn policy plans every turn."""
    rows = ["| policy | served turn | boundaries | KL | top-1 | positions |", "|---|---|---|---|---|---|"]
    for label, p in doc["policies"].items():
        for kind, v in (p.get("by_turn") or {}).items():
            rows.append(f"| {label} | {kind} | {v['boundaries']} | {v['kl']:.3f} | {v['top1']:.3f} | "
                        f"{v['positions']:.0f} |")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=DEV)
    ap.add_argument("--memory", default=None, help="memory model for pace+memory (default: the latest registered)")
    ap.add_argument("--budgets", default="2560,3072")
    ap.add_argument("--window", type=int, default=8192)
    ap.add_argument("--max-boundaries", type=int, default=20)
    ap.add_argument("--policy", default=POLICIES)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "dev")
    ap.add_argument("--half", choices=("all", "fit", "report"), default="all",
                    help="a hash half of --data (pipelines.trajectories.hash_halves; relevance rows: report)")
    ap.add_argument("--policy-config", type=Path, default=REFERENCE,
                    help="labels -> policy configs (benchmarks/served_relevance.yaml: the predictor's rows)")
    args = ap.parse_args()
    if not args.data.is_file():
        raise SystemExit(f"no trajectories at {args.data}; pass --data FILE")
    args.out.mkdir(parents=True, exist_ok=True)
    if args.half != "all":
        args.data = hash_halves(args.data, tempfile.mkdtemp(prefix="halves-"))[args.half]
    for budget in (int(b) for b in args.budgets.split(",")):
        doc = run(args.data, budget, args.window, args.policy, args.memory, args.max_boundaries,
                  args.out / f"eval_actions_{budget}.json", args.policy_config)
        n = max(p["boundaries"] for p in doc["policies"].values())
        trajectories = max(p.get("trajectories", 0) for p in doc["policies"].values())
        print(f"\n### Budget {budget:,} (window {args.window:,}): {n} boundaries from {trajectories} trajectories"
              f"{' (held out from the memory)' if doc.get('held_out_only') else ''}\n")
        print(table(doc))
        print()
        print(turn_table(doc))
        print(f"\nteacher cache: {doc['teacher_cache']}")


if __name__ == "__main__":
    main()
