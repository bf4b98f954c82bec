"""Crash consistency of the ledger: a child appends steps and is SIGKILLed at random moments, again and again.

Every append acknowledged before a kill must be present with a verifying hash; no record may be partial or
duplicated; the ledger must open cleanly after every kill. (RELIABILITY.md reports the figures.)
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

from palimpsest.platform.ledger import Ledger
from tests.reliability.appender import record

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
KILLS = int(os.environ.get("PALIMPSEST_CRASH_KILLS", "200"))
MIN_APPENDS = int(os.environ.get("PALIMPSEST_CRASH_APPENDS", "10000"))
PG_SHARE = 2  # the PostgreSQL run does half the kills and appends (each appender opens a connection pool)


def run_and_kill(db: Path | str, session: str, rng: random.Random, min_acks: int) -> list[tuple[int, str]]:
    """Start the appender, wait for ``min_acks`` acknowledgements plus a random delay, SIGKILL it mid-write."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "tests.reliability.appender", str(db), session], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1)
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
    print(f"crash consistency ({'postgresql' if pg else 'sqlite'}): {kills} SIGKILLs, {len(acked)} acknowledged appends, {n} stored, all verified")
