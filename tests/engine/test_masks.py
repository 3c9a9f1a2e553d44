"""The one mask rule (engine.masks) against the rule written out row by row."""

from __future__ import annotations

import pytest
import torch

from engine.masks import causal_mask, sequence_causal_mask


def _by_rule(kv_start: int, kv_len: int, window: int | None, blocks: list[int] | None) -> torch.Tensor:
    """Query row q (kv_start <= q < kv_len) sees key row k when k <= q or both are in one
    block, and q - k < window."""
    key_block = [-1] * kv_start + (blocks or [-1] * (kv_len - kv_start))
    out = torch.zeros(kv_len - kv_start, kv_len, dtype=torch.bool)
    for i, q in enumerate(range(kv_start, kv_len)):
        for k in range(kv_len):
            seen = k <= q or (key_block[q] >= 0 and key_block[q] == key_block[k])
            if window is not None:
                seen = seen and q - k < window
            out[i, k] = seen
    return out


@pytest.mark.parametrize("window", [None, 1, 3, 6])
@pytest.mark.parametrize(("kv_start", "q_len"), [(0, 1), (0, 9), (5, 1), (4, 7), (13, 3)])
def test_sequence_mask_follows_the_rule(kv_start, q_len, window):
    kv_len = kv_start + q_len
    assert torch.equal(
        sequence_causal_mask(kv_start, kv_len, window=window), _by_rule(kv_start, kv_len, window, None)
    )
    blocks = [-1, 0, 0, 0, -1, 1, 1, 2, -1][:q_len]
    ids = torch.tensor(blocks)
    assert torch.equal(
        sequence_causal_mask(kv_start, kv_len, window=window, block_ids=ids),
        _by_rule(kv_start, kv_len, window, blocks),
    )


def test_rows_need_not_be_contiguous():
    """One query per sequence at its last row over padded key rows: the batched-decode use."""
    kv_lens = torch.tensor([1, 4, 6])
    mask = causal_mask(kv_lens - 1, torch.arange(6), window=3)
    assert mask.tolist() == [
        [True, False, False, False, False, False],
        [False, True, True, True, False, False],
        [False, False, False, True, True, True],
    ]


def test_blocks_need_key_blocks():
    with pytest.raises(ValueError, match="k_blocks"):
        causal_mask(torch.arange(2), torch.arange(2), q_blocks=torch.tensor([0, 0]))
