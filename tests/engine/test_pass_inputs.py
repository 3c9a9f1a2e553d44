"""The runner's pass inputs built in bulk: positions of one-row steps given as ``pos``, and
each sequence's pages as a slice of the pass's page list made when first read."""

from __future__ import annotations

import pytest
import torch

from engine.attention import SeqMeta
from engine.forward import StepInput, pass_positions


def _step(rows: int, first: int, *, as_pos: bool, axes: int = 3) -> StepInput:
    positions = torch.arange(first, first + rows).repeat(axes, 1)
    positions[1] += 100  # axes differ, as an image's rows do (Qwen's M-RoPE)
    if as_pos:
        assert rows == 1
        return StepInput(
            tokens=[7], positions=None, pos=tuple(positions[:, 0].tolist()), kv_start=0, pages=[0]
        )
    return StepInput(tokens=[7] * rows, positions=positions, kv_start=0, pages=[0])


def test_positions_of_one_row_steps_equal_their_tensors() -> None:
    given = [_step(1, 5 + i, as_pos=True) for i in range(4)]
    tensors = [_step(1, 5 + i, as_pos=False) for i in range(4)]
    out = pass_positions(given, 3)
    assert out.dtype == torch.long and out.is_contiguous()
    assert torch.equal(out, torch.cat([s.positions for s in tensors], dim=1))


def test_a_pass_mixing_prefill_chunks_and_decode_rows_keeps_its_order() -> None:
    steps = [_step(1, 9, as_pos=True), _step(3, 0, as_pos=False), _step(1, 40, as_pos=True)]
    out = pass_positions(steps, 3)
    assert out[0].tolist() == [9, 0, 1, 2, 40]
    assert out[1].tolist() == [109, 100, 101, 102, 140]


def test_seq_pages_are_a_slice_of_the_pass_pages_made_when_read() -> None:
    flat = torch.tensor([4, 5, 9, 2, 3])
    seq = SeqMeta(0, 1, 20, None, None, None, pages_of=flat, at=2, end=5)
    assert seq.pages.tolist() == [9, 2, 3]
    assert seq.pages is seq.pages  # made once
    assert seq.kv_len == 21
    given = SeqMeta(q_start=0, q_len=1, kv_start=0, pages=torch.tensor([1]))
    assert given.pages.tolist() == [1]
    with pytest.raises(ValueError, match="one of the two"):
        SeqMeta(0, 1, 0)
    with pytest.raises(ValueError, match="one of the two"):
        SeqMeta(0, 1, 0, torch.tensor([1]), pages_of=flat)
