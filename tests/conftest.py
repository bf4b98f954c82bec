"""Shared fixtures: small hand-built sessions over a fresh ledger per test.

``ledger_url`` (and so ``ledger``, ``runtime`` and ``session``) is parametrized over both backends:
every test that uses them runs on SQLite and on PostgreSQL (see tests/pg.py).
"""

from __future__ import annotations

import pytest

from palimpsest.platform import Ledger, Runtime
from tests import pg
from tests.helpers import STEPS, TASK, step


@pytest.fixture(params=["sqlite", "postgresql"])
def ledger_url(request, tmp_path):
    """A URL of a new, empty ledger on each backend."""
    if request.param == "sqlite":
        yield str(tmp_path / "ledger.db")
    else:
        with pg.fresh_schema() as url:
            yield url


@pytest.fixture
def ledger(ledger_url):
    led = Ledger(ledger_url)
    yield led
    led.close()


@pytest.fixture
def runtime(ledger):
    return Runtime(ledger)


@pytest.fixture
def session(runtime):
    """The hand-built session above, imported and enriched; returns its id."""
    runtime.ledger.create_session("s1", TASK, system="You are a careful coding agent.")
    for t, (action, obs) in enumerate(STEPS):
        runtime.append("s1", step(t, action, obs))
    return "s1"
