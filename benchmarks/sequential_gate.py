"""The rollout gate's sequential test under continuous monitoring (BENCHMARKS.md, "A/B gate: the sequential
test read after every session"): ``experiments.stats.sequential_test`` read after every paired difference,
n = 1..200, a false positive being a rejection by either side at any n.

- the false-positive rate on nulls symmetric about 0 (the sign-flip null): normal, Student's t with 2 degrees
  of freedom, Cauchy, Laplace, and a symmetric bimodal mixture (two normals at -2 and +2, sd 0.5); and, outside
  the null as a caution, a skewed difference of mean 0 (an exponential minus its mean: median below 0);
- its power at shifts of 0.25, 0.5 and 1 sd (normal; Student's t(2) in its scale units) within 50, 100 and
  200 differences, the right side only, and the median n at which it stopped;
- the contrast: the fixed-n sign-flip test of the report (``sign_flip_p``, the p of ``paired_test``) read
  after every difference, which fires on noise far more often than 5%.

The vectorised runs call the module's own ``log_e_process`` and assignments (checked against
``sequential_test`` and ``sign_flip_p`` on a few replications before anything is counted).

    .venv/bin/python benchmarks/sequential_gate.py [--reps 2000] [--fixed-reps 1000] [--seed 2026]
        [--out benchmarks/results/sequential_gate/results.json]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

from palimpsest.experiments.stats import (
    EXACT_PAIRS,
    _sign_flips,
    log_e_process,
    running_scale,
    sequential_test,
    sign_flip_p,
)

ROOT = Path(__file__).resolve().parents[1]
N, ALPHA, LOOKS = 200, 0.05, (50, 100, 200)


def first_rejections(d: np.ndarray, alpha: float = ALPHA) -> tuple[np.ndarray, np.ndarray]:
    """(R, n) differences -> the first n (1-based; 0: never) at which each side of ``sequential_test`` rejects:
    (better, worse)."""
    scale = running_scale(d)
    out = []
    for centre, side in ((0.0, -1), (0.0, +1)):
        crossed = log_e_process(d, centre, side, scale) >= math.log(2.0 / alpha)
        out.append(np.where(crossed.any(1), crossed.argmax(1) + 1, 0))
    return out[0], out[1]


def fixed_n_first(d: np.ndarray, alpha: float = ALPHA) -> np.ndarray:
    """The first n at which the fixed-n sign-flip test (``sign_flip_p``, seed 0) reads p <= alpha (0: never)."""
    reps, n = d.shape
    first = np.zeros(reps, dtype=np.int64)
    for k in range(1, n + 1):
        signs, x = _sign_flips(k, 0), d[:, :k]
        observed = np.abs(x.mean(1))
        hits = np.zeros(reps)
        for i in range(0, len(signs), 5000):
            flipped = np.abs(signs[i:i + 5000] @ x.T / k)  # (assignments, reps)
            hits += (flipped >= observed - 1e-12 * np.maximum(1.0, observed)).sum(0)
        p = hits / len(signs) if k <= EXACT_PAIRS else (hits + 1) / (len(signs) + 1)
        first[(first == 0) & (p <= alpha)] = k
    return first


def check(d: np.ndarray) -> None:
    """The vectorised runs agree with the functions the gate calls."""
    b, w = first_rejections(d)
    for r in range(len(d)):
        t = sequential_test(list(d[r]), ALPHA)
        assert (t["at_better"] or 0, t["at_worse"] or 0) == (b[r], w[r]), (r, t, b[r], w[r])
    f = fixed_n_first(d[:3, :30])
    for r in range(3):
        ps = [sign_flip_p(list(d[r, :k])) for k in range(1, 31)]
        assert f[r] == next((k for k, p in enumerate(ps, 1) if p <= ALPHA), 0), (r, f[r], ps)


def rates(first: np.ndarray) -> dict[str, float]:
    return {f"by_{m}": float(((first > 0) & (first <= m)).mean()) for m in LOOKS}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=2000)
    ap.add_argument("--fixed-reps", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=2026)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "sequential_gate" / "results.json"))
    args = ap.parse_args()
    t0 = time.perf_counter()
    rng = np.random.default_rng(args.seed)
    check(rng.standard_normal((20, 60)) + rng.choice((0.0, 0.7, -0.7), (20, 1)))
    shape = (args.reps, N)
    nulls = {
        "normal": lambda: rng.standard_normal(shape),
        "t2": lambda: rng.standard_t(2, shape),
        "cauchy": lambda: rng.standard_cauchy(shape),
        "laplace": lambda: rng.laplace(0.0, 1.0, shape),
        "bimodal": lambda: rng.choice((-2.0, 2.0), shape) + 0.5 * rng.standard_normal(shape),
        "skewed_mean0 (not symmetric)": lambda: rng.exponential(1.0, shape) - 1.0,
    }
    out: dict = {"seed": args.seed, "reps": args.reps, "fixed_reps": args.fixed_reps, "n": N, "alpha": ALPHA,
                 "method": sequential_test([0.0])["method"], "null": [], "power": [], "fixed_n": []}
    for name, draw in nulls.items():
        b, w = first_rejections(draw())
        either = np.where((b > 0) & (w > 0), np.minimum(b, w), np.maximum(b, w))
        row = {"null": name, **rates(either), "better_side": rates(b)["by_200"], "worse_side": rates(w)["by_200"],
               "se": math.sqrt(ALPHA * (1 - ALPHA) / args.reps)}
        out["null"].append(row)
        print(json.dumps(row), file=sys.stderr)
    for name, draw in (("normal", lambda: rng.standard_normal(shape)), ("t2", lambda: rng.standard_t(2, shape))):
        for shift in (0.25, 0.5, 1.0):
            b, w = first_rejections(draw() + shift)  # the candidate worse by `shift`: the worse side must reject
            stop = np.where(w > 0, w, np.inf)
            row = {"noise": name, "shift_sd": shift, **rates(w), "wrong_side_by_200": rates(b)["by_200"],
                   "median_stop_n": float(np.median(stop)) if np.isfinite(np.median(stop)) else None,
                   "median_stop_n_of_rejections": float(np.median(w[w > 0])) if (w > 0).any() else None}
            out["power"].append(row)
            print(json.dumps(row), file=sys.stderr)
    for name, draw in (("normal", rng.standard_normal), ("cauchy", rng.standard_cauchy)):
        first = fixed_n_first(draw((args.fixed_reps, N)))
        row = {"null": name, "reps": args.fixed_reps, **rates(first),
               "first_look_n": int(first[first > 0].min()) if (first > 0).any() else None}
        out["fixed_n"].append(row)
        print(json.dumps(row), file=sys.stderr)
    out["seconds"] = round(time.perf_counter() - t0, 1)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
