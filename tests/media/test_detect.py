from __future__ import annotations

import pytest

from media import Audio, Image, MediaError, Video
from media.detect import open_media

KINDS = [
    ("images/photo_640x480.jpg", Image),
    ("images/rgba.png", Image),
    ("images/lossy.webp", Image),
    ("video/animated_160x120_10fps_2s.gif", Video),
    ("video/animated_160x120_10fps_2s.webp", Video),
    ("video/h264_320x240_30fps_3s.mp4", Video),
    ("video/vp9_320x240_25fps_2s.webm", Video),
    ("audio/tone_16k_mono.wav", Audio),
    ("audio/tone_44k1_stereo.flac", Audio),
    ("audio/tone_44k1_stereo.mp3", Audio),
    ("audio/tone_44k1_stereo.m4a", Audio),
    ("audio/tone_48k_stereo.opus", Audio),
    ("audio/tone_48k_stereo_with_video.mp4", Video),
]


@pytest.mark.parametrize("rel,cls", KINDS)
def test_kind_is_detected(samples, rel, cls):
    media = open_media((samples / rel).read_bytes())
    assert isinstance(media, cls)


@pytest.mark.parametrize(
    "rel,code",
    [
        ("hostile/zero_bytes.bin", "empty"),
        ("hostile/text_file.txt", "unsupported_format"),
        ("hostile/image.svg", "unsupported_format"),
        ("hostile/random_bytes.bin", "unsupported_format"),
        ("hostile/image_truncated.jpg", "corrupt"),
        ("hostile/image_bomb_100000x100000.png", "too_large"),
        ("hostile/audio_truncated.wav", "corrupt"),
        ("hostile/audio_declares_hours.wav", "too_long"),
    ],
)
def test_owner_of_the_format_owns_the_error(samples, rel, code):
    with pytest.raises(MediaError) as ei:
        open_media((samples / rel).read_bytes())
    assert ei.value.code == code, ei.value


def test_forced_kind(samples):
    data = (samples / "video/animated_160x120_10fps_2s.gif").read_bytes()
    assert isinstance(open_media(data, kind="image"), Image)
    with pytest.raises(MediaError) as ei:
        open_media(data, kind="sound")
    assert ei.value.code == "unsupported_format"
