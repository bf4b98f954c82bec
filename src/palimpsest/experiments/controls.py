"""The A/B lane's controls, in the configuration users run (``palimpsest demo --control``).

One live run drives every trajectory once per arm:

- ``last2``: the two previous steps only, planned per turn: the deliberately weak arm, and the control;
- ``pace``: PACE as users run it (the default compaction epochs);
- ``pace-per-turn``: PACE planning every turn anew (the seeds' behaviour), at the same budget;
- ``pace-aa``: ``pace`` again, under another name.

Two comparisons come out of the same records:

- **positive controls**: ``pace`` − ``last2`` and ``pace-per-turn`` − ``last2`` in fidelity KL to the full
  history (negative: the arm is closer to the full-history actor than ``last2``). A lane that cannot see these
  cannot see anything; if the default (epochs) loses, that is reported as it came out;
- **the A/A control**: ``pace-aa`` − ``pace``. Two arms with one configuration must not come out significant.

Each verdict names its direction, its test (``experiments.stats.paired_test``) and which turns its pairs came from
(an epoch's compaction boundary, an append-only turn, or a per-turn plan).
"""

from __future__ import annotations

from typing import Any

#: the controls' arms, control (the weak arm) first
CONTROL_ARMS: tuple[dict, ...] = (
    {"name": "last2", "policy": {"type": "window", "k": 2, "compaction": {"mode": "per_turn"}}, "weight": 1.0},
    {"name": "pace", "policy": {"type": "pace"}, "weight": 1.0},
    {"name": "pace-per-turn", "policy": {"type": "pace", "compaction": {"mode": "per_turn"}}, "weight": 1.0},
    {"name": "pace-aa", "policy": {"type": "pace"}, "weight": 1.0},
)
#: the positive controls' report: the weak arm first, then the two ways of running PACE
POSITIVE = ("last2", "pace", "pace-per-turn")
#: the A/A control's report: the same configuration under two names
AA = ("pace", "pace-aa")
#: where the controls run by default: the whole history of most dev trajectories fits an 8K reference at step
#: 8, and it passes the 4K budget, so the arms differ (BENCHMARKS.md "The controls")
CONTROL_SHAPE = {"budget": 4096, "window": 8192, "first": 8, "max_turns": 1}


def verdict(summary: dict, arm: str, metric: str = "kl:full") -> dict[str, Any]:
    """The paired comparison of ``arm`` against the summary's control on ``metric`` as one record: the mean
    difference, its interval, p, significance, the pairs' turn kinds, and the direction in words."""
    control = summary["control"]
    per = (summary.get("paired") or {}).get(arm)
    v = per.get(metric) if per else None
    if not v or not v.get("n"):
        return {"arm": arm, "control": control, "metric": metric, "n": 0, "direction": "no pairs"}
    d = v["mean"]
    closer = "closer to" if d < -5e-5 else "further from" if d > 5e-5 else "as close to"
    return {"arm": arm, "control": control, "metric": metric, "n": v["n"], "pairs": v["pairs"], "difference": d,
            "lo": v["lo"], "hi": v["hi"], "p": v["p"], "significant": bool(v["significant"]),
            "turn_kinds": dict((per.get("turn_kinds") or {}).get(metric.split(":", 1)[1], {})),
            "direction": f"`{arm}` is {closer} the full-history actor than `{control}`"}


def differing_prompts(served: list[dict], arms: tuple[str, str] = AA,
                      audit: list[dict] | None = None) -> dict[str, int]:
    """The two arms' turns on the same (trajectory, t), compared by what they served: ``pairs``, and ``differ``
    of them. Two arms of one configuration serve the same prompt on a deterministic platform, so any differing
    pair is a defect whatever the fidelity test says.

    A turn is compared by its prompt's hash (the audit's ``prompt_hash``: the same ids, not only as many), taken
    from the row itself or from ``audit`` (rows with ``session_id``, ``t`` and ``prompt_hash``, as
    :func:`audit_rows` gives them); a pair with a side that has none is compared by size (``tokens_context``)
    and counted in ``by_size``: equal sizes there do not show equal prompts."""
    hashes = {(r["session_id"], int(r["t"])): r["prompt_hash"] for r in audit or [] if r.get("prompt_hash")}
    by: dict[tuple[str, int], dict[str, tuple]] = {}
    for r in served:
        for arm in arms:
            if r["session_id"].endswith("@" + arm):
                key = (r["session_id"], int(r["t"]))
                h = r.get("prompt_hash") or hashes.get(key)
                by.setdefault((r["session_id"][: -len(arm) - 1], int(r["t"])), {})[arm] = \
                    (h, r.get("tokens_context"))
    pairs = [v for v in by.values() if len(v) == 2]
    hashed = [v[arms[0]][0] is not None and v[arms[1]][0] is not None for v in pairs]
    differ = sum(v[arms[0]][0 if h else 1] != v[arms[1]][0 if h else 1] for v, h in zip(pairs, hashed))
    return {"pairs": len(pairs), "differ": differ, "by_size": hashed.count(False)}


def audit_rows(ledger: Any, session_ids: set[str] | list[str]) -> list[dict]:
    """Each session's audited turns as rows for :func:`differing_prompts` (``session_id``, ``t``,
    ``prompt_hash``), read from a ledger (``Ledger.audit``)."""
    return [{"session_id": sid, "t": int(r["t"]), "prompt_hash": r["prompt_hash"]}
            for sid in sorted(set(session_ids)) for r in ledger.audit(sid)]


def control_verdicts(positive: dict, aa: dict, served: list[dict] | None = None,
                     audit: list[dict] | None = None) -> dict[str, Any]:
    """The positive controls (each PACE arm against ``last2``) and the A/A control, with their verdicts.

    The A/A verdict (``aa_status``) is ``failed`` when the test finds a difference, or when two arms of one
    configuration served different prompts (``served``: the run's served turns; ``audit``: their prompts'
    hashes, :func:`differing_prompts`); ``inconclusive`` when the test could not have found one at this many
    trajectories (5 or fewer: the smallest p a sign-flip test reaches is 2/2^n > 0.05), and ``ok``
    otherwise."""
    out: dict[str, Any] = {"positive": [verdict(positive, arm) for arm in POSITIVE[1:]], "aa": verdict(aa, AA[1])}
    a = out["aa"]
    out["aa_prompts"] = prompts = differing_prompts(served or [], AA, audit)
    if not a["n"]:
        out["aa_status"] = "inconclusive"
    elif a.get("significant") or prompts["differ"]:
        out["aa_status"] = "failed"
    else:
        out["aa_status"] = "ok" if 2.0 / 2 ** a["n"] <= 0.05 else "inconclusive"
    return out


def verdicts_markdown(v: dict) -> str:
    """The controls' verdicts as plain lines (a log reads them as well as a terminal)."""
    lines = ["**The controls** (fidelity KL to the full history, arm − control, paired by trajectory and turn; "
             "sign-flip test):", ""]
    for r in [*v["positive"], v["aa"]]:
        if not r["n"]:
            lines.append(f"- `{r['arm']}` − `{r['control']}`: no turn pairs against the `full` reference")
            continue
        kinds = ", ".join(f"{k} {n}" for k, n in sorted(r["turn_kinds"].items())) or "-"
        sig = "significant" if r["significant"] else "not significant"
        lines.append(f"- `{r['arm']}` − `{r['control']}`: {r['difference']:+.4f} [{r['lo']:+.4f}, {r['hi']:+.4f}], "
                     f"p = {r['p']:.3f} over {r['n']} trajectories ({r['pairs']} turn pairs; the arm's turns: "
                     f"{kinds}): {sig}; {r['direction']}")
    a, prompts = v["aa"], {"pairs": 0, "differ": 0, "by_size": 0, **(v.get("aa_prompts") or {})}
    said = {"ok": "no difference found, and the test could have found one",
            "inconclusive": f"no difference found, but at {a['n']} trajectories the test cannot find one (the "
                            "smallest p it reaches is above 0.05): read the prompts' agreement instead",
            "failed": "FAILED: two arms of one configuration differ (a finding, not a setting to change)"}
    size = f" ({prompts['by_size']} compared by size only: no prompt hash)" if prompts["by_size"] else ""
    lines.append(f"- A/A: {said[v['aa_status']]}; served prompts that differ: {prompts['differ']} of "
                 f"{prompts['pairs']} pairs{size}")
    return "\n".join(lines) + "\n"


__all__ = ["AA", "CONTROL_ARMS", "CONTROL_SHAPE", "POSITIVE", "audit_rows", "control_verdicts", "differing_prompts",
           "verdict", "verdicts_markdown"]
