"""The statistics of the A/B report: intervals of means and differences (Student's t where the sample is
normal enough, a seeded bootstrap otherwise), Wilson intervals of rates, percentiles, the smallest difference
a sample can detect, the paired sign-flip test read once at the end, and the anytime-valid sequential test and
rollout gate read after every session."""

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
    """(assignments, n) signs: every one of the 2^n assignments up to a global flip (the first sign +1: an
    assignment and its negation give one |mean|, so the share of hits is the same over half of them), or
    ``MONTE_CARLO`` drawn with a fixed seed."""
    if n <= EXACT_PAIRS:
        rest = max(n - 1, 0)
        codes = np.arange(2 ** rest, dtype=np.int64)[:, None] >> np.arange(rest, dtype=np.int64)[None, :]
        return np.hstack([np.ones((2 ** rest, min(n, 1))), np.where(codes & 1, -1.0, 1.0)])
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
    the smallest mean shift it detects with 80% power when the differences are normal with the sample's sd.
    Non-finite differences (NaN, ±inf) are left out and counted (``dropped_nan``); ``n`` is what was tested."""
    raw = np.asarray(list(diffs), dtype=np.float64)
    d = raw[np.isfinite(raw)]
    n, dropped = len(d), int(len(raw) - len(d))
    if n == 0:
        return {"n": 0, "mean": float("nan"), "p": float("nan"), "significant": False, "lo": float("nan"),
                "hi": float("nan"), "mde": float("nan"), "exact": True, "dropped_nan": dropped}
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
            "mde": _detectable(float(d.std(ddof=1)) if n > 1 else float("nan"), n, alpha, seed), "exact": exact,
            "dropped_nan": dropped}


def _detectable(sd: float, n: int, alpha: float, seed: int, power: float = 0.8, draws: int = 400) -> float:
    """The smallest mean shift the sign-flip test rejects with ``power`` on n normal differences of this sd
    (simulated, seeded), with the test's own assignments: all of them up to ``EXACT_PAIRS`` pairs, as the test
    enumerates them; infinite where the test can reject nothing at this n."""
    if n < 2 or not sd == sd or sd == 0:
        return float("nan")
    if (2.0 / 2 ** n if n <= EXACT_PAIRS else 0.0) > alpha:
        return float("inf")
    rng = np.random.default_rng(seed + 1)
    noise = rng.standard_normal((draws, n)) * sd
    exact = n <= EXACT_PAIRS
    signs = _sign_flips(n, seed) if exact else rng.choice((-1.0, 1.0), size=(2000, n))
    chunk = max(1, 2 ** 22 // len(signs))  # (draws, assignments) in blocks of ~32 MB

    def rate(shift: float) -> float:
        x = noise + shift
        observed = np.abs(x.mean(1))
        hits = np.concatenate([(np.abs(x[i:i + chunk] @ signs.T / n)
                                >= (observed[i:i + chunk] - 1e-12 * np.maximum(1.0, observed[i:i + chunk]))[:, None]
                                ).sum(1) for i in range(0, draws, chunk)])
        p = hits / signs.shape[0] if exact else (hits + 1) / (signs.shape[0] + 1)
        return float((p <= alpha).mean())

    low, high = 0.0, 8 * sd / math.sqrt(n) + sd
    while rate(high) < power and high < 1e6 * sd:
        high *= 2
    while high - low > 1e-4 * high:
        mid = (low + high) / 2
        low, high = (mid, high) if rate(mid) < power else (low, mid)
    return high


# -- the sequential test: read after every session, valid whenever it is read -----------------------------------

#: the betting fractions averaged by the sequential test (an average of e-processes is an e-process)
BETS = np.linspace(0.05, 0.95, 19)


def running_scale(d: np.ndarray) -> np.ndarray:
    """(R, n) -> (R, n): at position i, the median absolute deviation of ``d[:, :i]`` from its median, from the
    past only (0 before two values): the scale of the i-th bet."""
    s = np.zeros(d.shape)
    for i in range(2, d.shape[1]):
        past = d[:, :i]
        s[:, i] = np.median(np.abs(past - np.median(past, 1, keepdims=True)), 1)
    return s


def log_e_process(d: np.ndarray, centre: float, side: int, scale: np.ndarray | None = None) -> np.ndarray:
    """(R, n) differences -> (R, n) log e-values against the null that each difference is symmetric about a
    centre on the other side of ``centre`` (``side`` +1: a centre <= ``centre``; -1: >= ``centre``).

    Each bet is psi(x) = x / (|x| + s) on x = side * (d - centre), with s half the running scale of the past
    differences (the sign of x where the past has no spread). psi is odd, increasing and within (-1, 1), and
    s is known before the difference arrives, so under the null E[psi(x) | past] <= 0 with no moment
    condition: every fixed-fraction wealth prod(1 + lambda * psi) is a nonnegative supermartingale, and so is
    their average over ``BETS``."""
    x = side * (d - centre)
    s = 0.5 * (running_scale(d) if scale is None else scale)
    with np.errstate(divide="ignore", invalid="ignore"):
        psi = np.where(s > 0, x / (np.abs(x) + np.where(s > 0, s, 1.0)), np.sign(x))
    logs = np.cumsum(np.log1p(BETS * psi[..., None]), 1)  # (R, n, bets)
    top = logs.max(2)
    return top + np.log(np.exp(logs - top[..., None]).mean(2))


def sequential_test(diffs: list[float], alpha: float = 0.05, margin: float = 0.0) -> dict[str, Any]:
    """An anytime-valid paired test, to be read after every new difference (candidate minus control, in
    arrival order; lower is better, as with KL): two one-sided betting e-processes, each at ``alpha``/2.

    - ``better`` (direction -1) rejects the null that the differences are symmetric about a centre >= ``margin``
      (the candidate worse by ``margin`` or more) for a centre below it: with ``margin`` 0, the candidate is
      shown better; above 0, it is shown not worse than the control by ``margin`` or more (non-inferiority).
    - ``worse`` (direction +1) rejects the null that they are symmetric about a centre <= 0 (the candidate not
      worse) for a centre above 0: the candidate is shown worse.

    The null is the sign-flip one (each difference independent and symmetric about its centre, so its median
    is its mean); nothing is assumed of its tails. A side rejects once its e-value reaches 2/alpha at any n so
    far (Ville's inequality: under its null the chance that this ever happens, however long the test is read,
    is at most alpha/2), and it stays rejected; ``direction`` is the side that did first (``worse`` on a tie), 0
    while neither has (e-values are capped at e^700 to stay finite). Non-finite differences are left out of the
    sequence and counted (``dropped_nan``); ``n`` counts the finite ones and ``at_*`` the position in ``diffs``
    where a side rejected."""
    if not 0 < alpha < 1 or not math.isfinite(margin) or margin < 0:
        raise ValueError(f"alpha in (0, 1) and a finite margin >= 0, not {alpha!r}, {margin!r}")
    raw = np.asarray(list(diffs), dtype=np.float64).reshape(-1)
    finite = np.isfinite(raw)
    d, where = raw[finite][None, :], np.flatnonzero(finite) + 1
    threshold = 2.0 / alpha
    out: dict[str, Any] = {"n": int(d.shape[1]), "alpha": alpha, "margin": margin, "threshold": threshold,
                           "dropped_nan": int((~finite).sum()), "method": "sign-flip betting e-process"}
    scale = running_scale(d)
    first = {}
    for name, centre, side in (("better", margin, -1), ("worse", 0.0, +1)):
        logk = log_e_process(d, centre, side, scale)[0]
        crossed = np.flatnonzero(logk >= math.log(threshold))
        first[name] = int(where[crossed[0]]) if len(crossed) else None
        out[f"e_value_{name}"] = math.exp(min(float(logk[-1]), 700.0)) if len(logk) else 1.0  # finite in JSON
        out[f"e_max_{name}"] = math.exp(min(float(logk.max()), 700.0)) if len(logk) else 1.0
        out[f"at_{name}"] = first[name]
    b, w = first["better"], first["worse"]
    out["direction"] = 0 if b is None and w is None else +1 if b is None or (w is not None and w <= b) else -1
    out["reject"] = out["direction"] != 0
    return out


def gate_decision(quality_diffs: list[float], cost_diffs: list[float], alpha: float = 0.05, margin: float = 0.0,
                  candidates: int = 1, cost_margin: float = 0.0, primary: str = "kl") -> dict[str, Any]:
    """A rollout's decision for one candidate against the control, from per-session paired differences
    (candidate minus control, in arrival order, one pair per session in both lists): ``quality_diffs`` of the
    primary metric (lower is better: shadow KL) and ``cost_diffs`` of billed ids. Read after every session.

    - ``withdraw``: the candidate is shown worse on quality (``sequential_test``'s ``worse`` side);
    - ``promote``: it is shown better on quality, or shown not worse by ``margin`` or more on quality AND not
      more expensive by ``cost_margin`` or more (with ``cost_margin`` 0: shown cheaper);
    - ``hold``: neither yet (too few sessions always hold). The first decision reached stands (``at``: the
      session it was reached at; withdraw on a tie).

    Error control (Bonferroni): ``alpha`` is split over the ``candidates`` gated at once, then in half between
    the two decisions. Withdraw reads one e-process (quality worse) at alpha / (2 candidates). A wrong
    promotion needs a false rejection by the quality-better e-process or by one of quality non-inferior and
    cost non-inferior, so these three run at alpha / (4 candidates) each."""
    q, c = list(quality_diffs), list(cost_diffs)
    if len(q) != len(c):
        raise ValueError(f"one pair per session in both lists: {len(q)} quality, {len(c)} cost differences")
    if candidates < 1:
        raise ValueError(f"candidates >= 1, not {candidates!r}")
    a_withdraw, a_promote = alpha / (2 * candidates), alpha / (4 * candidates)
    tests = {"worse": sequential_test(q, 2 * a_withdraw, margin),
             "better": sequential_test(q, 2 * a_promote, 0.0),
             "non_inferior": sequential_test(q, 2 * a_promote, margin),
             "cost": sequential_test(c, 2 * a_promote, cost_margin)}
    keep = ("n", "threshold", "dropped_nan")
    quality = {"worse": {**{k: tests["worse"][k] for k in keep}, "e_value": tests["worse"]["e_value_worse"],
                         "at": tests["worse"]["at_worse"], "null": "centre <= 0"},
               **{name: {**{k: tests[name][k] for k in keep}, "e_value": tests[name]["e_value_better"],
                         "at": tests[name]["at_better"], "null": f"centre >= {m}"}
                  for name, m in (("better", 0.0), ("non_inferior", margin))}}
    cost = {**{k: tests["cost"][k] for k in keep}, "e_value": tests["cost"]["e_value_better"],
            "at": tests["cost"]["at_better"], "null": f"centre >= {cost_margin}"}
    both = None if quality["non_inferior"]["at"] is None or cost["at"] is None else \
        max(quality["non_inferior"]["at"], cost["at"])
    promote = min((x for x in (quality["better"]["at"], both) if x is not None), default=None)
    withdraw = quality["worse"]["at"]
    if withdraw is not None and (promote is None or withdraw <= promote):
        decision, at, reason = "withdraw", withdraw, f"{primary} shown worse than the control"
    elif promote is not None:
        decision, at = "promote", promote
        reason = f"{primary} shown better than the control" if promote == quality["better"]["at"] else \
            f"{primary} shown not worse by {margin} or more, and billed ids " + \
            ("shown lower" if cost_margin == 0 else f"shown not higher by {cost_margin} or more")
    else:
        decision, at, reason = "hold", None, "neither shown yet"
    return {"decision": decision, "at": at, "reason": reason, "primary": primary, "n": len(q), "alpha": alpha,
            "candidates": candidates, "margin": margin, "cost_margin": cost_margin,
            "alpha_withdraw": a_withdraw, "alpha_promote_each": a_promote, "quality": quality, "cost": cost}
