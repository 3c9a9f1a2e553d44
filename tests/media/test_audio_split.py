"""split_audio: pieces a clip-limited tower takes whole, every frame kept in order, cut at
the quietest moment before each limit."""

from __future__ import annotations

import numpy as np
import pytest

from media import Audio, EmptyMediaError, split_audio

RATE = 16_000


def tone(seconds: float, gaps: list[tuple[float, float]] = ()) -> Audio:
    t = np.arange(int(seconds * RATE)) / RATE
    x = 0.4 * np.sin(2 * np.pi * 330 * t) * (1.0 + 0.5 * np.sin(2 * np.pi * 0.7 * t))
    for a, b in gaps:
        x[int(a * RATE) : int(b * RATE)] = 0.0
    return Audio.from_array(np.stack([x, 0.5 * x], axis=1).astype(np.float32), RATE)


def test_a_clip_that_fits_is_itself():
    clip = tone(12.0)
    assert split_audio(clip, 30.0) == [clip]


def test_pieces_hold_every_frame_and_cut_in_the_silence():
    clip = tone(70.0, gaps=[(29.0, 29.3), (58.4, 58.6)])
    pieces = split_audio(clip, 30.0, search_seconds=2.0)
    assert len(pieces) == 3
    assert all(p.frames <= 30 * RATE for p in pieces)
    assert np.array_equal(np.concatenate([p.samples for p in pieces]), clip.samples)
    first, second = pieces[0].frames, pieces[0].frames + pieces[1].frames
    assert 29.0 <= first / RATE <= 29.3 - 0.05  # the quietest 50 ms window starts in the gap
    assert 58.4 <= second / RATE <= 58.6 - 0.05
    hashes = {p.content_hash for p in pieces} | {clip.content_hash}
    assert len(hashes) == 4  # each piece is its own content (encoder caches key on it)
    again = split_audio(tone(70.0, gaps=[(29.0, 29.3), (58.4, 58.6)]), 30.0, search_seconds=2.0)
    assert [p.content_hash for p in again] == [p.content_hash for p in pieces]  # deterministic


def test_no_silence_still_cuts_within_the_limit():
    clip = tone(95.0)
    pieces = split_audio(clip, 30.0)
    assert sum(p.frames for p in pieces) == clip.frames
    assert all(28.0 <= p.duration <= 30.0 for p in pieces[:-1])


def test_segment_bounds():
    clip = tone(1.0)
    assert clip.segment(0, clip.frames) is clip
    assert clip.segment(100, 10**9).frames == clip.frames - 100
    with pytest.raises(EmptyMediaError):
        clip.segment(500, 500)
