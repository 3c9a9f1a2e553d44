"""URLs as a caption source: a text file of URLs (one per line) or a Parquet URL column.

Every URL goes through the service's SSRF-safe fetcher (``api.http.security.remote_media``:
public addresses only, checked redirects, size and time caps), at most
``UrlOptions.per_host`` at once per host, and a transient failure (a timeout, a refused
connection, a 5xx or 429) is tried again up to ``UrlOptions.retries`` times with a short
backoff. A URL that still fails is an error sample with the fetcher's typed error."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

from api.batch.samples import Sample

FETCH_AHEAD = 32
"""URLs of a shard fetched at once (the shard's samples go on in order)."""
BACKOFF_S = 0.2


def url_samples(shard: Any) -> Iterator[Sample]:
    batch: list[Sample] = []
    for i, url in enumerate(shard.names):
        line = shard.first + i
        s = Sample(key=f"{line:09d}", shard=shard.id, name=url or f"{shard.path}:{line + 1}", url=url or None)
        if not url or url.startswith("#"):
            s.error = {"code": "invalid_url", "message": f"{shard.path}:{line + 1}: no URL on this line"}
            s.url = None
        batch.append(s)
        if len(batch) == FETCH_AHEAD:
            fetch_many(batch, shard.url_options)
            yield from batch
            batch = []
    if batch:
        fetch_many(batch, shard.url_options)
        yield from batch


def _transient(e: BaseException) -> bool:
    from api.http.security.remote_media import RemoteMediaFetchError, RemoteMediaTimeoutError

    if isinstance(e, RemoteMediaTimeoutError):
        return True
    if isinstance(e, RemoteMediaFetchError):
        status = getattr(e, "details", {}).get("status") if hasattr(e, "details") else None
        return status is None or status == 429 or int(status) >= 500
    return False


def fetch_many(samples: list[Sample], options: Any) -> None:
    """Fill ``data`` (or ``error``) of every sample with a ``url``, concurrently."""
    todo = [s for s in samples if s.url is not None and s.error is None]
    if todo:
        asyncio.run(_fetch_all(todo, options))


async def _fetch_all(samples: list[Sample], options: Any) -> None:
    from api.batch.records import error_dict
    from api.http.security.remote_media import MediaFetcher
    from media import DEFAULT_LIMITS

    fetcher = MediaFetcher(
        allow_http=options.allow_http,
        allow_private_networks=options.allow_private_networks,
        trusted_addresses=options.trusted_addresses,
        total_timeout=options.total_timeout,
        max_bytes=options.max_bytes or DEFAULT_LIMITS.max_bytes,
    )
    hosts: dict[str, asyncio.Semaphore] = {}

    async def one(s: Sample) -> None:
        assert s.url is not None
        host = (urlsplit(s.url).hostname or "").lower()
        sem = hosts.setdefault(host, asyncio.Semaphore(options.per_host))
        for attempt in range(options.retries + 1):
            try:
                async with sem:
                    got = await fetcher.fetch(s.url)
            except Exception as e:  # typed PieMediaErrors; anything else is the sample's error too
                if attempt < options.retries and _transient(e):
                    await asyncio.sleep(BACKOFF_S * (2**attempt))
                    continue
                s.error = error_dict(e)
                if attempt:
                    s.error["attempts"] = attempt + 1
                return
            s.data = got.data
            return

    await asyncio.gather(*(one(s) for s in samples))
