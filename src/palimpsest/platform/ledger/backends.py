"""Where a ledger keeps its rows: SQLite (the embedded default) or PostgreSQL, chosen by URL.

The :class:`~palimpsest.platform.ledger.Ledger` writes its SQL once, in the small dialect both
backends share (``?`` placeholders, ``INSERT OR IGNORE``, ``rowid`` for insertion order); a store
translates it, runs transactions, serialises writers where the ledger needs it and applies the
schema migrations kept in ``platform/migrations/<backend>/``.

- ``sqlite``: one file, WAL, ``synchronous=FULL``; ``BEGIN IMMEDIATE`` takes the single write lock,
  so every write is serialised. Several processes of one machine may share the file.
- ``postgresql``: a connection pool (psycopg 3, imported only when such a URL is opened); writes
  run at READ COMMITTED and the ledger locks the session row it appends to (``FOR UPDATE``), so
  appends to one session are serialised across replicas and machines while other sessions proceed;
  snapshots are REPEATABLE READ, READ ONLY.

Connection failures surface as :class:`LedgerUnavailableError` (retriable; the transaction was
rolled back, nothing of it is stored), never as a driver's own exception.
"""

from __future__ import annotations

import re
import sqlite3
import threading
from contextlib import contextmanager
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any, Iterator, Protocol, Sequence
from urllib.parse import unquote, urlsplit, urlunsplit

from palimpsest.platform.types import LedgerError, LedgerUnavailableError

_MIGRATION = re.compile(r"^(\d{4})_[a-z0-9_]+\.sql$")
_PG_SCHEMES = ("postgresql", "postgres")
_ADVISORY_MIGRATION_LOCK = 0x70616C6D  # one constant: migrations of every ledger in a database serialise


class Cursor(Protocol):
    def fetchone(self) -> Any: ...
    def fetchall(self) -> list: ...
    def __iter__(self) -> Iterator: ...


class Conn(Protocol):
    """What the ledger uses inside a transaction (``sqlite3.Connection`` has exactly this shape)."""

    def execute(self, sql: str, params: Sequence = ()) -> Cursor: ...
    def executemany(self, sql: str, rows: Sequence[Sequence]) -> Any: ...


def is_postgres_url(url: str | Path) -> bool:
    return isinstance(url, str) and url.split("://", 1)[0] in _PG_SCHEMES and "://" in url


def redact(url: str | Path) -> str:
    """The URL without its password, fit for an error message or a log line."""
    s = str(url)
    if "://" not in s:
        return s
    parts = urlsplit(s)
    query = re.sub(r"(^|&)password=[^&]*", r"\1password=***", parts.query)
    netloc = parts.netloc
    if parts.password is not None:
        netloc = f"{parts.username or ''}:***@{parts.hostname or ''}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc, query=query))


def migrations(backend: str) -> list[tuple[int, str, str]]:
    """(version, file name, SQL) of every migration of ``backend``, in order."""
    folder = resources.files("palimpsest.platform") / "migrations" / backend
    out = []
    for f in folder.iterdir():
        m = _MIGRATION.match(f.name)
        if m:
            out.append((int(m.group(1)), f.name, f.read_text(encoding="utf-8")))
    out.sort()
    if [v for v, _, _ in out] != list(range(1, len(out) + 1)):
        raise LedgerError(f"migrations of {backend} must be numbered 0001, 0002, ... without gaps")
    return out


def open_store(url: str | Path, *, synchronous: str = "FULL", timeout_s: float = 30.0,
               pool_size: int = 8) -> "SQLiteStore | PostgresStore":
    """The store for ``url``: ``postgresql://user:pw@host:port/db`` (libpq URL, ``?options=...``
    allowed), ``sqlite:///abs/path.db``, a plain path, or ``:memory:``."""
    if is_postgres_url(url):
        return PostgresStore(str(url), timeout_s=timeout_s, pool_size=pool_size)
    s = str(url)
    if s.startswith("sqlite://"):
        s = unquote(urlsplit(s).path) or ":memory:"
    elif "://" in s:
        raise LedgerError(f"unsupported ledger URL {redact(s)!r}: use a file path, sqlite:///path or postgresql://...")
    return SQLiteStore(s, synchronous=synchronous, timeout_s=timeout_s)


class SQLiteStore:
    backend = "sqlite"

    def __init__(self, path: str, *, synchronous: str = "FULL", timeout_s: float = 30.0):
        self.path = self.url = path
        if synchronous.upper() not in ("FULL", "NORMAL", "EXTRA"):
            raise LedgerError(f"synchronous must be FULL, NORMAL or EXTRA, got {synchronous!r}")
        if path != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.RLock()
        self._depth = 0
        try:
            self._db = sqlite3.connect(path, timeout=timeout_s, isolation_level=None, check_same_thread=False)
            self._db.execute("PRAGMA journal_mode=WAL")
        except sqlite3.Error as e:
            raise LedgerError(f"cannot open ledger {path}: {e}") from e
        self._db.execute(f"PRAGMA synchronous={synchronous.upper()}")
        self._db.execute("PRAGMA foreign_keys=ON")
        self._migrate()

    @contextmanager
    def tx(self, write: bool = True, snapshot: bool = False) -> Iterator[Conn]:
        """One transaction under the store's lock: BEGIN IMMEDIATE for writes (the write lock is taken
        up front, so read-then-write decisions inside cannot race), a plain BEGIN for snapshots, none
        for a single read (one statement is consistent by itself). Nested calls on the same thread
        join the outer transaction."""
        with self._lock:
            if self._depth:
                self._depth += 1
                try:
                    yield self._db
                finally:
                    self._depth -= 1
                return
            begin = "BEGIN IMMEDIATE" if write else "BEGIN" if snapshot else None
            if begin:
                self._db.execute(begin)
            self._depth = 1
            try:
                yield self._db
            except BaseException:
                if begin:
                    self._db.execute("ROLLBACK")
                raise
            finally:
                self._depth = 0
            if begin:
                self._db.execute("COMMIT")

    def lock_session(self, db: Conn, session_id: str) -> bool:
        """Serialise writers of one session for the rest of the transaction (the write lock already
        does); False when the session does not exist."""
        return db.execute("SELECT 1 FROM sessions WHERE id=?", (session_id,)).fetchone() is not None

    def next_id(self, db: Conn, table: str) -> int:
        (n,) = db.execute(f"SELECT COALESCE(MAX(id), 0) + 1 FROM {table}").fetchone()
        return n

    def _migrate(self) -> None:
        with self.tx() as db:
            have = _schema_version(db, "SELECT name FROM sqlite_master WHERE type='table' AND name='meta'")
            _apply_migrations(db, self.backend, have, lambda sql: [db.execute(s) for s in _sqlite_statements(sql)])

    def close(self) -> None:
        with self._lock:
            self._db.close()


def _sqlite_statements(sql: str) -> Iterator[str]:
    """Split a script into complete statements (trigger bodies hold ';' of their own)."""
    buf = ""
    for line in sql.splitlines(keepends=True):
        if line.lstrip().startswith("--") and not buf.strip():
            continue
        buf += line
        if sqlite3.complete_statement(buf):
            yield buf.strip()
            buf = ""
    if buf.strip():
        raise LedgerError(f"incomplete SQL statement in a migration: {buf.strip()[:80]!r}")


def _apply_migrations(db: Conn, backend: str, have: int, run_script) -> None:
    """Run every migration above version ``have``, in order, recording each (inside the caller's transaction)."""
    for version, _name, sql in migrations(backend):
        if version > have:
            run_script(sql)
            db.execute("INSERT OR REPLACE INTO meta VALUES ('schema_version', ?)", (str(version),))


def _schema_version(db: Conn, meta_exists_sql: str) -> int:
    if db.execute(meta_exists_sql).fetchone() is None:
        return 0
    row = db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
    return int(row[0]) if row else 0


@lru_cache(maxsize=512)
def _to_postgres(sql: str) -> str:
    """The shared dialect in PostgreSQL's words (no '?' or '%' appears in the ledger's literals)."""
    out = sql.replace("%", "%%").replace("?", "%s")
    out = re.sub(r"\browid\b", "seq", out)
    if out.lstrip().upper().startswith("INSERT OR IGNORE"):
        out = re.sub(r"^\s*INSERT OR IGNORE", "INSERT", out, flags=re.I) + " ON CONFLICT DO NOTHING"
    elif out.lstrip().upper().startswith("INSERT OR REPLACE INTO META"):
        out = re.sub(r"^\s*INSERT OR REPLACE", "INSERT", out, flags=re.I) + \
            " ON CONFLICT (key) DO UPDATE SET value = EXCLUDED.value"
    return out


class _PgConn:
    """A pooled psycopg connection that speaks the shared dialect."""

    def __init__(self, conn):
        self._conn = conn

    def execute(self, sql: str, params: Sequence = ()):
        return self._conn.execute(_to_postgres(sql), tuple(params))

    def executemany(self, sql: str, rows: Sequence[Sequence]):
        with self._conn.cursor() as cur:
            cur.executemany(_to_postgres(sql), [tuple(r) for r in rows])


class PostgresStore:
    backend = "postgresql"

    def __init__(self, url: str, *, timeout_s: float = 30.0, pool_size: int = 8):
        try:
            import psycopg
            from psycopg_pool import ConnectionPool
        except ImportError as e:  # pragma: no cover - part of the dependency set
            raise LedgerError(f"a postgresql:// ledger needs psycopg and psycopg-pool installed ({e})") from e
        self.url = redact(url)
        self._psycopg = psycopg
        self._timeout = timeout_s
        connect_timeout = max(1, int(min(timeout_s, 10)))
        # One direct attempt first: an unreachable or misconfigured server is named with the driver's
        # own reason (refused, unknown host, bad password), not a pool time-out.
        try:
            psycopg.connect(url, connect_timeout=connect_timeout, autocommit=True).close()
        except psycopg.Error as e:
            raise LedgerUnavailableError(
                f"cannot connect to the ledger database {self.url}: {_first_line(e)}") from None
        self._pool = ConnectionPool(
            url, min_size=1, max_size=max(1, pool_size), open=False, timeout=timeout_s, max_idle=300,
            kwargs={"autocommit": True, "connect_timeout": connect_timeout}, configure=_configure,
            check=ConnectionPool.check_connection, name="palimpsest-ledger")
        self._pool.open(wait=True, timeout=timeout_s)
        self._local = threading.local()
        self._migrate()

    @contextmanager
    def tx(self, write: bool = True, snapshot: bool = False) -> Iterator[Conn]:
        """One transaction on a pooled connection; nested calls on the same thread join it. Reads
        that must be one point in time (``snapshot``) run REPEATABLE READ, READ ONLY; a single read
        runs as one autocommitted statement (no BEGIN/COMMIT round trips)."""
        outer = getattr(self._local, "conn", None)
        if outer is not None:
            yield outer
            return
        psycopg = self._psycopg
        begin = "BEGIN" if write else "BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY" if snapshot else None
        try:
            with self._pool.connection() as raw:
                if begin:
                    raw.execute(begin)
                self._local.conn = _PgConn(raw)
                try:
                    yield self._local.conn
                except BaseException:
                    if begin and not raw.closed and not raw.broken:
                        raw.execute("ROLLBACK")
                    raise
                finally:
                    self._local.conn = None
                if begin:
                    raw.execute("COMMIT")
        except self._pool_timeout() as e:  # (an OperationalError too: caught first for its own message)
            raise LedgerUnavailableError(f"no connection to the ledger database {self.url} within "
                                         f"{self._timeout:g} s: {_first_line(e)}") from None
        except psycopg.OperationalError as e:
            # The connection dropped or the server went away: the transaction did not commit
            # (PostgreSQL rolls back a transaction whose client is gone), so a retry is safe.
            raise LedgerUnavailableError(f"lost the ledger database {self.url}: {_first_line(e)}") from None
        except psycopg.errors.IntegrityError as e:
            raise LedgerError(f"the ledger refused a write: {_first_line(e)}") from None

    def _pool_timeout(self):
        from psycopg_pool import PoolTimeout

        return PoolTimeout

    def lock_session(self, db: Conn, session_id: str) -> bool:
        # NO KEY UPDATE serialises the session's writers without blocking inserts whose foreign key names it
        return db.execute("SELECT 1 FROM sessions WHERE id=? FOR NO KEY UPDATE", (session_id,)).fetchone() is not None

    def next_id(self, db: Conn, table: str) -> int:
        (n,) = db.execute(f"SELECT nextval(pg_get_serial_sequence('{table}', 'id'))").fetchone()
        return n

    def _migrate(self) -> None:
        with self.tx() as db:
            db.execute("SELECT pg_advisory_xact_lock(?)", (_ADVISORY_MIGRATION_LOCK,))
            have = _schema_version(db, "SELECT 1 FROM information_schema.tables WHERE table_name='meta'"
                                       " AND table_schema=current_schema()")
            _apply_migrations(db, self.backend, have, db._conn.execute)  # a whole script, no parameters

    def close(self) -> None:
        self._pool.close()


def _configure(conn) -> None:
    """Every pooled connection: a commit returns only once it is durable on the server (whatever the
    server's default), which is what an acknowledged append promises."""
    conn.execute("SET synchronous_commit TO on")


def _first_line(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0]
