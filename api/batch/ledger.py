"""Which shards a job has finished, and which records of the unfinished ones exist.

The ledger is an append-only, fsync'ed JSONL of ``{"shard", "fingerprint", "samples",
"errors"}`` lines, written after a shard's output is complete: a shard in it (under the
job's fingerprint) is skipped without being read. For the other shards the existing
records (``DoneIndex``) say which samples, prompts and segments are already done."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from api.batch.journal import JournalWriter, cut_torn_tail, iter_records

SETTING_KEYS = (
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "fps",
    "max_frames",
    "segments",
    "scene_cuts",
    "prompt_field",
    "json_schema",
)


def settings_of(rec: dict[str, Any]) -> dict[str, Any]:
    return {k: rec[k] for k in SETTING_KEYS if k in rec}


def record_id(rec: dict[str, Any]) -> tuple[Any, ...]:
    """What makes a record unique within a sample (and one content): prompt, segment."""
    return (rec.get("prompt"), rec.get("segment"))


@dataclass
class DoneIndex:
    """(shard, key) -> content hash -> ([record ids], errors). Records written before
    shards existed have no shard: they are found under any shard by their key."""

    entries: dict[tuple[str, str], dict[str | None, tuple[set[tuple[Any, ...]], int]]] = field(
        default_factory=dict
    )

    def add(self, rec: dict[str, Any]) -> None:
        key = (rec.get("shard") or "*", rec.get("key") or rec["file"])
        by_hash = self.entries.setdefault(key, {})
        ids, errors = by_hash.get(rec.get("content_hash"), (set(), 0))
        ids.add(record_id(rec))
        by_hash[rec.get("content_hash")] = (ids, errors + ("error" in rec))

    def lookup(
        self, shard: str, key: str, content_hash: str | None
    ) -> tuple[set[tuple[Any, ...]], int] | None:
        for k in ((shard, key), ("*", key)):
            got = self.entries.get(k, {}).get(content_hash)
            if got is not None:
                return got
        return None

    def for_shard(self, shard: str) -> DoneIndex:
        """The part a worker reading ``shard`` needs (picklable)."""
        return DoneIndex({k: v for k, v in self.entries.items() if k[0] in (shard, "*")})

    def __len__(self) -> int:
        return len(self.entries)


def load_index(
    records: Iterable[dict[str, Any]], settings: dict[str, Any], skip_shards: set[str]
) -> DoneIndex:
    index = DoneIndex()
    for rec in records:
        if rec.get("shard") in skip_shards or settings_of(rec) != settings:
            continue
        index.add(rec)
    return index


@dataclass
class FinishedShards:
    """Shards a ledger says are finished: how many, and their samples and errors."""

    shards: int = 0
    samples: int = 0
    errors: int = 0


_S = TypeVar("_S")


class Ledger:
    def __init__(self, path: Path, fingerprint: str):
        self.path = path
        self.fingerprint = fingerprint
        cut_torn_tail(path)
        self.done: dict[str, dict[str, Any]] = {}
        for line in _lines(path):
            if line.get("fingerprint") == fingerprint and isinstance(line.get("shard"), str):
                self.done[line["shard"]] = line
        self._writer: JournalWriter | None = None

    def unfinished(self, shards: Iterable[_S]) -> tuple[list[_S], FinishedShards]:
        """The shards (anything with an ``id``) not finished under this fingerprint, in
        order, and what the finished ones held."""
        todo: list[_S] = []
        finished = FinishedShards()
        for shard in shards:
            done = self.done.get(shard.id)
            if done is None:
                todo.append(shard)
            else:
                finished.shards += 1
                finished.samples += int(done.get("samples", 0))
                finished.errors += int(done.get("errors", 0))
        return todo, finished

    def finish(self, shard: str, samples: int, errors: int) -> None:
        if self._writer is None:
            self._writer = JournalWriter(self.path)
        line = {
            "file": "",
            "shard": shard,
            "fingerprint": self.fingerprint,
            "samples": samples,
            "errors": errors,
        }
        self._writer.write(line)
        self.done[shard] = line

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def _lines(path: Path) -> Iterable[dict[str, Any]]:
    return iter_records(path)
