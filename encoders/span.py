"""A media span declared as segments and built into a :class:`~encoders.prepared.Prepared`
the same way for every family.

An encoder lists what its span is, in order: :class:`Text` (ids the span writes as they
are: delimiters, timestamps) and :class:`Placeholders` (a run of rows that receive
embeddings). :func:`build_span` derives the rest once: ``input_ids``, the per-row
:class:`TokenType`, the positions under the model's RoPE, how far the position cursor
moves, the delimiters and the placeholder runs. :meth:`Span.prepared` adds the model
inputs and bookkeeping.

Positions (relative to the span's anchor):

* ``"1d"`` (Gemma-4): every row advances the cursor by one, so positions are
  ``0..len-1``;
* ``"mrope"`` (Qwen3-VL, ``Qwen3VLModel.get_rope_index``): a text row at cursor ``s`` gets
  ``(s, s, s)`` and advances by one; a run of placeholders (one vision group: a whole
  image, or one temporal patch of a video) with merged grid ``h`` x ``w`` at cursor ``s``
  gets ``(s, s + row, s + col)`` and advances the cursor by ``max(h, w)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import Any, Literal

import numpy as np
import torch

from encoders.prepared import MediaKind, Prepared

__all__ = ["Placeholders", "Rope", "Segment", "Span", "Text", "TextIds", "TokenType", "build_span"]

Rope = Literal["1d", "mrope"]


class TokenType(IntEnum):
    """Per-row modality: the values of transformers' ``mm_token_type_ids``."""

    TEXT = 0
    IMAGE = 1
    VIDEO = 2
    AUDIO = 3


@dataclass(frozen=True)
class Text:
    """Rows written as they are (delimiters, timestamp text): :attr:`TokenType.TEXT`."""

    ids: tuple[int, ...]


@dataclass(frozen=True)
class Placeholders:
    """``count`` rows of ``token_id`` that receive encoder embeddings. ``grid`` (rows,
    cols of merged tokens, ``rows * cols == count``) places them under M-RoPE."""

    token_id: int
    token_type: TokenType
    count: int
    grid: tuple[int, int] | None = None


Segment = Text | Placeholders


@dataclass(frozen=True)
class Span:
    """What :func:`build_span` derives from the segments."""

    input_ids: tuple[int, ...]
    token_types: tuple[int, ...]
    positions: torch.Tensor
    position_span: int
    placeholder_id: int
    token_count: int
    prefix_tokens: tuple[int, ...]
    """The opening text segment (empty when the span opens with placeholders)."""
    suffix_tokens: tuple[int, ...]
    """The closing text segment (empty when the span closes with placeholders)."""
    placeholder_runs: tuple[tuple[int, int], ...]
    """Half-open row ranges of consecutive placeholder rows."""

    def prepared(
        self,
        *,
        kind: MediaKind,
        family: str,
        grid: tuple[int, int, int],
        inputs: dict[str, torch.Tensor],
        content_hash: str,
        cache_key: str,
        meta: dict[str, Any],
        timestamps: tuple[float, ...] | None = None,
    ) -> Prepared:
        return Prepared(
            kind=kind,
            family=family,
            input_ids=self.input_ids,
            placeholder_id=self.placeholder_id,
            token_count=self.token_count,
            grid=grid,
            positions=self.positions,
            position_span=self.position_span,
            prefix_tokens=self.prefix_tokens,
            suffix_tokens=self.suffix_tokens,
            inputs=inputs,
            content_hash=content_hash,
            cache_key=cache_key,
            mm_token_type=self.token_types,
            timestamps=timestamps,
            meta=meta,
        )


def build_span(segments: Sequence[Segment], *, rope: Rope) -> Span:
    """Ids, token types, positions and delimiters of the span ``segments`` declare."""
    if rope not in ("1d", "mrope"):
        raise ValueError(f"rope must be '1d' or 'mrope', got {rope!r}")
    placeholder_ids = {s.token_id for s in segments if isinstance(s, Placeholders)}
    if len(placeholder_ids) != 1:
        raise ValueError(f"a span needs placeholders of exactly one token id, got {sorted(placeholder_ids)}")
    ids: list[int] = []
    types: list[int] = []
    runs: list[list[int]] = []
    n = sum(len(s.ids) if isinstance(s, Text) else s.count for s in segments)
    axes = 3 if rope == "mrope" else 1
    pos = np.empty((axes, n), dtype=np.int64)
    row = cursor = 0
    for seg in segments:
        if isinstance(seg, Text):
            k = len(seg.ids)
            ids.extend(int(i) for i in seg.ids)
            types.extend([int(TokenType.TEXT)] * k)
            pos[:, row : row + k] = np.arange(cursor, cursor + k)
            advance = k
        else:
            k = seg.count
            ids.extend([int(seg.token_id)] * k)
            types.extend([int(seg.token_type)] * k)
            if runs and runs[-1][1] == row:
                runs[-1][1] = row + k
            else:
                runs.append([row, row + k])
            if rope == "mrope":
                if seg.grid is None or seg.grid[0] * seg.grid[1] != k:
                    raise ValueError(f"M-RoPE placeholders need a grid of {k} tokens, got {seg.grid}")
                gh, gw = seg.grid
                pos[0, row : row + k] = cursor
                pos[1, row : row + k] = cursor + np.repeat(np.arange(gh), gw)
                pos[2, row : row + k] = cursor + np.tile(np.arange(gw), gh)
                advance = max(gh, gw)
            else:
                pos[0, row : row + k] = np.arange(cursor, cursor + k)
                advance = k
        row += k
        cursor += advance
    first, last = segments[0], segments[-1]
    return Span(
        input_ids=tuple(ids),
        token_types=tuple(types),
        positions=torch.from_numpy(pos),
        position_span=cursor,
        placeholder_id=int(placeholder_ids.pop()),
        token_count=sum(s.count for s in segments if isinstance(s, Placeholders)),
        prefix_tokens=tuple(int(i) for i in first.ids) if isinstance(first, Text) else (),
        suffix_tokens=tuple(int(i) for i in last.ids) if isinstance(last, Text) else (),
        placeholder_runs=tuple((a, b) for a, b in runs),
    )


class TextIds:
    """Token ids of short text pieces a span interleaves (timestamps), memoised: the same
    few strings recur. The caller knows why a piece tokenizes alone as in context."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self._ids: dict[str, tuple[int, ...]] = {}

    def __call__(self, text: str) -> tuple[int, ...]:
        ids = self._ids.get(text)
        if ids is None:
            ids = tuple(self.tokenizer.encode(text, add_special_tokens=False).ids)
            self._ids[text] = ids
        return ids
