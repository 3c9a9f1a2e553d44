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


class HiddenRows:
    """K/V rows of one context masked out of every later pass (Pie 0.3's
    ``mask_token_range``): a sliding window's evicted rows, an attention sink's gap. Kept
    as a boolean array over rows; a page whose rows are all hidden can be released
    (``engine.page_table.PageTable.drop``)."""

    def __init__(self) -> None:
        self._hidden = torch.zeros(0, dtype=torch.bool)
        self._any = False  # asked before every decode step: no tensor reduction there

    def __bool__(self) -> bool:
        return self._any

    def __len__(self) -> int:
        """How many rows are hidden."""
        return int(self._hidden.sum())

    def set(self, start: int, end: int, hidden: bool) -> None:
        if end > self._hidden.shape[0]:
            grown = torch.zeros(end, dtype=torch.bool)
            grown[: self._hidden.shape[0]] = self._hidden
            self._hidden = grown
        self._hidden[start:end] = hidden
        self._any = bool(self._hidden.any())

    def truncate(self, rows: int) -> None:
        if self._hidden.shape[0] > rows:
            self._hidden = self._hidden[:rows].clone()
            self._any = bool(self._hidden.any())

    def copy(self) -> HiddenRows:
        out = HiddenRows()
        out._hidden, out._any = self._hidden.clone(), self._any
        return out

    def visible(self, kv_len: int) -> torch.Tensor:
        """(kv_len,) bool: True where a key row may be attended."""
        out = torch.ones(kv_len, dtype=torch.bool)
        n = min(kv_len, self._hidden.shape[0])
        out[:n] = ~self._hidden[:n]
        return out

    def whole_pages(self, page_size: int, rows: int) -> list[int]:
        """Indices of the pages among the first ``rows`` rows whose rows are all hidden."""
        full = min(rows, self._hidden.shape[0]) // page_size
        if full == 0:
            return []
        per_page = self._hidden[: full * page_size].view(full, page_size).all(dim=1)
        return per_page.nonzero().flatten().tolist()

    def __repr__(self) -> str:
        return f"HiddenRows({len(self)} of {self._hidden.shape[0]} rows)"
