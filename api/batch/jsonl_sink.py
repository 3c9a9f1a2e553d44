"""JSONL output: one record per line in one file, appended and fsync'ed as records are
made (see ``api.batch.sinks``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from api.batch.journal import JournalWriter, cut_torn_tail, iter_records
from api.batch.ledger import Ledger, load_index
from api.batch.sinks import Sink


class JsonlSink(Sink):
    format = "jsonl"

    def __init__(self, out: Path, fingerprint: str, settings: dict[str, Any]):
        super().__init__(out, fingerprint, settings)
        self.torn_bytes = cut_torn_tail(out)
        self.index = load_index(iter_records(out), settings, set(self.ledger.done))
        self._writer = JournalWriter(out)

    def _open_ledger(self) -> Ledger:
        return Ledger(self.out.with_name(self.out.name + ".shards"), self.fingerprint)

    def write(self, shard: Any, rec: dict[str, Any]) -> None:
        self._writer.write(rec)

    def close(self) -> None:
        self._writer.close()
        super().close()
