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
    """One generation's counts; ``apply`` to each row of logits, ``add`` each token taken."""

    def __init__(self, penalties: Penalties, context_ids: Iterable[int]):
        self.penalties = penalties
        self._context = list(context_ids)
        self._output: list[int] = []
        self._counts: torch.Tensor | None = None
        self._seen: torch.Tensor | None = None
        self._bias: tuple[torch.Tensor, torch.Tensor] | None = None

    def _init(self, logits: torch.Tensor) -> None:
        n, device = logits.shape[-1], logits.device
        self._counts = torch.zeros(n, dtype=logits.dtype, device=device)
        self._seen = torch.zeros(n, dtype=torch.bool, device=device)
        ids = [t for t in self._context if 0 <= t < n]
        if ids:
            self._seen[torch.tensor(ids, device=device)] = True
        if self.penalties.logit_bias:
            pairs = [(t, b) for t, b in self.penalties.logit_bias if t < n]
            self._bias = (
                torch.tensor([t for t, _ in pairs], device=device),
                torch.tensor([b for _, b in pairs], dtype=logits.dtype, device=device),
            )
        for t in self._output:
            self._count(t)

    def _count(self, token: int) -> None:
        assert self._counts is not None and self._seen is not None
        if 0 <= token < self._counts.shape[0]:
            self._counts[token] += 1
            self._seen[token] = True

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """A copy of one (vocab,) row of logits with the bias and penalties applied."""
        if self._counts is None:
            self._init(logits)
        assert self._counts is not None and self._seen is not None
        p = self.penalties
        out = logits.clone()
        if self._bias is not None:
            out.index_add_(0, self._bias[0], self._bias[1])
        if p.repetition != 1.0:
            penalized = torch.where(out < 0, out * p.repetition, out / p.repetition)
            # A penalty near 0 divides a logit past float range: the largest finite value
            # keeps it the most likely token instead of an infinity the sampler cannot use.
            out = torch.where(self._seen, penalized, out).clamp(max=torch.finfo(out.dtype).max)
        if p.frequency:
            out -= p.frequency * self._counts
        if p.presence:
            out -= p.presence * (self._counts > 0).to(out.dtype)
        return out

    def add(self, token: int) -> None:
        """``token`` was taken: it counts from the next row on."""
        self._output.append(token)
        if self._counts is not None:
            self._count(token)
