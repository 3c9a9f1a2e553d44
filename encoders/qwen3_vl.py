"""Qwen3-VL: image and video preparation exactly as the transformers reference, and the
vision tower (transformers' own ``Qwen3VLVisionModel``) with DeepStack features.

Reference (transformers 5.23), read top to bottom:

* images: ``Qwen2VLImageProcessorPil`` configured by ``preprocessor_config.json``:
  RGB uint8 -> ``smart_resize`` to multiples of ``patch * merge`` within
  [min_pixels, max_pixels] -> PIL resize (bicubic) -> rescale (float64 ``x * 1/255``, cast
  to float32) -> normalise (float32 ``(x - mean) / std``) -> patches flattened in the
  merge order ``(h/m, w/m, m, m, C, T, p, p)``, the single frame repeated over the
  temporal patch. ``image_grid_thw`` = (1, h/p, w/p).
* videos: ``Qwen3VLVideoProcessor`` configured by ``video_preprocessor_config.json``
  (which needs torchvision and cannot run here, so every step is reproduced from its
  source): ``num_frames = int(total / video_fps * fps)`` clamped to
  [min_frames, max_frames] and the total, indices ``linspace(0, total-1, n).round()``,
  a ``smart_resize`` that also weighs the frame count, torchvision's uint8 bicubic
  antialiased resize (on CPU that is ``torch.nn.functional.interpolate`` on the uint8
  tensor), the fused rescale+normalise ``(x - 255*mean) / (255*std)`` in float32, the
  last frame repeated to fill the last temporal patch, and patches in the order
  ``(t, h/m, w/m, m, m, C, T, p, p)``.
* text: ``Qwen3VLProcessor`` expands the chat template's
  ``<|vision_start|><|image_pad|><|vision_end|>`` to ``token_count`` image pads, and a
  video's ``<|video_pad|>`` to, per temporal patch, ``"<{t:.1f} seconds>"`` +
  ``<|vision_start|>`` + pads + ``<|vision_end|>`` (inside the template's own start/end
  pair), with ``t`` the mean of the group's first and last ``index / video_fps``.
* positions: ``Qwen3VLModel.get_rope_index``: text rows advance by one; a vision group
  (a whole image, or one temporal patch of a video) placed at cursor ``s`` gets
  ``(s, s + row, s + col)`` and advances the cursor by ``max(h, w) / merge``.

Speed: the image path makes the same numbers as the reference in a fraction of its time
(see ``_ImagePixels``): one PIL resize, then patchify + rescale + normalise fused, in
cache-sized bands, straight into the output tensor. Every float is bit-identical to the
reference's (checked over all 256 input levels when the encoder is built, with a lookup
table as fallback).
"""

from __future__ import annotations

import math
import mmap
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image as PILImage

from encoders.base import MediaEncoder, model_fingerprint
from encoders.cache import EncoderCache
from encoders.checkpoint_files import load_tokenizer, read_json, weight_files
from encoders.errors import UnsupportedModelError
from encoders.frame_resize import TORCH_MODES, resize_frames_like_torchvision
from encoders.prepared import Encoded, MediaKind, Prepared
from media import Image, Video
from media.errors import InvalidRequestError

__all__ = [
    "AspectRatioError",
    "ImageSettings",
    "Qwen3VLEncoder",
    "TooFewFramesError",
    "VideoSettings",
    "image_smart_resize",
    "sample_frame_indices",
    "temporal_group_timestamps",
    "video_smart_resize",
]

FAMILY = "qwen3_vl"
MAX_ASPECT_RATIO = 200
"""The reference refuses images (and frames) whose long side is over 200x the short one."""

# ``Qwen3VLVideoProcessor`` class defaults, used for keys a video config leaves out.
_VIDEO_DEFAULTS: dict[str, Any] = {
    "size": {"shortest_edge": 128 * 32 * 32, "longest_edge": 32 * 32 * 768},
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "resample": 3,
    "do_resize": True,
    "do_rescale": True,
    "rescale_factor": 1 / 255,
    "do_normalize": True,
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "min_frames": 4,
    "max_frames": 768,
    "fps": 2,
    "num_frames": None,
    "do_sample_frames": True,
    "cap_pixels_per_frame": None,
    "max_video_tokens": 768,
}


class AspectRatioError(InvalidRequestError):
    """The image (or video frame) is too elongated for Qwen3-VL: its long side is over
    200 times its short side (the reference processor refuses it too)."""


class TooFewFramesError(InvalidRequestError):
    """A video yields fewer frames than one temporal patch (2) needs."""


# --------------------------------------------------------------------------- reference math


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


# --------------------------------------------------------------------------- settings


def _size_bounds(cfg: dict[str, Any], defaults: dict[str, int]) -> tuple[int, int]:
    """(min_pixels, max_pixels) as the reference reads them: ``size`` {shortest_edge,
    longest_edge}, overridden by top-level ``min_pixels`` / ``max_pixels``."""
    size = dict(cfg.get("size") or defaults)
    if cfg.get("min_pixels") is not None:
        size["shortest_edge"] = cfg["min_pixels"]
    if cfg.get("max_pixels") is not None:
        size["longest_edge"] = cfg["max_pixels"]
    lo, hi = size.get("shortest_edge"), size.get("longest_edge")
    if not lo or not hi:
        raise UnsupportedModelError(f"processor `size` must hold shortest_edge and longest_edge, got {size}")
    return int(lo), int(hi)


def _channels(value: Any, name: str) -> tuple[float, float, float]:
    vals = [float(value)] * 3 if isinstance(value, (int, float)) else [float(v) for v in value]
    if len(vals) != 3:
        raise UnsupportedModelError(f"processor `{name}` must have 3 values (RGB), got {value!r}")
    return vals[0], vals[1], vals[2]


@dataclass(frozen=True)
class ImageSettings:
    """What ``preprocessor_config.json`` says (Qwen2VLImageProcessor fields)."""

    patch_size: int = 16
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 65536
    max_pixels: int = 16777216
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    do_resize: bool = True
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    resample: int = 3

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> ImageSettings:
        lo, hi = _size_bounds(cfg, {"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 1280})
        return cls(
            patch_size=int(cfg.get("patch_size", 14)),
            temporal_patch_size=int(cfg.get("temporal_patch_size", 2)),
            merge_size=int(cfg.get("merge_size", 2)),
            min_pixels=lo,
            max_pixels=hi,
            image_mean=_channels(cfg.get("image_mean", [0.48145466, 0.4578275, 0.40821073]), "image_mean"),
            image_std=_channels(cfg.get("image_std", [0.26862954, 0.26130258, 0.27577711]), "image_std"),
            do_resize=bool(cfg.get("do_resize", True)),
            do_rescale=bool(cfg.get("do_rescale", True)),
            rescale_factor=float(cfg.get("rescale_factor", 1 / 255)),
            do_normalize=bool(cfg.get("do_normalize", True)),
            resample=int(cfg.get("resample", 3)),
        )


@dataclass(frozen=True)
class VideoSettings:
    """What ``video_preprocessor_config.json`` says (Qwen3VLVideoProcessor fields; its class
    defaults for anything left out)."""

    patch_size: int = 16
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 128 * 32 * 32
    max_pixels: int = 32 * 32 * 768
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    do_resize: bool = True
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    resample: int = 3
    fps: float | None = 2
    num_frames: int | None = None
    min_frames: int = 4
    max_frames: int = 768
    do_sample_frames: bool = True
    cap_pixels_per_frame: bool = False
    max_video_tokens: int = 768

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> VideoSettings:
        merged = {**_VIDEO_DEFAULTS, **{k: v for k, v in cfg.items() if v is not None or k == "fps"}}
        lo, hi = _size_bounds(merged, _VIDEO_DEFAULTS["size"])
        resample = int(merged["resample"])
        if resample not in TORCH_MODES:
            raise UnsupportedModelError(
                f"video resample {resample} is not supported (nearest, bilinear, bicubic)"
            )
        return cls(
            patch_size=int(merged["patch_size"]),
            temporal_patch_size=int(merged["temporal_patch_size"]),
            merge_size=int(merged["merge_size"]),
            min_pixels=lo,
            max_pixels=hi,
            image_mean=_channels(merged["image_mean"], "image_mean"),
            image_std=_channels(merged["image_std"], "image_std"),
            do_resize=bool(merged["do_resize"]),
            do_rescale=bool(merged["do_rescale"]),
            rescale_factor=float(merged["rescale_factor"]),
            do_normalize=bool(merged["do_normalize"]),
            resample=resample,
            fps=None if merged["fps"] is None else float(merged["fps"]),
            num_frames=None if merged["num_frames"] is None else int(merged["num_frames"]),
            min_frames=int(merged["min_frames"]),
            max_frames=int(merged["max_frames"]),
            do_sample_frames=bool(merged["do_sample_frames"]),
            cap_pixels_per_frame=bool(merged["cap_pixels_per_frame"]),
            max_video_tokens=int(merged["max_video_tokens"]),
        )


@dataclass(frozen=True)
class SpecialTokens:
    vision_start: int
    vision_end: int
    image_pad: int
    video_pad: int


# --------------------------------------------------------------------------- pixels


class _ImagePixels:
    """Rescale + normalise + patchify for images, bit-identical to the reference's
    float64-rescale / float32-normalise / numpy-patchify chain, without its passes over
    full-size float64 and float32 copies.

    The output of each uint8 level is a fixed float32 number; ``self.lut`` holds the
    reference's value for all 256 levels (computed with the reference's own numpy
    operations). Pixels are converted band by band (whole merge rows, about 2 MB of
    float32 at a time, so a band stays in cache) with float32 arithmetic that was
    checked against the table for every level and channel when this object was built;
    if the check fails (an unusual mean/std/rescale_factor), the table itself is used.

    The band loop uses numpy, single-threaded on purpose: hundreds of small intra-op
    parallel regions (torch/OpenMP) stall badly when the cores are shared with other
    work, and the work is bound by memory traffic anyway.
    """

    def __init__(self, s: ImageSettings):
        self.s = s
        levels = np.arange(256, dtype=np.uint8)
        lut = np.empty((3, 256), dtype=np.float32)
        for c in range(3):
            x: np.ndarray = levels
            if s.do_rescale:  # image_transforms.rescale: float64 product, cast to float32
                x = (x.astype(np.float64) * s.rescale_factor).astype(np.float32)
            if s.do_normalize:  # image_transforms.normalize: float32 (x - mean) / std
                x = x.astype(np.float32)
                x = (x - np.array(s.image_mean[c], dtype=np.float32)) / np.array(
                    s.image_std[c], dtype=np.float32
                )
            lut[c] = np.asarray(x, dtype=np.float32)
        self.lut = lut
        self._divisor = np.float32(1.0 / s.rescale_factor) if s.do_rescale else None
        # Channel-uniform mean/std (Qwen3-VL: 0.5) are scalars and the arithmetic runs on the
        # band as decoded (channels last); otherwise it runs after the merge-order transpose,
        # where each channel is a contiguous p*p block (numpy broadcasting over a last axis of
        # 3 is slow).
        self.uniform = len(set(s.image_mean)) == 1 and len(set(s.image_std)) == 1
        if self.uniform:
            self._mean: np.ndarray = np.array(s.image_mean[0], dtype=np.float32)
            self._std: np.ndarray = np.array(s.image_std[0], dtype=np.float32)
        else:
            self._mean = np.array(s.image_mean, dtype=np.float32).reshape(3, 1, 1)
            self._std = np.array(s.image_std, dtype=np.float32).reshape(3, 1, 1)
        probe = np.repeat(np.arange(256, dtype=np.float32)[None, :, None], 3, axis=0)  # (channel, level, 1)
        self.arithmetic_exact = bool(np.array_equal(self._arith(probe).reshape(3, 256), lut))

    def _arith(self, x: np.ndarray) -> np.ndarray:
        """In place on float32 ``x`` (channels on axis -3 unless mean/std are uniform)."""
        if self._divisor is not None:
            np.divide(x, self._divisor, out=x)
        if self.s.do_normalize:
            np.subtract(x, self._mean, out=x)
            np.divide(x, self._std, out=x)
        return x

    def __call__(self, source: np.ndarray | PILImage.Image) -> torch.Tensor:
        """RGB pixels (an (H, W, 3) uint8 array or a mode-RGB PIL image), H and W multiples
        of patch * merge -> (patches, 3 * T * p * p) float32."""
        s = self.s
        p, m, t = s.patch_size, s.merge_size, s.temporal_patch_size
        if isinstance(source, np.ndarray):
            h, w = int(source.shape[0]), int(source.shape[1])
        else:
            w, h = source.size
        bh, bw = h // (p * m), w // (p * m)
        out_t = _alloc_float32((bh, bw, m, m, 3, t, p, p))
        out = out_t.numpy()
        rows = max(1, (2 << 20) // (m * p * w * 3 * 4))
        lut = self.lut.reshape(-1)
        offsets = (np.arange(3) * 256).reshape(3, 1, 1)
        for r0 in range(0, bh, rows):
            r1 = min(bh, r0 + rows)
            y0, y1 = r0 * m * p, r1 * m * p
            if isinstance(source, np.ndarray):
                band = source[y0:y1]
            else:  # a band at a time: no full-size uint8 copy of the resized image
                band = np.frombuffer(source.crop((0, y0, w, y1)).tobytes(), dtype=np.uint8).reshape(
                    y1 - y0, w, 3
                )
            # (rows, m, p, bw, m, p, C) -> (rows, bw, m, m, C, p, p): the reference's merge order
            order = (0, 3, 1, 4, 6, 2, 5)
            split = (r1 - r0, m, p, bw, m, p, 3)
            if not self.arithmetic_exact:
                x = lut[band.reshape(split).transpose(order) + offsets]
            elif self.uniform:
                x = self._arith(band.astype(np.float32))
                x = np.ascontiguousarray(x.reshape(split).transpose(order))
            else:
                x = np.ascontiguousarray(band.reshape(split).transpose(order)).astype(np.float32)
                self._arith(x)
            dst = out[r0:r1]
            for k in range(t):  # the one frame fills every temporal slot
                dst[:, :, :, :, :, k] = x
        return out_t.view(bh * bw * m * m, 3 * t * p * p)


_HUGE_PAGE_MIN_BYTES = 8 << 20


def _alloc_float32(shape: tuple[int, ...]) -> torch.Tensor:
    """An uninitialised float32 CPU tensor. Large ones (a 12 MP photo makes 290 MB of
    pixel values) come from anonymous memory advised for transparent huge pages: in a VM,
    first-touch faults on 4 KB pages cost more than all the arithmetic that fills them
    (measured here: 170 ms to fill 290 MB of fresh ``torch.empty``, 40 ms with huge
    pages). The tensor keeps the mapping alive and unmaps it when freed."""
    n = math.prod(shape)
    nbytes = n * 4
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if nbytes < _HUGE_PAGE_MIN_BYTES or advice is None:
        return torch.empty(shape, dtype=torch.float32)
    try:
        buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        buf.madvise(advice)
    except (OSError, ValueError, AttributeError):
        return torch.empty(shape, dtype=torch.float32)
    return torch.frombuffer(buf, dtype=torch.float32, count=n).view(shape)


def _video_pixels(frames: torch.Tensor, s: VideoSettings) -> torch.Tensor:
    """(N, C, H, W) uint8 resized frames (any memory layout) -> (t * h * w patches,
    C*T*p*p) float32, bit-identical to ``Qwen3VLVideoProcessor._preprocess`` (fused
    rescale+normalise in float32, then patchify; the last temporal group padded with
    copies of the last frame).

    The reference converts the whole clip to float32, normalises it in place and then
    copies it into merge order: three passes over hundreds of MB (16 frames of 720p make
    170 MB of float32). Here each temporal group is converted, normalised and scattered
    into merge order one band of merge rows at a time (about 2 MB, so it stays in cache),
    with the same float32 operations per element, straight into the output. numpy,
    single-threaded on purpose (see ``_ImagePixels``)."""
    n, c, h, w = frames.shape
    p, m, t = s.patch_size, s.merge_size, s.temporal_patch_size
    gt, gh, gw = -(-n // t), h // p, w // p
    bh, bw = gh // m, gw // m
    order = list(range(n)) + [n - 1] * (gt * t - n)
    if s.do_rescale and s.do_normalize:  # TorchvisionBackend._fuse_mean_std_and_rescale_factor
        sub = (torch.tensor(s.image_mean) * (1.0 / s.rescale_factor)).numpy()
        div = (torch.tensor(s.image_std) * (1.0 / s.rescale_factor)).numpy()
        mul = None
    elif s.do_normalize:
        sub = torch.tensor(s.image_mean).numpy()
        div = torch.tensor(s.image_std).numpy()
        mul = None
    else:
        sub = div = None
        mul = np.float32(s.rescale_factor) if s.do_rescale else None
    if sub is not None:
        sub, div = sub.reshape(1, c, 1, 1), div.reshape(1, c, 1, 1)  # type: ignore[union-attr]
    src = frames.numpy()  # a view; the layout only changes the read pattern
    out_t = _alloc_float32((gt, bh, bw, m, m, c, t, p, p))
    out = out_t.numpy()
    rows = max(1, (2 << 20) // (t * c * m * p * w * 4))  # merge rows per band
    x_buf = np.empty((t, c, rows * m * p, w), dtype=np.float32)
    for g in range(gt):
        group = order[g * t : (g + 1) * t]
        for r0 in range(0, bh, rows):
            r1 = min(bh, r0 + rows)
            y0, y1 = r0 * m * p, r1 * m * p
            x = x_buf[:, :, : y1 - y0]
            for k, f in enumerate(group):
                x[k] = src[f, :, y0:y1]  # uint8 -> float32, exact
            if sub is not None:
                np.subtract(x, sub, out=x)
                np.divide(x, div, out=x)
            elif mul is not None:
                np.multiply(x, mul, out=x)
            # (t, c, rows, m, p, bw, m, p) -> (rows, bw, m, m, c, t, p, p): the merge order
            out[g, r0:r1] = x.reshape(t, c, r1 - r0, m, p, bw, m, p).transpose(2, 5, 3, 6, 1, 0, 4, 7)
    return out_t.view(gt * gh * gw, c * t * p * p)


# --------------------------------------------------------------------------- positions


def _vision_group_positions(start: int, gh: int, gw: int) -> torch.Tensor:
    """Positions of one vision group (t = 1) at cursor ``start``:
    ``Qwen3VLModel.get_vision_position_ids`` with merged-grid ``gh`` x ``gw``."""
    rows = torch.arange(gh).view(gh, 1).expand(gh, gw).reshape(-1)
    cols = torch.arange(gw).view(1, gw).expand(gh, gw).reshape(-1)
    return torch.stack((torch.zeros_like(rows), rows, cols)) + start


def _text_positions(start: int, n: int) -> torch.Tensor:
    return (torch.arange(n) + start).view(1, n).expand(3, n)


# --------------------------------------------------------------------------- encoder


class Qwen3VLEncoder(MediaEncoder):
    """Preparation and vision tower of a ``Qwen3VLForConditionalGeneration`` checkpoint.

    ``prepare(Image | Video, **params)`` -> :class:`~encoders.prepared.Prepared`;
    ``encode([Prepared, ...])`` -> :class:`~encoders.prepared.Encoded` with the merged
    embeddings and one DeepStack feature tensor per ``deepstack_visual_indexes`` entry.

    Parameters accepted by ``prepare``: images ``min_pixels``, ``max_pixels``; videos
    ``fps`` or ``num_frames``, ``min_frames``, ``max_frames``, ``min_pixels``,
    ``max_pixels`` (the same names as the reference processor's call arguments; they
    override the processor config for that call and are part of the cache key).
    """

    family = FAMILY
    kinds = frozenset({"image", "video"})

    def __init__(
        self,
        *,
        name: str,
        fingerprint: str,
        cache: EncoderCache | None,
        config: dict[str, Any],
        image: ImageSettings,
        video: VideoSettings,
        tokens: SpecialTokens,
        tokenizer: Any,
        model_dir: Path | None,
        tower: torch.nn.Module | None,
        device: str | torch.device,
        dtype: torch.dtype,
    ):
        super().__init__(name=name, fingerprint=fingerprint, cache=cache)
        self.config = config
        self.image_settings = image
        self.video_settings = video
        self.tokens = tokens
        self.tokenizer = tokenizer
        self.model_dir = model_dir
        self.device = torch.device(device)
        self.dtype = dtype
        self._tower = tower
        self._tower_lock = threading.Lock()
        self._image_pixels = _ImagePixels(image)
        self._timestamp_ids: dict[str, tuple[int, ...]] = {}
        vision = config.get("vision_config") or {}
        self.deepstack_layers = tuple(vision.get("deepstack_visual_indexes") or ())

    # -- construction -------------------------------------------------------------------
    @classmethod
    def from_config(
        cls,
        model_dir: str | Path | None,
        config: dict[str, Any],
        *,
        cache: EncoderCache | None = None,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        tower: torch.nn.Module | None = None,
        load_weights: bool = True,
    ) -> Qwen3VLEncoder:
        """Read the processor configs and tokenizer from ``model_dir``; build the tower.

        ``tower``: the engine's already-loaded ``model.model.visual`` (its device and dtype
        win); otherwise a ``Qwen3VLVisionModel`` is built from ``config["vision_config"]``
        and only the vision weights are read from the checkpoint. ``load_weights=False``
        defers that until the first ``encode`` (prepare-only users never pay for it).
        """
        if model_dir is None:
            raise UnsupportedModelError(
                "Qwen3-VL needs its checkpoint directory (processor configs, tokenizer)"
            )
        model_dir = Path(model_dir)
        image_cfg, video_cfg = _read_processor_configs(model_dir)
        image = ImageSettings.from_dict(image_cfg)
        video = VideoSettings.from_dict(video_cfg if video_cfg is not None else {})
        vision = config.get("vision_config") or {}
        for what, s in (("image", image), ("video", video)):
            expected = (
                vision.get("patch_size", s.patch_size),
                vision.get("temporal_patch_size", s.temporal_patch_size),
                vision.get("spatial_merge_size", s.merge_size),
            )
            if (s.patch_size, s.temporal_patch_size, s.merge_size) != expected:
                raise UnsupportedModelError(
                    f"{what} processor patch/temporal/merge sizes "
                    f"{(s.patch_size, s.temporal_patch_size, s.merge_size)} disagree with the vision config {expected}"
                )
        tokenizer = load_tokenizer(model_dir)
        tokens = _special_tokens(config, tokenizer)
        if tower is not None:
            param = next(tower.parameters(), None)
            if param is not None:
                device, dtype = param.device, param.dtype
        enc = cls(
            name=model_dir.name,
            fingerprint=model_fingerprint(model_dir, config),
            cache=cache,
            config=config,
            image=image,
            video=video,
            tokens=tokens,
            tokenizer=tokenizer,
            model_dir=model_dir,
            tower=tower,
            device=device,
            dtype=dtype,
        )
        if tower is None and load_weights:
            enc.tower  # noqa: B018 - load now
        return enc

    @property
    def tower(self) -> torch.nn.Module:
        """The vision model (built and loaded on first use when deferred)."""
        if self._tower is None:
            with self._tower_lock:
                if self._tower is None:
                    self._tower = _build_tower(self.model_dir, self.config, self.device, self.dtype)
        return self._tower

    # -- planning -----------------------------------------------------------------------
    def image_size_for(self, width: int, height: int, **params: Any) -> tuple[int, int]:
        """(resized_width, resized_height) of an image of this size, no pixels needed."""
        s = self.image_settings
        lo, hi = self._pixel_bounds(params, s.min_pixels, s.max_pixels, "image")
        if not s.do_resize:
            return width, height
        h, w = image_smart_resize(height, width, s.patch_size * s.merge_size, lo, hi)
        return w, h

    def image_grid(self, width: int, height: int, **params: Any) -> tuple[int, int, int]:
        """``grid`` (t, h, w in merged tokens) a ``width`` x ``height`` image gets."""
        w, h = self.image_size_for(width, height, **params)
        unit = self.image_settings.patch_size * self.image_settings.merge_size
        return 1, h // unit, w // unit

    # -- prepare ------------------------------------------------------------------------
    def _prepare(self, kind: MediaKind, media: Any, cache_key: str, **params: Any) -> Prepared:
        if kind == "image":
            return self._prepare_image(media, cache_key, params)
        return self._prepare_video(media, cache_key, params)

    @staticmethod
    def _pixel_bounds(params: dict[str, Any], lo: int, hi: int, kind: str) -> tuple[int, int]:
        for key in ("min_pixels", "max_pixels"):
            _positive(params, key, integer=True, kind=kind)
        # No ordering check: with max < min the reference's smart_resize takes the
        # "too large" branch first, and so do we.
        return params.get("min_pixels") or lo, params.get("max_pixels") or hi

    def _prepare_image(self, image: Image, cache_key: str, params: dict[str, Any]) -> Prepared:
        self._check_params(params, {"min_pixels", "max_pixels"}, "image")
        s = self.image_settings
        rw, rh = self.image_size_for(image.width, image.height, **params)
        source: np.ndarray | PILImage.Image
        if (rw, rh) != (image.width, image.height):
            source = image.to_pil().resize((rw, rh), resample=PILImage.Resampling(s.resample))
        else:
            source = image.to_numpy()
        pixel_values = self._image_pixels(source)
        gh, gw = rh // s.patch_size, rw // s.patch_size
        grid_thw = torch.tensor([[1, gh, gw]], dtype=torch.long)
        m = s.merge_size
        n = gh * gw // (m * m)
        t = self.tokens
        input_ids = (t.vision_start, *([t.image_pad] * n), t.vision_end)
        mh, mw = gh // m, gw // m
        positions = torch.cat(
            (_text_positions(0, 1), _vision_group_positions(1, mh, mw), _text_positions(1 + max(mh, mw), 1)),
            dim=1,
        )
        return Prepared(
            kind="image",
            family=FAMILY,
            input_ids=input_ids,
            placeholder_id=t.image_pad,
            token_count=n,
            grid=(1, mh, mw),
            positions=positions.contiguous(),
            position_span=2 + max(mh, mw),
            prefix_tokens=(t.vision_start,),
            suffix_tokens=(t.vision_end,),
            inputs={"pixel_values": pixel_values, "image_grid_thw": grid_thw},
            content_hash=image.content_hash,
            cache_key=cache_key,
            mm_token_type=(0, *([1] * n), 0),
            meta={
                "source_size": [image.width, image.height],
                "resized_size": [rw, rh],
                "patches": gh * gw,
                "params": dict(params),
            },
        )

    def _prepare_video(self, video: Video, cache_key: str, params: dict[str, Any]) -> Prepared:
        allowed = {"fps", "num_frames", "min_frames", "max_frames", "min_pixels", "max_pixels"}
        self._check_params(params, allowed, "video")
        s = self.video_settings
        total = video.frame_count
        video_fps = video.fps if video.fps and video.fps > 0 else None
        if s.do_sample_frames:
            asked_fps = _positive(params, "fps", integer=False)
            asked_n = _positive(params, "num_frames", integer=True)
            if asked_fps is not None and asked_n is not None:
                raise InvalidRequestError("fps and num_frames are mutually exclusive", kind="video")
            if asked_n is not None:
                fps, num_frames = None, asked_n
            else:  # fps=None (or absent) means the configured rate, as in the reference
                fps, num_frames = asked_fps or s.fps, s.num_frames
                if fps is not None and num_frames is not None:
                    fps = None  # a configured frame count wins over the default rate
            indices = sample_frame_indices(
                total,
                video_fps,
                fps=fps,
                num_frames=num_frames,
                min_frames=_positive(params, "min_frames", integer=True) or s.min_frames,
                max_frames=_positive(params, "max_frames", integer=True) or s.max_frames,
            )
        else:
            indices = list(range(total))
        sampled = video.sample_indices(indices)
        kept = list(sampled.indices)  # frames a damaged file could not deliver are left out
        # (N, C, H, W) over the decoded (N, H, W, C) array, i.e. channels-last: torch's uint8
        # antialiased resize works in that layout anyway, so no transposing copy is made.
        frames = torch.from_numpy(np.ascontiguousarray(sampled.frames)).permute(0, 3, 1, 2)
        n_frames, _, height, width = frames.shape
        lo, hi = self._pixel_bounds(params, s.min_pixels, s.max_pixels, "video")
        factor = s.patch_size * s.merge_size
        if s.cap_pixels_per_frame:
            frame_cap = s.max_video_tokens * factor * factor
            hi = max(min(frame_cap, hi // n_frames), int(lo * 1.05)) * n_frames
        if n_frames < s.temporal_patch_size:
            raise TooFewFramesError(
                f"video gives {n_frames} frame(s); Qwen3-VL needs at least {s.temporal_patch_size}",
                limit=s.temporal_patch_size,
                actual=n_frames,
                kind="video",
            )
        if s.do_resize:
            rh, rw = video_smart_resize(n_frames, height, width, s.temporal_patch_size, factor, lo, hi)
            frames = resize_frames_like_torchvision(frames, rh, rw, s.resample)
        else:
            rh, rw = height, width
        pixel_values = _video_pixels(frames, s)
        gt = -(-n_frames // s.temporal_patch_size)
        gh, gw = rh // s.patch_size, rw // s.patch_size
        m = s.merge_size
        mh, mw = gh // m, gw // m
        per_frame = mh * mw
        stamps = temporal_group_timestamps(kept, video_fps or 24, s.temporal_patch_size)

        t = self.tokens
        ids: list[int] = [t.vision_start]
        types: list[int] = [0]
        pos: list[torch.Tensor] = [_text_positions(0, 1)]
        cursor = 1
        for stamp in stamps:
            text = self._timestamp_tokens(stamp)
            head = (*text, t.vision_start)
            ids.extend(head)
            types.extend([0] * len(head))
            pos.append(_text_positions(cursor, len(head)))
            cursor += len(head)
            ids.extend([t.video_pad] * per_frame)
            types.extend([2] * per_frame)
            pos.append(_vision_group_positions(cursor, mh, mw))
            cursor += max(mh, mw)
            ids.append(t.vision_end)
            types.append(0)
            pos.append(_text_positions(cursor, 1))
            cursor += 1
        ids.append(t.vision_end)
        types.append(0)
        pos.append(_text_positions(cursor, 1))
        cursor += 1
        return Prepared(
            kind="video",
            family=FAMILY,
            input_ids=tuple(ids),
            placeholder_id=t.video_pad,
            token_count=gt * per_frame,
            grid=(gt, mh, mw),
            positions=torch.cat(pos, dim=1).contiguous(),
            position_span=cursor,
            prefix_tokens=(t.vision_start,),
            suffix_tokens=(t.vision_end,),
            inputs={
                "pixel_values_videos": pixel_values,
                "video_grid_thw": torch.tensor([[gt, gh, gw]], dtype=torch.long),
            },
            content_hash=video.content_hash,
            cache_key=cache_key,
            mm_token_type=tuple(types),
            timestamps=tuple(stamps),
            meta={
                "frame_indices": kept,
                "skipped_frames": [f.index for f in sampled.skipped],
                "video_fps": video_fps,
                "total_frames": total,
                "source_size": [width, height],
                "resized_size": [rw, rh],
                "patches": gt * gh * gw,
                "params": dict(params),
            },
        )

    def _timestamp_tokens(self, seconds: float) -> tuple[int, ...]:
        """Ids of ``"<{seconds:.1f} seconds>"``. In the reference prompt this text always sits
        between two special tokens (a ``<|vision_start|>`` before and after), which the
        tokenizer splits on first, so it tokenizes the same on its own as in context."""
        text = f"<{seconds:.1f} seconds>"
        ids = self._timestamp_ids.get(text)
        if ids is None:
            ids = tuple(self.tokenizer.encode(text, add_special_tokens=False).ids)
            self._timestamp_ids[text] = ids
        return ids

    # -- encode -------------------------------------------------------------------------
    def _encode(self, kind: MediaKind, items: list[Prepared]) -> list[Encoded]:
        if kind == "image":
            key, grid_key = "pixel_values", "image_grid_thw"
        else:
            key, grid_key = "pixel_values_videos", "video_grid_thw"
        tower = self.tower
        pixels = torch.cat([p.inputs[key] for p in items]).to(device=self.device, dtype=self.dtype)
        grid = torch.cat([p.inputs[grid_key] for p in items]).to(self.device)
        out = tower(pixels, grid_thw=grid, return_dict=True)
        sizes = [p.token_count for p in items]
        merged = torch.split(out.pooler_output, sizes)
        deepstack = [torch.split(f, sizes) for f in (out.deepstack_features or ())]
        return [
            Encoded(embeddings=merged[i], deepstack=[layer[i] for layer in deepstack] if deepstack else None)
            for i in range(len(items))
        ]


def _positive(params: dict[str, Any], key: str, *, integer: bool, kind: str = "video") -> Any:
    """``params[key]`` when given: a positive finite number (an int where ``integer``)."""
    v = params.get(key)
    if v is None:
        return None
    ok = not isinstance(v, bool) and isinstance(v, (int, np.integer) if integer else (int, float))
    if not ok or not math.isfinite(v) or v <= 0:
        what = "a positive integer" if integer else "a positive number"
        raise InvalidRequestError(f"{key} must be {what}, got {v!r}", kind=kind)
    return int(v) if integer else v


# --------------------------------------------------------------------------- checkpoint files


def _read_processor_configs(model_dir: Path) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(image processor config, video processor config or None) from the files the
    reference's ``from_pretrained`` reads: ``preprocessor_config.json`` and
    ``video_preprocessor_config.json``, or the nested sections of ``processor_config.json``."""
    nested: dict[str, Any] = {}
    if (model_dir / "processor_config.json").is_file():
        nested = read_json(model_dir / "processor_config.json")
    if (model_dir / "preprocessor_config.json").is_file():
        image = read_json(model_dir / "preprocessor_config.json")
    elif isinstance(nested.get("image_processor"), dict):
        image = nested["image_processor"]
    else:
        raise UnsupportedModelError(
            f"{model_dir} has no preprocessor_config.json (the Qwen3-VL image processor)"
        )
    if (model_dir / "video_preprocessor_config.json").is_file():
        video: dict[str, Any] | None = read_json(model_dir / "video_preprocessor_config.json")
    elif isinstance(nested.get("video_processor"), dict):
        video = nested["video_processor"]
    else:
        video = None
    return image, video


def _tokenizer_from_file(path: str, mtime_ns: int, size: int) -> Any:
    """Parsing a real Qwen tokenizer.json takes ~0.5 s; encoders of one checkpoint share it
    (``tokenizers.Tokenizer.encode`` is safe to call from several threads)."""
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(path)
    except Exception as e:  # tokenizers raises its own Exception type
        raise UnsupportedModelError(f"cannot load {path}: {e}") from e


def _special_tokens(config: dict[str, Any], tokenizer: Any) -> SpecialTokens:
    names = {
        "vision_start": ("vision_start_token_id", "<|vision_start|>"),
        "vision_end": ("vision_end_token_id", "<|vision_end|>"),
        "image_pad": ("image_token_id", "<|image_pad|>"),
        "video_pad": ("video_token_id", "<|video_pad|>"),
    }
    ids: dict[str, int] = {}
    for field, (key, token) in names.items():
        from_config = config.get(key)
        from_tokenizer = tokenizer.token_to_id(token)
        if from_config is None and from_tokenizer is None:
            raise UnsupportedModelError(
                f"neither config.json ({key}) nor tokenizer.json ({token}) gives its id"
            )
        if from_config is not None and from_tokenizer is not None and int(from_config) != from_tokenizer:
            raise UnsupportedModelError(
                f"config.json {key}={from_config} disagrees with tokenizer.json {token}={from_tokenizer}"
            )
        ids[field] = int(from_config if from_config is not None else from_tokenizer)
    return SpecialTokens(**ids)


_VISUAL_PREFIXES = ("model.visual.", "visual.", "model.vision_tower.", "thinker.visual.")


def _build_tower(model_dir: Path | None, config: dict[str, Any], device: torch.device, dtype: torch.dtype):
    """transformers' ``Qwen3VLVisionModel`` for ``config["vision_config"]`` with only the
    vision weights read from the checkpoint's safetensors (sharded or not)."""
    from safetensors import safe_open
    from transformers import Qwen3VLConfig
    from transformers.initialization import no_init_weights
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

    if model_dir is None:
        raise UnsupportedModelError("no checkpoint directory to load the vision weights from")
    cfg = Qwen3VLConfig.from_dict({k: v for k, v in config.items() if not k.startswith("_")})
    files = weight_files(model_dir, _VISUAL_PREFIXES)
    state: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for key in st.keys():
                prefix = next((p for p in _VISUAL_PREFIXES if key.startswith(p)), None)
                if prefix is not None:
                    state[key[len(prefix) :]] = st.get_tensor(key)
    if not state:
        raise UnsupportedModelError(f"no vision weights (model.visual.*) in {model_dir}")
    with no_init_weights():
        tower = Qwen3VLVisionModel._from_config(cfg.vision_config, dtype=dtype)
    missing, unexpected = tower.load_state_dict(state, strict=False)
    missing = [k for k in missing if k not in dict(tower.named_buffers())]
    if missing or unexpected:
        raise UnsupportedModelError(
            f"vision weights in {model_dir} do not fit Qwen3VLVisionModel: "
            f"missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    return tower.to(device=device, dtype=dtype).eval()
