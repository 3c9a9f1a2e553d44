"""CSM's backbone as an engine architecture, so speech requests run on the engine's pages.

The backbone is a Llama-style decoder whose every input row is an embedding: prompt text
rows are ``embed_text_tokens(id)``, context-audio rows and generated frames are the sum of
their codebooks' ``embed_audio_tokens`` (``CsmBackboneModelEmbeddings``). Speech steps
therefore carry their rows' embeddings (``StepInput.embeds``); the runner places them like
media rows and this class hands them to transformers' ``CsmBackboneModel`` with explicit
positions and the engine's paged attention. The layer math is transformers' own.

``backbone_graphs``: the frame passes (every step one embedding row wanting the frame head)
replayed from CUDA graphs, by ``engine.decode_graphs.DecodeGraphs(inputs="embeds")``.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

from engine import Architecture, TextInputs

if TYPE_CHECKING:
    from engine import ForwardRunner
    from engine.decode_graphs import DecodeGraphs

log = logging.getLogger(__name__)

CSM_ARCHITECTURE = "CsmForConditionalGeneration"


class CsmBackbone(Architecture):
    name = CSM_ARCHITECTURE
    family = "csm"
    position_axes = 1

    @property
    def language_model(self) -> torch.nn.Module:
        return self.hf.backbone_model

    @property
    def hidden_size(self) -> int:
        return int(self.hf.config.hidden_size)

    @property
    def vocab_size(self) -> int:
        return int(self.hf.config.vocab_size)

    def placeholder_ids(self) -> dict[str, int]:
        return {}

    def hidden_states(self, inp: TextInputs, **attn_kwargs: Any) -> torch.Tensor:
        n = inp.ids.shape[0]
        if inp.media_embeds is None or inp.media_rows.numel() != n:
            raise ValueError(
                "every row of a CSM backbone pass must come with its embedding (StepInput.embeds)"
            )
        embeds = inp.media_embeds.new_empty(n, inp.media_embeds.shape[-1])
        embeds[inp.media_rows] = inp.media_embeds
        out = self.language_model(
            inputs_embeds=embeds[None].to(self.hf.dtype),
            position_ids=inp.positions[:1],
            use_cache=False,
            **attn_kwargs,
        )
        return out.last_hidden_state[0]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.hf.lm_head(hidden)


def backbone_graphs(runner: ForwardRunner, max_batch: int, *, capture: bool) -> DecodeGraphs | None:
    """Graphs for the backbone's frame passes of up to ``max_batch`` streams, every bucket
    captured (``capture=False``: run through the buffers) before the first request; None,
    with the reason logged, where the engine's graphs cannot run this model: they attend
    with flashinfer (CUDA, float16/bfloat16) and its kernels' head sizes (64, 128, 256), so
    e.g. a float32 model or the tiny fixture's 16-wide heads keep eager backbone passes
    (the frame head's graphs, ``speech.depth_graphs``, need neither)."""
    from engine.decode_graphs import DecodeGraphs

    try:
        graphs = DecodeGraphs(runner, max_batch=max_batch, capture=capture, inputs="embeds")
    except ValueError as e:
        log.info("speech backbone passes run without CUDA graphs: %s", e)
        return None
    graphs.warm()
    return graphs
