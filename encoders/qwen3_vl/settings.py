"""Qwen3-VL settings from the checkpoint: the image processor (``preprocessor_config.json``),
the video processor (``video_preprocessor_config.json``, or the nested blocks of
``processor_config.json``) and the vision special token ids."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from encoders.checkpoint_files import read_processor_files, special_token_id
from encoders.errors import UnsupportedModelError
from encoders.frame_resize import TORCH_MODES

__all__ = ["ImageSettings", "SpecialTokens", "VideoSettings", "read_settings", "special_tokens"]

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


def read_settings(model_dir: Path, config: dict[str, Any]) -> tuple[ImageSettings, VideoSettings]:
    """(image, video) settings from the files the reference's ``from_pretrained`` reads:
    ``preprocessor_config.json`` and ``video_preprocessor_config.json``, or the nested
    sections of ``processor_config.json`` (class defaults for a missing video config);
    their patch, temporal patch and merge sizes must match the vision config."""
    files = read_processor_files(model_dir)
    if files.preprocessor is not None:
        image_cfg = files.preprocessor
    elif isinstance(files.nested.get("image_processor"), dict):
        image_cfg = files.nested["image_processor"]
    else:
        raise UnsupportedModelError(
            f"{model_dir} has no preprocessor_config.json (the Qwen3-VL image processor)"
        )
    video_cfg = files.video_preprocessor
    if video_cfg is None and isinstance(files.nested.get("video_processor"), dict):
        video_cfg = files.nested["video_processor"]
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
    return image, video


def special_tokens(config: dict[str, Any], tokenizer: Any) -> SpecialTokens:
    """The vision token ids from config.json, checked against (or else taken from) the
    tokenizer."""
    names = {
        "vision_start": ("vision_start_token_id", "<|vision_start|>"),
        "vision_end": ("vision_end_token_id", "<|vision_end|>"),
        "image_pad": ("image_token_id", "<|image_pad|>"),
        "video_pad": ("video_token_id", "<|video_pad|>"),
    }
    ids = {
        field: special_token_id(config, (key,), token, tokenizer, required=True)
        for field, (key, token) in names.items()
    }
    return SpecialTokens(**ids)  # type: ignore[arg-type]
