"""Crash consistency of the ledger: a child appends steps and is SIGKILLed at random moments, again and again.

Every append acknowledged before a kill must be present with a verifying hash; no record may be partial or
duplicated; the ledger must open cleanly after every kill. With every other kind of versioned write beside the
appends, a replica that kept its snapshot across the kills (updated from the change log only) must hold what a
whole read of the ledger holds. (RELIABILITY.md reports the figures.)
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from palimpsest.platform import Runtime
from palimpsest.platform.ledger import Ledger
from tests.helpers import same_snapshot
from tests.reliability.appender import record

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
KILLS = int(os.environ.get("PALIMPSEST_CRASH_KILLS", "200"))
MIN_APPENDS = int(os.environ.get("PALIMPSEST_CRASH_APPENDS", "10000"))
PG_SHARE = 2  # the PostgreSQL run does half the kills and appends (each appender opens a connection pool)


def run_and_kill(db: Path | str, session: str, rng: random.Random, min_acks: int,
                 mode: str = "append") -> list[tuple[int, str]]:
    """Start the appender, wait for ``min_acks`` acknowledgements plus a random delay, SIGKILL it mid-write."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "tests.reliability.appender", str(db), session, mode],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1)
    acks: list[tuple[int, str]] = []
    try:
        while len(acks) < min_acks:
            line = proc.stdout.readline()
            if not line:
                raise AssertionError(f"the appender exited early: {proc.stderr.read()[-2000:]}")
            t, digest = line.split()
            acks.append((int(t), digest))
        time.sleep(rng.uniform(0.0, 0.02))  # land somewhere inside the next appends
        os.kill(proc.pid, signal.SIGKILL)
        rest, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    for line in rest.splitlines():  # acknowledgements written before the kill but not read yet
        if line.strip():
            t, digest = line.split()
            acks.append((int(t), digest))
    return acks


def test_acknowledged_appends_survive_sigkill(ledger_url):
    """On both backends: SQLite (the process holding the file dies) and PostgreSQL (the client dies mid-
    transaction and the server rolls its transaction back)."""
    rng = random.Random(1234)
    db = ledger_url
    pg = ledger_url.startswith("postgresql://")
    kills_wanted, appends_wanted = (KILLS // PG_SHARE, MIN_APPENDS // PG_SHARE) if pg else (KILLS, MIN_APPENDS)
    session = "crash-1"
    acked: dict[int, str] = {}
    per_run = max(1, appends_wanted // kills_wanted)
    kills = 0
    while kills < kills_wanted or len(acked) < appends_wanted:
        for t, digest in run_and_kill(db, session, rng, rng.randint(1, 2 * per_run)):
            assert acked.setdefault(t, digest) == digest  # an acknowledged step never changes
        kills += 1
        with Ledger(db) as led:  # opens cleanly after every kill (WAL recovery)
            n = led.count(session)
            # Every acknowledged step is there; at most the one in flight was committed but not acknowledged.
            assert max(acked) < n <= max(acked) + 2
    with Ledger(db) as led:
        n = led.count(session)
        assert led.verify(session) == n  # every stored hash matches its content: nothing partial
        steps = led.snapshot(session).steps
        assert [s.t for s in steps] == list(range(n))  # no gap, no duplicate
        for t, digest in acked.items():
            assert steps[t].sha256 == digest == record(t).sha256()
        if not pg:
            assert led._read_one("PRAGMA integrity_check")[0] == "ok"
    assert kills >= kills_wanted and len(acked) >= appends_wanted
    print(f"crash consistency ({'postgresql' if pg else 'sqlite'}): {kills} SIGKILLs, "
          f"{len(acked)} acknowledged appends, {n} stored, all verified")


def test_a_replicas_snapshot_equals_a_whole_read_after_every_sigkill(ledger_url):
    """The versioned writes (appends, summaries, keys, folds, audited turns and their boundaries) each bump the
    session's version and log what changed in the same transaction. A replica's cached snapshot follows the
    log (``Ledger.delta``): after a writer dies mid-transaction, the log must hold exactly what committed."""
    rng = random.Random(4321)
    pg = ledger_url.startswith("postgresql://")
    kills_wanted = max(1, KILLS // (4 * (PG_SHARE if pg else 1)))
    session = "crash-mixed"
    replica = Runtime(Ledger(ledger_url, tokenizer="approx"))  # open across every kill, as a serving replica is
    acked: dict[int, str] = {}
    versions = []
    for _ in range(kills_wanted):
        for t, digest in run_and_kill(ledger_url, session, rng, rng.randint(1, 6), mode="mixed"):
            assert acked.setdefault(t, digest) == digest
        with Ledger(ledger_url, tokenizer="approx") as whole:
            Runtime(whole)  # prices the session's prefix as the replica does
            cached = replica.snapshot(session)
            same_snapshot(cached, whole.snapshot(session, key_model=replica.embedder.name))
            assert cached.t > max(acked) and whole.verify(session) == cached.t
            versions.append(whole.version(session))
    stats = replica.snapshots.stats
    assert stats["full_reads"] == 1 and stats["refreshes"] >= kills_wanted - 1  # the log did the work, not rereads
    assert versions == sorted(versions) and versions[-1] > 2 * len(acked)  # summaries, keys, folds, plans logged too
    with Ledger(ledger_url, tokenizer="approx") as led:
        snap = led.snapshot(session, key_model=replica.embedder.name)
        assert snap.has_key[: max(acked)].all() and len(snap.folds) >= 1
    print(f"crash consistency with a replica ({'postgresql' if pg else 'sqlite'}): {kills_wanted} SIGKILLs, "
          f"{len(acked)} acknowledged appends, version {versions[-1]}, {stats['refreshes']} refreshes from the log, "
          f"the replica's snapshot equal to a whole read after every kill")
