"""The attention mask rule, in one place, over KV row indices (row = token index in a context).

A query at row q sees a key at row k when

* causal: ``k <= q``;
* or, with media blocks, both rows belong to the same bidirectional block (block id >= 0):
  rows of one image/video block see each other both ways (Gemma-4's
  ``use_bidirectional_attention="vision"``);
* and, with a sliding window, ``q - k < window`` (transformers' ``sliding_window_overlay``).

Masks are boolean, True = attend. The torch backend, the batched decode of the torch
backend and the flashinfer backend's custom masks all build theirs here.
"""

from __future__ import annotations

import torch


def causal_mask(
    q_rows: torch.Tensor,
    k_rows: torch.Tensor,
    *,
    window: int | None = None,
    q_blocks: torch.Tensor | None = None,
    k_blocks: torch.Tensor | None = None,
) -> torch.Tensor:
    """(len(q_rows), len(k_rows)) boolean mask of queries at rows ``q_rows`` over keys at
    rows ``k_rows``: causal, widened to whole blocks where ``q_blocks`` / ``k_blocks`` (the
    block id of each query / key row, -1 = none) match, then cut to ``window``.

    Leading dimensions broadcast: ``q_rows`` (B, Lq) and ``k_rows`` (B or 1, Lk) (blocks
    alike) give the (B, Lq, Lk) masks of B padded sequences at once (the torch backend's
    batched prefill)."""
    q = q_rows[..., :, None]
    k = k_rows[..., None, :]
    allowed = k <= q
    if q_blocks is not None:
        if k_blocks is None:
            raise ValueError("q_blocks needs k_blocks (the block id of every key row)")
        qb = q_blocks[..., :, None]
        allowed |= (qb == k_blocks[..., None, :]) & (qb >= 0)
    if window is not None:
        allowed &= k > q - window
    return allowed


def sequence_causal_mask(
    kv_start: int,
    kv_len: int,
    *,
    window: int | None = None,
    block_ids: torch.Tensor | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """(kv_len - kv_start, kv_len) mask of one sequence's queries (rows ``kv_start`` ..
    ``kv_len - 1``) over all its keys (rows 0 .. ``kv_len - 1``). ``block_ids``: the block
    id of each query row; key rows before ``kv_start`` are in no block (a block is always
    computed in one pass)."""
    q_rows = torch.arange(kv_start, kv_len, device=device)
    k_rows = torch.arange(kv_len, device=device)
    k_blocks = None
    if block_ids is not None:
        block_ids = block_ids.to(q_rows.device)
        k_blocks = torch.full((kv_len,), -1, dtype=block_ids.dtype, device=q_rows.device)
        k_blocks[kv_start:] = block_ids
    return causal_mask(q_rows, k_rows, window=window, q_blocks=block_ids, k_blocks=k_blocks)
