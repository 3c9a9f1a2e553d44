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


_LENGTH = struct.Struct("<I")
_MEDIA = struct.Struct("<Iq")
_ROW_BY_AXES: dict[int, struct.Struct] = {}


def _row_struct(axes: int) -> struct.Struct:
    """``<q`` token, ``<B`` axis count, ``<{axes}q`` positions, packed in one call."""
    row = _ROW_BY_AXES.get(axes)
    if row is None:
        row = _ROW_BY_AXES[axes] = struct.Struct(f"<qB{axes}q")
    return row


def page_key(
    parent: PageKey | None,
    tokens: Sequence[int],
    media: Sequence[MediaRow | None],
    positions: Sequence[Sequence[int]],
    salt: bytes = b"",
) -> PageKey:
    """Key of a full page whose rows are ``tokens``/``media``/``positions`` (one entry per
    row; ``positions[i]`` holds every position axis of row ``i``).

    The bytes hashed, in order: ``b"P"`` and the parent key (16 zero bytes for none), the
    row count (``<I``), ``b"A"`` + length (``<I``) + salt when there is a salt, then per
    row the token (``<q``), its axis count (``<B``) and positions (``<q`` each), and
    ``b"t"`` for a text row or ``b"m"`` + key length and offset (``<Iq``) + the media key
    (UTF-8). They are joined and hashed at once: one update per row part cost more than
    the hashing (an image adds a row per token)."""
    if not (len(tokens) == len(media) == len(positions)):
        raise ValueError("tokens, media and positions must describe the same rows")
    parts = [b"P", parent if parent is not None else b"\x00" * 16, _LENGTH.pack(len(tokens))]
    if salt:  # what else shaped the K/V (the LoRA adapter stack): never shared across it
        parts += (b"A", _LENGTH.pack(len(salt)), salt)
    key_str, key = None, b""
    axes = len(positions[0]) if positions else 1  # rows of a page share their axis count
    row = _row_struct(axes)
    for tok, m, pos in zip(tokens, media, positions, strict=True):
        if len(pos) != axes:
            axes, row = len(pos), _row_struct(len(pos))
        parts.append(row.pack(tok, axes, *pos))
        if m is None:
            parts.append(b"t")
        else:
            if m.key is not key_str:  # a span's rows share one key string
                key_str, key = m.key, m.key.encode()
            parts += (b"m", _MEDIA.pack(len(key), m.offset), key)
    return hashlib.blake2b(b"".join(parts), digest_size=16).digest()
