"""Frames of Pie's client protocol (pie-client 0.4.0, PROTOCOL.md §1-2): one msgpack map
per binary WebSocket frame, with a string ``type``; requests carry a ``corr_id`` and are
answered by ``{"type": "response", "corr_id", "ok", "result"}``, ``result`` always a string.

The client closes its connection on any frame over 1 MiB (``websockets``' default
``max_size``), so what the server sends is cut to fit: results and event values are
truncated past ``MAX_TEXT`` bytes (marked), files go as 256 KiB ``file`` chunks."""

from __future__ import annotations

from typing import Any

import msgpack

CHUNK_BYTES = 256 * 1024
"""Chunk size of uploads and of ``file`` messages, both ways (PROTOCOL.md §5)."""
CLIENT_MAX_FRAME = 1 << 20
"""The client's ``max_size``: a larger frame from the server closes its connection."""
MAX_TEXT = 960 * 1024
"""The most UTF-8 bytes of one result or event value the server sends (under the client's
limit with room for the map around it)."""
TRUNCATED = "\n[truncated by pie-media: over the protocol's 1 MiB frame]"


class FrameError(ValueError):
    """A frame that is not one msgpack map with a string ``type``."""


def decode(data: bytes | str) -> dict[str, Any]:
    """The message of one frame; ``FrameError`` with a reason a person can act on."""
    if isinstance(data, str):
        raise FrameError("a text frame; Pie's protocol sends binary frames holding msgpack maps")
    try:
        msg = msgpack.unpackb(data, raw=False, strict_map_key=False)
    except (msgpack.UnpackException, ValueError, TypeError, UnicodeDecodeError) as e:
        raise FrameError(f"not a msgpack message ({type(e).__name__}: {str(e)[:120]})") from None
    if not isinstance(msg, dict):
        raise FrameError(f"a msgpack {type(msg).__name__}, not a map with a 'type' field")
    if not isinstance(msg.get("type"), str):
        raise FrameError("a map without a string 'type' field")
    return msg


def fit(text: str, limit: int = MAX_TEXT) -> str:
    """``text`` cut (on a character boundary, marked) to at most ``limit`` UTF-8 bytes."""
    raw = text.encode("utf-8", "surrogatepass")
    if len(raw) <= limit:
        return text
    return raw[: limit - len(TRUNCATED.encode())].decode("utf-8", "ignore") + TRUNCATED


def encode(msg: dict[str, Any]) -> bytes:
    return msgpack.packb(msg, use_bin_type=True)


def response(corr_id: Any, ok: bool, result: str) -> bytes:
    return encode({"type": "response", "corr_id": corr_id, "ok": bool(ok), "result": fit(str(result))})


def process_event(process_id: str, event: str, value: str) -> bytes:
    return encode({"type": "process_event", "process_id": process_id, "event": event, "value": fit(value)})


def file_chunks(process_id: str, file_hash: str, data: bytes) -> list[bytes]:
    """A file as ``file`` messages of at most ``CHUNK_BYTES`` each (one empty chunk for
    empty data), as the client reassembles them."""
    total = max(1, -(-len(data) // CHUNK_BYTES))
    return [
        encode(
            {
                "type": "file",
                "process_id": process_id,
                "file_hash": file_hash,
                "chunk_index": i,
                "total_chunks": total,
                "chunk_data": data[i * CHUNK_BYTES : (i + 1) * CHUNK_BYTES],
            }
        )
        for i in range(total)
    ]
