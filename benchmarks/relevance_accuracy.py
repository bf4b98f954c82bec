r"""The relevance predictor's own accuracy against the cosine, on a hash half of dev_extra (the report half by default).

    .venv/bin/python benchmarks/relevance_accuracy.py --model models:/palimpsest-relevance/latest \
        --out benchmarks/results/relevance/accuracy.json

At every turn t of every trajectory of the half, each old step (older than PACE's N = 2 recent steps) is a
candidate, labelled as the predictor was trained (``training.relevance_data.labels``: a step of the epoch ahead,
t .. t + horizon - 1, needs a token the old step showed and that neither the recent steps nor a step appended since
show). Each scorer ranks the candidates of a turn: the predictor (its probability), PACE's cosine (the first
feature: the ``recent_first`` query against the step's key) and pace_plus's hybrid (cosine + 0.5 x identifier
overlap + 0.3 x recency, h = 8). Per turn with a reused step: precision and recall of the top k (k = 4, 8), pooled
over turns, and the average precision. Writes the figures as JSON and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from palimpsest.models.relevance_head import load_head
from palimpsest.pipelines.environment import open_runtime
from palimpsest.pipelines.trajectories import hash_halves
from palimpsest.platform.policies.relevance import SCALARS
from palimpsest.training.relevance_data import build_rows, ranking


def default_data() -> Path:
    return Path(__file__).resolve().parents[2] / "shared" / "data" / "trajectories" / "dev_extra.jsonl"


def hybrid(x: np.ndarray) -> np.ndarray:
    """pace_plus's default score from the same features: cos + 0.5 overlap + 0.3 x 2^(-age / 8)."""
    age = np.expm1(x[:, SCALARS.index("age")].astype(np.float64))
    return x[:, 0] + 0.5 * x[:, SCALARS.index("overlap")] + 0.3 * np.exp2(-age / 8.0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="models:/palimpsest-relevance/latest")
    ap.add_argument("--data", type=Path, default=default_data())
    ap.add_argument("--half", choices=("fit", "report"), default="report")
    ap.add_argument("--ledger", type=Path, default=Path(".palimpsest/dev_extra.db"))
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    head = load_head(args.model)
    if head is None:
        sys.exit(f"no relevance model is registered under {args.model}")
    t0 = time.perf_counter()
    data = hash_halves(args.data, tempfile.mkdtemp(prefix="halves-"))[args.half]
    rt = open_runtime(args.ledger)
    horizon, recent = int(head.meta.get("horizon", 10)), int(head.meta.get("recent", 2))
    rows = build_rows(rt, data, "all", horizon, recent)
    trained_on = set(head.meta.get("data", {}).get("trajectories", []))
    overlap = sorted(trained_on & set(rows.trajectory))
    if overlap:
        sys.exit(f"the model was trained on {len(overlap)} trajectories of this half ({overlap[:3]}...)")
    out = {"model": args.model, "half": args.half, "data": str(args.data), "horizon": horizon, "recent": recent,
           "trajectories": len(set(rows.trajectory)), "seconds": None, "scorers": {}}
    for name, s in (("predictor", head.logits(head.read(rows.x))), ("cosine", rows.x[:, 0].astype(np.float64)),
                    ("hybrid", hybrid(rows.x))):
        out["scorers"][name] = ranking(np.asarray(s, dtype=np.float64), rows.y, rows.group)
    out["seconds"] = round(time.perf_counter() - t0, 1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    first = next(iter(out["scorers"].values()))
    print(f"{args.half} half: {out['trajectories']} trajectories, {first['turns']} turns ({first['turns_with_reuse']} "
          f"with a reused old step), {first['rows']} candidates, {first['positives']} reused; horizon {horizon}\n")
    print("| scorer | precision@4 | recall@4 | precision@8 | recall@8 | average precision |")
    print("|---|---|---|---|---|---|")
    for name, m in out["scorers"].items():
        print(f"| {name} | {m['precision_at_4']} | {m['recall_at_4']} | {m['precision_at_8']} | {m['recall_at_8']} | "
              f"{m['average_precision']} |")


if __name__ == "__main__":
    main()
