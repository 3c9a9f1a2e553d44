"""Files and folders as a caption source: images, videos and audio files, read one at a
time (the shards are built by ``api.batch.sources``)."""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from api.batch.samples import Sample
from media import DEFAULT_LIMITS


def expand_paths(paths: Iterable[str | os.PathLike[str]], *, exclude: Path | None = None) -> list[Path]:
    """Files named directly, plus every non-hidden file under named directories (sorted)."""
    skip = exclude.resolve() if exclude is not None else None
    out: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            found = [
                f
                for f in sorted(p.rglob("*"))
                if f.is_file() and not any(part.startswith(".") for part in f.relative_to(p).parts)
            ]
        else:
            found = [p]
        out.extend(f for f in found if skip is None or not _is_output(f, skip))
    return out


def _is_output(f: Path, out: Path) -> bool:
    """The job's output or one of the files it keeps beside it (``out.shards``, ...)."""
    r = f.resolve()
    return r == out or (r.parent == out.parent and r.name.startswith(out.name + "."))


def file_samples(shard: Any) -> Iterator[Sample]:
    """The files of a ``files`` shard, one read at a time (too large or unreadable ones
    become error samples; nothing is decoded here)."""
    for name in shard.names:
        path = Path(name)
        try:
            size = path.stat().st_size
            if size > DEFAULT_LIMITS.max_bytes:
                yield Sample(
                    key=name,
                    shard=shard.id,
                    name=name,
                    error={
                        "code": "too_large",
                        "message": f"{path}: larger than {DEFAULT_LIMITS.max_bytes} bytes",
                    },
                )
                continue
            data = path.read_bytes()
        except OSError as e:
            yield Sample(
                key=name,
                shard=shard.id,
                name=name,
                error={"code": "unreadable", "message": f"{path}: {e.strerror or e}"},
            )
            continue
        yield Sample(key=name, shard=shard.id, name=name, data=data)
