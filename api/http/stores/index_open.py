"""Which index a store opens: above both backends, so neither imports the other."""

from __future__ import annotations

from pathlib import Path

from api.http.stores.index_db import IndexDB, SqliteIndex


def open_index(state_db: str | None, sqlite_path: Path, *, shared: bool = False) -> IndexDB:
    """The index a store uses: PostgreSQL when ``state_db`` names one, else SQLite at
    ``sqlite_path`` (``shared``: by several processes of this machine)."""
    if state_db:
        from api.http.stores.index_postgres import PostgresIndex  # psycopg only when asked for

        return PostgresIndex(state_db)
    return SqliteIndex(sqlite_path, shared=shared)
