"""Content hashes: the identity of a media object for caches and KV-page hashing."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable


def content_hash(data: bytes | memoryview, *salt: object) -> str:
    """SHA-256 of the raw bytes plus any decode-affecting options, truncated to 128 bits
    (32 hex digits).

    Hashing the encoded bytes (not the decoded pixels) needs no decode; options that
    change the decoded result (e.g. the background colour for transparent images) are
    folded in via ``salt`` so different results never share a hash. SHA-256 rather than
    BLAKE2b: with the SHA extensions every current x86 and ARM server CPU has, it runs
    ~1.5 GB/s against BLAKE2b's ~0.5 GB/s (measured here: 0.6 vs 2.0 ms per MB).
    """
    return content_hash_parts((data,), *salt)


def content_hash_parts(parts: Iterable[bytes | memoryview], *salt: object) -> str:
    """``content_hash`` of the concatenation of ``parts`` (hashed as they come, never
    joined: large pixel buffers are hashed band by band)."""
    h = hashlib.sha256()
    for part in parts:
        h.update(memoryview(part))
    for s in salt:
        h.update(b"\x00")
        h.update(repr(s).encode())
    return h.hexdigest()[:32]
