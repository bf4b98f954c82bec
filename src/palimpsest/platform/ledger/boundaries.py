"""Compaction boundaries (``platform.compile.epochs``) and work leases: what several replicas coordinate through (mixed
into :class:`palimpsest.platform.ledger.Ledger`)."""

from __future__ import annotations

import time

from palimpsest.platform.types import LedgerError, UnknownSessionError


class Boundaries:
    """A session's compaction boundaries under each policy key, and named leases on background work."""

    # -- compaction boundaries (platform.compile.epochs) ----------------------------------------------

    def add_boundary(self, session_id: str, key: str, boundary) -> tuple[int, bool]:
        """Store a compaction boundary (its exact messages and decisions) of a session under ``key`` at its step
        ``t``, unless one is stored there already: one boundary per (session, key, t). Returns (its row id,
        whether this call stored it). Under the session's lock, so of two replicas compacting the same turn at
        once the first stores its boundary and the second gets the first's row, which it serves. The latest row
        of a key at or before a step is the boundary in effect there; where a ledger written before migration
        0006 holds several at one step, the answer is the newest of them, the one :meth:`last_boundary` puts in
        effect."""
        with self._tx() as db:
            if not self._store.lock_session(db, session_id):
                raise UnknownSessionError(f"unknown session {session_id!r}")
            found = db.execute("SELECT id FROM boundaries WHERE session_id=? AND key=? AND t=? "
                               "ORDER BY id DESC LIMIT 1",
                               (session_id, key, int(boundary.t))).fetchone()
            if found is not None:
                return int(found[0]), False
            (row,) = db.execute(
                "INSERT INTO boundaries (session_id, key, t, digest, body, created) VALUES (?,?,?,?,?,?) RETURNING id",
                (session_id, key, int(boundary.t), boundary.digest, boundary.encode(), time.time())).fetchone()
        return int(row), True

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
