"""`palimpsest eval-actions`: does the actor act as it would with the whole history?

One behavioural measure for every policy. At sampled boundaries t of a trajectory file (those whose whole
history, with the recorded next action, fits the actor's window):

- the **teacher** is the actor given the whole history (the ``full`` policy's served prompt);
- each **student** is the actor given a policy's served prompt at the budget (the prompt serving sends:
  ``pipelines.replay_sessions.walk_turns`` compiles it with the served code). ``NAME+memory`` keeps room for the
  soft span of a memory model and puts it where serving puts it (before the recent raw turns), reading
  what the prompt left out (``platform.prompt.chat.memory_read``, the call serving makes); where the memory
  sends nothing (nothing left out, or its span gate shut) it is ``NAME``'s own prompt, as served; ``NAME+empty`` is
  the same prompt with the soft span left out (what the memory adds over its own text); plain ``NAME``
  spends those positions on text (the memory against the same positions of extra text);
- each is scored on the recorded next action (step t's thought and action, its first
  ``max_target_tokens`` tokens): KL(student || teacher) per target token, the recorded action's NLL
  under the student, and top-1 agreement with the teacher.

Teacher distributions are cached as their top-k plus the tail mass (Parquet, keyed by actor, data sha
and boundary), so each teacher pass is computed once; the KL is then taken over the partition {the
teacher's top-k tokens, the rest}, a lower bound of the full KL that is exact as k grows (docs/metrics.md).
Means come with bootstrap 95% intervals over trajectories; ``gap_closed`` is 1 - KL(policy) / KL(reference).
A policy whose constants were fitted on trajectories (``fitted_on`` of its config: pace_plus's fit half of dev)
is not scored on them: those boundaries are counted as ``in_sample`` and left out of its row.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

from palimpsest.experiments.stats import paired_test
from palimpsest.models.encoder import MemoryEncoder
from palimpsest.models.memory import MemoryRead
from palimpsest.models.registry import read_bundle
from palimpsest.pipelines.replay_sessions import teacher_boundaries, walk_turns
from palimpsest.platform.compile.budget import Budget
from palimpsest.platform.prompt.chat import memory_read
from palimpsest.platform.types import BudgetError, PalimpsestError
from palimpsest.training.losses import student_logits
from palimpsest.training.teachers import TOP_K, Teacher, TeacherCache, compute_teacher, score, teacher_of


@dataclass
class MemoryArm:
    """Soft memory on top of a text policy, as serving adds it: reading what its bundle says it reads."""
    encoder: Any  # palimpsest.models.encoder.MemoryEncoder
    spec: MemoryRead = field(default_factory=MemoryRead)

    @property
    def slots(self) -> int:
        return self.encoder.slots_for(self.spec.max_history_tokens)

    def read(self, tok, turn) -> tuple[list[int], list[int]] | None:
        """What the memory reads of a compiled turn (the call serving makes, ``serving.turn.turn.turn_memory``): the
        ids of what the prompt left out and of the context before the slot; None where it left nothing out."""
        return memory_read(tok, turn, self.spec.max_field_chars, self.spec.max_history_tokens)

    def encode(self, read: tuple[list[int], list[int]]) -> torch.Tensor:
        """The soft span of a read (S, d), as the memory deployment encodes it."""
        history, summary = read
        with torch.inference_mode():
            return self.encoder.encode(torch.tensor(history, dtype=torch.long), torch.tensor(summary, dtype=torch.long))


def memory_arm(ref: str, actor) -> MemoryArm:
    """The memory of bundle ``ref`` beside ``actor``, reading what the bundle says it reads (``MemoryBundle.read``,
    as serving reads it): what ``eval-actions`` and ``eval-memory`` score."""
    return MemoryArm(MemoryEncoder.load(ref, actor), read_bundle(ref).read)


@dataclass
class Arm:
    label: str
    config: Any  # a policy config
    memory: MemoryArm | None = None
    inject: bool = True  # False: keep the memory's room in the budget but send no soft span (NAME+empty)
    donor: bool = False  # True: another trajectory's memory in the same slot (NAME+other: the input control)


@dataclass
class ActionsResult:
    policies: dict[str, dict]
    gap_closed: dict[str, float | None]
    reference: str
    boundaries: list[dict] = field(default_factory=list)
    meta: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"policies": self.policies, "gap_closed": self.gap_closed, "reference": self.reference, **self.meta}


def bootstrap_ci(values_by_group: dict[str, list[float]], reps: int = 1000, seed: int = 0) -> tuple[float, float]:
    """95% interval of the mean over all values, resampling groups (trajectories) with replacement."""
    groups = [np.asarray(v, dtype=float) for v in values_by_group.values() if v]
    if not groups:
        return (float("nan"), float("nan"))
    rng = np.random.default_rng(seed)
    means = []
    for _ in range(reps):
        pick = rng.integers(0, len(groups), len(groups))
        vals = np.concatenate([groups[i] for i in pick])
        means.append(vals.mean())
    lo, hi = np.percentile(means, [2.5, 97.5])
    return (float(lo), float(hi))


def evaluate_actions(rt, sessions, arms: list[Arm], budget: int, actor, *, data_sha: str, actor_key: str,
                     window: int, max_boundaries: int | None = None, max_target_tokens: int = 48,
                     min_t: int = 2, seed: int = 0, reference: str | None = None, cache: TeacherCache | None = None,
                     allowed: Callable[[str], bool] = lambda _: True,
                     only: set[tuple[str, int]] | None = None,
                     on_progress: Callable[[str], None] | None = None) -> ActionsResult:
    """Score every arm at the sampled boundaries of ``sessions`` (replay sessions already imported into
    ``rt``'s ledger). ``allowed(trajectory)`` filters trajectories (held-out ones only, for a memory);
    ``only`` keeps just these (trajectory, t) boundaries (the learnability ladder's chosen ones)."""
    tok = rt.ledger.tokenizer
    cache = cache or TeacherCache(None)
    # the soft positions a memory arm reserves: boundaries are chosen as the REMORY data builder chooses them
    room = max((a.memory.slots for a in arms if a.memory is not None), default=0)
    # 1. Boundaries where the budget matters: the whole history (with the target) fits the actor's window but
    #    not the budget, and the fixed prefix leaves room in the budget for the reply and some history.
    candidates: list[tuple[Any, int, list[int], list[int]]] = []  # (session, t, target, the teacher's prompt)
    for sess in sessions:
        if not allowed(sess.session_id):
            continue
        for t, ids, target in teacher_boundaries(rt, sess, budget, window, max_target_tokens, min_t, room):
            if only is not None and (sess.session_id, t) not in only:
                continue
            candidates.append((sess, t, target, ids))
    if not candidates:
        raise PalimpsestError(f"no boundary whose whole history fits the actor's window ({window}) but not the "
                              f"budget ({budget}) with a prefix that leaves room")
    if max_boundaries is not None and len(candidates) > max_boundaries:
        candidates = random.Random(seed).sample(candidates, max_boundaries)
    wanted: dict[str, dict[int, list[int]]] = {}
    teacher_ids: dict[tuple[str, int], list[int]] = {}
    for sess, t, target, ids in candidates:
        wanted.setdefault(sess.session_id, {})[t] = target
        teacher_ids[(sess.session_id, t)] = ids
    by_id = {s.session_id: s for s in sessions}
    rows: list[dict] = []
    reads: dict[str, list[tuple[list[int], list[int]]]] = {}  # each trajectory's memory reads, for NAME+other
    # NAME+other rows, scored at the end: (arm, row, context, bridge, target, teacher, the policy's own turn)
    pending: list[tuple[Arm, dict, list[int], list[int], Any, Teacher, Any]] = []
    for sid, ts in wanted.items():
        sess = by_id[sid]
        # 2. The teacher at each boundary (cached).
        teachers: dict[int, Teacher] = {}
        for t, target in ts.items():
            key = cache.key(actor_key, data_sha, sid, t, teacher_ids[(sid, t)], target, TOP_K)
            teacher = cache.get(key)
            if teacher is None:
                teacher = compute_teacher(actor, teacher_ids[(sid, t)], target)
                cache.put(key, sid, t, teacher)
            teachers[t] = teacher
        # 3. Every student at the same boundaries.
        for arm in arms:
            soft = arm.memory.slots if arm.memory else 0
            last = max(ts)
            # where the memory sends nothing, serving gives its room back to the text: the policy's own prompts
            plain = _plain_turns(rt, sess, arm.config, Budget(budget, max_target_tokens), ts) \
                if arm.memory is not None and arm.inject else {}
            for rs, _snap, turn, _s in walk_turns(rt, sess, arm.config, Budget(budget, max_target_tokens, soft)):
                if rs.t > last:
                    break
                if rs.t not in ts:
                    continue
                target = torch.tensor(ts[rs.t], dtype=torch.long)
                row = {"policy": arm.label, "trajectory": sid, "t": rs.t, "budget": budget, "turn": turn_kind(turn)}
                if sid in getattr(arm.config, "fitted_on", ()):  # the policy's constants were fitted here
                    rows.append({**row, "skipped": None, "in_sample": True})
                    continue
                if isinstance(turn, BudgetError):
                    rows.append({**row, "skipped": str(turn)})
                    continue
                context, bridge = list(turn.prompt.context_ids), list(turn.prompt.bridge_ids)
                parts = [actor.embed(torch.tensor(context, dtype=torch.long))]
                n_soft = 0
                if arm.memory is not None and arm.donor:  # its own read is another row's donor
                    read = arm.memory.read(tok, turn)
                    if read is None:  # NAME+memory sends no soft span here: a donor's would not be its control
                        rows.append({**row, "skipped": "the prompt left nothing out: no memory at this turn"})
                        continue
                    reads.setdefault(sid, []).append(read)
                    pending.append((arm, row, context, bridge, target, teachers[rs.t], plain[rs.t]))
                    continue
                if arm.memory is not None and arm.inject:
                    read = arm.memory.read(tok, turn)
                    mem = arm.memory.encode(read) if read is not None else None
                    if mem is not None and mem.shape[0]:
                        parts.append(mem.to(parts[0].dtype))
                        n_soft = int(mem.shape[0])
                    elif isinstance(plain[rs.t], BudgetError):
                        rows.append({**row, "skipped": str(plain[rs.t])})
                        continue
                    else:  # it sends nothing: the policy's own prompt, as served
                        row["turn"] = turn_kind(plain[rs.t])
                        context, bridge = list(plain[rs.t].prompt.context_ids), list(plain[rs.t].prompt.bridge_ids)
                        parts = [actor.embed(torch.tensor(context, dtype=torch.long))]
                if bridge:
                    parts.append(actor.embed(torch.tensor(bridge, dtype=torch.long)))
                with torch.inference_mode():
                    q = student_logits(actor, torch.cat(parts), target)
                rows.append({**row, **score(q, target, teachers[rs.t]),
                             "positions": len(context) + n_soft + len(bridge), "soft": n_soft,
                             "text": text_digest(context, bridge), "skipped": None})
        if on_progress:
            on_progress(sid)
    rows += _donor_rows(actor, pending, reads)
    cache.save()
    result = summarize_actions(rows, [a.label for a in arms], reference, seed)
    result.boundaries = rows
    return result


def text_digest(context: list[int], bridge: list[int]) -> str:
    """The ids around the soft slot, as one digest: two rows with the same digest and no soft span gave the actor
    the same input."""
    return hashlib.sha256(json.dumps([context, bridge]).encode()).hexdigest()[:16]


def _plain_turns(rt, sess, config, budget: Budget, ts: dict[int, Any]) -> dict[int, Any]:
    """The policy's own served turns (no soft positions) at the boundaries ``ts``: what a memory arm's turn is
    where its memory sends nothing (``serving.turn.turn._with_memory``). Exact where the memory sent nothing at
    every turn before; a turn that sent a span is served from the other chain, which this walk does not skip."""
    out: dict[int, Any] = {}
    for rs, _snap, turn, _s in walk_turns(rt, sess, config, budget):
        if rs.t > max(ts):
            break
        if rs.t in ts:
            out[rs.t] = turn
    return out


def _donor_rows(actor, pending: list, reads: dict[str, list]) -> list[dict]:
    """NAME+other: each boundary with the memory of another trajectory (the next one, in order, that has a read;
    its k-th read for this trajectory's k-th boundary) in the same slot: what a memory that ignores its input
    would score. Where that memory sends nothing (its gate shut) the row is the policy's own prompt, as served.
    Without another trajectory the rows are skipped, and say so."""
    donors = sorted(reads)
    seen: dict[str, int] = {}
    out = []
    for arm, row, context, bridge, target, teacher, plain in pending:
        sid = row["trajectory"]
        others = [d for d in donors if d != sid]
        if not others:
            out.append({**row, "skipped": "no other trajectory to take a memory from"})
            continue
        donor = next((d for d in others if d > sid), others[0])
        k = seen.get(sid, 0)
        seen[sid] = k + 1
        mem = arm.memory.encode(reads[donor][k % len(reads[donor])])
        if not mem.shape[0]:
            if isinstance(plain, BudgetError):
                out.append({**row, "skipped": str(plain)})
                continue
            context, bridge = list(plain.prompt.context_ids), list(plain.prompt.bridge_ids)
            row = {**row, "turn": turn_kind(plain)}
        parts = [actor.embed(torch.tensor(context, dtype=torch.long))]
        if mem.shape[0]:
            parts.append(mem.to(parts[0].dtype))
        if bridge:
            parts.append(actor.embed(torch.tensor(bridge, dtype=torch.long)))
        with torch.inference_mode():
            q = student_logits(actor, torch.cat(parts), target)
        out.append({**row, **score(q, target, teacher), "positions": len(context) + int(mem.shape[0]) + len(bridge),
                    "soft": int(mem.shape[0]), "text": text_digest(context, bridge), "donor": donor, "skipped": None})
    return out


def turn_kind(turn) -> str:
    """What the served turn at a scored step was: ``boundary`` (an epoch's compaction), ``append`` (an epoch
    extended by the steps since: the prompt of the chain as served) or ``per turn`` (a policy planning every
    turn); ``none`` where no prompt fits."""
    if isinstance(turn, BudgetError):
        return "none"
    return "boundary" if turn.compacted else "append" if turn.boundary is not None else "per turn"


def summarize_actions(rows: list[dict], labels: list[str], reference: str | None, seed: int = 0) -> ActionsResult:
    policies: dict[str, dict] = {}
    for label in labels:
        ok = [r for r in rows if r["policy"] == label and r.get("skipped") is None and not r.get("in_sample")]
        groups: dict[str, list[float]] = {}
        for r in ok:
            groups.setdefault(r["trajectory"], []).append(r["kl"])
        n = len(ok)
        mean = (lambda k: float(np.mean([r[k] for r in ok])) if ok else float("nan"))  # noqa: E731
        policies[label] = {"kl": mean("kl"), "kl_ci": list(bootstrap_ci(groups, seed=seed)), "nll": mean("nll"),
                           "top1": mean("top1"), "positions": mean("positions"), "boundaries": n,
                           "trajectories": len(groups),
                           "skipped": sum(1 for r in rows if r["policy"] == label and r.get("skipped")),
                           "in_sample": sum(1 for r in rows if r["policy"] == label and r.get("in_sample")),
                           # the two kinds of served turn of an epoch policy, apart (per turn: every turn plans)
                           "by_turn": {kind: {"boundaries": len(mine), "kl": float(np.mean([r["kl"] for r in mine])),
                                              "top1": float(np.mean([r["top1"] for r in mine])),
                                              "positions": float(np.mean([r["positions"] for r in mine]))}
                                       for kind in ("boundary", "append", "per turn")
                                       for mine in [[r for r in ok if r.get("turn") == kind]] if mine}}
    ref = reference if reference in policies else None
    ref_kl = {(r["trajectory"], r["t"]): r["kl"] for r in rows if r["policy"] == ref and r.get("kl") is not None}
    gap: dict[str, float | None] = {}
    for label in policies:
        # paired: both means over the boundaries both were scored on (either may leave some out: skipped,
        # or in-sample for a policy fitted there)
        pairs = [(r["kl"], ref_kl[(r["trajectory"], r["t"])]) for r in rows
                 if r["policy"] == label and r.get("kl") is not None and (r["trajectory"], r["t"]) in ref_kl]
        mine, base = (float(np.mean(v)) for v in zip(*pairs)) if pairs else (float("nan"), float("nan"))
        gap[label] = (1.0 - mine / base) if ref and base > 0 and not math.isnan(mine) else None
    return ActionsResult(policies, gap, ref or "")


def paired_against(rows: list[dict], arm: str, controls: list[str], alpha: float = 0.05,
                   seed: int = 0) -> dict[str, dict]:
    """``arm`` against each control by the paired test the A/B report uses (``experiments.stats.paired_test``):
    one difference per trajectory, the mean of arm minus control over the boundaries both were scored on. The
    controls share ``alpha`` (Bonferroni: each is tested at ``alpha / len(controls)``), so the verdicts hold
    together. A boundary where neither row sent a soft span (a closed span gate, or nothing left out) and the ids
    around the slot are the same (``text_digest``) gave the actor the same input by construction: it is left out
    of that comparison and counted (``identical``).
    ``verdict``: ``lower`` / ``higher`` (the arm's KL, significant), ``no difference`` (the test could reject
    at this n and did not), ``no verdict`` (too few trajectories for any p-value to reach its level)."""
    scored = {(r["policy"], r["trajectory"], r["t"]): r for r in rows
              if r.get("skipped") is None and not r.get("in_sample") and r.get("kl") is not None}
    level = alpha / max(len(controls), 1)
    out: dict[str, dict] = {}
    for control in controls:
        by_traj: dict[str, list[float]] = {}
        identical = 0
        for (label, traj, t), r in scored.items():
            c = scored.get((control, traj, t))
            if label != arm or c is None:
                continue
            if not r.get("soft") and not c.get("soft") and r.get("text") is not None and r.get("text") == c.get("text"):
                identical += 1
                continue
            by_traj.setdefault(traj, []).append(r["kl"] - c["kl"])
        diffs = [float(np.mean(v)) for _, v in sorted(by_traj.items())]
        test = paired_test(diffs, alpha=level, seed=seed)
        if not math.isfinite(test["lo"]) and not math.isfinite(test["hi"]):
            verdict = "no verdict"
        elif test["significant"]:
            verdict = "lower" if test["mean"] < 0 else "higher"
        else:
            verdict = "no difference"
        out[control] = {**test, "alpha": level, "boundaries": sum(len(v) for v in by_traj.values()),
                        "identical": identical, "verdict": verdict}
    return out


__all__ = ["ActionsResult", "Arm", "MemoryArm", "TOP_K", "Teacher", "TeacherCache", "bootstrap_ci",
           "evaluate_actions", "memory_arm", "paired_against", "score", "summarize_actions", "teacher_of", "turn_kind"]
