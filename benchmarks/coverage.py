"""How much of what a later step needs does each resolution of the source step keep?

For every strong need of every step (token, last_obs_step), checks whether the token appears in the
source step's full, detailed, brief and placeholder texts, and reports the share and the mean token
cost of each resolution. A diagnostic that reads the need labels: pace_plus's default ``coverage`` is
fitted without them (benchmarks/fit_pace_plus.py), and this table shows how close that estimate is.

    python benchmarks/coverage.py [--data FILE] [--ledger .palimpsest/replay-smollm2.db]

Run `palimpsest replay` (or benchmarks/replay_dev.py) on the same file first: it fills the ledger.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from palimpsest.pipelines.trajectories import read_trajectories
from palimpsest.platform import Ledger
from palimpsest.platform.types import STORED_RESOLUTIONS as STORED


def main() -> None:
    from replay_dev import default_data  # benchmarks/ is the script's folder

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=default_data())
    ap.add_argument("--ledger", type=Path, default=Path(".palimpsest/replay-smollm2.db"))
    args = ap.parse_args()
    led = Ledger(args.ledger)
    hits = {r: 0 for r in STORED}
    cost: dict = {r: [] for r in STORED}
    total = 0
    for tr in read_trajectories(args.data).trajectories:
        snap = led.snapshot(tr.id)
        for r in STORED:
            cost[r] += snap.tokens[:, r].tolist()
        for s in tr.steps:
            for need in s.needs:
                if need.strength != "strong":
                    continue
                total += 1
                for r in STORED:
                    hits[r] += need.token in (snap.body(need.last_obs_step, r) or "")
    print(f"{total} strong needs; share found in the source step's text at each resolution (mean tokens)")
    print("| resolution | coverage | mean tokens |\n|---|---|---|")
    for r in STORED:
        print(f"| {r.label} | {hits[r] / max(total, 1):.3f} | {np.mean(cost[r]):.1f} |")


if __name__ == "__main__":
    main()
