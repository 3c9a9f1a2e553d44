"""A video's frame timeline and the seek-or-decode-forward cost model.

Frame identity. A demux-only pass over the video packets (no decoding, a few ms even
for a 60 s 720p clip) gives every frame's presentation timestamp and which frames are
keyframes: a :class:`Timeline`. Frame ``i`` is the frame with the i-th smallest pts; a
decoded frame is identified by its pts, not by counting frames, so a corrupt or dropped
frame never shifts the identity of the frames after it, and seeking and sequential
decoding return the same frames for the same indices. Streams whose packets lack unique
pts have no usable timeline (``pts`` is None): frames are counted, and never sought.

Seek or decode forward. Decoding forward from the current position to the next wanted
frame costs ``target - position`` frame decodes; seeking costs ``target - keyframe + 1``
decodes plus a fixed overhead (demuxer seek, decoder flush, refilling the decoder's
thread/reorder pipeline) of about :data:`SEEK_OVERHEAD_FRAMES` frame decodes, measured
with ``bench/media_decode.py``. ``strategy="auto"`` takes, for every wanted frame, the
cheaper of the two: it seeks only when the gap it skips is larger than the overhead. So
long clips with frequent keyframes and sparse samples seek; dense samples or rare
keyframes (a long GOP) decode forward. ``"seek"`` seeks whenever the wanted frame's
keyframe lies ahead; ``"sequential"`` never seeks. :func:`plan_decode` computes all three
and the chosen plan.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

__all__ = ["SEEK_OVERHEAD_FRAMES", "STRATEGIES", "DecodePlan", "Strategy", "Timeline", "plan_decode"]

Strategy = Literal["auto", "seek", "sequential"]

STRATEGIES: tuple[Strategy, ...] = ("auto", "seek", "sequential")

SEEK_OVERHEAD_FRAMES = 8
"""Cost of one seek, in frame decodes, beyond the frames it decodes.

A seek flushes the demuxer and decoder; the decoder then re-fills its reorder buffer
(B-frames) before the wanted frame comes out, and the frames decoded past the wanted
one (sometimes the next GOP's keyframe) are wasted when the next wanted frame needs
another seek. Calibrated on the 2-core development machine with the 720p H.264 bench
clip (keyframe every 15 frames, B-frames): seeking to each of its 120 keyframes and
decoding k = 0, 4, 8, 13 frames after it, against decoding all 1800 frames, fits a
seek overhead of ~25 ms CPU = 8 frame decodes. The model needs only the order of
magnitude: it decides between skipping hundreds of frames or a handful.
"""


@dataclass(frozen=True)
class Timeline:
    """Per-frame facts from a demux-only pass (packets, no decoding)."""

    pts: list[int] | None
    """Sorted presentation timestamps, one per frame; None when packets lack unique pts."""
    keyframes: list[int]
    """Presentation indices of keyframes, sorted (only meaningful when ``pts`` is set)."""
    packets: int
    error: str | None = None
    """Why the pass stopped early (demuxer error), if it did."""

    @classmethod
    def from_packets(
        cls, pts: Sequence[int | None], keyframe_pts: Iterable[int], error: str | None = None
    ) -> Timeline:
        """From each video packet's pts in demux order (None where a packet has none) and
        the pts of the keyframe packets. Frame 0 always counts as a keyframe."""
        known = [p for p in pts if p is not None]
        if len(known) != len(pts) or len(set(known)) != len(known):
            return cls(None, [], len(pts), error)
        known.sort()
        where = {p: i for i, p in enumerate(known)}
        keyframes = sorted(where[p] for p in keyframe_pts)
        if not keyframes or keyframes[0] != 0:
            keyframes.insert(0, 0)
        return cls(known, keyframes, len(pts), error)

    @property
    def can_seek(self) -> bool:
        """Whether seeking can help: frames have identities and there is a keyframe past 0."""
        return self.pts is not None and len(self.keyframes) > 1

    def keyframe_at_or_before(self, index: int) -> int:
        k = bisect.bisect_right(self.keyframes, index) - 1
        return self.keyframes[k] if k >= 0 else 0

    def index_of_pts(self, pts: int) -> int | None:
        """The frame whose pts is exactly ``pts``, or None."""
        if self.pts is None:
            return None
        k = bisect.bisect_left(self.pts, pts)
        return k if k < len(self.pts) and self.pts[k] == pts else None

    def frame_index(self, pts: int | None, previous: int) -> int:
        """Index of a decoded frame: by its pts (the nearest frame for a pts the demuxer
        never announced), or ``previous + 1`` when there is no pts to go by."""
        if self.pts is not None and pts is not None:
            k = bisect.bisect_left(self.pts, pts)
            if k < len(self.pts) and self.pts[k] == pts:
                return k
            if k > 0 and (k == len(self.pts) or pts - self.pts[k - 1] < self.pts[k] - pts):
                return k - 1
            return min(k, len(self.pts) - 1)
        return previous + 1


@dataclass(frozen=True)
class DecodePlan:
    """What decoding a set of frames will cost under each strategy (in frame decodes)."""

    targets: tuple[int, ...]
    sequential_frames: int
    """Frames decoded from the start through the last target."""
    seek_frames: int
    """Frames decoded when seeking to each target's keyframe whenever it lies ahead."""
    seek_count: int
    auto_frames: int
    """Frames decoded by the auto plan (which also pays ``auto_seeks`` seek overheads)."""
    auto_seeks: int
    seek_overhead_frames: float
    can_seek: bool
    seek_before: tuple[bool, ...]
    """For the chosen strategy: whether to seek before reaching ``targets[k]``."""
    strategy: str
    """The strategy these ``seek_before`` flags implement."""


def plan_decode(
    targets: Sequence[int],
    timeline: Timeline | None,
    strategy: Strategy = "auto",
    overhead: float = SEEK_OVERHEAD_FRAMES,
) -> DecodePlan:
    """Estimate the frames decoded under each strategy and pick where to seek.

    ``targets`` are sorted frame indices; ``timeline`` None (or one without pts or with
    a single keyframe) means no seeking. ``overhead`` is the cost of one seek in frame
    decodes.
    """
    targets = tuple(targets)
    can_seek = timeline is not None and timeline.can_seek
    seq = (targets[-1] + 1) if targets else 0

    def simulate(threshold: float) -> tuple[int, int, tuple[bool, ...]]:
        pos, cost, seeks, flags = -1, 0, 0, []
        for t in targets:
            if t <= pos:  # already decoded (only for duplicate/unsorted input)
                flags.append(False)
                continue
            kf = timeline.keyframe_at_or_before(t) if can_seek else 0  # type: ignore[union-attr]
            skipped = kf - (pos + 1)
            if can_seek and skipped > threshold:
                cost += t - kf + 1
                seeks += 1
                flags.append(True)
            else:
                cost += t - pos
                flags.append(False)
            pos = t
        return cost, seeks, tuple(flags)

    seek_cost, seek_n, seek_flags = simulate(0)
    auto_cost, auto_n, auto_flags = simulate(overhead)
    if strategy == "sequential" or not can_seek:
        flags, chosen = tuple(False for _ in targets), "sequential"
    elif strategy == "seek":
        flags, chosen = seek_flags, "seek"
    else:
        flags = auto_flags
        chosen = "sequential" if auto_n == 0 else ("seek" if all(auto_flags[1:]) else "mixed")
    return DecodePlan(
        targets=targets,
        sequential_frames=seq,
        seek_frames=seek_cost,
        seek_count=seek_n,
        auto_frames=auto_cost,
        auto_seeks=auto_n,
        seek_overhead_frames=overhead,
        can_seek=can_seek,
        seek_before=flags,
        strategy=chosen,
    )
