"""Uploaded inferlet components, stored once by content: ``<state>/inferlets/<sha256>.wasm``.

The id is ``inferlet-`` + the first 32 hex digits of the SHA-256 of the bytes, so uploading
the same component again gives the same id and stores nothing new. Nothing else is kept:
the file's size and modification time are its record.

Who may see a component: ``holders/<sha256>/<tenant mark>``, an empty file per tenant that
uploaded it (a folder on the shared state filesystem, so replicas agree). A component with
no holders folder predates tenants: admins only. The bytes go when the last holder deletes.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path

PREFIX = "inferlet-"
_ID = re.compile(r"^inferlet-[0-9a-f]{32}$")


@dataclass(frozen=True)
class InferletRecord:
    id: str
    bytes: int
    created_at: int
    sha256: str


def _mark(tenant: str) -> str:
    """A tenant's file name under a component's holders folder (any tenant id is safe)."""
    return hashlib.sha256(tenant.encode()).hexdigest()[:32]


class InferletStore:
    def __init__(self, root: Path):
        self.root = Path(root) / "inferlets"
        self.root.mkdir(parents=True, exist_ok=True)
        self.holders = self.root / "holders"
        self._lock = threading.Lock()

    def _holds(self, path: Path, scope: str | None) -> bool:
        """Whether ``scope`` (a tenant; None: an admin) may see the component at ``path``."""
        if scope is None:
            return True
        return (self.holders / path.stem / _mark(scope)).is_file()

    def __repr__(self) -> str:
        return f"InferletStore({str(self.root)!r}, {len(self.list())} components)"

    def _file(self, inferlet_id: str) -> Path | None:
        if not _ID.match(inferlet_id):
            return None
        hits = sorted(self.root.glob(f"{inferlet_id[len(PREFIX) :]}*.wasm"))
        return hits[0] if hits else None

    def add(self, spooled: Path, *, tenant: str = "") -> tuple[InferletRecord, bool]:
        """Move ``spooled`` in under its content hash, held by ``tenant`` -> (record, stored
        now). An identical component already stored: ``spooled`` is deleted and the stored
        one returned."""
        h = hashlib.sha256()
        with open(spooled, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        digest = h.hexdigest()
        dest = self.root / f"{digest}.wasm"
        with self._lock:
            new = not dest.exists()
            if new:
                os.replace(spooled, dest)
            else:
                spooled.unlink(missing_ok=True)
            marks = self.holders / digest
            if new or marks.is_dir() or tenant:
                if not new and not marks.is_dir():  # stored before tenants: the legacy holder too
                    marks.mkdir(parents=True, exist_ok=True)
                    (marks / _mark("")).touch()
                marks.mkdir(parents=True, exist_ok=True)
                (marks / _mark(tenant)).touch()
        return self._record(dest), new

    def _record(self, path: Path) -> InferletRecord:
        st = path.stat()
        digest = path.stem
        return InferletRecord(PREFIX + digest[:32], st.st_size, int(st.st_mtime), digest)

    def get(self, inferlet_id: str, *, scope: str | None = None) -> InferletRecord | None:
        path = self.path(inferlet_id, scope=scope)
        return None if path is None else self._record(path)

    def path(self, inferlet_id: str, *, scope: str | None = None) -> Path | None:
        path = self._file(inferlet_id)
        return path if path is not None and self._holds(path, scope) else None

    def list(self, *, scope: str | None = None) -> list[InferletRecord]:
        paths = [p for p in self.root.glob("*.wasm") if self._holds(p, scope)]
        return sorted((self._record(p) for p in paths), key=lambda r: r.created_at)

    def delete(self, inferlet_id: str, *, scope: str | None = None) -> bool:
        """Remove ``scope``'s hold (None: the component, whoever holds it); the bytes go
        with the last holder."""
        with self._lock:
            path = self.path(inferlet_id, scope=scope)
            if path is None:
                return False
            marks = self.holders / path.stem
            if scope is not None and marks.is_dir():
                (marks / _mark(scope)).unlink(missing_ok=True)
                if any(marks.iterdir()):
                    return True
            shutil.rmtree(marks, ignore_errors=True)
            path.unlink(missing_ok=True)
            return True
