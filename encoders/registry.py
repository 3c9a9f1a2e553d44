"""Pick the encoder for a checkpoint by the exact architecture name in config.json."""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

from encoders.base import MediaEncoder
from encoders.cache import EncoderCache
from encoders.errors import UnsupportedModelError

# architecture name -> (module, class). Exact match only: a text-only Qwen3 is not
# vision-capable just because its name starts with "Qwen3".
ENCODERS: dict[str, tuple[str, str]] = {
    "Qwen3VLForConditionalGeneration": ("encoders.qwen3_vl", "Qwen3VLEncoder"),
    "Gemma4ForConditionalGeneration": ("encoders.gemma4", "Gemma4Encoder"),
}

# Architectures we know and serve, but which take no media input.
NO_MEDIA_INPUT = {
    "CsmForConditionalGeneration": "CSM is a speech-output model; it takes no image/audio/video input",
}


def read_config(model_dir_or_config: str | Path | dict[str, Any]) -> tuple[Path | None, dict[str, Any]]:
    if isinstance(model_dir_or_config, dict):
        return None, model_dir_or_config
    d = Path(model_dir_or_config)
    cfg = d / "config.json"
    if not cfg.is_file():
        raise UnsupportedModelError(f"{d} has no config.json; expected a Hugging Face checkpoint directory")
    try:
        return d, json.loads(cfg.read_text())
    except json.JSONDecodeError as e:
        raise UnsupportedModelError(f"{cfg} is not valid JSON: {e}") from e


def architecture_of(config: dict[str, Any]) -> str:
    archs = config.get("architectures") or []
    if not archs:
        raise UnsupportedModelError("config.json names no 'architectures'; cannot pick a media encoder")
    return archs[0]


def encoder_for(
    model_dir_or_config: str | Path | dict[str, Any],
    *,
    cache: EncoderCache | None = None,
    **kwargs: Any,
) -> MediaEncoder:
    """The media encoder for a checkpoint directory (or a parsed config.json dict).

    Extra keyword arguments go to the encoder class (device, dtype, a tower module
    already loaded by the engine, ...).
    """
    model_dir, config = read_config(model_dir_or_config)
    arch = architecture_of(config)
    if arch in NO_MEDIA_INPUT:
        raise UnsupportedModelError(f"{arch}: {NO_MEDIA_INPUT[arch]}")
    if arch not in ENCODERS:
        known = ", ".join(sorted(ENCODERS))
        raise UnsupportedModelError(
            f"architecture {arch!r} has no media encoder (text-only or unknown); media-capable: {known}"
        )
    module, cls = ENCODERS[arch]
    encoder_cls = getattr(importlib.import_module(module), cls)
    return encoder_cls.from_config(model_dir, config, cache=cache, **kwargs)
