"""How often the A/B report's paired verdict comes out "significant" when the arms do not differ (BENCHMARKS.md,
"A/B verdicts"): simulated per-trajectory differences with no real effect, normal and heavy-tailed (Student's t
with 2 degrees of freedom, Cauchy), at the 3-12 trajectories a rollout has; the sign-flip permutation test of
``experiments.stats.paired_test`` beside the interval test it replaced (``mean_ci``: Student's t where the
sample looks normal, a seeded bootstrap otherwise; "significant" when the 95% interval excludes 0).

    .venv/bin/python benchmarks/ab_null.py [--sims 2000] [--out benchmarks/results/ab_null.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from palimpsest.experiments.stats import mean_ci, sign_flip_p

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sims", type=int, default=2000)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "ab_null.json"))
    args = ap.parse_args()
    rng = np.random.default_rng(2026)
    nulls = {"normal": rng.standard_normal, "t2": lambda n: rng.standard_t(2, n), "cauchy": rng.standard_cauchy}
    rows = []
    for n in (3, 4, 5, 6, 8, 10, 12):
        for name, draw in nulls.items():
            new = old = 0
            for k in range(args.sims):
                d = [float(x) for x in draw(n)]
                new += sign_flip_p(d) <= 0.05
                ci = mean_ci(d, seed=k)
                old += ci["lo"] > 0 or ci["hi"] < 0
            rows.append({"trajectories": n, "null": name, "sims": args.sims,
                         "sign_flip": new / args.sims, "interval_excludes_0": old / args.sims})
            print(json.dumps(rows[-1]), file=sys.stderr)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rows, indent=2))
    print(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
