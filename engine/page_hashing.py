"""Content hashes of committed KV pages (the key of the automatic prefix cache).

A page's K/V depends on everything before it and everything in it, so its key is a
chain: ``hash(parent page key, this page's rows)``. A row contributes

* its token id,
* for a media row, the media identity (``Prepared.cache_key``: model fingerprint, the
  media's content hash, preparation parameters) and the row's offset inside the span,
  because the K/V of a placeholder row comes from the embedding, not from the id:
  two different images after the same prefix have the same ids and must never share
  a page (Pie hashes token ids only and collides here);
* its position ids (all M-RoPE axes). For a given history the positions are a
  function of the tokens and media before them, so the chain already determines them;
  hashing them anyway costs nothing and keeps the key honest if explicit positions are
  ever allowed (drafters, masked ranges).

The row *kind* (text / media) is encoded unambiguously, so a text row whose id happens
to equal a placeholder id never matches a media row.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass

PageKey = bytes


@dataclass(frozen=True, slots=True)
class MediaRow:
    """What identifies the K/V-relevant content of one media row."""

    key: str
    """``Prepared.cache_key`` of the span the row belongs to."""
    offset: int
    """Row index inside the span (delimiters included)."""


def page_key(
    parent: PageKey | None,
    tokens: Sequence[int],
    media: Sequence[MediaRow | None],
    positions: Sequence[Sequence[int]],
    salt: bytes = b"",
) -> PageKey:
    """Key of a full page whose rows are ``tokens``/``media``/``positions`` (one entry per
    row; ``positions[i]`` holds every position axis of row ``i``)."""
    if not (len(tokens) == len(media) == len(positions)):
        raise ValueError("tokens, media and positions must describe the same rows")
    h = hashlib.blake2b(digest_size=16)
    h.update(b"P" + (parent if parent is not None else b"\x00" * 16))
    h.update(struct.pack("<I", len(tokens)))
    if salt:  # what else shaped the K/V (the LoRA adapter stack): never shared across it
        h.update(b"A" + struct.pack("<I", len(salt)) + salt)
    for tok, m, pos in zip(tokens, media, positions, strict=True):
        h.update(struct.pack("<q", tok))
        h.update(struct.pack("<B", len(pos)))
        h.update(struct.pack(f"<{len(pos)}q", *pos))
        if m is None:
            h.update(b"t")
        else:
            key = m.key.encode()
            h.update(b"m" + struct.pack("<Iq", len(key), m.offset) + key)
    return h.digest()
