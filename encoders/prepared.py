"""What a model-specific preparer makes of one media object, before any forward pass.

A ``Prepared`` is everything the engine needs to reserve KV rows, place positions and
splice embeddings, and everything the encoder tower needs to run. It is computed
synchronously from the decoded media, so an inferlet can budget before it spends.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import torch

MediaKind = Literal["image", "audio", "video"]


@dataclass(frozen=True)
class Prepared:
    kind: MediaKind
    family: str
    """Encoder family that made it, e.g. ``"qwen3_vl"`` or ``"gemma4"``."""

    input_ids: tuple[int, ...]
    """Every row the span occupies in the context, in order: prefix delimiters,
    placeholder ids (one per embedding row), any interleaved text (Qwen3-VL video
    timestamps), suffix delimiters. Exactly what the reference processor writes into
    ``input_ids`` for this media item."""

    placeholder_id: int
    """The token id at rows that receive encoder embeddings."""

    token_count: int
    """Embedding rows: how many rows of ``input_ids`` equal ``placeholder_id``
    (the reference's "number of image/video/audio tokens")."""

    grid: tuple[int, int, int]
    """(t, h, w) in merged-token units (audio: (1, 1, token_count))."""

    positions: torch.Tensor
    """Long tensor (n_axes, len(input_ids)): position of every row relative to the
    span's anchor (the position of the row just before the span, plus one). n_axes is
    3 for M-RoPE (t, h, w) and 1 for 1-D RoPE."""

    position_span: int
    """How far the position cursor advances past the span (``max(positions) + 1``);
    for M-RoPE this is NOT ``len(input_ids)``."""

    prefix_tokens: tuple[int, ...]
    suffix_tokens: tuple[int, ...]

    inputs: dict[str, torch.Tensor]
    """The model inputs for the tower, the same tensors (names, shapes, dtype, values)
    the transformers processor produces for this item alone, e.g. ``pixel_values``
    and ``image_grid_thw``."""

    content_hash: str
    """Hash of the source media (``media.*.content_hash``)."""

    cache_key: str
    """(model fingerprint, content hash, preparation parameters): the encoder-cache key."""

    mm_token_type: tuple[int, ...] = ()
    """Per-row modality type as the reference's ``mm_token_type_ids``: the int values of
    :class:`~encoders.span.TokenType` (0 text, 1 image, 2 video, 3 audio where the model
    uses it); empty when not needed."""

    timestamps: tuple[float, ...] | None = None
    """Video: the per-temporal-group timestamps (seconds) the reference emits."""

    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def num_rows(self) -> int:
        """KV rows the whole span occupies (delimiters and interleaved text included)."""
        return len(self.input_ids)

    def placeholder_rows(self) -> torch.Tensor:
        """Indices (into ``input_ids``) of the rows that receive embeddings, in order."""
        ids = torch.tensor(self.input_ids, dtype=torch.long)
        return torch.nonzero(ids == self.placeholder_id, as_tuple=False).flatten()


@dataclass
class Encoded:
    """Encoder output for one ``Prepared``: one embedding row per placeholder row."""

    embeddings: torch.Tensor
    """(token_count, hidden) in the language model's embedding space."""

    deepstack: list[torch.Tensor] | None = None
    """Qwen3-VL: per DeepStack layer, (token_count, hidden) features added to the
    hidden states of the first decoder layers at the placeholder rows."""

    def nbytes(self) -> int:
        n = self.embeddings.numel() * self.embeddings.element_size()
        for t in self.deepstack or ():
            n += t.numel() * t.element_size()
        return n
