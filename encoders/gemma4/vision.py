"""Gemma-4 image and video preparation, value-for-value with the transformers reference.

Images (``Gemma4ImageProcessorPil``):

1. the target size is the largest (h, w), both multiples of ``pooling_kernel_size *
   patch_size`` = 48, keeping the aspect ratio, with at most ``max_soft_tokens * 9``
   16x16 patches (:func:`aspect_ratio_preserving_size`, the reference's rule including
   its special cases for extreme aspect ratios);
2. a Pillow resize to that size with the configured filter (bicubic) -- the same call on
   the same uint8 RGB pixels, so the same pixels. (Not split over threads: Pillow 13
   picks the order of its two separable passes by the sizes, so bands computed pass by
   pass would not reproduce it for every shape.)
3. ``uint8 -> float64 * rescale_factor -> float32`` (and the optional normalisation), done
   with a 256-entry lookup table that holds exactly those float32 values;
4. 16x16 patches in (row, col, channel) order, position ids (x, y) per patch, both padded
   to ``max_soft_tokens * 9`` rows (pixels 0, positions -1).

Videos (``Gemma4VideoProcessor``, a torchvision processor; torchvision is not a
dependency, so it is reproduced): frame indices ``arange(num_frames) * total //
num_frames``; each frame resized with
``torchvision.transforms.v2.functional.resize(..., antialias=True)``, which for uint8
input on CPU is ``torch.nn.functional.interpolate(uint8, mode="bicubic",
antialias=True)`` (torch's native uint8 kernel; reproduced here without torchvision),
then the fused rescale/normalise ``x.float() / 255`` (the same float32 values as the image
path's table) and the same patch layout, padded to the per-frame budget (70 tokens).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from encoders.errors import UnsupportedModelError
from encoders.frame_resize import TORCH_MODES
from media import InvalidRequestError, check_int

__all__ = [
    "SUPPORTED_SOFT_TOKENS",
    "VisionSettings",
    "check_budget",
    "aspect_ratio_preserving_size",
    "patchify",
    "sample_frame_indices",
    "timestamp_text",
]

SUPPORTED_SOFT_TOKENS: tuple[int, ...] = (70, 140, 280, 560, 1120)
"""The soft-token budgets the Gemma-4 processors accept."""


def check_budget(value: Any, kind: str) -> int:
    """``max_soft_tokens`` validated against :data:`SUPPORTED_SOFT_TOKENS` (one error, with
    the supported values as its limit, for a wrong type and a wrong value alike)."""
    try:
        budget: int | None = check_int("max_soft_tokens", value, kind=kind)
    except InvalidRequestError:
        budget = None
    if budget not in SUPPORTED_SOFT_TOKENS:
        raise InvalidRequestError(
            f"max_soft_tokens must be one of {', '.join(map(str, SUPPORTED_SOFT_TOKENS))}, got {value!r}",
            limit=list(SUPPORTED_SOFT_TOKENS),
            actual=value if isinstance(value, (int, float, str)) else repr(value),
            kind=kind,
        )
    return budget


@dataclass(frozen=True)
class VisionSettings:
    """One Gemma-4 image or video processor config (``processor_config.json`` block)."""

    patch_size: int = 16
    pooling_kernel_size: int = 3
    max_soft_tokens: int = 280
    do_resize: bool = True
    resample: int = 3  # PIL.Image.Resampling.BICUBIC
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = False
    image_mean: tuple[float, float, float] = (0.0, 0.0, 0.0)
    image_std: tuple[float, float, float] = (1.0, 1.0, 1.0)
    # video only
    num_frames: int | None = None
    fps: float | None = None
    do_sample_frames: bool = True

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], *, video: bool) -> VisionSettings:
        defaults = cls(
            max_soft_tokens=70 if video else 280, num_frames=32 if video else None, do_normalize=video
        )

        def triple(key: str, default: tuple[float, float, float]) -> tuple[float, float, float]:
            v = cfg.get(key, default)
            if isinstance(v, (int, float)):
                v = [v] * 3
            if len(v) != 3:
                raise UnsupportedModelError(f"processor `{key}` must have 3 values (RGB), got {v!r}")
            return (float(v[0]), float(v[1]), float(v[2]))

        budget = cfg.get("max_soft_tokens", defaults.max_soft_tokens)
        if budget not in SUPPORTED_SOFT_TOKENS:
            raise UnsupportedModelError(
                f"processor max_soft_tokens {budget!r} is not one of {SUPPORTED_SOFT_TOKENS}"
            )
        resample = int(cfg.get("resample", 3))
        if video and resample not in TORCH_MODES:
            raise UnsupportedModelError(
                f"video processor resample={resample} has no torchvision equivalent here"
            )
        fps = cfg.get("fps")
        return cls(
            patch_size=int(cfg.get("patch_size", 16)),
            pooling_kernel_size=int(cfg.get("pooling_kernel_size", 3)),
            max_soft_tokens=int(budget),
            do_resize=bool(cfg.get("do_resize", True)),
            resample=resample,
            do_rescale=bool(cfg.get("do_rescale", True)),
            rescale_factor=float(cfg.get("rescale_factor", 1 / 255)),
            do_normalize=bool(cfg.get("do_normalize", defaults.do_normalize)),
            image_mean=triple("image_mean", defaults.image_mean),
            image_std=triple("image_std", defaults.image_std),
            num_frames=(int(cfg["num_frames"]) if cfg.get("num_frames") is not None else defaults.num_frames),
            fps=float(fps) if fps is not None else None,
            do_sample_frames=bool(cfg.get("do_sample_frames", True)),
        )

    @property
    def side_multiple(self) -> int:
        return self.patch_size * self.pooling_kernel_size

    def max_patches(self, max_soft_tokens: int) -> int:
        return max_soft_tokens * self.pooling_kernel_size**2

    def pixel_table(self, *, video: bool) -> np.ndarray:
        """(3, 256) float32: the processor's float value of each uint8 level per channel.

        Image (numpy): ``rescale`` is ``(x.astype(float64) * factor).astype(float32)``, then
        ``normalize`` is ``(x - mean) / std`` in float32. Video (torchvision): rescale and
        normalise are fused into ``(x.float() - mean / factor) / (std / factor)``, the
        factors formed in float32 tensors.
        """
        levels = np.arange(256)
        if video and self.do_rescale and self.do_normalize:
            inv = 1.0 / self.rescale_factor
            mean = (torch.tensor(self.image_mean) * inv).view(3, 1)
            std = (torch.tensor(self.image_std) * inv).view(3, 1)
            x = torch.arange(256, dtype=torch.float32).view(1, 256)
            return ((x - mean) / std).numpy().astype(np.float32)
        if video:
            x32 = torch.arange(256, dtype=torch.float32)
            if self.do_rescale:
                x32 = x32 * self.rescale_factor
            elif self.do_normalize:
                x32 = (x32.view(1, 256) - torch.tensor(self.image_mean).view(3, 1)) / torch.tensor(
                    self.image_std
                ).view(3, 1)
            return np.broadcast_to(x32.numpy().astype(np.float32), (3, 256)).copy()
        x = levels.astype(np.float64) * self.rescale_factor if self.do_rescale else levels
        x = np.asarray(x).astype(np.float32)
        table = np.broadcast_to(x, (3, 256)).copy()
        if self.do_normalize:
            mean = np.array(self.image_mean, dtype=np.float32).reshape(3, 1)
            std = np.array(self.image_std, dtype=np.float32).reshape(3, 1)
            table = ((table - mean) / std).astype(np.float32)
        return table


def aspect_ratio_preserving_size(
    height: int, width: int, patch_size: int, max_patches: int, pooling_kernel_size: int
) -> tuple[int, int]:
    """(target_height, target_width): the reference's ``get_aspect_ratio_preserving_size``.

    The largest size with both sides multiples of ``pooling_kernel_size * patch_size`` and at
    most ``max_patches`` patches, keeping the aspect ratio; a side that would round to zero
    becomes one unit and the other side ``floor(ratio)`` units, capped at the budget.
    """
    total_px = height * width
    target_px = max_patches * (patch_size**2)
    factor = math.sqrt(target_px / total_px)
    ideal_height = factor * height
    ideal_width = factor * width
    side = pooling_kernel_size * patch_size
    target_height = int(math.floor(ideal_height / side)) * side
    target_width = int(math.floor(ideal_width / side)) * side
    if target_height == 0 and target_width == 0:  # impossible for the supported budgets
        raise InvalidRequestError(f"a {width}x{height} image cannot be resized to a non-empty patch grid")
    max_side = (max_patches // pooling_kernel_size**2) * side
    if target_height == 0:
        target_height = side
        target_width = min(int(math.floor(width / height)) * side, max_side)
    elif target_width == 0:
        target_width = side
        target_height = min(int(math.floor(height / width)) * side, max_side)
    if target_height * target_width > target_px:  # cannot happen: kept as the reference checks it
        raise InvalidRequestError(
            f"resizing {width}x{height} to {target_width}x{target_height} exceeds {max_patches} patches"
        )
    return target_height, target_width


# --------------------------------------------------------------------------- patches


def patchify(
    pixels: np.ndarray, patch_size: int, table: np.ndarray, max_patches: int
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """uint8 ``pixels`` (N, H, W, 3) -> (pixel values (N, max_patches, 3 * p * p) float32,
    position ids (N, max_patches, 2) int64, real patches per frame).

    Patch vectors are (row, col, channel) within the patch, patches in row-major order
    over the grid, positions (x, y) = (col, row); rows past the real patches hold zeros
    and (-1, -1) -- the layout of the reference's ``convert_image_to_patches`` +
    ``pad_along_first_dim``. The float values come from ``table`` (see
    :meth:`VisionSettings.pixel_table`), which is exactly what the reference computes.
    """
    n, h, w, c = pixels.shape
    p = patch_size
    ph, pw = h // p, w // p
    real = ph * pw
    if real > max_patches:
        raise InvalidRequestError(f"{real} patches exceed the budget of {max_patches}")
    values = torch.empty((n, max_patches, c * p * p), dtype=torch.float32)
    dst = values.numpy()
    dst[:, real:] = 0.0
    same = bool((table == table[:1]).all())  # one table for all channels unless normalising per channel
    channel_offset = None if same else np.arange(p * p * c) % c * 256
    for f in range(n):  # frame by frame: each destination block is contiguous
        grid = pixels[f].reshape(ph, p, pw, p, c).transpose(0, 2, 1, 3, 4).reshape(real, p * p * c)
        if channel_offset is None:
            np.take(table[0], grid, out=dst[f, :real], mode="clip")  # uint8 indices are always in range
        else:
            np.take(table.reshape(-1), grid.astype(np.intp) + channel_offset, out=dst[f, :real], mode="clip")
    positions = torch.full((n, max_patches, 2), -1, dtype=torch.long)
    ys, xs = np.divmod(np.arange(real), pw)
    positions[:, :real, 0] = torch.from_numpy(xs)
    positions[:, :real, 1] = torch.from_numpy(ys)
    return values, positions, real


# --------------------------------------------------------------------------- video timing


def sample_frame_indices(
    total: int, num_frames: int | None, fps: float | None, video_fps: float
) -> list[int]:
    """The reference's ``default_sample_indices_fn``: ``num_frames`` frames at
    ``arange(num_frames) * total // num_frames`` (or, given ``fps``, ``max(1,
    int(total / video_fps * fps))`` of them; with neither, every frame).

    Where the reference raises (more frames asked than the clip has), every frame is
    taken instead: a 20-frame GIF gives 20 frames rather than an error.
    """
    if num_frames is None and fps is not None:
        if not video_fps or video_fps <= 0:
            raise InvalidRequestError(
                "the video's frame rate is unknown; sample by num_frames instead", kind="video"
            )
        num_frames = max(1, int(total / video_fps * fps))
    if num_frames is None:
        return list(range(total))
    num_frames = min(num_frames, total)
    return [int(i) for i in np.arange(num_frames, dtype=int) * total // num_frames]


def timestamp_text(seconds: float) -> str:
    """``mm:ss`` as ``Gemma4Processor.replace_video_token`` writes it."""
    return f"{int(seconds // 60):02d}:{int(seconds % 60):02d}"
