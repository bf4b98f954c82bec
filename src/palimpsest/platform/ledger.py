"""The step ledger: an append-only store of every step, its representations, keys and audits.

The backend is chosen by URL (:mod:`palimpsest.platform.stores`): SQLite in WAL mode with
``synchronous=FULL`` is the embedded default, PostgreSQL (``postgresql://...``) serves several
replicas and machines. Either way a step is committed before :meth:`Ledger.append` returns, and
triggers make every table append-only, so raw text can never be updated or deleted by any code
path, this module's included. The schema lives in ``platform/migrations/``.

Reads go through :meth:`Ledger.snapshot`, one read transaction that returns an immutable
:class:`SessionSnapshot` (columns as numpy arrays), the only input a policy ever sees. Every
read and every write names its session; a step id of another session is "unknown" here.
"""

from __future__ import annotations

import json
import re
import time
import zlib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

from palimpsest.platform.abstraction import Abstraction, Summaries, step_facts
from palimpsest.platform.stores import open_store
from palimpsest.platform.chat import prefix_tokens
from palimpsest.platform.render import render_full_body, render_placeholder_body, step_text
from palimpsest.platform.tokens import Tokenizer, get_tokenizer
from palimpsest.platform.toolcalls import check_calls
from palimpsest.platform.types import (
    Authority,
    CompiledTurn,
    Fold,
    LedgerError,
    Resolution,
    Session,
    Step,
    StepRecord,
    UnknownSessionError,
    UnknownStepError,
)

_SESSION_ID = re.compile(r"^[\w.:/@+-]{1,200}$")
_KIND = re.compile(r"^[a-z][a-z0-9_]{0,31}$")

_REPR_ORDER = (Resolution.DETAILED, Resolution.BRIEF, Resolution.PLACEHOLDER)
_LABELS = [r.label for r in sorted(Resolution, key=int)]


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
    prefix_tokens: int = 0  # system + tools + task, as the compiler renders them
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


class Ledger:
    """Append-only step ledger. Thread-safe; several processes (SQLite) or machines (PostgreSQL) may
    share one.

    ``url``: a file path or ``sqlite:///path`` (the default backend), ``:memory:``, or
    ``postgresql://user:password@host:port/db`` (``?options=-csearch_path%3Dname`` picks a schema).
    An unreachable database raises :class:`LedgerUnavailableError` naming it (password hidden).
    """

    def __init__(self, url: str | Path = ":memory:", tokenizer: Tokenizer | str | None = None, *,
                 synchronous: str = "FULL", timeout_s: float = 30.0, pool_size: int = 8):
        self._store = open_store(url, synchronous=synchronous, timeout_s=timeout_s, pool_size=pool_size)
        self.path = self.url = self._store.url  # the URL with its password hidden
        self.backend = self._store.backend
        self._tx = self._store.tx
        self.tokenizer = self._bind_tokenizer(tokenizer)

    # -- plumbing ---------------------------------------------------------------------------

    def transaction(self):
        """Group several writes into one transaction (all or nothing): ``with ledger.transaction(): ...``."""
        return self._tx()

    def _read(self, sql: str, params: Sequence = ()) -> list[tuple]:
        with self._tx(write=False) as db:
            return [tuple(r) for r in db.execute(sql, params).fetchall()]

    def _read_one(self, sql: str, params: Sequence = ()) -> tuple | None:
        rows = self._read(sql, params)
        return rows[0] if rows else None

    def _bind_tokenizer(self, tokenizer: Tokenizer | str | None) -> Tokenizer:
        """Token counts are stored, so one ledger counts with one tokenizer for its whole life."""
        row = self._read_one("SELECT value FROM meta WHERE key='tokenizer'")
        if tokenizer is None:
            tok = get_tokenizer(json.loads(row[0])["spec"] if row else None)
        elif isinstance(tokenizer, str):
            tok = get_tokenizer(tokenizer)
        else:
            tok = tokenizer
        spec = getattr(tok, "spec", None) or (tokenizer if isinstance(tokenizer, str) else None)
        if row is None:
            with self._tx() as db:
                db.execute("INSERT OR IGNORE INTO meta VALUES ('tokenizer', ?)",
                           (json.dumps({"name": tok.name, "spec": spec}),))
            row = self._read_one("SELECT value FROM meta WHERE key='tokenizer'")  # a concurrent opener may have won
        if json.loads(row[0])["name"] != tok.name:
            raise LedgerError(
                f"ledger {self.path} counts tokens with {json.loads(row[0])['name']!r}; "
                f"it cannot be opened with {tok.name!r}"
            )
        return tok

    def close(self) -> None:
        self._store.close()

    def __enter__(self) -> "Ledger":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- sessions ---------------------------------------------------------------------------

    def create_session(self, session_id: str, task: str, system: str = "", tools: str | None = None,
                       meta: Mapping | None = None) -> Session:
        """Create a session; creating it again with the same task/system/tools is a no-op."""
        if not isinstance(session_id, str) or not _SESSION_ID.match(session_id):
            raise LedgerError(f"invalid session id {session_id!r}: 1-200 characters of letters, digits and ._:/@+-")
        if not isinstance(task, str) or not task.strip():
            raise LedgerError(f"session {session_id!r}: the task must be a non-empty string")
        with self._tx() as db:
            # Insert-or-keep, then compare: two replicas creating one session at once both succeed.
            db.execute("INSERT OR IGNORE INTO sessions (id, task, system, tools, meta, created) VALUES (?,?,?,?,?,?)",
                       (session_id, task, system or "", tools, json.dumps(dict(meta or {})), time.time()))
            db.execute("INSERT OR IGNORE INTO session_versions (session_id, version) VALUES (?, 0)", (session_id,))
            row = db.execute("SELECT task, system, tools FROM sessions WHERE id=?", (session_id,)).fetchone()
            if tuple(row) != (task, system or "", tools):
                raise LedgerError(f"session {session_id!r} already exists with a different task, system or tools")
        return self.session(session_id)

    def session(self, session_id: str) -> Session:
        row = self._read_one("SELECT id, task, system, tools, meta, created FROM sessions WHERE id=?", (session_id,))
        if row is None:
            raise UnknownSessionError(f"unknown session {session_id!r}")
        return Session(id=row[0], task=row[1], system=row[2], tools=row[3], meta=json.loads(row[4]), created=row[5])

    def sessions(self) -> list[str]:
        return [r[0] for r in self._read("SELECT id FROM sessions ORDER BY created, id")]

    # -- steps ------------------------------------------------------------------------------

    def append(self, session_id: str, record: StepRecord) -> Step:
        """Store one raw step durably; returns only after the commit. Idempotent for identical content."""
        return self.append_many(session_id, [record])[0]

    def append_next(self, session_id: str, record: StepRecord) -> Step:
        """Store one step as the session's next one: its ``t`` is assigned under the session's lock, so
        concurrent appends of one session each get their own t (``record.t`` is ignored)."""
        return self.append_many(session_id, [record], assign_t=True)[0]

    def append_many(self, session_id: str, records: Sequence[StepRecord], assign_t: bool = False) -> list[Step]:
        """Store several steps in one transaction (all or nothing). With ``assign_t`` the records are the next
        steps whatever their ``t`` says (t assigned under the session's lock)."""
        for r in records:
            _validate_record(session_id, r)
        out: list[int] = []
        with self._tx() as db:
            # Appends to one session are serialised (SQLite: the write lock; PostgreSQL: the session
            # row's lock), so the next t and the idempotency check below cannot race another writer.
            if not self._store.lock_session(db, session_id):
                raise UnknownSessionError(f"unknown session {session_id!r}")
            version = self._bump(db, session_id)
            (next_t,) = db.execute("SELECT COUNT(*) FROM steps WHERE session_id=?", (session_id,)).fetchone()
            for r in records:
                if assign_t:
                    r = replace(r, t=next_t)
                digest = r.sha256()
                row = db.execute("SELECT id, sha256 FROM steps WHERE session_id=? AND t=?",
                                 (session_id, r.t)).fetchone()
                if row is not None:
                    if row[1] != digest:
                        raise LedgerError(
                            f"session {session_id!r} step t={r.t} already exists with different content "
                            f"(stored sha256 {row[1][:12]}, new {digest[:12]}); raw steps are immutable"
                        )
                    out.append(row[0])
                    continue
                if r.t != next_t:
                    raise LedgerError(f"session {session_id!r}: expected step t={next_t}, got t={r.t} (steps are appended in order)")
                # The id is drawn before the insert: the full segment's size (its header names the id)
                # is stored with the row, which is never updated.
                sid = self._store.next_id(db, "steps")
                ph_body = render_placeholder_body(r, sid)
                n_th, n_act, n_obs, n_full, n_ph = self.tokenizer.count_batch([
                    r.thought, r.action, r.observation or "",
                    step_text(r, sid, Resolution.FULL, None),
                    step_text(r, sid, Resolution.PLACEHOLDER, ph_body),
                ])
                db.execute(
                    "INSERT INTO steps (id, session_id, t, kind, thought, action, observation, authority, tool, sha256,"
                    " tok_thought, tok_action, tok_observation, tok_full, created, calls)"
                    " VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                    (sid, session_id, r.t, r.kind, r.thought, r.action, r.observation, r.authority.value, r.tool,
                     digest, n_th, n_act, n_obs, n_full, time.time(), r.calls),
                )
                db.execute(f"INSERT INTO representations ({_REPR_COLS}) VALUES (?,?,?,?,?,?,?)",
                           (sid, "placeholder", ph_body, n_ph, "ledger", "1", time.time()))
                out.append(sid)
                next_t += 1
            _log(db, session_id, version, [("step", sid, None, None) for sid in out])
        return [self.step(session_id, sid) for sid in out]

    def step(self, session_id: str, step_id: int) -> Step:
        """One raw step, looked up by id within its session. Another session's id is unknown here."""
        try:
            sid = int(str(step_id).lstrip("#"))
        except (TypeError, ValueError):
            raise UnknownStepError(f"invalid step id {step_id!r}") from None
        if not -(1 << 63) <= sid < (1 << 63):
            raise UnknownStepError(f"no step #{sid} in session {session_id!r}")
        row = self._read_one(f"SELECT {_STEP_COLS} FROM steps WHERE id=? AND session_id=?", (sid, session_id))
        if row is None:
            raise UnknownStepError(f"no step #{sid} in session {session_id!r}")
        return _step_from_row(row)

    def step_at(self, session_id: str, t: int) -> Step:
        if not isinstance(t, int) or not 0 <= t < (1 << 63):
            raise UnknownStepError(f"no step t={t} in session {session_id!r}")
        row = self._read_one(f"SELECT {_STEP_COLS} FROM steps WHERE session_id=? AND t=?", (session_id, t))
        if row is None:
            raise UnknownStepError(f"no step t={t} in session {session_id!r}")
        return _step_from_row(row)

    def steps(self, session_id: str, start: int = 0, limit: int = 100) -> list[Step]:
        """Steps ``start`` .. ``start + limit - 1`` of a session, in order (one query; for paging)."""
        self.session(session_id)
        rows = self._read(f"SELECT {_STEP_COLS} FROM steps WHERE session_id=? AND t>=? AND t<? ORDER BY t",
                          (session_id, int(start), int(start) + int(limit)))
        return [_step_from_row(r) for r in rows]

    def hashes(self, session_id: str) -> list[str]:
        """The content hash of every step of a session, in order (what idempotent re-sends match against)."""
        self.session(session_id)
        return [r[0] for r in self._read("SELECT sha256 FROM steps WHERE session_id=? ORDER BY t", (session_id,))]

    def count(self, session_id: str) -> int:
        return self._read_one("SELECT COUNT(*) FROM steps WHERE session_id=?", (session_id,))[0]

    # -- enrichment (added later, never replacing raw) --------------------------------------

    def add_summaries(self, session_id: str, step_id: int, s: Summaries, producer: str, version: str) -> None:
        step = self.step(session_id, step_id)
        texts = [step_text(step, step.id, Resolution.DETAILED, s.detailed),
                 step_text(step, step.id, Resolution.BRIEF, s.brief)]
        n_det, n_brief = self.tokenizer.count_batch(texts)
        now = time.time()
        with self._tx() as db:
            _log(db, session_id, self._bump(db, session_id), [("enrich", step.id, None, None)])
            db.execute("INSERT OR IGNORE INTO abstractions (step_id, producer, producer_version, body, created)"
                       " VALUES (?,?,?,?,?)",
                       (step.id, producer, version, s.abstraction.to_json(), now))
            db.executemany(f"INSERT OR IGNORE INTO representations ({_REPR_COLS}) VALUES (?,?,?,?,?,?,?)",
                           [(step.id, "detailed", s.detailed, n_det, producer, version, now),
                            (step.id, "brief", s.brief, n_brief, producer, version, now)])

    def add_keys(self, session_id: str, step_ids: Sequence[int], model: str, vectors: np.ndarray) -> None:
        vectors = np.asarray(vectors, dtype=np.float32)
        if vectors.ndim != 2 or vectors.shape[0] != len(step_ids):
            raise LedgerError(f"expected ({len(step_ids)}, d) key vectors, got shape {vectors.shape}")
        if not np.isfinite(vectors).all():
            raise LedgerError("key vectors must be finite")
        ids = [int(sid) for sid in step_ids]
        now = time.time()
        with self._tx() as db:
            version = self._bump(db, session_id)
            # Ownership in one query: a step id of another session is unknown here.
            owned = {r[0] for r in db.execute(
                f"SELECT id FROM steps WHERE session_id=? AND id IN ({','.join('?' * len(ids))})",
                (session_id, *ids)).fetchall()} if ids else set()
            for sid in ids:
                if sid not in owned:
                    raise UnknownStepError(f"no step #{sid} in session {session_id!r}")
            db.executemany("INSERT OR IGNORE INTO keys VALUES (?,?,?,?,?)",
                           [(sid, model, vectors.shape[1], vectors[i].tobytes(), now) for i, sid in enumerate(ids)])
            _log(db, session_id, version, [("key", sid, model, None) for sid in ids])

    def pending(self, session_id: str, key_model: str | None, producer: tuple[str, str] | None = None
                ) -> tuple[list[Step], list[Step]]:
        """(steps without a summary [of this (producer, version)], steps without a key for ``key_model``)."""
        cols = ", ".join(f"s.{c.strip()}" for c in _STEP_COLS.split(","))
        which = "" if producer is None else " AND a.producer=? AND a.producer_version=?"
        no_sum = self._read(
            f"SELECT {cols} FROM steps s WHERE s.session_id=? AND NOT EXISTS "
            f"(SELECT 1 FROM abstractions a WHERE a.step_id=s.id{which}) ORDER BY s.t",
            (session_id, *(producer or ())))
        no_key = [] if key_model is None else self._read(
            f"SELECT {cols} FROM steps s WHERE s.session_id=? AND NOT EXISTS "
            "(SELECT 1 FROM keys k WHERE k.step_id=s.id AND k.model=?) ORDER BY s.t", (session_id, key_model))
        return [_step_from_row(r) for r in no_sum], [_step_from_row(r) for r in no_key]

    def add_fold(self, session_id: str, policy_key: str, fold: Fold) -> None:
        with self._tx() as db:
            _log(db, session_id, self._bump(db, session_id), [("fold", None, policy_key, fold.upto)])
            db.execute("INSERT OR IGNORE INTO folds (session_id, policy_key, upto, text, tokens, producer, created)"
                       " VALUES (?,?,?,?,?,?,?)",
                       (session_id, policy_key, fold.upto, fold.text, fold.tokens, fold.producer, time.time()))

    # -- compaction boundaries (platform.epochs) ----------------------------------------------

    def add_boundary(self, session_id: str, key: str, boundary) -> int:
        """Store a compaction boundary (its exact messages and decisions) of a session under ``key``; returns
        its row id. The latest row of a key at or before a step is the boundary in effect there."""
        with self._tx() as db:
            if not self._store.lock_session(db, session_id):
                raise UnknownSessionError(f"unknown session {session_id!r}")
            (row,) = db.execute(
                "INSERT INTO boundaries (session_id, key, t, digest, body, created) VALUES (?,?,?,?,?,?) RETURNING id",
                (session_id, key, int(boundary.t), boundary.digest, boundary.encode(), time.time())).fetchone()
        return int(row)

    def last_boundary(self, session_id: str, key: str, at: int | None = None) -> int | None:
        """The row id of the session's last boundary under ``key`` (covering at most ``at`` steps), or None."""
        # the boundary covering the most steps (of those within `at`), the newest of equals: never one that a
        # replica which had not seen the latest steps stored after it
        if at is None:
            row = self._read_one("SELECT id FROM boundaries WHERE session_id=? AND key=? ORDER BY t DESC, id DESC "
                                 "LIMIT 1", (session_id, key))
        else:
            row = self._read_one("SELECT id FROM boundaries WHERE session_id=? AND key=? AND t<=? "
                                 "ORDER BY t DESC, id DESC LIMIT 1", (session_id, key, int(at)))
        return None if row is None else int(row[0])

    def boundary_blob(self, session_id: str, row_id: int) -> bytes:
        row = self._read_one("SELECT body FROM boundaries WHERE session_id=? AND id=?", (session_id, int(row_id)))
        if row is None:
            raise LedgerError(f"session {session_id!r} has no boundary {row_id}")
        return bytes(row[0])

    def boundaries(self, session_id: str) -> list[dict]:
        """Every compaction boundary of a session, oldest first: (id, key, t, digest, created)."""
        rows = self._read("SELECT id, key, t, digest, created FROM boundaries WHERE session_id=? ORDER BY id",
                          (session_id,))
        return [{"id": r[0], "key": r[1], "t": r[2], "digest": r[3], "created": r[4]} for r in rows]

    # -- audit ------------------------------------------------------------------------------

    def record_turn(self, turn: CompiledTurn) -> None:
        p = turn.plan
        # Format 2: t is 0..n-1; step ids, resolutions, reasons and scores as compact columns (a turn over
        # 100,000 steps writes ~1.5 MB before compression, not 4 MB).
        blob = zlib.compress(p.step_id.astype(np.int64).tobytes() + p.resolution.astype(np.int8).tobytes()
                             + p.reason_code.astype(np.int16).tobytes() + p.score.astype(np.float32).tobytes(), 1)
        head = {"n": len(p), "format": 2, "reasons": p.reasons, "reserve": turn.prompt.reserve}
        if p.info.get("elided"):
            head["elided"] = p.info["elided"]  # oversized steps shown head and tail
        if p.info.get("folded"):
            head["folded"] = p.info["folded"]  # old history folded into range lines
        for k in ("compaction", "epoch"):  # a compaction boundary (what changed, why), or the epoch extended
            if p.info.get(k):
                head[k] = p.info[k]
        plan_blob = json.dumps(head).encode() + b"\0" + blob
        with self._tx() as db:
            _log(db, turn.session_id, self._bump(db, turn.session_id), [("turn", None, p.policy, turn.prompt.tokens)])
            db.execute(
                "INSERT INTO audit (session_id, t, policy, config_hash, budget, prompt_hash, prefix_hash, tokens,"
                " prefix_tokens, counts, plan, degradations, created) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)",
                (turn.session_id, turn.t, p.policy, p.config_hash, turn.budget, turn.prompt.prompt_hash,
                 turn.prompt.prefix_hash, turn.prompt.tokens, turn.prompt.prefix_tokens, json.dumps(p.counts()),
                 plan_blob, json.dumps([[t, _LABELS[b], _LABELS[a]] for t, b, a in p.degraded.tolist()]), time.time()),
            )

    def audit(self, session_id: str) -> list[dict]:
        """Every recorded turn of a session, oldest first, with its full plan decoded."""
        self.session(session_id)
        rows = self._read(
            "SELECT t, policy, config_hash, budget, prompt_hash, prefix_hash, tokens, prefix_tokens, counts, plan,"
            " degradations, created FROM audit WHERE session_id=? ORDER BY id", (session_id,))
        out = []
        for r in rows:
            head, blob = bytes(r[9]).split(b"\0", 1)
            meta = json.loads(head)
            n = meta["n"]
            raw = zlib.decompress(blob)
            if meta.get("format", 1) == 2:
                ids = np.frombuffer(raw[: 8 * n], dtype=np.int64)
                res = np.frombuffer(raw[8 * n: 9 * n], dtype=np.int8)
                why = np.frombuffer(raw[9 * n: 11 * n], dtype=np.int16)
                scores = np.frombuffer(raw[11 * n:], dtype=np.float32)
                cols = (np.arange(n), ids, res, why)
            else:  # format 1: four int64 rows (t, step id, resolution, reason), then float64 scores
                cols = tuple(np.frombuffer(raw[: 4 * n * 8], dtype=np.int64).reshape(4, n))
                scores = np.frombuffer(raw[4 * n * 8:], dtype=np.float64)
            plan = [{"t": t, "step_id": sid, "resolution": _LABELS[lv], "reason": meta["reasons"][rc], "score": sc}
                    for t, sid, lv, rc, sc in zip(*(c.tolist() for c in cols), scores.tolist())]
            out.append({"t": r[0], "policy": r[1], "config_hash": r[2], "budget": r[3], "prompt_hash": r[4],
                        "prefix_hash": r[5], "tokens": r[6], "prefix_tokens": r[7], "counts": json.loads(r[8]),
                        "plan": plan, "degradations": json.loads(r[10]), "created": r[11],
                        "reserve": meta.get("reserve", 0), "elided": meta.get("elided", []),
                        "folded": meta.get("folded"), "compaction": meta.get("compaction"),
                        "epoch": meta.get("epoch")})
        return out

    def record_glimpse(self, session_id: str, step_id: int, limit: int) -> bool:
        """Count a glimpse against the current turn (t = steps so far); False once ``limit`` are used."""
        with self._tx() as db:
            self._store.lock_session(db, session_id)  # count-then-insert must not race another replica
            (t,) = db.execute("SELECT COUNT(*) FROM steps WHERE session_id=?", (session_id,)).fetchone()
            (used,) = db.execute("SELECT COUNT(*) FROM glimpses WHERE session_id=? AND t=?", (session_id, t)).fetchone()
            if used >= limit:
                return False
            db.execute("INSERT INTO glimpses (session_id, t, step_id, created) VALUES (?,?,?,?)",
                       (session_id, t, step_id, time.time()))
            return True

    # -- work leases (background enrichment from several replicas) ---------------------------

    def claim(self, name: str, owner: str, ttl_s: float) -> bool:
        """Take (or renew) the lease ``name`` for ``owner`` until ``ttl_s`` from now; False while
        another owner holds an unexpired one. A crashed holder's lease lapses by itself."""
        now = time.time()
        with self._tx() as db:
            row = db.execute(
                "INSERT INTO leases (name, owner, expires) VALUES (?,?,?) ON CONFLICT (name) DO UPDATE"
                " SET owner=excluded.owner, expires=excluded.expires"
                " WHERE leases.expires < ? OR leases.owner = excluded.owner RETURNING owner",
                (name, owner, now + ttl_s, now)).fetchone()
        return row is not None

    def release(self, name: str, owner: str) -> None:
        with self._tx() as db:
            db.execute("DELETE FROM leases WHERE name=? AND owner=?", (name, owner))

    # -- served turns and outcomes (the A/B record) ------------------------------------------

    def record_served(self, session_id: str, t: int, arm: str, metrics: Mapping[str, float | int]) -> None:
        """What a served turn cost (tokens, latency per stage, glimpses, error) under its arm."""
        with self._tx() as db:
            db.execute("INSERT INTO served (session_id, t, arm, metrics, created) VALUES (?,?,?,?,?)",
                       (session_id, int(t), arm, json.dumps(dict(metrics)), time.time()))

    def record_outcome(self, session_id: str, arm: str, value: float, note: str = "") -> None:
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value != value:
            raise LedgerError(f"an outcome must be a finite number, got {value!r}")
        self.session(session_id)
        with self._tx() as db:
            db.execute("INSERT INTO outcomes (session_id, arm, value, note, created) VALUES (?,?,?,?,?)",
                       (session_id, arm, float(value), note, time.time()))

    def served(self, since: float = 0.0) -> list[dict]:
        """Every served turn since ``since`` (unix time), oldest first."""
        return [{"session_id": r[0], "t": r[1], "arm": r[2], **json.loads(r[3]), "created": r[4]}
                for r in self._read("SELECT session_id, t, arm, metrics, created FROM served WHERE created>=?"
                                    " ORDER BY id", (since,))]

    def record_shadow(self, session_id: str, t: int, arm: str, status: str, reason: str = "", reference: str = "",
                      kl: float | None = None, top1: float | None = None, tokens: int = 0) -> None:
        """A sampled served turn's shadow fidelity (``scored``) or why it has none (``skipped``)."""
        if status not in ("scored", "skipped"):
            raise LedgerError(f"shadow status must be 'scored' or 'skipped', got {status!r}")
        with self._tx() as db:
            db.execute("INSERT INTO shadow (session_id, t, arm, status, reason, reference, kl, top1, tokens, created)"
                       " VALUES (?,?,?,?,?,?,?,?,?,?)",
                       (session_id, int(t), arm, status, reason, reference, kl, top1, int(tokens), time.time()))

    def shadows(self, since: float = 0.0) -> list[dict]:
        """Every shadow-fidelity record since ``since`` (unix time), oldest first."""
        cols = ("session_id", "t", "arm", "status", "reason", "reference", "kl", "top1", "tokens", "created")
        return [dict(zip(cols, r)) for r in self._read(
            f"SELECT {', '.join(cols)} FROM shadow WHERE created>=? ORDER BY id", (since,))]

    def outcomes(self, since: float = 0.0) -> list[dict]:
        return [{"session_id": r[0], "arm": r[1], "value": r[2], "note": r[3], "created": r[4]}
                for r in self._read("SELECT session_id, arm, value, note, created FROM outcomes WHERE created>=?"
                                    " ORDER BY id", (since,))]

    # -- snapshot ---------------------------------------------------------------------------

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
            prefix_tokens=prefix_tokens(self.tokenizer, session),
        )
        return snap, version

    def _bump(self, db, session_id: str) -> int:
        return _bump(self._store, db, session_id)

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

    def verify(self, session_id: str) -> int:
        """Recompute every stored hash of a session; returns the number of steps checked."""
        n = 0
        for row in self._read(f"SELECT {_STEP_COLS} FROM steps WHERE session_id=? ORDER BY t", (session_id,)):
            step = _step_from_row(row)
            if step.record().sha256() != step.sha256:
                raise LedgerError(f"session {session_id!r} step t={step.t}: stored hash does not match its content")
            n += 1
        return n


_REPR_COLS = "step_id, resolution, text, tokens, producer, producer_version, created"
_STEP_COLS = ("id, session_id, t, kind, thought, action, observation, authority, tool, sha256, tok_thought,"
              " tok_action, tok_observation, tok_full, created, calls")


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


def _version(db, session_id: str) -> int:
    row = db.execute("SELECT version FROM session_versions WHERE session_id=?", (session_id,)).fetchone()
    if row is None:
        raise UnknownSessionError(f"unknown session {session_id!r}")
    return int(row[0])


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


def _bump(store, db, session_id: str) -> int:
    """Count one more write to a session, first in its transaction, under the session's lock (on PostgreSQL the
    session row, taken first by every writer of the session: one lock order, and versions commit in order);
    returns the new version."""
    if not store.lock_session(db, session_id):
        raise UnknownSessionError(f"unknown session {session_id!r}")
    # a session created by code older than the counter has no row yet: it starts at 0
    db.execute("INSERT OR IGNORE INTO session_versions (session_id, version) VALUES (?, 0)", (session_id,))
    db.execute("UPDATE session_versions SET version = version + 1 WHERE session_id=?", (session_id,))
    row = db.execute("SELECT version FROM session_versions WHERE session_id=?", (session_id,)).fetchone()
    if row is None:
        raise UnknownSessionError(f"unknown session {session_id!r}")
    return int(row[0])


def _log(db, session_id: str, version: int, rows: Sequence[tuple]) -> None:
    """What a version added: (kind, step id, policy or key model, tokens or fold upto) rows."""
    if rows:
        db.executemany("INSERT INTO changes (session_id, version, kind, step_id, policy, tokens) VALUES (?,?,?,?,?,?)",
                       [(session_id, version, *r) for r in rows])


def _step_from_row(row) -> Step:
    return Step(
        id=row[0], session_id=row[1], t=row[2], kind=row[3], thought=row[4], action=row[5], observation=row[6],
        authority=Authority(row[7]), tool=row[8], sha256=row[9],
        tokens={"thought": row[10], "action": row[11], "observation": row[12], "full": row[13]},
        created=row[14], calls=row[15],
    )


def _validate_record(session_id: str, r: StepRecord) -> None:
    where = f"session {session_id!r} step t={getattr(r, 't', '?')}"
    if not isinstance(r, StepRecord):
        raise LedgerError(f"{where}: expected a StepRecord, got {type(r).__name__}")
    if not isinstance(r.t, int) or isinstance(r.t, bool) or r.t < 0:
        raise LedgerError(f"{where}: t must be a non-negative integer")
    if not isinstance(r.kind, str) or not _KIND.match(r.kind):
        raise LedgerError(f"{where}: invalid kind {r.kind!r}")
    for name in ("thought", "action"):
        if not isinstance(getattr(r, name), str):
            raise LedgerError(f"{where}: {name} must be a string")
    if r.observation is not None and not isinstance(r.observation, str):
        raise LedgerError(f"{where}: observation must be a string or null")
    if r.calls is not None:
        check_calls(r, where)
    if not isinstance(r.authority, Authority):
        raise LedgerError(f"{where}: authority must be one of {[a.value for a in Authority]}")

