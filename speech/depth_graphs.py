"""CSM's depth decoder replayed from CUDA graphs, one graph per codebook step and batch bucket.

Each frame of each stream runs the depth decoder ``num_codebooks - 1`` times (31 small
steps on a real CSM), batched over the streams of a pass (``speech.frame_head``). On a GPU
these steps are host-bound: a few tiny layers whose kernels the host launches one by one
from transformers' modules. A CUDA graph per step launches them at once.

Why a graph per STEP, not one per frame: sampling stays outside the graph, per row (each
stream's own settings and ``torch.Generator``, in the order it draws alone), and a sampled
row's code is the next step's input. So the host picks the codes between replays (greedy
rows: an argmax, as without graphs) and copies them into the static id buffer. The steps
also differ in shape (step 0 feeds two positions: the backbone's hidden state and codebook
0; later steps one), and each step's position is fixed (a frame always starts at the
depth decoder's position 0), so each step is one static function of the static buffers.

What is captured, per batch bucket (1, 2, 4, 8, 16, ... up to ``max_batch``) and step i:
transformers' ``CsmDepthDecoderForCausalLM`` over static inputs (the backbone hidden
states (B, H) and the previous codes (B,)) into a static logits buffer (B, V), with a KV
cache whose layers write into static tensors (B, kv_heads, num_codebooks, head_dim) at the
step's fixed positions and attend over exactly the positions written so far (the same
shapes and values as the ``DynamicCache`` of the plain path, so the same numbers, not a
masked full-length ``StaticCache``, whose length lives in a device tensor read by the host).
The inputs go in as embeddings, computed as the model does from ids (the codebook's offset
into the shared table; the hidden state at position 0), because the model reads a device
value on the host when only ids are given, which a capture forbids. Buffers are shared by
all buckets (a bucket uses their first B rows). Rows past a pass's batch are padding: they
run on whatever the buffers hold and are never read; every op of the depth decoder works
row by row (attention within a row's own cache), so they cannot change the real rows.

``capture=False`` runs the same static-buffer step eagerly instead of replaying a graph:
everything but the capture, which is how it is tested on the CPU. vLLM and SGLang capture
inside their own runners; there is no library to call for this.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from engine.decode_graphs import BUCKETS
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
    """Logits of the depth decoder's steps for a whole batch, from static buffers (see the
    module doc). ``FrameHead`` calls ``step`` once per codebook step when ``takes`` the batch."""

    def __init__(self, hf: Any, max_batch: int, *, capture: bool):
        from transformers.cache_utils import Cache

        if max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, got {max_batch}")
        depth = hf.depth_decoder
        cfg = depth.config
        self.depth = depth
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
        self.hidden = torch.zeros(max_batch, int(cfg.backbone_hidden_size), dtype=self.dtype, device=dev)
        self.ids = torch.zeros(max_batch, dtype=torch.long, device=dev)
        self.logits = torch.zeros(max_batch, self.vocab, dtype=self.dtype, device=dev)
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
        self._graphs: dict[tuple[int, int], Any] = {}
        self._mempool: Any = None
        self.bucket_steps: dict[int, int] = {}
        """Steps run per bucket (which padded shapes the passes took)."""
        self.replays = 0
        """Steps replayed from a graph (or, with ``capture=False``, run through the buffers)."""
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

    # -- a step -------------------------------------------------------------------------------
    def step(self, i: int, ids: torch.Tensor, hidden: torch.Tensor | None = None) -> torch.Tensor:
        """(n, V) logits of depth step ``i`` for ``n`` rows: ``ids`` (n,) are codebook ``i``'s
        codes (step 0: the backbone's codebook 0), ``hidden`` (n, H) the backbone's last hidden
        states (step 0 only). A view of the static buffer: read it before the next step."""
        if not 0 <= i < self.steps:
            raise ValueError(f"depth step {i} out of range 0..{self.steps - 1}")
        n = ids.shape[0]
        bucket = self.bucket(n)
        with torch.inference_mode():
            if i == 0:
                if hidden is None:
                    raise ValueError("depth step 0 needs the backbone's hidden states")
                self.hidden[:n].copy_(hidden)
            self.ids[:n].copy_(ids)
            if self.capture:
                graph = self._graphs.get((bucket, i))
                if graph is None:
                    graph = self._capture(bucket, i)
                graph.replay()
            else:
                self._forward(bucket, i)
        self.replays += 1
        self.bucket_steps[bucket] = self.bucket_steps.get(bucket, 0) + 1
        return self.logits[:n]

    def _forward(self, bucket: int, i: int) -> None:
        """Depth step ``i`` over the first ``bucket`` rows of the static buffers."""
        cache = self._caches[bucket]
        ids = self.ids[:bucket]
        if i == 0:  # positions 0 and 1: the backbone's hidden state, then codebook 0
            for layer in cache.layers:
                layer.seek(0)
            embeds = torch.stack([self.hidden[:bucket], self.embed(ids)], dim=1)
        else:  # position i + 1: codebook i (its slice of the shared table)
            for layer in cache.layers:
                layer.seek(i + 1)
            embeds = self.embed(ids + i * self.vocab)[:, None]
        out = self.depth(
            inputs_embeds=embeds, use_cache=True, logits_to_keep=1, **{self.cache_keyword: cache}
        )
        self.logits[:bucket].copy_(out.logits[:, -1])

    # -- capture ahead of traffic ---------------------------------------------------------------
    def warm(self) -> None:
        """Every step of every bucket now, largest bucket first (the smaller graphs reuse its
        memory pool), so no request waits for a capture. ``SpeechModel.load(cuda_graphs=N)``
        calls this. Runs on the buffers' current contents (any ids in range will do)."""
        with torch.inference_mode():
            self.ids.zero_()
            for bucket in sorted(self.buckets, reverse=True):
                for i in range(self.steps):
                    if self.capture:
                        if (bucket, i) not in self._graphs:
                            self._capture(bucket, i)
                    else:
                        self._forward(bucket, i)

    def _capture(self, bucket: int, i: int) -> Any:
        """Warm up on a side stream, then capture one run of the step."""
        dev = self.device
        side = torch.cuda.Stream(device=dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            for _ in range(2):
                self._forward(bucket, i)
        torch.cuda.current_stream(dev).wait_stream(side)
        if self._mempool is None:
            self._mempool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._mempool, capture_error_mode="thread_local"):
            self._forward(bucket, i)
        self._graphs[(bucket, i)] = graph
        self.captures += 1
        log.debug("captured depth step %d for batch size %d", i, bucket)
        return graph
