"""Trajectories as replay sessions and the turns a policy sees over them: the sessions imported into a runtime
(one per trajectory, or all of them concatenated), the turn walk with each turn's action targets, and the
boundaries a teacher scores. ``replay.py`` scores those turns."""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable, Sequence

import numpy as np

from palimpsest.pipelines.trajectories import (
    Need,
    Trajectory,
    import_trajectory,
    to_record,
)
from palimpsest.platform.compile.budget import Budget
from palimpsest.platform.compile.epochs import Boundary
from palimpsest.platform.embedding import Embedder
from palimpsest.platform.ledger import SessionSnapshot
from palimpsest.platform.policies import PolicyConfigBase, parse_policy_config
from palimpsest.platform.prompt.abstraction import extract_salient
from palimpsest.platform.runtime import Runtime
from palimpsest.platform.types import (
    Authority,
    BudgetError,
    Fold,
    LedgerError,
    PalimpsestError,
    StepRecord,
)

UNBOUNDED = 1 << 40  # the `full` policy is the unbudgeted reference: ReAct shows everything


@lru_cache(maxsize=65536)
def _pattern(token: str) -> re.Pattern:
    """A match of ``token`` that is not glued inside a longer identifier (``id_42`` does not match ``id_423``)."""
    # ... nor a step id or index of the prompt's own markup (`#438`, `t=438`) mistaken for a number needed
    left = r"(?<![\w#])(?<!t=)" if re.match(r"\w", token[:1]) else ""
    right = r"(?![\w])" if re.match(r"\w", token[-1:]) else ""
    return re.compile(left + re.escape(token) + right)


def appears(token: str, text: str) -> bool:
    """Whether ``token`` occurs in ``text`` on identifier boundaries."""
    return bool(token) and token in text and _pattern(token).search(text) is not None


class ReplayError(PalimpsestError):
    pass


@dataclass(frozen=True)
class ReplayStep:
    t: int
    trajectory: str
    needs: tuple[Need, ...]
    offset: int = 0  # where the trajectory starts inside a concatenated session


@dataclass
class ReplaySession:
    session_id: str
    steps: list[ReplayStep]


@dataclass
class Skipped:
    trajectory: str
    reason: str


class TimedEmbedder:
    """Wraps an embedder: measures the time spent embedding (excluded from ms_per_step) and memoises
    single-text calls, since every policy that scores step t embeds the same query."""

    def __init__(self, inner: Embedder, memo: int = 8192):
        self.inner = inner
        self.name = inner.name
        self.dim = inner.dim
        self.seconds = 0.0
        self._memo: dict[str, np.ndarray] = {}
        self._memo_size = memo

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        if len(texts) == 1 and texts[0] in self._memo:
            return self._memo[texts[0]][None].copy()
        t0 = time.perf_counter()
        try:
            out = self.inner.embed(texts)
        finally:
            self.seconds += time.perf_counter() - t0
        if len(texts) == 1:
            if len(self._memo) >= self._memo_size:
                self._memo.pop(next(iter(self._memo)))
            self._memo[texts[0]] = out[0].copy()
        return out


def _concat_records(trajs: Sequence[Trajectory]) -> tuple[list[StepRecord], list[ReplayStep]]:
    """One continuous session: each trajectory starts with its task as a user message."""
    records: list[StepRecord] = []
    steps: list[ReplayStep] = []
    for traj in trajs:
        offset = len(records) + 1
        records.append(StepRecord(t=len(records), kind="message", action="", observation=f"New task:\n{traj.task}",
                                  authority=Authority.USER, tool="task"))
        steps.append(ReplayStep(t=offset - 1, trajectory=traj.id, needs=()))
        for s in traj.steps:
            rec = to_record(s)
            records.append(StepRecord(t=offset + s.t, kind=rec.kind, action=rec.action, thought=rec.thought,
                                      observation=rec.observation, authority=rec.authority, tool=rec.tool))
            steps.append(ReplayStep(t=offset + s.t, trajectory=traj.id, needs=tuple(s.needs), offset=offset))
    return records, steps


def prepare_sessions(rt: Runtime, trajs: Sequence[Trajectory], concat: bool, data_sha: str,
                     skipped: list[Skipped], on_progress: Callable[[str], None] | None = None,
                     repeat: int = 1) -> list[ReplaySession]:
    """Import (idempotently) and enrich every trajectory; the ledger caches summaries and keys."""
    led = rt.ledger
    sessions: list[ReplaySession] = []
    if concat:
        sid = f"concat-{data_sha[:16]}" + (f"-x{repeat}" if repeat > 1 else "")
        records, steps = _concat_records(trajs)
        led.create_session(sid, "Work through the tasks that arrive as user messages, one after another.",
                           meta={"source": "replay-concat", "trajectories": [t.id for t in trajs]})
        led.append_many(sid, records)
        rt.enrich(sid)
        return [ReplaySession(sid, steps)]
    for traj in trajs:
        try:
            import_trajectory(led, traj)
        except LedgerError as e:
            skipped.append(Skipped(traj.id, f"cannot import: {e}"))
            continue
        rt.enrich(traj.id)
        sessions.append(ReplaySession(traj.id, [ReplayStep(s.t, traj.id, tuple(s.needs)) for s in traj.steps]))
        if on_progress:
            on_progress(traj.id)
    return sessions


@dataclass
class _PolicyState:
    fold: Fold | None = None
    prev_tokens: int = 0
    boundary: Boundary | None = None  # compaction epochs: the session's last boundary


def action_targets(snap: SessionSnapshot) -> list[tuple[str, ...]]:
    """Per step t, the identifiers (ids, paths, URLs, numbers) of step t's recorded action that an earlier
    observation showed: what the agent went on to use from its history. A label-free check of a context,
    computed from the raw trajectory alone (no need annotations), so parameters may be fit on it."""
    out: list[tuple[str, ...]] = []
    seen_text: list[str] = []
    for step in snap.steps:
        ids, paths, urls, numbers = extract_salient(step.action or "")
        earlier = "\n".join(seen_text)
        out.append(tuple(tok for tok in dict.fromkeys(ids + paths + urls + numbers)
                         if len(tok) >= 4 and appears(tok, earlier)))
        seen_text.append(step.observation or "")
    return out


def walk_turns(rt: Runtime, sess: ReplaySession, cfg: PolicyConfigBase, limit: Budget):
    """The served turn of every step of a session under one policy, in order (a rolling summary carries its
    fold from turn to turn as a served session does): yields (step, snapshot, turn or BudgetError,
    compile seconds). Replay measures these turns; ``eval-actions`` scores the actor on them."""
    full = rt.snapshot(sess.session_id)
    policy = rt.policy(cfg)
    bound = Budget(UNBOUNDED) if cfg.type == "full" else limit
    state = _PolicyState()
    for rs in sess.steps:
        snap = full.upto(rs.t, folds={policy.config_hash: state.fold} if state.fold else {},
                         last_context_tokens={policy.name: state.prev_tokens})
        t0 = time.perf_counter()
        try:
            turn = rt.compile(snap, policy, bound, boundary=state.boundary)
        except BudgetError as e:
            yield rs, snap, e, time.perf_counter() - t0
            continue
        elapsed = time.perf_counter() - t0
        if turn.plan.new_fold:
            state.fold = turn.plan.fold
        if turn.boundary is not None:
            state.boundary = turn.boundary
        state.prev_tokens = turn.prompt.tokens
        yield rs, snap, turn, elapsed


def action_text(step) -> str:
    """The recorded next action a boundary is scored on: the step's thought and action."""
    return "\n".join(x for x in (step.thought, step.action) if x).strip() or "(no action)"


#: Tokens of history a budget must leave after a session's fixed prefix, the reply and the soft positions
#: for its boundaries to count: below it every policy shows little more than the prefix.
MIN_HISTORY_ROOM = 256


def teacher_boundaries(rt: Runtime, sess: ReplaySession, budget: int, window: int, max_target_tokens: int,
                       min_t: int = 2, room: int = 0):
    """The boundaries of a session where the budget matters and the whole history is the teacher: yields
    (t, the ``full`` policy's served prompt ids, the recorded action's first ``max_target_tokens`` ids) for
    each step t >= ``min_t`` whose whole history plus its action fits ``window`` but whose whole history plus
    ``max_target_tokens`` + ``room`` (soft positions) does not fit ``budget``. A session whose fixed prefix
    leaves the budget less than ``MIN_HISTORY_ROOM`` tokens of history has none. ``eval-actions`` scores
    the actor there and the REMORY data builder trains there."""
    snap = rt.snapshot(sess.session_id)
    if snap.prefix_tokens + max_target_tokens + room + MIN_HISTORY_ROOM > budget:
        return
    tok = rt.ledger.tokenizer
    for rs, _snap, turn, _s in walk_turns(rt, sess, parse_policy_config("full"), Budget(budget)):
        if rs.t < min_t or isinstance(turn, BudgetError) or rs.t >= len(snap.steps):
            continue
        n = len(turn.prompt.ids)
        if n >= window:  # the whole history only grows: no later step fits the window either
            return
        target = tok.encode(action_text(snap.steps[rs.t]))[:max_target_tokens]
        if target and n + len(target) <= window and n + max_target_tokens + room > budget:
            yield rs.t, list(turn.prompt.ids), target
