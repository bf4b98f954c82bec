"""Reads: the immutable :class:`SessionSnapshot` a policy plans on, in one read transaction, and the
:class:`SnapshotDelta` that brings a cached snapshot up to date (``platform.snapshot_cache``)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Mapping, Sequence

import numpy as np

from palimpsest.platform.ledger.store import _STEP_COLS, _step_from_row, _version
from palimpsest.platform.prompt.abstraction import Abstraction, step_facts
from palimpsest.platform.prompt.render import render_full_body
from palimpsest.platform.types import Fold, LedgerError, Resolution, Session, Step

_REPR_ORDER = (Resolution.DETAILED, Resolution.BRIEF, Resolution.PLACEHOLDER)


@dataclass(frozen=True)
class SessionSnapshot:
    """Everything a policy may read about one session, as of one consistent point in time.

    Columns are aligned with ``steps`` (index i is step t=i). ``tokens[i, r]`` is the token count
    of step i rendered at resolution r (FULL, DETAILED, BRIEF, PLACEHOLDER), -1 where that
    representation does not exist yet. ``keys`` rows are zero where ``has_key`` is False.
    """

    session: Session
    steps: tuple[Step, ...]
    step_ids: np.ndarray  # (M,) int64
    tokens: np.ndarray  # (M, 4) int64
    bodies: tuple[tuple[str | None, ...], ...]  # per resolution DETAILED, BRIEF, PLACEHOLDER: (M,) texts
    key_model: str | None
    keys: np.ndarray  # (M, d) float32, L2-normalised
    has_key: np.ndarray  # (M,) bool
    abstractions: tuple[str | None, ...]  # (M,) JSON of the structured abstraction
    folds: Mapping[str, Fold] = field(default_factory=dict)  # policy key -> latest fold
    last_context_tokens: Mapping[str, int] = field(default_factory=dict)  # policy -> |C_{t-1}|
    tokenizer: str = "approx-v1"
    _prefix_tokens: int | None = None  # system + tools + task as the prompt renders them (the ledger's prefix_cost)
    _memo: dict = field(default_factory=dict, compare=False, repr=False)  # derived indexes, built once

    def without_keys(self) -> "SessionSnapshot":
        """The same snapshot with no key embeddings (what a turn plans on when the embedder is down)."""
        import dataclasses

        return dataclasses.replace(self, has_key=np.zeros_like(self.has_key), keys=np.zeros_like(self.keys))

    def salient_index(self) -> "SalientIndex":
        """Each step's identifiers (ids, paths, URLs of its abstraction and action) as one sparse
        matrix, so policies score identifier overlap with numpy instead of a loop per turn."""
        if "salient" not in self._memo:
            self._memo["salient"] = SalientIndex.build(self)
        return self._memo["salient"]

    @property
    def prefix_tokens(self) -> int:
        """The exact ids of the session's fixed prefix (system, tools, task, assistant prompt): what every turn
        costs at least, priced by the function the ledger was handed (``Ledger(prefix_cost=...)``)."""
        if self._prefix_tokens is None:
            raise LedgerError("this snapshot has no prefix size: its ledger was opened without a prefix_cost "
                              "(open it with Ledger(..., prefix_cost=...) or through a Runtime)")
        return self._prefix_tokens

    @property
    def t(self) -> int:
        """The index of the step about to be taken (= number of steps in the snapshot)."""
        return len(self.steps)

    def body(self, i: int, res: Resolution) -> str | None:
        if res is Resolution.FULL:
            return render_full_body(self.steps[i])
        if res is Resolution.DROP:
            return None
        return self.bodies[_REPR_ORDER.index(res)][i]

    def abstraction(self, i: int) -> Abstraction | None:
        s = self.abstractions[i]
        return Abstraction.from_json(s) if s else None

    def upto(self, t: int, folds: Mapping[str, Fold] | None = None,
             last_context_tokens: Mapping[str, int] | None = None) -> "SessionSnapshot":
        """The same session as it stood before step ``t`` (a slice, no I/O). Replay uses it with its
        own per-policy state (folds, previous context size) instead of what the ledger's audit holds."""
        if not 0 <= t <= self.t:
            raise ValueError(f"t must be within 0..{self.t}, got {t}")
        return replace(
            self, steps=self.steps[:t], step_ids=self.step_ids[:t], tokens=self.tokens[:t],
            bodies=tuple(b[:t] for b in self.bodies), keys=self.keys[:t], has_key=self.has_key[:t],
            abstractions=self.abstractions[:t],
            _memo={k: v[:t] for k, v in self._memo.items() if k == "messages_per_step"},
            folds=dict(folds) if folds is not None else {k: f for k, f in self.folds.items() if f.upto <= t},
            last_context_tokens=dict(last_context_tokens) if last_context_tokens is not None else {},
        )


@dataclass(frozen=True)
class SalientIndex:
    """Step identifiers in coordinate form: ``rows[k]`` holds token ``ids[k]`` (ids from ``vocab``)."""

    rows: np.ndarray  # (nnz,) int64 step index
    ids: np.ndarray  # (nnz,) int64 token id
    sizes: np.ndarray  # (M,) number of distinct identifiers per step
    failed: np.ndarray  # (M,) bool: the abstraction records a failure
    plans: np.ndarray  # (M,) bool: the abstraction records follow-ups
    ready: np.ndarray  # (M,) bool: the step has an abstraction
    dialogue: np.ndarray  # (M,) bool: a reply or message (a decision), not a tool call
    vocab: dict[str, int]

    @classmethod
    def build(cls, snap: "SessionSnapshot") -> "SalientIndex":
        m = snap.t
        vocab: dict[str, int] = {}
        rows: list[int] = []
        ids: list[int] = []
        sizes = np.zeros(m, dtype=np.int64)
        failed = np.zeros(m, dtype=bool)
        plans = np.zeros(m, dtype=bool)
        ready = np.zeros(m, dtype=bool)
        dialogue = np.fromiter((s.kind in ("respond", "message") for s in snap.steps), dtype=bool, count=m)
        for i, (step, a_json) in enumerate(zip(snap.steps, snap.abstractions)):
            if a_json is None:
                continue
            tokens, failed[i], plans[i] = step_facts(step.id, a_json, step.action)
            ready[i] = True
            sizes[i] = len(tokens)
            rows.extend([i] * len(tokens))
            ids.extend(vocab.setdefault(tok, len(vocab)) for tok in tokens)
        return cls(np.asarray(rows, dtype=np.int64), np.asarray(ids, dtype=np.int64), sizes, failed, plans, ready,
                   dialogue, vocab)

    def overlap(self, query: frozenset[str]) -> np.ndarray:
        """(M,) number of identifiers each step shares with ``query``."""
        q = np.fromiter((self.vocab[t] for t in query if t in self.vocab), dtype=np.int64)
        hit = np.isin(self.ids, q)
        return np.bincount(self.rows[hit], minlength=self.sizes.size)



@dataclass(frozen=True)
class SnapshotDelta:
    """What a session gained after a cached version (see :meth:`Ledger.delta`). Rows name step indices."""

    version: int
    steps: tuple[Step, ...]  # appended steps, in order
    representations: list[tuple[int, str, str, int]]  # (index, resolution, text, tokens), latest last
    abstractions: list[tuple[int, str]]  # (index, JSON), latest last
    keys: list[tuple[int, np.ndarray]]  # (index, vector) of the cached key model
    folds: dict[str, Fold]  # policy key -> its latest fold, for the keys that changed
    last_context_tokens: dict[str, int]  # policy -> tokens of its latest audited turn



class SnapshotReads:
    """The ledger's snapshot reads (mixed into :class:`palimpsest.platform.ledger.Ledger`)."""

    def snapshot(self, session_id: str, upto: int | None = None, key_model: str | None = None) -> SessionSnapshot:
        """A consistent, immutable view of the steps with t < upto (all steps when None)."""
        return self.versioned_snapshot(session_id, upto, key_model)[0]

    def versioned_snapshot(self, session_id: str, upto: int | None = None, key_model: str | None = None
                           ) -> tuple[SessionSnapshot, int]:
        """:meth:`snapshot` and the session's version (its count of writes) at the same point in time."""
        with self._tx(write=False, snapshot=True) as db:
            session = self.session(session_id)
            lim = upto if upto is not None else 1 << 62
            if lim < 0:
                raise LedgerError(f"upto must be >= 0, got {upto}")
            version = _version(db, session_id)
            rows = db.execute(f"SELECT {_STEP_COLS} FROM steps WHERE session_id=? AND t<? ORDER BY t",
                              (session_id, lim)).fetchall()
            steps = tuple(_step_from_row(r) for r in rows)
            m = len(steps)
            ids = np.fromiter((s.id for s in steps), dtype=np.int64, count=m)
            index = {int(sid): i for i, sid in enumerate(ids)}
            tokens = np.full((m, 4), -1, dtype=np.int64)
            tokens[:, Resolution.FULL] = [s.tokens["full"] for s in steps]
            bodies: list[list[str | None]] = [[None] * m for _ in _REPR_ORDER]
            abstractions: list[str | None] = [None] * m
            _apply_enrichment(db, "s.session_id=? AND s.t<?", (session_id, lim), index, tokens, bodies, abstractions)
            has_key = np.zeros(m, dtype=bool)
            keys = np.zeros((m, 0), dtype=np.float32)
            if key_model is not None:
                krows = db.execute(
                    "SELECT k.step_id, k.dim, k.vector FROM keys k JOIN steps s ON s.id=k.step_id"
                    " WHERE s.session_id=? AND s.t<? AND k.model=?", (session_id, lim, key_model)).fetchall()
                if krows:
                    keys = np.zeros((m, krows[0][1]), dtype=np.float32)
                    for sid, dim, vec in krows:
                        keys[index[sid]] = np.frombuffer(vec, dtype=np.float32)
                        has_key[index[sid]] = True
            folds = {}
            for key, f_upto, text, ntok, producer in db.execute(
                "SELECT policy_key, upto, text, tokens, producer FROM folds WHERE session_id=? AND upto<=?"
                " ORDER BY upto", (session_id, lim)):
                folds[key] = Fold(upto=f_upto, text=text, tokens=ntok, producer=producer)
            last = {}
            for policy, ntok in db.execute(
                "SELECT policy, tokens FROM audit WHERE session_id=? AND t<? ORDER BY id", (session_id, lim)):
                last[policy] = ntok
        snap = SessionSnapshot(
            session=session, steps=steps, step_ids=ids, tokens=tokens, bodies=tuple(tuple(b) for b in bodies),
            key_model=key_model, keys=keys, has_key=has_key, abstractions=tuple(abstractions), folds=folds,
            last_context_tokens=last, tokenizer=self.tokenizer.name,
            _prefix_tokens=None if self.prefix_cost is None else int(self.prefix_cost(session)),
        )
        return snap, version

    def version(self, session_id: str) -> int:
        """The session's count of writes (steps, summaries, keys, folds, audited turns): one indexed row."""
        with self._tx(write=False) as db:
            return _version(db, session_id)

    def delta(self, session_id: str, since: int, have_steps: int, have_ids: Mapping[int, int],
              key_model: str | None) -> "SnapshotDelta":
        """What a session gained after version ``since``, for a cached snapshot of ``have_steps`` steps
        (``have_ids``: step id -> index): one read transaction, O(what changed)."""
        with self._tx(write=False, snapshot=True) as db:
            version = _version(db, session_id)
            changes = db.execute("SELECT kind, step_id, policy, tokens FROM changes WHERE session_id=? AND version>?"
                                 " AND version<=? ORDER BY version", (session_id, since, version)).fetchall()
            steps = tuple(_step_from_row(r) for r in db.execute(
                f"SELECT {_STEP_COLS} FROM steps WHERE session_id=? AND t>=? ORDER BY t", (session_id, have_steps)))
            fresh_ids = {s.id: have_steps + k for k, s in enumerate(steps)}

            def index(sid: int) -> int | None:  # no copy of the cached id map: O(what changed)
                return fresh_ids[sid] if sid in fresh_ids else have_ids.get(sid)
            touched = sorted({int(c[1]) for c in changes if c[0] == "enrich" and c[1] in have_ids})
            keyed = sorted({int(c[1]) for c in changes if c[0] == "key" and c[2] == key_model and c[1] in have_ids})
            reps: list[tuple] = []
            abstractions: list[tuple] = []
            # the new steps' rows, then the re-read rows of older steps that gained a summary
            fresh = [("s.session_id=? AND s.t>=?", (session_id, have_steps))] if steps else []
            where = list(fresh)
            for chunk in _chunks(touched, 500):
                where.append((f"s.id IN ({','.join('?' * len(chunk))})", tuple(chunk)))
            for cond, params in where:
                reps += [tuple(r) for r in db.execute(
                    "SELECT r.step_id, r.resolution, r.text, r.tokens FROM representations r JOIN steps s ON"
                    f" s.id=r.step_id WHERE {cond} ORDER BY r.created, r.rowid", params)]
                abstractions += [tuple(r) for r in db.execute(
                    "SELECT a.step_id, a.body FROM abstractions a JOIN steps s ON s.id=a.step_id"
                    f" WHERE {cond} ORDER BY a.created, a.rowid", params)]
            keys: list[tuple] = []
            if key_model is not None:
                kwhere = fresh + [(f"s.id IN ({','.join('?' * len(c))})", tuple(c)) for c in _chunks(keyed, 500)]
                for cond, params in kwhere:
                    keys += [(int(r[0]), np.frombuffer(r[1], dtype=np.float32)) for r in db.execute(
                        "SELECT k.step_id, k.vector FROM keys k JOIN steps s ON s.id=k.step_id"
                        f" WHERE {cond} AND k.model=?", (*params, key_model))]
            folds = {}
            for key in sorted({c[2] for c in changes if c[0] == "fold"}):
                row = db.execute("SELECT upto, text, tokens, producer FROM folds WHERE session_id=? AND policy_key=?"
                                 " ORDER BY upto DESC LIMIT 1", (session_id, key)).fetchone()
                if row is not None:
                    folds[key] = Fold(upto=row[0], text=row[1], tokens=row[2], producer=row[3])
        last = {c[2]: int(c[3]) for c in changes if c[0] == "turn"}
        return SnapshotDelta(version, steps, [(index(r[0]), *r[1:]) for r in reps if index(r[0]) is not None],
                             [(index(a[0]), a[1]) for a in abstractions if index(a[0]) is not None],
                             [(index(k[0]), k[1]) for k in keys if index(k[0]) is not None], folds, last)


def _chunks(items: Sequence[int], n: int):
    for i in range(0, len(items), n):
        yield items[i: i + n]


def _apply_enrichment(db, cond: str, params: Sequence, index: Mapping[int, int], tokens: np.ndarray,
                      bodies: list[list[str | None]], abstractions: list[str | None]) -> None:
    """Fill the summaries and abstractions of the steps ``cond`` selects; the latest producer wins per resolution
    (an LLM summary written after the rule fallback)."""
    for sid, res, text, ntok in db.execute(
            "SELECT r.step_id, r.resolution, r.text, r.tokens FROM representations r JOIN steps s ON s.id=r.step_id"
            f" WHERE {cond} ORDER BY r.created, r.rowid", params):
        i = index[sid]
        level = Resolution.parse(res)
        tokens[i, level] = ntok
        if level is not Resolution.FULL:
            bodies[_REPR_ORDER.index(level)][i] = text
    for sid, body in db.execute(
            "SELECT a.step_id, a.body FROM abstractions a JOIN steps s ON s.id=a.step_id"
            f" WHERE {cond} ORDER BY a.created, a.rowid", params):
        abstractions[index[sid]] = body
