"""A/B analysis: per-arm comparison of served turns, posted outcomes and shadow fidelity, with intervals that
stay within their range.

Reads the ledger's record of served turns (tokens, latency by stage, glimpses, errors, under the arm that
served them), the outcomes clients posted, and the shadow lane's fidelity records (serving/turn/shadow.py).

- **Intervals.** Means come with 95% percentile-bootstrap intervals (a bootstrap mean lies between the
  smallest and the largest value, so a bounded quantity keeps its range: top-1 agreement stays in [0, 1], a
  KL stays >= 0); proportions (the share of identical turns) with Wilson's interval. Outcomes and shadow
  fidelity are taken per session (the independent units: turns of one session are correlated); per-turn
  cost metrics are per turn and so optimistic.
- **Shadow fidelity** is the exact KL(q || p) of a served prompt's next-token distributions against a
  reference's, over the reply positions. A turn whose served ids equal the reference's is ``identical``: its
  KL is 0 by construction, so it is counted and left out of the per-arm mean, which covers the turns where
  the arm changed something. References of different kinds (``full``; ``policy@window`` when the whole
  history does not fit the actor) measure different things and are reported apart, never pooled.
- **Paired comparison.** When every trajectory ran once per arm (sessions ``ID@ARM``), arms are compared turn
  by turn on the same (trajectory, t): a pair needs both arms recorded (scored or identical) against the same
  reference (``full``, or one policy at the window: ``pace`` and ``pace+memory`` share ``pace@W``, ``pace`` and
  ``window`` do not); an identical turn's KL is exactly 0 (top-1 exactly 1); pairs where both arms served the
  reference itself (difference 0 by construction) are counted and left out; pairs with one side skipped or
  missing are counted with the reason. Per-trajectory mean differences are the units of one test, valid at
  the few trajectories a rollout has: the sign-flip permutation test (``experiments.stats.paired_test``), its p-value,
  the interval that matches it, and the smallest difference it detects at 80% power. It is read once, at the
  end: there is no "significant after k trajectories" (stopping at the first look that excludes 0 fires on
  noise more than half the time).
"""

from __future__ import annotations

from typing import Any

from palimpsest.experiments.plot import close_figure, fidelity_cost_figure
from palimpsest.experiments.stats import (
    diff_ci,
    mean_ci,
    paired_test,
    percentile,
    unpaired_mde,
    wilson,
)
from palimpsest.models.registry import mlflow_experiment, tracking_uri
from palimpsest.platform.ledger.experiments import REFERENCE_KINDS, reference_kind
from palimpsest.platform.types import PalimpsestError

METRICS = (("tokens_context", "context tokens"), ("tokens_prompt", "actor input positions"),
           ("tokens_soft", "soft-memory positions"), ("plan_ms", "plan+compile ms"),
           ("embed_ms", "query-embedding wait ms"), ("memory_ms", "memory ms"),
           ("actor_ms", "actor ms"), ("total_ms", "turn ms"), ("glimpses", "glimpses per turn"),
           ("tokens_cached", "cached by vLLM per turn"), ("uncached", "uncached ids per turn (from the ids)"),
           ("billed", "billed ids per turn (from the ids)"), ("prefix_reuse", "prefix reuse (from the ids)"))
KINDS = REFERENCE_KINDS


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


def _fidelity(mine: list[dict]) -> dict[str, Any]:
    """An arm's shadow records: counts by status and skip reason, the identical share, and per reference kind the
    session means of KL and top-1 over the scored (non-identical) turns."""
    scored = [r for r in mine if r["status"] == "scored"]
    identical = [r for r in mine if r["status"] == "identical"]
    reasons: dict[str, int] = {}
    for r in mine:
        if r["status"] == "skipped":
            reasons[r["reason"]] = reasons.get(r["reason"], 0) + 1
    by_kind = {}
    for kind in KINDS:
        sc = [r for r in scored if reference_kind(r["reference"]) == kind]
        ident = [r for r in identical if reference_kind(r["reference"]) == kind]
        refs: dict[str, int] = {}
        for r in sc + ident:
            refs[r["reference"]] = refs.get(r["reference"], 0) + 1
        by_kind[kind] = {"scored": len(sc), "identical": len(ident), "references": refs,
                         "kl": mean_ci(list(_per_session(sc, "kl").values())),
                         "top1": mean_ci(list(_per_session(sc, "top1").values())),
                         "_kl": _per_session(sc, "kl")}
    return {"sampled": len(mine), "scored": len(scored), "identical": len(identical),
            "skipped": len(mine) - len(scored) - len(identical), "skip_reasons": reasons,
            # the window forced a policy reference that holds fewer ids than the prompt it judged
            "reference_smaller": sum(str(r.get("reason") or "").startswith("reference smaller") for r in scored),
            "identical_share": wilson(len(identical), len(scored) + len(identical)), "by_reference": by_kind}


CALL_FIELDS = ("calls", "input", "cached", "generated", "unanswered", "billed")


def _calls(rows: list[dict], prefix: str, turns: int) -> dict[str, Any]:
    """An arm's model calls of one kind, summed from its rows' ``{prefix}{field}`` columns (LLM summaries:
    served rows of ``kind: summary``; ACE's LLM elasticizer: the turns that planned with it), and their billed
    input per turn of the arm."""
    calls: dict[str, Any] = {k: sum(float(r.get(f"{prefix}{k}") or 0) for r in rows) for k in CALL_FIELDS}
    calls["billed_per_turn"] = calls["billed"] / turns if turns else float("nan")
    return calls


def _cost(a: dict, turns: list[dict], summaries: list[dict]) -> None:
    """An arm's billed input per turn with every model call in it: its turns' billed ids, plus its LLM summary
    calls and its elasticizer calls (a call that timed out counted with the ids it sent), split."""
    billed = [float(r["billed"]) for r in turns if r.get("billed") is not None]
    n = len(billed)  # one denominator: the turns whose cost is known (a replica that served the previous turn)
    a["summary_calls"] = _calls(summaries, "summary_", n)
    a["elasticizer_calls"] = _calls(turns, "elasticizer_", n)
    cost = {"turns": sum(billed) / n if n else float("nan"), "summaries": a["summary_calls"]["billed_per_turn"],
            "elasticizer": a["elasticizer_calls"]["billed_per_turn"]}
    a["cost"] = {**cost, "total": sum(cost.values())}


def ab_summary(served: list[dict], outcomes: list[dict], arms: list[str] | None = None,
               shadows: list[dict] | None = None, summaries: list[dict] | None = None) -> dict[str, Any]:
    """Per arm: turns, sessions, errors, every metric's mean/CI and p50/p95, LLM summary calls (``summaries``: the
    ledger's served rows of ``kind: summary``) and the billed input with them, outcome per session, shadow fidelity
    per reference kind over the non-identical turns, prefix-cache hit rate; each arm's difference from the first
    (control) arm with the smallest difference detectable at 80% power; and the paired comparison when sessions
    are named ID@ARM."""
    shadows = shadows or []
    names = arms or sorted({r["arm"] for r in served} | {o["arm"] for o in outcomes})
    if not names:
        raise PalimpsestError("no served turns and no outcomes recorded yet: nothing to compare")
    out: dict[str, Any] = {"arms": {}, "control": names[0]}
    values: dict[str, dict[str, list[float]]] = {}
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
        values[arm] = {"outcome": list(last.values())}
        for key, _ in METRICS:
            xs = [float(r[key]) for r in ok if r.get(key) is not None]
            values[arm][key] = xs
            a["metrics"][key] = {**mean_ci(xs), "p50": percentile(xs, 0.5), "p95": percentile(xs, 0.95)}
        prompt = sum(float(r.get("tokens_prompt", 0)) for r in ok)
        a["prefix_cache_hit_rate"] = (sum(float(r.get("tokens_cached", 0)) for r in ok) / prompt
                                      if prompt else float("nan"))
        # rebuilds of the prompt: compaction boundaries, or every turn of an arm that plans per turn
        a["compactions_per_100"] = 100.0 * sum(bool(r.get("rebuilt", r.get("compaction"))) for r in ok) / len(ok) \
            if ok else float("nan")
        a["fidelity"] = _fidelity([r for r in shadows if r["arm"] == arm])
        _cost(a, ok, [r for r in summaries or [] if r["arm"] == arm])
        for kind in KINDS:
            values[arm][f"kl:{kind}"] = list(a["fidelity"]["by_reference"][kind].pop("_kl").values())
        a["_sessions"] = {"outcome": last, "tokens_context": _per_session(ok, "tokens_context")}
        out["arms"][arm] = a
    control = names[0]
    for arm in names[1:]:
        a, va, vc = out["arms"][arm], values[arm], values[control]
        a["vs_control"] = {"outcome": diff_ci(vc["outcome"], va["outcome"]),
                           "fidelity_kl_full": diff_ci(vc["kl:full"], va["kl:full"]),
                           **{k: diff_ci(vc[k], va[k]) for k, _ in METRICS}}
        a["power"] = {"outcome_mde": unpaired_mde(vc["outcome"], va["outcome"]),
                      "fidelity_kl_full_mde": unpaired_mde(vc["kl:full"], va["kl:full"])}
    out["paired"] = _paired(out, names, shadows, {(r["session_id"], int(r["t"])): turn_kind(r) for r in served})
    for a in out["arms"].values():
        a.pop("_sessions")
    return out


def _paired_stat(by_traj: dict[str, list[float]], order: list[str]) -> dict[str, Any]:
    """Per-trajectory mean differences -> their mean, the sign-flip test's p-value, significance and matching
    interval, and the difference it detects at 80% power (``experiments.stats.paired_test``)."""
    keys = [k for k in order if by_traj.get(k)]
    d = [sum(by_traj[k]) / len(by_traj[k]) for k in keys]
    return {**paired_test(d), "pairs": sum(len(by_traj[k]) for k in keys)}


def turn_kind(row: dict) -> str:
    """What a served turn did to the prompt: ``boundary`` (an epoch's compaction), ``per turn`` (a policy that
    plans every turn) or ``append`` (an epoch extended by the steps since)."""
    return "boundary" if row.get("compaction") else "per turn" if row.get("rebuilt") else "append"


def _paired(out: dict, names: list[str], shadows: list[dict], kinds: dict[tuple[str, int], str]) -> dict[str, Any]:
    """Turn-by-turn differences (arm − control) on the same (trajectory, t) for sessions named ID@ARM; ``kinds``:
    the served turn's kind (:func:`turn_kind`) per (session, t), counted per pair on the arm's side."""
    result: dict[str, Any] = {}
    control = names[0]
    recs: dict[str, dict[tuple[str, int], dict]] = {arm: {} for arm in names}
    order: list[str] = []
    for r in shadows:
        pk = pair_key(r["session_id"], names)
        if pk is None or pk[1] not in recs:
            continue
        recs[pk[1]][(pk[0], int(r["t"]))] = r
        if pk[0] not in order:
            order.append(pk[0])
    for arm in names[1:]:
        per: dict[str, Any] = {}
        for metric in ("outcome", "tokens_context"):
            a_by = {pair_key(s, names)[0]: v for s, v in out["arms"][control]["_sessions"][metric].items()
                    if pair_key(s, names) is not None}
            b_by = {pair_key(s, names)[0]: v for s, v in out["arms"][arm]["_sessions"][metric].items()
                    if pair_key(s, names) is not None}
            keys = sorted(a_by.keys() & b_by.keys())
            per[metric] = _paired_stat({k: [b_by[k] - a_by[k]] for k in keys}, keys)
        unpaired: dict[str, int] = {}
        turns: dict[str, dict[str, int]] = {}
        for kind in KINDS:
            kl: dict[str, list[float]] = {}
            top1: dict[str, list[float]] = {}
            both_identical = 0
            for key in sorted(recs[control].keys() | recs[arm].keys()):
                rc, ra = recs[control].get(key), recs[arm].get(key)
                usable = {name: r for name, r in ((control, rc), (arm, ra))
                          if r is not None and r["status"] in ("scored", "identical")}
                if len(usable) < 2:
                    if usable and reference_kind(next(iter(usable.values()))["reference"]) == kind:
                        name, other = (arm, ra) if control in usable else (control, rc)
                        why = f"{name}: {other['reason'] if other is not None else 'no record'}"
                        unpaired[why] = unpaired.get(why, 0) + 1
                    continue
                if reference_kind(rc["reference"]) != kind:
                    continue
                if rc["reference"] != ra["reference"]:  # e.g. pace@4071 against window@4071: no common yardstick
                    unpaired["different references"] = unpaired.get("different references", 0) + 1
                    continue
                if rc["status"] == ra["status"] == "identical":
                    both_identical += 1
                    continue
                value = {"kl": lambda r: r["kl"] if r["status"] == "scored" else 0.0,
                         "top1": lambda r: r["top1"] if r["status"] == "scored" else 1.0}
                kl.setdefault(key[0], []).append(value["kl"](ra) - value["kl"](rc))
                which = kinds.get((ra["session_id"], key[1]), "not recorded")
                turns.setdefault(kind, {})[which] = turns.setdefault(kind, {}).get(which, 0) + 1
                top1.setdefault(key[0], []).append(value["top1"](ra) - value["top1"](rc))
            per[f"kl:{kind}"] = {**_paired_stat(kl, order), "both_identical": both_identical}
            per[f"top1:{kind}"] = _paired_stat(top1, order)
        per["unpaired"] = unpaired
        per["turn_kinds"] = turns  # per reference kind, the arm's served turn of each pair: boundary, append, per turn
        if any(v.get("n") for k, v in per.items() if isinstance(v, dict) and k not in ("unpaired", "turn_kinds")):
            result[arm] = per
    return result


def _fmt(x: float, digits: int = 1) -> str:
    return "-" if x is None or x != x else f"{x:.{digits}f}"


def _ci(m: dict, digits: int = 3) -> str:
    return f"{_fmt(m['mean'], digits)} [{_fmt(m['lo'], digits)}, {_fmt(m['hi'], digits)}]"


def summary_markdown(s: dict) -> str:
    arms = list(s["arms"])
    lines = ["| metric | " + " | ".join(arms) + " |", "|---|" + "---|" * len(arms)]

    def row(label, cell):
        lines.append(f"| {label} | " + " | ".join(cell(s["arms"][a]) for a in arms) + " |")

    row("sessions", lambda a: str(a["sessions"]))
    row("turns (errors)", lambda a: f"{a['turns']} ({a['errors']})")
    row("outcome (session mean, 95% bootstrap CI)", lambda a: _ci(a["outcome"]))
    row("shadow turns sampled: scored / identical / skipped (reasons)", lambda a: (
        f"{a['fidelity']['sampled']}: {a['fidelity']['scored']} / {a['fidelity']['identical']} / "
        f"{a['fidelity']['skipped']}"
        + (" (" + ", ".join(f"{k}: {v}" for k, v in sorted(a['fidelity']['skip_reasons'].items())) + ")"
           if a['fidelity']['skip_reasons'] else "")))
    row("identical to the reference (share, Wilson 95% CI)", lambda a: (
        f"{_fmt(a['fidelity']['identical_share']['p'], 3)} [{_fmt(a['fidelity']['identical_share']['lo'], 3)}, "
        f"{_fmt(a['fidelity']['identical_share']['hi'], 3)}]"))
    if any(s["arms"][a]["fidelity"].get("reference_smaller") for a in arms):
        row("scored against a reference smaller than the served prompt (the window forced it)",
            lambda a: str(a["fidelity"].get("reference_smaller", 0)))
    for kind in KINDS:
        if not any(s["arms"][a]["fidelity"]["by_reference"][kind]["scored"] +
                   s["arms"][a]["fidelity"]["by_reference"][kind]["identical"] for a in arms):
            continue
        row(f"vs `{kind}`: turns scored (non-identical) / identical", lambda a, k=kind: (
            f"{a['fidelity']['by_reference'][k]['scored']} / {a['fidelity']['by_reference'][k]['identical']}"))
        row(f"vs `{kind}`: fidelity KL, non-identical turns (session mean, 95% CI; lower is closer)",
            lambda a, k=kind: _ci(a["fidelity"]["by_reference"][k]["kl"], 4))
        row(f"vs `{kind}`: top-1 agreement, non-identical turns (session mean, 95% CI)",
            lambda a, k=kind: _ci(a["fidelity"]["by_reference"][k]["top1"]))
    row("prefix-cache hit rate", lambda a: _fmt(a["prefix_cache_hit_rate"], 3))
    for kind, label in (("summary_calls", "LLM summary calls"), ("elasticizer_calls", "ACE LLM elasticizer calls")):
        row(f"{label}: calls / input ids (cached) / generated ids / timed out (counted with the ids sent)",
            lambda a, k=kind: (f"{a[k]['calls']:.0f} / {a[k]['input']:,.0f} ({a[k]['cached']:,.0f}) / "
                               f"{a[k]['generated']:,.0f} / {a[k]['unanswered']:.0f}"))
    row("billed input ids per turn, every model call included: turns + summaries + elasticizer = total",
        lambda a: " + ".join(_fmt(a["cost"][k]) for k in ("turns", "summaries", "elasticizer"))
        + f" = {_fmt(a['cost']['total'])}")
    row("compactions per 100 turns", lambda a: _fmt(a.get("compactions_per_100", float("nan")), 1))
    for key, label in METRICS:
        digits = 2 if key == "glimpses" else 1
        row(f"{label} (mean, 95% CI; p50 / p95)", lambda a, k=key, d=digits: (
            f"{_ci(a['metrics'][k], d)}; {_fmt(a['metrics'][k]['p50'], d)} / {_fmt(a['metrics'][k]['p95'], d)}"))
    diffs = arms[1:]
    if diffs:
        lines += ["", f"Difference from the control arm `{s['control']}` (95% bootstrap CI, unpaired):", "",
                  "| arm | outcome | context tokens | billed ids per turn | turn ms |", "|---|---|---|---|---|"]
        for a in diffs:
            v = s["arms"][a]["vs_control"]
            cells = [f"{_fmt(v[k]['diff'], 3 if k == 'outcome' else 1)} "
                     f"[{_fmt(v[k]['lo'], 3 if k == 'outcome' else 1)}, {_fmt(v[k]['hi'], 3 if k == 'outcome' else 1)}]"
                     for k in ("outcome", "tokens_context", "billed", "total_ms")]
            lines.append(f"| {a} | " + " | ".join(cells) + " |")
    for a, per in s.get("paired", {}).items():
        lines += ["", f"Paired by trajectory and turn (each trajectory ran once per arm): `{a}` − `{s['control']}`; "
                      "per-trajectory mean differences; a two-sided sign-flip permutation test (exact up to "
                      "16 trajectories), significant when p ≤ 0.05, with the interval of the shifts it does not "
                      "reject (unbounded where it can reject none: 5 trajectories or fewer):", "",
                  "| metric | trajectories (turn pairs) | difference [95% interval] | p | significant | "
                  "detectable at 80% power |", "|---|---|---|---|---|---|"]
        for m, label in (("kl:full", "fidelity KL vs `full`"), ("top1:full", "top-1 vs `full`"),
                         ("kl:policy@window", "fidelity KL vs `policy@window`"),
                         ("top1:policy@window", "top-1 vs `policy@window`"),
                         ("outcome", "outcome"), ("tokens_context", "context tokens")):
            v = per[m]
            if not v["n"] and m.endswith("policy@window"):
                continue
            d = 1 if m == "tokens_context" else 4 if m.startswith("kl") else 3
            lines.append(f"| {label} | {v['n']} ({v['pairs']}) | {_ci(v, d)} | {_fmt(v['p'], 3)} | "
                         f"{'yes' if v['significant'] else 'no'} | {_fmt(v['mde'], d)} |")
        if per.get("turn_kinds"):
            lines += ["", f"The `{a}` turns of those pairs: " + "; ".join(
                f"vs `{kind}`: " + ", ".join(f"{k} {v}" for k, v in sorted(c.items()))
                for kind, c in per["turn_kinds"].items()) + "."]
        left = [f"{per[f'kl:{k}']['both_identical']} turn pairs where both arms served the `{k}` reference itself"
                for k in KINDS if per[f"kl:{k}"]["both_identical"]]
        if per["unpaired"]:
            left.append("unpaired turns: " + ", ".join(f"{k} ×{v}" for k, v in sorted(per["unpaired"].items())))
        if left:
            lines += ["", "Left out of the paired comparison: " + "; ".join(left) + "."]
    return "\n".join(lines) + "\n"


def log_ab(summary: dict, experiment: str, params: dict[str, Any], markdown: str,
           extra: dict[str, Any] | None = None) -> tuple[str, str]:
    """One MLflow run for the comparison (``extra``: further JSON artifacts by name); returns (run id, URI)."""
    mlflow, exp = mlflow_experiment(experiment)
    with mlflow.start_run(experiment_id=exp, run_name="ab-" + "-vs-".join(summary["arms"])) as run:
        mlflow.log_params({k: str(v)[:500] for k, v in params.items()})
        metrics = {}
        for arm, a in summary["arms"].items():
            tag = arm.replace("+", "_plus_")
            metrics[f"{tag}.turns"] = a["turns"]
            metrics[f"{tag}.errors"] = a["errors"]
            if a["outcome"]["n"]:
                metrics[f"{tag}.outcome"] = a["outcome"]["mean"]
            f = a["fidelity"]
            metrics.update({f"{tag}.shadow.scored": f["scored"], f"{tag}.shadow.identical": f["identical"],
                            f"{tag}.shadow.skipped": f["skipped"]})
            for kind, by in f["by_reference"].items():
                if by["kl"]["n"]:
                    metrics[f"{tag}.shadow_kl.{kind.replace('@', '_at_')}"] = by["kl"]["mean"]
                    metrics[f"{tag}.shadow_top1.{kind.replace('@', '_at_')}"] = by["top1"]["mean"]
            for k, m in a["metrics"].items():
                if m["n"]:
                    metrics[f"{tag}.{k}.mean"] = m["mean"]
                    metrics[f"{tag}.{k}.p95"] = m["p95"]
        mlflow.log_metrics(metrics)
        mlflow.log_dict(summary, "ab_summary.json")
        mlflow.log_text(markdown, "ab_report.md")
        for name, value in (extra or {}).items():
            mlflow.log_dict(value, name)
        fig = fidelity_cost_figure(summary)
        if fig is not None:
            mlflow.log_figure(fig, "fidelity_vs_cost.png")
            close_figure(fig)
        return run.info.run_id, tracking_uri()
