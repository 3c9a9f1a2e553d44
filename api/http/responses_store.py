"""Stored responses of the Responses API (``store: true``, the default): the response as
it was answered, and its conversation as chat messages (input and output, without the
instructions), which a request naming it as ``previous_response_id`` continues. Rows in an
:class:`~api.http.index_db.IndexDB` (SQLite by default, PostgreSQL shared by replicas), so
a response made on one replica continues on another and after a restart."""

from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path
from typing import Any

from api.http.index_db import IndexDB, SqliteIndex

_ID = re.compile(r"^resp_[0-9a-f]{32}$")


class ResponseStore:
    def __init__(self, path: Path, *, index: IndexDB | None = None):
        self._lock = threading.Lock()
        self._db: IndexDB = index if index is not None else SqliteIndex(path)
        self._db.create(
            "CREATE TABLE IF NOT EXISTS responses (id TEXT PRIMARY KEY, created_at {REAL} NOT NULL, "
            "body TEXT NOT NULL, conversation TEXT NOT NULL)"
        )

    def __repr__(self) -> str:
        return "ResponseStore()"

    def close(self) -> None:
        self._db.close()

    def put(self, response_id: str, body: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        with self._lock:
            self._db.execute(
                "INSERT INTO responses VALUES (?, ?, ?, ?)",
                (response_id, time.time(), json.dumps(body), json.dumps(conversation)),
            )

    def get(self, response_id: str) -> tuple[dict[str, Any], list[dict[str, Any]]] | None:
        """(the response, its conversation), or None."""
        if not _ID.match(response_id):
            return None
        with self._lock:
            row = self._db.execute(
                "SELECT body, conversation FROM responses WHERE id = ?", (response_id,)
            ).fetchone()
        return (json.loads(row[0]), json.loads(row[1])) if row else None

    def delete(self, response_id: str) -> bool:
        if not _ID.match(response_id):
            return False
        with self._lock:
            return self._db.execute("DELETE FROM responses WHERE id = ?", (response_id,)).rowcount == 1
