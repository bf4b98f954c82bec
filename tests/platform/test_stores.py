"""Backends and scale-out: URLs, migrations, unreachable and lost databases, several writers on one
session, and background enrichment from several replicas at once (each on SQLite and PostgreSQL)."""

from __future__ import annotations

import multiprocessing as mp
import sqlite3
import threading
import time
from collections import Counter

import pytest

from palimpsest.platform import Ledger, LedgerError, LedgerUnavailableError, Runtime
from palimpsest.platform.compile.budget import Budget
from palimpsest.platform.ledger.backends import migrations, redact
from palimpsest.platform.prompt.abstraction import RuleSummarizer
from tests import pg
from tests.helpers import TASK, step


def test_unreachable_database_is_a_clear_error_naming_it_without_the_password():
    url = "postgresql://agent:s3cret@127.0.0.1:1/ledger"  # nothing listens on port 1
    with pytest.raises(LedgerUnavailableError) as err:
        Ledger(url, timeout_s=2)
    msg = str(err.value)
    assert "cannot connect to the ledger database postgresql://agent:***@127.0.0.1:1/ledger" in msg
    assert "s3cret" not in msg and "\n" not in msg


def test_unsupported_urls_are_refused():
    with pytest.raises(LedgerError, match="unsupported ledger URL 'mysql://u:\\*\\*\\*@h/db'"):
        Ledger("mysql://u:pw@h/db")
    assert redact("postgresql://u@h:5/d") == "postgresql://u@h:5/d"
    assert redact("postgresql://h/d?user=u&password=pw&sslmode=require") == \
        "postgresql://h/d?user=u&password=***&sslmode=require"


def test_migrations_are_numbered_and_both_backends_have_the_same_versions():
    sq, pgm = migrations("sqlite"), migrations("postgresql")
    assert [v for v, _, _ in sq] == [v for v, _, _ in pgm] == list(range(1, len(sq) + 1))
    assert [n for _, n, _ in sq] == [n for _, n, _ in pgm]


def test_a_ledger_of_an_older_schema_is_migrated_in_place(tmp_path):
    path = tmp_path / "old.db"
    db = sqlite3.connect(path)
    (_, _, first), *_ = migrations("sqlite")
    db.executescript(first + "\nINSERT INTO meta VALUES ('schema_version', '1');")
    db.close()
    led = Ledger(path)
    assert led._read_one("SELECT value FROM meta WHERE key='schema_version'")[0] == str(len(migrations("sqlite")))
    assert led.claim("x", "me", 5)  # the table of migration 2 exists now


def test_commits_are_durable_on_the_server_whatever_its_default(ledger):
    if ledger.backend == "postgresql":
        assert ledger._read_one("SHOW synchronous_commit")[0] == "on"
    else:
        assert ledger._read_one("PRAGMA synchronous")[0] == 2  # FULL


def test_schema_version_is_the_latest_on_both_backends(ledger):
    assert int(ledger._read_one("SELECT value FROM meta WHERE key='schema_version'")[0]) == len(
        migrations(ledger.backend))


def test_leases_exclude_other_owners_until_released_or_expired(ledger):
    assert ledger.claim("enrich/s", "a", 30)
    assert ledger.claim("enrich/s", "a", 30)  # the holder renews
    assert not ledger.claim("enrich/s", "b", 30)
    ledger.release("enrich/s", "b")  # not b's to release
    assert not ledger.claim("enrich/s", "b", 30)
    ledger.release("enrich/s", "a")
    assert ledger.claim("enrich/s", "b", 0.05)
    time.sleep(0.1)
    assert ledger.claim("enrich/s", "a", 30)  # b's lease lapsed (a crashed holder loses it by itself)


def test_a_lost_connection_mid_append_is_retriable_and_stores_nothing():
    with pg.fresh_schema() as url:
        import psycopg

        led = Ledger(url)
        led.create_session("s", TASK)
        led.append("s", step(0, "ls", "x"))
        real = led.tokenizer.count_batch

        def drop_connection(texts):  # runs inside the append's transaction, after its row lock
            with psycopg.connect(pg.server_url(), autocommit=True) as admin:
                admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                              "WHERE state LIKE 'idle in transaction%'"
                              " AND datname = current_database() AND pid <> pg_backend_pid()")
            return real(texts)

        led.tokenizer.count_batch = drop_connection
        with pytest.raises(LedgerUnavailableError, match="lost the ledger database"):
            led.append_many("s", [step(1, "pwd", "/"), step(2, "cat a", "b")])
        led.tokenizer.count_batch = real
        assert led.count("s") == 1  # nothing half-written
        assert [s.t for s in led.append_many("s", [step(1, "pwd", "/"), step(2, "cat a", "b")])] == [1, 2]
        assert led.verify("s") == 3
        led.close()


def _replica(url: str, parity: int, n: int, errors) -> None:
    """One 'replica': appends the steps of its parity once the other's step before them is stored, and
    runs a turn after each (both replicas plan and audit the same session)."""
    try:
        rt = Runtime(Ledger(url), leases=True)
        for t in range(parity, n, 2):
            deadline = time.monotonic() + 60
            while rt.ledger.count("shared") < t:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"replica {parity} waited for step {t - 1}")
                time.sleep(0.005)
            rt.append("shared", step(t, f"cmd {t}", f"out {t}"), enrich=True)
            rt.turn("shared", "pace", budget=Budget(400))
        rt.ledger.close()
    except Exception as e:  # reported to the parent, which fails the test with it
        errors.put(f"replica {parity}: {type(e).__name__}: {e}")


def test_two_replicas_interleave_one_session_with_no_lost_or_duplicated_step(ledger_url):
    led = Ledger(ledger_url)
    led.create_session("shared", TASK)
    ctx = mp.get_context("spawn")
    errors = ctx.Queue()
    procs = [ctx.Process(target=_replica, args=(ledger_url, parity, 24, errors)) for parity in (0, 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(180)
    assert errors.empty(), errors.get()
    assert [p.exitcode for p in procs] == [0, 0]
    steps = led.snapshot("shared").steps
    assert [s.t for s in steps] == list(range(24))
    assert [s.action for s in steps] == [f"cmd {t}" for t in range(24)]
    assert len({s.id for s in steps}) == 24 and led.verify("shared") == 24
    assert len(led.audit("shared")) == 24  # every turn of both replicas audited
    no_sum, no_key = Runtime(led)._pending("shared")
    assert no_sum == [] and no_key == []


class _CountingSummarizer(RuleSummarizer):
    """The rule writer, slowed down so that replicas overlap, counting what it is asked to summarise."""

    def __init__(self, calls: Counter, lock: threading.Lock):
        self.calls, self.lock = calls, lock

    def summarize(self, record):
        with self.lock:
            self.calls[record.t] += 1
        time.sleep(0.01)
        return super().summarize(record)


def test_enrichment_from_several_replicas_does_no_double_work_and_loses_nothing(ledger_url):
    calls, lock = Counter(), threading.Lock()
    runtimes = [Runtime(Ledger(ledger_url), summarizer=_CountingSummarizer(calls, lock), leases=True)
                for _ in range(3)]
    writer = runtimes[0].ledger
    writer.create_session("s", TASK)
    stop = threading.Event()

    def enrich_forever(rt):
        while not stop.is_set():
            rt.enrich("s")

    threads = [threading.Thread(target=enrich_forever, args=(rt,)) for rt in runtimes]
    for th in threads:
        th.start()
    for t in range(30):  # appends land while the replicas enrich
        writer.append("s", step(t, f"cmd {t}", f"out {t}"))
    time.sleep(0.3)
    stop.set()
    for th in threads:
        th.join(30)
    for rt in runtimes:  # a last pass, as the replica that took the final append would run
        rt.enrich("s")
    no_sum, no_key = runtimes[0]._pending("s")
    assert no_sum == [] and no_key == []  # nothing lost
    assert sorted(calls) == list(range(30)) and set(calls.values()) == {1}  # each step summarised once
