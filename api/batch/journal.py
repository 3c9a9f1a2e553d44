"""An append-only JSONL file of records, each line flushed and fsync'ed as it is written,
so a killed run loses at most the records in flight and never leaves half a record
behind: a torn last line is cut off when the file is read back."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def cut_torn_tail(path: Path) -> int:
    """Truncate ``path`` to its last complete line; the bytes cut (0 when none)."""
    if not path.exists():
        return 0
    size = path.stat().st_size
    if size == 0:
        return 0
    with path.open("r+b") as f:
        # Walk back from the end in blocks to the last newline (never reads the whole file).
        pos, block = size, 64 * 1024
        end = 0
        while pos > 0:
            start = max(0, pos - block)
            f.seek(start)
            chunk = f.read(pos - start)
            i = chunk.rfind(b"\n")
            if i >= 0:
                end = start + i + 1
                break
            pos = start
        torn = size - end
        if torn:
            f.truncate(end)
            f.flush()
            os.fsync(f.fileno())
    return torn


def iter_records(path: Path) -> Iterator[dict[str, Any]]:
    """The records of a journal, line by line (unparsable or non-record lines skipped)."""
    if not path.exists():
        return
    with path.open("rb") as f:
        for line in f:
            if not line.endswith(b"\n"):
                break  # a torn tail (cut by cut_torn_tail before appending)
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if isinstance(rec, dict) and "file" in rec:
                yield rec


def read_records(out: Path) -> tuple[list[dict[str, Any]], int]:
    """The records in ``out`` and how many bytes of a torn last line were cut off (the file
    is truncated to its last complete line). Unparsable complete lines are ignored."""
    torn = cut_torn_tail(out)
    return list(iter_records(out)), torn


class JournalWriter:
    """Appends records to a JSONL file, one fsync'ed line each."""

    def __init__(self, out: Path):
        out.parent.mkdir(parents=True, exist_ok=True)
        self.path = out
        self._f = out.open("a", encoding="utf-8")

    def write(self, rec: dict[str, Any]) -> None:
        self._f.write(json.dumps(rec, ensure_ascii=False) + "\n")
        self._f.flush()
        os.fsync(self._f.fileno())

    def close(self) -> None:
        self._f.close()
