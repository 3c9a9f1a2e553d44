"""One codec frame for every speech stream of a pass, computed together.

After the backbone pass, each stream that asked for a frame (a "head" step) has its last
hidden state. ``FrameHead.run`` picks codebook 0 from the backbone's ``lm_head`` for all of
them, then runs the depth decoder once per codebook step over all of them (they are all on
the same step: a frame always starts at the depth decoder's position 0, so the batch needs
no padding and a plain ``DynamicCache``), and returns each stream's codes with the summed
codebook embedding that feeds the frame back to the backbone. A pass that
``speech.depth_graphs.DepthGraphs`` takes runs the same frame as one replay instead.

Sampling is per row, on the device, with no read back between codebooks (so the whole
frame can be one CUDA graph): ``choose`` applies transformers' order (suppress,
temperature, top-k, softmax) with each row's own settings and draws the code by an
exponential race, ``argmax(probs / E)`` with ``E ~ Exp(1)`` i.i.d. per id, which picks id
``i`` with probability ``probs[i]`` (the Gumbel-max trick in another form). The draws are
made BEFORE the frame, per stream, from the stream's own ``torch.Generator``
(``draw_noise``: one ``(num_codebooks, V)`` block per frame, row 0 for codebook 0), so a
seeded stream gives the same frames alone or batched, with or without graphs. Greedy rows
are an argmax, as before (the codes equal transformers'). Ids ``>= codebook_size`` are
suppressed at both levels (random weights can pick the 3 specials past the Mimi codes;
Mimi would index out of range); id 0, the eos code, is a valid code and is kept for the
stop rule.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from speech.hf_cache import cache_keyword


@dataclass(frozen=True)
class Sampling:
    """One level's (backbone or depth decoder) sampling settings."""

    do_sample: bool
    temperature: float
    top_k: int | None


GREEDY = Sampling(False, 1.0, None)


@dataclass(frozen=True, eq=False)
class FrameRequest:
    """What a stream asks of the head each frame (the same object every frame)."""

    backbone: Sampling
    depth: Sampling
    generator: torch.Generator | None = None


@dataclass(frozen=True, eq=False)
class FrameResult:
    codes: list[int]
    """The frame: one id per codebook."""
    embeds: torch.Tensor
    """(hidden,) the frame's backbone input embedding (sum over codebooks)."""


_FLOAT32_MAX = torch.finfo(torch.float32).max


def samples(request: FrameRequest) -> bool:
    """Whether a stream draws noise for its frames (it samples at either level)."""
    return request.backbone.do_sample or request.depth.do_sample


def row_settings(requests: Sequence[FrameRequest], vocab: int) -> torch.Tensor:
    """(B, 2, 3) float32 on the CPU: per stream and level (0: backbone, 1: depth decoder)
    ``[greedy, temperature, top_k]``; a greedy level reads ``[1, 1, V]``, a level without
    top-k (or with ``top_k >= V``) ``k = V`` (nothing filtered). Exact in float32 (k <= V);
    a temperature past float32's range is its largest finite value (an infinite one would
    turn the suppressed ids' -inf into NaN; both mean uniform over the kept ids)."""
    rows = []
    for r in requests:
        levels = []
        for s in (r.backbone, r.depth):
            if not s.do_sample:
                levels.append((1.0, 1.0, float(vocab)))
            else:
                k = s.top_k if s.top_k is not None and 0 < s.top_k < vocab else vocab
                levels.append((0.0, min(float(s.temperature), _FLOAT32_MAX), float(k)))
        rows.append(levels)
    return torch.tensor(rows, dtype=torch.float32)


def draw_noise(out: torch.Tensor, requests: Sequence[FrameRequest]) -> None:
    """Fill ``out[i]`` ((num_codebooks, V) float32, on the device) with Exp(1) draws from
    stream ``i``'s generator when it samples (the default generator when it has none); a
    greedy stream's rows are left as they are (never read: ``choose`` takes its argmax)."""
    for i, r in enumerate(requests):
        if samples(r):
            out[i].exponential_(generator=r.generator)


def greedy(logits: torch.Tensor, suppress: torch.Tensor) -> torch.Tensor:
    """(B,) argmax of each row of ``logits`` (B, V) with the suppressed ids masked."""
    return logits.float().masked_fill(suppress, float("-inf")).argmax(-1)


def choose(
    logits: torch.Tensor, suppress: torch.Tensor, settings: torch.Tensor, noise: torch.Tensor
) -> torch.Tensor:
    """(B,) next id per row of ``logits`` (B, V) with per-row ``settings`` (B, 3) of
    ``row_settings`` and ``noise`` (B, V) of ``draw_noise``: greedy rows an argmax, sampled
    rows transformers' suppress, temperature, top-k, softmax, then the exponential race.
    Device ops only, row by row (no host read, no row sees another's values)."""
    scores = logits.float().masked_fill(suppress, float("-inf"))
    best = scores.argmax(-1)
    scaled = scores / settings[:, 1:2]
    vocab = scores.shape[-1]
    k = settings[:, 2].long().clamp(1, vocab) - 1
    kth = scaled.sort(dim=-1, descending=True).values.gather(-1, k[:, None])
    scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    # E = 0 would make 0 / 0 a NaN (argmax's maximum): the smallest normal float instead.
    drawn = (probs / noise.clamp_min(torch.finfo(torch.float32).tiny)).argmax(-1)
    return torch.where(settings[:, 0] > 0, best, drawn)


class FrameHead:
    """The ``engine`` runner's ``BatchedHead`` for a CSM model (see the module doc)."""

    def __init__(self, hf: Any, suppress: torch.Tensor):
        self.hf = hf
        self.suppress = suppress
        self.num_codebooks = int(hf.config.num_codebooks)
        self.vocab = int(hf.config.vocab_size)
        self.cache_keyword = cache_keyword(hf.depth_decoder)
        self.frames = 0
        """Frames made so far (all streams)."""
        self.graphs: Any = None
        """A ``speech.depth_graphs.DepthGraphs``: the frames of the passes it takes run there,
        one replay each."""

    @torch.inference_mode()
    def run(self, hidden: torch.Tensor, requests: Sequence[FrameRequest]) -> list[FrameResult]:
        n = len(requests)
        if self.graphs is not None and self.graphs.takes(n):
            codes, embeds = self.graphs.frame(hidden, requests)
        else:
            codes, embeds = self._frame(hidden, requests)
        self.frames += n
        return [FrameResult(row, embeds[i]) for i, row in enumerate(codes.tolist())]

    def _frame(
        self, hidden: torch.Tensor, requests: Sequence[FrameRequest]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, num_codebooks) codes and (B, hidden) frame embeddings, without graphs."""
        from transformers import DynamicCache

        hf = self.hf
        hidden = hidden.to(hf.dtype)
        dev = hidden.device
        settings = noise = None
        if any(samples(r) for r in requests):  # all greedy: argmaxes only, no draws
            settings = row_settings(requests, self.vocab).to(dev)
            noise = torch.ones(len(requests), self.num_codebooks, self.vocab, device=dev)
            draw_noise(noise, requests)

        def pick(logits: torch.Tensor, level: int, codebook: int) -> torch.Tensor:
            if settings is None or noise is None:
                return greedy(logits, self.suppress)
            return choose(logits, self.suppress, settings[:, level], noise[:, codebook])

        first = pick(hf.lm_head(hidden), 0, 0)
        cache = DynamicCache(config=hf.depth_decoder.config)
        step_ids = torch.stack([torch.zeros_like(first), first], dim=-1)
        frame = [first]
        for i in range(self.num_codebooks - 1):
            out = hf.depth_decoder(
                input_ids=step_ids,
                backbone_last_hidden_state=hidden if i == 0 else None,
                use_cache=True,
                logits_to_keep=1,
                **{self.cache_keyword: cache},
            )
            code = pick(out.logits[:, -1, :], 1, i + 1)
            frame.append(code)
            step_ids = code[:, None]
        codes = torch.stack(frame, dim=-1)  # (B, num_codebooks)
        embeds = hf.backbone_model.embed_tokens(codes[:, None, :])[:, 0]  # (B, hidden)
        return codes, embeds
