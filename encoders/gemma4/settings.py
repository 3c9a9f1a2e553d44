"""Gemma-4 settings from the checkpoint: the image and video processors, the audio feature
extractor and the processor's own keys (``processor_config.json``, or the flat
``preprocessor_config.json`` / ``video_preprocessor_config.json``), and the special token
ids."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from encoders.checkpoint_files import read_processor_files, special_token_id
from encoders.errors import UnsupportedModelError
from encoders.gemma4.audio import AudioSettings
from encoders.gemma4.vision import VisionSettings

__all__ = ["Settings", "SpecialTokens", "read_settings", "special_tokens"]


@dataclass(frozen=True)
class Settings:
    image: VisionSettings
    video: VisionSettings
    audio: AudioSettings | None
    """None when the checkpoint has no audio tower."""
    processor: dict[str, Any]
    """The processor's own (non-block) keys, e.g. ``image_seq_length``."""


@dataclass(frozen=True)
class SpecialTokens:
    boi: int
    eoi: int
    image: int
    video: int
    boa: int | None
    eoa: int | None
    audio: int | None


def read_settings(model_dir: Path, config: dict[str, Any]) -> Settings:
    """The processor settings as ``Gemma4Processor.from_pretrained`` finds them: the nested
    blocks of ``processor_config.json`` (``image_processor``, ``feature_extractor``,
    ``video_processor`` and the processor's own keys) first, else the flat
    ``preprocessor_config.json`` / ``video_preprocessor_config.json`` files. The image and
    video patch and pooling sizes must match the vision config."""
    files = read_processor_files(model_dir)
    blocks = dict(files.nested)
    flat = files.preprocessor
    if flat is not None:
        if "feature_extractor_type" in flat and "image_processor_type" not in flat:
            blocks.setdefault("feature_extractor", flat)
        else:
            blocks.setdefault("image_processor", flat)
    if files.video_preprocessor is not None:
        blocks.setdefault("video_processor", files.video_preprocessor)
    image = VisionSettings.from_dict(blocks.get("image_processor") or {}, video=False)
    video = VisionSettings.from_dict(blocks.get("video_processor") or {}, video=True)
    vision_cfg = config.get("vision_config") or {}
    for what, s in (("image", image), ("video", video)):
        expected = (
            vision_cfg.get("patch_size", s.patch_size),
            vision_cfg.get("pooling_kernel_size", s.pooling_kernel_size),
        )
        if (s.patch_size, s.pooling_kernel_size) != expected:
            raise UnsupportedModelError(
                f"{what} processor patch/pooling sizes {(s.patch_size, s.pooling_kernel_size)} "
                f"disagree with the vision config {expected}"
            )
    audio = None
    if config.get("audio_config") is not None:
        audio = AudioSettings.from_dict(blocks.get("feature_extractor") or {})
    return Settings(
        image=image,
        video=video,
        audio=audio,
        processor={k: v for k, v in blocks.items() if not isinstance(v, dict)},
    )


def special_tokens(config: dict[str, Any], tokenizer: Any) -> SpecialTokens:
    """The image, video and audio token ids from config.json, checked against (or else
    taken from) the tokenizer; the vision ones are required when there is a vision tower."""
    names = {
        "boi": (("boi_token_id",), "<|image>"),
        "eoi": (("eoi_token_id",), "<image|>"),
        "image": (("image_token_id",), "<|image|>"),
        "video": (("video_token_id",), "<|video|>"),
        "boa": (("boa_token_id",), "<|audio>"),
        "eoa": (("eoa_token_id", "eoa_token_index"), "<audio|>"),
        "audio": (("audio_token_id",), "<|audio|>"),
    }
    vision = config.get("vision_config") is not None
    ids = {
        field: special_token_id(
            config, keys, token, tokenizer, required=vision and field in ("boi", "eoi", "image", "video")
        )
        for field, (keys, token) in names.items()
    }
    return SpecialTokens(**ids)  # type: ignore[arg-type]
