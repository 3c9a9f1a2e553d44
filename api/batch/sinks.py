"""Where a batch job's records go, shard by shard, resumably.

Every sink journals each record as it is made (an fsync'ed JSONL line) and, once a
shard's last record is in, makes that shard's output final and notes the shard in its
ledger (``api.batch.ledger``). A killed run therefore loses nothing that was written
and a rerun duplicates nothing: finished shards are skipped whole, and within the
unfinished ones every record already journaled is skipped.

- ``jsonl``: the output file is the journal (``captions.jsonl``), the ledger is
  ``captions.jsonl.shards`` beside it.
- ``parquet``: one real Parquet file. Each finished shard becomes a part
  (``captions.parquet.parts/``); at the end of the run the parts (and the rows of an
  earlier ``captions.parquet``) are written into the file, a row group per part, and the
  parts are removed.
- ``webdataset``: a folder of caption-only tar shards mirroring the input's (``<shard>.tar``
  with ``<key>.txt``, the caption, and ``<key>.json``, the sample's records), as
  img2dataset writes them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from api.batch.ledger import DoneIndex, Ledger

FORMATS = ("jsonl", "parquet", "webdataset")


class Sink:
    """Base: a ledger, a done index, records in, shards finished."""

    format = ""

    def __init__(self, out: Path, fingerprint: str, settings: dict[str, Any]):
        self.out = out
        self.fingerprint = fingerprint
        self.settings = settings
        self.ledger = self._open_ledger()
        self.index = DoneIndex()
        self.torn_bytes = 0

    def _open_ledger(self) -> Ledger:
        raise NotImplementedError

    def write(self, shard: Any, rec: dict[str, Any]) -> None:
        raise NotImplementedError

    def finish_shard(self, shard: Any, samples: int, errors: int) -> None:
        self.ledger.finish(shard.id, samples, errors)

    def close(self) -> None:
        self.ledger.close()


def format_for(out: Path, asked: str | None) -> str:
    if asked is not None:
        if asked not in FORMATS:
            raise ValueError(f"--out-format must be one of {', '.join(FORMATS)}, got {asked!r}")
        return asked
    name = out.name.lower()
    if name.endswith(".parquet"):
        return "parquet"
    if name.endswith((".jsonl", ".ndjson", ".json")):
        return "jsonl"
    if out.is_dir() or not out.suffix:
        return "webdataset"
    raise ValueError(
        f"cannot tell the output format of {out} from its name: use .jsonl, .parquet or a folder "
        "with --out-format webdataset"
    )
