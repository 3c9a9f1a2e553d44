"""WebDataset output: a folder of caption-only tar shards that mirror the input's
(``<out>/<shard>.tar``), each sample as ``<key>.txt`` (its first caption; absent when
it failed) and ``<key>.json`` (``{"key", "records": [...]}``, every record of the
sample), in the order the samples were captioned. See ``api.batch.sinks`` for resume:
a shard's records are journaled in ``<out>/.<shard>.jsonl`` and its tar is written whole
(temporary name, then renamed) when the shard is finished."""

from __future__ import annotations

import io
import json
import os
import tarfile
import time
from pathlib import Path
from typing import Any

from api.batch.journal import JournalWriter, cut_torn_tail, iter_records
from api.batch.ledger import Ledger, load_index
from api.batch.sinks import Sink


def member_key(key: str) -> str:
    """A sample key as a tar member stem: WebDataset splits names at the first dot of the
    file name, so a file path's dots become underscores (WebDataset keys have none)."""
    head, _, tail = key.rpartition("/")
    return (head + "/" if head else "") + tail.replace(".", "_")


class WebDatasetSink(Sink):
    format = "webdataset"

    def __init__(self, out: Path, fingerprint: str, settings: dict[str, Any]):
        out.mkdir(parents=True, exist_ok=True)
        super().__init__(out, fingerprint, settings)
        journals = []
        for j in sorted(out.glob(".*.jsonl")):
            if j.name == ".ledger.jsonl":
                continue
            self.torn_bytes += cut_torn_tail(j)
            journals.extend(iter_records(j))
        self.index = load_index(journals, settings, set(self.ledger.done))
        self._writers: dict[str, JournalWriter] = {}
        self._stems: dict[str, str] = {}

    def _open_ledger(self) -> Ledger:
        return Ledger(self.out / ".ledger.jsonl", self.fingerprint)

    def _journal(self, shard: Any) -> Path:
        return self.out / f".{shard.stem}.jsonl"

    def write(self, shard: Any, rec: dict[str, Any]) -> None:
        w = self._writers.get(shard.id)
        if w is None:
            w = self._writers[shard.id] = JournalWriter(self._journal(shard))
        w.write(rec)

    def finish_shard(self, shard: Any, samples: int, errors: int) -> None:
        w = self._writers.pop(shard.id, None)
        if w is not None:
            w.close()
        journal = self._journal(shard)
        by_key: dict[str, list[dict[str, Any]]] = {}
        for rec in iter_records(journal):
            by_key.setdefault(rec.get("key") or rec["file"], []).append(rec)
        tmp = self.out / f".{shard.stem}.tar.tmp"
        now = time.time()
        with tarfile.open(tmp, "w") as tar:
            for key, recs in by_key.items():
                stem = member_key(key)
                caption = next((r.get("caption") for r in recs if r.get("caption") is not None), None)
                members = []
                if caption is not None:
                    members.append((f"{stem}.txt", caption.encode("utf-8")))
                body = {"key": key, "records": recs}
                members.append((f"{stem}.json", json.dumps(body, ensure_ascii=False).encode("utf-8")))
                for name, data in members:
                    info = tarfile.TarInfo(name)
                    info.size, info.mtime, info.mode = len(data), int(now), 0o644
                    tar.addfile(info, io.BytesIO(data))
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, self.out / f"{shard.stem}.tar")
        super().finish_shard(shard, samples, errors)
        journal.unlink(missing_ok=True)

    def close(self) -> None:
        for w in self._writers.values():
            w.close()
        self._writers.clear()
        super().close()


def read_tar_records(path: Path) -> list[dict[str, Any]]:
    """Every record in a caption tar (for tests and tools)."""
    out = []
    with tarfile.open(path) as tar:
        for info in tar:
            if info.name.endswith(".json"):
                f = tar.extractfile(info)
                assert f is not None
                out.extend(json.loads(f.read())["records"])
    return out
