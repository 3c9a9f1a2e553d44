"""CSM's frame head replayed from CUDA graphs: a whole frame per batch bucket in one replay.

Each frame of each stream runs codebook 0 (the backbone's ``lm_head``) and then the depth
decoder ``num_codebooks - 1`` times (31 small steps on a real CSM), batched over the
streams of a pass (``speech.frame_head``). On a GPU these steps are host-bound: a few tiny
layers whose kernels the host launches one by one from transformers' modules. Here the
whole frame (codebook 0, every depth step with its code choice, and the frame's summed
codebook embedding) is one static function of static buffers, captured once per bucket
and launched as one replay.

What makes that possible: the code choice of every step happens on the device
(``speech.frame_head.choose``: greedy rows an argmax; sampled rows per-row temperature and
top-k, then an exponential race over noise the streams drew from their own generators
BEFORE the replay, ``draw_noise``), so no value goes back to the host between steps; and
every step's shape and position are fixed (a frame always starts at the depth decoder's
position 0: step 0 feeds two positions, the backbone's hidden state and codebook 0, later
steps one), so the step loop unrolls into the graph. Two graphs per bucket: one whose rows
are all greedy (argmaxes only) and one with the sampler (its sort for top-k is skipped by
passes with no sampled row).

Buffers, per model (a bucket uses their first B rows): the backbone hidden states (B, H),
the per-row settings (B, 2, 3) and noise (B, num_codebooks, V) in, codes (B,
num_codebooks) and frame embeddings (B, H) out; a KV cache whose layers write into static
tensors (B, kv_heads, num_codebooks, head_dim) at each step's fixed positions and attend
over exactly the positions written so far (the same shapes and values as the
``DynamicCache`` of the plain path, so the same numbers, not a masked full-length
``StaticCache``, whose length lives in a device tensor read by the host). The depth inputs
go in as embeddings, computed as the model does from ids (the codebook's offset into the
shared table; the hidden state at position 0), because the model reads a device value on
the host when only ids are given, which a capture forbids. Rows past a pass's batch are
padding: they run on whatever the buffers hold and are never read; every op works row by
row (attention within a row's own cache, the sampler within a row), so they cannot change
the real rows.

``capture=False`` runs the same static-buffer frame eagerly instead of replaying a graph:
everything but the capture, which is how it is tested on the CPU. vLLM and SGLang capture
inside their own runners; there is no library to call for this.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from engine.decode_graphs import BUCKETS
from speech.frame_head import FrameRequest, choose, draw_noise, greedy, row_settings, samples
from speech.hf_cache import cache_keyword

log = logging.getLogger(__name__)


def _fixed_layer_class() -> type:
    from transformers.cache_utils import DynamicLayer

    class FixedLayer(DynamicLayer):
        """A ``DynamicLayer`` whose keys and values live in preallocated tensors: ``update``
        writes the new positions in place and returns views of the positions so far, and the
        length is a host integer (set per step), so a captured step has fixed addresses."""

        def __init__(self, keys: torch.Tensor, values: torch.Tensor):
            super().__init__()
            self.store = (keys, values)
            self.device = keys.device
            self.is_initialized = True
            self.seek(0)

        def seek(self, length: int) -> None:
            """Positions ``0..length-1`` count as written (the next update writes after them)."""
            self.length = length
            self.keys = self.store[0][:, :, :length]
            self.values = self.store[1][:, :, :length]

        def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
            return None

        def update(
            self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
        ) -> tuple[torch.Tensor, torch.Tensor]:
            start, end = self.length, self.length + key_states.shape[-2]
            self.store[0][:, :, start:end].copy_(key_states)
            self.store[1][:, :, start:end].copy_(value_states)
            self.seek(end)
            return self.keys, self.values

        def get_seq_length(self) -> int:
            return self.length

    return FixedLayer


class DepthGraphs:
    """Frames of a whole batch from static buffers, one replay each (see the module doc).
    ``FrameHead`` calls ``frame`` for a pass it ``takes``."""

    def __init__(self, hf: Any, max_batch: int, *, capture: bool, suppress: torch.Tensor | None = None):
        """``suppress``: (V,) bool, the ids never chosen (default: ids >= the codec's
        codebook size, as ``SpeechModel`` suppresses)."""
        from transformers.cache_utils import Cache

        if max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, got {max_batch}")
        depth = hf.depth_decoder
        cfg = depth.config
        self.depth = depth
        self.lm_head = hf.lm_head
        self.frame_embed = hf.backbone_model.embed_tokens
        self.cache_keyword = cache_keyword(depth)
        self.embed = depth.model.embed_tokens
        self.vocab = int(depth.model.vocab_size)
        self.num_codebooks = int(hf.config.num_codebooks)
        self.steps = self.num_codebooks - 1
        param = next(depth.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.capture = capture
        if capture and self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device; the depth decoder is on {self.device}")
        self.max_batch = max_batch
        self.buckets = [b for b in BUCKETS if b < max_batch] + [max_batch]
        dev = self.device
        if suppress is None:
            suppress = torch.arange(self.vocab) >= int(hf.config.codec_config.codebook_size)
        self.suppress = suppress.to(dev)
        hidden_size = int(cfg.backbone_hidden_size)
        self.hidden = torch.zeros(max_batch, hidden_size, dtype=self.dtype, device=dev)
        self.settings = torch.tensor([[1.0, 1.0, float(self.vocab)]] * 2, device=dev).repeat(max_batch, 1, 1)
        self.noise = torch.ones(max_batch, self.num_codebooks, self.vocab, device=dev)
        self.codes = torch.zeros(max_batch, self.num_codebooks, dtype=torch.long, device=dev)
        self.embeds = torch.zeros(max_batch, hidden_size, dtype=self.dtype, device=dev)
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        shape = (max_batch, int(cfg.num_key_value_heads), self.num_codebooks, int(head_dim))
        self._kv = [
            (
                torch.zeros(shape, dtype=self.dtype, device=dev),
                torch.zeros(shape, dtype=self.dtype, device=dev),
            )
            for _ in range(int(cfg.num_hidden_layers))
        ]
        layer = _fixed_layer_class()
        self._caches = {b: Cache(layers=[layer(k[:b], v[:b]) for k, v in self._kv]) for b in self.buckets}
        self._graphs: dict[tuple[int, bool], Any] = {}
        self._mempool: Any = None
        self.bucket_frames: dict[int, int] = {}
        """Frame passes run per bucket (which padded shapes the passes took)."""
        self.replays = 0
        """Frame passes replayed from a graph (or, with ``capture=False``, run through the
        buffers): one per pass, whatever the number of codebooks."""
        self.sampled_replays = 0
        """Of those, passes with a sampled row (the sampler's graph)."""
        self.captures = 0

    def __repr__(self) -> str:
        return (
            f"DepthGraphs(buckets={self.buckets}, steps={self.steps}, captured={len(self._graphs)}, "
            f"replays={self.replays}, capture={self.capture})"
        )

    def takes(self, batch: int) -> bool:
        """Whether a pass of ``batch`` streams runs here (larger ones run as usual)."""
        return 0 < batch <= self.max_batch

    def bucket(self, batch: int) -> int:
        return next(b for b in self.buckets if b >= batch)

    # -- a frame ------------------------------------------------------------------------------
    def frame(
        self, hidden: torch.Tensor, requests: Sequence[FrameRequest]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(n, num_codebooks) codes and (n, H) frame embeddings of ``n`` streams whose
        backbone last hidden states are ``hidden`` (n, H) (copies, not the buffers)."""
        n = len(requests)
        if not self.takes(n) or hidden.shape[0] != n:
            raise ValueError(
                f"{n} requests and {hidden.shape[0]} hidden states for buckets up to {self.max_batch}"
            )
        bucket = self.bucket(n)
        sampling = any(samples(r) for r in requests)
        with torch.inference_mode():
            self.hidden[:n].copy_(hidden)
            if sampling:
                settings = row_settings(requests, self.vocab)
                if self.device.type == "cuda":  # no sync: the stream orders the copy
                    settings = settings.pin_memory()
                self.settings[:n].copy_(settings, non_blocking=True)
                draw_noise(self.noise[:n], requests)
            if self.capture:
                graph = self._graphs.get((bucket, sampling))
                if graph is None:
                    graph = self._capture(bucket, sampling)
                graph.replay()
            else:
                self._forward(bucket, sampling)
            codes, embeds = self.codes[:n].clone(), self.embeds[:n].clone()
        self.replays += 1
        self.sampled_replays += sampling
        self.bucket_frames[bucket] = self.bucket_frames.get(bucket, 0) + 1
        return codes, embeds

    def _forward(self, bucket: int, sampling: bool) -> None:
        """A frame over the first ``bucket`` rows of the static buffers."""
        hidden = self.hidden[:bucket]

        def pick(logits: torch.Tensor, level: int, codebook: int) -> torch.Tensor:
            if not sampling:
                return greedy(logits, self.suppress)
            return choose(logits, self.suppress, self.settings[:bucket, level], self.noise[:bucket, codebook])

        code = pick(self.lm_head(hidden), 0, 0)
        self.codes[:bucket, 0].copy_(code)
        cache = self._caches[bucket]
        for i in range(self.steps):
            if i == 0:  # positions 0 and 1: the backbone's hidden state, then codebook 0
                for layer in cache.layers:
                    layer.seek(0)
                embeds = torch.stack([hidden, self.embed(code)], dim=1)
            else:  # position i + 1: codebook i (its slice of the shared table)
                for layer in cache.layers:
                    layer.seek(i + 1)
                embeds = self.embed(code + i * self.vocab)[:, None]
            out = self.depth(
                inputs_embeds=embeds, use_cache=True, logits_to_keep=1, **{self.cache_keyword: cache}
            )
            code = pick(out.logits[:, -1], 1, i + 1)
            self.codes[:bucket, i + 1].copy_(code)
        self.embeds[:bucket].copy_(self.frame_embed(self.codes[:bucket, None, :])[:, 0])

    # -- capture ahead of traffic ---------------------------------------------------------------
    def warm(self) -> None:
        """Both graphs (greedy, sampler) of every bucket now, largest bucket first (the
        smaller graphs reuse its memory pool), so no request waits for a capture.
        ``SpeechModel.load(cuda_graphs=N)`` calls this. Runs on the buffers' current
        contents (zeros, ones and greedy settings from construction will do)."""
        with torch.inference_mode():
            for bucket in sorted(self.buckets, reverse=True):
                for sampling in (False, True):
                    if self.capture:
                        if (bucket, sampling) not in self._graphs:
                            self._capture(bucket, sampling)
                    else:
                        self._forward(bucket, sampling)

    def _capture(self, bucket: int, sampling: bool) -> Any:
        """Warm up on a side stream, then capture one run of the frame."""
        dev = self.device
        side = torch.cuda.Stream(device=dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            for _ in range(2):
                self._forward(bucket, sampling)
        torch.cuda.current_stream(dev).wait_stream(side)
        if self._mempool is None:
            self._mempool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._mempool, capture_error_mode="thread_local"):
            self._forward(bucket, sampling)
        self._graphs[(bucket, sampling)] = graph
        self.captures += 1
        log.debug("captured the frame head for batch size %d (sampler: %s)", bucket, sampling)
        return graph
