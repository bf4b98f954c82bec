"""The policy interface: one method, ``plan(snapshot, budget) -> RenderPlan``.

A policy is built from its pydantic config (``config.build(deps)``) and is a pure function of
(session snapshot, budget, config): the same input gives the same plan. Embeddings and token
counts reach it through :class:`PolicyDeps`, never through I/O of its own.
"""

from __future__ import annotations

import abc
import hashlib
import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, ClassVar, Literal, Protocol

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from palimpsest.platform.compile.epochs import Compaction
from palimpsest.platform.compile.folding import HistoryBound
from palimpsest.platform.compile.retain import Retain
from palimpsest.platform.embedding import Embedder, HashingEmbedder
from palimpsest.platform.prompt.render import head_tail, key_text, own_words
from palimpsest.platform.prompt.salient import extract_salient, uniq
from palimpsest.platform.prompt.tokens import ApproxTokenizer, Tokenizer
from palimpsest.platform.types import ConfigError, Fold, RenderPlan, Resolution

if TYPE_CHECKING:
    from palimpsest.platform.ledger import SessionSnapshot


class ContextPolicy(Protocol):
    name: str
    config_hash: str

    def plan(self, snap: "SessionSnapshot", budget: int) -> RenderPlan: ...


@dataclass
class PolicyDeps:
    """What a policy may use besides the snapshot: the key embedder and the actor's tokenizer."""

    embedder: Embedder = field(default_factory=HashingEmbedder)
    tokenizer: Tokenizer = field(default_factory=ApproxTokenizer)
    # A served language model, when there is one: chat message lists in, one reply each out (None where a
    # reply failed or timed out). The LLM elasticizer of `ace` uses it; it is absent offline.
    chat: Callable[[list[list[dict]]], list[str | None]] | None = None
    # Finds a relevance predictor by its reference (``platform.policies.relevance``; None where none is registered), for
    # the policies whose config names one; absent, they score by the cosine.
    relevance: Callable[[str], object] | None = None


class PolicyConfigBase(BaseModel):
    """Every policy config: strict (unknown keys are errors), hashable, and able to build its policy."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    name: ClassVar[str]
    history: HistoryBound = Field(default_factory=HistoryBound, description="how much of the budget history older "
                                  "than the recent window may take before the compiler folds it (compile.folding)")
    compaction: Compaction = Field(default_factory=Compaction, description="when the session's prompt is rebuilt: "
                                   "at compaction boundaries, append-only between (compile.epochs), or per turn")
    retain: Retain = Field(default_factory=Retain, description="steps no plan degrades (a client's context edit: "
                           "platform.compile.context_edits)")

    def config_hash(self) -> str:
        data = self.model_dump(mode="json")
        if self.retain.empty:  # what every config had before retain existed: the same hash
            data.pop("retain")
        if data.get("relevance", 0) is None:  # likewise for a policy that names no relevance predictor
            data.pop("relevance")
        blob = json.dumps(data, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    @abc.abstractmethod
    def build(self, deps: PolicyDeps | None = None) -> ContextPolicy:
        """The policy this config describes."""


class Reasons:
    """Interns reason strings so a plan stores one small int per step."""

    def __init__(self) -> None:
        self.items: list[str] = []
        self._index: dict[str, int] = {}

    def __call__(self, reason: str) -> int:
        if reason not in self._index:
            self._index[reason] = len(self.items)
            self.items.append(reason)
        return self._index[reason]


def new_plan(policy: str, config_hash: str, snap: "SessionSnapshot", resolution: np.ndarray, score: np.ndarray,
             reason_code: np.ndarray, reasons: Reasons, *, pin_last: int = 1, fold: Fold | None = None,
             new_fold: bool = False, fold_ranges: bool = False, info: dict | None = None,
             history: HistoryBound | None = None, masked: np.ndarray | None = None) -> RenderPlan:
    m = snap.t
    pinned = np.zeros(m, dtype=bool)
    if m and pin_last:
        pinned[max(0, m - pin_last):] = True
    return RenderPlan(
        policy=policy, config_hash=config_hash, t=np.arange(m, dtype=np.int64), step_id=snap.step_ids.copy(),
        resolution=resolution.astype(np.int8), score=score.astype(np.float64),
        reason_code=reason_code.astype(np.int16), reasons=reasons.items, pinned=pinned, fold=fold,
        new_fold=new_fold, fold_ranges=fold_ranges, info=info or {}, history=history,
        masked=None if masked is None else np.asarray(masked, dtype=np.int8),
    )


def scored_plan_start(snap: "SessionSnapshot", recent: int, embedder, policy: str
                      ) -> tuple[np.ndarray, np.ndarray, np.ndarray, Reasons, np.ndarray]:
    """Columns of a plan that scores old steps by their keys: every step a placeholder until scored,
    the last ``recent`` steps full and degraded last. Returns (res, score, codes, reasons, recent idx)."""
    m = snap.t
    if m and snap.key_model != embedder.name:
        raise ConfigError(f"{policy} needs keys of {embedder.name!r}; the snapshot holds {snap.key_model!r}")
    reasons = Reasons()
    res = np.full(m, Resolution.PLACEHOLDER, dtype=np.int8)
    score = np.zeros(m, dtype=np.float64)
    codes = np.full(m, reasons("no key yet: placeholder"), dtype=np.int16)
    idx = np.arange(max(0, m - recent), m)
    res[idx] = Resolution.FULL
    score[idx] = 1e9 + idx  # degraded last, oldest of them first
    codes[idx] = reasons(f"one of the last {recent} steps")
    return res, score, codes, reasons, idx


#: The query's share of the embedder's window (MiniLM reads 256 word pieces: about 900 characters of prose,
#: as few as ~650 of dense code or logs): each recent step's head and tail, then the head of the task, 640
#: characters for N = 2 (docs/methods.md).
QUERY_STEP_HEAD, QUERY_STEP_TAIL, QUERY_TASK_HEAD = 160, 80, 160
QueryLayout = Literal["recent_first", "task_first", "epoch"]

#: ``query: epoch``: the plan serves every turn until the next boundary, so the query covers the task, each of
#: this many latest steps as its own text (never cut by the embedder's window), and the identifiers they name;
#: a step's relevance is its best cosine over those texts (docs/methods.md).
EPOCH_QUERY_STEPS = 8
#: the live identifiers' text: at most this many of them (the latest steps' first)
EPOCH_QUERY_IDS = 48


def query_from(task: str, recent_steps, layout: QueryLayout = "recent_first") -> str:
    """PACE's query text from the task and the last N steps (oldest first).

    ``task_first`` is the paper's order, Q ⊕ R_full(t-N..t-1), truncated by the embedder: when the task
    alone fills the window (most real tasks do) the query is the same text on every turn. ``recent_first``
    (the default) puts the latest step first, each recent step as a bounded head and tail, then a bounded
    head of the task, so the last N steps are never cut."""
    if layout == "task_first":
        return "\n".join([task] + [key_text(s) for s in recent_steps])
    parts = [head_tail(own_words(s), QUERY_STEP_HEAD,
                       QUERY_STEP_TAIL) for s in reversed(list(recent_steps))]
    parts.append(task[:QUERY_TASK_HEAD])
    return "\n".join(parts)


def query_text(snap: "SessionSnapshot", recent: int, layout: QueryLayout = "recent_first") -> str:
    """PACE's query over a snapshot: the task and the last ``recent`` steps (see :func:`query_from`); for
    ``epoch``, its texts joined (the identifier overlap of pace_plus reads it)."""
    return "\n".join(query_texts(snap.session.task, query_steps(snap, recent, layout), layout))


def query_steps(snap: "SessionSnapshot", recent: int, layout: QueryLayout) -> list:
    """The latest steps a query reads: ``recent`` of them, ``max(recent, EPOCH_QUERY_STEPS)`` for ``epoch``."""
    n = max(recent, EPOCH_QUERY_STEPS) if layout == "epoch" else recent
    return [snap.steps[i] for i in range(max(0, snap.t - n), snap.t)]


def query_texts(task: str, recent_steps, layout: QueryLayout = "recent_first") -> list[str]:
    """The texts a policy embeds for its query: one (``query_from``), or for ``epoch`` the head of the task,
    each recent step's bounded head and tail (newest first), and the identifiers they name, each its own text."""
    return [text for text, _ in _query_parts(task, recent_steps, layout)]


def _query_parts(task: str, recent_steps, layout: QueryLayout) -> list[tuple[str, int]]:
    """(text, k): k is the position in ``recent_steps`` of the step the text is (-1: the task, the identifiers
    or a one-text query)."""
    if layout != "epoch":
        return [(query_from(task, recent_steps, layout), -1)]
    steps = list(recent_steps)
    parts = [(task[: QUERY_TASK_HEAD * 3] or "(no task)", -1)]
    parts += [(head_tail(own_words(steps[k]), QUERY_STEP_HEAD, QUERY_STEP_TAIL), k)
              for k in range(len(steps) - 1, -1, -1)]
    names: list[str] = []
    for s in reversed(steps):
        ids, paths, urls, _ = extract_salient(own_words(s), limit=32)
        names += paths + ids + urls
    parts.append((" ".join(uniq(names, EPOCH_QUERY_IDS)), -1))
    return [(text, k) for text, k in parts if text.strip()]


def query_relevance(snap: "SessionSnapshot", recent: int, layout: QueryLayout, embedder) -> np.ndarray:
    """(M,) each step's cosine to the policy's query: for one text, that cosine; for ``epoch``, its best over the
    texts other than its own (a step among the latest ones is a query text itself, and would score 1 against
    it). Keys are L2-normalised."""
    steps = query_steps(snap, recent, layout)
    parts = _query_parts(snap.session.task, steps, layout)
    q = embedder.embed([text for text, _ in parts])  # (n, d)
    if len(parts) == 1:
        return snap.keys @ q[0]
    s = snap.keys @ q.T  # (M, n)
    first = snap.t - len(steps)
    for col, (_, k) in enumerate(parts):
        if k >= 0:
            s[first + k, col] = -np.inf
    return s.max(axis=1)


def relative_softmax(s: np.ndarray, tau: float) -> np.ndarray:
    """M * softmax(s / tau): relative weights with mean 1 over the M scored steps."""
    z = s / tau
    w = np.exp(z - z.max())
    return s.size * w / w.sum()


def recency(m: int) -> np.ndarray:
    """Scores in (0, 1] rising with t: the fallback order for degrading (oldest first)."""
    return (np.arange(m, dtype=np.float64) + 1.0) / max(m, 1)


def fallback_missing(snap: "SessionSnapshot", budget: int, res: np.ndarray, score: np.ndarray,
                     codes: np.ndarray, reasons: Reasons, cheap: Resolution) -> None:
    """Steps planned at a summary that is not written yet: full if the budget allows, else ``cheap``.

    Never waits for a summary (PACE, section 3.4). Runs in place, highest score first, and only
    loops over the steps whose summary is missing (normally the last one or two).
    """
    m = snap.t
    if m == 0:
        return
    idx = np.arange(m)
    lvl = res.astype(np.int64)
    stored = lvl < Resolution.DROP
    cost = np.where(stored, snap.tokens[idx, np.minimum(lvl, Resolution.PLACEHOLDER)], 0)
    missing = stored & (cost < 0)
    if not missing.any():
        return
    used = snap.prefix_tokens + int(cost[~missing].sum())
    for i in sorted(np.flatnonzero(missing).tolist(), key=lambda j: -score[j]):
        full = int(snap.tokens[i, Resolution.FULL])
        if used + full <= budget:
            res[i], used = Resolution.FULL, used + full
            codes[i] = reasons(f"{Resolution(lvl[i]).label} summary not ready; full fits the budget")
        else:
            res[i] = cheap
            used += max(int(snap.tokens[i, cheap]), 0) if cheap < Resolution.DROP else 0
            codes[i] = reasons(f"{Resolution(lvl[i]).label} summary not ready; {cheap.label} to stay in budget")
