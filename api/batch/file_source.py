"""Files and folders as a caption source."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path


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
        out.extend(f for f in found if skip is None or f.resolve() != skip)
    return out
