"""Penalties and logit bias: the logits adjustments OpenAI's and vLLM's APIs take, applied
to a generation's logits before the grammar mask and the sampler.

- ``logit_bias`` (OpenAI): a value in [-100, 100] added to a token's logit.
- ``repetition_penalty`` (transformers, vLLM): every token already in the context (the
  prompt and the output) has a positive logit divided by it and a negative one multiplied
  by it, as transformers' ``RepetitionPenaltyLogitsProcessor`` does.
- ``frequency_penalty`` / ``presence_penalty`` (OpenAI, in [-2, 2]): a token's logit
  loses ``frequency * count + presence * (count > 0)``, ``count`` its occurrences in the
  output so far (OpenAI's formula, and vLLM's).

In vLLM's order: bias, then repetition, then frequency and presence. Log-probabilities
reported with the tokens stay those of the model's own logits, as vLLM reports them by
default. The counts are a generation's own: each of ``n`` choices counts its own output.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

from engine.errors import InvalidRequestError

MAX_BIASED_TOKENS = 300
"""Entries of one ``logit_bias`` (OpenAI's limit is 300 too)."""


@dataclass(frozen=True)
class Penalties:
    presence: float = 0.0
    frequency: float = 0.0
    repetition: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    """(token id, bias) pairs; ``Penalties.of(logit_bias={id: bias})`` builds them."""

    def __post_init__(self) -> None:
        for name, value, low, high in (
            ("presence_penalty", self.presence, -2.0, 2.0),
            ("frequency_penalty", self.frequency, -2.0, 2.0),
        ):
            if not (math.isfinite(value) and low <= value <= high):
                raise InvalidRequestError(f"{name} must be in [{low}, {high}], got {value}", param=name)
        if not (math.isfinite(self.repetition) and 0 < self.repetition <= 10):
            raise InvalidRequestError(
                f"repetition_penalty must be in (0, 10] (1 disables it), got {self.repetition}",
                param="repetition_penalty",
            )
        if len(self.logit_bias) > MAX_BIASED_TOKENS:
            raise InvalidRequestError(
                f"logit_bias has {len(self.logit_bias)} entries; the limit is {MAX_BIASED_TOKENS}",
                param="logit_bias",
                limit=MAX_BIASED_TOKENS,
            )
        for token, bias in self.logit_bias:
            if not (math.isfinite(bias) and -100 <= bias <= 100):
                raise InvalidRequestError(
                    f"logit_bias of token {token} must be in [-100, 100]", param="logit_bias"
                )

    @classmethod
    def of(
        cls,
        *,
        presence: float = 0.0,
        frequency: float = 0.0,
        repetition: float = 1.0,
        logit_bias: Mapping[int, float] | None = None,
    ) -> Penalties:
        return cls(presence, frequency, repetition, tuple(sorted((logit_bias or {}).items())))

    @property
    def active(self) -> bool:
        """Whether any of them changes a logit."""
        return bool(self.presence or self.frequency or self.repetition != 1.0 or self.logit_bias)

    def check_vocab(self, vocab: int) -> None:
        for token, _ in self.logit_bias:
            if not 0 <= token < vocab:
                raise InvalidRequestError(
                    f"logit_bias names token {token}, outside the vocabulary (0..{vocab - 1})",
                    param="logit_bias",
                )

    def start(self, context_ids: Iterable[int]) -> PenaltyState | None:
        """A generation's state (None when nothing applies): ``context_ids``, the tokens
        before it, count for the repetition penalty only."""
        return PenaltyState(self, context_ids) if self.active else None


class PenaltyState:
    """One generation's counts; ``apply`` to each row of logits, ``add`` each token taken.

    Only the rows of tokens that occurred are touched (index ops over the context's
    distinct tokens and the output's), not the whole vocabulary: a full-vocabulary
    ``where`` per token cost ~2 ms on a 152k vocabulary here, as much as a tiny model's
    decode pass."""

    def __init__(self, penalties: Penalties, context_ids: Iterable[int]):
        self.penalties = penalties
        self._seen: dict[int, None] = dict.fromkeys(int(t) for t in context_ids)  # ordered set
        self._context = frozenset(self._seen)
        self._counts: dict[int, int] = {}
        self._seen_idx: torch.Tensor | None = None  # the rows of ``_seen``, rebuilt when it grows
        self._bias: tuple[torch.Tensor, torch.Tensor] | None = None

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """A copy of one (vocab,) row of logits with the bias and penalties applied."""
        p, n, device = self.penalties, logits.shape[-1], logits.device
        out = logits.clone()
        if p.logit_bias:
            if self._bias is None:
                pairs = [(t, b) for t, b in p.logit_bias if t < n]
                self._bias = (
                    torch.tensor([t for t, _ in pairs], dtype=torch.long, device=device),
                    torch.tensor([b for _, b in pairs], dtype=logits.dtype, device=device),
                )
            out.index_add_(0, self._bias[0], self._bias[1])
        if p.repetition != 1.0 and self._seen:
            if self._seen_idx is None:
                ids = [t for t in self._seen if 0 <= t < n]
                self._seen_idx = torch.tensor(ids, dtype=torch.long, device=device)
            rows = out.index_select(0, self._seen_idx)
            rows = torch.where(rows < 0, rows * p.repetition, rows / p.repetition)
            # A penalty near 0 divides a logit past float range: the largest finite value
            # keeps it the most likely token instead of an infinity the sampler cannot use.
            out.index_copy_(0, self._seen_idx, rows.clamp(max=torch.finfo(out.dtype).max))
        if (p.frequency or p.presence) and self._counts:
            ids = [t for t in self._counts if 0 <= t < n]
            idx = torch.tensor(ids, dtype=torch.long, device=device)
            counts = torch.tensor([self._counts[t] for t in ids], dtype=out.dtype, device=device)
            rows = out.index_select(0, idx) - p.frequency * counts  # OpenAI's formula, in its order
            out.index_copy_(0, idx, rows - p.presence)
        return out

    def discard(self, token: int) -> None:
        """Undo one ``add(token)`` (a token drawn for a step the generation dropped)."""
        token = int(token)
        left = self._counts.get(token, 0) - 1
        if left > 0:
            self._counts[token] = left
            return
        self._counts.pop(token, None)
        if token not in self._context and token in self._seen:
            del self._seen[token]
            self._seen_idx = None

    def add(self, token: int) -> None:
        """``token`` was taken: it counts from the next row on."""
        token = int(token)
        self._counts[token] = self._counts.get(token, 0) + 1
        if token not in self._seen:
            self._seen[token] = None
            self._seen_idx = None
