"""Media named in a request (a URL of some scheme, or inline base64) -> a decoded
``media`` object. Decoding runs on a worker thread so the event loop keeps serving.

Schemes: ``data:`` (inline, parsed by ``media``), ``pie-media://ID`` (an upload in the
store), ``https://`` (and ``http://`` when allowed) through the SSRF-checked fetcher,
``file://`` only under ``--allowed-local-media-path``.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import functools
import threading
from collections import OrderedDict
from typing import Any

from api.http.errors import ServiceError
from api.http.security.keys import LocalMediaPolicy, MediaFetcher
from api.http.security.tenancy import current_caller
from api.http.stores.uploads import MediaStore
from media import Audio, Image, InvalidRequestError, MediaLimits, Video, content_hash, decode_data_url

DECODERS: dict[str, Any] = {"image": Image, "audio": Audio, "video": Video}
UPLOAD_SCHEME = "pie-media://"
DECODED_CACHE_BYTES = 256 * 1024 * 1024


class DecodedMediaCache:
    """Decoded images and audio by (kind, hash of the encoded bytes), LRU within a byte
    budget: a client that sends the same image with every request pays its decode once
    (the encoder cache then skips preparation and the tower too). Images and audio are
    immutable, so one object is safely shared; videos decode frames lazily from a
    stateful source and are not cached."""

    def __init__(self, byte_budget: int = DECODED_CACHE_BYTES):
        self.byte_budget = byte_budget
        self._items: OrderedDict[tuple[str, str], tuple[Any, int]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    @staticmethod
    def cost(media: Any) -> int:
        return int(media.nbytes if isinstance(media, Image) else media.samples.nbytes)

    def get(self, key: tuple[str, str]) -> Any | None:
        with self._lock:
            item = self._items.get(key)
            if item is None:
                self.misses += 1
                return None
            self._items.move_to_end(key)
            self.hits += 1
            return item[0]

    def put(self, key: tuple[str, str], media: Any) -> None:
        size = self.cost(media)
        if size > self.byte_budget:
            return
        with self._lock:
            if key in self._items:
                return
            self._items[key] = (media, size)
            self._bytes += size
            while self._bytes > self.byte_budget:
                _, (_, dropped) = self._items.popitem(last=False)
                self._bytes -= dropped

    @property
    def nbytes(self) -> int:
        """Bytes of decoded media held now (at most ``byte_budget``)."""
        return self._bytes

    def __len__(self) -> int:
        return len(self._items)

    def __repr__(self) -> str:
        return f"DecodedMediaCache({len(self._items)} items, {self._bytes} bytes, hits={self.hits}, misses={self.misses})"


INLINE_BYTES = 64 * 1024
"""Payloads up to this size are base64-decoded and looked up in the decoded cache on the event
loop: a sha256 of 64 KiB is ~40 us, less than a hop to a worker thread and back under load
(two hops per request showed as 6% of the server's loop in bench/serve.py's profile). Larger
payloads, and every decode that misses the cache, still run on a thread."""


class MediaResolver:
    def __init__(
        self,
        store: MediaStore,
        fetcher: MediaFetcher,
        local: LocalMediaPolicy,
        limits: MediaLimits,
        decoded_cache_bytes: int = DECODED_CACHE_BYTES,
    ):
        self.store = store
        self.fetcher = fetcher
        self.local = local
        self.limits = limits
        self.decoded = DecodedMediaCache(decoded_cache_bytes)

    async def from_url(self, url: str, kind: str) -> Any:
        """The ``kind`` media object a URL names."""
        if url.startswith(UPLOAD_SCHEME):
            return await self.from_upload(url[len(UPLOAD_SCHEME) :], kind)
        scheme = url.split(":", 1)[0].lower() if ":" in url[:16] else ""
        if scheme == "data":
            if len(url) <= INLINE_BYTES * 4 // 3 + 256:  # base64 of INLINE_BYTES, plus the header
                data = decode_data_url(url, kind=kind, limits=self.limits)
            else:
                data = await asyncio.to_thread(decode_data_url, url, kind=kind, limits=self.limits)
        elif scheme in ("http", "https"):
            data = (await self.fetcher.fetch(url)).data
        elif scheme == "file":
            data = await asyncio.to_thread(self.local.read, url)
        else:
            raise InvalidRequestError(
                f"unsupported {kind} URL scheme {scheme or url[:16]!r}; use data:, https://, "
                f"{UPLOAD_SCHEME}<id> (from POST /v1/media) or file:// (when the server allows a folder)",
                kind=kind,
            )
        return await self.decode(data, kind)

    async def from_base64(self, payload: str, kind: str) -> Any:
        max_chars = (self.limits.max_bytes + 2) // 3 * 4 + 8
        if len(payload) > max_chars:
            raise InvalidRequestError(
                f"inline {kind} is {len(payload)} base64 characters, over the limit of {max_chars}",
                kind=kind,
                limit=max_chars,
                actual=len(payload),
            )
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as e:
            raise InvalidRequestError(f"inline {kind} data is not valid base64: {e}", kind=kind) from None
        return await self.decode(data, kind)

    async def from_upload(self, media_id: str, kind: str) -> Any:
        scope = current_caller().scope  # another tenant's upload is as unknown as a missing one
        record = await asyncio.to_thread(functools.partial(self.store.get, media_id, scope=scope))
        if record is None:
            raise ServiceError("media_not_found", f"no uploaded media with id {media_id!r}", param="url")
        if record.kind != kind:
            raise InvalidRequestError(f"{UPLOAD_SCHEME}{media_id} is {record.kind}, not {kind}", kind=kind)
        data = await asyncio.to_thread(functools.partial(self.store.read_bytes, media_id, scope=scope))
        return await self.decode(data, kind)

    async def decode(self, data: bytes, kind: str) -> Any:
        if kind == "video":
            return await asyncio.to_thread(Video.from_bytes, data, self.limits)
        key = None
        if len(data) <= INLINE_BYTES:
            key = (kind, content_hash(data))
            media = self.decoded.get(key)
            if media is not None:
                return media
        return await asyncio.to_thread(self._decode_cached, data, kind, key)

    def _decode_cached(self, data: bytes, kind: str, missed: tuple[str, str] | None = None) -> Any:
        """The decoded media (``missed``: its key, already looked up and not found)."""
        key = missed or (kind, content_hash(data))
        media = None if missed else self.decoded.get(key)
        if media is None:
            media = DECODERS[kind].from_bytes(data, self.limits)
            self.decoded.put(key, media)
        return media
