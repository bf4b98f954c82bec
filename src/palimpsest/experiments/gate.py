"""Rollouts that decide: a candidate arm (``candidate_of`` in the serve config) moves dark -> canary -> promoted,
or is withdrawn, on the evidence of its paired shadow records, and each decision is appended to the ledger.

The evidence of a stage is the pairs scored since the stage began (the candidate's last decision, or the first
pair of its ``subject``): a paired turn is the control's and the candidate's prompt of that same turn scored
against the same full-history reference over the same reply (``serving/turn/shadow.py``). The gate
(:func:`palimpsest.experiments.stats.gate_decision`, a sequential test read after every session) takes one
difference per session, in arrival order, from the session's first scored pair (the turns of one session are
not independent of each other; sessions are):

- quality: ``candidate_kl - control_kl`` (KL nats per reply token; lower is better: negative where the
  candidate's prompt leaves the actor closer to the whole history);
- cost: ``candidate_tokens - control_tokens`` (prompt positions, ids and soft; positive where it costs more).

A ``promote`` moves a dark candidate to canary and a canary to promoted, a ``withdraw`` moves either to
withdrawn; ``hold`` records nothing. A decision names the decision it follows, and the ledger refuses one taken
on a stale view, so of several replicas deciding at once one decision stands. Nothing here loads Ray or torch:
the replicas, ``palimpsest ab status`` and the tests call the same functions.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from palimpsest.experiments import stats
from palimpsest.pipelines import tracking
from palimpsest.platform.types import PalimpsestError

log = logging.getLogger("palimpsest.rollouts")

QUALITY = ("candidate_kl - control_kl of each session's first paired turn (lower is better: negative where the "
           "candidate's prompt is closer to the reference)")
COST = ("candidate_tokens - control_tokens of each session's first paired turn (prompt positions, ids and soft; "
        "positive where it costs more)")
#: where each decision takes a candidate from each stage it is gated in
MOVES = {("dark", "promote"): "canary", ("canary", "promote"): "promoted",
         ("dark", "withdraw"): "withdrawn", ("canary", "withdraw"): "withdrawn"}
GATED = ("dark", "canary")


def subject_of(policy_hash: str, memory: str | None) -> str:
    """What a candidate is judged as: its policy config and its memory model. Another of either (a newly
    registered memory) starts a history of its own, dark."""
    return f"policy={policy_hash} memory={memory or 'none'}"


@dataclass(frozen=True)
class Judged:
    """A candidate arm as the rollout sees it."""
    name: str
    control: str
    subject: str
    stage: str = "dark"  # its stage until the ledger records a decision (the serve config's)
    policy: dict = field(default_factory=dict, compare=False)  # its policy config, as JSON (logged with decisions)
    memory: str | None = None  # its memory model's reference


def stages(ledger, candidates: Sequence[Judged]) -> dict[str, dict]:
    """Each candidate's stage in force: ``{name: {stage, control, decision (the latest's id, 0: none), since
    (when the stage began, 0: none recorded)}}``."""
    latest = ledger.rollout_latest()
    out = {}
    for c in candidates:
        row = latest.get((c.name, c.subject))
        out[c.name] = {"stage": row["stage"] if row else c.stage, "control": c.control,
                       "decision": row["id"] if row else 0, "since": row["created"] if row else 0.0}
    return out


def evidence(ledger, c: Judged, since: float = 0.0) -> dict[str, Any]:
    """The paired records of ``c`` since ``since``: the gate's two lists (one difference per session, from its
    first scored pair, in arrival order) and the counts of pairs and sessions."""
    pairs = [p for p in ledger.shadow_pairs(c.name, c.subject) if p["created"] >= since]
    scored = [p for p in pairs if p["status"] == "scored"]
    first: dict[str, dict] = {}
    for p in scored:
        first.setdefault(p["session_id"], p)
    return {"quality_diffs": [p["candidate_kl"] - p["control_kl"] for p in first.values()],
            "cost_diffs": [float(p["candidate_tokens"] - p["control_tokens"]) for p in first.values()],
            "sessions": len(first), "scored": len(scored), "skipped": len(pairs) - len(scored)}


def gate_function() -> Callable[..., dict]:
    """The gate, looked up when it is called (a test puts its own in its place)."""
    fn = getattr(stats, "gate_decision", None)
    if fn is None:
        raise PalimpsestError("experiments.stats has no gate_decision: the rollout gate is not available")
    return fn


def decide(ledger, c: Judged, alpha: float, margin: float, min_pairs: int, candidates: int = 1) -> dict:
    """Run the gate on ``c``'s evidence since its stage began and append the decision when it moves the stage.
    Returns the gate's answer with ``stage`` (in force after it) and ``recorded`` (the new decision's id, or
    None: a hold, too few pairs, a stage the gate does not move, or another replica deciding first)."""
    now = stages(ledger, [c])[c.name]
    if now["stage"] not in GATED:
        return {"decision": "hold", "reason": f"{now['stage']}: not gated", "stage": now["stage"], "recorded": None}
    ev = evidence(ledger, c, now["since"])
    if ev["sessions"] < min_pairs:
        return {"decision": "hold", "reason": f"{ev['sessions']} of {min_pairs} sessions paired", "stage": now["stage"],
                "pairs": ev["scored"], "sessions": ev["sessions"], "recorded": None}
    result = dict(gate_function()(quality_diffs=ev["quality_diffs"], cost_diffs=ev["cost_diffs"], alpha=alpha,
                                  margin=margin, candidates=candidates))
    to = MOVES.get((now["stage"], result.get("decision")))
    if to is None:
        return {**result, "stage": now["stage"], "pairs": ev["scored"], "sessions": ev["sessions"], "recorded": None}
    record = {**result, "from": now["stage"], "to": to, "pairs": ev["scored"], "pairs_skipped": ev["skipped"],
              "sessions": ev["sessions"], "since": now["since"], "alpha": alpha, "margin": margin,
              "candidates": candidates, "quality_diff": QUALITY, "cost_diff": COST, "policy": c.policy,
              "memory": c.memory}
    row = ledger.record_rollout(c.name, c.control, c.subject, to, result["decision"], record, prev=now["decision"])
    return {**record, "stage": to if row is not None else now["stage"], "recorded": row}


def status(ledger) -> dict:
    """Every candidate the ledger holds decisions or pairs of, per subject: the stage in force, each decision with
    its evidence, and the pairs recorded since the stage began (``palimpsest ab status``)."""
    decisions = ledger.rollouts()
    pairs = ledger.shadow_pairs()
    keys = list(dict.fromkeys([(d["candidate"], d["subject"], d["control"]) for d in decisions]
                              + [(p["candidate"], p["subject"], p["control"]) for p in pairs]))
    out = []
    for name, subject, control in keys:
        mine = [d for d in decisions if d["candidate"] == name and d["subject"] == subject]
        since = mine[-1]["created"] if mine else 0.0
        c = Judged(name, control, subject)
        ev = evidence(ledger, c, since)
        q = ev["quality_diffs"]
        out.append({"candidate": name, "control": control, "subject": subject,
                    "stage": mine[-1]["stage"] if mine else "dark", "since": since, "decisions": mine,
                    "pairs": {"scored": ev["scored"], "skipped": ev["skipped"], "sessions": ev["sessions"],
                              "quality_mean": sum(q) / len(q) if q else None}})
    return {"candidates": out}


def most_evidence(n: int) -> float:
    """The largest e-value the sequential test can reach after ``n`` differences (every bet won in full): a side
    needs 2/alpha, so below the ``n`` where this reaches it no decision is possible whatever the data."""
    import numpy as np

    return float(np.mean((1.0 + stats.BETS) ** n)) if n else 1.0


def _gate_line(r: dict) -> str:
    """A gate answer's evidence in words: n, each e-value beside the level it must reach, the differences' means."""
    q, c = r.get("quality") or {}, r.get("cost") or {}
    if not q:
        return r.get("reason", "")
    n = int(r.get("n", 0))
    e = {k: v["e_value"] for k, v in q.items()}
    return (f"n = {n} sessions (the most any e-value can reach at this n: {most_evidence(n):.1f}); quality e-values: "
            f"worse {e['worse']:.3g} (withdraws at {q['worse']['threshold']:g}), better {e['better']:.3g}, not worse "
            f"by {r.get('margin', 0):g} {e['non_inferior']:.3g} (each promotes at {q['better']['threshold']:g}); "
            f"cost e-value (billed ids lower) {c.get('e_value', 1.0):.3g}")


def decisions_markdown(results: list[dict], state: dict) -> str:
    """The rollout's decisions, first in a report: per candidate, the gate's answer on the run's last read (``decide``:
    promote, withdraw or hold, with its evidence) and every decision the ledger holds for it (``status``)."""
    if not results:
        return ""
    lines = ["**Decisions** (the rollout gate, `experiments/stats.py:gate_decision`: a sequential test valid "
             "whenever it is read, one difference per session from its first paired turn, "
             f"alpha {results[0].get('alpha', 0.05):g} over {len(results)} candidate(s)):", ""]
    recorded = {(c["candidate"], c["subject"]): c for c in state.get("candidates", [])}
    for r in results:
        row = recorded.get((r["candidate"], r["subject"])) or {"decisions": [], "stage": r.get("stage")}
        head = f"- `{r['candidate']}` (candidate of `{r['control']}`, {r['subject']})"
        for d in row["decisions"]:
            ev = d["evidence"]
            lines.append(f"{head}: **{d['decision']}** -> {d['stage']} (ledger decision #{d['id']}; "
                         f"{ev.get('reason', '')}): {_gate_line(ev)}")
        if r.get("recorded") is None and r.get("stage") in GATED:  # the last read moved nothing: what it said
            lines.append(f"{head}: **{r['decision']}**, stays {r.get('stage')} ({r.get('reason', '')})"
                         + (f": {_gate_line(r)}" if r.get("quality") else ""))
    lines += ["", f"Quality: {QUALITY}. Cost: {COST}.", ""]
    return "\n".join(lines) + "\n"


def pairs_markdown(ledger, judged: Sequence[Judged]) -> str:
    """Each candidate's pairs of the run: counts, the per-session differences' means, and the fixed-n sign-flip
    test on the same differences (valid read once, at the end; the gate above is the one read at every refresh)."""
    if not judged:
        return ""
    lines = ["| candidate | pairs scored (skipped) | sessions | quality diff, mean | cost diff, mean (positions) | "
             "sign-flip p, read once |", "|---|---|---|---|---|---|"]
    for c in judged:
        ev = evidence(ledger, c)
        q, cost = ev["quality_diffs"], ev["cost_diffs"]
        p = stats.paired_test(q)["p"] if q else float("nan")
        lines.append(f"| {c.name} | {ev['scored']} ({ev['skipped']}) | {ev['sessions']} | "
                     f"{(sum(q) / len(q) if q else float('nan')):+.4f} | "
                     f"{(sum(cost) / len(cost) if cost else 0):+.1f} | {p:.3f} |")
    return "\n".join(lines) + "\n\n"


def tracking_configured(uri: str | None) -> bool:
    """Whether decisions go to MLflow: a serve config's ``tracking.uri`` or ``$MLFLOW_TRACKING_URI``."""
    return bool(uri or os.environ.get("MLFLOW_TRACKING_URI"))


def log_decision(decision: dict, c: Judged, experiment: str) -> str | None:
    """The decision as an MLflow run beside the policy config and the memory bundle it concerns; best effort
    (a tracking store that fails is logged, never raised into the replica)."""
    try:
        return tracking.log_rollout(c.name, c.control, c.subject, decision, c.policy, c.memory, experiment)
    except Exception as e:
        log.warning("could not log the rollout decision on %s to MLflow: %s", c.name, e)
        return None


def markdown(state: dict) -> str:
    """``palimpsest ab status`` as text."""
    if not state["candidates"]:
        return "No candidate arm has a decision or a paired shadow record in this ledger."
    lines = ["| candidate | control | stage | pairs since | quality diff mean | subject |", "|---|---|---|---|---|---|"]
    for c in state["candidates"]:
        q = c["pairs"]["quality_mean"]
        lines.append(f"| {c['candidate']} | {c['control']} | {c['stage']} | {c['pairs']['scored']} scored "
                     f"({c['pairs']['sessions']} sessions), {c['pairs']['skipped']} skipped | "
                     f"{'-' if q is None else f'{q:+.4f}'} | {c['subject']} |")
    lines += ["", f"Quality diff: {QUALITY}."]
    for c in state["candidates"]:
        for d in c["decisions"]:
            ev = {k: v for k, v in d["evidence"].items() if k not in ("quality_diff", "cost_diff", "policy", "quality",
                                                                      "cost")}
            lines.append(f"- {c['candidate']}: {d['decision']} -> {d['stage']} (#{d['id']}): "
                         f"{json.dumps(ev, default=str)}")
    return "\n".join(lines)
