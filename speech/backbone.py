"""CSM's backbone as an engine architecture, so speech requests run on the engine's pages.

The backbone is a Llama-style decoder whose every input row is an embedding: prompt text
rows are ``embed_text_tokens(id)``, context-audio rows and generated frames are the sum of
their codebooks' ``embed_audio_tokens`` (``CsmBackboneModelEmbeddings``). Speech steps
therefore carry their rows' embeddings (``StepInput.embeds``); the runner places them like
media rows and this class hands them to transformers' ``CsmBackboneModel`` with explicit
positions and the engine's paged attention. The layer math is transformers' own.
"""

from __future__ import annotations

from typing import Any

import torch

from engine import Architecture, TextInputs

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
