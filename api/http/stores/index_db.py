"""The index behind the service's stores (uploads, Files API files, caption jobs, batches).

The stores keep their blobs in folders and their rows in an :class:`IndexDB`, of which
there are two:

- :class:`SqliteIndex` (the embedded default): one SQLite file per store under the state
  folder, WAL and ``synchronous=FULL``; one server process.
- :class:`api.http.stores.index_postgres.PostgresIndex` (``--state-db postgresql://...``): one
  PostgreSQL database shared by every replica, with the state folder on a shared
  filesystem for the blobs (same layout).

The stores write one SQL text for both: ``?`` placeholders, ``INSERT ... ON CONFLICT``,
``RETURNING``, and the few dialect words below (``{REAL}``, ``{SERIAL}`` in schemas,
:attr:`IndexDB.for_update` / :attr:`IndexDB.skip_locked` in claims). Each call is its own
transaction unless made inside :meth:`IndexDB.transaction`. Every method is thread-safe
(one connection behind a lock; a transaction holds the lock until it ends).
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol

from api.http.stores.sql_dialect import fill_words


class Rows(Protocol):
    """What a statement gives back (a DB-API cursor)."""

    rowcount: int

    def fetchone(self) -> Any: ...

    def fetchall(self) -> list[Any]: ...


class IndexDB(Protocol):
    """The interface the stores use; see the module docstring."""

    dialect: str
    """``"sqlite"`` or ``"postgresql"``."""
    shared: bool
    """Whether other processes (replicas, maybe on other machines) use the same index."""
    for_update: str
    """Appended to a SELECT that must lock its rows until the transaction ends."""
    skip_locked: str
    """Appended to a claim's SELECT: rows another transaction holds are passed over."""

    def execute(self, sql: str, params: Sequence[Any] = ()) -> Rows: ...

    def executemany(self, sql: str, rows: Iterable[Sequence[Any]]) -> None: ...

    def transaction(self) -> Any:
        """A context manager: the statements inside commit together or not at all."""
        ...

    def create(self, schema: str) -> None:
        """Run ``CREATE ... IF NOT EXISTS`` statements (``;``-separated, dialect words filled)."""
        ...

    def add_column(self, table: str, column: str, decl: str) -> None:
        """Add a column to a table made by an older version (nothing if it is there)."""
        ...

    def user_version(self, name: str) -> int: ...

    def set_user_version(self, name: str, version: int) -> None: ...

    def close(self) -> None: ...


_SQLITE_WORDS = {"REAL": "REAL", "SERIAL": "INTEGER PRIMARY KEY AUTOINCREMENT"}


class SqliteIndex:
    """One SQLite file (WAL, ``synchronous=FULL``): the embedded default."""

    dialect = "sqlite"
    shared = False
    for_update = ""
    skip_locked = ""  # BEGIN IMMEDIATE already holds the whole file's write lock

    def __init__(self, path: str | Path, *, timeout_s: float = 30.0, shared: bool = False):
        self.path = Path(path)
        self.shared = shared
        """True when replicas on this machine share the file (claims then wait for leases)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.RLock()
        self._conn: sqlite3.Connection | None = sqlite3.connect(
            self.path, check_same_thread=False, isolation_level=None, timeout=timeout_s
        )
        try:
            self._conn.execute("PRAGMA journal_mode=WAL")
            self._conn.execute("PRAGMA synchronous=FULL")
            self._conn.execute(f"PRAGMA busy_timeout={int(timeout_s * 1000)}")
        except BaseException:
            self.close()
            raise

    def __repr__(self) -> str:
        return f"SqliteIndex({str(self.path)!r})"

    def _db(self) -> sqlite3.Connection:
        if self._conn is None:
            raise RuntimeError(f"the index {self.path} is closed")
        return self._conn

    def execute(self, sql: str, params: Sequence[Any] = ()) -> Rows:
        with self._lock:
            return self._db().execute(sql, tuple(params))

    def executemany(self, sql: str, rows: Iterable[Sequence[Any]]) -> None:
        with self._lock:
            self._db().executemany(sql, rows)

    @contextmanager
    def transaction(self) -> Iterator[SqliteIndex]:
        with self._lock:
            db = self._db()
            db.execute("BEGIN IMMEDIATE")
            try:
                yield self
            except BaseException:
                db.execute("ROLLBACK")
                raise
            db.execute("COMMIT")

    def create(self, schema: str) -> None:
        with self._lock:
            self._db().executescript(fill_words(schema, _SQLITE_WORDS))

    def add_column(self, table: str, column: str, decl: str) -> None:
        with self._lock:
            have = {r[1] for r in self._db().execute(f"PRAGMA table_info({table})")}
            if column not in have:
                self._db().execute(f"ALTER TABLE {table} ADD COLUMN {column} {decl}")

    def user_version(self, name: str) -> int:
        # One file per store: the file's own user_version is the store's.
        return int(self.execute("PRAGMA user_version").fetchone()[0])

    def set_user_version(self, name: str, version: int) -> None:
        self.execute(f"PRAGMA user_version={int(version)}")

    def close(self) -> None:
        with self._lock:
            conn, self._conn = self._conn, None
            if conn is not None:
                conn.close()
