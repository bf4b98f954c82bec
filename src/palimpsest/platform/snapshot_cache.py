"""Per-session snapshots kept in memory and brought up to date from what changed (incremental snapshots).

Reading a whole session from the ledger every turn costs O(session): 264 ms at 10,000 steps, seconds at
100,000. A :class:`SnapshotCache` (one per runtime, so one per serving replica) keeps each session's
columns, keys, token counts and salient index, and on every turn:

1. reads the session's version (its count of writes, bumped in the transaction of every append, summary,
   key, fold and audited turn; one indexed row), and returns the cached snapshot when it is current;
2. otherwise reads only what changed after the cached version (:meth:`Ledger.delta`: the new steps with
   their summaries and keys, the older steps that gained a summary or key, the changed folds, the latest
   audited size per policy) and extends the cached columns.

So a replica never serves a stale snapshot, whoever wrote to the session: another replica's append bumps
the version the first replica checks before its next turn. The cache is an LRU bounded in bytes
(``max_bytes``); an evicted session is read whole on its next turn.

Snapshots stay immutable to their readers: the columns a later version changes in place are copied per
version (token counts, key flags: O(M) bytes, cheap); the key matrix is shared, because a key row is written
once, before the flag that makes a snapshot read it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import replace

import numpy as np

from palimpsest.platform.compile.compiler import step_message_counts
from palimpsest.platform.ledger import Ledger, SalientIndex, SessionSnapshot, SnapshotDelta
from palimpsest.platform.prompt.abstraction import step_facts
from palimpsest.platform.types import Resolution

_REPR_ORDER = (Resolution.DETAILED, Resolution.BRIEF, Resolution.PLACEHOLDER)


class _Reread(Exception):
    """The cached entry cannot take this delta: read the session whole."""


def _grow(a: np.ndarray, n: int) -> np.ndarray:
    """``a`` with room for at least ``n`` rows (capacity doubles: appends are amortised O(1))."""
    if a.shape[0] >= n:
        return a
    out = np.zeros((max(n, 2 * a.shape[0], 64),) + a.shape[1:], dtype=a.dtype)
    out[: a.shape[0]] = a
    return out


class _Entry:
    """One session's cached columns, with spare capacity; :meth:`snapshot` is the immutable view."""

    def __init__(self, snap: SessionSnapshot, version: int):
        self.version = version
        self.base = snap  # session, tokenizer name, prefix tokens, key model
        m = snap.t
        self.m = m
        self.steps = list(snap.steps)
        self.index = {int(s): i for i, s in enumerate(snap.step_ids)}
        self.ids = _grow(snap.step_ids.copy(), m)
        self.tokens = _grow(snap.tokens.copy(), m)
        self.bodies = [list(b) for b in snap.bodies]
        self.abstractions = list(snap.abstractions)
        self.keys = _grow(snap.keys.copy(), m) if snap.keys.shape[1] else snap.keys
        self.has_key = _grow(snap.has_key.copy(), m)
        self.folds = dict(snap.folds)
        self.last = dict(snap.last_context_tokens)
        # the salient index in coordinate form, appended to as steps gain abstractions
        sal = snap.salient_index()
        self.vocab = dict(sal.vocab)
        self.rows, self.tok_ids, self.nnz = (_grow(sal.rows.copy(), sal.rows.size), _grow(sal.ids.copy(), sal.ids.size),
                                             sal.rows.size)
        self.sizes, self.failed = _grow(sal.sizes.copy(), m), _grow(sal.failed.copy(), m)
        self.plans, self.ready = _grow(sal.plans.copy(), m), _grow(sal.ready.copy(), m)
        self.dialogue = _grow(sal.dialogue.copy(), m)
        self.mps = _grow(step_message_counts(snap.steps), m)
        self.lock = threading.Lock()
        self.nbytes = 0
        self._snap: SessionSnapshot | None = snap
        self._count_bytes(0, m)

    def _count_bytes(self, start: int, stop: int) -> None:
        text = 0
        for s in self.steps[start:stop]:
            text += len(s.thought) + len(s.action) + len(s.observation or "") + len(s.calls or "") + 200
        for b in self.bodies:
            text += sum(len(x or "") for x in b[start:stop])
        text += sum(len(x or "") for x in self.abstractions[start:stop])
        per_row = 8 + 32 + 1 + 4 * (self.keys.shape[1] if self.keys.ndim == 2 else 0) + 8 * 4 + 24
        self.nbytes += text + (stop - start) * per_row

    # -- applying a delta ---------------------------------------------------------------------

    def apply(self, d: SnapshotDelta) -> None:
        start, n = self.m, len(d.steps)
        m = start + n
        if n:
            self.steps.extend(d.steps)
            if self.keys.shape[1]:  # rows for the new steps (their keys may come later)
                self.keys = _grow(self.keys, m)
            self.ids = _grow(self.ids, m)
            self.tokens = _grow(self.tokens, m)
            self.has_key = _grow(self.has_key, m)
            for k, s in enumerate(d.steps):
                self.ids[start + k] = s.id
                self.index[s.id] = start + k
                self.tokens[start + k] = -1
                self.tokens[start + k, Resolution.FULL] = s.tokens["full"]
            for b in self.bodies:
                b.extend([None] * n)
            self.abstractions.extend([None] * n)
            for arr in ("sizes", "failed", "plans", "ready", "dialogue"):
                setattr(self, arr, _grow(getattr(self, arr), m))
            self.dialogue[start:m] = [s.kind in ("respond", "message") for s in d.steps]
            self.mps = _grow(self.mps, m)
            self.mps[start:m] = step_message_counts(d.steps)
        # token counts and key flags change in place: every snapshot holds its own copy of them
        for i, res, text, ntok in d.representations:
            level = Resolution.parse(res)
            self.tokens[i, level] = ntok
            if level is not Resolution.FULL:
                column = self.bodies[_REPR_ORDER.index(level)]
                if i < start:  # a summary of a cached step: count its bytes here (new rows are counted below)
                    self.nbytes += len(text) - len(column[i] or "")
                column[i] = text
        for i, body in d.abstractions:
            if self.abstractions[i] == body:
                continue
            if self.ready[i]:  # a newer producer's abstraction replaces the older one's identifiers
                keep = self.rows[: self.nnz] != i
                self.rows, self.tok_ids = self.rows[: self.nnz][keep].copy(), self.tok_ids[: self.nnz][keep].copy()
                self.nnz = self.rows.size
            if i < start:
                self.nbytes += len(body) - len(self.abstractions[i] or "") + 16 * len(body) // 40
            self.abstractions[i] = body
            self._add_facts(i, body)
        if d.keys:
            dim = d.keys[0][1].shape[0]
            if self.keys.shape[1] and self.keys.shape[1] != dim:
                raise _Reread("the key model's dimension changed")
            if not self.keys.shape[1]:  # the first key of this session
                self.keys = np.zeros((max(m, 64), dim), dtype=np.float32)
                self.nbytes += 4 * dim * start  # rows of steps cached before it (new rows are counted below)
            self.keys = _grow(self.keys, m)
            for i, vec in d.keys:
                self.keys[i] = vec  # written before the flag: a snapshot reads only flagged rows
                self.has_key[i] = True
        self.folds.update(d.folds)
        self.last.update(d.last_context_tokens)
        self.m = m
        self._count_bytes(start, m)
        self.version = d.version
        self._snap = None

    def _add_facts(self, i: int, body: str) -> None:
        step = self.steps[i]
        toks, self.failed[i], self.plans[i] = step_facts(step.id, body, step.action)
        self.ready[i] = True
        self.sizes[i] = len(toks)
        k = len(toks)
        self.rows = _grow(self.rows, self.nnz + k)
        self.tok_ids = _grow(self.tok_ids, self.nnz + k)
        self.rows[self.nnz: self.nnz + k] = i
        self.tok_ids[self.nnz: self.nnz + k] = [self.vocab.setdefault(t, len(self.vocab)) for t in toks]
        self.nnz += k

    # -- the immutable view -------------------------------------------------------------------

    def snapshot(self) -> SessionSnapshot:
        if self._snap is None:
            m = self.m
            keys = self.keys[:m] if self.keys.ndim == 2 and self.keys.shape[1] else np.zeros((m, 0), np.float32)
            sal = SalientIndex(self.rows[: self.nnz], self.tok_ids[: self.nnz], self.sizes[:m].copy(),
                               self.failed[:m].copy(), self.plans[:m].copy(), self.ready[:m].copy(),
                               self.dialogue[:m].copy(), self.vocab)
            self._snap = replace(
                self.base, steps=tuple(self.steps), step_ids=self.ids[:m], tokens=self.tokens[:m].copy(),
                bodies=tuple(tuple(b) for b in self.bodies), keys=keys, has_key=self.has_key[:m].copy(),
                abstractions=tuple(self.abstractions), folds=dict(self.folds), last_context_tokens=dict(self.last),
                _memo={"salient": sal, "messages_per_step": self.mps[:m]})
        return self._snap


class SnapshotCache:
    """Each session's latest snapshot, kept current from the ledger's change log; an LRU bounded in bytes."""

    def __init__(self, ledger: Ledger, max_bytes: int = 512 << 20):
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.ledger = ledger
        self.max_bytes = max_bytes
        self._entries: OrderedDict[tuple[str, str | None], _Entry] = OrderedDict()
        self._lock = threading.Lock()
        self.stats = {"hits": 0, "refreshes": 0, "full_reads": 0, "evictions": 0}

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self._entries.values())

    def cached_steps(self) -> int:
        return sum(e.m for e in self._entries.values())

    def get(self, session_id: str, key_model: str | None) -> SessionSnapshot:
        """The session's snapshot as of now: cached, refreshed from what changed, or read whole."""
        key = (session_id, key_model)
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
        if entry is None or self.max_bytes == 0:
            snap, version = self.ledger.versioned_snapshot(session_id, key_model=key_model)
            self.stats["full_reads"] += 1
            if self.max_bytes:
                self._put(key, _Entry(snap, version))
            return snap
        with entry.lock:
            version = self.ledger.version(session_id)
            if version == entry.version:
                self.stats["hits"] += 1
                return entry.snapshot()
            before = entry.nbytes
            try:
                entry.apply(self.ledger.delta(session_id, entry.version, entry.m, entry.index, key_model))
            except _Reread:
                with self._lock:
                    self._entries.pop(key, None)
                return self.get(session_id, key_model)
            self.stats["refreshes"] += 1
            snap = entry.snapshot()
        if entry.nbytes != before:
            self._evict()
        return snap

    def _put(self, key, entry: _Entry) -> None:
        with self._lock:
            self._entries[key] = entry
            self._entries.move_to_end(key)
        self._evict()

    def _evict(self) -> None:
        with self._lock:
            total = sum(e.nbytes for e in self._entries.values())
            while total > self.max_bytes and len(self._entries) > 1:
                _, old = self._entries.popitem(last=False)
                total -= old.nbytes
                self.stats["evictions"] += 1
            if total > self.max_bytes and self._entries:  # one session larger than the whole cache
                self._entries.clear()
                self.stats["evictions"] += 1


__all__ = ["SnapshotCache"]
