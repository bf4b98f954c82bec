"""The PostgreSQL tier: a server URL from $PALIMPSEST_TEST_POSTGRES (``scripts/postgres.sh run``
sets it for ``make test``) and one fresh schema per test, so tests never see each other's rows."""

from __future__ import annotations

import os
import uuid
from contextlib import contextmanager
from typing import Iterator

import pytest

ENV = "PALIMPSEST_TEST_POSTGRES"


def server_url() -> str:
    """The test server's URL; skips the test where none runs (fails instead under
    PALIMPSEST_REQUIRE_POSTGRES=1, which CI sets: there the tier must run)."""
    url = os.environ.get(ENV)
    if not url:
        if os.environ.get("PALIMPSEST_REQUIRE_POSTGRES") == "1":
            pytest.fail(f"${ENV} is not set but PALIMPSEST_REQUIRE_POSTGRES=1")
        pytest.skip(f"no PostgreSQL server (${ENV} unset; `make test` starts one with scripts/postgres.sh)")
    return url


@contextmanager
def fresh_schema() -> Iterator[str]:
    """A ledger URL whose connections use a new, empty schema; the schema is dropped afterwards."""
    import psycopg

    base = server_url()
    name = "t_" + uuid.uuid4().hex[:12]
    with psycopg.connect(base, autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {name}")
    sep = "&" if "?" in base else "?"
    try:
        yield f"{base}{sep}options=-csearch_path%3D{name}"
    finally:
        with psycopg.connect(base, autocommit=True) as conn:
            conn.execute(f"DROP SCHEMA {name} CASCADE")
