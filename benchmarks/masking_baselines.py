"""The rules users pick instead, side by side with Palimpsest's policies, in one run: recall and what a turn costs.

    python benchmarks/masking_baselines.py                         # dev and dev_extra's report half, 8K and 16K
    python benchmarks/masking_baselines.py --data dev --budgets 16000 --no-sweep

Rows (every one with 128 ids reserved for the reply, the real embedder and the actor's tokenizer, as
``palimpsest replay``): ``full`` (the unbudgeted whole history), ``window``, ``pace``, ``ace``, ``pace_plus`` at their
defaults (compaction epochs), and the two published rules at their published defaults, in epochs and per turn:
``observation_masking`` (arXiv 2508.21433, M = 10) and ``clear_tool_uses`` (Anthropic's ``clear_tool_uses_20250919``:
trigger 100,000, keep 3). Then a small sweep of each rule: M in 3, 5, 20, 40; and clear_tool_uses with its trigger at
half the budget (its default never fires below 100,000 input tokens) and keep 3, 10, 30; each in epochs and per turn.

Matched cost: for each of pace, ace and pace_plus, the strongest peer row (window, either rule, any sweep point) whose
billed ids per turn are at most its own (x 1.05): the row a claim of "better" must name. Billed cost reads no need
label, so the match reads none either.

Data: ``dev.jsonl`` (10 trajectories) and the **report** half of ``dev_extra.jsonl`` (a hash of each trajectory's id,
``pipelines.trajectories.hash_halves``: 44 trajectories, 1,392 steps; the other 48 are the fit half, unused here).
Writes ``summary.json`` / ``summary.md`` per data file and budget and ``masking.json`` / ``masking.md`` (the tables of
BENCHMARKS.md) under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from palimpsest.evaluation.replay import run_replay, summary_markdown
from palimpsest.pipelines.trajectories import hash_halves
from palimpsest.platform.policies import parse_policy_config

sys.path.insert(0, str(Path(__file__).resolve().parent))
from replay_dev import RESERVE, default_data, runtime  # noqa: E402

OURS = ("pace", "ace", "pace_plus")
PEERS = ("window", "observation_masking", "clear_tool_uses")
PER_TURN = {"mode": "per_turn"}
#: A peer "at equal billed cost" may cost this much more than the row it is matched to.
MATCH_SLACK = 1.05


def rows(budget: int, sweep: bool) -> dict:
    out = {p: p for p in ("full", "window", "pace", "ace", "pace_plus", "observation_masking", "clear_tool_uses")}
    out["observation_masking@per_turn"] = {"type": "observation_masking", "compaction": PER_TURN}
    out["clear_tool_uses@per_turn"] = {"type": "clear_tool_uses", "compaction": PER_TURN}
    if sweep:
        for m in (3, 5, 20, 40):
            out[f"observation_masking m={m}"] = {"type": "observation_masking", "m": m}
            out[f"observation_masking m={m}@per_turn"] = {"type": "observation_masking", "m": m, "compaction": PER_TURN}
        for keep in (3, 10, 30):
            cfg = {"type": "clear_tool_uses", "trigger": budget // 2, "keep": keep}
            out[f"clear_tool_uses trigger={budget // 2} keep={keep}"] = cfg
            out[f"clear_tool_uses trigger={budget // 2} keep={keep}@per_turn"] = {**cfg, "compaction": PER_TURN}
    return {k: parse_policy_config(v) for k, v in out.items()}


def family(label: str) -> str:
    return label.split(" ")[0].split("@")[0]


def strongest_peer(pols: dict, ours: str) -> tuple[str, dict] | None:
    """The peer row with the best far recall (then strong recall) among those billing at most ``ours`` x slack."""
    cap = pols[ours]["billed_per_turn"] * MATCH_SLACK
    fits = [(k, m) for k, m in pols.items() if family(k) in PEERS and m["billed_per_turn"] <= cap]
    if not fits:
        return None
    return max(fits, key=lambda km: (km[1]["need_recall_far"] or 0.0, km[1]["need_recall_strong"] or 0.0))


def table(pols: dict) -> list[str]:
    full = pols.get("full", {}).get("billed_per_turn")
    lines = ["| policy | strong recall | far recall | 20+ | mean prompt ids | prefix kept | uncached/turn "
             "| billed/turn (x full) | compactions/100 |", "|---|---|---|---|---|---|---|---|---|"]
    for k, m in pols.items():
        x = f" ({m['billed_per_turn'] / full:.2f})" if full else ""
        lines.append(f"| {k} | {m['need_recall_strong']:.3f} | {m['need_recall_far']:.3f} | "
                     f"{m['recall_by_distance']['20+']:.3f} | {m['mean_tokens']:,.0f} | {m['prefix_reuse']:.3f} | "
                     f"{m['uncached_per_turn']:,.0f} | {m['billed_per_turn']:,.0f}{x} | {m['compactions_per_100']} |")
    return lines


def matched(pols: dict) -> list[str]:
    lines = ["| ours | billed/turn | strong / far | strongest peer at <= its billed (x 1.05) | billed/turn | "
             "strong / far | far: ours - peer |", "|---|---|---|---|---|---|---|"]
    for ours in OURS:
        m = pols[ours]
        peer = strongest_peer(pols, ours)
        if peer is None:
            lines.append(f"| {ours} | {m['billed_per_turn']:,.0f} | {m['need_recall_strong']:.3f} / "
                         f"{m['need_recall_far']:.3f} | (none as cheap) | - | - | - |")
            continue
        k, p = peer
        lines.append(f"| {ours} | {m['billed_per_turn']:,.0f} | {m['need_recall_strong']:.3f} / "
                     f"{m['need_recall_far']:.3f} | {k} | {p['billed_per_turn']:,.0f} | "
                     f"{p['need_recall_strong']:.3f} / "
                     f"{p['need_recall_far']:.3f} | {m['need_recall_far'] - p['need_recall_far']:+.3f} |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default="dev,extra-report", help="dev, extra-report, or both (comma-separated)")
    ap.add_argument("--budgets", default="8000,16000")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/masking"))
    ap.add_argument("--ledger", type=Path, default=Path(".palimpsest/replay-smollm2.db"))
    ap.add_argument("--no-sweep", action="store_true", help="the published defaults only")
    args = ap.parse_args()
    dev = default_data()
    files = {"dev": dev}
    if "extra-report" in args.data.split(","):
        files["extra-report"] = hash_halves(dev.parent / "dev_extra.jsonl", Path(tempfile.mkdtemp()))["report"]
    files = {k: v for k, v in files.items() if k in args.data.split(",")}
    rt, timer = runtime(args.ledger)
    report: dict = {"reserve": RESERVE, "match_slack": MATCH_SLACK, "runs": {}}
    md: list[str] = []
    for name, path in files.items():
        for budget in [int(b) for b in args.budgets.split(",")]:
            t0 = time.perf_counter()
            res = run_replay(rt, path, rows(budget, not args.no_sweep), budget, timer=timer, reserve=RESERVE)
            out = args.out / f"{name}-b{budget}"
            out.mkdir(parents=True, exist_ok=True)
            (out / "summary.json").write_text(json.dumps(res.summary, indent=2) + "\n")
            (out / "summary.md").write_text(summary_markdown(res.summary))
            pols = res.summary["policies"]
            seconds = round(time.perf_counter() - t0, 1)
            report["runs"][f"{name}@{budget}"] = {"data": res.summary["data"], "seconds": seconds,
                                                 "policies": pols, "strongest_peer": {
                                                     o: (strongest_peer(pols, o) or [None])[0] for o in OURS}}
            d = res.summary["data"]
            md += [f"### {name} ({d['trajectories']} trajectories, {d['steps']} steps), budget {budget:,} "
                   f"(128 reserved; {seconds:.0f} s)", "", *table(pols), "", *matched(pols), ""]
            print("\n".join(md[-(len(pols) + len(OURS) + 8):]), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "masking.json").write_text(json.dumps(report, indent=2) + "\n")
    (args.out / "masking.md").write_text("\n".join(md) + "\n")
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
