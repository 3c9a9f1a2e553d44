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
  K/V gathered with a slot table built once per pass and shared by every layer. The other
  sequences (prefill chunks, with or without a KV prefix, media-block rows; every sequence
  under a softcap) are grouped by shape (padding within ``PAD_WASTE`` of the real area,
  scores within ``SCORE_LIMIT``) and each group is one right-padded SDPA call per layer:
  query/slot/scatter tables built once per pass, masks once per pass and layer kind, and no
  mask at all for fresh causal prefills (``is_causal`` is exact under right padding). A
  sequence alone in its group is attended on its own. ``TorchBackend(batch_sequences=False)``
  attends every multi-row sequence on its own (the path before; ``bench/torch_backend.py``).
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
    are consecutive ids (then K/V are read as views); ``mask``: a (q_len, kv_len) boolean
    mask the caller chose (``engine.forward_pass``: Pie's per-token attention masks), used
    instead of the causal rule (a layer's media blocks still see each other, and a sliding
    layer still cuts it to its window). A
    plain class with slots: one is made per sequence and pass."""

    __slots__ = (
        "q_start",
        "q_len",
        "kv_start",
        "block_ids",
        "first_page",
        "mask",
        "_pages",
        "_of",
        "_at",
        "_end",
    )

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
        mask: torch.Tensor | None = None,
    ):
        if (pages is None) == (pages_of is None):
            raise ValueError("a SeqMeta takes its pages or a slice of the pass's pages, one of the two")
        self.q_start, self.q_len, self.kv_start = q_start, q_len, kv_start
        self.block_ids, self.first_page, self.mask = block_ids, first_page, mask
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
    see ``_attend``). A sequence's own ``mask`` replaces the causal rule; media blocks on
    the layers that have them are added to it, and a sliding window still cuts it (the
    layer never sees past its window)."""
    if seq.mask is not None:
        mask = seq.mask.to(device)
        if blocks and seq.block_ids is not None and bool((seq.block_ids >= 0).any()):
            # the layer's media blocks still see each other both ways (the model's own rule)
            q_blocks = seq.block_ids.to(device)
            k_blocks = torch.full((seq.kv_len,), -1, dtype=q_blocks.dtype, device=device)
            k_blocks[seq.kv_start :] = q_blocks
            mask = mask | ((q_blocks[:, None] == k_blocks[None, :]) & (q_blocks[:, None] >= 0))
        if sliding_window is not None and seq.kv_len > sliding_window:
            q_rows = torch.arange(seq.kv_start, seq.kv_len, device=device)
            mask = mask & (
                torch.arange(seq.kv_len, device=device)[None, :] > q_rows[:, None] - sliding_window
            )
        return mask
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


SCORE_LIMIT = 1 << 26
"""Most attention scores one batched prefill call may span (sequences x query heads x padded
query rows x padded key rows): 64 Mi, 256 MiB in float32, which is what SDPA's math path (and
the softcap path) materialize. A longer group is split; one sequence alone is never split
(its chunk is bounded by the scheduler), it is attended on its own as before."""
PAD_WASTE = 2.0
"""A batched group's padded area (sequences x longest query x longest key run) stays within
this factor of its real area (sum of query rows x key rows). Sequences sorted by query rows,
this also keeps the padded K/V gather within 2x of the real K/V rows."""


class TorchBackend:
    """Reference backend: gather the pages, then scaled-dot-product attention, batched across
    the sequences of a pass (``batch_sequences``; False attends every multi-row sequence on
    its own, the path benches compare against)."""

    name = "torch"

    def __init__(self, *, batch_sequences: bool = True):
        self.batch_sequences = batch_sequences

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
        masked = _masked(meta)
        if masked:  # sequences with masks of their own are attended alone, with their mask
            rest = [s for s in rest if s.mask is None]
        plan = None
        if self.batch_sequences and len(rest) >= 2:
            plan = _prefill_plan(meta, rest, page_size, query.shape[1], whole=group is None and not masked)
        rows = query[0].transpose(0, 1)  # (N, H, D): a view of the projection's layout
        out: torch.Tensor | None = None
        if plan is not None:
            for bucket in plan.buckets:
                o = _attend_bucket(
                    meta,
                    layer,
                    rows,
                    bucket,
                    scaling=scaling,
                    window=sliding_window,
                    blocks=blocks,
                    softcap=softcap,
                )  # (n, H, D)
                if plan.whole:
                    return o.transpose(0, 1).unsqueeze(0)
                if out is None:
                    out = rows.new_empty(rows.shape[0], rows.shape[1], o.shape[-1])
                out.index_copy_(0, bucket.dest, o)
            rest = plan.singles
        for seq in rest + masked if masked else rest:
            q = query[:, :, seq.q_start : seq.q_start + seq.q_len]  # (1, H, n, D)
            k, v = meta.pool.read_pages(layer, seq.pages, seq.kv_len, q.dtype, seq.first_page)
            k, v = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
            mask = sequence_mask(seq, sliding_window=sliding_window, blocks=blocks, device=q.device)
            o = _attend(q, k, v, mask, seq, scaling=scaling, softcap=softcap)  # (1, H, n, D)
            if group is None and plan is None and len(meta.seqs) == 1:
                return o
            if out is None:
                out = rows.new_empty(rows.shape[0], rows.shape[1], o.shape[-1])
            out[seq.q_start : seq.q_start + seq.q_len] = o[0].transpose(0, 1)
        if group is None:
            assert out is not None
            return out.transpose(0, 1).unsqueeze(0)
        # All single-row causal queries at once: (B, H, 1, D) over (B, kv_heads, Lmax, D)
        # gathered with one index_select of the pass's flat slot table, padding masked out.
        # A kv head's query heads are folded into query rows, (B, kv_heads, H / kv_heads, D):
        # no GQA mode needed and no K/V repeated on any device (the mask broadcasts over the
        # rows); on the CPU it measured 5-25% faster than SDPA's enable_gqa.
        n = group.rows.shape[0]
        q = rows.index_select(0, group.rows)  # (B, H, D)
        shape = (n, group.width, kvh, hd)
        k, v = meta.pool.read(layer, group.slots, q.dtype)
        k, v = k.view(shape).transpose(1, 2), v.view(shape).transpose(1, 2)
        o = F.scaled_dot_product_attention(
            q.view(n, kvh, -1, q.shape[2]), k, v, attn_mask=group.mask, scale=scaling
        )
        o = o.reshape(n, q.shape[1], -1)  # (B, H, Dv)
        if group.in_order:
            return o.transpose(0, 1).unsqueeze(0)
        if out is None:
            out = rows.new_empty(rows.shape[0], rows.shape[1], o.shape[-1])
        out.index_copy_(0, group.rows, o)
        return out.transpose(0, 1).unsqueeze(0)


def _masked(meta: BatchMeta) -> list[SeqMeta]:
    """The pass's sequences that carry a mask of their own (cached per pass)."""
    masked = meta.cache.get("masked")
    if masked is None:
        masked = meta.cache["masked"] = [s for s in meta.seqs if s.mask is not None]
    return masked


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
        plain = seq.q_len == 1 and seq.block_ids is None and seq.mask is None
        (group_seqs if plain else rest).append(seq)
    group = None
    if len(group_seqs) >= 2:
        dev = meta.slots.device
        kv_lens = torch.tensor([s.kv_len for s in group_seqs])
        lmax = int(kv_lens.max())
        page_at, offset = _slot_index(group_seqs, kv_lens, lmax, page_size)
        q_rows = torch.tensor([s.q_start for s in group_seqs])
        sizes = [page_at.numel(), offset.numel(), kv_lens.numel(), q_rows.numel()]
        page_at, offset, kv_lens, rows = torch.cat([page_at, offset, kv_lens, q_rows]).to(dev).split(sizes)
        # Each query is its sequence's last row (kv_len - 1): keys past it are padding.
        valid = causal_mask(kv_lens - 1, torch.arange(lmax, device=dev), window=sliding_window)
        group = _DecodeGroup(
            rows=rows,
            slots=_slots(group_seqs, page_at, offset, page_size),
            width=lmax,
            mask=valid[:, None, None, :],
            rest=rest,
            in_order=not rest and all(s.q_start == i for i, s in enumerate(group_seqs)),
        )
    meta.cache[key] = group
    return group


@dataclass
class _Bucket:
    """Sequences of a pass attended together: queries and keys right-padded to the longest
    (``lq`` rows, ``lk`` keys), one SDPA call per layer. Index tables are built once per pass;
    masks once per pass and layer kind (window, media blocks)."""

    seqs: list[SeqMeta]
    lq: int
    lk: int
    q_index: torch.Tensor | None
    """(B * lq,) batch row of each padded query row (padding repeats the sequence's last row);
    None when that is 0, 1, ..., B * lq - 1 (no padding, rows in order: a view serves)."""
    slots: torch.Tensor
    """(B * lk,) flat K/V slot of each padded key row (padding: slot 0, masked out)."""
    keep: torch.Tensor | None
    """Positions of the real query rows in the flattened (B * lq) output; None: no padding."""
    dest: torch.Tensor
    """(n,) the batch row of each kept output row."""
    rows_in_order: int
    """n when ``dest`` is 0, 1, ..., n - 1, else -1."""
    kv_start: torch.Tensor
    """(B,) on the device; ``q_len`` and ``kv_len`` alike."""
    q_len: torch.Tensor
    kv_len: torch.Tensor
    fresh: bool
    """Every sequence starts at row 0: plain causal attention needs no mask (right padding
    is only ever seen by padded query rows, whose outputs are dropped)."""
    max_kv: int
    block_ids: torch.Tensor | None
    """(B, lq) media block id of each padded query row (-1: none), or None when no
    sequence has any."""
    masks: dict[Any, torch.Tensor | None] = field(default_factory=dict)


@dataclass
class _PrefillPlan:
    buckets: list[_Bucket]
    singles: list[SeqMeta]
    """Sequences attended on their own (alone in their group)."""
    whole: bool
    """One bucket holds every row of the pass in order: its output is the pass's output."""


def _group_by_shape(seqs: list[SeqMeta], heads: int) -> list[list[SeqMeta]]:
    """Greedy groups over sequences sorted by (query rows, key rows), longest first: a
    sequence joins the open group while the padded area stays within ``PAD_WASTE`` of the
    real one and the scores within ``SCORE_LIMIT``."""
    groups: list[list[SeqMeta]] = []
    cur: list[SeqMeta] = []
    lq = lk = area = 0
    for s in sorted(seqs, key=lambda s: (s.q_len, s.kv_len), reverse=True):
        if cur:
            nlq, nlk = max(lq, s.q_len), max(lk, s.kv_len)
            padded = (len(cur) + 1) * nlq * nlk
            if padded * heads <= SCORE_LIMIT and padded <= PAD_WASTE * (area + s.q_len * s.kv_len):
                cur.append(s)
                lq, lk, area = nlq, nlk, area + s.q_len * s.kv_len
                continue
            groups.append(cur)
        cur = [s]
        lq, lk, area = s.q_len, s.kv_len, s.q_len * s.kv_len
    if cur:
        groups.append(cur)
    return groups


def _prefill_plan(
    meta: BatchMeta, seqs: list[SeqMeta], page_size: int, heads: int, *, whole: bool
) -> _PrefillPlan:
    """Built once per pass and shared by every layer (``meta.cache``). ``whole``: ``seqs``
    are all of the pass's sequences."""
    key = ("torch-prefill", page_size, heads, whole)
    if key in meta.cache:
        return meta.cache[key]
    buckets, singles = [], []
    for group in _group_by_shape(seqs, heads):
        if len(group) == 1:
            singles.extend(group)
        else:
            buckets.append(_make_bucket(sorted(group, key=lambda s: s.q_start), page_size, meta.slots.device))
    n_rows = int(meta.slots.shape[0])
    plan = _PrefillPlan(
        buckets=buckets,
        singles=singles,
        whole=whole and not singles and len(buckets) == 1 and buckets[0].rows_in_order == n_rows,
    )
    meta.cache[key] = plan
    return plan


def _make_bucket(seqs: list[SeqMeta], page_size: int, dev: torch.device) -> _Bucket:
    """Index tables for ``seqs`` (in batch order), computed on the host and copied to the
    device in one transfer."""
    n = len(seqs)
    q_start = torch.tensor([s.q_start for s in seqs])
    q_len = torch.tensor([s.q_len for s in seqs])
    kv_start = torch.tensor([s.kv_start for s in seqs])
    kv_len = q_len + kv_start
    lq, lk = int(q_len.max()), int(kv_len.max())
    qpos = torch.arange(lq)
    q_real = qpos[None, :] < q_len[:, None]  # (B, lq)
    q_index = (q_start[:, None] + torch.minimum(qpos[None, :], q_len[:, None] - 1)).flatten()
    keep = q_real.flatten().nonzero().squeeze(1) if not bool(q_real.all()) else None
    dest = (q_start[:, None] + qpos[None, :])[q_real]
    identity_q = torch.equal(q_index, torch.arange(n * lq))
    page_at, offset = _slot_index(seqs, kv_len, lk, page_size)
    parts = {
        "page_at": page_at,
        "offset": offset,
        "dest": dest,
        "kv_start": kv_start,
        "q_len": q_len,
        "kv_len": kv_len,
        **({} if identity_q else {"q_index": q_index}),
        **({} if keep is None else {"keep": keep}),
    }
    on_dev = dict(
        zip(
            parts,
            torch.cat(list(parts.values())).to(dev).split([t.numel() for t in parts.values()]),
            strict=True,
        )
    )
    block_ids = None
    if any(s.block_ids is not None for s in seqs):
        ids = [
            s.block_ids.to(dev, torch.long)
            if s.block_ids is not None
            else torch.full((s.q_len,), -1, device=dev)
            for s in seqs
        ]
        flat = torch.full((n * lq,), -1, dtype=torch.long, device=dev)
        if keep is None:
            flat.copy_(torch.cat(ids))
        else:
            flat.index_copy_(0, on_dev["keep"], torch.cat(ids))
        block_ids = flat.view(n, lq)
    return _Bucket(
        seqs=seqs,
        lq=lq,
        lk=lk,
        q_index=on_dev.get("q_index"),
        slots=_slots(seqs, on_dev["page_at"], on_dev["offset"], page_size),
        keep=on_dev.get("keep"),
        dest=on_dev["dest"],
        rows_in_order=dest.shape[0] if torch.equal(dest, torch.arange(dest.shape[0])) else -1,
        kv_start=on_dev["kv_start"],
        q_len=on_dev["q_len"],
        kv_len=on_dev["kv_len"],
        fresh=all(s.kv_start == 0 for s in seqs),
        max_kv=lk,
        block_ids=block_ids,
    )


def _slot_index(
    seqs: list[SeqMeta], kv_len: torch.Tensor, width: int, page_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Host side of a padded slot table: for key row k < ``width`` of each sequence, the
    index of its page in the sequences' pages laid end to end (``_slots``) and its offset
    in the page; rows past a sequence's ``kv_len`` point at the extra entry after them (0)."""
    n_pages = [-(-int(s.kv_len) // page_size) for s in seqs]
    first = torch.tensor([0, *n_pages]).cumsum(0)
    kpos = torch.arange(width)
    real = kpos[None, :] < kv_len[:, None]  # (B, width)
    page_at = torch.where(real, first[:-1, None] + kpos // page_size, first[-1])
    offset = torch.where(real, kpos % page_size, 0)
    return page_at.flatten(), offset.flatten()


def _slots(seqs: list[SeqMeta], page_at: torch.Tensor, offset: torch.Tensor, page_size: int) -> torch.Tensor:
    """Device side: flat K/V slot of every padded key row (padding: slot 0), from the
    sequences' pages joined in one ``cat`` (not one copy per sequence)."""
    pages = [s.pages[: -(-int(s.kv_len) // page_size)] for s in seqs]
    flat = torch.cat([*pages, torch.zeros(1, dtype=pages[0].dtype, device=pages[0].device)])
    return flat.index_select(0, page_at) * page_size + offset


def _bucket_mask(bucket: _Bucket, window: int | None, blocks: bool, need: bool) -> torch.Tensor | None:
    """(B, 1, lq, lk) boolean mask (True = attend) of a bucket, or None when ``is_causal``
    is exact (fresh causal prefills, no window that bites, no media block; ``need``: a mask
    is wanted anyway). Same rule as ``sequence_mask`` (``engine.masks.causal_mask``), plus:
    padded keys are masked out, and a padded query row sees key 0 only (its output is
    dropped; a row that sees nothing would be NaN)."""
    window = window if window is not None and bucket.max_kv > window else None
    use_blocks = blocks and bucket.block_ids is not None
    if not need and bucket.fresh and window is None and not use_blocks:
        return None
    key = (window, use_blocks)
    if key in bucket.masks:
        return bucket.masks[key]
    dev = bucket.slots.device
    qpos = torch.arange(bucket.lq, device=dev)
    kpos = torch.arange(bucket.lk, device=dev)[None, :]  # (1, lk)
    q_rows = bucket.kv_start[:, None] + qpos[None, :]  # (B, lq)
    q_blocks = k_blocks = None
    if use_blocks:
        assert bucket.block_ids is not None
        # Key row k of a sequence is its query row k - kv_start (a block is computed in one
        # pass), rows before the pass are in no block.
        at = (kpos - bucket.kv_start[:, None]).clamp(0, bucket.lq - 1)
        inside = (kpos >= bucket.kv_start[:, None]) & (kpos < bucket.kv_len[:, None])
        q_blocks = bucket.block_ids
        k_blocks = torch.where(inside, q_blocks.gather(1, at), -1)
    mask = causal_mask(q_rows, kpos, window=window, q_blocks=q_blocks, k_blocks=k_blocks)
    mask &= (kpos < bucket.kv_len[:, None])[:, None, :]
    pad_q = qpos[None, :] >= bucket.q_len[:, None]  # (B, lq)
    mask |= pad_q[:, :, None] & (kpos == 0)[:, None, :]
    mask = mask.unsqueeze(1)
    bucket.masks[key] = mask
    return mask


def _attend_bucket(
    meta: BatchMeta,
    layer: int,
    rows: torch.Tensor,
    bucket: _Bucket,
    *,
    scaling: float,
    window: int | None,
    blocks: bool,
    softcap: float | None,
) -> torch.Tensor:
    """(n, H, D) outputs of a bucket's real query rows (in ``bucket.dest`` order)."""
    n, heads, hd = len(bucket.seqs), rows.shape[1], rows.shape[2]
    if bucket.q_index is None:
        q = rows.narrow(0, 0, n * bucket.lq).reshape(n, bucket.lq, heads, hd).transpose(1, 2)
    else:
        q = rows.index_select(0, bucket.q_index).view(n, bucket.lq, heads, hd).transpose(1, 2)
    k, v = meta.pool.read(layer, bucket.slots, rows.dtype)
    kvh = k.shape[1]
    k = k.view(n, bucket.lk, kvh, -1).transpose(1, 2)
    v = v.view(n, bucket.lk, kvh, -1).transpose(1, 2)
    mask = _bucket_mask(bucket, window, blocks, need=softcap is not None)
    if softcap is not None:
        assert mask is not None
        o = _softcapped(q, k, v, mask, scaling=scaling, softcap=softcap)
    else:
        o = _sdpa(q, k, v, mask, causal=mask is None, scaling=scaling)  # (B, H, lq, Dv)
    o = o.transpose(1, 2).reshape(n * bucket.lq, heads, -1)
    return o if bucket.keep is None else o.index_select(0, bucket.keep)


def _sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    *,
    causal: bool,
    scaling: float,
) -> torch.Tensor:
    """SDPA with grouped K/V heads. On CUDA, SDPA's GQA mode runs only in the flash kernel
    (float16/bfloat16, head size <= 256, no mask) and the math path: any other call gets K/V
    repeated to every query head (as transformers' sdpa path does), so that the
    memory-efficient kernel can take it rather than the math path. On the CPU, SDPA's own
    kernel takes GQA with or without a mask."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1 and q.device.type == "cuda" and not _cuda_flash_gqa(q, mask):
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        groups = 1
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=causal, scale=scaling, enable_gqa=groups > 1
    )


def _cuda_flash_gqa(q: torch.Tensor, mask: torch.Tensor | None) -> bool:
    return (
        mask is None
        and q.dtype in (torch.float16, torch.bfloat16)
        and q.shape[-1] <= 256
        and q.shape[-1] % 8 == 0
    )


def _softcapped(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, *, scaling: float, softcap: float
) -> torch.Tensor:
    """Attention with tanh-capped scores (Gemma-2's ``attn_logit_softcapping``), as the
    reference computes it; ``mask`` broadcasts over (B, H, Lq, Lk)."""
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1)
    v = v.repeat_interleave(groups, dim=1)
    w = torch.matmul(q, k.transpose(2, 3)) * scaling
    w = torch.tanh(w / softcap) * softcap
    w = w.masked_fill(~mask, float("-inf"))
    w = torch.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(w, v)


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
    if softcap is not None:
        if mask is None:
            mask = sequence_causal_mask(seq.kv_start, seq.kv_len, device=q.device)
        return _softcapped(q, k, v, mask, scaling=scaling, softcap=softcap)
    if mask is None:
        # Plain causal over the whole history: the last q_len keys are the queries' own rows.
        if seq.q_len == 1:
            return _sdpa(q, k, v, None, causal=False, scaling=scaling)
        if seq.kv_start == 0:
            return _sdpa(q, k, v, None, causal=True, scaling=scaling)
        mask = sequence_causal_mask(seq.kv_start, seq.kv_len, device=q.device)
    return _sdpa(q, k, v, mask, causal=False, scaling=scaling)


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
