"""A/B analysis: per-arm comparison of served turns and posted outcomes, with confidence intervals.

Reads the ledger's record of served turns (tokens, latency by stage, glimpses, errors, under the arm that
served them) and the outcomes clients posted. Means come with 95% intervals (Student's t on the per-turn
values; per-session outcomes likewise), and every arm is compared with the first (control)
arm by the difference of means with a Welch interval. Turns of one session are correlated, so the
per-turn intervals are optimistic; outcomes and shadow fidelity are taken per session (the independent units)
and are the figures to decide on.

Shadow fidelity (serving/shadow.py) is the action-fidelity KL of a served prompt against the full-history
reference, and needs no task outcome. Each comparison states the smallest difference its data could detect
at 80% power (two-sided, alpha = 0.05). When every trajectory ran once per arm (sessions named ``ID@ARM``),
arms are also compared pairwise, trajectory by trajectory, which removes the between-trajectory variance.
"""

from __future__ import annotations

import math
from typing import Any

from palimpsest.platform.types import PalimpsestError

Z95 = 1.959963984540054
Z80 = 0.8416212335729143  # the one-sided normal quantile of 80% power
METRICS = (("tokens_context", "context tokens"), ("tokens_prompt", "actor input positions"),
           ("tokens_soft", "soft-memory positions"), ("plan_ms", "plan+compile ms"), ("embed_ms", "query-embedding wait ms"),
           ("memory_ms", "memory ms"),
           ("actor_ms", "actor ms"), ("total_ms", "turn ms"), ("glimpses", "glimpses per turn"),
           ("tokens_cached", "cached by vLLM per turn"), ("uncached", "uncached ids per turn (from the ids)"),
           ("billed", "billed ids per turn (from the ids)"), ("prefix_reuse", "prefix reuse (from the ids)"))


#: Student's t 97.5% quantiles for 1..30 degrees of freedom (beyond, the normal's): small samples get wide intervals.
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
         2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def t975(df: float) -> float:
    """Student's t 97.5% quantile (beyond 30 degrees of freedom, the Cornish-Fisher expansion: within 0.1%)."""
    if df != df or df < 1:
        return float("nan")
    if df <= len(_T975):
        return _T975[int(df) - 1]  # a fractional (Welch) df rounds down: the wider interval
    return Z95 + (Z95 ** 3 + Z95) / (4 * df) + (5 * Z95 ** 5 + 16 * Z95 ** 3 + 3 * Z95) / (96 * df ** 2)


def welch_df(a: dict, b: dict) -> float:
    va, vb = a["sd"] ** 2 / a["n"], b["sd"] ** 2 / b["n"]
    den = (va ** 2 / (a["n"] - 1) if a["n"] > 1 else 0) + (vb ** 2 / (b["n"] - 1) if b["n"] > 1 else 0)
    return (va + vb) ** 2 / den if den > 0 else float(a["n"] + b["n"] - 2)


def mean_ci(xs: list[float]) -> dict[str, float]:
    """Mean with a 95% interval (Student's t on n - 1 degrees of freedom)."""
    n = len(xs)
    if n == 0:
        return {"n": 0, "mean": float("nan"), "lo": float("nan"), "hi": float("nan"), "sd": float("nan")}
    m = sum(xs) / n
    sd = math.sqrt(sum((x - m) ** 2 for x in xs) / (n - 1)) if n > 1 else 0.0
    half = t975(n - 1) * sd / math.sqrt(n) if n > 1 else float("nan")
    return {"n": n, "mean": m, "lo": m - half, "hi": m + half, "sd": sd}


def diff_ci(a: dict, b: dict) -> dict[str, float]:
    """b - a with a Welch 95% interval (Student's t on the Welch-Satterthwaite degrees of freedom)."""
    if a["n"] < 2 or b["n"] < 2:
        return {"diff": b["mean"] - a["mean"], "lo": float("nan"), "hi": float("nan")}
    se = math.sqrt(a["sd"] ** 2 / a["n"] + b["sd"] ** 2 / b["n"])
    d = b["mean"] - a["mean"]
    q = t975(welch_df(a, b))
    return {"diff": d, "lo": d - q * se, "hi": d + q * se}


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    k = (len(s) - 1) * q
    f, c = math.floor(k), math.ceil(k)
    return s[f] + (s[c] - s[f]) * (k - f)


def mde(se: float, df: float = float("inf")) -> float:
    """The smallest true difference a comparison with standard error ``se`` (and ``df`` degrees of freedom)
    detects at 80% power, two-sided 5% (the t quantile for the test, the normal one for the power: approximate)."""
    if se != se or se == 0:  # no spread (e.g. identical outcomes): nothing to say about power
        return float("nan")
    return ((Z95 if df == float("inf") else t975(df)) + Z80) * se


def _se(a: dict, b: dict) -> float:
    if a["n"] < 2 or b["n"] < 2:
        return float("nan")
    return math.sqrt(a["sd"] ** 2 / a["n"] + b["sd"] ** 2 / b["n"])


def pair_key(session_id: str, arms: list[str]) -> tuple[str, str] | None:
    """(trajectory key, arm) of a session named ``ID@ARM``; None otherwise."""
    for arm in sorted(arms, key=len, reverse=True):
        if session_id.endswith("@" + arm):
            return session_id[: -len(arm) - 1], arm
    return None


def _per_session(rows: list[dict], key: str) -> dict[str, float]:
    by: dict[str, list[float]] = {}
    for r in rows:
        if r.get(key) is not None:
            by.setdefault(r["session_id"], []).append(float(r[key]))
    return {sid: sum(v) / len(v) for sid, v in by.items()}


def ab_summary(served: list[dict], outcomes: list[dict], arms: list[str] | None = None,
               shadows: list[dict] | None = None) -> dict[str, Any]:
    """Per arm: turns, sessions, errors, every metric's mean/CI and p50/p95, outcome and shadow fidelity
    mean/CI per session, prefix-cache hit rate; each arm's difference from the first (control) arm with the
    smallest difference detectable at 80% power; and the paired comparison when sessions are named ID@ARM."""
    shadows = shadows or []
    names = arms or sorted({r["arm"] for r in served} | {o["arm"] for o in outcomes})
    if not names:
        raise PalimpsestError("no served turns and no outcomes recorded yet: nothing to compare")
    out: dict[str, Any] = {"arms": {}, "control": names[0]}
    for arm in names:
        rows = [r for r in served if r["arm"] == arm]
        ok = [r for r in rows if not r.get("error")]
        # One outcome per session (the last posted): sessions are the independent units.
        last: dict[str, float] = {}
        for o in outcomes:
            if o["arm"] == arm:
                last[o["session_id"]] = o["value"]
        a: dict[str, Any] = {"turns": len(ok), "errors": len(rows) - len(ok),
                             "sessions": len({r["session_id"] for r in rows} | set(last)),
                             "outcome": mean_ci(list(last.values())), "metrics": {}}
        for key, _ in METRICS:
            xs = [float(r[key]) for r in ok if key in r]
            a["metrics"][key] = {**mean_ci(xs), "p50": percentile(xs, 0.5), "p95": percentile(xs, 0.95)}
        prompt = sum(float(r.get("tokens_prompt", 0)) for r in ok)
        a["prefix_cache_hit_rate"] = sum(float(r.get("tokens_cached", 0)) for r in ok) / prompt if prompt else float("nan")
        # rebuilds of the prompt: compaction boundaries, or every turn of an arm that plans per turn
        a["compactions_per_100"] = 100.0 * sum(bool(r.get("rebuilt", r.get("compaction"))) for r in ok) / len(ok) \
            if ok else float("nan")
        mine = [r for r in shadows if r["arm"] == arm]
        scored = [r for r in mine if r["status"] == "scored"]
        reasons: dict[str, int] = {}
        for r in mine:
            if r["status"] != "scored":
                reasons[r["reason"]] = reasons.get(r["reason"], 0) + 1
        refs: dict[str, int] = {}
        for r in scored:
            refs[r["reference"]] = refs.get(r["reference"], 0) + 1
        a["fidelity"] = {"kl": mean_ci(list(_per_session(scored, "kl").values())),
                         "top1": mean_ci(list(_per_session(scored, "top1").values())),
                         "scored": len(scored), "skipped": len(mine) - len(scored), "skip_reasons": reasons,
                         "references": refs}
        a["_sessions"] = {"outcome": last, "kl": _per_session(scored, "kl"), "top1": _per_session(scored, "top1"),
                          "tokens_context": _per_session(ok, "tokens_context")}
        out["arms"][arm] = a
    control = out["arms"][names[0]]
    for arm in names[1:]:
        a = out["arms"][arm]
        a["vs_control"] = {"outcome": diff_ci(control["outcome"], a["outcome"]),
                           "fidelity_kl": diff_ci(control["fidelity"]["kl"], a["fidelity"]["kl"]),
                           "fidelity_top1": diff_ci(control["fidelity"]["top1"], a["fidelity"]["top1"]),
                           **{k: diff_ci(control["metrics"][k], a["metrics"][k]) for k, _ in METRICS}}
        co, ao = control["outcome"], a["outcome"]
        ck, ak = control["fidelity"]["kl"], a["fidelity"]["kl"]
        a["power"] = {"outcome_mde": mde(_se(co, ao), welch_df(co, ao) if min(co["n"], ao["n"]) > 1 else float("nan")),
                      "fidelity_kl_mde": mde(_se(ck, ak), welch_df(ck, ak) if min(ck["n"], ak["n"]) > 1 else float("nan"))}
    out["paired"] = _paired(out, names)
    for a in out["arms"].values():
        a.pop("_sessions")
    return out


def _paired(out: dict, names: list[str]) -> dict[str, Any]:
    """Trajectory-by-trajectory differences (arm − control) for sessions named ID@ARM."""
    result: dict[str, Any] = {}
    control = names[0]
    for arm in names[1:]:
        per: dict[str, Any] = {}
        for metric in ("outcome", "kl", "top1", "tokens_context"):
            a_by = {pair_key(s, names)[0]: v for s, v in out["arms"][control]["_sessions"][metric].items()
                    if pair_key(s, names) is not None}
            b_by = {pair_key(s, names)[0]: v for s, v in out["arms"][arm]["_sessions"][metric].items()
                    if pair_key(s, names) is not None}
            d = [b_by[k] - a_by[k] for k in sorted(a_by.keys() & b_by.keys())]
            ci = mean_ci(d)
            significant = ci["n"] >= 2 and (ci["lo"] > 0 or ci["hi"] < 0)
            per[metric] = {**ci, "significant": bool(significant),
                           "mde": mde(ci["sd"] / math.sqrt(ci["n"]), ci["n"] - 1) if ci["n"] >= 2 else float("nan")}
        if any(v["n"] for v in per.values()):
            result[arm] = per
    return result


def _fmt(x: float, digits: int = 1) -> str:
    return "-" if x != x else f"{x:.{digits}f}"


def summary_markdown(s: dict) -> str:
    arms = list(s["arms"])
    lines = ["| metric | " + " | ".join(arms) + " |", "|---|" + "---|" * len(arms)]

    def row(label, cell):
        lines.append(f"| {label} | " + " | ".join(cell(s["arms"][a]) for a in arms) + " |")

    row("sessions", lambda a: str(a["sessions"]))
    row("turns (errors)", lambda a: f"{a['turns']} ({a['errors']})")
    row("outcome (mean, 95% CI)", lambda a: f"{_fmt(a['outcome']['mean'], 3)} [{_fmt(a['outcome']['lo'], 3)}, {_fmt(a['outcome']['hi'], 3)}]")
    row("shadow fidelity KL (session mean, 95% CI; lower is closer)", lambda a: (
        f"{_fmt(a['fidelity']['kl']['mean'], 3)} [{_fmt(a['fidelity']['kl']['lo'], 3)}, {_fmt(a['fidelity']['kl']['hi'], 3)}]"))
    row("shadow top-1 agreement (session mean, 95% CI)", lambda a: (
        f"{_fmt(a['fidelity']['top1']['mean'], 3)} [{_fmt(a['fidelity']['top1']['lo'], 3)}, {_fmt(a['fidelity']['top1']['hi'], 3)}]"))
    row("shadow turns scored / skipped (reasons)", lambda a: (
        f"{a['fidelity']['scored']} / {a['fidelity']['skipped']}"
        + (" (" + ", ".join(f"{k}: {v}" for k, v in sorted(a['fidelity']['skip_reasons'].items())) + ")"
           if a['fidelity']['skip_reasons'] else "")))
    row("shadow reference", lambda a: ", ".join(f"{k} ×{v}" for k, v in sorted(a["fidelity"]["references"].items())) or "-")
    row("prefix-cache hit rate", lambda a: _fmt(a["prefix_cache_hit_rate"], 3))
    row("compactions per 100 turns", lambda a: _fmt(a.get("compactions_per_100", float("nan")), 1))
    for key, label in METRICS:
        digits = 2 if key == "glimpses" else 1
        row(f"{label} (mean, 95% CI; p50 / p95)", lambda a, k=key, d=digits: (
            f"{_fmt(a['metrics'][k]['mean'], d)} [{_fmt(a['metrics'][k]['lo'], d)}, {_fmt(a['metrics'][k]['hi'], d)}]; "
            f"{_fmt(a['metrics'][k]['p50'], d)} / {_fmt(a['metrics'][k]['p95'], d)}"))
    diffs = [a for a in arms[1:]]
    if diffs:
        lines += ["", f"Difference from the control arm `{s['control']}` (95% Welch CI):", "",
                  "| arm | outcome | context tokens | turn ms |", "|---|---|---|---|"]
        for a in diffs:
            v = s["arms"][a]["vs_control"]
            cells = [f"{_fmt(v[k]['diff'], 3 if k == 'outcome' else 1)} [{_fmt(v[k]['lo'], 3 if k == 'outcome' else 1)}, "
                     f"{_fmt(v[k]['hi'], 3 if k == 'outcome' else 1)}]" for k in ("outcome", "tokens_context", "total_ms")]
            lines.append(f"| {a} | " + " | ".join(cells) + " |")
        lines += [""]
        for a in diffs:
            p = s["arms"][a]["power"]
            c, b = s["arms"][s["control"]], s["arms"][a]
            lines.append(f"Power: with {c['outcome']['n']} and {b['outcome']['n']} sessions with outcomes "
                         f"({c['fidelity']['kl']['n']} and {b['fidelity']['kl']['n']} with shadow fidelity), the smallest "
                         f"difference `{a}` vs `{s['control']}` detectable at 80% power (two-sided 5%) is "
                         f"{_fmt(p['outcome_mde'], 3)} in outcome and {_fmt(p['fidelity_kl_mde'], 3)} in fidelity KL.")
    for a, per in s.get("paired", {}).items():
        lines += ["", f"Paired by trajectory (each ran once per arm): `{a}` − `{s['control']}`, mean difference "
                      "with 95% CI; significant when the interval excludes 0:", "",
                  "| metric | pairs | difference [95% CI] | significant | detectable at 80% power |", "|---|---|---|---|---|"]
        for m, label in (("outcome", "outcome"), ("kl", "shadow fidelity KL"), ("top1", "shadow top-1"),
                         ("tokens_context", "context tokens")):
            v = per[m]
            d = 1 if m == "tokens_context" else 3
            lines.append(f"| {label} | {v['n']} | {_fmt(v['mean'], d)} [{_fmt(v['lo'], d)}, {_fmt(v['hi'], d)}] | "
                         f"{'yes' if v['significant'] else 'no'} | {_fmt(v['mde'], d)} |")
    return "\n".join(lines) + "\n"


def log_ab(summary: dict, experiment: str, params: dict[str, Any], markdown: str) -> tuple[str, str]:
    """One MLflow run for the comparison; returns (run id, tracking URI)."""
    import mlflow

    from palimpsest.pipelines.tracking import experiment_id, tracking_uri

    try:
        mlflow.set_tracking_uri(tracking_uri())
        exp = experiment_id(mlflow, experiment)
    except Exception as e:
        raise PalimpsestError(f"MLflow tracking at {tracking_uri()} is not usable: {e}") from None
    with mlflow.start_run(experiment_id=exp, run_name="ab-" + "-vs-".join(summary["arms"])) as run:
        mlflow.log_params({k: str(v)[:500] for k, v in params.items()})
        metrics = {}
        for arm, a in summary["arms"].items():
            tag = arm.replace("+", "_plus_")
            metrics[f"{tag}.turns"] = a["turns"]
            metrics[f"{tag}.errors"] = a["errors"]
            if a["outcome"]["n"]:
                metrics[f"{tag}.outcome"] = a["outcome"]["mean"]
            for k, m in a["metrics"].items():
                if m["n"]:
                    metrics[f"{tag}.{k}.mean"] = m["mean"]
                    metrics[f"{tag}.{k}.p95"] = m["p95"]
        mlflow.log_metrics(metrics)
        mlflow.log_dict(summary, "ab_summary.json")
        mlflow.log_text(markdown, "ab_report.md")
        return run.info.run_id, tracking_uri()
