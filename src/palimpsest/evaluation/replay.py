"""Replay evaluation: does a policy keep what the agent will need, at what token cost, for how long?

For every trajectory and every step t, the context the actor would see before taking step t's
action is compiled from the ledger (history = steps before t) under each policy, then checked
against the step's ground-truth needs: tokens of earlier observations that step t's action uses.
The policy, the compiler and the runtime are the production ones; replay only keeps each policy's
own state (its rolling summary, its previous context size) instead of writing audits.

Outputs in ``out``: ``steps.parquet`` (one row per policy and step), ``summary.json`` and
``summary.md``. Metrics are defined in ``docs/metrics.md``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

import numpy as np

from palimpsest.pipelines.replay_sessions import (
    ReplayError,
    ReplaySession,
    ReplayStep,
    Skipped,
    TimedEmbedder,
    action_targets,
    appears,
    prepare_sessions,
    walk_turns,
)
from palimpsest.pipelines.trajectories import (
    Need,
    file_sha256,
    read_trajectories,
)
from palimpsest.platform.compile.budget import Budget
from palimpsest.platform.compile.epochs import CACHE_BLOCK, compaction_of, turn_cost
from palimpsest.platform.ledger import SessionSnapshot
from palimpsest.platform.policies import PolicyConfigBase
from palimpsest.platform.prompt.chat import chat_ids, prefix_messages
from palimpsest.platform.prompt.render import own_words, step_messages
from palimpsest.platform.runtime import Runtime
from palimpsest.platform.types import (
    BudgetError,
    Resolution,
)

DISTANCES = (("1-4", 1, 4), ("5-19", 5, 19), ("20+", 20, math.inf))
CONCAT_WINDOW = 250
#: Longevity on a concatenated session: steps until a window's recall 1-4 steps back falls below this.
RECENT_RECALL_FLOOR = 0.95


#: A cached input token's price against an uncached one (the API providers' cached-input rate).
CACHED_RATE = 0.1


def replay_session(rt: Runtime, sess: ReplaySession, label: str, cfg: PolicyConfigBase, limit: Budget,
                   timer: TimedEmbedder | None, on_step: Callable[[], None] | None = None,
                   targets: list[tuple[str, ...]] | None = None,
                   cached_rate: float = CACHED_RATE) -> list[dict]:
    """Per-step rows for one policy over one session: the served prompt (its exact ids), checked on the
    text the actor receives, and what it costs against the previous turn's ids (a prefix cache holds their
    common prefix in whole blocks)."""
    full = rt.snapshot(sess.session_id)
    full_cost = _full_sizes(rt, full)
    prefix_text = _prefix_text(full)
    rows = []
    embed_before = timer.seconds if timer else 0.0
    prev_ids: list[int] | None = None
    epochs = compaction_of(rt.policy(cfg)) is not None
    for rs, snap, turn, seconds in walk_turns(rt, sess, cfg, limit):
        t = rs.t
        row = {"policy": label, "budget": limit.total, "trajectory": rs.trajectory, "t": t - rs.offset, "session_t": t,
               "full_tokens": int(full_cost[t]), "skipped": None}
        embedded = (timer.seconds - embed_before) if timer else 0.0
        embed_before = timer.seconds if timer else 0.0
        if isinstance(turn, BudgetError):
            row.update(_empty_row(rs.needs))
            row["skipped"] = str(turn)
            rows.append(row)
            if on_step:
                on_step()
            continue
        row.update(_check(turn.prompt.text, turn, rs, snap, prefix_text))
        if targets is not None and t < len(targets):
            row["action_ids"] = len(targets[t])
            row["action_id_hits"] = sum(appears(tok, turn.prompt.text) for tok in targets[t])
        ids = turn.prompt.ids
        row.update(turn_cost(prev_ids, ids, cached_rate))
        # a rebuild: a compaction boundary (epochs), or every turn of a policy that plans per turn
        row["compaction"] = bool(turn.compacted) if epochs else prev_ids is not None
        prev_ids = ids
        row["ms"] = (seconds - embedded) * 1000
        row["over_budget"] = turn.prompt.tokens + limit.reserve > limit.total
        row["elided"] = len(turn.plan.info.get("elided", []))
        rows.append(row)
        if on_step:
            on_step()
    return rows


def cost_summary(rows: list[dict]) -> dict:
    """Per-turn means of what a prefix cache leaves to pay (rows with ``turn_cost`` fields and ``compaction``)."""
    if not rows:
        return {"prefix_reuse": None, "uncached_per_turn": None, "billed_per_turn": None, "compactions_per_100": None}
    return {"prefix_reuse": round(float(np.mean([r["prefix_reuse"] for r in rows])), 4),
            "uncached_per_turn": round(float(np.mean([r["uncached"] for r in rows])), 1),
            "billed_per_turn": round(float(np.mean([r["billed"] for r in rows])), 1),
            "compactions_per_100": round(100.0 * sum(r["compaction"] for r in rows) / len(rows), 2)}


def session_cost(rt: Runtime, session_id: str, cfg: PolicyConfigBase, limit: Budget, upto: int,
                 cached_rate: float = CACHED_RATE) -> dict:
    """What the turns of one ledger session cost under a policy, replayed from its first step to ``upto``:
    the per-turn means of ``summarize`` (prefix reuse, uncached and billed ids, compactions per 100 turns)
    and the last turn's own figures. ``palimpsest render --json`` reports it."""
    sess = ReplaySession(session_id, [ReplayStep(t, session_id, ()) for t in range(upto + 1)])
    epochs = compaction_of(rt.policy(cfg)) is not None
    prev: list[int] | None = None
    rows = []
    for _rs, _snap, turn, _s in walk_turns(rt, sess, cfg, limit):
        if isinstance(turn, BudgetError):
            continue
        ids = turn.prompt.ids
        rows.append({**turn_cost(prev, ids, cached_rate), "tokens": len(ids),
                     "compaction": bool(turn.compacted) if epochs else prev is not None})
        prev = ids
    if not rows:
        return {"turns": 0}
    return {"turns": len(rows), "cached_rate": cached_rate, "cache_block": CACHE_BLOCK, **cost_summary(rows),
            "this_turn": rows[-1]}


def _full_sizes(rt: Runtime, snap: SessionSnapshot) -> np.ndarray:
    """(M + 1,) the exact size of the whole history's prompt before each step t (what `full` would send),
    from each step's messages measured under the chat template once (messages are delimited by the
    template's special tokens, so their sizes add up)."""
    tok = rt.ledger.tokenizer
    prefix = prefix_messages(snap.session)
    base = len(chat_ids(tok, prefix))
    sizes = np.zeros(snap.t + 1, dtype=np.int64)
    sizes[0] = base
    for i, step in enumerate(snap.steps):
        msgs = step_messages(step, step.id, Resolution.FULL, None)
        sizes[i + 1] = len(chat_ids(tok, prefix + msgs)) - base
    return base + np.concatenate([[0], np.cumsum(sizes[1:])])


def _empty_row(needs: Iterable[Need]) -> dict:
    needs = list(needs)
    strong = [n for n in needs if n.strength == "strong"]
    out = {"tokens": 0, "ms": float("nan"), "over_budget": False, "strong_needs": len(strong), "strong_hits": 0,
           "weak_needs": len(needs) - len(strong), "weak_hits": 0, "recoverable": 0, "far_needs": 0, "far_hits": 0,
           "elided": 0, "action_ids": 0, "action_id_hits": 0, "cached": 0, "uncached": 0, "billed": 0.0,
           "prefix_reuse": 0.0, "compaction": False}
    out.update({f"n_{r.label}": 0 for r in Resolution})
    out.update({f"far_lost_{r.label}": 0 for r in Resolution})
    out["far_lost_ids"] = 0
    for key, lo, hi in DISTANCES:
        out[f"needs_{key}"] = 0
        out[f"hits_{key}"] = 0
    return out


def _prefix_text(snap: SessionSnapshot) -> str:
    return "\n".join(m["content"] for m in prefix_messages(snap.session))


def _check(text: str, turn, rs: ReplayStep, snap: SessionSnapshot, prefix_text: str = "") -> dict:
    """Need checks on the text the actor receives (the prompt's ids decoded), on identifier boundaries.

    A strong need is *far* when its token is in neither of the two previous steps nor the fixed prefix:
    those are the needs a policy can lose (every policy shows the prefix and the latest steps)."""
    out = _empty_row(rs.needs)
    out["tokens"] = turn.prompt.tokens
    for name, n in turn.plan.counts().items():
        out[f"n_{name}"] = n
    placeholders = {s.t for s in turn.prompt.segments if s.resolution is Resolution.PLACEHOLDER}
    spent = {s.t: s.tokens for s in turn.prompt.segments if s.kind == "step" and s.t is not None}
    near = "\n".join(own_words(snap.steps[i]) for i in range(max(0, snap.t - 2), snap.t))
    for need in rs.needs:
        hit = appears(need.token, text)
        if need.strength != "strong":
            out["weak_hits"] += hit
            continue
        out["strong_hits"] += hit
        if not (appears(need.token, near) or appears(need.token, prefix_text)):
            out["far_needs"] += 1
            out["far_hits"] += hit
            if not hit:  # where a lost far need went: its source step's resolution and the ids spent on it
                src = need.last_obs_step + rs.offset
                if 0 <= src < len(turn.plan):
                    label = Resolution(int(turn.plan.resolution[src])).label
                    out[f"far_lost_{label}"] += 1
                    out["far_lost_ids"] += int(spent.get(src, 0))
        dist = (rs.t - rs.offset) - need.last_obs_step
        for key, lo, hi in DISTANCES:
            if lo <= dist <= hi:
                out[f"needs_{key}"] += 1
                out[f"hits_{key}"] += hit
        if not hit:
            sources = getattr(need, "obs_steps", None) or [need.last_obs_step]
            out["recoverable"] += any(s + rs.offset in placeholders for s in sources)
    return out


def _ratio(hits: int, total: int) -> float | None:
    return round(hits / total, 4) if total else None


def summarize(rows: list[dict], budget: int, concat: bool) -> dict:
    done = [r for r in rows if r["skipped"] is None]
    strong = sum(r["strong_needs"] for r in done)
    weak = sum(r["weak_needs"] for r in done)
    tokens = np.array([r["tokens"] for r in done], dtype=np.float64)
    ratios = [r["tokens"] / r["full_tokens"] for r in done if r["full_tokens"]]
    ms = [r["ms"] for r in done]
    out = {
        "need_recall_strong": _ratio(sum(r["strong_hits"] for r in done), strong),
        "need_recall_weak": _ratio(sum(r["weak_hits"] for r in done), weak),
        "need_recall_far": _ratio(sum(r["far_hits"] for r in done), sum(r["far_needs"] for r in done)),
        "far_needs": sum(r["far_needs"] for r in done),
        # each far need the prompt lost, by the resolution its source step got (and the ids spent on those)
        "far_lost": {r.label: sum(x[f"far_lost_{r.label}"] for x in done) for r in Resolution},
        "far_lost_ids": sum(r["far_lost_ids"] for r in done),
        "action_id_recall": _ratio(sum(r["action_id_hits"] for r in done), sum(r["action_ids"] for r in done)),
        "recall_by_distance": {k: _ratio(sum(r[f"hits_{k}"] for r in done), sum(r[f"needs_{k}"] for r in done))
                               for k, _, _ in DISTANCES},
        "token_ratio": round(float(np.mean(ratios)), 4) if ratios else None,
        "mean_tokens": round(float(tokens.mean()), 1) if done else None,
        "p95_tokens": round(float(np.percentile(tokens, 95)), 1) if done else None,
        "over_budget_steps": sum(1 for r in done if r["over_budget"]),
        "elided_steps": sum(1 for r in done if r["elided"]),
        "recoverable": sum(r["recoverable"] for r in done),
        "ms_per_step": round(float(np.median(ms)), 3) if ms else None,
        # what a prefix cache leaves to pay, per turn (the previous turn's ids, 16-token blocks)
        **cost_summary(done),
        "steps": len(rows),
        "strong_needs": strong,
        "skipped_steps": len(rows) - len(done),
    }
    if concat:
        # Longevity that can fail: the first step of the first window whose recall 1-4 steps back falls below
        # RECENT_RECALL_FLOOR (the session's length when none does). The budget bound itself always holds.
        windows = []
        out["longevity_steps"] = len(rows)
        for start in range(0, len(rows), CONCAT_WINDOW):
            chunk = [r for r in rows[start: start + CONCAT_WINDOW] if r["skipped"] is None]
            recent = _ratio(sum(r["hits_1-4"] for r in chunk), sum(r["needs_1-4"] for r in chunk))
            windows.append({"steps": f"{start}-{start + CONCAT_WINDOW - 1}",
                            "need_recall_strong": _ratio(sum(r["strong_hits"] for r in chunk),
                                                         sum(r["strong_needs"] for r in chunk)),
                            "recall_1-4": recent})
            if recent is not None and recent < RECENT_RECALL_FLOOR and out["longevity_steps"] == len(rows):
                out["longevity_steps"] = start
        out["recall_by_window"] = windows
    return out


@dataclass
class ReplayResult:
    summary: dict
    rows: list[dict] = field(default_factory=list)


def run_replay(rt: Runtime, data: Path, policies: dict[str, PolicyConfigBase], budget: int, concat: bool = False,
               timer: TimedEmbedder | None = None, progress=None, reserve: int = 0, repeat: int = 1,
               cached_rate: float = CACHED_RATE) -> ReplayResult:
    """Replay every trajectory of ``data`` under every policy. ``progress`` is an optional rich Progress.
    ``repeat`` (with ``concat``): the trajectories N times over, as one session N times as long."""
    if not 0.0 <= cached_rate <= 1.0:
        raise ReplayError(f"the cached-input rate must be within [0, 1], got {cached_rate}")
    if repeat < 1 or (repeat > 1 and not concat):
        raise ReplayError(f"repeat must be >= 1 and needs concat, got repeat={repeat}, concat={concat}")
    limit = Budget(budget, reserve)
    read = read_trajectories(data)
    skipped = [Skipped(e.split(":")[0], e) for e in read.errors]
    if not read.trajectories:
        raise ReplayError(f"{data}: no valid trajectory to replay ({'; '.join(read.errors[:3])})")
    sha = file_sha256(data)
    trajs = list(read.trajectories) * repeat
    task = progress.add_task("importing + enriching", total=len(trajs)) if progress else None
    sessions = prepare_sessions(rt, trajs, concat, sha, skipped, repeat=repeat,
                                on_progress=(lambda _: progress.advance(task)) if progress else None)
    # A budget that cannot hold a trajectory's fixed prefix is that trajectory's error, not the run's.
    usable = []
    for sess in sessions:
        prefix = rt.snapshot(sess.session_id, at=0).prefix_tokens
        if prefix + reserve > budget:
            skipped.append(Skipped(sess.session_id,
                                   f"budget {budget} is smaller than its fixed prefix ({prefix} tokens)"))
        else:
            usable.append(sess)
    if not usable:
        raise ReplayError("; ".join(f"{s.trajectory}: {s.reason}" for s in skipped) or "nothing to replay")
    n_steps = sum(len(s.steps) for s in usable)
    targets = {s.session_id: action_targets(rt.snapshot(s.session_id)) for s in usable}
    rows: list[dict] = []
    by_policy: dict[str, dict] = {}
    for label, cfg in policies.items():
        bar = progress.add_task(f"{label}", total=n_steps) if progress else None
        policy_rows = []
        for sess in usable:
            policy_rows += replay_session(rt, sess, label, cfg, limit, timer,
                                          on_step=(lambda: progress.advance(bar)) if progress else None,
                                          targets=targets[sess.session_id],
                                          cached_rate=cached_rate)
        by_policy[label] = summarize(policy_rows, budget, concat)
        rows += policy_rows
    summary = {
        "data": {"file": str(data), "sha256": sha, "trajectories": len(read.trajectories), "steps": n_steps},
        "budget": budget,
        "max_tokens": reserve,
        "concat": concat,
        "repeat": repeat,
        "cached_rate": cached_rate,
        "cache_block": CACHE_BLOCK,
        "embedder": rt.embedder.name,
        "tokenizer": rt.ledger.tokenizer.name,
        "policies": by_policy,
        "policy_configs": {k: v.model_dump(mode="json") for k, v in policies.items()},
        "skipped": [{"trajectory": s.trajectory, "reason": s.reason} for s in skipped],
    }
    return ReplayResult(summary, rows)


def write_outputs(result: ReplayResult, out: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    out.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(result.rows), out / "steps.parquet")
    (out / "summary.json").write_text(json.dumps(result.summary, indent=2) + "\n")
    (out / "summary.md").write_text(summary_markdown(result.summary))


def summary_markdown(summary: dict) -> str:
    d = summary["data"]
    lines = [f"# Replay: {Path(d['file']).name} ({d['trajectories']} trajectories, {d['steps']} steps), "
             f"budget {summary['budget']}{' — concatenated' if summary.get('concat') else ''}", "",
             f"embedder `{summary['embedder']}`, tokenizer `{summary['tokenizer']}`, "
             f"data sha256 `{d['sha256'][:16]}`", "",
             f"cost per turn against the previous turn's ids: a prefix cache holds their common prefix in "
             f"{summary.get('cache_block', CACHE_BLOCK)}-token blocks; billed = uncached + "
             f"{summary.get('cached_rate', CACHED_RATE):g} x cached", "",
             "| policy | mean tokens | p95 tokens | token ratio | strong recall | far recall | weak recall | 1-4 "
             "| 5-19 | 20+ | prefix reuse | uncached/turn | billed/turn | compactions/100 | over budget | recoverable "
             "| ms/step |" + (" longevity |" if summary.get("concat") else ""),
             "|---|" + "---|" * (17 if summary.get("concat") else 16)]
    for name, m in summary["policies"].items():
        rbd = m["recall_by_distance"]
        cells = [m["mean_tokens"], m["p95_tokens"], m["token_ratio"], m["need_recall_strong"], m.get("need_recall_far"),
                 m["need_recall_weak"], rbd["1-4"], rbd["5-19"], rbd["20+"], m.get("prefix_reuse"),
                 m.get("uncached_per_turn"), m.get("billed_per_turn"), m.get("compactions_per_100"),
                 m["over_budget_steps"], m["recoverable"], m["ms_per_step"]]
        if summary.get("concat"):
            cells.append(m["longevity_steps"])
        lines.append(f"| {name} | " + " | ".join("-" if c is None else str(c) for c in cells) + " |")
    if summary["skipped"]:
        lines += ["", "Skipped:"] + [f"- {s['trajectory']}: {s['reason']}" for s in summary["skipped"]]
    return "\n".join(lines) + "\n"
