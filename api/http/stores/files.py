"""Files of the OpenAI Files API (batch inputs and outputs): content under the state dir,
an index in an :class:`~api.http.stores.index_db.IndexDB` (SQLite by default, PostgreSQL shared by
replicas), surviving restarts like uploads and jobs."""

from __future__ import annotations

import os
import re
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from api.http.stores.index_db import IndexDB, SqliteIndex
from api.http.stores.sql_dialect import tenant_clause

_ID = re.compile(r"^file-[0-9a-f]{32}$")
_COLUMNS = "id, filename, purpose, bytes, created_at, tenant"


@dataclass(frozen=True)
class FileRecord:
    id: str
    filename: str
    purpose: str
    bytes: int
    created_at: float
    tenant: str = ""
    """Who made it (``api.http.security.tenancy``): only that tenant and admins see it."""


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
        self._db.add_column("files", "tenant", "TEXT NOT NULL DEFAULT ''")

    def close(self) -> None:
        self._db.close()

    def __repr__(self) -> str:
        return f"FileStore({str(self.root)!r})"

    def path(self, file_id: str) -> Path | None:
        return self.dir / file_id if _ID.match(file_id) else None

    def add(self, source: Path | bytes, *, filename: str, purpose: str, tenant: str = "") -> FileRecord:
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
        record = FileRecord(file_id, filename, purpose, target.stat().st_size, time.time(), tenant)
        with self._lock:
            self._db.execute(
                f"INSERT INTO files ({_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?)",
                (record.id, record.filename, record.purpose, record.bytes, record.created_at, tenant),
            )
        return record

    def get(self, file_id: str, *, scope: str | None = None) -> FileRecord | None:
        """The file, if it exists and ``scope`` (a tenant; None: any) may see it."""
        if not _ID.match(file_id):
            return None
        with self._lock:
            mine, param = tenant_clause(scope)
            row = self._db.execute(
                f"SELECT {_COLUMNS} FROM files WHERE id = ?{mine}", (file_id, *param)
            ).fetchone()
        return FileRecord(*row) if row else None

    def list(
        self,
        limit: int = 100,
        *,
        scope: str | None = None,
        after: str | None = None,
        order: str = "desc",
        purpose: str | None = None,
    ) -> tuple[list[FileRecord], bool]:
        """(up to ``limit`` files by creation time, whether more follow): OpenAI's cursor
        listing, ``after`` the id of the last file of the previous page (one ``scope`` may
        not see is as unknown as none: an empty page)."""
        direction, cmp = ("DESC", "<") if order == "desc" else ("ASC", ">")
        mine, param = tenant_clause(scope)
        where, params = f"1 = 1{mine}", list(param)
        if purpose is not None:
            where += " AND purpose = ?"
            params.append(purpose)
        if after is not None:
            cursor = self.get(after, scope=scope)
            if cursor is None:
                return [], False
            where += f" AND (created_at {cmp} ? OR (created_at = ? AND id {cmp} ?))"
            params += [cursor.created_at, cursor.created_at, cursor.id]
        with self._lock:
            rows = self._db.execute(
                f"SELECT {_COLUMNS} FROM files WHERE {where} ORDER BY created_at {direction}, id {direction} LIMIT ?",
                (*params, limit + 1),
            ).fetchall()
        return [FileRecord(*r) for r in rows[:limit]], len(rows) > limit

    def stored_bytes(self, tenant: str) -> int:
        """What ``tenant``'s files hold (its stored-bytes limit counts them)."""
        with self._lock:
            row = self._db.execute(
                "SELECT COALESCE(SUM(bytes), 0) FROM files WHERE tenant = ?", (tenant,)
            ).fetchone()
        return int(row[0])

    def delete(self, file_id: str, *, scope: str | None = None) -> bool:
        if not _ID.match(file_id):
            return False
        with self._lock:
            mine, param = tenant_clause(scope)
            gone = self._db.execute(f"DELETE FROM files WHERE id = ?{mine}", (file_id, *param)).rowcount == 1
        if gone:
            (self.dir / file_id).unlink(missing_ok=True)
        return gone
