"""Qwen3-VL reference arithmetic, as the transformers processors compute it (no pixels):
the image and video ``smart_resize`` rules, frame sampling, and the timestamps printed
before each temporal patch.

The rope index (``Qwen3VLModel.get_rope_index``) is M-RoPE in :mod:`encoders.span`: text
rows advance by one; a vision group (a whole image, or one temporal patch of a video)
placed at cursor ``s`` gets ``(s, s + row, s + col)`` and advances the cursor by
``max(h, w) / merge``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from media import InvalidRequestError

__all__ = [
    "MAX_ASPECT_RATIO",
    "AspectRatioError",
    "TooFewFramesError",
    "image_smart_resize",
    "sample_frame_indices",
    "temporal_group_timestamps",
    "video_smart_resize",
]

MAX_ASPECT_RATIO = 200
"""The reference refuses images (and frames) whose long side is over 200x the short one."""


class AspectRatioError(InvalidRequestError):
    """The image (or video frame) is too elongated for Qwen3-VL: its long side is over
    200 times its short side (the reference processor refuses it too)."""


class TooFewFramesError(InvalidRequestError):
    """A video yields fewer frames than one temporal patch (2) needs."""


def image_smart_resize(
    height: int, width: int, factor: int, min_pixels: int, max_pixels: int
) -> tuple[int, int]:
    """(height, width) the reference resizes an image to: multiples of ``factor``, area within
    [min_pixels, max_pixels], aspect ratio kept as well as that allows. Same arithmetic as
    ``transformers.models.qwen2_vl.image_processing_pil_qwen2_vl.smart_resize`` (Python's
    ``round`` rounds half to even, as there)."""
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        ratio = max(height, width) / min(height, width)
        raise AspectRatioError(
            f"image is {width}x{height}: aspect ratio {ratio:.1f} is over Qwen3-VL's limit of {MAX_ASPECT_RATIO}",
            limit=MAX_ASPECT_RATIO,
            actual=round(ratio, 3),
            kind="image",
        )
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def video_smart_resize(
    num_frames: int,
    height: int,
    width: int,
    temporal_factor: int,
    factor: int,
    min_pixels: int,
    max_pixels: int,
) -> tuple[int, int]:
    """(height, width) the reference resizes every frame of a video to
    (``transformers.models.qwen3_vl.video_processing_qwen3_vl.smart_resize``): like the
    image rule, but the pixel budget covers all ``num_frames`` frames."""
    if num_frames < temporal_factor:
        raise TooFewFramesError(
            f"video gives {num_frames} frame(s); Qwen3-VL needs at least {temporal_factor} (one temporal patch)",
            limit=temporal_factor,
            actual=num_frames,
            kind="video",
        )
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height = int(height * scale)
        width = int(width * scale)
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        ratio = max(height, width) / min(height, width)
        raise AspectRatioError(
            f"video frames are {width}x{height}: aspect ratio {ratio:.1f} is over Qwen3-VL's limit of "
            f"{MAX_ASPECT_RATIO}",
            limit=MAX_ASPECT_RATIO,
            actual=round(ratio, 3),
            kind="video",
        )
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    t_bar = round(num_frames / temporal_factor) * temporal_factor
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt((num_frames * height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (num_frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def sample_frame_indices(
    total_frames: int,
    video_fps: float | None,
    *,
    fps: float | None = 2,
    num_frames: int | None = None,
    min_frames: int = 4,
    max_frames: int = 768,
) -> list[int]:
    """Frame indices ``Qwen3VLVideoProcessor.sample_frames`` picks: ``fps`` frames per second
    of video (``int(total / video_fps * fps)``, at least ``min_frames``, at most
    ``max_frames`` and the total), or exactly ``num_frames``, spread by
    ``linspace(0, total - 1, n).round()``. A missing ``video_fps`` counts as 24, as there."""
    if fps is not None and num_frames is not None:
        raise InvalidRequestError("`num_frames` and `fps` are mutually exclusive", kind="video")
    if total_frames <= 0:
        raise TooFewFramesError("video has no frames", limit=1, actual=total_frames, kind="video")
    if num_frames is None and fps is not None:
        rate = video_fps if video_fps else 24
        num_frames = int(total_frames / rate * fps)
        num_frames = min(max(num_frames, min_frames), max_frames, total_frames)
    if num_frames is None:
        num_frames = min(max(total_frames, min_frames), max_frames)
    return [int(i) for i in np.linspace(0, total_frames - 1, num_frames).round().astype(int)]


def temporal_group_timestamps(
    indices: Sequence[int], video_fps: float, temporal_patch_size: int
) -> list[float]:
    """Seconds the reference prints before each temporal patch
    (``Qwen3VLProcessor._calculate_timestamps``): ``index / video_fps`` per frame, the last
    index repeated to fill the last patch, then the mean of each patch's first and last."""
    idx = list(indices)
    if len(idx) % temporal_patch_size:
        idx.extend(idx[-1] for _ in range(temporal_patch_size - len(idx) % temporal_patch_size))
    seconds = [i / video_fps for i in idx]
    return [
        (seconds[i] + seconds[i + temporal_patch_size - 1]) / 2
        for i in range(0, len(seconds), temporal_patch_size)
    ]
