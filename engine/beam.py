"""Beam search on a context, built on forks (beams share the prompt's pages and each
other's common prefixes; a step's beams compute their next-token logits in one batched
pass).

The rule is transformers' ``generate(num_beams=width, do_sample=False)``: every step
each beam's log-softmax is added to its score, the best ``2 * width`` continuations
over all beams are considered in order, a continuation ending in EOS becomes a finished
hypothesis scored ``sum_logprobs / generated_len ** length_penalty`` (only when it ranks
within the first ``width``), the others fill the next ``width`` beams. The search ends at
``max_tokens``, or, as transformers' default ``early_stopping=False`` does, once ``width``
hypotheses are finished and the best running beam cannot beat the worst of them any more.
At the end running beams are scored like finished ones and the best ``num_return`` come back.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from engine.context import Context
from engine.errors import InvalidRequestError
from media import check_int, check_number


@dataclass(frozen=True)
class Hypothesis:
    tokens: tuple[int, ...]
    """Generated tokens (EOS included when it ended the hypothesis)."""
    text: str
    score: float
    """``sum of token logprobs / len(tokens) ** length_penalty``."""
    finish_reason: str
    """"eos" or "length"."""

    def __repr__(self) -> str:
        return f"Hypothesis(score={self.score:.4f}, {len(self.tokens)} tokens, {self.finish_reason}, {self.text!r})"


def _normalized(total: float, length: int, length_penalty: float) -> float:
    return total / (max(length, 1) ** length_penalty)


async def beam_search(
    ctx: Context,
    width: int,
    max_tokens: int,
    *,
    length_penalty: float = 1.0,
    eos: Iterable[int] | None = None,
    num_return: int = 1,
) -> list[Hypothesis]:
    """Hypotheses continuing ``ctx`` (which is left as it was), best first. ``eos``:
    the token ids that end a hypothesis (default: the model's EOS ids; ``()`` for none)."""
    width = check_int("width", width, min=1)
    max_tokens = check_int("max_tokens", max_tokens, min=1)
    num_return = check_int("num_return", num_return, min=1, max=width)
    length_penalty = check_number("length_penalty", length_penalty)
    eos_ids = frozenset(ctx.model.eos_token_ids if eos is None else eos)
    model = ctx.model
    beams: list[tuple[Context, tuple[int, ...], float]] = [(ctx.fork(), (), 0.0)]
    finished: list[tuple[float, tuple[int, ...], float]] = []  # (normalized score, tokens, raw sum)
    try:
        for step in range(max_tokens):
            logits = await asyncio.gather(*(b.next_token_logits() for b, _, _ in beams))
            scores = torch.stack(
                [torch.log_softmax(x.float(), dim=-1) + s for x, (_, _, s) in zip(logits, beams, strict=True)]
            )
            flat = scores.reshape(-1)
            top = torch.topk(flat, min(2 * width, flat.numel()))
            vocab = scores.shape[-1]
            chosen: list[tuple[int, int, float]] = []
            for rank, (value, index) in enumerate(
                zip(top.values.tolist(), top.indices.tolist(), strict=True)
            ):
                beam, token = divmod(index, vocab)
                if token in eos_ids:
                    if rank < width:
                        tokens = (*beams[beam][1], token)
                        finished.append((_normalized(value, len(tokens), length_penalty), tokens, value))
                    continue
                chosen.append((beam, token, value))
                if len(chosen) == width:
                    break
            finished.sort(key=lambda f: -f[0])
            del finished[width:]
            new_beams = []
            for beam, token, value in chosen:
                child = beams[beam][0].fork()
                child.fill_tokens([token])
                new_beams.append((child, (*beams[beam][1], token), value))
            for b, _, _ in beams:
                b.close()
            beams = new_beams
            if not beams:
                break
            if len(finished) >= width:
                # transformers' early_stopping=False: the best running beam, scored at the
                # current length, cannot beat the worst finished hypothesis any more.
                best_running = max(_normalized(s, step + 1, length_penalty) for _, _, s in beams)
                if best_running <= finished[-1][0]:
                    break
        results = [
            Hypothesis(tokens, model.detokenize(tokens, skip_special_tokens=True), score, "eos")
            for score, tokens, _ in finished
        ]
        results += [
            Hypothesis(
                tokens,
                model.detokenize(tokens, skip_special_tokens=True),
                _normalized(s, len(tokens), length_penalty),
                "length",
            )
            for _, tokens, s in beams
        ]
        if not results:
            raise InvalidRequestError("beam search produced no hypothesis")
        results.sort(key=lambda h: -h.score)
        return results[:num_return]
    finally:
        for b, _, _ in beams:
            b.close()
