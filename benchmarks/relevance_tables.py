r"""Replay tables on the hash halves of dev_extra: recall, the lost far needs by resolution, and the cost per turn.

    .venv/bin/python benchmarks/relevance_tables.py --half report --budgets 16384,8192 \
        --policies full,window,pace,pace_plus --out benchmarks/results/relevance/report
    .venv/bin/python benchmarks/relevance_tables.py --half fit --policies full,pace,pace+predictor \
        --predictor models:/palimpsest-relevance/latest --out benchmarks/results/relevance/fit

The file (`--data`, dev_extra.jsonl by default) is split by a hash of each trajectory's id
(`pipelines.trajectories.hash_halves`): `fit` is what every choice was made on, `report` what is reported. Each
policy runs at its default config in compaction epochs; `NAME+predictor` is NAME with `relevance: {model:
--predictor}` (pace, pace_plus), scored by the registered relevance predictor where one is found (the row
refuses to run when none is found, so a row never silently falls back to the cosine). 128 tokens
are reserved for the reply; billed = uncached + 0.1 x cached, against the previous turn's ids (a prefix cache
holds their common prefix in 16-token blocks). Writes `epochs.json` (one summary per budget, what
`benchmarks/loss_table.py` reads), `epochs.md` and the per-step Parquet under --out.

    .venv/bin/python benchmarks/relevance_tables.py --table DIR [DIR ...]   # one table from several runs
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from compaction_epochs import table  # noqa: E402
from replay_dev import RESERVE, runtime  # noqa: E402

from palimpsest.evaluation.replay import run_replay, write_outputs  # noqa: E402
from palimpsest.pipelines.trajectories import hash_halves  # noqa: E402
from palimpsest.platform.policies import parse_policy_config  # noqa: E402

PREDICTED = ("pace", "pace_plus")


def default_data() -> Path:
    return Path(__file__).resolve().parents[2] / "shared" / "data" / "trajectories" / "dev_extra.jsonl"


def configs(names: list[str], predictor: str | None) -> dict:
    out = {}
    for name in names:
        base, _, variant = name.partition("+")
        if variant not in ("", "predictor") or (variant and base not in PREDICTED):
            raise SystemExit(f"--policies: {name!r}: NAME or NAME+predictor (NAME one of {', '.join(PREDICTED)})")
        if variant and not predictor:
            raise SystemExit(f"--policies: {name!r} needs --predictor")
        cfg: dict = {"type": base}
        if base == "last2":
            cfg = {"type": "window", "k": 2, "compaction": {"mode": "per_turn"}}
        if variant:
            cfg["relevance"] = {"model": predictor}
        out[name] = parse_policy_config(cfg)
    return out


def combined(dirs: list[Path]) -> str:
    """One table per budget from several runs' ``epochs.json`` (a half each): per half and policy, recall, billed and
    uncached ids per turn against `full`'s, and the lost far needs by how their source step was shown."""
    by_budget: dict[int, list[dict]] = {}
    for d in dirs:
        for s in json.loads((d / "epochs.json").read_text()):
            by_budget.setdefault(int(s["budget"]), []).append(s)
    out = []
    for budget, runs in sorted(by_budget.items(), reverse=True):
        out += [f"**Budget {budget:,}** (128 reserved; billed = uncached + 0.1 x cached, per turn; x full: against "
                "`full` on the same half)", "",
                "| half | policy | strong | far | billed/turn (x full) | uncached/turn (x full) | lost far: detailed / "
                "brief / placeholder / hidden / full |", "|---|---|---|---|---|---|---|"]
        for s in runs:
            pols = s["policies"]
            full = pols.get("full", {})
            for name, m in pols.items():
                if name == "full":
                    continue
                lost = m["far_lost"]
                out.append(f"| {s['part']} ({s['data']['trajectories']}) | {name} | {m['need_recall_strong']:.3f} | "
                           f"{m['need_recall_far']:.3f} | {m['billed_per_turn']:,.0f} "
                           f"({m['billed_per_turn'] / full['billed_per_turn']:.2f}) | {m['uncached_per_turn']:,.0f} "
                           f"({m['uncached_per_turn'] / full['uncached_per_turn']:.2f}) | "
                           + " / ".join(str(lost.get(k, 0))
                                        for k in ("detailed", "brief", "placeholder", "drop", "full"))
                           + " |")
        out.append("")
    return "\n".join(out)


def main() -> None:
    if sys.argv[1:2] == ["--table"]:  # the combined table of runs already written
        print(combined([Path(d) for d in sys.argv[2:]]))
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=default_data())
    ap.add_argument("--half", choices=("fit", "report", "all"), default="report")
    ap.add_argument("--budgets", default="16384")
    ap.add_argument("--policies", default="full,window,pace")
    ap.add_argument("--predictor", default=None, help="the relevance model NAME+predictor rows name "
                    "(models:/palimpsest-relevance/latest, or a bundle directory)")
    ap.add_argument("--cached-rate", type=float, default=0.1)
    ap.add_argument("--ledger", type=Path, default=Path(".palimpsest/dev_extra.db"))
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    if not args.data.is_file():
        sys.exit(f"no trajectories at {args.data}; pass --data FILE")
    data = args.data if args.half == "all" else hash_halves(args.data, tempfile.mkdtemp(prefix="halves-"))[args.half]
    rt, timer = runtime(args.ledger)
    if args.predictor:
        from palimpsest.models.relevance_head import RelevanceResolver

        rt.deps.relevance = RelevanceResolver()
        if rt.deps.relevance(args.predictor) is None:
            sys.exit(f"--predictor {args.predictor}: no relevance model is registered under it")
    cfgs = configs([p for p in args.policies.split(",") if p], args.predictor)
    summaries, text = [], []
    for budget in [int(b) for b in args.budgets.split(",")]:
        t0 = time.perf_counter()
        res = run_replay(rt, data, cfgs, budget, timer=timer, reserve=RESERVE, cached_rate=args.cached_rate)
        write_outputs(res, args.out / f"b{budget}")
        res.summary.update(seconds=round(time.perf_counter() - t0, 1), part=args.half, data_file=str(args.data))
        summaries.append(res.summary)
        text.append(f"**{args.half} half** — " + table(res.summary))
        print(text[-1], flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "epochs.md").write_text("\n".join(text))
    (args.out / "epochs.json").write_text(json.dumps(summaries, indent=2) + "\n")
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
