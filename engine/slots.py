"""Sampler slots of a forward pass (Pie's ``inference.sampler`` variant) and their results
(Pie's ``slot-output``).

A pass carries any number of slots, each reading one of its rows: a sampled token
(multinomial, top-k, top-p, min-p, top-k-top-p, with temperature), the top-k distribution
(``dist``), the raw logits, log-probabilities of chosen tokens, the entropy, or the row's
final hidden state. ``compute`` answers all of a pass's slots from the logits the pass
computed (one row per distinct slot row), without a second pass: token slots are drawn
in one ``engine.sampling.sample`` call; log-probabilities, entropies and dists come from
each row's softmax statistics (max, log-sum-exp, entropy, a dist's top-k), computed once
per row whatever and however many slots read it. On the CPU that is one compiled read of
the row after its max (``engine.sampling_kernel.RowSoftmax``: no exp or log-softmax row
is written, a dist reads only the blocks that can hold its top k), where torch's
``logsumexp``, ``exp`` and ``topk`` over the 151,936-token row cost ~0.65 ms a row
(bench/forward_pass.py, 32 contexts, stand-in forward: a pass with a dist, an entropy
and a logprobs slot beside its token went from 6.9x to 1.3x a one-slot pass per extra
slot; the first scoring slot on a row pays ~110 us, each further one ~15 us); elsewhere
torch on the logits' device.

Semantics (Pie 0.4.0's ``inference.wit``): ``raw_logits``, ``logprob(s)`` and ``entropy``
see the unscaled logits (no temperature, no logit mask); ``dist`` is softmax(logits / T),
its ``k`` most probable tokens, most probable first; token slots honour the pass's logit
mask (tokens it hides are never drawn). Temperature 0 is greedy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch

from engine import sampling, sampling_kernel
from engine.errors import InvalidRequestError
from media import check_int, check_number

SlotKind = Literal["token", "dist", "raw_logits", "logprob", "logprobs", "entropy", "embedding"]


@dataclass(frozen=True)
class Slot:
    """What one slot asks of its row. Build with the constructors: ``Slot.top_p(0.7, 0.9)``,
    ``Slot.dist(1.0, 5)``, ``Slot.logprobs([yes, no])``, ``Slot.entropy()``, ..."""

    kind: SlotKind
    sampler: sampling.Sampler | None = None
    """For "token" and "dist": temperature (and filters) of the distribution."""
    top: int = 0
    """For "dist": how many of the most probable tokens."""
    tokens: tuple[int, ...] = ()
    """For "logprob" / "logprobs": the tokens asked about, in order."""
    seed: int | None = None
    """For "token": a seed of this slot's own (Pie's multinomial seed); None draws from the
    context's generator."""

    # Pie's variants, by name.
    @classmethod
    def multinomial(cls, temperature: float = 1.0, seed: int | None = None) -> Slot:
        return cls("token", sampling.Sampler.multinomial(temperature), seed=_seed(seed))

    @classmethod
    def greedy(cls) -> Slot:
        return cls("token", sampling.Sampler.greedy())

    @classmethod
    def top_k(cls, temperature: float, k: int) -> Slot:
        return cls("token", sampling.Sampler.top_k(temperature, k))

    @classmethod
    def top_p(cls, temperature: float, p: float) -> Slot:
        return cls("token", sampling.Sampler.top_p(temperature, p))

    @classmethod
    def min_p(cls, temperature: float, p: float) -> Slot:
        return cls("token", sampling.Sampler.min_p(temperature, p))

    @classmethod
    def top_k_top_p(cls, temperature: float, k: int, p: float) -> Slot:
        return cls("token", sampling.Sampler.top_k_top_p(temperature, k, p))

    @classmethod
    def sample(cls, sampler: sampling.Sampler) -> Slot:
        """A token slot drawing with an engine ``Sampler`` (custom ones included)."""
        if not isinstance(sampler, sampling.Sampler):
            raise InvalidRequestError(f"expected an engine Sampler, got {type(sampler).__name__}")
        return cls("token", sampler)

    @classmethod
    def dist(cls, temperature: float, k: int) -> Slot:
        check_number("dist temperature", temperature, min=0)
        check_int("dist k", k, min=1)
        return cls("dist", sampling.Sampler.multinomial(temperature), top=k)

    @classmethod
    def raw_logits(cls) -> Slot:
        return cls("raw_logits")

    @classmethod
    def logprob(cls, token: int) -> Slot:
        return cls("logprob", tokens=(check_int("logprob token", token, min=0),))

    @classmethod
    def logprobs(cls, tokens: Sequence[int]) -> Slot:
        ids = tuple(check_int("logprobs token", t, min=0) for t in tokens)
        if not ids:
            raise InvalidRequestError("logprobs needs at least one token to score")
        return cls("logprobs", tokens=ids)

    @classmethod
    def entropy(cls) -> Slot:
        return cls("entropy")

    @classmethod
    def embedding(cls) -> Slot:
        return cls("embedding")

    @property
    def needs_logits(self) -> bool:
        return self.kind != "embedding"

    def __repr__(self) -> str:
        extra = ""
        if self.sampler is not None:
            extra = f" {self.sampler}"
        if self.top:
            extra += f" top={self.top}"
        if self.tokens:
            extra += f" tokens={list(self.tokens)}"
        return f"Slot.{self.kind}({extra.strip()})"


def _seed(seed: int | None) -> int | None:
    return None if seed is None else check_int("seed", seed)


# -- results (Pie's slot-output variants) ----------------------------------------------------
@dataclass(frozen=True)
class SlotToken:
    token: int


@dataclass(frozen=True)
class SlotDistribution:
    ids: list[int]
    probs: list[float]

    def __iter__(self):
        return iter(zip(self.ids, self.probs, strict=True))


@dataclass(frozen=True, eq=False)
class SlotLogits:
    logits: torch.Tensor
    """(vocab,) float32, unscaled."""

    def to_bytes(self) -> bytes:
        """Little-endian float32 bytes (Pie's ``logits(list<u8>)``)."""
        return self.logits.detach().cpu().float().numpy().astype("<f4").tobytes()


@dataclass(frozen=True)
class SlotLogprobs:
    values: list[float]


@dataclass(frozen=True)
class SlotEntropy:
    value: float


@dataclass(frozen=True, eq=False)
class SlotEmbedding:
    vector: torch.Tensor
    """(hidden,) float32 final hidden state (after the model's final norm)."""

    def to_bytes(self) -> bytes:
        return self.vector.detach().cpu().float().numpy().astype("<f4").tobytes()


SlotOutput = SlotToken | SlotDistribution | SlotLogits | SlotLogprobs | SlotEntropy | SlotEmbedding


@dataclass
class SlotRequest:
    """A slot attached to a row of the pass (``row``: index into the pass's input rows)."""

    row: int
    slot: Slot
    generator: torch.Generator | None = field(default=None, repr=False)


def check_slot(slot: Slot, vocab: int) -> None:
    """Raise ``InvalidRequestError`` for a slot the model cannot answer."""
    bad = [t for t in slot.tokens if not 0 <= t < vocab]
    if bad:
        raise InvalidRequestError(
            f"{slot.kind} asks about token(s) outside the vocabulary [0, {vocab}): {bad[:5]}"
        )
    if slot.kind == "dist" and slot.top > vocab:
        raise InvalidRequestError(f"dist asks for the top {slot.top} tokens of a {vocab}-token vocabulary")


def compute(
    requests: Sequence[SlotRequest],
    logits: torch.Tensor | None,
    logit_row: Sequence[int],
    hidden: torch.Tensor | None,
    hidden_row: Sequence[int],
    *,
    logit_mask: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> list[SlotOutput]:
    """Every slot's result, in slot order. ``logits``: (R, V) float32, the rows the slots read
    (``logit_row[i]``: which of them slot i reads); ``hidden`` and ``hidden_row`` alike for
    embedding slots. ``logit_mask``: (V,) bool, True = allowed (token slots only);
    ``generator``: what token slots without a seed of their own draw from."""
    out: list[SlotOutput | None] = [None] * len(requests)
    tokens = [i for i, r in enumerate(requests) if r.slot.kind == "token"]
    if tokens:
        assert logits is not None
        rows = logits[torch.tensor([logit_row[i] for i in tokens], device=logits.device)]
        if logit_mask is not None:
            rows = rows.masked_fill(~logit_mask.to(rows.device), float("-inf"))
        gens = [requests[i].generator or generator for i in tokens]
        drawn = sampling.sample(rows, [requests[i].slot.sampler for i in tokens], gens).tolist()  # type: ignore[misc]
        for i, t in zip(tokens, drawn, strict=True):
            out[i] = SlotToken(int(t))
    scored = [i for i, r in enumerate(requests) if r.slot.kind in _SCORED]
    if scored:
        assert logits is not None
        dists: dict[int, tuple[float, int]] = {}
        for i in scored:  # the first dist on a row is read with the row's statistics
            slot = requests[i].slot
            if slot.kind == "dist" and slot.sampler is not None and slot.sampler.temperature > 0:
                dists.setdefault(logit_row[i], (slot.sampler.temperature, slot.top))
        stats = _RowStats(logits, sorted({logit_row[i] for i in scored}), dists)
        for i in scored:
            slot, row = requests[i].slot, logit_row[i]
            if slot.kind == "entropy":
                out[i] = SlotEntropy(stats.entropy(row))
            elif slot.kind == "dist":
                assert slot.sampler is not None
                out[i] = stats.dist(row, slot.sampler.temperature, slot.top)
            else:
                out[i] = SlotLogprobs(stats.logprobs(row, slot.tokens))
    for i, r in enumerate(requests):
        if r.slot.kind == "raw_logits":
            assert logits is not None
            out[i] = SlotLogits(logits[logit_row[i]].clone())
        elif r.slot.kind == "embedding":
            assert hidden is not None
            out[i] = SlotEmbedding(hidden[hidden_row[i]].clone())
    assert all(o is not None for o in out)
    return out  # type: ignore[return-value]


_SCORED = frozenset(("logprob", "logprobs", "entropy", "dist"))
_KERNEL_DIST_MAX_K = 1024
"""The largest dist the kernel answers (it keeps the k best by insertion); larger ones
take torch's ``topk``."""


class _RowStats:
    """The softmax statistics of the rows a pass's scoring slots read (logprob(s), entropy,
    dist), each row's computed once, whatever and however many slots read it: its max and
    log sum exp (every logprob is x - max - log s), its entropy, and a dist's top-k. On the
    CPU with numba one read of each row after its max (``engine.sampling_kernel.
    RowSoftmax``); elsewhere, and for a row whose max is not finite, torch's
    ``logsumexp`` on the logits' device (the rows' together)."""

    def __init__(self, logits: torch.Tensor, rows: list[int], dists: dict[int, tuple[float, int]]):
        self._logits = logits
        self._rows = rows
        self._where = {r: j for j, r in enumerate(rows)}
        self._fast: sampling_kernel.RowSoftmax | None = None
        self._x: np.ndarray | None = None
        self._lse: torch.Tensor | None = None
        if logits.device.type == "cpu" and sampling_kernel.available():
            x = logits.detach().to(torch.float32)
            x = (x if len(rows) == x.shape[0] else x[torch.tensor(rows)]).contiguous().numpy()
            self._x = x
            self._fast = sampling_kernel.RowSoftmax(x, [dists.get(r) for r in rows])

    def _torch(self, j: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits row, its logsumexp) by torch, every row's at once."""
        if self._lse is None:
            rows = self._rows
            x = self._logits if len(rows) == self._logits.shape[0] else self._logits[torch.tensor(rows)]
            self._lse = torch.logsumexp(x.to(self._logits.device), dim=-1)
        return self._logits[self._rows[j]], self._lse[j]

    def logprobs(self, row: int, tokens: tuple[int, ...]) -> list[float]:
        j, fast = self._where[row], self._fast
        if fast is not None and fast.ok[j]:
            assert self._x is not None
            row, lse = self._x[j], fast.mx[j] + fast.log_s[j]
            return [float(row[t]) - lse for t in tokens]
        x, lse = self._torch(j)
        return (x[list(tokens)] - lse).tolist()

    def entropy(self, row: int) -> float:
        j, fast = self._where[row], self._fast
        if fast is not None and fast.ok[j]:
            return fast.entropy[j]
        # H = -sum p (x - lse) = lse - sum p x, with p = exp(x - lse); -inf logits add 0
        x, lse = self._torch(j)
        return float(lse - (torch.exp(x - lse) * x.nan_to_num(neginf=0.0)).sum())

    def dist(self, row: int, temperature: float, k: int) -> SlotDistribution:
        if temperature == 0:
            return SlotDistribution([int(sampling.argmax(self._logits[row][None])[0])], [1.0])
        j, fast = self._where[row], self._fast
        if fast is not None and fast.ok[j] and k <= min(_KERNEL_DIST_MAX_K, self._logits.shape[-1]):
            return SlotDistribution(*fast.top(j, temperature, k))
        return _top_k_distribution(self._logits[row], temperature, k)


def _top_k_distribution(row: torch.Tensor, temperature: float, k: int) -> SlotDistribution:
    """softmax(row / T)'s ``k`` most probable tokens (T = 0: the argmax with 1.0), most
    probable first, ties by lower id, probabilities not renormalised. A ``topk`` of k + 1
    then a stable sort of those: no sort of the vocabulary (13 ms a row at 152k tokens)."""
    if temperature == 0:
        return SlotDistribution([int(sampling.argmax(row[None])[0])], [1.0])
    scaled = row.float() / temperature
    k = min(k, scaled.shape[0])
    top, ids = scaled.topk(min(k + 1, scaled.shape[0]))  # order of the logits = of the probs
    # the k-th place may tie with tokens topk left out: take every token at that value
    if k < scaled.shape[0] and bool(top[-1] == top[k - 1]):
        ids = torch.nonzero(scaled >= top[k - 1]).flatten()
        top = scaled[ids]
    values = torch.exp(top - torch.logsumexp(scaled, dim=-1))
    order = sorted(range(ids.shape[0]), key=lambda j: (-float(values[j]), int(ids[j])))[:k]
    keep = [p for p in order if float(values[p]) > 0]
    return SlotDistribution([int(ids[p]) for p in keep], [float(values[p]) for p in keep])
