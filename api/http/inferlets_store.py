"""Uploaded inferlet components, stored once by content: ``<state>/inferlets/<sha256>.wasm``.

The id is ``inferlet-`` + the first 32 hex digits of the SHA-256 of the bytes, so uploading
the same component again gives the same id and stores nothing new. Nothing else is kept:
the file's size and modification time are its record.
"""

from __future__ import annotations

import hashlib
import os
import re
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


class InferletStore:
    def __init__(self, root: Path):
        self.root = Path(root) / "inferlets"
        self.root.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"InferletStore({str(self.root)!r}, {len(self.list())} components)"

    def _file(self, inferlet_id: str) -> Path | None:
        if not _ID.match(inferlet_id):
            return None
        hits = sorted(self.root.glob(f"{inferlet_id[len(PREFIX) :]}*.wasm"))
        return hits[0] if hits else None

    def add(self, spooled: Path) -> tuple[InferletRecord, bool]:
        """Move ``spooled`` in under its content hash -> (record, stored now). An identical
        component already stored: ``spooled`` is deleted and the stored one returned."""
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
        return self._record(dest), new

    def _record(self, path: Path) -> InferletRecord:
        st = path.stat()
        digest = path.stem
        return InferletRecord(PREFIX + digest[:32], st.st_size, int(st.st_mtime), digest)

    def get(self, inferlet_id: str) -> InferletRecord | None:
        path = self._file(inferlet_id)
        return None if path is None else self._record(path)

    def path(self, inferlet_id: str) -> Path | None:
        return self._file(inferlet_id)

    def list(self) -> list[InferletRecord]:
        return sorted((self._record(p) for p in self.root.glob("*.wasm")), key=lambda r: r.created_at)

    def delete(self, inferlet_id: str) -> bool:
        path = self._file(inferlet_id)
        if path is None:
            return False
        path.unlink(missing_ok=True)
        return True
