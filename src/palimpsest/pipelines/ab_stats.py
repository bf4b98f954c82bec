"""The statistics of the A/B report: intervals of means and differences (Student's t where the sample is
normal enough, a seeded bootstrap otherwise), Wilson intervals of rates, percentiles, and the smallest
difference a sample can detect."""

from __future__ import annotations

import math
import random
from typing import Any

import numpy as np

Z95 = 1.959963984540054
Z80 = 0.8416212335729143  # the one-sided normal quantile of 80% power

#: Student's t 97.5% quantiles for 1..30 degrees of freedom (beyond, the normal's): small samples get wide intervals.
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
         2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)

BOOTSTRAP = 2000  # resamples per interval (seeded: a report is reproducible)


def t975(df: float) -> float:
    """Student's t 97.5% quantile (beyond 30 degrees of freedom, the Cornish-Fisher expansion: within 0.1%)."""
    if df != df or df < 1:
        return float("nan")
    if df <= len(_T975):
        return _T975[int(df) - 1]  # a fractional df rounds down: the wider quantile
    return Z95 + (Z95 ** 3 + Z95) / (4 * df) + (5 * Z95 ** 5 + 16 * Z95 ** 3 + 3 * Z95) / (96 * df ** 2)


def _quantile(s: list[float], q: float) -> float:
    k = (len(s) - 1) * q
    f, c = math.floor(k), math.ceil(k)
    return s[f] + (s[c] - s[f]) * (k - f)


def mean_ci(xs: list[float], seed: int = 0) -> dict[str, float]:
    """Mean with a 95% percentile-bootstrap interval (no interval below two values). Every resampled mean lies
    within [min, max] of the values, so the interval never leaves the quantity's range."""
    n = len(xs)
    nan = float("nan")
    if n == 0:
        return {"n": 0, "mean": nan, "lo": nan, "hi": nan, "sd": nan}
    m = sum(xs) / n
    sd = math.sqrt(sum((x - m) ** 2 for x in xs) / (n - 1)) if n > 1 else 0.0
    if n < 2:
        return {"n": n, "mean": m, "lo": nan, "hi": nan, "sd": sd}
    rng = random.Random(seed)
    means = sorted(sum(rng.choices(xs, k=n)) / n for _ in range(BOOTSTRAP))
    lo, hi = _quantile(means, 0.025), _quantile(means, 0.975)
    return {"n": n, "mean": m, "lo": min(lo, m), "hi": max(hi, m), "sd": sd}


def diff_ci(xs: list[float], ys: list[float], seed: int = 0) -> dict[str, float]:
    """mean(ys) - mean(xs) of two independent samples, with a 95% bootstrap interval (each resampled apart)."""
    nan = float("nan")
    if not xs or not ys:
        return {"diff": nan, "lo": nan, "hi": nan}
    d = sum(ys) / len(ys) - sum(xs) / len(xs)
    if len(xs) < 2 or len(ys) < 2:
        return {"diff": d, "lo": nan, "hi": nan}
    rng = random.Random(seed)
    ds = sorted(sum(rng.choices(ys, k=len(ys))) / len(ys) - sum(rng.choices(xs, k=len(xs))) / len(xs)
                for _ in range(BOOTSTRAP))
    return {"diff": d, "lo": min(_quantile(ds, 0.025), d), "hi": max(_quantile(ds, 0.975), d)}


def wilson(k: int, n: int) -> dict[str, float]:
    """A proportion k/n with Wilson's 95% score interval (within [0, 1], sensible at 0 and n)."""
    if n == 0:
        return {"k": 0, "n": 0, "p": float("nan"), "lo": float("nan"), "hi": float("nan")}
    p = k / n
    z2 = Z95 * Z95
    centre = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = Z95 * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / (1 + z2 / n)
    return {"k": k, "n": n, "p": p, "lo": min(p, max(0.0, centre - half)), "hi": max(p, min(1.0, centre + half))}


def percentile(xs: list[float], q: float) -> float:
    return _quantile(sorted(xs), q) if xs else float("nan")


def mde(sd: float, n: int) -> float:
    """The smallest true mean difference a paired comparison of ``n`` units with spread ``sd`` detects at 80%
    power, two-sided 5% (the t quantile for the test, the normal one for the power: approximate)."""
    if n < 2 or sd != sd or sd == 0:  # no spread (e.g. identical outcomes): nothing to say about power
        return float("nan")
    return (t975(n - 1) + Z80) * sd / math.sqrt(n)


def unpaired_mde(a: list[float], b: list[float]) -> float:
    """As :func:`mde` for two independent samples (Welch's standard error)."""
    if len(a) < 2 or len(b) < 2:
        return float("nan")
    va, vb = (mean_ci(a)["sd"] ** 2 / len(a)), (mean_ci(b)["sd"] ** 2 / len(b))
    se = math.sqrt(va + vb)
    if se == 0:
        return float("nan")
    den = va ** 2 / (len(a) - 1) + vb ** 2 / (len(b) - 1)
    df = (va + vb) ** 2 / den if den > 0 else len(a) + len(b) - 2
    return (t975(df) + Z80) * se


#: Up to this many pairs the sign-flip test enumerates every assignment (2^16 = 65,536); beyond, Monte Carlo
EXACT_PAIRS = 16
MONTE_CARLO = 20_000


def _sign_flips(n: int, seed: int) -> np.ndarray:
    """(assignments, n) signs: every one of the 2^n assignments, or ``MONTE_CARLO`` drawn with a fixed seed."""
    if n <= EXACT_PAIRS:
        codes = np.arange(2 ** n, dtype=np.int64)[:, None] >> np.arange(n, dtype=np.int64)[None, :]
        return np.where(codes & 1, -1.0, 1.0)
    return np.random.default_rng(seed).choice((-1.0, 1.0), size=(MONTE_CARLO, n))


def _p_value(d: np.ndarray, signs: np.ndarray, exact: bool) -> float:
    """Two-sided sign-flip p-value of the mean of ``d`` (the observed assignment is one of the enumerated ones)."""
    observed = abs(d.mean())
    flipped = np.abs((signs * d[None, :]).mean(1))
    hits = int((flipped >= observed - 1e-12 * max(1.0, observed)).sum())
    return hits / len(signs) if exact else (hits + 1) / (len(signs) + 1)


def sign_flip_p(diffs: list[float], seed: int = 0) -> float:
    """The two-sided sign-flip p-value of the paired differences' mean (``paired_test``'s, alone)."""
    d = np.asarray(diffs, dtype=np.float64)
    return _p_value(d, _sign_flips(len(d), seed), len(d) <= EXACT_PAIRS) if len(d) else float("nan")


def paired_test(diffs: list[float], alpha: float = 0.05, seed: int = 0) -> dict[str, Any]:
    """A two-sided test that the paired differences (one per trajectory: arm minus control) have mean 0, valid at
    any number of pairs: the sign-flip permutation test, exact under the null of exchangeable arms (each
    difference is as likely to have come out with the other sign). Every assignment of signs is enumerated up
    to ``EXACT_PAIRS`` pairs, ``MONTE_CARLO`` seeded draws beyond. ``lo``/``hi`` is the interval that matches it:
    the shifts of the mean the test does not reject at ``alpha`` (found by bisection; infinite where no shift
    can be rejected, as with 5 pairs or fewer at 5%: 2/2^5 > 0.05). ``significant`` is p <= alpha; ``mde``
    the smallest mean shift it detects with 80% power when the differences are normal with the sample's sd."""
    d = np.asarray([x for x in diffs if x == x], dtype=np.float64)
    n = len(d)
    if n == 0:
        return {"n": 0, "mean": float("nan"), "p": float("nan"), "significant": False, "lo": float("nan"),
                "hi": float("nan"), "mde": float("nan"), "exact": True}
    exact = n <= EXACT_PAIRS
    signs = _sign_flips(n, seed)
    p = _p_value(d, signs, exact)
    floor = 2.0 / 2 ** n if exact else 1.0 / (MONTE_CARLO + 1)  # the smallest p any data can give
    lo, hi = float("-inf"), float("inf")
    spread = float(d.max() - d.min()) or abs(float(d.mean())) or 1.0
    if floor <= alpha:
        def accepted(shift: float) -> bool:
            return _p_value(d - shift, signs, exact) > alpha

        def edge(inside: float, outside: float) -> float:
            for _ in range(40):
                mid = (inside + outside) / 2
                inside, outside = (mid, outside) if accepted(mid) else (inside, mid)
            return inside

        centre = float(d.mean())
        lo = edge(centre, float(d.min()) - spread)
        hi = edge(centre, float(d.max()) + spread)
    return {"n": n, "mean": float(d.mean()), "p": p, "significant": bool(p <= alpha), "lo": lo, "hi": hi,
            "mde": _detectable(float(d.std(ddof=1)) if n > 1 else float("nan"), n, alpha, seed), "exact": exact}


def _detectable(sd: float, n: int, alpha: float, seed: int, power: float = 0.8, draws: int = 400) -> float:
    """The smallest mean shift the sign-flip test rejects with ``power`` on n normal differences of this sd
    (simulated, seeded); infinite where the test can reject nothing at this n."""
    if n < 2 or not sd == sd or sd == 0:
        return float("nan")
    if (2.0 / 2 ** n if n <= EXACT_PAIRS else 0.0) > alpha:
        return float("inf")
    rng = np.random.default_rng(seed + 1)
    noise = rng.standard_normal((draws, n)) * sd
    signs = _sign_flips(n, seed) if n <= 12 else rng.choice((-1.0, 1.0), size=(2000, n))
    exact = n <= 12

    def rate(shift: float) -> float:
        x = noise + shift
        observed = np.abs(x.mean(1))
        flipped = np.abs(x @ signs.T / n)  # (draws, assignments)
        hits = (flipped >= observed[:, None] - 1e-12).sum(1)
        p = hits / signs.shape[0] if exact else (hits + 1) / (signs.shape[0] + 1)
        return float((p <= alpha).mean())

    low, high = 0.0, 8 * sd / math.sqrt(n) + sd
    while rate(high) < power and high < 1e6 * sd:
        high *= 2
    for _ in range(30):
        mid = (low + high) / 2
        low, high = (mid, high) if rate(mid) < power else (low, mid)
    return high
