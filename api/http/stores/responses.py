"""Stored responses of the Responses API (``store: true``, the default): the response as
it was answered, and its conversation as chat messages (input and output, without the
instructions), which a request naming it as ``previous_response_id`` continues. Rows in an
:class:`~api.http.stores.index_db.IndexDB` (SQLite by default, PostgreSQL shared by replicas), so
a response made on one replica continues on another and after a restart."""

from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path
from typing import Any

from api.http.stores.index_db import IndexDB, SqliteIndex
from api.http.stores.sql_dialect import tenant_clause

_ID = re.compile(r"^resp_[0-9a-f]{32}$")


class ResponseStore:
    def __init__(self, path: Path, *, index: IndexDB | None = None):
        self._lock = threading.Lock()
        self._db: IndexDB = index if index is not None else SqliteIndex(path)
        self._db.create(
            "CREATE TABLE IF NOT EXISTS responses (id TEXT PRIMARY KEY, created_at {REAL} NOT NULL, "
            "body TEXT NOT NULL, conversation TEXT NOT NULL)"
        )
        self._db.add_column("responses", "tenant", "TEXT NOT NULL DEFAULT ''")

    def __repr__(self) -> str:
        return "ResponseStore()"

    def close(self) -> None:
        self._db.close()

    def put(
        self, response_id: str, body: dict[str, Any], conversation: list[dict[str, Any]], *, tenant: str = ""
    ) -> None:
        with self._lock:
            self._db.execute(
                "INSERT INTO responses (id, created_at, body, conversation, tenant) VALUES (?, ?, ?, ?, ?)",
                (response_id, time.time(), json.dumps(body), json.dumps(conversation), tenant),
            )

    def get(
        self, response_id: str, *, scope: str | None = None
    ) -> tuple[dict[str, Any], list[dict[str, Any]]] | None:
        """(the response, its conversation), or None (also when ``scope``, a tenant, may not
        see it)."""
        if not _ID.match(response_id):
            return None
        mine, param = tenant_clause(scope)
        with self._lock:
            row = self._db.execute(
                f"SELECT body, conversation FROM responses WHERE id = ?{mine}", (response_id, *param)
            ).fetchone()
        return (json.loads(row[0]), json.loads(row[1])) if row else None

    def delete(self, response_id: str, *, scope: str | None = None) -> bool:
        if not _ID.match(response_id):
            return False
        mine, param = tenant_clause(scope)
        with self._lock:
            return (
                self._db.execute(f"DELETE FROM responses WHERE id = ?{mine}", (response_id, *param)).rowcount
                == 1
            )
