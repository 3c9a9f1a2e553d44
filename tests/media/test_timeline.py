"""media.timeline: frame timeline from demuxed packets, and the seek-vs-sequential cost model."""

from __future__ import annotations

import numpy as np
import pytest

from media import DecodePlan, Timeline
from media.timeline import SEEK_OVERHEAD_FRAMES, STRATEGIES, plan_decode


def _timeline(n: int, gop: int) -> Timeline:
    return Timeline(pts=list(range(n)), keyframes=list(range(0, n, gop)), packets=n)


# --------------------------------------------------------------------------- Timeline


def test_from_packets_sorts_by_presentation_order() -> None:
    # Decode order I P B B (pts 0 3 1 2), then a second keyframe at pts 4.
    tl = Timeline.from_packets([0, 3, 1, 2, 4], keyframe_pts=[0, 4])
    assert tl.pts == [0, 1, 2, 3, 4]
    assert tl.keyframes == [0, 4]
    assert tl.packets == 5 and tl.error is None
    assert tl.can_seek


def test_from_packets_frame_zero_is_always_a_keyframe() -> None:
    tl = Timeline.from_packets([10, 20, 30], keyframe_pts=[20], error="demuxing stopped")
    assert tl.keyframes == [0, 1]
    assert tl.error == "demuxing stopped"


@pytest.mark.parametrize("pts", [[0, None, 2], [0, 1, 1, 2]])
def test_from_packets_without_unique_pts_has_no_frame_identities(pts: list[int | None]) -> None:
    tl = Timeline.from_packets(pts, keyframe_pts=[0])
    assert tl.pts is None and tl.keyframes == [] and tl.packets == len(pts)
    assert not tl.can_seek


def test_keyframe_at_or_before() -> None:
    tl = _timeline(100, 30)
    assert [tl.keyframe_at_or_before(i) for i in (0, 29, 30, 31, 99)] == [0, 0, 30, 30, 90]
    assert tl.keyframe_at_or_before(-1) == 0


def test_index_of_pts_and_frame_index() -> None:
    tl = Timeline(pts=[0, 10, 20, 30], keyframes=[0], packets=4)
    assert tl.index_of_pts(20) == 2
    assert tl.index_of_pts(15) is None
    assert tl.frame_index(20, previous=0) == 2
    assert tl.frame_index(14, previous=0) == 1  # unknown pts: the nearest frame
    assert tl.frame_index(16, previous=0) == 2
    assert tl.frame_index(99, previous=0) == 3
    assert tl.frame_index(None, previous=1) == 2  # no pts: count
    no_pts = Timeline(pts=None, keyframes=[], packets=4)
    assert no_pts.index_of_pts(10) is None
    assert no_pts.frame_index(10, previous=2) == 3


def test_a_single_keyframe_cannot_seek() -> None:
    assert not _timeline(100, 1000).can_seek


# --------------------------------------------------------------------------- plan_decode


def test_cost_model() -> None:
    long_clip_short_gop = _timeline(1800, 15)
    long_clip_long_gop = _timeline(1800, 300)
    sparse = np.linspace(0, 1799, 16).round().astype(int).tolist()
    dense = list(range(0, 1800, 3))

    p = plan_decode(sparse, long_clip_short_gop, "auto", 8)
    assert isinstance(p, DecodePlan)
    assert p.strategy == "seek"
    assert p.auto_frames < p.sequential_frames / 10  # ~16 x half a GOP vs 1800

    p = plan_decode(dense, long_clip_short_gop, "auto", 8)
    assert p.strategy == "sequential" and p.auto_seeks == 0  # every gap is tiny

    # Rare keyframes: seeking saves little; auto seeks only over whole skipped GOPs.
    p = plan_decode(sparse, long_clip_long_gop, "auto", 8)
    assert p.auto_seeks <= 5 and p.auto_frames > 0.7 * p.sequential_frames

    # Forced strategies; no timeline means no seeking.
    assert plan_decode(sparse, long_clip_short_gop, "sequential", 8).seek_before == (False,) * 16
    assert plan_decode(sparse, long_clip_short_gop, "seek", 8).seek_count == 15
    assert plan_decode(sparse, None, "seek", 8).strategy == "sequential"
    # The seek plan never decodes more than sequential decoding.
    for tl in (long_clip_short_gop, long_clip_long_gop):
        for idx in (sparse, dense, [1799], [0, 1]):
            p = plan_decode(idx, tl, "auto", 8)
            assert p.seek_frames <= p.sequential_frames and p.auto_frames <= p.sequential_frames


def test_plan_counts_exactly() -> None:
    tl = _timeline(90, 30)  # keyframes 0, 30, 60
    p = plan_decode([0, 89], tl)
    assert p.targets == (0, 89)
    assert p.sequential_frames == 90
    assert p.seek_frames == 1 + (89 - 60 + 1) and p.seek_count == 1
    assert p.auto_frames == p.seek_frames and p.auto_seeks == 1  # skipping 59 frames beats the overhead
    assert p.seek_before == (False, True) and p.strategy == "seek"
    assert p.seek_overhead_frames == SEEK_OVERHEAD_FRAMES and p.can_seek


def test_plan_mixed_and_empty() -> None:
    tl = _timeline(90, 30)
    p = plan_decode([0, 2, 70], tl)  # a short step forward, then a jump over a GOP
    assert p.seek_before == (False, False, True) and p.strategy == "mixed"
    empty = plan_decode([], tl)
    assert empty.targets == () and empty.sequential_frames == 0 and empty.seek_before == ()


def test_strategies() -> None:
    assert set(STRATEGIES) == {"auto", "seek", "sequential"}
