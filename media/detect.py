"""Which kind of media are these bytes? Try the decoders in an order the magic bytes
(:func:`media.sniff.sniff`) suggest; the first decoder that recognises the format
decides (its error included)."""

from __future__ import annotations

from media.audio import Audio
from media.errors import EmptyMediaError, MediaError, PieMediaError, UnsupportedFormatError
from media.image import Image
from media.limits import DEFAULT_LIMITS, MediaLimits
from media.sniff import sniff
from media.video import Video

Media = Image | Audio | Video

# Formats Pillow reads whose files may hold an animation (then they are videos).
_MAYBE_ANIMATED = {"GIF", "WEBP", "PNG"}


def open_media(data: bytes, limits: MediaLimits | None = None, kind: str | None = None) -> Media:
    """Decode ``data`` as an Image, Audio or Video (``kind`` forces one).

    Animated GIF/WebP/PNG become a Video; a still one an Image. When no decoder
    recognises the bytes the error is ``UnsupportedFormatError``; when one recognised
    the format but failed (corrupt, too large, ...), that decoder's error is raised.
    """
    limits = limits or DEFAULT_LIMITS
    if kind is not None:
        cls = {"image": Image, "audio": Audio, "video": Video}.get(kind)
        if cls is None:
            raise UnsupportedFormatError(f"unknown media kind {kind!r}; expected image, audio or video")
        return cls.from_bytes(data, limits)
    if not data:
        raise EmptyMediaError("no bytes: the input is empty")

    first_error: MediaError | None = None
    image: Image | None = None
    try:
        image = Image.from_bytes(data, limits)
    except UnsupportedFormatError as e:
        first_error = e
    if image is not None:
        if image.format in _MAYBE_ANIMATED:
            try:
                video = Video.from_bytes(data, limits)
                if video.info.frame_count > 1:
                    return video
            except MediaError:
                pass
        return image

    sniffed = sniff(data)
    # Audio formats that may also carry video (Ogg, M4A) are audio first.
    order = (Audio, Video) if sniffed is not None and sniffed.kind == "audio" else (Video, Audio)
    for cls in order:
        try:
            return cls.from_bytes(data, limits)
        except UnsupportedFormatError as e:
            first_error = first_error or e
        except PieMediaError:
            raise
    raise UnsupportedFormatError(
        "not a recognised image, audio or video format (tried Pillow, PyAV and libsndfile); "
        f"first bytes: {data[:16]!r}"
    )
