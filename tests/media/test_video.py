"""media.Video: metadata, sampling, seeking, audio, hostile input."""

from __future__ import annotations

import time
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fixtures import video as fx
from media import (
    CorruptMediaError,
    EmptyMediaError,
    InvalidRequestError,
    MediaError,
    MediaLimits,
    MediaTooLargeError,
    MediaTooLongError,
    SampledFrames,
    UnsupportedFormatError,
    Video,
    VideoInfo,
    content_hash,
)

CFR_CLIPS = [name for name, spec in fx.CLIPS.items() if spec["fps"] is not None]
ALL_CLIPS = list(fx.CLIPS)
SEEKABLE = [n for n in ALL_CLIPS if fx.CLIPS[n]["codec"] not in ("gif", "webp")]


@pytest.fixture(scope="module")
def vdir(samples: Path) -> Path:
    return samples / "video"


@pytest.fixture(scope="module")
def hdir(samples: Path) -> Path:
    return samples / "hostile"


def load(vdir: Path, name: str, limits: MediaLimits | None = None) -> Video:
    return Video.from_bytes((vdir / name).read_bytes(), limits)


def markers(s: SampledFrames) -> list[int]:
    return [fx.read_marker(f) for f in s.frames]


# --------------------------------------------------------------------------- metadata


@pytest.mark.parametrize("name", ALL_CLIPS)
def test_metadata_from_header(vdir: Path, name: str) -> None:
    spec = fx.CLIPS[name]
    data = (vdir / name).read_bytes()
    v = Video.from_bytes(data)
    w, h = spec["size"]
    assert (v.info.width, v.info.height) == (w, h)
    assert v.info.frame_count == spec["frames"]
    assert v.info.frame_count_source in ("container", "demux")
    if spec["fps"] is not None:
        assert v.info.fps == pytest.approx(spec["fps"], rel=1e-3)
        assert v.info.duration == pytest.approx(spec["frames"] / spec["fps"], abs=0.05)
    else:  # variable frame rate: 40 frames averaging 40 ms
        assert v.info.fps == pytest.approx(1000 / np.mean(fx.VFR_DURATIONS_MS), rel=0.05)
        assert v.info.duration == pytest.approx(sum(fx.VFR_DURATIONS_MS[:-1]) / 1000, abs=0.07)
    assert spec["codec"] in v.info.codec
    assert v.info.has_audio == (name == fx.AUDIO_CLIP)
    assert v.content_hash == content_hash(data)
    assert v.to_dict()["frame_count"] == v.info.frame_count
    assert "Video(" in repr(v)


def test_info_is_a_frozen_dataclass(vdir: Path) -> None:
    v = load(vdir, fx.AUDIO_CLIP)
    assert isinstance(v.info, VideoInfo)
    with pytest.raises(AttributeError):
        v.info.width = 1  # type: ignore[misc]
    d = v.to_dict()
    assert d == {
        "kind": "video",
        **v.info.to_dict(),
        "size_bytes": v.size_bytes,
        "content_hash": v.content_hash,
    }
    assert list(v.info.to_dict()) == [
        "format",
        "codec",
        "width",
        "height",
        "fps",
        "duration",
        "frame_count",
        "frame_count_source",
        "has_audio",
    ]


def test_frame_count_source(vdir: Path) -> None:
    # MP4 declares its sample count; Matroska does not, so packets are counted (no decode).
    assert load(vdir, "h264_320x240_30fps_3s.mp4").info.frame_count_source == "container"
    assert load(vdir, "vp9_320x240_25fps_2s.webm").info.frame_count_source == "demux"
    assert load(vdir, "h264_256x192_24fps_2s.mkv").info.frame_count_source == "demux"


def test_metadata_needs_no_frame_data(hdir: Path) -> None:
    """An MP4 whose frames are all zeros still opens with the header's metadata: nothing is
    decoded at open; decoding then finds nothing usable."""
    data = bytearray((hdir / fx.HOSTILE["truncated_faststart"]).read_bytes())
    for kind, off, _size in fx._mp4_boxes(bytes(data)):
        if kind == b"mdat":
            data[off + 8 :] = bytes(len(data) - off - 8)
    v = Video.from_bytes(bytes(data))
    assert (v.info.width, v.info.height, v.info.frame_count) == (320, 240, 90)
    assert v.info.duration == pytest.approx(3.0, abs=0.05)
    with pytest.raises(CorruptMediaError, match="none of the 4 requested frames"):
        v.sample(max_frames=4)


def test_from_path_and_hash(vdir: Path) -> None:
    p = vdir / "h264_320x240_30fps_3s.mp4"
    v = Video.from_path(p)
    assert v.content_hash == content_hash(p.read_bytes())
    assert v.size_bytes == p.stat().st_size
    with pytest.raises(MediaTooLargeError) as ei:
        Video.from_path(p, MediaLimits(max_bytes=1000))
    assert ei.value.limit == 1000 and ei.value.actual == p.stat().st_size


# --------------------------------------------------------------------------- sampling


@pytest.mark.parametrize("name", ALL_CLIPS)
def test_uniform_sampling(vdir: Path, name: str) -> None:
    v = load(vdir, name)
    n = v.info.frame_count
    s = v.sample(max_frames=8)
    assert (
        len(s) == 8 and s.frames.shape == (8, v.info.height, v.info.width, 3) and s.frames.dtype == np.uint8
    )
    assert s.indices[0] == 0 and s.indices[-1] == n - 1  # first and last frame included
    assert s.indices == sorted(set(s.indices))
    assert all(b > a for a, b in zip(s.timestamps, s.timestamps[1:], strict=False))  # monotonic
    assert s.timestamps[0] == pytest.approx(0.0, abs=1e-6)
    assert markers(s) == s.indices  # the right frames came back
    assert s.skipped == []
    assert s.fps == v.info.fps and s.duration == v.info.duration
    if fx.CLIPS[name]["fps"]:
        fps = fx.CLIPS[name]["fps"]
        assert s.timestamps == pytest.approx([i / fps for i in s.indices], abs=0.002)


def test_sampled_frames_iterate_as_timestamp_frame_pairs(vdir: Path) -> None:
    v = load(vdir, "h264_320x240_30fps_3s.mp4")
    s = v.sample_indices([45, 3, 89])
    pairs = list(s)
    assert len(pairs) == len(s) == 3
    assert [t for t, _ in pairs] == s.timestamps
    assert [fx.read_marker(f) for _, f in pairs] == [45, 3, 89]
    assert all(np.shares_memory(f, s.frames) for _, f in pairs)
    r = repr(s)
    assert r.startswith("SampledFrames(3 frames 320x240, indices=[45, 3, 89], ")
    assert "strategy=" in r and "array" not in r and len(r) < 300
    many = v.sample(max_frames=40)
    first, last = many.indices[:3], many.indices[-3:]
    assert f"indices=[{', '.join(map(str, first))}, ..., {', '.join(map(str, last))}]" in repr(many)
    assert len(repr(many)) < 300


def test_sampling_more_frames_than_the_clip_returns_all(vdir: Path) -> None:
    v = load(vdir, "mpeg4_320x240_25fps_2s.avi")
    s = v.sample(max_frames=500)
    assert s.indices == list(range(50)) and markers(s) == s.indices
    assert v.sample(max_frames=1).indices == [0]
    assert v.sample(max_frames=2).indices == [0, 49]


def test_sampling_is_bounded_by_limits_max_frames(vdir: Path) -> None:
    v = load(vdir, "h264_320x240_30fps_3s.mp4", MediaLimits(max_frames=5))
    assert len(v.sample()) == 5
    assert len(v.sample(max_frames=50)) == 5
    assert len(v.sample(fps=30)) == 5
    with pytest.raises(InvalidRequestError) as ei:
        v.sample_indices(range(6))
    assert ei.value.limit == 5 and ei.value.actual == 6


def test_fps_sampling(vdir: Path) -> None:
    v = load(vdir, "h264_320x240_30fps_3s.mp4")  # 90 frames, 3 s
    s = v.sample(fps=5)
    assert len(s) == 15  # one frame every 0.2 s over 3 s
    assert s.indices[0] == 0 and s.indices[-1] == 89
    assert markers(s) == s.indices
    gaps = np.diff(s.timestamps)
    assert gaps.max() - gaps.min() < 0.05  # evenly spread
    assert len(v.sample(fps=5, max_frames=4)) == 4  # capped, still whole clip
    assert v.sample(fps=5, max_frames=4).indices[-1] == 89
    assert v.sample(fps=60).indices == list(range(90))  # faster than the source: every frame
    assert v.sample(fps=0.1).indices == [0]  # at least one frame


def test_fps_sampling_variable_frame_rate_is_even_in_time(vdir: Path) -> None:
    v = load(vdir, "h264_vfr_320x240.mp4")
    s = v.sample(fps=5)
    assert markers(s) == s.indices
    assert s.indices[0] == 0 and s.indices[-1] == v.info.frame_count - 1
    # Frame k starts at the sum of the durations before it.
    starts = np.concatenate([[0], np.cumsum(fx.VFR_DURATIONS_MS[:-1])]) / 1000
    assert s.timestamps == pytest.approx([starts[i] for i in s.indices], abs=1e-3)
    gaps = np.diff(s.timestamps)
    assert gaps.max() < 0.3  # ~0.2 s apart, off by at most one 60 ms frame


def test_sample_indices_exact_order_and_duplicates(vdir: Path) -> None:
    v = load(vdir, "h264_320x240_30fps_3s.mp4")
    want = [45, 3, 3, 89, 0, 60, 61]
    s = v.sample_indices(want)
    assert s.indices == want
    assert markers(s) == want
    assert np.array_equal(s.frames[1], s.frames[2])
    s2 = v.sample_indices(np.array([7, 8], dtype=np.int64))
    assert markers(s2) == [7, 8]


@pytest.mark.parametrize(
    "bad",
    [[], [90], [-1], [1.5], ["3"]],
)
def test_sample_indices_rejects_bad_indices(vdir: Path, bad: list) -> None:
    v = load(vdir, "h264_320x240_30fps_3s.mp4")
    with pytest.raises(InvalidRequestError):
        v.sample_indices(bad)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_frames": 0},
        {"max_frames": -3},
        {"max_frames": 2.5},
        {"fps": 0},
        {"fps": -1.0},
        {"fps": float("nan")},
        {"fps": float("inf")},
        {"strategy": "bogus"},
    ],
)
def test_invalid_sample_requests(vdir: Path, kwargs: dict) -> None:
    v = load(vdir, "h264_320x240_30fps_3s.mp4")
    with pytest.raises(InvalidRequestError):
        v.sample(**kwargs)


# --------------------------------------------------------------------------- seeking


@pytest.mark.parametrize("name", SEEKABLE)
def test_seek_and_sequential_give_the_same_frames(vdir: Path, name: str) -> None:
    v = load(vdir, name)
    n = v.info.frame_count
    rng = np.random.default_rng(3)
    sets = [
        v.uniform_indices(6),
        sorted(set(rng.integers(0, n, 5).tolist())),
        [n - 1],
        v.keyframe_indices[-1:] + [max(0, v.keyframe_indices[-1] - 1)],  # either side of a keyframe
    ]
    for idx in sets:
        seq = v.sample_indices(idx, strategy="sequential")
        seek = v.sample_indices(idx, strategy="seek")
        auto = v.sample_indices(idx, strategy="auto")
        assert seq.indices == seek.indices == auto.indices == idx
        assert np.array_equal(seq.frames, seek.frames)
        assert np.array_equal(seq.frames, auto.frames)
        assert seq.timestamps == pytest.approx(seek.timestamps, abs=1e-9)
        assert markers(seek) == idx
        assert seq.seeks == 0
        if len(v.keyframe_indices) > 1 and max(idx) >= v.keyframe_indices[1] + 1:
            assert seek.seeks >= 1
            assert seek.frames_decoded < seq.frames_decoded


def test_keyframes_from_demux(vdir: Path) -> None:
    # x264 was told keyint=30, no scene cuts: keyframes at 0, 30, 60.
    assert load(vdir, "h264_320x240_30fps_3s.mp4").keyframe_indices == [0, 30, 60]
    assert load(vdir, "mjpeg_240x160_20fps_2s.mov").keyframe_indices == list(range(40))
    assert load(vdir, "animated_160x120_10fps_2s.gif").keyframe_indices == [0]


def test_auto_seeks_only_when_it_saves_work(vdir: Path) -> None:
    v = load(vdir, "mjpeg_240x160_20fps_2s.mov")  # every frame a keyframe
    sparse = v.sample_indices([0, 20, 39])
    assert sparse.strategy in ("seek", "mixed") and sparse.seeks == 2 and sparse.frames_decoded == 3
    dense = v.sample_indices([0, 2, 4, 6])  # gaps smaller than a seek's overhead
    assert dense.strategy == "sequential" and dense.seeks == 0


def test_decode_plan_is_public(vdir: Path) -> None:
    v = load(vdir, "h264_320x240_30fps_3s.mp4")
    plan = v.decode_plan([0, 89])
    assert plan.sequential_frames == 90
    assert plan.seek_frames == 1 + (89 - 60 + 1)
    assert plan.can_seek


# --------------------------------------------------------------------------- corrupt frames


def test_corrupt_frame_is_skipped_and_reported(vdir: Path) -> None:
    data = bytearray((vdir / "mjpeg_240x160_20fps_2s.mov").read_bytes())
    starts = [i for i in range(len(data) - 3) if data[i : i + 3] == b"\xff\xd8\xff"]
    assert len(starts) == 40
    data[starts[10] : starts[11]] = bytes(starts[11] - starts[10])  # frame 10 -> zeros
    v = Video.from_bytes(bytes(data))
    for strategy in ("sequential", "seek"):
        s = v.sample_indices([5, 10, 15], strategy=strategy)
        assert s.indices == [5, 15] and markers(s) == [5, 15]  # identities survive the gap
        assert [k.index for k in s.skipped] == [10]
        assert "decoder error" in s.skipped[0].reason


def test_truncated_with_index_first_returns_what_is_there(hdir: Path) -> None:
    v = Video.from_bytes((hdir / fx.HOSTILE["truncated_faststart"]).read_bytes())
    assert v.info.frame_count == 90  # what the header promises
    s = v.sample(max_frames=4)
    assert s.indices == [0, 30] and markers(s) == [0, 30]
    assert [k.index for k in s.skipped] == [59, 89]
    assert all("truncated" in k.reason or "error" in k.reason for k in s.skipped)


# --------------------------------------------------------------------------- animation, audio


@pytest.mark.parametrize("name", ["animated_160x120_10fps_2s.gif", "animated_160x120_10fps_2s.webp"])
def test_animated_images_are_videos(vdir: Path, name: str) -> None:
    v = load(vdir, name)
    assert (v.info.frame_count, v.info.fps, v.info.duration) == (20, pytest.approx(10), pytest.approx(2.0))
    s = v.sample_indices(list(range(20)))
    assert markers(s) == list(range(20))
    assert s.timestamps == pytest.approx([i / 10 for i in range(20)], abs=1e-6)
    assert v.audio() is None


def test_audio_track(vdir: Path) -> None:
    v = load(vdir, fx.AUDIO_CLIP)
    a = v.audio()
    assert a is not None
    assert a.sample_rate == fx.AUDIO_RATE and a.channels == 2
    assert a.duration == pytest.approx(2.0, abs=0.1)
    x = a.samples[4096 : 4096 + 16384]
    freqs = np.fft.rfftfreq(len(x), 1 / a.sample_rate)
    for ch, f in enumerate(fx.AUDIO_FREQS):
        peak = freqs[np.argmax(np.abs(np.fft.rfft(x[:, ch])))]
        assert peak == pytest.approx(f, abs=5)
    assert a.content_hash != v.content_hash
    assert load(vdir, "h264_320x240_30fps_3s.mp4").audio() is None


def test_audio_track_limits(vdir: Path) -> None:
    v = load(vdir, fx.AUDIO_CLIP, MediaLimits(max_audio_seconds=0.5))
    with pytest.raises(MediaTooLongError):
        v.audio()


# --------------------------------------------------------------------------- limits


def test_frame_pixel_limit(vdir: Path) -> None:
    with pytest.raises(MediaTooLargeError) as ei:
        load(vdir, "h264_320x240_30fps_3s.mp4", MediaLimits(max_frame_pixels=320 * 240 - 1))
    assert ei.value.actual == 320 * 240 and ei.value.code == "too_large"
    with pytest.raises(MediaTooLargeError):
        load(vdir, "animated_160x120_10fps_2s.webp", MediaLimits(max_frame_pixels=100))


def test_duration_limit(vdir: Path) -> None:
    with pytest.raises(MediaTooLongError) as ei:
        load(vdir, "h264_320x240_30fps_3s.mp4", MediaLimits(max_video_seconds=2.5))
    assert ei.value.limit == 2.5 and ei.value.actual == pytest.approx(3.0, abs=0.05)
    with pytest.raises(MediaTooLongError):
        load(vdir, "vp9_320x240_25fps_2s.webm", MediaLimits(max_video_seconds=1))
    with pytest.raises(MediaTooLongError):
        load(vdir, "animated_160x120_10fps_2s.webp", MediaLimits(max_video_seconds=1))


def test_container_frame_limit(vdir: Path) -> None:
    for name in ("h264_320x240_30fps_3s.mp4", "h264_256x192_24fps_2s.mkv", "animated_160x120_10fps_2s.webp"):
        with pytest.raises(MediaTooLongError) as ei:
            load(vdir, name, MediaLimits(max_container_frames=10))
        assert ei.value.limit == 10


def test_byte_limit(vdir: Path) -> None:
    with pytest.raises(MediaTooLargeError):
        load(vdir, "h264_320x240_30fps_3s.mp4", MediaLimits(max_bytes=100))


def test_sampling_holds_only_the_requested_frames(vdir: Path) -> None:
    v = load(vdir, "h264_320x240_30fps_3s.mp4")
    tracemalloc.start()
    try:
        s = v.sample(max_frames=4)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    one = 320 * 240 * 3
    assert s.frames.nbytes == 4 * one
    assert peak < 4 * one + 3 * one  # the 4 frames, one frame in flight, small change


# --------------------------------------------------------------------------- hostile


HOSTILE_CASES = [
    ("truncated", CorruptMediaError, "corrupt"),
    ("no_moov", CorruptMediaError, "corrupt"),
    ("huge_duration", MediaTooLongError, "too_long"),
    ("audio_only", UnsupportedFormatError, "unsupported_format"),
    ("still_png", UnsupportedFormatError, "unsupported_format"),
    ("still_gif", UnsupportedFormatError, "unsupported_format"),
]


def _bounded(fn, seconds: float = 2.0, peak_bytes: int = 32 << 20):
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        return fn()
    finally:
        elapsed = time.perf_counter() - t0
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert elapsed < seconds, f"took {elapsed:.2f} s"
        assert peak < peak_bytes, f"peak {peak} bytes"


@pytest.mark.parametrize(("key", "error", "code"), HOSTILE_CASES)
def test_hostile_video_files(hdir: Path, key: str, error: type[MediaError], code: str) -> None:
    data = (hdir / fx.HOSTILE[key]).read_bytes()

    def run() -> None:
        with pytest.raises(error) as ei:
            Video.from_bytes(data).sample(max_frames=4)
        assert ei.value.code == code and ei.value.message

    _bounded(run)


def test_audio_only_says_no_video_stream(hdir: Path) -> None:
    with pytest.raises(UnsupportedFormatError, match="no video stream"):
        Video.from_bytes((hdir / fx.HOSTILE["audio_only"]).read_bytes())


def test_huge_declared_duration_is_refused_before_decoding(hdir: Path) -> None:
    with pytest.raises(MediaTooLongError) as ei:
        _bounded(lambda: Video.from_bytes((hdir / fx.HOSTILE["huge_duration"]).read_bytes()), 0.5, 1 << 20)
    assert ei.value.actual > 1e6 and ei.value.limit == MediaLimits().max_video_seconds


def test_gif_with_thousands_of_frames(hdir: Path) -> None:
    data = (hdir / fx.HOSTILE["gif_bomb"]).read_bytes()
    # Default limits: 5000 tiny frames are a legal 100 s clip, handled in bounded time and memory.
    s = _bounded(lambda: Video.from_bytes(data).sample(max_frames=4))
    assert s.indices == [0, 1666, 3333, 4999]
    # A deployment that caps frames per container refuses it from the header alone.
    with pytest.raises(MediaTooLongError) as ei:
        _bounded(lambda: Video.from_bytes(data, MediaLimits(max_container_frames=1000)), 0.5)
    assert ei.value.actual == fx.GIF_BOMB_FRAMES and ei.value.limit == 1000


@pytest.mark.parametrize(
    ("name", "error"),
    [
        ("zero_bytes.bin", EmptyMediaError),
        ("random_bytes.bin", UnsupportedFormatError),
        ("text_file.txt", UnsupportedFormatError),
        ("image.svg", UnsupportedFormatError),
        ("wrong_magic_png.png", UnsupportedFormatError),
        ("wrong_magic_wav.wav", UnsupportedFormatError),
    ],
)
def test_kind_agnostic_hostile_files(hdir: Path, name: str, error: type[MediaError]) -> None:
    data = (hdir / name).read_bytes()
    with pytest.raises(error) as ei:
        _bounded(lambda: Video.from_bytes(data))
    assert ei.value.kind == "video"
    assert ei.value.to_dict()["code"] == error.code


@pytest.mark.parametrize(
    ("rel", "words", "actual"),
    [
        ("images/photo_640x480.jpg", "JPEG is a still image format", "jpeg"),
        ("audio/tone_44k1_stereo.flac", "FLAC audio file has no video stream", "flac"),
        ("audio/tone_44k1_stereo.aiff", "AIFF audio file has no video stream", "aiff"),
        ("hostile/image.svg", "SVG (vector image) is not a video format", "svg"),
    ],
)
def test_refused_from_the_magic_bytes(samples: Path, rel: str, words: str, actual: str) -> None:
    with pytest.raises(UnsupportedFormatError) as ei:
        Video.from_bytes((samples / rel).read_bytes())
    assert words in ei.value.message and ei.value.actual == actual


def test_still_images_are_not_videos(samples: Path) -> None:
    images = sorted(p for p in (samples / "images").iterdir() if p.is_file() and p.name != "animated.gif")
    assert images
    for p in images:
        with pytest.raises(UnsupportedFormatError):
            Video.from_bytes(p.read_bytes())


# --------------------------------------------------------------------------- fuzzing


def _only_media_errors(data: bytes) -> None:
    try:
        v = Video.from_bytes(data, MediaLimits(max_container_frames=20_000))
        s = v.sample(max_frames=4)
    except MediaError:
        return
    assert s.frames.ndim == 4 and s.frames.shape[0] == len(s.indices) >= 1


_FUZZ = settings(
    max_examples=120,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@_FUZZ
@given(st.binary(min_size=0, max_size=4096))
def test_fuzz_random_bytes(data: bytes) -> None:
    _only_media_errors(data)


_MUTATE_FROM = [
    "h264_320x240_30fps_3s.mp4",
    "vp9_320x240_25fps_2s.webm",
    "h264_256x192_24fps_2s.mkv",
    "mpeg4_320x240_25fps_2s.avi",
    "mjpeg_240x160_20fps_2s.mov",
    "animated_160x120_10fps_2s.gif",
    "animated_160x120_10fps_2s.webp",
]


@pytest.fixture(scope="module")
def originals(vdir: Path) -> dict[str, bytes]:
    return {n: (vdir / n).read_bytes() for n in _MUTATE_FROM}


@_FUZZ
@given(
    name=st.sampled_from(_MUTATE_FROM),
    cut=st.floats(0.0, 1.0),
    flips=st.lists(st.tuples(st.floats(0.0, 1.0), st.integers(0, 255)), max_size=12),
    head_only=st.booleans(),
)
def test_fuzz_mutated_samples(
    originals: dict[str, bytes], name: str, cut: float, flips, head_only: bool
) -> None:
    data = bytearray(originals[name])
    for where, value in flips:
        # Most container structure sits in the first and last few KB: hit those often.
        span = min(len(data), 4096) if head_only else len(data)
        data[min(int(where * span), len(data) - 1)] = value
    data = data[: max(0, int(len(data) * cut))] if cut < 0.97 else data
    _only_media_errors(bytes(data))
