"""The resolver decodes a repeated image or clip once (bounded LRU), never a video."""

from __future__ import annotations

import asyncio
from pathlib import Path

from api.http.media_refs import DecodedMediaCache, MediaResolver
from api.http.security.keys import LocalMediaPolicy, MediaFetcher
from api.http.stores.uploads import MediaStore
from media import DEFAULT_LIMITS, Image


def _resolver(tmp: Path) -> MediaResolver:
    return MediaResolver(
        MediaStore(tmp / "store"), MediaFetcher(), LocalMediaPolicy(None, max_bytes=1 << 20), DEFAULT_LIMITS
    )


def test_repeated_bytes_decode_once(tmp_path: Path, samples: Path) -> None:
    r = _resolver(tmp_path)
    jpg = (samples / "images" / "photo_640x480.jpg").read_bytes()
    wav = (samples / "audio" / "tone_16k_mono.wav").read_bytes()
    mp4 = (samples / "video" / "h264_320x240_30fps_3s.mp4").read_bytes()

    async def run():
        a = await r.decode(jpg, "image")
        b = await r.decode(jpg, "image")
        c = await r.decode(wav, "audio")
        d = await r.decode(wav, "audio")
        v1 = await r.decode(mp4, "video")
        v2 = await r.decode(mp4, "video")
        return a, b, c, d, v1, v2

    a, b, c, d, v1, v2 = asyncio.run(run())
    assert a is b and c is d and v1 is not v2
    assert (r.decoded.hits, r.decoded.misses) == (2, 2)


def test_budget_evicts_least_recent(samples: Path) -> None:
    img = Image.from_path(samples / "images" / "rgba.png")
    cache = DecodedMediaCache(byte_budget=2 * img.nbytes)
    for i in range(3):
        cache.put(("image", str(i)), img)
    assert cache.get(("image", "0")) is None
    assert cache.get(("image", "1")) is img and cache.get(("image", "2")) is img
    assert (len(cache), cache.nbytes) == (2, 2 * img.nbytes)
    big = DecodedMediaCache(byte_budget=img.nbytes - 1)
    big.put(("image", "x"), img)
    assert big.get(("image", "x")) is None and big.nbytes == 0


def test_a_zero_budget_keeps_nothing(tmp_path: Path, samples: Path) -> None:
    """--decoded-media-cache-mib 0: every request decodes its bytes afresh."""
    r = MediaResolver(
        MediaStore(tmp_path / "store"),
        MediaFetcher(),
        LocalMediaPolicy(None, max_bytes=1 << 20),
        DEFAULT_LIMITS,
        decoded_cache_bytes=0,
    )
    png = (samples / "images" / "rgba.png").read_bytes()

    async def twice():
        return await r.decode(png, "image"), await r.decode(png, "image")

    a, b = asyncio.run(twice())
    assert a is not b and a.content_hash == b.content_hash and r.decoded.nbytes == 0


def test_fast_token_chunk_equals_the_pydantic_one() -> None:
    from api.http.routes.chat import chunk_head, token_chunk
    from api.http.schemas.chat import ChatCompletionChunk, ChunkChoice, Delta

    head = chunk_head("chatcmpl-1", 17, 'tiny "model"')
    for index, text in [(0, "hi"), (3, 'quote " backslash \\ newline \n'), (1, "日本語 ✓"), (0, "\u2028")]:
        chunk = ChatCompletionChunk(
            id="chatcmpl-1",
            created=17,
            model='tiny "model"',
            choices=[ChunkChoice(index=index, delta=Delta(content=text))],
        )
        assert token_chunk(head, index, text) == f"data: {chunk.model_dump_json(exclude_none=True)}\n\n"


def test_data_urls_small_and_large_resolve_once_each(tmp_path: Path, samples: Path) -> None:
    """Small payloads are decoded from base64 and found in the cache on the loop, large ones
    on a thread: either way the same decoded object, and each counted once."""
    import base64

    from api.http.media_refs import INLINE_BYTES

    r = _resolver(tmp_path)
    small = (samples / "images" / "rgba.png").read_bytes()
    large = (samples / "images" / "photo_1024x768.png").read_bytes()
    assert len(small) < INLINE_BYTES < len(large)
    urls = [f"data:image/png;base64,{base64.b64encode(b).decode()}" for b in (small, large)]

    async def run():
        return [await r.from_url(u, "image") for u in urls + urls]

    s1, l1, s2, l2 = asyncio.run(run())
    assert s1 is s2 and l1 is l2
    assert s1.content_hash == Image.from_bytes(small).content_hash
    assert l1.content_hash == Image.from_bytes(large).content_hash
    assert (r.decoded.hits, r.decoded.misses) == (2, 2)
