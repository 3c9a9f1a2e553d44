"""One codec frame for every speech stream of a pass, computed together.

After the backbone pass, each stream that asked for a frame (a "head" step) has its last
hidden state. ``FrameHead.run`` picks codebook 0 from the backbone's ``lm_head`` for all of
them, then runs the depth decoder once per codebook step over all of them (they are all on
the same step: a frame always starts at the depth decoder's position 0, so the batch needs
no padding and a plain ``DynamicCache``), and returns each stream's codes with the summed
codebook embedding that feeds the frame back to the backbone.

Sampling is per stream (its own settings and ``torch.Generator``): greedy rows of a pass
are one argmax; a sampled row draws from its own row of the logits with its own generator,
in the same order as alone (codebook 0, then 1..n-1), so a seeded request gives the same
frames alone and batched. Logits processing follows transformers' order: suppress,
temperature, top-k, softmax, multinomial. Ids ``>= codebook_size`` are suppressed at both
levels (random weights can pick the 3 specials past the Mimi codes; Mimi would index out
of range); id 0, the eos code, is a valid code and is kept for the stop rule.
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


def pick(
    logits: torch.Tensor, suppress: torch.Tensor, s: Sampling, gen: torch.Generator | None
) -> torch.Tensor:
    """Next id per row of ``logits`` (B, V), as transformers' processors + greedy/sample do."""
    scores = logits.float().masked_fill(suppress, float("-inf"))
    if not s.do_sample:
        return scores.argmax(-1)
    scores = scores / s.temperature
    if s.top_k is not None and 0 < s.top_k < scores.shape[-1]:
        kth = torch.topk(scores, s.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.multinomial(probs, 1, generator=gen).squeeze(-1)


def pick_rows(
    logits: torch.Tensor, suppress: torch.Tensor, levels: Sequence[Sampling], gens: Sequence[Any]
) -> torch.Tensor:
    """``pick`` for a batch whose rows each have their own settings and generator."""
    if not any(s.do_sample for s in levels):
        return pick(logits, suppress, GREEDY, None)
    return torch.cat(
        [pick(logits[i : i + 1], suppress, s, g) for i, (s, g) in enumerate(zip(levels, gens, strict=True))]
    )


class FrameHead:
    """The ``engine`` runner's ``BatchedHead`` for a CSM model (see the module doc)."""

    def __init__(self, hf: Any, suppress: torch.Tensor):
        self.hf = hf
        self.suppress = suppress
        self.num_codebooks = int(hf.config.num_codebooks)
        self.cache_keyword = cache_keyword(hf.depth_decoder)
        self.frames = 0
        """Frames made so far (all streams)."""
        self.graphs: Any = None
        """A ``speech.depth_graphs.DepthGraphs``: depth steps of the passes it takes run there."""

    @torch.inference_mode()
    def run(self, hidden: torch.Tensor, requests: Sequence[FrameRequest]) -> list[FrameResult]:
        from transformers import DynamicCache

        hf = self.hf
        gens = [r.generator for r in requests]
        hidden = hidden.to(hf.dtype)
        first = pick_rows(hf.lm_head(hidden), self.suppress, [r.backbone for r in requests], gens)
        depth_levels = [r.depth for r in requests]
        cache = DynamicCache(config=hf.depth_decoder.config)
        step_ids = torch.stack([torch.zeros_like(first), first], dim=-1)
        frame = [first]
        graphs = self.graphs if self.graphs is not None and self.graphs.takes(len(requests)) else None
        for i in range(self.num_codebooks - 1):
            if graphs is not None:
                logits = graphs.step(i, frame[-1], hidden if i == 0 else None)
            else:
                out = hf.depth_decoder(
                    input_ids=step_ids,
                    backbone_last_hidden_state=hidden if i == 0 else None,
                    use_cache=True,
                    logits_to_keep=1,
                    **{self.cache_keyword: cache},
                )
                logits = out.logits[:, -1, :]
            code = pick_rows(logits, self.suppress, depth_levels, gens)
            frame.append(code)
            step_ids = code[:, None]
        codes = torch.stack(frame, dim=-1)  # (B, num_codebooks)
        embeds = hf.backbone_model.embed_tokens(codes[:, None, :])[:, 0]  # (B, hidden)
        self.frames += len(requests)
        return [FrameResult([int(c) for c in row], embeds[i]) for i, row in enumerate(codes.tolist())]
