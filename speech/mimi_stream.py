"""Stateful streaming Mimi decode: each codec frame of a stream is decoded once.

``MimiModel.decode`` is stateless apart from its decoder transformer's KV cache, so a stream
decoded chunk by chunk had to re-decode a window of left context every chunk. Mimi's decoder
is causal throughout (``use_causal_conv``), so the state a chunk needs from the past is small
and fixed: per causal ``MimiConv1d`` its last ``padding_total`` input samples, per causal
``MimiConvTranspose1d`` (the upsample layer and the SEANet upsamplers) the ``kernel - stride``
output samples that still await the next input's overlap, and the decoder transformer's KV
cache (a sliding-window ``DynamicCache``, as ``MimiTransformerModel`` would make).

Everything numeric is transformers' own: the quantizer's ``decode``, ``MimiConv1d.forward``
with transformers' ``MimiConv1dPaddingCache`` (its streaming path, which only the encoder
uses), the decoder transformer's ``forward`` with its cache, the convolutions' weights. Only
the state handling is written here: the transposed convolutions' overlap-add (see
``_transposed``) and the walk over the SEANet layers that threads the caches through.

Chunks joined equal the whole-clip ``MimiModel.decode`` up to float reordering: in float64
to the returned float32's rounding (4.7e-7 at a raw peak of 11.8), in float32 within ~2e-6 of
the clip's peak (2.7e-5 absolute on the random tiny codec, whose activations reach ~20; its
own decode of a prefix already differs from the whole clip's by 1e-5). The convolution kernels
run at other lengths, and the transposed convolutions add overlap and bias in another order.
See tests/speech/test_mimi_stream.py for the tolerances. A non-causal codec (centred padding,
or a transposed convolution trimmed on the left) needs future samples and cannot be streamed
exactly: ``MimiStreamDecoder`` refuses it with ``NonCausalCodecError`` and
``stream_decoder_for`` answers None, so callers keep the left-context chunk decode.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from speech.errors import SpeechError

__all__ = ["MimiStreamDecoder", "MimiStreamState", "NonCausalCodecError", "stream_decoder_for"]


class NonCausalCodecError(SpeechError):
    """The Mimi codec's decoder looks ahead (non-causal padding), so it cannot be decoded
    frame by frame; decode with left context instead."""

    code = "non_causal_codec"


@dataclass
class MimiStreamState:
    """One stream's decoder state (``MimiStreamDecoder.start``); used by one thread at a time."""

    convs: Any
    """transformers' ``MimiConv1dPaddingCache``: every causal conv's left-padding input tail."""
    cache: Any
    """The decoder transformer's KV cache (sliding window)."""
    tails: list[torch.Tensor | None] = field(default_factory=list)
    """Per transposed convolution (upsample first, then SEANet's): the overlap held back."""
    frames: int = 0
    """Frames decoded so far."""


class MimiStreamDecoder:
    """Decodes a stream of Mimi codes chunk by chunk, every frame once (see the module)."""

    def __init__(self, codec_model: Any):
        from transformers.models.mimi.modeling_mimi import MimiConv1d, MimiConvTranspose1d, MimiResnetBlock

        self._conv_cls, self._tconv_cls, self._block_cls = MimiConv1d, MimiConvTranspose1d, MimiResnetBlock
        decoder = getattr(codec_model, "decoder", None)
        if decoder is None or not hasattr(decoder, "decoder_seanet"):
            raise NonCausalCodecError("the codec has no Mimi decoder to stream")
        self.codec = codec_model
        self.decoder = decoder
        self.config = decoder.config
        if not getattr(self.config, "use_causal_conv", False):
            raise NonCausalCodecError("the Mimi codec is not causal (use_causal_conv=False)")
        seanet = decoder.decoder_seanet
        for layer in seanet.layers:
            if not isinstance(layer, MimiConv1d | MimiConvTranspose1d | MimiResnetBlock | nn.ELU):
                raise NonCausalCodecError(f"unknown Mimi decoder layer {type(layer).__name__}")
        self.transposed = [decoder.upsample] if decoder.upsample is not None else []
        self.transposed += [m for m in seanet.layers if isinstance(m, MimiConvTranspose1d)]
        for m in self.transposed:
            if not m.causal or m.padding_left != 0:
                raise NonCausalCodecError(
                    "a Mimi transposed convolution is trimmed on the left (trim_right_ratio != 1): "
                    "its output needs future frames"
                )
        self.convs = [m for m in seanet.modules() if isinstance(m, MimiConv1d)]
        for i, m in enumerate(self.convs):
            if not m.causal or int(m.stride) != 1 or m.pad_mode not in ("constant", "replicate"):
                raise NonCausalCodecError(
                    f"a Mimi decoder convolution is not causal with stride 1 (causal={m.causal}, "
                    f"stride={int(m.stride)}, pad_mode={m.pad_mode!r})"
                )
            # MimiConv1dPaddingCache finds a conv's tail by its layer_idx. MimiEncoder numbers
            # its own convs; the decoder's are unnumbered (None) since only the encoder streams.
            # The numbering is a fixed function of the module tree: every decoder agrees.
            if m.layer_idx not in (None, i):
                raise NonCausalCodecError(f"a Mimi decoder convolution is already numbered {m.layer_idx}")
            m.layer_idx = i
        self.samples_per_frame = int(np.prod(self.config.upsampling_ratios)) * (
            int(self.config.latent_stride) if decoder.upsample is not None else 1
        )
        param = next(codec_model.parameters())
        self.device, self.dtype = param.device, param.dtype

    def start(self) -> MimiStreamState:
        """A fresh stream: zero (or replicated, per ``pad_mode``) left padding, empty caches."""
        from transformers import DynamicCache
        from transformers.models.mimi.modeling_mimi import MimiConv1dPaddingCache

        convs = MimiConv1dPaddingCache(
            num_layers=len(self.convs),
            per_layer_padding=[int(m.padding_total) for m in self.convs],
            per_layer_padding_mode=[m.pad_mode for m in self.convs],
            per_layer_in_channels=[m.in_channels for m in self.convs],
        )
        cache = DynamicCache(config=self.decoder.decoder_transformer.config)
        return MimiStreamState(convs=convs, cache=cache, tails=[None] * len(self.transposed))

    @torch.no_grad()
    def decode(self, state: MimiStreamState, codes: np.ndarray | torch.Tensor) -> np.ndarray:
        """Float32 PCM (not clipped) of exactly ``frames * samples_per_frame`` new samples for
        the next ``codes`` (frames, codebooks) of the stream; ``state`` advances."""
        codes = torch.as_tensor(np.asarray(codes), dtype=torch.long, device=self.device)
        if codes.ndim != 2:
            raise ValueError(f"codes must be (frames, codebooks), got shape {tuple(codes.shape)}")
        if codes.shape[0] == 0:
            return np.zeros(0, dtype=np.float32)
        hidden = self.codec.quantizer.decode(codes.transpose(0, 1).unsqueeze(0))  # per frame: no state
        t = 0
        if self.decoder.upsample is not None:
            hidden = self._transposed(state, t, hidden)
            t += 1
        out = self.decoder.decoder_transformer(hidden.transpose(1, 2), cache=state.cache, use_cache=True)
        hidden = out.last_hidden_state.transpose(1, 2)
        for layer in self.decoder.decoder_seanet.layers:
            if isinstance(layer, self._tconv_cls):
                hidden = self._transposed(state, t, hidden)
                t += 1
            elif isinstance(layer, self._conv_cls | self._block_cls):
                hidden = layer(hidden, padding_cache=state.convs)  # transformers' streaming path
            else:
                hidden = layer(hidden)
        state.frames += int(codes.shape[0])
        return hidden[0, 0].float().cpu().numpy()

    def _transposed(self, state: MimiStreamState, index: int, hidden: torch.Tensor) -> torch.Tensor:
        """A causal ``MimiConvTranspose1d`` over new input only (hand-written state handling).

        The full layer computes ``conv_transpose(x)`` and trims ``kernel - stride`` samples on
        the right. Over a stream: the previous call's trailing ``kernel - stride`` samples (its
        would-be right trim, awaiting this input's overlap) are added into this call's head,
        and this call's own trailing ``kernel - stride`` are held back. The bias is added once,
        to the samples emitted (adding it in the conv would count it twice in the overlap)."""
        conv = self.transposed[index].conv
        y = nn.functional.conv_transpose1d(
            hidden,
            conv.weight,
            None,
            conv.stride,
            conv.padding,
            conv.output_padding,
            conv.groups,
            conv.dilation,
        )
        keep = hidden.shape[-1] * conv.stride[0]
        tail = state.tails[index]
        if tail is not None:
            y[..., : tail.shape[-1]] += tail
        state.tails[index] = y[..., keep:].clone()  # not a view: y is freed
        y = y[..., :keep]
        if conv.bias is not None:
            y = y + conv.bias[:, None]
        return y


def stream_decoder_for(codec_model: Any) -> MimiStreamDecoder | None:
    """A ``MimiStreamDecoder`` for ``codec_model``, or None when it cannot stream exactly
    (``NonCausalCodecError``): the caller then decodes chunks with left context."""
    try:
        return MimiStreamDecoder(codec_model)
    except NonCausalCodecError:
        return None
