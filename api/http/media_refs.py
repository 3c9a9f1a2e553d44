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
from typing import Any

from api.http.errors import ServiceError
from api.http.security import LocalMediaPolicy, MediaFetcher
from api.http.store import MediaStore
from media import Audio, Image, InvalidRequestError, MediaLimits, Video, decode_data_url

DECODERS: dict[str, Any] = {"image": Image, "audio": Audio, "video": Video}
UPLOAD_SCHEME = "pie-media://"


class MediaResolver:
    def __init__(
        self, store: MediaStore, fetcher: MediaFetcher, local: LocalMediaPolicy, limits: MediaLimits
    ):
        self.store = store
        self.fetcher = fetcher
        self.local = local
        self.limits = limits

    async def from_url(self, url: str, kind: str) -> Any:
        """The ``kind`` media object a URL names."""
        if url.startswith(UPLOAD_SCHEME):
            return await self.from_upload(url[len(UPLOAD_SCHEME) :], kind)
        scheme = url.split(":", 1)[0].lower() if ":" in url[:16] else ""
        if scheme == "data":
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
        record = await asyncio.to_thread(self.store.get, media_id)
        if record is None:
            raise ServiceError("media_not_found", f"no uploaded media with id {media_id!r}", param="url")
        if record.kind != kind:
            raise InvalidRequestError(f"{UPLOAD_SCHEME}{media_id} is {record.kind}, not {kind}", kind=kind)
        data = await asyncio.to_thread(self.store.read_bytes, media_id)
        return await self.decode(data, kind)

    async def decode(self, data: bytes, kind: str) -> Any:
        return await asyncio.to_thread(DECODERS[kind].from_bytes, data, self.limits)
