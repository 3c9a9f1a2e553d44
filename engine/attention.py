"""Paged attention plugged into transformers' attention-function registry.

The transformers decoder layers compute Q/K/V (projections, norms, RoPE: the reference
math) and then call the attention function named by ``config._attn_implementation``.
We register ``"pie_paged"``: it writes this step's K/V rows into the model's page pool
and attends each sequence's queries over that sequence's pages. The language model is
called with ``use_cache=False``; the pages are the cache.

A forward batch is flattened into one row of ``N`` tokens (``batch = 1``): every op in a
decoder layer except attention is per token, so sequences of different lengths (prefill
chunks and decode steps of many contexts) share one pass, and ``BatchMeta`` tells this
function where each sequence's queries are and which pages hold its keys.

Masks are built per sequence over KV row indices (row = token index in the context), by
``engine.masks``:

* causal: key row <= query row;
* sliding window (layers that pass ``sliding_window``, Gemma-4's sliding layers):
  ``query row - key row < window`` as transformers' ``sliding_window_overlay``;
* bidirectional media blocks (Gemma-4 with ``use_bidirectional_attention="vision"``,
  on the layers ``BatchMeta.block_overlay_layers`` names): rows of the same image/video
  block see each other. A block is always prefilled in one pass (spans are never split).

Backends plug in through ``AttentionBackend`` (``write`` this step's K/V, ``attend``):

* ``torch`` (here; CPU and CUDA, any dtype): gather the pages of a sequence, then SDPA.
  With a quantized pool (``kv_dtype`` int8 / fp8_e4m3) ``write`` quantizes through
  ``KVPool.write`` and the gathers dequantize to the query's dtype (``KVPool.read``).
  It attends all one-row queries of a pass (decode steps) in one padded SDPA call over
  K/V gathered with a slot table built once per pass and shared by every layer; prefill
  chunks and media-block rows go one sequence at a time.
* ``flashinfer`` (``engine.attention_flashinfer``; CUDA, float16/bfloat16): flashinfer's
  paged kernels read the pool in place (its ``"NHD"`` layout is ours): the batch decode
  wrapper for one-row queries, the batch prefill wrapper (causal) for chunks, and the
  prefill wrapper with a ``custom_mask`` built by ``sequence_mask`` for media-block rows.
  Page tables are built and kernels planned once per pass, per layer kind. The module is
  imported lazily (only to serve a CUDA device), and flashinfer never on a machine
  without CUDA.

Choosing one (``engine.attention_select.select_backend``): ``Model.load(attention="auto")`` picks flashinfer
when the device is CUDA, the dtype is float16/bfloat16 and flashinfer imports, else torch;
``"torch"`` and ``"flashinfer"`` force one (the latter raises
``AttentionBackendUnavailableError`` saying why it cannot run). ``Model.attention_backend``
names the one in use.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.nn.functional as F
import transformers

from engine.kv_pool import KVPool
from engine.masks import causal_mask, sequence_causal_mask

ATTN_IMPLEMENTATION = "pie_paged"

log = logging.getLogger(__name__)


class SeqMeta:
    """One sequence's slice of a flattened forward batch.

    ``q_start``: first row of this sequence in the batch; ``q_len``: rows it computes in
    this pass; ``kv_start``: rows already in its KV before this pass (= row index of its
    first query); ``pages``: long tensor of page ids covering ``kv_start + q_len`` rows,
    on the pool's device (given, or a slice ``pages_of[at:end]`` of the pass's page list,
    made when first read: a decode pass of hundreds of sequences makes hundreds of these
    and many backends never read them); ``block_ids``: (q_len,) media block id per query
    row (-1 = none) for bidirectional blocks; ``first_page``: ``pages[0]`` when the pages
    are consecutive ids (then K/V are read as views). A plain class with slots: one is
    made per sequence and pass."""

    __slots__ = ("q_start", "q_len", "kv_start", "block_ids", "first_page", "_pages", "_of", "_at", "_end")

    def __init__(
        self,
        q_start: int,
        q_len: int,
        kv_start: int,
        pages: torch.Tensor | None = None,
        block_ids: torch.Tensor | None = None,
        first_page: int | None = None,
        *,
        pages_of: torch.Tensor | None = None,
        at: int = 0,
        end: int = 0,
    ):
        if (pages is None) == (pages_of is None):
            raise ValueError("a SeqMeta takes its pages or a slice of the pass's pages, one of the two")
        self.q_start, self.q_len, self.kv_start = q_start, q_len, kv_start
        self.block_ids, self.first_page = block_ids, first_page
        self._pages, self._of, self._at, self._end = pages, pages_of, at, end

    @property
    def pages(self) -> torch.Tensor:
        if self._pages is None:
            assert self._of is not None
            self._pages = self._of[self._at : self._end]
        return self._pages

    @property
    def kv_len(self) -> int:
        return self.kv_start + self.q_len

    def __repr__(self) -> str:
        return f"SeqMeta(q_start={self.q_start}, q_len={self.q_len}, kv_start={self.kv_start})"


@dataclass
class BatchMeta:
    pool: KVPool
    seqs: list[SeqMeta]
    slots: torch.Tensor
    """(N,) flat slot (page * page_size + offset) each batch row writes its K/V to."""
    block_overlay_layers: frozenset[int] = field(default_factory=frozenset)
    backend: AttentionBackend | None = None
    cache: dict[Any, Any] = field(default_factory=dict)
    """Per-pass values a backend computes once and reuses in every layer (index tables)."""


class AttentionBackend(Protocol):
    name: str

    def write(self, meta: BatchMeta, layer: int, key: torch.Tensor, value: torch.Tensor) -> None: ...

    def attend(
        self,
        meta: BatchMeta,
        layer: int,
        query: torch.Tensor,
        *,
        scaling: float,
        sliding_window: int | None,
        softcap: float | None,
    ) -> torch.Tensor: ...


def sequence_mask(
    seq: SeqMeta,
    *,
    sliding_window: int | None,
    blocks: bool,
    device: torch.device,
) -> torch.Tensor | None:
    """Boolean (q_len, kv_len) mask (True = attend), or None when plain causal attention
    over everything so far is right (decode without window, or a fresh causal prefill:
    see ``_attend``)."""
    use_blocks = blocks and seq.block_ids is not None and bool((seq.block_ids >= 0).any())
    window_bites = sliding_window is not None and seq.kv_len > sliding_window
    if not use_blocks and not window_bites:
        return None
    return sequence_causal_mask(
        seq.kv_start,
        seq.kv_len,
        window=sliding_window if window_bites else None,
        block_ids=seq.block_ids if use_blocks else None,
        device=device,
    )


class TorchBackend:
    """Reference backend: gather each sequence's pages, then scaled-dot-product attention."""

    name = "torch"

    def write(self, meta: BatchMeta, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        # key/value: (1, kv_heads, N, head_dim) -> (N, kv_heads, head_dim); the pool
        # quantizes when its format is int8/fp8 (``engine.kv_quant``).
        meta.pool.write(layer, meta.slots, key[0].transpose(0, 1), value[0].transpose(0, 1))

    def attend(
        self,
        meta: BatchMeta,
        layer: int,
        query: torch.Tensor,
        *,
        scaling: float,
        sliding_window: int | None,
        softcap: float | None,
    ) -> torch.Tensor:
        kc, _ = meta.pool.kv(layer)
        _, page_size, kvh, hd = kc.shape
        blocks = layer in meta.block_overlay_layers
        group = None if softcap is not None else _decode_group(meta, page_size, sliding_window)
        rest = meta.seqs if group is None else group.rest
        outs = []
        for seq in rest:
            q = query[:, :, seq.q_start : seq.q_start + seq.q_len]  # (1, H, n, D)
            k, v = meta.pool.read_pages(layer, seq.pages, seq.kv_len, q.dtype, seq.first_page)
            k, v = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
            mask = sequence_mask(seq, sliding_window=sliding_window, blocks=blocks, device=q.device)
            outs.append(_attend(q, k, v, mask, seq, scaling=scaling, softcap=softcap))
        if group is None:
            return torch.cat(outs, dim=2)
        # All single-row causal queries at once: (B, H, 1, D) over (B, kv_heads, Lmax, D)
        # gathered with one index_select of the pass's flat slot table, padding masked out.
        q = query[0].index_select(1, group.rows).transpose(0, 1).unsqueeze(2)
        shape = (group.rows.shape[0], group.width, kvh, hd)
        k, v = meta.pool.read(layer, group.slots, q.dtype)
        k, v = k.view(shape).transpose(1, 2), v.view(shape).transpose(1, 2)
        o = F.scaled_dot_product_attention(
            q, k, v, attn_mask=group.mask, scale=scaling, enable_gqa=q.shape[1] != kvh
        )  # (B, H, 1, D)
        o = o.squeeze(2).transpose(0, 1)  # (H, B, D)
        if group.in_order:
            return o.unsqueeze(0)
        out = o.new_empty(1, o.shape[0], query.shape[2], o.shape[2])
        for seq, part in zip(rest, outs, strict=True):
            out[:, :, seq.q_start : seq.q_start + seq.q_len] = part
        out[0].index_copy_(1, group.rows, o)
        return out


@dataclass
class _DecodeGroup:
    """The one-row, plain-causal sequences of a pass, attended in one padded SDPA call."""

    rows: torch.Tensor
    """(B,) their query rows in the batch."""
    slots: torch.Tensor
    """(B * Lmax,) flat K/V slot of every key row of every sequence (padding: slot 0)."""
    width: int
    """Lmax: the longest sequence's KV length."""
    mask: torch.Tensor
    """(B, 1, 1, Lmax) True where the key row exists."""
    rest: list[SeqMeta]
    """The other sequences of the pass (attended one by one)."""
    in_order: bool
    """The group is the whole batch, rows 0..B-1 in order."""


def _decode_group(meta: BatchMeta, page_size: int, sliding_window: int | None) -> _DecodeGroup | None:
    """Built once per pass (and window) and shared by every layer; None when fewer than two
    sequences qualify (one query row, no media block: causal over all its keys, cut to the
    sliding window where the layer has one)."""
    key = ("decode", page_size, sliding_window)
    if key in meta.cache:
        return meta.cache[key]
    group_seqs, rest = [], []
    for seq in meta.seqs:
        (group_seqs if seq.q_len == 1 and seq.block_ids is None else rest).append(seq)
    group = None
    if len(group_seqs) >= 2:
        dev = meta.slots.device
        kv_lens = torch.tensor([s.kv_len for s in group_seqs], dtype=torch.long, device=dev)
        lmax = int(max(s.kv_len for s in group_seqs))
        n_pages = -(-lmax // page_size)
        table = torch.zeros(len(group_seqs), n_pages, dtype=torch.long, device=dev)
        for i, s in enumerate(group_seqs):
            pages = s.pages[: -(-s.kv_len // page_size)]
            table[i, : pages.shape[0]] = pages
        pos = torch.arange(lmax, device=dev)
        # Each query is its sequence's last row (kv_len - 1): keys past it are padding.
        valid = causal_mask(kv_lens - 1, pos, window=sliding_window)
        slots = table[:, pos // page_size] * page_size + pos % page_size
        rows = torch.tensor([s.q_start for s in group_seqs], dtype=torch.long, device=dev)
        group = _DecodeGroup(
            rows=rows,
            slots=torch.where(valid, slots, torch.zeros_like(slots)).flatten(),
            width=lmax,
            mask=valid[:, None, None, :],
            rest=rest,
            in_order=not rest and all(s.q_start == i for i, s in enumerate(group_seqs)),
        )
    meta.cache[key] = group
    return group


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    seq: SeqMeta,
    *,
    scaling: float,
    softcap: float | None,
) -> torch.Tensor:
    groups = q.shape[1] // k.shape[1]
    if softcap is not None:
        if mask is None:
            mask = sequence_causal_mask(seq.kv_start, seq.kv_len, device=q.device)
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
        w = torch.matmul(q, k.transpose(2, 3)) * scaling
        w = torch.tanh(w / softcap) * softcap
        w = w.masked_fill(~mask, float("-inf"))
        w = torch.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.matmul(w, v)
    if mask is None:
        # Plain causal over the whole history: the last q_len keys are the queries' own rows.
        if seq.q_len == 1:
            return F.scaled_dot_product_attention(q, k, v, scale=scaling, enable_gqa=groups > 1)
        if seq.kv_start == 0:
            return F.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=scaling, enable_gqa=groups > 1
            )
        mask = sequence_causal_mask(seq.kv_start, seq.kv_len, device=q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling, enable_gqa=groups > 1)


TORCH_BACKEND = TorchBackend()


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    pie_batch: BatchMeta | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The function registered as ``"pie_paged"``; returns (batch, N, heads, head_dim)."""
    if pie_batch is None:
        raise RuntimeError(
            "pie_paged attention was called without a batch (pie_batch=...); this model's "
            "language model is wired to the engine's KV pages and must be run through engine.Model"
        )
    if query.shape[0] != 1:
        raise RuntimeError(f"pie_paged attention expects a flattened batch of 1, got {query.shape[0]}")
    layer = module.layer_idx
    backend = pie_batch.backend or TORCH_BACKEND
    if scaling is None:
        scaling = module.head_dim**-0.5
    if pie_batch.pool.layers[layer].shares_with is None:
        backend.write(pie_batch, layer, key, value)
    out = backend.attend(
        pie_batch, layer, query, scaling=scaling, sliding_window=sliding_window, softcap=softcap
    )
    return out.transpose(1, 2).contiguous(), None


def register() -> str:
    """Register the attention function with transformers (idempotent); returns its name."""
    transformers.AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
    return ATTN_IMPLEMENTATION


register()
