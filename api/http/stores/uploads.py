"""Uploads that survive a restart: files on disk plus a small SQLite index beside them.

Layout under ``root`` (the service's ``--media-dir``)::

    files/media-<content_hash>   the uploaded bytes, exactly as received
    spool/                       uploads being received (same filesystem: moved, not copied)
    media.sqlite3                the index (WAL, synchronous=FULL), unless another
                                 :class:`~api.http.stores.index_db.IndexDB` is given (PostgreSQL
                                 for replicas sharing this folder: ``spool/<host>/`` then)

An id is ``"media-" + content_hash``, so the same bytes get the same id and a second
``put`` of them keeps the first record. Methods are synchronous and thread-safe (one
connection behind a lock); async callers use ``asyncio.to_thread``.

Crash safety: ``put`` makes the file durable (fsync, rename, fsync of the folder) before
it writes the row; ``delete`` removes the row before the file. So a crash can leave a
file without a row (removed on a later open once old) but never a row without a file;
rows whose file went missing anyway are dropped on open, and so are stale spool files.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import shutil
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from api.http.stores.index_db import IndexDB, SqliteIndex
from api.http.uploads import spool_owner_pid
from media.errors import InvalidRequestError, PieMediaError

log = logging.getLogger("pie_media.http.store")

ID_PREFIX = "media-"
_HASH = re.compile(r"[0-9a-f]{16,128}")
_ID = re.compile(r"media-[0-9a-f]{16,128}")
_KIND = re.compile(r"[a-z][a-z0-9_]{0,31}")
_TMP_PREFIX = ".tmp-"
MAX_LIST_LIMIT = 10_000
SCHEMA_VERSION = 1

_SCHEMA = """
CREATE TABLE IF NOT EXISTS media (
    seq          {SERIAL},
    id           TEXT    NOT NULL UNIQUE,
    kind         TEXT    NOT NULL,
    content_hash TEXT    NOT NULL,
    size         INTEGER NOT NULL,
    filename     TEXT,
    content_type TEXT,
    created_at   {REAL}  NOT NULL,
    metadata     TEXT    NOT NULL DEFAULT '{}'
);
CREATE TABLE IF NOT EXISTS media_holders (
    seq          {SERIAL},
    id           TEXT    NOT NULL,
    tenant       TEXT    NOT NULL,
    filename     TEXT,
    content_type TEXT,
    created_at   {REAL}  NOT NULL,
    metadata     TEXT    NOT NULL DEFAULT '{}',
    UNIQUE (id, tenant)
)
"""
_HOLDER_COLUMNS = (
    "m.id, m.kind, m.content_hash, m.size, h.filename, h.content_type, h.created_at, h.metadata, h.tenant"
)
_COLUMNS = "id, kind, content_hash, size, filename, content_type, created_at, metadata"


class MediaNotFoundError(PieMediaError, KeyError):
    """No stored upload has this id (or the id is not a valid one)."""

    code = "media_not_found"


@dataclass(frozen=True)
class MediaRecord:
    """One stored upload. ``created_at`` is Unix time in seconds."""

    id: str
    kind: str
    content_hash: str
    size: int
    filename: str | None
    content_type: str | None
    created_at: float
    metadata: dict[str, Any] = field(default_factory=dict)
    tenant: str | None = field(default=None, compare=False)
    """The tenant whose upload this record is (None: the stored bytes, seen by an admin)."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "kind": self.kind,
            "content_hash": self.content_hash,
            "size": self.size,
            "filename": self.filename,
            "content_type": self.content_type,
            "created_at": self.created_at,
            "metadata": dict(self.metadata),
        }


def is_media_id(value: object) -> bool:
    """Whether ``value`` is a well-formed upload id (``media-`` + 16..128 lowercase hex)."""
    return isinstance(value, str) and _ID.fullmatch(value) is not None


class MediaStore:
    """Stored uploads under ``root``. ``stale_after_s``: on open, spool files of dead
    processes are removed at once, any other spool or orphan file once older than this.
    ``index``: where the rows live (default: SQLite at ``root/media.sqlite3``); the store
    closes it."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        stale_after_s: float = 3600.0,
        index: IndexDB | None = None,
    ):
        self.root = Path(root)
        self.files_dir = self.root / "files"
        self.db_path = self.root / "media.sqlite3"
        self.stale_after_s = float(stale_after_s)
        self._lock = threading.RLock()
        self._conn: IndexDB | None = None
        self.root.mkdir(parents=True, exist_ok=True)
        self._conn = index if index is not None else SqliteIndex(self.db_path)
        # A spool file names its process id: on a shared folder each host keeps its own.
        self.spool_dir = (
            self.root / "spool" / socket.gethostname() if self._conn.shared else self.root / "spool"
        )
        for d in (self.files_dir, self.spool_dir):
            d.mkdir(parents=True, exist_ok=True)
        try:
            self._conn.create(_SCHEMA)
            version = self._conn.user_version("media")
            if version == 0:
                self._conn.set_user_version("media", SCHEMA_VERSION)
            elif version != SCHEMA_VERSION:
                raise RuntimeError(
                    f"{self._conn!r} has schema version {version}; this pie-media reads {SCHEMA_VERSION}"
                )
            self._recover()
        except BaseException:
            self.close()
            raise

    # -- writing ---------------------------------------------------------------------

    def put(
        self,
        spool_path: str | os.PathLike[str],
        *,
        content_hash: str,
        kind: str,
        size: int,
        filename: str | None = None,
        content_type: str | None = None,
        metadata: dict[str, Any] | None = None,
        tenant: str = "",
    ) -> tuple[MediaRecord, bool]:
        """Store the file at ``spool_path`` (moved, so it should be under
        :attr:`spool_dir`) as ``media-<content_hash>``, held by ``tenant``. Returns
        ``(record, created)``: the tenant's record (its own filename, type, time and
        metadata), ``created=False`` when the tenant already held these bytes. The bytes are
        stored once whoever uploads them; the spool file of a repeat is deleted."""
        record, fresh = self._put_bytes(
            spool_path,
            content_hash=content_hash,
            kind=kind,
            size=size,
            filename=filename,
            content_type=content_type,
            metadata=metadata,
        )
        meta_json = json.dumps(
            record.metadata if metadata is None else metadata, sort_keys=True, separators=(",", ":")
        )
        with self._lock:
            cur = self._db().execute(
                "INSERT INTO media_holders (id, tenant, filename, content_type, created_at, metadata) "
                "VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (id, tenant) DO NOTHING",
                (
                    record.id,
                    tenant,
                    filename,
                    content_type,
                    record.created_at if fresh else time.time(),
                    meta_json,
                ),
            )
            held = self._get_held(record.id, tenant)
        if held is None:  # deleted in between: store it again
            return self.put(
                spool_path,
                content_hash=content_hash,
                kind=kind,
                size=size,
                filename=filename,
                content_type=content_type,
                metadata=metadata,
                tenant=tenant,
            )
        return held, cur.rowcount == 1

    def _put_bytes(
        self,
        spool_path: str | os.PathLike[str],
        *,
        content_hash: str,
        kind: str,
        size: int,
        filename: str | None = None,
        content_type: str | None = None,
        metadata: dict[str, Any] | None = None,
    ) -> tuple[MediaRecord, bool]:
        """The bytes' own row and file (the first uploader's facts)."""
        # Wrong arguments here are the caller's bugs, not the client's: plain
        # ValueError / TypeError (a 500), never a typed 4xx.
        spool_path = Path(spool_path)
        if not isinstance(content_hash, str) or _HASH.fullmatch(content_hash) is None:
            raise ValueError(
                f"content_hash must be 16-128 lowercase hex digits, got {str(content_hash)[:40]!r}"
            )
        if not isinstance(kind, str) or _KIND.fullmatch(kind) is None:
            raise ValueError(f"kind must be a short lowercase word, got {str(kind)[:40]!r}")
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise ValueError(f"size must be an int >= 0, got {size!r}")
        for name, value in (("filename", filename), ("content_type", content_type)):
            if value is not None and not isinstance(value, str):
                raise TypeError(f"{name} must be a str or None, got {type(value).__name__}")
        meta = {} if metadata is None else metadata
        if not isinstance(meta, dict):
            raise TypeError(f"metadata must be a dict, got {type(meta).__name__}")
        meta_json = json.dumps(meta, sort_keys=True, separators=(",", ":"))  # TypeError if not JSON
        actual = spool_path.stat().st_size
        if actual != size:
            raise ValueError(f"size is {size} but {spool_path.name} holds {actual} bytes")

        media_id = ID_PREFIX + content_hash
        target = self.files_dir / media_id
        with self._lock:
            existing = self._get(media_id)
            if existing is not None and target.is_file():
                _unlink(spool_path)
                return existing, False
            self._place(spool_path, target)
            if existing is not None:  # a row whose file had gone: the same bytes restore it
                return existing, False
            record = MediaRecord(
                id=media_id,
                kind=kind,
                content_hash=content_hash,
                size=size,
                filename=filename,
                content_type=content_type,
                created_at=time.time(),
                metadata=json.loads(meta_json),
            )
            try:
                cur = self._db().execute(
                    f"INSERT INTO media ({_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (id) DO NOTHING",
                    (
                        media_id,
                        kind,
                        content_hash,
                        size,
                        filename,
                        content_type,
                        record.created_at,
                        meta_json,
                    ),
                )
            except BaseException:
                _unlink(target)
                raise
            if cur.rowcount == 0:  # another process stored it between our look-up and insert
                other = self._get(media_id)
                if other is not None:
                    return other, False
            return record, True

    def delete(self, media_id: str, *, scope: str | None = None) -> bool:
        """Remove ``scope``'s hold on the upload (None: every hold: an admin's delete); the
        bytes go once nobody holds them. False when there was nothing to remove."""
        if not is_media_id(media_id):
            return False
        with self._lock:
            db = self._db()
            with db.transaction():
                if scope is None:
                    db.execute("DELETE FROM media_holders WHERE id = ?", (media_id,))
                    removed = db.execute("DELETE FROM media WHERE id = ?", (media_id,)).rowcount > 0
                else:
                    removed = (
                        db.execute(
                            "DELETE FROM media_holders WHERE id = ? AND tenant = ?", (media_id, scope)
                        ).rowcount
                        > 0
                    )
                    left = db.execute("SELECT 1 FROM media_holders WHERE id = ?", (media_id,)).fetchone()
                    if removed and left is None:
                        db.execute("DELETE FROM media WHERE id = ?", (media_id,))
                    else:
                        return removed
            if removed:
                _unlink(self.files_dir / media_id)
            return removed

    # -- reading ---------------------------------------------------------------------

    def get(self, media_id: str, *, scope: str | None = None) -> MediaRecord | None:
        """The record, or None (also for a malformed id such as ``../x``, and when
        ``scope``, a tenant, holds no such upload). An admin (``scope`` None) gets the
        bytes' own record."""
        if not is_media_id(media_id):
            return None
        with self._lock:
            return self._get(media_id) if scope is None else self._get_held(media_id, scope)

    def path(self, media_id: str, *, scope: str | None = None) -> Path | None:
        """Where the bytes are, or None when there is no such record (for ``scope``) or file."""
        if self.get(media_id, scope=scope) is None:
            return None
        p = self.files_dir / media_id
        return p if p.is_file() else None

    def stored_bytes(self, tenant: str) -> int:
        """What ``tenant``'s uploads hold (each counted whole, also when shared)."""
        with self._lock:
            row = (
                self._db()
                .execute(
                    "SELECT COALESCE(SUM(m.size), 0) FROM media_holders h JOIN media m ON m.id = h.id "
                    "WHERE h.tenant = ?",
                    (tenant,),
                )
                .fetchone()
            )
        return int(row[0])

    def read_bytes(self, media_id: str, *, scope: str | None = None) -> bytes:
        """The stored bytes; :class:`MediaNotFoundError` when there are none (for ``scope``)."""
        p = self.path(media_id, scope=scope)
        if p is not None:
            with contextlib.suppress(FileNotFoundError):  # deleted in between
                return p.read_bytes()
        raise MediaNotFoundError(f"no uploaded media with id {str(media_id)[:80]!r}", param="media_id")

    def __len__(self) -> int:
        with self._lock:
            return self._db().execute("SELECT COUNT(*) FROM media").fetchone()[0]

    def __bool__(self) -> bool:  # an empty store is still a store (``if store:``)
        return True

    def __contains__(self, media_id: object) -> bool:
        if not is_media_id(media_id):
            return False
        with self._lock:
            row = self._db().execute("SELECT 1 FROM media WHERE id = ?", (media_id,)).fetchone()
        return row is not None

    def __repr__(self) -> str:
        if self._conn is None:
            return f"MediaStore({str(self.root)!r}, closed)"
        return f"MediaStore({str(self.root)!r}, records={len(self)})"

    def list(
        self, limit: int = 100, after: str | None = None, *, scope: str | None = None
    ) -> list[MediaRecord]:
        """Up to ``limit`` records in the order they were stored, starting after the
        record ``after`` (a cursor: the last id of the previous page); ``scope``: only that
        tenant's uploads (None: every stored file)."""
        if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_LIST_LIMIT:
            raise InvalidRequestError(
                f"limit must be an int in 1..{MAX_LIST_LIMIT}, got {limit!r}",
                param="limit",
                limit=MAX_LIST_LIMIT,
            )
        if scope is not None:
            return self._list_held(limit, after, scope)
        with self._lock:
            db = self._db()
            start = 0
            if after is not None:
                row = (
                    db.execute("SELECT seq FROM media WHERE id = ?", (after,)).fetchone()
                    if is_media_id(after)
                    else None
                )
                if row is None:
                    raise MediaNotFoundError(f"no uploaded media with id {str(after)[:80]!r}", param="after")
                start = row[0]
            rows = db.execute(
                f"SELECT {_COLUMNS} FROM media WHERE seq > ? ORDER BY seq LIMIT ?", (start, limit)
            ).fetchall()
        return [_record(r) for r in rows]

    # -- lifecycle -------------------------------------------------------------------

    def close(self) -> None:
        with self._lock:
            conn, self._conn = self._conn, None
            if conn is not None:
                conn.close()

    def __enter__(self) -> MediaStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals -------------------------------------------------------------------

    def _db(self) -> IndexDB:
        if self._conn is None:
            raise RuntimeError(f"MediaStore at {self.root} is closed")
        return self._conn

    def _get(self, media_id: str) -> MediaRecord | None:
        row = self._db().execute(f"SELECT {_COLUMNS} FROM media WHERE id = ?", (media_id,)).fetchone()
        return _record(row) if row is not None else None

    def _get_held(self, media_id: str, tenant: str) -> MediaRecord | None:
        row = (
            self._db()
            .execute(
                f"SELECT {_HOLDER_COLUMNS} FROM media_holders h JOIN media m ON m.id = h.id "
                "WHERE h.id = ? AND h.tenant = ?",
                (media_id, tenant),
            )
            .fetchone()
        )
        return _record(row) if row is not None else None

    def _list_held(self, limit: int, after: str | None, tenant: str) -> list[MediaRecord]:
        with self._lock:
            db = self._db()
            start = 0
            if after is not None:
                row = (
                    db.execute(
                        "SELECT seq FROM media_holders WHERE id = ? AND tenant = ?", (after, tenant)
                    ).fetchone()
                    if is_media_id(after)
                    else None
                )
                if row is None:
                    raise MediaNotFoundError(f"no uploaded media with id {str(after)[:80]!r}", param="after")
                start = row[0]
            rows = db.execute(
                f"SELECT {_HOLDER_COLUMNS} FROM media_holders h JOIN media m ON m.id = h.id "
                "WHERE h.tenant = ? AND h.seq > ? ORDER BY h.seq LIMIT ?",
                (tenant, start, limit),
            ).fetchall()
        return [_record(r) for r in rows]

    def legacy_count(self) -> int:
        """Uploads stored before tenants (held by the legacy tenant: admins only)."""
        with self._lock:
            return int(
                self._db().execute("SELECT COUNT(*) FROM media_holders WHERE tenant = ''").fetchone()[0]
            )

    def _place(self, source: Path, target: Path) -> None:
        """Move ``source`` to ``target`` durably (contents, then the name)."""
        _fsync_file(source)
        try:
            os.replace(source, target)
        except OSError as e:
            if e.errno != errno.EXDEV:
                raise
            # Another filesystem: copy beside the target, then rename over it.
            tmp = self.files_dir / f"{_TMP_PREFIX}{uuid.uuid4().hex}"
            try:
                shutil.copyfile(source, tmp)
                _fsync_file(tmp)
                os.replace(tmp, target)
            except BaseException:
                _unlink(tmp)
                raise
            _unlink(source)
        _fsync_dir(self.files_dir)

    def _recover(self) -> None:
        db = self._db()
        now = time.time()
        # Rows whose file is missing (the file was removed behind our back).
        ids = [r[0] for r in db.execute("SELECT id FROM media")]
        missing = [i for i in ids if not (self.files_dir / i).is_file()]
        if missing:
            with db.transaction():
                db.executemany("DELETE FROM media_holders WHERE id = ?", [(i,) for i in missing])
                db.executemany("DELETE FROM media WHERE id = ?", [(i,) for i in missing])
            log.warning("dropped %d index rows whose file is missing under %s", len(missing), self.files_dir)
        # Uploads stored before tenants: held by the legacy tenant (admins see them).
        db.execute(
            "INSERT INTO media_holders (id, tenant, filename, content_type, created_at, metadata) "
            "SELECT id, '', filename, content_type, created_at, metadata FROM media m "
            "WHERE NOT EXISTS (SELECT 1 FROM media_holders h WHERE h.id = m.id) "
            "ON CONFLICT (id, tenant) DO NOTHING"
        )
        # Spool files of dead processes, or old ones.
        removed = 0
        for entry in _entries(self.spool_dir):
            pid = spool_owner_pid(entry.name)
            if (pid is not None and not _alive(pid)) or _older_than(entry, now - self.stale_after_s):
                removed += _unlink(entry)
        # Files without a row (a crash between the rename and the insert), once old.
        known = set(ids) - set(missing)
        for entry in _entries(self.files_dir):
            if entry.name not in known and _older_than(entry, now - self.stale_after_s):
                removed += _unlink(entry)
        if removed:
            log.info("removed %d stale spool/orphan files under %s", removed, self.root)


def _record(row: tuple[Any, ...]) -> MediaRecord:
    media_id, kind, content_hash, size, filename, content_type, created_at, meta, *held = row
    try:
        metadata = json.loads(meta) if meta else {}
    except ValueError:
        metadata = {}
    return MediaRecord(
        id=media_id,
        kind=kind,
        content_hash=content_hash,
        size=int(size),
        filename=filename,
        content_type=content_type,
        created_at=float(created_at),
        metadata=metadata if isinstance(metadata, dict) else {},
        tenant=held[0] if held else None,
    )


def _entries(folder: Path) -> list[Path]:
    try:
        return [p for p in folder.iterdir() if p.is_file() and not p.is_symlink()]
    except FileNotFoundError:
        return []


def _older_than(path: Path, cutoff: float) -> bool:
    try:
        return path.stat().st_mtime < cutoff
    except FileNotFoundError:
        return False


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except OSError:
        return False
    return True


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _unlink(path: Path) -> int:
    try:
        path.unlink()
        return 1
    except OSError:
        return 0
