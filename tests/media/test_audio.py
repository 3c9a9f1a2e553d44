"""media.Audio: every format and bit depth, transforms with librosa parity, limits,
hostile files, and property tests (only MediaError may leave from_bytes)."""

from __future__ import annotations

import io
import math
import time
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fixtures import audio as fa
from media.audio import RESAMPLE_QUALITY, Audio
from media.audio_decode import read_sndfile
from media.errors import (
    CorruptMediaError,
    EmptyMediaError,
    InvalidRequestError,
    MediaError,
    MediaTooLargeError,
    MediaTooLongError,
    UnsupportedFormatError,
)
from media.hashing import content_hash
from media.limits import DEFAULT_LIMITS, MediaLimits

LOSSLESS = [s.name for s in fa.SPECS.values() if s.lossless]
LOSSY = [s.name for s in fa.SPECS.values() if not s.lossless]


@pytest.fixture(scope="module")
def audio_dir(samples: Path) -> Path:
    return samples / "audio"


@pytest.fixture(scope="module")
def hostile_dir(samples: Path) -> Path:
    return samples / "hostile"


@pytest.fixture(scope="module")
def librosa():
    # First import JIT-compiles (numba) for ~20-30 s on a cold cache, ~3 s warm: pay it once.
    import librosa

    return librosa


def load(audio_dir: Path, name: str) -> Audio:
    return Audio.from_path(audio_dir / name)


# ----------------------------------------------------------------------------- formats


@pytest.mark.parametrize("name", list(fa.SPECS))
def test_header_fields(audio_dir: Path, name: str) -> None:
    spec = fa.SPECS[name]
    a = load(audio_dir, name)
    assert a.sample_rate == spec.rate
    assert a.channels == spec.channels
    assert a.format == spec.format
    assert a.subtype == spec.decoded_subtype
    assert a.samples.dtype == np.float32 and a.samples.ndim == 2
    assert a.samples.flags.c_contiguous and not a.samples.flags.writeable
    assert a.frames == a.samples.shape[0]
    assert a.duration == pytest.approx(a.frames / a.sample_rate)
    tol = 0 if spec.lossless else 0.05
    assert abs(a.duration - spec.seconds) <= tol + 1e-9
    assert np.isfinite(a.samples).all() and np.abs(a.samples).max() <= 1.0


@pytest.mark.parametrize("name", LOSSLESS)
def test_lossless_values_exact(audio_dir: Path, name: str) -> None:
    """PCM/FLAC decode to the integer codes / 2**(bits-1) exactly (int16: / 32768)."""
    a = load(audio_dir, name)
    np.testing.assert_array_equal(a.samples, fa.expected(name))


def test_int16_is_code_over_32768(audio_dir: Path) -> None:
    raw = audio_dir / "tone_16k_mono.wav"
    codes, _ = sf.read(raw, dtype="int16")
    a = Audio.from_path(raw)
    np.testing.assert_array_equal(a.samples[:, 0], codes.astype(np.float32) / 32768)


@pytest.mark.parametrize("name", LOSSY)
def test_lossy_values_close(audio_dir: Path, name: str) -> None:
    """Lossy codecs: each channel keeps its tone (440 / 660 Hz) and its level."""
    spec = fa.SPECS[name]
    a = load(audio_dir, name)
    mid = a.samples[int(0.4 * a.sample_rate) : int(0.9 * a.sample_rate)]
    for ch, freq in zip(range(a.channels), (440.0, 660.0), strict=False):
        seg = mid[:, ch].astype(np.float64)
        spectrum = np.abs(np.fft.rfft(seg * np.hanning(len(seg))))
        peak = np.argmax(spectrum) * a.sample_rate / len(seg)
        assert abs(peak - freq) < 5.0, (name, ch, peak)
        rms = math.sqrt(float(np.mean(seg**2)))
        assert rms == pytest.approx(0.5 / math.sqrt(2), rel=0.1), (name, ch, rms)
    assert spec.signal in ("tone", "burst_tone")


def test_vbr_mp3_without_xing_decodes_fully(audio_dir: Path) -> None:
    """libsndfile stops at its bitrate estimate (~0.4 s here); our MP3 path must not."""
    raw = (audio_dir / "burst_tone_44k1_mono_vbr_noxing.mp3").read_bytes()
    with sf.SoundFile(io.BytesIO(raw)) as f:
        libsndfile_frames = f.frames
    a = Audio.from_bytes(raw)
    assert libsndfile_frames < 0.5 * a.frames
    assert a.duration == pytest.approx(3.0, abs=0.06)


def test_speechlike_and_long_clips(audio_dir: Path) -> None:
    a = load(audio_dir, "speechlike_30s_16k.wav")
    assert (a.sample_rate, a.channels, a.frames) == (16000, 1, 480000)
    b = load(audio_dir, "speechlike_35s_16k.wav")
    assert b.duration == 35.0 and b.duration > 30.0  # over Gemma-4's 30 s cap
    with pytest.raises(MediaTooLongError):
        Audio.from_path(audio_dir / "speechlike_35s_16k.wav", MediaLimits(max_audio_seconds=30.0))


# ----------------------------------------------------------------------------- containers / hashing


def test_content_hash_is_over_raw_bytes(audio_dir: Path) -> None:
    raw = (audio_dir / "tone_44k1_stereo.flac").read_bytes()
    a, b = Audio.from_bytes(raw), Audio.from_bytes(bytearray(raw))
    assert a.content_hash == b.content_hash == content_hash(raw)
    assert Audio.from_bytes(memoryview(raw)).content_hash == a.content_hash
    other = Audio.from_path(audio_dir / "tone_44k1_stereo.wav")
    assert other.content_hash != a.content_hash
    np.testing.assert_array_equal(a.samples, other.samples)  # same PCM, different identity


def test_audio_track_of_video_container(audio_dir: Path) -> None:
    raw = (audio_dir / "tone_48k_stereo_with_video.mp4").read_bytes()
    a = Audio.from_container_bytes(raw)
    b = Audio.from_bytes(raw)
    assert (a.format, a.subtype, a.sample_rate, a.channels) == ("MP4", "AAC", 48000, 2)
    assert a.duration == pytest.approx(1.0, abs=0.03)
    np.testing.assert_array_equal(a.samples, b.samples)
    # Never the identity of the video made from the same bytes.
    assert a.content_hash == b.content_hash == content_hash(raw, "audio-track")
    assert a.content_hash != content_hash(raw)


def test_container_bytes_accepts_audio_only_files(audio_dir: Path) -> None:
    for name in ("tone_44k1_stereo.m4a", "tone_48k_stereo.webm", "tone_16k_mono.wav"):
        raw = (audio_dir / name).read_bytes()
        a = Audio.from_container_bytes(raw)
        assert a.content_hash == content_hash(raw)
        assert a.sample_rate == fa.SPECS[name].rate


def test_container_without_audio(hostile_dir: Path) -> None:
    raw = (hostile_dir / "audio_video_only.mp4").read_bytes()
    for decode in (Audio.from_bytes, Audio.from_container_bytes):
        with pytest.raises(UnsupportedFormatError, match="no audio stream"):
            decode(raw)


# ----------------------------------------------------------------------------- transforms


def test_to_mono_matches_librosa(audio_dir: Path, librosa) -> None:
    a = load(audio_dir, "chirp_44k1_stereo.wav")
    m = a.to_mono()
    assert (m.channels, m.frames, m.sample_rate) == (1, a.frames, a.sample_rate)
    np.testing.assert_array_equal(m.samples[:, 0], librosa.to_mono(np.ascontiguousarray(a.samples.T)))
    assert m.to_mono() is m and a.to_mono() is m  # memoised; mono of mono is itself
    assert m.content_hash == content_hash(a.content_hash.encode(), "mono") != a.content_hash


@pytest.mark.parametrize(
    ("name", "rate"),
    [
        ("tone_44k1_stereo.wav", 16000),
        ("chirp_48k_stereo_float.wav", 16000),
        ("chirp_44k1_stereo.wav", 24000),
        ("tone_16k_mono.wav", 22050),
        ("speechlike_30s_16k.wav", 8000),
    ],
)
def test_resampled_matches_librosa_soxr_hq(audio_dir: Path, librosa, name: str, rate: int) -> None:
    assert RESAMPLE_QUALITY == "HQ"
    a = load(audio_dir, name)
    r = a.resampled(rate)
    ref = librosa.resample(
        np.ascontiguousarray(a.samples.T), orig_sr=a.sample_rate, target_sr=rate, res_type="soxr_hq"
    )
    assert r.sample_rate == rate and r.channels == a.channels
    # librosa computes ceil(n * (rate / sr)) in floats (88200 * 24000/44100 -> 48001); so do we.
    assert r.frames == ref.shape[-1]
    assert abs(r.frames - math.ceil(a.frames * rate / a.sample_rate)) <= 1
    assert r.samples.dtype == np.float32
    np.testing.assert_array_equal(r.samples, ref.T)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # audioread's imports inside librosa.load
def test_mono_at_matches_librosa_load(audio_dir: Path, librosa) -> None:
    """The encoders' common path equals what HF processors get from librosa.load."""
    for name in ("chirp_48k_stereo_24.flac", "tone_44k1_stereo.wav", "tone_16k_mono.wav"):
        a = load(audio_dir, name)
        y = a.mono_at(16000)
        ref, sr = librosa.load(audio_dir / name, sr=16000, mono=True)
        assert sr == 16000 and y.ndim == 1 and y.dtype == np.float32
        np.testing.assert_array_equal(y, ref)
        assert not y.flags.writeable


def test_resampled_identity_memo_and_hashes(audio_dir: Path) -> None:
    a = load(audio_dir, "tone_48k_stereo.wav")
    assert a.resampled(48000) is a
    r = a.resampled(16000)
    assert a.resampled(16000) is r
    assert r.content_hash == content_hash(a.content_hash.encode(), "resample", 16000, "soxr", "HQ")
    assert (
        len({a.content_hash, r.content_hash, a.resampled(24000).content_hash, a.to_mono().content_hash}) == 4
    )
    # Same operations on an equal clip give the same hashes (caches hit across requests).
    again = load(audio_dir, "tone_48k_stereo.wav")
    assert again.to_mono().resampled(16000).content_hash == a.to_mono().resampled(16000).content_hash
    assert r.format == a.format and r.subtype == a.subtype


@pytest.mark.parametrize("bad", [0, -16000, 10**9, 16000.0, "16000", True, None])
def test_resampled_rejects_bad_rates(audio_dir: Path, bad: object) -> None:
    a = load(audio_dir, "tone_16k_mono.wav")
    with pytest.raises(InvalidRequestError):
        a.resampled(bad)  # type: ignore[arg-type]


def test_to_wav_bytes_round_trip(audio_dir: Path) -> None:
    a = load(audio_dir, "tone_44k1_stereo.flac")
    back = Audio.from_bytes(a.to_wav_bytes())
    np.testing.assert_array_equal(back.samples, a.samples)  # int16 codes survive exactly
    f = Audio.from_bytes(a.resampled(16000).to_wav_bytes("FLOAT"))
    np.testing.assert_array_equal(f.samples, a.resampled(16000).samples)
    with pytest.raises(InvalidRequestError):
        a.to_wav_bytes("MP3")


# ----------------------------------------------------------------------------- from_array


def test_from_array_shapes_dtypes_and_hash() -> None:
    rng = np.random.default_rng(0)
    x = rng.uniform(-1, 1, 1600).astype(np.float32)
    a = Audio.from_array(x, 16000)
    assert (a.frames, a.channels, a.format, a.subtype) == (1600, 1, "PCM", "FLOAT")
    np.testing.assert_array_equal(a.samples[:, 0], x)
    assert Audio.from_array(x.astype(np.float64), 16000).content_hash == a.content_hash
    assert Audio.from_array(x, 8000).content_hash != a.content_hash
    assert Audio.from_array(x[:, None], 16000).content_hash == a.content_hash
    before = a.samples.copy()
    x[:] = 0.25  # the Audio holds its own copy
    np.testing.assert_array_equal(a.samples, before)
    s = Audio.from_array(np.array([[0, -32768], [16384, 32767]], np.int16), 8000)
    np.testing.assert_array_equal(s.samples, np.array([[0, -1], [0.5, 32767 / 32768]], np.float32))
    u = Audio.from_array(np.array([0, 128, 255], np.uint8), 8000)
    np.testing.assert_array_equal(u.samples[:, 0], np.array([-1, 0, 127 / 128], np.float32))


@pytest.mark.parametrize(
    ("samples", "rate", "error"),
    [
        (np.zeros(0, np.float32), 16000, EmptyMediaError),
        (np.zeros((2, 48000), np.float32), 48000, MediaTooLargeError),  # channels-first by mistake
        (np.zeros((2, 2, 2), np.float32), 16000, InvalidRequestError),
        (np.array([0.0, np.nan]), 16000, InvalidRequestError),
        (np.zeros(10, bool), 16000, InvalidRequestError),
        (np.zeros(10, np.float32), 0, InvalidRequestError),
        (np.zeros(10, np.float32), 16000.5, InvalidRequestError),
        (np.zeros(10, np.float32), 10**7, MediaTooLargeError),
        (np.zeros(16000 * 601, np.float32), 16000, MediaTooLongError),
        ([0.0, 0.1], 16000, InvalidRequestError),
    ],
)
def test_from_array_rejects(samples: object, rate: object, error: type[MediaError]) -> None:
    with pytest.raises(error):
        Audio.from_array(samples, rate)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- limits


def test_limits_bytes_checked_first(audio_dir: Path) -> None:
    raw = (audio_dir / "tone_16k_mono.wav").read_bytes()
    with pytest.raises(MediaTooLargeError) as e:
        Audio.from_bytes(raw, MediaLimits(max_bytes=1000))
    assert (e.value.limit, e.value.actual, e.value.kind) == (1000, len(raw), "audio")
    with pytest.raises(MediaTooLargeError):
        Audio.from_path(audio_dir / "tone_16k_mono.wav", MediaLimits(max_bytes=1000))


@pytest.mark.parametrize(
    "name",
    [
        "tone_16k_mono.wav",
        "tone_44k1_stereo.flac",
        "tone_44k1_stereo.ogg",
        "tone_44k1_stereo.m4a",
        "tone_44k1_stereo.mp3",
        "tone_48k_stereo.webm",
        "tone_48k_stereo.opus",
    ],
)
def test_limit_duration_from_header(audio_dir: Path, name: str) -> None:
    with pytest.raises(MediaTooLongError) as e:
        Audio.from_path(audio_dir / name, MediaLimits(max_audio_seconds=1.5))
    err = e.value
    assert err.code == "too_long" and err.limit == 1.5
    assert "1.5 s" in err.message
    if isinstance(err.actual, float):
        assert err.actual == pytest.approx(2.0, abs=0.1)


def test_limit_channels_and_rate(audio_dir: Path) -> None:
    with pytest.raises(MediaTooLargeError) as e:
        Audio.from_path(audio_dir / "tone_44k1_stereo.wav", MediaLimits(max_audio_channels=1))
    assert (e.value.limit, e.value.actual) == (1, 2) and "channels" in e.value.message
    with pytest.raises(MediaTooLargeError) as e:
        Audio.from_path(audio_dir / "tone_48k_stereo.webm", MediaLimits(max_sample_rate=44100))
    assert (e.value.limit, e.value.actual) == (44100, 48000) and "Hz" in e.value.message


def test_limit_enforced_while_decoding(audio_dir: Path) -> None:
    """A FLAC with no sample count (streamed) has no header duration: the running
    guard stops decoding once the limit is passed."""
    path = audio_dir / "tone_16k_mono_unknown_length.flac"
    assert Audio.from_path(path).duration == 2.0
    with pytest.raises(MediaTooLongError, match="decoding stopped"):
        Audio.from_path(path, MediaLimits(max_audio_seconds=1.0))


class _UnderDeclaringFile:
    """Stands in for a soundfile.SoundFile whose header under-declares its length."""

    samplerate, channels, frames, format, subtype = 1000, 1, 10, "WAV", "PCM_16"

    def __init__(self, total: int) -> None:
        self.left = total

    def read(self, frames: int, dtype: str, always_2d: bool) -> np.ndarray:
        n = max(0, min(frames, self.left))
        self.left -= n
        return np.zeros((n, 1), np.float32)


def test_sndfile_guard_stops_past_the_limit() -> None:
    limits = MediaLimits(max_audio_seconds=5.0)
    ok = read_sndfile(_UnderDeclaringFile(4000), limits, 10**6)  # type: ignore[arg-type]
    assert ok.samples.shape == (4000, 1)
    with pytest.raises(MediaTooLongError):
        read_sndfile(_UnderDeclaringFile(10**9), limits, 10**6)  # type: ignore[arg-type]


def test_error_to_dict(audio_dir: Path) -> None:
    with pytest.raises(MediaError) as e:
        Audio.from_path(audio_dir / "tone_16k_mono.wav", MediaLimits(max_audio_seconds=1.0))
    d = e.value.to_dict()
    assert d["code"] == "too_long" and d["kind"] == "audio" and d["limit"] == 1.0 and d["actual"] == 2.0


# ----------------------------------------------------------------------------- hostile


def _decode_measured(raw: bytes) -> tuple[Audio | MediaError, float, int]:
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        out: Audio | MediaError = Audio.from_bytes(raw)
    except MediaError as e:
        out = e
    finally:
        elapsed = time.perf_counter() - t0
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    return out, elapsed, peak


@pytest.mark.parametrize("name", sorted(fa.HOSTILE))
def test_hostile_audio(hostile_dir: Path, name: str) -> None:
    raw = (hostile_dir / name).read_bytes()
    out, elapsed, peak = _decode_measured(raw)
    assert isinstance(out, MediaError), f"{name} decoded: {out!r}"
    assert out.code == fa.HOSTILE[name], out.message
    assert out.kind == "audio" and out.message
    assert elapsed < 2.0
    assert peak < 4 * len(raw) + 16 * 2**20  # never the size a header claims


def test_lying_and_truncated_wav_messages(hostile_dir: Path) -> None:
    with pytest.raises(CorruptMediaError) as e:
        Audio.from_path(hostile_dir / "audio_lying_sizes.wav")
    assert (e.value.limit, e.value.actual) == (640000, 64000)
    with pytest.raises(MediaTooLongError) as e:
        Audio.from_path(hostile_dir / "audio_declares_hours.wav")
    assert e.value.actual == pytest.approx(0xFFFFFFF0 / 8000, rel=1e-6) and e.value.limit == 600.0
    with pytest.raises(MediaTooLongError):
        Audio.from_path(hostile_dir / "audio_declares_hours.flac")


@pytest.mark.parametrize("name", sorted(fa.LENIENT))
def test_lenient_damage_decodes_what_is_there(hostile_dir: Path, name: str) -> None:
    raw = (hostile_dir / name).read_bytes()
    out, elapsed, peak = _decode_measured(raw)
    assert isinstance(out, Audio), out
    assert out.duration == pytest.approx(fa.LENIENT[name], abs=0.1)
    assert elapsed < 2.0 and peak < 32 * 2**20


@pytest.mark.parametrize(
    ("name", "error"),
    [
        ("zero_bytes.bin", EmptyMediaError),
        ("random_bytes.bin", UnsupportedFormatError),
        ("text_file.txt", UnsupportedFormatError),
        ("image.svg", UnsupportedFormatError),
        ("wrong_magic_png.png", UnsupportedFormatError),
        ("wrong_magic_wav.wav", CorruptMediaError),
    ],
)
def test_kind_agnostic_hostile(hostile_dir: Path, name: str, error: type[MediaError]) -> None:
    raw = (hostile_dir / name).read_bytes()
    for decode in (Audio.from_bytes, Audio.from_container_bytes):
        with pytest.raises(MediaError) as e:
            decode(raw)
        assert e.value.kind == "audio"
    with pytest.raises(error):
        Audio.from_bytes(raw)


@pytest.mark.parametrize("data", [None, "RIFF....WAVE", 123, [1, 2, 3]])
def test_non_bytes_input(data: object) -> None:
    with pytest.raises(InvalidRequestError):
        Audio.from_bytes(data)  # type: ignore[arg-type]


def test_images_are_unsupported(samples: Path) -> None:
    images = sorted((samples / "images").glob("*"))[:8]
    for path in images:
        with pytest.raises(MediaError):
            Audio.from_path(path)


# ----------------------------------------------------------------------------- properties

FUZZ_SOURCES = [
    "tone_16k_mono.wav",
    "tone_16k_mono_float.wav",
    "tone_44k1_stereo.aiff",
    "tone_44k1_stereo.flac",
    "tone_16k_mono_unknown_length.flac",
    "tone_44k1_stereo.ogg",
    "tone_48k_stereo.opus",
    "tone_44k1_stereo.mp3",
    "tone_44k1_stereo.m4a",
    "tone_48k_stereo.webm",
    "tone_48k_stereo_with_video.mp4",
]

FUZZ = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module")
def fuzz_sources(audio_dir: Path) -> dict[str, bytes]:
    return {name: (audio_dir / name).read_bytes() for name in FUZZ_SOURCES}


def _only_media_errors(raw: bytes, *, container: bool = False) -> None:
    decode = Audio.from_container_bytes if container else Audio.from_bytes
    try:
        a = decode(raw)
    except MediaError as e:
        assert isinstance(e.message, str) and e.code
        return
    assert a.samples.dtype == np.float32 and a.samples.ndim == 2 and a.frames > 0
    assert 0 < a.channels <= DEFAULT_LIMITS.max_audio_channels
    assert 0 < a.sample_rate <= DEFAULT_LIMITS.max_sample_rate
    assert a.duration <= DEFAULT_LIMITS.max_audio_seconds
    assert np.isfinite(a.samples).all()


@FUZZ
@given(raw=st.binary(max_size=4096), container=st.booleans())
def test_random_bytes_only_media_errors(raw: bytes, container: bool) -> None:
    _only_media_errors(raw, container=container)


@FUZZ
@given(
    source=st.sampled_from(FUZZ_SOURCES),
    flips=st.lists(st.tuples(st.integers(0, 2**20), st.integers(0, 255)), max_size=12),
    in_header=st.booleans(),
    cut=st.one_of(st.none(), st.floats(0.0, 1.0)),
)
def test_mutated_samples_only_media_errors(
    fuzz_sources: dict[str, bytes],
    source: str,
    flips: list[tuple[int, int]],
    in_header: bool,
    cut: float | None,
) -> None:
    data = bytearray(fuzz_sources[source])
    span = min(len(data), 128) if in_header else len(data)
    for pos, value in flips:
        data[pos % span] = value
    if cut is not None:
        data = data[: int(len(data) * cut)]
    _only_media_errors(bytes(data))


@FUZZ
@given(
    magic=st.sampled_from(
        [
            b"RIFF\x24\x00\x00\x00WAVEfmt ",
            b"fLaC",
            b"OggS\x00\x02",
            b"ID3\x04\x00",
            b"\xff\xfb",
            b"\xff\xf1",
            b"\x00\x00\x00\x20ftypM4A ",
            b"\x1a\x45\xdf\xa3",
            b"FORM\x00\x00\x00\x00AIFF",
            b".snd",
            b"caff",
            b"RF64\xff\xff\xff\xffWAVE",
            b"#!AMR\n",
            b"FLV\x01",
        ]
    ),
    tail=st.binary(max_size=2048),
)
def test_magic_plus_garbage_only_media_errors(magic: bytes, tail: bytes) -> None:
    _only_media_errors(magic + tail)
