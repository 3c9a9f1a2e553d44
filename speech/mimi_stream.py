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
``_transposed``), the walk over the SEANet layers that threads the caches through, and the
batching of several streams (``decode_many``: a batch row per stream, conv tails per row,
KV caches of streams at the same position stacked for one transformer call and split back).
``StreamDecodeQueue`` gathers the chunks of concurrent streams into those batches.

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

import copy
import threading
from collections.abc import Sequence
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from speech.errors import SpeechError

__all__ = [
    "MimiStreamDecoder",
    "MimiStreamState",
    "NonCausalCodecError",
    "StreamDecodeQueue",
    "stream_decoder_for",
]


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

    def decode(self, state: MimiStreamState, codes: np.ndarray | torch.Tensor) -> np.ndarray:
        """Float32 PCM (not clipped) of exactly ``frames * samples_per_frame`` new samples for
        the next ``codes`` (frames, codebooks) of the stream; ``state`` advances."""
        return self.decode_many([state], [codes])[0]

    @torch.no_grad()
    def decode_many(
        self, states: Sequence[MimiStreamState], codes: Sequence[np.ndarray | torch.Tensor]
    ) -> list[np.ndarray]:
        """``decode`` of several streams' next codes (distinct states) at once: chunks of the
        same length share one batched pass through the quantizer and the convolutions (one
        row per stream); the decoder transformer runs per stream, each on its own KV cache."""
        if len({id(s) for s in states}) != len(states) or len(states) != len(codes):
            raise ValueError("decode_many takes one chunk of codes per distinct stream state")
        ids = [torch.as_tensor(np.asarray(c), dtype=torch.long, device=self.device) for c in codes]
        for c in ids:
            if c.ndim != 2:
                raise ValueError(f"codes must be (frames, codebooks), got shape {tuple(c.shape)}")
        out: list[np.ndarray] = [np.zeros(0, dtype=np.float32)] * len(ids)
        groups: dict[tuple[int, ...], list[int]] = {}
        for i, c in enumerate(ids):
            if c.shape[0]:
                groups.setdefault(tuple(c.shape), []).append(i)
        for rows in groups.values():
            pcm = self._decode_rows([states[i] for i in rows], torch.stack([ids[i] for i in rows]))
            for i, row in zip(rows, pcm, strict=True):
                out[i] = row
        return out

    def _decode_rows(self, states: list[MimiStreamState], codes: torch.Tensor) -> np.ndarray:
        """(streams, frames, codebooks) codes -> (streams, samples) float32 PCM."""
        hidden = self.codec.quantizer.decode(codes.transpose(1, 2))  # per frame: no state
        t = 0
        if self.decoder.upsample is not None:
            hidden = self._transposed(states, t, hidden)
            t += 1
        hidden = self._transformer(states, hidden)
        convs = states[0].convs if len(states) == 1 else _RowCaches([s.convs for s in states])
        for layer in self.decoder.decoder_seanet.layers:
            if isinstance(layer, self._tconv_cls):
                hidden = self._transposed(states, t, hidden)
                t += 1
            elif isinstance(layer, self._conv_cls | self._block_cls):
                hidden = layer(hidden, padding_cache=convs)  # transformers' streaming path
            else:
                hidden = layer(hidden)
        for state in states:
            state.frames += int(codes.shape[1])
        return hidden[:, 0].float().cpu().numpy()

    def _transformer(self, states: list[MimiStreamState], hidden: torch.Tensor) -> torch.Tensor:
        """The decoder transformer over each stream's own KV cache. Streams at the same position
        (streams that started together) run as one batch: their caches stacked for the call
        and split back after (hand-written state handling over transformers' cache layers)."""
        groups: dict[int, list[int]] = {}
        for i, state in enumerate(states):
            groups.setdefault(state.cache.get_seq_length(), []).append(i)
        out = torch.empty_like(hidden)
        for rows in groups.values():
            caches = [states[i].cache for i in rows]
            stacked = _stack_caches(caches) if len(rows) > 1 else caches[0]
            if stacked is None:  # cache layers of an unknown kind: one stream at a time
                for i in rows:
                    out[i : i + 1] = self._transformer(states[i : i + 1], hidden[i : i + 1])
                continue
            index = torch.tensor(rows, device=hidden.device)
            result = self.decoder.decoder_transformer(
                hidden.index_select(0, index).transpose(1, 2), cache=stacked, use_cache=True
            ).last_hidden_state.transpose(1, 2)
            out.index_copy_(0, index, result)
            if stacked is not caches[0]:
                _split_cache(stacked, caches)
        return out

    def _transposed(self, states: list[MimiStreamState], index: int, hidden: torch.Tensor) -> torch.Tensor:
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
        for i, state in enumerate(states):
            tail = state.tails[index]
            if tail is not None:
                y[i : i + 1, :, : tail.shape[-1]] += tail
            state.tails[index] = y[i : i + 1, :, keep:].clone()  # not a view: y is freed
        y = y[..., :keep]
        if conv.bias is not None:
            y = y + conv.bias[:, None]
        return y


def _stack_caches(caches: list[Any]) -> Any:
    """One ``DynamicCache`` holding ``caches`` (same length, a batch row each), or None when
    a layer is not a plain or sliding-window dynamic layer."""
    from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

    stacked = copy.copy(caches[0])
    stacked.layers = []
    for layers in zip(*(c.layers for c in caches), strict=True):
        kinds = {type(layer) for layer in layers}
        if len(kinds) != 1 or kinds.pop() not in (DynamicLayer, DynamicSlidingWindowLayer):
            return None
        layer = copy.copy(layers[0])  # its scalars (cumulative length, window) are the same in all
        if layer.is_initialized:
            layer.keys = torch.cat([x.keys for x in layers])
            layer.values = torch.cat([x.values for x in layers])
        stacked.layers.append(layer)
    return stacked


def _split_cache(stacked: Any, caches: list[Any]) -> None:
    """``stacked``'s rows back into ``caches`` (row ``i`` -> ``caches[i]``)."""
    for n, layer in enumerate(stacked.layers):
        for i, cache in enumerate(caches):
            row = copy.copy(layer)
            if layer.is_initialized:
                row.keys, row.values = layer.keys[i : i + 1], layer.values[i : i + 1]
            cache.layers[n] = row


class _RowCaches:
    """Several streams' ``MimiConv1dPaddingCache``s as one, a batch row each: transformers'
    own ``update`` per row (a new stream's replicate padding comes from its own row)."""

    def __init__(self, caches: list[Any]):
        self.caches = caches

    def update(self, hidden_states: torch.Tensor, layer_idx: int) -> torch.Tensor:
        return torch.cat([c.update(hidden_states[i : i + 1], layer_idx) for i, c in enumerate(self.caches)])


class StreamDecodeQueue:
    """Chunks of every stream decoded together: ``submit`` queues a stream's next codes, and
    one job on ``executor`` (a single worker) decodes all chunks queued by then in one
    ``decode_many``. While a batch decodes the next one gathers, so concurrent streams share
    passes instead of paying a decode each."""

    def __init__(self, decoder: MimiStreamDecoder, executor: Executor):
        self.decoder = decoder
        self.executor = executor
        self._pending: list[tuple[MimiStreamState, np.ndarray, Future[np.ndarray]]] = []
        self._lock = threading.Lock()
        self._scheduled = False

    def start(self) -> MimiStreamState:
        return self.decoder.start()

    def submit(self, state: MimiStreamState, codes: np.ndarray) -> Future[np.ndarray]:
        """The float32 PCM (not clipped) of ``codes``, the stream's next frames, when decoded.
        A stream submits its next chunk only after this one's result (its state is in use)."""
        future: Future[np.ndarray] = Future()
        with self._lock:
            self._pending.append((state, np.asarray(codes, dtype=np.int64), future))
            if not self._scheduled:
                self._scheduled = True
                self.executor.submit(self._drain)
        return future

    def _drain(self) -> None:
        with self._lock:
            batch, self._pending, self._scheduled = self._pending, [], False
        batch = [b for b in batch if b[2].set_running_or_notify_cancel()]  # a cancelled stream's: dropped
        if not batch:
            return
        try:
            pcm = self.decoder.decode_many([b[0] for b in batch], [b[1] for b in batch])
        except BaseException as e:  # every stream of the batch fails with it
            for b in batch:
                b[2].set_exception(e)
            return
        for b, row in zip(batch, pcm, strict=True):
            b[2].set_result(row)


def stream_decoder_for(codec_model: Any) -> MimiStreamDecoder | None:
    """A ``MimiStreamDecoder`` for ``codec_model``, or None when it cannot stream exactly
    (``NonCausalCodecError``): the caller then decodes chunks with left context."""
    try:
        return MimiStreamDecoder(codec_model)
    except NonCausalCodecError:
        return None
