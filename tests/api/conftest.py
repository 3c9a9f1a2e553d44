"""A PostgreSQL server for the tests of the shared index (uploads, files, jobs, batches)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.api.postgres_server import HOW_TO_GET_ONE, NoPostgres, PostgresServer, start_postgres


@pytest.fixture(scope="session")
def postgres() -> Iterator[PostgresServer]:
    """One server for the session (about 3 s to start); skips with how to get one."""
    try:
        server = start_postgres()
    except NoPostgres as e:
        pytest.skip(f"{HOW_TO_GET_ONE} ({e})")
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(params=["sqlite", "postgresql"])
def state_db(request: pytest.FixtureRequest) -> str | None:
    """Each store test on both indexes: None (SQLite, the default) or a PostgreSQL URL
    naming a fresh schema."""
    if request.param == "sqlite":
        return None
    return request.getfixturevalue("postgres").fresh_schema_url()
