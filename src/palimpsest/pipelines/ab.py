"""A/B analysis: per-arm comparison of served turns and posted outcomes, with confidence intervals.

Reads the ledger's record of served turns (tokens, latency by stage, glimpses, errors, under the arm that
served them) and the outcomes clients posted. Means come with 95% intervals (normal approximation on
the per-turn values; per-session outcomes likewise), and every arm is compared with the first (control)
arm by the difference of means with a Welch interval. Turns of one session are correlated, so the
per-turn intervals are optimistic; outcomes are per session and are the figure to decide on.
"""

from __future__ import annotations

import math
from typing import Any

from palimpsest.platform.types import PalimpsestError

Z95 = 1.959963984540054
METRICS = (("tokens_context", "context tokens"), ("tokens_prompt", "actor input positions"),
           ("tokens_soft", "soft-memory positions"), ("plan_ms", "plan+compile ms"), ("embed_ms", "query-embedding wait ms"),
           ("memory_ms", "memory ms"),
           ("actor_ms", "actor ms"), ("total_ms", "turn ms"), ("glimpses", "glimpses per turn"))


def mean_ci(xs: list[float]) -> dict[str, float]:
    n = len(xs)
    if n == 0:
        return {"n": 0, "mean": float("nan"), "lo": float("nan"), "hi": float("nan"), "sd": float("nan")}
    m = sum(xs) / n
    sd = math.sqrt(sum((x - m) ** 2 for x in xs) / (n - 1)) if n > 1 else 0.0
    half = Z95 * sd / math.sqrt(n) if n > 1 else float("nan")
    return {"n": n, "mean": m, "lo": m - half, "hi": m + half, "sd": sd}


def diff_ci(a: dict, b: dict) -> dict[str, float]:
    """b - a with a Welch (normal) 95% interval."""
    if a["n"] < 2 or b["n"] < 2:
        return {"diff": b["mean"] - a["mean"], "lo": float("nan"), "hi": float("nan")}
    se = math.sqrt(a["sd"] ** 2 / a["n"] + b["sd"] ** 2 / b["n"])
    d = b["mean"] - a["mean"]
    return {"diff": d, "lo": d - Z95 * se, "hi": d + Z95 * se}


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    k = (len(s) - 1) * q
    f, c = math.floor(k), math.ceil(k)
    return s[f] + (s[c] - s[f]) * (k - f)


def ab_summary(served: list[dict], outcomes: list[dict], arms: list[str] | None = None) -> dict[str, Any]:
    """Per arm: turns, sessions, errors, every metric's mean/CI and p50/p95, outcome mean/CI; and each arm's
    difference from the first (control) arm."""
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
        out["arms"][arm] = a
    control = out["arms"][names[0]]
    for arm in names[1:]:
        a = out["arms"][arm]
        a["vs_control"] = {"outcome": diff_ci(control["outcome"], a["outcome"]),
                           **{k: diff_ci(control["metrics"][k], a["metrics"][k]) for k, _ in METRICS}}
    return out


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
