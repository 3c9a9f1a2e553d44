"""Files of the OpenAI Files API (batch inputs and outputs): content under the state dir,
an index in SQLite (WAL), surviving restarts like uploads and jobs."""

from __future__ import annotations

import os
import re
import sqlite3
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

_ID = re.compile(r"^file-[0-9a-f]{32}$")


@dataclass(frozen=True)
class FileRecord:
    id: str
    filename: str
    purpose: str
    bytes: int
    created_at: float


class FileStore:
    def __init__(self, root: Path):
        self.root = root
        self.dir = root / "files"
        self.dir.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(root / "files.sqlite3", check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.execute(
            "CREATE TABLE IF NOT EXISTS files (id TEXT PRIMARY KEY, filename TEXT NOT NULL, purpose TEXT NOT NULL, "
            "bytes INTEGER NOT NULL, created_at REAL NOT NULL)"
        )

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
            row = self._db.execute("SELECT * FROM files WHERE id = ?", (file_id,)).fetchone()
        return FileRecord(*row) if row else None

    def list(self, limit: int = 100) -> list[FileRecord]:
        with self._lock:
            rows = self._db.execute(
                "SELECT * FROM files ORDER BY created_at DESC LIMIT ?", (limit,)
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
