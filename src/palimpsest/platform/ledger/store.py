"""The store: sessions, steps, their summaries and keys, folds, compaction boundaries and work leases.

Every write is one transaction that first bumps the session's version (its count of writes) and logs what it
added (the ``changes`` table), so a cached snapshot catches up from what changed (``SnapshotReads.delta``).
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable, Mapping, Sequence

import numpy as np

from palimpsest.platform.ledger.backends import open_store
from palimpsest.platform.prompt.abstraction import Summaries
from palimpsest.platform.prompt.render import render_placeholder_body, step_text
from palimpsest.platform.prompt.tokens import Tokenizer, get_tokenizer
from palimpsest.platform.prompt.toolcalls import check_calls
from palimpsest.platform.types import (
    Authority,
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
_REPR_COLS = "step_id, resolution, text, tokens, producer, producer_version, created"
_STEP_COLS = ("id, session_id, t, kind, thought, action, observation, authority, tool, sha256, tok_thought,"
              " tok_action, tok_observation, tok_full, created, calls")


#: What a session's fixed prefix (system, tools, task) costs in the actor's ids, as the prompt renders it.
PrefixCost = Callable[[Session], int]


class Store:
    """Sessions, steps, enrichment, folds, boundaries and leases over one backend (see :class:`Ledger`).
    ``prefix_cost``: the prompt's price of a session's fixed prefix, which snapshots carry."""

    def __init__(self, url: str | Path = ":memory:", tokenizer: Tokenizer | str | None = None, *,
                 prefix_cost: PrefixCost | None = None, synchronous: str = "FULL", timeout_s: float = 30.0,
                 pool_size: int = 8):
        self._store = open_store(url, synchronous=synchronous, timeout_s=timeout_s, pool_size=pool_size)
        self.path = self.url = self._store.url  # the URL with its password hidden
        self.backend = self._store.backend
        self._tx = self._store.tx
        self.tokenizer = self._bind_tokenizer(tokenizer)
        self.prefix_cost = prefix_cost

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

    def __enter__(self) -> "Store":
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
                    raise LedgerError(f"session {session_id!r}: expected step t={next_t}, got t={r.t} "
                                      "(steps are appended in order)")
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

    def _bump(self, db, session_id: str) -> int:
        return _bump(self._store, db, session_id)

    def verify(self, session_id: str) -> int:
        """Recompute every stored hash of a session; returns the number of steps checked."""
        n = 0
        for row in self._read(f"SELECT {_STEP_COLS} FROM steps WHERE session_id=? ORDER BY t", (session_id,)):
            step = _step_from_row(row)
            if step.record().sha256() != step.sha256:
                raise LedgerError(f"session {session_id!r} step t={step.t}: stored hash does not match its content")
            n += 1
        return n


def _version(db, session_id: str) -> int:
    row = db.execute("SELECT version FROM session_versions WHERE session_id=?", (session_id,)).fetchone()
    if row is None:
        raise UnknownSessionError(f"unknown session {session_id!r}")
    return int(row[0])


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
