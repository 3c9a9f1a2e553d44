"""Drafters for speculative decoding: cheap guesses of the next tokens that the model checks
in one pass (``Context.generate(..., drafter=...)``).

A drafter is Pie's shape: ``update(accepted)`` hears every token that joined the context
(the whole history first, then each step's accepted tokens), ``draft()`` proposes the
tokens it expects next. The context appends the proposal as rows of ONE forward step with
every row's logits, samples each position in order with the request's own sampler and
random generator, and keeps drafted tokens while the sampled token equals the draft; the
first mismatch (or the last row, when every draft held) gives one more token. Rejected
rows are rolled back (their pages returned).

Why sampled output keeps its distribution: for a deterministic drafter (its proposal is a
point mass q = δ_x), speculative sampling accepts x with probability min(1, p(x)/q(x)) =
p(x) and on rejection samples from normalize(max(p - q, 0)), which is p with x removed.
Drawing y ~ p (one uniform through the inverse CDF, as plain decoding does) and accepting
iff y == x is the same rule: P(accept) = p(x), and a rejected y is distributed as p given
y != x. Each emitted token consumes exactly one uniform, the one plain decoding would have
spent on that position, so a seeded generation with a drafter gives the tokens of the
same seeded generation without one (as far as the multi-row pass's logits equal the
one-row pass's, which they do bit for bit in the tests here on the CPU).

``PromptLookupDrafter`` is the built-in n-gram ("prompt lookup") drafter: it finds the
latest earlier occurrence of the context's last n tokens and proposes what followed it,
which pays off when the output copies from the input (quoting, editing, extraction, code).
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

from engine.errors import InvalidRequestError
from media import check_int

MAX_DRAFT = 32
"""Most drafted tokens one step verifies (bounds the rows a drafter adds to a pass)."""


@runtime_checkable
class Drafter(Protocol):
    """Proposes tokens for the model to verify in one pass (Pie's ``Drafter`` trait)."""

    def update(self, accepted: Sequence[int]) -> None:
        """Tokens that joined the context since the last call, in order (the first call of
        a generation gets the whole history, prompt included)."""
        ...

    def draft(self) -> list[int]:
        """The tokens expected next (possibly none: the step then decodes one token)."""
        ...


class PromptLookupDrafter:
    """N-gram drafter over the context's own tokens: the latest earlier occurrence of the
    last ``max_ngram`` tokens (down to ``min_ngram``) proposes the ``num_draft`` tokens that
    followed it. Updates are O(max_ngram) per token (one dict entry per n-gram length)."""

    def __init__(self, *, max_ngram: int = 3, num_draft: int = 4, min_ngram: int = 1):
        self.max_ngram = check_int("max_ngram", max_ngram, min=1, max=16)
        self.min_ngram = check_int("min_ngram", min_ngram, min=1, max=self.max_ngram)
        self.num_draft = check_int("num_draft", num_draft, min=1, max=MAX_DRAFT)
        self._tokens: list[int] = []
        self._follow: list[dict[tuple[int, ...], int]] = [{} for _ in range(self.max_ngram + 1)]
        """``_follow[n][gram]`` = index of the token that followed the latest occurrence of
        the n-gram ``gram`` (only occurrences with a follower are indexed)."""

    def update(self, accepted: Sequence[int]) -> None:
        toks = self._tokens
        for t in accepted:
            at = len(toks)  # the new token's index: it follows the n-grams ending just before it
            for n in range(1, min(self.max_ngram, at) + 1):
                self._follow[n][tuple(toks[at - n : at])] = at
            toks.append(int(t))

    def draft(self) -> list[int]:
        toks = self._tokens
        for n in range(min(self.max_ngram, len(toks)), self.min_ngram - 1, -1):
            at = self._follow[n].get(tuple(toks[-n:]))
            if at is not None:
                # Copy what followed; a match close to the end overlaps the copy (as in
                # LZ77): the proposal continues the repeating pattern.
                out = toks[at : at + self.num_draft]
                period = len(toks) - at
                while len(out) < self.num_draft:
                    out.append(out[len(out) - period])
                return out
        return []

    def __repr__(self) -> str:
        return (
            f"PromptLookupDrafter(max_ngram={self.max_ngram}, num_draft={self.num_draft}, "
            f"min_ngram={self.min_ngram}, {len(self._tokens)} tokens seen)"
        )


@dataclass(frozen=True)
class DraftSpec:
    """A drafter described by value (an HTTP request's ``speculative`` field): each
    generation gets its own fresh drafter from ``make()`` (drafters are stateful)."""

    method: Literal["prompt_lookup"] = "prompt_lookup"
    num_draft: int = 4
    max_ngram: int = 3
    min_ngram: int = 1

    def __post_init__(self) -> None:
        if self.method != "prompt_lookup":
            raise InvalidRequestError(f"unknown speculative method {self.method!r}; known: 'prompt_lookup'")
        self.make()  # validates the numbers

    def make(self) -> Drafter:
        return PromptLookupDrafter(
            max_ngram=self.max_ngram, num_draft=self.num_draft, min_ngram=self.min_ngram
        )


def checked_draft(draft: object, vocab: int, limit: int) -> list[int]:
    """A drafter's proposal as ids, at most ``limit`` of them; a typed error for anything
    that is not a list of ids in the vocabulary (a guest's drafter is untrusted)."""
    if not isinstance(draft, list | tuple):
        raise InvalidRequestError(f"a drafter must return a list of token ids, got {type(draft).__name__}")
    out: list[int] = []
    for t in draft[: max(0, limit)]:
        try:
            i = -1 if isinstance(t, bool) else operator.index(t)
        except TypeError:
            i = -1
        if not 0 <= i < vocab:
            raise InvalidRequestError(f"drafted token {t!r} is not an id in the vocabulary [0, {vocab})")
        out.append(i)
    return out


__all__ = ["MAX_DRAFT", "DraftSpec", "Drafter", "PromptLookupDrafter", "checked_draft"]
