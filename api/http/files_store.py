"""Files of the OpenAI Files API (batch inputs and outputs): content under the state dir,
an index in an :class:`~api.http.index_db.IndexDB` (SQLite by default, PostgreSQL shared by
replicas), surviving restarts like uploads and jobs."""

from __future__ import annotations

import os
import re
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from api.http.index_db import IndexDB, SqliteIndex

_ID = re.compile(r"^file-[0-9a-f]{32}$")
_COLUMNS = "id, filename, purpose, bytes, created_at"


@dataclass(frozen=True)
class FileRecord:
    id: str
    filename: str
    purpose: str
    bytes: int
    created_at: float


class FileStore:
    """``index``: where the rows live (default: SQLite at ``root/files.sqlite3``)."""

    def __init__(self, root: Path, *, index: IndexDB | None = None):
        self.root = root
        self.dir = root / "files"
        self.dir.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._db: IndexDB = index if index is not None else SqliteIndex(root / "files.sqlite3")
        self._db.create(
            "CREATE TABLE IF NOT EXISTS files (id TEXT PRIMARY KEY, filename TEXT NOT NULL, purpose TEXT NOT NULL, "
            "bytes INTEGER NOT NULL, created_at {REAL} NOT NULL)"
        )

    def close(self) -> None:
        self._db.close()

    def __repr__(self) -> str:
        return f"FileStore({str(self.root)!r})"

    def path(self, file_id: str) -> Path | None:
        return self.dir / file_id if _ID.match(file_id) else None

    def add(self, source: Path | bytes, *, filename: str, purpose: str) -> FileRecord:
        """Store ``source`` (a spool file, moved in, or bytes); the file first, then its row."""
        file_id = "file-" + uuid.uuid4().hex
        target = self.dir / file_id
        if isinstance(source, bytes):
            tmp = self.dir / f".{file_id}.part"
            with tmp.open("wb") as f:
                f.write(source)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, target)
        else:
            os.replace(source, target)
        record = FileRecord(file_id, filename, purpose, target.stat().st_size, time.time())
        with self._lock:
            self._db.execute(
                "INSERT INTO files VALUES (?, ?, ?, ?, ?)",
                (record.id, record.filename, record.purpose, record.bytes, record.created_at),
            )
        return record

    def get(self, file_id: str) -> FileRecord | None:
        if not _ID.match(file_id):
            return None
        with self._lock:
            row = self._db.execute(f"SELECT {_COLUMNS} FROM files WHERE id = ?", (file_id,)).fetchone()
        return FileRecord(*row) if row else None

    def list(self, limit: int = 100) -> list[FileRecord]:
        with self._lock:
            rows = self._db.execute(
                f"SELECT {_COLUMNS} FROM files ORDER BY created_at DESC LIMIT ?", (limit,)
            ).fetchall()
        return [FileRecord(*r) for r in rows]

    def delete(self, file_id: str) -> bool:
        if not _ID.match(file_id):
            return False
        with self._lock:
            gone = self._db.execute("DELETE FROM files WHERE id = ?", (file_id,)).rowcount == 1
        if gone:
            (self.dir / file_id).unlink(missing_ok=True)
        return gone
