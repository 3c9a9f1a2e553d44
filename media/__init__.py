"""media: model-agnostic Image / Audio / Video decoded from bytes, validated against
limits and content-hashed. Knows nothing about models."""

from media.audio import Audio
from media.audio_split import split_audio
from media.cache_scope import cache_scope, set_cache_scope, use_cache_scope
from media.data_url import decode_data_url
from media.detect import open_media
from media.errors import (
    CorruptMediaError,
    EmptyMediaError,
    InvalidRequestError,
    MediaError,
    MediaTooLargeError,
    MediaTooLongError,
    PieMediaError,
    UnsupportedFormatError,
)
from media.hashing import content_hash
from media.image import Image
from media.kernels import warm as warm_kernels
from media.limits import DEFAULT_LIMITS, MediaLimits
from media.timeline import DecodePlan, Timeline
from media.validation import check_int, check_number
from media.video import SampledFrames, SkippedFrame, Video
from media.video_info import VideoInfo

__all__ = [
    "cache_scope",
    "set_cache_scope",
    "use_cache_scope",
    "Audio",
    "CorruptMediaError",
    "DEFAULT_LIMITS",
    "DecodePlan",
    "EmptyMediaError",
    "Image",
    "InvalidRequestError",
    "MediaError",
    "MediaLimits",
    "MediaTooLargeError",
    "MediaTooLongError",
    "PieMediaError",
    "SampledFrames",
    "SkippedFrame",
    "Timeline",
    "UnsupportedFormatError",
    "Video",
    "VideoInfo",
    "check_int",
    "check_number",
    "content_hash",
    "decode_data_url",
    "open_media",
    "split_audio",
    "warm_kernels",
]
