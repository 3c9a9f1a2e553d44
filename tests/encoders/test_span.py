"""The shared span builder: ids, token types, positions (1-D and M-RoPE), delimiters and
placeholder runs from declared segments."""

from __future__ import annotations

import pytest
import torch

from encoders.span import Placeholders, Text, TextIds, TokenType, build_span


def test_token_types_are_transformers_values():
    assert [int(t) for t in TokenType] == [0, 1, 2, 3]
    assert [t.name for t in TokenType] == ["TEXT", "IMAGE", "VIDEO", "AUDIO"]


def test_1d_span_positions_are_rows():
    span = build_span([Text((7,)), Placeholders(9, TokenType.AUDIO, 4), Text((8,))], rope="1d")
    assert span.input_ids == (7, 9, 9, 9, 9, 8)
    assert span.token_types == (0, 3, 3, 3, 3, 0)
    assert all(type(t) is int for t in span.token_types)
    assert torch.equal(span.positions, torch.arange(6).view(1, 6))
    assert span.position_span == 6
    assert (span.placeholder_id, span.token_count) == (9, 4)
    assert (span.prefix_tokens, span.suffix_tokens) == ((7,), (8,))
    assert span.placeholder_runs == ((1, 5),)


def test_mrope_span_follows_the_rope_index():
    """Text advances every axis by one; a vision group at cursor s gets (s, s+row, s+col) and
    advances by max(h, w)."""
    span = build_span(
        [
            Text((1,)),
            Text((5, 6, 1)),
            Placeholders(9, TokenType.VIDEO, 6, grid=(2, 3)),
            Text((2,)),
            Text((5, 1)),
            Placeholders(9, TokenType.VIDEO, 6, grid=(2, 3)),
            Text((2,)),
            Text((2,)),
        ],
        rope="mrope",
    )
    t = [0, 1, 2, 3]  # opening delimiter, then "<t>" + vision_start
    group1 = [[4] * 6, [4, 4, 4, 5, 5, 5], [4, 5, 6, 4, 5, 6]]
    after1 = [7, 8, 9]  # vision_end, then the next "<t>" + vision_start
    group2 = [[10] * 6, [10, 10, 10, 11, 11, 11], [10, 11, 12, 10, 11, 12]]
    tail = [13, 14]
    expected = torch.tensor([t + g + after1 + h + tail for g, h in zip(group1, group2, strict=True)])
    assert torch.equal(span.positions, expected)
    assert span.position_span == 15
    assert span.token_types == (0, 0, 0, 0, *[2] * 6, 0, 0, 0, *[2] * 6, 0, 0)
    assert (span.prefix_tokens, span.suffix_tokens) == ((1,), (2,))
    assert span.placeholder_runs == ((4, 10), (13, 19))
    assert span.token_count == 12


def test_adjacent_placeholder_segments_are_one_run():
    span = build_span([Placeholders(9, TokenType.IMAGE, 2), Placeholders(9, TokenType.IMAGE, 3)], rope="1d")
    assert span.placeholder_runs == ((0, 5),)
    assert (span.prefix_tokens, span.suffix_tokens) == ((), ())


def test_bad_declarations_are_refused():
    with pytest.raises(ValueError, match="exactly one token id"):
        build_span([Text((1,))], rope="1d")
    with pytest.raises(ValueError, match="exactly one token id"):
        build_span([Placeholders(9, TokenType.IMAGE, 1), Placeholders(8, TokenType.IMAGE, 1)], rope="1d")
    with pytest.raises(ValueError, match="grid"):
        build_span([Placeholders(9, TokenType.IMAGE, 5, grid=(2, 2))], rope="mrope")
    with pytest.raises(ValueError, match="rope"):
        build_span([Placeholders(9, TokenType.IMAGE, 1)], rope="2d")  # type: ignore[arg-type]


def test_text_ids_are_memoised():
    class Tok:
        calls = 0

        def encode(self, text, add_special_tokens):
            Tok.calls += 1
            return type("E", (), {"ids": [ord(c) for c in text]})()

    ids = TextIds(Tok())
    assert ids("ab") == (97, 98) and ids("ab") == (97, 98)
    assert Tok.calls == 1
