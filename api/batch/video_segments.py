"""Cutting a video into segments for one caption each: ``n`` equal parts, or at its scene
changes.

A ``VideoSegment`` is a ``media.Video`` that shows the encoders only the frames of one
time range: its ``info`` counts that range's frames, and ``sample_indices`` maps the
encoder's indices onto the whole video's. The frames come back with their indices in
the whole video, so the timestamps a model sees are the segment's real times."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from media import SampledFrames, Video
from media.hashing import content_hash_parts

SCENE_PROBE_FPS = 4.0
SCENE_PROBE_MAX = 240
SCENE_THRESHOLD = 0.12
"""Mean absolute difference (0-1) of two consecutive 32x32 grey probes that counts as a cut."""
MIN_SCENE_S = 0.5


class VideoSegment(Video):
    """Frames ``[start, end)`` of ``parent``."""

    def __init__(self, parent: Video, start: int, end: int):  # noqa: D107 - no Video.__init__: no new source
        self.parent = parent
        self.start, self.end = start, end
        fps = parent.info.fps or 0.0
        self._info = dataclasses.replace(
            parent.info,
            frame_count=end - start,
            duration=(end - start) / fps if fps > 0 else parent.info.duration,
        )
        self.content_hash = content_hash_parts((parent.content_hash.encode(),), "segment", start, end)
        self.size_bytes = parent.size_bytes

    @property
    def info(self):  # type: ignore[override]
        return self._info

    @property
    def limits(self):  # type: ignore[override]
        return self.parent.limits

    def sample_indices(self, indices: Sequence[int], *, strategy: str = "auto") -> SampledFrames:  # type: ignore[override]
        return self.parent.sample_indices([self.start + int(i) for i in indices], strategy=strategy)  # type: ignore[arg-type]

    def __repr__(self) -> str:
        return f"VideoSegment({self.start}..{self.end} of {self.parent!r})"


def even_bounds(frames: int, n: int) -> list[tuple[int, int]]:
    """``n`` contiguous frame ranges covering ``frames`` (fewer when the video is shorter)."""
    n = max(1, min(n, frames))
    edges = [round(i * frames / n) for i in range(n + 1)]
    return [(a, b) for a, b in zip(edges, edges[1:], strict=False) if b > a]


def scene_bounds(video: Video) -> list[tuple[int, int]]:
    """Frame ranges between scene changes: the video probed at ``SCENE_PROBE_FPS`` (at
    most ``SCENE_PROBE_MAX`` frames) as 32x32 grey thumbnails; a cut where consecutive
    probes differ by more than ``SCENE_THRESHOLD`` (scenes shorter than ``MIN_SCENE_S``
    are merged into the one before)."""
    info = video.info
    total = info.frame_count
    fps = info.fps if info.fps and info.fps > 0 else 24.0
    n = int(min(SCENE_PROBE_MAX, max(2, total / fps * SCENE_PROBE_FPS), total))
    idx = sorted({round(i * (total - 1) / max(1, n - 1)) for i in range(n)})
    sampled = video.sample_indices(idx)
    thumbs = [_thumb(f) for f in sampled.frames]
    cuts = [0]
    min_gap = MIN_SCENE_S * fps
    for k in range(1, len(thumbs)):
        diff = float(np.abs(thumbs[k] - thumbs[k - 1]).mean())
        at = sampled.indices[k]
        if diff > SCENE_THRESHOLD and at - cuts[-1] >= min_gap:
            cuts.append(at)
    cuts.append(total)
    return [(a, b) for a, b in zip(cuts, cuts[1:], strict=False) if b > a]


def _thumb(frame: np.ndarray) -> np.ndarray:
    h, w = frame.shape[:2]
    ys = (np.arange(32) * h // 32).clip(0, h - 1)
    xs = (np.arange(32) * w // 32).clip(0, w - 1)
    return frame[ys][:, xs].mean(axis=2) / 255.0


def segment_times(video: Video, bounds: tuple[int, int]) -> tuple[float, float]:
    fps = video.info.fps if video.info.fps and video.info.fps > 0 else 24.0
    return round(bounds[0] / fps, 3), round(bounds[1] / fps, 3)
