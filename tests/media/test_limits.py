from __future__ import annotations

import pytest

from media import MediaLimits, MediaTooLargeError, Video


def test_sample_bytes_bound_refuses_before_decoding(samples):
    data = (samples / "video/h264_320x240_30fps_3s.mp4").read_bytes()
    one_frame = 320 * 240 * 3
    video = Video.from_bytes(data, MediaLimits(max_sample_bytes=4 * one_frame))
    assert len(video.sample(max_frames=4)) == 4
    with pytest.raises(MediaTooLargeError) as ei:
        video.sample(max_frames=5)
    assert ei.value.limit == 4 * one_frame and ei.value.actual == 5 * one_frame
    with pytest.raises(MediaTooLargeError):
        video.sample_indices([0, 1, 2, 3, 4])


def test_limits_with_returns_a_changed_copy():
    base = MediaLimits()
    changed = base.with_(max_frames=3)
    assert changed.max_frames == 3 and base.max_frames != 3
