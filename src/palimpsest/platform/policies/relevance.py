"""A learned relevance predictor for PACE: will the actions of the epoch ahead reuse what an old step introduced?

At a boundary, every old step i gets a feature row built from the snapshot's past alone (the served embedder's
vectors and the ledger's identifiers), and a small head (a logistic regression, or one hidden layer) maps it to the
probability that a step of the epoch ahead needs a token step i showed. PACE and pace_plus read that probability
where they would read the cosine (``relevance: {model: ...}`` in their config), and fall back to the cosine when no
model is found.

Features (``SCALARS``, then, for a head trained with them, the query times the key, one column per embedding
dimension):

- ``cos``: the cosine of PACE's query (``recent_first``) and the step's key;
- ``overlap``: identifiers the step shares with the query's text, over ``sqrt(#step ids * #query ids)`` (pace_plus's);
- ``task``: whether the task names one of the step's identifiers;
- ``age``: ``log1p(t - 1 - i)``; ``position``: ``i / t``;
- ``introduced_recurring``: ``log1p`` of how many identifiers the step named first in the session that a later
  step (before t) names again; ``recurring``: the same without "first"; ``ids``: ``log1p`` of its identifiers;
- ``failed``, ``dialogue``: the abstraction records a failure; the step is a reply or a message.

The head is numpy only (this package imports no torch): trained by ``palimpsest train-relevance``
(``training/relevance_trainer.py``), kept as a bundle (``models/relevance_head.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from palimpsest.platform.prompt.salient import extract_salient

if TYPE_CHECKING:
    from palimpsest.platform.ledger import SessionSnapshot
    from palimpsest.platform.ledger.snapshot import SalientIndex

#: Bumped whenever a feature's definition changes: a head trained on other features is refused.
FEATURES_VERSION = "1"
SCALARS = ("cos", "overlap", "task", "age", "position", "introduced_recurring", "recurring", "ids", "failed",
           "dialogue")
ARCHITECTURE = "relevance-head-v1"


def recurrence(index: "SalientIndex") -> tuple[np.ndarray, np.ndarray]:
    """(introduced and recurring, recurring), (M,) each: per step, how many of its identifiers a later step of the
    snapshot names again, counting only those the step named first in the session, then all of them."""
    m = index.sizes.size
    if index.ids.size == 0:
        return np.zeros(m, dtype=np.int64), np.zeros(m, dtype=np.int64)
    v = len(index.vocab)
    first = np.full(v, m, dtype=np.int64)
    last = np.full(v, -1, dtype=np.int64)
    np.minimum.at(first, index.ids, index.rows)
    np.maximum.at(last, index.ids, index.rows)
    later = last[index.ids] > index.rows
    intro = first[index.ids] == index.rows
    return (np.bincount(index.rows[later & intro], minlength=m), np.bincount(index.rows[later], minlength=m))


def _salient_set(text: str) -> frozenset[str]:
    ids, paths, urls, _ = extract_salient(text)
    return frozenset(ids) | frozenset(paths) | frozenset(urls)


def features(snap: "SessionSnapshot", old: np.ndarray, query: np.ndarray, query_text: str) -> np.ndarray:
    """(len(old), len(SCALARS) + d): the feature rows of the old steps ``old`` at the snapshot's turn, for the query
    vector ``query`` (L2-normalised, the embedder's) of the text ``query_text``."""
    old = np.asarray(old, dtype=np.int64)
    t = max(snap.t, 1)
    keys = snap.keys[old]
    index = snap.salient_index()
    n_ids = index.sizes[old].astype(np.float64)
    q_ids = _salient_set(query_text)
    shared = index.overlap(q_ids)[old].astype(np.float64)
    task = index.overlap(_salient_set(snap.session.task))[old] > 0
    intro, rec = recurrence(index)
    scal = np.stack([
        keys @ query,
        shared / np.sqrt(np.maximum(n_ids, 1.0) * max(len(q_ids), 1)),
        task.astype(np.float64),
        np.log1p((snap.t - 1 - old).astype(np.float64)),
        old / t,
        np.log1p(intro[old].astype(np.float64)),
        np.log1p(rec[old].astype(np.float64)),
        np.log1p(n_ids),
        index.failed[old].astype(np.float64),
        index.dialogue[old].astype(np.float64),
    ], axis=1)
    return np.concatenate([scal, keys * query[None, :]], axis=1).astype(np.float32)


@dataclass(frozen=True)
class RelevanceHead:
    """``p = sigmoid(w2 . relu(W1 z + b1) + b2)`` with ``z = (x - mean) / scale`` (no hidden layer when ``w1`` is
    empty: a logistic regression). ``meta`` records what it was trained on and with."""

    mean: np.ndarray  # (F,)
    scale: np.ndarray  # (F,)
    w1: np.ndarray  # (F, H), or (0, 0)
    b1: np.ndarray  # (H,)
    w2: np.ndarray  # (H,) or (F,)
    b2: float
    meta: dict = field(default_factory=dict)

    ARRAYS = ("mean", "scale", "w1", "b1", "w2")

    @property
    def n_features(self) -> int:
        return int(self.mean.size)

    def read(self, x: np.ndarray) -> np.ndarray:
        """The columns of a ``features`` matrix this head reads: all of them, or the scalars alone (a head trained
        without ``q ⊙ k``)."""
        return x[:, : len(SCALARS)] if self.n_features == len(SCALARS) else x

    def logits(self, x: np.ndarray) -> np.ndarray:
        if x.shape[1] != self.n_features:
            raise ValueError(f"the head reads {self.n_features} features, got {x.shape[1]}")
        z = (x.astype(np.float64) - self.mean) / self.scale
        if self.w1.size:
            z = np.maximum(z @ self.w1 + self.b1, 0.0)
        return z @ self.w2 + self.b2

    def probability(self, x: np.ndarray) -> np.ndarray:
        return 1.0 / (1.0 + np.exp(-self.logits(x)))

    def arrays(self) -> dict[str, np.ndarray]:
        return {**{k: getattr(self, k) for k in self.ARRAYS}, "b2": np.asarray([self.b2])}

    @classmethod
    def from_arrays(cls, arrays, meta: dict) -> "RelevanceHead":
        return cls(*(np.asarray(arrays[k], dtype=np.float64) for k in cls.ARRAYS), b2=float(arrays["b2"][0]),
                   meta=dict(meta))


#: What a policy is handed to find a head by its reference (``models:/NAME/VERSION`` or a bundle directory):
#: the head, or None when none is registered under it (the policy then scores by the cosine).
RelevanceResolver = Callable[[str], "RelevanceHead | None"]


class RelevanceSection(BaseModel):
    """A policy's ``relevance:`` section: the predictor it scores old steps with at a boundary."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    model: str = Field(..., min_length=1, description="a registered predictor (models:/palimpsest-relevance/latest, "
                       "models:/NAME/VERSION) or a bundle directory; where none is registered, the cosine")
    tau: float | None = Field(None, gt=0.0, le=10.0, description="softmax temperature over the predicted "
                              "probabilities (None: the policy's tau)")


def head_scores(snap: "SessionSnapshot", old: np.ndarray, head: RelevanceHead, embedder,
                query_text: Callable[[int], str]) -> np.ndarray:
    """(len(old),) the head's probability that the epoch ahead reuses each old step. ``query_text(n)``: PACE's
    ``recent_first`` query over the last n steps (the head's ``recent``, as it was trained)."""
    text = query_text(int(head.meta.get("recent", 2)))
    q = embedder.embed([text])[0]
    return head.probability(head.read(features(snap, old, q, text)))


def predicted(snap: "SessionSnapshot", old: np.ndarray, section: RelevanceSection | None, deps,
              query_text: Callable[[int], str]) -> tuple[np.ndarray | None, float | None, str]:
    """(scores, tau, source) where a policy's ``relevance`` section names a head its deps can find: the head's
    probabilities, the section's temperature and the reference; else (None, None, "cosine")."""
    if section is None or deps.relevance is None:
        return None, None, "cosine"
    head = deps.relevance(section.model)
    if head is None:
        return None, None, "cosine"
    return head_scores(snap, old, head, deps.embedder, query_text), section.tau, section.model


__all__ = ["ARCHITECTURE", "FEATURES_VERSION", "RelevanceHead", "RelevanceResolver", "RelevanceSection", "SCALARS",
           "features", "head_scores", "predicted", "recurrence"]
