"""Shared fixtures: small hand-built sessions over a fresh ledger per test."""

from __future__ import annotations

import pytest

from palimpsest.platform import Ledger, Runtime
from tests.helpers import STEPS, TASK, step


@pytest.fixture
def ledger(tmp_path):
    led = Ledger(tmp_path / "ledger.db")
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
