"""Parquet output: one real ``.parquet`` file (see ``api.batch.sinks``).

While the job runs, each shard's records are journaled in
``<out>.parts/<shard>.jsonl``; a finished shard becomes ``<out>.parts/<shard>.parquet``
(written whole, then renamed) and a ledger line. ``close`` writes the file: the rows of
an earlier ``<out>`` first (so a rerun that adds shards keeps them), then each part as a
row group, into a temporary file renamed over ``<out>``; then the parts folder goes.
A part whose shard is already in the earlier file (a run killed between the rename and
the clean-up) is left out, so nothing is written twice."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path
from typing import Any

from api.batch.journal import JournalWriter, cut_torn_tail, iter_records
from api.batch.ledger import Ledger, load_index, settings_of
from api.batch.records import arrow_schema, from_row, to_row
from api.batch.sinks import Sink

ROW_GROUP = 4096


def _part_name(shard_id: str, stem: str) -> str:
    return f"{stem}-{hashlib.sha256(shard_id.encode()).hexdigest()[:8]}"


class ParquetSink(Sink):
    format = "parquet"

    def __init__(self, out: Path, fingerprint: str, settings: dict[str, Any]):
        self.parts = out.with_name(out.name + ".parts")
        super().__init__(out, fingerprint, settings)
        self.parts.mkdir(parents=True, exist_ok=True)
        self._earlier_shards: set[str] = set()
        earlier = list(self._earlier_records())
        for rec in earlier:
            if settings_of(rec) == settings and rec.get("shard"):
                self._earlier_shards.add(rec["shard"])
        done = set(self.ledger.done) | self._earlier_shards
        journals = []
        for j in sorted(self.parts.glob("*.jsonl")):
            if j.name == "ledger.jsonl":
                continue
            self.torn_bytes += cut_torn_tail(j)
            journals.extend(iter_records(j))
        self.index = load_index([*earlier, *journals], settings, done)
        for shard in self._earlier_shards:
            if shard not in self.ledger.done:
                self.ledger.done[shard] = {"shard": shard, "samples": 0, "errors": 0, "earlier": True}
        self._writers: dict[str, JournalWriter] = {}

    def _open_ledger(self) -> Ledger:
        return Ledger(self.parts / "ledger.jsonl", self.fingerprint)

    def _earlier_records(self) -> Any:
        if not self.out.exists():
            return
        import pyarrow.parquet as pq

        pf = pq.ParquetFile(self.out)
        for batch in pf.iter_batches(batch_size=ROW_GROUP):
            for row in batch.to_pylist():
                yield from_row(row)

    def write(self, shard: Any, rec: dict[str, Any]) -> None:
        w = self._writers.get(shard.id)
        if w is None:
            w = self._writers[shard.id] = JournalWriter(
                self.parts / f"{_part_name(shard.id, shard.stem)}.jsonl"
            )
        w.write(rec)

    def finish_shard(self, shard: Any, samples: int, errors: int) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        name = _part_name(shard.id, shard.stem)
        w = self._writers.pop(shard.id, None)
        if w is not None:
            w.close()
        journal = self.parts / f"{name}.jsonl"
        rows = [to_row(r) for r in iter_records(journal)]
        tmp = self.parts / f"{name}.parquet.tmp"
        pq.write_table(pa.Table.from_pylist(rows, schema=arrow_schema()), tmp)
        os.replace(tmp, self.parts / f"{name}.parquet")
        super().finish_shard(shard, samples, errors)
        journal.unlink(missing_ok=True)

    def close(self) -> None:
        for w in self._writers.values():
            w.close()
        self._writers.clear()
        super().close()
        if any(self.parts.glob("*.jsonl")) and any(
            j.name != "ledger.jsonl" for j in self.parts.glob("*.jsonl")
        ):
            return  # an unfinished shard: the file is written when every shard is done
        self._merge()

    def _merge(self) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        parts = sorted(self.parts.glob("*.parquet"))
        if not parts and self.out.exists():
            shutil.rmtree(self.parts, ignore_errors=True)
            return
        tmp = self.out.with_name(self.out.name + ".tmp")
        schema = arrow_schema()
        with pq.ParquetWriter(tmp, schema) as writer:
            if self.out.exists():
                pf = pq.ParquetFile(self.out)
                for i in range(pf.num_row_groups):
                    writer.write_table(pf.read_row_group(i).cast(schema))
            for part in parts:
                table = pq.read_table(part)
                if self._earlier_shards and table.num_rows:
                    shards = set(table.column("shard").to_pylist())
                    if shards & self._earlier_shards:
                        continue
                writer.write_table(
                    table.cast(schema) if table.num_rows else pa.Table.from_pylist([], schema=schema)
                )
        os.replace(tmp, self.out)
        shutil.rmtree(self.parts, ignore_errors=True)
