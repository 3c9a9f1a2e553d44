"""Caption jobs and batches that survive a crash, in an :class:`~api.http.stores.index_db.IndexDB`
(SQLite under the state dir by default; PostgreSQL shared by replicas).

A job is a row; each of its items is a row keyed by (job, index) holding the media id and,
once done, its result record. A result is committed the moment it exists, in the same
transaction that marks the item done, so a server killed with SIGKILL and started again
finds exactly which items are left: none is lost, none is run twice into the results
(a record is written only by the transaction that flips its item from pending).

Replicas share the items by **claims**: a runner takes pending items with
:meth:`JobStore.claim_items` (``FOR UPDATE SKIP LOCKED`` on PostgreSQL: two replicas never
take the same row), stamping its owner id and the time; it renews the stamp while it works
(:meth:`JobStore.renew`). A claim older than the lease is free again, so the items of a
replica that died are taken by the others once its lease runs out. Finishing still needs
the item to be pending, so a slow replica whose lease was taken over cannot add a second
result: whichever finishes first writes the one record.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from api.http.stores.index_db import IndexDB, SqliteIndex
from api.http.stores.sql_dialect import tenant_clause

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
    created_at {REAL} NOT NULL,
    started_at {REAL},
    finished_at {REAL},
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
    finished_at {REAL},
    seq INTEGER,
    PRIMARY KEY (job_id, idx)
);
"""
_JOB_COLUMNS = (
    "id, kind, meta, status, model, prompt, max_tokens, concurrency, total, created_at, started_at, "
    "finished_at, error, tenant"
)
_LIVE = "('queued', 'running')"


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
    tenant: str = ""
    """Who made it (``api.http.security.tenancy``): only that tenant and admins see it."""
    done: int = 0
    failed: int = 0

    @property
    def finished(self) -> bool:
        return self.status in FINAL


class JobStore:
    """Jobs and their items. ``index``: where they live (default: SQLite at ``path``); the
    store closes it. On the embedded index the claims a previous process left are dropped
    at open (it was the only runner); on a shared one they wait for their lease to end."""

    def __init__(self, path: Path, *, index: IndexDB | None = None):
        self.path = path
        self._lock = threading.Lock()
        self._db: IndexDB = index if index is not None else SqliteIndex(path)
        self._db.create(_SCHEMA)
        for table, column, decl in (
            ("job_items", "claimed_by", "TEXT"),
            ("job_items", "claimed_at", "DOUBLE PRECISION"),
            ("jobs", "final_by", "TEXT"),
            ("jobs", "final_at", "DOUBLE PRECISION"),
            ("jobs", "tenant", "TEXT NOT NULL DEFAULT ''"),
        ):  # (columns a store made by an older version lacks)
            self._db.add_column(table, column, decl)
        if not self._db.shared:
            self._db.execute("UPDATE job_items SET claimed_by = NULL WHERE claimed_by IS NOT NULL")
            self._db.execute("UPDATE jobs SET final_by = NULL WHERE final_by IS NOT NULL")

    @property
    def shared(self) -> bool:
        """Whether other replicas run the same jobs (a shared index)."""
        return self._db.shared

    def __repr__(self) -> str:
        return f"JobStore({self._db!r})"

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
        tenant: str = "",
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
        with self._lock, self._db.transaction():
            self._db.execute(
                "INSERT INTO jobs (id, kind, meta, status, model, prompt, max_tokens, concurrency, total, "
                "created_at, tenant) VALUES (?, ?, ?, 'queued', ?, ?, ?, ?, ?, ?, ?)",
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
                    tenant,
                ),
            )
            self._db.executemany(
                "INSERT INTO job_items (job_id, idx, name, media_id, payload, status, result, finished_at, seq) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                rows,
            )
        job = self.get(job_id)
        assert job is not None
        return job

    def get(self, job_id: str, *, scope: str | None = None) -> JobRecord | None:
        """The job, or None (also when ``scope``, a tenant, may not see it)."""
        mine, param = tenant_clause(scope)
        with self._lock:
            row = self._db.execute(
                f"SELECT {_JOB_COLUMNS} FROM jobs WHERE id = ?{mine}", (job_id, *param)
            ).fetchone()
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

    def list(self, limit: int = 100, kind: str = "captions", *, scope: str | None = None) -> list[JobRecord]:
        mine, param = tenant_clause(scope)
        with self._lock:
            ids = [
                r[0]
                for r in self._db.execute(
                    f"SELECT id FROM jobs WHERE kind = ?{mine} ORDER BY created_at DESC LIMIT ?",
                    (kind, *param, limit),
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

    def claim_items(
        self, job_id: str, owner: str, limit: int, lease_s: float
    ) -> list[tuple[int, str, str | None, str | None]]:
        """Take up to ``limit`` pending items of a live job that nobody holds (or whose
        holder's lease ran out): (index, name, media id, payload), lowest index first."""
        now = time.time()
        with self._lock, self._db.transaction():
            rows = self._db.execute(
                # The chosen rows are fixed once (MATERIALIZED): PostgreSQL may otherwise
                # re-run a LIMIT subquery under IN and take more than ``limit``.
                "WITH chosen AS MATERIALIZED (SELECT idx FROM job_items WHERE job_id = ? AND status = "
                "'pending' AND (claimed_by IS NULL OR claimed_at < ?) AND EXISTS (SELECT 1 FROM jobs WHERE "
                f"id = ? AND status IN {_LIVE}) ORDER BY idx LIMIT ?{self._db.skip_locked}) "
                "UPDATE job_items SET claimed_by = ?, claimed_at = ? WHERE job_id = ? AND idx IN "
                "(SELECT idx FROM chosen) RETURNING idx, name, media_id, payload",
                (job_id, now - lease_s, job_id, int(limit), owner, now, job_id),
            ).fetchall()
        return sorted(tuple(r) for r in rows)  # type: ignore[misc]

    def renew(self, owner: str) -> int:
        """Stamp every pending item ``owner`` holds with the time now (its heartbeat)."""
        with self._lock:
            return self._db.execute(
                "UPDATE job_items SET claimed_at = ? WHERE claimed_by = ? AND status = 'pending'",
                (time.time(), owner),
            ).rowcount

    def release(self, owner: str) -> int:
        """Give back what ``owner`` holds (a clean shutdown: others take it at once)."""
        with self._lock:
            n = self._db.execute(
                "UPDATE job_items SET claimed_by = NULL WHERE claimed_by = ? AND status = 'pending'", (owner,)
            ).rowcount
            self._db.execute(
                f"UPDATE jobs SET final_by = NULL WHERE final_by = ? AND status IN {_LIVE}", (owner,)
            )
        return n

    def pending_count(self, job_id: str) -> int:
        with self._lock:
            row = self._db.execute(
                "SELECT COUNT(*) FROM job_items WHERE job_id = ? AND status = 'pending'", (job_id,)
            ).fetchone()
        return int(row[0])

    def claim_finalize(self, job_id: str, owner: str, lease_s: float) -> bool:
        """Whether ``owner`` is the one to finish the job (write a batch's output files,
        mark it completed): every item is finished and nobody else holds this claim."""
        now = time.time()
        with self._lock:
            cur = self._db.execute(
                f"UPDATE jobs SET final_by = ?, final_at = ? WHERE id = ? AND status IN {_LIVE} "
                "AND (final_by IS NULL OR final_by = ? OR final_at < ?) AND NOT EXISTS ("
                "SELECT 1 FROM job_items WHERE job_id = ? AND status = 'pending')",
                (owner, now, job_id, owner, now - lease_s, job_id),
            )
            return cur.rowcount == 1

    def finish_item(self, job_id: str, idx: int, result: dict[str, Any], *, failed: bool) -> bool:
        """Store an item's record; False (and nothing written) when it was already finished."""
        status = "failed" if failed else "done"
        with self._lock, self._db.transaction():
            # The job's row lock orders the finishes of one job, so ``seq`` grows in commit
            # order and a reader following ``results(after=seq)`` never skips one.
            self._db.execute(f"SELECT id FROM jobs WHERE id = ?{self._db.for_update}", (job_id,))
            cur = self._db.execute(
                "UPDATE job_items SET status = ?, result = ?, finished_at = ?, claimed_by = NULL, "
                "seq = (SELECT COALESCE(MAX(seq), 0) + 1 FROM job_items WHERE job_id = ?) "
                "WHERE job_id = ? AND idx = ? AND status = 'pending'",
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
