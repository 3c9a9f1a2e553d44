"""Caption jobs that survive a crash: SQLite (WAL, synchronous=FULL) under the state dir.

A job is a row; each of its items is a row keyed by (job, index) holding the media id and,
once done, its result record. A result is committed the moment it exists, in the same
transaction that marks the item done, so a server killed with SIGKILL and started again
finds exactly which items are left: none is lost, none is run twice into the results
(a record is written only by the transaction that flips its item from pending).
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FINAL = ("completed", "cancelled", "failed")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    id TEXT PRIMARY KEY,
    kind TEXT NOT NULL,
    meta TEXT NOT NULL,
    status TEXT NOT NULL,
    model TEXT NOT NULL,
    prompt TEXT NOT NULL,
    max_tokens INTEGER NOT NULL,
    concurrency INTEGER NOT NULL,
    total INTEGER NOT NULL,
    created_at REAL NOT NULL,
    started_at REAL,
    finished_at REAL,
    error TEXT
);
CREATE TABLE IF NOT EXISTS job_items (
    job_id TEXT NOT NULL,
    idx INTEGER NOT NULL,
    name TEXT NOT NULL,
    media_id TEXT,
    payload TEXT,
    status TEXT NOT NULL DEFAULT 'pending',
    result TEXT,
    finished_at REAL,
    seq INTEGER,
    PRIMARY KEY (job_id, idx)
);
"""


@dataclass
class JobRecord:
    id: str
    kind: str
    """"captions" or "batch" (an OpenAI Batch API batch of chat requests)."""
    meta: dict[str, Any]
    status: str
    model: str
    prompt: str
    max_tokens: int
    concurrency: int
    total: int
    created_at: float
    started_at: float | None
    finished_at: float | None
    error: str | None
    done: int = 0
    failed: int = 0

    @property
    def finished(self) -> bool:
        return self.status in FINAL


class JobStore:
    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._lock = threading.Lock()
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.executescript(_SCHEMA)

    def __repr__(self) -> str:
        return f"JobStore({str(self.path)!r})"

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def create(
        self,
        *,
        model: str,
        prompt: str,
        max_tokens: int,
        concurrency: int,
        items: list[tuple[str, str | None, dict[str, Any] | None, str | None]],
        kind: str = "captions",
        meta: dict[str, Any] | None = None,
        prefix: str = "job-",
    ) -> JobRecord:
        """A queued job over ``items`` = (name, media id, error record, payload), each optional
        but the name: an item that already failed at submission (an undecodable upload, a
        malformed batch line) is stored finished with its error record."""
        job_id = prefix + uuid.uuid4().hex
        now = time.time()
        rows = [
            (
                job_id,
                i,
                name,
                media_id,
                payload,
                "failed" if err else "pending",
                json.dumps(err) if err else None,
                now if err else None,
                i + 1 if err else None,
            )
            for i, (name, media_id, err, payload) in enumerate(items)
        ]
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                self._db.execute(
                    "INSERT INTO jobs (id, kind, meta, status, model, prompt, max_tokens, concurrency, total, "
                    "created_at) VALUES (?, ?, ?, 'queued', ?, ?, ?, ?, ?, ?)",
                    (
                        job_id,
                        kind,
                        json.dumps(meta or {}),
                        model,
                        prompt,
                        max_tokens,
                        concurrency,
                        len(items),
                        now,
                    ),
                )
                self._db.executemany(
                    "INSERT INTO job_items (job_id, idx, name, media_id, payload, status, result, finished_at, seq) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    rows,
                )
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        job = self.get(job_id)
        assert job is not None
        return job

    def get(self, job_id: str) -> JobRecord | None:
        with self._lock:
            row = self._db.execute("SELECT * FROM jobs WHERE id = ?", (job_id,)).fetchone()
            if row is None:
                return None
            counts = dict(
                self._db.execute(
                    "SELECT status, COUNT(*) FROM job_items WHERE job_id = ? GROUP BY status", (job_id,)
                ).fetchall()
            )
        job_id, kind, meta, *rest = row
        return JobRecord(
            job_id, kind, json.loads(meta), *rest, done=counts.get("done", 0), failed=counts.get("failed", 0)
        )

    def list(self, limit: int = 100, kind: str = "captions") -> list[JobRecord]:
        with self._lock:
            ids = [
                r[0]
                for r in self._db.execute(
                    "SELECT id FROM jobs WHERE kind = ? ORDER BY created_at DESC LIMIT ?", (kind, limit)
                ).fetchall()
            ]
        return [j for j in map(self.get, ids) if j is not None]

    def unfinished(self) -> list[JobRecord]:
        with self._lock:
            ids = [
                r[0]
                for r in self._db.execute(
                    "SELECT id FROM jobs WHERE status IN ('queued', 'running') ORDER BY created_at"
                ).fetchall()
            ]
        return [j for j in map(self.get, ids) if j is not None]

    def pending_items(self, job_id: str) -> list[tuple[int, str, str | None, str | None]]:
        """(index, name, media id, payload) of the items still to run."""
        with self._lock:
            return self._db.execute(
                "SELECT idx, name, media_id, payload FROM job_items WHERE job_id = ? AND status = 'pending' "
                "ORDER BY idx",
                (job_id,),
            ).fetchall()

    def finish_item(self, job_id: str, idx: int, result: dict[str, Any], *, failed: bool) -> bool:
        """Store an item's record; False (and nothing written) when it was already finished."""
        status = "failed" if failed else "done"
        with self._lock:
            cur = self._db.execute(
                "UPDATE job_items SET status = ?, result = ?, finished_at = ?, seq = (SELECT COALESCE(MAX(seq), 0) "
                "+ 1 FROM job_items WHERE job_id = ?) WHERE job_id = ? AND idx = ? AND status = 'pending'",
                (status, json.dumps(result, ensure_ascii=False), time.time(), job_id, job_id, idx),
            )
            return cur.rowcount == 1

    def set_status(self, job_id: str, status: str, *, error: str | None = None) -> None:
        now = time.time()
        with self._lock:
            if status == "running":
                self._db.execute(
                    "UPDATE jobs SET status = 'running', started_at = COALESCE(started_at, ?) "
                    "WHERE id = ? AND status IN ('queued', 'running')",
                    (now, job_id),
                )
            else:
                self._db.execute(
                    "UPDATE jobs SET status = ?, finished_at = ?, error = ? WHERE id = ? AND status NOT IN "
                    "('completed', 'cancelled', 'failed')",
                    (status, now, error, job_id),
                )

    def update_meta(self, job_id: str, **changes: Any) -> None:
        with self._lock:
            row = self._db.execute("SELECT meta FROM jobs WHERE id = ?", (job_id,)).fetchone()
            if row is not None:
                meta = {**json.loads(row[0]), **changes}
                self._db.execute("UPDATE jobs SET meta = ? WHERE id = ?", (json.dumps(meta), job_id))

    def results(self, job_id: str, after: int = 0) -> Iterator[tuple[int, dict[str, Any]]]:
        """Finished items' records in the order they finished: (sequence number, record) for
        sequence numbers past ``after`` (so a reader can follow a running job)."""
        with self._lock:
            rows = self._db.execute(
                "SELECT seq, result FROM job_items WHERE job_id = ? AND seq > ? ORDER BY seq", (job_id, after)
            ).fetchall()
        for seq, result in rows:
            yield seq, json.loads(result)
