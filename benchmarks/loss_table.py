r"""Where the lost far needs went, side by side across runs of `compaction_epochs.py`.

    .venv/bin/python benchmarks/loss_table.py before=benchmarks/results/epochs_steps/before \
        after=benchmarks/results/range_lines/after_fixed "query epoch=benchmarks/results/epoch_query/whole:pace@epoch" \
        [--policies window,pace,ace] [--budgets 8192,16384]

Each argument is LABEL=DIR[:POLICY,...], a directory holding the `epochs.json` a replay wrote (one summary per
budget), and optionally the only rows to take from it (a run that adds a `--query` row repeats the others). For
every budget, policy and run: far recall, the far needs lost, and how the turn that lost each one showed its
source step (`full` = an oversized step shown head and tail, `detailed`, `brief`, `placeholder`, `hidden` in a
range), and billed ids per turn against `full`'s. Rows a run does not have (a `--query` row, say) are left out.
Prints markdown; reads only what the replays wrote.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

KINDS = ("full", "detailed", "brief", "placeholder", "drop")  # "drop": hidden in a range (the replay's name)


def load(path: Path) -> dict[int, dict]:
    """The summaries of one run by budget."""
    doc = json.loads((path / "epochs.json").read_text())
    return {int(s["budget"]): s for s in (doc if isinstance(doc, list) else [doc])}


def rows(runs: dict[str, dict[int, dict]], budget: int, policies: list[str],
         only: dict[str, set[str]] | None = None) -> list[str]:
    out = [f"**Budget {budget:,}** (epochs; far recall, far needs lost by how their source step was shown, "
           "billed ids per turn (x full))", "",
           "| policy | run | far recall | lost | full | detailed | brief | placeholder | hidden | billed/turn |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for name in policies:
        for label, by_budget in runs.items():
            summary = by_budget.get(budget)
            m = summary and summary["policies"].get(name)
            if not m or (only and only.get(label) and name not in only[label]):
                continue
            lost = m["far_lost"]
            full = summary["policies"].get("full", {}).get("billed_per_turn")
            ratio = f" ({m['billed_per_turn'] / full:.2f})" if full else ""
            out.append(f"| {name} | {label} | {m['need_recall_far']:.3f} | {sum(lost.get(k, 0) for k in KINDS)} | "
                       + " | ".join(str(lost.get(k, 0)) for k in KINDS)
                       + f" | {m['billed_per_turn']:,.0f}{ratio} |")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", help="LABEL=DIR[:POLICY,...] (a directory with epochs.json)")
    ap.add_argument("--policies", default="window,rolling_summary,pace,pace@epoch,ace,pace_plus,pace_plus@epoch")
    ap.add_argument("--budgets", default="", help="comma-separated (default: every budget of the first run)")
    args = ap.parse_args()
    runs: dict[str, dict[int, dict]] = {}
    only: dict[str, set[str]] = {}
    for spec in args.runs:
        label, sep, rest = spec.partition("=")
        folder, names = (rest, "") if (Path(rest) / "epochs.json").is_file() else rest.rpartition(":")[::2]
        if not sep or not label or not (Path(folder) / "epochs.json").is_file():
            raise SystemExit(f"{spec!r}: expected LABEL=DIR[:POLICY,...] with DIR/epochs.json")
        if label in runs:
            raise SystemExit(f"{spec!r}: the label {label!r} is used twice")
        runs[label] = load(Path(folder))
        only[label] = {n for n in names.split(",") if n}
    budgets = ([int(b) for b in args.budgets.split(",") if b]
               or sorted(next(iter(runs.values()))))
    missing = [b for b in budgets if not any(b in r for r in runs.values())]
    if missing:
        raise SystemExit(f"--budgets: no run has budget(s) {missing}")
    policies = [p for p in args.policies.split(",") if p]
    for name in sorted(set().union(*only.values()) - set(policies)):  # a filtered row follows its base policy
        base = name.split("@")[0]
        policies.insert(policies.index(base) + 1 if base in policies else len(policies), name)
    for budget in budgets:
        print("\n".join(rows(runs, budget, policies, only)) + "\n")


if __name__ == "__main__":
    main()
