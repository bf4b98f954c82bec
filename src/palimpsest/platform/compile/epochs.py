"""Compaction epochs: a session's prompt is rebuilt only at a compaction boundary, and grows append-only between.

A prefix cache (vLLM's automatic prefix caching, cached-input pricing at the API providers) serves the part
of a prompt that equals the previous request's start. A policy that re-plans every step's resolution on
every turn changes the prompt near its start on almost every turn and is paid for in full each time. So,
for every policy (``compaction`` in its config):

- Between boundaries a turn's prompt is the previous turn's prompt, message for message, plus the steps
  appended since, raw (:func:`extend`). Its ids extend the previous turn's ids.
- A boundary happens when those ids plus the reserve (the reply's ``max_tokens`` and soft positions) would
  pass ``high`` x budget. The policy then plans as it does per turn (PACE's scores and pressure, ACE's
  elasticizer, folding) and the compiler compacts the prompt to ``low`` x budget (hysteresis: every rebuild
  buys many append-only turns). The audit records the boundary, what changed and why.
- A session starts with the empty boundary (the prefix alone): until the first compaction every step is
  shown raw, as the whole history is.

A boundary is stored in the ledger (:meth:`palimpsest.platform.ledger.Ledger.add_boundary`) with the exact
messages it built, so a restarted or second replica rebuilds every later turn's prompt byte for byte from
the ledger. Nothing is lost: every step stays in the ledger and glimpse-able by id; the budget bound
(ids + reserve <= budget) holds on every turn. The soft-memory slot of REMORY is the boundary itself: after
the compacted history, before the steps appended since, so the memory (computed from what the boundary left
out) is the same for the whole epoch. ``mode: per_turn`` restores the seeds' per-turn planning.
"""

from __future__ import annotations

import hashlib
import json
import zlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, Sequence

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from palimpsest.platform.prompt.render import step_messages
from palimpsest.platform.types import Fold, RenderPlan, Resolution, Segment

if TYPE_CHECKING:
    from palimpsest.platform.compile.budget import Budget
    from palimpsest.platform.ledger import SessionSnapshot

#: vLLM's KV-cache block: the prefix cache serves whole blocks only.
CACHE_BLOCK = 16


class Compaction(BaseModel):
    """When a session's prompt is rebuilt (every policy config has one)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    mode: Literal["epochs", "per_turn"] = Field(
        "epochs", description="epochs: rebuild only when the prompt would pass `high` of the budget, append-only "
        "between; per_turn: plan every turn anew (the seeds' behaviour; the prompt changes near its start)")
    high: float = Field(0.9, gt=0.0, le=1.0, description="the high watermark: a turn whose ids plus reserve would "
                        "pass high x budget is a compaction boundary")
    low: float = Field(0.6, gt=0.0, le=1.0, description="the low watermark: a boundary compacts the prompt (plus "
                       "reserve) to low x budget")

    keep: float = Field(0.5, ge=0.0, lt=1.0, description="at a boundary, the oldest steps stay as the previous "
                        "boundary rendered them (a prefix the cache holds) while they cost at most this share of "
                        "the low watermark's room; 0 re-plans every step")

    @model_validator(mode="after")
    def _ordered(self) -> "Compaction":
        if self.low > self.high:
            raise ValueError(f"low ({self.low}) must not exceed high ({self.high})")
        return self

    @property
    def epochs(self) -> bool:
        return self.mode == "epochs"


def compaction_of(policy) -> Compaction | None:
    """The epoch settings of a built policy, None when it plans per turn."""
    cfg = getattr(getattr(policy, "cfg", None), "compaction", None)
    return cfg if isinstance(cfg, Compaction) and cfg.epochs else None


def recent_of(policy) -> int:
    """How many of the latest steps a policy always shows in full, which a boundary never degrades: its
    ``recent`` (PACE's N), else the latest step (ACE's latest raw; every policy shows it)."""
    n = getattr(getattr(policy, "cfg", None), "recent", None)
    return n if isinstance(n, int) and n >= 1 else 1


def epoch_key(config_hash: str, limit: "Budget") -> str:
    """What a session's boundaries are kept under: one epoch chain per policy config, budget and reserve. Whether
    a turn extends or compacts, and what a boundary keeps, depend on the reserve (the reply's ``max_tokens`` and
    the soft positions), so a chain is one reserve's: every replica serving a request of that reserve reads the
    same boundaries and extends them alike, and a request of another reserve never moves them (it has its own
    chain; a client that changes its ``max_tokens`` starts one)."""
    return f"{config_hash}@{int(limit.total)}" + (f"/{int(limit.reserve)}" if limit.reserve else "")


@dataclass(frozen=True)
class Boundary:
    """The prompt a compaction boundary built, frozen until the next one.

    ``messages`` is the whole prompt (prefix included) as the boundary compiled it; ``split`` is where the
    steps appended since go (and the soft-memory slot). The plan columns are the boundary's decisions for
    the ``t`` steps it covers; ``segments`` its prompt's pieces."""

    t: int
    messages: tuple[dict, ...]
    resolution: np.ndarray  # (t,) int8
    score: np.ndarray  # (t,) float64
    reason_code: np.ndarray  # (t,) int16
    reasons: tuple[str, ...]
    segments: tuple[Segment, ...]
    fold: Fold | None = None
    info: dict = field(default_factory=dict)
    budget: int = 0
    id: int | None = None  # the ledger row, once stored

    @property
    def split(self) -> int:
        return len(self.messages)

    @property
    def digest(self) -> str:
        return hashlib.sha256(json.dumps(list(self.messages), sort_keys=True).encode()).hexdigest()

    # -- the ledger's form ----------------------------------------------------------------------

    def encode(self) -> bytes:
        doc = {"t": self.t, "messages": list(self.messages), "reasons": list(self.reasons), "info": self.info,
               "budget": self.budget,
               "segments": [[s.kind, s.role, s.tokens, s.t, s.step_id,
                             None if s.resolution is None else int(s.resolution), *s.messages] for s in self.segments],
               "fold": None if self.fold is None else [self.fold.upto, self.fold.text, self.fold.tokens,
                                                       self.fold.producer]}
        cols = (self.resolution.astype(np.int8).tobytes() + self.reason_code.astype(np.int16).tobytes()
                + self.score.astype(np.float64).tobytes())
        return zlib.compress(json.dumps(doc, separators=(",", ":")).encode() + b"\0" + cols, 1)

    @classmethod
    def decode(cls, blob: bytes, row_id: int | None = None) -> "Boundary":
        head, cols = zlib.decompress(bytes(blob)).split(b"\0", 1)
        doc = json.loads(head)
        n = int(doc["t"])
        messages = tuple(doc["messages"])
        segments = tuple(Segment(kind, role, "\n".join(m["content"] for m in messages[a:b]), tokens, t, sid,
                                 None if res is None else Resolution(res), (a, b))
                         for kind, role, tokens, t, sid, res, a, b in doc["segments"])
        fold = None if doc["fold"] is None else Fold(*doc["fold"])
        return cls(t=n, messages=messages, resolution=np.frombuffer(cols[:n], dtype=np.int8).copy(),
                   reason_code=np.frombuffer(cols[n: 3 * n], dtype=np.int16).copy(),
                   score=np.frombuffer(cols[3 * n:], dtype=np.float64).copy(), reasons=tuple(doc["reasons"]),
                   segments=segments, fold=fold, info=doc.get("info") or {}, budget=int(doc.get("budget", 0)),
                   id=row_id)


def empty_boundary(prefix: Sequence[dict], segments: Sequence[Segment]) -> Boundary:
    """The boundary every session starts from: the prefix alone, before any step."""
    return Boundary(t=0, messages=tuple(prefix), resolution=np.zeros(0, np.int8), score=np.zeros(0),
                    reason_code=np.zeros(0, np.int16), reasons=(), segments=tuple(segments))


def boundary_of(plan: RenderPlan, messages: Sequence[dict], segments: Sequence[Segment], budget: int,
                info: dict) -> Boundary:
    """The boundary a compaction turn built (its plan and prompt)."""
    return Boundary(t=len(plan), messages=tuple(messages), resolution=plan.resolution.astype(np.int8).copy(),
                    score=plan.score.astype(np.float64).copy(), reason_code=plan.reason_code.astype(np.int16).copy(),
                    reasons=tuple(plan.reasons), segments=tuple(segments), fold=plan.fold, info=dict(info),
                    budget=int(budget))


def extend(b: Boundary, snap: "SessionSnapshot", overhead: int) -> tuple[list[dict], list[Segment]]:
    """The boundary's messages plus every step appended since, raw, and the pieces of that prompt."""
    msgs = list(b.messages)
    segments = list(b.segments)
    for i in range(b.t, snap.t):
        step = snap.steps[i]
        parts = step_messages(step, step.id, Resolution.FULL, None)
        segments.append(Segment("step", parts[0]["role"], "\n".join(m["content"] for m in parts),
                                int(snap.tokens[i, Resolution.FULL]) + overhead * len(parts), t=step.t,
                                step_id=step.id, resolution=Resolution.FULL,
                                messages=(len(msgs), len(msgs) + len(parts))))
        msgs.extend(parts)
    return msgs, segments


def extended_plan(b: Boundary, snap: "SessionSnapshot", policy: str, config_hash: str) -> RenderPlan:
    """The plan of an append-only turn: the boundary's decisions, then each step appended since at full."""
    m, k = snap.t, snap.t - b.t
    reasons = list(b.reasons)
    code = len(reasons)
    reasons.append(f"appended since the compaction boundary at t={b.t}: raw")
    pinned = np.zeros(m, dtype=bool)
    if m:
        pinned[-1] = True
    return RenderPlan(
        policy=policy, config_hash=config_hash, t=np.arange(m, dtype=np.int64), step_id=snap.step_ids.copy(),
        resolution=np.concatenate([b.resolution, np.full(k, Resolution.FULL, np.int8)]).astype(np.int8),
        score=np.concatenate([b.score, 1e9 + np.arange(b.t, m, dtype=np.float64)]),
        reason_code=np.concatenate([b.reason_code, np.full(k, code, np.int16)]).astype(np.int16),
        reasons=reasons, pinned=pinned, fold=b.fold, new_fold=False,
        info={"epoch": {"boundary_t": b.t, "boundary_id": b.id, "appended": k}},
    )


def estimate_extension(b: Boundary, snap: "SessionSnapshot", boundary_tokens: int, overhead: int,
                       messages_per_step: np.ndarray) -> int:
    """The planning estimate of an extension's ids (stored per-step counts plus the template per message)."""
    tail = snap.tokens[b.t:, Resolution.FULL]
    return int(boundary_tokens + np.maximum(tail, 0).sum() + overhead * messages_per_step[b.t:].sum())


def cached_tokens(prev: Sequence[int] | None, ids: Sequence[int], block: int = CACHE_BLOCK) -> int:
    """What a prefix cache holds of ``ids`` after a request of ``prev``: their common prefix in whole blocks,
    never the last token (an engine computes at least one position to produce logits)."""
    if prev is None or ids is None or not len(prev) or not len(ids):
        return 0
    n = min(len(prev), len(ids))
    a = np.asarray(prev[:n], dtype=np.int64)
    b = np.asarray(ids[:n], dtype=np.int64)
    diff = np.flatnonzero(a != b)
    common = int(diff[0]) if diff.size else n
    return (min(common, len(ids) - 1) // block) * block


def turn_cost(prev: Sequence[int] | None, ids: Sequence[int], cached_rate: float, block: int = CACHE_BLOCK,
              extra: int = 0) -> dict:
    """One turn's input cost against the previous request: ``cached`` ids, ``uncached`` ids, ``billed`` =
    uncached + ``cached_rate`` x cached, and ``prefix_reuse`` (cached / ids). ``extra`` (soft positions) is
    paid uncached."""
    cached = cached_tokens(prev, ids, block)
    n = len(ids) + int(extra)
    uncached = n - cached
    return {"cached": cached, "uncached": uncached, "billed": uncached + cached_rate * cached,
            "prefix_reuse": cached / n if n else 0.0}


def with_soft(cost: dict, ids: int, soft: int) -> dict:
    """A turn's cost (:func:`turn_cost` of its ``ids`` ids) with ``soft`` soft-memory positions added, paid as
    uncached input: the prefix cache holds ids, and a span computed for this turn is never among them."""
    n = ids + int(soft)
    return {**cost, "uncached": cost["uncached"] + int(soft), "billed": cost["billed"] + int(soft),
            "prefix_reuse": cost["cached"] / n if n else 0.0}
