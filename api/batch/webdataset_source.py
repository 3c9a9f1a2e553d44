"""WebDataset tar shards as a caption source.

A shard is read as a stream (``tarfile`` mode ``r|*``: one member at a time, gzip too).
Members are grouped into samples by key, the path up to the first dot of the file name
(``000123.jpg`` and ``000123.json`` are sample ``000123``), as WebDataset does; a
sample's members are consecutive in the tar. The media member is the first image,
video or audio member by extension; ``.json`` (parsed) and ``.txt`` (text) members are
kept as metadata. A sample with no media member, a member that cannot be read and a
shard cut off mid-member each give an error sample; the shard goes on where it can.
"""

from __future__ import annotations

import json
import tarfile
from collections.abc import Iterator
from typing import Any

from api.batch.samples import MEDIA_EXTS, Sample
from media import DEFAULT_LIMITS


def split_member_name(name: str) -> tuple[str, str]:
    """(key, extension) of a member: ``a/b/000123.seg.jpg`` -> (``a/b/000123``, ``seg.jpg``)."""
    slash = name.rfind("/")
    dot = name.find(".", slash + 1)
    if dot < 0:
        return name, ""
    return name[:dot], name[dot + 1 :]


def sample_from_members(
    shard: Any, key: str, members: dict[str, bytes], errors: list[dict[str, Any]]
) -> Sample:
    """One sample from its members (extension -> bytes, in tar order), as described above."""
    metadata: dict[str, Any] = {}
    media_ext = None
    for ext, data in members.items():
        last = ext.rsplit(".", 1)[-1].lower()
        if last == "json":
            try:
                value = json.loads(data)
            except ValueError:
                value = None
            if isinstance(value, dict):
                metadata.update(value)
        elif last in ("txt", "caption", "text"):
            metadata[last] = data.decode("utf-8", "replace")
        elif last in MEDIA_EXTS and media_ext is None:
            media_ext = ext
    name = f"{shard.path}/{key}.{media_ext}" if media_ext else f"{shard.path}/{key}"
    base = Sample(key=key, shard=shard.id, name=name, metadata=metadata)
    if errors:
        base.error = errors[0]
    elif media_ext is None:
        base.error = {
            "code": "missing_media",
            "message": f"sample {key!r} of {shard.path} has no image, video or audio member "
            f"(members: {', '.join(sorted(members)) or 'none'})",
        }
    else:
        base.data = members[media_ext]
    return base


def tar_samples(shard: Any) -> Iterator[Sample]:
    key: str | None = None
    members: dict[str, bytes] = {}
    errors: list[dict[str, Any]] = []
    try:
        with tarfile.open(shard.path, mode="r|*") as tar:
            for info in tar:
                if not info.isfile():
                    continue
                k, ext = split_member_name(info.name)
                if k != key:
                    if key is not None:
                        yield sample_from_members(shard, key, members, errors)
                    key, members, errors = k, {}, []
                if info.size > DEFAULT_LIMITS.max_bytes:
                    errors.append(
                        {
                            "code": "too_large",
                            "message": f"member {info.name} is {info.size} bytes, over the limit of "
                            f"{DEFAULT_LIMITS.max_bytes} bytes",
                            "limit": DEFAULT_LIMITS.max_bytes,
                            "actual": info.size,
                        }
                    )
                    continue
                f = tar.extractfile(info)
                assert f is not None
                data = f.read()
                if len(data) < info.size:
                    raise tarfile.ReadError(f"unexpected end of data in member {info.name}")
                members[ext] = data
    except (tarfile.TarError, OSError, EOFError) as e:
        where = f" (in sample {key!r})" if key is not None else ""
        err = {
            "code": "truncated_shard",
            "message": f"{shard.path}: the shard ends early or is damaged{where}: {e}",
        }
        if key is None:
            yield Sample(key="", shard=shard.id, name=shard.path, error=err)
        else:
            yield sample_from_members(shard, key, members, [err])
        return
    if key is not None:
        yield sample_from_members(shard, key, members, errors)
