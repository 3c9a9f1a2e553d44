"""What differs between the served architectures, in one place per architecture.

Each ``Architecture`` wraps a loaded transformers model and knows how its language model
is entered: how token ids become ``inputs_embeds`` (and which rows receive media
embeddings), what else the layers need (DeepStack features, per-layer embeddings), how
many position axes it uses, and how hidden states become logits. Everything else (the
decoder layers' math) is the transformers module, called as is.

Selection is by the exact ``architectures[0]`` name in config.json.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from engine.errors import UnsupportedArchitectureError
from engine.kv_pool import LayerLayout

# Architectures we know but do not serve here, with the reason.
NOT_SERVED = {
    "Qwen3ForCausalLM": "a text-only Qwen3 checkpoint; this engine serves Qwen3VLForConditionalGeneration",
    "Qwen2ForCausalLM": "a text-only checkpoint; this engine serves multimodal models",
    "LlamaForCausalLM": "a text-only checkpoint; this engine serves multimodal models",
    "Gemma4ForCausalLM": "the text-only Gemma-4 head; this engine serves Gemma4ForConditionalGeneration",
    "Qwen2VLForConditionalGeneration": "Qwen2-VL is not supported (only Qwen3-VL)",
    "Qwen2_5_VLForConditionalGeneration": "Qwen2.5-VL is not supported (only Qwen3-VL)",
    "Qwen3VLMoeForConditionalGeneration": "Qwen3-VL-MoE is not supported yet (only dense Qwen3-VL)",
    "CsmForConditionalGeneration": "CSM is a speech-output model, served by model.speak(), not by contexts",
}


@dataclass
class TextInputs:
    """One flattened forward batch, as the architecture needs it."""

    ids: torch.Tensor
    """(N,) token id per row."""
    positions: torch.Tensor
    """(n_axes, N) absolute positions."""
    media_rows: torch.Tensor
    """(M,) rows that take media embeddings, in order."""
    media_embeds: torch.Tensor | None
    """(M, hidden) the embeddings for those rows."""
    deepstack: list[torch.Tensor] | None
    """Qwen3-VL: per DeepStack layer (M, hidden), aligned with ``media_rows``."""


class LMHead:
    """The LM head (``hf.lm_head``) applied to (rows, hidden) states, fast on the CPU.

    In a decode pass of a small model the head over a ~150k vocabulary costs more than all
    decoder layers, and MKL's ``F.linear`` is slow for that shape (few rows, huge output).
    A plain bias-free fp32 ``Linear`` on the CPU therefore runs through oneDNN with the
    weight packed once (about 2x faster than ``F.linear`` here; logits within ~1e-6 of
    it; the packed copy costs the head's size in memory), or, without oneDNN, as
    ``weight @ hidden.T`` (same sums as ``F.linear``, about 1.5x faster). Anything else
    (CUDA, other dtypes, custom heads) calls the module."""

    def __init__(self, head: torch.nn.Module):
        self.head = head
        self._packed: tuple[tuple[int, int], torch.Tensor] | None = None

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        head, w = self.head, getattr(self.head, "weight", None)
        if (
            type(head) is not torch.nn.Linear
            or head.bias is not None
            or w is None
            or hidden.dim() != 2
            or hidden.device.type != "cpu"
            or not (w.dtype == hidden.dtype == torch.float32)
        ):
            return head(hidden)
        packed = self._packed_weight(w)
        if packed is not None:
            return torch.ops.mkldnn._linear_pointwise(hidden.contiguous(), packed, None, "none", [None], "")
        return torch.matmul(w, hidden.t()).t().contiguous()

    def _packed_weight(self, w: torch.Tensor) -> torch.Tensor | None:
        key = (w.data_ptr(), w._version)
        if self._packed is not None and self._packed[0] == key:
            return self._packed[1]
        if not _ONEDNN_LINEAR:
            return None
        with torch.no_grad():
            packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), None)
        self._packed = (key, packed)
        return packed


_ONEDNN_LINEAR = (
    torch.backends.mkldnn.is_available()
    and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    and hasattr(torch.ops.mkldnn, "_linear_pointwise")
)


class Architecture:
    name: str = ""
    family: str = ""
    position_axes: int = 1

    def __init__(self, hf: Any):
        self.hf = hf
        self.text_config = hf.config.get_text_config()
        self._lm_head: LMHead | None = None

    # -- facts ------------------------------------------------------------------------------
    @property
    def language_model(self) -> torch.nn.Module:
        return self.hf.model.language_model

    @property
    def hidden_size(self) -> int:
        return int(self.text_config.hidden_size)

    @property
    def vocab_size(self) -> int:
        return int(self.text_config.vocab_size)

    def placeholder_ids(self) -> dict[str, int]:
        """kind -> the placeholder token id rows of that kind carry."""
        raise NotImplementedError

    def media_marker(self, kind: str) -> str:
        """What the chat template writes for one media item of ``kind`` (the processor
        replaces exactly this text with the item's span)."""
        raise NotImplementedError

    def layer_layouts(self) -> list[LayerLayout]:
        out = []
        for i, layer in enumerate(self.language_model.layers):
            attn = layer.self_attn
            share = self.kv_source(i)
            if share is not None:
                out.append(LayerLayout(0, attn.head_dim, shares_with=share))
                continue
            kv_heads = attn.k_proj.out_features // attn.head_dim
            out.append(LayerLayout(kv_heads, attn.head_dim))
        return out

    def kv_source(self, layer: int) -> int | None:
        """The layer whose K/V ``layer`` reads instead of its own (KV sharing), or None."""
        return None

    def block_overlay_layers(self) -> frozenset[int]:
        """Layers where rows of one image/video block attend to each other both ways."""
        return frozenset()

    def encoder_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``encoders.encoder_for`` that hand it our loaded towers."""
        return {}

    # -- the forward pass -------------------------------------------------------------------
    def hidden_states(self, inp: TextInputs, **attn_kwargs: Any) -> torch.Tensor:
        raise NotImplementedError

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        if self._lm_head is None or self._lm_head.head is not self.hf.lm_head:
            self._lm_head = LMHead(self.hf.lm_head)
        return self._lm_head(hidden)

    def _scatter(self, embeds: torch.Tensor, inp: TextInputs) -> torch.Tensor:
        if inp.media_embeds is None or inp.media_rows.numel() == 0:
            return embeds
        embeds = embeds.clone()
        embeds[inp.media_rows] = inp.media_embeds.to(embeds.device, embeds.dtype)
        return embeds


class Qwen3VL(Architecture):
    """``Qwen3VLForConditionalGeneration``: M-RoPE over (t, h, w), DeepStack.

    Reference (``Qwen3VLModel.forward``): ``inputs_embeds = embed_tokens(input_ids)`` then
    ``masked_scatter`` of the merged vision features at the image/video pad rows; the
    text model gets 3-axis ``position_ids`` (``get_rope_index``), ``visual_pos_masks``
    (the pad rows) and ``deepstack_visual_embeds`` (added after decoder layers 0..k-1)."""

    name = "Qwen3VLForConditionalGeneration"
    family = "qwen3_vl"
    position_axes = 3

    def placeholder_ids(self) -> dict[str, int]:
        c = self.hf.config
        return {"image": int(c.image_token_id), "video": int(c.video_token_id)}

    def media_marker(self, kind: str) -> str:
        pad = {"image": "<|image_pad|>", "video": "<|video_pad|>"}[kind]
        return f"<|vision_start|>{pad}<|vision_end|>"

    def encoder_kwargs(self) -> dict[str, Any]:
        return {"tower": self.hf.model.visual}

    def hidden_states(self, inp: TextInputs, **attn_kwargs: Any) -> torch.Tensor:
        lm = self.language_model
        embeds = self._scatter(lm.embed_tokens(inp.ids), inp)
        visual_mask = None
        deepstack = None
        if inp.deepstack and inp.media_rows.numel():
            visual_mask = torch.zeros(1, inp.ids.shape[0], dtype=torch.bool, device=embeds.device)
            visual_mask[0, inp.media_rows] = True
            deepstack = [d.to(embeds.device, embeds.dtype) for d in inp.deepstack]
        out = lm(
            inputs_embeds=embeds[None],
            position_ids=inp.positions[:, None, :],
            visual_pos_masks=visual_mask,
            deepstack_visual_embeds=deepstack,
            use_cache=False,
            **attn_kwargs,
        )
        return out.last_hidden_state[0]


class Gemma4(Architecture):
    """``Gemma4ForConditionalGeneration``: sliding/full layers, per-layer embeddings (PLE),
    final logit soft-cap, optional bidirectional vision blocks and KV sharing.

    Reference (``Gemma4Model.forward``): placeholder ids (image/video/audio) become the pad
    id, ``inputs_embeds = embed_tokens(ids)`` (scaled by sqrt(hidden)); the PLE token part
    is ``get_per_layer_inputs`` of those pad-substituted ids; media features are
    ``masked_scatter``-ed at the placeholder rows; the text model then projects the
    merged ``inputs_embeds`` for PLE. Logits are ``tanh(x / cap) * cap``."""

    name = "Gemma4ForConditionalGeneration"
    family = "gemma4"
    position_axes = 1

    def __init__(self, hf: Any):
        super().__init__(hf)
        tc = self.text_config
        if getattr(tc, "use_bidirectional_attention", None) == "all":
            raise UnsupportedArchitectureError(
                "Gemma-4 with use_bidirectional_attention='all' is an encoder, not a generator"
            )
        self._placeholders: dict[torch.device, torch.Tensor] = {}
        modes = list(tc.kv_sharing_modes)
        self._kv_source: dict[int, int] = {}
        for i, mode in enumerate(modes):
            if mode == "reuse":
                kind = tc.layer_types[i]
                src = [j for j, m in enumerate(modes) if m == "store" and tc.layer_types[j] == kind]
                if len(src) != 1:
                    raise UnsupportedArchitectureError(f"cannot find the K/V producer of shared layer {i}")
                self._kv_source[i] = src[0]

    def placeholder_ids(self) -> dict[str, int]:
        c = self.hf.config
        out = {"image": int(c.image_token_id), "video": int(c.video_token_id)}
        if getattr(c, "audio_token_id", None) is not None:
            out["audio"] = int(c.audio_token_id)
        return out

    def media_marker(self, kind: str) -> str:
        return {"image": "<|image|>", "audio": "<|audio|>", "video": "<|video|>"}[kind]

    def kv_source(self, layer: int) -> int | None:
        return self._kv_source.get(layer)

    def block_overlay_layers(self) -> frozenset[int]:
        if getattr(self.text_config, "use_bidirectional_attention", None) != "vision":
            return frozenset()
        # create_masks_for_vision_model: sliding layers get AND(window, OR(causal, block));
        # full-attention layers stay causal.
        return frozenset(i for i, t in enumerate(self.text_config.layer_types) if t == "sliding_attention")

    def encoder_kwargs(self) -> dict[str, Any]:
        m = self.hf.model
        towers = {
            "vision_tower": m.vision_tower,
            "embed_vision": m.embed_vision,
            "audio_tower": m.audio_tower,
            "embed_audio": m.embed_audio,
        }
        return {"towers": {k: v for k, v in towers.items() if v is not None}}

    def hidden_states(self, inp: TextInputs, **attn_kwargs: Any) -> torch.Tensor:
        lm = self.language_model
        ids = inp.ids
        placeholders = self._placeholders.get(ids.device)
        if placeholders is None:  # made once per device: no host-to-device copy per pass
            placeholders = torch.tensor(sorted(self.placeholder_ids().values()), device=ids.device)
            self._placeholders[ids.device] = placeholders
        pad = int(self.text_config.pad_token_id)
        llm_ids = torch.where(torch.isin(ids, placeholders), torch.full_like(ids, pad), ids)
        embeds = self._scatter(lm.embed_tokens(llm_ids), inp)
        per_layer = None
        if self.text_config.hidden_size_per_layer_input:
            per_layer = lm.get_per_layer_inputs(llm_ids[None], None)
        out = lm(
            inputs_embeds=embeds[None],
            per_layer_inputs=per_layer,
            position_ids=inp.positions[:1],
            use_cache=False,
            **attn_kwargs,
        )
        return out.last_hidden_state[0]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        cap = self.text_config.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits


ARCHITECTURES: dict[str, type[Architecture]] = {cls.name: cls for cls in (Qwen3VL, Gemma4)}


def architecture_class(archs: Sequence[str] | None) -> type[Architecture]:
    if not archs:
        raise UnsupportedArchitectureError("config.json names no 'architectures'; cannot pick a model class")
    name = archs[0]
    if name in ARCHITECTURES:
        return ARCHITECTURES[name]
    served = ", ".join(sorted(ARCHITECTURES))
    why = NOT_SERVED.get(name, "unknown to this engine")
    raise UnsupportedArchitectureError(f"architecture {name!r} is not served: {why}. Served: {served}")
