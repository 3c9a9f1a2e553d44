"""Caption sources as shards: a shard is read sample by sample (never the whole dataset
in memory) and is the unit of output and resume.

- files and folders (images, videos, audio): sorted, in shards of ``files_per_shard``
  whose ids hash the names they hold, so a folder that grows gets new shard ids;
- WebDataset tar shards, brace patterns included (``shards/{00000..00127}.tar``);
- Parquet files or folders of them, a binary or a URL column (``column``);
- ``.txt``/``.urls`` files of URLs, one per line, fetched through the SSRF-safe fetcher.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from api.batch.samples import Sample

FILES_PER_SHARD = 1000
URLS_PER_SHARD = 1000
_BRACE = re.compile(r"\{(\d+)\.\.(\d+)\}")


@dataclass(frozen=True)
class UrlOptions:
    """How URL samples are fetched: the fetcher's rules (``api.http.security.remote_media``),
    retries of transient failures and the concurrency per host."""

    allow_http: bool = False
    allow_private_networks: bool = False
    trusted_addresses: tuple[str, ...] = ()
    retries: int = 2
    per_host: int = 4
    total_timeout: float = 30.0
    max_bytes: int | None = None


@dataclass(frozen=True)
class Shard:
    """One shard of a source; picklable, so a worker process can read it."""

    id: str
    kind: str  # "files", "webdataset", "parquet", "urls"
    path: str = ""
    names: tuple[str, ...] = ()
    """files: the file paths; urls: the URLs (with ``first`` the first line's index)."""
    first: int = 0
    column: str | None = None
    url_options: UrlOptions = field(default_factory=UrlOptions)

    @property
    def stem(self) -> str:
        """A file-name-safe name for this shard's outputs."""
        if self.kind in ("webdataset", "parquet"):
            return Path(self.path).name.split(".")[0]
        return re.sub(r"[^A-Za-z0-9._-]+", "_", self.id)

    def samples(self) -> Iterator[Sample]:
        if self.kind == "files":
            from api.batch.file_source import file_samples

            return file_samples(self)
        if self.kind == "webdataset":
            from api.batch.webdataset_source import tar_samples

            return tar_samples(self)
        if self.kind == "parquet":
            from api.batch.parquet_source import parquet_samples

            return parquet_samples(self)
        if self.kind == "urls":
            from api.batch.url_source import url_samples

            return url_samples(self)
        raise ValueError(f"unknown shard kind {self.kind!r}")


def expand_braces(pattern: str) -> list[str]:
    """``a/{000..002}.tar`` -> ``a/000.tar a/001.tar a/002.tar`` (zero padding kept;
    several ranges expand as a product, left to right)."""
    m = _BRACE.search(pattern)
    if m is None:
        return [pattern]
    lo, hi = m.group(1), m.group(2)
    width = len(lo) if lo.startswith("0") or len(lo) == len(hi) else 0
    out = []
    for i in range(int(lo), int(hi) + 1):
        out.extend(expand_braces(pattern[: m.start()] + str(i).zfill(width) + pattern[m.end() :]))
    return out


def _digest(names: Iterable[str]) -> str:
    h = hashlib.sha256()
    for n in names:
        h.update(n.encode("utf-8", "surrogateescape") + b"\0")
    return h.hexdigest()[:10]


def _kind_of_path(p: Path) -> str:
    name = p.name.lower()
    if name.endswith((".tar", ".tar.gz", ".tgz")):
        return "webdataset"
    if name.endswith(".parquet"):
        return "parquet"
    if name.endswith((".urls", ".urls.txt")):
        return "urls"
    return "files"


def open_shards(
    inputs: Iterable[str | os.PathLike[str]],
    *,
    column: str | None = None,
    exclude: Path | None = None,
    files_per_shard: int = FILES_PER_SHARD,
    url_options: UrlOptions | None = None,
    urls: bool = False,
) -> list[Shard]:
    """The shards of every input, in order. A folder holding ``.tar`` or ``.parquet``
    files is read as those shards; any other folder as media files. ``urls=True`` reads
    every plain file input as a list of URLs (so does a ``.urls`` file)."""
    from api.batch.file_source import expand_paths

    url_options = url_options or UrlOptions()
    shards: list[Shard] = []
    loose: list[Path] = []

    def flush_loose() -> None:
        for i in range(0, len(loose), files_per_shard):
            chunk = [str(p) for p in loose[i : i + files_per_shard]]
            shards.append(
                Shard(
                    id=f"files-{i // files_per_shard:05d}-{_digest(chunk)}", kind="files", names=tuple(chunk)
                )
            )
        loose.clear()

    for raw in inputs:
        for item in expand_braces(str(raw)):
            p = Path(item)
            if p.is_dir():
                inner = sorted(f for f in p.iterdir() if f.is_file() and not f.name.startswith("."))
                kinds = {_kind_of_path(f) for f in inner}
                if inner and kinds <= {"webdataset"} or kinds == {"parquet"}:
                    for f in inner:
                        shards.append(_data_shard(f, column))
                    continue
                loose.extend(expand_paths([p], exclude=exclude))
                continue
            kind = "urls" if urls and p.suffix.lower() in (".txt", ".urls", "") else _kind_of_path(p)
            if kind == "files":
                loose.extend(expand_paths([p], exclude=exclude))
            elif kind == "urls":
                flush_loose()
                shards.extend(_url_shards(p, url_options))
            else:
                flush_loose()
                shards.append(_data_shard(p, column))
    flush_loose()
    return shards


def _data_shard(p: Path, column: str | None) -> Shard:
    kind = _kind_of_path(p)
    return Shard(id=str(p), kind=kind, path=str(p), column=column if kind == "parquet" else None)


def _url_shards(p: Path, options: UrlOptions) -> list[Shard]:
    """A URL list in shards of ``URLS_PER_SHARD`` lines (read line by line; a shard holds
    its own URLs, a few hundred KB at most)."""
    out: list[Shard] = []
    chunk: list[str] = []
    first = 0

    def close(start: int) -> None:
        if chunk:
            out.append(
                Shard(
                    id=f"{p}@{start:09d}-{_digest(chunk)}",
                    kind="urls",
                    path=str(p),
                    names=tuple(chunk),
                    first=start,
                    url_options=options,
                )
            )

    with p.open(encoding="utf-8") as f:
        n = 0
        for line in f:
            chunk.append(line.strip())
            n += 1
            if len(chunk) == URLS_PER_SHARD:
                close(first)
                chunk, first = [], n
    close(first)
    return out


def metadata_value(metadata: dict[str, Any], field_name: str) -> Any:
    """``metadata[a][b]`` for ``a.b`` (a WebDataset ``.json``'s nested fields)."""
    cur: Any = metadata
    for part in field_name.split("."):
        if not isinstance(cur, dict) or part not in cur:
            return None
        cur = cur[part]
    return cur
